"""Parameter mappings: checking them and creating them from a seed."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from attnx import _checks, _dispatch


def require_mapping(operation: str, params: Any, *, required: tuple[str, ...], optional: tuple[str, ...]) -> None:
    if not isinstance(params, Mapping):
        raise TypeError(f"{operation}: params must be a mapping of names to arrays, got {type(params).__name__}")
    missing = [name for name in required if params.get(name) is None]
    if missing:
        raise ValueError(
            f"{operation}: params is missing {', '.join(map(repr, missing))}; it needs {', '.join(required)}"
        )
    unknown = sorted(set(params) - set(required) - set(optional))
    if unknown:
        raise ValueError(
            f"{operation}: params has unknown entries {unknown}; expected {', '.join(required + optional)}"
        )


def _require_array(operation: str, name: str, value: Any) -> None:
    # Arrays of a backend were checked by dispatch; Python scalars pass it (as
    # for bandwidth=0.5), so they are refused here.
    if not hasattr(value, "shape"):
        raise TypeError(f"{operation}: params[{name!r}] must be an array, got {type(value).__name__}")


def _check_dtype(operation: str, xp: Any, name: str, array: Any, dtype: Any) -> None:
    _checks.require_float(operation, xp, f"params[{name!r}]", array)
    if dtype is not None and array.dtype != dtype:
        raise TypeError(
            f"{operation}: params[{name!r}] has dtype {_checks.dtype_name(array)} but the inputs have {_checks.dtype_label(dtype)}"
        )


def matrix(
    operation: str,
    xp: Any,
    params: Mapping[str, Any],
    name: str,
    *,
    rows: int,
    rows_name: str,
    cols: int | None = None,
    cols_name: str = "",
    dtype: Any = None,
) -> Any:
    """``params[name]``, checked to be a ``(rows, cols)`` matrix."""
    w = params[name]
    _require_array(operation, name, w)
    expected = f"({rows_name}, {cols_name or 'any'})"
    if w.ndim != 2 or w.shape[0] != rows or (cols is not None and w.shape[1] != cols):
        wanted = (rows, cols) if cols is not None else (rows, "*")
        raise ValueError(
            f"{operation}: params[{name!r}] must have shape {expected} = {wanted}, got {_checks.shape_of(w)}"
        )
    _check_dtype(operation, xp, name, w, dtype)
    return w


def vector(operation: str, xp: Any, params: Mapping[str, Any], name: str, *, size: int, dtype: Any = None) -> Any:
    """``params[name]`` if present, checked to be a ``(size,)`` vector."""
    b = params.get(name)
    if b is None:
        return None
    _require_array(operation, name, b)
    if _checks.shape_of(b) != (size,):
        raise ValueError(f"{operation}: params[{name!r}] must have shape ({size},), got {_checks.shape_of(b)}")
    _check_dtype(operation, xp, name, b, dtype)
    return b


def create(
    operation: str,
    backend: str | None,
    seed: int,
    dtype: Any,
    device: Any,
    *,
    xavier: Mapping[str, tuple[int, int]] = {},
    normal: Mapping[str, tuple[int, ...]] = {},
    zeros: Mapping[str, int] = {},
) -> dict[str, Any]:
    """Draw parameters once in float64 NumPy (same numbers on every backend),
    then convert them to ``backend`` in ``dtype`` (default float32).

    ``xavier``: uniform on +-sqrt(6 / (fan_in + fan_out)), as PyTorch's
    ``xavier_uniform_``; ``normal``: standard normal, as ``nn.Embedding``;
    ``zeros``: biases.
    """
    import numpy as np

    seed = _checks.require_int(operation, "seed", seed)
    if seed < 0:  # NumPy's generators take any non-negative int, however large
        raise ValueError(f"{operation}: seed must be a non-negative integer, got {seed}")
    chosen, _, device = _dispatch.resolve_creation(operation, backend, device)
    generator = np.random.default_rng(seed)
    drawn: dict[str, Any] = {}
    for name, (fan_in, fan_out) in xavier.items():
        bound = math.sqrt(6.0 / (fan_in + fan_out))
        drawn[name] = generator.uniform(-bound, bound, size=(fan_in, fan_out))
    for name, shape in normal.items():
        drawn[name] = generator.standard_normal(shape)
    for name, size in zeros.items():
        drawn[name] = np.zeros(size)
    dtype = (
        "float32"
        if dtype is None
        else _checks.require_dtype_name(operation, chosen.xp, chosen.name, dtype, floating=True)
    )
    return {
        name: chosen.asarray(
            value.astype(np.float32) if dtype == "bfloat16" else value.astype(dtype), dtype=dtype, device=device
        )
        for name, value in drawn.items()
    }
