"""What attnx adds per call on tiny inputs, where dispatch and checks dominate.

    OPENBLAS_THREAD_TIMEOUT=4 python bench/overhead.py [--rounds 21] [--calls 3000]

Calls, interleaved round by round so that drift hits every candidate alike,
at shape (1, 1, 16, 16) float32:

- PyTorch: ``F.scaled_dot_product_attention`` direct, the same behind the
  fewest checks attnx's contract asks for, inline on every call
  (:func:`checked_torch_sdpa`), and ``attnx.scaled_dot_product_attention``,
  which checks a signature once and then runs its plan (``attnx._plans``);
- NumPy: the textbook version and attnx on NumPy arrays (its backend's plan
  for small calls).

Reports the best round of each (per call), the time added over the direct
call and the ratio to the textbook version.  The pytest-benchmark suite's
``tiny`` groups time the same calls one by one (medians, noisier).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import attnx
from attnx.benchmark import textbook_attention

SHAPE = (1, 1, 16, 16)


def checked_torch_sdpa(query: Any, key: Any, value: Any) -> Any:
    """PyTorch's SDPA behind the fewest checks attnx asks for (ranks, one
    floating dtype, matching sizes), written inline: the cost of a wrapper
    that validates every call before computing."""
    import torch

    q_shape, k_shape, v_shape = tuple(query.shape), tuple(key.shape), tuple(value.shape)
    if len(q_shape) < 2 or len(k_shape) < 2 or len(v_shape) < 2:
        raise ValueError("query, key and value need at least two dimensions")
    if not query.dtype.is_floating_point or key.dtype != query.dtype or value.dtype != query.dtype:
        raise TypeError("query, key and value need one floating dtype")
    if k_shape[-1] != q_shape[-1] or v_shape[-2] != k_shape[-2] or not q_shape[:-2] == k_shape[:-2] == v_shape[:-2]:
        raise ValueError("query, key and value shapes do not match")
    return torch.nn.functional.scaled_dot_product_attention(
        query, key, value, None, 0.0, False, scale=1.0 / q_shape[-1] ** 0.5
    )


def candidates() -> dict[str, Callable[[], Any]]:
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(SHAPE).astype(np.float32) for _ in range(3))
    calls: dict[str, Callable[[], Any]] = {
        "numpy textbook": lambda: textbook_attention(q, k, v),
        "numpy attnx": lambda: attnx.scaled_dot_product_attention(q, k, v),
    }
    try:
        import torch
    except ImportError:
        return calls
    tq, tk, tv = (torch.from_numpy(a) for a in (q, k, v))
    sdpa = torch.nn.functional.scaled_dot_product_attention
    calls |= {
        "torch direct": lambda: sdpa(tq, tk, tv),
        "torch checked each call": lambda: checked_torch_sdpa(tq, tk, tv),
        "torch attnx": lambda: attnx.scaled_dot_product_attention(tq, tk, tv),
    }
    return calls


def measure(rounds: int, calls: int) -> dict[str, float]:
    """Best time per call of each candidate, in microseconds."""
    functions = candidates()
    for function in functions.values():
        function()  # warm-up: imports, caches
    best = dict.fromkeys(functions, float("inf"))
    for _ in range(rounds):
        for name, function in functions.items():
            start = time.perf_counter()
            for _ in range(calls):
                function()
            best[name] = min(best[name], (time.perf_counter() - start) / calls * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=21)
    parser.add_argument("--calls", type=int, default=3000)
    arguments = parser.parse_args()
    best = measure(arguments.rounds, arguments.calls)
    print(f"per call at {SHAPE} float32, best of {arguments.rounds} rounds of {arguments.calls} calls")
    for name, micros in best.items():
        library = name.split()[0]
        baseline = best[f"{library} direct" if library == "torch" else f"{library} textbook"]
        print(f"  {name:24s} {micros:7.2f} us  {micros - baseline:+6.2f} us  x{micros / baseline:.2f}")


if __name__ == "__main__":
    main()
