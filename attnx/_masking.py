"""Mask rules and the masked softmax: the single home of both.

A mask says which keys each query may attend.  Boolean masks are ``True``
where attention is allowed; real-valued masks are added to the scores
(``-inf`` forbids).  Causal, padding (``key_lengths``) and window masks are
boolean.  All masks combine: a key is attended only where every mask allows
it.

A query row with no key left to attend gets all-zero weights, hence an
all-zero output: never NaN, never a uniform average (which is what filling
with a large negative number gives).
"""

from __future__ import annotations

from typing import Any, Literal

from array_api_compat import is_writeable_array

from attnx._checks import (
    accumulation_dtype,
    broadcasts_to,
    device_of,
    dtype_kind,
    dtype_label,
    dtype_name,
    index_dtype,
    shape_of,
    values_known,
)
from attnx._tracing import compiling

Align = Literal["bottom_right", "top_left"]


def check_align(operation: str, align: Any) -> None:
    if align not in ("bottom_right", "top_left"):
        raise ValueError(f"{operation}: align must be 'bottom_right' or 'top_left', got {align!r}")


def _offset(n: int, m: int, align: str) -> int:
    check_align("attnx.masks", align)
    return m - n if align == "bottom_right" else 0


Span = tuple[int, int]


def _positions(
    xp: Any, n: int, m: int, align: str, device: Any, rows: Span | None = None, cols: Span | None = None
) -> tuple[Any, Any]:
    """Query positions aligned to key positions, as (rows, 1) and (1, cols)
    grids; ``rows``/``cols`` select a block (a range of queries/keys)."""
    c0, c1 = cols or (0, m)
    key_positions = xp.arange(c0, c1, device=device)[None, :]
    return _query_positions(xp, n, m, align, device, rows)[:, None], key_positions


def _query_positions(xp: Any, n: int, m: int, align: str, device: Any, rows: Span | None = None) -> Any:
    """``(rows,)``: the queries' positions on the keys' axis."""
    r0, r1 = rows or (0, n)
    return xp.arange(r0, r1, device=device) + _offset(n, m, align)


def causal(
    xp: Any,
    n: int,
    m: int,
    *,
    align: str = "bottom_right",
    device: Any = None,
    rows: Span | None = None,
    cols: Span | None = None,
) -> Any:
    """Boolean ``(n, m)`` (or the block ``rows x cols``): query ``i`` attends
    key ``j`` where ``j <= i + offset``."""
    query_positions, key_positions = _positions(xp, n, m, align, device, rows, cols)
    return causal_rule(query_positions, key_positions)


def causal_rule(query_positions: Any, key_positions: Any) -> Any:
    """The causal rule on aligned positions: a query attends the keys at or
    before its own position.  Operators only, so that a ``mask_mod`` can call
    it on any library's index arrays (:mod:`attnx.mods`)."""
    return key_positions <= query_positions


def window_rule(query_positions: Any, key_positions: Any, left: int | None, right: int | None) -> Any:
    """The window rule on aligned positions: keys from ``left`` before to
    ``right`` after the query (None: unbounded; both None: every key)."""
    allowed = None
    if left is not None:
        allowed = key_positions >= query_positions - left
    if right is not None:
        upper = key_positions <= query_positions + right
        allowed = upper if allowed is None else allowed & upper
    return allowed


def window(
    xp: Any,
    n: int,
    m: int,
    left: int | None,
    right: int | None,
    *,
    align: str = "bottom_right",
    device: Any = None,
) -> Any:
    """Boolean ``(n, m)``: keys from ``left`` before to ``right`` after the query."""
    rows, cols = _positions(xp, n, m, align, device)
    allowed = window_rule(rows, cols, left, right)
    if allowed is None:
        allowed = xp.ones((n, m), dtype=xp.bool, device=device)
    return allowed


# -- checks ---------------------------------------------------------------


def check_mask(
    operation: str, xp: Any, mask: Any, batch_shape: tuple[int, ...], n: int, m: int, scores_dtype: Any
) -> None:
    kind = dtype_kind(xp, mask)
    if kind not in ("bool", "float"):
        raise TypeError(
            f"{operation}: mask must be boolean (True where attention is allowed) or real "
            f"floating (added to the scores), got dtype {dtype_name(mask)}"
        )
    target = (*batch_shape, n, m)
    if not broadcasts_to(operation, "mask", shape_of(mask), target):
        raise ValueError(
            f"{operation}: mask must broadcast to the scores' shape (..., n, m) = {target}, got shape {shape_of(mask)}"
        )
    # A real mask is added to the scores: +inf or NaN there makes its rows
    # NaN (inf - inf), which masking must never give.  Traced and lazy masks
    # are checked by their shape and dtype only, as key_lengths are.
    if kind == "float" and values_known(mask) and bool(xp.any(~(mask < float("inf")))):
        found = "NaN" if bool(xp.any(xp.isnan(mask))) else "+inf"
        raise ValueError(
            f"{operation}: a real mask is added to the scores and must hold finite values or -inf "
            f"(forbidden), got {found}"
        )
    compute = accumulation_dtype(xp, scores_dtype)
    if kind == "float" and mask.dtype != compute and values_known(mask) and mask.ndim and 0 not in shape_of(mask):
        # A float64 mask for float32 scores: its large values become +inf there.
        largest = float(xp.max(mask))
        if largest > float(xp.finfo(compute).max):
            raise ValueError(
                f"{operation}: a real mask is added to the scores and must hold finite values or -inf "
                f"(forbidden) in {dtype_label(compute)}, the dtype the scores are computed in, got {largest!r}"
            )


def lengths_layout(shape: tuple[int, ...], batch_shape: tuple[int, ...], n: int) -> str | None:
    if len(shape) == 1 and len(batch_shape) > 1 and shape[0] == batch_shape[0]:
        return "batch_first"
    # Lengths broadcast *to* the batch: a size where the batch has 1 would grow it.
    if len(shape) == len(batch_shape) + 1 and shape[-1] in (n, 1) and broadcasts_to("", "", shape[:-1], batch_shape):
        return "per_query"
    if len(shape) <= len(batch_shape) and broadcasts_to("", "", shape, batch_shape):
        return "per_sequence"
    return None


def check_lengths(operation: str, xp: Any, key_lengths: Any, batch_shape: tuple[int, ...], n: int, m: int) -> None:
    if dtype_kind(xp, key_lengths) != "int":
        raise TypeError(f"{operation}: key_lengths must have an integer dtype, got {dtype_name(key_lengths)}")
    shape = shape_of(key_lengths)
    if lengths_layout(shape, batch_shape, n) is None:
        first = f"({batch_shape[0]},), " if batch_shape else ""
        raise ValueError(
            f"{operation}: key_lengths must have shape {first}the leading shape {batch_shape} "
            f"(broadcastable) or {(*batch_shape, n)} (one per query), got {shape}"
        )
    # Reading values would break a trace or compute a lazy graph: traced and
    # lazy lengths are checked by their shape and dtype only.
    if values_known(key_lengths) and (xp.any(key_lengths < 0) or xp.any(key_lengths > m)):
        low, high = int(xp.min(key_lengths)), int(xp.max(key_lengths))
        raise ValueError(
            f"{operation}: key_lengths must lie in [0, m] with m = {m} keys, got values from {low} to {high}"
        )


def check_masks(
    operation: str,
    xp: Any,
    mask: Any,
    key_lengths: Any,
    batch_shape: tuple[int, ...],
    n: int,
    m: int,
    *,
    scores_dtype: Any,
    mask_batch_shape: tuple[int, ...] | None = None,
) -> None:
    """Check ``mask`` (against ``mask_batch_shape``, default ``batch_shape``)
    and ``key_lengths`` for scores of shape ``(*batch_shape, n, m)`` of
    inputs of ``scores_dtype``."""
    if mask is not None:
        mask_shape = batch_shape if mask_batch_shape is None else mask_batch_shape
        check_mask(operation, xp, mask, mask_shape, n, m, scores_dtype)
    if key_lengths is not None:
        check_lengths(operation, xp, key_lengths, batch_shape, n, m)


# -- building -------------------------------------------------------------


def lengths_mask(
    xp: Any,
    key_lengths: Any,
    batch_shape: tuple[int, ...],
    n: int,
    m: int,
    rows: Span | None = None,
    cols: Span | None = None,
    positions: Any = None,
) -> Any:
    """Boolean mask broadcastable to ``(*batch_shape, n, m)`` (or to the block
    ``rows x cols``): keys ``j < length``.  ``positions``: the keys' ``j``,
    made by the caller (``arange`` of the columns by default)."""
    lengths = aligned_lengths(xp, key_lengths, batch_shape, n, rows)
    if positions is None:
        c0, c1 = cols or (0, m)
        positions = xp.arange(c0, c1, device=device_of(key_lengths), dtype=key_lengths.dtype)
    return positions < lengths


def key_counts(
    xp: Any, key_lengths: Any, is_causal: bool, batch_shape: tuple[int, ...], n: int, m: int, device: Any = None
) -> Any:
    """How many keys each query attends under the causal rule and
    ``key_lengths``, both of which keep a prefix of a row's keys: integers
    of the namespace's index dtype (:func:`attnx._checks.index_dtype`),
    broadcastable to ``(*batch_shape, n)``, at most ``m`` (lengths lie in
    ``[0, m]``) and below 0 where a causal query has no key; None where the
    call has neither rule."""
    counts = None
    if key_lengths is not None:
        device = device if device is not None else device_of(key_lengths)
        counts = xp.astype(aligned_lengths(xp, key_lengths, batch_shape, n)[..., 0], index_dtype(xp))
    if is_causal:  # the keys at or before the query's position (causal_rule)
        before = xp.astype(_query_positions(xp, n, m, "bottom_right", device), index_dtype(xp)) + 1
        counts = before if counts is None else xp.minimum(counts, before)
    return counts


#: ``causal_align``: the causal rule aligned to the end of all ``m`` keys, or
#: to the end of each sequence's own ``key_lengths`` (decoding a batch of
#: caches of different lengths).
CAUSAL_ALIGNS = ("bottom_right", "key_lengths")


def check_causal_align(operation: str, causal_align: Any, is_causal: bool, key_lengths: Any) -> None:
    if causal_align == "bottom_right":
        return
    if causal_align not in CAUSAL_ALIGNS:
        raise ValueError(
            f"{operation}: causal_align must be one of {', '.join(map(repr, CAUSAL_ALIGNS))}, got {causal_align!r}"
        )
    if is_causal is not True:
        raise ValueError(f"{operation}: causal_align={causal_align!r} aligns the causal rule: pass is_causal=True too")
    if key_lengths is None:
        raise ValueError(
            f"{operation}: causal_align={causal_align!r} aligns each query to the end of its own keys: give key_lengths"
        )


def causal_by_lengths(xp: Any, key_lengths: Any, batch_shape: tuple[int, ...], n: int) -> Any:
    """The causal rule aligned to the end of each sequence's own keys
    (``causal_align="key_lengths"``), with their padding, as one length per
    query: the query in row ``i`` of ``n``, with ``L`` keys, attends the keys
    ``j <= i + L - n``, a prefix (the last query all ``L``; none where ``i +
    L < n``).  In ``key_lengths``' per-query layout ``(*batch_shape, n)``
    (broadcastable), so that every backend computes it as padding."""
    lengths = xp.astype(aligned_lengths(xp, key_lengths, batch_shape, n)[..., 0], index_dtype(xp))
    counts = lengths + xp.arange(1 - n, 1, dtype=lengths.dtype, device=device_of(lengths))
    counts = xp.where(counts < 0, xp.zeros_like(counts), counts)
    return xp.reshape(counts, (1,) * (len(batch_shape) + 1 - counts.ndim) + tuple(counts.shape))


def aligned_lengths(xp: Any, key_lengths: Any, batch_shape: tuple[int, ...], n: int, rows: Span | None = None) -> Any:
    """``key_lengths``, in any layout attnx accepts, broadcastable to
    ``(*batch_shape, n, 1)`` (or to the block of queries ``rows``): the
    length that each query's keys are cut to."""
    layout = lengths_layout(shape_of(key_lengths), batch_shape, n)
    if layout == "batch_first":
        key_lengths = xp.reshape(key_lengths, (key_lengths.shape[0],) + (1,) * (len(batch_shape) - 1))
    if layout == "per_query":
        if rows is not None and key_lengths.shape[-1] != 1:
            key_lengths = key_lengths[..., rows[0] : rows[1]]
        return key_lengths[..., None]
    return key_lengths[..., None, None]


def batch_block(array: Any, batch_ndim: int, core_ndim: int, batch: Span) -> Any:
    """The entries ``batch`` of the first batch axis of an array whose
    trailing ``core_ndim`` axes follow ``batch_ndim`` batch axes, aligned to
    the right as broadcasting aligns them (an array without that axis, or
    with size 1 there, broadcasts: it comes back whole)."""
    axis = array.ndim - core_ndim - batch_ndim
    if axis < 0 or array.shape[axis] == 1:
        return array
    return array[(slice(None),) * axis + (slice(*batch), ...)]


def lengths_batch_block(key_lengths: Any, batch_shape: tuple[int, ...], n: int, batch: Span) -> Any:
    """``key_lengths`` for the entries ``batch`` of the first batch axis."""
    layout = lengths_layout(shape_of(key_lengths), batch_shape, n)
    if layout == "batch_first":
        return key_lengths[batch[0] : batch[1]]
    return batch_block(key_lengths, len(batch_shape), 1 if layout == "per_query" else 0, batch)


def block(mask: Any, rows: Span | None, cols: Span | None) -> Any:
    """The ``rows x cols`` block of a mask broadcastable to ``(..., n, m)``
    (a mask without the axis, or with size 1 there, broadcasts whole)."""
    if rows is not None and mask.ndim >= 2 and mask.shape[-2] != 1:
        mask = mask[..., rows[0] : rows[1], :]
    if cols is not None and mask.ndim >= 1 and mask.shape[-1] != 1:
        mask = mask[..., cols[0] : cols[1]]
    return mask


def combine(
    xp: Any,
    *,
    mask: Any,
    key_lengths: Any,
    is_causal: bool,
    batch_shape: tuple[int, ...],
    n: int,
    m: int,
    dtype: Any,
    device: Any,
    rows: Span | None = None,
    cols: Span | None = None,
) -> tuple[Any, Any]:
    """All masks as ``(allowed, additive)``: a boolean and a real array (each
    None when absent), both broadcastable to ``(*batch_shape, n, m)``, or to
    the block of queries ``rows`` and keys ``cols`` when given."""
    allowed = additive = None
    if is_causal:
        allowed = causal(xp, n, m, device=device, rows=rows, cols=cols)
    if key_lengths is not None:
        padding = lengths_mask(xp, key_lengths, batch_shape, n, m, rows, cols)
        allowed = padding if allowed is None else allowed & padding
    if mask is not None:
        return with_mask(xp, allowed, additive, block(mask, rows, cols), dtype)
    return allowed, additive


def with_mask(xp: Any, allowed: Any, additive: Any, mask: Any, dtype: Any) -> tuple[Any, Any]:
    """``(allowed, additive)`` with ``mask`` (boolean or real, or None) folded in."""
    if mask is None:
        return allowed, additive
    if mask.dtype == xp.bool:
        return (mask if allowed is None else allowed & mask), additive
    mask = xp.astype(mask, dtype) if mask.dtype != dtype else mask
    return allowed, (mask if additive is None else additive + mask)


def allow_extra_keys(xp: Any, mask: Any, m: int, count: int) -> Any:
    """``mask`` (boolean or additive, broadcastable to ``(..., n, m)``) with
    ``count`` always-attended keys appended: ``(..., n, m + count)``.  The
    extra keys (multi-head attention's ``bias_k`` and zero attention) are
    beyond every mask, as in ``torch.nn.MultiheadAttention``."""
    if mask is None or count == 0:
        return mask
    if mask.shape[-1] != m:  # one column for every key: spelled out before more are appended
        mask = xp.broadcast_to(mask, (*mask.shape[:-1], m))
    shape = (*mask.shape[:-1], count)
    device = device_of(mask)
    if mask.dtype == xp.bool:
        extra = xp.ones(shape, dtype=xp.bool, device=device)
    else:
        extra = xp.zeros(shape, dtype=mask.dtype, device=device)
    return xp.concat([mask, extra], axis=-1)


def as_additive(xp: Any, allowed: Any, additive: Any, dtype: Any) -> Any:
    """One real mask equivalent to ``(allowed, additive)`` (for native kernels)."""
    if allowed is None:
        return additive
    base = additive if additive is not None else xp.zeros((), dtype=dtype, device=device_of(allowed))
    return xp.where(allowed, base, xp.asarray(-float("inf"), dtype=dtype, device=device_of(allowed)))


_WRITEABLE: dict[type, bool] = {}


def can_mutate(array: Any) -> bool:
    """In-place updates are safe on this intermediate: its library allows them
    and it records no gradient (autograd needs the values it saw).

    An array that says so itself (NumPy's ``flags.writeable``: broadcast
    views are read-only) is asked each time; for the others the answer is
    their library's, asked once per array type and kept in a plain dict.
    Under ``torch.compile`` the answer is no: the compiled graph is
    functional, so out of place costs nothing there, and asking would have
    Dynamo read the array's value (which fails where it depends on a
    tensor that a ``torch.autograd.Function``'s forward closes over) or
    trace the ``lru_cache`` inside array-api-compat's answer."""
    if getattr(array, "requires_grad", False):
        return False
    own = getattr(getattr(array, "flags", None), "writeable", None)
    if own is not None:
        return own
    if compiling():
        return False
    kind = type(array)
    writeable = _WRITEABLE.get(kind)
    if writeable is None:
        writeable = _WRITEABLE[kind] = is_writeable_array(array)
    return writeable


def unnormalised_softmax(
    xp: Any,
    scores: Any,
    allowed: Any = None,
    additive: Any = None,
    running_max: Any = None,
    owned: bool = True,
    scores_may_mask: bool = False,
) -> tuple[Any, Any]:
    """``(exp(scores - shift), max)`` over the last axis, with masks applied.

    ``scores`` is an intermediate the caller owns and may be overwritten,
    unless ``owned=False`` (the user's own array, or a view of it).
    ``max`` is the row maximum (combined with ``running_max``, the online
    softmax's maximum so far), ``-inf`` on a row with nothing allowed;
    ``shift`` is that maximum with ``-inf`` replaced by 0 (see
    :func:`finite_shift`), so such a row's exponentials are zeros, not NaN.
    Masked entries give exactly 0.  ``scores_may_mask``: the scores may
    hold ``-inf`` themselves (a user's scores, a ``score_mod``'s), which
    masks as an additive mask's ``-inf`` does; scores of a product of
    finite arrays never do, and skip the check.
    """
    mutable = owned and can_mutate(scores)
    if additive is not None:
        if mutable and additive.dtype == scores.dtype:
            scores += additive
        else:
            scores = scores + additive
    if allowed is not None:
        scores = xp.where(allowed, scores, -float("inf"))
    row_max = xp.max(scores, axis=-1, keepdims=True)
    if running_max is not None:
        row_max = xp.maximum(running_max, row_max)
    masked = allowed is not None or additive is not None or running_max is not None or scores_may_mask
    shift = finite_shift(xp, row_max) if masked else row_max
    if mutable:
        scores -= shift
        return xp.exp(scores), row_max
    return xp.exp(scores - shift), row_max


def finite_shift(xp: Any, row_max: Any) -> Any:
    """The softmax shift: the row maximum, or 0 where it is ``-inf``."""
    return xp.where(row_max == -float("inf"), 0.0, row_max)


def nonzero_total(xp: Any, total: Any) -> Any:
    """Row totals to divide by: 1 where a row sums to 0 (nothing allowed, so
    all its terms are 0), so the division gives zeros, never NaN."""
    return xp.where(total == 0.0, 1.0, total)


def safe_total(xp: Any, exp_scores: Any, masked: bool = True) -> Any:
    """Row sums of the exponentials, through :func:`nonzero_total`.  Without
    masks every row holds an exp(0) = 1, so no row sums to 0."""
    total = xp.sum(exp_scores, axis=-1, keepdims=True)
    return nonzero_total(xp, total) if masked else total


def softmax(
    xp: Any, scores: Any, allowed: Any = None, additive: Any = None, owned: bool = True, scores_may_mask: bool = False
) -> Any:
    """Stable softmax over the last axis with masks; fully masked rows give
    zeros.  ``scores`` may be overwritten unless ``owned=False``;
    ``scores_may_mask`` as in :func:`unnormalised_softmax`."""
    if 0 in tuple(scores.shape):  # nothing to normalise (a maximum of nothing is undefined; Dask won't take one)
        return scores
    exp_scores, _ = unnormalised_softmax(xp, scores, allowed, additive, owned=owned, scores_may_mask=scores_may_mask)
    total = safe_total(xp, exp_scores, allowed is not None or additive is not None or scores_may_mask)
    if can_mutate(exp_scores):
        exp_scores /= total
        return exp_scores
    return exp_scores / total
