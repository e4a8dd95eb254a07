"""Nadaraya-Watson kernel regression: attention with a fixed kernel."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from attnx import _checks, _dispatch, _masking, blocks

__all__ = ["KERNELS", "finish_state", "kernel_state", "nadaraya_watson", "nearest_distance"]

_NW = "nadaraya_watson"


def _gaussian(xp: Any, u: Any) -> Any:
    return xp.exp(-0.5 * u * u)


def _boxcar(xp: Any, u: Any) -> Any:
    return xp.astype(xp.abs(u) <= 1.0, u.dtype)


def _epanechnikov(xp: Any, u: Any) -> Any:
    return xp.clip(0.75 * (1.0 - u * u), min=0.0)


#: The named kernels, as functions of the scaled distance ``u``.
#: :func:`nadaraya_watson` takes the gaussian's weights from the distances
#: instead (:func:`_gaussian_weights`), over its nearest key's: ``u`` squared
#: overflows, and every weight underflows, for a query far from every key.
KERNELS: dict[str, Callable[[Any, Any], Any]] = {
    "gaussian": _gaussian,
    "boxcar": _boxcar,
    "epanechnikov": _epanechnikov,
}


def nadaraya_watson(
    queries: Any,
    keys: Any,
    values: Any,
    *,
    kernel: str | Callable[[Any], Any] = "gaussian",
    bandwidth: float | Any = 1.0,
    return_weights: bool = False,
    backend: str | None = None,
) -> Any:
    r"""Nadaraya-Watson kernel regression.

    .. math:: f(q) = \sum_i \frac{K((q - k_i)/b)}{\sum_j K((q - k_j)/b)} v_i

    Parameters
    ----------
    queries : array, shape (n,) or (n, d)
    keys : array, shape (m,) for scalar keys or (m, d) for vector keys
        (the distance is then Euclidean).
    values : array, shape (m,) or (m, d_v)
    kernel : {"gaussian", "boxcar", "epanechnikov"} or callable
        A callable receives the scaled distances ``u`` (an array, ``>= 0``)
        and returns non-negative kernel values of the same shape.  It may
        be called on the chunks of a lazy backend's arrays (Dask's: NumPy
        or CuPy arrays), so it takes its functions from ``u``
        (``array_api_compat.array_namespace(u)``) or its operators.
    bandwidth : float or 0-d array
        ``b > 0``.  An array of the inputs' backend may carry gradients: with
        the gaussian kernel and ``bandwidth = 1/w`` this is the learned-width
        form ``softmax(-((q - k) w)^2 / 2)``.
    return_weights : bool

    Returns
    -------
    estimate : array, shape (n,) or (n, d_v)
    weights : array, shape (n, m), only with ``return_weights=True``
        In the inputs' dtype; half precision is computed in float32.

    Notes
    -----
    A query that no key reaches (compact kernels) gets zeros, never NaN.
    With the gaussian, a query gets the value of its nearest key (the mean
    of the nearest, where keys tie) as the bandwidth shrinks, however far
    below the distances it goes: no scaled distance is squared.

    Native implementations (:meth:`attnx.Backend.implementations`) are
    called with the keyword arguments ``queries``, ``keys``, ``values``,
    ``kernel`` (a name or the callable), ``bandwidth`` (a float or a 0-d
    array) and ``return_weights``, after validation.
    """
    names = ("queries", "keys", "values", "bandwidth")
    bandwidth_array = None if isinstance(bandwidth, (int, float)) else bandwidth  # a number needs no backend
    chosen, reason = _dispatch.resolve(_NW, backend, names, (queries, keys, values, bandwidth_array), 3)
    xp = chosen.xp
    _checks.require_flag(_NW, "return_weights", return_weights)
    for name, array in (("queries", queries), ("keys", keys), ("values", values)):
        _checks.require_float(_NW, xp, name, array)
    if keys.ndim not in (1, 2):
        raise ValueError(f"{_NW}: keys must have shape (m,) or (m, d), got {_checks.shape_of(keys)}")
    expected = (keys.ndim == 1 and queries.ndim == 1) or (
        keys.ndim == 2 and queries.ndim == 2 and queries.shape[1] == keys.shape[1]
    )
    if not expected:
        layout = "(n,)" if keys.ndim == 1 else f"(n, {keys.shape[1]})"
        raise ValueError(
            f"{_NW}: queries must have shape {layout} to match keys {_checks.shape_of(keys)}, got {_checks.shape_of(queries)}"
        )
    if values.ndim not in (1, 2) or (
        values.shape[0] != keys.shape[0] and _checks.known(values.shape[0], keys.shape[0])
    ):
        raise ValueError(
            f"{_NW}: values must have shape ({keys.shape[0]},) or ({keys.shape[0]}, d_v), got {_checks.shape_of(values)}"
        )
    _checks.require_same_dtype(_NW, ("queries", "keys", "values"), (queries, keys, values))
    if isinstance(kernel, str):
        if kernel not in KERNELS:
            raise ValueError(f"{_NW}: kernel must be one of {sorted(KERNELS)} or a callable, got {kernel!r}")
    elif not callable(kernel):
        raise TypeError(f"{_NW}: kernel must be a name or a callable, got {type(kernel).__name__}")
    else:
        _check_kernel(chosen, kernel, queries)
    if isinstance(bandwidth, bool):
        raise TypeError(f"{_NW}: bandwidth must be a positive float or a 0-d array, got {bandwidth!r}")
    if isinstance(bandwidth, (int, float)):
        if not (bandwidth > 0 and math.isfinite(bandwidth)):
            raise ValueError(f"{_NW}: bandwidth must be positive and finite, got {bandwidth}")
        bandwidth = float(bandwidth)
        if not _checks.FLOAT32_SMALLEST_NORMAL <= bandwidth <= _checks.FLOAT32_MAX:  # 0 or inf in float32
            compute = blocks.state_dtype(xp, queries.dtype)
            _checks.require_finite_in(_NW, "bandwidth", xp, bandwidth, compute, positive=True)
    elif getattr(bandwidth, "ndim", None) != 0:
        raise ValueError(f"{_NW}: bandwidth must be a positive float or a 0-d array, got {bandwidth!r}")
    elif _checks.values_known(bandwidth) and not bool(bandwidth > 0):
        raise ValueError(f"{_NW}: bandwidth must be positive, got {float(bandwidth)}")
    return _dispatch.call(
        _NW,
        chosen,
        reason,
        _nadaraya_watson_generic,
        {
            "queries": queries,
            "keys": keys,
            "values": values,
            "kernel": kernel,
            "bandwidth": bandwidth,
            "return_weights": return_weights,
        },
    )


#: Scaled distances a callable kernel is tried on before the call: the
#: shape (2, 3) tells a kernel that keeps u's shape from one that broadcasts
#: or slices it; 0 to 8 cover the compact kernels' support and past it.
_PROBE = [[0.0, 0.5, 1.0], [2.0, 4.0, 8.0]]


def _check_kernel(chosen: Any, kernel: Callable[[Any], Any], queries: Any) -> None:
    """A callable kernel, tried on :data:`_PROBE`: an array of the backend,
    of the distances' shape, of non-negative finite values (where they can
    be read), or an error naming the kernel before anything is computed."""
    xp = chosen.xp
    probe = xp.asarray(_PROBE, dtype=queries.dtype, device=_checks.device_of(queries))
    result = _checks.call_users_function(_NW, "kernel", chosen, kernel, (probe,), f"scaled distances {_PROBE}")
    if _checks.shape_of(result) != (2, 3):
        raise ValueError(
            f"{_NW}: kernel must return an array of the distances' own shape: on distances of shape (2, 3) "
            f"it returned shape {_checks.shape_of(result)}"
        )
    kind = _checks.dtype_kind(xp, result)
    if kind not in ("bool", "int", "float"):
        raise TypeError(f"{_NW}: kernel must return real values, got dtype {_checks.dtype_name(result)}")
    if kind != "bool" and _checks.values_known(result) and not bool(xp.all((result >= 0) & (result < float("inf")))):
        raise ValueError(
            f"{_NW}: kernel must return non-negative, finite values (weights): on scaled distances {_PROBE} "
            f"it returned {chosen.to_numpy(result).tolist()}"
        )


def _nadaraya_watson_generic(
    xp: Any, *, queries: Any, keys: Any, values: Any, kernel: Any, bandwidth: Any, return_weights: bool
) -> Any:
    dtype = queries.dtype
    if not return_weights:
        state = kernel_state(queries, keys, values, kernel=kernel, bandwidth=bandwidth, xp=xp)
        return finish_state(state, values, dtype=dtype, xp=xp)
    queries, keys, values, bandwidth = _in_state_dtype(xp, queries, keys, values, bandwidth)
    kernel_values, _ = _kernel_values(xp, queries, keys, kernel, bandwidth)
    weights = kernel_values / _masking.safe_total(xp, kernel_values)
    estimate = weights @ values if values.ndim == 2 else xp.sum(weights * values, axis=-1)
    if estimate.dtype != dtype:
        estimate, weights = xp.astype(estimate, dtype), xp.astype(weights, dtype)
    return estimate, weights


def _in_state_dtype(xp: Any, queries: Any, keys: Any, values: Any, bandwidth: Any) -> tuple[Any, Any, Any, Any]:
    """The arguments in the dtype the states are computed in: float32 for
    half precision, whose squared distances overflow past 256 (a query far
    from every key would get zeros, not its nearest key's value)."""
    dtype = queries.dtype
    compute, (queries, keys, values) = _checks.in_accumulation_dtype(xp, queries, keys, values)
    if compute != dtype and not isinstance(bandwidth, float):  # a 0-d array, with inputs of half precision
        bandwidth = xp.astype(bandwidth, compute)
    return queries, keys, values, bandwidth


#: Up to this many features the squared distances are summed one feature at
#: a time, over ``(n, m)`` arrays: 3-5x faster on NumPy at 2-4 features than
#: a difference ``(n, m, d)`` summed over its last axis, which wins past 16.
_FEATURES_ONE_AT_A_TIME = 16


def _distances(xp: Any, queries: Any, keys: Any, *, root: bool = True) -> Any:
    """The distances ``(n, m)`` between queries and keys: absolute for
    scalar keys, Euclidean for vectors (``root=False``: the vectors' squared
    distances, for a minimum: the root, monotonic and correctly rounded,
    may follow it exactly)."""
    if keys.ndim == 1:
        return xp.abs(queries[:, None] - keys[None, :])
    features = keys.shape[1]
    if features is not None and 0 < features <= _FEATURES_ONE_AT_A_TIME:
        total = None
        for feature in range(features):
            difference = queries[:, feature, None] - keys[None, :, feature]
            mutable = _masking.can_mutate(difference)
            if mutable:
                difference *= difference
            square = difference if mutable else difference * difference
            if total is None:
                total = square
            elif mutable:
                total += square
            else:
                total = total + square
    else:
        difference = queries[:, None, :] - keys[None, :, :]
        total = xp.sum(difference * difference, axis=-1)
    return xp.sqrt(total) if root else total


def _gaussian_weights(xp: Any, distances: Any, bandwidth: Any, nearest: Any) -> Any:
    """The gaussian ``exp(-(d / b)^2 / 2)`` over ``exp(-(nearest / b)^2 / 2)``,
    ``nearest`` a distance of each row ``(n, 1)`` no larger than its own.

    Taken as ``exp((nearest - d)(d + nearest) / (b sqrt 2)^2)``, dividing by
    ``b sqrt 2`` twice, so that no scaled distance is squared: that square
    overflows past the float range's root (1.8e19 in float32) for a query
    far from every key in bandwidths, and a softmax of ``-inf`` everywhere
    would give zeros where the nearest key's value is the exact estimate.
    A key at the nearest distance weighs exactly 1; the row's largest
    exponent is known, so no maximum is taken."""
    width = bandwidth * math.sqrt(2.0)
    exponent = (nearest - distances) * (distances + nearest)
    if _masking.can_mutate(exponent):
        exponent /= width
        exponent /= width
        return xp.exp(exponent)
    return xp.exp(exponent / width / width)


def _kernel_values(
    xp: Any, queries: Any, keys: Any, kernel: Any, bandwidth: Any, nearest: Any = None
) -> tuple[Any, Any]:
    """The kernel ``(n, m)`` between queries and keys and, for the gaussian,
    given over a constant of each row, the logarithm of that constant
    ``(n, 1)``: ``-(nearest / b)^2 / 2`` with ``nearest`` the row's smallest
    distance (this block's unless given); None for the other kernels."""
    distances = _distances(xp, queries, keys)
    if kernel != "gaussian":
        u = distances / bandwidth
        return (KERNELS[kernel](xp, u) if isinstance(kernel, str) else kernel(u)), None
    if nearest is None:
        nearest = xp.min(distances, axis=-1, keepdims=True) if keys.shape[0] else xp.zeros_like(distances[:, :1])
    scaled = nearest / bandwidth
    return _gaussian_weights(xp, distances, bandwidth, nearest), -0.5 * scaled * scaled


def nearest_distance(queries: Any, keys: Any, *, xp: Any = None) -> Any:
    """The distance ``(n,)`` from each query to its nearest key (``inf``
    where there is no key), for :func:`kernel_state`'s ``nearest`` over
    keys split into blocks: the minimum of the blocks' own."""
    xp = xp or _checks.common_namespace(queries, keys)
    compute, (queries, keys) = _checks.in_accumulation_dtype(xp, queries, keys)
    if not keys.shape[0]:
        return xp.full((queries.shape[0],), float("inf"), dtype=compute, device=_checks.device_of(queries))
    if keys.ndim == 1:  # sorted keys: the nearest is next to the query's place, in O((n + m) log m)
        ordered = xp.sort(keys)
        above = xp.clip(xp.searchsorted(ordered, queries), max=keys.shape[0] - 1)
        below = xp.clip(above - 1, min=0)
        return xp.minimum(xp.abs(queries - xp.take(ordered, below)), xp.abs(queries - xp.take(ordered, above)))
    return xp.sqrt(xp.min(_distances(xp, queries, keys, root=False), axis=-1))


def kernel_state(
    queries: Any,
    keys: Any,
    values: Any,
    *,
    kernel: Any = "gaussian",
    bandwidth: Any = 1.0,
    nearest: Any = None,
    xp: Any = None,
) -> Any:
    """The partial state (:mod:`attnx.blocks`) of Nadaraya-Watson regression
    over some of the keys: states of disjoint keys combine, and
    :func:`finish_state` gives the estimate.  For backends that split the
    keys (a chunked training set); arguments as in :func:`nadaraya_watson`.

    Parameters
    ----------
    nearest : array, shape (n,), optional
        The gaussian's only: each query's :func:`nearest_distance` over all
        the keys.  Without it the states hold the scores
        ``-(d / b)^2 / 2`` themselves, which are ``-inf`` for a query farther
        than about ``1.8e19`` bandwidths (float32; ``1.3e154`` in float64)
        from every key of a block: one such state still finishes exactly,
        but two of them combine to zeros.  With it the scores are taken
        less ``-(nearest / b)^2 / 2``, which is finite for the nearest key,
        and the states of the blocks combine exactly; states made with
        ``nearest`` combine only with states made with the same.

    Returns
    -------
    array, shape (n, d_v + 2), with ``d_v = 1`` for values of shape ``(m,)``
        In float32 for inputs of half precision (:func:`attnx.blocks.state_dtype`).
    """
    xp = xp or _checks.common_namespace(queries, keys, values)
    queries, keys, values, bandwidth = _in_state_dtype(xp, queries, keys, values, bandwidth)
    columns = values if values.ndim == 2 else values[:, None]
    if nearest is not None:
        nearest = xp.astype(nearest, queries.dtype)[:, None] if nearest.dtype != queries.dtype else nearest[:, None]
    kernel_values, log_constant = _kernel_values(xp, queries, keys, kernel, bandwidth, nearest)
    if log_constant is None:
        return blocks.from_weights(kernel_values, columns, xp=xp)
    if 0 in tuple(kernel_values.shape):  # no key: the state of nothing attended (maximum -inf)
        return blocks.from_scores(kernel_values, columns, xp=xp)
    # The gaussian's weights are over exp(log_constant): the state's maximum
    # (blocks' scores) is that, or 0 for states over one shared ``nearest``.
    total = xp.sum(kernel_values, axis=-1, keepdims=True)
    maximum = xp.zeros_like(total) if nearest is not None else log_constant
    return blocks.pack(xp, kernel_values @ columns, total, maximum)


def finish_state(state: Any, values: Any, *, dtype: Any = None, xp: Any = None) -> Any:
    """The estimate of a :func:`kernel_state`: ``(n, d_v)``, or ``(n,)`` for
    values of shape ``(m,)``, in ``dtype`` (the state's by default)."""
    estimate = blocks.finish(state, dtype=dtype, xp=xp or _checks.common_namespace(state))
    return estimate if values.ndim == 2 else estimate[:, 0]
