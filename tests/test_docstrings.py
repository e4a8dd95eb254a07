"""Each public operation's docstring is good enough to learn from: it says
its parameters, what it returns, what it raises and when, and shows an
example whose output doctest checks (``pytest --doctest-modules --pyargs
attnx``, in tox)."""

from __future__ import annotations

import inspect

import pytest

import attnx
from attnx import masks, mods

# For backend authors, documented on the extending pages; and the errors.
AUTHORS = {"Backend", "BackendInfo", "hookimpl", "plugin_manager", "register_plugin", "unregister_plugin"}
ERRORS = {"BackendUnavailableError", "PluginError", "PluginWarning"}
TYPES = {"Array", "DType", "Device"}  # the names the signatures use
# Nothing they can be given is wrong: no Raises to write.
RAISE_NOTHING = {"attnx.list_backends", "attnx.get_backend", "attnx.mods.causal", "attnx.BlockMask"}
# Return nothing, or are classes (their instances are what they make).
RETURN_NOTHING = {"attnx.set_backend", "attnx.set_memory_budget", "attnx.memory_budget", "attnx.use_backend"}


def _public():
    found = []
    for name in attnx.__all__:
        obj = getattr(attnx, name)
        if inspect.ismodule(obj) or name in AUTHORS | ERRORS | TYPES:
            continue
        found.append((f"attnx.{name}", obj))
    for module in (masks, mods):
        found += [(f"{module.__name__}.{name}", getattr(module, name)) for name in module.__all__]
    found += [(f"attnx.plot.{name}", getattr(attnx.plot, name)) for name in ("attention_heatmap", "block_mask")]
    return found


PUBLIC = _public()


def _sections(obj) -> set[str]:
    lines = (inspect.getdoc(obj) or "").splitlines()
    return {line for line, under in zip(lines, lines[1:]) if under and set(under) == {"-"} and len(under) == len(line)}


def test_the_public_names_are_all_here():
    assert len(PUBLIC) >= 40, len(PUBLIC)


@pytest.mark.parametrize(("name", "obj"), PUBLIC, ids=[name for name, _ in PUBLIC])
def test_docstring_has_every_section(name, obj):
    sections = _sections(obj)
    required = {"Examples"}
    takes = [p for p in inspect.signature(obj).parameters.values() if p.name != "self"]
    if takes and name not in {"attnx.BlockMask"}:  # made by create_block_mask, not by hand
        required.add("Parameters")
    if not inspect.isclass(obj) and name not in RETURN_NOTHING:
        required.add("Returns" if "Yields" not in sections else "Yields")
    if name not in RAISE_NOTHING:
        required.add("Raises")
    assert required <= sections, f"{name} lacks {sorted(required - sections)}"
    assert ">>> " in inspect.getdoc(obj), f"{name}'s Examples hold no doctest"


@pytest.mark.parametrize(("name", "obj"), PUBLIC, ids=[name for name, _ in PUBLIC])
def test_signature_types_arrays_by_name(name, obj):
    # `Array` reads as what it is; `Any` said nothing (help() showed `query: Any`)
    signature = inspect.signature(obj)
    anys = [
        p.name
        for p in signature.parameters.values()
        if p.annotation in ("Any", "Any | None") and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
    ]
    assert not anys, f"{name}: parameters typed Any: {anys}"
