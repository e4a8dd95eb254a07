"""attnx's attention as a Flax layer: ``import attnx.flax`` (it imports Flax).

:class:`MultiHeadAttention` is ``flax.nnx.MultiHeadAttention`` with its
attention computed by attnx (:func:`dot_product_attention`, Flax's
``attention_fn`` hook): the same constructor, parameters, call and
autoregressive cache, Flax's own projections, and attnx's
:func:`~attnx.scaled_dot_product_attention` between them, so that attnx's
memory-efficient tiles and backward (a ``jax.custom_vjp`` over JAX's own
loops on the CPU) and its dropout (the same mask on every library) serve a
Flax model, under ``nnx.jit`` and ``nnx.grad``.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from attnx._checks import broadcasts_to
from attnx.attention import scaled_dot_product_attention
from attnx.masks import causal

__all__ = ["MultiHeadAttention", "dot_product_attention"]

#: Seeds of attnx's dropout masks, drawn from the layer's dropout key at each call.
_SEEDS = 2**31 - 1


def dot_product_attention(
    query: Any,
    key: Any,
    value: Any,
    bias: Any = None,
    mask: Any = None,
    broadcast_dropout: bool = True,
    dropout_rng: Any = None,
    dropout_rate: float = 0.0,
    deterministic: bool = False,
    dtype: Any = None,
    precision: Any = None,
    module: Any = None,
    promote_dtype: Any = None,
    is_causal: bool = False,
) -> Any:
    """``flax.nnx.dot_product_attention``, computed by attnx.

    Parameters
    ----------
    query : array, shape (..., n, H, d_k)
    key : array, shape (..., m, H_kv, d_k)
    value : array, shape (..., m, H_kv, d_v)
        Flax's layout; ``H_kv`` dividing ``H`` is grouped-query attention.
    bias : array, optional
        Added to the scores, broadcastable to ``(..., H, n, m)``.
    mask : boolean array, optional
        Broadcastable to ``(..., H, n, m)``: ``False`` forbids (Flax's
        convention, attnx's too).
    broadcast_dropout, dropout_rng, dropout_rate, deterministic
        Flax's dropout of the weights, drawn as attnx draws it: the seed of
        :func:`attnx.scaled_dot_product_attention`'s ``dropout_seed`` comes
        from ``dropout_rng``.  attnx's mask is drawn for every batch entry
        and head, so ``broadcast_dropout=True`` (one mask for all) is refused
        where dropout applies.
    dtype, promote_dtype
        As Flax's: the inputs are promoted to ``dtype`` (Flax's
        ``promote_dtype`` by default).
    precision : None
        attnx's products take the arrays' own precision; any other value is refused.
    module : nnx.Module, optional
        Sows the weights ``(..., H, n, m)`` (after dropout, as PyTorch's
        are) into its ``nnx.Intermediate`` ``attention_weights``.
    is_causal : bool
        Flax's causal rule: query ``i`` attends keys ``j <= i``.

    Returns
    -------
    array, shape (..., n, H, d_v)
        A query with no key left to attend gets zeros (Flax's own gives it
        the mean of the values).

    Raises
    ------
    ValueError
        If the inputs break Flax's rules (one rank, at least 3, the same
        batch axes, keys and values of the same positions and heads, keys
        of the queries' features, a ``bias`` that broadcasts to the
        scores), if ``broadcast_dropout=True`` comes with dropout that
        applies, if dropout applies without a ``dropout_rng``, or if
        ``precision`` is given; and whatever
        :func:`attnx.scaled_dot_product_attention` raises.
    """
    if precision is not None:
        raise ValueError(
            f"attnx.flax: precision must be None (attnx's products take the arrays' own), got {precision!r}"
        )
    _check_inputs(query, key, value, bias)
    if promote_dtype is None:
        from flax.nnx.nn import dtypes

        promote_dtype = dtypes.promote_dtype
    query, key, value = promote_dtype((query, key, value), dtype=dtype)
    dropout_p, dropout_seed = 0.0, None
    if not deterministic and dropout_rate > 0.0:
        if broadcast_dropout:
            raise ValueError(
                "attnx.flax: broadcast_dropout=True (one dropout mask for every batch entry and head) is not what "
                "attnx draws; give broadcast_dropout=False for a mask of each"
            )
        if dropout_rng is None:
            raise ValueError("attnx.flax: dropout applies (deterministic=False) but no dropout_rng was given")
        dropout_p = float(dropout_rate)
        dropout_seed = jax.random.randint(dropout_rng, (), 0, _SEEDS, dtype=jnp.int32)
    n, m = query.shape[-3], key.shape[-3]
    heads, kv_heads = query.shape[-2], key.shape[-2]
    # Flax's causal rule aligns the diagonal to the first key; attnx's is_causal to the last:
    # the same where n = m, a mask where not.
    attnx_causal = is_causal and n == m
    if is_causal and n != m:
        top_left = causal(n, m, align="top_left", backend="jax")
        mask = top_left if mask is None else jnp.logical_and(mask, top_left)
    if bias is not None:  # one real mask: the bias where allowed, -inf where not
        bias = bias.astype(query.dtype)
        mask = bias if mask is None else jnp.where(mask, bias, -jnp.inf)
    elif mask is not None:
        mask = mask.astype(jnp.bool_)
    result = scaled_dot_product_attention(
        *(jnp.swapaxes(a, -3, -2) for a in (query, key, value)),
        mask=mask,
        is_causal=attnx_causal,
        enable_gqa=heads != kv_heads,
        return_weights=module is not None,
        dropout_p=dropout_p,
        dropout_seed=dropout_seed,
    )
    if module is not None:
        result, weights = result
        module.sow(nnx.Intermediate, "attention_weights", weights)
    return jnp.swapaxes(result, -3, -2)


def _check_inputs(query: Any, key: Any, value: Any, bias: Any) -> None:
    """Flax's rules for the inputs, in its layout ``(..., n, H, d)``, as
    ValueErrors naming the argument (attnx's own checks see its layout)."""
    shapes = f"{tuple(query.shape)}, {tuple(key.shape)} and {tuple(value.shape)}"
    if query.ndim < 3 or key.ndim != query.ndim or value.ndim != query.ndim:
        raise ValueError(
            f"attnx.flax: query, key and value must be (..., n, H, d) arrays of one rank, got shapes {shapes}"
        )
    if not query.shape[:-3] == key.shape[:-3] == value.shape[:-3]:
        raise ValueError(f"attnx.flax: query, key and value must have the same batch axes (...), got shapes {shapes}")
    if key.shape[:-1] != value.shape[:-1]:
        raise ValueError(
            f"attnx.flax: key and value must have the same (..., m, H_kv), got shapes {tuple(key.shape)} "
            f"and {tuple(value.shape)}"
        )
    if key.shape[-1] != query.shape[-1]:
        raise ValueError(
            f"attnx.flax: key must have d_k = {query.shape[-1]} features (from query), got shape {tuple(key.shape)}"
        )
    if bias is not None:
        scores = (*query.shape[:-3], query.shape[-2], query.shape[-3], key.shape[-3])
        if not broadcasts_to("attnx.flax", "bias", tuple(bias.shape), scores):
            raise ValueError(
                f"attnx.flax: bias must broadcast to the scores' shape (..., H, n, m) = {scores}, "
                f"got shape {tuple(bias.shape)}"
            )


class MultiHeadAttention(nnx.MultiHeadAttention):
    """``flax.nnx.MultiHeadAttention``, its attention computed by attnx.

    Parameters
    ----------
    *args, **kwargs
        As ``flax.nnx.MultiHeadAttention``'s (``num_heads``,
        ``in_features``, ``qkv_features``, ``out_features``,
        ``num_kv_heads``, ``dropout_rate``, ``decode``, ``rngs``, ...), with
        its parameters and their layout: ``nnx.update`` copies one layer's
        state into the other.  ``attention_fn`` defaults to
        :func:`dot_product_attention`.

    Raises
    ------
    ValueError
        If ``dropout_rate > 0`` comes with ``broadcast_dropout=True`` (Flax's
        default): attnx draws a dropout mask for each batch entry and head;
        and whatever ``flax.nnx.MultiHeadAttention`` raises.

    Notes
    -----
    Where it differs from Flax's own: a query with no key left to attend
    (a fully padded sequence) gets zeros before the output projection,
    where Flax's averages the values.

    Examples
    --------
    >>> import jax.numpy as jnp
    >>> from flax import nnx
    >>> import attnx.flax
    >>> ours = attnx.flax.MultiHeadAttention(num_heads=2, in_features=8, decode=False, rngs=nnx.Rngs(0))
    >>> theirs = nnx.MultiHeadAttention(num_heads=2, in_features=8, decode=False, rngs=nnx.Rngs(0))
    >>> x = jnp.linspace(-1.0, 1.0, 3 * 5 * 8).reshape(3, 5, 8)
    >>> bool(jnp.allclose(ours(x), theirs(x), atol=1e-5))
    True
    """

    def __init__(self, *args: Any, attention_fn: Any = dot_product_attention, **kwargs: Any) -> None:
        if kwargs.get("dropout_rate", 0.0) > 0.0 and kwargs.get("broadcast_dropout", True):
            raise ValueError(
                "attnx.flax.MultiHeadAttention: dropout_rate > 0 needs broadcast_dropout=False (attnx draws a "
                "dropout mask for each batch entry and head, not one for all)"
            )
        super().__init__(*args, attention_fn=attention_fn, **kwargs)
