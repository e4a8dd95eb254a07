"""`attnx bench` runs a sweep and writes its report (sizes tiny: a test, not a benchmark)."""

from __future__ import annotations

import json
import platform
import subprocess
import sys
import sysconfig

import numpy as np
import pytest

import attnx
from attnx import benchmark
from attnx.benchmark import Case, PoolPeak, Result, fit_exponent, ratios


def test_bench_writes_table_json_and_plots(tmp_path):
    out = tmp_path / "report"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "attnx.cli",
            "bench",
            "--sizes",
            "16",
            "32",
            "--heads",
            "2",
            "--head-dim",
            "8",
            "--repeat",
            "2",
            "--baselines",  # each case is a process of its own: PyTorch's and JAX's imports took 35 s here
            "numpy-textbook",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr + result.stdout
    assert "x fastest baseline" in result.stdout
    rows = json.loads((out / "results.json").read_text())
    implementations = {row["implementation"] for row in rows}
    assert {"attnx:numpy", "numpy-textbook"} <= implementations
    assert all(row["error"] is None and row["median_s"] > 0 for row in rows)
    assert all(row["peak_bytes"] is not None for row in rows)
    markdown = (out / "results.md").read_text()
    assert markdown.startswith("Command: `attnx bench --sizes 16 32")
    assert f"Python {platform.python_version()}" in markdown
    assert ("free-threaded" in markdown) is bool(sysconfig.get_config_var("Py_GIL_DISABLED"))
    assert "time grows as n^" in markdown
    assert (out / "time.png").stat().st_size > 10_000


def test_the_report_says_whether_the_gil_is_off_on_a_free_threaded_build(monkeypatch):
    from attnx import benchmark

    monkeypatch.setattr(benchmark.sysconfig, "get_config_var", lambda name: 1 if name == "Py_GIL_DISABLED" else None)
    for enabled, words in ((False, "the GIL off"), (True, "the GIL on")):
        monkeypatch.setattr(benchmark.sys, "_is_gil_enabled", lambda enabled=enabled: enabled, raising=False)
        assert benchmark._python() == f"Python {platform.python_version()}, free-threaded, {words}"


def test_ratio_is_against_the_fastest_baseline_of_the_same_size():
    def result(implementation, n, seconds):
        return Result(Case(implementation, "sdpa", 1, 1, n, 8), median_s=seconds)

    results = [
        result("attnx:numpy", 16, 3.0),
        result("numpy-textbook", 16, 2.0),
        result("torch-sdpa", 16, 1.5),
        result("attnx:numpy", 32, 1.0),
    ]
    assert ratios(results) == {0: 2.0, 1: 2.0 / 1.5, 2: 1.0, 3: None}


def test_rounds_take_turns_by_shape_and_report_the_median_round(monkeypatch):
    from attnx import benchmark

    cases = [
        Case(implementation, "sdpa", 1, 1, n, 8) for n in (16, 32) for implementation in ("attnx:numpy", "torch-sdpa")
    ]
    seconds = iter([5.0, 1.0, 7.0, 2.0, 6.0, 3.0, 4.0, 4.0, 8.0, 8.0, 1.0, 1.0])
    calls = []

    def measure(case, memory=True):
        calls.append((case.implementation, case.n, memory))
        median = next(seconds)
        return Result(case, median, [median], peak_bytes=100 if memory else None)

    monkeypatch.setattr(benchmark, "measure", measure)
    results = benchmark.sweep(cases, rounds=3)
    turns = [(implementation, n) for implementation, n, _ in calls]
    assert turns == 3 * [("attnx:numpy", 16), ("torch-sdpa", 16)] + 3 * [("attnx:numpy", 32), ("torch-sdpa", 32)]
    assert [memory for *_, memory in calls] == 2 * [True, True, False, False, False, False]
    assert [r.case for r in results] == cases
    assert [r.median_s for r in results] == [6.0, 2.0, 4.0, 4.0]  # medians of (5, 7, 6), (1, 2, 3), ...
    assert results[0].times_s == [5.0, 7.0, 6.0] and results[0].peak_bytes == 100
    assert ratios(results) == {0: 3.0, 1: 1.0, 2: 1.0, 3: 1.0}


def test_a_case_that_fails_is_not_run_again_and_reports_its_error(monkeypatch):
    from attnx import benchmark

    cases = [Case("attnx:numpy", "sdpa", 1, 1, 16, 8), Case("torch-sdpa", "sdpa", 1, 1, 16, 8)]
    calls = []

    def measure(case, memory=True):
        calls.append(case.implementation)
        if case.implementation == "torch-sdpa":
            return Result(case, error="ImportError: no torch")
        return Result(case, 1.0, [1.0], 100 if memory else None)

    monkeypatch.setattr(benchmark, "measure", measure)
    results = benchmark.sweep(cases, rounds=3)
    assert calls == ["attnx:numpy", "torch-sdpa", "attnx:numpy", "attnx:numpy"]
    assert results[1].error == "ImportError: no torch" and results[1].median_s is None
    assert results[0].median_s == 1.0 and results[0].error is None


def test_fit_exponent_recovers_a_power_law():
    sizes = [128, 256, 512, 1024]
    assert abs(fit_exponent(sizes, [3e-9 * n**2 for n in sizes]) - 2.0) < 1e-9


def test_pool_peak_counts_what_is_in_use_at_once():
    # The accounting behind CuPy's peak memory (its pool's hooks call these).
    peak = PoolPeak()
    for event, size in [("malloc", 512), ("malloc", 1024), ("free", 512), ("malloc", 256), ("free", 1024)]:
        getattr(peak, f"{event}_postprocess")(device_id=0, mem_size=size, mem_ptr=1, pmem_id=1)
    assert (peak.peak, peak.in_use) == (1536, 256)


def test_grid_reports_ratios_to_torch_sdpa_over_batch_n_and_d():
    from attnx.benchmark import grid_rows, plan

    cases = plan(
        ["numpy"],
        ["sdpa", "sdpa_causal"],
        [16, 32],
        batch=[1, 4],
        heads=2,
        head_dim=[8, 16],
        dtype="float32",
        repeat=1,
        baselines=["torch-sdpa"],
    )
    assert len(cases) == 2 * 2 * 2 * 2 * 2  # operations x batches x dims x sizes x implementations
    results = [Result(case, median_s=2.0 if case.implementation == "attnx:numpy" else 1.0) for case in cases]
    results[0].median_s = 3.0  # (1, 2, 16, 8) full
    headers, rows = grid_rows(results)
    assert headers == ["shape (B, H, n, d)", "dtype", "attnx:numpy full", "attnx:numpy causal"]
    assert rows[0] == ("(1, 2, 16, 8)", "float32", "3.00", "2.00")
    assert len(rows) == 8 and all(row[2:] == ("2.00", "2.00") for row in rows[1:])


def test_grid_without_its_baseline_is_one_error_line():
    result = subprocess.run(
        [sys.executable, "-m", "attnx.cli", "bench", "--grid", "--baselines", "jax-sdpa"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "torch-sdpa" in result.stderr


@pytest.mark.slow  # `tox -e slow`
def test_dask_on_local_clusters_reports_the_speed_up(tmp_path):
    out = tmp_path / "report"
    command = [sys.executable, "-m", "attnx.cli", "bench", "--backends", "dask", "--dask-workers", "1", "2"]
    command += ["--batch", "2", "--sizes", "16", "--heads", "2", "--head-dim", "8", "--operations", "sdpa"]
    command += ["--no-baselines", "--repeat", "2", "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr + result.stdout
    rows = json.loads((out / "results.json").read_text())
    assert [row["workers"] for row in rows] == [1, 2]
    assert all(row["error"] is None and row["median_s"] > 0 for row in rows)
    assert "x over 1" in result.stdout and "attnx:dask (2 workers)" in result.stdout
    assert "Dask on a local cluster" in (out / "results.md").read_text()


def test_dask_workers_without_the_dask_backend_is_one_error_line():
    command = [sys.executable, "-m", "attnx.cli", "bench", "--backends", "numpy", "--dask-workers", "2"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "add dask to --backends" in result.stderr


@pytest.mark.parametrize("operation", benchmark.OPERATIONS)
def test_every_operation_runs_on_the_device_asked_for(array_api_strict_backend, operation):
    # array-api-strict's device1 is not its default device: an input or a
    # parameter made without the device asked for would land on the default
    # (as multi-head attention's did on PyTorch: --device cuda:0 timed the CPU).
    import array_api_strict as strict

    case = Case("attnx:array_api_strict", operation, batch=1, heads=2, n=8, head_dim=4, device="device1", window=2)
    function, synchronize = benchmark._callable(case)
    output = function()
    synchronize()
    for array in output if isinstance(output, tuple) else (output,):  # a training step's gradients
        assert array.device == strict.Device("device1")


def test_a_third_partys_backend_gets_the_dtype_asked_for():
    # NumPy has no bfloat16: the inputs start as float32 and the backend makes them bfloat16.
    torch = pytest.importorskip("torch")
    from attnx_backends.torch_backend import TorchBackend

    class ThirdParty(TorchBackend):
        name = "third-party-torch"

    class Plugin:
        @attnx.hookimpl
        def attnx_backends(self):
            return [ThirdParty()]

    name = attnx.register_plugin(Plugin(), name="third-party-torch-plugin")
    try:
        case = Case("attnx:third-party-torch", "sdpa", batch=1, heads=2, n=8, head_dim=4, dtype="bfloat16")
        function, _ = benchmark._callable(case)
        assert function().dtype == torch.bfloat16
    finally:
        attnx.unregister_plugin(name)


def _bench(tmp_path, *arguments):
    """``attnx bench`` in this process: its exit status and its rows.  The
    cases are planned and reported but not timed (``measure`` gives 1 ms)."""
    from attnx.cli import main

    out = tmp_path / "report"
    status = main(["bench", "--heads", "1", "--repeat", "1", "--rounds", "1", "--out", str(out), *arguments])
    return status, json.loads((out / "results.json").read_text())


@pytest.fixture
def untimed(monkeypatch):
    monkeypatch.setattr(benchmark, "measure", lambda case, memory=True: Result(case, 1e-3, [1e-3], 100))


def test_bench_fills_in_what_was_not_given_and_takes_the_baselines_named(tmp_path, capsys, untimed):
    pytest.importorskip("torch")
    status, rows = _bench(tmp_path, "--sizes", "16", "--baselines", "torch-sdpa")
    assert status == 0
    assert {row["implementation"] for row in rows} == {"attnx:numpy", "torch-sdpa"}
    assert {(row["batch"], row["head_dim"]) for row in rows} == {(1, 64)}  # the defaults
    out = capsys.readouterr().out
    assert "time.png" in out and "no plots" not in out  # matplotlib is a test dependency


def test_grid_fills_in_the_grid_s_batches_and_widths(tmp_path, untimed):
    pytest.importorskip("torch")
    status, rows = _bench(tmp_path, "--grid", "--sizes", "16", "--operations", "sdpa", "--baselines", "torch-sdpa")
    assert status == 0
    assert sorted({row["batch"] for row in rows}) == list(benchmark.GRID["batch"])
    assert sorted({row["head_dim"] for row in rows}) == list(benchmark.GRID["head_dim"])


def test_bench_exits_1_when_a_case_fails(tmp_path, monkeypatch):
    monkeypatch.setattr(
        benchmark, "measure", lambda case, memory=True: Result(case, error="RuntimeError: out of memory")
    )
    status, rows = _bench(tmp_path, "--sizes", "16", "--no-baselines")
    assert status == 1 and rows and all(row["error"] == "RuntimeError: out of memory" for row in rows)


def test_flops_count_the_two_products_over_the_scores_computed():
    """The report's GFLOP/s: 2 d FLOPs a score for Q K^T and as many for P V,
    over the scores each operation computes (counted one row at a time)."""
    batch, heads, n, d, window = 2, 8, 128, 64, 16
    per_score = 4.0 * batch * heads * d

    def flops(operation):
        return Case("attnx:numpy", operation, batch, heads, n, d, window=window).flops

    assert flops("sdpa") == per_score * n * n
    assert flops("sdpa_causal") == per_score * n * n / 2
    assert flops("sliding_window") == per_score * sum(min(row + 1, window + 1) for row in range(n))


@pytest.mark.parametrize("baseline", ["numpy-textbook", "torch-sdpa", "jax-sdpa"])
def test_each_baseline_computes_the_attention_attnx_computes(baseline):
    """A baseline timed on other shapes or another layout than attnx's would
    make its ratio meaningless: each one's output, on the same inputs, is
    attnx's (JAX's in its (B, n, H, d) layout, swapped back)."""
    pytest.importorskip(baseline.partition("-")[0])
    shape = {"batch": 2, "heads": 3, "n": 16, "head_dim": 8}
    for operation in ("sdpa", "sdpa_causal"):
        expected_function, _ = benchmark._callable(Case("attnx:numpy", operation, **shape))
        function, _ = benchmark._callable(Case(baseline, operation, **shape))
        got = np.asarray(function())
        if baseline == "jax-sdpa":
            got = got.swapaxes(1, 2)
        np.testing.assert_allclose(got, np.asarray(expected_function()), rtol=1e-5, atol=1e-6, err_msg=operation)


def test_a_load_above_the_cores_used_warns_that_figures_will_be_noisy(monkeypatch):
    monkeypatch.setattr(benchmark.os, "sched_getaffinity", lambda pid: {0, 1})
    for load, warned in ((1.0, False), (2.0, False), (2.5, True)):
        monkeypatch.setattr(benchmark.os, "getloadavg", lambda load=load: (load, 0.0, 0.0))
        warning = benchmark.load_warning()
        assert (warning is not None) == warned, (load, warning)
    assert "load average 2.5 over the 2 cores" in warning
    assert benchmark.load_warning(threads=4) is not None  # at most the cores there are: 2


def test_baselines_that_hold_the_whole_scores_run_only_where_they_fit():
    """(1, 8, 8192, 8192) float32 scores are 2 GiB, DENSE_LIMIT_BYTES: the
    textbook runs there, not at n = 12288 (4.5 GiB); PyTorch's SDPA at both."""
    cases = benchmark.plan(
        ["numpy"],
        ["sdpa"],
        [8192, 12288],
        batch=1,
        heads=8,
        head_dim=64,
        dtype="float32",
        repeat=1,
        baselines=["numpy-textbook", "torch-sdpa"],
    )
    ran = {(case.implementation, case.n) for case in cases}
    assert ran == {
        ("attnx:numpy", 8192),
        ("attnx:numpy", 12288),
        ("numpy-textbook", 8192),
        ("torch-sdpa", 8192),
        ("torch-sdpa", 12288),
    }


def test_a_case_measures_what_it_is_asked_for():
    """Memory in a process of its own (its allocator set for it), time in
    another: ``run_case`` does the one it is given, or both."""
    case = Case("attnx:numpy", "sdpa", batch=1, heads=1, n=16, head_dim=8, repeat=2)
    timed = benchmark.run_case(case, "time")
    assert timed.peak_bytes is None and timed.median_s > 0 and len(timed.times_s) >= 2
    measured = benchmark.run_case(case, "memory")
    assert measured.peak_bytes is not None and measured.median_s is None and measured.times_s == []
    both = benchmark.run_case(case, "both")
    assert both.peak_bytes is not None and both.median_s > 0


def test_a_worker_that_crashes_is_reported_by_its_last_line(tmp_path, monkeypatch):
    """The last line of a traceback is its error: that is what the table shows."""
    crashing = tmp_path / "python"
    crashing.write_text(
        "#!/bin/sh\necho 'Traceback (most recent call last):' >&2\necho '  File x' >&2\necho 'MemoryError: no' >&2\nexit 1\n"
    )
    crashing.chmod(0o755)
    monkeypatch.setattr(benchmark.sys, "executable", str(crashing))
    case = Case("attnx:numpy", "sdpa", batch=1, heads=1, n=16, head_dim=8)
    assert benchmark._run_worker(case, "time", timeout=30) == {"error": "worker failed: MemoryError: no"}


@pytest.mark.parametrize("baseline", ["torch-flex", "attnx-dense-mask"])
def test_each_sliding_window_baseline_attends_the_same_window(baseline):
    """The window's baselines (PyTorch's FlexAttention, attnx with a dense
    mask) attend the keys attnx's block-sparse sliding window does."""
    if baseline == "torch-flex":
        pytest.importorskip("torch")
    shape = {"batch": 1, "heads": 2, "n": 16, "head_dim": 8, "window": 3}
    expected, _ = benchmark._callable(Case("attnx:numpy", "sliding_window", **shape))
    function, _ = benchmark._callable(Case(baseline, "sliding_window", **shape))
    np.testing.assert_allclose(np.asarray(function()), np.asarray(expected()), rtol=1e-5, atol=1e-6)


def test_plots_draw_a_line_per_batch_and_width_only_where_a_sweep_has_several():
    def results(*shapes):
        return [Result(Case("attnx:numpy", "sdpa", b, 8, 128, d), median_s=1e-3) for b, d in shapes]

    assert list(benchmark._series(results((1, 64)))) == [("sdpa", "attnx:numpy")]
    assert list(benchmark._series(results((1, 64), (16, 128)))) == [
        ("sdpa", "attnx:numpy B=1 d=64"),
        ("sdpa", "attnx:numpy B=16 d=128"),
    ]


def test_the_table_gives_milliseconds_gflops_and_mebibytes():
    case = Case("attnx:numpy", "sdpa", 1, 8, 128, 64)
    (row,) = benchmark.table_rows([Result(case, median_s=2.5e-4, peak_bytes=3 * 2**20 + 2**19)])
    assert row[4:7] == ("0.25", f"{case.flops / 2.5e-4 / 1e9:.1f}", "3.5")


@pytest.mark.parametrize(
    ("files", "said"),
    [
        ({}, ""),
        ({"devices/system/cpu/cpuidle/current_driver": "intel_idle\n"}, "cpuidle driver intel_idle"),
        ({"devices/system/cpu/cpuidle/current_driver": "haltpoll\n"}, "cpuidle driver haltpoll"),
        (
            {
                "devices/system/cpu/cpuidle/current_driver": "haltpoll\n",
                "module/haltpoll/parameters/guest_halt_poll_ns": "200000\n",
            },
            "cpuidle driver haltpoll, guest_halt_poll_ns 200000",
        ),
        (
            {
                "devices/system/cpu/cpuidle/current_driver": "haltpoll\n",
                "module/haltpoll/parameters/guest_halt_poll_ns": "0\n",
            },
            "cpuidle driver haltpoll, guest_halt_poll_ns 0 (an idle vCPU halts at once, "
            "and waking it costs tens of microseconds)",
        ),
    ],
)
def test_the_report_says_how_idle_cpus_wait(tmp_path, files, said):
    """The host's idle policy decides what a threaded call under a
    millisecond costs (docs/archive/bench-sessions.md): the report names it where Linux
    says, and nothing where it does not."""
    for name, text in files.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    assert benchmark._idle_policy(tmp_path) == said


@pytest.mark.parametrize(
    ("lines", "said"),
    [
        ("model name\t: AMD EPYC\nflags\t\t: fpu sse2 avx avx2 fma avx512f avx512bw\n", "AVX-512"),
        ("flags\t\t: fpu sse2 avx avx2 fma\nflags\t\t: fpu sse2 avx avx2 fma\n", "AVX2"),
        ("Features\t: fp asimd evtstrm sve\n", "SVE"),
        ("Features\t: fp asimd evtstrm\n", "NEON"),
        ("flags\t\t: fpu sse2\n", ""),
    ],
)
def test_the_report_names_the_vector_units(tmp_path, lines, said):
    """NumPy's exponential against PyTorch's turns on them (0.4x its time
    with AVX-512, 1.3x with AVX2): the report says which the run had."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(lines)
    assert benchmark._vector_units(cpuinfo) == said
    assert benchmark._vector_units(tmp_path / "absent") == ""


@pytest.mark.parametrize("baseline", ["torch-sdpa", "jax-sdpa"])
def test_each_training_step_computes_the_gradients_attnx_computes(baseline):
    """``--backward``: a baseline's training step gives the gradients of
    attnx's (``attnx.vjp`` on NumPy), the output as the cotangent."""
    pytest.importorskip(baseline.partition("-")[0])
    shape = {"batch": 2, "heads": 3, "n": 16, "head_dim": 8}
    for operation in benchmark.BACKWARD.values():
        expected_function, _ = benchmark._callable(Case("attnx:numpy", operation, **shape))
        function, _ = benchmark._callable(Case(baseline, operation, **shape))
        for got, expected in zip(function(), expected_function()):
            got = np.asarray(got)
            if baseline == "jax-sdpa":
                got = got.swapaxes(1, 2)
            np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5, err_msg=operation)
    assert Case("attnx:numpy", "sdpa+backward", **shape).flops == 3.5 * Case("attnx:numpy", "sdpa", **shape).flops


def test_backward_of_an_operation_without_one_is_one_error_line():
    result = subprocess.run(
        [sys.executable, "-m", "attnx.cli", "bench", "--backward", "--operations", "additive_attention"],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("attnx bench: error: --backward times sdpa")
    assert "Traceback" not in result.stderr
