from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

import attnx
from attnx_backends.numpy_backend import NumPyBackend

pytest_plugins = ["pytester"]

#: The example third-party package (tox -e strict installs it and runs the conformance suite on it).
ARRAY_API_STRICT_EXAMPLE = Path(__file__).parents[1] / "examples" / "attnx-array-api-strict"


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
def register_backend():
    """``register_backend(backend, name)``: ``backend`` registered with attnx
    as a plugin of its own called ``name``, unregistered after the test."""
    names = []

    def register(backend, name):
        class Plugin:
            @attnx.hookimpl
            def attnx_backends(self):
                return [backend]

        names.append(attnx.register_plugin(Plugin(), name=name))
        return backend

    yield register
    for name in reversed(names):
        attnx.unregister_plugin(name)


@pytest.fixture
def loopback(register_backend):
    return register_backend(LoopbackBackend(), "loopback-plugin")


@pytest.fixture
def array_api_strict_backend():
    """The example backend for array-api-strict, registered as its entry
    point registers it where it is installed: its ``device1`` refuses arrays
    of the default device, so a device that was not passed on shows."""
    if "array_api_strict" in {info.name for info in attnx.list_backends()}:  # installed: its entry point did it
        yield attnx._registry.get("array_api_strict")
        return
    sys.path.insert(0, str(ARRAY_API_STRICT_EXAMPLE))
    try:
        plugin = importlib.import_module("attnx_array_api_strict")
    finally:
        sys.path.remove(str(ARRAY_API_STRICT_EXAMPLE))
    name = attnx.register_plugin(plugin, name="attnx-array-api-strict")
    yield attnx._registry.get("array_api_strict")
    attnx.unregister_plugin(name)
