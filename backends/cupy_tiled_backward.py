"""The backward of :mod:`cupy_tiled`'s attention: FlashAttention-2's, on the
float units, in two kernels.

The forward keeps each row's log-sum-exp (``attend(..., with_stats=True)``);
here each tile's weights are recomputed from it, never stored:

- the keys' side: a block of 32 keys walks the blocks of 64 queries that
  attend them (under the causal rule, from the first query that sees
  them; a tile no query of which attends them is skipped), into their keys'
  and values' gradients;
- the queries' side: a block of 64 queries walks its keys, into their
  gradients.

A tile's scores and their gradients are a thread's 4 x 4, as in the
forward.  A row with no key, or of log-sum-exp ``-inf`` (all its scores
``-inf``), weighs nothing: zero gradients, never NaN.  ptxas (CUDA 13,
sm_90): 137 registers each at 64 features, none spilled; 168 at 128, the
queries' side spilling 28 bytes.  Shared memory: 61 and 69 KiB at 64
features, 109 and 117 at 128 (asked for past CUDA's 48 KiB; a GPU that
holds less declines the call, which then trains through attnx's generic
backward).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy

from . import cupy_launch
from .cupy_tiled import HELPERS_SOURCE, MAX_FEATURES, SHARED_LIMIT, THREADS

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

        padded = cupy_launch.padded
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


def plans(
    dtype_name: str, d_k: int, d_v: int, n: int, m: int, slices: int, shared_limit: int = SHARED_LIMIT
) -> tuple[BackwardPlan, ...] | None:
    """The backward's two kernels (the queries' side, the keys'), or None
    where they can't take the call (as :func:`cupy_tiled.plan`, in tiles of 4 x 4):
    61 and 69 KiB of shared memory at 64 features, 109 and 117 at 128."""
    if dtype_name != "float32" or max(d_k, d_v) > MAX_FEATURES or min(d_k, d_v) < 1:
        return None
    if max(n, m) >= 2**31 - 128 or slices * max(-(-n // 64), -(-m // 32)) >= 2**31:
        return None
    plans = BackwardPlan(d_k, d_v, True), BackwardPlan(d_k, d_v, False)
    return plans if all(plan.shared_bytes <= shared_limit for plan in plans) else None


def kernel_source(side: BackwardPlan) -> str:
    """The CUDA source of one of the backward's kernels."""
    header = "".join(f"#define {name} {size}\n" for name, size in side.sizes.items())
    return header + HELPERS_SOURCE + BACKWARD_SOURCE.replace("KERNEL_NAME", kernel_name(side))


def kernel_name(side: BackwardPlan) -> str:
    return f"tiled_backward_{'queries' if side.query_side else 'keys'}_float32_{side.d_k}_{side.d_v}"


def attend(
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
    *,
    arrays: Any = None,
    run: cupy_launch.Run | None = None,
) -> tuple[Any, Any, Any]:
    """The gradients ``(d_query, d_key, d_value)`` of
    :func:`cupy_tiled.attend`'s ``output`` (``with_stats``, from the same
    arrays) for its ``cotangent``: two launches, and one reduction for the
    rows' deltas.  ``arrays`` and ``run``: CuPy and :func:`cupy_launch.run`
    (the tests' are NumPy and a launch on the CPU)."""
    arrays, run = arrays or cupy_launch.cupy_arrays(), run or cupy_launch.run
    # C-ordered as attend read them (no copy where they are already).
    query, key, value = (arrays.ascontiguousarray(array) for array in (query, key, value))
    cotangent = arrays.ascontiguousarray(cotangent, dtype=output.dtype)
    deltas = row_deltas(cotangent, output)
    d_query, d_key, d_value = (arrays.empty_like(array) for array in (query, key, value))
    limits, has_limits = cupy_launch.limits_argument(limits, arrays)
    gradients = (d_query, d_key, d_value)
    for side, (grid, block, arguments) in zip(
        plans,
        launches(
            plans, query, key, value, cotangent, stats, deltas, *gradients, limits, scale, causal, has_limits=has_limits
        ),
    ):
        run(kernel_source(side), kernel_name(side), side.shared_bytes, grid, block, arguments)
    return gradients


def row_deltas(cotangent: Any, output: Any) -> Any:
    """Each row's sum of its output times its cotangent, ``(slices, n)``:
    the backward's shift of the weights' gradients (FlashAttention-2's
    ``D``), in the arrays' own library."""
    return (cotangent * output).sum(axis=-1)


def launches(
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
    ``plans``' order, from the arrays' shapes alone (as
    :func:`cupy_tiled.launch`)."""
    slices, n, m = query.shape[0], query.shape[1], key.shape[1]
    launches = []
    for side in plans:
        blocks = -(-(n if side.query_side else m) // side.block_rows)
        gradients = (d_query,) if side.query_side else (d_key, d_value)
        flags = map(numpy.int32, (has_limits, causal, n, m, blocks))
        arguments = (query, key, value, cotangent, stats, deltas, *gradients, limits, *flags, numpy.float32(scale))
        launches.append(((slices * blocks,), (THREADS,), arguments))
    return launches
