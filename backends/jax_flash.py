"""FlashAttention in JAX's loops: the JAX backend's tiled SDPA, forward and backward.

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
"""

from __future__ import annotations

import functools
import math
from typing import Any


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
) -> Any:
    """Attention of ``(..., n, d)`` queries against ``(..., m, d)`` keys and
    values, in blocks of ``blocks = (queries, keys)``, differentiable by its
    own backward.  The leading shapes are one, or grouped (``groups`` > 1):
    the keys' ``(..., H_kv, 1)`` against the queries' ``(..., H_kv, G)``.
    ``counts`` (integers broadcastable to ``(..., n)``): query ``i``
    attends the keys ``j < counts[..., i]`` only; ``mask`` (boolean,
    ``(S or 1, n or 1, m or 1)`` over the ``S`` query slices laid end to
    end): True where a query may attend a key."""
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
    output = _attention(float(scale), bool(is_causal), block_q, block_k, groups > 1)(q, k, v, counts, mask)
    return output.reshape(*leading, n, value.shape[-1])


@functools.lru_cache(maxsize=64)
def _attention(scale: float, is_causal: bool, block_q: int, block_k: int, grouped: bool) -> Any:
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

    def last_block(row_block: Any, offset: int, key_blocks: int) -> Any:
        """One past the last block of keys the row block reads."""
        if not is_causal:
            return key_blocks
        last_key = (row_block + 1) * block_q - 1 + offset  # the block's last query's last key
        return jnp.clip(last_key // block_k + 1, 0, key_blocks)

    def first_row_block(key_block: Any, offset: int, row_blocks: int) -> Any:
        """The first block of queries that reads the key block."""
        if not is_causal:
            return 0
        first_row = key_block * block_k - offset  # the first query that reads the block's first key
        return jnp.clip(first_row // block_q, 0, row_blocks)

    def allowed(i: Any, j: Any, offset: int, m: int, counts: Any, mask: Any) -> Any:
        """Where the queries of row block ``i`` may attend the keys of key
        block ``j``: ``(S or 1, [G or 1,] block_q, block_k)``."""
        rows = (i * block_q + jnp.arange(block_q))[:, None]
        cols = (j * block_k + jnp.arange(block_k))[None, :]
        keep = cols < m
        if is_causal:
            keep = keep & (cols <= rows + offset)
        if counts is not None:
            keep = keep & (cols < cut(counts, i * block_q, block_q, -1)[..., None])
        if mask is not None:
            keep = keep & cut(cut(mask, i * block_q, block_q, -2), j * block_k, block_k, -1)
        return keep

    def tile(q_block: Any, k: Any, j: Any) -> Any:
        """The scores of a block of queries against key block ``j``."""
        k_block = lax.dynamic_slice_in_dim(k, j * block_k, block_k, axis=1)
        return jnp.einsum(scores_of, q_block, k_block) * scale

    def pad_all(q: Any, k: Any, v: Any, counts: Any, mask: Any) -> tuple[Any, ...]:
        row_blocks, key_blocks, _, _ = plan(q.shape[-2], k.shape[1])
        rows, keys = row_blocks * block_q, key_blocks * block_k
        q, k, v = padded(q, rows, -2), padded(k, keys, 1), padded(v, keys, 1)
        counts = None if counts is None else padded(counts, rows, -1)  # padded rows: no key
        mask = None if mask is None else padded(padded(mask, rows, -2, False), keys, -1, False)
        return q, k, v, counts, mask

    def forward(q: Any, k: Any, v: Any, counts: Any, mask: Any) -> tuple[Any, Any]:
        n, m = q.shape[-2], k.shape[1]
        row_blocks, key_blocks, offset, _ = plan(n, m)
        q, k, v, counts, mask = pad_all(q, k, v, counts, mask)
        shape, d_v = q.shape[:-2], v.shape[-1]

        def row_block(i: Any) -> tuple[Any, Any]:
            q_block = cut(q, i * block_q, block_q, -2)

            def step(j: Any, state: tuple[Any, Any, Any]) -> tuple[Any, Any, Any]:
                total, largest, acc = state
                scores = jnp.where(allowed(i, j, offset, m, counts, mask), tile(q_block, k, j), -jnp.inf)
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
            total, largest, acc = lax.fori_loop(0, last_block(i, offset, key_blocks), step, state)
            output = acc / jnp.where(total > 0, total, 1.0)[..., None]  # a row with no key: zeros
            log_sum = jnp.where(total > 0, largest + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)
            return output, log_sum

        outputs, log_sums = lax.map(row_block, jnp.arange(row_blocks))  # (row_blocks, S, [G,] block_q, ...)
        output = jnp.moveaxis(outputs, 0, -3).reshape(*shape, row_blocks * block_q, d_v)[..., :n, :]
        log_sum = jnp.moveaxis(log_sums, 0, -2).reshape(*shape, row_blocks * block_q)[..., :n]
        return output, log_sum

    @jax.custom_vjp
    def flash(q: Any, k: Any, v: Any, counts: Any, mask: Any) -> Any:
        return forward(q, k, v, counts, mask)[0]

    def flash_forward(q: Any, k: Any, v: Any, counts: Any, mask: Any) -> tuple[Any, Any]:
        output, log_sum = forward(q, k, v, counts, mask)
        return output, (q, k, v, counts, mask, output, log_sum)

    def flash_backward(saved: Any, d_output: Any) -> tuple[Any, ...]:
        q, k, v, counts, mask, output, log_sum = saved
        n, m, d_k = q.shape[-2], k.shape[1], q.shape[-1]
        row_blocks, key_blocks, offset, _ = plan(n, m)
        shift = jnp.sum(d_output * output, axis=-1)  # D = rowsum(dO * O)
        rows_padded = row_blocks * block_q
        q, k, v, counts, mask = pad_all(q, k, v, counts, mask)
        d_output, shift = padded(d_output, rows_padded, -2), padded(shift, rows_padded, -1)
        # Padded rows and rows with no key: -inf, so their weights are 0.
        log_sum = padded(log_sum, rows_padded, -1, -jnp.inf)

        def key_block(d_query: Any, j: Any) -> tuple[Any, tuple[Any, Any]]:
            k_block = lax.dynamic_slice_in_dim(k, j * block_k, block_k, axis=1)
            v_block = lax.dynamic_slice_in_dim(v, j * block_k, block_k, axis=1)

            def step(i: Any, state: tuple[Any, Any, Any]) -> tuple[Any, Any, Any]:
                d_key, d_value, d_query = state
                q_block, d_out = (cut(a, i * block_q, block_q, -2) for a in (q, d_output))
                lse, row_shift = (cut(a, i * block_q, block_q, -1) for a in (log_sum, shift))
                finite = jnp.isfinite(lse)[..., None]
                keep = allowed(i, j, offset, m, counts, mask) & finite
                scores = tile(q_block, k, j)
                weights = jnp.where(keep, jnp.exp(scores - jnp.where(finite, lse[..., None], 0.0)), 0.0)
                d_value = d_value + jnp.einsum(summed, weights, d_out)
                d_scores = weights * (jnp.einsum(by_rows, d_out, v_block) - row_shift[..., None])
                d_key = d_key + jnp.einsum(summed, d_scores, q_block) * scale
                part = jnp.einsum(weighted, d_scores, k_block) * scale
                rows = d_query.ndim - 2
                d_query = lax.dynamic_update_slice_in_dim(
                    d_query, cut(d_query, i * block_q, block_q, -2) + part, i * block_q, rows
                )
                return d_key, d_value, d_query

            state = (jnp.zeros_like(k_block), jnp.zeros_like(v_block), d_query)
            d_key, d_value, d_query = lax.fori_loop(first_row_block(j, offset, row_blocks), row_blocks, step, state)
            return d_query, (d_key, d_value)

        d_query, (d_keys, d_values) = lax.scan(key_block, jnp.zeros_like(q), jnp.arange(key_blocks))
        key_slices = k.shape[0]
        d_key = jnp.moveaxis(d_keys, 0, 1).reshape(key_slices, key_blocks * block_k, d_k)[:, :m]
        d_value = jnp.moveaxis(d_values, 0, 1).reshape(key_slices, key_blocks * block_k, v.shape[-1])[:, :m]
        return d_query[..., :n, :], d_key, d_value, None, None  # the counts and the mask: no gradient

    flash.defvjp(flash_forward, flash_backward)
    return jax.jit(flash)  # compiled once a shape when called eagerly; inlined under an outer jit
