"""The tiled online-softmax walk: one home of block skipping.

Attention over tiles of the scores: a tile holds some query rows and some
key columns for a group of (batch, head) slices.  The caller says which key
tiles each range of rows visits (a tile it leaves out is never computed:
the causal future, an empty block of a block mask) and whether a tile
needs its mask evaluated (the causal diagonal, a partial block) or is fully
attended.  :func:`scaled_dot_product_attention`'s chunked algorithm and
:func:`flex_attention` both walk their tiles here, so a causal mask given
as ``is_causal=True`` or as a block mask is skipped by the same code.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from attnx import _checks, _cotangents, _masking, blocks
from attnx._config import user_memory_budget
from attnx._dropout import Dropout
from attnx.backend import Backend

Span = tuple[int, int]
#: A key tile ``(start, stop, masked)``: ``masked`` says its mask must be
#: evaluated; an unmasked tile is attended whole.
Tile = tuple[int, int, bool]
#: The tiles of the rows ``(start, stop)`` of a group of slices (the span of
#: the first batch axis it holds, None for the whole batch).
TilePlan = Callable[[Span | None, Span], Iterable[Tile]]
#: ``(scores, group, rows, cols, masked) -> (scores, allowed, additive)``: a
#: tile's scores (modified), with the masks that apply to it (each None when
#: absent, broadcastable to the scores).
TileScores = Callable[[Any, Span | None, Span, Span, bool], tuple[Any, Any, Any]]

#: Target size of one block of scores in the chunked algorithm, in bytes,
#: unless the backend says otherwise (:attr:`attnx.Backend.block_bytes`):
#: small enough to stay in a CPU's cache, large enough for efficient matrix
#: products.  The memory budget caps it, and blocks run at once share it.
BLOCK_BYTES = 4 * 2**20
#: Bytes of scores one block of the chunked SDPA holds at least when its
#: arrays are traced into one program (``jax.jit``: :func:`attnx._checks.traced`).
#: Each block adds operations that the compiler compiles one by one, and none
#: costs a dispatch; XLA's CPU also held more memory for more blocks.  A
#: causal (1, 8, 8192, 64) call jitted on JAX's CPU (2 cores) compiled in
#: 47.4 s, ran in 1.38 s and peaked at 4.7 GB with 4 MiB blocks; 8.5 s,
#: 1.08 s and 2.4 GB with 16 MiB; 2.8 s, 0.99 s and 1.8 GB with 64 MiB; 2.1
#: s, 1.08 s with 256 MiB.  Under a vectorizing map (``jax.vmap``) the plan
#: sees one example, so a block holds this much for every mapped example, as
#: it held the CPU's 4 MiB before.
TRACED_BLOCK_BYTES = 64 * 2**20
#: Bytes of one chunk at least where a tracer unrolls the default
#: :meth:`attnx.Backend.map_chunks` loop (``torch.compile``), each chunk's
#: operations compiled on their own.  ``torch.compile`` on 2 cores of an AMD
#: EPYC (32 MiB of L3), caches off, compile / run: Nadaraya-Watson at n = m
#: = 16384 (float32, 256 chunks of 4 MiB) 102 s / 153 ms, 16 MiB 31 s / 168
#: ms, 64 MiB 19 s / 657 ms (its chunks' intermediates outgrow the cache; at
#: n = m = 4096 12 ms, 10 ms and 30 ms); additive attention at (1, 8, 512,
#: 64), h = 64: 30 s / 135 ms, 18 s / 132 ms, 12 s / 114 ms.
UNROLLED_CHUNK_BYTES = 16 * 2**20
#: Keys per block (Rabe and Staats use 4096).
KEY_CHUNK = 4096
#: Query rows per block, at least: below 64 rows a (rows x 64) @ (64 x 512)
#: float32 product on one core loses a fifth of its speed or more (measured
#: on an AMD EPYC with AVX2 and OpenBLAS: 78-86 GFLOP/s from 64 rows up, 67
#: at 32, 46 at 16), so blocks shrink in keys and slices before in rows.
MIN_ROWS = 64


def memory_budget(block_bytes: int = BLOCK_BYTES) -> int:
    """The memory budget in force on a backend whose blocks hold
    ``block_bytes``: the user's, else one block."""
    return user_memory_budget() or block_bytes


def bytes_per_block(concurrent_blocks: int, block_bytes: int = BLOCK_BYTES) -> int:
    """The bytes of scores one block may hold: the backend's ``block_bytes``
    within the memory budget, shared by the blocks in flight."""
    return min(block_bytes, memory_budget(block_bytes)) // max(1, concurrent_blocks)


def chunk_bytes(backend: Backend, array: Any) -> int:
    """The bytes of one chunk of an operation that hands its chunks of
    ``array`` to ``backend.map_chunks`` (additive attention, Nadaraya-Watson):
    the backend's block for the array's device, and at least
    :data:`UNROLLED_CHUNK_BYTES` where a tracer unrolls the default loop
    into a copy of the chunk's operations per chunk.  A backend with a
    traced loop of its own (JAX's ``lax.map``) keeps its blocks: there more
    turns of the loop cost less than larger chunks (on JAX's CPU, 64 MiB
    chunks made Nadaraya-Watson 2-3.6x slower, additive attention 3.6x)."""
    block_bytes = backend.block_bytes_on(_checks.device_of(array))
    if type(backend).map_chunks is Backend.map_chunks and _checks.traced(array):
        block_bytes = max(block_bytes, UNROLLED_CHUNK_BYTES)
    return block_bytes


def rows_per_chunk(block_bytes: int, row_bytes: int) -> int:
    """Rows of ``row_bytes`` each that one chunk of :func:`chunk_bytes`
    holds within the memory budget: one at least."""
    return max(1, bytes_per_block(1, block_bytes) // max(1, row_bytes))


def itemsize(xp: Any, dtype: Any) -> int:
    """Bytes per score for inputs of ``dtype`` (half precision computes in float32)."""
    return 4 if _checks.accumulation_dtype(xp, dtype) == xp.float32 else 8


def slices_per_block(
    xp: Any,
    dtype: Any,
    chunks: tuple[int, int],
    slices: int,
    concurrent_blocks: int = 1,
    block_bytes: int = BLOCK_BYTES,
) -> int:
    """How many (batch, head) slices one block of the chunked algorithm holds:
    as many as keep its scores within the block size (:func:`bytes_per_block`)."""
    query_chunk, key_chunk = chunks
    fit = bytes_per_block(concurrent_blocks, block_bytes) // (itemsize(xp, dtype) * query_chunk * key_chunk)
    return max(1, min(slices, fit))


def batch_groups(
    xp: Any,
    dtype: Any,
    batch_shape: tuple[int, ...],
    n: int,
    query_chunk: int,
    key_chunk: int,
    concurrent_blocks: int,
    block_bytes: int = BLOCK_BYTES,
) -> tuple[list[Span | None], int]:
    """Spans of the first batch axis that make the blocks (``[None]``: the
    whole batch in each block), and the query rows per block: as many slices
    per block as fit the block size, and blocks enough for every worker."""
    slices = math.prod(batch_shape)
    fit = slices_per_block(xp, dtype, (query_chunk, key_chunk), slices, concurrent_blocks, block_bytes)
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


def split(start: int, stop: int, key_chunk: int, masked: bool) -> Iterator[Tile]:
    """Tiles of at most ``key_chunk`` keys covering ``start:stop``."""
    for c0 in range(start, stop, key_chunk):
        yield c0, min(stop, c0 + key_chunk), masked


def causal_tiles(m: int, rows: Span, offset: int, key_chunk: int) -> Iterator[Tile]:
    """The key tiles of the causal mask (query ``i`` attends keys
    ``j <= i + offset``) for the queries ``rows``: keys in every row's past
    come unmasked, the diagonal band in one masked tile, and keys in every
    row's future are never visited."""
    r0, r1 = rows
    past = min(m, max(0, r0 + offset + 1))  # keys j <= r0 + offset: allowed for every row
    stop = min(m, max(0, r1 + offset))  # keys j >= r1 + offset: future for every row
    if past < stop - past:  # a past smaller than the band isn't worth its own products
        past = 0
    yield from split(0, past, key_chunk, False)
    if stop > past:
        yield past, stop, True


def attend_tiles(
    xp: Any,
    query: Any,
    key: Any,
    value: Any,
    *,
    scale: Any,
    batch_shape: tuple[int, ...],
    query_chunk: int,
    key_chunk: int,
    tiles: TilePlan,
    tile_scores: TileScores,
    map_blocks: Callable[..., list[Any]] | None = None,
    concurrent_blocks: int = 1,
    block_bytes: int = BLOCK_BYTES,
    scores_may_mask: bool = False,
    with_stats: bool = False,
    dropout: Dropout | None = None,
) -> Any:
    """Attention ``(*batch_shape, n, d_v)`` walked tile by tile with a running
    maximum and sum (Rabe and Staats 2021; the FlashAttention recurrence):
    O(query_chunk * key_chunk) extra memory per slice, never the weights.

    Rows go ``query_chunk`` at a time; for each range of rows ``tiles`` says
    which key tiles (of at most ``key_chunk`` keys) to visit and which need
    their masks, and ``tile_scores`` modifies a tile's scores and gives its
    masks.  The batch is cut into groups of slices that fit the block size
    (:func:`batch_groups`); every (group, rows) pair is independent and goes
    through ``map_blocks`` (the backend's :meth:`~attnx.Backend.map_blocks`),
    which may run them concurrently.  Inputs of half precision are computed
    in float32; the output has the query's dtype.  ``scores_may_mask``:
    ``tile_scores`` may give ``-inf`` scores (a ``score_mod``'s), which mask.
    ``with_stats``: also each row's sum of weights and maximum score,
    ``(*batch_shape, n, 2)`` in the accumulation dtype (``(0, -inf)`` where
    a row attends nothing), from which :func:`backward_tiles` recomputes
    each tile's weights without a walk of its own.  ``dropout``: each
    tile's weights are multiplied by its mask (:mod:`attnx._dropout`) after
    their sum is taken.
    """
    batch_shape = tuple(batch_shape)
    dtype = query.dtype
    compute, (query, key, value) = _checks.in_accumulation_dtype(xp, query, key, value)
    n, d_v = query.shape[-2], value.shape[-1]
    device = _checks.device_of(query)
    # A column of ones after the values: one matrix product then yields both
    # the weighted values and the row sums of a tile's state.
    value = xp.concat([value, xp.ones((*value.shape[:-1], 1), dtype=value.dtype, device=device)], axis=-1)
    groups, query_chunk = batch_groups(
        xp, dtype, batch_shape, n, query_chunk, key_chunk, concurrent_blocks, block_bytes
    )
    ndim = len(batch_shape)
    parts = []  # per group: (scaled query, transposed key, value with ones, leading shape)
    for span in groups:
        if span is None:
            q, k, v, group_shape = query, key, value, batch_shape
        else:
            q, k, v = (_masking.batch_block(a, ndim, 2, span) for a in (query, key, value))
            group_shape = (span[1] - span[0], *batch_shape[1:])
        parts.append((q * scale, xp.matrix_transpose(k), v, group_shape))

    def attend(item: tuple[int, int]) -> Any:
        index, r0 = item
        span, (q, key_t, v, group_shape) = groups[index], parts[index]
        rows = (r0, min(n, r0 + query_chunk))
        q = q[..., rows[0] : rows[1], :]
        state = None
        for c0, c1, masked in tiles(span, rows):
            scores, allowed, additive = tile_scores(q @ key_t[..., c0:c1], span, rows, (c0, c1), masked)
            weights, row_max = _masking.unnormalised_softmax(
                xp, scores, allowed, additive, scores_may_mask=scores_may_mask
            )
            if dropout is None:
                tile = blocks.pack(xp, weights @ v[..., c0:c1, :], row_max)
            else:  # the row's sum is of every weight, the values' of those kept
                kept = (weights * dropout.tile(span, rows, (c0, c1))) @ v[..., c0:c1, :]
                tile = blocks.pack(xp, kept[..., :-1], xp.sum(weights, axis=-1, keepdims=True), row_max)
            state = tile if state is None else blocks.combine(state, tile, xp=xp)
        if state is None:  # no key to visit for these rows: nothing attended
            shape = (*group_shape, rows[1] - rows[0])
            output = xp.zeros((*shape, d_v), dtype=compute, device=device)
            if with_stats:
                nothing = xp.zeros((*shape, 1), dtype=compute, device=device)
                return output, xp.concat([nothing, nothing - float("inf")], axis=-1)
            return output
        output = blocks.finish(state, xp=xp)
        stats = state[..., -2:] if with_stats else None
        if tuple(output.shape[:-2]) != group_shape:  # leading dimensions only value had
            output = xp.broadcast_to(output, (*group_shape, *output.shape[-2:]))
            stats = None if stats is None else xp.broadcast_to(stats, (*group_shape, *stats.shape[-2:]))
        return output if stats is None else (output, stats)

    items = [(index, r0) for index in range(len(groups)) for r0 in range(0, n, query_chunk)]
    run = map_blocks if map_blocks is not None else (lambda function, items: [function(item) for item in items])
    results = run(attend, items)
    per_group = len(range(0, n, query_chunk))

    def joined(parts: list[Any]) -> Any:
        rows_of = [parts[i * per_group : (i + 1) * per_group] for i in range(len(groups))]
        return _joined(xp, [_joined(xp, rows, -2) for rows in rows_of], 0)

    output = joined([result[0] for result in results] if with_stats else results)
    output = xp.astype(output, dtype) if output.dtype != dtype else output
    return (output, joined([result[1] for result in results])) if with_stats else output


def attend_differentiable(
    custom_vjp: Callable[..., Any],
    xp: Any,
    query: Any,
    key: Any,
    value: Any,
    *,
    scale: Any,
    plan: Callable[..., tuple[TilePlan, TileScores]],
    masks: dict[str, Any],
    real_mask: str | None = None,
    dropout: Dropout | None = None,
    tables: dict[str, Any] | None = None,
    table_vjp: Callable[[dict[str, Any], list[dict[str, Any]]], Callable[..., Any]] | None = None,
    **walk: Any,
) -> Any:
    """:func:`attend_tiles`, differentiated by :func:`backward_tiles` where
    the backend has autograd (its :meth:`~attnx.Backend.custom_vjp`): the
    tape then holds the inputs, the output and the rows' statistics, never
    a tile.

    ``masks`` are the arrays the tiles' masks are made of, by name (None
    where absent), and ``plan(**masks)`` makes the tiles and their scores
    from them: they travel as arguments, not in a closure, so that a tracer
    (``jax.jit``) sees them as its inputs.  ``real_mask`` names the one
    that is added to the scores, whose gradient is then the scores'; the
    others get none.  ``scale`` gets its gradient where it is an array.
    ``tables`` are the arrays a score_mod closes over, by name (ALiBi's
    slopes): ``plan(**masks, **tables)`` gets them as the library hands
    them over (under ``torch.func.vmap`` a ``Function`` must compute on
    its inputs, never on what it closes over), and ``table_vjp(tables,
    parts)`` is the tiles' ``score_vjp`` (:func:`backward_tiles`), which
    appends each tile's gradients of the tables to ``parts``; they are
    summed.
    ``walk`` holds :func:`attend_tiles`' other keywords.
    """
    names = [name for name, array in masks.items() if array is not None]
    tables = tables or {}
    scale_is_array = not isinstance(scale, int | float)
    arrays = (
        query,
        key,
        value,
        *((scale,) if scale_is_array else ()),
        *(masks[name] for name in names),
        *tables.values(),
    )

    def unpacked(arrays: tuple[Any, ...]) -> tuple[Any, ...]:
        q, k, v, *rest = arrays
        s = rest.pop(0) if scale_is_array else scale
        given = dict(zip(names, rest[: len(names)], strict=True))
        given_tables = dict(zip(tables, rest[len(names) :], strict=True))
        tiles, tile_scores = plan(**{name: given.get(name) for name in masks}, **given_tables)
        options = {"tiles": tiles, "tile_scores": tile_scores, "dropout": dropout, **walk}
        return q, k, v, s, given, given_tables, options

    def forward(*arrays: Any) -> tuple[Any, tuple[Any, ...]]:
        q, k, v, s, _, _, options = unpacked(arrays)
        output, stats = attend_tiles(xp, q, k, v, scale=s, with_stats=True, **options)
        return output, (stats,)

    def backward(arrays: tuple[Any, ...], output: Any, residuals: tuple[Any, ...], cotangent: Any) -> tuple[Any, ...]:
        q, k, v, s, given, given_tables, options = unpacked(arrays)
        mask = given.get(real_mask) if real_mask is not None else None
        table_parts: list[dict[str, Any]] = []  # each tile's (threads append alike)
        if table_vjp is not None:
            options["score_vjp"] = table_vjp(given_tables, table_parts)
        d_query, d_key, d_value, d_scale, *d_mask = backward_tiles(
            xp,
            q,
            k,
            v,
            output,
            cotangent,
            scale=s,
            row_stats=residuals[0],
            mask_shape=None if mask is None else tuple(mask.shape),
            **options,
        )
        grads = [_cotangents.like(xp, d, a) for d, a in ((d_query, q), (d_key, k), (d_value, v))]
        if scale_is_array:
            grads.append(_cotangents.like(xp, d_scale, s))
        grads += [_cotangents.like(xp, d_mask[0], mask) if name == real_mask else None for name in names]
        for name, table in given_tables.items():
            parts = [part[name] for part in table_parts]
            grads.append(_cotangents.like(xp, sum(parts[1:], parts[0]), table) if parts else xp.zeros_like(table))
        return tuple(grads)

    return custom_vjp(forward, backward, arrays)


def backward_tiles(
    xp: Any,
    query: Any,
    key: Any,
    value: Any,
    output: Any,
    cotangent: Any,
    *,
    scale: Any,
    batch_shape: tuple[int, ...],
    query_chunk: int,
    key_chunk: int,
    tiles: TilePlan,
    tile_scores: TileScores,
    map_blocks: Callable[..., list[Any]] | None = None,
    concurrent_blocks: int = 1,
    block_bytes: int = BLOCK_BYTES,
    scores_may_mask: bool = False,
    mask_shape: tuple[int, ...] | None = None,
    row_stats: Any = None,
    dropout: Dropout | None = None,
    score_vjp: Callable[[Any, Any, Span | None, Span, Span], Any] | None = None,
) -> tuple[Any, ...]:
    """The gradients of :func:`attend_tiles`' output, walking the same tiles.

    The FlashAttention-2 backward, array API only: for each range of rows,
    a first walk over its tiles gives each row's maximum and sum, a second
    recomputes each tile's weights ``P`` from them (or from ``row_stats``,
    the forward's, :func:`attend_tiles`' ``with_stats``, without the first
    walk) and adds the tile's part
    of every gradient (``dS = P * (dO V^T - rowsum(dO * O))``), so no tile
    outlives its step and the memory is that of the forward's blocks plus
    the gradients themselves.  Tiles ``tiles`` leaves out (the causal
    future, empty blocks) are never computed, as in the forward; a row that
    attends nothing gets zero gradients, never NaN.

    Returns ``(d_query, d_key, d_value, d_scale)`` over ``batch_shape`` (the
    caller sums them to its inputs' broadcast shapes), in the accumulation
    dtype; ``d_scale`` is a 0-d array.  With ``mask_shape``, the shape of a
    real mask added to the scores, its gradient comes fifth: the scores'
    gradient, summed where the mask broadcasts (its other leading axes are
    the caller's to sum), each range of rows' tiles laid out together.
    ``score_vjp(d_scores, raw, group, rows, cols)``: where ``tile_scores``
    changes the scores (a ``score_mod``), the gradient of the tile's raw
    scores (``q k^T s``) from that of the changed ones.
    """
    batch_shape = tuple(batch_shape)
    compute, (query, key, value, output, cotangent) = _checks.in_accumulation_dtype(
        xp, query, key, value, output, cotangent
    )
    n, m, d_k, d_v = query.shape[-2], key.shape[-2], query.shape[-1], value.shape[-1]
    device = _checks.device_of(query)
    groups, query_chunk = batch_groups(
        xp, query.dtype, batch_shape, n, query_chunk, key_chunk, concurrent_blocks, block_bytes
    )
    ndim = len(batch_shape)
    # D = rowsum(dO * O): the weights' gradient shifts by it in every tile
    shift_all = xp.sum(cotangent * output, axis=-1, keepdims=True)
    # The mask's shape against (*batch_shape, n, m): the axes its gradient is summed along.
    aligned = None if mask_shape is None else (1,) * (ndim + 2 - len(mask_shape)) + tuple(mask_shape[-(ndim + 2) :])

    def mask_part(parts: list[tuple[int, int, Any]], group_shape: tuple[int, ...], rows: Span) -> Any:
        """A range of rows' tiles of the scores' gradient ``(..., r, c)``
        over all ``m`` keys, summed along the axes the mask broadcasts."""
        pieces, at = [], 0
        shape = (*group_shape, rows[1] - rows[0])
        for c0, c1, part in sorted(parts, key=lambda entry: entry[0]):
            if c0 > at:
                pieces.append(xp.zeros((*shape, c0 - at), dtype=compute, device=device))
            pieces.append(xp.broadcast_to(part, (*shape, c1 - c0)))
            at = c1
        if at < m:
            pieces.append(xp.zeros((*shape, m - at), dtype=compute, device=device))
        whole = pieces[0] if len(pieces) == 1 else xp.concat(pieces, axis=-1)
        axes = tuple(axis for axis, size in enumerate(aligned) if size == 1 and whole.shape[axis] != 1)
        return xp.sum(whole, axis=axes, keepdims=True) if axes else whole

    def group_gradients(item: tuple[int, range]) -> tuple[list[Any], Any, Any, Any]:
        """One group's gradients from some of its ranges of rows: their
        ``d_query`` rows (a list, one a range), and their parts of
        ``d_key``, ``d_value`` and ``d_scale`` (summed with the other items'
        of the group)."""
        index, starts = item
        span = groups[index]
        arrays = (query, key, value, output, cotangent, shift_all, row_stats)
        if span is not None:
            arrays = tuple(None if a is None else _masking.batch_block(a, ndim, 2, span) for a in arrays)
        q, k, v, out, d_out, shift, stats = arrays
        group_shape = batch_shape if span is None else (span[1] - span[0], *batch_shape[1:])
        q_scaled, key_t, value_t = q * scale, xp.matrix_transpose(k), xp.matrix_transpose(v)
        visits_of = {r0: list(tiles(span, (r0, min(n, r0 + query_chunk)))) for r0 in starts}
        bounds = sorted({0, m, *(c for visits in visits_of.values() for c0, c1, _ in visits for c in (c0, c1))})
        d_key = KeyBlocks(xp, group_shape, bounds, d_k, compute, device)
        d_value = KeyBlocks(xp, group_shape, bounds, d_v, compute, device)
        d_scale = xp.zeros((), dtype=compute, device=device)
        row_grads, mask_grads = [], []
        for r0 in starts:
            rows = (r0, min(n, r0 + query_chunk))
            q_rows = q_scaled[..., rows[0] : rows[1], :]
            visits = visits_of[r0]
            # walk 1: each row's maximum and sum over every visited tile, unless the forward gave them
            state = None if stats is None or not visits else stats[..., rows[0] : rows[1], :]
            for c0, c1, masked in visits if stats is None else ():
                scores, allowed, additive = tile_scores(q_rows @ key_t[..., c0:c1], span, rows, (c0, c1), masked)
                weights, row_max = _masking.unnormalised_softmax(
                    xp, scores, allowed, additive, scores_may_mask=scores_may_mask
                )
                tile = blocks.pack(xp, xp.sum(weights, axis=-1, keepdims=True), row_max)
                state = tile if state is None else blocks.combine(state, tile, xp=xp)
            d_out_rows = d_out[..., rows[0] : rows[1], :]
            if state is None:  # nothing visited: these rows attend nothing
                row_grads.append(xp.zeros((*group_shape, rows[1] - rows[0], d_k), dtype=compute, device=device))
                if aligned is not None:
                    mask_grads.append(mask_part([], group_shape, rows))
                continue
            row_max, total = state[..., -1:], _masking.nonzero_total(xp, state[..., -2:-1])
            shift_rows = shift[..., rows[0] : rows[1], :]
            d_rows = None  # dS @ K, unscaled: d_query is its scale times, d_scale its product with q
            score_parts = []  # this range's tiles of dS
            # walk 2: each tile's weights again, and its part of every gradient
            for c0, c1, masked in visits:
                raw = q_rows @ key_t[..., c0:c1]
                scores, allowed, additive = tile_scores(raw, span, rows, (c0, c1), masked)
                # the masks applied as in the forward, shifted by the whole row's maximum (the raw
                # scores kept whole where score_vjp reads them)
                weights, _ = _masking.unnormalised_softmax(
                    xp, scores, allowed, additive, running_max=row_max, owned=score_vjp is None
                )
                probabilities = weights / total  # 0 where masked or nothing attended
                d_weights = d_out_rows @ value_t[..., c0:c1]
                if dropout is None:
                    d_value.add(c0, c1, xp.matrix_transpose(probabilities) @ d_out_rows)
                else:  # the forward's mask, made again: O = (P * Z) V
                    kept = dropout.tile(span, rows, (c0, c1))
                    d_value.add(c0, c1, xp.matrix_transpose(probabilities * kept) @ d_out_rows)
                    d_weights = d_weights * kept
                d_scores = probabilities * (d_weights - shift_rows)
                if score_vjp is not None:
                    d_scores = score_vjp(d_scores, raw, span, rows, (c0, c1))
                if aligned is not None:
                    score_parts.append((c0, c1, d_scores))
                part = d_scores @ k[..., c0:c1, :]
                d_rows = part if d_rows is None else d_rows + part
                d_key.add(c0, c1, xp.matrix_transpose(d_scores) @ q_rows)
            if aligned is not None:
                mask_grads.append(mask_part(score_parts, group_shape, rows))
            d_scale = d_scale + xp.sum(d_rows * q[..., rows[0] : rows[1], :])
            d_rows = d_rows * scale
            if tuple(d_rows.shape[:-2]) != group_shape:
                d_rows = xp.broadcast_to(d_rows, (*group_shape, *d_rows.shape[-2:]))
            row_grads.append(d_rows)
        return row_grads, d_key.laid_out(), d_value.laid_out(), d_scale, mask_grads

    # Where the groups are fewer than the blocks that can run at once, each
    # group's ranges of rows are shared out too: their key-side parts are
    # summed after (each item holds a d_key and d_value of its own).
    starts = range(0, n, query_chunk)
    shares = max(1, min(len(starts), concurrent_blocks // len(groups)))
    items = [(index, starts[share::shares]) for index in range(len(groups)) for share in range(shares)]
    run = map_blocks if map_blocks is not None else (lambda function, items: [function(item) for item in items])
    results = run(group_gradients, items)
    per_group = []
    for index in range(len(groups)):
        shared = list(zip(items[index * shares : (index + 1) * shares], results[index * shares : (index + 1) * shares]))
        # The shares hold the ranges s, s + shares, ...: the rows back in order.
        ordered = sorted(
            (
                (r0, grad, mask_grad)
                for (_, share_starts), result in shared
                for r0, grad, mask_grad in zip(share_starts, result[0], result[4] or [None] * len(result[0]))
            ),
            key=lambda entry: entry[0],
        )
        d_query = _joined(xp, [grad for _, grad, _ in ordered], -2)
        d_key, d_value, d_scale = shared[0][1][1:4]
        for _, result in shared[1:]:
            d_key, d_value, d_scale = d_key + result[1], d_value + result[2], d_scale + result[3]
        gradients = [d_query, d_key, d_value, d_scale]
        if aligned is not None:  # the rows' parts side by side, or summed where the mask has one row
            mask_rows = [mask_grad for _, _, mask_grad in ordered]
            gradients.append(_summed(mask_rows) if aligned[-2] == 1 else _joined(xp, mask_rows, -2))
        per_group.append(tuple(gradients))
    if len(per_group) == 1:
        return per_group[0]
    gradients = [xp.concat([g[i] for g in per_group], axis=0) for i in range(3)]
    gradients.append(_summed([g[3] for g in per_group]))
    if aligned is not None:  # the groups' parts along the batch, or summed where the mask has no batch
        mask_groups = [g[4] for g in per_group]
        gradients.append(_summed(mask_groups) if aligned[0] == 1 else xp.concat(mask_groups, axis=0))
    return tuple(gradients)


class KeyBlocks:
    """A key-side gradient ``(*lead, m, width)`` summed from tiles' parts,
    held in blocks between ``bounds`` (every tile's first and last key, 0
    and ``m``, sorted): a part adds to the blocks it spans, so the work
    grows with the tiles, not with ``m`` for each range of rows (a sliding
    window's backward stays linear in n); laid out once at the end (no
    item assignment: the standard's arrays may be immutable)."""

    def __init__(self, xp: Any, lead: tuple[int, ...], bounds: list[int], width: int, dtype: Any, device: Any) -> None:
        self.xp, self.lead, self.bounds, self.width = xp, tuple(lead), bounds, width
        self.index_of = {bound: index for index, bound in enumerate(bounds)}  # no bisect: dynamo can't trace it
        self.dtype, self.device = dtype, device
        self.blocks: dict[int, Any] = {}

    def _zeros(self, keys: int) -> Any:
        return self.xp.zeros((*self.lead, keys, self.width), dtype=self.dtype, device=self.device)

    def add(self, c0: int, c1: int, part: Any) -> None:
        """Add ``part``, the gradient of keys ``c0:c1`` (both in ``bounds``)."""
        if tuple(part.shape[:-2]) != self.lead:
            part = self.xp.broadcast_to(part, (*self.lead, c1 - c0, self.width))
        bounds = self.bounds
        for index in range(self.index_of[c0], self.index_of[c1]):
            b0, b1 = bounds[index], bounds[index + 1]
            piece = part if (b0, b1) == (c0, c1) else part[..., b0 - c0 : b1 - c0, :]
            held = self.blocks.get(index)
            self.blocks[index] = piece if held is None else held + piece

    def laid_out(self) -> Any:
        """The whole gradient, zeros where no part came."""
        pieces, empty = [], 0  # runs of untouched blocks become one array of zeros
        for index in range(len(self.bounds) - 1):
            block = self.blocks.get(index)
            if block is None:
                empty += self.bounds[index + 1] - self.bounds[index]
                continue
            if empty:
                pieces.append(self._zeros(empty))
                empty = 0
            pieces.append(block)
        if empty or not pieces:
            pieces.append(self._zeros(empty))
        return _joined(self.xp, pieces, -2)


def _joined(xp: Any, arrays: list[Any], axis: int) -> Any:
    return arrays[0] if len(arrays) == 1 else xp.concat(arrays, axis=axis)


def _summed(arrays: list[Any]) -> Any:
    total = arrays[0]
    for array in arrays[1:]:
        total = total + array
    return total
