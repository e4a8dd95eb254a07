"""A causal sliding window (w = 256) through flex_attention and a block mask,
beside the dense masked SDPA and PyTorch's FlexAttention (eager and
compiled), built by the same code as ``attnx bench --operations
sliding_window``.  The time of attnx's should grow linearly in n."""

from __future__ import annotations

import importlib.util

import pytest
from conftest import GRID, timed

from attnx import benchmark as report

WINDOW = 256
SIZES = {"small": [4096], "full": [4096, 8192, 16384, 32768, 65536]}[GRID]
IMPLEMENTATIONS = ["attnx:numpy", "attnx:torch", "attnx-dense-mask", "torch-flex", "torch-flex-compiled"]


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("n", SIZES)
def test_sliding_window(benchmark, implementation, n):
    library = report.BASELINES.get(implementation) or implementation.partition(":")[2]
    if importlib.util.find_spec(library) is None:
        pytest.skip(f"{library} is not installed")
    case = report.Case(implementation, "sliding_window", 1, 2, n, 64, window=WINDOW)
    if implementation in report.DENSE_BASELINES and case.batch * case.heads * n * n * 4 > report.DENSE_LIMIT_BYTES:
        pytest.skip(f"{implementation} holds the whole (n, n) scores or mask: more than 2 GiB at n = {n}")
    function, _ = report._callable(case)
    benchmark.group = f"sliding window w={WINDOW} (1, 2, {n}, 64)"
    benchmark.extra_info.update(flops=case.flops, baseline=not implementation.startswith("attnx:"))
    timed(benchmark, function)
