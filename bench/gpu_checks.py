"""The GPU items of ``bench/RESULTS.md`` ("For the next lent GPU"), timed in
one process against baselines measured in the same run.

    python bench/gpu_checks.py [window] [family]   # on a machine with CUDA, CuPy and PyTorch

Each row is :func:`attnx.benchmark.run_case`, as ``attnx bench`` times it
(the median of at least 5 synchronised calls and 0.25 s, and the peak
memory); a baseline is the same case under the memory budget that gives
the plan attnx made before the change measured:

- flex_attention on CuPy, a causal sliding window of 256 keys (``window``): rows of
  blocks joined into steps (the default) against one row of blocks a step
  (a budget of one row's scores, 128 x 384 keys x 8 heads x 4 bytes);
- flex_attention on PyTorch's CUDA tensors in float64 (attnx's own tiles:
  PyTorch's compiled flex takes no float64): the GPU's blocks against the
  CPU's 4 MiB;
- multi-head and additive attention on PyTorch's CUDA tensors and on CuPy
  (``family``).

The window's anchor is PyTorch's compiled FlexAttention, in the same run.
Dask arrays of CuPy chunks are checked by ``tests/test_dask_cupy.py``.
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


CUDA = "cuda:0"


def window() -> None:
    shape = dict(operation="sliding_window", batch=1, heads=8, n=8192, head_dim=64, device=CUDA, repeat=10)
    anchor = row("torch-flex-compiled window", Case("torch-flex-compiled", **shape))
    on_torch = row("torch window (PyTorch's compiled flex)", Case("attnx:torch", **shape))
    joined = row("cupy window, joined rows", Case("attnx:cupy", **shape))
    one_row = row("cupy window, one row a step", Case("attnx:cupy", **shape), ONE_ROW_BYTES)
    for line in (on_torch, joined, one_row):
        ratio(line, anchor)
    ratio(joined, one_row)
    gpu = row("torch float64 window, GPU blocks", Case("attnx:torch", dtype="float64", **shape))
    cpu = row("torch float64 window, CPU blocks", Case("attnx:torch", dtype="float64", **shape), 4 * MiB)
    ratio(gpu, cpu)


def family() -> None:
    for operation in ("multi_head_attention", "additive_attention"):
        for n in (2048, 8192):
            shape = dict(operation=operation, batch=1, heads=8, n=n, head_dim=64, device=CUDA, repeat=10)
            on_torch = row(f"torch {operation} {n}", Case("attnx:torch", **shape))
            on_cupy = row(f"cupy {operation} {n}", Case("attnx:cupy", **shape))
            ratio(on_cupy, on_torch)


if __name__ == "__main__":
    stages = sys.argv[1:] or ["window", "family"]
    if "window" in stages:
        window()
    if "family" in stages:
        family()
