"""Issue-sized shapes: attnx on NumPy beside PyTorch's SDPA, one group per shape.

The targets (``attnx bench --grid`` reports them as ratios): attnx on NumPy
within 1.5x of ``torch.nn.functional.scaled_dot_product_attention``, full
and causal, over batch {1, 16, 64} x 8 heads x n {128, 512, 2048, 8192} x
d {64, 128}.  The small grid keeps the calls under a second each:

    OPENBLAS_THREAD_TIMEOUT=4 pytest bench/test_bench_grid.py --benchmark-only
    ATTNX_BENCH_GRID=full OPENBLAS_THREAD_TIMEOUT=4 pytest bench/test_bench_grid.py --benchmark-only  # hours
"""

from __future__ import annotations

import pytest
from conftest import GRID, timed
from test_bench_attention import flops, inputs

import attnx
from attnx.benchmark import GRID as TARGET_GRID

SHAPES = {
    "small": [(b, 8, n, d) for b in (1, 16) for n in (128, 512) for d in (64, 128)] + [(1, 8, 2048, 64)],
    "full": [
        (b, TARGET_GRID["heads"], n, d)
        for b in TARGET_GRID["batch"]
        for n in TARGET_GRID["sizes"]
        for d in TARGET_GRID["head_dim"]
    ],
}[GRID]
DTYPES = ["float32", "float64"] if GRID == "full" else ["float32"]


def _group(shape, causal, dtype):
    return f"grid {'causal' if causal else 'full'} {shape} {dtype}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_grid_attnx_numpy(benchmark, shape, causal, dtype):
    q, k, v = inputs("numpy", shape, dtype)
    benchmark.group = _group(shape, causal, dtype)
    benchmark.extra_info.update(flops=flops(shape, causal), baseline=False)
    timed(benchmark, lambda: attnx.scaled_dot_product_attention(q, k, v, is_causal=causal))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_grid_torch_sdpa_baseline(benchmark, shape, causal, dtype):
    torch = pytest.importorskip("torch")
    q, k, v = inputs("torch", shape, dtype)
    benchmark.group = _group(shape, causal, dtype)
    benchmark.extra_info.update(flops=flops(shape, causal), baseline=True)
    timed(benchmark, lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal))
