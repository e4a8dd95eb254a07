"""The CuPy backend's fused attention: one kernel, the scores never written.

:mod:`cupy_attention` computes a block of scores with a matrix product,
turns them into exponentials in place (its row softmax kernel) and
multiplies them by the values: each step a pass over the scores in GPU
memory, and some ten launches a block.  At (1, 8, 8192, 64) on an H200
that is 1.42x PyTorch's SDPA, and at n = 512, where the call waits on its
launches, 3.9x (docs/archive/bench-sessions.md, sixth GPU run).

Here one launch computes the whole call, FlashAttention's way on the
GPU's float units: a block of threads holds :data:`FlashPlan.rows`
queries (a thread each, its running maximum, sum and output in
registers) and walks the keys in tiles of :data:`FlashPlan.keys`, each
tile and its values loaded once into shared memory for all the block's
queries.  Each tile's scores live in registers: the tile's maximum
rescales what the thread has summed so far (the online softmax), its
exponentials are added to the sum and multiply the tile's values.  The
causal rule alone is applied in the kernel, from each query's position;
``key_lengths`` arrive as one number per query, the keys it attends
(:func:`attnx.natives.key_counts`, the causal rule included): a block stops at the
furthest key any of its queries attends, so a causal call computes about
half the scores, and the blocks with the most keys start first.

The kernel takes no ``mask`` (a mask that need not keep a prefix of each
row goes to :mod:`cupy_attention`), and inputs whose features fit its
registers (:func:`plan`).  A row with no key to attend gets zeros, as
attnx's algorithm gives; a NaN score propagates to its row, as there.

It does its products on the float units, one query a thread, where cuBLAS
(attend's blocks) tiles them for the GPU's caches: on an H200 (eighth GPU
run) it is the faster only where launches decide, in small calls
(0.52x-0.70x of attend's blocks up to 256 x 256 scores a slice) and in
calls that a small memory budget cuts into many blocks (0.01x-0.88x from 8
of them), and :func:`cupy_attention.prefers_fused` sends it those.  At the
default budget from 512 x 512 scores a slice it takes 1.1x-1.9x the
blocks' time (2.9x-3.2x at d = 128), in 16 MiB where they hold 556 MiB at
(1, 8, 8192, 64).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy

from . import cupy_launch

#: The kernel, written once for ``T`` (float or double) and the sizes of
#: :func:`kernel_source`: ``D``/``DV`` the query's and value's features,
#: ``DP``/``DVP`` those padded to whole vectors ``V`` of ``VEC`` numbers
#: (16 bytes: shared memory serves a vector a load), ``ROWS`` the block's
#: queries (its threads) and ``KEYS`` a tile's keys.  Each block is one
#: slice's ``ROWS`` queries; ``limits`` (one int a query, where
#: ``has_limits``) are the keys each may attend.
FLASH_SOURCE = r"""
__device__ __forceinline__ T nan_max(T a, T b) { return (a != a || a > b) ? a : b; }
__device__ __forceinline__ T part(const V& v, int c) { return reinterpret_cast<const T*>(&v)[c]; }

#define QROWS (ROWS * QPT)

extern "C" __global__ void __launch_bounds__(ROWS) KERNEL_NAME(
        const T* __restrict__ query, const T* __restrict__ key, const T* __restrict__ value,
        T* __restrict__ output, const int* __restrict__ limits, const int has_limits, const int causal,
        const int n, const int m, const int row_blocks, const T scale) {
    // A row of queries is padded by one vector, so that the threads' loads of
    // their own rows fall in different banks.
    __shared__ __align__(16) T queries[QROWS][DP + VEC];
    __shared__ __align__(16) T keys[KEYS][DP];
    __shared__ __align__(16) T values[KEYS][DVP];
    __shared__ int block_stop;
    const T minus_infinity = MINUS_INFINITY;
    const int t = threadIdx.x;
    const long long slice = blockIdx.x / row_blocks;
    // The blocks of a slice's last queries first: under the causal rule they have the most keys.
    const int first_row = (row_blocks - 1 - (int)(blockIdx.x % row_blocks)) * QROWS;
    const T* q = query + (slice * n + first_row) * D;
    const T* k = key + slice * m * D;
    const T* v = value + slice * m * DV;

    for (int i = t; i < QROWS * DP; i += ROWS) {
        const int r = i / DP, e = i % DP;
        queries[r][e] = (first_row + r < n && e < D) ? q[(long long)r * D + e] * scale : (T)0;
    }
    // Thread t holds the queries t, t + ROWS, ...: neighbours read neighbouring rows.
    int limit[QPT];
    if (t == 0) block_stop = 0;
    __syncthreads();
#pragma unroll
    for (int r = 0; r < QPT; ++r) {
        const int row = first_row + t + r * ROWS;
        limit[r] = m;
        if (has_limits) {
            limit[r] = row < n ? limits[slice * n + row] : 0;
            limit[r] = limit[r] < 0 ? 0 : (limit[r] > m ? m : limit[r]);
        }
        if (causal) {  // attnx's alignment: query i attends the keys j <= i + m - n
            const int keys_seen = row + 1 + m - n;
            limit[r] = keys_seen < 0 ? 0 : (keys_seen < limit[r] ? keys_seen : limit[r]);
        }
        if (row < n) atomicMax(&block_stop, limit[r]);
    }
    __syncthreads();
    const int stop = block_stop;

    T most[QPT], total[QPT];
    T out[QPT][DVP];
#pragma unroll
    for (int r = 0; r < QPT; ++r) {
        most[r] = minus_infinity;
        total[r] = 0;
#pragma unroll
        for (int e = 0; e < DVP; ++e) out[r][e] = 0;
    }

    for (int first_key = 0; first_key < stop; first_key += KEYS) {
        __syncthreads();  // the last tile's reads are done
        for (int i = t; i < KEYS * DP; i += ROWS) {
            const int j = i / DP, e = i % DP;
            keys[j][e] = (first_key + j < m && e < D) ? k[(long long)(first_key + j) * D + e] : (T)0;
        }
        for (int i = t; i < KEYS * DVP; i += ROWS) {
            const int j = i / DVP, e = i % DVP;
            values[j][e] = (first_key + j < m && e < DV) ? v[(long long)(first_key + j) * DV + e] : (T)0;
        }
        __syncthreads();

        // A key's vector read from shared memory serves the thread's QPT queries.
        T scores[QPT][KEYS];
#pragma unroll
        for (int r = 0; r < QPT; ++r)
#pragma unroll
            for (int j = 0; j < KEYS; ++j) scores[r][j] = 0;
#pragma unroll
        for (int e = 0; e < DP; e += VEC) {
            V qv[QPT];
#pragma unroll
            for (int r = 0; r < QPT; ++r) qv[r] = *reinterpret_cast<const V*>(&queries[t + r * ROWS][e]);
#pragma unroll
            for (int j = 0; j < KEYS; ++j) {
                const V kv = *reinterpret_cast<const V*>(&keys[j][e]);
#pragma unroll
                for (int r = 0; r < QPT; ++r)
#pragma unroll
                    for (int c = 0; c < VEC; ++c) scores[r][j] += part(qv[r], c) * part(kv, c);
            }
        }
        T weights[QPT][KEYS];
#pragma unroll
        for (int r = 0; r < QPT; ++r) {
            T tile_most = most[r];
#pragma unroll
            for (int j = 0; j < KEYS; ++j)
                if (first_key + j < limit[r]) tile_most = nan_max(tile_most, scores[r][j]);
            // With no finite score yet, shift by 0: exp(-inf - 0) weighs 0 where exp(-inf + inf) is NaN.
            const T shift = tile_most == minus_infinity ? (T)0 : tile_most;
            const T correction = EXP(most[r] - shift);
            total[r] *= correction;
#pragma unroll
            for (int e = 0; e < DVP; ++e) out[r][e] *= correction;
#pragma unroll
            for (int j = 0; j < KEYS; ++j) {
                weights[r][j] = first_key + j < limit[r] ? EXP(scores[r][j] - shift) : (T)0;
                total[r] += weights[r][j];
            }
            most[r] = tile_most;
        }
#pragma unroll
        for (int j = 0; j < KEYS; ++j) {
#pragma unroll
            for (int e = 0; e < DVP; e += VEC) {
                const V vv = *reinterpret_cast<const V*>(&values[j][e]);
#pragma unroll
                for (int r = 0; r < QPT; ++r)
#pragma unroll
                    for (int c = 0; c < VEC; ++c) out[r][e + c] += weights[r][j] * part(vv, c);
            }
        }
    }
#pragma unroll
    for (int r = 0; r < QPT; ++r) {
        const int row = first_row + t + r * ROWS;
        if (row < n) {
            // A row with no key (its sum 0) gets its zeros divided by 1.
            const T divisor = total[r] == 0 ? (T)1 : total[r];
            T* o = output + (slice * n + row) * DV;
#pragma unroll
            for (int e = 0; e < DV; ++e) o[e] = out[r][e] / divisor;
        }
    }
}
"""

#: Per dtype: the C type, its vector of 16 bytes, its exponential and -inf
#: (NVRTC defines no INFINITY).
_TYPES = {
    "float32": ("float", "float4", "expf", "__int_as_float(0xff800000)"),
    "float64": ("double", "double2", "exp", "__longlong_as_double(0xfff0000000000000LL)"),
}
#: What a block may hold in shared memory without asking for more (CUDA's
#: static limit, less the block's stopping key).
SHARED_BYTES = 48 * 1024 - 16
#: What a thread's running output and a tile's scores may take in
#: registers (of the 255 a thread has).  Compiled for sm_90 by CUDA 13's
#: ptxas, 478 plans of 11 x 11 float32 and 8 x 8 float64 feature sizes:
#: 435 spill nothing, 43 spill 4-128 bytes to memory (float64 values of 64
#: features, 72-128; float32 of 136, 4-44); float64 with 64 features in
#: tiles of 16 keys (640 bytes) spilled 236.
REGISTER_BYTES = 576
#: A tile's keys, largest first: the first whose scores fit REGISTER_BYTES.
#: On an H200, float32, d = 64, blocks of 128 queries, tiles of 8 keys
#: against 16 (docs/archive/bench-sessions.md, eighth GPU run): (1, 8, 8192, 64) 7.29 ms
#: against 8.52, (16, 8, 1024, 64) 1.73 against 1.80, (1, 8, 512, 64) 0.226
#: against 0.246; causal (1, 8, 8192, 64) 4.66 against 4.38.  Fewer
#: registers a thread, more threads a multiprocessor.
KEY_CHOICES = (8,)
#: The queries a block may hold, largest first: the first that the shared
#: memory holds and that leaves less than a warp of its threads without a
#: query.  Larger blocks read each tile of keys for more queries: 128 rows
#: took 0.93x the time of 64 and 0.68x-0.76x that of 32 at (1, 8, 8192, 64),
#: (16, 8, 1024, 64) and (1, 8, 512, 64), even where 32 made four times the
#: blocks (512 queries: 32 blocks of 128 on 132 multiprocessors).
ROW_CHOICES = (128, 64, 32)
#: The queries a thread holds, largest first: the first whose outputs and
#: scores fit its registers.  Each vector of a key or a value read from
#: shared memory then serves that many queries' products.
QUERY_CHOICES = (1,)


@dataclasses.dataclass(frozen=True)
class FlashPlan:
    """A launch of the kernel: ``rows`` threads a block, each holding
    ``queries`` queries (a block holds ``rows * queries``), ``keys`` a tile,
    the features padded to whole vectors."""

    dtype_name: str
    d_k: int
    d_v: int
    rows: int
    keys: int
    queries: int = 1

    @property
    def vector(self) -> int:
        return 16 // _ITEMSIZE[self.dtype_name]

    @property
    def block_queries(self) -> int:
        """The queries a block holds."""
        return self.rows * self.queries


_ITEMSIZE = {"float32": 4, "float64": 8}


def plan(dtype_name: str, d_k: int, d_v: int, n: int, m: int, slices: int) -> FlashPlan | None:
    """The kernel's blocks for a call, or None where it can't take it (a
    dtype other than float32 or float64, features past its registers,
    positions past its int32 or a grid past CUDA's).

    Keys come in tiles of :data:`KEY_CHOICES` (8), whose scores and a
    thread's output fit :data:`REGISTER_BYTES` up to 136 features in
    float32 and 64 in float64, for each of a thread's
    :data:`QUERY_CHOICES` queries; threads in blocks of
    :data:`ROW_CHOICES` whose queries fit the shared memory with the
    tiles: 128 threads of one query up to 80 features in float32 and 40 in
    float64, 64 above (fewer where the call has fewer queries)."""
    itemsize = _ITEMSIZE.get(dtype_name)
    # Positions (a block's first query past the last among them) in int32, the grid in CUDA's 2**31 - 1.
    if itemsize is None or max(n, m) >= 2**31 - 512 or slices * -(-n // min(ROW_CHOICES, default=1)) >= 2**31:
        return None
    vector = 16 // itemsize
    padded_k, padded_v = cupy_launch.padded(d_k, vector), cupy_launch.padded(d_v, vector)
    fitting = [
        (queries, keys)
        for queries in QUERY_CHOICES
        for keys in KEY_CHOICES
        if queries * (max(padded_k, padded_v) + keys) * itemsize <= REGISTER_BYTES
    ]
    if not fitting:
        return None
    queries, keys = fitting[0]
    shared = [
        rows
        for rows in ROW_CHOICES
        if (rows * queries * (padded_k + vector) + keys * (padded_k + padded_v)) * itemsize <= SHARED_BYTES
    ]
    useful = [rows for rows in shared if rows * queries - n < 32] or shared[-1:]  # less than a warp idle
    if not useful:
        return None
    return FlashPlan(dtype_name, d_k, d_v, useful[0], keys, queries)


def kernel_source(flash: FlashPlan) -> str:
    """The kernel's CUDA source for one plan."""
    c_type, vector_type, exponential, minus_infinity = _TYPES[flash.dtype_name]
    sizes = {
        "D": flash.d_k,
        "DV": flash.d_v,
        "VEC": flash.vector,
        "DP": cupy_launch.padded(flash.d_k, flash.vector),
        "DVP": cupy_launch.padded(flash.d_v, flash.vector),
        "ROWS": flash.rows,
        "KEYS": flash.keys,
        "QPT": flash.queries,
    }
    header = f"typedef {c_type} T;\ntypedef {vector_type} V;\n#define EXP {exponential}\n"
    header += f"#define MINUS_INFINITY {minus_infinity}\n"
    header += "".join(f"#define {name} {size}\n" for name, size in sizes.items())
    return header + FLASH_SOURCE.replace("KERNEL_NAME", kernel_name(flash))


def kernel_name(flash: FlashPlan) -> str:
    name = f"flash_{flash.dtype_name}_{flash.d_k}_{flash.d_v}_{flash.rows}_{flash.keys}"
    return name if flash.queries == 1 else f"{name}_{flash.queries}"


def attend(
    flash: FlashPlan,
    query: Any,
    key: Any,
    value: Any,
    limits: Any,
    scale: float,
    causal: bool = False,
    *,
    arrays: Any = None,
    run: cupy_launch.Run | None = None,
) -> Any:
    """The attention of CuPy arrays ``(slices, n, d_k)``, ``(slices, m,
    d_k)`` and ``(slices, m, d_v)`` (C-ordered, in ``flash``'s dtype), each
    query's scores ``scale`` times its dot products, ``limits``
    ``(slices, n)`` the keys each attends (or None for every key), and
    ``causal`` the causal rule applied in the kernel besides:
    ``(slices, n, d_v)``, one launch.  Inputs laid out otherwise are
    copied.  ``arrays`` and ``run``: CuPy and :func:`cupy_launch.run`
    (the tests' are NumPy and a launch on the CPU)."""
    arrays, run = arrays or cupy_launch.cupy_arrays(), run or cupy_launch.run
    query, key, value = (arrays.ascontiguousarray(array) for array in (query, key, value))
    output = arrays.empty((query.shape[0], query.shape[1], flash.d_v), dtype=query.dtype)
    limits, has_limits = cupy_launch.limits_argument(limits, arrays)
    grid, block, arguments = launch(flash, query, key, value, output, limits, scale, causal, has_limits=has_limits)
    run(kernel_source(flash), kernel_name(flash), 0, grid, block, arguments)
    return output


def launch(
    flash: FlashPlan,
    query: Any,
    key: Any,
    value: Any,
    output: Any,
    limits: Any,
    scale: float,
    causal: bool,
    *,
    has_limits: bool,
) -> tuple[tuple[int], tuple[int], tuple[Any, ...]]:
    """``(grid, block, arguments)`` of the kernel's launch on C-ordered
    arrays laid out as :func:`attend` lays them out, ``limits`` an int32
    array (read where ``has_limits``).  Written from their shapes alone, so
    that the tests launch the same source on the CPU
    (``tests/cuda_on_cpu.py``)."""
    slices, n, m = query.shape[0], query.shape[1], key.shape[1]
    row_blocks = -(-n // flash.block_queries)
    arguments = (query, key, value, output, limits, *map(numpy.int32, (has_limits, causal, n, m, row_blocks)))
    return (slices * row_blocks,), (flash.rows,), (*arguments, query.dtype.type(scale))
