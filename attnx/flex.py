"""Programmable attention: ``score_mod``, ``mask_mod`` and block sparsity.

PyTorch's FlexAttention, on every backend, with its calling convention: a
``score_mod(score, b, h, q_idx, kv_idx)`` changes the scores, a
``mask_mod(b, h, q_idx, kv_idx)`` says which keys a query attends, and
:func:`create_block_mask` records which blocks of the scores a ``mask_mod``
leaves empty, full or partial, so that :func:`flex_attention` never computes
an empty block and evaluates the mask on partial blocks only.

attnx calls a mod with arrays of the inputs' backend: the scores of a tile
``(B, H, rows, cols)`` and integer index arrays that broadcast against them,
``b`` of shape ``(B, 1, 1, 1)``, ``h`` of ``(1, H, 1, 1)``, ``q_idx`` of
``(1, 1, rows, 1)`` and ``kv_idx`` of ``(1, 1, 1, cols)``.  A mod written with
operators (``q_idx >= kv_idx``, ``score + slopes[h]``) runs unchanged here
and in PyTorch, where it is called on 0-d tensors.  :mod:`attnx.mods` holds
the common ones.

Examples
--------
>>> import numpy as np, attnx
>>> q = k = v = np.ones((1, 2, 6, 4), dtype=np.float32)
>>> window = attnx.create_block_mask(attnx.mods.sliding_window(2), None, None, 6, 6, block_size=2)
>>> window.kinds[0, 0].tolist()  # 0: empty (skipped), 1: partial (masked), 2: full
[[1, 0, 0], [1, 1, 0], [0, 1, 1]]
>>> attnx.flex_attention(q, k, v, block_mask=window).shape
(1, 2, 6, 4)
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

from attnx import _checks, _dispatch, _dropout, _grouping, _masking, _tiling, _tracing
from attnx._typing import Array, Device
from attnx.attention import choose_chunks

__all__ = ["BlockMask", "and_masks", "create_block_mask", "flex_attention", "or_masks"]

_FLEX = "flex_attention"
_CREATE = "create_block_mask"

#: A block's kind in :attr:`BlockMask.kinds`.
EMPTY, PARTIAL, FULL = 0, 1, 2

ScoreMod = Callable[[Any, Any, Any, Any, Any], Any]
MaskMod = Callable[[Any, Any, Any, Any], Any]


class BlockMask:
    """Which blocks of the scores a ``mask_mod`` leaves empty, partial or full.

    Made by :func:`create_block_mask`; reusable across calls and layers of
    the same sizes.

    Attributes
    ----------
    mask_mod : callable
        The mod, evaluated on the partial blocks by :func:`flex_attention`.
    shape : (B, H, Q_LEN, KV_LEN)
        ``B`` or ``H`` is None where the mask broadcasts over it.
    block_size : (int, int)
        Queries and keys per block.
    kinds : integer array, shape (B or 1, H or 1, q_blocks, kv_blocks)
        Of the backend that made it: :data:`EMPTY` (0), :data:`PARTIAL` (1)
        or :data:`FULL` (2) for each block.
    backend : str
        The backend that made it, whose arrays it is used with.

    Examples
    --------
    >>> import attnx
    >>> from attnx import mods
    >>> block_mask = attnx.create_block_mask(mods.causal, None, None, 512, 512)
    >>> block_mask.shape, block_mask.block_size
    ((None, None, 512, 512), (128, 128))
    >>> print(block_mask.kinds[0, 0])   # 0 empty (skipped), 1 partial (masked), 2 full
    [[1 0 0 0]
     [2 1 0 0]
     [2 2 1 0]
     [2 2 2 1]]
    """

    def __init__(
        self,
        *,
        mask_mod: MaskMod,
        shape: tuple[int | None, int | None, int, int],
        block_size: tuple[int, int],
        kinds: Array,
        backend: str,
        plan: list[list[list[tuple[tuple[int, int], ...]]]] | None,
    ) -> None:
        self.mask_mod = mask_mod
        self.shape = shape
        self.block_size = block_size
        self.kinds = kinds
        self.backend = backend
        # Per (b, h, query block): the non-empty key blocks as (index, kind),
        # read once from concrete kinds; None where they were traced or lazy
        # (then every block is computed, with its mask).
        self._plan = plan
        #: The most key blocks any row of blocks visits, read once from the plan.
        self._widest = max((len(row) for entry in plan for head in entry for row in head), default=1) if plan else 1
        # Per row of blocks: the first and last key block any entry or head
        # visits, from which the keys of joined rows are bounded.
        self._row_spans = (
            [
                (min(kbs, default=0), max(kbs, default=-1))
                for kbs in (
                    [kb for entry in plan for head in entry for kb, _ in head[qb]] for qb in range(len(plan[0][0]))
                )
            ]
            if plan
            else []
        )
        #: The (batch, heads) of calls whose mod was found not to read what
        #: the mask broadcasts over (:func:`_require_broadcast_mod`): probed
        #: once, since the probe costs some 190 us a call on PyTorch's CPU
        #: tensors, more on CUDA's (attnx:torch 1.71x PyTorch's compiled
        #: flex on an H200 with it, 0.94x before it).
        self._broadcast_checked: set[tuple[int, int]] = set()

    @property
    def sparsity(self) -> float | None:
        """The fraction of blocks skipped (empty), or None where the kinds
        can't be read (traced or lazy)."""
        if self._plan is None:
            return None
        q_blocks, kv_blocks = self.kinds.shape[-2:]
        total = math.prod(self.kinds.shape)
        visited = sum(len(row) for heads in self._plan for rows in heads for row in rows)
        return 1.0 - visited / total if total and q_blocks and kv_blocks else 0.0

    def _joined_width(self, rows_per_step: int) -> int:
        """At most how many key blocks a step of ``rows_per_step`` rows of
        blocks visits (the span from its first to its last key block)."""
        spans = self._row_spans
        widths = [
            max(hi for _, hi in spans[r : r + rows_per_step]) - min(lo for lo, _ in spans[r : r + rows_per_step]) + 1
            for r in range(0, len(spans), rows_per_step)
        ]
        return max(widths + [1])  # no max(default=): torch.compile can't trace it

    def tiles(self, batch: tuple[int, int], rows: tuple[int, int], key_chunk: int) -> list[_tiling.Tile]:
        """The key tiles of the queries ``rows`` of the batch entries
        ``batch``: blocks empty for all are left out, blocks full for all are
        unmasked, and neighbouring blocks of one kind merge up to
        ``key_chunk`` keys."""
        q_block, kv_block = self.block_size
        plan = self._plan
        entries = range(*batch) if len(plan) > 1 else range(1)
        query_blocks = range(rows[0] // q_block, (rows[1] - 1) // q_block + 1)
        # A key block non-empty somewhere is visited; it is unmasked only
        # where every (b, h, query block) finds it full.
        full_count: dict[int, int] = {}
        for b in entries:
            for heads in plan[b]:
                for qb in query_blocks:
                    for kb, kind in heads[qb]:
                        full_count[kb] = full_count.get(kb, 0) + (kind == FULL)
        total = len(entries) * len(plan[0]) * len(query_blocks)
        kv_len, run = self.shape[3], max(1, key_chunk // kv_block)
        tiles: list[_tiling.Tile] = []
        for kb in sorted(full_count):
            masked = full_count[kb] < total
            start, stop = kb * kv_block, min(kv_len, (kb + 1) * kv_block)
            if tiles and tiles[-1][1] == start and tiles[-1][2] == masked and stop - tiles[-1][0] <= run * kv_block:
                tiles[-1] = (tiles[-1][0], stop, masked)
            else:
                tiles.append((start, stop, masked))
        return tiles

    def __repr__(self) -> str:
        sparsity = self.sparsity
        said = "unknown" if sparsity is None else f"{sparsity:.1%}"
        return f"BlockMask(shape={self.shape}, block_size={self.block_size}, sparsity={said})"


def and_masks(*mask_mods: MaskMod) -> MaskMod:
    """A ``mask_mod`` that attends where every one of ``mask_mods`` does.

    Parameters
    ----------
    *mask_mods : callable ``(b, h, q_idx, kv_idx) -> bool array``

    Returns
    -------
    callable
        A ``mask_mod``.

    Raises
    ------
    TypeError
        If a mod is not callable.

    Examples
    --------
    >>> import numpy as np
    >>> import attnx
    >>> from attnx import mods
    >>> local = attnx.and_masks(mods.causal, mods.sliding_window(1))
    >>> print(local(0, 0, np.arange(4)[:, None], np.arange(4)[None, :]).astype(int))
    [[1 0 0 0]
     [1 1 0 0]
     [0 1 1 0]
     [0 0 1 1]]
    """
    _require_mods("and_masks", mask_mods)

    def both(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        allowed = q_idx == q_idx  # True, in the index arrays' own library
        for mod in mask_mods:
            allowed = allowed & mod(b, h, q_idx, kv_idx)
        return allowed

    return for_sizes(both, *(size for mod in mask_mods for size in declared_sizes(mod)))


def or_masks(*mask_mods: MaskMod) -> MaskMod:
    """A ``mask_mod`` that attends where any one of ``mask_mods`` does.

    Parameters
    ----------
    *mask_mods : callable ``(b, h, q_idx, kv_idx) -> bool array``

    Returns
    -------
    callable
        A ``mask_mod``.

    Raises
    ------
    TypeError
        If a mod is not callable.

    Examples
    --------
    >>> import numpy as np
    >>> import attnx
    >>> from attnx import mods
    >>> first_or_causal = attnx.or_masks(mods.causal, lambda b, h, q_idx, kv_idx: kv_idx == 0)
    >>> print(first_or_causal(0, 0, np.arange(3)[:, None], np.arange(3)[None, :]).astype(int))
    [[1 0 0]
     [1 1 0]
     [1 1 1]]
    """
    _require_mods("or_masks", mask_mods)

    def either(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
        allowed = q_idx != q_idx  # False, in the index arrays' own library
        for mod in mask_mods:
            allowed = allowed | mod(b, h, q_idx, kv_idx)
        return allowed

    return for_sizes(either, *(size for mod in mask_mods for size in declared_sizes(mod)))


#: A mod's tables and the call they were made for, as ``(maker, argument,
#: axis, size)`` with ``axis`` one of ``"B"``, ``"H"``, ``"positions"``:
#: ``alibi(slopes)`` of 8 slopes is for 8 heads.  Indexing a table past its
#: end fails, but indexing it short of its end (4 heads of 8 slopes) would
#: silently take another call's entries: the sizes are checked instead.
TableSize = tuple[str, str, str, int]
_SIZES_ATTRIBUTE = "_attnx_table_sizes"


def for_sizes(mod: Any, *sizes: TableSize) -> Any:
    """``mod``, recording the sizes its tables are for (see :data:`TableSize`)."""
    if sizes:
        setattr(mod, _SIZES_ATTRIBUTE, sizes)
    return mod


#: A score_mod's backward, ``backward(d_score, score, b, h, q_idx, kv_idx) ->
#: (d_score_in, {table name: its gradient})``, for :func:`attnx.vjp` on
#: backends without autograd, and for autograd's tile by tile
#: (:func:`with_backward`).
ModBackward = Callable[..., tuple[Any, dict[str, Any]]]
_BACKWARD_ATTRIBUTE = "_attnx_backward"


class ModRule(NamedTuple):
    """How attnx differentiates a mod of :mod:`attnx.mods`: its
    ``backward``, the ``tables`` it closes over by the names
    :func:`attnx.vjp` gives their gradients, and ``remake(**tables)``, the
    same mod closing over other tables (those an autograd library hands its
    ``Function``, its tracer or its batched tensors: a ``Function`` must not
    compute on what it closes over)."""

    backward: ModBackward
    tables: dict[str, Any]
    remake: Callable[..., Any] | None


def with_backward(mod: Any, backward: ModBackward, remake: Callable[..., Any] | None = None, **tables: Any) -> Any:
    """``mod``, with its :class:`ModRule` (``remake`` is needed where it
    has ``tables``)."""
    setattr(mod, _BACKWARD_ATTRIBUTE, ModRule(backward, tables, remake))
    return mod


def mod_backward(mod: Any) -> ModRule | None:
    """A mod's :class:`ModRule` (:func:`with_backward`); None for a mod of
    the user's own."""
    return getattr(mod, _BACKWARD_ATTRIBUTE, None)


def remade(mod: Any, tables: dict[str, Any]) -> Any:
    """``mod`` closing over ``tables`` instead of its own (itself where it
    has none)."""
    rule = mod_backward(mod)
    return mod if not tables or rule is None or rule.remake is None else rule.remake(**tables)


def declared_sizes(mod: Any) -> tuple[TableSize, ...]:
    """The sizes ``mod``'s tables are for; none for a mod of the user's own."""
    return getattr(mod, _SIZES_ATTRIBUTE, ())


def _require_table_sizes(
    operation: str, role: str, mod: Any, batch: int | None, heads: int | None, n: int, m: int
) -> None:
    """A ValueError when one of ``mod``'s tables was made for another batch,
    other heads or fewer positions than the call's (``None``: not known)."""
    for maker, argument, axis, size in declared_sizes(mod):
        if axis == "B" and batch is not None and size != batch:
            made_for, wanted = f"{size} batch entries", f"B = {batch}"
        elif axis == "H" and heads is not None and size != heads:
            made_for, wanted = f"{size} heads", f"H = {heads}"
        elif axis == "positions" and size < max(n, m):
            made_for, wanted = f"{size} positions", f"max(n, m) = {max(n, m)}"
        else:
            continue
        raise ValueError(
            f"{operation}: {role} {maker}({argument}) has {argument} for {made_for}, but the call has {wanted}"
        )


def _require_mods(operation: str, mods: tuple[Any, ...]) -> None:
    for position, mod in enumerate(mods):
        if not callable(mod):
            raise TypeError(
                f"{operation}: mask_mods must be callables (b, h, q_idx, kv_idx) -> bool array, "
                f"got {type(mod).__name__} at position {position}"
            )


def create_block_mask(
    mask_mod: MaskMod,
    B: int | None,
    H: int | None,
    Q_LEN: int,
    KV_LEN: int,
    *,
    block_size: int | tuple[int, int] = 128,
    backend: str | None = None,
    device: Device = None,
) -> BlockMask:
    """Evaluate ``mask_mod`` once, tile by tile, and record which blocks are
    empty, full or partial.

    Parameters
    ----------
    mask_mod : callable ``(b, h, q_idx, kv_idx) -> bool array``
        True where a query attends a key.
    B, H : int or None
        Batch size and heads; None where the mask is the same for all.
        The blocks are then recorded for ``b = 0`` (``h = 0``) alone, as
        PyTorch's are: a ``mask_mod`` that reads ``b`` (``h``), such as
        :func:`attnx.mods.prefix_lm` of one length per entry, needs ``B``
        (``H``); :func:`flex_attention` refuses it otherwise.
    Q_LEN, KV_LEN : int
        Queries and keys.
    block_size : int or (int, int)
        Queries and keys per block: the granularity of skipping.
    backend, device :
        Where the mask is evaluated (the current backend by default).

    Returns
    -------
    BlockMask
        Its kinds have shape ``(B or 1, H or 1, ceil(Q_LEN / q_block),
        ceil(KV_LEN / kv_block))``; ``B`` or ``H`` is 1 also where the
        ``mask_mod`` does not depend on ``b`` or ``h``.

    Raises
    ------
    TypeError
        If ``mask_mod`` is not callable, fails on a tile, or returns anything
        but a boolean array; or a size is not an integer.
    ValueError
        If a size or ``block_size`` is not positive, the mod's result does not
        broadcast to the tile, or ``backend=`` names no registered backend.
    BackendUnavailableError
        If the backend cannot run here.

    Notes
    -----
    The mod is evaluated on every query and key, in tiles of a whole number
    of blocks within the memory budget: O(Q_LEN * KV_LEN) work, once.

    Examples
    --------
    >>> import attnx
    >>> from attnx import mods
    >>> block_mask = attnx.create_block_mask(mods.sliding_window(128), None, None, 1024, 1024)
    >>> block_mask
    BlockMask(shape=(None, None, 1024, 1024), block_size=(128, 128), sparsity=76.6%)
    >>> block_mask.kinds.shape   # (B or 1, H or 1, query blocks, key blocks): 0 empty, 1 partial, 2 full
    (1, 1, 8, 8)
    """
    operation = _CREATE
    if not callable(mask_mod):
        raise TypeError(
            f"{operation}: mask_mod must be a callable (b, h, q_idx, kv_idx) -> bool array, got {mask_mod!r}"
        )
    batch = 1 if B is None else _checks.require_positive_int(operation, "B", B)
    heads = 1 if H is None else _checks.require_positive_int(operation, "H", H)
    n = _checks.require_positive_int(operation, "Q_LEN", Q_LEN)
    m = _checks.require_positive_int(operation, "KV_LEN", KV_LEN)
    # The mod is evaluated at every index: refused before a loop over more
    # elements than any array's index can count.
    _checks.require_size(operation, "B x H x Q_LEN x KV_LEN", batch, heads, n, m)
    _require_table_sizes(
        operation, "mask_mod", mask_mod, None if B is None else batch, None if H is None else heads, n, m
    )
    q_block, kv_block = _block_size(operation, block_size)
    chosen, _, device = _dispatch.resolve_creation(operation, backend, device)
    xp = chosen.xp
    probe = call_mask_mod(operation, chosen, mask_mod, (0, batch), heads, (0, min(n, 2)), (0, min(m, 2)), device)
    mask_batch, mask_heads = probe.shape[:2]  # 1 where the mod does not depend on b or h
    # Tiles of whole blocks, their mask within the memory budget (a mod's
    # integer intermediates take 8 bytes an element).
    block_bytes = chosen.block_bytes_on(_checks.device_of(probe))
    elements = max(q_block * kv_block, _tiling.memory_budget(block_bytes) // 8 // (mask_batch * mask_heads))
    cols = min(m, max(kv_block, elements // q_block // kv_block * kv_block))
    rows = min(n, max(q_block, elements // cols // q_block * q_block))
    row_kinds = []
    for r0 in range(0, n, rows):
        tiles = []
        for c0 in range(0, m, cols):
            allowed = call_mask_mod(
                operation, chosen, mask_mod, (0, batch), heads, (r0, min(n, r0 + rows)), (c0, min(m, c0 + cols)), device
            )
            shape = (mask_batch, mask_heads, *allowed.shape[2:])
            tiles.append(
                _block_kinds(
                    xp, xp.broadcast_to(allowed, shape) if allowed.shape != shape else allowed, q_block, kv_block
                )
            )
        row_kinds.append(tiles[0] if len(tiles) == 1 else xp.concat(tiles, axis=-1))
    kinds = row_kinds[0] if len(row_kinds) == 1 else xp.concat(row_kinds, axis=-2)
    plan = None
    if _checks.values_known(kinds):
        plan = [
            [[tuple((kb, kind) for kb, kind in enumerate(row) if kind) for row in head] for head in entry]
            for entry in chosen.to_numpy(kinds).tolist()
        ]
    return BlockMask(
        mask_mod=mask_mod,
        shape=(B, H, n, m),
        block_size=(q_block, kv_block),
        kinds=kinds,
        backend=chosen.name,
        plan=plan,
    )


def _block_size(operation: str, block_size: Any) -> tuple[int, int]:
    pair = block_size if isinstance(block_size, tuple) else (block_size, block_size)
    if len(pair) != 2:
        raise ValueError(f"{operation}: block_size must be an int or a (q_block, kv_block) pair, got {block_size!r}")
    return tuple(_checks.require_positive_int(operation, "block_size", size) for size in pair)  # type: ignore[return-value]


def _block_kinds(xp: Any, allowed: Any, q_block: int, kv_block: int) -> Any:
    """``(b, h, rows, cols)`` booleans to the kinds of their blocks
    ``(b, h, ceil(rows / q_block), ceil(cols / kv_block))``."""
    full_blocks = _blocks_reduce(xp, allowed, q_block, kv_block, xp.all, True)
    some = _blocks_reduce(xp, allowed, q_block, kv_block, xp.any, False)
    full, partial, empty = (
        xp.asarray(kind, dtype=xp.int8, device=_checks.device_of(allowed)) for kind in (FULL, PARTIAL, EMPTY)
    )
    return xp.where(full_blocks, full, xp.where(some, partial, empty))


def _blocks_reduce(xp: Any, allowed: Any, q_block: int, kv_block: int, reduce: Any, fill: bool) -> Any:
    lead, (rows, cols) = tuple(allowed.shape[:-2]), allowed.shape[-2:]
    device = _checks.device_of(allowed)
    missing_rows, missing_cols = -rows % q_block, -cols % kv_block
    if missing_rows:  # the last block is short: pad it with what changes nothing
        allowed = xp.concat([allowed, xp.full((*lead, missing_rows, cols), fill, device=device)], axis=-2)
    if missing_cols:
        allowed = xp.concat(
            [allowed, xp.full((*lead, rows + missing_rows, missing_cols), fill, device=device)], axis=-1
        )
    shape = (*lead, (rows + missing_rows) // q_block, q_block, (cols + missing_cols) // kv_block, kv_block)
    return reduce(xp.reshape(allowed, shape), axis=(-3, -1))


def index_arrays(
    xp: Any, batch: tuple[int, int], heads: int, rows: tuple[int, int], cols: tuple[int, int], device: Any
) -> tuple[Any, Any, Any, Any]:
    """``b (B, 1, 1, 1)``, ``h (1, H, 1, 1)``, ``q_idx (1, 1, rows, 1)``,
    ``kv_idx (1, 1, 1, cols)``: the positions of a tile, for the mods."""
    return (
        xp.reshape(xp.arange(*batch, device=device), (-1, 1, 1, 1)),
        xp.reshape(xp.arange(heads, device=device), (1, -1, 1, 1)),
        xp.reshape(xp.arange(*rows, device=device), (1, 1, -1, 1)),
        xp.reshape(xp.arange(*cols, device=device), (1, 1, 1, -1)),
    )


def _indices_said(indices: tuple[Any, ...]) -> str:
    return ", ".join(
        f"{name} of shape {_checks.shape_of(a)}" for name, a in zip(("b", "h", "q_idx", "kv_idx"), indices)
    )


def _call_mod(
    operation: str,
    chosen: Any,
    name: str,
    mod: Any,
    arguments: tuple[Any, ...],
    indices: tuple[Any, ...],
    tile: tuple[int, ...],
) -> Any:
    """``mod(*arguments)``, checked to be an array of the backend that
    broadcasts to ``tile``; one error naming the mod otherwise."""
    on = f"index arrays ({_indices_said(indices)})"
    result = _checks.call_users_function(operation, name, chosen, mod, arguments, on)
    if not _checks.broadcasts_to(operation, name, _checks.shape_of(result), tile):
        raise ValueError(
            f"{operation}: {name} must return an array broadcastable to the tile's shape {tile} "
            f"(for {_indices_said(indices)}), got shape {_checks.shape_of(result)}"
        )
    return result


def call_mask_mod(
    operation: str,
    chosen: Any,
    mask_mod: MaskMod,
    batch: tuple[int, int],
    heads: int,
    rows: tuple[int, int],
    cols: tuple[int, int],
    device: Any,
) -> Any:
    """``mask_mod`` on a tile's index arrays: a boolean array broadcastable
    to ``(B, H, rows, cols)``, never fewer than 4 dimensions."""
    xp = chosen.xp
    indices = index_arrays(xp, batch, heads, rows, cols, device)
    tile = (batch[1] - batch[0], heads, rows[1] - rows[0], cols[1] - cols[0])
    allowed = _call_mod(operation, chosen, "mask_mod", mask_mod, indices, indices, tile)
    if allowed.dtype != xp.bool:
        raise TypeError(
            f"{operation}: mask_mod must return a boolean array (True attends), got dtype {_checks.dtype_name(allowed)}"
        )
    return _four_dimensional(xp, allowed)


def call_score_mod(
    operation: str,
    chosen: Any,
    score_mod: ScoreMod,
    scores: Any,
    batch: tuple[int, int],
    rows: tuple[int, int],
    cols: tuple[int, int],
) -> Any:
    """``score_mod`` on a tile's scores ``(B, H, rows, cols)`` and index
    arrays: scores of the same shape and dtype."""
    xp = chosen.xp
    indices = index_arrays(xp, batch, scores.shape[1], rows, cols, _checks.device_of(scores))
    tile = tuple(scores.shape)
    result = _call_mod(operation, chosen, "score_mod", score_mod, (scores, *indices), indices, tile)
    if result.dtype != scores.dtype:
        if not _checks.is_float_dtype(xp, result.dtype):
            raise TypeError(
                f"{operation}: score_mod must return scores of their own dtype {_checks.dtype_name(scores)}, got "
                f"{_checks.dtype_name(result)}"
            )
        # Real scores of another precision: a term of the integer indices promoted them (NumPy makes
        # float32 with int64 float64, where PyTorch and JAX keep float32), so a mod written for
        # PyTorch's flex runs unchanged; back in the scores' dtype, as PyTorch computes it.
        result = xp.astype(result, scores.dtype)
    return result if tuple(result.shape) == tile else xp.broadcast_to(result, tile)


def _four_dimensional(xp: Any, array: Any) -> Any:
    return array if array.ndim == 4 else xp.reshape(array, (1,) * (4 - array.ndim) + tuple(array.shape))


def flex_attention(
    query: Array,
    key: Array,
    value: Array,
    score_mod: ScoreMod | None = None,
    block_mask: BlockMask | None = None,
    *,
    scale: float | Array | None = None,
    enable_gqa: bool = False,
    return_weights: bool = False,
    dropout_p: float = 0.0,
    dropout_seed: int | Array | None = None,
    backend: str | None = None,
) -> Array:
    r"""Attention with programmable scores and masks:
    :math:`\mathrm{softmax}(\mathrm{score\_mod}(q k^T s)\ \mathrm{masked}) v`.

    Parameters
    ----------
    query : array, shape (B, H, n, d)
    key : array, shape (B, H_kv, m, d)
    value : array, shape (B, H_kv, m, d_v)
        One floating dtype; ``B`` of key and value may be 1 (broadcast).
    score_mod : callable ``(score, b, h, q_idx, kv_idx) -> score``, optional
        Changes the scaled scores (a bias, a cap) before the softmax.
    block_mask : BlockMask, optional
        From :func:`create_block_mask` for ``(B or None, H or None, n, m)``:
        its empty blocks are never computed, its partial blocks are masked
        by its ``mask_mod``.
    scale : float or 0-d array, optional
        Multiplies the scores; ``1 / sqrt(d)`` by default.
    enable_gqa : bool
        Grouped-query attention: the ``H`` query heads share the ``H_kv``
        key/value heads, query head ``h`` using ``h // (H // H_kv)``.
    return_weights : bool
        Also return the weights ``(B, H, n, m)`` (computed whole, without
        skipping; after dropout, where asked).
    dropout_p : float
        Drop each weight with this probability, scaling those kept by
        ``1 / (1 - dropout_p)``; 0 by default, which costs nothing.
    dropout_seed : int or 0-d integer array, optional
        Required with ``dropout_p > 0``: the mask is a hash of the seed and
        each weight's ``(b, h, q_idx, kv_idx)``, the same on every backend
        and device and as :func:`scaled_dot_product_attention`'s on
        ``(B, H, n, d)`` inputs.
    backend : str, optional
        Run on this backend; by default the one that owns the inputs.

    Returns
    -------
    output : array, shape (B, H, n, d_v)
    weights : array, shape (B, H, n, m)
        Only with ``return_weights=True``.

    Raises
    ------
    TypeError
        If an input is not an array of a registered backend, the inputs come
        from two backends, or ``backend=`` does not own them.
        If the inputs are not of one real floating dtype, ``score_mod`` is
        not callable, fails on a tile or returns scores that are not real
        floats (real ones of another precision, which NumPy's promotion of
        the integer indices makes, come back in the scores' dtype),
        ``block_mask`` is not a :class:`BlockMask` of the inputs' backend,
        a flag is not ``True`` or ``False``, or ``dropout_p`` or
        ``dropout_seed`` is of another type than a float and an int or 0-d
        integer array.
    ValueError
        If an input is not 4-dimensional, the sizes disagree (``d``, ``m``,
        ``H`` not a multiple of ``H_kv`` with ``enable_gqa``), ``block_mask``
        was made for other sizes or for ``B=None`` (``H=None``) with a
        ``mask_mod`` that reads ``b`` (``h``), a mod of :mod:`attnx.mods` was
        made for other sizes, ``scale`` is not finite, or ``dropout_p`` lies
        outside ``[0, 1]`` or comes without a ``dropout_seed``.
        If ``backend=`` names no registered backend, or the inputs lie on
        two different devices.
    BackendUnavailableError
        If the backend that would run the call cannot run here (its library is
        not installed, or it has no device).

    Notes
    -----
    A query with no key to attend (every key masked by ``block_mask``, or
    given ``-inf`` by ``score_mod``) gets zeros, as in PyTorch's.  Work runs
    tile by tile on the online softmax within the memory budget, so a
    sliding window of width ``w`` costs O(n * w * d).  The mods are called
    once on a small tile before any other work, so a mod that fails, or
    returns the wrong shape or dtype, is named in one error; the mods of
    :mod:`attnx.mods` made for another batch, other heads or fewer
    positions are refused (``alibi`` of 8 slopes for 4 heads), and so is a
    block mask made with ``B=None`` or ``H=None`` whose ``mask_mod`` reads
    ``b`` or ``h``.

    Examples
    --------
    >>> import numpy as np
    >>> import attnx
    >>> from attnx import mods
    >>> rng = np.random.default_rng(0)
    >>> q, k, v = (rng.standard_normal((1, 2, 256, 16), dtype=np.float32) for _ in range(3))
    >>> window = attnx.create_block_mask(mods.sliding_window(32), None, None, 256, 256, block_size=64)
    >>> out = attnx.flex_attention(q, k, v, mods.soft_cap(20.0), window)
    >>> out.shape
    (1, 2, 256, 16)

    The same call, checked against the dense softmax with the window as a mask:

    >>> scores = 20.0 * np.tanh(q @ k.swapaxes(-1, -2) / 4.0 / 20.0)
    >>> scores[..., ~attnx.masks.sliding_window(256, window=32)] = -np.inf
    >>> weights = np.exp(scores - scores.max(-1, keepdims=True))
    >>> bool(np.allclose(out, weights / weights.sum(-1, keepdims=True) @ v, atol=1e-5))
    True
    """
    chosen, reason, arguments, dropout = validated_call(
        _FLEX,
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
    if dropout is None:
        return _dispatch.call(_FLEX, chosen, reason, _flex_generic, arguments, {"backend": chosen})
    options = {"backend": chosen, "dropout": dropout}
    return _dispatch.call(_FLEX, chosen, reason, _flex_generic, arguments, options, generic_for="dropout")


def validated_call(
    operation: str,
    query: Any,
    key: Any,
    value: Any,
    score_mod: Any,
    block_mask: Any,
    scale: Any,
    enable_gqa: Any,
    return_weights: Any,
    dropout_p: Any,
    dropout_seed: Any,
    backend: str | None,
) -> tuple[Any, str, dict[str, Any], _dropout.Dropout | None]:
    """:func:`flex_attention`'s checks, all before any work: the backend,
    why, the generic algorithm's (and natives') keyword arguments, and the
    call's dropout (None without)."""
    if block_mask is not None and not isinstance(block_mask, BlockMask):
        raise TypeError(
            f"{operation}: block_mask must be a BlockMask from attnx.create_block_mask, got {type(block_mask).__name__}"
        )
    chosen, reason = _dispatch.resolve(
        operation,
        backend,
        ("query", "key", "value", "scale", "dropout_seed"),
        (query, key, value, _checks.scale_array(scale), _dropout.seed_array(dropout_seed)),
        3,
    )
    xp = chosen.xp
    if dropout_p or dropout_seed is not None:
        dropout_p = _dropout.require_dropout(operation, xp, dropout_p, dropout_seed, chosen.owns)
    if block_mask is not None and not chosen.owns(block_mask.kinds):
        raise TypeError(
            f"{operation}: block_mask was created on the {block_mask.backend!r} backend but the inputs are "
            f"{chosen.name!r} arrays; create it with attnx.create_block_mask(..., backend={chosen.name!r})"
        )
    _checks.require_flag(operation, "enable_gqa", enable_gqa)
    _checks.require_flag(operation, "return_weights", return_weights)
    if score_mod is not None and not callable(score_mod):
        raise TypeError(
            f"{operation}: score_mod must be a callable (score, b, h, q_idx, kv_idx) -> score, got {score_mod!r}"
        )
    batch, heads, n, m = _check_flex_inputs(operation, xp, query, key, value, enable_gqa)
    scale = _checks.require_scale(operation, xp, scale, query.shape[-1], query.dtype)
    if score_mod is not None:
        _require_table_sizes(operation, "score_mod", score_mod, batch, heads, n, m)
    if block_mask is not None:
        _check_block_mask(operation, block_mask, batch, heads, n, m)
        _require_table_sizes(operation, "block_mask's mask_mod", block_mask.mask_mod, batch, heads, n, m)
        if n and m:
            _require_broadcast_mod(operation, chosen, block_mask, batch, heads, n, m, _checks.device_of(query))
    if score_mod is not None and n and m:
        _probe_score_mod(operation, chosen, score_mod, batch, heads, n, m, query)
    arguments = {
        "query": query,
        "key": key,
        "value": value,
        "score_mod": score_mod,
        "block_mask": block_mask,
        "scale": scale,
        "enable_gqa": enable_gqa,
        "return_weights": return_weights,
    }
    return chosen, reason, arguments, _dropout.make(xp, dropout_p, dropout_seed, (batch, heads), query)


def _check_flex_inputs(
    operation: str, xp: Any, query: Any, key: Any, value: Any, enable_gqa: bool
) -> tuple[int, int, int, int]:
    """Check ``(B, H, n, d)`` inputs; returns ``B`` (broadcast), ``H``, ``n`` and ``m``."""
    for name, array, layout in (
        ("query", query, "(B, H, n, d)"),
        ("key", key, "(B, H_kv, m, d)"),
        ("value", value, "(B, H_kv, m, d_v)"),
    ):
        if array.ndim != 4:
            raise ValueError(f"{operation}: {name} must have shape {layout}, got shape {_checks.shape_of(array)}")
        _checks.require_float(operation, xp, name, array)
    _checks.require_same_dtype(operation, _checks.QKV, (query, key, value))
    _checks.require_known(operation, _FLEX, {"query": query, "key": key, "value": value})
    (batch, heads, n, d), (_, kv_heads, m, d_k) = query.shape, key.shape
    if d_k != d:
        raise ValueError(
            f"{operation}: key must have shape (B, H_kv, m, d) with d = {d} (from query), got {_checks.shape_of(key)}"
        )
    if tuple(value.shape[1:3]) != (kv_heads, m):
        raise ValueError(
            f"{operation}: value must have shape (B, H_kv, m, d_v) with H_kv = {kv_heads} and m = {m} (from key), got {_checks.shape_of(value)}"
        )
    if enable_gqa:
        _grouping.require_multiple(operation, heads, kv_heads)
    elif kv_heads != heads:
        raise ValueError(
            f"{operation}: key and value must have the query's H = {heads} heads, got H_kv = {kv_heads} "
            f"(pass enable_gqa=True for grouped-query attention)"
        )
    batch = _checks.broadcast(
        operation, {"query": (batch,), "key": (key.shape[0],), "value": (value.shape[0],)}, "batch sizes B"
    )[0]
    return batch, heads, n, m


def _check_block_mask(operation: str, block_mask: BlockMask, batch: int, heads: int, n: int, m: int) -> None:
    mask_batch, mask_heads, q_len, kv_len = block_mask.shape
    inputs = (batch, heads, n, m)
    if (q_len, kv_len) != (n, m) or mask_batch not in (None, 1, batch) or mask_heads not in (None, 1, heads):
        raise ValueError(
            f"{operation}: block_mask was created for (B, H, Q_LEN, KV_LEN) = {block_mask.shape}, "
            f"but the inputs have (B, H, n, m) = {inputs}; create it for these sizes"
        )


#: Per score_mod: the (batch, heads, dtype, device) it was probed for.  The
#: probe (the mod on a 2 x 2 tile, so that a broken mod fails before the
#: work) cost some 160 us a call on PyTorch's CPU tensors, and more in
#: launches on CUDA's.  Mods that refuse weak references are probed each call.
_probed_score_mods: weakref.WeakKeyDictionary[Any, set[tuple[Any, ...]]] = weakref.WeakKeyDictionary()


def _probe_score_mod(
    operation: str, chosen: Any, score_mod: ScoreMod, batch: int, heads: int, n: int, m: int, query: Any
) -> None:
    xp, device = chosen.xp, _checks.device_of(query)
    signature = (batch, heads, str(query.dtype), str(device))
    try:
        # While torch.compile traces, a store keyed by a mod made inside the
        # compiled function can't be replayed (dynamo can't rebuild the
        # closure): probed each trace instead, a tile the compiler drops.
        probed = set() if _tracing.compiling() else _probed_score_mods.setdefault(score_mod, set())
    except TypeError:  # not weakly referable: probed at every call
        probed = set()
    if signature in probed:
        return
    compute = _checks.accumulation_dtype(xp, query.dtype)
    probe = xp.zeros((batch, heads, min(n, 2), min(m, 2)), dtype=compute, device=device)
    call_score_mod(operation, chosen, score_mod, probe, (0, batch), (0, min(n, 2)), (0, min(m, 2)))
    probed.add(signature)


def _require_broadcast_mod(
    operation: str, chosen: Any, block_mask: BlockMask, batch: int, heads: int, n: int, m: int, device: Any
) -> None:
    """A block mask made with ``B=None`` (``H=None``) recorded its blocks for
    entry 0 alone: its ``mask_mod`` must not read ``b`` (``h``), or the other
    entries' blocks would be skipped or left unmasked.  Told apart by the
    shape of the mod's mask on a small tile of every entry and head."""
    mask_batch, mask_heads = block_mask.shape[:2]
    if (mask_batch is not None or batch == 1) and (mask_heads is not None or heads == 1):
        return
    if (batch, heads) in block_mask._broadcast_checked:
        return
    allowed = call_mask_mod(
        operation, chosen, block_mask.mask_mod, (0, batch), heads, (0, min(n, 2)), (0, min(m, 2)), device
    )
    for axis, (made_with, size, name, index) in enumerate(
        ((mask_batch, batch, "B", "b"), (mask_heads, heads, "H", "h"))
    ):
        if made_with is None and size > 1 and allowed.shape[axis] != 1:
            raise ValueError(
                f"{operation}: block_mask was created with {name}=None, for a mask that is the same for every "
                f"{'batch entry' if name == 'B' else 'head'}, but its mask_mod reads {index} (it gave one mask per "
                f"{'entry' if name == 'B' else 'head'}): create it with {name}={size}"
            )
    block_mask._broadcast_checked.add((batch, heads))


class FlexTiles(NamedTuple):
    """A flex attention call's tiled walk (:func:`flex_tiles`): its heads
    grouped ``(B, H_kv, G, ...)`` as ``query``, ``key`` and ``value``, the
    tiles and their scores, and :func:`attnx._tiling.attend_tiles`' other
    keywords in ``walk``; ``shape`` is the output's, ``(B, H, n, d_v)``."""

    query: Any
    key: Any
    value: Any
    tiles: _tiling.TilePlan
    tile_scores: _tiling.TileScores
    walk: dict[str, Any]
    shape: tuple[int, int, int, int]
    #: ``scores_for(score_mod)``: the tiles' scores with another score_mod
    #: (:func:`remade`), as ``tile_scores`` with the call's.
    scores_for: Callable[[ScoreMod | None], _tiling.TileScores]


def flex_tiles(
    xp: Any,
    *,
    query: Any,
    key: Any,
    value: Any,
    score_mod: ScoreMod | None,
    block_mask: BlockMask | None,
    backend: Any,
    dropout: _dropout.Dropout | None = None,
) -> FlexTiles | None:
    """The tiled walk of a validated call, the one plan of the forward and
    of its backward (:mod:`attnx._flex_vjp`); None where there is nothing to
    compute (an axis of size 0)."""
    batch_size, heads, n, d = query.shape
    kv_heads, m, d_v = key.shape[1], key.shape[2], value.shape[3]
    group = heads // kv_heads
    # Broadcast, not the largest: a batch of 0 against key/value's 1 is 0.
    batch = _checks.broadcast(_FLEX, {"query": (batch_size,), "key": key.shape[:1], "value": value.shape[:1]})[0]
    if 0 in (batch, heads, n, m):  # nothing to compute (a reduction over nothing is undefined: Dask's fails)
        return None
    device, dtype = _checks.device_of(query), query.dtype
    block_bytes = backend.block_bytes_on(device)
    grouped = (
        xp.reshape(query, (batch_size, kv_heads, group, n, d)),
        xp.reshape(key, (key.shape[0], kv_heads, 1, m, d)),
        xp.reshape(value, (value.shape[0], kv_heads, 1, m, d_v)),
    )
    batch_shape = (batch, kv_heads, group)
    dropout = None if dropout is None else dropout.regrouped(batch_shape)

    def scores_for(mod: ScoreMod | None) -> _tiling.TileScores:
        def tile_scores(scores: Any, span: Any, rows: Any, cols: Any, masked: bool) -> tuple[Any, Any, Any]:
            entries = span or (0, batch)
            if mod is not None:
                # The tile as the mod sees it, (B, H, rows, cols): the grouped
                # heads (H_kv, G) are one axis of H in memory.
                grouped_shape = tuple(scores.shape)
                flat = xp.reshape(scores, (grouped_shape[0], heads, *grouped_shape[3:]))
                scores = xp.reshape(call_score_mod(_FLEX, backend, mod, flat, entries, rows, cols), grouped_shape)
            allowed = None
            if masked and block_mask is not None:
                allowed = call_mask_mod(_FLEX, backend, block_mask.mask_mod, entries, heads, rows, cols, device)
                allowed = _grouped(xp, allowed, kv_heads, group)
            return scores, allowed, None

        return tile_scores

    if block_mask is None or block_mask._plan is None:
        chunks = choose_chunks(xp, dtype, n, m, batch_shape, None, False, False, backend.concurrent_blocks, block_bytes)
        query_chunk, key_chunk = chunks if chunks is not None else (n, m)
        masked = block_mask is not None  # kinds unknown (traced, lazy): every tile masked

        def tiles(span: Any, rows: Any) -> Any:
            return _tiling.split(0, m, key_chunk, masked)
    else:
        q_block, kv_block = block_mask.block_size
        block = _tiling.bytes_per_block(backend.concurrent_blocks, block_bytes)
        slice_bytes = _tiling.itemsize(xp, dtype) * math.prod(batch_shape)  # a score of every slice

        def step_keys(rows_per_step: int) -> int:
            # The keys a step visits (at most): runs no wider, so that the
            # batch groups are planned on the tiles' real size.
            width = block_mask._widest if rows_per_step == 1 else block_mask._joined_width(rows_per_step)
            return min(_tiling.KEY_CHUNK, width * kv_block)

        # Rows of blocks joined into one step while its scores fit one block:
        # a GPU's blocks (CuPy's 512 MiB) take a sliding window's 64 rows of
        # 128 queries in few steps, where each step costs some dozens of
        # kernel launches whatever its size.  On a CPU it joins the rows of
        # few heads (one head of 8192 queries: 0.73x the time), as many as
        # leave a step for every thread.
        rows_per_step, q_blocks = 1, len(block_mask._row_spans)
        while (
            -(-q_blocks // (rows_per_step * 2)) >= backend.concurrent_blocks
            and rows_per_step * 2 * q_block * step_keys(rows_per_step * 2) * slice_bytes <= block
        ):
            rows_per_step *= 2
        query_chunk = rows_per_step * q_block
        width = block // (_tiling.itemsize(xp, dtype) * query_chunk)
        key_chunk = max(kv_block, min(width, step_keys(rows_per_step)) // kv_block * kv_block)
        entries = (0, batch)

        def tiles(span: Any, rows: Any) -> Any:
            return block_mask.tiles(span or entries, rows, key_chunk)

    walk = {
        "batch_shape": batch_shape,
        "query_chunk": min(query_chunk, n),
        "key_chunk": key_chunk,
        "map_blocks": backend.map_blocks,
        "concurrent_blocks": backend.concurrent_blocks,
        "block_bytes": block_bytes,
        "dropout": dropout,
    }
    return FlexTiles(*grouped, tiles, scores_for(score_mod), walk, (batch, heads, n, d_v), scores_for)


def _flex_generic(
    xp: Any,
    *,
    query: Any,
    key: Any,
    value: Any,
    score_mod: ScoreMod | None,
    block_mask: BlockMask | None,
    scale: Any,
    enable_gqa: bool,
    return_weights: bool,
    backend: Any,
    dropout: _dropout.Dropout | None = None,
) -> Any:
    """The generic algorithm, array API only (inputs already validated): the
    heads grouped as ``(B, H_kv, G, n, d)`` so that G query heads share one
    key/value head without copies, walked by :func:`attnx._tiling.attend_tiles`."""
    plan = flex_tiles(
        xp,
        query=query,
        key=key,
        value=value,
        score_mod=score_mod,
        block_mask=block_mask,
        backend=backend,
        dropout=dropout,
    )
    if plan is None:
        shape = empty_shape(query, key, value)
        output = xp.zeros(shape, dtype=query.dtype, device=_checks.device_of(query))
        if not return_weights:
            return output
        weights = xp.zeros((*shape[:3], key.shape[2]), dtype=query.dtype, device=_checks.device_of(query))
        return output, weights
    if return_weights:
        return _flex_weights(xp, plan, scale)
    rule = None if score_mod is None else mod_backward(score_mod)
    if score_mod is None or rule is not None:
        # Differentiated tile by tile (the autograd libraries keep no tile),
        # attnx.mods' score_mods by their own backward, their tables (ALiBi's
        # slopes) inputs whose gradients it gives.  The Function computes
        # with the tables it is handed, the mod made again around them.
        output = _tiling.attend_differentiable(
            backend.custom_vjp,
            xp,
            plan.query,
            plan.key,
            plan.value,
            scale=scale,
            plan=lambda **tables: (plan.tiles, plan.scores_for(remade(score_mod, tables))),
            masks={},
            tables={} if rule is None else rule.tables,
            table_vjp=None
            if rule is None
            else lambda tables, parts: tile_score_vjp(
                xp, mod_backward(remade(score_mod, tables)).backward, plan, parts
            ),
            scores_may_mask=score_mod is not None,
            **plan.walk,
        )
    else:
        # A score_mod of the user's own stays on the library's tape, tile by
        # tile, whose gradients reach what it closes over.
        output = _tiling.attend_tiles(
            xp,
            plan.query,
            plan.key,
            plan.value,
            scale=scale,
            tiles=plan.tiles,
            tile_scores=plan.tile_scores,
            scores_may_mask=True,
            **plan.walk,
        )
    return xp.reshape(output, plan.shape)


def tile_score_vjp(xp: Any, backward: ModBackward, plan: FlexTiles, table_parts: list[dict[str, Any]]) -> Any:
    """The backward of the score_mod on a grouped tile ``(B, H_kv, G, rows,
    cols)``, called as the forward calls the mod: on the tile as ``(B, H,
    rows, cols)``, with the same index arrays.  Its tables' gradients go to
    ``table_parts``."""
    batch, heads = plan.shape[:2]
    device = _checks.device_of(plan.query)

    def score_vjp(d_scores: Any, raw: Any, span: Any, rows: Any, cols: Any) -> Any:
        grouped_shape = tuple(d_scores.shape)
        flat_shape = (grouped_shape[0], heads, *grouped_shape[3:])
        raw = xp.broadcast_to(raw, grouped_shape) if tuple(raw.shape) != grouped_shape else raw
        indices = index_arrays(xp, span or (0, batch), heads, rows, cols, device)
        d_raw, tables = backward(xp.reshape(d_scores, flat_shape), xp.reshape(raw, flat_shape), *indices)
        table_parts.append(tables)
        return xp.reshape(d_raw, grouped_shape)

    return score_vjp


def empty_shape(query: Any, key: Any, value: Any) -> tuple[int, int, int, int]:
    batch = _checks.broadcast(_FLEX, {"query": query.shape[:1], "key": key.shape[:1], "value": value.shape[:1]})[0]
    return (batch, query.shape[1], query.shape[2], value.shape[3])


def _flex_weights(xp: Any, plan: FlexTiles, scale: Any) -> tuple[Any, Any]:
    """The output and the whole weights ``(B, H, n, m)``, computed in one tile."""
    batch, heads, n, d_v = plan.shape
    m, dtype, dropout = plan.key.shape[-2], plan.query.dtype, plan.walk["dropout"]
    compute, (q, k, v) = _checks.in_accumulation_dtype(xp, plan.query, plan.key, plan.value)
    scores, allowed, _ = plan.tile_scores((q * scale) @ xp.matrix_transpose(k), None, (0, n), (0, m), True)
    weights = _masking.softmax(xp, scores, allowed, scores_may_mask=True)
    weights = weights if dropout is None else weights * dropout.tile(None, (0, n), (0, m))
    output = xp.reshape(weights @ v, (batch, heads, n, d_v))
    weights = xp.reshape(xp.broadcast_to(weights, (*plan.walk["batch_shape"], n, m)), (batch, heads, n, m))
    if compute != dtype:
        output, weights = xp.astype(output, dtype), xp.astype(weights, dtype)
    return output, weights


def _grouped(xp: Any, array: Any, kv_heads: int, group: int) -> Any:
    """A ``(b, h, rows, cols)`` array (``h`` 1 or ``H``) in the grouped layout
    ``(b, H_kv or 1, G or 1, rows, cols)``."""
    b, h, rows, cols = array.shape
    return xp.reshape(array, (b, kv_heads, group, rows, cols) if h != 1 else (b, 1, 1, rows, cols))
