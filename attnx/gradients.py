"""Gradients on every backend: :func:`vjp`, JAX's convention.

Each operation's backward lives beside its forward, array API only, so it
runs where no autograd does (NumPy, CuPy, Dask); this module picks it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from attnx._attention_vjp import masked_softmax_vjp, scaled_dot_product_attention_vjp
from attnx._flex_vjp import flex_attention_vjp
from attnx._typing import Array
from attnx.additive import additive_attention, additive_attention_vjp, bahdanau_context, bahdanau_context_vjp
from attnx.attention import masked_softmax, scaled_dot_product_attention
from attnx.convolution import causal_conv1d, causal_conv1d_vjp
from attnx.flex import flex_attention
from attnx.kernel_regression import nadaraya_watson, nadaraya_watson_vjp
from attnx.multihead import multi_head_attention, multi_head_attention_vjp
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
        :func:`attnx.masked_softmax`, :func:`attnx.flex_attention` (a
        block mask, and the score_mods of :mod:`attnx.mods` that carry
        their backward: ``alibi``, ``relative_bias``, ``soft_cap``; on a
        backend with autograd, PyTorch's or JAX's, a score_mod of the
        user's own is handed to the library, which differentiates the call
        again at the backward), :func:`attnx.multi_head_attention`,
        :func:`attnx.additive_attention`, :func:`attnx.bahdanau_context`,
        :func:`attnx.nadaraya_watson`, :func:`attnx.causal_conv1d`,
        :func:`attnx.apply_rotary` or an :class:`attnx.LearnedPositions`
        (its lookup).
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
        array or a NumPy scalar, ``scale``, and a real ``mask`` (for
        ``flex_attention``, its key and value gradients summed over the
        query heads of each group, and the score_mod's tables under
        ``score_mod``, by name: ``{"slopes": ...}`` for ``alibi``); ``scores``
        (and a real ``mask``) for
        ``masked_softmax``; ``query``, ``key``, ``value`` and ``params`` (a
        dict by the params' names) for ``multi_head_attention`` and
        ``additive_attention`` (and a real ``mask``'s there);
        ``decoder_state``, ``annotations`` and ``params`` for
        ``bahdanau_context``;
        ``queries``, ``keys``, ``values`` and (an array's
        or a NumPy scalar's) ``bandwidth`` for ``nadaraya_watson``; ``x``,
        ``weight`` and ``bias`` for ``causal_conv1d``; ``x`` and real
        ``positions`` for ``apply_rotary``; ``table`` for a
        ``LearnedPositions``.  Each has its argument's shape (broadcast axes
        summed) and dtype.

    Raises
    ------
    TypeError
        If ``operation`` is not one that :func:`vjp` differentiates, a
        ``score_mod`` of the user's own is given to ``flex_attention`` on
        a backend without autograd, a kernel of the user's own to
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
    outlives its step; tiles the forward skips (the causal future, a block
    mask's empty blocks) are skipped, rows that attend nothing get zero
    gradients, and dropout's mask is made again from its seed.
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
    if isinstance(operation, LearnedPositions):  # a lookup in its table
        return learned_positions_vjp(operation, *args, **kwargs)
    rule = _RULES.get(operation) if callable(operation) else None
    if rule is None:
        name = getattr(operation, "__qualname__", repr(operation))
        known = ", ".join(f"attnx.{function.__name__}" for function in _RULES)
        raise TypeError(
            f"{_VJP}: can't differentiate {name} yet; it differentiates {known} and a LearnedPositions "
            "(on PyTorch and JAX, their own autograd differentiates every operation)"
        )
    return rule(*args, **kwargs)


#: Each operation's backward, beside its forward in its own module.
_RULES: dict[Callable[..., Any], Callable[..., Any]] = {
    scaled_dot_product_attention: scaled_dot_product_attention_vjp,
    masked_softmax: masked_softmax_vjp,
    flex_attention: flex_attention_vjp,
    multi_head_attention: multi_head_attention_vjp,
    additive_attention: additive_attention_vjp,
    bahdanau_context: bahdanau_context_vjp,
    nadaraya_watson: nadaraya_watson_vjp,
    causal_conv1d: causal_conv1d_vjp,
    apply_rotary: apply_rotary_vjp,
}
