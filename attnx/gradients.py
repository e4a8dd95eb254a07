"""Gradients on every backend: :func:`vjp`, JAX's convention.

The backward of attention walks the forward's tiles
(:func:`attnx._tiling.backward_tiles`), array API only, so it runs where
no autograd does (NumPy, CuPy, Dask) and keeps the forward's memory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from attnx import _checks, _cotangents, _dispatch, _tiling
from attnx._typing import Array
from attnx.attention import (
    _SDPA,
    _SDPA_ARGS,
    check_attention_inputs,
    choose_chunks,
    masked_softmax,
    scaled_dot_product_attention,
    sdpa_tile_plan,
)
from attnx.convolution import causal_conv1d, causal_conv1d_vjp
from attnx.kernel_regression import nadaraya_watson, nadaraya_watson_vjp
from attnx.positional import LearnedPositions, apply_rotary, apply_rotary_vjp, learned_positions_vjp

__all__ = ["vjp"]

_VJP = "vjp"


def vjp(operation: Callable[..., Any], *args: Any, **kwargs: Any) -> tuple[Array, Callable[[Array], dict[str, Array]]]:
    """The output of ``operation(*args, **kwargs)``, and a function that
    pulls a cotangent of it back to the arguments (JAX's ``jax.vjp``).

    Parameters
    ----------
    operation : callable
        :func:`attnx.scaled_dot_product_attention`,
        :func:`attnx.masked_softmax`, :func:`attnx.nadaraya_watson`,
        :func:`attnx.causal_conv1d`, :func:`attnx.apply_rotary` or an
        :class:`attnx.LearnedPositions` (its lookup).
    *args, **kwargs
        Its arguments, as the operation takes them.

    Returns
    -------
    output : array
        ``operation(*args, **kwargs)``.
    backward : callable ``(cotangent) -> dict``
        Given a cotangent of ``output`` (its shape, dtype and backend), the
        cotangents of the operation's floating-point array arguments, by
        parameter name: ``query``, ``key``, ``value`` and, where it was an
        array or a NumPy scalar, ``scale``; ``scores`` (and a real ``mask``) for
        ``masked_softmax``; ``queries``, ``keys``, ``values`` and (an array's
        or a NumPy scalar's) ``bandwidth`` for ``nadaraya_watson``; ``x``,
        ``weight`` and ``bias`` for ``causal_conv1d``; ``x`` and real
        ``positions`` for ``apply_rotary``; ``table`` for a
        ``LearnedPositions``.  Each has its argument's shape (broadcast axes
        summed) and dtype.

    Raises
    ------
    TypeError
        If ``operation`` is not one that :func:`vjp` differentiates, a real
        (additive) mask is given to ``scaled_dot_product_attention`` (its
        gradient is not implemented yet), a kernel of the user's own to
        ``nadaraya_watson``, or the cotangent is not an array of the
        output's backend and dtype; and whatever ``operation`` raises for
        its arguments.
    ValueError
        If ``return_weights=True`` is asked (differentiate the weights through
        :func:`attnx.masked_softmax`), or the cotangent's shape is not the
        output's; and whatever ``operation`` raises for its arguments.

    Notes
    -----
    Attention's backward is FlashAttention-2's: each tile's weights are
    recomputed from its rows' maximum and sum, and no ``(n, m)`` tile
    outlives its step; tiles the forward skips (the causal future) are
    skipped, and rows that attend nothing get zero gradients.
    Nadaraya-Watson's walks the forward's chunks of queries.

    Examples
    --------
    >>> import numpy as np
    >>> import attnx
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, 2, 4, 8)) for _ in range(3))
    >>> out, backward = attnx.vjp(attnx.scaled_dot_product_attention, q, k, v, is_causal=True)
    >>> grads = backward(np.ones_like(out))
    >>> sorted(grads), grads["query"].shape
    (['key', 'query', 'value'], (1, 2, 4, 8))

    The gradient of the sum of the outputs through the value is the
    column sums of the weights:

    >>> _, weights = attnx.scaled_dot_product_attention(q, k, v, is_causal=True, return_weights=True)
    >>> bool(np.allclose(grads["value"][..., 0], weights.sum(-2)))
    True
    """
    if operation is scaled_dot_product_attention:
        return _attention_vjp(*args, **kwargs)
    if operation is masked_softmax:
        return _softmax_vjp(*args, **kwargs)
    if operation is nadaraya_watson:
        return nadaraya_watson_vjp(*args, **kwargs)
    if operation is causal_conv1d:
        return causal_conv1d_vjp(*args, **kwargs)
    if operation is apply_rotary:
        return apply_rotary_vjp(*args, **kwargs)
    if isinstance(operation, LearnedPositions):
        return learned_positions_vjp(operation, *args, **kwargs)
    name = getattr(operation, "__qualname__", repr(operation))
    raise TypeError(
        f"{_VJP}: can't differentiate {name} yet; it differentiates attnx.scaled_dot_product_attention, "
        "attnx.masked_softmax, attnx.nadaraya_watson, attnx.causal_conv1d, attnx.apply_rotary and a "
        "LearnedPositions (on PyTorch and JAX, their own autograd differentiates every operation)"
    )


def _attention_vjp(
    query: Any,
    key: Any,
    value: Any,
    *,
    mask: Any = None,
    key_lengths: Any = None,
    is_causal: bool = False,
    scale: Any = None,
    return_weights: bool = False,
    chunk_size: Any = None,
    backend: str | None = None,
) -> tuple[Any, Callable[[Any], dict[str, Any]]]:
    operation = f"{_VJP}({_SDPA})"
    chosen, _ = _dispatch.resolve(
        operation, backend, _SDPA_ARGS, (query, key, value, mask, key_lengths, _checks.scale_array(scale)), 3
    )
    xp = chosen.xp
    _checks.require_flag(operation, "return_weights", return_weights)
    if return_weights:
        raise ValueError(
            f"{operation}: return_weights=True has two outputs; differentiate the weights through attnx.masked_softmax"
        )
    if mask is not None and _checks.is_float_dtype(xp, mask.dtype):
        raise TypeError(
            f"{operation}: the gradient of a real (additive) mask is not implemented yet; give a boolean mask "
            f"(True attends), got dtype {_checks.dtype_label(mask.dtype)}"
        )
    output = scaled_dot_product_attention(
        query,
        key,
        value,
        mask=mask,
        key_lengths=key_lengths,
        is_causal=is_causal,
        scale=scale,
        chunk_size=chunk_size,
        backend=backend,
    )
    scale_value, batch_shape, n, m = check_attention_inputs(_SDPA, xp, query, key, value, mask, key_lengths, scale)
    block_bytes = chosen.block_bytes_on(_checks.device_of(query))
    if _checks.traced(query):
        block_bytes = max(block_bytes, _tiling.TRACED_BLOCK_BYTES)
    chunks = choose_chunks(
        xp, query.dtype, n, m, batch_shape, chunk_size, False, is_causal, chosen.concurrent_blocks, block_bytes
    ) or (max(1, n), max(1, m))
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

    def backward(cotangent: Any) -> dict[str, Any]:
        _cotangents.require(operation, cotangent, output)
        d_query, d_key, d_value, d_scale = _tiling.backward_tiles(
            xp,
            query,
            key,
            value,
            output,
            cotangent,
            scale=scale_value,
            batch_shape=batch_shape,
            query_chunk=chunks[0],
            key_chunk=chunks[1],
            tiles=tiles,
            tile_scores=tile_scores,
            map_blocks=chosen.map_blocks,
            concurrent_blocks=chosen.concurrent_blocks,
            block_bytes=block_bytes,
        )
        grads = {
            "query": _cotangents.like(xp, d_query, query),
            "key": _cotangents.like(xp, d_key, key),
            "value": _cotangents.like(xp, d_value, value),
        }
        # A 0-d array, or NumPy's scalar (what arithmetic on a 0-d array gives
        # back): a training loop's updated scale keeps its gradient.
        if scale is not None and type(scale) not in (int, float):
            grads["scale"] = _cotangents.like(xp, d_scale, scale) if chosen.owns(scale) else d_scale
        return grads

    return output, backward


def _softmax_vjp(
    scores: Any, *, mask: Any = None, key_lengths: Any = None, axis: int = -1, backend: str | None = None
) -> tuple[Any, Callable[[Any], dict[str, Any]]]:
    operation = f"{_VJP}(masked_softmax)"
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
