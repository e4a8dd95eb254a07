"""A call's masks as the NumPy native cuts its work: by (batch, head)
slices, query rows and keys.

The native attends ``(slices, rows, d)`` blocks of the (batch, head) slices
laid end to end.  A ``mask`` and ``key_lengths`` broadcast over the leading
shape instead, so here they are laid out once per call by slice, as views
of the user's arrays: the slices of a block are one view where the mask's
strides merge the leading axes into one.  Where they don't (a ``(B, 1, n,
m)`` mask, or a ``(1, H, n, m)`` bias, on ``B x H`` slices), the slices
fall into *runs* (here of ``H``) that are one view each, and the native
cuts its blocks at the runs' ends.  Masks of one row of keys per slice
(padding masks, ``(B, 1, 1, m)``) and lengths of one per sequence are
copied instead, one row per slice, small beside the scores: blocks then
need no cut.

What a mask does to a block is attnx's rule (:mod:`attnx.natives`): a
boolean mask or a length forbids a key, a real mask is added to the
scores.  Lengths, and masks of one row of keys per slice (padding masks,
boolean or ``-inf``), also tell which keys no row of a block may see: the
native does not compute those at all (a padded batch costs its lengths,
not its longest sequence).
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import array_api_compat.numpy as xp
import numpy as np

from attnx import natives


class CallMasks:
    """A call's ``mask`` and ``key_lengths``, laid out by slice
    (:class:`_Laid`): ``allowed`` (boolean), ``additive`` (real) and
    ``lengths`` (integer, ``(..., n or 1, 1)``), each None where the call
    has none.  For a mask of one row of keys per slice, ``reach`` is the
    keys up to its last allowed one (those past it are not computed, as for
    lengths) and ``untouched`` the keys before the first it forbids or
    shifts (blocks of those alone need no mask).  :meth:`runs` and
    :meth:`slices` cut a block's masks out of them."""

    def __init__(self, mask: Any, key_lengths: Any, batch_shape: tuple[int, ...], n: int, m: int) -> None:
        self.allowed = self.additive = self.lengths = self.reach = self.untouched = self.positions = None
        self.m = m
        if mask is not None:
            laid = _Laid.of(mask, batch_shape)
            if laid.array.dtype == np.bool_:
                self.allowed = laid
            else:
                self.additive = laid
            if laid.array.shape[-2:] == (1, m):  # one row of keys per slice: a padding mask
                keys = _allowed_keys(laid.array)
                self.reach = laid._replace(array=_reach(keys))
                kept = keys if self.allowed is not None else laid.array == 0
                self.untouched = laid._replace(array=_first(~kept))
        if key_lengths is not None:
            self.lengths = _Laid.of(natives.aligned_lengths(xp, key_lengths, batch_shape, n), batch_shape)
            self.positions = np.arange(m)  # the keys' positions, which lengths cut

    def settle_empty_rows(self, totals: Any, output: Any, is_causal: bool) -> None:
        """Give the rows that no mask lets attend any key (``(slices, n, 1)``
        ``totals`` and ``(slices, n, d_v)`` ``output``) a sum of 1 and
        zeros: what they are, whatever their unshifted run left there.

        A row has a key to attend where its mask's first allowed key comes
        before its length and, if causal, at or before its diagonal (both
        cut the keys from the end).  Read from the values once per call, and
        only for calls where some sum failed: a pass over the mask."""
        slices, n = totals.shape[:2]
        m = self.m
        first = np.zeros((1, 1), dtype=np.intp)  # without a mask: key 0
        mask = self.allowed if self.allowed is not None else self.additive
        if mask is not None:
            found = _first(_allowed_keys(mask.array))[..., 0]
            first = found.reshape(-1, found.shape[-1])  # (slices or 1, n or 1)
        limit = np.full((1, 1), m)
        if self.lengths is not None:
            limit = self.lengths.array.reshape(-1, self.lengths.array.shape[-2])
        if is_causal:  # the keys up to each row's diagonal, i + m - n
            limit = np.minimum(limit, np.arange(n)[None, :] + (m - n + 1))
        empty = np.broadcast_to(first >= limit, (slices, n))
        totals[empty] = 1
        output[empty] = 0

    def runs(self, s0: int, s1: int) -> list[tuple[int, int]]:
        """The slices ``s0:s1``, cut where a mask's run of slices ends."""
        run = min(laid.run for laid in (self.allowed, self.additive, self.lengths) if laid is not None)
        return [(start, min(s1, (start // run + 1) * run)) for start in _starts(s0, s1, run)]

    def slices(self, s0: int, s1: int) -> BlockMasks:
        """The masks of the slices ``s0:s1``, within one of :meth:`runs`."""
        laid = (self.allowed, self.additive, self.lengths, self.reach, self.untouched)
        return BlockMasks(*(None if one is None else one.slices(s0, s1) for one in laid), self.positions)


class BlockMasks:
    """The masks of a block's slices: ``allowed`` (boolean) and ``additive``
    (real) ``(slices or 1, n or 1, m or 1)``, ``lengths`` (integer) and
    ``reach`` and ``untouched`` ``(slices or 1, n or 1, 1)``, each None
    where the call has none, and ``positions``, the keys' positions where
    there are lengths."""

    def __init__(self, allowed: Any, additive: Any, lengths: Any, reach: Any, untouched: Any, positions: Any) -> None:
        self.allowed, self.additive, self.lengths = allowed, additive, lengths
        self.reach, self.untouched, self.positions = reach, untouched, positions

    def key_range(self, r0: int, r1: int, stop: int) -> tuple[int, int]:
        """``(stop, free)`` for the rows ``r0:r1``, given the keys ``0:stop``
        they may see otherwise: no row's length or mask reaches past the new
        ``stop``, and no length or mask of one row of keys per slice acts on
        a key before ``free``, so blocks of those keys need neither."""
        free = stop
        if self.reach is not None:
            stop = min(stop, int(self.reach.max()))
            free = min(stop, int(self.untouched.min()))
        if self.lengths is not None:
            lengths = _cut(self.lengths, 1, r0, r1)
            stop = min(stop, int(lengths.max()))
            free = min(free, stop, int(lengths.min()))
        return stop, free

    def block(self, r0: int, r1: int, c0: int, c1: int, free: int, dtype: Any, factors: Any) -> tuple[Any, Any, Any]:
        """``(additive, allowed, kept)`` for the rows ``r0:r1`` and the keys
        ``c0:c1``, each broadcastable to the block's scores or None: the
        real mask in ``dtype``, the boolean mask, and the lengths' factor of
        1 for a key a row may see and 0 for one it may not, written into the
        flat buffer ``factors``; the lengths and a mask of one row of keys
        per slice only where the keys reach past ``free``.

        ``kept`` covers the block's last keys only, from ``free`` on (every
        row may see the keys before it), so it applies to the scores' last
        ``kept.shape[-1]`` keys: a chunk of prefill whose lengths cut 127
        keys of a block of 2,048 is masked on those, not on the whole
        block.  Where that band is a third of the block or more it covers
        the whole block: a product on part of each row costs some three
        times one on whole rows (as the causal band's, ``_mask_future``)."""
        additive = allowed = kept = None
        if self.untouched is not None and c1 <= free:  # a padding mask (and lengths), before their first hole
            return None, None, None
        if self.additive is not None:
            additive = _cut(_cut(self.additive, 1, r0, r1), 2, c0, c1)
            if additive.dtype != dtype:  # attnx's rule: a real mask takes the scores' dtype, then adds
                additive = additive.astype(dtype)
        if self.allowed is not None:
            allowed = _cut(_cut(self.allowed, 1, r0, r1), 2, c0, c1)
        if self.lengths is not None and c1 > free:
            lengths = _cut(self.lengths, 1, r0, r1)
            b0 = c0 if 3 * (c1 - max(c0, free)) >= c1 - c0 else free
            shape = (lengths.shape[0], lengths.shape[1], c1 - b0)
            kept = factors[: math.prod(shape)].reshape(shape)
            np.less(self.positions[b0:c1], lengths, out=kept)
        return additive, allowed, kept


class _Laid(NamedTuple):
    """An array broadcastable to ``(*batch_shape, n, m)``, laid out as
    ``array`` of shape ``(*outer, run, n or 1, m or 1)``: slice ``s`` is
    ``array[unravel(s // run, outer)][s % run]``, so that the slices of one
    run are one view."""

    array: Any
    outer: tuple[int, ...]
    run: int

    @classmethod
    def of(cls, array: Any, batch_shape: tuple[int, ...]) -> _Laid:
        array = np.asarray(array)
        array = array.reshape((1,) * (len(batch_shape) + 2 - array.ndim) + array.shape)
        core, slices = array.shape[-2:], math.prod(batch_shape)
        if all(size == 1 for size in array.shape[:-2]):  # shared by every slice
            return cls(array.reshape(1, *core), (), slices)
        spread = np.broadcast_to(array, (*batch_shape, *core))
        # The trailing leading axes that merge into one, without a copy.
        sizes, strides = spread.shape[:-2], spread.strides[:-2]
        split = len(sizes)
        while split > 0 and _mergeable(sizes[split - 1 :], strides[split - 1 :]):
            split -= 1
        if split > 0 and core[0] == 1:  # one row per slice: copied, small beside the scores, so blocks need no cut
            return cls(spread.reshape(slices, *core), (), slices)
        outer, run = sizes[:split], math.prod(sizes[split:])
        return cls(spread.reshape(*outer, run, *core), outer, run)

    def slices(self, s0: int, s1: int) -> Any:
        """``(s1 - s0 or 1, n or 1, m or 1)``: the slices ``s0:s1`` of one run."""
        index, start = divmod(s0, self.run)
        array = self.array[np.unravel_index(index, self.outer)] if self.outer else self.array
        return _cut(array, 0, start, start + s1 - s0)


def _starts(s0: int, s1: int, run: int) -> list[int]:
    """Where the slices ``s0:s1`` begin a run of ``run`` slices, ``s0`` first."""
    return [s0, *range((s0 // run + 1) * run, s1, run)]


def _first(found: Any) -> Any:
    """``(..., 1)``: the first True of each row of ``found`` (``(..., m)``),
    ``m`` where there is none."""
    return np.where(found.any(axis=-1, keepdims=True), np.argmax(found, axis=-1, keepdims=True), found.shape[-1])


def _reach(allowed: Any) -> Any:
    """``(..., 1)``: one past the last True of each row of ``allowed``
    (``(..., m)``), 0 where there is none."""
    return allowed.shape[-1] - _first(allowed[..., ::-1])


def _allowed_keys(mask: Any) -> Any:
    """Where a boolean or real mask lets a query attend a key (a real mask
    forbids with ``-inf`` only)."""
    return mask if mask.dtype == np.bool_ else mask > -np.inf


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
