"""Train a small encoder-decoder with Bahdanau attention to reverse sequences.

Runs on the PyTorch backend (attnx.bahdanau_context on torch tensors, with
gradients flowing into the attention parameters), then saves the attention
weights of one example as a heatmap: reversing puts them on the
anti-diagonal.

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
        f"this example needs {' and '.join(_MISSING)}: pip install 'attnx[torch,plot]' "
        "(PyTorch for CPU only: pip install torch --index-url https://download.pytorch.org/whl/cpu)"
    )

import torch  # noqa: E402
from torch import nn  # noqa: E402

import attnx  # noqa: E402

VOCAB, LENGTH, BOS = 10, 7, 10  # digits 0-9, plus a start token


class Seq2Seq(nn.Module):
    def __init__(self, hidden: int = 64, attention: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB + 1, 32)
        self.encoder = nn.GRU(32, hidden, batch_first=True, bidirectional=True)
        self.decoder = nn.GRUCell(32 + 2 * hidden, hidden)
        self.init_state = nn.Linear(2 * hidden, hidden)
        self.out = nn.Linear(hidden + 2 * hidden, VOCAB)
        gen = torch.Generator().manual_seed(0)
        self.w_q = nn.Parameter(torch.randn(hidden, attention, generator=gen) / hidden**0.5)
        self.w_k = nn.Parameter(torch.randn(2 * hidden, attention, generator=gen) / (2 * hidden) ** 0.5)
        self.w_v = nn.Parameter(torch.randn(attention, generator=gen) / attention**0.5)

    def forward(self, source: torch.Tensor, target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        annotations, _ = self.encoder(self.embed(source))  # (B, T, 2h)
        state = torch.tanh(self.init_state(annotations.mean(1)))
        params = {"w_q": self.w_q, "w_k": self.w_k, "w_v": self.w_v}
        previous = torch.full_like(target[:, 0], BOS)
        logits, alignments = [], []
        for t in range(target.shape[1]):  # teacher forcing
            context, weights = attnx.bahdanau_context(state, annotations, params, return_weights=True)
            state = self.decoder(torch.cat([self.embed(previous), context], -1), state)
            logits.append(self.out(torch.cat([state, context], -1)))
            alignments.append(weights)
            previous = target[:, t]
        return torch.stack(logits, 1), torch.stack(alignments, 1)


def batch(size: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    source = torch.randint(0, VOCAB, (size, LENGTH), generator=gen)
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
    source, target = batch(1, gen)
    with torch.no_grad():
        _, alignment = model(source, target)
    weights = alignment[0]  # (output step, input position): reversal puts it on the anti-diagonal
    on_anti_diagonal = weights.flip(1).diagonal().sum().item() / weights.sum().item()
    print(f"attention on the anti-diagonal: {on_anti_diagonal:.3f} of the total {weights.sum().item():.6f}")
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
    print(f"saved {args.out}: the weights lie on the anti-diagonal when reversal is learned")


if __name__ == "__main__":
    main()
