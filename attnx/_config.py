"""The current backend: for operations that create arrays from nothing."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

from attnx import _checks
from attnx._registry import registry
from attnx._tracing import run_at_trace_time
from attnx._typing import Device
from attnx.backend import Backend

#: Environment variable naming the default backend.
BACKEND_ENV = "ATTNX_BACKEND"
DEFAULT_BACKEND = "numpy"

_context_backend: ContextVar[str | None] = ContextVar("attnx_backend", default=None)
_process_backend: str | None = None


def set_backend(name: str | None) -> None:
    """Set the process-wide current backend (``None`` restores the default).

    :func:`use_backend` blocks take precedence over it.

    Parameters
    ----------
    name : str or None
        A registered backend, or None.

    Raises
    ------
    ValueError
        If ``name`` is not a registered backend.
    TypeError
        If ``name`` is neither a string nor None.

    Examples
    --------
    >>> import attnx
    >>> attnx.set_backend("numpy")
    >>> attnx.get_backend()
    'numpy'
    >>> attnx.set_backend(None)   # back to $ATTNX_BACKEND, else numpy
    """
    global _process_backend
    if name is not None:
        registry.get(name)  # fail now, with the reason, rather than at the next call
    _process_backend = name


@contextmanager
def use_backend(name: str) -> Iterator[Backend]:
    """Make ``name`` the current backend inside a ``with`` block.

    Backed by :mod:`contextvars`, so it is local to the thread or async task.

    Parameters
    ----------
    name : str
        A registered backend.

    Yields
    ------
    Backend
        The backend, current inside the block.

    Raises
    ------
    ValueError
        If ``name`` is not a registered backend.

    Examples
    --------
    >>> import attnx
    >>> with attnx.use_backend("numpy"):
    ...     attnx.masks.causal(2).shape
    (2, 2)
    """
    backend = registry.get(name)
    token = _context_backend.set(name)
    try:
        yield backend
    finally:
        _context_backend.reset(token)


#: Default memory budget for an attention's score matrix, in bytes, on the
#: CPU backends (:attr:`attnx.Backend.block_bytes`: a GPU backend's is larger).
DEFAULT_MEMORY_BUDGET = Backend.block_bytes
_context_budget: ContextVar[int | None] = ContextVar("attnx_memory_budget", default=None)
_process_budget: int | None = None


def set_memory_budget(nbytes: int | None) -> None:
    """Set the process-wide memory budget for score matrices.

    ``None`` restores the default: each backend's
    :attr:`~attnx.Backend.block_bytes`, 4 MiB on the CPU backends, past
    which the chunked algorithm is also the faster one (its blocks stay in
    cache), and 512 MiB on CuPy.

    Attention whose ``(..., n, m)`` scores would exceed it switches to the
    chunked, memory-efficient algorithm.

    Parameters
    ----------
    nbytes : int or None
        The bytes of scores one block may hold, or None for the default.

    Raises
    ------
    TypeError
        If ``nbytes`` is neither an integer nor None.
    ValueError
        If ``nbytes`` is not positive.

    Examples
    --------
    >>> import attnx
    >>> attnx.set_memory_budget(64 * 2**20)
    >>> attnx.get_memory_budget("numpy") // 2**20
    64
    >>> attnx.set_memory_budget(None)
    >>> attnx.get_memory_budget("numpy") // 2**20
    4
    """
    global _process_budget
    _process_budget = _budget("set_memory_budget", nbytes) if nbytes is not None else None


@contextmanager
def memory_budget(nbytes: int) -> Iterator[None]:
    """The memory budget for score matrices inside a ``with`` block.

    Local to the thread or async task, as :func:`use_backend`; it takes
    precedence over :func:`set_memory_budget`.

    Parameters
    ----------
    nbytes : int
        The bytes of scores one block may hold.

    Raises
    ------
    TypeError
        If ``nbytes`` is not an integer.
    ValueError
        If ``nbytes`` is not positive.

    Examples
    --------
    >>> import attnx
    >>> with attnx.memory_budget(2**20):
    ...     attnx.get_memory_budget("numpy")
    1048576
    >>> attnx.get_memory_budget("numpy")
    4194304
    """
    token = _context_budget.set(_budget("memory_budget", nbytes))
    try:
        yield
    finally:
        _context_budget.reset(token)


@run_at_trace_time
def user_memory_budget() -> int | None:
    """The memory budget the user set (:func:`memory_budget` block, else
    :func:`set_memory_budget`), or None."""
    return _context_budget.get() or _process_budget


def get_memory_budget(backend: str | Backend | None = None, device: Device = None) -> int:
    """The memory budget in force, in bytes: the one set with
    :func:`memory_budget` or :func:`set_memory_budget`, else the default of
    ``backend`` (a name or a :class:`Backend`; the current backend when
    None) for arrays on ``device``: its
    :meth:`~attnx.Backend.block_bytes_on` (512 MiB for CuPy, PyTorch's CUDA
    tensors and JAX's GPU arrays outside jit, 4 MiB on the CPU).

    Parameters
    ----------
    backend : str or Backend, optional
    device : optional
        A device of the backend, or None for its default.

    Returns
    -------
    int

    Raises
    ------
    ValueError
        If ``backend`` names no registered backend.

    Examples
    --------
    >>> import attnx
    >>> attnx.get_memory_budget("numpy") // 2**20
    4
    """
    budget = user_memory_budget()
    if budget is not None:
        return budget
    chosen = current_backend()[0] if backend is None else registry.get(backend) if isinstance(backend, str) else backend
    return chosen.block_bytes_on(device)


def _budget(operation: str, nbytes: int) -> int:
    nbytes = _checks.require_int(operation, "the memory budget (nbytes)", nbytes)  # NumPy's integers too
    if nbytes <= 0:
        raise ValueError(f"{operation}: the memory budget must be a positive number of bytes, got {nbytes}")
    return nbytes


@run_at_trace_time
def chosen_backend_name() -> tuple[str | None, str]:
    """The backend the user chose (not the default), and how."""
    name = _context_backend.get()
    if name is not None:
        return name, "use_backend() block"
    if _process_backend is not None:
        return _process_backend, "set_backend()"
    return os.environ.get(BACKEND_ENV) or None, f"${BACKEND_ENV}"


def current_backend() -> tuple[Backend, str]:
    """The current backend and why it is current."""
    name = _context_backend.get()
    if name is not None:
        return registry.get(name), "use_backend() block"
    if _process_backend is not None:
        return registry.get(_process_backend), "set_backend()"
    name = os.environ.get(BACKEND_ENV)
    if name:
        try:
            return registry.get(name), f"${BACKEND_ENV}"
        except (ValueError, RuntimeError) as exc:
            raise type(exc)(f"{exc} (from the environment variable {BACKEND_ENV})") from None
    return registry.get(DEFAULT_BACKEND), "default"


def get_backend() -> str:
    """Name of the current backend.

    The one a :func:`use_backend` block made current, else the one
    :func:`set_backend` set, else ``$ATTNX_BACKEND``, else ``"numpy"``.

    Returns
    -------
    str

    Examples
    --------
    >>> import attnx
    >>> attnx.get_backend()
    'numpy'
    >>> with attnx.use_backend("torch"):
    ...     attnx.get_backend()
    'torch'
    """
    return current_backend()[0].name
