"""The Dask backend's array namespace: array-api-compat's, with creation
functions that make chunks of the kind ``device=`` names.

For attnx a Dask array's device is the kind of its chunks: ``"cpu"`` for
NumPy's, :class:`Chunks` for any other (CuPy's, on GPU workers).  attnx's
algorithms make every array with the ``device=`` of the arrays it goes with,
so what they make holds the chunks of their inputs; Dask's own ``arange``,
``zeros`` and the like make NumPy chunks, which CuPy refuses.
"""

from __future__ import annotations

from typing import Any

import array_api_compat.dask.array as _compat
import dask.array as _da
import numpy as _np
from array_api_compat import array_namespace as _array_namespace
from array_api_compat.dask.array import *  # noqa: F403
from array_api_compat.dask.array import __array_api_version__, __array_namespace_info__  # noqa: F401
from dask.base import tokenize as _tokenize

__all__ = [*_compat.__all__, "Chunks", "device", "rechunk"]


class Chunks:
    """The device of a Dask array whose chunks are not NumPy arrays: an
    empty chunk of their kind (``meta``), equal for every array of it."""

    def __init__(self, meta: Any) -> None:
        self.meta = meta

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Chunks) and type(other.meta) is type(self.meta)

    def __hash__(self) -> int:
        return hash(type(self.meta))

    def __repr__(self) -> str:
        kind = type(self.meta)
        return f"Chunks({kind.__module__}.{kind.__name__})"

    def __str__(self) -> str:
        """The chunks' library, as ``attnx backends`` lists the device: ``"cupy"``."""
        return type(self.meta).__module__.partition(".")[0]


def device(array: Any) -> Any:
    """``"cpu"`` for an array of NumPy chunks, else its :class:`Chunks`."""
    kind = Chunks(_da.utils.meta_from_array(array))
    return "cpu" if str(kind) == "numpy" else kind


def _of_kind(device: Any, dtype: Any, default: Any, kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """``device`` and ``dtype`` for array-api-compat, a :class:`Chunks`
    device moved to ``meta=`` in ``kwargs``: Dask then makes chunks like the
    meta, of the meta's dtype unless told, so the dtype is always told."""
    if not isinstance(device, Chunks):
        return device, dtype
    dtype = default if dtype is None else dtype
    kwargs["meta"] = _da.utils.meta_from_array(device.meta, dtype=dtype)
    return None, dtype


def arange(
    start: Any, /, stop: Any = None, step: Any = 1, *, dtype: Any = None, device: Any = None, **kwargs: Any
) -> Any:
    if not isinstance(device, Chunks):
        return _compat.arange(start, stop, step, dtype=dtype, device=device, **kwargs)
    # Moved chunk by chunk, not made with ``like=``: Dask names an arange by
    # its numbers alone (2026.8), so one of CuPy chunks and one of NumPy's
    # would share a name, and one set of chunks, in a graph holding both.
    numbers = _compat.arange(start, stop, step, dtype=dtype, **kwargs)
    meta = _da.utils.meta_from_array(device.meta, ndim=1, dtype=numbers.dtype)
    return numbers.map_blocks(_array_namespace(device.meta).asarray, dtype=numbers.dtype, meta=meta)


def zeros(shape: Any, *, dtype: Any = None, device: Any = None, **kwargs: Any) -> Any:
    device, dtype = _of_kind(device, dtype, _compat.float64, kwargs)
    return _compat.zeros(shape, dtype=dtype, device=device, **kwargs)


def ones(shape: Any, *, dtype: Any = None, device: Any = None, **kwargs: Any) -> Any:
    device, dtype = _of_kind(device, dtype, _compat.float64, kwargs)
    return _compat.ones(shape, dtype=dtype, device=device, **kwargs)


def empty(shape: Any, *, dtype: Any = None, device: Any = None, **kwargs: Any) -> Any:
    device, dtype = _of_kind(device, dtype, _compat.float64, kwargs)
    return _compat.empty(shape, dtype=dtype, device=device, **kwargs)


def full(shape: Any, fill_value: Any, *, dtype: Any = None, device: Any = None, **kwargs: Any) -> Any:
    # The array API's dtype of a Python fill value: bool, int64 or float64.
    device, dtype = _of_kind(device, dtype, _np.asarray(fill_value).dtype, kwargs)
    return _compat.full(shape, fill_value, dtype=dtype, device=device, **kwargs)


def clip(x: Any, /, min: Any = None, max: Any = None) -> Any:
    # Dask's own elementwise clip keeps the chunks' kind; array-api-compat's
    # makes its bounds as NumPy chunks.
    return x if min is None and max is None else _da.clip(x, min, max)


def asarray(obj: Any, /, *, dtype: Any = None, device: Any = None, copy: Any = None, **kwargs: Any) -> Any:
    if isinstance(device, Chunks) and not isinstance(obj, _da.Array):
        # A value of the chunks' own library, in one chunk, named by its
        # kind too (an equal NumPy value must not share its name).
        value = _array_namespace(device.meta).asarray(obj, dtype=dtype)
        name = f"asarray-{type(value).__module__}-{_tokenize(obj, dtype)}"
        return _da.from_array(value, asarray=False, name=name)
    return _compat.asarray(obj, dtype=dtype, device=device, copy=copy, **kwargs)


def rechunk(array: Any, chunks: Any) -> Any:
    """``array.rechunk(chunks)``, in chunks of the array's own kind where it
    is empty: Dask (2026.8) remakes an empty array's chunks with NumPy's
    ``empty``, which CuPy chunks beside them refuse."""
    rechunked = array.rechunk(chunks)
    if 0 not in array.shape or rechunked.chunks == array.chunks:
        return rechunked
    return empty(array.shape, dtype=array.dtype, device=device(array), chunks=rechunked.chunks)
