"""The conformance suite catches a wrong backend, with a readable message."""

from __future__ import annotations

import os
import subprocess

import numpy as np
import pytest

import attnx


def broken_plugin(base_module: str, base: str, body: str) -> str:
    """A third party's plugin module registering "broken": ``base`` (of
    ``attnx_backends.<base_module>``) under another name, with ``body``, the
    class's statements, holding the bug."""
    return f"""
import attnx
from attnx.attention import sdpa_generic
from attnx_backends.{base_module} import {base}


class Broken({base}):
    name = "broken"
{body}

class Plugin:
    @attnx.hookimpl
    def attnx_backends(self):
        return [Broken()]


attnx.register_plugin(Plugin(), name="broken-plugin")
"""


# Owns NumPy arrays; its native SDPA forgets the scale.
BROKEN = broken_plugin(
    "numpy_backend",
    "NumPyBackend",
    """
    def implementations(self):
        return {"scaled_dot_product_attention": self.sdpa}

    def sdpa(self, **kwargs):
        kwargs["scale"] = 1.0  # the bug
        return sdpa_generic(self.xp, **kwargs)
""",
)


@pytest.fixture(autouse=True)
def _array_libraries_imported_before_pytester():
    """The backends' array libraries imported (by listing the backends and
    their devices) before ``pytester`` snapshots ``sys.modules``: it gives
    them back as it found them, dropping what its test imported, and
    importing PyTorch's or jaxlib's extension a second time in one process
    crashes it (jaxlib aborts: absl's logging initialised twice)."""
    attnx.list_backends()


def _sdpa_suite_on_broken(pytester, plugin_source, *options):
    """The SDPA conformance tests on the "broken" backend that ``plugin_source`` registers."""
    pytester.makepyfile(broken_plugin=plugin_source)
    return pytester.runpytest_subprocess(
        "-p",
        "broken_plugin",
        "--pyargs",
        "attnx_conformance.test_scaled_dot_product_attention",
        "--attnx-backend",
        "broken",
        "-p",
        "no:cacheprovider",
        *options,
    )


def test_suite_fails_a_backend_that_drops_the_scale(pytester):
    result = _sdpa_suite_on_broken(pytester, BROKEN)
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) >= 5, outcomes
    assert outcomes.get("passed", 0) >= 1, outcomes  # calls that decline to the native path still pass
    result.stdout.fnmatch_lines(["*attnx conformance, per operation*", "scaled_dot_product_attention * failed*"])
    result.stdout.fnmatch_lines(["*Not equal to tolerance*"])


# In one dtype alone (what its tolerance must catch by itself); its native
# SDPA is off by ``error``.
OFF_BY = """
    float_dtypes = ("{dtype}",)

    def implementations(self):
        return {{"scaled_dot_product_attention": self.sdpa}}

    def specialize(self, operation, arguments):
        return None  # no plan of the base's own: every call comes to sdpa

    def sdpa(self, **kwargs):
        if kwargs["return_weights"]:
            return NotImplemented
        return sdpa_generic(self.xp, **kwargs) * (1 + {error})  # the bug
"""


@pytest.mark.parametrize(
    "module, base, dtype, error",
    [
        ("numpy_backend", "NumPyBackend", "float32", 1e-4),
        ("numpy_backend", "NumPyBackend", "float16", 0.05),
        ("torch_backend", "TorchBackend", "bfloat16", 0.2),
    ],
    ids=["float32", "float16", "bfloat16"],
)
def test_suite_fails_a_backend_off_by_a_little_more_than_its_dtype_allows(pytester, module, base, dtype, error):
    """The tolerances are tight enough to see an error far below any that
    drops a term: float32 results must be right to about 2e-5, float16's
    to 2e-2 and bfloat16's to 6e-2 (of the values, 2e-3 and 2e-2 absolute)."""
    if module == "torch_backend":
        pytest.importorskip("torch")
    source = broken_plugin(module, base, OFF_BY.format(dtype=dtype, error=error))
    result = _sdpa_suite_on_broken(pytester, source, "-k", "test_matches_reference_over_shapes_and_dtypes")
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) >= 5, outcomes
    result.stdout.fnmatch_lines(["*Not equal to tolerance*"])


def test_suite_runs_from_the_command_line_on_numpy(pytester):
    result = pytester.run("attnx", "conformance", "numpy", "-k", "test_masks_match_reference and causal")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["scaled_dot_product_attention * passed*"])


def test_the_report_names_the_backends_under_test(pytester):
    """pytest's header says what is tested: the version and devices of the
    backend selected, and no other (the suite runs on it alone)."""
    version = attnx._registry.get("numpy").version()
    result = pytester.runpytest_subprocess(
        "--pyargs", "attnx_conformance.test_masked_softmax", "--attnx-backend", "numpy", "-k", "additive_inf"
    )
    assert result.ret == 0
    result.stdout.fnmatch_lines(
        [f"attnx {attnx.__version__}; backends under test:", f"  numpy {version} (attnx), devices cpu"]
    )
    for other in {info.name for info in attnx.list_backends()} - {"numpy"}:  # the one named, and no other
        result.stdout.no_fnmatch_line(f"  {other}*")


def test_only_a_lazy_backend_skips_the_checks_of_values():
    """The checks of values that can't be read before computing are skipped
    on lazy arrays alone: NumPy's run them all."""
    from attnx_conformance.plugin import BackendUnderTest

    assert BackendUnderTest("numpy", attnx._registry.get("numpy")).lazy is False
    pytest.importorskip("dask.array")
    assert BackendUnderTest("dask", attnx._registry.get("dask")).lazy is True


def test_checks_written_for_float64_run_in_the_widest_dtype_a_backend_has():
    """JAX without x64 and many GPU libraries have no float64: the suite's
    float64 checks run there in their widest float dtype, with its tolerances."""
    from attnx_conformance.plugin import BackendUnderTest

    numpy_backend = attnx._registry.get("numpy")

    def under_test(*dtypes):
        return BackendUnderTest("numpy", numpy_backend, None, dtypes)

    assert under_test("float16", "float32").widest == "float32"
    assert under_test("float16", "float32").dtype("float64") == "float32"
    assert under_test("float16", "float32").dtype("float16") == "float16"
    assert under_test("float16", "bfloat16").widest == "bfloat16"
    assert under_test("float64", "float32").dtype("float64") == "float64"
    # and the arrays it makes of float64 data, given or implied, come in that dtype
    assert under_test("float16", "float32").array(np.ones(2), "float64").dtype == np.float32
    assert under_test("float16", "float32").array(np.ones(2)).dtype == np.float32
    with pytest.raises(ValueError, match="backend 'numpy' lists no float dtype attnx knows"):
        under_test("int8").dtype("float64")


def test_known_failures_file_xfails_and_warns_on_unused_entries(pytester):
    xfails = pytester.makefile(
        ".txt",
        known_failures="""
        # known failures of the numpy backend
        test_scaled_dot_product_attention.py::test_scale_argument   # says it fails, but it passes: XPASS
        test_no_such_thing                                          # matches nothing: warned about
        """,
    )
    result = pytester.runpytest_subprocess(
        "--pyargs",
        "attnx_conformance.test_scaled_dot_product_attention",
        "--attnx-backend",
        "numpy",
        "--attnx-xfails",
        str(xfails),
        "-k",
        "test_scale_argument",
        "-p",
        "no:cacheprovider",
        "-rX",
    )
    assert result.parseoutcomes().get("xpassed") == 1
    result.stdout.fnmatch_lines(["*XPASS*test_scale_argument*says it fails*"])
    result.stdout.fnmatch_lines(["*entry matches no test: 'test_no_such_thing'*"])


UNAVAILABLE = """
import attnx
from attnx_backends.numpy_backend import NumPyBackend


class NoDevice(NumPyBackend):
    name = "nodevice"

    def unavailable_reason(self):
        return "needs a frobnicator, none found"


class Plugin:
    @attnx.hookimpl
    def attnx_backends(self):
        return [NoDevice()]


attnx.register_plugin(Plugin(), name="nodevice-plugin")
"""


def _suite(pytester, *args):
    return pytester.runpytest_subprocess("--pyargs", "attnx_conformance", "-p", "no:cacheprovider", *args)


def test_an_unknown_backend_is_an_error_naming_the_registered_ones(pytester):
    result = pytester.run("attnx", "conformance", "nmpy")
    assert result.ret == 2
    assert len(result.errlines) == 1 and "unknown attnx backend 'nmpy'" in result.errlines[0]
    assert "numpy" in result.errlines[0]
    plain = _suite(pytester, "--attnx-backend", "nmpy")
    assert plain.ret == pytest.ExitCode.USAGE_ERROR
    plain.stderr.fnmatch_lines(["*unknown attnx backend 'nmpy'*registered backends:*numpy*"])


def test_a_plugin_that_failed_to_load_is_named_with_its_error(pytester, monkeypatch):
    import attnx
    from attnx_conformance.plugin import selection_problem

    class Broken:
        @attnx.hookimpl
        def attnx_backends(self):
            raise ImportError("libfrob.so: cannot open shared object file")

    monkeypatch.delenv("ATTNX_STRICT_PLUGINS", raising=False)
    with pytest.warns(attnx.PluginWarning):
        attnx.register_plugin(Broken(), name="frob")
    try:
        problem = selection_problem(["frob"], None, False)
    finally:
        attnx.unregister_plugin("frob")
    assert "unknown attnx backend 'frob'" in problem and "'frob'" in problem and "libfrob.so" in problem


def test_an_unavailable_backend_fails_unless_allowed(pytester):
    pytester.makepyfile(nodevice_plugin=UNAVAILABLE)
    refused = _suite(pytester, "-p", "nodevice_plugin", "--attnx-backend", "nodevice")
    assert refused.ret == pytest.ExitCode.USAGE_ERROR
    refused.stderr.fnmatch_lines(["*'nodevice' is unavailable here: needs a frobnicator*"])
    allowed = _suite(pytester, "-p", "nodevice_plugin", "--attnx-backend", "nodevice", "--attnx-allow-unavailable")
    assert allowed.ret == 0
    assert allowed.parseoutcomes().get("skipped", 0) > 100 and "passed" not in allowed.parseoutcomes()
    allowed.stdout.fnmatch_lines(["*skipped: attnx backend 'nodevice' is unavailable: needs a frobnicator*"])


def test_a_backend_with_no_test_run_fails_the_session(pytester):
    result = _suite(pytester, "--attnx-backend", "numpy", "-k", "no_test_has_this_name")
    assert result.ret in (pytest.ExitCode.TESTS_FAILED, pytest.ExitCode.NO_TESTS_COLLECTED)
    result.stdout.fnmatch_lines(["*no test ran for backend 'numpy'*"])
    all_skipped = _suite(
        pytester, "--attnx-backend", "numpy", "-k", "test_explicit_backend_that_does_not_own_the_inputs"
    )
    # the anchor tests' module is skipped too where PyTorch is not installed
    assert "passed" not in all_skipped.parseoutcomes()
    all_skipped.stdout.fnmatch_lines(["scaled_dot_product_attention*1 skipped"])
    assert all_skipped.ret == pytest.ExitCode.TESTS_FAILED


def test_a_device_the_backend_does_not_list_is_one_error_before_any_test(pytester):
    result = pytester.run("attnx", "conformance", "numpy", "--device", "cuda:0")
    assert result.ret == 2
    assert result.errlines == [
        "attnx conformance: error: attnx backend 'numpy' has no device 'cuda:0'; its devices: cpu "
        "(see 'attnx conformance --help')"
    ]
    plain = _suite(pytester, "--attnx-backend", "numpy", "--attnx-device", "cuda:0")
    assert plain.ret == pytest.ExitCode.USAGE_ERROR and "failed" not in plain.stdout.str()


def test_the_suite_leaves_nothing_in_the_users_folder(tmp_path):
    """Nor in the temporary folder, where hypothesis kept what it learnt."""
    folder, temporary = tmp_path / "work", tmp_path / "tmp"
    for made in (folder, temporary):
        made.mkdir()
    command = ["attnx", "conformance", "numpy", "-k", "test_properties or test_scale_argument"]
    environment = {**os.environ, "TMPDIR": str(temporary)}
    result = subprocess.run(command, cwd=folder, env=environment, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "passed" in result.stdout
    assert list(folder.iterdir()) == [] and list(temporary.iterdir()) == []


# Owns NumPy arrays; declares no tracer and no vectorizing map; its native
# SDPA fails on every call.
FAILING_WITHOUT_TRACER = broken_plugin(
    "numpy_backend",
    "NumPyBackend",
    """
    def trace(self, function):
        return None

    def vectorize(self, function):
        return None

    def implementations(self):
        return {"scaled_dot_product_attention": self.sdpa}

    def sdpa(self, **kwargs):
        raise RuntimeError("the native is broken")
""",
)


def test_a_backend_without_transforms_gets_no_transforms_failures(pytester):
    """An unrelated failure (here the native SDPA) must not show again as
    failures of transforms the backend never declared: the transforms tests
    skip before they build any input (ndonnx, Cubed and sparse showed 20
    such failures each)."""
    pytester.makepyfile(broken_plugin=FAILING_WITHOUT_TRACER)
    result = pytester.runpytest_subprocess(
        "-p",
        "broken_plugin",
        "--pyargs",
        "attnx_conformance.test_transforms",
        "--attnx-backend",
        "broken",
        "-p",
        "no:cacheprovider",
        "-q",
    )
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) == 0, result.stdout.str()[-3000:]
    assert outcomes.get("skipped", 0) > 10
