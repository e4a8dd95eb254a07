"""Additive (Bahdanau) attention and the seq2seq context vector."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

from attnx import _checks, _cotangents, _dispatch, _masking, _params, _tiling
from attnx._typing import Array

__all__ = ["additive_attention", "additive_attention_vjp", "bahdanau_context", "bahdanau_context_vjp"]

_ADD = "additive_attention"


def additive_attention(
    query: Array,
    key: Array,
    value: Array,
    params: Mapping[str, Any],
    *,
    mask: Array = None,
    key_lengths: Array = None,
    return_weights: bool = False,
    backend: str | None = None,
) -> Array:
    r"""Additive attention (Bahdanau et al. 2015).

    Scores :math:`a(q, k) = \tanh(q W_q + k W_k)\, w_v`, then a masked
    softmax over the keys and a weighted sum of the values.

    Parameters
    ----------
    query : array, shape (..., n, d_query)
    key : array, shape (..., m, d_key)
    value : array, shape (..., m, d_v)
    params : mapping
        ``w_q (d_query, h)``, ``w_k (d_key, h)``, ``w_v (h,)``: query and key
        widths may differ.
    mask, key_lengths :
        As in :func:`attnx.scaled_dot_product_attention`.
    return_weights : bool

    Returns
    -------
    output : array, shape (..., n, d_v)
    weights : array, shape (..., n, m), only with ``return_weights=True``
        In the inputs' dtype; half precision is computed in float32.

    Raises
    ------
    TypeError
        If an input is not an array of a registered backend, the inputs come
        from two backends, or ``backend=`` does not own them.
        If ``params`` holds arrays of another backend or dtype, ``mask`` is
        neither boolean nor real floating, ``key_lengths`` is not integer, or ``return_weights`` is
        not ``True`` or ``False``.
    ValueError
        If ``params`` lacks ``w_q``, ``w_k`` or ``w_v`` or holds one of
        another shape, ``key`` and ``value`` disagree on ``m``, the leading
        shapes do not broadcast, or a mask or ``key_lengths`` has another
        shape.
        If ``backend=`` names no registered backend, or the inputs lie on
        two different devices.
    BackendUnavailableError
        If the backend that would run the call cannot run here (its library is
        not installed, or it has no device).

    Notes
    -----
    The ``(..., n, m, h)`` intermediate is never held whole: queries go in
    chunks whose ``(..., chunk, m, h)`` part fits one block of the backend
    (:meth:`attnx.Backend.block_bytes_on` the inputs' device, within the
    memory budget: 4 MiB on the CPU, 512 MiB on a GPU; 16 MiB at least where
    a tracer unrolls the chunks, as ``torch.compile`` does), one query at
    least, through the backend's :meth:`~attnx.Backend.map_chunks` (under
    ``jax.jit``, one ``lax.map``: the traced program holds one chunk).

    Examples
    --------
    >>> import numpy as np
    >>> import attnx
    >>> rng = np.random.default_rng(0)
    >>> params = {"w_q": rng.standard_normal((8, 4)), "w_k": rng.standard_normal((6, 4)),
    ...           "w_v": rng.standard_normal(4)}
    >>> q = rng.standard_normal((2, 3, 8))   # (batch, n, d_query)
    >>> k = rng.standard_normal((2, 5, 6))   # (batch, m, d_key)
    >>> v = rng.standard_normal((2, 5, 7))   # (batch, m, d_v)
    >>> out, weights = attnx.additive_attention(q, k, v, params, key_lengths=np.array([5, 2]),
    ...                                         return_weights=True)
    >>> out.shape
    (2, 3, 7)
    >>> print(weights[1].round(2))
    [[0.5  0.5  0.   0.   0.  ]
     [0.04 0.96 0.   0.   0.  ]
     [0.15 0.85 0.   0.   0.  ]]
    """
    names = ("query", "key", "value", "mask", "key_lengths", "params['w_q']", "params['w_k']", "params['w_v']")
    getter = params.get if isinstance(params, Mapping) else (lambda name: None)
    chosen, reason = _dispatch.resolve(
        _ADD, backend, names, (query, key, value, mask, key_lengths, getter("w_q"), getter("w_k"), getter("w_v")), 3
    )
    xp = chosen.xp
    _checks.require_flag(_ADD, "return_weights", return_weights)
    check_additive(xp, query, key, value, params, mask, key_lengths)
    return _call(
        chosen,
        reason,
        {
            "query": query,
            "key": key,
            "value": value,
            "params": params,
            "mask": mask,
            "key_lengths": key_lengths,
            "return_weights": return_weights,
        },
    )


def _call(chosen: Any, reason: str, arguments: dict[str, Any]) -> Any:
    """The backend's native additive attention, else the generic one in
    chunks of the block size of the query's device."""
    options = {"block_bytes": _tiling.chunk_bytes(chosen, arguments["query"]), "map_chunks": chosen.map_chunks}
    return _dispatch.call(_ADD, chosen, reason, _additive_generic, arguments, options)


def check_additive(
    xp: Any,
    query: Any,
    key: Any,
    value: Any,
    params: Any,
    mask: Any,
    key_lengths: Any,
    operation: str = _ADD,
    names: tuple[str, str, str] = _checks.QKV,
    layouts: tuple[str, str, str] = ("(..., n, d_query)", "(..., m, d_key)", "(..., m, d_v)"),
) -> None:
    """Validate additive attention's inputs, named as the caller's arguments."""
    _checks.require_query_key_value(operation, xp, query, key, value, layouts, names)
    _checks.require_same_dtype(operation, names, (query, key, value))
    _params.require_mapping(operation, params, required=("w_q", "w_k", "w_v"), optional=())
    w_q = _params.matrix(operation, xp, params, "w_q", rows=query.shape[-1], rows_name="d_query", dtype=query.dtype)
    hidden = w_q.shape[1]
    _params.matrix(
        operation,
        xp,
        params,
        "w_k",
        rows=key.shape[-1],
        rows_name="d_key",
        cols=hidden,
        cols_name="h",
        dtype=query.dtype,
    )
    _params.vector(operation, xp, params, "w_v", size=hidden, dtype=query.dtype)
    batch_shape = _checks.leading_shape(query, key, value, operation, names)
    _masking.check_masks(
        operation, xp, mask, key_lengths, batch_shape, query.shape[-2], key.shape[-2], scores_dtype=query.dtype
    )


def additive_scores(
    xp: Any,
    query: Any,
    key: Any,
    params: Mapping[str, Any],
    block_bytes: int,
    map_chunks: Callable[..., Any],
) -> Any:
    """``tanh(q W_q + k W_k) w_v`` as ``(..., n, m)``, in chunks of queries
    whose ``(..., chunk, m, h)`` intermediate, every slice's, fits one block
    (:func:`attnx._tiling.bytes_per_block`): as many launches as a GPU's
    blocks need, and a CPU's intermediate within its memory budget.  The
    chunks go through ``map_chunks`` (the backend's
    :meth:`~attnx.Backend.map_chunks`), a loop in Python by default."""
    q = query @ params["w_q"]  # (..., n, h)
    k = key @ params["w_k"]  # (..., m, h)
    m, hidden = k.shape[-2], q.shape[-1]
    w_v = params["w_v"]
    # Sizes unknown (Dask, after a selection) count as 1: the chunks are then
    # planned on the known sizes alone.
    sizes = [size for size in (*_checks.leading_shape(q, k, k), m, hidden) if _checks.known(size)]
    step = _tiling.rows_per_chunk(block_bytes, _tiling.itemsize(xp, q.dtype) * math.prod(sizes))
    k = k[..., None, :, :]

    def scores_of(chunk: Any) -> Any:  # (..., c, h) -> (..., c, m)
        return xp.sum(xp.tanh(chunk[..., None, :] + k) * w_v, axis=-1)

    return map_chunks(scores_of, q, step)


def _additive_generic(
    xp: Any,
    *,
    query: Any,
    key: Any,
    value: Any,
    params: Mapping[str, Any],
    mask: Any,
    key_lengths: Any,
    return_weights: bool,
    block_bytes: int,
    map_chunks: Callable[..., Any],
) -> Any:
    # Half precision in float32, as attention: a float16 sum over 65,504 keys is inf.
    dtype = query.dtype
    compute, (query, key, value) = _checks.in_accumulation_dtype(xp, query, key, value)
    if compute != dtype:
        params = {name: xp.astype(array, compute) for name, array in params.items()}
    scores = additive_scores(xp, query, key, params, block_bytes, map_chunks)
    batch_shape = _checks.leading_shape(query, key, value)
    allowed, additive = _masking.combine(
        xp,
        mask=mask,
        key_lengths=key_lengths,
        is_causal=False,
        batch_shape=batch_shape,
        n=query.shape[-2],
        m=key.shape[-2],
        dtype=scores.dtype,
        device=_checks.device_of(query),
    )
    weights = _masking.softmax(xp, scores, allowed, additive)
    output = weights @ value
    if compute != dtype:
        output, weights = xp.astype(output, dtype), xp.astype(weights, dtype)
    if not return_weights:
        return output
    if tuple(weights.shape[:-2]) != tuple(batch_shape):  # leading dimensions only value had
        weights = xp.broadcast_to(weights, (*batch_shape, *weights.shape[-2:]))
    return output, weights


def bahdanau_context(
    decoder_state: Array,
    annotations: Array,
    params: Mapping[str, Any],
    *,
    key_lengths: Array = None,
    return_weights: bool = False,
    backend: str | None = None,
) -> Array:
    r"""One decoder step of Bahdanau attention: the context vector.

    :math:`C_t = \sum_i \alpha_{t,i} h_i` with
    :math:`\alpha_{t,i} = \mathrm{softmax}_i(a(s_{t-1}, h_i))` and ``a`` the
    additive score of :func:`additive_attention`.

    Parameters
    ----------
    decoder_state : array, shape (..., d_s)
        The previous decoder state :math:`s_{t-1}`.
    annotations : array, shape (..., T, d_h)
        The encoder states :math:`h_i`, serving as keys and values.
    params : mapping
        ``w_q (d_s, h)``, ``w_k (d_h, h)``, ``w_v (h,)``.
    key_lengths : integer array, shape (...), optional
        Valid annotations per sequence (padding).

    Returns
    -------
    context : array, shape (..., d_h)
    weights : array, shape (..., T), only with ``return_weights=True``

    Raises
    ------
    TypeError
        If an input is not an array of a registered backend, the inputs come
        from two backends, or ``backend=`` does not own them.
        If ``params`` holds arrays of another backend or dtype,
        ``key_lengths`` is not integer, or ``return_weights`` is not ``True``
        or ``False``.
    ValueError
        If ``params`` lacks ``w_q``, ``w_k`` or ``w_v`` or holds one of
        another shape, or ``decoder_state`` and ``annotations`` disagree on
        the batch.
        If ``backend=`` names no registered backend, or the inputs lie on
        two different devices.
    BackendUnavailableError
        If the backend that would run the call cannot run here (its library is
        not installed, or it has no device).

    Examples
    --------
    >>> import numpy as np
    >>> import attnx
    >>> rng = np.random.default_rng(0)
    >>> params = {"w_q": rng.standard_normal((8, 4)), "w_k": rng.standard_normal((6, 4)),
    ...           "w_v": rng.standard_normal(4)}
    >>> state = rng.standard_normal((2, 8))            # (batch, d_state)
    >>> annotations = rng.standard_normal((2, 5, 6))   # (batch, T, d_annotation)
    >>> context, weights = attnx.bahdanau_context(state, annotations, params, return_weights=True)
    >>> context.shape, weights.shape
    ((2, 6), (2, 5))
    >>> print(weights.sum(-1).round(6))
    [1. 1.]
    """
    op = "bahdanau_context"
    _checks.require_flag(op, "return_weights", return_weights)
    getter = params.get if isinstance(params, Mapping) else (lambda name: None)
    chosen, reason = _dispatch.resolve(
        op,
        backend,
        ("decoder_state", "annotations", "key_lengths", "params['w_q']", "params['w_k']", "params['w_v']"),
        (decoder_state, annotations, key_lengths, getter("w_q"), getter("w_k"), getter("w_v")),
        2,
    )
    xp = chosen.xp
    _checks.require_ndim(op, "decoder_state", decoder_state, 1, "(..., d_s)")
    query = decoder_state[..., None, :]  # one query per sequence
    names = ("decoder_state", "annotations", "annotations")
    layouts = ("(..., d_s)", "(..., T, d_h)", "(..., T, d_h)")
    check_additive(xp, query, annotations, annotations, params, None, key_lengths, op, names, layouts)
    arguments = {
        "query": query,
        "key": annotations,
        "value": annotations,
        "params": params,
        "mask": None,
        "key_lengths": key_lengths,
        "return_weights": return_weights,
    }
    result = _call(chosen, reason, arguments)
    if return_weights:
        return result[0][..., 0, :], result[1][..., 0, :]
    return result[..., 0, :]


def additive_attention_vjp(
    query: Any,
    key: Any,
    value: Any,
    params: Mapping[str, Any],
    *,
    mask: Any = None,
    key_lengths: Any = None,
    return_weights: bool = False,
    backend: str | None = None,
) -> tuple[Any, Callable[[Any], dict[str, Any]]]:
    """:func:`attnx.vjp` of :func:`additive_attention`: the output, and a
    backward giving ``query``, ``key``, ``value``, ``params`` (by name) and
    a real ``mask``'s, a chunk of queries at a time as the forward.

    With ``T = tanh(q W_q + k W_k)``, ``s = T w_v`` and ``P`` the masked
    softmax of ``s``: ``ds = P (g v^T - g . out)``, ``dT = ds w_v (1 - T^2)``,
    ``dw_v = sum ds T``; ``dT`` summed over the keys is the projected
    queries', over the queries the projected keys'."""
    operation = f"vjp({_ADD})"
    _checks.require_flag(operation, "return_weights", return_weights)
    if return_weights:
        raise ValueError(f"{operation}: return_weights=True has two outputs; differentiate the output alone")
    output = additive_attention(query, key, value, params, mask=mask, key_lengths=key_lengths, backend=backend)
    chosen = _dispatch.resolve(operation, backend, ("query", "key", "value"), (query, key, value), 3)[0]
    xp, block_bytes = chosen.xp, _tiling.chunk_bytes(chosen, query)
    real_mask = mask is not None and _checks.is_float_dtype(xp, mask.dtype)

    def backward(cotangent: Any) -> dict[str, Any]:
        _cotangents.require(operation, cotangent, output)
        dtype = query.dtype
        compute, (q_in, k_in, v_in, g, out) = _checks.in_accumulation_dtype(xp, query, key, value, cotangent, output)
        weights_of = {
            name: array if array.dtype == compute else xp.astype(array, compute) for name, array in params.items()
        }
        w_q, w_k, w_v = weights_of["w_q"], weights_of["w_k"], weights_of["w_v"]
        q, k = q_in @ w_q, k_in @ w_k  # (..., n, h), (..., m, h)
        batch_shape = _checks.leading_shape(q_in, k_in, v_in)
        n, m, hidden = q.shape[-2], k.shape[-2], q.shape[-1]
        sizes = [size for size in (*_checks.leading_shape(q, k, k), m, hidden) if _checks.known(size)]
        step = max(1, _tiling.rows_per_chunk(block_bytes, _tiling.itemsize(xp, compute) * math.prod(sizes)))
        device = _checks.device_of(query)
        d_q_rows, d_scores_rows = [], []
        d_k = d_value = None
        d_w_v = xp.zeros_like(w_v)
        for start in range(0, max(n, 1), step):  # a chunk of queries at a time, as the forward
            rows = (start, min(n, start + step))
            q_rows, g_rows, out_rows = (a[..., rows[0] : rows[1], :] for a in (q, g, out))
            turned = xp.tanh(q_rows[..., None, :] + k[..., None, :, :])  # (..., c, m, h)
            scores = xp.sum(turned * w_v, axis=-1)
            allowed, additive = _masking.combine(
                xp,
                mask=mask,
                key_lengths=key_lengths,
                is_causal=False,
                batch_shape=batch_shape,
                n=n,
                m=m,
                dtype=compute,
                device=device,
                rows=rows,
            )
            weights = _masking.softmax(xp, scores, allowed, additive)
            pulls = g_rows @ xp.matrix_transpose(v_in) - xp.sum(g_rows * out_rows, axis=-1, keepdims=True)
            d_scores = weights * pulls  # 0 where masked: the weight is 0 there
            if real_mask:
                d_scores_rows.append(d_scores)
            d_value_rows = xp.matrix_transpose(weights) @ g_rows
            d_value = d_value_rows if d_value is None else d_value + d_value_rows
            d_turned = d_scores[..., None] * (1.0 - turned * turned)  # times w_v below
            d_w_v = d_w_v + _cotangents.leading_sum(xp, d_scores[..., None] * turned, 1)
            d_turned = d_turned * w_v
            d_q_rows.append(xp.sum(d_turned, axis=-2))
            d_k_rows = xp.sum(d_turned, axis=-3)
            d_k = d_k_rows if d_k is None else d_k + d_k_rows
        d_q = xp.concat(d_q_rows, axis=-2) if len(d_q_rows) > 1 else d_q_rows[0]
        grads = {
            "query": _cotangents.like(xp, d_q @ xp.matrix_transpose(w_q), query),
            "key": _cotangents.like(xp, d_k @ xp.matrix_transpose(w_k), key),
            "value": _cotangents.like(xp, d_value, value),
            "params": {
                "w_q": _cotangents.leading_sum(xp, xp.matrix_transpose(q_in) @ d_q, 2),
                "w_k": _cotangents.leading_sum(xp, xp.matrix_transpose(k_in) @ d_k, 2),
                "w_v": d_w_v,
            },
        }
        grads["params"] = {
            name: g_ if g_.dtype == dtype else xp.astype(g_, dtype) for name, g_ in grads["params"].items()
        }
        if real_mask:  # added to the scores: their gradient, summed over its broadcast axes
            d_mask = xp.concat(d_scores_rows, axis=-2) if len(d_scores_rows) > 1 else d_scores_rows[0]
            grads["mask"] = _cotangents.like(xp, d_mask, mask)
        return grads

    return output, backward


def bahdanau_context_vjp(
    decoder_state: Any,
    annotations: Any,
    params: Mapping[str, Any],
    *,
    key_lengths: Any = None,
    return_weights: bool = False,
    backend: str | None = None,
) -> tuple[Any, Callable[[Any], dict[str, Any]]]:
    """:func:`attnx.vjp` of :func:`bahdanau_context`: additive attention's
    backward with one query a sequence, the annotations' gradient as keys
    and as values summed."""
    operation = "vjp(bahdanau_context)"
    _checks.require_flag(operation, "return_weights", return_weights)
    if return_weights:
        raise ValueError(f"{operation}: return_weights=True has two outputs; differentiate the context alone")
    context = bahdanau_context(decoder_state, annotations, params, key_lengths=key_lengths, backend=backend)
    _, attention_backward = additive_attention_vjp(
        decoder_state[..., None, :], annotations, annotations, params, key_lengths=key_lengths, backend=backend
    )

    def backward(cotangent: Any) -> dict[str, Any]:
        _cotangents.require(operation, cotangent, context)
        grads = attention_backward(cotangent[..., None, :])
        return {
            "decoder_state": grads["query"][..., 0, :],
            "annotations": grads["key"] + grads["value"],
            "params": grads["params"],
        }

    return context, backward
