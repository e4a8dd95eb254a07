"""The backwards of attention and of the masked softmax (:func:`attnx.vjp`).

Attention's walks the forward's tiles (:func:`attnx._tiling.backward_tiles`),
array API only, so it runs where no autograd does (NumPy, CuPy, Dask) and
keeps the forward's memory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from attnx import _checks, _cotangents, _dispatch, _dropout, _grouping, _tiling
from attnx.attention import (
    _SDPA,
    ValidatedCall,
    computed,
    masked_softmax,
    planned_chunks,
    sdpa_tile_plan,
    validated_call,
)

__all__ = ["masked_softmax_vjp", "scaled_dot_product_attention_vjp"]


def scaled_dot_product_attention_vjp(
    query: Any,
    key: Any,
    value: Any,
    *,
    mask: Any = None,
    key_lengths: Any = None,
    is_causal: bool = False,
    causal_align: str = "bottom_right",
    scale: Any = None,
    enable_gqa: bool = False,
    return_weights: bool = False,
    chunk_size: Any = None,
    dropout_p: float = 0.0,
    dropout_seed: Any = None,
    backend: str | None = None,
) -> tuple[Any, Callable[[Any], dict[str, Any]]]:
    operation = f"vjp({_SDPA})"
    _checks.require_flag(operation, "return_weights", return_weights)
    if return_weights:
        raise ValueError(
            f"{operation}: return_weights=True has two outputs; differentiate the weights through attnx.masked_softmax"
        )
    call = validated_call(
        operation,
        query,
        key,
        value,
        mask=mask,
        key_lengths=key_lengths,
        is_causal=is_causal,
        causal_align=causal_align,
        scale=scale,
        enable_gqa=enable_gqa,
        return_weights=False,
        dropout_p=dropout_p,
        dropout_seed=dropout_seed,
        backend=backend,
    )
    chosen, xp = call.chosen, call.chosen.xp
    real_mask = mask is not None and _checks.is_float_dtype(xp, mask.dtype)
    given = {"query": query, "key": key, "value": value, "mask": mask}  # the shapes the gradients take
    query, key, value, mask, key_lengths, is_causal, batch_shape, n = call.computed
    found = _native(operation, call, chunk_size)
    native = None if found is None else found[1]
    _dispatch.log_choice(operation, chosen.name, call.reason, "generic" if native is None else "native")
    output = computed(call, chunk_size=chunk_size, dropout_seed=dropout_seed) if found is None else found[0]
    given_output = call.given(output)
    if native is None:
        backward_tiles = _generic_backward(call, output, chunk_size, dropout_seed, real_mask)

    def backward(cotangent: Any) -> dict[str, Any]:
        _cotangents.require(operation, cotangent, given_output)
        if enable_gqa:
            cotangent = _grouping.group(xp, cotangent, tuple(output.shape))
        if native is not None:
            d_query, d_key, d_value, d_scale = native(cotangent)
            d_mask = []
        else:
            d_query, d_key, d_value, d_scale, *d_mask = backward_tiles(cotangent)
        grads = {
            "query": _cotangents.like(xp, d_query, query),
            "key": _cotangents.like(xp, d_key, key),
            "value": _cotangents.like(xp, d_value, value),
        }
        if real_mask:  # added to the scores: their gradient, summed where it broadcasts
            grads["mask"] = _cotangents.like(xp, d_mask[0], mask)
        if enable_gqa:  # in the caller's shapes
            for name, grad in grads.items():
                shape = tuple(given[name].shape)
                grads[name] = _grouping.ungroup(xp, grad, shape) if name == "query" else xp.reshape(grad, shape)
        if _cotangents.gets_cotangent(scale):
            grads["scale"] = _cotangents.like(xp, d_scale, scale) if chosen.owns(scale) else d_scale
        return grads

    return given_output, backward


def _native(operation: str, call: ValidatedCall, chunk_size: Any) -> tuple[Any, Callable[[Any], Any]] | None:
    """The backend's native ``(output, backward)`` of a validated call, or
    None where it has none or declines it (dropout: natives draw their masks
    their own way).  Its backward gives ``(d_query, d_key, d_value,
    d_scale)`` in the computed layout, as :func:`attnx._tiling.backward_tiles`."""
    native = None if call.dropout_p else call.chosen.implementations().get(operation)
    if native is None:
        return None
    query, key, value, mask, key_lengths, is_causal, batch_shape, _ = call.computed
    found = native(
        query=query,
        key=key,
        value=value,
        mask=mask,
        key_lengths=key_lengths,
        is_causal=is_causal,
        scale=call.scale,
        chunks=planned_chunks(call, chunk_size)[0],
        batch_shape=batch_shape,
        chunk_size=chunk_size,
    )
    return None if found is NotImplemented else found


def _generic_backward(
    call: ValidatedCall, output: Any, chunk_size: Any, dropout_seed: Any, real_mask: bool
) -> Callable[[Any], tuple[Any, ...]]:
    """attnx's tiled backward of a validated call (:func:`attnx._tiling.backward_tiles`),
    planned as its forward's tiles: a function of the cotangent."""
    chosen, xp = call.chosen, call.chosen.xp
    query, key, value, mask, key_lengths, is_causal, batch_shape, n = call.computed
    # The forward's mask, made again tile by tile (the forward checked the arguments)
    dropout = _dropout.make(xp, float(call.dropout_p), dropout_seed, batch_shape, query)
    chunks, block_bytes = planned_chunks(call, chunk_size)
    chunks = chunks or (max(1, n), max(1, key.shape[-2]))
    tiles, tile_scores = sdpa_tile_plan(
        xp,
        query,
        key,
        mask=mask,
        key_lengths=key_lengths,
        is_causal=is_causal,
        batch_shape=batch_shape,
        key_chunk=chunks[1],
    )

    def backward(cotangent: Any) -> tuple[Any, ...]:
        return _tiling.backward_tiles(
            xp,
            query,
            key,
            value,
            output,
            cotangent,
            scale=call.scale,
            batch_shape=batch_shape,
            query_chunk=chunks[0],
            key_chunk=chunks[1],
            tiles=tiles,
            tile_scores=tile_scores,
            map_blocks=chosen.map_blocks,
            concurrent_blocks=chosen.concurrent_blocks,
            block_bytes=block_bytes,
            mask_shape=tuple(mask.shape) if real_mask else None,
            dropout=dropout,
        )

    return backward


def masked_softmax_vjp(
    scores: Any, *, mask: Any = None, key_lengths: Any = None, axis: int = -1, backend: str | None = None
) -> tuple[Any, Callable[[Any], dict[str, Any]]]:
    operation = "vjp(masked_softmax)"
    weights = masked_softmax(scores, mask=mask, key_lengths=key_lengths, axis=axis, backend=backend)
    chosen, _ = _dispatch.resolve(operation, backend, ("scores", "mask", "key_lengths"), (scores, mask, key_lengths))
    xp = chosen.xp
    real_mask = mask is not None and _checks.is_float_dtype(xp, mask.dtype)

    def backward(cotangent: Any) -> dict[str, Any]:
        _cotangents.require(operation, cotangent, weights)
        compute, (w, g) = _checks.in_accumulation_dtype(xp, weights, cotangent)
        d_scores = w * (g - xp.sum(g * w, axis=axis, keepdims=True))  # 0 where masked: w is 0 there
        grads = {"scores": _cotangents.like(xp, d_scores, scores)}
        if real_mask:  # added to the scores: the same gradient, summed over its broadcast axes
            grads["mask"] = _cotangents.like(xp, d_scores, mask)
        return grads

    return weights, backward
