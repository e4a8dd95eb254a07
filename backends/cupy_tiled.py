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
and 168 at 128, 20 bytes spilled (:data:`REGISTERS`); the backward's
kernels 137 each at 64, and 168 at 128 (the queries' side spilling 28
bytes).  ``attnx.vjp`` of float32 takes it; inference joins it
(``cupy_attention.TILED_FORWARD``) when a GPU has timed it against
:mod:`cupy_flash` and the blocks (``bench/gpu_checks.py tiled_outputs
tiled_times decode_times``).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import numpy

from .cupy_flash import limits_argument

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


#: The backward's two kernels, FlashAttention-2's on the float units, each
#: recomputing a tile's weights from the row's log-sum-exp that the forward
#: kept (``stats``) and ``deltas`` (each row's sum of its output times its
#: cotangent): one walks a block of 32 keys over the queries that attend
#: them, into their keys' and values' gradients, the other a block of 64
#: queries over their keys, into their gradients.  A tile's scores and
#: their gradients are a thread's 4 x 4, as in the forward; a weight of a
#: row with no key, or of log-sum-exp -inf, is 0.  Written once for both,
#: ``QUERY_SIDE`` choosing.
BACKWARD_SOURCE = r"""
#define THREADS 128
#define ROW_GROUPS 16                   // threads ty: queries ty + 16 r
#define KEY_GROUPS 8                    // threads tx: keys tx + 8 c
#define RM 4
#define CN 4
#define QB 64                           // a block's or a tile's queries
#define KB 32                           // a block's or a tile's keys
#define QS (DPA + 4)                    // a row of queries in shared memory
#define OS (DVPA + 4)                   // a row of the output's cotangent
#define KS (DPQ + 4)                    // a row of keys
#define VS (DVP + 4)                    // a row of values
#define TS (QB + 4)                     // a row of weights or score gradients, transposed (keys' side)
#define PS (KB + 4)                     // a row of score gradients (queries' side)

// The keys a query attends: its limit (key lengths, clamped to [0, m]) and
// the causal rule in attnx's alignment; 0 past the last query.
__device__ __forceinline__ int keys_attended(int row, const int* limits, long long slice, int has_limits, int causal,
                                             int n, int m) {
    if (row >= n) return 0;
    int limit = m;
    if (has_limits) {
        limit = limits[slice * n + row];
        limit = limit < 0 ? 0 : (limit > m ? m : limit);
    }
    if (causal) {
        const int keys_seen = row + 1 + m - n;
        limit = keys_seen < 0 ? 0 : (keys_seen < limit ? keys_seen : limit);
    }
    return limit;
}

// A tile's weights and score gradients, 4 queries x 4 keys a thread: the
// scores from queries (scaled) and keys, the weights' gradients from the
// output's cotangent and the values.
__device__ __forceinline__ void tile_gradients(const float* queries, const float* keys, const float* d_outputs,
                                               const float* values, const float* row_stats, const float* row_deltas,
                                               const int* limit, int first_key, int ty, int tx,
                                               float weight[RM][CN], float d_score[RM][CN]) {
    float score[RM][CN], d_weight[RM][CN];
#pragma unroll
    for (int r = 0; r < RM; ++r)
#pragma unroll
        for (int c = 0; c < CN; ++c) score[r][c] = d_weight[r][c] = 0.0f;
#pragma unroll 4
    for (int e = 0; e < DP; e += 4) {
        float4 qv[RM], kv[CN];
#pragma unroll
        for (int r = 0; r < RM; ++r) qv[r] = vector_at(&queries[(ty + ROW_GROUPS * r) * QS + e]);
#pragma unroll
        for (int c = 0; c < CN; ++c) kv[c] = vector_at(&keys[(tx + KEY_GROUPS * c) * KS + e]);
#pragma unroll
        for (int r = 0; r < RM; ++r)
#pragma unroll
            for (int c = 0; c < CN; ++c)
                score[r][c] += qv[r].x * kv[c].x + qv[r].y * kv[c].y + qv[r].z * kv[c].z + qv[r].w * kv[c].w;
    }
#pragma unroll 4
    for (int e = 0; e < DVP; e += 4) {
        float4 ov[RM], vv[CN];
#pragma unroll
        for (int r = 0; r < RM; ++r) ov[r] = vector_at(&d_outputs[(ty + ROW_GROUPS * r) * OS + e]);
#pragma unroll
        for (int c = 0; c < CN; ++c) vv[c] = vector_at(&values[(tx + KEY_GROUPS * c) * VS + e]);
#pragma unroll
        for (int r = 0; r < RM; ++r)
#pragma unroll
            for (int c = 0; c < CN; ++c)
                d_weight[r][c] += ov[r].x * vv[c].x + ov[r].y * vv[c].y + ov[r].z * vv[c].z + ov[r].w * vv[c].w;
    }
    const float minus_infinity = __int_as_float(0xff800000);
#pragma unroll
    for (int r = 0; r < RM; ++r) {
        const float log_sum = row_stats[ty + ROW_GROUPS * r], delta = row_deltas[ty + ROW_GROUPS * r];
#pragma unroll
        for (int c = 0; c < CN; ++c) {
            const bool attended = first_key + tx + KEY_GROUPS * c < limit[r] && log_sum != minus_infinity;
            weight[r][c] = attended ? expf(score[r][c] - log_sum) : 0.0f;
            d_score[r][c] = weight[r][c] * (d_weight[r][c] - delta);
        }
    }
}

// Rows [first_row, first_row + QB) of queries (scaled), the output's
// cotangent and the rows' statistics into shared memory, zeros past n.
__device__ __forceinline__ void load_rows(const float* query, const float* d_output, const float* stats,
                                          const float* deltas, long long slice, int first_row, int n, float scale,
                                          float* queries, float* d_outputs, float* row_stats, float* row_deltas) {
    const float minus_infinity = __int_as_float(0xff800000);
    const float* q = query + (slice * n + first_row) * D;
    const float* o = d_output + (slice * n + first_row) * DV;
    // A row of log-sum-exp -inf weighs nothing: its query is left at zeros, so
    // that an infinite one gives the keys no 0 * inf.
    for (int i = threadIdx.x; i < QB * DPA; i += THREADS) {
        const int r = i / DPA, e = i % DPA;
        const bool inside = first_row + r < n && e < D && stats[slice * n + first_row + r] != minus_infinity;
        queries[r * QS + e] = inside ? q[(long long)r * D + e] * scale : 0.0f;
    }
    for (int i = threadIdx.x; i < QB * DVPA; i += THREADS) {
        const int r = i / DVPA, e = i % DVPA;
        d_outputs[r * OS + e] = (first_row + r < n && e < DV) ? o[(long long)r * DV + e] : 0.0f;
    }
    for (int i = threadIdx.x; i < QB; i += THREADS) {
        const bool inside = first_row + i < n;
        row_stats[i] = inside ? stats[slice * n + first_row + i] : minus_infinity;
        row_deltas[i] = inside ? deltas[slice * n + first_row + i] : 0.0f;
    }
}

// Keys [first_key, first_key + KB) and their values into shared memory, zeros past m.
__device__ __forceinline__ void load_keys(const float* key, const float* value, long long slice, int first_key, int m,
                                          float* keys, float* values) {
    const float* k = key + (slice * m + first_key) * D;
    const float* v = value + (slice * m + first_key) * DV;
    for (int i = threadIdx.x; i < KB * DPQ; i += THREADS) {
        const int j = i / DPQ, e = i % DPQ;
        keys[j * KS + e] = (first_key + j < m && e < D) ? k[(long long)j * D + e] : 0.0f;
    }
    for (int i = threadIdx.x; i < KB * DVP; i += THREADS) {
        const int j = i / DVP, e = i % DVP;
        values[j * VS + e] = (first_key + j < m && e < DV) ? v[(long long)j * DV + e] : 0.0f;
    }
}

#if QUERY_SIDE
#define VQ (DPQ / 32)                   // a thread's vectors of query-gradient features: tx * 4 + 32 q

extern "C" __global__ void __launch_bounds__(THREADS) KERNEL_NAME(
        const float* __restrict__ query, const float* __restrict__ key, const float* __restrict__ value,
        const float* __restrict__ d_output, const float* __restrict__ stats, const float* __restrict__ deltas,
        float* __restrict__ d_query, const int* __restrict__ limits, const int has_limits, const int causal,
        const int n, const int m, const int blocks, const float scale) {
    extern __shared__ __align__(16) float shared[];
    float* queries = shared;                     // [QB][QS]
    float* d_outputs = queries + QB * QS;        // [QB][OS]
    float* keys = d_outputs + QB * OS;           // [KB][KS]
    float* values = keys + KB * KS;              // [KB][VS]
    float* d_scores = values + KB * VS;          // [QB][PS]
    float* row_stats = d_scores + QB * PS;       // [QB]
    float* row_deltas = row_stats + QB;          // [QB]
    __shared__ int block_stop;
    const int t = threadIdx.x, ty = t / KEY_GROUPS, tx = t % KEY_GROUPS;
    const long long slice = blockIdx.x / blocks;
    const int first_row = (blocks - 1 - (int)(blockIdx.x % blocks)) * QB;  // the most keys first
    load_rows(query, d_output, stats, deltas, slice, first_row, n, scale, queries, d_outputs, row_stats, row_deltas);
    if (t == 0) block_stop = 0;
    __syncthreads();
    int limit[RM];
#pragma unroll
    for (int r = 0; r < RM; ++r) {
        limit[r] = keys_attended(first_row + ty + ROW_GROUPS * r, limits, slice, has_limits, causal, n, m);
        atomicMax(&block_stop, limit[r]);
    }
    __syncthreads();
    const int stop = block_stop;
    float dq[RM][4 * VQ];
#pragma unroll
    for (int r = 0; r < RM; ++r)
#pragma unroll
        for (int e = 0; e < 4 * VQ; ++e) dq[r][e] = 0.0f;

    for (int first_key = 0; first_key < stop; first_key += KB) {
        __syncthreads();  // the last tile's reads are done
        load_keys(key, value, slice, first_key, m, keys, values);
        __syncthreads();
        float weight[RM][CN], d_score[RM][CN];
        tile_gradients(queries, keys, d_outputs, values, row_stats, row_deltas, limit, first_key, ty, tx, weight,
                       d_score);
#pragma unroll
        for (int r = 0; r < RM; ++r)
#pragma unroll
            for (int c = 0; c < CN; ++c) d_scores[(ty + ROW_GROUPS * r) * PS + tx + KEY_GROUPS * c] = d_score[r][c];
        __syncwarp();  // a query's score gradients come from the 8 lanes of its own warp
        // d_query += d_score keys (times the scale, at the end)
#pragma unroll 2
        for (int j = 0; j < KB; j += 4) {
            float4 ds[RM];
#pragma unroll
            for (int r = 0; r < RM; ++r) ds[r] = vector_at(&d_scores[(ty + ROW_GROUPS * r) * PS + j]);
#pragma unroll
            for (int jj = 0; jj < 4; ++jj)
#pragma unroll
                for (int vq = 0; vq < VQ; ++vq) {
                    const float4 kv = vector_at(&keys[(j + jj) * KS + tx * 4 + 32 * vq]);
#pragma unroll
                    for (int r = 0; r < RM; ++r) add_scaled(&dq[r][4 * vq], part(ds[r], jj), kv);
                }
        }
    }
#pragma unroll
    for (int r = 0; r < RM; ++r) {
        const int row = first_row + ty + ROW_GROUPS * r;
        if (row < n) {
            float* g = d_query + (slice * n + row) * D;
#pragma unroll
            for (int vq = 0; vq < VQ; ++vq)
#pragma unroll
                for (int c = 0; c < 4; ++c) {
                    const int feature = tx * 4 + 32 * vq + c;
                    if (feature < D) g[feature] = dq[r][4 * vq + c] * scale;
                }
        }
    }
}
#else
#define FQ (DPA / 64)                   // a thread's vectors of key-gradient features: fb * 4 + 64 q
#define FV (DVPA / 64)                  // and of value-gradient features

extern "C" __global__ void __launch_bounds__(THREADS) KERNEL_NAME(
        const float* __restrict__ query, const float* __restrict__ key, const float* __restrict__ value,
        const float* __restrict__ d_output, const float* __restrict__ stats, const float* __restrict__ deltas,
        float* __restrict__ d_key, float* __restrict__ d_value, const int* __restrict__ limits,
        const int has_limits, const int causal, const int n, const int m, const int blocks, const float scale) {
    extern __shared__ __align__(16) float shared[];
    float* queries = shared;                     // [QB][QS]
    float* d_outputs = queries + QB * QS;        // [QB][OS]
    float* keys = d_outputs + QB * OS;           // [KB][KS]
    float* values = keys + KB * KS;              // [KB][VS]
    float* weights_t = values + KB * VS;         // [KB][TS]
    float* d_scores_t = weights_t + KB * TS;     // [KB][TS]
    float* row_stats = d_scores_t + KB * TS;     // [QB]
    float* row_deltas = row_stats + QB;          // [QB]
    __shared__ int tile_stop;
    const int t = threadIdx.x, ty = t / KEY_GROUPS, tx = t % KEY_GROUPS;
    const int ka = t / 16, fb = t % 16;          // the gradients' keys ka + 8 c and features fb * 4 + 64 q
    const long long slice = blockIdx.x / blocks;
    const int first_key = (int)(blockIdx.x % blocks) * KB;
    load_keys(key, value, slice, first_key, m, keys, values);
    float dk[CN][4 * FQ], dv[CN][4 * FV];
#pragma unroll
    for (int c = 0; c < CN; ++c) {
#pragma unroll
        for (int e = 0; e < 4 * FQ; ++e) dk[c][e] = 0.0f;
#pragma unroll
        for (int e = 0; e < 4 * FV; ++e) dv[c][e] = 0.0f;
    }
    // Under the causal rule, the queries before first_key - (m - n) attend none of these keys.
    int first_row = causal ? first_key - (m - n) : 0;
    first_row = first_row < 0 ? 0 : first_row / QB * QB;
    for (int row0 = first_row; row0 < n; row0 += QB) {
        __syncthreads();  // the last tile's reads are done
        if (t == 0) tile_stop = 0;
        load_rows(query, d_output, stats, deltas, slice, row0, n, scale, queries, d_outputs, row_stats, row_deltas);
        __syncthreads();
        int limit[RM];
#pragma unroll
        for (int r = 0; r < RM; ++r) {
            limit[r] = keys_attended(row0 + ty + ROW_GROUPS * r, limits, slice, has_limits, causal, n, m);
            atomicMax(&tile_stop, limit[r]);
        }
        __syncthreads();
        if (tile_stop <= first_key) continue;  // no query of the tile attends these keys
        float weight[RM][CN], d_score[RM][CN];
        tile_gradients(queries, keys, d_outputs, values, row_stats, row_deltas, limit, first_key, ty, tx, weight,
                       d_score);
#pragma unroll
        for (int r = 0; r < RM; ++r)
#pragma unroll
            for (int c = 0; c < CN; ++c) {
                weights_t[(tx + KEY_GROUPS * c) * TS + ty + ROW_GROUPS * r] = weight[r][c];
                d_scores_t[(tx + KEY_GROUPS * c) * TS + ty + ROW_GROUPS * r] = d_score[r][c];
            }
        __syncthreads();
        // d_value += weights^T d_output, d_key += d_score^T queries (scaled: a score's gradient in a key)
#pragma unroll 2
        for (int i = 0; i < QB; i += 4) {
            float4 w[CN], ds[CN];
#pragma unroll
            for (int c = 0; c < CN; ++c) {
                w[c] = vector_at(&weights_t[(ka + KEY_GROUPS * c) * TS + i]);
                ds[c] = vector_at(&d_scores_t[(ka + KEY_GROUPS * c) * TS + i]);
            }
#pragma unroll
            for (int ii = 0; ii < 4; ++ii) {
#pragma unroll
                for (int f = 0; f < FV; ++f) {
                    const float4 o = vector_at(&d_outputs[(i + ii) * OS + fb * 4 + 64 * f]);
#pragma unroll
                    for (int c = 0; c < CN; ++c) add_scaled(&dv[c][4 * f], part(w[c], ii), o);
                }
#pragma unroll
                for (int f = 0; f < FQ; ++f) {
                    const float4 x = vector_at(&queries[(i + ii) * QS + fb * 4 + 64 * f]);
#pragma unroll
                    for (int c = 0; c < CN; ++c) add_scaled(&dk[c][4 * f], part(ds[c], ii), x);
                }
            }
        }
    }
#pragma unroll
    for (int c = 0; c < CN; ++c) {
        const int j = first_key + ka + KEY_GROUPS * c;
        if (j < m) {
#pragma unroll
            for (int f = 0; f < FQ; ++f)
#pragma unroll
                for (int cc = 0; cc < 4; ++cc) {
                    const int feature = fb * 4 + 64 * f + cc;
                    if (feature < D) d_key[(slice * m + j) * D + feature] = dk[c][4 * f + cc];
                }
#pragma unroll
            for (int f = 0; f < FV; ++f)
#pragma unroll
                for (int cc = 0; cc < 4; ++cc) {
                    const int feature = fb * 4 + 64 * f + cc;
                    if (feature < DV) d_value[(slice * m + j) * DV + feature] = dv[c][4 * f + cc];
                }
        }
    }
}
#endif
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
        return -(-self.d_k // 4) * 4

    @property
    def padded_v(self) -> int:
        return -(-self.d_v // 32) * 32

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


@dataclasses.dataclass(frozen=True)
class BackwardPlan:
    """The backward's two launches for queries and keys of ``d_k`` features
    and values of ``d_v``: ``query_side`` the kernel of the queries'
    gradients (blocks of 64 queries), else that of the keys' and values'
    (blocks of 32 keys)."""

    d_k: int
    d_v: int
    query_side: bool

    @property
    def sizes(self) -> dict[str, int]:
        """The source's sizes: the features padded to vectors of 4 (``DP``,
        ``DVP``), and to the 32 and 64 that the gradients' threads share
        out (``DPQ``; ``DPA``, ``DVPA``)."""

        def padded(size: int, to: int) -> int:
            return -(-size // to) * to

        return {
            "D": self.d_k,
            "DV": self.d_v,
            "DP": padded(self.d_k, 4),
            "DVP": padded(self.d_v, 4),
            "DPQ": padded(self.d_k, 32),
            "DPA": padded(self.d_k, 64),
            "DVPA": padded(self.d_v, 64),
            "QUERY_SIDE": int(self.query_side),
        }

    @property
    def block_rows(self) -> int:
        """What a block walks from: 64 queries, or 32 keys."""
        return 64 if self.query_side else 32

    @property
    def shared_bytes(self) -> int:
        sizes = self.sizes
        rows = 64 * (sizes["DPA"] + 4) + 64 * (sizes["DVPA"] + 4) + 32 * (sizes["DPQ"] + 4) + 32 * (sizes["DVP"] + 4)
        tiles = 64 * (32 + 4) if self.query_side else 2 * 32 * (64 + 4)
        return 4 * (rows + tiles + 2 * 64)


def backward_plans(
    dtype_name: str, d_k: int, d_v: int, n: int, m: int, slices: int, shared_limit: int = SHARED_LIMIT
) -> tuple[BackwardPlan, ...] | None:
    """The backward's two kernels (the queries' side, the keys'), or None
    where they can't take the call (as :func:`plan`, in tiles of 4 x 4):
    61 and 69 KiB of shared memory at 64 features, 109 and 117 at 128."""
    if dtype_name != "float32" or max(d_k, d_v) > MAX_FEATURES or min(d_k, d_v) < 1:
        return None
    if max(n, m) >= 2**31 - 128 or slices * max(-(-n // 64), -(-m // 32)) >= 2**31:
        return None
    plans = BackwardPlan(d_k, d_v, True), BackwardPlan(d_k, d_v, False)
    return plans if all(plan.shared_bytes <= shared_limit for plan in plans) else None


def backward_source(side: BackwardPlan) -> str:
    """The CUDA source of one of the backward's kernels."""
    header = "".join(f"#define {name} {size}\n" for name, size in side.sizes.items())
    return header + HELPERS_SOURCE + BACKWARD_SOURCE.replace("KERNEL_NAME", backward_name(side))


def backward_name(side: BackwardPlan) -> str:
    return f"tiled_backward_{'queries' if side.query_side else 'keys'}_float32_{side.d_k}_{side.d_v}"


@functools.cache
def _compiled(source: str, name: str, shared_bytes: int, device: int) -> Any:
    import cupy

    kernel = cupy.RawKernel(source, name)
    if shared_bytes > 48 * 1024:  # past CUDA's default: asked for, on this device
        with cupy.cuda.Device(device):
            kernel.max_dynamic_shared_size_bytes = shared_bytes
    return kernel


def _launch(source: str, name: str, shared_bytes: int, grid: Any, block: Any, arguments: Any) -> None:
    import cupy

    kernel = _compiled(source, name, shared_bytes, cupy.cuda.Device().id)
    kernel(grid, block, arguments, shared_mem=shared_bytes)


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
) -> Any:
    """:func:`cupy_flash.attend`'s contract, in this kernel: CuPy arrays
    ``(slices, n, d_k)``, ``(slices, m, d_k)`` and ``(slices, m, d_v)`` in
    float32, ``limits`` ``(slices, n)`` or None, the causal rule applied in
    the kernel where ``causal``: ``(slices, n, d_v)``, one launch.  With
    ``with_stats``, ``(output, stats)``: each row's log-sum-exp of its
    scores too, ``(slices, n)``, for :func:`attend_backward`."""
    import cupy

    query, key, value = (cupy.ascontiguousarray(array) for array in (query, key, value))
    slices, n = query.shape[0], query.shape[1]
    output = cupy.empty((slices, n, tiled.d_v), dtype=query.dtype)
    stats = cupy.empty((slices, n) if with_stats else (1,), dtype=query.dtype)
    limits, has_limits = limits_argument(limits)
    split = tiled.splits > 1  # each split's own output and statistics, joined after
    parts = cupy.empty((tiled.splits, slices, n, tiled.d_v), dtype=query.dtype) if split else output
    part_stats = cupy.empty((tiled.splits, slices, n), dtype=query.dtype) if split else stats
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
    _launch(kernel_source(tiled), kernel_name(tiled), tiled.shared_bytes, grid, block, arguments)
    if split:
        grid, block, arguments = combine_launch(tiled, parts, part_stats, output, stats, has_stats=with_stats)
        _launch(combine_source(tiled), combine_name(tiled), 0, grid, block, arguments)
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
    threads = min(128, -(-tiled.d_v // 32) * 32)
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


def attend_backward(
    plans: tuple[BackwardPlan, ...],
    query: Any,
    key: Any,
    value: Any,
    output: Any,
    stats: Any,
    cotangent: Any,
    limits: Any,
    scale: float,
    causal: bool = False,
) -> tuple[Any, Any, Any]:
    """The gradients ``(d_query, d_key, d_value)`` of :func:`attend`'s
    output (``with_stats``, from the same C-ordered arrays) for its
    ``cotangent``: two launches, and one reduction for the rows' deltas."""
    import cupy

    # C-ordered as attend read them (no copy where they are already).
    query, key, value = (cupy.ascontiguousarray(array) for array in (query, key, value))
    cotangent = cupy.ascontiguousarray(cotangent, dtype=output.dtype)
    deltas = row_deltas(cotangent, output)
    d_query, d_key, d_value = (cupy.empty_like(array) for array in (query, key, value))
    limits, has_limits = limits_argument(limits)
    for side, (grid, block, arguments) in zip(
        plans,
        backward_launches(
            plans,
            query,
            key,
            value,
            cotangent,
            stats,
            deltas,
            d_query,
            d_key,
            d_value,
            limits,
            scale,
            causal,
            has_limits=has_limits,
        ),
    ):
        _launch(backward_source(side), backward_name(side), side.shared_bytes, grid, block, arguments)
    return d_query, d_key, d_value


def row_deltas(cotangent: Any, output: Any) -> Any:
    """Each row's sum of its output times its cotangent, ``(slices, n)``:
    the backward's shift of the weights' gradients (FlashAttention-2's
    ``D``), in the arrays' own library."""
    return (cotangent * output).sum(axis=-1)


def backward_launches(
    plans: tuple[BackwardPlan, ...],
    query: Any,
    key: Any,
    value: Any,
    cotangent: Any,
    stats: Any,
    deltas: Any,
    d_query: Any,
    d_key: Any,
    d_value: Any,
    limits: Any,
    scale: float,
    causal: bool,
    *,
    has_limits: bool,
) -> list[tuple[tuple[int], tuple[int], tuple[Any, ...]]]:
    """``(grid, block, arguments)`` of each of the backward's launches, in
    ``plans``' order, from the arrays' shapes alone (as :func:`launch`)."""
    slices, n, m = query.shape[0], query.shape[1], key.shape[1]
    launches = []
    for side in plans:
        blocks = -(-(n if side.query_side else m) // side.block_rows)
        gradients = (d_query,) if side.query_side else (d_key, d_value)
        flags = map(numpy.int32, (has_limits, causal, n, m, blocks))
        arguments = (query, key, value, cotangent, stats, deltas, *gradients, limits, *flags, numpy.float32(scale))
        launches.append(((slices * blocks,), (THREADS,), arguments))
    return launches
