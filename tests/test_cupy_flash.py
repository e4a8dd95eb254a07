"""The CuPy backend's fused kernel (``attnx_backends.cupy_flash``), on the
CPU: its plans, its source, and its algorithm (the tiles of keys, the
online softmax with its shift for rows that have no finite score yet, each
block's stopping key) written in NumPy, run through the native's marshalling
(``cupy_attention.attend_fused``) against the float64 reference.  The CUDA
kernel itself needs a GPU: ``bench/gpu_checks.py flash`` checks its outputs
against the generic algorithm's there, and the conformance suite on CuPy
checks the whole."""

from __future__ import annotations

import array_api_compat.numpy as xp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnx_backends import cupy_attention, cupy_flash
from attnx_conformance import reference


def numpy_flash_kernel(flash, query, key, value, limits, scale):
    """The kernel's algorithm: each block of ``flash.rows`` queries walks
    the keys in tiles of ``flash.keys`` up to the furthest key any of its
    queries attends, joining each tile's exponentials by the online
    softmax."""
    slices, n, _ = query.shape
    m = key.shape[1]
    limit = np.full((slices, n), m) if limits is None else np.clip(limits, 0, m)
    output = np.zeros((slices, n, value.shape[-1]), dtype=query.dtype)
    minus_infinity = query.dtype.type(-np.inf)
    for s in range(slices):
        for first_row in range(0, n, flash.rows):
            rows = slice(first_row, min(n, first_row + flash.rows))
            row_limit = limit[s, rows][:, None]
            most = np.full(row_limit.shape, minus_infinity)
            total = np.zeros(row_limit.shape, dtype=query.dtype)
            out = np.zeros((row_limit.shape[0], value.shape[-1]), dtype=query.dtype)
            for first_key in range(0, int(row_limit.max()), flash.keys):
                keys = slice(first_key, min(m, first_key + flash.keys))
                scores = (query[s, rows] * query.dtype.type(scale)) @ key[s, keys].T
                allowed = np.arange(keys.start, keys.stop) < row_limit
                tile_most = np.maximum(most, np.max(np.where(allowed, scores, minus_infinity), axis=1, keepdims=True))
                shift = np.where(tile_most == minus_infinity, 0, tile_most)
                with np.errstate(invalid="ignore", over="ignore"):
                    correction = np.exp(most - shift)
                    weights = np.where(allowed, np.exp(scores - shift), 0)
                total = total * correction + weights.sum(axis=1, keepdims=True)
                out = out * correction + weights @ value[s, keys]
                most = tile_most
            output[s, rows] = out / np.where(total == 0, 1, total)
    return output


def _plan(dtype, rows, keys):
    return cupy_flash.FlashPlan(np.dtype(dtype).name, 0, 0, rows, keys)


@settings(max_examples=300, deadline=None)
@given(
    batch=st.sampled_from([(), (1,), (3,), (2, 3)]),
    n=st.integers(1, 12),
    m=st.integers(1, 11),
    is_causal=st.booleans(),
    lengths=st.sampled_from([None, "batch_first", "sequence", "query"]),
    tiles=st.sampled_from([(32, 32), (4, 2), (2, 3), (1, 8)]),
    scale=st.sampled_from(["float", "array"]),
    dtype=st.sampled_from([np.float32, np.float64]),
    keys_batch=st.sampled_from(["same", "none", "last", "ones"]),
    seed=st.integers(0, 2**16),
)
def test_the_kernels_algorithm_computes_the_reference(
    batch, n, m, is_causal, lengths, tiles, scale, dtype, keys_batch, seed
):
    """Blocks of rows and tiles of keys of every size against the float64
    reference: causal calls with ``n`` above and below ``m``, key lengths of
    each layout (rows with no key get zeros), keys and values shared by
    every slice, a scale that is a float (the kernel's) or an array (folded
    into the queries first)."""
    rng = np.random.default_rng(seed)
    d_k, d_v = 3, 2
    query = rng.standard_normal((*batch, n, d_k)).astype(dtype)
    key_batch = {"same": batch, "none": (), "last": batch[-1:], "ones": (1,) * len(batch)}[keys_batch]
    key = rng.standard_normal((*key_batch, m, d_k)).astype(dtype)
    value = rng.standard_normal((*key_batch, m, d_v)).astype(dtype)
    key_lengths, lengths_per = None, "sequence"
    if lengths == "batch_first" and batch:
        key_lengths, lengths_per = rng.integers(0, m + 1, size=batch[0]), "batch"
    elif lengths == "sequence":
        key_lengths = rng.integers(0, m + 1, size=batch)
    elif lengths == "query":
        key_lengths, lengths_per = rng.integers(0, m + 1, size=(*batch, n)), "query"
    allowed = reference.allowed_mask(
        n, m, batch_shape=batch, key_lengths=key_lengths, lengths_per=lengths_per, is_causal=is_causal
    )
    expected, _ = reference.scaled_dot_product_attention(query, key, value, allowed=allowed, scale=0.7)
    got = cupy_attention.attend_fused(
        xp,
        numpy_flash_kernel,
        _plan(dtype, *tiles),
        query=query,
        key=key,
        value=value,
        key_lengths=key_lengths,
        is_causal=is_causal,
        scale=0.7 if scale == "float" else np.asarray(0.7, dtype=dtype),
        batch_shape=batch,
    )
    assert got.dtype == dtype and got.shape == expected.shape
    tolerance = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(got, expected, rtol=tolerance, atol=tolerance)


def test_a_row_whose_scores_are_all_minus_infinity_gets_zeros_and_a_nan_propagates():
    """The shift of a row with no finite score yet is 0, so that its
    exponentials weigh 0 (exp(-inf + inf) would be NaN): attnx's zeros.  A
    NaN score makes its row NaN, as in attnx's algorithm."""
    query = np.ones((1, 3, 2))
    query[0, 0] = -np.inf  # scores of -inf against positive keys
    query[0, 1, 0] = np.nan
    key = np.abs(np.random.default_rng(7).standard_normal((1, 40, 2))) + 0.5
    value = np.ones((1, 40, 2))
    for tiles in ((32, 32), (1, 8)):
        got = numpy_flash_kernel(_plan(np.float64, *tiles), query, key, value, None, 1.0)
        assert np.array_equal(got[0, 0], [0.0, 0.0])
        assert np.isnan(got[0, 1]).all()
        np.testing.assert_allclose(got[0, 2], [1.0, 1.0])


def test_a_kernel_that_drops_the_limits_fails():
    """The test above can fail: a kernel that ignored the causal rule would."""
    query = np.ones((1, 4, 2))
    key = value = np.arange(8.0).reshape(1, 4, 2)
    arguments = dict(query=query, key=key, value=value, key_lengths=None, is_causal=True, scale=1.0)
    plan = _plan(np.float64, 32, 32)
    right = cupy_attention.attend_fused(xp, numpy_flash_kernel, plan, **arguments, batch_shape=(1,))
    wrong = cupy_attention.attend_fused(
        xp, lambda *args: numpy_flash_kernel(*args[:4], None, args[5]), plan, **arguments, batch_shape=(1,)
    )
    assert not np.allclose(right, wrong)


@pytest.mark.parametrize(
    ("dtype_name", "d_k", "d_v", "n", "rows"),
    [
        ("float32", 64, 64, 8192, 128),
        ("float32", 64, 64, 512, 128),
        ("float32", 80, 80, 512, 128),  # the most features that 128 queries' shared memory holds
        ("float32", 81, 64, 512, 64),
        ("float32", 128, 128, 8192, 64),
        ("float32", 136, 136, 8192, 64),  # the most features a thread's registers hold
        ("float32", 40, 24, 16, 32),  # 16 queries: a warp's block, not 112 threads idle
        ("float32", 64, 64, 97, 128),  # 97 queries: 31 threads idle
        ("float32", 64, 64, 96, 64),
        ("float64", 40, 40, 8192, 128),
        ("float64", 64, 64, 8192, 64),
        ("float64", 3, 2, 33, 64),
    ],
)
def test_plan(dtype_name, d_k, d_v, n, rows):
    planned = cupy_flash.plan(dtype_name, d_k, d_v, n, n, 8)
    assert planned == cupy_flash.FlashPlan(dtype_name, d_k, d_v, rows, 8)


@pytest.mark.parametrize(
    ("slices", "n", "m", "is_causal", "budget", "fused"),
    [
        (8, 256, 256, False, 2**29, True),  # 2**16 scores a slice: small
        (64, 128, 128, True, 2**29, True),
        (8, 512, 512, False, 2**29, False),  # 2**18: attend's one block
        (8, 8192, 8192, False, 2**29, False),  # 4 blocks of 2 slices
        (8, 8192, 8192, True, 2**29, False),  # 4 causal blocks of rows
        (8, 8192, 8192, False, 2**26, True),  # 32 blocks of a 64 MiB budget
        (8, 2048, 2048, False, 2**24, True),  # 8 of 16 MiB
        (8, 2048, 2048, False, 2**25, False),  # 4 of 32 MiB
        (1, 300, 2**20, False, 2**29, False),  # whole rows of a million keys: 1 block
        (1, 300, 2**20, False, 2**20, True),  # blocks of 4,096 keys: 256
    ],
)
def test_prefers_fused(slices, n, m, is_causal, budget, fused):
    assert cupy_attention.prefers_fused(slices, n, m, 4, is_causal, budget) is fused


@pytest.mark.parametrize(
    ("dtype_name", "d_k", "d_v", "n", "m", "slices"),
    [
        ("float16", 64, 64, 128, 128, 8),  # computed in float32 by the native, never here
        ("float32", 137, 64, 128, 128, 8),  # past a thread's registers, even in tiles of 8 keys
        ("float32", 64, 137, 128, 128, 8),
        ("float64", 65, 8, 128, 128, 8),
        ("float32", 64, 64, 2**31, 8, 1),  # past the kernel's int32 positions
        ("float32", 64, 64, 8, 2**31, 1),
        ("float32", 64, 64, 32, 8, 2**31),  # past CUDA's grid
    ],
)
def test_plan_declines(dtype_name, d_k, d_v, n, m, slices):
    assert cupy_flash.plan(dtype_name, d_k, d_v, n, m, slices) is None


def test_kernel_source_is_written_for_each_plan():
    plan = cupy_flash.FlashPlan("float64", 40, 3, 32, 8)
    source = cupy_flash.kernel_source(plan)
    assert source.startswith("typedef double T;\ntypedef double2 V;\n")
    for line in ("#define D 40", "#define DV 3", "#define VEC 2", "#define DP 40", "#define DVP 4"):
        assert f"\n{line}\n" in source
    assert "#define ROWS 32\n#define KEYS 8\n" in source
    assert 'extern "C" __global__ void __launch_bounds__(ROWS) flash_float64_40_3_32_8(' in source
    assert "KERNEL_NAME" not in source
