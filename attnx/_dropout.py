"""Dropout on the attention weights: one counter-based mask on every backend.

Whether weight ``(…, i, j)`` is kept is a hash of the seed and its
position, not a draw from a library's generator, so the same seed gives
the same mask on NumPy, PyTorch, JAX, CuPy and Dask, on any device, in
tiles of any size, and the backward makes it again instead of storing it.

The hash is Chris Wellons' ``lowbias32`` (an integer finalizer; each
output bit depends on every input bit), folded over the position:

- ``key = mix(mix(seed mod 2**32) ^ slice)``, ``slice`` the index of the
  weight's (batch, head) slice in the leading shape, in row-major order
  (``b * H + h`` for ``(B, H, n, m)`` weights: grouped heads laid out as
  ``(B, H_kv, G)`` count alike, and axes of one entry count for nothing);
- ``row = mix(key ^ i)`` for query ``i``, ``column = mix(j ^ 0x9E3779B9)``
  for key ``j``;
- the weight is kept where ``mix(row ^ column) >= round(p * 2**32)``, so
  with probability ``1 - p`` (to 2**-32), and kept weights are multiplied
  by ``1 / (1 - p)`` (PyTorch's inverted dropout).

All arithmetic is on unsigned 32-bit words.  The standard's ``uint32`` is
not usable everywhere (PyTorch 2.13 has no shift, comparison or addition
for it; JAX without x64 has no ``int64``), so the words live in ``int32``
arrays: multiplication wraps alike in two's complement, right shifts are
masked to be logical, and the unsigned comparison flips the sign bit.
"""

from __future__ import annotations

import math
import operator
from typing import Any

from attnx import _checks

#: lowbias32's multipliers, as the int32 values with their bits.
_MULTIPLY_1 = 0x7FEB352D
_MULTIPLY_2 = 0x846CA68B - 2**32
#: Mixed into each key's index, so that key j and query j differ.
_COLUMN = 0x9E3779B9 - 2**32
_SIGN = -(2**31)


def require_dropout(operation: str, xp: Any, dropout_p: Any, dropout_seed: Any, owns: Any) -> float:
    """``dropout_p`` as a float in ``[0, 1]`` and a seed where it is
    positive: an int, or a 0-d integer array of the inputs' backend
    (``owns``), which may be traced."""
    if require_probability(operation, "dropout_p", dropout_p) == 0.0:
        return 0.0
    if dropout_seed is None:
        raise ValueError(
            f"{operation}: dropout_p={dropout_p!r} needs dropout_seed= (an int, or a 0-d integer array): attnx's "
            "dropout mask is a function of the seed, the same on every backend, with no hidden generator"
        )
    if isinstance(dropout_seed, bool):
        raise TypeError(f"{operation}: dropout_seed must be an int or a 0-d integer array, got bool")
    if not isinstance(dropout_seed, int):
        if not owns(dropout_seed) or not hasattr(dropout_seed, "dtype"):
            raise TypeError(
                f"{operation}: dropout_seed must be an int or a 0-d integer array of the inputs' backend, "
                f"got {type(dropout_seed).__module__}.{type(dropout_seed).__name__}"
            )
        if not xp.isdtype(dropout_seed.dtype, "integral") or dropout_seed.ndim != 0:
            raise TypeError(
                f"{operation}: dropout_seed must be a 0-d integer array, got dtype "
                f"{_checks.dtype_label(dropout_seed.dtype)} and shape {_checks.shape_of(dropout_seed)}"
            )
    return float(dropout_p)


def require_probability(operation: str, name: str, p: Any) -> float:
    """A dropout probability: a real number in ``[0, 1]``, as a float."""
    if isinstance(p, bool) or not isinstance(p, int | float):
        raise TypeError(f"{operation}: {name} must be a float in [0, 1], got {type(p).__name__}")
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"{operation}: {name} must be in [0, 1], got {p!r}")
    return float(p)


def seed_array(dropout_seed: Any) -> Any:
    """``dropout_seed`` if it is an array (for the backend and device
    checks of the inputs), else None."""
    return dropout_seed if getattr(dropout_seed, "ndim", None) is not None else None


def _shifted(words: Any, bits: int) -> Any:
    """The logical right shift of unsigned words held in int32."""
    return (words >> bits) & ((1 << (32 - bits)) - 1)


def mix(words: Any) -> Any:
    """lowbias32 of unsigned words held in an int32 array (operators only)."""
    words = words ^ _shifted(words, 16)
    words = words * _MULTIPLY_1
    words = words ^ _shifted(words, 15)
    words = words * _MULTIPLY_2
    return words ^ _shifted(words, 16)


def _as_word(value: int) -> int:
    """A Python int's low 32 bits as an int32 value."""
    value = operator.index(value) & 0xFFFFFFFF
    return value - 2**32 if value >= 2**31 else value


class Dropout:
    """The dropout of one call: makes the multiplier of any tile of its
    weights, ``(..., rows, cols)``, 0 where dropped and ``1 / (1 - p)``
    where kept."""

    def __init__(self, xp: Any, p: float, seed: Any, batch_shape: tuple[int, ...], device: Any, dtype: Any) -> None:
        self.xp, self.p, self.device, self.dtype = xp, p, device, dtype
        batch_shape = tuple(batch_shape)
        int32, ndim = xp.int32, len(batch_shape) + 2
        if isinstance(seed, int):
            key = xp.asarray(_as_word(seed), dtype=int32, device=device)
        else:
            key = xp.astype(seed, int32) if seed.dtype != int32 else seed
        # Never 0-d: NumPy computes 0-d arrays as scalars, which warn where they wrap.
        key = mix(xp.reshape(key, (1,) * ndim))
        slices = xp.arange(math.prod(batch_shape), dtype=int32, device=device)
        #: (*batch_shape, 1, 1): one key per slice, from its index in the leading shape's order.
        self.slice_keys = mix(key ^ xp.reshape(slices, (*batch_shape, 1, 1)))
        # Kept where the word >= threshold: compared as signed after the sign bit flips.
        self.threshold = round(p * 2**32) + _SIGN
        self.keep_scale = 1.0 / (1.0 - p) if p < 1.0 else 0.0

    def regrouped(self, batch_shape: tuple[int, ...]) -> Dropout:
        """The same mask over another layout of the same slices (flex
        attention's heads as ``(H_kv, G)``), in order."""
        copy = object.__new__(Dropout)
        copy.__dict__.update(self.__dict__)
        copy.slice_keys = self.xp.reshape(self.slice_keys, (*batch_shape, 1, 1))
        return copy

    def tile(self, span: tuple[int, int] | None, rows: tuple[int, int], cols: tuple[int, int]) -> Any:
        """The multiplier of rows ``rows``, keys ``cols`` of the slices
        whose first index lies in ``span`` (None: all)."""
        xp, int32, device = self.xp, self.xp.int32, self.device
        keys = self.slice_keys if span is None else self.slice_keys[span[0] : span[1], ...]
        if self.p >= 1.0:  # nothing kept (a threshold of 2**32 has no int32 to stand for it)
            return xp.zeros((*keys.shape[:-2], rows[1] - rows[0], cols[1] - cols[0]), dtype=self.dtype, device=device)
        query_index = xp.reshape(xp.arange(rows[0], rows[1], dtype=int32, device=device), (-1, 1))
        key_index = xp.reshape(xp.arange(cols[0], cols[1], dtype=int32, device=device), (1, -1))
        words = mix(mix(keys ^ query_index) ^ mix(key_index ^ _COLUMN))
        kept = (words ^ _SIGN) >= self.threshold
        return xp.astype(kept, self.dtype) * self.keep_scale


def make(xp: Any, p: float, seed: Any, batch_shape: tuple[int, ...], query: Any) -> Dropout | None:
    """The call's :class:`Dropout` for weights over ``batch_shape``, on
    ``query``'s device in its accumulation dtype; None where ``p`` is 0
    (nothing to do)."""
    if not p:
        return None
    return Dropout(xp, p, seed, batch_shape, _checks.device_of(query), _checks.accumulation_dtype(xp, query.dtype))
