"""The NumPy backend's native scaled dot-product attention, in plain NumPy.

The generic algorithm (array API only) is the reference every backend is
held to; this one computes the same function faster where NumPy allows
what the standard does not: exponentials and shifts in place, tiles of
scores held keys by queries where BLAS computes them faster so
(:func:`keys_first`), transposed views handed straight to BLAS, outputs
written into one preallocated array, and blocks of several (batch, head)
slices run on threads that each hold BLAS to one core.

The work is cut into tasks of ``slices`` (batch, head) pairs by ``rows``
queries (a causal call of one task a thread: spans of rows of equal work,
:func:`causal_spans`); each task walks the keys in blocks of ``key_chunk``
with the online softmax (a running maximum and sum), so its scores never
exceed one block.

Softmax does not change when a row is shifted by any constant; the shift
(each row's running maximum) is there only to keep the exponentials and
their sums finite and normal.  So every task first takes the exponentials
of its scores as they are: no pass for the maximum, none to subtract it,
no rescaling from one key block to the next, and on the causal diagonal the
exponentials are masked by a product.  The rows' sums of weights and the
outputs then tell whether that was exact (:func:`_exact_unshifted`): every
sum finite and no smaller than the square root of the smallest normal
number, so that what underflows weighs nothing beside the row's largest
weight; every output finite, so that nothing overflowed (an exponential
that overflowed makes its row's sum inf or NaN; a product with the values
that overflowed makes its output so).  The tasks where it was not run
again, shifted by the rows' running maxima.  The checks run after the
tasks, on the calling thread: short NumPy calls inside a task hand the GIL
to the other threads and wait to have it back, and cost more than their
work (four such checks a task took 63 us of a (1, 8, 128, 64) call's
492 us; the fourteenth session's figures in docs/archive/bench-sessions.md say why).

Masks (``mask``, ``key_lengths``) are laid out by slice once per call
(:mod:`.numpy_masks`) and applied as the causal band is: a product with the
exponentials (a real mask is added to the scores first).  A row with no key
left has a sum of 0, which fails the test above: where the masks show that
it has no key (not that its exponentials all underflowed), it gets its
zeros, as attnx's algorithm does, without a second run.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Mapping
from typing import Any

import array_api_compat.numpy as xp
import numpy as np

from attnx import get_memory_budget, natives

# The same thresholds as the generic algorithm's (measured there): blocks
# of at least MIN_ROWS query rows, at most KEY_CHUNK keys.
from attnx.natives import KEY_CHUNK, MIN_ROWS

from .numpy_masks import BlockMasks, CallMasks

#: Query rows per task at most: more rows per task means fewer tasks to share
#: among threads, and for causal masks more work spent above the diagonal.
MAX_ROWS = 256
#: Scores below which threads cost more than they save (a single task).
PARALLEL_SCORES = 2**16
#: Slices times ``d_k`` per causal task from which its rows are attended in
#: blocks of MIN_ROWS, each to the keys up to its own diagonal: less work,
#: in smaller products whose per-call costs narrow tasks don't amortise.  On
#: two threads, against no split: 0.93x the time at (1, 8, 512, 64) (8
#: slices a task of d_k 64).  Calls of one task a thread take
#: :func:`causal_spans` instead: at (1, 8, 128, 64) and (1, 4, 128, 128)
#: this split took 0.93x and 0.94x of no split, spans 0.84-0.91x and 0.87x
#: of this split (docs/archive/bench-sessions.md, twenty-fourth session).
SPLIT_WIDTH = 256
#: Scores from which each thread gets two tasks or more.
BALANCED_SCORES = 2**20


def plan(
    slices: int, n: int, m: int, itemsize: int, is_causal: bool, threads: int, budget: int
) -> tuple[int, int, int]:
    """``(slices_per_task, rows, key_chunk)``: the blocks of one call.

    Threads share the memory budget: each task's scores, ``slices_per_task
    * rows * key_chunk``, stay within ``budget / threads`` bytes, shrinking
    keys first (down to 512) and rows after (down to :data:`MIN_ROWS`).
    attnx's own chunk plan is not used: it is made for the generic
    algorithm, which cannot spread slices over threads as this one does.
    """
    per_thread = max(1, budget // threads)
    rows, key_chunk = min(n, MAX_ROWS), min(m, KEY_CHUNK)
    if is_causal:  # thinner blocks skip more of the future
        rows = min(rows, max(2 * MIN_ROWS, n // 8))
    while rows * key_chunk * itemsize > per_thread and key_chunk > 512:
        key_chunk = -(-key_chunk // 2)
    while rows * key_chunk * itemsize > per_thread and rows > MIN_ROWS:
        rows = -(-rows // 2)
    per_task = min(max(1, per_thread // (rows * key_chunk * itemsize)), slices)
    if threads > 1 and slices * n * m >= PARALLEL_SCORES:
        # A task per thread; from BALANCED_SCORES two, so that threads
        # finishing early find more (each task costs some 20 us to hand over).
        tasks = threads if slices * n * m < BALANCED_SCORES else 2 * threads
        per_task = max(1, min(per_task, slices * -(-n // rows) // tasks))
    return per_task, rows, key_chunk


@functools.lru_cache(maxsize=64)
def causal_spans(n: int, m: int, count: int) -> tuple[tuple[int, int], ...] | None:
    """``count`` spans of causal query rows, ``((r0, r1), ...)`` from the
    last rows to the first, that take about the same work; None where the
    narrowest would have fewer than ``MIN_ROWS // 2`` rows.

    The rows ``r0:r1`` attend the keys up to the last one's diagonal,
    ``r1 + m - n``: ``(r1 - r0) * (r1 + m - n)`` scores, a rectangle over
    the triangle the mask leaves.  Spans of equal work are short where the
    keys are many (n = m = 128 on two threads: rows 79-128 and 0-79, 76% of
    the full square's scores), and each is one block of every slice: the
    NumPy calls of a task of the full square, half those of tasks attended
    in blocks of MIN_ROWS rows (``SPLIT_WIDTH``)."""
    offset = m - n

    def ends(work: float) -> list[int]:
        # Top down, each span as tall as ``work`` allows: r1 solves
        # (r1 - r0) * (r1 + offset) = work.
        bounds = [0]
        while bounds[-1] < n and len(bounds) <= count:
            r0 = bounds[-1]
            r1 = (r0 - offset + math.sqrt((r0 + offset) ** 2 + 4 * work)) / 2
            bounds.append(min(n, max(r0 + 1, round(r1))))
        return bounds

    # Bisect for the least work per span with which ``count`` spans cover the rows.
    low, high = 0.0, float(n * m)
    for _ in range(48):
        middle = (low + high) / 2
        low, high = (low, middle) if ends(middle)[-1] == n else (middle, high)
    bounds = ends(high)
    spans = tuple(zip(bounds, bounds[1:]))
    if len(spans) != count or min(r1 - r0 for r0, r1 in spans) < MIN_ROWS // 2:
        return None
    return spans[::-1]


def scaled_dot_product_attention(
    *,
    query: Any,
    key: Any,
    value: Any,
    mask: Any,
    key_lengths: Any,
    is_causal: bool,
    scale: Any,
    return_weights: bool,
    chunks: tuple[int, int] | None,
    batch_shape: tuple[int, ...],
    chunk_size: Any,
    backend: Any,
) -> Any:
    """attnx's native entry point (see :meth:`attnx.Backend.implementations`);
    ``backend`` (bound by it) runs the tasks on its threads.  A ``chunk_size``
    the user gave sets the rows and keys of each task (``chunks``).  Calls
    with no query, key or slice it declines (:func:`_slices_taken`)."""
    slices = _slices_taken(query, key, is_causal, return_weights, batch_shape)
    if slices is None:
        return NotImplemented
    n, m = query.shape[-2], key.shape[-2]
    dtype = query.dtype
    # A Python float keeps the inputs' dtype (NEP 50); a 0-d array is cast to it.
    scale = scale if type(scale) is float else dtype.type(scale)
    masked = mask is not None or key_lengths is not None
    if chunks is None and slices * n * m < PARALLEL_SCORES:  # within the budget: attnx planned no chunks
        if masked:
            return _attend_small_masked(query, key, value, scale, is_causal, mask, key_lengths, batch_shape)
        return _attend_small(query, key, value, scale, is_causal)
    output, _ = attend(query, key, value, mask, key_lengths, is_causal, scale, chunks, batch_shape, chunk_size, backend)
    return output.reshape(*batch_shape, n, value.shape[-1])


def attend(
    query: Any,
    key: Any,
    value: Any,
    mask: Any,
    key_lengths: Any,
    is_causal: bool,
    scale: Any,
    chunks: tuple[int, int] | None,
    batch_shape: tuple[int, ...],
    chunk_size: Any,
    backend: Any,
    with_stats: bool = False,
) -> tuple[Any, Any]:
    """The blocked computation of a call the native takes (checked by
    :func:`_slices_taken`, ``scale`` in the inputs' dtype): ``(output,
    stats)``, the output ``(slices, n, d_v)`` and, ``with_stats``, each
    row's log-sum-exp of its scores ``(slices, n, 1)``, from which a
    backward makes the weights again (0 for a row that attends nothing:
    its weights are all 0 whatever it is); else None."""
    slices, n, m = math.prod(batch_shape), query.shape[-2], key.shape[-2]
    dtype = query.dtype
    masks = CallMasks(mask, key_lengths, batch_shape, n, m) if mask is not None or key_lengths is not None else None
    d_v = value.shape[-1]
    threads, budget = backend.concurrent_blocks, get_memory_budget(backend, "cpu")
    # Queries within a thread's share of the budget are scaled once, here: a
    # task that begins with a short NumPy call hands the GIL to a worker just
    # woken, and waits some 40 us to have it back (on this project's VMs).
    # They go into a buffer kept between calls: freed with the output, a
    # fresh one leaves enough free at the top of glibc's heap for it to be
    # given back to the system, and the next call's page faults took some
    # 250 us of a (1, 8, 128, 128) call of 1 ms.  Larger queries are scaled
    # by each task, a block at a time.
    d_k = query.shape[-1]
    block_scale = None if slices * n * d_k * dtype.itemsize <= budget // threads else scale
    if block_scale is None:
        scaled = _scratch(slices * n * d_k, dtype, "queries").reshape(*batch_shape, n, d_k)
        q = np.multiply(query, scale, out=scaled).reshape(slices, n, d_k)
    else:
        q = _as_slices(query, batch_shape, slices)
    groups = natives.key_groups(query.shape, key.shape, value.shape)
    if groups > 1:  # grouped heads (attnx._grouping): a key/value slice serves its group's query slices in place
        k, v = (a.reshape(slices // groups, m, a.shape[-1]) for a in (key, value))
    else:
        k, v = _as_slices(key, batch_shape, slices), _as_slices(value, batch_shape, slices)
    output = np.empty((slices, n, d_v), dtype=dtype)
    # Causal calls of one task a thread (see plan) take spans of rows of
    # equal work over every slice, where a thread's share of the budget
    # holds a span's scores.
    spans = None
    if (
        is_causal
        and groups == 1  # spans take every slice in one task: across groups
        and chunk_size is None
        and threads > 1
        and PARALLEL_SCORES <= slices * n * m < BALANCED_SCORES
        and slices * n * min(m, KEY_CHUNK) * dtype.itemsize <= budget // threads
    ):
        spans = causal_spans(n, m, threads)
    if spans is not None:
        tasks = [(0, slices, r0, r1) for r0, r1 in spans]
        per_task, rows, key_chunk = slices, max(r1 - r0 for r0, r1 in spans), min(m, KEY_CHUNK)
        inner_rows = n
    else:
        per_task, rows, key_chunk = plan(slices, n, m, dtype.itemsize, is_causal, threads, budget)
        if chunk_size is not None:
            (rows, key_chunk), per_task = chunks, 1
        if groups > 1:  # a task's slices within one group, which then reads one key/value slice
            per_task = max(size for size in range(1, min(per_task, groups) + 1) if groups % size == 0)
        # Causal tasks near the end of the sequence cost the most: start them
        # first, so that the last tasks to finish are short.
        tasks = [
            (s0, min(slices, s0 + per_task), r0, min(n, r0 + rows))
            for r0 in reversed(range(0, n, rows))
            for s0 in range(0, slices, per_task)
        ]
        # Causal tasks of many slices attend their rows in blocks of MIN_ROWS,
        # each to the keys up to its own diagonal (see SPLIT_WIDTH).
        inner_rows = MIN_ROWS if is_causal and per_task * query.shape[-1] >= SPLIT_WIDTH else rows
    key_t = k.transpose(0, 2, 1)  # a view: BLAS reads it transposed
    size = per_task * rows * key_chunk
    # Each row's sum of weights: the tasks' normalisers, and the test of
    # whether their exponentials could be taken unshifted.
    totals = np.empty((slices, n, 1), dtype=dtype)
    # Each row's shift, where with_stats: 0 for rows attended unshifted.
    shifts = np.zeros((slices, n, 1), dtype=dtype) if with_stats else None

    def attend_task(task: tuple[tuple[int, int, int, int], bool]) -> None:
        span, shifted = task
        if not shifted:
            # Overflow and its NaN are expected there, and caught by the
            # sums: the user hears of them only from the shifted run.
            with np.errstate(over="ignore", invalid="ignore", divide="ignore", under="ignore"):
                return attend_rows(*span, shifted)
        return attend_rows(*span, shifted)

    def attend_rows(s0: int, s1: int, r0: int, r1: int, shifted: bool) -> None:
        scratch = _scratch(size, dtype)
        factors = None if masks is None or masks.lengths is None else _scratch(size, dtype, "factors")
        # A task's slices, cut where a mask's run of slices that are one view ends.
        for a0, a1 in [(s0, s1)] if masks is None else masks.runs(s0, s1):
            block_masks = None if masks is None else masks.slices(a0, a1)
            # The key/value slices of query slices a0:a1; with groups, their group's one.
            group = slice(a0, a1) if groups == 1 else slice(a0 // groups, a0 // groups + 1)
            for b0 in range(r0, r1, inner_rows):
                b1 = min(r1, b0 + inner_rows)
                _attend_block(
                    q[a0:a1, b0:b1],
                    key_t[group],
                    v[group],
                    output[a0:a1, b0:b1],
                    totals[a0:a1, b0:b1],
                    block_scale,
                    is_causal,
                    b0,
                    n,
                    key_chunk,
                    scratch,
                    block_masks,
                    factors,
                    None if shifts is None else shifts[a0:a1, b0:b1],
                    shifted,
                )

    def run(tasks: list[tuple[int, int, int, int]], shifted: bool) -> None:
        if len(tasks) == 1:
            attend_task((tasks[0], shifted))
        else:
            backend.map_blocks(attend_task, [(task, shifted) for task in tasks])

    run(tasks, False)
    if not _exact_unshifted(totals, output, m):
        if masks is not None:  # rows with no key to attend: their zeros are exact, and need no second run
            masks.settle_empty_rows(totals, output, is_causal)
        run(
            [
                (s0, s1, r0, r1)
                for s0, s1, r0, r1 in tasks
                if not _exact_unshifted(totals[s0:s1, r0:r1], output[s0:s1, r0:r1], m)
            ],
            True,
        )
    if shifts is None:
        return output, None
    return output, shifts + np.log(totals)


def _as_slices(array: Any, batch_shape: tuple[int, ...], slices: int) -> Any:
    """``array`` as ``(slices, rows, d)``: a view where the layout allows, a
    copy where it broadcasts over the batch."""
    if array.shape[:-2] != batch_shape:
        array = np.broadcast_to(array, (*batch_shape, *array.shape[-2:]))
    return array.reshape(slices, *array.shape[-2:])


def _slices_taken(query: Any, key: Any, is_causal: bool, return_weights: bool, batch_shape: Any) -> int | None:
    """The number of (batch, head) slices of a call this native computes, or
    None for the calls it hands to the generic algorithm."""
    n, m = query.shape[-2], key.shape[-2]
    if (
        return_weights
        or query.dtype.char not in ("f", "d")  # float32, float64
        or n == 0
        or m == 0
        or (is_causal and n > m)  # rows with no key at all: the generic algorithm's zeros
    ):
        return None
    return math.prod(batch_shape) or None


def call_plan(backend: Any, arguments: Mapping[str, Any]) -> Callable[..., Any] | None:
    """A plan (:meth:`attnx.Backend.specialize`) for the calls this native
    takes: attnx's checks and dispatch cost some 20 us, half as much again as
    the work of a small call and a twentieth of a (1, 8, 128, 64) one on two
    threads.  Small calls run in one block, :func:`_attend_small`; the memory
    budget is read at every call, and where it no longer holds their scores
    they get the blocks a full call would.  Larger calls go to the native,
    which plans its blocks at every call."""
    query, key, scale = arguments["query"], arguments["key"], arguments["scale"]
    is_causal, batch_shape = arguments["is_causal"], arguments["batch_shape"]
    slices = _slices_taken(query, key, is_causal, arguments["return_weights"], batch_shape)
    if (
        slices is None
        or arguments["mask"] is not None  # attnx plans no masked call: masks differ from call to call
        or arguments["key_lengths"] is not None
        or arguments["chunk_size"] is not None
        or type(scale) is not float
    ):
        return None
    n, m, dtype = query.shape[-2], key.shape[-2], query.dtype
    options = {name: arguments[name] for name in ("mask", "key_lengths", "is_causal", "scale", "return_weights")}
    small = slices * n * m < PARALLEL_SCORES

    def plan(query: Any, key: Any, value: Any) -> Any:
        chunks = None
        if small:  # attnx's one rule for when scores need blocks, asked at each call
            chunks = natives.planned_chunks(backend, dtype, n, m, batch_shape, is_causal=is_causal)
            if chunks is None:
                return _attend_small(query, key, value, scale, is_causal)
        return scaled_dot_product_attention(
            query=query,
            key=key,
            value=value,
            chunks=chunks,
            batch_shape=batch_shape,
            chunk_size=None,
            backend=backend,
            **options,
        )

    return plan


#: Each thread's buffers, kept between calls: its scores, and on a calling
#: thread the scaled queries.  A fresh buffer of blocks' size is a fresh
#: mmap, whose page faults cost a third of a block's time and, taken by two
#: threads at once, serialise them on the kernel's lock.  At most a thread's
#: share of the memory budget each.
_scratch_space = threading.local()


def _scratch(size: int, dtype: Any, name: str = "scores") -> Any:
    """A flat buffer of at least ``size`` items of ``dtype``, this thread's
    own ``name`` buffer."""
    buffer = getattr(_scratch_space, name, None)
    nbytes = size * np.dtype(dtype).itemsize
    if buffer is None or buffer.nbytes < nbytes:
        buffer = np.empty(nbytes, dtype=np.uint8)
        setattr(_scratch_space, name, buffer)
    return buffer[:nbytes].view(dtype)


def _attend_small(query: Any, key: Any, value: Any, scale: Any, is_causal: bool) -> Any:
    """One block for everything, on the inputs as they come: small calls are
    all overhead, and planning is the largest part of it."""
    n, m = query.shape[-2], key.shape[-2]
    scores = np.matmul(query * scale, key.swapaxes(-1, -2))
    if is_causal:
        np.copyto(scores, -np.inf, where=_band(n, m, 0, n, 0, m, bool))
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    output = np.matmul(scores, value)
    output /= _row_sums(scores)
    return output


def _attend_small_masked(
    query: Any, key: Any, value: Any, scale: Any, is_causal: bool, mask: Any, key_lengths: Any, batch_shape: Any
) -> Any:
    """:func:`_attend_small` with masks: attnx's combined mask broadcasts
    over the whole call, and the rows are shifted by their maxima (a row
    with no key to attend has none: its shift is 0 and its output zeros)."""
    n, m = query.shape[-2], key.shape[-2]
    masks = {"mask": mask, "key_lengths": key_lengths, "is_causal": is_causal, "batch_shape": batch_shape}
    combined = natives.combined_mask(xp, n=n, m=m, dtype=query.dtype, **masks)
    scores = np.matmul(query * scale, key.swapaxes(-1, -2))
    # Out of place: a mask may have leading axes that the scores broadcast over (the values had them).
    if combined.dtype == np.bool_:
        scores = np.where(combined, scores, -np.inf)
    else:
        scores = scores + combined
    shift = scores.max(axis=-1, keepdims=True)
    np.copyto(shift, 0, where=shift == -np.inf)
    scores -= shift
    np.exp(scores, out=scores)
    output = np.matmul(scores, value)
    totals = _row_sums(scores)
    np.copyto(totals, 1, where=totals == 0)
    output /= totals
    return output


def _row_sums(weights: Any, out: Any = None) -> Any:
    """``(..., rows, 1)``: the sums of the rows of ``weights``, as a product
    with a column of ones: BLAS sums (4, 128, 128) float32 in 5 us where
    ``sum(axis=-1)`` takes 25 us, to the accuracy of the product with the
    values that these sums divide."""
    m = weights.shape[-1]
    ones = _ones.get((m, weights.dtype.char))
    if ones is None:
        ones = np.ones((m, 1), dtype=weights.dtype)
        ones.flags.writeable = False
        if len(_ones) >= BANDS:
            _ones.clear()
        _ones[m, weights.dtype.char] = ones
    return np.matmul(weights, ones, out=out)


#: Read-only columns of ones by length and dtype (at most BANDS, as the bands).
_ones: dict[tuple[int, str], Any] = {}


def _exact_unshifted(totals: Any, output: Any, m: int) -> bool:
    """Whether rows attended with their exponentials unshifted, with sums of
    weights ``totals`` (``(..., rows, 1)``) over ``m`` keys and outputs
    ``output`` (``(..., rows, d_v)``), came out as exact as shifted ones.

    Every sum is finite (an exponential that overflowed makes it inf, or NaN
    on the causal diagonal, inf times the mask's 0) and at least ``m *
    sqrt(tiny)``: the row's largest weight is then at least ``sqrt(tiny)``,
    so the weights lost to underflow weigh at most ``sqrt(tiny)`` of it, and
    a product with the values loses to subnormal numbers at most ``m *
    denormal / sum``, some 2**-87 (float32) of the output's units.  Every
    output is finite: a sum in the products with the values that overflowed
    made it inf or NaN (as do values that hold inf or NaN, which the shifted
    run gives back as they are).  Read by their minimum and maximum, not a
    sum: a sum of finite outputs may overflow, and would run them again."""
    finfo = np.finfo(totals.dtype)
    low, high = math.sqrt(float(finfo.tiny)) * m, float(finfo.max)
    if not (low <= totals.min() and totals.max() <= high):
        return False
    return output.size == 0 or bool(-high <= output.min() and output.max() <= high)  # d_v may be 0


def keys_first(masks: BlockMasks | None) -> bool:
    """Whether a block's tiles of scores are held keys by queries, ``(slices,
    keys, rows)``, and seen through a transposed view: OpenBLAS's sgemm
    makes K Q^T faster than Q K^T (1.34 ns a score against 1.70 with its
    AVX-512 kernels at d = 64 on one core; 1.25 against 1.30 with its AVX2
    ones), and a backward's P^T dO and dS^T Q then read the tile as it lies
    (1.32 against 1.51; 1.24 against 1.44).  Not where a mask varies by
    query: it lies queries by keys in the user's memory, and applying it
    across the tile's grain took 1.76x the time of a forward at (1, 8,
    2048, 64); lengths and padding masks, one row of keys per slice, are
    read along either grain alike."""
    if masks is None:
        return True
    return all(mask is None or mask.shape[-2] == 1 for mask in (masks.allowed, masks.additive))


def as_held(array: Any, held_keys_first: bool) -> Any:
    """An ``(slices, rows, ...)`` array or view as the tiles lie in memory:
    transposed where they are held keys by queries (:func:`keys_first`),
    so that a pass over a whole tile takes it in its own order."""
    return array.transpose(0, 2, 1) if held_keys_first else array


def _products(query: Any, key_t: Any, buffer: Any, c0: int, c1: int, held_keys_first: bool) -> Any:
    """The scores of ``query`` against the keys ``c0:c1``, ``(slices, rows,
    keys)``, in ``buffer``: held keys by queries and seen through a
    transposed view where ``held_keys_first`` (:func:`keys_first`)."""
    slices, rows = query.shape[0], query.shape[1]
    if not held_keys_first:
        held = buffer[: slices * rows * (c1 - c0)].reshape(slices, rows, c1 - c0)
        return np.matmul(query, key_t[..., c0:c1], out=held)
    keys = key_t[..., c0:c1].transpose(0, 2, 1)
    held = buffer[: slices * rows * (c1 - c0)].reshape(slices, c1 - c0, rows)
    return np.matmul(keys, query.transpose(0, 2, 1), out=held).transpose(0, 2, 1)


def _mask_future(
    scores: Any, r0: int, n: int, m: int, c0: int, c1: int, exponentials: bool, held_keys_first: bool
) -> None:
    """Mask the keys ``c0:c1`` in the future of the queries ``r0:r0 + rows``
    on the band where the causal diagonal crosses them: scores are set to
    ``-inf``; their exponentials (``exponentials``) are multiplied by 0
    there: the same where they are finite (an inf becomes NaN, which its
    row's sum carries to :func:`_exact_unshifted`), in a third of the time (8 us
    against 27 us for (4, 128, 128) float32) where the band is the whole
    block.  ``scores`` ``(slices, rows, keys)`` is held keys by queries
    where ``held_keys_first`` (:func:`keys_first`), and the band, its keys
    ``b0:c1``, is then a run of whole rows of the tile as it lies.  Held
    queries by keys, the band is part of each row, which takes three times
    as long as whole rows: the product takes whole rows where the band
    would be a third of them or more."""
    past = r0 + m - n + 1  # keys before it are in every row's past: no mask needed
    if c1 <= past:
        return
    b0 = max(c0, past)
    if exponentials and not held_keys_first and 3 * (c1 - b0) >= c1 - c0:
        b0 = c0
    held = as_held(scores[..., b0 - c0 :], held_keys_first)
    geometry = (n, m, r0, r0 + scores.shape[1], b0, c1)
    if exponentials:
        np.multiply(held, _band(*geometry, scores.dtype, held_keys_first), out=held)
    else:
        np.copyto(held, -np.inf, where=_band(*geometry, bool, held_keys_first))


def _last_keys(scores: Any, kept: Any) -> Any:
    """The scores of the keys that the lengths' factors ``kept`` cover: a
    block's last ones (:meth:`.numpy_masks.BlockMasks.block`)."""
    return scores[..., scores.shape[-1] - kept.shape[-1] :]


#: The causal mask on the band of a block, by the block's geometry and dtype
#: (see :func:`_band`): building one takes some 17 us, a tenth of a task of
#: four (128, 128) slices.  At most BANDS of at most BAND_ITEMS each.
_bands: dict[tuple[int, int, int, Any, bool], Any] = {}
BANDS, BAND_ITEMS = 64, 2**16


def _band(n: int, m: int, r0: int, r1: int, b0: int, c1: int, dtype: Any, held_keys_first: bool = False) -> Any:
    """``(r1 - r0, c1 - b0)``, or ``(c1 - b0, r1 - r0)`` where
    ``held_keys_first`` (as the tiles are held, :func:`keys_first`): where
    a key of ``b0:c1`` is in the future of a query of ``r0:r1`` (the
    negation of the causal rule): True there as booleans, or as a float
    ``dtype`` the factor 0 there and 1 elsewhere.  It depends only on the
    block's size and where the diagonal crosses it, so blocks of the same
    geometry share one read-only array."""
    geometry = (r1 - r0, c1 - b0, r0 + m - n - b0, dtype, held_keys_first)
    band = _bands.get(geometry)
    if band is None:
        past = natives.combined_mask(
            xp, mask=None, key_lengths=None, is_causal=True, batch_shape=(), n=n, m=m, rows=(r0, r1), cols=(b0, c1)
        )
        band = ~past if dtype is bool else past.astype(dtype)
        if held_keys_first:
            band = np.ascontiguousarray(band.T)
        if band.size <= BAND_ITEMS:
            band.flags.writeable = False
            if len(_bands) >= BANDS:
                _bands.clear()
            _bands[geometry] = band
    return band


def _attend_block(
    query: Any,
    key_t: Any,
    value: Any,
    output: Any,
    totals: Any,
    scale: Any,
    is_causal: bool,
    r0: int,
    n: int,
    key_chunk: int,
    buffer: Any,
    masks: BlockMasks | None,
    factors: Any,
    shifts: Any,
    shifted: bool,
) -> None:
    """Attention of the queries ``r0:r0 + rows`` (``query``: ``(slices, rows,
    d_k)``, to be multiplied by ``scale``, or scaled already where it is None)
    to every key they may see, written into ``output``, and each row's sum of
    weights into ``totals`` (``(slices, rows, 1)``); ``buffer`` (flat, at
    least ``slices * rows * key_chunk``) holds the scores.  The online
    softmax, its rows ``shifted`` by their running maximum or not at all (see
    the module's docstring).  ``masks`` are those of these slices, and
    ``factors`` (flat, as large as ``buffer``) holds their lengths' factors;
    ``shifts`` (``(slices, rows, 1)``, or None), where the rows are
    shifted, gets each row's final shift."""
    rows, m = query.shape[1], key_t.shape[-1]
    if scale is not None:  # (slices, rows, d_k): small, unlike the scores
        query = query * scale
    # With a causal mask, keys past r1 + (m - n) are in every row's future.
    stop = min(m, r0 + rows + m - n) if is_causal else m
    free = stop
    if masks is not None:  # nor are the keys past every row's length computed
        stop, free = masks.key_range(r0, r0 + rows, stop)
    if stop == 0:  # no row has a key to attend (lengths of 0): zeros, as attnx's algorithm gives
        output[...] = 0
        totals[...] = 1
        if shifts is not None:
            shifts[...] = 0
        return
    shift = None
    held_keys_first = keys_first(masks)
    for c0 in range(0, stop, key_chunk):
        c1 = min(stop, c0 + key_chunk)
        scores = _products(query, key_t, buffer, c0, c1, held_keys_first)
        additive = allowed = kept = None
        if masks is not None:
            additive, allowed, kept = masks.block(r0, r0 + rows, c0, c1, free, scores.dtype, factors)
            if additive is not None:
                np.add(scores, additive, out=scores)
        if shifted:
            if is_causal:
                _mask_future(scores, r0, n, m, c0, c1, False, held_keys_first)
            if allowed is not None:
                np.copyto(scores, -np.inf, where=~allowed)
            if kept is not None:
                np.copyto(_last_keys(scores, kept), -np.inf, where=kept == 0)
            block_max = scores.max(axis=-1, keepdims=True)
            if shift is None:
                # Without masks the first block holds key 0, which every row
                # may attend: its maximum is finite (causal rows with no key
                # at all were declined).
                shift = block_max
            else:
                new_shift = np.maximum(shift, block_max)
                with np.errstate(invalid="ignore"):  # -inf - -inf: a row with no key yet
                    correction = np.exp(shift - new_shift)
                if masks is not None:  # such a row's totals and outputs are 0 so far: any finite factor
                    np.copyto(correction, 0, where=new_shift == -np.inf)
                totals *= correction
                output *= correction
                shift = new_shift
            # A row with no key yet is shifted by 0: its exponentials are 0, not NaN.
            scores -= shift if masks is None else np.where(shift == -np.inf, 0, shift)
        np.exp(scores, out=scores)
        if not shifted:
            if is_causal:
                _mask_future(scores, r0, n, m, c0, c1, True, held_keys_first)
            # Forbidden keys weigh 0 (an exponential that overflowed gives NaN, caught by the sums).
            if allowed is not None:
                np.multiply(scores, allowed, out=scores)
            if kept is not None:
                band = _last_keys(scores, kept)
                np.multiply(band, kept, out=band)
        if c0 == 0:
            _row_sums(scores, out=totals)
            np.matmul(scores, value[:, c0:c1], out=output)
        else:
            totals += _row_sums(scores)
            output += scores @ value[:, c0:c1]
    if shifted and masks is not None:  # a row with no key to attend: zeros, never NaN
        np.copyto(totals, 1, where=totals == 0)
    if shifted and shifts is not None:
        np.copyto(shifts, shift if masks is None else np.where(shift == -np.inf, 0, shift))
    output /= totals
