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
It takes the calls it computes exactly as attnx's algorithm: ``(B, H, n,
d)`` inputs of one leading shape, no ``mask`` or ``key_lengths``, a float
scale, causal in attnx's alignment (the last query sees every key); rows
with no key get zeros, and zero gradients.
"""

from __future__ import annotations

import functools
import math
from typing import Any


def attention(query: Any, key: Any, value: Any, *, scale: float, is_causal: bool, blocks: tuple[int, int]) -> Any:
    """Attention of ``(..., n, d)`` inputs of one leading shape, in blocks
    of ``blocks = (queries, keys)``, differentiable by its own backward."""
    leading = tuple(query.shape[:-2])
    n, m = query.shape[-2], key.shape[-2]
    block_q, block_k = max(1, min(blocks[0], n)), max(1, min(blocks[1], m))
    flat = [a.reshape(math.prod(leading), *a.shape[-2:]) for a in (query, key, value)]
    output = _attention(float(scale), bool(is_causal), block_q, block_k)(*flat)
    return output.reshape(*leading, n, value.shape[-1])


@functools.lru_cache(maxsize=64)
def _attention(scale: float, is_causal: bool, block_q: int, block_k: int) -> Any:
    import jax
    import jax.numpy as jnp
    from jax import lax

    def plan(n: int, m: int) -> tuple[int, int, int, int]:
        return -(-n // block_q), -(-m // block_k), m - n, m

    def padded(array: Any, size: int) -> Any:
        extra = size - array.shape[1]
        return array if extra == 0 else jnp.pad(array, ((0, 0), (0, extra), (0, 0)))

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

    def allowed(rows: Any, cols: Any, offset: int, m: int) -> Any:
        keep = cols[None, :] < m
        if is_causal:
            keep = keep & (cols[None, :] <= rows[:, None] + offset)
        return keep

    def tile(q_block: Any, k: Any, j: Any, rows: Any, offset: int, m: int) -> tuple[Any, Any, Any]:
        """The scores of a block of queries against key block ``j``, and its keys' mask."""
        cols = j * block_k + jnp.arange(block_k)
        k_block = lax.dynamic_slice_in_dim(k, j * block_k, block_k, axis=1)
        scores = jnp.einsum("sqd,skd->sqk", q_block, k_block) * scale
        return scores, allowed(rows, cols, offset, m)[None], cols

    def forward(q: Any, k: Any, v: Any) -> tuple[Any, Any]:
        n, m = q.shape[1], k.shape[1]
        row_blocks, key_blocks, offset, _ = plan(n, m)
        q, k, v = padded(q, row_blocks * block_q), padded(k, key_blocks * block_k), padded(v, key_blocks * block_k)
        slices, d_v = q.shape[0], v.shape[-1]

        def row_block(i: Any) -> tuple[Any, Any]:
            rows = i * block_q + jnp.arange(block_q)
            q_block = lax.dynamic_slice_in_dim(q, i * block_q, block_q, axis=1)

            def step(j: Any, state: tuple[Any, Any, Any]) -> tuple[Any, Any, Any]:
                total, largest, acc = state
                scores, keep, _ = tile(q_block, k, j, rows, offset, m)
                scores = jnp.where(keep, scores, -jnp.inf)
                new_largest = jnp.maximum(largest, scores.max(-1))
                shift = jnp.where(jnp.isfinite(new_largest), new_largest, 0.0)
                weights = jnp.exp(scores - shift[..., None])
                rescale = jnp.exp(jnp.where(jnp.isfinite(largest), largest - shift, -jnp.inf))
                v_block = lax.dynamic_slice_in_dim(v, j * block_k, block_k, axis=1)
                acc = acc * rescale[..., None] + jnp.einsum("sqk,skd->sqd", weights, v_block)
                return total * rescale + weights.sum(-1), new_largest, acc

            state = (
                jnp.zeros((slices, block_q), q.dtype),
                jnp.full((slices, block_q), -jnp.inf, q.dtype),
                jnp.zeros((slices, block_q, d_v), q.dtype),
            )
            total, largest, acc = lax.fori_loop(0, last_block(i, offset, key_blocks), step, state)
            output = acc / jnp.where(total > 0, total, 1.0)[..., None]  # a row with no key: zeros
            log_sum = jnp.where(total > 0, largest + jnp.log(jnp.where(total > 0, total, 1.0)), -jnp.inf)
            return output, log_sum

        outputs, log_sums = lax.map(row_block, jnp.arange(row_blocks))  # (row_blocks, S, block_q, ...)
        output = jnp.moveaxis(outputs, 0, 1).reshape(slices, row_blocks * block_q, d_v)[:, :n]
        log_sum = jnp.moveaxis(log_sums, 0, 1).reshape(slices, row_blocks * block_q)[:, :n]
        return output, log_sum

    @jax.custom_vjp
    def flash(q: Any, k: Any, v: Any) -> Any:
        return forward(q, k, v)[0]

    def flash_forward(q: Any, k: Any, v: Any) -> tuple[Any, Any]:
        output, log_sum = forward(q, k, v)
        return output, (q, k, v, output, log_sum)

    def flash_backward(saved: Any, d_output: Any) -> tuple[Any, Any, Any]:
        q, k, v, output, log_sum = saved
        n, m, d_k = q.shape[1], k.shape[1], q.shape[-1]
        row_blocks, key_blocks, offset, _ = plan(n, m)
        shift = jnp.sum(d_output * output, axis=-1)  # D = rowsum(dO * O)
        rows_padded = row_blocks * block_q
        q, d_output = padded(q, rows_padded), padded(d_output, rows_padded)
        shift = jnp.pad(shift, ((0, 0), (0, rows_padded - n)))
        # Padded rows and rows with no key: -inf, so their weights are 0.
        log_sum = jnp.pad(log_sum, ((0, 0), (0, rows_padded - n)), constant_values=-jnp.inf)
        k, v = padded(k, key_blocks * block_k), padded(v, key_blocks * block_k)

        def key_block(d_query: Any, j: Any) -> tuple[Any, tuple[Any, Any]]:
            k_block = lax.dynamic_slice_in_dim(k, j * block_k, block_k, axis=1)
            v_block = lax.dynamic_slice_in_dim(v, j * block_k, block_k, axis=1)

            def step(i: Any, state: tuple[Any, Any, Any]) -> tuple[Any, Any, Any]:
                d_key, d_value, d_query = state
                rows = i * block_q + jnp.arange(block_q)
                q_block = lax.dynamic_slice_in_dim(q, i * block_q, block_q, axis=1)
                d_out = lax.dynamic_slice_in_dim(d_output, i * block_q, block_q, axis=1)
                lse = lax.dynamic_slice_in_dim(log_sum, i * block_q, block_q, axis=1)
                row_shift = lax.dynamic_slice_in_dim(shift, i * block_q, block_q, axis=1)
                scores, keep, _ = tile(q_block, k, j, rows, offset, m)
                finite = jnp.isfinite(lse)[..., None]
                weights = jnp.where(keep & finite, jnp.exp(scores - jnp.where(finite, lse[..., None], 0.0)), 0.0)
                d_value = d_value + jnp.einsum("sqk,sqd->skd", weights, d_out)
                d_scores = weights * (jnp.einsum("sqd,skd->sqk", d_out, v_block) - row_shift[..., None])
                d_key = d_key + jnp.einsum("sqk,sqd->skd", d_scores, q_block) * scale
                part = jnp.einsum("sqk,skd->sqd", d_scores, k_block) * scale
                d_query = lax.dynamic_update_slice_in_dim(
                    d_query, lax.dynamic_slice_in_dim(d_query, i * block_q, block_q, axis=1) + part, i * block_q, axis=1
                )
                return d_key, d_value, d_query

            state = (jnp.zeros_like(k_block), jnp.zeros_like(v_block), d_query)
            d_key, d_value, d_query = lax.fori_loop(first_row_block(j, offset, row_blocks), row_blocks, step, state)
            return d_query, (d_key, d_value)

        d_query, (d_keys, d_values) = lax.scan(key_block, jnp.zeros_like(q), jnp.arange(key_blocks))
        slices = q.shape[0]
        d_key = jnp.moveaxis(d_keys, 0, 1).reshape(slices, key_blocks * block_k, d_k)[:, :m]
        d_value = jnp.moveaxis(d_values, 0, 1).reshape(slices, key_blocks * block_k, v.shape[-1])[:, :m]
        return d_query[:, :n], d_key, d_value

    flash.defvjp(flash_forward, flash_backward)
    return jax.jit(flash)  # compiled once a shape when called eagerly; inlined under an outer jit
