"""The NumPy backend's native backward of scaled dot-product attention
(:func:`attnx.vjp`), in plain NumPy.

FlashAttention-2's backward, as the native forward (:mod:`.numpy_attention`)
is its forward: the forward keeps each row's log-sum-exp, and the backward
makes each tile's weights again from it, ``P = exp(q k^T s - lse)``, then
adds the tile's part of every gradient (``dS = P * (dO V^T - rowsum(dO *
O))``), in place in two buffers of a tile each, on threads that each hold
BLAS to one core.  No tile outlives its step: the memory is the forward's
blocks plus the gradients.  attnx's generic backward
(:func:`attnx._tiling.backward_tiles`) is the reference; it walks each
range of rows twice (once for the statistics this one is given) in NumPy
calls that allocate each tile anew, and took 2.3x this one's time at (1, 8,
2048, 64) float32 on two cores.

A task owns whole key/value slices (a group's, with grouped heads), so the
key and value gradients of one slice are summed by one thread; where the
slices are fewer than the threads, each slice's rows are shared out too,
each share summing into gradients of its own that are added after.  The
causal rule, boolean masks and lengths forbid keys as in the forward: their
scores become ``-inf`` before the exponential, so a row that attends
nothing gets zero gradients.  A real mask (whose gradient the generic
backward gives) and a call the forward declines go to the generic backward.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np

from attnx import get_memory_budget, natives

from .numpy_attention import (
    _as_slices,
    _last_keys,
    _mask_future,
    _products,
    _scratch,
    _slices_taken,
    as_held,
    attend,
    keys_first,
    plan,
)
from .numpy_masks import CallMasks


def scaled_dot_product_attention_vjp(
    *,
    query: Any,
    key: Any,
    value: Any,
    mask: Any,
    key_lengths: Any,
    is_causal: bool,
    scale: Any,
    chunks: tuple[int, int] | None,
    batch_shape: tuple[int, ...],
    chunk_size: Any,
    backend: Any,
) -> Any:
    """attnx's native entry point for ``vjp(scaled_dot_product_attention)``
    (see :meth:`attnx.Backend.implementations`): ``(output, backward)``, or
    ``NotImplemented`` for a call it leaves to the generic backward.  A
    ``chunk_size`` the user gave sets the rows and keys of each tile
    (``chunks``), forward and backward; else they are planned here."""
    slices = _slices_taken(query, key, is_causal, False, batch_shape)
    if slices is None or (mask is not None and mask.dtype != np.bool_):
        return NotImplemented
    n, m, d_k, d_v = query.shape[-2], key.shape[-2], query.shape[-1], value.shape[-1]
    dtype = query.dtype
    scale = scale if type(scale) is float else dtype.type(scale)
    chunks = chunks if chunk_size is not None else None
    output, lse = attend(
        query, key, value, mask, key_lengths, is_causal, scale, chunks, batch_shape, chunk_size, backend, True
    )
    groups = natives.key_groups(query.shape, key.shape, value.shape)
    if groups > 1:  # grouped heads (attnx._grouping): one key/value slice serves a group of query slices
        k, v = (a.reshape(slices // groups, m, a.shape[-1]) for a in (key, value))
    else:
        k, v = (_as_slices(a, batch_shape, slices) for a in (key, value))
    q = _as_slices(query, batch_shape, slices)
    masks = CallMasks(mask, key_lengths, batch_shape, n, m) if mask is not None or key_lengths is not None else None

    def backward(cotangent: Any) -> tuple[Any, Any, Any, Any]:
        d_out = _as_slices(cotangent, batch_shape, slices)
        d_query, d_key, d_value, d_scale = _backward(
            q, k, v, d_out, lse, output, scale, is_causal, masks, groups, chunks, backend
        )
        if groups > 1:  # in the keys' and values' own shapes
            d_key, d_value = d_key.reshape(key.shape), d_value.reshape(value.shape)
        else:
            d_key, d_value = d_key.reshape(*batch_shape, m, d_k), d_value.reshape(*batch_shape, m, d_v)
        return d_query.reshape(*batch_shape, n, d_k), d_key, d_value, d_scale

    return output.reshape(*batch_shape, n, d_v), backward


def _backward(
    q: Any,
    k: Any,
    v: Any,
    d_out: Any,
    lse: Any,
    output: Any,
    scale: Any,
    is_causal: bool,
    masks: CallMasks | None,
    groups: int,
    chunks: tuple[int, int] | None,
    backend: Any,
) -> tuple[Any, Any, Any, Any]:
    """``(d_query, d_key, d_value, d_scale)`` of ``(slices, n, d)`` query
    slices against ``(slices / groups, m, d)`` key/value slices, given the
    forward's ``output`` and row statistics ``lse``."""
    slices, n, d_k = q.shape
    key_slices, m, d_v = v.shape
    dtype = q.dtype
    threads = backend.concurrent_blocks
    # Two buffers of a tile each (the weights and their gradient): the
    # forward's tiles (numpy_attention.plan) in half its budget.
    budget = get_memory_budget(backend, "cpu") // 2
    per_thread = max(1, budget // threads)
    _, rows, key_chunk = plan(slices, n, m, dtype.itemsize, False, threads, budget) if chunks is None else (1, *chunks)
    # Query slices a tile, within one group (its keys one slice) and the budget.
    per_tile = max(1, min(groups if groups > 1 else slices, per_thread // (rows * key_chunk * dtype.itemsize)))
    while groups % per_tile and groups > 1:
        per_tile -= 1
    starts = list(range(0, n, rows))
    # Tasks own whole key slices; too few of them for the threads: their rows are shared out as well.
    shares = max(1, min(len(starts), -(-threads // key_slices))) if threads > 1 else 1
    if shares > 1:
        per_task = 1
    elif threads > 1:  # two tasks a thread or more, so that threads finishing early find more
        per_task = max(1, key_slices // (2 * threads))
    else:
        per_task = key_slices
    tasks = [
        (k0, min(key_slices, k0 + per_task), share) for k0 in range(0, key_slices, per_task) for share in range(shares)
    ]
    d_query = np.empty_like(q)
    d_key = np.zeros((key_slices, m, d_k), dtype=dtype) if shares == 1 else None
    d_value = np.zeros((key_slices, m, d_v), dtype=dtype) if shares == 1 else None

    def task(item: tuple[int, int, int]) -> tuple[int, Any, Any, Any]:
        k0, k1, share = item
        own_key = d_key[k0:k1] if shares == 1 else np.zeros((k1 - k0, m, d_k), dtype=dtype)
        own_value = d_value[k0:k1] if shares == 1 else np.zeros((k1 - k0, m, d_v), dtype=dtype)
        weights_buffer, gradient_buffer = (
            _scratch(per_tile * rows * key_chunk, dtype),
            _scratch(per_tile * rows * key_chunk, dtype, "gradients"),
        )
        parts_buffer = _scratch(parts_size(per_tile, rows, key_chunk, d_k, d_v), dtype, "parts")
        factors = (
            None if masks is None or masks.lengths is None else _scratch(per_tile * rows * key_chunk, dtype, "factors")
        )
        d_scale = 0.0
        for s0 in range(k0 * groups, k1 * groups, per_tile):
            s1 = min(k1 * groups, s0 + per_tile)
            for a0, a1 in [(s0, s1)] if masks is None else masks.runs(s0, s1):
                kv = (
                    slice(a0 - k0 * groups, a1 - k0 * groups)
                    if groups == 1
                    else slice(a0 // groups - k0, a0 // groups - k0 + 1)
                )
                kv_global = slice(kv.start + k0, kv.stop + k0)
                block_masks = None if masks is None else masks.slices(a0, a1)
                for r0 in starts[share::shares]:
                    r1 = min(n, r0 + rows)
                    d_scale += _rows(
                        q[a0:a1, r0:r1],
                        k[kv_global],
                        v[kv_global],
                        d_out[a0:a1, r0:r1],
                        lse[a0:a1, r0:r1],
                        output[a0:a1, r0:r1],
                        d_query[a0:a1, r0:r1],
                        own_key[kv],
                        own_value[kv],
                        scale,
                        is_causal,
                        r0,
                        n,
                        key_chunk,
                        block_masks,
                        weights_buffer,
                        gradient_buffer,
                        parts_buffer,
                        factors,
                    )
        return k0, own_key, own_value, d_scale

    run: Callable[..., list[Any]] = backend.map_blocks if len(tasks) > 1 else (lambda f, items: [f(i) for i in items])
    results = run(task, tasks)
    if shares > 1:  # each share's sums of the same slices, added
        d_key = np.zeros((key_slices, m, d_k), dtype=dtype)
        d_value = np.zeros((key_slices, m, d_v), dtype=dtype)
        for k0, own_key, own_value, _ in results:
            d_key[k0 : k0 + own_key.shape[0]] += own_key
            d_value[k0 : k0 + own_value.shape[0]] += own_value
    d_scale = np.asarray(math.fsum(result[3] for result in results), dtype=dtype)
    return d_query, d_key, d_value, d_scale


def parts_size(slices: int, rows: int, key_chunk: int, d_k: int, d_v: int) -> int:
    """Items of :func:`_rows`'s ``parts_buffer`` for tiles of ``slices`` by
    ``rows`` by ``key_chunk``: the scaled queries, then room for the largest
    product (a tile's rows or keys by a feature axis)."""
    return slices * (rows * d_k + max(rows, key_chunk) * max(d_k, d_v))


def _rows(
    q: Any,
    k: Any,
    v: Any,
    d_out: Any,
    lse: Any,
    output: Any,
    d_query: Any,
    d_key: Any,
    d_value: Any,
    scale: Any,
    is_causal: bool,
    r0: int,
    n: int,
    key_chunk: int,
    masks: Any,
    weights_buffer: Any,
    gradient_buffer: Any,
    parts_buffer: Any,
    factors: Any,
) -> float:
    """The gradients' parts from the query rows ``r0:r0 + rows`` of some
    slices (``q``: ``(slices, rows, d_k)``; ``output``, their forward's
    outputs) against their keys (``k``: ``(slices or 1, m, d_k)``): their
    ``d_query`` rows written, their parts of ``d_key`` and ``d_value``
    (``k``'s slices) added; returns their part of the scale's gradient.
    ``parts_buffer`` (flat, :func:`parts_size` items) holds the scaled
    queries and each product before it is added."""
    a, rows, m = q.shape[0], q.shape[1], k.shape[1]
    stop = min(m, r0 + rows + m - n) if is_causal else m
    free = stop
    if masks is not None:
        stop, free = masks.key_range(r0, r0 + rows, stop)
    if stop == 0:  # no row attends a key: no gradient
        d_query[...] = 0
        return 0.0
    # The products to be added, in this thread's buffer rather than arrays
    # of their own made and freed at every tile, which move glibc's heap
    # top up and down (a training loop paid page faults every other step;
    # most of those that are left are the gradients', new arrays each step).
    d_k, d_v = q.shape[2], v.shape[2]
    q_scaled = np.multiply(q, scale, out=parts_buffer[: a * rows * d_k].reshape(a, rows, d_k))
    parts = parts_buffer[a * rows * d_k :]

    def part(shape: tuple[int, ...]) -> Any:
        return parts[: math.prod(shape)].reshape(shape)

    shift = np.multiply(d_out, output, out=part((a, rows, d_v))).sum(axis=-1, keepdims=True)  # rowsum(dO * O)
    shared = k.shape[0] == 1 and a > 1  # grouped heads: the group's parts summed into one key slice
    # Tiles are held as the forward's are (numpy_attention.keys_first):
    # keys by queries but where a mask varies by query.  Passes over a
    # whole tile take it as it lies; products see it through a view.
    held_keys_first = keys_first(masks)
    key_t, value_t = k.transpose(0, 2, 1), v.transpose(0, 2, 1)
    lse_held, shift_held = as_held(lse, held_keys_first), as_held(shift, held_keys_first)
    for c0 in range(0, stop, key_chunk):
        c1 = min(stop, c0 + key_chunk)
        weights = _products(q_scaled, key_t, weights_buffer, c0, c1, held_keys_first)
        if is_causal:
            _mask_future(weights, r0, n, m, c0, c1, False, held_keys_first)
        if masks is not None:
            _, allowed, kept = masks.block(r0, r0 + rows, c0, c1, free, weights.dtype, factors)
            if allowed is not None:
                np.copyto(weights, -np.inf, where=~allowed)
            if kept is not None:
                np.copyto(_last_keys(weights, kept), -np.inf, where=kept == 0)
        held = as_held(weights, held_keys_first)
        held -= lse_held
        np.exp(held, out=held)  # P
        value_part = np.matmul(weights.transpose(0, 2, 1), d_out, out=part((a, c1 - c0, d_v)))
        d_value[:, c0:c1] += value_part.sum(axis=0, keepdims=True) if shared else value_part
        gradient = _products(d_out, value_t, gradient_buffer, c0, c1, held_keys_first)
        gradient_held = as_held(gradient, held_keys_first)
        gradient_held -= shift_held
        gradient_held *= held  # dS
        if c0 == 0:
            np.matmul(gradient, k[:, c0:c1], out=d_query)
        else:
            d_query += np.matmul(gradient, k[:, c0:c1], out=part(d_query.shape))
        key_part = np.matmul(gradient.transpose(0, 2, 1), q_scaled, out=part((a, c1 - c0, d_k)))
        d_key[:, c0:c1] += key_part.sum(axis=0, keepdims=True) if shared else key_part
    # dS K is d_query unscaled: the scale's gradient is its product with the queries
    d_scale = float(np.vdot(d_query, q))
    d_query *= scale
    return d_scale
