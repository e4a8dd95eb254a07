"""attnx's attention as a Keras layer: ``import attnx.keras`` (it imports Keras).

:class:`MultiHeadAttention` is ``keras.layers.MultiHeadAttention`` with its
attention computed by attnx: Keras' own projections and masks (the
inputs' Keras masks, ``attention_mask``, ``use_causal_mask``, a sliding
window) and, between them, :func:`attnx.scaled_dot_product_attention` on
the backend's own tensors, overriding ``_compute_attention`` as Keras
documents.  On Keras' JAX and PyTorch backends attnx dispatches to its JAX
or PyTorch backend, so attnx's tiles, its backward and its dropout (the
same mask on every library) serve a Keras model; ``get_config``,
``from_config`` and saved models work as for Keras' layer.
"""

from __future__ import annotations

from typing import Any

import keras
from keras import ops

from attnx.attention import scaled_dot_product_attention

__all__ = ["MultiHeadAttention"]

#: Seeds of attnx's dropout masks, drawn from the layer's Dropout seed generator at each training call.
_SEEDS = 2**31 - 1


@keras.saving.register_keras_serializable(package="attnx")
class MultiHeadAttention(keras.layers.MultiHeadAttention):
    """``keras.layers.MultiHeadAttention``, its attention computed by attnx.

    Parameters
    ----------
    *args, **kwargs
        As ``keras.layers.MultiHeadAttention``'s (``num_heads``,
        ``key_dim``, ``value_dim``, ``dropout``, ``use_bias``,
        ``output_shape``, ``seed``, ...), with its weights in its order:
        ``set_weights(keras_layer.get_weights())`` copies Keras' layer into
        this one.  In training, ``dropout`` drops attention weights by
        attnx's mask, its seed drawn from the layer's seed generator.

    Raises
    ------
    ValueError
        If ``attention_axes`` is other than None or ``(1,)`` (attnx attends
        over one axis of sequence: inputs ``(B, T, features)``; inputs with
        more axes are refused when called) or ``flash_attention=True`` (Keras' choice of kernel:
        attnx's own runs); and whatever ``keras.layers.MultiHeadAttention``
        raises.

    Notes
    -----
    Where it differs from Keras' own: a query with no key left to attend
    (a fully padded sequence) gets zeros before the output projection,
    where Keras' averages the values; with ``return_attention_scores=True``
    in training, the scores returned are those after dropout (PyTorch's
    convention, and attnx's), where Keras returns them before.

    Examples
    --------
    >>> import numpy as np
    >>> import keras
    >>> import attnx.keras
    >>> x = np.linspace(-1.0, 1.0, 2 * 5 * 8, dtype="float32").reshape(2, 5, 8)
    >>> theirs = keras.layers.MultiHeadAttention(num_heads=2, key_dim=4)
    >>> ours = attnx.keras.MultiHeadAttention(num_heads=2, key_dim=4)
    >>> _ = theirs(x, x), ours(x, x)                   # built
    >>> ours.set_weights(theirs.get_weights())
    >>> bool(np.allclose(keras.ops.convert_to_numpy(ours(x, x)), keras.ops.convert_to_numpy(theirs(x, x)), atol=1e-5))
    True
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        axes = kwargs.get("attention_axes")
        if axes is not None and tuple(axes if isinstance(axes, (tuple, list)) else (axes,)) != (1,):
            raise ValueError(
                "attnx.keras.MultiHeadAttention: attention_axes must be None or (1,) (attnx attends over one "
                f"axis of sequence), got {axes!r}"
            )
        if kwargs.get("flash_attention"):
            raise ValueError(
                "attnx.keras.MultiHeadAttention: flash_attention=True asks Keras' backend for its fused kernel; "
                "attnx computes the attention with its own (leave flash_attention unset)"
            )
        super().__init__(*args, **kwargs)
        self._flash_attention = False  # Keras reads it; attnx's kernel runs whatever Keras' config says

    def _compute_attention(
        self,
        query: Any,
        key: Any,
        value: Any,
        attention_mask: Any = None,
        training: Any = None,
        return_attention_scores: bool = False,
        use_causal_mask: bool = False,
    ) -> tuple[Any, Any]:
        """attnx's attention of the projected heads, Keras' ``(B, T, N, H)``
        layout in and out; ``attention_mask`` ``(B, T, S)`` (True attends)."""
        if len(query.shape) != 4:
            raise ValueError(
                "attnx.keras.MultiHeadAttention attends over one axis of sequence: inputs (B, T, features), "
                f"got queries projected to {tuple(query.shape)}"
            )
        if use_causal_mask:  # Keras' rule (j <= i), as its own path builds it
            causal = self._compute_causal_mask(query, value)
            attention_mask = (
                causal if attention_mask is None else ops.logical_and(ops.cast(attention_mask, "bool"), causal)
            )
        mask = None
        if attention_mask is not None:
            mask = ops.expand_dims(ops.cast(attention_mask, "bool"), axis=1)  # the heads' axis
        dropout_p, dropout_seed = 0.0, None
        if training and self._dropout > 0.0:
            dropout_p = float(self._dropout)
            dropout_seed = keras.random.randint((), 0, _SEEDS, dtype="int32", seed=self._dropout_layer.seed_generator)
        result = scaled_dot_product_attention(
            *(ops.transpose(a, (0, 2, 1, 3)) for a in (query, key, value)),
            mask=mask,
            scale=float(self._inverse_sqrt_key_dim),
            return_weights=return_attention_scores,
            dropout_p=dropout_p,
            dropout_seed=dropout_seed,
        )
        output, scores = result if return_attention_scores else (result, None)
        return ops.transpose(output, (0, 2, 1, 3)), scores
