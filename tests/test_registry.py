from __future__ import annotations

import subprocess
import sys
import warnings

import pytest

import attnx
from attnx._registry import Registry, _Entry


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


def test_two_backends_with_one_name_the_first_wins_and_the_message_says_why(monkeypatch, loopback_class):
    monkeypatch.delenv("ATTNX_STRICT_PLUGINS", raising=False)
    LoopbackBackend = loopback_class
    registry = Registry(group="attnx.no-such-group")
    first, second = LoopbackBackend(), LoopbackBackend()
    registry.register_plugin(_plugin(first), name="first")
    with pytest.warns(attnx.PluginWarning) as warned:
        registry.register_plugin(_plugin(second), name="second")
    (message,) = [str(w.message) for w in warned]
    assert "plugin 'first' from no distribution is used" in message
    assert "plugin 'second' from no distribution is ignored, because it was registered first" in message
    assert registry.get("loopback") is first
    rows = [info for info in registry.info() if info.name == "loopback"]
    assert [row.available for row in rows] == [True, False] and "ignored" in rows[1].reason


def test_attnx_s_own_backend_wins_a_conflict_and_says_so(monkeypatch, loopback_class):
    monkeypatch.delenv("ATTNX_STRICT_PLUGINS", raising=False)
    registry = Registry(group="attnx.no-such-group")
    registry._ensure_loaded()
    ours, theirs = loopback_class(), loopback_class()
    registry._add_backend(_Entry(ours, "numpy", "".join(["att", "nx"])))  # as metadata reads it: not interned
    with pytest.warns(attnx.PluginWarning, match="from attnx is used.*from otherdist is ignored, because attnx's own"):
        registry._add_backend(_Entry(theirs, "their-numpy", "otherdist"))
    assert registry.get("loopback") is ours


def test_a_backend_whose_namespace_fails_to_import_is_listed_unavailable_with_the_error(loopback_class):
    class Hollow(loopback_class):
        name = "hollow"

        def namespace(self):
            raise ImportError("libhollow.so: cannot open shared object file")

    registry = Registry(group="attnx.no-such-group")
    registry.register_plugin(_plugin(Hollow()), name="hollow-plugin")
    (row,) = [info for info in registry.info() if info.name == "hollow"]
    assert not row.available and "libhollow.so" in row.reason
    with pytest.raises(attnx.BackendUnavailableError, match="hollow.*libhollow.so"):
        registry.get("hollow")


def test_unknown_backend_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown attnx backend 'nope'.*'numpy'"):
        attnx.set_backend("nope")


@pytest.mark.parametrize("name", [3, ["numpy"], b"numpy"])
def test_a_backend_is_named_by_a_str(name):
    with pytest.raises(TypeError, match="an attnx backend is named by a str"):
        attnx.set_backend(name)
    with pytest.raises(TypeError, match="an attnx backend is named by a str"):
        attnx.masks.causal(2, backend=name)


def test_cli_backends_table():
    result = subprocess.run([sys.executable, "-m", "attnx.cli", "backends"], capture_output=True, text=True, check=True)
    header, _, *rows = result.stdout.splitlines()
    assert header.split()[:3] == ["backend", "available", "version"]
    assert any(row.startswith("numpy") and " yes " in row for row in rows)
    assert any(row.startswith("cupy") for row in rows)


def test_an_entry_point_whose_module_raises_on_import_is_listed_not_fatal(monkeypatch, tmp_path):
    from importlib.metadata import EntryPoint

    registry_module = sys.modules["attnx._registry"]  # attnx._registry is the registry object

    (tmp_path / "attnx_test_raises_on_import.py").write_text("raise RuntimeError('no frobnicator on this machine')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("ATTNX_STRICT_PLUGINS", raising=False)
    found = [EntryPoint("frob", "attnx_test_raises_on_import", "attnx.test-group")]
    monkeypatch.setattr(registry_module, "entry_points", lambda group: found if group == "attnx.test-group" else [])
    registry = Registry(group="attnx.test-group")
    with pytest.warns(attnx.PluginWarning, match="no frobnicator"):
        rows = registry.info()
    (row,) = rows
    assert row.name == "frob" and not row.available and "no frobnicator on this machine" in row.reason
    monkeypatch.setenv("ATTNX_STRICT_PLUGINS", "1")
    with pytest.raises(attnx.PluginError, match="no frobnicator"):
        Registry(group="attnx.test-group").info()


class _EntryPoint:
    """An entry point of an installed distribution, as importlib.metadata
    lists them: its name, its distribution's, and the plugin it loads."""

    def __init__(self, name, plugin, distribution):
        self.name, self.value, self._plugin = name, f"{distribution.replace('-', '_')}:plugin", plugin
        self.dist = type(sys)("dist")
        self.dist.name = distribution

    def load(self):
        return self._plugin


def test_plugins_load_in_order_of_their_distribution_s_name(monkeypatch, loopback_class):
    """Two distributions claim one backend name: the first by distribution
    name wins, whatever their entry points are called, and the message says so."""
    monkeypatch.delenv("ATTNX_STRICT_PLUGINS", raising=False)
    registry_module = sys.modules["attnx._registry"]  # attnx._registry is the registry object
    first, second = loopback_class(), loopback_class()
    found = [
        _EntryPoint("a-plugin", _plugin(second), "zeta-dist"),
        _EntryPoint("z-plugin", _plugin(first), "alpha-dist"),
    ]
    monkeypatch.setattr(registry_module, "entry_points", lambda group: found if group == "attnx.test-group" else [])
    registry = Registry(group="attnx.test-group")
    with pytest.warns(attnx.PluginWarning) as warned:
        assert registry.get("loopback") is first
    (message,) = [str(w.message) for w in warned]
    assert (
        "plugin 'z-plugin' from alpha-dist is used and plugin 'a-plugin' from zeta-dist is ignored, "
        "because plugins are loaded in order of their distribution's name and the first claim wins"
    ) in message


def _declines(self):
    return "no frobnicator on this machine"


def _fails_to_tell(self):
    raise OSError("the frobnicator's driver did not answer")


@pytest.mark.parametrize(
    ("check", "reason"),
    [(_declines, "no frobnicator on this machine"), (_fails_to_tell, "availability check failed: OSError")],
)
def test_a_backend_s_own_word_on_its_availability_is_listed(loopback_class, check, reason):
    """A backend whose namespace imports may still say it can't run here,
    or fail to tell (which must not break attnx): listed unavailable, with
    the reason, and refused by name."""

    class Declining(loopback_class):
        name = "declining"
        unavailable_reason = check

    registry = Registry(group="attnx.no-such-group")
    registry.register_plugin(_plugin(Declining()), name="declining-plugin")
    (row,) = [info for info in registry.info() if info.name == "declining"]
    assert not row.available and row.reason.startswith(reason)
    with pytest.raises(attnx.BackendUnavailableError, match=f"'declining' is unavailable: {reason}"):
        registry.get("declining")


def test_unregistering_a_plugin_takes_its_rows_alone(monkeypatch, loopback_class):
    """A plugin unregistered leaves the list with its failure or its ignored
    claim, and nothing of the others'."""
    monkeypatch.delenv("ATTNX_STRICT_PLUGINS", raising=False)
    registry = Registry(group="attnx.no-such-group")
    with pytest.warns(attnx.PluginWarning):
        registry.register_plugin(_Broken(), name="broken")
    registry.register_plugin(_plugin(loopback_class()), name="first")
    with pytest.warns(attnx.PluginWarning):
        registry.register_plugin(_plugin(loopback_class()), name="second")

    def rows():
        return sorted((info.name, info.available) for info in registry.info())

    assert rows() == [("broken", False), ("loopback", False), ("loopback", True)]
    registry.unregister_plugin("".join(["sec", "ond"]))  # a name equal to the registered one, not the same object
    assert rows() == [("broken", False), ("loopback", True)]
    registry.unregister_plugin("first")
    assert rows() == [("broken", False)]
    registry.unregister_plugin("broken")
    assert rows() == []


def test_a_backend_that_says_nothing_of_threads_runs_its_blocks_one_at_a_time():
    """The base class's contract with a third party's backend: ``map_blocks``
    runs the blocks in order on the calling thread, and ``concurrent_blocks``
    says so, so that the planner gives each block the whole budget."""
    import threading

    class Plain(attnx.Backend):
        name = "plain"

    threads = []

    def double(item):
        threads.append(threading.get_ident())
        return 2 * item

    plain = Plain()
    assert plain.map_blocks(double, [1, 2, 3]) == [2, 4, 6]
    assert threads == [threading.get_ident()] * 3
    assert plain.concurrent_blocks == 1
