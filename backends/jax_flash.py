"""FlashAttention in JAX's loops: the JAX backend's tiled SDPA and flex attention, forward and backward.

attnx's generic tiles are a Python loop, which ``jax.jit`` unrolls into one
program whose tiles are all independent: XLA's scheduler keeps many alive
at once, and ``jax.grad`` keeps every tile's weights for its backward (892
MiB of temporaries for a causal (1, 2, 8192, 64) call, 2 CPU cores).  Here
the tiles run in ``lax`` loops, which XLA runs as loops, and a
``jax.custom_vjp`` keeps the inputs, the output and one log-sum-exp a row:
the backward (FlashAttention-2's) recomputes each tile's weights from them.

- Forward: ``lax.map`` over blocks of queries; for each, a ``fori_loop``
  over the blocks of keys it reads (the causal future is not visited:
  the loop's end depends on the block), with the online softmax.
- Backward: a ``scan`` over blocks of keys, each gathering its key and
  value gradients over the blocks of queries that read it (a
  ``fori_loop`` from the first that does), the query gradient
  accumulated in one buffer updated in place.

Sizes that don't divide into blocks are padded, the padded keys masked.
It takes the calls it computes exactly as attnx's algorithm: ``(..., n,
d)`` inputs of one leading shape, or grouped heads as attnx lays them out
(keys broadcast over each group's ``G`` query heads, read once for the
group, never copied); a float scale; causal in attnx's alignment (the last
query sees every key); ``key_lengths`` in any layout (as the keys each
query attends, :func:`attnx.natives.key_counts`); a boolean mask of one
row of keys per slice (padding), or shared by every slice, or one per
slice.  Rows with no key get zeros, and zero gradients.  A real mask
(whose gradient the generic backward gives) is left to attnx's algorithm.

``flex_attention`` runs in the same loops (:func:`flex_loops`): the loops
visit the blocks that the block mask leaves non-empty (its ``kinds``, read
once where concrete; in the backward, the blocks of queries that read each
block of keys), evaluate its ``mask_mod`` on each, and put each tile's
scores through the ``score_mod``.  ``jax.closure_convert`` makes what the
score_mod closes over (ALiBi's slopes, a bias table, a user's array) inputs
of the ``custom_vjp``, and the backward differentiates the mod tile by
tile (``jax.vjp``), so their gradients come back too, as PyTorch's compiled
FlexAttention gives them.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple


def attention(
    query: Any,
    key: Any,
    value: Any,
    *,
    scale: float,
    is_causal: bool,
    blocks: tuple[int, int],
    groups: int = 1,
    counts: Any = None,
    mask: Any = None,
    flex: FlexLoops | None = None,
) -> Any:
    """Attention of ``(..., n, d)`` queries against ``(..., m, d)`` keys and
    values, in blocks of ``blocks = (queries, keys)``, differentiable by its
    own backward.  The leading shapes are one, or grouped (``groups`` > 1):
    the keys' ``(..., H_kv, 1)`` against the queries' ``(..., H_kv, G)``.
    ``counts`` (integers broadcastable to ``(..., n)``): query ``i``
    attends the keys ``j < counts[..., i]`` only; ``mask`` (boolean,
    ``(S or 1, n or 1, m or 1)`` over the ``S`` query slices laid end to
    end): True where a query may attend a key.  ``flex``: a
    ``flex_attention`` call's mods and block mask (:class:`FlexLoops`)."""
    import jax.numpy as jnp

    leading = tuple(query.shape[:-2])
    n, m = query.shape[-2], key.shape[-2]
    slices = math.prod(leading)
    block_q, block_k = max(1, min(blocks[0], n)), max(1, min(blocks[1], m))
    # The query slices as (S, n, d), or grouped (S_kv, G, n, d); the masks alike.
    heads = (slices,) if groups == 1 else (slices // groups, groups)
    q = query.reshape(*heads, n, query.shape[-1])
    k, v = (a.reshape(slices // groups, m, a.shape[-1]) for a in (key, value))
    if counts is not None:
        counts = jnp.broadcast_to(counts, (*leading, n)).reshape(*heads, n).astype(jnp.int32)
    if mask is not None and groups > 1:
        mask = mask.reshape(mask.shape[0] // groups if mask.shape[0] > 1 else 1, -1, *mask.shape[-2:])
    if flex is None:
        output = _attention_of_sizes(float(scale), bool(is_causal), block_q, block_k, groups > 1)(q, k, v, counts, mask)
    else:  # its mods are new functions at each call: built anew, for the trace they are part of
        output = _attention(float(scale), bool(is_causal), block_q, block_k, groups > 1, flex)(
            q, k, v, counts, mask, *flex.tables
        )
    return output.reshape(*leading, n, value.shape[-1])


class FlexLoops(NamedTuple):
    """A ``flex_attention`` call as the loops take it (:func:`flex_loops`)."""

    #: ``(B, H)``: the heads the mods see.
    heads: tuple[int, int]
    #: Per block of queries, how many blocks of keys it visits and which
    #: (``(row_blocks,)``, ``(row_blocks, widest)``); None: every one.
    key_visits: tuple[Any, Any] | None
    #: Per block of keys, the blocks of queries that visit it, alike.
    row_visits: tuple[Any, Any] | None
    #: ``score_mod(scores, b, h, q_idx, kv_idx, *tables)``, or None.
    score_mod: Callable[..., Any] | None
    #: The arrays the score_mod closes over and is differentiated in.
    tables: tuple[Any, ...]
    #: ``mask_mod(b, h, q_idx, kv_idx)``, evaluated on every block visited
    #: (a full block's is all True), or None.
    mask_mod: Callable[..., Any] | None


def flex_loops(query: Any, m: int, score_mod: Any, block_mask: Any, blocks: tuple[int, int]) -> FlexLoops:
    """The loops' view of a ``flex_attention`` call of ``(B, H, n, d)``
    queries against ``m`` keys in blocks of ``blocks`` (the block mask's,
    where there is one):
    the blocks the block mask leaves non-empty for any batch entry or head
    (its ``kinds`` read once, where they are concrete), and the score_mod
    with the arrays it closes over made its inputs (``jax.closure_convert``),
    so that their gradients come back from the loops' backward."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    batch, heads, n, _ = query.shape
    key_visits = row_visits = None
    if block_mask is not None and not isinstance(block_mask.kinds, jax.core.Tracer):
        visited = (np.asarray(block_mask.kinds) != 0).any(axis=(0, 1))  # (row_blocks, key_blocks)
        key_visits, row_visits = _visits(visited), _visits(visited.T)
    converted, tables = None, ()
    if score_mod is not None:
        # The mod as a function of the tables, traced on the loops' tile (whose shape it keeps).
        rows, keys = min(blocks[0], n), min(blocks[1], m)
        tile = jax.ShapeDtypeStruct((batch, heads, rows, keys), query.dtype)
        indices = _indices(jnp, batch, heads, 0, rows, 0, keys)
        converted, tables = jax.closure_convert(score_mod, tile, *indices)
    mask_mod = None if block_mask is None else block_mask.mask_mod
    return FlexLoops((batch, heads), key_visits, row_visits, converted, tuple(tables), mask_mod)


def _visits(visited: Any) -> tuple[Any, Any]:
    """``(counts, blocks)`` of a boolean ``(outer, inner)`` table: how many
    inner blocks each outer one visits, and which, first to last (padded
    with 0)."""
    import numpy as np

    counts = visited.sum(axis=1).astype(np.int32)
    blocks = np.zeros((visited.shape[0], max(1, int(counts.max(initial=0)))), dtype=np.int32)
    for outer, row in enumerate(visited):
        found = np.flatnonzero(row)
        blocks[outer, : found.size] = found
    return counts, blocks


def _indices(jnp: Any, batch: int, heads: int, r0: Any, rows: int, c0: Any, keys: int) -> tuple[Any, Any, Any, Any]:
    """The mods' index arrays of a tile, laid out as ``flex_attention``
    documents them for a mod (``b (B, 1, 1, 1)``, ``h (1, H, 1, 1)``,
    ``q_idx (1, 1, rows, 1)``, ``kv_idx (1, 1, 1, keys)``), from the tile's
    first query ``r0`` and key ``c0``, which may be traced.  Written here:
    attnx's own helper is not public API, which backends keep to
    (tests/test_layout.py)."""
    return (
        jnp.arange(batch).reshape(-1, 1, 1, 1),
        jnp.arange(heads).reshape(1, -1, 1, 1),
        (r0 + jnp.arange(rows)).reshape(1, 1, -1, 1),
        (c0 + jnp.arange(keys)).reshape(1, 1, 1, -1),
    )


@functools.lru_cache(maxsize=64)
def _attention_of_sizes(scale: float, is_causal: bool, block_q: int, block_k: int, grouped: bool) -> Any:
    return _attention(scale, is_causal, block_q, block_k, grouped, None)


def _attention(scale: float, is_causal: bool, block_q: int, block_k: int, grouped: bool, flex: FlexLoops | None) -> Any:
    import jax
    import jax.numpy as jnp
    from jax import lax

    # Rows are the queries' axis -2 (their statistics' and counts' -1);
    # grouped, each key slice serves the G query slices of axis 1.
    g = "g" if grouped else ""
    scores_of, weighted = f"s{g}qd,skd->s{g}qk", f"s{g}qk,skd->s{g}qd"
    summed, by_rows = f"s{g}qk,s{g}qd->skd", f"s{g}qd,skd->s{g}qk"

    def plan(n: int, m: int) -> tuple[int, int, int, int]:
        return -(-n // block_q), -(-m // block_k), m - n, m

    def padded(array: Any, size: int, axis: int, fill: Any = 0) -> Any:
        """``array`` padded to ``size`` along ``axis`` (unless it broadcasts there)."""
        extra = size - array.shape[axis]
        if extra <= 0 or array.shape[axis] == 1:
            return array
        widths = [(0, 0)] * array.ndim
        widths[axis] = (0, extra)
        return jnp.pad(array, widths, constant_values=fill)

    def cut(array: Any, start: Any, size: int, axis: int) -> Any:
        """``size`` entries of ``array`` from ``start`` along ``axis`` (unless it broadcasts there)."""
        if array.shape[axis] == 1:
            return array
        return lax.dynamic_slice_in_dim(array, start, size, axis=axis % array.ndim)

    def keys_read(i: Any, offset: int, key_blocks: int) -> tuple[Any, Callable[[Any], Any]]:
        """``(stop, block)``: how many blocks of keys the row block ``i``
        reads, and ``block(t)`` the ``t``-th of them."""
        if flex is not None and flex.key_visits is not None:
            counts, table = (jnp.asarray(a) for a in flex.key_visits)
            return counts[i], lambda t: table[i, t]
        if not is_causal:
            return key_blocks, lambda t: t
        last_key = (i + 1) * block_q - 1 + offset  # the block's last query's last key
        return jnp.clip(last_key // block_k + 1, 0, key_blocks), lambda t: t

    def rows_reading(j: Any, offset: int, row_blocks: int) -> tuple[Any, Any, Callable[[Any], Any]]:
        """``(start, stop, block)``: the blocks of queries that read the key
        block ``j``, ``block(t)`` for ``t`` from ``start`` to ``stop``."""
        if flex is not None and flex.row_visits is not None:
            counts, table = (jnp.asarray(a) for a in flex.row_visits)
            return 0, counts[j], lambda t: table[j, t]
        if not is_causal:
            return 0, row_blocks, lambda t: t
        first_row = j * block_k - offset  # the first query that reads the block's first key
        return jnp.clip(first_row // block_q, 0, row_blocks), row_blocks, lambda t: t

    def as_tile(array: Any, shape: tuple[int, ...]) -> Any:
        """A mod's ``(B, H, block_q, block_k)`` array (broadcastable) as the
        loops' tile of ``shape``, ``(S, [G,] block_q, block_k)``."""
        assert flex is not None
        return jnp.broadcast_to(array, (*flex.heads, block_q, block_k)).reshape(shape)

    def allowed(i: Any, j: Any, offset: int, m: int, counts: Any, mask: Any, shape: tuple[int, ...]) -> Any:
        """Where the queries of row block ``i`` may attend the keys of key
        block ``j``: broadcastable to ``shape``, ``(S, [G,] block_q, block_k)``."""
        rows = (i * block_q + jnp.arange(block_q))[:, None]
        cols = (j * block_k + jnp.arange(block_k))[None, :]
        keep = cols < m
        if is_causal:
            keep = keep & (cols <= rows + offset)
        if counts is not None:
            keep = keep & (cols < cut(counts, i * block_q, block_q, -1)[..., None])
        if mask is not None:
            keep = keep & cut(cut(mask, i * block_q, block_q, -2), j * block_k, block_k, -1)
        if flex is not None and flex.mask_mod is not None:
            indices = _indices(jnp, *flex.heads, i * block_q, block_q, j * block_k, block_k)
            keep = keep & as_tile(flex.mask_mod(*indices), shape)
        return keep

    def tile(q_block: Any, k: Any, j: Any) -> Any:
        """The scores of a block of queries against key block ``j``."""
        k_block = lax.dynamic_slice_in_dim(k, j * block_k, block_k, axis=1)
        return jnp.einsum(scores_of, q_block, k_block) * scale

    def modded(scores: Any, i: Any, j: Any, tables: tuple[Any, ...]) -> Any:
        """A tile's scores through the score_mod, where there is one."""
        if flex is None or flex.score_mod is None:
            return scores
        indices = _indices(jnp, *flex.heads, i * block_q, block_q, j * block_k, block_k)
        result = flex.score_mod(scores.reshape(*flex.heads, block_q, block_k), *indices, *tables)
        return as_tile(result.astype(scores.dtype), scores.shape)  # as attnx.flex.call_score_mod keeps it

    def pad_all(q: Any, k: Any, v: Any, counts: Any, mask: Any) -> tuple[Any, ...]:
        row_blocks, key_blocks, _, _ = plan(q.shape[-2], k.shape[1])
        rows, keys = row_blocks * block_q, key_blocks * block_k
        q, k, v = padded(q, rows, -2), padded(k, keys, 1), padded(v, keys, 1)
        counts = None if counts is None else padded(counts, rows, -1)  # padded rows: no key
        mask = None if mask is None else padded(padded(mask, rows, -2, False), keys, -1, False)
        return q, k, v, counts, mask

    def forward(q: Any, k: Any, v: Any, counts: Any, mask: Any, tables: tuple[Any, ...]) -> tuple[Any, Any]:
        n, m = q.shape[-2], k.shape[1]
        row_blocks, key_blocks, offset, _ = plan(n, m)
        q, k, v, counts, mask = pad_all(q, k, v, counts, mask)
        shape, d_v = q.shape[:-2], v.shape[-1]

        def row_block(i: Any) -> tuple[Any, Any]:
            q_block = cut(q, i * block_q, block_q, -2)
            stop, block = keys_read(i, offset, key_blocks)

            def step(t: Any, state: tuple[Any, Any, Any]) -> tuple[Any, Any, Any]:
                total, largest, acc = state
                j = block(t)
                scores = modded(tile(q_block, k, j), i, j, tables)
                scores = jnp.where(allowed(i, j, offset, m, counts, mask, scores.shape), scores, -jnp.inf)
                new_largest = jnp.maximum(largest, scores.max(-1))
                shift = jnp.where(jnp.isfinite(new_largest), new_largest, 0.0)
                weights = jnp.exp(scores - shift[..., None])
                rescale = jnp.exp(jnp.where(jnp.isfinite(largest), largest - shift, -jnp.inf))
                v_block = lax.dynamic_slice_in_dim(v, j * block_k, block_k, axis=1)
                acc = acc * rescale[..., None] + jnp.einsum(weighted, weights, v_block)
                return total * rescale + weights.sum(-1), new_largest, acc

            state = (
                jnp.zeros((*shape, block_q), q.dtype),
                jnp.full((*shape, block_q), -jnp.inf, q.dtype),
                jnp.zeros((*shape, block_q, d_v), q.dtype),
            )
            total, largest, acc = lax.fori_loop(0, stop, step, state)
            output = acc / jnp.where(total > 0, total, 1.0)[..., None]  # a row with no key: zeros
            log_sum = jnp.where(total > 0, largest + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)
            return output, log_sum

        outputs, log_sums = lax.map(row_block, jnp.arange(row_blocks))  # (row_blocks, S, [G,] block_q, ...)
        output = jnp.moveaxis(outputs, 0, -3).reshape(*shape, row_blocks * block_q, d_v)[..., :n, :]
        log_sum = jnp.moveaxis(log_sums, 0, -2).reshape(*shape, row_blocks * block_q)[..., :n]
        return output, log_sum

    @jax.custom_vjp
    def flash(q: Any, k: Any, v: Any, counts: Any, mask: Any, *tables: Any) -> Any:
        return forward(q, k, v, counts, mask, tables)[0]

    def flash_forward(q: Any, k: Any, v: Any, counts: Any, mask: Any, *tables: Any) -> tuple[Any, Any]:
        output, log_sum = forward(q, k, v, counts, mask, tables)
        return output, (q, k, v, counts, mask, tables, output, log_sum)

    def flash_backward(saved: Any, d_output: Any) -> tuple[Any, ...]:
        q, k, v, counts, mask, tables, output, log_sum = saved
        n, m, d_k = q.shape[-2], k.shape[1], q.shape[-1]
        row_blocks, key_blocks, offset, _ = plan(n, m)
        shift = jnp.sum(d_output * output, axis=-1)  # D = rowsum(dO * O)
        rows_padded = row_blocks * block_q
        q, k, v, counts, mask = pad_all(q, k, v, counts, mask)
        d_output, shift = padded(d_output, rows_padded, -2), padded(shift, rows_padded, -1)
        # Padded rows and rows with no key: -inf, so their weights are 0.
        log_sum = padded(log_sum, rows_padded, -1, -jnp.inf)
        # The tables' gradients (a score_mod's), where they are real.
        learned = [jnp.issubdtype(table.dtype, jnp.inexact) for table in tables]

        def key_block(carry: tuple[Any, Any], j: Any) -> tuple[tuple[Any, Any], tuple[Any, Any]]:
            k_block = lax.dynamic_slice_in_dim(k, j * block_k, block_k, axis=1)
            v_block = lax.dynamic_slice_in_dim(v, j * block_k, block_k, axis=1)
            start, stop, block = rows_reading(j, offset, row_blocks)

            def step(t: Any, state: tuple[Any, Any, Any, Any]) -> tuple[Any, Any, Any, Any]:
                d_key, d_value, d_query, d_tables = state
                i = block(t)
                q_block, d_out = (cut(a, i * block_q, block_q, -2) for a in (q, d_output))
                lse, row_shift = (cut(a, i * block_q, block_q, -1) for a in (log_sum, shift))
                finite = jnp.isfinite(lse)[..., None]
                raw = tile(q_block, k, j)

                def through_mod(raw: Any, *reals: Any) -> Any:
                    given = iter(reals)
                    return modded(raw, i, j, tuple(next(given) if real else t for t, real in zip(tables, learned)))

                scores, mod_vjp = jax.vjp(through_mod, raw, *(t for t, real in zip(tables, learned) if real))
                keep = allowed(i, j, offset, m, counts, mask, raw.shape) & finite
                weights = jnp.where(keep, jnp.exp(scores - jnp.where(finite, lse[..., None], 0.0)), 0.0)
                d_value = d_value + jnp.einsum(summed, weights, d_out)
                d_scores = weights * (jnp.einsum(by_rows, d_out, v_block) - row_shift[..., None])
                # Back through the score_mod (the identity without one): to the raw scores and its tables.
                d_scores, *parts = mod_vjp(d_scores)
                d_tables = tuple(total + part for total, part in zip(d_tables, parts, strict=True))
                d_key = d_key + jnp.einsum(summed, d_scores, q_block) * scale
                part = jnp.einsum(weighted, d_scores, k_block) * scale
                rows = d_query.ndim - 2
                d_query = lax.dynamic_update_slice_in_dim(
                    d_query, cut(d_query, i * block_q, block_q, -2) + part, i * block_q, rows
                )
                return d_key, d_value, d_query, d_tables

            d_query, d_tables = carry
            state = (jnp.zeros_like(k_block), jnp.zeros_like(v_block), d_query, d_tables)
            d_key, d_value, d_query, d_tables = lax.fori_loop(start, stop, step, state)
            return (d_query, d_tables), (d_key, d_value)

        zeros = tuple(jnp.zeros_like(table) for table, real in zip(tables, learned) if real)
        (d_query, d_tables), (d_keys, d_values) = lax.scan(
            key_block, (jnp.zeros_like(q), zeros), jnp.arange(key_blocks)
        )
        key_slices = k.shape[0]
        d_key = jnp.moveaxis(d_keys, 0, 1).reshape(key_slices, key_blocks * block_k, d_k)[:, :m]
        d_value = jnp.moveaxis(d_values, 0, 1).reshape(key_slices, key_blocks * block_k, v.shape[-1])[:, :m]
        # The counts, the mask and integer tables: no gradient.
        given = iter(d_tables)
        tables_cotangents = tuple(next(given) if real else None for real in learned)
        return (d_query[..., :n, :], d_key, d_value, None, None, *tables_cotangents)

    flash.defvjp(flash_forward, flash_backward)
    return jax.jit(flash)  # compiled once a shape when called eagerly; inlined under an outer jit
