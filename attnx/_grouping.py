"""Grouped-query heads (``enable_gqa``): one home for their rule and layout.

PyTorch's rule: query head ``h`` of ``H`` reads key/value head
``h // (H / H_kv)``.  attnx computes it without copying a key: the query
heads are regrouped as ``(..., H_kv, G, n, d)`` (a reshape) against keys
``(..., H_kv, 1, m, d)``, which broadcast over the ``G`` heads of their
group; masks and ``key_lengths`` with a head axis are regrouped alike.
Row-major order is unchanged, so a grouped head's slice index (which the
dropout mask hashes) is its query head's.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from attnx import _checks, _masking

__all__ = ["check_heads", "group", "key_groups", "regroup", "require_multiple", "ungroup"]


def check_heads(operation: str, query: Any, key: Any, value: Any) -> tuple[int, int]:
    """``(H, H_kv)`` of inputs ``(..., H, n, d_k)``, ``(..., H_kv, m, d_k)``
    and ``(..., H_kv, m, d_v)``, or a ValueError naming what differs."""
    for name, array, layout in (
        ("query", query, "(..., H, n, d_k)"),
        ("key", key, "(..., H_kv, m, d_k)"),
        ("value", value, "(..., H_kv, m, d_v)"),
    ):
        if array.ndim < 3:
            raise ValueError(
                f"{operation}: with enable_gqa=True, {name} must have shape {layout}, got shape {_checks.shape_of(array)}"
            )
    _checks.require_known(operation, "enable_gqa", {"query": query, "key": key, "value": value}, axes=(-3,))
    heads, kv_heads = query.shape[-3], key.shape[-3]
    if value.shape[-3] != kv_heads:
        raise ValueError(
            f"{operation}: value must have shape (..., H_kv, m, d_v) with H_kv = {kv_heads} (from key), "
            f"got {_checks.shape_of(value)}"
        )
    require_multiple(operation, heads, kv_heads)
    return heads, kv_heads


def require_multiple(operation: str, heads: int, kv_heads: int) -> None:
    if kv_heads == 0 or heads % kv_heads:
        raise ValueError(
            f"{operation}: with enable_gqa=True the query heads H must be a multiple of the key/value heads H_kv, "
            f"got H = {heads} and H_kv = {kv_heads}"
        )


def _split_heads(xp: Any, array: Any, axis: int, kv_heads: int, groups: int) -> Any:
    """``array`` with its head axis ``axis`` (negative; size ``H`` or 1) as
    the two axes ``(H_kv, G)`` (or ``(1, 1)``)."""
    shape = tuple(array.shape)
    at = array.ndim + axis
    pair = (1, 1) if shape[at] == 1 else (kv_heads, groups)
    return xp.reshape(array, (*shape[:at], *pair, *shape[at + 1 :]))


class GroupedCall(NamedTuple):
    """A validated SDPA call's arrays, rules and sizes: the broadcasting
    call that computes a grouped one (:func:`regroup`), or a call as given."""

    query: Any
    key: Any
    value: Any
    mask: Any
    key_lengths: Any
    is_causal: bool
    batch_shape: tuple[int, ...]
    n: int


def regroup(
    xp: Any,
    *,
    query: Any,
    key: Any,
    value: Any,
    mask: Any,
    key_lengths: Any,
    is_causal: bool,
    batch_shape: tuple[int, ...],
    n: int,
    fold: bool = True,
) -> GroupedCall:
    """A validated grouped call (its ``batch_shape`` ending in ``H``) as the
    broadcasting call that computes it, with the heads as ``(H_kv, G)``.

    With ``fold``, where no mask tells a group's heads or its queries apart
    (decoding: one query, masks by key only), the ``G`` heads of a group
    become ``G * n`` rows of one head instead: each key is then read once
    for the whole group, in one matrix product where there were ``G``
    products with one row each.  The caller's ``fold=False`` keeps the
    grouped slices (dropout hashes each slice's rows)."""
    heads, kv_heads = query.shape[-3], key.shape[-3]
    groups = heads // kv_heads
    query = _split_heads(xp, query, -3, kv_heads, groups)
    key, value = xp.expand_dims(key, axis=-3), xp.expand_dims(value, axis=-3)
    if mask is not None and mask.ndim >= 3:  # (..., H or 1, n, m)
        mask = _split_heads(xp, mask, -3, kv_heads, groups)
    layout = None
    if key_lengths is not None:
        layout = _masking.lengths_layout(_checks.shape_of(key_lengths), batch_shape, n)
        # One per query (..., H, n); the leading shape, aligned to its end: (..., H).
        if layout == "per_query":
            key_lengths = _split_heads(xp, key_lengths, -2, kv_heads, groups)
        elif layout == "per_sequence" and key_lengths.ndim:
            key_lengths = _split_heads(xp, key_lengths, -1, kv_heads, groups)
    grouped = GroupedCall(query, key, value, mask, key_lengths, is_causal, (*batch_shape[:-1], kv_heads, groups), n)
    return _folded(xp, grouped, layout) if fold and groups > 1 and _checks.known(n) else grouped


#: A causal call folds only where its queries are at most this fraction of
#: its keys (decoding, chunked prefill): folded, the rule becomes one key
#: count per row, and the tiles no longer skip the future (at most 1/16 of
#: the scores, then computed and masked).
FOLD_CAUSAL = 8


def _folded(xp: Any, call: GroupedCall, layout: str | None) -> GroupedCall:
    """``call`` with each group's ``G`` heads as ``G * n`` rows of one head,
    where no mask tells them apart; else ``call`` itself."""
    mask, lengths, n, m = call.mask, call.key_lengths, call.n, call.key.shape[-2]
    if mask is not None:
        if mask.ndim >= 3 and mask.shape[-3] != 1:
            return call  # one mask per head
        if mask.ndim >= 2 and mask.shape[-2] != 1 and n != 1:
            return call  # one mask per query, whose rows the fold would have to repeat
        if mask.ndim >= 3:
            mask = xp.reshape(mask, (*mask.shape[:-3], *mask.shape[-2:]))  # (..., 1, n or 1, m): its G axis goes
    groups = call.batch_shape[-1]
    counts = None  # one length per query, where the rows differ
    if call.is_causal and n > 1:
        if n * FOLD_CAUSAL > m:
            return call
        counts = _masking.key_counts(xp, lengths, True, call.batch_shape, n, m, _checks.device_of(call.query))
    elif layout == "per_query":  # (..., H_kv or 1, G or 1, n or 1)
        counts = lengths
    elif layout == "per_sequence" and lengths.ndim:  # (..., H_kv or 1, G or 1)
        if lengths.shape[-1] != 1:
            return call  # lengths per head
        lengths = xp.reshape(lengths, tuple(lengths.shape[:-1]))
    if counts is not None:
        if counts.ndim >= 2 and counts.shape[-2] != 1:
            return call  # lengths per head
        # The group's rows g * n + i: each query's length, for each head of the group (a few integers).
        counts = xp.broadcast_to(counts, (*call.batch_shape, n))
        lengths = xp.reshape(counts, (*call.batch_shape[:-1], groups * n))
    query = call.query
    return GroupedCall(
        xp.reshape(query, (*query.shape[:-3], groups * n, query.shape[-1])),
        xp.squeeze(call.key, axis=-3),
        xp.squeeze(call.value, axis=-3),
        mask,
        lengths,
        False,  # one query a head attends every key; more: counted in the lengths above
        call.batch_shape[:-1],
        groups * n,
    )


def key_groups(query_shape: tuple[int, ...], key_shape: tuple[int, ...], value_shape: tuple[int, ...]) -> int:
    """``G`` of the layout :func:`regroup` makes (keys and values broadcast
    over the queries' last leading axis alone), else 1: natives read it
    through :func:`attnx.natives.key_groups`."""
    lead = tuple(query_shape[:-2])
    if len(lead) < 2 or lead[-1] == 1:
        return 1
    grouped = (*lead[:-1], 1)
    return lead[-1] if tuple(key_shape[:-2]) == grouped == tuple(value_shape[:-2]) else 1


def ungroup(xp: Any, array: Any, shape: tuple[int, ...]) -> Any:
    """An array of the call :func:`regroup` made, ``(..., H_kv, G, n, x)``
    or folded ``(..., H_kv, G * n, x)`` (an output, weights, a query's
    cotangent), as ``shape``, ``(..., H, n, x)``."""
    if array.ndim == len(shape):  # folded: its rows first, as Dask reshapes one axis at a time
        array = xp.reshape(array, (*array.shape[:-2], shape[-3] // array.shape[-3], shape[-2], array.shape[-1]))
    return xp.reshape(array, shape)


def group(xp: Any, array: Any, shape: tuple[int, ...]) -> Any:
    """The inverse of :func:`ungroup`: ``(..., H, n, x)`` as ``shape``, the
    grouped or folded layout."""
    if array.ndim == len(shape):  # folded: its heads first
        kv_heads = shape[-3]
        array = xp.reshape(array, (*array.shape[:-3], kv_heads, array.shape[-3] // kv_heads, *array.shape[-2:]))
    return xp.reshape(array, shape)
