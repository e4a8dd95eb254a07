from __future__ import annotations

import pytest

import attnx
from attnx_backends.numpy_backend import NumPyBackend

pytest_plugins = ["pytester"]


class LoopbackBackend(NumPyBackend):
    """Owns NumPy arrays too (registered after numpy), with a native SDPA that
    records its calls and declines when asked for weights."""

    name = "loopback"

    def __init__(self):
        self.calls = []

    def implementations(self):
        return {"scaled_dot_product_attention": self._sdpa}

    def _sdpa(self, **kwargs):
        self.calls.append(kwargs)
        if kwargs["return_weights"]:
            return NotImplemented
        from attnx.attention import sdpa_generic

        return sdpa_generic(self.xp, **kwargs)


@pytest.fixture
def loopback_class():
    return LoopbackBackend


@pytest.fixture
def loopback():
    backend = LoopbackBackend()

    class Plugin:
        @attnx.hookimpl
        def attnx_backends(self):
            return [backend]

    name = attnx.register_plugin(Plugin(), name="loopback-plugin")
    yield backend
    attnx.unregister_plugin(name)
