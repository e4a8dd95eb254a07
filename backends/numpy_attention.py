"""The NumPy backend's native scaled dot-product attention, in plain NumPy.

The generic algorithm (array API only) is the reference every backend is
held to; this one computes the same function faster where NumPy allows
what the standard does not: exponentials and shifts in place, a transposed
view of the keys handed straight to BLAS, outputs written into one
preallocated array, and blocks of several (batch, head) slices run on
threads that each hold BLAS to one core.

The work is cut into tasks of ``slices`` (batch, head) pairs by ``rows``
queries; each task walks the keys in blocks of ``key_chunk`` with the online
softmax (a running maximum and sum), so its scores never exceed one block.

Where the keys take more than one block and the inputs allow it, a task
skips the running maximum altogether (:func:`_attend_bounded`): by
Cauchy-Schwarz every score of row ``i`` lies within ``±b_i = scale * |q_i| *
max_j |k_j|``, so ``exp(s - b_i)`` can neither overflow nor, while ``b_i``
stays within :data:`SHIFT_LIMIT`, underflow.
Softmax does not change when a row is shifted by any constant, so the
result is the same function; the pass that finds each row's maximum and
every rescaling of the running sums disappear.  Over a single key block
the maximum is one pass, which costs no more than the bound (measured at
n = 512 and 2048) and less at n = 128, where the bound was a tenth of the
call.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Mapping
from typing import Any

import array_api_compat.numpy as xp
import numpy as np

from attnx import _masking, get_memory_budget

# The same thresholds as the generic algorithm's (measured there): blocks
# of at least MIN_ROWS query rows, at most KEY_CHUNK keys.
from attnx.attention import KEY_CHUNK, MIN_ROWS, choose_chunks

#: Query rows per task at most: more rows per task means fewer tasks to share
#: among threads, and for causal masks more work spent above the diagonal.
MAX_ROWS = 256
#: Scores below which threads cost more than they save (a single task).
PARALLEL_SCORES = 2**16
#: Slices per causal task from which its rows are attended in blocks of
#: MIN_ROWS, each to the keys up to its own diagonal: less work (0.86-0.88x
#: the time at (16, 8, 128, 128) and (64, 8, 128, 64) on two threads), in
#: smaller products whose per-call costs fewer slices don't amortise (1.10x
#: at (1, 8, 128, 64), 4 slices a task; 1.05x at n = 2048, 1 slice a task).
SPLIT_SLICES = 16
#: Scores from which each thread gets two tasks or more.
BALANCED_SCORES = 2**20
#: The largest bound ``b_i`` (see the module's docstring) for which a task
#: shifts its rows by ``b_i`` instead of their maximum: ``exp(-2 b_i)`` stays a
#: normal number (float32 from e^-87, float64 from e^-708), with room for the
#: rounding of the shifted scores, whose error grows with ``b_i`` (at the
#: limit, twice that of the maximum's shift).
SHIFT_LIMIT = {"f": 32.0, "d": 256.0}


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
    chunks: tuple[int, int] | None = None,
    batch_shape: tuple[int, ...] | None = None,
    chunk_size: Any = None,
    backend: Any,
) -> Any:
    """attnx's native entry point (see :meth:`attnx.Backend.implementations`);
    ``backend`` (bound by it) runs the tasks on its threads.  A ``chunk_size``
    the user gave sets the rows and keys of each task (``chunks``)."""
    if batch_shape is None:
        batch_shape = np.broadcast_shapes(query.shape[:-2], key.shape[:-2], value.shape[:-2])
    slices = _slices_taken(query, key, mask, key_lengths, is_causal, return_weights, batch_shape)
    if slices is None:
        return NotImplemented
    n, m = query.shape[-2], key.shape[-2]
    dtype = query.dtype
    # A Python float keeps the inputs' dtype (NEP 50); a 0-d array is cast to it.
    scale = scale if type(scale) is float else dtype.type(scale)
    if chunks is None and slices * n * m < PARALLEL_SCORES:  # within the budget: attnx planned no chunks
        return _attend_small(query, key, value, scale, is_causal)
    d_v = value.shape[-1]
    threads, budget = backend.concurrent_blocks, get_memory_budget()
    # Queries within a thread's share of the budget are scaled once, here: a
    # task that begins with a short NumPy call hands the GIL to a worker just
    # woken, and waits some 40 us to have it back (on this project's VMs).
    # Larger ones are scaled by each task, a block at a time.
    block_scale = None if query.nbytes <= budget // threads else scale
    q = _as_slices(query * scale if block_scale is None else query, batch_shape, slices)
    k, v = _as_slices(key, batch_shape, slices), _as_slices(value, batch_shape, slices)
    output = np.empty((slices, n, d_v), dtype=dtype)
    per_task, rows, key_chunk = plan(slices, n, m, dtype.itemsize, is_causal, threads, budget)
    if chunk_size is not None:
        (rows, key_chunk), per_task = chunks, 1
    key_t = k.transpose(0, 2, 1)  # a view: BLAS reads it transposed
    size = per_task * rows * key_chunk
    # Over one key block the running maximum is one pass and no rescaling:
    # the bound would cost more than it saves (see the module's docstring).
    bound = score_bound(q, k, 1.0 if block_scale is None else scale) if m > key_chunk else None
    limit = SHIFT_LIMIT[dtype.char]
    # Causal tasks of many slices attend their rows in blocks of MIN_ROWS, each
    # to the keys up to its own diagonal (see SPLIT_SLICES).
    inner_rows = MIN_ROWS if is_causal and per_task >= SPLIT_SLICES else rows

    def attend(task: tuple[int, int]) -> None:
        s0, r0 = task
        s1, r1 = min(slices, s0 + per_task), min(n, r0 + rows)
        shift = None if bound is None else bound[s0:s1, r0:r1, None]
        # ``<=`` is False for NaN: inputs with NaN or inf take the maximum's path.
        attend_block = _attend_bounded if shift is not None and shift.max() <= limit else _attend_block
        scratch = _scratch(size, dtype)
        for b0 in range(r0, r1, inner_rows):
            b1 = min(r1, b0 + inner_rows)
            attend_block(
                q[s0:s1, b0:b1],
                key_t[s0:s1],
                v[s0:s1],
                output[s0:s1, b0:b1],
                block_scale,
                is_causal,
                b0,
                n,
                key_chunk,
                scratch,
                None if shift is None else shift[:, b0 - r0 : b1 - r0],
            )

    # Causal tasks near the end of the sequence cost the most: start them
    # first, so that the last tasks to finish are short.
    tasks = [(s0, r0) for r0 in reversed(range(0, n, rows)) for s0 in range(0, slices, per_task)]
    if len(tasks) == 1:
        attend(tasks[0])
    else:
        backend.map_blocks(attend, tasks)
    return output.reshape(*batch_shape, n, d_v)


def _as_slices(array: Any, batch_shape: tuple[int, ...], slices: int) -> Any:
    """``array`` as ``(slices, rows, d)``: a view where the layout allows, a
    copy where it broadcasts over the batch."""
    if array.shape[:-2] != batch_shape:
        array = np.broadcast_to(array, (*batch_shape, *array.shape[-2:]))
    return array.reshape(slices, *array.shape[-2:])


def _slices_taken(
    query: Any, key: Any, mask: Any, key_lengths: Any, is_causal: bool, return_weights: bool, batch_shape: Any
) -> int | None:
    """The number of (batch, head) slices of a call this native computes, or
    None for the calls it hands to the generic algorithm."""
    n, m = query.shape[-2], key.shape[-2]
    if (
        return_weights
        or mask is not None
        or key_lengths is not None
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
    slices = _slices_taken(
        query,
        key,
        arguments["mask"],
        arguments["key_lengths"],
        is_causal,
        arguments["return_weights"],
        batch_shape,
    )
    if slices is None or arguments["chunk_size"] is not None or type(scale) is not float:
        return None
    n, m, dtype = query.shape[-2], key.shape[-2], query.dtype
    options = {name: arguments[name] for name in ("mask", "key_lengths", "is_causal", "scale", "return_weights")}
    small = slices * n * m < PARALLEL_SCORES

    def plan(query: Any, key: Any, value: Any) -> Any:
        chunks = None
        if small:  # attnx's one rule for when scores need blocks, asked at each call
            chunks = choose_chunks(xp, dtype, n, m, batch_shape, None, False, is_causal, backend.concurrent_blocks)
            if chunks is None:
                return _attend_small(query, key, value, scale, is_causal)
        return scaled_dot_product_attention(
            query=query, key=key, value=value, chunks=chunks, batch_shape=batch_shape, backend=backend, **options
        )

    return plan


#: Each thread's scores buffer, kept between calls: a fresh buffer of blocks'
#: size is a fresh mmap, whose page faults cost a third of a block's time
#: and, taken by two threads at once, serialise them on the kernel's lock.
#: At most the memory budget in all (each thread's share of it).
_scratch_space = threading.local()


def _scratch(size: int, dtype: Any) -> Any:
    """A flat buffer of at least ``size`` items of ``dtype``, this thread's own."""
    buffer = getattr(_scratch_space, "buffer", None)
    nbytes = size * np.dtype(dtype).itemsize
    if buffer is None or buffer.nbytes < nbytes:
        buffer = _scratch_space.buffer = np.empty(nbytes, dtype=np.uint8)
    return buffer[:nbytes].view(dtype)


def _attend_small(query: Any, key: Any, value: Any, scale: Any, is_causal: bool) -> Any:
    """One block for everything, on the inputs as they come: small calls are
    all overhead, and planning is the largest part of it."""
    n, m = query.shape[-2], key.shape[-2]
    scores = np.matmul(query * scale, key.swapaxes(-1, -2))
    if is_causal:
        np.copyto(scores, -np.inf, where=_future(n, m, 0, n, 0, m))
    scores -= scores.max(axis=-1, keepdims=True)
    np.exp(scores, out=scores)
    output = np.matmul(scores, value)
    output /= scores.sum(axis=-1, keepdims=True)
    return output


def score_bound(query: Any, key: Any, scale: Any) -> Any:
    """``(slices, n)``: ``|scale| * |q_i| * max_j |k_j|``, which no score of
    row ``i`` exceeds in magnitude (Cauchy-Schwarz); inf or NaN where the
    inputs hold them."""
    # einsum, not vecdot: NumPy 1.26 is supported and has no vecdot.
    query_norms = np.sqrt(np.einsum("...d,...d->...", query, query))
    key_norms = np.sqrt(np.einsum("...d,...d->...", key, key).max(axis=-1, keepdims=True))
    return query_norms * key_norms * abs(scale)


def _scores(query: Any, key_t: Any, buffer: Any, is_causal: bool, r0: int, n: int, c0: int, c1: int) -> Any:
    """The scores of ``query`` against the keys ``c0:c1``, in ``buffer``, with
    the future at ``-inf`` where the causal mask's diagonal crosses them."""
    slices, rows, m = query.shape[0], query.shape[1], key_t.shape[-1]
    scores = np.matmul(query, key_t[..., c0:c1], out=buffer[: slices * rows * (c1 - c0)].reshape(slices, rows, c1 - c0))
    past = r0 + m - n + 1  # keys before it are in every row's past: no mask needed
    if is_causal and c1 > past:  # mask the band around the diagonal only
        b0 = max(c0, past)
        np.copyto(scores[..., b0 - c0 :], -np.inf, where=_future(n, m, r0, r0 + rows, b0, c1))
    return scores


#: The causal mask's future on the band of a block, by the block's geometry
#: (see :func:`_future`): building one takes some 17 us, a tenth of a task
#: of four (128, 128) slices.  At most BANDS of at most BAND_ITEMS each.
_bands: dict[tuple[int, int, int], Any] = {}
BANDS, BAND_ITEMS = 64, 2**16


def _future(n: int, m: int, r0: int, r1: int, b0: int, c1: int) -> Any:
    """Boolean ``(r1 - r0, c1 - b0)``: True where a key of ``b0:c1`` is in
    the future of a query of ``r0:r1`` (the negation of the causal rule).
    It depends only on the block's size and where the diagonal crosses it,
    so blocks of the same geometry share one read-only array."""
    geometry = (r1 - r0, c1 - b0, r0 + m - n - b0)
    future = _bands.get(geometry)
    if future is None:
        future = ~_masking.causal(xp, n, m, rows=(r0, r1), cols=(b0, c1))
        if future.size <= BAND_ITEMS:
            future.flags.writeable = False
            if len(_bands) >= BANDS:
                _bands.clear()
            _bands[geometry] = future
    return future


def _attend_bounded(
    query: Any,
    key_t: Any,
    value: Any,
    output: Any,
    scale: Any,
    is_causal: bool,
    r0: int,
    n: int,
    key_chunk: int,
    buffer: Any,
    shift: Any,
) -> None:
    """:func:`_attend_block` with every row shifted by its bound ``shift``
    (``(slices, rows, 1)``, at most :data:`SHIFT_LIMIT`) instead of its running
    maximum: no pass for the maximum, and no rescaling of the sums and
    outputs from one key block to the next."""
    rows, m = query.shape[1], key_t.shape[-1]
    if scale is not None:
        query = query * scale
    stop = min(m, r0 + rows + m - n) if is_causal else m
    total = None
    for c0 in range(0, stop, key_chunk):
        c1 = min(stop, c0 + key_chunk)
        scores = _scores(query, key_t, buffer, is_causal, r0, n, c0, c1)
        scores -= shift
        np.exp(scores, out=scores)
        if total is None:
            total = scores.sum(axis=-1, keepdims=True)
            np.matmul(scores, value[:, c0:c1], out=output)
        else:
            total += scores.sum(axis=-1, keepdims=True)
            output += scores @ value[:, c0:c1]
    # Every row holds key 0 with a weight of at least exp(-2 * shift): no zero.
    output /= total


def _attend_block(
    query: Any,
    key_t: Any,
    value: Any,
    output: Any,
    scale: Any,
    is_causal: bool,
    r0: int,
    n: int,
    key_chunk: int,
    buffer: Any,
    shift: Any = None,
) -> None:
    """Attention of the queries ``r0:r0 + rows`` (``query``: ``(slices, rows,
    d_k)``, to be multiplied by ``scale``, or scaled already where it is None)
    to every key they may see, written into ``output``; ``buffer`` (flat, at
    least ``slices * rows * key_chunk``) holds the scores.  The online softmax
    with each row's running maximum; ``shift`` is unused."""
    rows, m = query.shape[1], key_t.shape[-1]
    if scale is not None:  # (slices, rows, d_k): small, unlike the scores
        query = query * scale
    # With a causal mask, keys past r1 + (m - n) are in every row's future.
    stop = min(m, r0 + rows + m - n) if is_causal else m
    row_max = total = None
    for c0 in range(0, stop, key_chunk):
        c1 = min(stop, c0 + key_chunk)
        scores = _scores(query, key_t, buffer, is_causal, r0, n, c0, c1)
        block_max = scores.max(axis=-1, keepdims=True)
        if row_max is None:
            # The first block holds key 0, which every row may attend: its
            # maximum is finite (causal rows with no key at all were declined).
            row_max = block_max
            scores -= row_max
            np.exp(scores, out=scores)
            total = scores.sum(axis=-1, keepdims=True)
            np.matmul(scores, value[:, c0:c1], out=output)
            continue
        new_max = np.maximum(row_max, block_max)
        scores -= new_max
        np.exp(scores, out=scores)
        correction = np.exp(row_max - new_max)
        total *= correction
        total += scores.sum(axis=-1, keepdims=True)
        output *= correction
        output += scores @ value[:, c0:c1]
        row_max = new_max
    output /= total
