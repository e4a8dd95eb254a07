"""What a backend's native implementations may use of attnx's own rules.

A native (:meth:`attnx.Backend.implementations`) computes the function of
attnx's generic algorithm its own way; the rules that say *what* it
computes and *how big* its blocks may be stay attnx's, so that every
backend keeps to the same ones.  The built-in backends use these and
nothing private, as a backend in another package would.

- :func:`combined_mask`: a call's ``mask``, ``key_lengths`` and
  ``is_causal`` as the one mask that a fused kernel takes (PyTorch's
  ``attn_mask``), or any block of it.
- :func:`aligned_lengths`: a call's ``key_lengths``, in whichever layout
  the user gave them, aligned to the scores' axes.
- :func:`key_counts`: the causal rule and ``key_lengths`` as one number
  per query, the keys it attends (both keep a prefix of a row's keys), for
  a kernel that stops each row there rather than reading a mask.
- :func:`key_groups`: grouped-query heads (``enable_gqa``) as attnx lays
  them out, keys broadcast over each group's query heads, for a native
  that reads one key slice for a group rather than copying it per head.
- :func:`planned_chunks`: attnx's plan of blocks for a call, under the
  memory budget in force (a native with a plan of its own, see
  :meth:`attnx.Backend.specialize`, asks it at each call).
- :data:`KEY_CHUNK` and :data:`MIN_ROWS`: the block sizes attnx plans within.

Examples
--------
>>> import array_api_compat.numpy as xp
>>> from attnx import natives
>>> natives.combined_mask(
...     xp, mask=None, key_lengths=xp.asarray([2]), is_causal=True,
...     batch_shape=(1,), n=3, m=3,
... ).astype(int)
array([[[1, 0, 0],
        [1, 1, 0],
        [1, 1, 0]]])
"""

from __future__ import annotations

from typing import Any

from attnx import _grouping, _masking
from attnx._tiling import KEY_CHUNK, MIN_ROWS
from attnx.attention import choose_chunks
from attnx.backend import Backend

__all__ = ["KEY_CHUNK", "MIN_ROWS", "aligned_lengths", "combined_mask", "key_counts", "key_groups", "planned_chunks"]


def combined_mask(
    xp: Any,
    *,
    mask: Any,
    key_lengths: Any,
    is_causal: bool,
    batch_shape: tuple[int, ...],
    n: int,
    m: int,
    dtype: Any = None,
    device: Any = None,
    rows: tuple[int, int] | None = None,
    cols: tuple[int, int] | None = None,
) -> Any:
    """A call's masks as one array, broadcastable to ``(*batch_shape, n, m)``,
    or None where the call has none.

    Boolean (True where a query may attend a key) where every mask is;
    else real, of ``dtype``, to be added to the scores: ``-inf`` where a
    boolean rule forbids a key, the sum of the additive masks elsewhere.
    ``rows`` and ``cols`` (``(start, stop)``) give the block of queries and
    keys that a native computes at a time instead.

    Parameters
    ----------
    xp : namespace
        The array API namespace of the call's arrays.
    mask, key_lengths, is_causal, batch_shape
        As a native receives them (validated: see
        :func:`attnx.scaled_dot_product_attention`).
    n, m : int
        Queries and keys.
    dtype : dtype, optional
        The scores' dtype, for a real mask (default: the real ``mask``'s).
    device : device, optional
        Where to build what the call's arrays don't hold (the causal rule).
    rows, cols : (int, int), optional
        A block of queries and of keys.

    Notes
    -----
    A row whose keys are all forbidden is one that attnx's algorithm
    answers with zeros; a fused kernel may answer NaN or the mean of the
    values there, so a native must treat such rows itself (or decline).
    """
    if dtype is None and mask is not None:
        dtype = mask.dtype
    allowed, additive = _masking.combine(
        xp,
        mask=mask,
        key_lengths=key_lengths,
        is_causal=is_causal,
        batch_shape=batch_shape,
        n=n,
        m=m,
        dtype=dtype,
        device=device,
        rows=rows,
        cols=cols,
    )
    if additive is None:
        return allowed
    return _masking.as_additive(xp, allowed, additive, dtype)


def aligned_lengths(
    xp: Any, key_lengths: Any, batch_shape: tuple[int, ...], n: int, *, rows: tuple[int, int] | None = None
) -> Any:
    """A call's ``key_lengths`` broadcastable to ``(*batch_shape, n, 1)``:
    the query in row ``i`` attends the keys ``j < lengths[..., i, 0]``.

    Whichever layout the user gave (one length per sequence, ``(B,)``; the
    leading shape, broadcastable; one per query, ``(..., n)``), a native
    that cuts keys by length, or builds its own mask from them, reads them
    here; ``rows`` (``(start, stop)``) gives a block of queries instead.

    Examples
    --------
    >>> import array_api_compat.numpy as xp
    >>> from attnx import natives
    >>> natives.aligned_lengths(xp, xp.asarray([2, 3]), (2, 4), 5).shape
    (2, 1, 1, 1)
    """
    return _masking.aligned_lengths(xp, key_lengths, batch_shape, n, rows)


def key_counts(
    xp: Any,
    key_lengths: Any,
    is_causal: bool,
    batch_shape: tuple[int, ...],
    n: int,
    m: int,
    *,
    device: Any = None,
) -> Any:
    """How many keys each query attends under the causal rule and
    ``key_lengths``: query ``i`` attends the keys ``j < counts[..., i]``.

    Integers of the namespace's index dtype (int64; int32 on JAX without
    x64), broadcastable to ``(*batch_shape, n)``; at most ``m`` (attnx's
    checks keep lengths within ``[0, m]``), and below 0 where a causal query
    (``n > m``) has no key at all; None where the call has neither rule.  A
    ``mask`` is not counted: it need not keep a prefix.

    Examples
    --------
    >>> import array_api_compat.numpy as xp
    >>> from attnx import natives
    >>> natives.key_counts(xp, xp.asarray([2, 4]), True, (2,), 3, 4)
    array([[2, 2, 2],
           [2, 3, 4]])
    """
    return _masking.key_counts(xp, key_lengths, is_causal, batch_shape, n, m, device)


def key_groups(query_shape: tuple[int, ...], key_shape: tuple[int, ...], value_shape: tuple[int, ...]) -> int:
    """``G`` where keys and values broadcast over the last leading axis of
    the queries alone, else 1.

    That is how :func:`attnx.scaled_dot_product_attention` lays out
    grouped-query heads (``enable_gqa=True``, where they do not fold into
    rows): queries ``(..., H_kv, G, n, d_k)`` against keys ``(..., H_kv, 1,
    m, d_k)`` and values ``(..., H_kv, 1, m, d_v)``, query slice ``s``
    reading key/value slice ``s // G``.  A native that reads that slice for
    each of its group's queries copies no key (broadcasting the keys to
    every query head would copy them ``G`` times).

    Examples
    --------
    >>> from attnx import natives
    >>> natives.key_groups((2, 8, 4, 5, 64), (2, 8, 1, 9, 64), (2, 8, 1, 9, 32))
    4
    >>> natives.key_groups((2, 8, 5, 64), (2, 8, 9, 64), (2, 8, 9, 32))
    1
    """
    return _grouping.key_groups(query_shape, key_shape, value_shape)


def planned_chunks(
    backend: Backend,
    dtype: Any,
    n: int,
    m: int,
    batch_shape: tuple[int, ...],
    *,
    is_causal: bool = False,
    device: Any = None,
) -> tuple[int, int] | None:
    """``(query_chunk, key_chunk)``: the blocks of one (batch, head) slice
    that attnx plans for a call of these sizes on ``backend``, or None where
    its scores fit the memory budget in force and ``backend``'s blocks
    would not share them among its :attr:`~attnx.Backend.concurrent_blocks`.
    ``device``: the arrays' (:meth:`~attnx.Backend.block_bytes_on`).

    The ``chunks`` a native receives when the user gave no ``chunk_size``;
    a plan (:meth:`attnx.Backend.specialize`) asks again at each call,
    since the memory budget may change between them.
    """
    return choose_chunks(
        backend.xp,
        dtype,
        n,
        m,
        batch_shape,
        None,
        False,
        is_causal,
        backend.concurrent_blocks,
        backend.block_bytes_on(device),
    )
