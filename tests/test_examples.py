"""The examples run (briefly), check their dependencies first, and compute the right numbers."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import attnx

pytest.importorskip("torch")
pytest.importorskip("matplotlib")

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def _run(script, *args):
    return subprocess.run([sys.executable, str(EXAMPLES / script), *args], capture_output=True, text=True, timeout=300)


def _module(script):
    spec = importlib.util.spec_from_file_location(script.removesuffix(".py"), EXAMPLES / script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # `tox -e slow`
def test_seq2seq_learns_reversal_with_its_weight_on_the_reversed_position(tmp_path):
    out = tmp_path / "plot.png"
    result = _run("bahdanau_seq2seq.py", "--out", str(out))  # the default steps, as the docs show them
    assert result.returncode == 0, result.stderr
    assert out.stat().st_size > 10_000
    accuracy = float(re.search(r"token accuracy ([\d.]+) on 256 new sequences", result.stdout).group(1))
    assert accuracy > 0.99, result.stdout
    per_step = re.search(r"per output step: ([\d. ]+)\n", result.stdout).group(1).split()
    assert len(per_step) == 7, result.stdout
    assert min(map(float, per_step)) >= 0.9, result.stdout  # each step attends its reversed position


def test_seq2seq_attention_equals_the_formula_on_the_model_s_own_tensors():
    import torch

    import attnx

    example = _module("bahdanau_seq2seq.py")
    model = example.Seq2Seq()
    source, _ = example.batch(4, torch.Generator().manual_seed(5))
    with torch.no_grad():
        annotations = model.encode(source)
        state = torch.randn(4, model.decoder.hidden_size, generator=torch.Generator().manual_seed(6))
        params = {"w_q": model.w_q, "w_k": model.w_k, "w_v": model.w_v}
        context, weights = attnx.bahdanau_context(state, annotations, params, return_weights=True)
    h, s = annotations.double().numpy(), state.double().numpy()
    w_q, w_k, w_v = (p.detach().double().numpy() for p in (model.w_q, model.w_k, model.w_v))
    scores = np.tanh((s @ w_q)[:, None, :] + h @ w_k) @ w_v  # a(s, h_i) = w_v . tanh(W_q s + W_k h_i)
    expected_weights = np.exp(scores - scores.max(1, keepdims=True))
    expected_weights /= expected_weights.sum(1, keepdims=True)
    np.testing.assert_allclose(weights.numpy(), expected_weights, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(context.numpy(), np.einsum("bt,btd->bd", expected_weights, h), rtol=1e-4, atol=1e-5)


def test_kernel_regression_fit_equals_the_formula_at_the_learned_width(tmp_path):
    out = tmp_path / "plot.png"
    result = _run("nadaraya_watson_fit.py", "--steps", "20", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert out.stat().st_size > 10_000
    w = float(re.search(r"learned w ([\d.]+)", result.stdout).group(1))
    error = float(re.search(r"mean squared error against the truth ([\d.]+)", result.stdout).group(1))
    x_train, y_train, x_test = _module("nadaraya_watson_fit.py").make_data()
    weights = np.exp(-(((x_test[:, None] - x_train[None, :]) * w) ** 2) / 2)
    expected = weights @ y_train / weights.sum(1)
    truth = 2 * np.sin(x_test) + x_test**0.8
    assert error == pytest.approx(((expected - truth) ** 2).mean(), abs=2e-9)  # printed to 9 decimals
    assert w != pytest.approx(1.0, abs=0.05), "the width was not learned"


def test_kernel_regression_learns_the_same_width_through_vjp_on_numpy_as_through_pytorch_s_autograd(tmp_path):
    widths = []
    for options in ([], ["--autograd"]):
        result = _run("nadaraya_watson_fit.py", "--steps", "10", "--out", str(tmp_path / "plot.png"), *options)
        assert result.returncode == 0, result.stderr
        widths.append(float(re.search(r"learned w ([\d.]+)", result.stdout).group(1)))
    assert widths[0] == pytest.approx(widths[1], abs=1e-9)
    assert widths[0] != pytest.approx(1.0, abs=0.05), "the width was not learned"


def test_kernel_regression_names_a_backend_that_cannot_run_in_one_line(tmp_path):
    result = _run("nadaraya_watson_fit.py", "--backend", "no-such-backend", "--out", str(tmp_path / "plot.png"))
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].endswith("backend 'no-such-backend' can't run here: not registered")
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize(
    ("script", "extras"), [("bahdanau_seq2seq.py", "torch,plot"), ("nadaraya_watson_fit.py", "plot")]
)
def test_a_missing_dependency_is_reported_before_training(script, extras, tmp_path):
    blocker = tmp_path / "sitecustomize.py"  # makes matplotlib look uninstalled
    blocker.write_text(
        "import importlib.util\n_find = importlib.util.find_spec\n"
        "importlib.util.find_spec = lambda name, *a: None if name == 'matplotlib' else _find(name, *a)\n"
    )
    env = {**__import__("os").environ, "PYTHONPATH": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--steps", "1000000"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert result.returncode == 1
    assert f"needs matplotlib: pip install '.[{extras}]' in attnx's clone" in result.stderr
    assert "step" not in result.stdout


def test_attnx_plot_is_reachable_after_a_plain_import():
    code = (
        "import sys, attnx\n"
        "assert 'matplotlib' not in sys.modules\n"
        "import matplotlib; matplotlib.use('Agg')\n"
        "import numpy as np\n"
        "ax = attnx.plot.attention_heatmap(np.eye(3))\n"
        "print(type(ax).__name__)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "Axes"


@pytest.mark.parametrize(
    "labels, words",
    [
        ({"queries": ["a"]}, "queries must be 3 labels, one per row of weights, got 1 labels"),
        ({"keys": list("abcdefg")}, "keys must be 4 labels, one per column of weights, got 7 labels"),
        ({"keys": "abcd"}, "keys must be 4 labels, one per column of weights, got 'abcd'"),
    ],
)
def test_heatmap_labels_one_per_row_and_column(labels, words):
    """Labels for fewer rows than the weights have would name the wrong rows."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    with pytest.raises(ValueError, match=words):
        attnx.plot.attention_heatmap(np.ones((3, 4)), **labels)


def test_attention_heatmap_draws_the_weights_as_given():
    """Any backend's weights, drawn from 0 with their labels, title and colour
    bar, on a new figure sized by the weights or on the user's axes."""
    import matplotlib
    import torch

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    weights = np.random.default_rng(0).random((3, 5)).astype(np.float32)
    ax = attnx.plot.attention_heatmap(
        torch.from_numpy(weights), queries=["q0", "q1", "q2"], keys=list("abcde"), title="one head"
    )
    image = ax.get_images()[0]
    np.testing.assert_array_equal(image.get_array(), weights)
    assert image.get_clim()[0] == 0.0 and image.get_cmap().name == "viridis"
    assert (ax.get_xlabel(), ax.get_ylabel(), ax.get_title()) == ("keys", "queries", "one head")
    assert [label.get_text() for label in ax.get_xticklabels()] == list("abcde")
    assert [label.get_text() for label in ax.get_yticklabels()] == ["q0", "q1", "q2"]
    assert len(ax.figure.axes) == 2  # the weights and their colour bar
    np.testing.assert_allclose(ax.figure.get_size_inches(), (1 + 0.4 * 5, 1 + 0.4 * 3))
    plt.close(ax.figure)
    figure, given = plt.subplots()
    assert attnx.plot.attention_heatmap(weights, ax=given, colorbar=False, cmap="magma") is given
    assert figure.axes == [given] and given.get_images()[0].get_cmap().name == "magma"
    plt.close(figure)
    with pytest.raises(ValueError, match=r"weights must have shape \(n, m\), got \(1, 3, 5\)"):
        attnx.plot.attention_heatmap(weights[None])
    with pytest.raises(TypeError):  # labels are keywords: a positional list would be taken for another option
        attnx.plot.attention_heatmap(weights, ["q0", "q1", "q2"])


def test_attention_heatmap_without_matplotlib_says_how_to_install_it():
    code = (
        "import sys; sys.modules['matplotlib'] = None; sys.modules['matplotlib.pyplot'] = None\n"
        "import attnx, numpy as np\n"
        "attnx.plot.attention_heatmap(np.eye(3))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 1 and "needs matplotlib: pip install '.[plot]' in attnx's clone" in result.stderr


def test_dask_kernel_regression_on_a_local_cluster():
    pytest.importorskip("distributed")
    result = _run("dask_kernel_regression.py", "--points", "2000000", "--chunk", "200000", "--memory-limit", "400MiB")
    assert result.returncode == 0, result.stderr
    assert "cluster stopped" in result.stdout
    error = float(result.stdout.partition("largest error against sin: ")[2].split()[0])
    assert error < 0.05, result.stdout


def test_decoding_over_a_cache_equals_attention_over_the_whole_sequences_on_numpy_and_pytorch():
    """examples/decode.py: grouped heads over caches that grow to different
    lengths; a follow-up of 4 tokens appended to every sequence in one
    call, each aligned to its own sequence's end, and the last step equal
    attention recomputed over each whole sequence, and both backends pick
    the same tokens."""
    result = _run("decode.py", "--steps", "8")
    assert result.returncode == 0, result.stderr
    rates = re.findall(r"^ *(numpy|torch): 64 tokens in \d+ ms, \d+ tokens/s$", result.stdout, re.M)
    assert rates == ["numpy", "torch"], result.stdout
    differences = [float(d) for d in re.findall(r"(?:follow-up|last) (\S+?)(?:,|$)", result.stdout, re.M)]
    assert len(differences) == 4 and max(differences) < 1e-5, result.stdout
    assert "same tokens on numpy, torch: yes" in result.stdout


def test_decode_names_a_backend_that_cannot_run_in_one_line():
    result = _run("decode.py", "--backends", "nmpy")
    assert result.returncode == 2 and result.stderr.strip().endswith("backend 'nmpy' can't run here: not registered")
