"""The command line: user mistakes are one line on stderr and exit 2, found before any work."""

from __future__ import annotations

import pytest

from attnx import benchmark, cli

MISTAKES = [
    ["demo", "--backend", "foo"],
    ["demo", "--backend", "cupy"],
    ["bench", "--sizes", "0"],
    ["bench", "--sizes", "-3"],
    ["bench", "--sizes", "ten"],
    ["bench", "--operations", "foo"],
    ["bench", "--backends", "foo"],
    ["bench", "--backends", "cupy"],
    ["bench", "--dtype", "bfloat16"],  # NumPy has no bfloat16
    ["bench", "--heads", "0"],
    ["bench", "--rounds", "0"],
    ["bench", "--device", "cuda:7"],
    ["conformance", "nmpy"],
    ["conformance", "cupy"],
    ["conformance", "numpy", "--device", "cuda:7"],
    ["backends", "--what"],
    ["demo", "--what"],
    ["frobnicate"],
    [],
]


@pytest.mark.parametrize("argv", MISTAKES, ids=" ".join)
def test_a_mistake_is_one_line_on_stderr_and_exit_2(argv, capsys, monkeypatch, tmp_path):
    if argv[-1:] == ["cupy"] and _cupy_available():
        pytest.skip("cupy is available here")
    monkeypatch.chdir(tmp_path)
    started = []
    monkeypatch.setattr(benchmark, "sweep", lambda cases, **options: started.append(cases) or [])
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("attnx") and "error:" in lines[0] and "Traceback" not in captured.err
    assert not started, "work started before the arguments were checked"
    assert list(tmp_path.iterdir()) == []


def _cupy_available():
    import attnx

    return next(info for info in attnx.list_backends() if info.name == "cupy").available


def test_unknown_names_are_named_with_the_registered_ones(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "--backends", "nmupy"])
    err = capsys.readouterr().err
    assert "'nmupy'" in err and "'numpy'" in err and "--backends" in err


def test_help_lists_every_command_on_one_line_and_every_default(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for command in ("backends", "demo", "conformance", "bench"):
        (line,) = [line for line in text.splitlines() if line.startswith(f"  {command} ")]
        assert len(line.split()) > 3, line  # the name and its description on the same line
    parser = cli.build_parser()
    for name, sub in parser._subparsers._group_actions[0].choices.items():
        help_text = " ".join(sub.format_help().partition("options:")[2].split())
        for action in sub._actions:
            if action.option_strings and action.help and action.dest != "help":
                start = " ".join(action.help.split()[:3])
                assert start in help_text, (name, action.dest)
                after = help_text.partition(start)[2][:300]
                assert "default" in after, f"attnx {name} {action.option_strings[0]} does not show its default"
    bench_help = " ".join(parser._subparsers._group_actions[0].choices["bench"].format_help().split())
    assert "--no-baselines skip the baselines" in bench_help
    assert "where installed) (default: off)" in bench_help  # a flag's default reads off or on, not False


def test_bench_warns_when_the_machine_is_busy(monkeypatch):
    monkeypatch.setattr(benchmark.os, "getloadavg", lambda: (9.0, 9.0, 9.0))
    monkeypatch.setattr(benchmark.os, "sched_getaffinity", lambda pid: {0, 1})
    assert "busy" in benchmark.load_warning() and "2 cores" in benchmark.load_warning()
    assert "1 cores" in benchmark.load_warning(threads=1)
    monkeypatch.setattr(benchmark.os, "getloadavg", lambda: (0.5, 0.5, 0.5))
    assert benchmark.load_warning() is None


def test_the_bfloat16_textbook_row_says_it_ran_in_float32():
    case = benchmark.Case("numpy-textbook", "sdpa", 1, 1, 16, 8, dtype="bfloat16")
    result = benchmark.Result(case, median_s=1e-3, times_s=[1e-3])
    (row,) = benchmark.table_rows([result])
    assert row[3].startswith("float32") and "bfloat16" in row[3]
    torch_case = benchmark.Case("torch-sdpa", "sdpa", 1, 1, 16, 8, dtype="bfloat16")
    assert benchmark.measured_dtype(torch_case) == "bfloat16"


def test_the_benchmark_report_does_not_import_the_command_line():
    import subprocess
    import sys

    code = "import sys, attnx.benchmark; print('attnx.cli' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False"


def test_the_demo_shows_causal_padded_weights_that_sum_to_1(capsys):
    """`attnx demo`, the README's first command: the backends with their
    versions, then weights with nothing on the future or the padding."""
    import numpy as np

    assert cli.main(["demo"]) == 0
    out = capsys.readouterr().out
    assert any(line.split()[:3] == ["numpy", "yes", np.__version__] for line in out.splitlines())
    rows = [line.split() for line in out.splitlines() if line.startswith("  ") and "sum" in line]
    weights = np.array([[float(w) for w in row[:5]] for row in rows]).reshape(2, 5, 5)
    assert not np.triu(weights, 1).any() and not weights[1, :, 3:].any()
    np.testing.assert_allclose(weights.sum(-1), 1.0, atol=0.03)  # printed to 2 decimals
    assert "output: numpy.ndarray (2, 5, 4) float32." in out
