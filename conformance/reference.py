"""float64 NumPy references, written straight from the formulas.

Deliberately independent of attnx: loops and explicit definitions, no code
shared with the algorithms under test.
"""

from __future__ import annotations

import math

import numpy as np


def allowed_mask(
    n: int,
    m: int,
    *,
    batch_shape: tuple[int, ...] = (),
    mask: np.ndarray | None = None,
    key_lengths: np.ndarray | None = None,
    lengths_per: str = "sequence",
    is_causal: bool = False,
) -> np.ndarray:
    """Boolean (*batch_shape, n, m), True where query i may attend key j.

    ``lengths_per`` says how ``key_lengths`` is laid out: ``"batch"`` (one per
    first leading index), ``"sequence"`` (the leading shape) or ``"query"``.
    """
    allowed = np.ones((*batch_shape, n, m), dtype=bool)
    for index in np.ndindex(*batch_shape, n, m):
        *batch, i, j = index
        if is_causal and j > i + (m - n):
            allowed[index] = False
        if key_lengths is not None:
            if lengths_per == "batch":
                length = key_lengths[batch[0]]
            elif lengths_per == "query":
                length = np.broadcast_to(key_lengths, (*batch_shape, n))[(*batch, i)]
            else:
                length = np.broadcast_to(key_lengths, batch_shape)[tuple(batch)]
            if j >= length:
                allowed[index] = False
    if mask is not None and mask.dtype == bool:
        allowed &= np.broadcast_to(mask, allowed.shape)
    return allowed


def softmax(scores: np.ndarray, allowed: np.ndarray | None = None) -> np.ndarray:
    """Row softmax over the last axis; entries not allowed (or -inf) get 0, and
    a row with nothing allowed is all zeros."""
    scores = np.asarray(scores, dtype=np.float64)
    if allowed is None:
        allowed = np.ones(scores.shape, dtype=bool)
    allowed = np.broadcast_to(allowed, scores.shape) & (scores != -np.inf)
    weights = np.zeros(scores.shape)
    for index in np.ndindex(*scores.shape[:-1]):
        keep = allowed[index]
        if keep.any():
            row = scores[index][keep]
            exp = np.exp(row - row.max())
            weights[index][keep] = exp / exp.sum()
    return weights


def scaled_dot_product_attention(
    query: np.ndarray,
    key: np.ndarray,
    value: np.ndarray,
    *,
    allowed: np.ndarray | None = None,
    additive: np.ndarray | None = None,
    scale: float | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """softmax(q k^T * scale + additive) v with the allowed mask; (output, weights)."""
    query, key, value = (np.asarray(a, dtype=np.float64) for a in (query, key, value))
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1])
    scores = np.einsum("...nd,...md->...nm", query, key) * scale
    if additive is not None:
        scores = scores + np.asarray(additive, dtype=np.float64)
    weights = softmax(scores, allowed)
    return np.einsum("...nm,...md->...nd", weights, value), weights
