"""The backward of :func:`attnx.flex_attention` (:func:`attnx.vjp`).

It walks the forward's own tiles (:func:`attnx.flex.flex_tiles`): the
empty blocks of a block mask are skipped, the partial ones masked, grouped
heads share their key/value heads without copies, and the forward's row
statistics spare the backward a walk of its own.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from attnx import _checks, _cotangents, _tiling
from attnx.flex import _FLEX, empty_shape, flex_attention, flex_tiles, mod_backward, tile_score_vjp, validated_call

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
    mod = None
    if score_mod is not None:
        mod = mod_backward(score_mod)
        if mod is None and chosen.supports_autograd:
            call = functools.partial(
                flex_attention,
                score_mod=score_mod,
                block_mask=block_mask,
                enable_gqa=enable_gqa,
                dropout_p=dropout_p,
                dropout_seed=dropout_seed,
                backend=backend,
            )
            return _through_autograd(operation, chosen, call, query, key, value, scale)
        if mod is None:
            name = getattr(score_mod, "__qualname__", type(score_mod).__name__)
            raise TypeError(
                f"{operation}: can't differentiate the score_mod {name}, a function of your own, on "
                f"{chosen.name!r}, which has no autograd: attnx differentiates the score_mods of attnx.mods that "
                "say how (alibi, relative_bias, soft_cap); on PyTorch and JAX attnx.vjp hands any score_mod "
                "to their autograd"
            )
    xp, given_scale, scale = chosen.xp, scale, arguments["scale"]
    plan = flex_tiles(
        xp,
        query=query,
        key=key,
        value=value,
        score_mod=score_mod,
        block_mask=block_mask,
        backend=chosen,
        dropout=dropout,
    )
    tables = {} if mod is None else mod.tables
    if plan is None:  # an axis of size 0: zeros, and zero gradients
        output = xp.zeros(empty_shape(query, key, value), dtype=query.dtype, device=_checks.device_of(query))
        return output, _backward(operation, xp, query, key, value, given_scale, tables, output, None)
    grouped_output, stats = _tiling.attend_tiles(
        xp,
        plan.query,
        plan.key,
        plan.value,
        scale=scale,
        tiles=plan.tiles,
        tile_scores=plan.tile_scores,
        with_stats=True,
        scores_may_mask=score_mod is not None,
        **plan.walk,
    )
    output = xp.reshape(grouped_output, plan.shape)

    def tiled(cotangent: Any) -> tuple[Any, ...]:
        table_parts: list[dict[str, Any]] = []  # each tile's, summed after (threads append alike)
        score_vjp = None if mod is None else tile_score_vjp(xp, mod.backward, plan, table_parts)
        gradients = _tiling.backward_tiles(
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
            score_vjp=score_vjp,
            **plan.walk,
        )
        summed = {name: sum(part[name] for part in table_parts[1:]) + table_parts[0][name] for name in tables}
        return (*gradients, summed)

    return output, _backward(operation, xp, query, key, value, given_scale, tables, output, tiled)


def _through_autograd(
    operation: str, chosen: Any, call: Callable[..., Any], query: Any, key: Any, value: Any, scale: Any
) -> tuple[Any, Callable[[Any], dict[str, Any]]]:
    """``attnx.vjp`` of ``call(query, key, value, scale=scale)`` (a score_mod
    of the user's own) by the backend's autograd (:meth:`~attnx.Backend.gradients`
    of the output times the cotangent): the forward again at each backward,
    as the library's own ``vjp`` of a recomputed function.  The cotangents
    are those of the arrays given; what the mod closes over gets none here
    (the library's own ``grad`` gives it)."""
    xp = chosen.xp
    scale_is_array = _cotangents.gets_cotangent(scale)
    names = ["query", "key", "value", *(["scale"] if scale_is_array else [])]
    arrays = [query, key, value, *([scale] if scale_is_array else [])]

    def called(q: Any, k: Any, v: Any, *given_scale: Any) -> Any:
        return call(q, k, v, scale=given_scale[0] if given_scale else scale)

    output = called(*arrays)

    def backward(cotangent: Any) -> dict[str, Any]:
        _cotangents.require(operation, cotangent, output)
        grads = chosen.gradients(lambda *xs: called(*xs) * cotangent, arrays)
        return {
            name: xp.zeros_like(array) if grad is None else _cotangents.like(xp, grad, array)
            for name, grad, array in zip(names, grads, arrays, strict=True)
        }

    return output, backward


def _backward(
    operation: str,
    xp: Any,
    query: Any,
    key: Any,
    value: Any,
    scale: Any,
    tables: dict[str, Any],
    output: Any,
    tiled: Callable[[Any], tuple[Any, ...]] | None,
) -> Callable[[Any], dict[str, Any]]:
    """The backward that :func:`attnx.vjp` hands out: the tiles' gradients
    (zeros where ``tiled`` is None: nothing was computed), the grouped
    heads' key/value gradients summed over the query heads that share them,
    each summed to its argument's (broadcast) shape, and the score_mod's
    ``tables``' under ``"score_mod"``."""
    scale_is_array = _cotangents.gets_cotangent(scale)

    def backward(cotangent: Any) -> dict[str, Any]:
        _cotangents.require(operation, cotangent, output)
        grads = {name: xp.zeros_like(array) for name, array in (("query", query), ("key", key), ("value", value))}
        if scale_is_array:
            grads["scale"] = xp.zeros((), dtype=query.dtype, device=_checks.device_of(query))
        if tables:
            grads["score_mod"] = {name: xp.zeros_like(table) for name, table in tables.items()}
        if tiled is None:
            return grads
        d_query, d_key, d_value, d_scale, d_tables = tiled(cotangent)
        for name, d_table in d_tables.items():
            grads["score_mod"][name] = _cotangents.like(xp, d_table, tables[name])
        batch = d_query.shape[0]
        grads["query"] = _cotangents.like(xp, xp.reshape(d_query, (batch, *query.shape[1:])), query)
        # (B, H_kv, G, m, d): the G query heads of each key/value head summed
        grads["key"] = _cotangents.like(xp, xp.sum(d_key, axis=2), key)
        grads["value"] = _cotangents.like(xp, xp.sum(d_value, axis=2), value)
        if scale_is_array:
            grads["scale"] = _cotangents.like(xp, d_scale, scale) if hasattr(scale, "shape") else d_scale
        return grads

    return backward
