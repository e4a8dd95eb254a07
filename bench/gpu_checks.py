"""The GPU items of ``bench/RESULTS.md`` ("For the next lent GPU"), timed in
one process against baselines measured in the same run.

    python bench/gpu_checks.py            # on a machine with CUDA, CuPy and PyTorch
    python bench/gpu_checks.py dask-cupy  # also Dask arrays of CuPy chunks (needs dask)

Each row is :func:`attnx.benchmark.run_case`, as ``attnx bench`` times it
(the median of at least 5 synchronised calls and 0.25 s, and the peak
memory); a baseline is the same case under the memory budget that gives
the plan attnx made before the change measured:

- flex_attention on CuPy, a causal sliding window of 256 keys: rows of
  blocks joined into steps (the default) against one row of blocks a step
  (a budget of one row's scores, 128 x 384 keys x 8 heads x 4 bytes);
- flex_attention on PyTorch's CUDA tensors in float64 (attnx's own tiles:
  PyTorch's compiled flex takes no float64): the GPU's blocks against the
  CPU's 4 MiB;
- multi-head and additive attention on PyTorch's CUDA tensors and on CuPy.

With ``dask-cupy`` it also computes attnx's operations on Dask arrays whose
chunks are CuPy arrays, against the same operations on the CuPy arrays.
"""

from __future__ import annotations

import contextlib
import json
import sys
from typing import Any

import attnx
from attnx.benchmark import Case, run_case

MiB = 2**20
#: One row of 128-query blocks of a window of 256 keys (3 key blocks), 8 heads, float32.
ONE_ROW_BYTES = 128 * 384 * 8 * 4


def row(name: str, case: Case, budget: int | None = None) -> dict[str, Any]:
    with attnx.memory_budget(budget) if budget else contextlib.nullcontext():
        result = run_case(case)
    line = {
        "row": name,
        "implementation": case.implementation,
        "operation": case.operation,
        "shape": [case.batch, case.heads, case.n, case.head_dim],
        "dtype": case.dtype,
        "budget_mib": None if budget is None else round(budget / MiB, 2),
        "median_ms": None if result.median_s is None else round(result.median_s * 1e3, 3),
        "calls": len(result.times_s),
        "peak_mib": None if result.peak_bytes is None else round(result.peak_bytes / MiB, 1),
        "error": result.error,
    }
    print(json.dumps(line), flush=True)
    return line


def ratio(line: dict[str, Any], baseline: dict[str, Any]) -> None:
    if line["median_ms"] and baseline["median_ms"]:
        print(f"  {line['row']}: {line['median_ms'] / baseline['median_ms']:.3f}x {baseline['row']}", flush=True)


def timings() -> None:
    cuda = "cuda:0"
    window = dict(operation="sliding_window", batch=1, heads=8, n=8192, head_dim=64, device=cuda, repeat=10)
    joined = row("cupy window, joined rows", Case("attnx:cupy", **window))
    one_row = row("cupy window, one row a step", Case("attnx:cupy", **window), ONE_ROW_BYTES)
    ratio(joined, one_row)
    gpu = row("torch float64 window, GPU blocks", Case("attnx:torch", dtype="float64", **window))
    cpu = row("torch float64 window, CPU blocks", Case("attnx:torch", dtype="float64", **window), 4 * MiB)
    ratio(gpu, cpu)
    for operation in ("multi_head_attention", "additive_attention"):
        for n in (2048, 8192):
            shape = dict(operation=operation, batch=1, heads=8, n=n, head_dim=64, device=cuda, repeat=10)
            on_torch = row(f"torch {operation} {n}", Case("attnx:torch", **shape))
            on_cupy = row(f"cupy {operation} {n}", Case("attnx:cupy", **shape))
            ratio(on_cupy, on_torch)


def dask_cupy() -> None:
    """attnx's operations on Dask arrays of CuPy chunks, against CuPy."""
    import cupy as cp
    import dask.array as da
    import numpy as np

    gen = np.random.default_rng(0)
    q, k, v = (cp.asarray(gen.standard_normal((2, 4, 256, 32))) for _ in range(3))
    lengths = cp.asarray([200, 256])
    mask = cp.asarray(gen.random((256, 256)) < 0.8)
    x = cp.asarray(gen.standard_normal((2, 3, 64)))
    weight = cp.asarray(gen.standard_normal((5, 3, 3)))

    def lazy(array: Any) -> Any:
        chunks = tuple(max(1, size // 2) for size in array.shape)
        return da.from_array(array, chunks=chunks, asarray=False)

    cases = {
        "sdpa": (lambda q, k, v: attnx.scaled_dot_product_attention(q, k, v), (q, k, v)),
        "sdpa causal": (lambda q, k, v: attnx.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v)),
        "sdpa key_lengths": (
            lambda q, k, v, n: attnx.scaled_dot_product_attention(q, k, v, key_lengths=n),
            (q, k, v, lengths),
        ),
        "sdpa boolean mask": (lambda q, k, v, m: attnx.scaled_dot_product_attention(q, k, v, mask=m), (q, k, v, mask)),
        "sdpa weights": (
            lambda q, k, v: attnx.scaled_dot_product_attention(q, k, v, return_weights=True)[1],
            (q, k, v),
        ),
        "nadaraya_watson": (lambda q, k, v: attnx.nadaraya_watson(q[0, 0], k[0, 0], v[0, 0]), (q, k, v)),
        "causal_conv1d": (lambda x, w: attnx.causal_conv1d(x, w, dilation=2), (x, weight)),
    }
    for name, (function, arrays) in cases.items():
        try:
            expected = cp.asnumpy(function(*arrays))
            result = function(*(lazy(a) for a in arrays))
            computed = result.compute()
            error = float(np.max(np.abs(cp.asnumpy(computed) - expected)))
            print(json.dumps({"dask-cupy": name, "chunk type": type(computed).__module__, "max_error": error}))
        except Exception as exc:  # each case reports, none stops the others
            print(json.dumps({"dask-cupy": name, "error": f"{type(exc).__name__}: {str(exc)[:300]}"}))


if __name__ == "__main__":
    timings()
    if "dask-cupy" in sys.argv[1:]:
        dask_cupy()
