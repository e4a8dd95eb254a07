"""What attnx asks of a backend's array namespace, checked in seconds.

``attnx conformance NAME --coverage`` lists, before any test runs, each
function of the standard that attnx's algorithms call (read from attnx's
own source, so the list follows the code), each operator they use on the
arrays themselves (a namespace adapter cannot change those), and the
arguments and behaviours they rely on, with what the backend's namespace
does with each: there, missing, or refused with the library's error.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

#: Modules of attnx that are not algorithms: they call no namespace.
_NOT_ALGORITHMS = {"cli.py", "benchmark.py", "plot.py", "__init__.py"}

#: The operators attnx applies to arrays (so the array type, not the namespace, must have them).
OPERATORS = {
    "a @ b": "__matmul__",
    "a + b": "__add__",
    "a - b": "__sub__",
    "a * b": "__mul__",
    "a / b": "__truediv__",
    "-a": "__neg__",
    "a & b": "__and__",
    "a | b": "__or__",
    "~a": "__invert__",
    "a < b, a <= b, ...": "__lt__",
    "a == b": "__eq__",
    "a[...]": "__getitem__",
}


def namespace_functions() -> list[str]:
    """The names attnx's algorithms take from a namespace (``xp.NAME``)."""
    import attnx

    names: set[str] = set()
    for path in Path(attnx.__file__).parent.glob("*.py"):
        if path.name in _NOT_ALGORITHMS:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "xp":
                names.add(node.attr)
    return sorted(names)


def _probes() -> list[tuple[str, Callable[[Any, Any], Any]]]:
    """Arguments and behaviours attnx relies on, each tried on a small array."""
    return [
        ("concat along a negative axis", lambda xp, x: xp.concat([x, x], axis=-1)),
        ("clip with one bound (2023.12)", lambda xp, x: xp.clip(x, min=0.0)),
        ("cumulative_sum along a negative axis", lambda xp, x: xp.cumulative_sum(x, axis=-1)),
        ("searchsorted", lambda xp, x: xp.searchsorted(xp.asarray([0.0, 1.0, 2.0], dtype=x.dtype), x[0, :])),
        ("take along a negative axis", lambda xp, x: xp.take(x, xp.asarray([0, 1]), axis=-1)),
        ("max with keepdims", lambda xp, x: xp.max(x, axis=-1, keepdims=True)),
        ("where with arrays", lambda xp, x: xp.where(x > 0, x, -x)),
        ("indexing by an integer array (a mod's slopes[h])", lambda xp, x: xp.reshape(x, (-1,))[xp.asarray([1, 0])]),
        ("moveaxis", lambda xp, x: xp.moveaxis(x, 0, -1)),
        ("broadcast_to", lambda xp, x: xp.broadcast_to(x[None, ...], (2, *x.shape))),
        ("__array_namespace_info__().dtypes() with no argument", lambda xp, x: xp.__array_namespace_info__().dtypes()),
    ]


def rows(backend: Any) -> list[tuple[str, str, str]]:
    """``(what, kind, status)`` for everything attnx asks of ``backend``."""
    xp = backend.xp
    found: list[tuple[str, str, str]] = []
    for name in namespace_functions():
        found.append((f"xp.{name}", "function", "ok" if hasattr(xp, name) else "missing"))
    sample = backend.asarray(np.arange(6, dtype=np.float32).reshape(2, 3) - 2.0, dtype="float32")
    for what, method in OPERATORS.items():
        found.append((what, "operator", "ok" if hasattr(sample, method) else f"missing ({method})"))
    for what, probe in _probes():
        try:
            probe(xp, sample)
            status = "ok"
        except Exception as exc:  # the library's own refusal, whatever its type
            status = f"refused: {type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''}"
        found.append((what, "argument", status))
    found += _declarations(backend)
    return found


def _declarations(backend: Any) -> list[tuple[str, str, str]]:
    """What the backend declares, against what its library says."""
    found = []
    try:
        offered = set(backend.xp.__array_namespace_info__().dtypes())
    except Exception:
        offered = None
    if offered is not None:
        standard = {"float32", "float64"}
        extra = sorted(set(backend.float_dtypes) & standard - offered)
        found.append(
            (
                "float_dtypes agree with dtypes()",
                "declaration",
                "ok" if not extra else f"declares {', '.join(extra)}, which dtypes() does not offer",
            )
        )
    unnamed = [str(device) for device in backend.devices() if " at 0x" in str(device)]
    found.append(
        (
            "devices() print as names",
            "declaration",
            "ok" if not unnamed else f"{unnamed[0]} prints as an object, so --device cannot name it",
        )
    )
    return found


def report(backend: Any) -> tuple[str, bool]:
    """The table as text, and whether everything was there."""
    from attnx._table import format_table

    table = rows(backend)
    problems = [row for row in table if row[2] != "ok"]
    text = format_table(("what attnx uses", "kind", backend.name), table)
    summary = f"\n{len(table) - len(problems)} of {len(table)} there" + (
        f"; {len(problems)} missing or refused: the operations that use them will fail" if problems else ""
    )
    return text + summary, not problems
