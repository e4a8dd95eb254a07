"""The conformance suite catches a wrong backend, with a readable message."""

from __future__ import annotations

BROKEN = '''
import attnx
from attnx.attention import sdpa_generic
from attnx_backends.numpy_backend import NumPyBackend


class DropsTheScale(NumPyBackend):
    """Owns NumPy arrays under another name; its native SDPA forgets the scale."""

    name = "broken"

    def implementations(self):
        return {"scaled_dot_product_attention": self.sdpa}

    def sdpa(self, **kwargs):
        kwargs["scale"] = 1.0  # the bug
        return sdpa_generic(self.xp, **kwargs)


class Plugin:
    @attnx.hookimpl
    def attnx_backends(self):
        return [DropsTheScale()]


attnx.register_plugin(Plugin(), name="broken-plugin")
'''


def test_suite_fails_a_backend_that_drops_the_scale(pytester):
    pytester.makepyfile(broken_plugin=BROKEN)
    result = pytester.runpytest_subprocess(
        "-p",
        "broken_plugin",
        "--pyargs",
        "attnx_conformance.test_scaled_dot_product_attention",
        "--attnx-backend",
        "broken",
        "-p",
        "no:cacheprovider",
    )
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) >= 5, outcomes
    assert outcomes.get("passed", 0) >= 1, outcomes  # calls that decline to the native path still pass
    result.stdout.fnmatch_lines(["*attnx conformance, per operation*", "scaled_dot_product_attention * failed*"])
    result.stdout.fnmatch_lines(["*Not equal to tolerance*"])


def test_suite_runs_from_the_command_line_on_numpy(pytester):
    result = pytester.run("attnx", "conformance", "numpy", "-k", "test_masks_match_reference and causal")
    assert result.ret == 0
    result.stdout.fnmatch_lines(["scaled_dot_product_attention * passed*"])


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
