from __future__ import annotations

import subprocess
import sys
import warnings

import pytest

import attnx
from attnx._registry import Registry


def test_builtin_backends_are_listed_with_reasons():
    infos = {info.name: info for info in attnx.list_backends()}
    assert {"numpy", "torch", "cupy"} <= set(infos)
    assert infos["numpy"].available and infos["numpy"].distribution == "attnx"
    assert infos["numpy"].devices == ("cpu",)
    cupy = infos["cupy"]
    if not cupy.available:
        assert cupy.reason and ("cupy" in cupy.reason or "CUDA" in cupy.reason)


def test_import_attnx_and_numpy_calls_import_neither_torch_nor_cupy():
    code = (
        "import sys, attnx, numpy as np\n"
        "attnx.scaled_dot_product_attention(*[np.ones((2, 3))] * 3)\n"
        "print(sorted(m for m in ('torch', 'cupy') if m in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


def test_runtime_plugin_registers_and_unregisters(loopback):
    assert "loopback" in {info.name for info in attnx.list_backends()}
    attnx.unregister_plugin("loopback-plugin")
    assert "loopback" not in {info.name for info in attnx.list_backends()}
    attnx.register_plugin(type(sys)("dummy"), name="loopback-plugin")  # re-register for the fixture's teardown


class _Broken:
    @attnx.hookimpl
    def attnx_backends(self):
        raise ImportError("libfoo.so not found")


def test_a_failing_plugin_is_listed_and_warned_about_once(monkeypatch):
    monkeypatch.delenv("ATTNX_STRICT_PLUGINS", raising=False)
    registry = Registry(group="attnx.no-such-group")
    with pytest.warns(attnx.PluginWarning, match="libfoo"):
        registry.register_plugin(_Broken(), name="broken")
    rows = {info.name: info for info in registry.info()}
    assert not rows["broken"].available and "libfoo" in rows["broken"].reason
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        registry.info()  # no second warning


def test_strict_mode_raises(monkeypatch):
    monkeypatch.setenv("ATTNX_STRICT_PLUGINS", "1")
    registry = Registry(group="attnx.no-such-group")
    with pytest.raises(attnx.PluginError, match="libfoo"):
        registry.register_plugin(_Broken(), name="broken")


def _plugin(backend):
    class Plugin:
        @attnx.hookimpl
        def attnx_backends(self):
            return [backend]

    return Plugin()


def test_two_backends_with_one_name_are_a_reported_conflict(monkeypatch, loopback_class):
    monkeypatch.delenv("ATTNX_STRICT_PLUGINS", raising=False)
    LoopbackBackend = loopback_class
    registry = Registry(group="attnx.no-such-group")
    registry.register_plugin(_plugin(LoopbackBackend()), name="first")
    with pytest.warns(attnx.PluginWarning, match="claimed by more than one plugin"):
        registry.register_plugin(_plugin(LoopbackBackend()), name="second")
    with pytest.raises(attnx.BackendUnavailableError, match="'first'.*'second'"):
        registry.get("loopback")


def test_unknown_backend_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown attnx backend 'nope'.*'numpy'"):
        attnx.set_backend("nope")


def test_cli_backends_table():
    result = subprocess.run([sys.executable, "-m", "attnx.cli", "backends"], capture_output=True, text=True, check=True)
    header, _, *rows = result.stdout.splitlines()
    assert header.split()[:3] == ["backend", "available", "version"]
    assert any(row.startswith("numpy") and " yes " in row for row in rows)
    assert any(row.startswith("cupy") for row in rows)
