"""The backward of :func:`attnx.flex_attention` (:func:`attnx.vjp`).

It walks the forward's own tiles (:func:`attnx.flex.flex_tiles`): the
empty blocks of a block mask are skipped, the partial ones masked, grouped
heads share their key/value heads without copies, and the forward's row
statistics spare the backward a walk of its own.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from attnx import _checks, _cotangents, _tiling
from attnx.flex import _FLEX, _empty_shape, flex_tiles, validated_call

__all__ = ["flex_attention_vjp"]


def flex_attention_vjp(
    query: Any,
    key: Any,
    value: Any,
    score_mod: Any = None,
    block_mask: Any = None,
    *,
    scale: Any = None,
    enable_gqa: bool = False,
    return_weights: bool = False,
    dropout_p: float = 0.0,
    dropout_seed: Any = None,
    backend: str | None = None,
) -> tuple[Any, Callable[[Any], dict[str, Any]]]:
    operation = f"vjp({_FLEX})"
    chosen, _, arguments, dropout = validated_call(
        operation,
        query,
        key,
        value,
        score_mod,
        block_mask,
        scale,
        enable_gqa,
        return_weights,
        dropout_p,
        dropout_seed,
        backend,
    )
    if return_weights:
        raise ValueError(f"{operation}: return_weights=True has two outputs; differentiate the output alone")
    if score_mod is not None:
        raise TypeError(
            f"{operation}: can't differentiate a score_mod on {chosen.name!r} yet; without one it differentiates "
            "block masks (on PyTorch and JAX their autograd differentiates a score_mod, and what it closes over)"
        )
    xp, scale = chosen.xp, arguments["scale"]
    plan = flex_tiles(
        xp, query=query, key=key, value=value, score_mod=None, block_mask=block_mask, backend=chosen, dropout=dropout
    )
    if plan is None:  # an axis of size 0: zeros, and zero gradients
        output = xp.zeros(_empty_shape(query, key, value), dtype=query.dtype, device=_checks.device_of(query))
        return output, _backward(operation, xp, query, key, value, scale, output, None)
    grouped_output, stats = _tiling.attend_tiles(
        xp,
        plan.query,
        plan.key,
        plan.value,
        scale=scale,
        tiles=plan.tiles,
        tile_scores=plan.tile_scores,
        with_stats=True,
        **plan.walk,
    )
    output = xp.reshape(grouped_output, plan.shape)

    def tiled(cotangent: Any) -> tuple[Any, ...]:
        return _tiling.backward_tiles(
            xp,
            plan.query,
            plan.key,
            plan.value,
            grouped_output,
            xp.reshape(cotangent, tuple(grouped_output.shape)),
            scale=scale,
            tiles=plan.tiles,
            tile_scores=plan.tile_scores,
            row_stats=stats,
            **plan.walk,
        )

    return output, _backward(operation, xp, query, key, value, scale, output, tiled)


def _backward(
    operation: str,
    xp: Any,
    query: Any,
    key: Any,
    value: Any,
    scale: Any,
    output: Any,
    tiled: Callable[[Any], tuple[Any, ...]] | None,
) -> Callable[[Any], dict[str, Any]]:
    """The backward that :func:`attnx.vjp` hands out: the tiles' gradients
    (zeros where ``tiled`` is None: nothing was computed), the grouped
    heads' key/value gradients summed over the query heads that share them,
    each summed to its argument's (broadcast) shape."""
    scale_is_array = not isinstance(scale, int | float)

    def backward(cotangent: Any) -> dict[str, Any]:
        _cotangents.require(operation, cotangent, output)
        grads = {name: xp.zeros_like(array) for name, array in (("query", query), ("key", key), ("value", value))}
        if scale_is_array:
            grads["scale"] = xp.zeros_like(scale)
        if tiled is None:
            return grads
        d_query, d_key, d_value, d_scale = tiled(cotangent)
        batch = d_query.shape[0]
        grads["query"] = _cotangents.like(xp, xp.reshape(d_query, (batch, *query.shape[1:])), query)
        # (B, H_kv, G, m, d): the G query heads of each key/value head summed
        grads["key"] = _cotangents.like(xp, xp.sum(d_key, axis=2), key)
        grads["value"] = _cotangents.like(xp, xp.sum(d_value, axis=2), value)
        if scale_is_array:
            grads["scale"] = _cotangents.like(xp, d_scale, scale)
        return grads

    return backward
