"""A call's masks as the NumPy native cuts its work: by (batch, head)
slices, query rows and keys.

The native attends ``(slices, rows, d)`` blocks of the (batch, head) slices
laid end to end.  A ``mask`` and ``key_lengths`` broadcast over the leading
shape instead, so here they are laid out once per call as arrays of shape
``(slices or 1, n or 1, m or 1)``: views of the user's arrays where their
strides allow, copies where they hold one row of keys per slice (a padding
mask of shape ``(B, 1, 1, m)`` on ``B x H`` slices: ``B x H x m`` items).
A mask that would need a copy of a whole ``(n, m)`` per slice (``(B, 1, n,
m)`` on ``B x H`` slices) is declined, and so is its call: the generic
algorithm takes its blocks by batch entries, without that copy.

What a mask does to a block is attnx's rule (:mod:`attnx.natives`): a
boolean mask or a length forbids a key, a real mask is added to the
scores.  Lengths, and masks of one row of keys per slice (padding masks,
boolean or ``-inf``), also tell which keys no row of a block may see: the
native does not compute those at all (a padded batch costs its lengths,
not its longest sequence).
"""

from __future__ import annotations

import math
from typing import Any

import array_api_compat.numpy as xp
import numpy as np

from attnx import natives


class SliceMasks:
    """A call's ``mask`` and ``key_lengths`` by (batch, head) slice.

    ``allowed`` (boolean) and ``additive`` (real) are ``(slices or 1, n or
    1, m or 1)``, ``lengths`` (integer) is ``(slices or 1, n or 1, 1)``;
    each None where the call has none.  ``reach`` (``(slices or 1, 1, 1)``,
    or None) is, for a mask of one row of keys per slice, the keys up to its
    last allowed one: those past it are not computed, as for lengths.  :meth:`of` builds them;
    :meth:`slices` cuts the slices of a task out of them.
    """

    def __init__(self, allowed: Any, additive: Any, lengths: Any, reach: Any, positions: Any) -> None:
        self.allowed, self.additive, self.lengths, self.reach = allowed, additive, lengths, reach
        self.positions = positions  # the keys' positions, 0 to m - 1, where lengths cut them

    @classmethod
    def of(cls, mask: Any, key_lengths: Any, batch_shape: tuple[int, ...], n: int, m: int) -> SliceMasks | None:
        """The masks of a call with leading shape ``batch_shape``, ``n``
        queries and ``m`` keys (validated by attnx), or None where a mask
        would need a copy of ``(n, m)`` items per slice."""
        allowed = additive = lengths = reach = positions = None
        if mask is not None:
            per_slice = _per_slice(mask, batch_shape)
            if per_slice is None:
                return None
            if per_slice.dtype == np.bool_:
                allowed = per_slice
            else:
                additive = per_slice
            if per_slice.shape[1:] == (1, m) and m > 1:  # one row of keys per slice: a padding mask
                reach = _reach(per_slice if allowed is not None else per_slice > -np.inf)
        if key_lengths is not None:
            # One length per slice, or per query: (slices, n) at most, small beside the scores.
            lengths = _per_slice(natives.aligned_lengths(xp, key_lengths, batch_shape, n), batch_shape, copy_rows=True)
            positions = np.arange(m)
        return cls(allowed, additive, lengths, reach, positions)

    def slices(self, s0: int, s1: int) -> SliceMasks:
        """The masks of the slices ``s0:s1``."""
        cut = (_cut(array, 0, s0, s1) for array in (self.allowed, self.additive, self.lengths, self.reach))
        return SliceMasks(*cut, self.positions)

    def key_range(self, r0: int, r1: int, stop: int) -> tuple[int, int]:
        """``(stop, free)`` for the rows ``r0:r1``, given the keys ``0:stop``
        they may see otherwise: no row's length or mask reaches past the new
        ``stop``, and every row's length reaches ``free``, so the keys
        before it need no mask for their lengths."""
        if self.reach is not None:
            stop = min(stop, int(self.reach.max()))
        if self.lengths is None:
            return stop, stop
        lengths = _cut(self.lengths, 1, r0, r1)
        return min(stop, int(lengths.max())), min(stop, int(lengths.min()))

    def block(self, r0: int, r1: int, c0: int, c1: int, free: int, dtype: Any, factors: Any) -> tuple[Any, Any, Any]:
        """``(additive, allowed, kept)`` for the rows ``r0:r1`` and the keys
        ``c0:c1``, each broadcastable to the block's scores or None: the
        real mask in ``dtype``, the boolean mask, and (where the keys reach
        past ``free``) the lengths' factor of 1 for a key a row may see and
        0 for one it may not, written into the flat buffer ``factors``."""
        additive = allowed = kept = None
        if self.additive is not None:
            additive = _cut(_cut(self.additive, 1, r0, r1), 2, c0, c1)
            if additive.dtype != dtype:  # attnx's rule: a real mask takes the scores' dtype, then adds
                additive = additive.astype(dtype)
        if self.allowed is not None:
            allowed = _cut(_cut(self.allowed, 1, r0, r1), 2, c0, c1)
        if self.lengths is not None and c1 > free:
            lengths = _cut(self.lengths, 1, r0, r1)
            shape = (lengths.shape[0], lengths.shape[1], c1 - c0)
            kept = factors[: math.prod(shape)].reshape(shape)
            np.less(self.positions[c0:c1], lengths, out=kept)
        return additive, allowed, kept


def _per_slice(array: Any, batch_shape: tuple[int, ...], copy_rows: bool = False) -> Any:
    """``array`` (broadcastable to ``(*batch_shape, n, m)``) as ``(slices or
    1, n or 1, m or 1)``; None where that would copy more than one row per
    slice, unless ``copy_rows``."""
    array = np.asarray(array)
    array = array.reshape((1,) * (len(batch_shape) + 2 - array.ndim) + array.shape)
    core = array.shape[-2:]
    if all(size == 1 for size in array.shape[:-2]):
        return array.reshape(1, *core)
    spread = np.broadcast_to(array, (*batch_shape, *core))
    if core[0] != 1 and not copy_rows and not _mergeable(spread.shape[:-2], spread.strides[:-2]):
        return None
    return spread.reshape(-1, *core)  # a view where mergeable; else a copy of one row of keys per slice


def _reach(allowed: Any) -> Any:
    """``(..., 1)``: one past the last True of each row of ``allowed``
    (``(..., m)``), 0 where there is none."""
    m = allowed.shape[-1]
    last = m - np.argmax(allowed[..., ::-1], axis=-1, keepdims=True)
    return np.where(allowed.any(axis=-1, keepdims=True), last, 0)


def _mergeable(shape: tuple[int, ...], strides: tuple[int, ...]) -> bool:
    """Whether the axes ``shape`` (with ``strides``) are one axis in memory:
    then NumPy reshapes them into one without a copy."""
    axes = [(size, stride) for size, stride in zip(shape, strides) if size != 1]
    return all(outer == inner * size for (_, outer), (size, inner) in zip(axes, axes[1:]))


def _cut(array: Any, axis: int, start: int, stop: int) -> Any:
    """``array[start:stop]`` along ``axis``, unless it broadcasts there (size 1)."""
    if array is None or array.shape[axis] == 1:
        return array
    return array[(slice(None),) * axis + (slice(start, stop),)]
