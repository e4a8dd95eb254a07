"""The CuPy backend's native scaled dot-product attention: the softmax of a
block of scores in one kernel.

The generic algorithm (array API only) takes a row's maximum, subtracts it
into a new array, exponentiates, and sums: each a pass over the whole block
of scores in GPU memory, and together 57% of a textbook attention's time on
an H200 at (1, 8, 8192, 64) (docs/archive/bench-sessions.md, fifth GPU run), where the two
matrix products were 39%.  Here one kernel (:data:`ROW_SOFTMAX_SOURCE`, a
block of threads per row) reads each row twice, the second time from L2,
and writes its exponentials in place, with the row's maximum and sum; the output of the
values' product is divided by the sums, an ``(n, d_v)`` array rather than
the ``(n, m)`` weights.

The causal rule and ``key_lengths`` reach the kernel as one number per row,
the keys it may attend (:func:`_row_limits`): no mask is built or applied.
A ``mask`` is added to (or applied to) the scores before the kernel, a
block at a time; one with leading axes of its own (a ``(B, 1, 1, m)``
padding mask, a per-head bias) gives each block of slices its entries by
integer indexing (:func:`_mask_slices`), never laid out for the whole call
(it would be as large as the scores).  A row with no key to attend gets
zeros, as attnx's algorithm gives.

Blocks hold whole rows of keys where the memory budget allows
(:func:`plan`), so most calls need no running maximum; where they don't
(a small budget, or a ``chunk_size`` the user gave), the blocks of keys are
joined as :mod:`attnx.blocks` states (the online softmax), each block's
maximum and sum from the kernel.

Calls without a ``mask`` that are small, or that a small memory budget
would cut into many blocks (each a round of some ten launches), go to a
fused kernel instead (:mod:`cupy_flash`, :func:`prefers_fused`).

The blocking (:func:`attend`) is plain NumPy-style code over ``xp``, the
array's namespace, with the row softmax passed in; on the CPU the tests run
it with a row softmax written in NumPy, so that only the kernel needs a GPU
(the conformance suite on CuPy checks the whole).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy

from attnx import blocks, get_memory_budget, natives
from attnx.natives import MIN_ROWS

from . import cupy_cudnn, cupy_flash, cupy_launch, cupy_tiled, cupy_tiled_backward

#: Causal calls are cut into blocks of rows (each of at least MIN_ROWS
#: rows) that compute the keys up to their last row's diagonal: with 4
#: blocks, 5/8 of the square's scores.  Each block is a round of some ten
#: launches, which the work skipped pays for only in large calls: by the
#: scores of the whole call, ``(from, blocks)``.  On an H200, in float32
#: (docs/archive/bench-sessions.md, sixth GPU run, two machines), against 4 blocks:
#: (1, 8, 2048, 64), 2**25 scores, 0.38x-0.52x in one block; (1, 8, 8192,
#: 64), 2**29, 1.36x in one, 1.15x-1.20x in two, 1.18x-1.21x in eight;
#: (16, 8, 1024, 64), 2**27, 0.84x and 1.13x in two, 0.91x and 1.18x in
#: one (the two machines disagreed there).
CAUSAL_BLOCKS = ((2**29, 4), (2**27, 2))
#: The row softmax's threads per row: one for every SCORES_PER_THREAD scores
#: (a power of two), a warp at least, MAX_THREADS at most.  The kernel alone
#: on 512 MiB of float32 scores, on an H200: rows of 512 took 0.41 ms with
#: 64 threads and 0.47 with 256 to 1,024; rows of 1,024 0.41 ms with 64 or
#: 128 and 0.51-0.53 with more; rows of 8,192 0.47 ms with 512, 0.49 with
#: 256, 0.62-0.64 with 128 or 1,024.
SCORES_PER_THREAD = 8
MAX_THREADS = 512
#: The inputs' dtypes the native takes: half precision that cuDNN does not
#: take is computed in float32 (attnx's rule), as the generic algorithm does.
DTYPES = ("float32", "float64", "float16", "bfloat16")
#: Where the fused kernel (:mod:`cupy_flash`) takes a call without a mask
#: (:func:`prefers_fused`).  On an H200, float32, d = 64, its time over
#: attend's blocks' (docs/archive/bench-sessions.md, eighth GPU run): up to 2**16 scores
#: a slice, 0.52x-0.70x ((1, 8, 128), (1, 8, 256), (4, 8, 256)), and
#: 0.93x-1.01x at (64, 8, 128); from 2**18 at the default budget, 0.87x-1.94x
#: ((1, 1, 512) 0.87x, (1, 8, 512) 1.09x-1.26x, (1, 2, 1024) 1.23x-1.55x,
#: (1, 8, 2048) 1.7x-1.9x, (1, 8, 8192) 1.19x-1.31x; and 2.9x-3.2x at d =
#: 128).  Under budgets that cut a call into 8 blocks or more: 0.009x-0.88x
#: (one tie, 1.00x, at 32 blocks of (1, 8, 8192)): each block is a round of
#: some ten launches, and a small budget makes many.
FUSED_SCORES = 2**16
FUSED_ROUNDS = 8
#: The fused kernel walks each query's keys in one thread: where the call
#: has few queries in all (decoding: one a slice), most of the GPU idles
#: while each thread walks its keys alone, ``m * (d_k + d_v)`` products in a
#: row (a million at (1, 32, 1, 4096, 128)).  A call of fewer than
#: FUSED_MIN_QUERIES queries whose threads would each do more than
#: FUSED_MAX_SERIAL products for each round of attend's blocks goes to
#: those blocks, whose matrix products spread the keys over the GPU.  From
#: arithmetic, not yet timed: 2**17 products in a row take some 75 us, about
#: the host's cost of a round's ten launches (a small call took 108 us,
#: ninth GPU run); 2**12 queries fill some 3% of an H200's threads.
#: ``bench/gpu_checks.py decode_times`` times both sides.
FUSED_MIN_QUERIES = 2**12
FUSED_MAX_SERIAL = 2**17
#: Whether float32 calls without a mask go to :mod:`cupy_tiled`'s kernel
#: (with split keys where few blocks of queries would leave the GPU idle:
#: decoding) rather than where the ninth GPU run measured them best
#: (:mod:`cupy_flash`'s kernel for small calls and small budgets, attend's
#: blocks for the rest and for decoding).  Off until a GPU has timed it:
#: ``bench/gpu_checks.py tiled_times decode_times`` time both ways.
TILED_FORWARD = False
#: Keys a block holds at least, where the budget can't hold whole rows (the
#: generic algorithm's floor, below which the products lose their efficiency).
MIN_KEYS = 512

#: The row softmax, written once for ``T`` (float or double: :func:`kernel_source`).  A block of
#: threads per row of ``width`` scores; the row's keys from ``limit`` on
#: (the causal rule, the key lengths: ``limits[row] - first_key``) weigh 0.
#: The maximum propagates NaN, as a NaN score propagates it in attnx's
#: algorithm; a row whose allowed scores are all ``-inf`` (or that has none)
#: gets zeros and a maximum of ``-inf``.  Each row's divisor is the sum of
#: its exponentials, or 1 where they are all 0 (no key): its output is then
#: the zeros attnx gives, without a pass to make the sums safe.
ROW_SOFTMAX_SOURCE = r"""
__device__ __forceinline__ T nan_max(T a, T b) { return (a != a || a > b) ? a : b; }

extern "C" __global__ void KERNEL_NAME(T* scores, T* maxima, T* divisors, const int* limits,
                                const int has_limits, const int width, const int first_key) {
    const long long r = blockIdx.x;
    T* row = scores + r * (long long)width;
    int limit = width;
    if (has_limits) {
        limit = limits[r] - first_key;
        limit = limit < 0 ? 0 : (limit > width ? width : limit);
    }
    __shared__ T partial[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const T minus_infinity = MINUS_INFINITY;
    T most = minus_infinity;
    for (int j = threadIdx.x; j < limit; j += blockDim.x) most = nan_max(most, row[j]);
    for (int o = 16; o > 0; o >>= 1) most = nan_max(most, __shfl_xor_sync(0xffffffff, most, o));
    if (lane == 0) partial[warp] = most;
    __syncthreads();
    most = minus_infinity;
    for (int w = 0; w < warps; ++w) most = nan_max(most, partial[w]);
    __syncthreads();
    const bool none = most == minus_infinity;
    T sum = 0;
    for (int j = threadIdx.x; j < width; j += blockDim.x) {
        const T e = (j < limit && !none) ? EXP(row[j] - most) : (T)0;
        row[j] = e;
        sum += e;
    }
    for (int o = 16; o > 0; o >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, o);
    if (lane == 0) partial[warp] = sum;
    __syncthreads();
    if (threadIdx.x == 0) {
        T total = 0;
        for (int w = 0; w < warps; ++w) total += partial[w];
        divisors[r] = total == 0 ? (T)1 : total;
        maxima[r] = most;
    }
}
"""

#: Per dtype: the C type, its exponential, and -inf (NVRTC defines no INFINITY).
_TYPES = {
    "float32": ("float", "expf", "__int_as_float(0xff800000)"),
    "float64": ("double", "exp", "__longlong_as_double(0xfff0000000000000LL)"),
}

#: A row softmax: ``(scores, limits, first_key) -> (maxima, divisors)``, the
#: scores ``(count, width)`` turned into their exponentials in place.
RowSoftmax = Callable[[Any, Any, int], tuple[Any, Any]]


def kernel_source(dtype_name: str) -> str:
    """The row softmax's CUDA source for ``"float32"`` or ``"float64"``."""
    c_type, exponential, minus_infinity = _TYPES[dtype_name]
    header = f"typedef {c_type} T;\n#define EXP {exponential}\n#define MINUS_INFINITY {minus_infinity}\n"
    return header + ROW_SOFTMAX_SOURCE.replace("KERNEL_NAME", f"row_softmax_{dtype_name}")


def cupy_row_softmax(
    scores: Any, limits: Any, first_key: int, *, arrays: Any = None, run: cupy_launch.Run | None = None
) -> tuple[Any, Any]:
    """:data:`RowSoftmax` on the GPU: one launch of the kernel, on C-ordered
    ``scores`` (a matrix product's: they are written in place).  ``arrays``
    and ``run``: CuPy and :func:`cupy_launch.run` (the tests' are NumPy and
    a launch on the CPU)."""
    arrays, run = arrays or cupy_launch.cupy_arrays(), run or cupy_launch.run
    if not scores.flags.c_contiguous:
        raise ValueError("the row softmax works in place on C-ordered scores")

    count, name = scores.shape[0], scores.dtype.name
    maxima = arrays.empty((count,), dtype=scores.dtype)
    divisors = arrays.empty((count,), dtype=scores.dtype)
    limits, has_limits = cupy_launch.limits_argument(limits, arrays)  # one int a row, in the rows' order
    grid, block, arguments = row_softmax_launch(scores, maxima, divisors, limits, first_key, has_limits=has_limits)
    run(kernel_source(name), f"row_softmax_{name}", 0, grid, block, arguments)
    return maxima, divisors


def row_softmax_launch(
    scores: Any, maxima: Any, divisors: Any, limits: Any, first_key: int, *, has_limits: bool
) -> tuple[tuple[int], tuple[int], tuple[Any, ...]]:
    """``(grid, block, arguments)`` of the row softmax's launch on C-ordered
    ``(count, width)`` scores, ``limits`` an int32 array (read where
    ``has_limits``).  Written from their shapes alone, so that the tests
    launch the same source on the CPU (``tests/cuda_on_cpu.py``)."""
    count, width = scores.shape
    arguments = (scores, maxima, divisors, limits, *map(numpy.int32, (has_limits, width, first_key)))
    return (count,), (threads_per_row(width),), arguments


def threads_per_row(width: int) -> int:
    """The kernel's threads for a row of ``width`` scores: a warp at least,
    :data:`MAX_THREADS` at most, else one for every
    :data:`SCORES_PER_THREAD` scores (a power of two)."""
    wanted = 1 << max(0, -(-width // SCORES_PER_THREAD) - 1).bit_length()
    return min(MAX_THREADS, max(32, wanted))


def plan(
    slices: int, n: int, m: int, itemsize: int, is_causal: bool, budget: int, chunks: tuple[int, int] | None
) -> tuple[int, int, int]:
    """``(slices_per_block, rows, key_chunk)``: as many keys as ``MIN_ROWS``
    rows of them fit the budget (whole rows where they do; ``MIN_KEYS`` at
    least); as many rows as the budget holds; large causal calls cut into
    blocks of rows (:data:`CAUSAL_BLOCKS`).  ``chunks``, the user's
    ``chunk_size``, sets rows and keys instead.  ``itemsize``: the bytes a
    score takes, with what a block holds beside it."""
    if chunks is not None:
        rows, key_chunk = chunks
    else:
        key_chunk = min(m, max(MIN_KEYS, budget // (MIN_ROWS * itemsize)))
        row_blocks = next((count for scores, count in CAUSAL_BLOCKS if slices * n * m >= scores), 1) if is_causal else 1
        rows = min(n, max(MIN_ROWS, budget // (key_chunk * itemsize)), max(MIN_ROWS, -(-n // row_blocks)))
    per_block = max(1, min(slices, budget // (rows * key_chunk * itemsize)))
    return per_block, rows, key_chunk


def _row_limits(
    xp: Any, key_lengths: Any, is_causal: bool, batch_shape: tuple[int, ...], n: int, m: int, device: Any
) -> Any:
    """``(slices, n)`` int32: the keys each query may attend
    (:func:`attnx.natives.key_counts`; below 0 where none, which the kernel
    reads as 0), or None where it is every key.  Not clamped with ``clip``:
    array-api-compat's on CuPy indexes by a boolean mask, which waits for
    the GPU."""
    counts = natives.key_counts(xp, key_lengths, is_causal, batch_shape, n, m, device=device)
    if counts is None:
        return None
    counts = xp.reshape(xp.broadcast_to(counts, (*batch_shape, n)), (math.prod(batch_shape), n))
    return xp.astype(counts, xp.int32)


def attend(
    xp: Any,
    row_softmax: RowSoftmax,
    *,
    query: Any,
    key: Any,
    value: Any,
    mask: Any,
    key_lengths: Any,
    is_causal: bool,
    scale: Any,
    batch_shape: tuple[int, ...],
    budget: int,
    chunks: tuple[int, int] | None,
) -> Any:
    """Scaled dot-product attention of float32 or float64 inputs with at
    least one query, key and feature, in blocks of :func:`plan`."""
    n, m, d_v = query.shape[-2], key.shape[-2], value.shape[-1]
    slices = math.prod(batch_shape)
    dtype, device = query.dtype, query.device
    q, k, v = (_as_slices(xp, array, batch_shape) for array in (query, key, value))
    q = q * scale
    key_t = xp.matrix_transpose(k)
    limits = _row_limits(xp, key_lengths, is_causal, batch_shape, n, m, device)
    itemsize = dtype.itemsize  # float32 or float64: half precision arrives cast to float32
    mask_slices = _mask_slices(xp, mask, batch_shape, device)
    if mask_slices is not None:  # each block's entries of the mask, beside its scores
        itemsize += 1 if mask.dtype == xp.bool else itemsize
    per_block, rows, key_chunk = plan(slices, n, m, itemsize, is_causal, budget, chunks)
    output = None
    if per_block < slices or rows < n:
        output = xp.empty((slices, n, d_v), dtype=dtype, device=device)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        # Keys past the last row's diagonal are in every row's future.
        stop = max(0, min(m, r1 + m - n)) if is_causal else m
        # A mask that every slice shares is cut and cast once a block of rows.
        shared_mask = None
        if mask is not None and mask_slices is None:
            shared_mask = _mask_block(xp, mask, None, (0, slices, r0, r1, 0, m), batch_shape, n, m, dtype, device)
        for s0 in range(0, slices, per_block):
            s1 = min(slices, s0 + per_block)
            if stop == 0:  # no query of the block has a key to attend
                result = xp.zeros((s1 - s0, r1 - r0, d_v), dtype=dtype, device=device)
            else:
                block_limits = None if limits is None else xp.reshape(limits[s0:s1, r0:r1], (-1,))
                state = None  # blocks of keys joined: attnx.blocks' states
                for c0 in range(0, stop, key_chunk):
                    c1 = min(stop, c0 + key_chunk)
                    scores = q[s0:s1, r0:r1, :] @ key_t[s0:s1, :, c0:c1]
                    if shared_mask is not None:
                        scores = _masked(xp, scores, _columns(shared_mask, c0, c1))
                    elif mask is not None:
                        block = (s0, s1, r0, r1, c0, c1)
                        block_mask = _mask_block(xp, mask, mask_slices, block, batch_shape, n, m, dtype, device)
                        scores = _masked(xp, scores, block_mask)
                    maxima, divisors = row_softmax(xp.reshape(scores, (-1, c1 - c0)), block_limits, c0)
                    shape = (s1 - s0, r1 - r0, 1)
                    products = scores @ v[s0:s1, c0:c1, :]
                    del scores  # its memory is the next block's
                    divisors, maxima = xp.reshape(divisors, shape), xp.reshape(maxima, shape)
                    if stop <= key_chunk:  # one block of keys: no state to join
                        result = products / divisors
                        break
                    # A keyless row's divisor of 1 weighs exp(-inf - shift) = 0 when joined.
                    part = blocks.pack(xp, products, divisors, maxima)
                    state = part if state is None else blocks.combine(state, part, xp=xp)
                if state is not None:
                    result = blocks.finish(state, xp=xp)
            if output is None:  # one block: the whole call
                return xp.reshape(result, (*batch_shape, n, d_v))
            output[s0:s1, r0:r1, :] = result
    return xp.reshape(output, (*batch_shape, n, d_v))


def prefers_fused(slices: int, n: int, m: int, features: int, itemsize: int, is_causal: bool, budget: int) -> bool:
    """Whether a call without a mask is faster in the fused kernel than in
    :func:`attend`'s blocks: a small call (:data:`FUSED_SCORES` scores a
    slice at most), whose blocks' launches outweigh their work, or one that
    the memory ``budget`` cuts into :data:`FUSED_ROUNDS` blocks or more (the
    fused kernel holds no scores whatever the budget); never a call of few
    queries whose threads would each walk more keys than the blocks' rounds
    cost (:data:`FUSED_MIN_QUERIES`; ``features``: ``d_k + d_v``)."""
    per_block, rows, key_chunk = plan(slices, n, m, itemsize, is_causal, budget, None)
    rounds = -(-slices // per_block) * -(-n // rows) * -(-m // key_chunk)
    if slices * n < FUSED_MIN_QUERIES and m * features > FUSED_MAX_SERIAL * rounds:
        return False
    return n * m <= FUSED_SCORES or rounds >= FUSED_ROUNDS


#: The fused kernel: ``(plan, query, key, value, limits, scale, causal) ->
#: output`` on ``(slices, n, d)`` arrays (:func:`cupy_flash.attend`).
FusedKernel = Callable[[Any, Any, Any, Any, Any, float], Any]


def attend_fused(
    xp: Any,
    kernel: FusedKernel,
    flash: Any,
    *,
    query: Any,
    key: Any,
    value: Any,
    key_lengths: Any,
    is_causal: bool,
    scale: Any,
    batch_shape: tuple[int, ...],
) -> Any:
    """Scaled dot-product attention without a ``mask`` in one launch of the
    fused ``kernel`` (:mod:`cupy_flash`, whose ``flash`` plan it is): the
    inputs as ``(slices, rows, features)``, the causal rule and
    ``key_lengths`` as each query's keys.  A ``scale`` that is an array multiplies the queries
    first; a float goes to the kernel."""
    n, m = query.shape[-2], key.shape[-2]
    q, k, v = (_as_slices(xp, array, batch_shape) for array in (query, key, value))
    if not isinstance(scale, float):
        q, scale = q * scale, 1.0
    # The causal rule alone is the kernel's own: no launches to lay out each query's keys.
    in_kernel = is_causal and key_lengths is None
    limits = None if in_kernel else _row_limits(xp, key_lengths, is_causal, batch_shape, n, m, query.device)
    output = kernel(flash, q, k, v, limits, scale, in_kernel)
    return xp.reshape(output, (*batch_shape, n, value.shape[-1]))


def _as_slices(xp: Any, array: Any, batch_shape: tuple[int, ...]) -> Any:
    """``array`` ``(..., rows, features)`` as ``(slices, rows, features)``,
    broadcast over ``batch_shape`` (a view where it can be, a copy after)."""
    if tuple(array.shape[:-2]) != batch_shape:
        array = xp.broadcast_to(array, (*batch_shape, *array.shape[-2:]))
    return xp.reshape(array, (math.prod(batch_shape), *array.shape[-2:]))


def _mask_slices(xp: Any, mask: Any, batch_shape: tuple[int, ...], device: Any) -> Any:
    """``(slices,)``: for a ``mask`` with leading axes over several slices,
    each slice's entry of them (flattened); None for a mask that every slice
    shares (or none).  attnx's checks keep a mask's leading axes within
    ``batch_shape``, which they broadcast to."""
    if mask is None or math.prod(mask.shape[:-2]) <= 1:
        return None
    leading = tuple(mask.shape[:-2])
    entries = xp.reshape(xp.arange(math.prod(leading), device=device), leading)
    return xp.reshape(xp.broadcast_to(entries, batch_shape), (-1,))


def _mask_block(
    xp: Any,
    mask: Any,
    mask_slices: Any,
    block: tuple[int, int, int, int, int, int],
    batch_shape: tuple[int, ...],
    n: int,
    m: int,
    dtype: Any,
    device: Any,
) -> Any:
    """The user's ``mask`` for the block ``(s0, s1, r0, r1, c0, c1)`` of
    slices, queries and keys, boolean or real in ``dtype``: ``(s1 - s0,
    rows, keys)`` where it has entries per slice (``mask_slices``), taken by
    integer indexing, else without its leading axes, ``(rows, keys)`` or any
    shape that broadcasts to it."""
    s0, s1, r0, r1, c0, c1 = block
    cut = natives.combined_mask(
        xp,
        mask=mask,
        key_lengths=None,
        is_causal=False,
        batch_shape=batch_shape,
        n=n,
        m=m,
        dtype=dtype,
        device=device,
        rows=(r0, r1),
        cols=(c0, c1),
    )
    if mask_slices is not None:
        entries = xp.reshape(cut, (-1, *cut.shape[-2:]))
        return xp.take(entries, mask_slices[s0:s1], axis=0)
    return xp.reshape(cut, cut.shape[-2:]) if cut.ndim > 2 else cut


def _columns(mask: Any, c0: int, c1: int) -> Any:
    """The keys ``c0:c1`` of a block's ``mask`` (one without the keys' axis,
    or with size 1 there, applies whole)."""
    return mask[..., c0:c1] if mask.ndim > 0 and mask.shape[-1] != 1 else mask


def _masked(xp: Any, scores: Any, mask: Any) -> Any:
    """``scores`` with their block's ``mask`` applied: ``-inf`` where a
    boolean mask forbids, a real one added."""
    if mask.dtype == xp.bool:
        return xp.where(mask, scores, xp.asarray(-math.inf, dtype=scores.dtype, device=scores.device))
    scores += mask
    return scores


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
    ``backend`` is bound by it.  Declines the weights and calls with no
    query, key or feature.  A float16 call without a ``mask``,
    ``key_lengths`` or ``chunk_size`` goes to cuDNN where it takes it
    (:mod:`cupy_cudnn`).  A call without a ``mask`` or a ``chunk_size``
    goes to the fused kernel (:mod:`cupy_flash`) where :func:`prefers_fused`
    and the kernel's plan take it; the rest to :func:`attend`'s blocks."""
    import array_api_compat.cupy as xp

    n, m = query.shape[-2], key.shape[-2]
    if (
        return_weights
        or query.dtype.name not in DTYPES
        or 0 in (n, m, query.shape[-1], value.shape[-1], math.prod(batch_shape))
    ):
        return NotImplemented
    if mask is None and chunk_size is None:
        route = _cudnn_route(
            xp, query, key, value, key_lengths, is_causal, scale, batch_shape, device_index=query.device.id
        )
        if route is not None:  # half precision on the tensor cores
            with query.device:
                return _attend_cudnn(xp, *route, query, key, value, batch_shape)
    # Grouped heads that did not fold into rows: these kernels read one key slice
    # per query slice, so they would copy each key for each query head of its
    # group; attnx's generic algorithm broadcasts them in CuPy's matmul instead.
    if natives.key_groups(query.shape, key.shape, value.shape) > 1:
        return NotImplemented
    dtype, compute = query.dtype, blocks.state_dtype(xp, query.dtype)  # attnx's rule: half precision in float32
    if compute != dtype:
        query, key, value = (xp.astype(a, compute) for a in (query, key, value))
    if not isinstance(scale, float):  # a 0-d array, in the inputs' dtype
        scale = xp.astype(scale, query.dtype)
    slices, budget = math.prod(batch_shape), get_memory_budget(backend, query.device)
    fused, kernel = None, cupy_flash.attend
    # A mask goes to attend's blocks, and so does a chunk_size, which asks for them.
    if mask is None and chunk_size is None:
        d_k, d_v, device = query.shape[-1], value.shape[-1], query.device.id
        if TILED_FORWARD:
            shared, filling = cupy_tiled.device_shared_bytes(device), cupy_tiled.device_blocks(device)
            fused, kernel = (
                cupy_tiled.plan(query.dtype.name, d_k, d_v, n, m, slices, shared, filling),
                cupy_tiled.attend,
            )
        if fused is None and prefers_fused(slices, n, m, d_k + d_v, query.dtype.itemsize, is_causal, budget):
            fused, kernel = cupy_flash.plan(query.dtype.name, d_k, d_v, n, m, slices), cupy_flash.attend
    with query.device:
        if fused is not None:
            output = attend_fused(
                xp,
                kernel,
                fused,
                query=query,
                key=key,
                value=value,
                key_lengths=key_lengths,
                is_causal=is_causal,
                scale=scale,
                batch_shape=batch_shape,
            )
        else:
            output = attend(
                xp,
                cupy_row_softmax,
                query=query,
                key=key,
                value=value,
                mask=mask,
                key_lengths=key_lengths,
                is_causal=is_causal,
                scale=scale,
                batch_shape=batch_shape,
                budget=budget,
                chunks=chunks if chunk_size is not None else None,
            )
    return output if output.dtype == dtype else xp.astype(output, dtype)


def _cudnn_route(
    xp: Any,
    query: Any,
    key: Any,
    value: Any,
    key_lengths: Any,
    is_causal: bool,
    scale: Any,
    batch_shape: tuple[int, ...],
    *,
    device_index: int,
    training: bool = False,
) -> tuple[Any, Any] | None:
    """``(call, lengths)`` where cuDNN takes this call without a ``mask`` or
    ``chunk_size`` (:mod:`cupy_cudnn`) on the GPU ``device_index``, else
    None.  ``lengths``: each key slice's keys ``(slices,)``, where
    ``key_lengths`` are one number a slice (not one a query); else None.
    Shapes decide, never values: the plan's rules first, so that a call
    cuDNN does not take (float32, causal with lengths) costs no launch."""
    n, m = query.shape[-2], key.shape[-2]
    groups = natives.key_groups(query.shape, key.shape, value.shape)
    if key_lengths is not None and groups > 1:  # lengths may differ within a group
        return None
    if n == 1:  # one query, aligned to the last key: the causal rule keeps every key
        is_causal = False
    call = cupy_cudnn.plan(
        query.dtype.name,
        slices=math.prod(batch_shape) // groups,
        groups=groups,
        n=n,
        m=m,
        d_k=query.shape[-1],
        d_v=value.shape[-1],
        is_causal=is_causal,
        lengths=key_lengths is not None,
        scale=scale,
        device=device_index,
        training=training,
    )
    if call is None:
        return None
    if key_lengths is None:
        return call, None
    counts = natives.key_counts(xp, key_lengths, False, batch_shape, n, m, device=query.device)
    if n > 1 and counts.shape[-1] != 1:  # one length a query: they may differ within a slice
        return None
    counts = xp.reshape(xp.broadcast_to(counts[..., :1], (*batch_shape, 1)), (-1,))
    return call, counts


def _cudnn_layout(xp: Any, call: Any, query: Any, key: Any, value: Any, batch_shape: tuple[int, ...]) -> list[Any]:
    """The arrays in the leading shapes ``call`` reads: queries in
    ``batch_shape``, keys and values in it too, or, with grouped heads, with
    1 in place of its last axis (broadcast to them where they were smaller:
    a copy)."""
    key_shape = (*batch_shape[:-1], 1) if call.groups > 1 else batch_shape
    return [
        array if tuple(array.shape[:-2]) == shape else xp.broadcast_to(array, (*shape, *array.shape[-2:]))
        for array, shape in ((query, batch_shape), (key, key_shape), (value, key_shape))
    ]


def _attend_cudnn(
    xp: Any, call: Any, lengths: Any, query: Any, key: Any, value: Any, batch_shape: tuple[int, ...]
) -> Any:
    """cuDNN's attention (:func:`_cudnn_route`'s call), ``(*batch_shape, n,
    d_v)``.  Rows of a slice of no keys get zeros, as attnx gives: cuDNN
    leaves them undefined."""
    output, _ = cupy_cudnn.attend(call, *_cudnn_layout(xp, call, query, key, value, batch_shape), lengths)
    if lengths is None:
        return output
    has_keys = xp.reshape(lengths > 0, (*batch_shape, 1, 1))
    return xp.where(has_keys, output, xp.zeros((), dtype=output.dtype))


def scaled_dot_product_attention_vjp(
    *,
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
) -> Any:
    """attnx's native entry point for ``vjp(scaled_dot_product_attention)``
    (see :meth:`attnx.Backend.implementations`), ``(output, backward)``:
    half precision through cuDNN's forward, which keeps each row's
    statistics, and cuDNN's backward (:mod:`cupy_cudnn`); float32 through
    the tiled kernels (:func:`tiled_vjp`); ``NotImplemented`` for the rest
    (attnx's generic backward, in tiles of the GPU's blocks)."""
    import array_api_compat.cupy as xp

    if (
        mask is not None
        or chunk_size is not None
        or 0 in (query.shape[-2], key.shape[-2], query.shape[-1], value.shape[-1], math.prod(batch_shape))
    ):
        return NotImplemented
    route = None
    if key_lengths is None:
        route = _cudnn_route(
            xp, query, key, value, None, is_causal, scale, batch_shape, device_index=query.device.id, training=True
        )
    if route is None:
        with query.device:
            found = tiled_vjp(
                xp,
                cupy_tiled.attend,
                cupy_tiled_backward.attend,
                query=query,
                key=key,
                value=value,
                key_lengths=key_lengths,
                is_causal=is_causal,
                scale=scale,
                batch_shape=batch_shape,
                shared_limit=cupy_tiled.device_shared_bytes(query.device.id),
            )
        if found is NotImplemented:
            return found
        output, tiled_backward = found

        def on_device(cotangent: Any) -> tuple[Any, Any, Any, Any]:
            with query.device:
                return tiled_backward(cotangent)

        return output, on_device
    call = route[0]
    with query.device:
        # C-ordered once: the backward reads the same arrays (a broadcast key is a copy)
        laid = cupy_cudnn.c_ordered(*_cudnn_layout(xp, call, query, key, value, batch_shape))
        output, stats = cupy_cudnn.attend(call, *laid)

    def backward(cotangent: Any) -> tuple[Any, Any, Any, Any]:
        with query.device:
            d_query, d_key, d_value = cupy_cudnn.attend_backward(call, *laid, output, cotangent, stats)
        return d_query, d_key, d_value, None  # the route takes a float scale only: it has no cotangent

    return output, backward


#: The tiled kernels' forward and backward (:func:`cupy_tiled.attend` and
#: :func:`cupy_tiled_backward.attend`'s signatures).
TiledAttend = Callable[..., Any]
TiledBackward = Callable[..., tuple[Any, Any, Any]]


def tiled_vjp(
    xp: Any,
    attend_kernel: TiledAttend,
    backward_kernel: TiledBackward,
    *,
    query: Any,
    key: Any,
    value: Any,
    key_lengths: Any,
    is_causal: bool,
    scale: Any,
    batch_shape: tuple[int, ...],
    shared_limit: int,
) -> Any:
    """``(output, backward)`` of a float32 call without a mask in the tiled
    kernels (:mod:`cupy_tiled`): the forward keeps each row's log-sum-exp,
    the backward recomputes each tile's weights from it in two launches
    (the queries' gradients; the keys' and values'), so that training holds
    no tile of scores, FlashAttention-2's way.  The backward gives
    ``(d_query, d_key, d_value, None)`` over ``batch_shape`` (attnx sums
    them to the inputs' shapes).  ``NotImplemented`` for other dtypes, a
    scale that is an array (its gradient is the generic backward's),
    grouped heads that do not fold, and features the kernels do not hold
    (in registers, or in the GPU's ``shared_limit`` bytes a block)."""
    n, m, d_k, d_v = query.shape[-2], key.shape[-2], query.shape[-1], value.shape[-1]
    slices = math.prod(batch_shape)
    if (
        query.dtype != xp.float32
        or not isinstance(scale, float)
        or natives.key_groups(query.shape, key.shape, value.shape) > 1
    ):
        return NotImplemented
    forward = cupy_tiled.plan("float32", d_k, d_v, n, m, slices, shared_limit)
    backward_plans = cupy_tiled_backward.plans("float32", d_k, d_v, n, m, slices, shared_limit)
    if forward is None or backward_plans is None:
        return NotImplemented
    # Laid out once: the backward reads the same slices (a broadcast key is a copy).
    laid = [_as_slices(xp, array, batch_shape) for array in (query, key, value)]
    # The kernels apply the causal rule themselves; the key lengths come as each query's count.
    limits = _row_limits(xp, key_lengths, False, batch_shape, n, m, query.device)
    output, stats = attend_kernel(forward, *laid, limits, scale, is_causal, with_stats=True)

    def backward(cotangent: Any) -> tuple[Any, Any, Any, Any]:
        cotangent = _as_slices(xp, cotangent, batch_shape)
        gradients = backward_kernel(backward_plans, *laid, output, stats, cotangent, limits, scale, is_causal)
        d_query, d_key, d_value = (xp.reshape(gradient, (*batch_shape, *gradient.shape[1:])) for gradient in gradients)
        return d_query, d_key, d_value, None  # a float scale only: it has no cotangent

    return xp.reshape(output, (*batch_shape, n, d_v)), backward


def call_plan(backend: Any, arguments: Mapping[str, Any]) -> Callable[..., Any] | None:
    """A plan (:meth:`attnx.Backend.specialize`) for the calls this native
    takes without a ``mask``, ``key_lengths`` or ``chunk_size`` and with a
    float ``scale``: attnx's checks and dispatch cost some 45 us a call on
    the host (docs/archive/bench-sessions.md, seventh GPU run), as much as
    the GPU's work in a small call.  float16 calls that cuDNN takes go
    straight to it; the rest to the native, which chooses its kernel at
    every call (the memory budget may change)."""
    query, key, value = arguments["query"], arguments["key"], arguments["value"]
    batch_shape, is_causal, scale = arguments["batch_shape"], arguments["is_causal"], arguments["scale"]
    if (
        arguments["mask"] is not None
        or arguments["key_lengths"] is not None
        or arguments["chunk_size"] is not None
        or arguments["return_weights"]
        or type(scale) is not float
        or query.dtype.name not in DTYPES
        or 0 in (query.shape[-2], key.shape[-2], query.shape[-1], value.shape[-1], math.prod(batch_shape))
    ):
        return None  # the native declines these, or they differ from call to call
    import array_api_compat.cupy as xp

    route = _cudnn_route(xp, query, key, value, None, is_causal, scale, batch_shape, device_index=query.device.id)
    if route is not None:

        def cudnn_plan(query: Any, key: Any, value: Any) -> Any:
            with query.device:
                return _attend_cudnn(xp, *route, query, key, value, batch_shape)

        return cudnn_plan
    if natives.key_groups(query.shape, key.shape, value.shape) > 1:
        return None  # the native declines grouped heads outside cuDNN (see scaled_dot_product_attention)
    options = {name: value for name, value in arguments.items() if name not in ("query", "key", "value")}

    def native_plan(query: Any, key: Any, value: Any) -> Any:
        return scaled_dot_product_attention(query=query, key=key, value=value, backend=backend, **options)

    return native_plan
