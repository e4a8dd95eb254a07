"""Nadaraya-Watson kernel regression: attention with a fixed kernel."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from attnx import _checks, _cotangents, _dispatch, _masking, _tiling, blocks
from attnx._typing import Array

__all__ = ["KERNELS", "combine_states_along", "finish_state", "kernel_state", "nadaraya_watson", "nadaraya_watson_vjp"]

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
    queries: Array,
    keys: Array,
    values: Array,
    *,
    kernel: str | Callable[[Any], Any] = "gaussian",
    bandwidth: float | Array = 1.0,
    return_weights: bool = False,
    backend: str | None = None,
) -> Array:
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

    Raises
    ------
    TypeError
        If an input is not an array of a registered backend, the inputs come
        from two backends, or ``backend=`` does not own them.
        If ``bandwidth`` is not a real number or 0-d array, or ``kernel`` is
        neither a name nor a callable.
    ValueError
        If ``kernel`` names no kernel, ``bandwidth`` is not positive and
        finite (on concrete values), or the shapes disagree: ``queries``
        ``(n,)`` or ``(n, d)`` with ``keys`` of the same ``d``, ``values``
        with ``m`` rows.
        If ``backend=`` names no registered backend, or the inputs lie on
        two different devices.
    BackendUnavailableError
        If the backend that would run the call cannot run here (its library is
        not installed, or it has no device).

    Notes
    -----
    The kernel is made a chunk of queries at a time: chunks whose kernel
    (``(chunk, m, d)`` differences past 16 features) fit one block of the
    backend
    (:meth:`attnx.Backend.block_bytes_on` the inputs' device, within the
    memory budget; 16 MiB at least where a tracer unrolls the chunks, as
    ``torch.compile`` does), one query at least, through the backend's
    :meth:`~attnx.Backend.map_chunks` (under ``jax.jit``, one ``lax.map``).
    Without the weights the kernel is never whole: at n = m = 2048 in
    float64 on NumPy the peak is 12 MiB where the whole kernel and the
    arrays beside it took 96 MiB (docs/archive/bench-sessions.md has the times: 0.6-0.8x
    of whole where the allocator keeps freed memory).  With them, the
    ``(n, m)`` weights are the output: each chunk's are normalised alone
    and joined, so the peak is the weights twice over (the chunks, and
    their join) where it was three times, and 2 GiB of differences with 32
    features.

    A query that no key reaches (compact kernels) gets zeros, never NaN.
    With the gaussian, a query gets the value of its nearest key (the mean
    of the nearest, where keys tie) as the bandwidth shrinks, however far
    below the distances it goes: no scaled distance is squared.

    Examples
    --------
    >>> import numpy as np
    >>> import attnx
    >>> x_train = np.linspace(0, 5, 50)
    >>> y_train = np.sin(x_train)
    >>> fit = attnx.nadaraya_watson(np.array([1.0, 2.0, 3.0]), x_train, y_train, bandwidth=0.2)
    >>> print(fit.round(3), np.sin([1.0, 2.0, 3.0]).round(3))
    [0.825 0.891 0.138] [0.841 0.909 0.141]
    >>> attnx.nadaraya_watson(np.array([1.0]), x_train, y_train, bandwidth=-1.0)
    Traceback (most recent call last):
        ...
    ValueError: nadaraya_watson: bandwidth must be positive and finite, got -1.0
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
    elif getattr(bandwidth, "ndim", None) is None:
        raise TypeError(
            f"{_NW}: bandwidth must be a positive float or a 0-d array, got {bandwidth!r} ({type(bandwidth).__name__})"
        )
    elif bandwidth.ndim != 0:
        raise ValueError(f"{_NW}: bandwidth must be a positive float or a 0-d array, got {bandwidth!r}")
    elif _checks.values_known(bandwidth) and not bool(bandwidth > 0):
        raise ValueError(f"{_NW}: bandwidth must be positive, got {float(bandwidth)}")
    options = {"block_bytes": _tiling.chunk_bytes(chosen, queries), "map_chunks": chosen.map_chunks}
    arguments = {
        "queries": queries,
        "keys": keys,
        "values": values,
        "kernel": kernel,
        "bandwidth": bandwidth,
        "return_weights": return_weights,
    }
    return _dispatch.call(_NW, chosen, reason, _nadaraya_watson_generic, arguments, options)


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
    xp: Any,
    *,
    queries: Any,
    keys: Any,
    values: Any,
    kernel: Any,
    bandwidth: Any,
    return_weights: bool,
    block_bytes: int,
    map_chunks: Callable[..., Any],
) -> Any:
    """The estimate (and the weights), in chunks of queries whose ``(chunk,
    m)`` kernel fits one block (``(chunk, m, d)`` past
    :data:`_FEATURES_ONE_AT_A_TIME` features), through ``map_chunks``
    (:meth:`attnx.Backend.map_chunks`)."""
    dtype = queries.dtype
    n, m = queries.shape[0], keys.shape[0]
    width = keys.shape[1] if keys.ndim == 2 else 1
    step = None  # one chunk where a size is unknown: a lazy library's arrays come in chunks of their own
    if _checks.known(n, m, width):
        features = width if width > _FEATURES_ONE_AT_A_TIME else 1
        step = _tiling.rows_per_chunk(block_bytes, _tiling.itemsize(xp, dtype) * m * features)
    one_chunk = step is None or n <= step
    if one_chunk and not return_weights:
        state = kernel_state(queries, keys, values, kernel=kernel, bandwidth=bandwidth, xp=xp)
        return finish_state(state, values, dtype=dtype, xp=xp)
    queries, keys, values, bandwidth = _in_state_dtype(xp, queries, keys, values, bandwidth)
    rows = queries if queries.ndim == 2 else queries[:, None]  # scalar queries as (n, 1)

    def in_chunks(function: Callable[[Any], Any]) -> Any:
        def of_rows(chunk: Any) -> Any:  # (c, d) -> (c, e)
            return function(chunk if keys.ndim == 2 else chunk[:, 0])

        return of_rows(rows) if one_chunk else map_chunks(of_rows, rows, step)

    if return_weights:  # (n, m) themselves, but each chunk's kernel is made and normalised alone

        def weights_of(chunk: Any) -> Any:
            kernel_values, _, _ = _kernel_values(xp, chunk, keys, kernel, bandwidth)
            return kernel_values / _masking.safe_total(xp, kernel_values)

        weights = in_chunks(weights_of)
        estimate = weights @ values
        if estimate.dtype != dtype:
            estimate, weights = xp.astype(estimate, dtype), xp.astype(weights, dtype)
        return estimate, weights
    columns = values if values.ndim == 2 else values[:, None]

    def estimate_of(chunk: Any) -> Any:
        state = kernel_state(chunk, keys, columns, kernel=kernel, bandwidth=bandwidth, xp=xp)
        return blocks.finish(state, dtype=dtype, xp=xp)

    estimate = in_chunks(estimate_of)
    return estimate if values.ndim == 2 else estimate[:, 0]


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


def _distances(xp: Any, queries: Any, keys: Any) -> Any:
    """The distances ``(n, m)`` between queries and keys: absolute for
    scalar keys, Euclidean for vectors."""
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
    return xp.sqrt(total)


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
    xp: Any, queries: Any, keys: Any, kernel: Any, bandwidth: Any, with_nearest: bool = False
) -> tuple[Any, Any, Any]:
    """The kernel ``(n, m)`` between queries and keys; for the gaussian,
    given over a constant of each row, the logarithm of that constant
    ``(n, 1)``, ``-(nearest / b)^2 / 2`` (None for the other kernels); and
    ``nearest`` ``(n, 1)``, each query's distance to its nearest key (``inf``
    without keys), for the gaussian or where asked (None otherwise)."""
    distances = _distances(xp, queries, keys)
    nearest = None
    if kernel == "gaussian" or with_nearest:
        nearest = (
            xp.min(distances, axis=-1, keepdims=True)
            if keys.shape[0]
            else xp.full((queries.shape[0], 1), float("inf"), dtype=distances.dtype, device=_checks.device_of(queries))
        )
    if kernel != "gaussian":
        u = distances / bandwidth
        return (KERNELS[kernel](xp, u) if isinstance(kernel, str) else kernel(u)), None, nearest
    scaled = nearest / bandwidth
    return _gaussian_weights(xp, distances, bandwidth, nearest), -0.5 * scaled * scaled, nearest


def kernel_state(
    queries: Any,
    keys: Any,
    values: Any,
    *,
    kernel: Any = "gaussian",
    bandwidth: Any = 1.0,
    return_nearest: bool = False,
    xp: Any = None,
) -> Any:
    """The partial state (:mod:`attnx.blocks`) of Nadaraya-Watson regression
    over some of the keys: states of disjoint keys combine, and
    :func:`finish_state` gives the estimate.  For backends that split the
    keys (a chunked training set); arguments as in :func:`nadaraya_watson`.

    Parameters
    ----------
    return_nearest : bool
        Also return each query's distance to its nearest key here, for
        :func:`combine_states_along`.  The states hold the gaussian's scores
        ``-(d / b)^2 / 2``, which are ``-inf`` for a query farther than about
        ``1.8e19`` bandwidths (float32; ``1.3e154`` in float64) from every
        key of a state: one such state still finishes exactly, but
        :func:`attnx.blocks.combine` of two gives zeros, where the nearest
        distances tell which to keep.

    Returns
    -------
    state : array, shape (n, d_v + 2), with ``d_v = 1`` for values of shape ``(m,)``
        In float32 for inputs of half precision (:func:`attnx.blocks.state_dtype`).
    nearest : array, shape (n,), only with ``return_nearest=True``
        In the state's dtype; ``inf`` where there is no key.
    """
    xp = xp or _checks.common_namespace(queries, keys, values)
    queries, keys, values, bandwidth = _in_state_dtype(xp, queries, keys, values, bandwidth)
    columns = values if values.ndim == 2 else values[:, None]
    kernel_values, log_constant, nearest = _kernel_values(xp, queries, keys, kernel, bandwidth, return_nearest)
    if log_constant is None:
        state = blocks.from_weights(kernel_values, columns, xp=xp)
    elif 0 in tuple(kernel_values.shape):  # no key: the state of nothing attended (maximum -inf)
        state = blocks.from_scores(kernel_values, columns, xp=xp)
    else:  # the gaussian's weights are over exp(log_constant): that is the state's maximum score
        total = xp.sum(kernel_values, axis=-1, keepdims=True)
        state = blocks.pack(xp, kernel_values @ columns, total, log_constant)
    return (state, nearest[:, 0]) if return_nearest else state


def combine_states_along(states: Any, nearest: Any, axis: int, *, keepdims: bool = False, xp: Any = None) -> Any:
    """Kernel states of disjoint keys, stacked along ``axis`` with their
    nearest distances (:func:`kernel_state` with ``return_nearest=True``),
    combined: ``(state, nearest)``.

    As :func:`attnx.blocks.combine_along`, except for a query whose gaussian
    scores are ``-inf`` in every state (all its keys beyond the float range
    in bandwidths): there the states of its nearest keys are summed and the
    others dropped, exactly, since another key's weight is below
    ``exp(-1e31)`` times theirs (one rounding of a distance past ``1.8e19``
    bandwidths).

    Parameters
    ----------
    states : array, shape (..., n, d_v + 2)
    nearest : array, shape (..., n)
        Stacked along the same ``axis`` (not the states' last).
    """
    xp = xp or _checks.common_namespace(states, nearest)
    axis = axis % states.ndim
    combined = blocks.combine_along(states, axis, keepdims=True, xp=xp)
    least = xp.min(nearest, axis=axis, keepdims=True)
    keep = xp.astype(nearest == least, states.dtype)[..., None]
    beyond = xp.sum(states[..., :-1] * keep, axis=axis, keepdims=True)
    every_beyond = combined[..., -1:] == -float("inf")
    state = xp.where(every_beyond, xp.concat([beyond, combined[..., -1:]], axis=-1), combined)
    if not keepdims:
        state, least = xp.squeeze(state, axis=axis), xp.squeeze(least, axis=axis)
    return state, least


def finish_state(state: Any, values: Any, *, dtype: Any = None, xp: Any = None) -> Any:
    """The estimate of a :func:`kernel_state`: ``(n, d_v)``, or ``(n,)`` for
    values of shape ``(m,)``, in ``dtype`` (the state's by default)."""
    estimate = blocks.finish(state, dtype=dtype, xp=xp or _checks.common_namespace(state))
    return estimate if values.ndim == 2 else estimate[:, 0]


def nadaraya_watson_vjp(
    queries: Any,
    keys: Any,
    values: Any,
    *,
    kernel: Any = "gaussian",
    bandwidth: Any = 1.0,
    return_weights: bool = False,
    backend: str | None = None,
) -> tuple[Any, Callable[[Any], dict[str, Any]]]:
    """:func:`attnx.vjp` of :func:`nadaraya_watson`: the estimate, and its
    backward, a chunk of queries at a time as the forward.

    Each named kernel is a function of ``t = (d / b)^2``: with the weights
    ``w = K(t) / sum K(t)`` and ``a = g v^T``, ``dt = (a - g . f) dK/dt /
    sum K(t)`` (the gaussian's ``dK/dt / K`` is ``-1/2``, the boxcar's 0);
    then ``dq = 2 / b^2 (rowsum(dt) q - dt k)``, ``dk = 2 / b^2 (colsum(dt)
    k - dt^T q)``, ``db = -2 / b sum(dt t)`` and ``dv = w^T g``."""
    operation = f"vjp({_NW})"
    _checks.require_flag(operation, "return_weights", return_weights)
    if return_weights:
        raise ValueError(f"{operation}: return_weights=True has two outputs; differentiate the estimate alone")
    if not isinstance(kernel, str):
        raise TypeError(
            f"{operation}: a kernel of your own has no gradient here; give one of {sorted(KERNELS)}, or "
            "differentiate attnx.nadaraya_watson with PyTorch's or JAX's autograd, which differentiate your kernel"
        )
    estimate = nadaraya_watson(queries, keys, values, kernel=kernel, bandwidth=bandwidth, backend=backend)
    chosen, _ = _dispatch.resolve(
        operation,
        backend,
        ("queries", "keys", "values", "bandwidth"),
        (queries, keys, values, _checks.scale_array(bandwidth)),
        3,
    )
    # A 0-d array, or NumPy's scalar (what arithmetic on a 0-d array gives back): a learned width.
    learned = type(bandwidth) not in (int, float)
    xp = chosen.xp
    block_bytes = _tiling.chunk_bytes(chosen, queries)

    def backward(cotangent: Any) -> dict[str, Any]:
        _cotangents.require(operation, cotangent, estimate)
        dtype = queries.dtype
        q, k, v, b = _in_state_dtype(xp, queries, keys, values, bandwidth if learned else float(bandwidth))
        compute = q.dtype
        g, f = (a if a.dtype == compute else xp.astype(a, compute) for a in (cotangent, estimate))
        # Scalar positions as one feature, scalar values as one column: |q - k| is the distance of both.
        q, k, v, g, f = (a if a.ndim == 2 else a[:, None] for a in (q, k, v, g, f))
        n, m = q.shape[0], k.shape[0]
        step = n
        if _checks.known(n, m, k.shape[1]):
            features = k.shape[1] if k.shape[1] > _FEATURES_ONE_AT_A_TIME else 1
            step = max(1, _tiling.rows_per_chunk(block_bytes, _tiling.itemsize(xp, compute) * m * features))
        flat = kernel == "boxcar"  # flat wherever it is differentiable: only the values get gradients
        d_queries, d_keys, d_values, d_bandwidth = [], xp.zeros_like(k), xp.zeros_like(v), xp.sum(xp.zeros_like(k))
        for start in range(0, max(n, 1), step):  # a chunk of queries at a time, as the forward: no (n, m) whole
            rows = slice(start, min(n, start + step))  # in bounds: the standard leaves other stops unspecified
            q_rows, g_rows, f_rows = q[rows, ...], g[rows, ...], f[rows, ...]
            kernel_values, _, _ = _kernel_values(xp, q_rows, k, kernel, b)
            totals = _masking.safe_total(xp, kernel_values)
            weights = kernel_values / totals
            d_values = d_values + xp.matrix_transpose(weights) @ g_rows
            if flat:
                d_queries.append(xp.zeros_like(q_rows))
                continue
            # How the loss moves with each kernel value, then with t = (d / b)^2.
            pulls = g_rows @ xp.matrix_transpose(v) - xp.sum(g_rows * f_rows, axis=-1, keepdims=True)
            distances = _distances(xp, q_rows, k) / b
            t = distances * distances
            if kernel == "gaussian":  # dK/dt = -K / 2, and K over its row's total is the weight
                d_t = -0.5 * weights * pulls
            else:  # the epanechnikov: dK/dt = -3/4 inside its support
                d_t = xp.where(t < 1.0, -0.75 * pulls / totals, xp.zeros_like(pulls))
            factor = 2.0 / (b * b)
            d_queries.append(factor * (xp.sum(d_t, axis=-1, keepdims=True) * q_rows - d_t @ k))
            column_sums = xp.matrix_transpose(xp.sum(d_t, axis=0, keepdims=True))
            d_keys = d_keys + factor * (column_sums * k - xp.matrix_transpose(d_t) @ q_rows)
            # A key whose weight underflowed moves nothing, however far it is (its t may be inf).
            d_bandwidth = d_bandwidth - 2.0 / b * xp.sum(xp.where(d_t == 0, xp.zeros_like(t), d_t * t))
        grads = {
            "queries": _shaped(
                xp, xp.concat(d_queries, axis=0) if len(d_queries) > 1 else d_queries[0], queries, dtype
            ),
            "keys": _shaped(xp, d_keys, keys, dtype),
            "values": _shaped(xp, d_values, values, dtype),
        }
        if learned:
            grads["bandwidth"] = (
                xp.astype(d_bandwidth, bandwidth.dtype)
                if chosen.owns(bandwidth) and d_bandwidth.dtype != bandwidth.dtype
                else d_bandwidth
            )
        return grads

    return estimate, backward


def _shaped(xp: Any, gradient: Any, argument: Any, dtype: Any) -> Any:
    """A gradient computed over ``(rows, features)`` in its argument's shape and dtype."""
    if argument.ndim == 1:
        gradient = gradient[:, 0]
    return gradient if gradient.dtype == dtype else xp.astype(gradient, dtype)
