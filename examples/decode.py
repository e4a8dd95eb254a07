"""Generate tokens with a toy decoder layer over a growing key/value cache, on NumPy and on PyTorch.

One attention layer of a language model as it is served: 8 query heads
over 2 key/value heads (grouped-query attention, ``enable_gqa=True``),
rotary positions, and a batch of prompts of different lengths.  The
prompts are read in one causal call (padded on the right, ``key_lengths``
their lengths); then each step appends every sequence's newest token to
its own place in the cache and attends, in one call, with the queries
aligned to the end of each sequence's own keys
(``causal_align="key_lengths"``).  The weights are random: the tokens
mean nothing, but every backend must pick the same ones.

Prints the tokens per second of each backend, checks that they generated
the same tokens, and that the last step's attention over the cache equals
attention recomputed over the whole sequence without it.  A few seconds on
2 CPU cores.

    python examples/decode.py [--backends numpy torch] [--steps 32]
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
from array_api_compat import array_namespace

import attnx

VOCABULARY, D_MODEL, HEADS, KV_HEADS, HEAD_DIM = 512, 256, 8, 2, 32
PROMPT_LENGTHS = (12, 7, 3, 9)
#: Tokens appended to every sequence in one call between two rounds of generation.
FOLLOW_UP = 4


def make_weights() -> dict[str, np.ndarray]:
    gen = np.random.default_rng(0)

    def matrix(rows: int, columns: int) -> np.ndarray:
        return (gen.standard_normal((rows, columns)) / np.sqrt(rows)).astype(np.float32)

    return {
        "embedding": matrix(VOCABULARY, D_MODEL) * np.float32(np.sqrt(D_MODEL)),
        "w_q": matrix(D_MODEL, HEADS * HEAD_DIM),
        "w_k": matrix(D_MODEL, KV_HEADS * HEAD_DIM),
        "w_v": matrix(D_MODEL, KV_HEADS * HEAD_DIM),
        "w_o": matrix(HEADS * HEAD_DIM, D_MODEL),
    }


def make_prompts() -> np.ndarray:
    """``(B, longest)`` token ids, each row padded on the right with 0."""
    gen = np.random.default_rng(1)
    prompts = np.zeros((len(PROMPT_LENGTHS), max(PROMPT_LENGTHS)), dtype=np.int64)
    for row, length in enumerate(PROMPT_LENGTHS):
        prompts[row, :length] = gen.integers(1, VOCABULARY, length)
    return prompts


class Decoder:
    """The layer and its cache on one backend: ``(B, H_kv, capacity, d)``
    keys and values, ``lengths`` the tokens each sequence holds."""

    def __init__(self, backend: str, weights: dict[str, np.ndarray], capacity: int) -> None:
        self.backend = backend
        self.w = {name: attnx.asarray(value, backend=backend) for name, value in weights.items()}
        self.xp = array_namespace(self.w["w_q"])
        batch = len(PROMPT_LENGTHS)
        self.keys = self.xp.zeros((batch, KV_HEADS, capacity, HEAD_DIM), dtype=self.xp.float32)
        self.values = self.xp.zeros_like(self.keys)
        self.slots = attnx.asarray(np.arange(capacity), backend=backend)

    def _heads(self, x: Any, weight: str, heads: int, positions: Any) -> Any:
        """``x (B, n, D_MODEL)`` projected to ``(B, heads, n, HEAD_DIM)``, rotated to ``positions (B, 1, n)``."""
        projected = self.xp.reshape(x @ self.w[weight], (x.shape[0], x.shape[1], heads, HEAD_DIM))
        projected = self.xp.permute_dims(projected, (0, 2, 1, 3))
        return projected if weight == "w_v" else attnx.apply_rotary(projected, positions)

    def step(self, tokens: Any, lengths: Any) -> Any:
        """Append ``tokens (B, n)`` after each sequence's ``lengths (B,)``
        tokens; the logits ``(B, n, VOCABULARY)`` of the next token after each.
        ``self.last_heads``: the attention's output ``(B, H, n, d)``."""
        xp, n = self.xp, tokens.shape[1]
        x = xp.take(self.w["embedding"], xp.reshape(tokens, (-1,)), axis=0)
        x = xp.reshape(x, (*tokens.shape, D_MODEL))
        positions = lengths[:, None, None] + attnx.asarray(np.arange(n), backend=self.backend)
        query = self._heads(x, "w_q", HEADS, positions)
        new_keys, new_values = self._heads(x, "w_k", KV_HEADS, positions), self._heads(x, "w_v", KV_HEADS, positions)
        # Each sequence writes its n new tokens at its own place in the cache.
        for offset in range(n):
            slot = (self.slots == (lengths + offset)[:, None])[:, None, :, None]  # (B, 1, capacity, 1)
            self.keys = xp.where(slot, new_keys[:, :, offset : offset + 1], self.keys)
            self.values = xp.where(slot, new_values[:, :, offset : offset + 1], self.values)
        heads = attnx.scaled_dot_product_attention(
            query,
            self.keys,
            self.values,
            key_lengths=lengths + n,
            is_causal=True,
            causal_align="key_lengths",  # the new queries end where each sequence's keys do
            enable_gqa=True,
        )
        self.last_heads = heads
        merged = xp.reshape(xp.permute_dims(heads, (0, 2, 1, 3)), (tokens.shape[0], n, HEADS * HEAD_DIM))
        # No residual: with random weights, a token's own embedding would pick it again and again.
        return (merged @ self.w["w_o"]) @ xp.matrix_transpose(self.w["embedding"])


def generate(backend: str, steps: int) -> dict[str, Any]:
    """On ``backend``: the prompts, ``steps`` greedy tokens, a follow-up of
    :data:`FOLLOW_UP` tokens appended to every sequence in one call (their
    caches at different lengths), ``steps`` tokens more.  Returns each
    sequence's tokens, the seconds the one-token steps took, and the heads
    of the follow-up's call and of the last step."""
    weights, prompts = make_weights(), make_prompts()
    decoder = Decoder(backend, weights, capacity=prompts.shape[1] + 2 * steps + FOLLOW_UP)
    xp = decoder.xp
    # The prompts in one call, into an empty cache: padded on the right, so
    # each real query attends real keys only (causal, n == m), and the
    # padding's keys are overwritten by the tokens generated after them.
    empty = attnx.asarray(np.zeros(len(PROMPT_LENGTHS), dtype=np.int64), backend=backend)
    all_logits = decoder.step(attnx.asarray(prompts, backend=backend), empty)
    last = np.arange(prompts.shape[1]) == np.array(PROMPT_LENGTHS)[:, None] - 1  # each prompt's last token
    logits = xp.sum(all_logits * attnx.asarray(last[..., None].astype(np.float32), backend=backend), axis=1)
    lengths = attnx.asarray(np.array(PROMPT_LENGTHS), backend=backend)
    sequences = [list(prompts[row, :length]) for row, length in enumerate(PROMPT_LENGTHS)]
    seconds, follow_up = 0.0, make_follow_up()
    for turn in range(2):
        started = time.perf_counter()
        for _ in range(steps):
            token = xp.argmax(logits, axis=-1)
            for sequence, chosen in zip(sequences, attnx.to_numpy(token)):
                sequence.append(int(chosen))
            logits = decoder.step(token[:, None], lengths)[:, 0]
            lengths = lengths + 1
        attnx.to_numpy(logits)  # waits for the last step (a GPU's or a lazy backend's)
        seconds += time.perf_counter() - started
        if turn == 0:  # the follow-up: FOLLOW_UP new queries each, at the end of each sequence's own keys
            logits = decoder.step(attnx.asarray(follow_up, backend=backend), lengths)[:, -1]
            follow_up_heads = attnx.to_numpy(decoder.last_heads)
            follow_up_at = attnx.to_numpy(lengths)
            lengths = lengths + FOLLOW_UP
            for sequence, tokens in zip(sequences, follow_up):
                sequence.extend(int(t) for t in tokens)
    return {
        "sequences": sequences,
        "generated": 2 * steps * len(PROMPT_LENGTHS),
        "seconds": seconds,
        "follow_up_heads": follow_up_heads,
        "follow_up_at": follow_up_at,
        "last_heads": attnx.to_numpy(decoder.last_heads)[:, :, -1],
    }


def make_follow_up() -> np.ndarray:
    return np.random.default_rng(2).integers(1, VOCABULARY, (len(PROMPT_LENGTHS), FOLLOW_UP))


def recomputed_heads(sequence: list[int]) -> np.ndarray:
    """Attention without a cache: the whole sequence through the
    projections, causal; the heads of every position ``(H, len, d)``, float64."""
    weights = make_weights()
    x = weights["embedding"][np.array(sequence)][None].astype(np.float64)
    positions = np.arange(len(sequence))

    def heads(weight: str, count: int) -> np.ndarray:
        projected = (x @ weights[weight]).reshape(1, len(sequence), count, HEAD_DIM).transpose(0, 2, 1, 3)
        return projected if weight == "w_v" else attnx.apply_rotary(projected, positions)

    query, key, value = heads("w_q", HEADS), heads("w_k", KV_HEADS), heads("w_v", KV_HEADS)
    return attnx.scaled_dot_product_attention(query, key, value, is_causal=True, enable_gqa=True)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backends", nargs="+", default=["numpy", "torch"], help="(default: numpy torch)")
    parser.add_argument("--steps", type=int, default=32, help="tokens to generate per sequence (default: 32)")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error(f"--steps must be at least 1, got {args.steps}")
    available = {info.name: info for info in attnx.list_backends()}
    for name in args.backends:
        if name not in available or not available[name].available:
            reason = available[name].reason if name in available else "not registered"
            parser.error(f"backend {name!r} can't run here: {reason}")
    generated = {}
    for name in args.backends:
        run = generate(name, args.steps)
        generated[name] = run["sequences"]
        rate = run["generated"] / run["seconds"]
        print(f"{name:>6}: {run['generated']} tokens in {run['seconds'] * 1e3:.0f} ms, {rate:.0f} tokens/s")
        # The cache's answers against attention over the whole sequences: the
        # follow-up's queries (each aligned to its own sequence's end) and the last step's.
        follow_up, last = 0.0, 0.0
        for row, sequence in enumerate(run["sequences"]):
            whole = recomputed_heads(sequence)
            at = run["follow_up_at"][row]
            follow_up = max(follow_up, np.abs(run["follow_up_heads"][row] - whole[:, at : at + FOLLOW_UP]).max())
            last = max(last, np.abs(run["last_heads"][row] - whole[:, -1]).max())
        print(
            f"        attention over the cache against the whole sequences: follow-up {follow_up:.1e}, last {last:.1e}"
        )
    first, *others = args.backends
    same = all(generated[first] == generated[name] for name in others)
    print(f"first sequence: {' '.join(map(str, generated[first][0][-12:]))} (its last 12 tokens)")
    if others:
        print(f"same tokens on {', '.join(args.backends)}: {'yes' if same else 'NO'}")


if __name__ == "__main__":
    main()
