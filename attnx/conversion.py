"""Moving arrays between backends, and listing them."""

from __future__ import annotations

from typing import Any

from attnx import _checks, _dispatch
from attnx._registry import BackendInfo, registry

__all__ = ["asarray", "list_backends", "to_numpy"]


def asarray(obj: Any, *, backend: str | None = None, dtype: Any = None, device: Any = None) -> Any:
    """Convert ``obj`` to an array of ``backend`` (default: the current one).

    Arrays of another backend go through NumPy on the host.  ``dtype`` is a
    name (``"float32"``) or any library's dtype object (``torch.float32``
    works for NumPy), read by its name.

    Examples
    --------
    >>> import attnx, numpy as np
    >>> attnx.asarray([1.0, 2.0], backend="numpy", dtype="float32")
    array([1., 2.], dtype=float32)
    """
    target, _, device = _dispatch.resolve_creation("asarray", backend, device)
    if dtype is not None:
        dtype = _checks.require_dtype_name("asarray", target.xp, target.name, dtype)
    owner = registry.owner_of(obj) if not isinstance(obj, (list, tuple, int, float, bool)) else None
    if owner is not None and owner is not target:
        obj = owner.to_numpy(obj)
    return target.asarray(obj, dtype=dtype, device=device)


def to_numpy(array: Any) -> Any:
    """Copy an array of any registered backend to a NumPy array."""
    owner = registry.owner_of(array)
    if owner is None:
        raise TypeError(f"to_numpy: expected an array of a registered backend, got {type(array).__name__}")
    return owner.to_numpy(array)


def list_backends() -> list[BackendInfo]:
    """One record per registered backend: name, available, reason, version,
    devices and the distribution that registered it."""
    return registry.info()
