"""Where one NumPy attention call's time goes: each step stamped, both threads.

    OPENBLAS_THREAD_TIMEOUT=4 python bench/timeline.py [--shape 1 8 128 64] [--causal] [--calls 3000]

Stamps, in microseconds from the caller's line, the NumPy native's entry,
``map_blocks`` (the hand-over to the helper thread and the join), each
thread's first block in and last block out, and the exactness check, and
prints the median of each over ``--calls`` calls (the first 200 are warm-up).
The stamps wrap the native's own functions, so the call is the one users
make, with a few microseconds of wrapping.  docs/archive/bench-sessions.md (forty-first
session) reads it with the host's idle polling off and on.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

import attnx
from attnx_backends import numpy_attention, numpy_backend

WARM_UP = 200


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs=4, default=[1, 8, 128, 64])
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--calls", type=int, default=3000)
    args = parser.parse_args()

    stamps: dict[str, float] = {}

    def stamped(function: Callable[..., Any], step: str) -> Callable[..., Any]:
        @functools.wraps(function)
        def wrapper(*arguments: Any, **keywords: Any) -> Any:
            thread = "calling thread" if threading.current_thread() is threading.main_thread() else "helper"
            stamps.setdefault(f"{step} in, {thread}", time.perf_counter())
            result = function(*arguments, **keywords)
            stamps[f"{step} out, {thread}"] = time.perf_counter()
            return result

        return wrapper

    # The plan attnx keeps per signature calls the native through its module, so these are seen.
    for name, step in (
        ("scaled_dot_product_attention", "native"),
        ("_attend_block", "block"),
        ("_exact_unshifted", "check"),
    ):
        setattr(numpy_attention, name, stamped(getattr(numpy_attention, name), step))
    backend_class = numpy_backend.NumPyBackend
    backend_class.map_blocks = stamped(backend_class.map_blocks, "map_blocks")

    rng = np.random.default_rng(0)
    query, key, value = (rng.standard_normal(args.shape, dtype=np.float32) for _ in range(3))
    rows = []
    for index in range(WARM_UP + args.calls):
        stamps.clear()
        start = time.perf_counter()
        attnx.scaled_dot_product_attention(query, key, value, is_causal=args.causal, backend="numpy")
        end = time.perf_counter()
        if index >= WARM_UP:
            rows.append({step: (at - start) * 1e6 for step, at in {**stamps, "returned": end}.items()})
    medians = {step: statistics.median(row[step] for row in rows if step in row) for step in rows[-1]}
    print(f"{tuple(args.shape)} float32{' causal' if args.causal else ''}: medians of {len(rows)} calls, us")
    for step, at in sorted(medians.items(), key=lambda item: item[1]):
        print(f"  {step:32s} {at:7.1f}")


if __name__ == "__main__":
    main()
