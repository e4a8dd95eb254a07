"""The common mods of :func:`attnx.flex_attention`, a few lines each.

A ``mask_mod(b, h, q_idx, kv_idx)`` returns True where a query attends a
key; a ``score_mod(score, b, h, q_idx, kv_idx)`` returns changed scores.
Positions are those of the mod's arguments: ``q_idx`` and ``kv_idx`` count
from the first query and the first key (PyTorch's convention: the causal
mask is aligned to the top left, as :func:`attnx.masks.causal` with
``align="top_left"``).  Every mod here is written with operators and the
arrays' own namespace, so it also runs inside PyTorch's FlexAttention.

Examples
--------
>>> import numpy as np, attnx
>>> from attnx import mods
>>> segments = np.array([0, 0, 1, 1, 1])
>>> mask = attnx.create_block_mask(
...     attnx.and_masks(mods.causal, mods.document(segments)), None, None, 5, 5, block_size=1
... )
>>> mask.kinds[0, 0].tolist()
[[2, 0, 0, 0, 0], [2, 2, 0, 0, 0], [0, 0, 2, 0, 0], [0, 0, 2, 2, 0], [0, 0, 2, 2, 2]]
"""

from __future__ import annotations

import math
from typing import Any

from attnx import _checks, _dispatch, _masking
from attnx._typing import Array, Device, DType
from attnx.flex import for_sizes, with_backward

__all__ = [
    "alibi",
    "alibi_slopes",
    "causal",
    "document",
    "document_from_lengths",
    "prefix_lm",
    "relative_bias",
    "sliding_window",
    "soft_cap",
]


def causal(b: Array, h: Array, q_idx: Array, kv_idx: Array) -> Any:
    """``mask_mod``: a query attends the keys at or before its position.

    Parameters
    ----------
    b, h, q_idx, kv_idx : integer arrays
        The batch entry, head, query and key of each score, broadcasting
        against a tile of scores.

    Returns
    -------
    array of bool
        ``q_idx >= kv_idx``.

    Examples
    --------
    >>> import attnx
    >>> from attnx import mods
    >>> print(attnx.create_block_mask(mods.causal, None, None, 256, 256, block_size=64))
    BlockMask(shape=(None, None, 256, 256), block_size=(64, 64), sparsity=37.5%)
    """
    return _masking.causal_rule(q_idx, kv_idx)


def sliding_window(window: int) -> Any:
    """``mask_mod``: causal, and at most ``window`` keys back (the key at
    ``q_idx - window`` included), as :func:`attnx.masks.sliding_window`.

    Parameters
    ----------
    window : int
        Keys back from the query's own position that it may attend.

    Returns
    -------
    callable
        A ``mask_mod`` for :func:`attnx.create_block_mask`.

    Raises
    ------
    ValueError
        If ``window`` is not a non-negative integer.

    Examples
    --------
    >>> import numpy as np
    >>> from attnx import mods
    >>> mask_mod = mods.sliding_window(1)
    >>> print(mask_mod(0, 0, np.arange(4)[:, None], np.arange(4)[None, :]).astype(int))
    [[1 0 0 0]
     [1 1 0 0]
     [0 1 1 0]
     [0 0 1 1]]
    """
    window = _checks.require_positive_int("sliding_window", "window", window, allow_zero=True)

    def sliding_window_mask(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return _masking.window_rule(q_idx, kv_idx, window, 0)

    return sliding_window_mask


def document(document_ids: Array) -> Any:
    """``mask_mod`` for packed sequences: a query attends keys of its own
    document only.

    Parameters
    ----------
    document_ids : integer array, shape (n,) or (B, n)
        The document of each position (one row per batch entry, or one for
        all), of the inputs' backend.  Combine with :func:`causal` through
        :func:`attnx.and_masks` for causal packed sequences.

    Returns
    -------
    callable
        A ``mask_mod`` for :func:`attnx.create_block_mask`.

    Raises
    ------
    TypeError
        If ``document_ids`` is not an integer array of a registered backend.
    ValueError
        If ``document_ids`` has neither 1 nor 2 dimensions.

    Examples
    --------
    >>> import numpy as np
    >>> from attnx import mods
    >>> same_document = mods.document(np.array([0, 0, 1, 1, 1]))
    >>> print(same_document(0, 0, np.arange(5)[:, None], np.arange(5)[None, :]).astype(int))
    [[1 1 0 0 0]
     [1 1 0 0 0]
     [0 0 1 1 1]
     [0 0 1 1 1]
     [0 0 1 1 1]]
    """
    _require_integer_array("document", "document_ids", document_ids, (1, 2))
    positions = ("document", "document_ids", "positions", document_ids.shape[-1])
    if document_ids.ndim == 1:

        def same_document(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return _gather(document_ids, q_idx) == _gather(document_ids, kv_idx)

        return for_sizes(same_document, positions)

    def same_document_per_entry(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return _gather(document_ids, b, q_idx) == _gather(document_ids, b, kv_idx)

    return for_sizes(same_document_per_entry, positions, ("document", "document_ids", "B", document_ids.shape[0]))


def document_from_lengths(lengths: Array, n: int) -> Any:
    """:func:`document` for documents of ``lengths`` packed one after the
    other in ``n`` positions (positions past their sum form one more
    document).

    Parameters
    ----------
    lengths : integer array, shape (num_documents,)
    n : int
        Positions (queries and keys).

    Returns
    -------
    callable
        A ``mask_mod`` for :func:`attnx.create_block_mask`.

    Raises
    ------
    TypeError
        If ``lengths`` is not an integer array of a registered backend.
    ValueError
        If ``lengths`` is not 1-dimensional, or ``n`` is not a positive integer.

    Examples
    --------
    >>> import numpy as np
    >>> import attnx
    >>> from attnx import mods
    >>> packed = attnx.and_masks(mods.causal, mods.document_from_lengths(np.array([2, 3]), 5))
    >>> print(packed(0, 0, np.arange(5)[:, None], np.arange(5)[None, :]).astype(int))
    [[1 0 0 0 0]
     [1 1 0 0 0]
     [0 0 1 0 0]
     [0 0 1 1 0]
     [0 0 1 1 1]]
    """
    _require_integer_array("document_from_lengths", "lengths", lengths, (1,))
    n = _checks.require_positive_int("document_from_lengths", "n", n)
    xp = _checks.namespace_of(lengths)
    ends = xp.cumulative_sum(lengths)
    positions = xp.arange(n, dtype=ends.dtype, device=_checks.device_of(lengths))
    mod = document(xp.searchsorted(ends, positions, side="right"))
    return for_sizes(mod, ("document_from_lengths", "n", "positions", n))


def prefix_lm(prefix_length: int | Array) -> Any:
    """``mask_mod`` of a prefix language model: the first ``prefix_length``
    keys are attended by every query (bidirectional), the rest causally.
    ``prefix_length`` is an int, or an integer array ``(B,)`` of one per
    batch entry.

    Parameters
    ----------
    prefix_length : int or integer array, shape (B,)
        Keys every query attends.

    Returns
    -------
    callable
        A ``mask_mod`` for :func:`attnx.create_block_mask`; with an array, for
        a block mask made with ``B`` given.

    Raises
    ------
    TypeError
        If ``prefix_length`` is neither an int nor an integer array.
    ValueError
        If ``prefix_length`` is negative, or an array of other than one dimension.

    Examples
    --------
    >>> import numpy as np
    >>> from attnx import mods
    >>> prefix = mods.prefix_lm(2)
    >>> print(prefix(0, 0, np.arange(4)[:, None], np.arange(4)[None, :]).astype(int))
    [[1 1 0 0]
     [1 1 0 0]
     [1 1 1 0]
     [1 1 1 1]]
    """
    if hasattr(prefix_length, "shape"):
        _require_integer_array("prefix_lm", "prefix_length", prefix_length, (1,))

        def prefix_mask_per_entry(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return (kv_idx < _gather(prefix_length, b)) | _masking.causal_rule(q_idx, kv_idx)

        return for_sizes(prefix_mask_per_entry, ("prefix_lm", "prefix_length", "B", prefix_length.shape[0]))
    prefix_length = _checks.require_positive_int("prefix_lm", "prefix_length", prefix_length, allow_zero=True)

    def prefix_mask(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return (kv_idx < prefix_length) | _masking.causal_rule(q_idx, kv_idx)

    return prefix_mask


def alibi(slopes: Array) -> Any:
    """``score_mod`` of ALiBi (Press et al. 2022): adds ``slope[h] * (kv_idx -
    q_idx)``, a penalty growing with the distance to past keys.

    Parameters
    ----------
    slopes : real array, shape (H,)
        One slope per head (:func:`alibi_slopes`), of the inputs' backend
        and dtype; gradients reach it where the backend has autograd, and
        through :func:`attnx.vjp` on every backend (``grads["score_mod"]["slopes"]``).

    Returns
    -------
    callable
        A ``score_mod`` for :func:`attnx.flex_attention`, for ``H`` heads.

    Raises
    ------
    TypeError
        If ``slopes`` is not an array of a registered backend.
    ValueError
        If ``slopes`` is not 1-dimensional.

    Examples
    --------
    >>> import numpy as np
    >>> import attnx
    >>> from attnx import mods
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, 4, 6, 8), dtype=np.float32) for _ in range(3))
    >>> causal = attnx.create_block_mask(mods.causal, None, None, 6, 6)
    >>> attnx.flex_attention(q, k, v, mods.alibi(mods.alibi_slopes(4)), causal).shape
    (1, 4, 6, 8)
    """
    _require_array("alibi", "slopes", slopes, (1,))

    def alibi_bias(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        distance = _checks.namespace_of(score).astype(kv_idx - q_idx, score.dtype)
        return score + _gather(slopes, h) * distance

    def backward(d_score: Any, score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> tuple[Any, dict[str, Any]]:
        xp = _checks.namespace_of(d_score)
        distance = xp.astype(kv_idx - q_idx, d_score.dtype)
        return d_score, {"slopes": xp.sum(d_score * distance, axis=(0, 2, 3))}  # a tile (B, H, rows, cols)

    with_backward(alibi_bias, backward, alibi, slopes=slopes)
    return for_sizes(alibi_bias, ("alibi", "slopes", "H", slopes.shape[0]))


def alibi_slopes(
    num_heads: int, *, dtype: DType = "float32", backend: str | None = None, device: Device = None
) -> Array:
    """The ALiBi slopes of ``num_heads`` heads, ``(num_heads,)``: the
    geometric sequence ``2**(-8 / p), 2**(-16 / p), ...`` for the power of
    two ``p`` at or above ``num_heads``, interleaved as in the paper's code
    when ``num_heads`` is not a power of two.

    Parameters
    ----------
    num_heads : int
    dtype : dtype or str
        float32 by default.
    backend, device : optional
        Where to make the slopes; the current backend by default.

    Returns
    -------
    array, shape (num_heads,)

    Raises
    ------
    TypeError
        If ``dtype`` is not a real floating dtype of the backend.
    ValueError
        If ``num_heads`` is not a positive integer.

    Examples
    --------
    >>> from attnx import mods
    >>> print(mods.alibi_slopes(4))
    [0.25       0.0625     0.015625   0.00390625]
    """
    operation = "alibi_slopes"
    num_heads = _checks.require_positive_int(operation, "num_heads", num_heads)
    chosen, _, device = _dispatch.resolve_creation(operation, backend, device)
    name = _checks.require_dtype_name(operation, chosen.xp, chosen.name, dtype, floating=True)
    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = [2 ** (-8 * (i + 1) / closest) for i in range(closest)]
    if closest < num_heads:  # the odd powers of the next power of two fill the rest
        slopes += [2 ** (-4 * (2 * i + 1) / closest) for i in range(num_heads - closest)]
    return chosen.xp.asarray(slopes, dtype=getattr(chosen.xp, name), device=device)


def soft_cap(cap: float) -> Any:
    """``score_mod`` that caps the scores smoothly: ``cap * tanh(score / cap)``
    (Gemma 2, Grok).

    Parameters
    ----------
    cap : float
        The largest magnitude a score approaches.

    Returns
    -------
    callable
        A ``score_mod`` for :func:`attnx.flex_attention`.

    Raises
    ------
    ValueError
        If ``cap`` is not a positive finite number.

    Examples
    --------
    >>> import numpy as np
    >>> from attnx import mods
    >>> print(mods.soft_cap(5.0)(np.array([1.0, 10.0, 100.0]), 0, 0, 0, 0).round(3))
    [0.987 4.82  5.   ]
    """
    cap = _checks.require_positive_real("soft_cap", "cap", cap)

    def capped(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        return cap * _checks.namespace_of(score).tanh(score / cap)

    def backward(d_score: Any, score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> tuple[Any, dict[str, Any]]:
        squashed = _checks.namespace_of(score).tanh(score / cap)
        return d_score * (1.0 - squashed * squashed), {}

    return with_backward(capped, backward)


def relative_bias(table: Array) -> Any:
    """``score_mod`` that adds a learned bias of the relative position:
    ``table[..., clip(q_idx - kv_idx, -R, R) + R]`` (Shaw et al. 2018:
    distances beyond ``R`` share the bias of ``R``).

    Parameters
    ----------
    table : real array, shape (2R + 1,) or (H, 2R + 1)
        One bias per distance (per head), of the inputs' backend and dtype;
        gradients reach it where the backend has autograd, and through
        :func:`attnx.vjp` on every backend (``grads["score_mod"]["table"]``).

    Returns
    -------
    callable
        A ``score_mod`` for :func:`attnx.flex_attention`.

    Raises
    ------
    TypeError
        If ``table`` is not an array of a registered backend.
    ValueError
        If ``table`` has neither 1 nor 2 dimensions, or an even last axis.

    Examples
    --------
    >>> import numpy as np
    >>> from attnx import mods
    >>> bias = mods.relative_bias(np.array([-1.0, 0.0, 1.0]))   # R = 1: distances -1, 0, 1
    >>> scores = np.zeros((4, 4))
    >>> print(bias(scores, 0, 0, np.arange(4)[:, None], np.arange(4)[None, :]))
    [[ 0. -1. -1. -1.]
     [ 1.  0. -1. -1.]
     [ 1.  1.  0. -1.]
     [ 1.  1.  1.  0.]]
    """
    _require_array("relative_bias", "table", table, (1, 2))
    reach = (table.shape[-1] - 1) // 2
    if table.shape[-1] % 2 == 0:
        raise ValueError(
            f"relative_bias: table must have an odd length 2R + 1 on its last axis, got shape {_checks.shape_of(table)}"
        )

    def bucket(xp: Any, distance: Any) -> Any:
        # where, not clip: array-api-compat's clip reads its bounds in Python, which PyTorch's flex can't trace
        return xp.where(distance > reach, reach, xp.where(distance < -reach, -reach, distance)) + reach

    def bias(score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        distance = bucket(_checks.namespace_of(score), q_idx - kv_idx)
        return score + (_gather(table, distance) if table.ndim == 1 else _gather(table, h, distance))

    def backward(d_score: Any, score: Any, b: Any, h: Any, q_idx: Any, kv_idx: Any) -> tuple[Any, dict[str, Any]]:
        """The table's gradient: the tile's scores' gradient summed along
        each diagonal (one distance ``q - kv`` each), without a scatter."""
        xp, device = _checks.namespace_of(d_score), _checks.device_of(d_score)
        *lead, rows, cols = d_score.shape
        # A skew: keys reversed and each row padded with `rows` zeros, then the tile read flat in rows
        # one shorter, puts entry (i, j) in column i - j + cols - 1.
        padded = xp.concat(
            [xp.flip(d_score, axis=-1), xp.zeros((*lead, rows, rows), dtype=d_score.dtype, device=device)], axis=-1
        )
        flat = xp.reshape(padded, (*lead, rows * (cols + rows)))[..., : rows * (cols + rows - 1)]
        diagonals = xp.sum(xp.reshape(flat, (*lead, rows, cols + rows - 1)), axis=-2)  # (B, H, rows + cols - 1)
        # Each diagonal's distance, from the tile's first query and first key, then its bucket.
        first = xp.reshape(q_idx, (-1,))[:1] - xp.reshape(kv_idx, (-1,))[:1]
        distances = first + xp.arange(rows + cols - 1, dtype=first.dtype, device=device) - (cols - 1)
        buckets = bucket(xp, distances)
        one_hot = xp.astype(
            buckets[:, None] == xp.arange(2 * reach + 1, dtype=buckets.dtype, device=device), d_score.dtype
        )
        per_head = xp.sum(diagonals @ one_hot, axis=0)  # (H, 2R + 1)
        return d_score, {"table": xp.sum(per_head, axis=0) if table.ndim == 1 else per_head}

    with_backward(bias, backward, relative_bias, table=table)
    return bias if table.ndim == 1 else for_sizes(bias, ("relative_bias", "table", "H", table.shape[0]))


def _gather(table: Any, *indices: Any) -> Any:
    """``table[indices]``: one index (an int, or an integer array) for each
    of ``table``'s axes, the arrays broadcasting together, read as one
    ``take`` of the flattened table at the flat indices (row-major).  Dask
    indexes by 1-d integer arrays only, and ``take`` is the standard's way;
    PyTorch's flex hands the mods 0-d indices, which it takes too."""
    if not any(hasattr(index, "shape") for index in indices):
        return table[indices]
    xp = _checks.namespace_of(table)
    flat, stride = indices[-1], table.shape[-1]
    for axis in range(len(indices) - 2, -1, -1):
        flat = flat + indices[axis] * stride
        stride *= table.shape[axis]
    values = table if table.ndim == 1 else xp.reshape(table, (-1,))
    return xp.reshape(xp.take(values, xp.reshape(flat, (-1,)), axis=0), tuple(flat.shape))


def _require_array(operation: str, name: str, array: Any, ndims: tuple[int, ...]) -> None:
    if not hasattr(array, "shape") or not hasattr(array, "ndim"):
        raise TypeError(f"{operation}: {name} must be an array, got {type(array).__name__}")
    if array.ndim not in ndims:
        expected = " or ".join(f"{d} dimension{'s' * (d > 1)}" for d in ndims)
        raise ValueError(f"{operation}: {name} must have {expected}, got shape {_checks.shape_of(array)}")


def _require_integer_array(operation: str, name: str, array: Any, ndims: tuple[int, ...]) -> None:
    _require_array(operation, name, array, ndims)
    if _checks.dtype_kind(_checks.namespace_of(array), array) != "int":
        raise TypeError(f"{operation}: {name} must have an integer dtype, got {_checks.dtype_name(array)}")
