"""The conformance suite catches a wrong backend, with a readable message."""

from __future__ import annotations

BROKEN = '''
import attnx
from attnx.attention import sdpa_generic


class DropsTheScale(attnx.Backend):
    """Owns NumPy arrays under another name; its native SDPA forgets the scale."""

    name = "broken"
    array_module = "numpy"

    def namespace(self):
        import array_api_compat.numpy
        return array_api_compat.numpy

    def asarray(self, obj, *, dtype=None, device=None):
        import numpy
        return numpy.asarray(obj, dtype=dtype)

    def to_numpy(self, array):
        return array

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
        "-p", "broken_plugin", "--pyargs", "attnx_conformance.test_scaled_dot_product_attention",
        "--attnx-backend", "broken", "-p", "no:cacheprovider",
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
