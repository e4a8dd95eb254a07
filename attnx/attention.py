"""Scaled dot-product attention and the masked softmax."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

from attnx import _checks, _dispatch, _masking, blocks
from attnx._config import get_memory_budget

__all__ = ["masked_softmax", "scaled_dot_product_attention"]

_SDPA = "scaled_dot_product_attention"
_SDPA_ARGS = ("query", "key", "value", "mask", "key_lengths", "scale")


def scaled_dot_product_attention(
    query: Any,
    key: Any,
    value: Any,
    *,
    mask: Any = None,
    key_lengths: Any = None,
    is_causal: bool = False,
    scale: float | Any | None = None,
    return_weights: bool = False,
    chunk_size: int | tuple[int, int] | None = None,
    backend: str | None = None,
) -> Any:
    r"""Scaled dot-product attention, :math:`\mathrm{softmax}(q k^T s + M) v`.

    Parameters
    ----------
    query : array, shape (..., n, d_k)
    key : array, shape (..., m, d_k)
    value : array, shape (..., m, d_v)
        Leading dimensions broadcast against each other, so one key/value
        head can serve many query heads.  All three share one floating dtype.
    mask : array, optional
        Broadcastable to ``(..., n, m)``.  Boolean: ``True`` where a query may
        attend a key (PyTorch SDPA's convention, the inverse of
        ``nn.MultiheadAttention``'s).  Real-valued: added to the scores, with
        ``-inf`` forbidding.
    key_lengths : integer array, optional
        Keys at positions ``>= length`` are ignored (padding).  Shape ``(B,)``
        with one length per sequence of the batch (``B`` is the first leading
        dimension, shared by the others, such as heads), or the leading shape
        ``(...)`` (broadcastable), or ``(..., n)`` for one length per query.
    is_causal : bool
        Query ``i`` attends key ``j`` only where ``j <= i + (m - n)``: aligned
        to the end, the usual lower triangle when ``n == m`` and right for
        decoding with cached keys.  (PyTorch aligns to the start; pass
        ``mask=attnx.masks.causal(n, m, align="top_left")`` for that.)
    scale : float or 0-d array, optional
        Multiplies the scores; ``1 / sqrt(d_k)`` by default.  A 0-d array of
        the inputs' backend may be traced (``jax.jit``, ``torch.compile``)
        and receives gradients.
    return_weights : bool
        Also return the attention weights.
    chunk_size : int or (int, int), optional
        Use the memory-efficient algorithm (:func:`sdpa_chunked`) with this
        many queries (and keys) per block and (batch, head) slice.  By
        default it is used when the score matrix would exceed the memory
        budget (:func:`attnx.set_memory_budget`, 4 MiB unless set).  It
        never materialises the weights, so it can't be combined with
        ``return_weights=True``.  A backend's native implementation may cut
        the work its own way, within the same budget.
    backend : str, optional
        Run on this backend; by default the one that owns the inputs.

    Returns
    -------
    output : array, shape (..., n, d_v)
        Same array type, dtype and device as ``query``.
    weights : array, shape (..., n, m)
        Only with ``return_weights=True``.

    Notes
    -----
    All masks combine.  A query with no key left to attend gets zeros as
    output and as weights, never NaN.  Half-precision inputs are computed
    in float32 and returned in their own dtype.

    Native implementations are called with the keyword arguments ``query``,
    ``key``, ``value``, ``mask``, ``key_lengths``, ``is_causal``, ``scale``
    (a float, or a 0-d array in the computation's dtype), ``return_weights``,
    ``chunks`` (None, or the ``(query_chunk, key_chunk)`` per (batch, head)
    slice the generic algorithm would use: ``chunk_size`` when given),
    ``batch_shape`` (the broadcast leading shape) and ``chunk_size`` (the
    user's, None unless given: a native that honours it cuts its blocks so),
    after validation.
    """
    chosen, reason = _dispatch.resolve(
        _SDPA, backend, _SDPA_ARGS, (query, key, value, mask, key_lengths, _checks.scale_array(scale)), 3
    )
    xp = chosen.xp
    if is_causal is not False or return_weights is not False:  # the common call skips the checks
        _checks.require_flag(_SDPA, "is_causal", is_causal)
        _checks.require_flag(_SDPA, "return_weights", return_weights)
        if is_causal:
            _checks.require_known(_SDPA, "is_causal", {"query": query, "key": key})
    scale, batch_shape, n, m = check_attention_inputs(_SDPA, xp, query, key, value, mask, key_lengths, scale)
    chunks = choose_chunks(
        xp, query.dtype, n, m, batch_shape, chunk_size, return_weights, is_causal, chosen.concurrent_blocks
    )
    return _dispatch.call(
        _SDPA,
        chosen,
        reason,
        sdpa_generic,
        {
            "query": query,
            "key": key,
            "value": value,
            "mask": mask,
            "key_lengths": key_lengths,
            "is_causal": is_causal,
            "scale": scale,
            "return_weights": return_weights,
            "chunks": chunks,
            "batch_shape": batch_shape,
            "chunk_size": chunk_size,
        },
        {"map_blocks": chosen.map_blocks, "concurrent_blocks": chosen.concurrent_blocks}
        if chunks is not None
        else None,
    )


#: Target size of one block of scores in the chunked algorithm, in bytes:
#: small enough to stay in cache, large enough for efficient matrix products.
#: The memory budget caps it, and blocks run at once share it.
BLOCK_BYTES = 4 * 2**20
#: Keys per block (Rabe and Staats use 4096).
KEY_CHUNK = 4096
#: Query rows per block, at least: below 64 rows a (rows x 64) @ (64 x 512)
#: float32 product on one core loses a fifth of its speed or more (measured
#: on an AMD EPYC with AVX2 and OpenBLAS: 78-86 GFLOP/s from 64 rows up, 67
#: at 32, 46 at 16), so blocks shrink in keys and slices before in rows.
MIN_ROWS = 64
#: Query rows per causal block, at most, as a fraction of n: thinner blocks
#: skip more of the future (a block computes up to its own square in vain).
CAUSAL_BLOCKS = 8
#: Scores (elements) from which a backend that runs blocks concurrently gets
#: the chunked algorithm within the memory budget too: below, threads cost
#: more than they save (measured on NumPy, 2 cores: 1.3x faster at 8 x 128 x
#: 128 scores, 1.7x at 8 x 256 x 256, 2x slower at 8 x 64 x 64).
PARALLEL_SCORES = 2**17


def choose_chunks(
    xp: Any,
    dtype: Any,
    n: int,
    m: int,
    batch_shape: tuple[int, ...],
    chunk_size: Any,
    return_weights: bool,
    is_causal: bool = False,
    concurrent_blocks: int = 1,
) -> tuple[int, int] | None:
    """``(query_chunk, key_chunk)`` for the chunked algorithm on ``n`` queries
    and ``m`` keys of ``dtype`` in each (batch, head) slice, or None for the
    plain algorithm: ``chunk_size`` if given, else chunks when the scores of
    all slices would exceed the memory budget, or when ``concurrent_blocks``
    workers can share them (at least :data:`PARALLEL_SCORES` scores).

    The plan is per slice: a block's scores are ``query_chunk x key_chunk``
    for each slice it holds, and :func:`slices_per_block` says how many
    slices one block holds.
    """
    if chunk_size is not None:
        if return_weights:
            raise ValueError(
                f"{_SDPA}: chunk_size can't be combined with return_weights=True (the chunked algorithm never materialises the weights)"
            )
        pair = chunk_size if isinstance(chunk_size, tuple) else (chunk_size, KEY_CHUNK)
        if len(pair) != 2:
            raise ValueError(
                f"{_SDPA}: chunk_size must be an int or a (query_chunk, key_chunk) pair, got {chunk_size!r}"
            )
        query_chunk, key_chunk = (_checks.require_positive_int(_SDPA, "chunk_size", c) for c in pair)
        return min(query_chunk, max(n, 1)), min(key_chunk, max(m, 1))
    if return_weights:
        return None
    slices = math.prod(batch_shape)
    scores = slices * n * m
    if scores != scores:  # unknown sizes (NaN: a lazy array's): no plan, the array's own chunks decide
        return None
    shared = concurrent_blocks > 1 and scores >= PARALLEL_SCORES
    budget = get_memory_budget()
    if scores * 8 <= budget and not shared:  # fits even in float64: the common, cheap case
        return None
    itemsize = _itemsize(xp, dtype)
    if scores * itemsize <= budget and not shared:
        return None
    block_bytes = _block_bytes(budget, concurrent_blocks)
    # One slice's block of about block_bytes; keys give way before rows do.
    key_chunk = min(m, KEY_CHUNK)
    while key_chunk > 512 and block_bytes // (itemsize * key_chunk) < MIN_ROWS:
        key_chunk //= 2
    rows = max(MIN_ROWS, block_bytes // (itemsize * key_chunk))
    if is_causal:
        rows = min(rows, max(MIN_ROWS, n // CAUSAL_BLOCKS))
    if concurrent_blocks > slices:  # too few slices to give every worker a block: split rows too
        rows = min(rows, max(MIN_ROWS, -(-n * slices // concurrent_blocks)))
    return min(n, rows), key_chunk


def slices_per_block(xp: Any, dtype: Any, chunks: tuple[int, int], slices: int, concurrent_blocks: int = 1) -> int:
    """How many (batch, head) slices one block of the chunked algorithm holds:
    as many as keep its scores within the block size (the memory budget
    shared by ``concurrent_blocks`` blocks in flight)."""
    query_chunk, key_chunk = chunks
    fit = _block_bytes(get_memory_budget(), concurrent_blocks) // (_itemsize(xp, dtype) * query_chunk * key_chunk)
    return max(1, min(slices, fit))


def _block_bytes(budget: int, concurrent_blocks: int) -> int:
    return min(BLOCK_BYTES, budget) // max(1, concurrent_blocks)


def _itemsize(xp: Any, dtype: Any) -> int:
    return 4 if _checks.accumulation_dtype(xp, dtype) == xp.float32 else 8


def check_attention_inputs(
    operation: str, xp: Any, query: Any, key: Any, value: Any, mask: Any, key_lengths: Any, scale: Any
) -> tuple[float, tuple[int, ...], int, int]:
    """Validate query/key/value/masks; returns the scale (a Python float, or
    a 0-d array: :func:`attnx._checks.require_scale`), the broadcast leading
    shape, ``n`` and ``m``."""
    q_shape, k_shape, v_shape = tuple(query.shape), tuple(key.shape), tuple(value.shape)
    if len(q_shape) < 2 or len(k_shape) < 2 or len(v_shape) < 2:
        _checks.require_ndim(operation, "query", query, 2, "(..., n, d_k)")
        _checks.require_ndim(operation, "key", key, 2, "(..., m, d_k)")
        _checks.require_ndim(operation, "value", value, 2, "(..., m, d_v)")
    dtype = query.dtype
    if not (_checks.is_float_dtype(xp, dtype) and key.dtype == dtype and value.dtype == dtype):
        for name, array in (("query", query), ("key", key), ("value", value)):
            _checks.require_float(operation, xp, name, array)
        _checks.require_same_dtype(operation, ("query", "key", "value"), (query, key, value))
    n, d_k = q_shape[-2], q_shape[-1]
    m = k_shape[-2]
    if k_shape[-1] != d_k and _checks.known(k_shape[-1], d_k):
        raise ValueError(f"{operation}: key must have shape (..., m, d_k) with d_k = {d_k} (from query), got {k_shape}")
    if v_shape[-2] != m and _checks.known(v_shape[-2], m):
        raise ValueError(f"{operation}: value must have shape (..., m, d_v) with m = {m} (from key), got {v_shape}")
    batch_shape = q_shape[:-2]
    if not batch_shape == k_shape[:-2] == v_shape[:-2]:
        batch_shape = _checks.broadcast(operation, {"query": batch_shape, "key": k_shape[:-2], "value": v_shape[:-2]})
    if mask is not None or key_lengths is not None:
        _checks.require_known(
            operation, "a mask", {"query": query, "key": key, "value": value, "mask": mask, "key_lengths": key_lengths}
        )
        _masking.check_masks(operation, xp, mask, key_lengths, batch_shape, n, m)
    return _checks.require_scale(operation, xp, scale, d_k, dtype), batch_shape, n, m


def sdpa_generic(
    xp: Any,
    *,
    query: Any,
    key: Any,
    value: Any,
    mask: Any,
    key_lengths: Any,
    is_causal: bool,
    scale: Any,
    return_weights: bool,
    chunks: tuple[int, int] | None = None,
    batch_shape: tuple[int, ...] | None = None,
    chunk_size: Any = None,
    map_blocks: Callable[..., list[Any]] | None = None,
    concurrent_blocks: int = 1,
) -> Any:
    """The generic algorithm, array API only (inputs already validated).
    ``chunk_size`` is the user's, for natives: ``chunks`` carries it here."""
    n, m = query.shape[-2], key.shape[-2]
    if n == 0 or m == 0:  # no queries, or no key to attend: zeros, as for fully masked rows
        return _empty_attention(xp, query, key, value, batch_shape, return_weights)
    if chunks is not None:
        return sdpa_chunked(
            xp,
            query=query,
            key=key,
            value=value,
            mask=mask,
            key_lengths=key_lengths,
            is_causal=is_causal,
            scale=scale,
            query_chunk=chunks[0],
            key_chunk=chunks[1],
            batch_shape=batch_shape,
            map_blocks=map_blocks,
            concurrent_blocks=concurrent_blocks,
        )
    dtype = query.dtype
    compute = _checks.accumulation_dtype(xp, dtype)
    if compute != dtype:
        query, key, value = (xp.astype(a, compute) for a in (query, key, value))
    if batch_shape is None:
        batch_shape = _checks.leading_shape(query, key, value)
    allowed = additive = None
    if mask is not None or key_lengths is not None or is_causal:
        allowed, additive = _masking.combine(
            xp,
            mask=mask,
            key_lengths=key_lengths,
            is_causal=is_causal,
            batch_shape=batch_shape,
            n=n,
            m=m,
            dtype=compute,
            device=_checks.device_of(query),
        )
    scores = (query * scale) @ xp.matrix_transpose(key)
    if return_weights:
        weights = _masking.softmax(xp, scores, allowed, additive)
        output = weights @ value
    else:
        # Normalise the (n, d_v) output rather than the (n, m) weights.
        exp_scores, _ = _masking.unnormalised_softmax(xp, scores, allowed, additive)
        masked = allowed is not None or additive is not None
        output = (exp_scores @ value) / _masking.safe_total(xp, exp_scores, masked)
        weights = None
    if compute != dtype:
        output = xp.astype(output, dtype)
        weights = None if weights is None else xp.astype(weights, dtype)
    if not return_weights:
        return output
    if tuple(weights.shape[:-2]) != tuple(batch_shape):  # leading dimensions only value had
        weights = xp.broadcast_to(weights, (*batch_shape, n, m))
    return output, weights


def _empty_attention(xp: Any, query: Any, key: Any, value: Any, batch_shape: Any, return_weights: bool) -> Any:
    if batch_shape is None:
        batch_shape = _checks.leading_shape(query, key, value)
    n, m, device = query.shape[-2], key.shape[-2], _checks.device_of(query)
    output = xp.zeros((*batch_shape, n, value.shape[-1]), dtype=query.dtype, device=device)
    if not return_weights:
        return output
    return output, xp.zeros((*batch_shape, n, m), dtype=query.dtype, device=device)


def masked_softmax(
    scores: Any,
    *,
    mask: Any = None,
    key_lengths: Any = None,
    axis: int = -1,
    backend: str | None = None,
) -> Any:
    """Numerically stable softmax with attention masks.

    Parameters
    ----------
    scores : array, shape (..., n, m)
        Real floating scores; the softmax runs over ``axis`` (the keys).
    mask, key_lengths :
        As in :func:`scaled_dot_product_attention`, relative to ``scores``
        with ``axis`` moved last.
    axis : int
        The axis to normalise.

    Returns
    -------
    array, same shape and dtype as ``scores``
        Non-negative, summing to one along ``axis``; all zeros on a row
        where every entry is masked.

    Notes
    -----
    Native implementations (:meth:`attnx.Backend.implementations`) are
    called with the keyword arguments ``scores``, ``mask``, ``key_lengths``
    and ``axis`` (made non-negative), after validation.
    """
    operation = "masked_softmax"
    chosen, reason = _dispatch.resolve(
        operation, backend, ("scores", "mask", "key_lengths"), (scores, mask, key_lengths), 1
    )
    xp = chosen.xp
    _checks.require_ndim(operation, "scores", scores, 1, "(..., m)")
    _checks.require_float(operation, xp, "scores", scores)
    axis = _checks.require_int(operation, "axis", axis)
    if not -scores.ndim <= axis < scores.ndim:
        raise ValueError(f"{operation}: axis {axis} is out of range for scores with {scores.ndim} dimensions")
    shape = _checks.shape_of(scores)
    axis = axis % scores.ndim
    moved = shape[:axis] + shape[axis + 1 :] + (shape[axis],)
    if len(moved) == 1:
        moved = (1, *moved)
    batch_shape, n, m = moved[:-2], moved[-2], moved[-1]
    if scores.ndim == 1 and mask is not None and mask.ndim > 1:  # the (1, m) view is attnx's, not the user's
        raise ValueError(
            f"{operation}: mask must broadcast to the scores' shape ({m},), got shape {_checks.shape_of(mask)}"
        )
    _masking.check_masks(operation, xp, mask, key_lengths, batch_shape, n, m)
    return _dispatch.call(
        operation,
        chosen,
        reason,
        _masked_softmax_generic,
        {"scores": scores, "mask": mask, "key_lengths": key_lengths, "axis": axis},
    )


def _masked_softmax_generic(xp: Any, *, scores: Any, mask: Any, key_lengths: Any, axis: int) -> Any:
    ndim = scores.ndim
    dtype = scores.dtype
    compute = _checks.accumulation_dtype(xp, dtype)
    moved = xp.moveaxis(scores, axis, -1) if axis != ndim - 1 else scores
    if ndim == 1:
        moved = moved[None, :]
    if compute != dtype:
        moved = xp.astype(moved, compute)
    allowed, additive = _masking.combine(
        xp,
        mask=mask,
        key_lengths=key_lengths,
        is_causal=False,
        batch_shape=tuple(moved.shape[:-2]),
        n=moved.shape[-2],
        m=moved.shape[-1],
        dtype=compute,
        device=_checks.device_of(scores),
    )
    # The user's scores (or a view of them) unless the cast made a copy: never overwritten.
    weights = _masking.softmax(xp, moved, allowed, additive, owned=compute != dtype)
    if compute != dtype:
        weights = xp.astype(weights, dtype)
    if ndim == 1:
        weights = weights[0, :]
    return xp.moveaxis(weights, -1, axis) if axis != ndim - 1 else weights


def _key_blocks(
    m: int, r0: int, r1: int, offset: int, key_chunk: int, is_causal: bool
) -> Iterator[tuple[int, int, bool]]:
    """Key blocks ``(start, stop, needs_causal_mask)`` for the queries
    ``r0:r1``.  With a causal mask, keys in every row's past come in
    unmasked blocks, the diagonal band in one masked block, and keys in
    every row's future are never visited."""
    if not is_causal:
        for c0 in range(0, m, key_chunk):
            yield c0, min(m, c0 + key_chunk), False
        return
    past = min(m, max(0, r0 + offset + 1))  # keys j <= r0 + offset: allowed for every row
    stop = min(m, max(0, r1 + offset))  # keys j >= r1 + offset: future for every row
    if past < stop - past:  # a past smaller than the band isn't worth its own products
        past = 0
    for c0 in range(0, past, key_chunk):
        yield c0, min(past, c0 + key_chunk), False
    if stop > past:
        yield past, stop, True


def sdpa_chunked(
    xp: Any,
    *,
    query: Any,
    key: Any,
    value: Any,
    mask: Any,
    key_lengths: Any,
    is_causal: bool,
    scale: Any,
    query_chunk: int,
    key_chunk: int,
    batch_shape: tuple[int, ...] | None = None,
    map_blocks: Callable[..., list[Any]] | None = None,
    concurrent_blocks: int = 1,
) -> Any:
    """Memory-efficient attention (Rabe and Staats 2021; the FlashAttention
    recurrence), array API only.

    Queries are processed ``query_chunk`` rows at a time and keys
    ``key_chunk`` columns at a time with a running maximum and sum, so the
    extra memory is O(query_chunk * key_chunk) per leading index instead of
    O(n * m).  Masks are built block by block; with ``is_causal`` the key
    blocks that lie wholly in a query block's future are never visited.
    The weights are not materialised.  Query blocks are independent: they
    go through ``map_blocks`` (the backend's :meth:`~attnx.Backend.map_blocks`),
    which may run them concurrently.  The chunks are per (batch, head)
    slice: a block holds as many slices as :func:`slices_per_block` allows,
    the batch is split into groups of them.
    """
    if batch_shape is None:
        batch_shape = _checks.leading_shape(query, key, value)
    batch_shape = tuple(batch_shape)
    n = query.shape[-2]
    groups, query_chunk = _batch_groups(xp, query.dtype, batch_shape, n, query_chunk, key_chunk, concurrent_blocks)
    attend, group_shapes = [], []  # per group of slices: a function of a row start, the leading shape
    for span in groups:
        if span is None:
            q, k, v, group_mask, lengths, group_shape = query, key, value, mask, key_lengths, batch_shape
        else:
            ndim = len(batch_shape)
            q, k, v = (_masking.batch_block(a, ndim, 2, span) for a in (query, key, value))
            group_mask = None if mask is None else _masking.batch_block(mask, ndim, 2, span)
            lengths = None if key_lengths is None else _masking.lengths_batch_block(key_lengths, batch_shape, n, span)
            group_shape = (span[1] - span[0], *batch_shape[1:])
        attend.append(
            _row_attention(xp, q, k, v, group_mask, lengths, is_causal, scale, query_chunk, key_chunk, group_shape)
        )
        group_shapes.append(group_shape)
    # Every (group, query block) pair is independent: one map, so that
    # workers share groups as well as rows.
    items = [(index, r0) for index in range(len(groups)) for r0 in range(0, n, query_chunk)]
    run = map_blocks if map_blocks is not None else (lambda function, items: [function(item) for item in items])
    outputs = run(lambda item: attend[item[0]](item[1]), items)
    per_group = len(range(0, n, query_chunk))
    parts = []
    for index, group_shape in enumerate(group_shapes):
        rows = outputs[index * per_group : (index + 1) * per_group]
        part = rows[0] if len(rows) == 1 else xp.concat(rows, axis=-2)
        if part.shape[:-2] != group_shape:  # leading dimensions only value had
            part = xp.broadcast_to(part, (*group_shape, *part.shape[-2:]))
        parts.append(part)
    output = parts[0] if len(parts) == 1 else xp.concat(parts, axis=0)
    return xp.astype(output, query.dtype) if output.dtype != query.dtype else output


def _batch_groups(
    xp: Any,
    dtype: Any,
    batch_shape: tuple[int, ...],
    n: int,
    query_chunk: int,
    key_chunk: int,
    concurrent_blocks: int,
) -> tuple[list[tuple[int, int] | None], int]:
    """Spans of the first batch axis that make the blocks (``[None]``: the
    whole batch in each block), and the query rows per block: as many slices
    per block as fit the block size, and blocks enough for every worker."""
    slices = math.prod(batch_shape)
    fit = slices_per_block(xp, dtype, (query_chunk, key_chunk), slices, concurrent_blocks)
    row_blocks = -(-n // query_chunk)
    if concurrent_blocks > row_blocks:  # rows alone don't give every worker a block
        fit = min(fit, max(1, slices * row_blocks // concurrent_blocks))
    if fit >= slices or not batch_shape:
        return [None], query_chunk
    per_entry = slices // batch_shape[0]
    if fit < per_entry:  # one entry of the batch still holds too many slices (many heads): fewer rows
        query_chunk = max(1, query_chunk * fit // per_entry)
    group = max(1, fit // per_entry)
    return [(start, min(batch_shape[0], start + group)) for start in range(0, batch_shape[0], group)], query_chunk


def _row_attention(
    xp: Any,
    query: Any,
    key: Any,
    value: Any,
    mask: Any,
    key_lengths: Any,
    is_causal: bool,
    scale: Any,
    query_chunk: int,
    key_chunk: int,
    batch_shape: tuple[int, ...],
) -> Callable[[int], Any]:
    """The attention of ``query_chunk`` queries from a row start, for slices
    that fit one block together, in the computation's dtype."""
    dtype = query.dtype
    compute = _checks.accumulation_dtype(xp, dtype)
    if compute != dtype:
        query, key, value = (xp.astype(a, compute) for a in (query, key, value))
    n, m = query.shape[-2], key.shape[-2]
    device = _checks.device_of(query)
    offset = m - n
    key_t = xp.matrix_transpose(key)
    d_v = value.shape[-1]
    # A column of ones after the values: one matrix product then yields both
    # the weighted values and the row sums of a block's state.
    ones = xp.ones((*value.shape[:-1], 1), dtype=value.dtype, device=device)
    value = xp.concat([value, ones], axis=-1)

    def attend_rows(r0: int) -> Any:
        r1 = min(n, r0 + query_chunk)
        q = query[..., r0:r1, :] * scale
        state = None
        for c0, c1, needs_causal in _key_blocks(m, r0, r1, offset, key_chunk, is_causal):
            allowed, additive = _masking.combine(
                xp,
                mask=mask,
                key_lengths=key_lengths,
                is_causal=needs_causal,
                batch_shape=batch_shape,
                n=n,
                m=m,
                dtype=compute,
                device=device,
                rows=(r0, r1),
                cols=(c0, c1),
            )
            weights, row_max = _masking.unnormalised_softmax(xp, q @ key_t[..., c0:c1], allowed, additive)
            block = blocks.pack(xp, weights @ value[..., c0:c1, :], row_max)
            state = block if state is None else blocks.combine(state, block, xp=xp)
        if state is None:  # no key at all for these rows (causal with n > m)
            return xp.zeros((*batch_shape, r1 - r0, d_v), dtype=compute, device=device)
        return blocks.finish(state, xp=xp)

    return attend_rows
