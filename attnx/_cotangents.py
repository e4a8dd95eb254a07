"""Cotangents, the arrays a backward takes and gives (:func:`attnx.vjp`):
one home for what shape and dtype they have."""

from __future__ import annotations

from typing import Any

from attnx import _checks


def require(operation: str, cotangent: Any, output: Any) -> None:
    """A cotangent given to a backward (:func:`attnx.vjp`): an array of the
    output's type, shape and dtype."""
    if type(cotangent) is not type(output):
        raise TypeError(
            f"{operation}: the cotangent must be an array like the output "
            f"({type(output).__module__}.{type(output).__name__}), got {type(cotangent).__module__}.{type(cotangent).__name__}"
        )
    if tuple(cotangent.shape) != tuple(output.shape):
        raise ValueError(
            f"{operation}: the cotangent must have the output's shape {tuple(output.shape)}, got {tuple(cotangent.shape)}"
        )
    if cotangent.dtype != output.dtype:
        raise TypeError(
            f"{operation}: the cotangent must have the output's dtype {_checks.dtype_label(output.dtype)}, "
            f"got {_checks.dtype_label(cotangent.dtype)}"
        )


def gets_cotangent(scale: Any) -> bool:
    """Whether :func:`attnx.vjp` gives ``scale`` a cotangent: a 0-d array,
    or NumPy's scalar (what arithmetic on a 0-d array gives back, so that a
    training loop's updated scale keeps its gradient); not None or a Python
    number."""
    return scale is not None and type(scale) not in (int, float)


def like(xp: Any, gradient: Any, argument: Any) -> Any:
    """``gradient`` summed over the axes ``argument`` was broadcast along,
    in ``argument``'s dtype: a cotangent has its argument's shape."""
    shape = tuple(argument.shape)
    extra = gradient.ndim - len(shape)
    if extra > 0:
        gradient = xp.sum(gradient, axis=tuple(range(extra)))
    ones = tuple(axis for axis, size in enumerate(shape) if size == 1 and gradient.shape[axis] != 1)
    if ones:
        gradient = xp.sum(gradient, axis=ones, keepdims=True)
    if tuple(gradient.shape) != shape:
        gradient = xp.broadcast_to(gradient, shape)
    return gradient if gradient.dtype == argument.dtype else xp.astype(gradient, argument.dtype)


def leading_sum(xp: Any, gradient: Any, keep: int) -> Any:
    """``gradient`` summed over all but its last ``keep`` axes: a
    parameter's gradient, from every slice of the batch that used it."""
    axes = tuple(range(gradient.ndim - keep))
    return xp.sum(gradient, axis=axes) if axes else gradient
