"""The CuPy backend's fused attention in shared tiles: float32, each thread
a 4 x 4 tile of scores.

:mod:`cupy_flash` gives each thread one query and walks a tile of keys
read from shared memory: every vector of 4 features it reads, of a key or
a value, serves 4 multiply-adds.  On an H200 it takes 1.4x-2.9x PyTorch's
SDPA in float32 (ninth GPU run).

Here a block of 128 threads holds 64 queries and walks the keys in tiles
of 32 (:data:`TILE_CHOICES`: 4 queries and 4 keys a thread), FlashAttention's way
on the float units, the products tiled as a matrix product's are:

- each thread computes 4 queries' scores against 4 keys (the queries
  ``ty + 16 r``, the keys ``tx + 8 c``: neighbouring threads read
  neighbouring rows of shared memory, whose rows are padded by a vector
  so that they fall in different banks), a vector of 4 features of each
  read once for 4 products: 64 multiply-adds for 8 loads, twice
  cupy_flash's share;
- the 8 threads that share a query (neighbouring lanes of one warp) join
  its tile's maximum by shuffles; each keeps its own part of the sum
  (the online softmax's correction is the same for all 8), joined once at
  the end;
- the tile's exponentials go to shared memory, and each thread multiplies
  its 4 queries' weights by 4 keys' values at a time into its outputs: the
  value features ``tx * 4 + 32 q``, a vector each (at 64 features, 128
  multiply-adds for 12 loads).

A call of few blocks of queries (decoding: a query a sequence) would
leave most of the GPU idle, each block walking all the keys; there the
keys are cut in splits (:attr:`TiledPlan.splits`), each walked by blocks
of its own that keep their rows' log-sum-exp, and a combine kernel joins
them (FlashDecoding's split keys).

The contract is :mod:`cupy_flash`'s (:func:`attend`): no ``mask``, the
causal rule applied in the kernel, ``key_lengths`` as each query's count of
keys, a row with no key gets zeros and a NaN score its row's NaN.  Its
source runs on the CPU in the tests (``tests/cuda_on_cpu.py``); ptxas
(CUDA 13, sm_90) gives it 140 registers at 64 features, none spilled,
and 168 at 128, 20 bytes spilled (:data:`REGISTERS`).  Its backward is
:mod:`cupy_tiled_backward`'s.  ``attnx.vjp`` of float32 takes both; inference joins it
(``cupy_attention.TILED_FORWARD``) when a GPU has timed it against
:mod:`cupy_flash` and the blocks (``bench/gpu_checks.py tiled_outputs
tiled_times decode_times``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy

from . import cupy_launch

#: Device functions both sources use: a vector's part, a vector read from
#: shared memory, a maximum that keeps NaN, and a vector's multiple added
#: to four accumulators.
HELPERS_SOURCE = r"""
__device__ __forceinline__ float part(const float4& v, int c) { return reinterpret_cast<const float*>(&v)[c]; }
__device__ __forceinline__ float4 vector_at(const float* p) { return *reinterpret_cast<const float4*>(p); }
__device__ __forceinline__ float nan_max(float a, float b) { return (a != a || a > b) ? a : b; }
__device__ __forceinline__ void add_scaled(float* accumulators, float weight, const float4& v) {
    accumulators[0] += weight * v.x;
    accumulators[1] += weight * v.y;
    accumulators[2] += weight * v.z;
    accumulators[3] += weight * v.w;
}
"""

TILED_SOURCE = r"""
#define THREADS 128
#define ROW_GROUPS 16                   // threads ty: queries ty + 16 r
#define KEY_GROUPS 8                    // threads tx: keys tx + 8 c, value features tx * 4 + 32 q
#define BQ (ROW_GROUPS * RM)            // a block's queries
#define BK (KEY_GROUPS * CN)            // a tile's keys
#define QS (DP + 4)                     // a row of queries or keys in shared memory, padded by a vector
#define PS (BK + 4)                     // a row of weights
#define VQ (DVP / 32)                   // a thread's vectors of output features

extern "C" __global__ void __launch_bounds__(THREADS) KERNEL_NAME(
        const float* __restrict__ query, const float* __restrict__ key, const float* __restrict__ value,
        float* __restrict__ output, float* __restrict__ stats, const int has_stats, const int* __restrict__ limits,
        const int has_limits, const int causal, const int n, const int m, const int row_blocks, const int slices,
        const int key_span, const float scale) {
    extern __shared__ __align__(16) float shared[];
    float* queries = shared;                 // [BQ][QS]
    float* keys = queries + BQ * QS;         // [BK][QS]
    float* values = keys + BK * QS;          // [BK][DVP]
    float* weights = values + BK * DVP;      // [BQ][PS]
    __shared__ int block_stop;
    const float minus_infinity = __int_as_float(0xff800000);
    const int t = threadIdx.x, ty = t / KEY_GROUPS, tx = t % KEY_GROUPS;
    // Block b: the keys [split * key_span, (split + 1) * key_span) of a slice's rows (its
    // output and statistics the split's own, joined by the combine kernel where there are several).
    const long long split = blockIdx.x / ((long long)slices * row_blocks);
    const long long slice = blockIdx.x / row_blocks % slices;
    // The blocks of a slice's last queries first: under the causal rule they have the most keys.
    const int first_row = (row_blocks - 1 - (int)(blockIdx.x % row_blocks)) * BQ;
    const int split_start = (int)split * key_span;
    const float* q = query + (slice * n + first_row) * D;
    const float* k = key + slice * m * D;
    const float* v = value + slice * m * DV;
    output += split * slices * n * DV;
    stats += has_stats ? split * slices * n : 0;

    for (int i = t; i < BQ * DP; i += THREADS) {
        const int r = i / DP, e = i % DP;
        queries[r * QS + e] = (first_row + r < n && e < D) ? q[(long long)r * D + e] * scale : 0.0f;
    }
    if (t == 0) block_stop = 0;
    __syncthreads();
    int limit[RM];
#pragma unroll
    for (int r = 0; r < RM; ++r) {
        const int row = first_row + ty + ROW_GROUPS * r;
        limit[r] = m;
        if (has_limits) {
            limit[r] = row < n ? limits[slice * n + row] : 0;
            limit[r] = limit[r] < 0 ? 0 : (limit[r] > m ? m : limit[r]);
        }
        if (causal) {  // attnx's alignment: query i attends the keys j <= i + m - n
            const int keys_seen = row + 1 + m - n;
            limit[r] = keys_seen < 0 ? 0 : (keys_seen < limit[r] ? keys_seen : limit[r]);
        }
        if (row >= n) limit[r] = 0;
        else atomicMax(&block_stop, limit[r]);
    }
    __syncthreads();
    const int stop = block_stop < split_start + key_span ? block_stop : split_start + key_span;

    float most[RM], partial[RM], out[RM][4 * VQ];
#pragma unroll
    for (int r = 0; r < RM; ++r) {
        most[r] = minus_infinity;
        partial[r] = 0.0f;
#pragma unroll
        for (int e = 0; e < 4 * VQ; ++e) out[r][e] = 0.0f;
    }

    for (int first_key = split_start; first_key < stop; first_key += BK) {
        __syncthreads();  // the last tile's reads are done
        for (int i = t; i < BK * DP; i += THREADS) {
            const int j = i / DP, e = i % DP;
            keys[j * QS + e] = (first_key + j < m && e < D) ? k[(long long)(first_key + j) * D + e] : 0.0f;
        }
        for (int i = t; i < BK * DVP; i += THREADS) {
            const int j = i / DVP, e = i % DVP;
            values[j * DVP + e] = (first_key + j < m && e < DV) ? v[(long long)(first_key + j) * DV + e] : 0.0f;
        }
        __syncthreads();

        float scores[RM][CN];
#pragma unroll
        for (int r = 0; r < RM; ++r)
#pragma unroll
            for (int c = 0; c < CN; ++c) scores[r][c] = 0.0f;
#pragma unroll 4
        for (int e = 0; e < DP; e += 4) {
            float4 qv[RM], kv[CN];
#pragma unroll
            for (int r = 0; r < RM; ++r) qv[r] = vector_at(&queries[(ty + ROW_GROUPS * r) * QS + e]);
#pragma unroll
            for (int c = 0; c < CN; ++c) kv[c] = vector_at(&keys[(tx + KEY_GROUPS * c) * QS + e]);
#pragma unroll
            for (int r = 0; r < RM; ++r)
#pragma unroll
                for (int c = 0; c < CN; ++c)
                    scores[r][c] += qv[r].x * kv[c].x + qv[r].y * kv[c].y + qv[r].z * kv[c].z + qv[r].w * kv[c].w;
        }
#pragma unroll
        for (int r = 0; r < RM; ++r) {
            float tile_most = most[r];
#pragma unroll
            for (int c = 0; c < CN; ++c)
                if (first_key + tx + KEY_GROUPS * c < limit[r]) tile_most = nan_max(tile_most, scores[r][c]);
#pragma unroll
            for (int o = KEY_GROUPS / 2; o > 0; o >>= 1)
                tile_most = nan_max(tile_most, __shfl_xor_sync(0xffffffff, tile_most, o));
            // With no finite score yet, shift by 0: exp(-inf - 0) weighs 0 where exp(-inf + inf) is NaN.
            const float shift = tile_most == minus_infinity ? 0.0f : tile_most;
            const float correction = expf(most[r] - shift);
            partial[r] *= correction;
#pragma unroll
            for (int e = 0; e < 4 * VQ; ++e) out[r][e] *= correction;
#pragma unroll
            for (int c = 0; c < CN; ++c) {
                const float weight = first_key + tx + KEY_GROUPS * c < limit[r] ? expf(scores[r][c] - shift) : 0.0f;
                partial[r] += weight;
                weights[(ty + ROW_GROUPS * r) * PS + tx + KEY_GROUPS * c] = weight;
            }
            most[r] = tile_most;
        }
        __syncwarp();  // a query's weights come from the 8 lanes of its own warp

#pragma unroll 2
        for (int j = 0; j < BK; j += 4) {
            float4 pv[RM];
#pragma unroll
            for (int r = 0; r < RM; ++r) pv[r] = vector_at(&weights[(ty + ROW_GROUPS * r) * PS + j]);
#pragma unroll
            for (int jj = 0; jj < 4; ++jj)
#pragma unroll
                for (int vq = 0; vq < VQ; ++vq) {
                    const float4 vv = vector_at(&values[(j + jj) * DVP + tx * 4 + 32 * vq]);
#pragma unroll
                    for (int r = 0; r < RM; ++r) add_scaled(&out[r][4 * vq], part(pv[r], jj), vv);
                }
        }
    }
#pragma unroll
    for (int r = 0; r < RM; ++r) {
        float total = partial[r];
#pragma unroll
        for (int o = KEY_GROUPS / 2; o > 0; o >>= 1) total += __shfl_xor_sync(0xffffffff, total, o);
        const int row = first_row + ty + ROW_GROUPS * r;
        if (row < n) {
            // The row's log-sum-exp for the backward: -inf for a row with no key.
            if (has_stats && tx == 0) stats[slice * n + row] = total == 0.0f ? minus_infinity : most[r] + logf(total);
            // A row with no key (its sum 0) gets its zeros divided by 1.
            const float divisor = total == 0.0f ? 1.0f : total;
            float* o = output + (slice * n + row) * DV;
#pragma unroll
            for (int vq = 0; vq < VQ; ++vq)
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const int feature = tx * 4 + 32 * vq + c;
                    if (feature < DV) o[feature] = out[r][4 * vq + c] / divisor;
                }
        }
    }
}
"""

#: The splits' outputs joined (a call whose keys :attr:`TiledPlan.splits`
#: cut, so that a call of few blocks of queries, decoding, fills the GPU):
#: each row's log-sum-exp ``L = log sum_s exp(l_s)`` and its output ``sum_s
#: exp(l_s - L) o_s`` from each split's ``l_s`` and ``o_s``; a split with no
#: key weighs 0, a row with none gets zeros, a NaN its row's NaN.  A block a
#: row, a thread a feature.
COMBINE_SOURCE = r"""
extern "C" __global__ void KERNEL_NAME(const float* __restrict__ outputs, const float* __restrict__ split_stats,
                                       float* __restrict__ output, float* __restrict__ stats, const int has_stats,
                                       const int splits, const long long rows) {
    const long long row = blockIdx.x;
    const float minus_infinity = __int_as_float(0xff800000);
    float most = minus_infinity;
    for (int s = 0; s < splits; ++s) most = nan_max(most, split_stats[s * rows + row]);
    const float shift = most == minus_infinity ? 0.0f : most;
    float total = 0.0f;
    for (int s = 0; s < splits; ++s) total += expf(split_stats[s * rows + row] - shift);
    for (int e = threadIdx.x; e < DV; e += blockDim.x) {
        float sum = 0.0f;
        for (int s = 0; s < splits; ++s) sum += expf(split_stats[s * rows + row] - shift) * outputs[(s * rows + row) * DV + e];
        output[row * DV + e] = total == 0.0f ? 0.0f : sum / total;
    }
    if (has_stats && threadIdx.x == 0) stats[row] = total == 0.0f ? minus_infinity : shift + logf(total);
}
"""


#: A block's threads (the source's THREADS): 16 groups of rows by 8 of keys.
THREADS = 128
#: The most features a query, key or value may have.
MAX_FEATURES = 128
#: A thread's (queries, keys of a tile), first first: the first whose
#: outputs and scores fit :data:`REGISTER_FLOATS`.  Until a GPU has timed
#: them (``bench/gpu_checks.py tiled_times``), 4 x 4: blocks of 64
#: queries, tiles of 32 keys.
TILE_CHOICES = ((4, 4),)
#: A thread's outputs and a tile's scores, in floats: 4 queries of 128
#: value features and 8 keys (96 floats) compile to 210 registers.
REGISTER_FLOATS = 96
#: Shared memory a block may ask for where the GPU says nothing: an A100's
#: (sm_80).  A GPU's own limit (:func:`device_shared_bytes`: 227 KiB on an
#: H100, 99 KiB on an RTX 4090, 64 KiB on a T4) decides where it is known;
#: CUDA gives 48 KiB unasked.
SHARED_LIMIT = 163 * 1024
#: Compiled by CUDA 13's ptxas for sm_90 (``nvcc -arch=sm_90 -Xptxas -v``),
#: the registers a thread of the forward uses by its features (queries'
#: and values' alike) in tiles of 4 x 4: none spilled up to 96, 20 bytes at
#: 128.  At 64, 140 registers and 43 KiB of shared memory leave a
#: multiprocessor three blocks (12 warps), as :mod:`cupy_flash`'s 136 and
#: 39 KiB do.  In tiles of 2 x 8 ptxas holds fewer and spills a little: 80
#: at 64 features (24 bytes spilled), 127 at 128 (none).
REGISTERS = {16: 111, 32: 96, 64: 140, 80: 128, 96: 128, 128: 168}


@dataclasses.dataclass(frozen=True)
class TiledPlan:
    """A launch of the kernel for queries and keys of ``d_k`` features and
    values of ``d_v``."""

    d_k: int
    d_v: int
    #: A thread's queries, and its keys of a tile: a block holds 16 times
    #: the first, a tile 8 times the second.
    rows_per_thread: int = 4
    keys_per_thread: int = 4
    #: The parts the keys are cut in, each walked by its own blocks and
    #: joined by the combine kernel: 1 but where few blocks of queries
    #: would leave the GPU idle (:func:`plan`'s ``target_blocks``).
    splits: int = 1

    def key_span(self, m: int) -> int:
        """The keys of a split: whole tiles."""
        tiles = -(-m // self.tile_keys)
        return max(1, -(-tiles // self.splits)) * self.tile_keys

    @property
    def block_queries(self) -> int:
        return 16 * self.rows_per_thread

    @property
    def tile_keys(self) -> int:
        return 8 * self.keys_per_thread

    @property
    def padded_k(self) -> int:
        return cupy_launch.padded(self.d_k, 4)

    @property
    def padded_v(self) -> int:
        return cupy_launch.padded(self.d_v, 32)

    @property
    def shared_bytes(self) -> int:
        """Dynamic shared memory a block takes: its queries, a tile's keys
        and values, and the tile's weights."""
        row, queries, keys = self.padded_k + 4, self.block_queries, self.tile_keys
        return 4 * (queries * row + keys * row + keys * self.padded_v + queries * (keys + 4))


def device_shared_bytes(device: int) -> int:
    """The shared memory a block may ask for on CUDA device ``device``
    (``sharedMemPerBlockOptin``), read once a device."""
    return int(_device_properties(device)["sharedMemPerBlockOptin"])


def device_blocks(device: int) -> int:
    """The blocks that fill CUDA device ``device``: two a multiprocessor
    (its registers hold two or three of the forward's)."""
    return 2 * int(_device_properties(device)["multiProcessorCount"])


@functools.cache
def _device_properties(device: int) -> dict[str, Any]:
    import cupy

    return cupy.cuda.runtime.getDeviceProperties(device)


#: The most parts a call's keys are cut in (the combine kernel reads each
#: split's statistics for every feature).
MAX_SPLITS = 32


def plan(
    dtype_name: str,
    d_k: int,
    d_v: int,
    n: int,
    m: int,
    slices: int,
    shared_limit: int = SHARED_LIMIT,
    target_blocks: int | None = None,
) -> TiledPlan | None:
    """The kernel's launch for a call, or None where it can't take it: a
    dtype other than float32, features past :data:`MAX_FEATURES`, positions
    past its int32 or a grid past CUDA's.  Its tiles: the first of
    :data:`TILE_CHOICES` whose outputs and scores fit a thread's registers
    and whose block fits ``shared_limit`` (the GPU's: :func:`device_shared_bytes`).
    With ``target_blocks`` (:func:`device_blocks`), a call of fewer blocks of
    queries has its keys cut in as many splits as make up the difference
    (at most :data:`MAX_SPLITS`, and a tile of keys a split at least):
    decoding's split keys."""
    if dtype_name != "float32" or max(d_k, d_v) > MAX_FEATURES or min(d_k, d_v) < 1:
        return None
    for rows, keys in TILE_CHOICES:
        tiled = TiledPlan(d_k, d_v, rows, keys)
        queries = tiled.block_queries
        if (
            rows * (tiled.padded_v // 8 + keys) <= REGISTER_FLOATS
            and tiled.shared_bytes <= shared_limit
            and max(n, m) < 2**31 - 2 * queries
            and slices * -(-n // queries) * MAX_SPLITS < 2**31
        ):
            blocks = slices * -(-n // queries)
            if target_blocks and blocks < target_blocks:
                splits = min(-(-target_blocks // blocks), MAX_SPLITS, -(-m // tiled.tile_keys))
                tiled = dataclasses.replace(tiled, splits=max(1, splits))
            return tiled
    return None


def kernel_source(tiled: TiledPlan) -> str:
    """The forward kernel's CUDA source for one plan."""
    sizes = {
        "D": tiled.d_k,
        "DV": tiled.d_v,
        "DP": tiled.padded_k,
        "DVP": tiled.padded_v,
        "RM": tiled.rows_per_thread,
        "CN": tiled.keys_per_thread,
    }
    header = "".join(f"#define {name} {size}\n" for name, size in sizes.items())
    return header + HELPERS_SOURCE + TILED_SOURCE.replace("KERNEL_NAME", kernel_name(tiled))


def kernel_name(tiled: TiledPlan) -> str:
    return f"tiled_float32_{tiled.d_k}_{tiled.d_v}_{tiled.rows_per_thread}x{tiled.keys_per_thread}"


def attend(
    tiled: TiledPlan,
    query: Any,
    key: Any,
    value: Any,
    limits: Any,
    scale: float,
    causal: bool = False,
    *,
    with_stats: bool = False,
    arrays: Any = None,
    run: cupy_launch.Run | None = None,
) -> Any:
    """:func:`cupy_flash.attend`'s contract, in this kernel: CuPy arrays
    ``(slices, n, d_k)``, ``(slices, m, d_k)`` and ``(slices, m, d_v)`` in
    float32, ``limits`` ``(slices, n)`` or None, the causal rule applied in
    the kernel where ``causal``: ``(slices, n, d_v)``, one launch (two
    where the keys are split).  With ``with_stats``, ``(output, stats)``:
    each row's log-sum-exp of its scores too, ``(slices, n)``, for
    :func:`cupy_tiled_backward.attend`.  ``arrays`` and ``run``: CuPy and
    :func:`cupy_launch.run` (the tests' are NumPy and a launch on the CPU)."""
    arrays, run = arrays or cupy_launch.cupy_arrays(), run or cupy_launch.run
    query, key, value = (arrays.ascontiguousarray(array) for array in (query, key, value))
    slices, n = query.shape[0], query.shape[1]
    output = arrays.empty((slices, n, tiled.d_v), dtype=query.dtype)
    stats = arrays.empty((slices, n) if with_stats else (1,), dtype=query.dtype)
    limits, has_limits = cupy_launch.limits_argument(limits, arrays)
    split = tiled.splits > 1  # each split's own output and statistics, joined after
    parts = arrays.empty((tiled.splits, slices, n, tiled.d_v), dtype=query.dtype) if split else output
    part_stats = arrays.empty((tiled.splits, slices, n), dtype=query.dtype) if split else stats
    grid, block, arguments = launch(
        tiled,
        query,
        key,
        value,
        parts,
        part_stats,
        limits,
        scale,
        causal,
        has_stats=with_stats or split,
        has_limits=has_limits,
    )
    run(kernel_source(tiled), kernel_name(tiled), tiled.shared_bytes, grid, block, arguments)
    if split:
        grid, block, arguments = combine_launch(tiled, parts, part_stats, output, stats, has_stats=with_stats)
        run(combine_source(tiled), combine_name(tiled), 0, grid, block, arguments)
    return (output, stats) if with_stats else output


def combine_source(tiled: TiledPlan) -> str:
    """The combine kernel's CUDA source for values of ``tiled.d_v`` features."""
    return f"#define DV {tiled.d_v}\n" + HELPERS_SOURCE + COMBINE_SOURCE.replace("KERNEL_NAME", combine_name(tiled))


def combine_name(tiled: TiledPlan) -> str:
    return f"tiled_combine_float32_{tiled.d_v}"


def combine_launch(
    tiled: TiledPlan, parts: Any, part_stats: Any, output: Any, stats: Any, *, has_stats: bool
) -> tuple[tuple[int], tuple[int], tuple[Any, ...]]:
    """``(grid, block, arguments)`` of the combine kernel's launch: a block a
    row, a warp's threads at least and one a feature up to 128."""
    rows = output.shape[0] * output.shape[1]
    threads = min(128, cupy_launch.padded(tiled.d_v, 32))
    arguments = (parts, part_stats, output, stats, numpy.int32(has_stats), numpy.int32(tiled.splits), numpy.int64(rows))
    return (rows,), (threads,), arguments


def launch(
    tiled: TiledPlan,
    query: Any,
    key: Any,
    value: Any,
    output: Any,
    stats: Any,
    limits: Any,
    scale: float,
    causal: bool,
    *,
    has_stats: bool,
    has_limits: bool,
) -> tuple[tuple[int], tuple[int], tuple[Any, ...]]:
    """``(grid, block, arguments)`` of the forward's launch on C-ordered
    arrays laid out as :func:`attend` lays them out (its shared memory is
    :attr:`TiledPlan.shared_bytes`; ``output`` and ``stats`` each split's,
    ``(splits, slices, n, ...)``, where the keys are split), from their
    shapes alone, so that the tests launch the same source on the CPU
    (``tests/cuda_on_cpu.py``)."""
    slices, n, m = query.shape[0], query.shape[1], key.shape[1]
    row_blocks = -(-n // tiled.block_queries)
    flags = map(numpy.int32, (has_limits, causal, n, m, row_blocks, slices, tiled.key_span(m)))
    arguments = (query, key, value, output, stats, numpy.int32(has_stats), limits, *flags, numpy.float32(scale))
    return (tiled.splits * slices * row_blocks,), (THREADS,), arguments
