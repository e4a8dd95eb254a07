"""pytest-benchmark suite: attnx on every available backend beside the baselines.

    OPENBLAS_THREAD_TIMEOUT=4 pytest bench --benchmark-only              # the small grid
    ATTNX_BENCH_GRID=full OPENBLAS_THREAD_TIMEOUT=4 pytest bench --benchmark-only

Benchmarks are grouped by operation and size, so each group compares the
backends and the baselines side by side; the summary at the end gives each
row's ratio to the fastest baseline of its group, measured in the same run.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")  # idle OpenBLAS threads stop spinning

import pytest  # noqa: E402

import attnx  # noqa: E402

GRID = os.environ.get("ATTNX_BENCH_GRID", "small")
BACKENDS = [info.name for info in attnx.list_backends() if info.name in ("numpy", "torch", "cupy")]


@pytest.fixture(params=BACKENDS)
def backend(request):
    """A built-in backend, or a skip with its reason."""
    try:
        chosen = attnx._registry.get(request.param)
    except (ValueError, RuntimeError) as exc:
        pytest.skip(str(exc))
    return chosen


def timed(benchmark, function, backend=None):
    """``benchmark(function)`` after one untimed call (lazy imports and caches
    would otherwise skew pytest-benchmark's calibration), with a GPU
    backend's queued work waited for in every timed call."""
    function()
    if backend is not None and backend.name != "numpy":

        def synchronised():
            result = function()
            backend.synchronize()
            return result

        return benchmark(synchronised)
    return benchmark(function)


def pytest_terminal_summary(terminalreporter, config):
    session = getattr(config, "_benchmarksession", None)
    benchmarks = [b for b in getattr(session, "benchmarks", []) if b.stats is not None]
    if not benchmarks:
        return
    fastest: dict[str, float] = {}
    for bench in benchmarks:
        if bench.extra_info.get("baseline"):
            fastest[bench.group] = min(fastest.get(bench.group, float("inf")), bench.stats.median)
    terminalreporter.section("attnx: ratio to the fastest baseline in the same group (same run)")
    terminalreporter.write_line(f"OPENBLAS_THREAD_TIMEOUT={os.environ.get('OPENBLAS_THREAD_TIMEOUT')}")
    for bench in sorted(benchmarks, key=lambda b: (b.group or "", b.name)):
        median = bench.stats.median
        ratio = median / fastest[bench.group] if bench.group in fastest else None
        gflops = bench.extra_info.get("flops", 0) / median / 1e9 if median else 0
        text = f"{bench.group:40s} {bench.name:60s} {median * 1e3:9.3f} ms {gflops:7.1f} GFLOP/s"
        if ratio is not None:
            text += f"  x{ratio:.2f}"
            if bench.group.startswith("tiny"):  # the target there is time added per call
                text += f" ({(median - fastest[bench.group]) * 1e6:+.1f} us)"
        terminalreporter.write_line(text)
