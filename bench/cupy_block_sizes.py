"""attnx on CuPy against the size of its blocks, on a GPU.

    python bench/cupy_block_sizes.py

For each shape (float32), full and causal: PyTorch's SDPA on the same GPU
(the anchor), a textbook CuPy attention (matrix product, ``exp``, sum,
matrix product), and attnx's generic algorithm on CuPy with the backend's
``block_bytes`` set to each size in turn; attnx's and the textbook's times
are printed as ratios to PyTorch's.  Each time is the best of three rounds
of five synchronised calls, after a warm-up.  The figures behind the CuPy
backend's ``block_bytes`` are in ``docs/archive/bench-sessions.md`` ("GPU").
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial

import cupy as cp
import numpy as np
import torch

import attnx

SHAPES = ((1, 8, 512, 64), (1, 8, 2048, 64), (1, 8, 8192, 64), (16, 8, 1024, 64), (1, 8, 16384, 64))
BLOCK_MIB = (64, 128, 256, 512, 1024)
#: The CPU's block size, timed only where it ends in seconds rather than minutes.
SMALL_BLOCK_MIB, SMALL_BLOCK_UP_TO_N = 4, 2048
#: The textbook holds every score: timed up to this many bytes of them.
TEXTBOOK_BYTES = 2**32


def best_ms(function: Callable[[], object], synchronize: Callable[[], None], calls: int = 5) -> float:
    function()
    synchronize()
    rounds = []
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(calls):
            function()
        synchronize()
        rounds.append((time.perf_counter() - start) / calls * 1e3)
    return min(rounds)


def textbook(q: cp.ndarray, k: cp.ndarray, v: cp.ndarray, causal: bool) -> cp.ndarray:
    scores = (q @ cp.swapaxes(k, -1, -2)) * (1 / np.sqrt(q.shape[-1]))
    if causal:
        scores = cp.where(cp.tri(q.shape[-2], dtype=bool), scores, -cp.inf)
    weights = cp.exp(scores - scores.max(-1, keepdims=True))
    return (weights / weights.sum(-1, keepdims=True)) @ v


def main() -> None:
    backend = attnx._registry.get("cupy")
    default = backend.block_bytes
    synchronize = cp.cuda.Device().synchronize
    for shape in SHAPES:
        arrays = [np.random.default_rng(seed).standard_normal(shape).astype(np.float32) for seed in range(3)]
        q, k, v = (cp.asarray(a) for a in arrays)
        tq, tk, tv = (torch.from_numpy(a).cuda() for a in arrays)
        sizes = ((SMALL_BLOCK_MIB,) if shape[2] <= SMALL_BLOCK_UP_TO_N else ()) + BLOCK_MIB
        for causal in (False, True):
            sdpa = partial(torch.nn.functional.scaled_dot_product_attention, tq, tk, tv, is_causal=causal)
            anchor = best_ms(sdpa, torch.cuda.synchronize)
            line = [f"{str(shape):20s} causal={causal!s:5s} torch-sdpa {anchor:.3f} ms"]
            if shape[0] * shape[1] * shape[2] ** 2 * 4 <= TEXTBOOK_BYTES:
                line.append(f"textbook {best_ms(partial(textbook, q, k, v, causal), synchronize) / anchor:.2f}x")
            try:
                for mib in sizes:
                    backend.block_bytes = mib * 2**20
                    attend = partial(attnx.scaled_dot_product_attention, q, k, v, is_causal=causal)
                    line.append(f"{mib} MiB {best_ms(attend, synchronize) / anchor:.2f}x")
            finally:
                backend.block_bytes = default
            print("  ".join(line), flush=True)
            cp.get_default_memory_pool().free_all_blocks()


if __name__ == "__main__":
    main()
