"""Argument checks shared by every operation: one home for each rule.

Every check runs before any computation and raises the exception users
expect (``ValueError`` for shapes and values, ``TypeError`` for types),
naming the operation, the argument, what was expected and what came.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

import array_api_compat

#: The device an array lives on, for any array API library.
device_of = array_api_compat.device


def shape_of(array: Any) -> tuple[int, ...]:
    return tuple(array.shape)


def dtype_label(dtype: Any) -> str:
    """``"float32"`` for every library's float32 (not ``torch.float32``)."""
    return str(dtype).rpartition(".")[2]


def dtype_name(array: Any) -> str:
    """The :func:`dtype_label` of an array's dtype."""
    return dtype_label(array.dtype)


def require_ndim(operation: str, name: str, array: Any, min_ndim: int, layout: str) -> None:
    if array.ndim < min_ndim:
        raise ValueError(
            f"{operation}: {name} must have shape {layout} (at least {min_ndim} dimensions), "
            f"got shape {shape_of(array)}"
        )


@lru_cache(maxsize=64)
def _kind(xp: Any, dtype: Any) -> str:
    if xp.isdtype(dtype, "real floating"):
        return "float"
    if xp.isdtype(dtype, "bool"):
        return "bool"
    if xp.isdtype(dtype, "integral"):
        return "int"
    if "bfloat16" in str(dtype):  # not in the standard, but a real float
        return "float"
    return "other"


_FLOAT_DTYPES: dict[tuple[type, Any], bool] = {}


def is_float_dtype(xp: Any, dtype: Any) -> bool:
    """Fast, cached: whether ``dtype`` is a real floating dtype."""
    # Keyed with the dtype's type first, so dtypes of two libraries are never
    # compared with each other (array-api-strict warns when they are).
    cache_key = (type(dtype), dtype)
    known = _FLOAT_DTYPES.get(cache_key)
    if known is None:
        known = _FLOAT_DTYPES[cache_key] = _kind(xp, dtype) == "float"
    return known


def dtype_kind(xp: Any, array: Any) -> str:
    """``"float"``, ``"int"``, ``"bool"`` or ``"other"`` (cached per dtype)."""
    return _kind(xp, array.dtype)


def require_float(operation: str, xp: Any, name: str, array: Any) -> None:
    if _kind(xp, array.dtype) != "float":
        raise TypeError(f"{operation}: {name} must have a real floating-point dtype, got {dtype_name(array)}")


def require_same_dtype(operation: str, names: tuple[str, ...], arrays: tuple[Any, ...]) -> None:
    first = arrays[0].dtype
    for name, array in zip(names[1:], arrays[1:]):
        if array.dtype != first:
            raise TypeError(
                f"{operation}: {name} has dtype {dtype_name(array)} but {names[0]} has {dtype_name(arrays[0])}; "
                f"cast them to one dtype"
            )


def broadcast(operation: str, named_shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    """Broadcast shapes, or a ValueError naming the arguments that clash."""
    shapes = list(named_shapes.values())
    first = shapes[0]
    if all(shape == first for shape in shapes):
        return tuple(first)
    ndim = max(map(len, shapes), default=0)
    result = [1] * ndim
    for shape in shapes:
        for axis, size in enumerate(shape, start=ndim - len(shape)):
            if size != 1:
                if result[axis] not in (1, size):
                    described = ", ".join(f"{name} {tuple(s)}" for name, s in named_shapes.items())
                    raise ValueError(f"{operation}: shapes do not broadcast: {described}")
                result[axis] = size
    return tuple(result)


def leading_shape(query: Any, key: Any, value: Any, operation: str = "") -> tuple[int, ...]:
    """The broadcast leading shape ``(...)`` of ``query (..., n, d)``,
    ``key (..., m, d)`` and ``value (..., m, d_v)``, or a ValueError naming
    them."""
    return broadcast(operation, {"query": query.shape[:-2], "key": key.shape[:-2], "value": value.shape[:-2]})


def require_query_key_value(
    operation: str, xp: Any, query: Any, key: Any, value: Any, layouts: tuple[str, str, str]
) -> None:
    """Each of query, key, value a real floating array with at least two
    dimensions (``layouts`` say which), and as many values as keys."""
    for name, array, layout in zip(("query", "key", "value"), (query, key, value), layouts):
        require_ndim(operation, name, array, 2, layout)
        require_float(operation, xp, name, array)
    if key.shape[-2] != value.shape[-2]:
        raise ValueError(
            f"{operation}: value must have m = {key.shape[-2]} positions (from key), got shape {shape_of(value)}"
        )


def require_positive_int(operation: str, name: str, value: Any, *, allow_zero: bool = False) -> int:
    if isinstance(value, bool) or not isinstance(value, int) and not hasattr(value, "__index__"):
        raise TypeError(f"{operation}: {name} must be an integer, got {type(value).__name__}")
    value = int(value.__index__())
    if value < 0 or (value == 0 and not allow_zero):
        expected = "a non-negative" if allow_zero else "a positive"
        raise ValueError(f"{operation}: {name} must be {expected} integer, got {value}")
    return value


def accumulation_dtype(xp: Any, dtype: Any) -> Any:
    """float32 for half-precision inputs, the input dtype otherwise."""
    if dtype == xp.float32 or dtype == xp.float64:
        return dtype
    return xp.float32
