"""The examples run (briefly) and write their plots."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("matplotlib")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize("script, steps", [("bahdanau_seq2seq.py", 150), ("nadaraya_watson_fit.py", 20)])
def test_example_runs(tmp_path, script, steps):
    out = tmp_path / "plot.png"
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--steps", str(steps), "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    assert out.stat().st_size > 10_000
    if script == "bahdanau_seq2seq.py":
        last = [line for line in result.stdout.splitlines() if "token accuracy" in line][-1]
        assert float(last.rpartition("token accuracy")[2]) > 0.5, result.stdout
