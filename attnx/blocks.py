"""Partial attention states: the online softmax as building blocks.

For backends and users that cut attention their own way: over the chunks
of a lazy array, over workers, over devices.  A *state* summarises what
some queries gathered from some of the keys, as one array of shape
``(..., n, d_v + 2)``:

- ``state[..., :d_v]``: the values weighted by ``exp(score - max)``, summed;
- ``state[..., d_v]``: the sum of those weights;
- ``state[..., d_v + 1]``: ``max``, the largest score seen (``-inf`` where
  every key so far was masked).

States of disjoint sets of keys :func:`combine` associatively and
commutatively, so the keys may be split in any way and the parts merged
in any order or tree (Rabe and Staats 2021; the FlashAttention
recurrence); :func:`finish` turns a state into the attention output.
A query with nothing to attend ends with zeros, never NaN.

Every function works on the arrays of any array API library (the blocks
of a Dask array, say), and none reads an array's values.

Examples
--------
>>> import numpy as np
>>> from attnx import blocks
>>> rng = np.random.default_rng(0)
>>> q, k, v = rng.normal(size=(4, 8)), rng.normal(size=(6, 8)), rng.normal(size=(6, 3))
>>> left = blocks.attend_block(q, k[:2], v[:2], scale=0.5)
>>> right = blocks.attend_block(q, k[2:], v[2:], scale=0.5, offset=(0, 2), scores_shape=(4, 6))
>>> whole = blocks.finish(blocks.combine(left, right))
>>> bool(np.allclose(whole, blocks.finish(blocks.attend_block(q, k, v, scale=0.5))))
True
"""

from __future__ import annotations

from typing import Any

from attnx import _checks, _masking

__all__ = [
    "attend_block",
    "attend_block_vjp",
    "combine",
    "combine_along",
    "finish",
    "from_scores",
    "from_weights",
    "lengths_mask",
    "pack",
    "state_dtype",
]


def from_scores(scores: Any, value: Any, *, allowed: Any = None, additive: Any = None, xp: Any = None) -> Any:
    """The state of ``softmax(scores) @ value`` before normalisation.

    Parameters
    ----------
    scores : array, shape (..., n, m)
        Real scores (logits), ``-inf`` where masked; overwritten where its
        library allows it.
    value : array, shape (..., m, d_v)
    allowed : boolean array, optional
        Broadcastable to ``scores``: ``False`` masks a key.
    additive : array, optional
        Broadcastable to ``scores``, added to them (``-inf`` masks).

    Returns
    -------
    array, shape (..., n, d_v + 2)
    """
    xp = xp or _checks.common_namespace(scores, value)
    _require_scores_and_values("from_scores", scores, value, "scores")
    if 0 in tuple(scores.shape):  # no query or no key: a maximum of nothing is undefined (Dask won't take one)
        leading, device = tuple(scores.shape[:-1]), _checks.device_of(scores)
        nothing = xp.zeros((*leading, value.shape[-1] + 1), dtype=scores.dtype, device=device)
        return xp.concat([nothing, xp.full((*leading, 1), -float("inf"), dtype=scores.dtype, device=device)], axis=-1)
    exp_scores, row_max = _masking.unnormalised_softmax(xp, scores, allowed, additive, scores_may_mask=True)
    total = xp.sum(exp_scores, axis=-1, keepdims=True)
    return pack(xp, exp_scores @ value, total, row_max)


def from_weights(weights: Any, value: Any, *, xp: Any = None) -> Any:
    """The state of non-negative ``weights`` (a kernel's, say, not yet
    normalised) over ``value``: as :func:`from_scores` of ``log(weights)``,
    without the logarithm.  Shapes as in :func:`from_scores`."""
    xp = xp or _checks.common_namespace(weights, value)
    _require_scores_and_values("from_weights", weights, value, "weights")
    total = xp.sum(weights, axis=-1, keepdims=True)
    return pack(xp, weights @ value, total, xp.zeros_like(total))


def _require_scores_and_values(operation: str, scores: Any, value: Any, name: str) -> None:
    """``scores (..., n, m)`` and ``value (..., m, d_v)`` that fit, with
    leading shapes that broadcast; a ValueError naming them otherwise."""
    _checks.require_ndim(operation, name, scores, 2, "(..., n, m)")
    _checks.require_ndim(operation, "value", value, 2, "(..., m, d_v)")
    m = scores.shape[-1]
    if value.shape[-2] != m and _checks.known(value.shape[-2], m):
        raise ValueError(
            f"{operation}: value must have shape (..., m, d_v) with m = {m} (from {name}), got {_checks.shape_of(value)}"
        )
    _checks.broadcast(operation, {name: scores.shape[:-2], "value": value.shape[:-2]}, _checks.LEADING)


def _require_states(operation: str, named: dict[str, Any]) -> None:
    """States ``(..., n, d_v + 2)`` of one ``d_v`` whose leading shapes
    broadcast; a ValueError naming them otherwise."""
    for name, state in named.items():
        _checks.require_ndim(operation, name, state, 2, "(..., n, d_v + 2)")
        if _checks.known(state.shape[-1]) and state.shape[-1] < 2:
            raise ValueError(
                f"{operation}: {name} must be a state of shape (..., n, d_v + 2), got {_checks.shape_of(state)}"
            )
    widths = {state.shape[-1] for state in named.values()}
    if len(widths) > 1 and _checks.known(*widths):
        described = ", ".join(f"{name} {_checks.shape_of(state)}" for name, state in named.items())
        raise ValueError(f"{operation}: states must have one width d_v + 2, got {described}")
    _checks.broadcast(operation, {name: state.shape[:-1] for name, state in named.items()}, "states' shapes (..., n)")


def pack(xp: Any, weighted: Any, *columns: Any) -> Any:
    """A state from its parts, concatenated on the last axis: the weighted
    values ``(..., n, d_v)`` (or with the sum of the weights as their last
    column already), then the sum ``(..., n, 1)`` if not, and the row maxima
    ``(..., n, 1)``.  Parts broadcast to the leading shape of ``weighted``."""
    leading = tuple(weighted.shape[:-1])
    columns = tuple(c if tuple(c.shape[:-1]) == leading else xp.broadcast_to(c, (*leading, 1)) for c in columns)
    return xp.concat([weighted, *columns], axis=-1)


def attend_block(
    query: Any,
    key: Any,
    value: Any,
    *,
    scale: Any,
    mask: Any = None,
    is_causal: bool = False,
    offset: tuple[int, int] = (0, 0),
    scores_shape: tuple[int, int] | None = None,
    xp: Any = None,
) -> Any:
    """The state of a block of queries over a block of keys.

    Parameters
    ----------
    query : array, shape (..., rows, d_k)
    key : array, shape (..., cols, d_k)
    value : array, shape (..., cols, d_v)
        Half precision is computed in float32; the state is float32 then.
    scale : float or 0-d array
        Multiplies the scores.
    mask : array or tuple of arrays, optional
        This block's masks, each broadcastable to ``(..., rows, cols)``:
        boolean (``True`` attends) or real (added).  All apply.
    is_causal : bool
        The causal mask of :func:`attnx.scaled_dot_product_attention`
        (aligned to the end), at this block's place in the whole scores.
    offset : (int, int)
        The block's first query and first key in the whole scores.
    scores_shape : (int, int), optional
        ``(n, m)`` of the whole scores; the block's own by default.  Only
        the causal mask needs the place and the whole.

    Returns
    -------
    array, shape (..., rows, d_v + 2)
        A block wholly in the causal future is never multiplied: its state
        says that nothing was attended.
    """
    xp = xp or _checks.common_namespace(query, key, value)
    layouts = ("(..., rows, d_k)", "(..., cols, d_k)", "(..., cols, d_v)")
    _checks.require_query_key_value("attend_block", xp, query, key, value, layouts)
    if key.shape[-1] != query.shape[-1] and _checks.known(key.shape[-1], query.shape[-1]):
        raise ValueError(
            f"attend_block: key must have shape (..., cols, d_k) with d_k = {query.shape[-1]} (from query), "
            f"got {_checks.shape_of(key)}"
        )
    _checks.leading_shape(query, key, value, "attend_block")
    compute, (query, key, value) = _checks.in_accumulation_dtype(xp, query, key, value)
    future, allowed, additive = _block_masks(xp, query, key, compute, mask, is_causal, offset, scores_shape)
    if future:
        leading, rows, device = _checks.leading_shape(query, key, value), query.shape[-2], _checks.device_of(query)
        nothing = xp.zeros((*leading, rows, value.shape[-1] + 1), dtype=compute, device=device)
        return xp.concat([nothing, xp.full((*leading, rows, 1), -float("inf"), dtype=compute, device=device)], axis=-1)
    return from_scores((query * scale) @ xp.matrix_transpose(key), value, allowed=allowed, additive=additive, xp=xp)


def _block_masks(
    xp: Any,
    query: Any,
    key: Any,
    compute: Any,
    mask: Any,
    is_causal: bool,
    offset: tuple[int, int],
    scores_shape: tuple[int, int] | None,
) -> tuple[bool, Any, Any]:
    """``(future, allowed, additive)`` of a block (:func:`attend_block`'s
    arguments): whether every key lies in every query's causal future, and
    the block's masks combined, boolean and real (each None where absent)."""
    rows, cols = query.shape[-2], key.shape[-2]
    n, m = scores_shape if scores_shape is not None else (rows, cols)
    r0, c0 = offset
    allowed = additive = None
    if is_causal:
        if c0 > r0 + rows - 1 + (m - n):
            return True, None, None
        allowed = _masking.causal(xp, n, m, device=_checks.device_of(query), rows=(r0, r0 + rows), cols=(c0, c0 + cols))
    for one in mask if isinstance(mask, tuple) else (mask,):
        allowed, additive = _masking.with_mask(xp, allowed, additive, one, compute)
    return False, allowed, additive


def attend_block_vjp(
    query: Any,
    key: Any,
    value: Any,
    d_output: Any,
    state: Any,
    *,
    scale: Any,
    mask: Any = None,
    is_causal: bool = False,
    offset: tuple[int, int] = (0, 0),
    scores_shape: tuple[int, int] | None = None,
    xp: Any = None,
) -> tuple[Any, Any, Any, Any]:
    """A block's parts of attention's gradients: FlashAttention-2's backward
    of one block of queries over one block of keys.

    Summed over the blocks of keys, the parts of ``d_query`` are the
    gradient of the queries; summed over the blocks of queries, those of
    ``d_key`` and ``d_value`` are the keys' and values'.  Each block makes
    its weights again from ``state``, so no block needs another's.

    Parameters
    ----------
    query, key, value, scale, mask, is_causal, offset, scores_shape
        As for :func:`attend_block`.
    d_output : array, shape (..., rows, d_v)
        The gradient of the attention output of these queries (over every key).
    state : array, shape (..., rows, d_v + 2)
        The combined state of these queries over *every* key (whose
        :func:`finish` is their output), in the state dtype.

    Returns
    -------
    d_query : array, shape (..., rows, d_k)
    d_key : array, shape (..., cols, d_k)
    d_value : array, shape (..., cols, d_v)
    d_scale : array, shape (..., rows, 1)
        Each query's part of the gradient of ``scale``, over this block's keys.

    All over the leading shape the inputs broadcast to (sum them to an
    input's own), in the state dtype.  A key that no query of the block may
    attend, and a query with nothing to attend, get zeros, never NaN.

    Examples
    --------
    >>> import numpy as np
    >>> from attnx import blocks
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = rng.normal(size=(4, 8)), rng.normal(size=(6, 8)), rng.normal(size=(6, 3))
    >>> state = blocks.attend_block(q, k, v, scale=0.5)
    >>> d_out = rng.normal(size=(4, 3))
    >>> left = blocks.attend_block_vjp(q, k[:2], v[:2], d_out, state, scale=0.5)
    >>> right = blocks.attend_block_vjp(q, k[2:], v[2:], d_out, state, scale=0.5, offset=(0, 2), scores_shape=(4, 6))
    >>> whole = blocks.attend_block_vjp(q, k, v, d_out, state, scale=0.5)
    >>> bool(np.allclose(left[0] + right[0], whole[0]))
    True
    >>> bool(np.allclose(np.concatenate([left[1], right[1]]), whole[1]))
    True
    """
    xp = xp or _checks.common_namespace(query, key, value, d_output, state)
    layouts = ("(..., rows, d_k)", "(..., cols, d_k)", "(..., cols, d_v)")
    _checks.require_query_key_value("attend_block_vjp", xp, query, key, value, layouts)
    _require_states("attend_block_vjp", {"state": state})
    d_v = value.shape[-1]
    if tuple(state.shape[-2:]) != (query.shape[-2], d_v + 2) or tuple(d_output.shape[-2:]) != (query.shape[-2], d_v):
        raise ValueError(
            f"attend_block_vjp: d_output and state must have shapes (..., rows, d_v) and (..., rows, d_v + 2) "
            f"with rows = {query.shape[-2]} and d_v = {d_v}, got {_checks.shape_of(d_output)} and {_checks.shape_of(state)}"
        )
    compute, (query, key, value, d_output) = _checks.in_accumulation_dtype(xp, query, key, value, d_output)
    future, allowed, additive = _block_masks(xp, query, key, compute, mask, is_causal, offset, scores_shape)
    leading = _checks.broadcast(
        "attend_block_vjp",
        {
            name: a.shape[:-2]
            for name, a in zip(_checks.QKV + ("d_output", "state"), (query, key, value, d_output, state))
        },
        _checks.LEADING,
    )
    device = _checks.device_of(query)
    if future:  # no weight: no gradient
        rows, cols = query.shape[-2], key.shape[-2]
        shapes = ((rows, query.shape[-1]), (cols, key.shape[-1]), (cols, d_v), (rows, 1))
        return tuple(xp.zeros((*leading, *shape), dtype=compute, device=device) for shape in shapes)
    row_max, total = state[..., -1:], _masking.nonzero_total(xp, state[..., -2:-1])
    shift = xp.sum(d_output * finish(state, xp=xp), axis=-1, keepdims=True)  # rowsum(dO * O)
    raw = query @ xp.matrix_transpose(key)  # the scores, unscaled
    weights, _ = _masking.unnormalised_softmax(xp, raw * scale, allowed, additive, running_max=row_max)
    probabilities = weights / total  # 0 where masked or nothing attended
    d_scores = probabilities * (d_output @ xp.matrix_transpose(value) - shift)
    d_rows = d_scores @ key  # d_query unscaled
    return (
        d_rows * scale,
        xp.matrix_transpose(d_scores) @ (query * scale),
        xp.matrix_transpose(probabilities) @ d_output,
        xp.sum(d_scores * raw, axis=-1, keepdims=True),
    )


def combine(first: Any, second: Any, *, xp: Any = None) -> Any:
    """The state of the union of two disjoint sets of keys (broadcasting)."""
    xp = xp or _checks.common_namespace(first, second)
    _require_states("combine", {"first": first, "second": second})
    row_max = xp.maximum(first[..., -1:], second[..., -1:])
    shift = _masking.finite_shift(xp, row_max)
    summed = _rescaled(xp, first, shift) + _rescaled(xp, second, shift)
    return xp.concat([summed, xp.broadcast_to(row_max, (*summed.shape[:-1], 1))], axis=-1)


def combine_along(states: Any, axis: int, *, keepdims: bool = False, xp: Any = None) -> Any:
    """The combined state of the states stacked along ``axis`` (not the
    last): a reduction, as for the partial results of a tree."""
    xp = xp or _checks.common_namespace(states)
    _require_states("combine_along", {"states": states})
    axis = _checks.require_int("combine_along", "axis", axis)
    if not -states.ndim <= axis < states.ndim:
        raise ValueError(f"combine_along: axis must lie in [-{states.ndim}, {states.ndim}), got {axis}")
    axis = axis % states.ndim
    if axis == states.ndim - 1:
        raise ValueError(f"combine_along: axis must not be the last (the state's own), got {axis}")
    row_max = xp.max(states[..., -1:], axis=axis, keepdims=True)
    summed = xp.sum(_rescaled(xp, states, _masking.finite_shift(xp, row_max)), axis=axis, keepdims=True)
    state = xp.concat([summed, row_max], axis=-1)
    return state if keepdims else xp.squeeze(state, axis=axis)


def _rescaled(xp: Any, state: Any, shift: Any) -> Any:
    """A state's weighted values and sum, ``(..., d_v + 1)``, moved from its
    own maximum to ``shift`` (a finite maximum over the states combined).
    A state that attended nothing (maximum ``-inf``) gives zeros: its factor
    is ``exp(-inf - shift) = 0``, never NaN."""
    return state[..., :-1] * xp.exp(state[..., -1:] - shift)


def finish(state: Any, *, dtype: Any = None, xp: Any = None) -> Any:
    """The attention output ``(..., n, d_v)`` of a state: the weighted values
    over the sum of the weights (zeros where nothing was attended), in
    ``dtype`` (the state's by default)."""
    xp = xp or _checks.common_namespace(state)
    _require_states("finish", {"state": state})
    output = state[..., :-2] / _masking.nonzero_total(xp, state[..., -2:-1])
    return output if dtype is None or output.dtype == dtype else xp.astype(output, dtype)


def lengths_mask(
    key_lengths: Any, batch_shape: tuple[int, ...], n: int, m: int, *, xp: Any = None, positions: Any = None
) -> Any:
    """``key_lengths``, in any layout :func:`attnx.scaled_dot_product_attention`
    accepts, as a boolean mask broadcastable to ``(*batch_shape, n, m)``
    (``True`` for keys ``j < length``): for backends that cut the masks into
    blocks with the scores.  ``positions``, shape ``(m,)``: the keys' ``j``
    where the namespace's ``arange`` would not make them of the lengths'
    kind (Dask's ``arange`` makes NumPy chunks, whatever the lengths' are)."""
    xp = xp or _checks.common_namespace(key_lengths)
    return _masking.lengths_mask(xp, key_lengths, tuple(batch_shape), n, m, positions=positions)


def state_dtype(xp: Any, dtype: Any) -> Any:
    """The dtype of the states of inputs of ``dtype``: float32 for half
    precision (computed in float32), the inputs' own otherwise."""
    return _checks.accumulation_dtype(xp, dtype)
