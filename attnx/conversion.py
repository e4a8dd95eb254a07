"""Moving arrays between backends, and listing them."""

from __future__ import annotations

from attnx import _checks, _dispatch
from attnx._registry import BackendInfo, registry
from attnx._typing import Array, Device, DType

__all__ = ["asarray", "list_backends", "to_numpy"]


def asarray(obj: Array, *, backend: str | None = None, dtype: DType = None, device: Device = None) -> Array:
    """Convert ``obj`` to an array of ``backend`` (default: the current one).

    Arrays of another backend go through NumPy on the host.  ``dtype`` is a
    name (``"float32"``) or any library's dtype object (``torch.float32``
    works for NumPy), read by its name.

    Parameters
    ----------
    obj : array or array-like
        An array of any registered backend, a NumPy array, a Python scalar or
        nested sequence.
    backend : str, optional
        The backend to convert to; the current one by default.
    dtype : dtype or str, optional
        The result's dtype; ``obj``'s by default.
    device : optional
        A device of ``backend``, by name (``"cuda:0"``, ``"cpu"``) or the
        library's own object.

    Returns
    -------
    array
        An array of ``backend``.

    Raises
    ------
    TypeError
        If ``dtype`` is not a dtype of the backend, or ``obj`` cannot be
        converted.
    ValueError
        If ``backend`` names no registered backend, or ``device`` is not one
        of its devices.
    BackendUnavailableError
        If the backend cannot run here.

    Examples
    --------
    >>> import attnx, numpy as np
    >>> attnx.asarray([1.0, 2.0], backend="numpy", dtype="float32")
    array([1., 2.], dtype=float32)

    Between backends:

    >>> import numpy as np
    >>> import attnx
    >>> x = attnx.asarray(np.ones((2, 3)), backend="torch", dtype="float32")
    >>> type(x).__module__, tuple(x.shape), str(x.dtype)
    ('torch', (2, 3), 'torch.float32')
    >>> type(attnx.to_numpy(x)).__name__
    'ndarray'
    """
    target, _, device = _dispatch.resolve_creation("asarray", backend, device)
    if dtype is not None:
        dtype = _checks.require_dtype_name("asarray", target.xp, target.name, dtype)
    owner = registry.owner_of(obj) if not isinstance(obj, (list, tuple, int, float, bool)) else None
    if owner is not None and owner is not target:
        obj = owner.to_numpy(obj)
    return target.asarray(obj, dtype=dtype, device=device)


def to_numpy(array: Array) -> Array:
    """Copy an array of any registered backend to a NumPy array.

    Parameters
    ----------
    array : array
        An array of any registered backend (on any device: copied to the host).

    Returns
    -------
    numpy.ndarray

    Raises
    ------
    TypeError
        If ``array`` is not an array of a registered backend.

    Examples
    --------
    >>> import numpy as np
    >>> import attnx
    >>> attnx.to_numpy(attnx.masks.causal(2, backend="numpy"))
    array([[ True, False],
           [ True,  True]])
    >>> attnx.to_numpy([1.0])
    Traceback (most recent call last):
        ...
    TypeError: to_numpy: expected an array of a registered backend, got list
    """
    owner = registry.owner_of(array)
    if owner is None:
        raise TypeError(f"to_numpy: expected an array of a registered backend, got {type(array).__name__}")
    return owner.to_numpy(array)


def list_backends() -> list[BackendInfo]:
    """One record per registered backend: name, available, reason, version,
    devices and the distribution that registered it.

    Returns
    -------
    list of BackendInfo
        Sorted by name, unavailable backends included with their reason.

    Examples
    --------
    >>> import attnx
    >>> [info.name for info in attnx.list_backends() if info.name in ("numpy", "torch", "jax", "cupy", "dask")]
    ['cupy', 'dask', 'jax', 'numpy', 'torch']
    >>> numpy_backend = next(info for info in attnx.list_backends() if info.name == "numpy")
    >>> numpy_backend.available, numpy_backend.devices
    (True, ('cpu',))
    """
    return registry.info()
