"""Train a small encoder-decoder with Bahdanau attention to reverse sequences.

Runs on the PyTorch backend (attnx.bahdanau_context on torch tensors, with
gradients flowing into the attention parameters). The encoder gives each
input position its token and its place and nothing of its neighbours, so
the decoder can only read a token through attention: to write output step
t it must attend input position L - 1 - t, the anti-diagonal. The script
prints the share of each output step's weight on that position, over 256
new sequences, and saves one example's weights as a heatmap.

About 10 s on 2 CPU cores at the default 400 steps.

    python examples/bahdanau_seq2seq.py [--steps 400] [--out bahdanau_attention.png]
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

# Checked before anything trains: a missing plotting library found only at
# the end would waste the whole run.
_MISSING = [name for name in ("torch", "matplotlib") if importlib.util.find_spec(name) is None]
if _MISSING:
    sys.exit(
        f"this example needs {' and '.join(_MISSING)}: pip install '.[torch,plot]' in attnx's clone "
        "(PyTorch for CPU only: pip install torch --index-url https://download.pytorch.org/whl/cpu)"
    )

import torch  # noqa: E402
from torch import nn  # noqa: E402

import attnx  # noqa: E402

VOCAB, LENGTH, BOS = 10, 7, 10  # digits 0-9, plus a start token; 7 distinct digits a sequence


class Seq2Seq(nn.Module):
    def __init__(self, hidden: int = 64, attention: int = 32, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB + 1, width)
        self.place = nn.Embedding(LENGTH, width)
        self.annotate = nn.Linear(width, 2 * width)
        self.decoder = nn.GRUCell(width + 2 * width, hidden)
        self.out = nn.Linear(hidden + 2 * width, VOCAB)
        gen = torch.Generator().manual_seed(0)
        self.w_q = nn.Parameter(torch.randn(hidden, attention, generator=gen) / hidden**0.5)
        self.w_k = nn.Parameter(torch.randn(2 * width, attention, generator=gen) / (2 * width) ** 0.5)
        # tanh bounds each term of a score to [-1, 1]: w_v starts large enough for
        # the softmax to single out one position (at 1/sqrt(attention) the weights
        # stayed spread over neighbours, 0.72 on the right one after 400 steps)
        self.w_v = nn.Parameter(torch.randn(attention, generator=gen) * 6 / attention**0.5)

    def encode(self, source: torch.Tensor) -> torch.Tensor:
        """One annotation per input position: its token and its place, no neighbours."""
        places = torch.arange(source.shape[1], device=source.device)
        return torch.tanh(self.annotate(self.embed(source) + self.place(places)))  # (B, T, 2w)

    def forward(self, source: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        annotations = self.encode(source)
        state = annotations.new_zeros(source.shape[0], self.decoder.hidden_size)
        params = {"w_q": self.w_q, "w_k": self.w_k, "w_v": self.w_v}
        previous = torch.full_like(target[:, 0], BOS)
        context = annotations.new_zeros(source.shape[0], annotations.shape[-1])
        logits, alignments = [], []
        for t in range(target.shape[1]):  # teacher forcing
            # the state, told the last token and context, asks for the next position
            state = self.decoder(torch.cat([self.embed(previous), context], -1), state)
            context, weights = attnx.bahdanau_context(state, annotations, params, return_weights=True)
            logits.append(self.out(torch.cat([state, context], -1)))
            alignments.append(weights)
            previous = target[:, t]
        return torch.stack(logits, 1), torch.stack(alignments, 1)


def batch(size: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences of distinct digits and their reversals: with a digit twice,
    either of its places would serve, and the alignment would be ambiguous."""
    source = torch.rand(size, VOCAB, generator=gen).argsort(-1)[:, :LENGTH]
    return source, source.flip(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--out", default="bahdanau_attention.png")
    args = parser.parse_args()
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    model = Seq2Seq()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    for step in range(1, args.steps + 1):
        source, target = batch(64, gen)
        logits, _ = model(source, target)
        loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), target.reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 100 == 0:
            accuracy = (logits.argmax(-1) == target).float().mean().item()
            print(f"step {step:4d}  loss {loss.item():.3f}  token accuracy {accuracy:.2f}")
    source, target = batch(256, gen)  # sequences the model has not seen
    with torch.no_grad():
        logits, alignment = model(source, target)
    # alignment[b, t, i]: output step t's weight on input position i; reversal puts it on i = L - 1 - t
    on_reversed = alignment.flip(-1).diagonal(dim1=1, dim2=2).mean(0)  # (L,): per output step
    accuracy = (logits.argmax(-1) == target).float().mean().item()
    print(f"after {args.steps} steps: token accuracy {accuracy:.3f} on 256 new sequences")
    print("weight on the reversed input position, per output step: " + " ".join(f"{w:.3f}" for w in on_reversed))
    print(f"smallest: {on_reversed.min().item():.3f}")
    import matplotlib

    matplotlib.use("Agg")
    ax = attnx.plot.attention_heatmap(
        alignment[0],
        queries=[f"out {int(d)}" for d in target[0]],
        keys=[f"in {int(d)}" for d in source[0]],
        title="Bahdanau attention, reversing a sequence",
    )
    ax.figure.tight_layout()
    ax.figure.savefig(args.out, dpi=120)
    print(f"saved {args.out}: output step t attends input position {LENGTH - 1} - t, the anti-diagonal")


if __name__ == "__main__":
    main()
