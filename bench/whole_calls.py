"""One whole attention call on one thread and on two: attnx's NumPy backend
beside PyTorch's fused SDPA, in one process, interleaved round by round.

    OPENBLAS_THREAD_TIMEOUT=4 python bench/whole_calls.py [--shape 1 8 128 64] [--rounds 3]

NumPy's threads are set through the backend's ``concurrent_blocks``,
PyTorch's with ``torch.set_num_threads``.  Reports the best of 7 runs of
``--calls`` calls of each, over the rounds, and the ratios attnx / torch.
:mod:`thread_scaling` times the pieces of such a call.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import numpy as np
import torch

import attnx
from attnx._registry import registry


def best(function: Callable[[], object], calls: int) -> float:
    """Best time per call of 7 runs of ``calls`` calls, in microseconds."""
    function()
    fastest = float("inf")
    for _ in range(7):
        start = time.perf_counter()
        for _ in range(calls):
            function()
        fastest = min(fastest, (time.perf_counter() - start) / calls)
    return fastest * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=4, default=[1, 8, 128, 64])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=200)
    arguments = parser.parse_args()
    numpy_backend = registry.get("numpy")
    threads = numpy_backend.concurrent_blocks
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(arguments.shape).astype(np.float32) for _ in range(3)]
    tensors = [torch.from_numpy(a) for a in arrays]
    for causal in (False, True):
        times: dict[str, float] = {}
        for _ in range(arguments.rounds):
            for count in (threads, 1):
                numpy_backend.concurrent_blocks = count
                torch.set_num_threads(count)
                for name, call in (
                    ("attnx", lambda causal=causal: attnx.scaled_dot_product_attention(*arrays, is_causal=causal)),
                    (
                        "torch",
                        lambda causal=causal: torch.nn.functional.scaled_dot_product_attention(
                            *tensors, is_causal=causal
                        ),
                    ),
                ):
                    label = f"{name} {count}t"
                    times[label] = min(times.get(label, float("inf")), best(call, arguments.calls))
        numpy_backend.concurrent_blocks = threads
        torch.set_num_threads(threads)
        kind = "causal" if causal else "full"
        cells = "  ".join(f"{label} {micros:7.1f} us" for label, micros in times.items())
        ratios = "  ".join(
            f"{count}t x{times[f'attnx {count}t'] / times[f'torch {count}t']:.2f}" for count in (threads, 1)
        )
        print(f"{tuple(arguments.shape)} {kind:6s}  {cells}  attnx/torch: {ratios}")


if __name__ == "__main__":
    main()
