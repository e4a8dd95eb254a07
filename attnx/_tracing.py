"""Marks for tracers that run Python (``torch.compile``'s dynamo).

attnx's calls do some bookkeeping in plain Python before any array work:
loading the plugins, reading the configuration (the memory budget, the
backend chosen with :func:`attnx.use_backend`).  Its results depend on attnx's
own state, never on array values, so a compiler may run it once while
tracing and treat its result as a constant; dynamo could not trace it anyway
(locks, entry points, :mod:`contextvars`).  JAX's tracers run Python as
usual and need no mark.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TypeVar

Function = TypeVar("Function", bound=Callable[..., object])

#: The attribute ``torch.compiler.assume_constant_result`` sets: set here
#: without importing torch (``tests/test_tracing.py`` checks it is the same).
DYNAMO_CONSTANT_MARK = "_dynamo_marked_constant"


def run_at_trace_time(function: Function) -> Function:
    """Mark ``function`` to be called, not traced, by ``torch.compile``: its
    result (attnx's state, no arrays) becomes a constant of the compiled graph.
    A change of that state after compiling (a new memory budget) is seen
    only by a new compilation."""
    setattr(function, DYNAMO_CONSTANT_MARK, True)
    return function


def compiling() -> bool:
    """Whether ``torch.compile``'s dynamo is tracing the caller (False where
    PyTorch isn't loaded: it is looked up, never imported).  For state that a
    compiled graph must not depend on: dynamo guards on what traced code
    reads, and a store that grows with every new call (attnx's plans) would
    make it compile again after each."""
    global _is_compiling
    if _is_compiling is None:  # until PyTorch is loaded, nothing can be compiling
        torch = sys.modules.get("torch")
        if torch is None:
            return False
        _is_compiling = torch.compiler.is_compiling
    return _is_compiling()


_is_compiling: Callable[[], bool] | None = None
