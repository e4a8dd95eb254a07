"""The CuPy native on the CPU: its blocking
(``attnx_backends.cupy_attention.attend``) run over NumPy arrays with the
row softmax written in NumPy from the kernel's contract, and its fused
kernel's (``cupy_flash``) plans and algorithm, and the backend's reading of
device names (``cupy_backend``).  The kernels themselves need
a GPU; the conformance suite on CuPy (``attnx conformance cupy``) checks
the whole there, and ``bench/gpu_checks.py native`` and ``flash`` time
it."""

from __future__ import annotations

import dataclasses
import functools

import array_api_compat.numpy as xp
import cuda_on_cpu
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnx_backends import cupy_attention, cupy_backend, cupy_cudnn, cupy_flash, cupy_tiled, cupy_tiled_backward
from attnx_conformance import reference

needs_compiler = pytest.mark.skipif(cuda_on_cpu.UNAVAILABLE is not None, reason=str(cuda_on_cpu.UNAVAILABLE))


def numpy_row_softmax(scores, limits, first_key):
    """The kernel's contract: each row's allowed keys (``limits - first_key``
    of them) exponentiated in place, shifted by their maximum; the rest 0; a
    row with nothing allowed (or only ``-inf``) all 0.  Each row's divisor:
    its sum, or 1 where that is 0."""
    count, width = scores.shape
    limit = np.full(count, width) if limits is None else np.clip(limits - first_key, 0, width)
    allowed = np.arange(width) < limit[:, None]
    most = np.max(np.where(allowed, scores, -np.inf), axis=1, initial=-np.inf)
    none = most == -np.inf
    with np.errstate(invalid="ignore"):
        exponentials = np.exp(scores - np.where(none, 0, most)[:, None])
    scores[...] = np.where(allowed & ~none[:, None], exponentials, 0)
    totals = scores.sum(axis=1)
    return most, np.where(totals == 0, 1, totals)


def test_kernel_source_is_written_for_each_dtype():
    for name, text in (("float32", "float"), ("float64", "double")):
        source = cupy_attention.kernel_source(name)
        assert source.startswith(f"typedef {text} T;\n")
        assert f'extern "C" __global__ void row_softmax_{name}(T* scores' in source
        assert "KERNEL_NAME" not in source


def random_call(rng, batch, n, m, dtype, keys_batch, lengths):
    """``(query, key, value, key_lengths, lengths_per)`` of a call over
    ``batch``: keys and values with the batch's leading axes (``"same"``),
    none, its last, or ones (broadcast over the rest); key lengths per batch
    entry (``"batch_first"``), per sequence, per query, or none."""
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
    return query, key, value, key_lengths, lengths_per


@settings(max_examples=300, deadline=None)
@given(
    batch=st.sampled_from([(), (1,), (3,), (2, 3)]),
    n=st.integers(1, 9),
    m=st.integers(1, 11),
    is_causal=st.booleans(),
    lengths=st.sampled_from([None, "batch_first", "sequence", "query"]),
    mask_kind=st.sampled_from(
        [None, "bool", "real", "keys_row", "scalar", "leading_one", "padding", "per_batch", "per_head", "per_slice"]
    ),
    chunks=st.sampled_from([None, (2, 3), (4, 1), (1, 5)]),
    budget=st.sampled_from([2**20, 96]),
    dtype=st.sampled_from([np.float32, np.float64]),
    keys_batch=st.sampled_from(["same", "none", "last", "ones"]),
    seed=st.integers(0, 2**16),
)
def test_blocks_compute_the_reference(
    batch, n, m, is_causal, lengths, mask_kind, chunks, budget, dtype, keys_batch, seed
):
    """Every plan (whole rows, blocks of keys joined by the online softmax,
    causal blocks of rows, a budget of a few scores) against the float64
    reference, with masks (shared by every slice, or with entries per batch,
    per head or per slice), key lengths of each layout, keys and values
    shared by every slice (broadcast over the batch) and rows that have no
    key at all."""
    rng = np.random.default_rng(seed)
    query, key, value, key_lengths, lengths_per = random_call(rng, batch, n, m, dtype, keys_batch, lengths)
    batch_shape = batch
    mask = allowed_by_mask = additive = None
    if mask_kind == "bool":
        mask = allowed_by_mask = rng.random((n, m)) < 0.7
    elif mask_kind == "real":
        mask = additive = np.where(rng.random((n, m)) < 0.2, -np.inf, rng.standard_normal((n, m))).astype(dtype)
    elif mask_kind == "keys_row":  # one row of keys, for every query
        mask = allowed_by_mask = rng.random(m) < 0.7
    elif mask_kind == "scalar":  # added to every score
        mask = additive = np.asarray(1.5, dtype=dtype)
    elif mask_kind == "leading_one":  # leading axes of one entry, as many as the batch's
        mask = additive = rng.standard_normal((*(1,) * len(batch), n, m)).astype(dtype)
    elif mask_kind == "padding" and batch:  # (B, 1, 1, m): keys per batch entry
        mask = allowed_by_mask = rng.random((batch[0], *(1,) * len(batch[1:]), 1, m)) < 0.7
    elif mask_kind == "per_batch" and batch:  # (B, 1, n, m)
        mask = allowed_by_mask = rng.random((batch[0], *(1,) * len(batch[1:]), n, m)) < 0.7
    elif mask_kind == "per_head" and batch:  # (H, n, m) after the batch's first axes: a per-head bias
        bias = np.where(rng.random((batch[-1], n, m)) < 0.2, -np.inf, rng.standard_normal((batch[-1], n, m)))
        mask = additive = bias.astype(dtype)
    elif mask_kind == "per_slice" and batch:  # (*batch, n, m), real, in float64 whatever the inputs
        mask = additive = np.where(rng.random((*batch, n, m)) < 0.2, -np.inf, rng.standard_normal((*batch, n, m)))
    allowed = reference.allowed_mask(
        n,
        m,
        batch_shape=batch_shape,
        mask=allowed_by_mask,
        key_lengths=key_lengths,
        lengths_per=lengths_per,
        is_causal=is_causal,
    )
    expected, _ = reference.scaled_dot_product_attention(
        query, key, value, allowed=allowed, additive=additive, scale=0.7
    )
    got = cupy_attention.attend(
        xp,
        numpy_row_softmax,
        query=query,
        key=key,
        value=value,
        mask=mask,
        key_lengths=key_lengths,
        is_causal=is_causal,
        scale=0.7,
        batch_shape=batch_shape,
        budget=budget,
        chunks=chunks,
    )
    assert got.dtype == dtype and got.shape == expected.shape
    tolerance = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(got, expected, rtol=tolerance, atol=tolerance)


def run_on_cpu(source, name, shared_bytes, grid, block, arguments):
    """:func:`cupy_launch.run`'s launch, on the CPU (``tests/cuda_on_cpu.py``)."""
    cuda_on_cpu.RawKernel(source, name)(grid, block, arguments, shared_mem=shared_bytes)


#: The kernels' shells given NumPy for CuPy and the CPU for the GPU: each
#: shell runs as it runs on a GPU, its kernels' CUDA source included.
ON_CPU = {"arrays": np, "run": run_on_cpu}
cpu_tiled_kernel = functools.partial(cupy_tiled.attend, **ON_CPU)
cpu_tiled_backward = functools.partial(cupy_tiled_backward.attend, **ON_CPU)


@needs_compiler
@settings(max_examples=100, deadline=None)
@given(
    batch=st.sampled_from([(), (2,), (2, 3)]),
    n=st.sampled_from([1, 2, 63, 64, 65, 150]),
    m=st.sampled_from([1, 5, 31, 32, 33, 100]),
    features=st.sampled_from([(3, 2), (64, 40), (33, 64), (128, 128)]),
    tiling=st.sampled_from([(4, 4), (2, 8), (1, 1)]),
    splits=st.sampled_from([1, 1, 2, 3, 7]),
    is_causal=st.booleans(),
    lengths=st.sampled_from([None, "sequence", "query"]),
    keys_batch=st.sampled_from(["same", "none"]),
    seed=st.integers(0, 2**16),
)
def test_the_tiled_kernel_computes_the_reference(
    batch, n, m, features, tiling, splits, is_causal, lengths, keys_batch, seed
):
    """The tiled fused kernel's CUDA source on the CPU against the float64
    reference: blocks of 64 queries and tiles of 32 keys cut short or not,
    causal calls with ``n`` above and below ``m`` (the blocks of the last
    queries first), key lengths per sequence and per query (rows with no key
    get zeros), keys shared by the batch, features that fill no vector and
    128 of them (shared memory past CUDA's default 48 KiB), in tilings of a
    thread's queries and keys down to one of each, the keys in splits joined
    by the combine kernel (some with no key: more splits than tiles)."""
    rng = np.random.default_rng(seed)
    d_k, d_v = features
    query = rng.standard_normal((*batch, n, d_k)).astype(np.float32)
    key_batch = batch if keys_batch == "same" else ()
    key = rng.standard_normal((*key_batch, m, d_k)).astype(np.float32)
    value = rng.standard_normal((*key_batch, m, d_v)).astype(np.float32)
    key_lengths = None
    if lengths == "sequence":
        key_lengths = rng.integers(0, m + 1, size=batch)
    elif lengths == "query":
        key_lengths = rng.integers(0, m + 1, size=(*batch, n))
    allowed = reference.allowed_mask(
        n, m, batch_shape=batch, key_lengths=key_lengths, lengths_per=lengths or "sequence", is_causal=is_causal
    )
    expected, _ = reference.scaled_dot_product_attention(query, key, value, allowed=allowed, scale=d_k**-0.5)
    got = cupy_attention.attend_fused(
        xp,
        cpu_tiled_kernel,
        cupy_tiled.TiledPlan(d_k, d_v, *tiling, splits=splits),
        query=query,
        key=key,
        value=value,
        key_lengths=key_lengths,
        is_causal=is_causal,
        scale=d_k**-0.5,
        batch_shape=batch,
    )
    assert got.dtype == np.float32 and got.shape == expected.shape
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


@needs_compiler
@pytest.mark.parametrize("splits", [2, 5])
def test_split_keys_join_scores_past_the_exponentials_range(splits):
    """Scores of some 400 (exp(400) overflows float32): each split shifts
    by its own maximum, and the combine kernel joins the splits by theirs,
    the largest first: the reference's rows, finite.  Splits without keys
    (5 splits of 40 keys in tiles of 32) weigh nothing."""
    rng = np.random.default_rng(9)
    query = (rng.standard_normal((2, 3, 16)) * 40).astype(np.float32)
    key = rng.standard_normal((2, 40, 16)).astype(np.float32)
    value = rng.standard_normal((2, 40, 8)).astype(np.float32)
    got, stats = cpu_tiled_kernel(
        cupy_tiled.TiledPlan(16, 8, splits=splits), query, key, value, None, 1.0, with_stats=True
    )
    expected, _ = reference.scaled_dot_product_attention(query, key, value, scale=1.0)
    scores = np.einsum("snd,smd->snm", query.astype(np.float64), key)
    assert np.abs(scores).max() > 200
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)
    log_sum = scores.max(-1) + np.log(np.exp(scores - scores.max(-1, keepdims=True)).sum(-1))
    np.testing.assert_allclose(stats, log_sum, rtol=1e-5)


@needs_compiler
@settings(max_examples=60, deadline=None)
@given(
    slices=st.sampled_from([1, 3]),
    n=st.sampled_from([1, 2, 63, 64, 65, 150]),
    m=st.sampled_from([1, 5, 31, 32, 33, 100]),
    features=st.sampled_from([(3, 2), (64, 40), (33, 64), (128, 128), (65, 96)]),
    is_causal=st.booleans(),
    lengths=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_the_tiled_backward_computes_the_reference(slices, n, m, features, is_causal, lengths, seed):
    """The backward's two kernels on the CPU, from the forward's outputs and
    row statistics, against the float64 reference's gradients: blocks of
    64 queries and 32 keys cut short or not, causal calls with ``n`` above
    and below ``m`` (the keys' blocks skip the queries before them), key
    lengths with rows of no key (zero gradients, never NaN), features
    padded to the 32 and 64 the gradients' threads share out."""
    rng = np.random.default_rng(seed)
    d_k, d_v = features
    query = rng.standard_normal((slices, n, d_k)).astype(np.float32)
    key = rng.standard_normal((slices, m, d_k)).astype(np.float32)
    value = rng.standard_normal((slices, m, d_v)).astype(np.float32)
    cotangent = rng.standard_normal((slices, n, d_v)).astype(np.float32)
    limits = rng.integers(0, m + 1, size=(slices, n)) if lengths else None
    scale = d_k**-0.5
    output, stats = cpu_tiled_kernel(
        cupy_tiled.TiledPlan(d_k, d_v), query, key, value, limits, scale, is_causal, with_stats=True
    )
    plans = cupy_tiled_backward.plans("float32", d_k, d_v, n, m, slices)
    got = cpu_tiled_backward(plans, query, key, value, output, stats, cotangent, limits, scale, is_causal)
    allowed = reference.allowed_mask(n, m, batch_shape=(slices,), is_causal=is_causal)
    if lengths:
        allowed = allowed & (np.arange(m) < limits[..., None])
    expected = reference.scaled_dot_product_attention_vjp(query, key, value, cotangent, allowed=allowed, scale=scale)
    for name, gradient in zip(("query", "key", "value"), got):
        assert gradient.dtype == np.float32 and not np.isnan(gradient).any()
        np.testing.assert_allclose(gradient, expected[name], rtol=2e-4, atol=2e-4, err_msg=name)


@needs_compiler
def test_the_tiled_kernel_gives_zeros_to_rows_of_minus_infinity_and_propagates_a_nan():
    """As :mod:`cupy_flash`: a NaN score makes its row NaN (the 8 threads
    that share a query join their maxima, NaN included); with its key left
    out, a row whose scores are all ``-inf`` gets zeros (its shift is 0) and
    the others attnx's values."""
    rng = np.random.default_rng(3)
    query = np.ones((1, 70, 8), dtype=np.float32)
    query[0, 0] = -np.inf  # scores of -inf against positive keys
    key = (np.abs(rng.standard_normal((1, 40, 8))) + 0.5).astype(np.float32)
    key[0, 37, 5] = np.nan  # the NaN in the second tile, in a thread other than the first
    value = rng.standard_normal((1, 40, 8)).astype(np.float32)
    tiled = cupy_tiled.plan("float32", 8, 8, 70, 40, 1)
    got = cpu_tiled_kernel(tiled, query, key, value, None, 1.0)
    assert np.isnan(got).all()  # every row attends the NaN's key
    limits = np.full((1, 70), 37, dtype=np.int32)  # the NaN's key left out: finite rows
    got = cpu_tiled_kernel(tiled, query, key, value, limits, 1.0)
    expected, _ = reference.scaled_dot_product_attention(query[:, 1:], key[:, :37], value[:, :37], scale=1.0)
    assert np.array_equal(got[0, 0], np.zeros(8))
    np.testing.assert_allclose(got[:, 1:], expected, rtol=1e-5, atol=1e-6)


@needs_compiler
def test_the_tiled_backward_gives_zero_gradients_to_a_row_of_minus_infinity():
    """A row whose scores are all ``-inf`` (its log-sum-exp ``-inf`` too)
    weighs nothing in the backward: zeros for its query, never NaN (its
    weights would be exp(-inf + inf)), and the keys' and values' gradients
    those of the other rows alone."""
    rng = np.random.default_rng(5)
    query = rng.standard_normal((1, 70, 8)).astype(np.float32)
    query[0, 3] = -np.inf  # scores of -inf against positive keys
    key = (np.abs(rng.standard_normal((1, 40, 8))) + 0.5).astype(np.float32)
    value, cotangent = (rng.standard_normal((1, rows, 8)).astype(np.float32) for rows in (40, 70))
    output, stats = cpu_tiled_kernel(cupy_tiled.TiledPlan(8, 8), query, key, value, None, 1.0, with_stats=True)
    assert stats[0, 3] == -np.inf and np.array_equal(output[0, 3], np.zeros(8))
    plans = cupy_tiled_backward.plans("float32", 8, 8, 70, 40, 1)
    d_query, d_key, d_value = cpu_tiled_backward(plans, query, key, value, output, stats, cotangent, None, 1.0)
    assert np.array_equal(d_query[0, 3], np.zeros(8))
    others = np.arange(70) != 3
    expected = reference.scaled_dot_product_attention_vjp(query[:, others], key, value, cotangent[:, others], scale=1.0)
    np.testing.assert_allclose(d_query[:, others], expected["query"], rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(d_key, expected["key"], rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(d_value, expected["value"], rtol=2e-4, atol=2e-4)


def tiled_vjp(query, key, value, shared_limit=cupy_tiled.SHARED_LIMIT, **options):
    """``cupy_attention.tiled_vjp`` of a call of NumPy arrays standing in for
    CuPy's, in the layout attnx computes it, the kernels run on the CPU."""
    from attnx.attention import validated_call

    call = validated_call("scaled_dot_product_attention", query, key, value, backend="numpy", **options)
    query, key, value, _, key_lengths, is_causal, batch_shape, _ = call.computed
    return cupy_attention.tiled_vjp(
        xp,
        cpu_tiled_kernel,
        cpu_tiled_backward,
        query=query,
        key=key,
        value=value,
        key_lengths=key_lengths,
        is_causal=is_causal,
        scale=call.scale,
        batch_shape=batch_shape,
        shared_limit=shared_limit,
    )


SEQUENCE_LENGTHS = np.array([[3, 0, 40], [40, 12, 1]])  # a sequence of no key among them


@needs_compiler
@pytest.mark.parametrize(
    ("options", "lengths_per"),
    [
        ({}, None),
        ({"is_causal": True}, None),  # n > m: the first queries attend no key
        ({"key_lengths": np.array([0, 17])}, "batch"),  # a batch entry of no key
        ({"key_lengths": SEQUENCE_LENGTHS, "is_causal": True}, "sequence"),
        ({"key_lengths": SEQUENCE_LENGTHS, "is_causal": True, "causal_align": "key_lengths"}, "sequence"),
        ({"shared_keys": True, "is_causal": True}, None),  # keys broadcast over the batch: gradients summed
    ],
)
def test_the_tiled_vjp_computes_the_reference(options, lengths_per):
    """attnx's call laid out for the tiled kernels (slices, key lengths as
    counts, the causal rule in the kernels or aligned to each sequence's
    lengths) and the gradients back over the batch, against the float64
    reference."""
    from attnx import _cotangents

    options = dict(options)
    rng = np.random.default_rng(11)
    n, m = 70, 40
    key_batch = (3,) if options.pop("shared_keys", False) else (2, 3)
    query = rng.standard_normal((2, 3, n, 16)).astype(np.float32)
    key = rng.standard_normal((*key_batch, m, 16)).astype(np.float32)
    value = rng.standard_normal((*key_batch, m, 8)).astype(np.float32)
    cotangent = rng.standard_normal((2, 3, n, 8)).astype(np.float32)
    output, backward = tiled_vjp(query, key, value, **options)
    d_query, d_key, d_value, d_scale = backward(cotangent)
    allowed = reference.allowed_mask(n, m, batch_shape=(2, 3), lengths_per=lengths_per or "sequence", **options)
    expected, _ = reference.scaled_dot_product_attention(query, key, value, allowed=allowed)
    np.testing.assert_allclose(output, expected, rtol=1e-5, atol=1e-5)
    gradients = reference.scaled_dot_product_attention_vjp(query, key, value, cotangent, allowed=allowed)
    got = {"query": d_query, "key": _cotangents.like(xp, d_key, key), "value": _cotangents.like(xp, d_value, value)}
    for name, gradient in got.items():
        np.testing.assert_allclose(gradient, gradients[name], rtol=2e-4, atol=2e-4, err_msg=name)
    assert d_scale is None


@pytest.mark.parametrize(
    ("dtype", "features", "options", "why"),
    [
        (np.float64, (16, 16), {}, "float32 only"),
        (np.float32, (16, 16), {"scale": np.asarray(0.5, dtype=np.float32)}, "an array scale has a gradient"),
        (np.float32, (129, 16), {}, "features past the kernels' registers"),
        (np.float32, (64, 64), {"shared_limit": 64 * 1024}, "a T4's 64 KiB: the keys' kernel asks 69"),
        (np.float32, (128, 128), {"shared_limit": 99 * 1024}, "an RTX 4090's 99 KiB: 109 and 117 asked"),
    ],
)
def test_the_tiled_vjp_declines_what_its_kernels_cannot_do(dtype, features, options, why):
    query = np.zeros((2, 5, features[0]), dtype=dtype)
    key = np.zeros((2, 7, features[0]), dtype=dtype)
    value = np.zeros((2, 7, features[1]), dtype=dtype)
    assert tiled_vjp(query, key, value, **options) is NotImplemented, why


def test_the_tiled_vjp_declines_grouped_heads_that_do_not_fold():
    query = np.zeros((1, 4, 5, 8), dtype=np.float32)  # 4 query heads over 2 key heads, one query a head
    key = value = np.zeros((1, 2, 7, 8), dtype=np.float32)
    assert tiled_vjp(query, key, value, enable_gqa=True, is_causal=True) is NotImplemented


@pytest.mark.parametrize(
    ("dtype_name", "d_k", "d_v", "n", "m", "shared_bytes"),
    [
        ("float32", 64, 64, 8192, 8192, 43_520),  # within CUDA's default 48 KiB
        ("float32", 128, 128, 8192, 8192, 76_288),  # past it: asked for at the kernel's making
        ("float32", 3, 2, 1, 1, 4 * (64 * 8 + 32 * 8 + 32 * 32 + 64 * 36)),  # features padded: 4 for keys, 32 values
        ("float32", 128, 1, 5, 5, 4 * (64 * 132 + 32 * 132 + 32 * 32 + 64 * 36)),
    ],
)
def test_tiled_plan(dtype_name, d_k, d_v, n, m, shared_bytes):
    assert cupy_tiled.plan(dtype_name, d_k, d_v, n, m, 8).shared_bytes == shared_bytes


def test_the_tiled_kernels_take_one_feature():
    assert cupy_tiled.plan("float32", 1, 1, 5, 5, 1) == cupy_tiled.TiledPlan(1, 1)
    assert cupy_tiled_backward.plans("float32", 1, 1, 5, 5, 1) is not None


@pytest.mark.parametrize(
    ("choices", "d", "expected"),
    [
        (((8, 4), (4, 4)), 128, (4, 4)),  # 8 queries of 128 value features: 160 floats, past the registers
        (((8, 4), (4, 4)), 64, (8, 4)),  # 8 of 64: 96 floats, just
        (((4, 8),), 128, (4, 8)),  # 4 queries and 8 keys of 128: 96
        (((8, 8),), 64, None),  # 8 and 8 of 64: 128
    ],
)
def test_tiled_plan_keeps_a_threads_outputs_and_scores_in_its_registers(monkeypatch, choices, d, expected):
    monkeypatch.setattr(cupy_tiled, "TILE_CHOICES", choices)
    tiled = cupy_tiled.plan("float32", d, d, 100, 100, 8, shared_limit=227 * 1024)
    assert (None if tiled is None else (tiled.rows_per_thread, tiled.keys_per_thread)) == expected


@pytest.mark.parametrize(
    ("n", "m", "slices", "planned"),
    [
        (1, 2**31 - 129, 1, True),  # positions within int32, a block's keys past the last among them
        (1, 2**31 - 128, 1, False),
        (1, 2**20, 65535, True),  # 65,535 x 32,768 blocks of keys: within CUDA's grid
        (1, 2**20, 65536, False),  # 2**31 blocks
        (2**22 - 64, 32, 2**15, True),  # 2**31 - 2**15 blocks of queries
        (2**22, 32, 2**15, False),  # 2**31
    ],
)
def test_backward_plans_keep_positions_and_grids_in_range(n, m, slices, planned):
    assert (cupy_tiled_backward.plans("float32", 64, 64, n, m, slices) is not None) == planned


@pytest.mark.parametrize(
    ("n", "m", "slices", "target_blocks", "splits", "key_span"),
    [
        (1, 16384, 32, None, 1, 16384),  # not asked: one split
        (1, 16384, 32, 264, 9, 1824),  # decoding, 32 heads on an H200 (132 multiprocessors): 9 x 32 blocks
        (4, 4096, 8 * 32, 264, 2, 2048),  # 256 blocks of grouped queries: 2 splits reach 264
        (1, 40, 1, 264, 2, 32),  # never more splits than tiles of keys
        (1, 2**20, 1, 264, 32, 2**15),  # at most MAX_SPLITS
        (8192, 8192, 8, 264, 1, 8192),  # 1,024 blocks of queries fill the GPU already
    ],
)
def test_tiled_plan_splits_the_keys_of_calls_too_few_blocks_to_fill_the_gpu(
    n, m, slices, target_blocks, splits, key_span
):
    tiled = cupy_tiled.plan("float32", 128, 128, n, m, slices, target_blocks=target_blocks)
    assert (tiled.splits, tiled.key_span(m)) == (splits, key_span)
    assert tiled.splits * tiled.key_span(m) >= m > (tiled.splits - 1) * tiled.key_span(m) - tiled.tile_keys


@pytest.mark.parametrize(
    ("dtype_name", "d_k", "d_v", "n", "m", "slices"),
    [
        ("float64", 64, 64, 100, 100, 8),  # float32 only: cupy_flash takes float64
        ("float16", 64, 64, 100, 100, 8),
        ("float32", 129, 64, 100, 100, 8),  # a thread's outputs past its registers
        ("float32", 64, 129, 100, 100, 8),
        ("float32", 64, 64, 2**31 - 64, 100, 1),  # positions past int32
        ("float32", 64, 64, 2**20, 100, 2**17),  # a grid past CUDA's
    ],
)
def test_tiled_plan_declines(dtype_name, d_k, d_v, n, m, slices):
    assert cupy_tiled.plan(dtype_name, d_k, d_v, n, m, slices) is None


@needs_compiler
@settings(max_examples=60, deadline=None)
@given(
    count=st.integers(1, 4),
    width=st.sampled_from([1, 7, 31, 32, 33, 200, 257, 600]),
    limits=st.sampled_from([None, "rows"]),
    first_key=st.integers(0, 40),
    special=st.sampled_from([None, "minus_infinity", "nan"]),
    dtype_name=st.sampled_from(["float32", "float64"]),
    seed=st.integers(0, 2**16),
)
def test_the_row_softmax_kernel_keeps_its_contract(count, width, limits, first_key, special, dtype_name, seed):
    """The row softmax's CUDA source on the CPU against its contract
    (:func:`numpy_row_softmax`): rows narrower and wider than a block of
    threads, limits before the first key, inside the row and past it, rows
    of only ``-inf`` and a NaN."""
    rng = np.random.default_rng(seed)
    scores = rng.standard_normal((count, width)).astype(dtype_name) * 4
    if special == "minus_infinity":
        scores[0] = -np.inf
    elif special == "nan":
        scores[-1, rng.integers(width)] = np.nan
    row_limits = None if limits is None else rng.integers(first_key - 3, first_key + width + 3, size=count)
    expected_scores = scores.copy()
    expected = numpy_row_softmax(expected_scores, row_limits, first_key)
    got = cpu_row_softmax(scores, row_limits, first_key)
    tolerance = 1e-6 if dtype_name == "float32" else 1e-14
    np.testing.assert_allclose(scores, expected_scores, rtol=tolerance, atol=tolerance)
    for got_part, expected_part in zip(got, expected):
        np.testing.assert_allclose(got_part, expected_part, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize(
    ("slices", "n", "m", "is_causal", "budget", "bytes_per_score", "expected"),
    [
        (8, 8192, 8192, False, 512 * 2**20, 4, (2, 8192, 8192)),  # whole rows: two slices a block
        (8, 8192, 8192, True, 512 * 2**20, 4, (8, 2048, 8192)),  # causal, 2**29 scores: four blocks of rows
        (128, 1024, 1024, True, 512 * 2**20, 4, (128, 512, 1024)),  # 2**27: two
        (8, 2048, 2048, True, 512 * 2**20, 4, (8, 2048, 2048)),  # 2**25: one
        (8, 100, 2**24, False, 2**20, 4, (1, 64, 4096)),  # rows too long for the budget: blocks of keys
        (8, 100, 2**24, False, 1024, 4, (1, 64, 512)),  # never fewer keys than MIN_KEYS
        (16, 4096, 4096, True, 512 * 2**20, 4, (16, 2048, 4096)),  # 2**28: two
        (8, 8192, 8192, False, 512 * 2**20, 8, (1, 8192, 8192)),  # 8 bytes a score: a real mask per slice
        (1, 64, 1024, False, 64 * 1024 * 4, 4, (1, 64, 1024)),  # whole rows, just
        (1, 64, 1024, False, 64 * 1024 * 4 - 1, 4, (1, 64, 1023)),  # not quite: as many keys as fit
    ],
)
def test_plan(slices, n, m, is_causal, budget, bytes_per_score, expected):
    planned = cupy_attention.plan(slices, n, m, bytes_per_score, is_causal, budget, None)
    assert planned == expected and all(type(size) is int for size in planned)


@pytest.mark.parametrize(("width", "threads"), [(1, 32), (100, 32), (512, 64), (1024, 128), (8192, 512), (2**20, 512)])
def test_threads_per_row(width, threads):
    assert cupy_attention.threads_per_row(width) == threads


def test_a_row_softmax_that_drops_the_limits_fails():
    """The test above can fail: a kernel that ignored the causal rule would."""
    query = np.ones((1, 4, 2))
    key = value = np.arange(8.0).reshape(1, 4, 2)
    arguments = dict(query=query, key=key, value=value, mask=None, key_lengths=None, scale=1.0)
    arguments.update(is_causal=True, batch_shape=(1,), budget=2**20, chunks=None)
    right = cupy_attention.attend(xp, numpy_row_softmax, **arguments)
    wrong = cupy_attention.attend(xp, lambda s, limits, first: numpy_row_softmax(s, None, first), **arguments)
    assert not np.allclose(right, wrong)


@pytest.mark.parametrize(
    ("mask_kind", "bytes_per_score"), [("per slice, real", 8), ("per slice, boolean", 5), ("shared", 4), (None, 4)]
)
def test_blocks_hold_their_scores_and_a_mask_per_slice_within_the_budget(mask_kind, bytes_per_score):
    """Each block's entries of a mask with leading axes are taken beside its
    scores: the plan counts both against the memory budget, and nothing
    else (a mask every slice shares is not taken per block)."""
    rng = np.random.default_rng(5)
    query, key, value = (rng.standard_normal((8, 64, 4)).astype(np.float32) for _ in range(3))
    allowed = rng.random((8, 64, 64)) < 0.7
    mask = {
        "per slice, real": np.where(allowed, 0.0, -np.inf).astype(np.float32),
        "per slice, boolean": allowed,
        "shared": allowed[0],
        None: None,
    }[mask_kind]
    budget = 8 * 64 * 64 * 4  # every slice's float32 scores at once
    sizes = []

    def recording_row_softmax(scores, limits, first_key):
        sizes.append(scores.size)
        return numpy_row_softmax(scores, limits, first_key)

    arguments = dict(query=query, key=key, value=value, mask=mask, key_lengths=None, is_causal=False, scale=0.5)
    cupy_attention.attend(xp, recording_row_softmax, **arguments, batch_shape=(8,), budget=budget, chunks=None)
    slices_per_block = min(8, budget // (64 * 64 * bytes_per_score))
    assert max(sizes) == slices_per_block * 64 * 64


def test_causal_blocks_of_rows_compute_no_key_in_every_rows_future():
    """Blocks of 64 causal rows (a budget of 64 rows) compute the keys up to
    their last row's diagonal: 64, 128, 192 and 256 of them."""
    rng = np.random.default_rng(6)
    query, key, value = (rng.standard_normal((1, 256, 4)) for _ in range(3))
    widths = []

    def recording_row_softmax(scores, limits, first_key):
        widths.append(scores.shape[1])
        return numpy_row_softmax(scores, limits, first_key)

    arguments = dict(query=query, key=key, value=value, mask=None, key_lengths=None, is_causal=True, scale=0.5)
    got = cupy_attention.attend(
        xp, recording_row_softmax, **arguments, batch_shape=(1,), budget=64 * 256 * 8, chunks=None
    )
    assert widths == [64, 128, 192, 256]
    allowed = reference.allowed_mask(256, 256, batch_shape=(1,), is_causal=True)
    expected, _ = reference.scaled_dot_product_attention(query, key, value, allowed=allowed, scale=0.5)
    np.testing.assert_allclose(got, expected, rtol=1e-12, atol=1e-12)


# The fused kernel (attnx_backends.cupy_flash): its plans, its source, and
# its algorithm (the tiles of keys, the online softmax with its shift for
# rows that have no finite score yet, each block's stopping key) written in
# NumPy, run through the native's marshalling (attend_fused).  The CUDA
# kernel itself: bench/gpu_checks.py flash_outputs and the suite on a GPU.


def numpy_flash_kernel(flash, query, key, value, limits, scale, causal=False):
    """The kernel's algorithm: each block of ``flash.block_queries`` queries walks
    the keys in tiles of ``flash.keys`` up to the furthest key any of its
    queries attends, joining each tile's exponentials by the online
    softmax."""
    assert isinstance(scale, float)  # the kernel's argument: an array scale is folded into the queries first
    slices, n, _ = query.shape
    m = key.shape[1]
    limit = np.full((slices, n), m) if limits is None else np.clip(limits, 0, m)
    if causal:  # the kernel's own rule, from each query's position
        limit = np.minimum(limit, np.clip(np.arange(n) + 1 + m - n, 0, None))
    output = np.zeros((slices, n, value.shape[-1]), dtype=query.dtype)
    minus_infinity = query.dtype.type(-np.inf)
    for s in range(slices):
        for first_row in range(0, n, flash.block_queries):
            rows = slice(first_row, min(n, first_row + flash.block_queries))
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


def _plan(dtype, rows, keys, queries=1):
    return cupy_flash.FlashPlan(np.dtype(dtype).name, 0, 0, rows, keys, queries)


# The kernels' own CUDA source, run on the CPU (tests/cuda_on_cpu.py): what
# NVRTC compiles on a GPU, launched as cupy_flash.attend and
# cupy_attention.cupy_row_softmax launch it, over NumPy arrays.


def cpu_flash_kernel(flash, query, key, value, limits, scale, causal=False):
    """:func:`cupy_flash.attend` on the CPU, the plan's tiles at the call's
    features."""
    flash = dataclasses.replace(flash, d_k=query.shape[-1], d_v=value.shape[-1])
    return cupy_flash.attend(flash, query, key, value, limits, scale, causal, **ON_CPU)


def cpu_row_softmax(scores, limits, first_key):
    """:func:`cupy_attention.cupy_row_softmax` on the CPU."""
    return cupy_attention.cupy_row_softmax(scores, limits, first_key, **ON_CPU)


FLASH_KERNELS = [numpy_flash_kernel, pytest.param(cpu_flash_kernel, marks=needs_compiler)]


@settings(max_examples=300, deadline=None)
@given(
    batch=st.sampled_from([(), (1,), (3,), (2, 3)]),
    n=st.integers(1, 12),
    m=st.integers(1, 11),
    is_causal=st.booleans(),
    lengths=st.sampled_from([None, "batch_first", "sequence", "query"]),
    tiles=st.sampled_from([(32, 32), (4, 2), (2, 3), (1, 8), (2, 2, 2), (1, 3, 4)]),
    scale=st.sampled_from(["float", "array"]),
    dtype=st.sampled_from([np.float32, np.float64]),
    keys_batch=st.sampled_from(["same", "none", "last", "ones"]),
    seed=st.integers(0, 2**16),
)
@pytest.mark.parametrize("kernel", FLASH_KERNELS)
def test_the_fused_kernel_computes_the_reference(
    kernel, batch, n, m, is_causal, lengths, tiles, scale, dtype, keys_batch, seed
):
    """The kernel's algorithm in NumPy, and its CUDA source on the CPU:
    blocks of rows and tiles of keys of every size against the float64
    reference: causal calls with ``n`` above and below ``m``, key lengths of
    each layout (rows with no key get zeros), keys and values shared by
    every slice, a scale that is a float (the kernel's) or an array (folded
    into the queries first)."""
    rng = np.random.default_rng(seed)
    query, key, value, key_lengths, lengths_per = random_call(rng, batch, n, m, dtype, keys_batch, lengths)
    allowed = reference.allowed_mask(
        n, m, batch_shape=batch, key_lengths=key_lengths, lengths_per=lengths_per, is_causal=is_causal
    )
    expected, _ = reference.scaled_dot_product_attention(query, key, value, allowed=allowed, scale=0.7)
    got = cupy_attention.attend_fused(
        xp,
        kernel,
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


@pytest.mark.parametrize("kernel", FLASH_KERNELS)
def test_a_row_whose_scores_are_all_minus_infinity_gets_zeros_and_a_nan_propagates(kernel):
    """The shift of a row with no finite score yet is 0, so that its
    exponentials weigh 0 (exp(-inf + inf) would be NaN): attnx's zeros.  A
    NaN score makes its row NaN, as in attnx's algorithm."""
    query = np.ones((1, 3, 2))
    query[0, 0] = -np.inf  # scores of -inf against positive keys
    query[0, 1, 0] = np.nan
    key = np.abs(np.random.default_rng(7).standard_normal((1, 40, 2))) + 0.5
    value = np.ones((1, 40, 2))
    for tiles in ((32, 32), (1, 8)):
        got = kernel(_plan(np.float64, *tiles), query, key, value, None, 1.0)
        assert np.array_equal(got[0, 0], [0.0, 0.0])
        assert np.isnan(got[0, 1]).all()
        np.testing.assert_allclose(got[0, 2], [1.0, 1.0])


@pytest.mark.parametrize("kernel", FLASH_KERNELS)
def test_a_fused_kernel_that_drops_the_limits_fails(kernel):
    """The test above can fail: a kernel that ignored the causal rule would."""
    query = np.ones((1, 4, 2))
    key = value = np.arange(8.0).reshape(1, 4, 2)
    arguments = dict(query=query, key=key, value=value, key_lengths=None, is_causal=True, scale=1.0)
    plan = _plan(np.float64, 32, 32)
    right = cupy_attention.attend_fused(xp, kernel, plan, **arguments, batch_shape=(1,))
    wrong = cupy_attention.attend_fused(
        xp, lambda *args: kernel(*args[:4], None, args[5], False), plan, **arguments, batch_shape=(1,)
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
def test_flash_plan(dtype_name, d_k, d_v, n, rows):
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
        (1, 64, 7 * 4096 + 1, False, 2**20, True),  # 8 blocks of keys, the last of one
        (1, 64, 7 * 4096, False, 2**20, False),  # 7
        (1, 7 * 64 + 1, 4096, False, 2**20, True),  # 8 blocks of rows, the last of one
        (29, 512, 512, False, 2**22, True),  # 8 blocks of 4 slices, the last of one
        (28, 512, 512, False, 2**22, False),
    ],
)
def test_prefers_fused(slices, n, m, is_causal, budget, fused):
    """Small calls and many rounds of blocks; with few features, so that no
    thread's walk over its keys decides (the next test's rule)."""
    assert cupy_attention.prefers_fused(slices, n, m, 8, 4, is_causal, budget) is fused


@pytest.mark.parametrize(
    ("slices", "n", "m", "features", "budget", "fused"),
    [
        (32, 1, 4096, 256, 2**29, False),  # decoding: 32 threads of a million products each
        (256, 4, 4096, 256, 2**29, False),  # grouped heads folded into rows: 1,024 queries
        (32, 1, 256, 256, 2**29, True),  # 2**16 products a thread: a small call still
        (32, 1, 2**20, 256, 2**29, False),  # a million keys in one round of blocks
        (1, 300, 2**14, 128, 2**20, True),  # 2**21 products a thread against 20 rounds of blocks
        (1, 300, 2**14, 128, 2**29, False),  # against one round
        (8, 512, 2**20, 128, 2**26, True),  # 4,096 queries: enough threads for the rounds
        (1, 4096, 4096, 128, 2**20, True),  # as many queries, within one slice
    ],
)
def test_prefers_fused_never_leaves_few_queries_to_walk_many_keys(slices, n, m, features, budget, fused):
    """A thread's walk over its keys (``m * features`` products) against
    the blocks' rounds (some ten launches each), where the queries are too
    few to fill the GPU."""
    assert cupy_attention.prefers_fused(slices, n, m, features, 4, False, budget) is fused


@pytest.mark.parametrize(
    ("dtype_name", "d_k", "d_v", "n", "m", "slices"),
    [
        ("float16", 64, 64, 128, 128, 8),  # computed in float32 by the native, never here
        ("float32", 137, 64, 128, 128, 8),  # past a thread's registers, even in tiles of 8 keys
        ("float32", 64, 137, 128, 128, 8),
        ("float64", 65, 8, 128, 128, 8),
        ("float32", 64, 64, 2**31 - 128, 8, 1),  # past the kernel's int32 positions
        ("float32", 64, 64, 8, 2**31 - 128, 1),
        ("float32", 64, 64, 32, 8, 2**31),  # past CUDA's grid
    ],
)
def test_flash_plan_declines(dtype_name, d_k, d_v, n, m, slices):
    assert cupy_flash.plan(dtype_name, d_k, d_v, n, m, slices) is None


def test_flash_kernel_source_is_written_for_each_plan():
    plan = cupy_flash.FlashPlan("float64", 41, 3, 32, 8)  # features padded to whole vectors of 2
    source = cupy_flash.kernel_source(plan)
    assert source.startswith("typedef double T;\ntypedef double2 V;\n")
    for line in ("#define D 41", "#define DV 3", "#define VEC 2", "#define DP 42", "#define DVP 4"):
        assert f"\n{line}\n" in source
    assert "#define ROWS 32\n#define KEYS 8\n" in source
    assert 'extern "C" __global__ void __launch_bounds__(ROWS) flash_float64_41_3_32_8(' in source
    assert "KERNEL_NAME" not in source


class _CupyDevice:
    """Stands for ``cupy.cuda.Device``, whose index is its ``id``."""

    def __init__(self, index):
        self.id = index


@pytest.mark.parametrize(
    ("device", "index"),
    [(0, 0), (3, 3), ("cuda", 0), ("cuda:0", 0), ("cuda:12", 12), (_CupyDevice(2), 2)],
)
def test_cupy_reads_device_names_and_indices(device, index):
    assert cupy_backend._device_index(device) == index


@pytest.mark.parametrize("device", ["cpu", "cuda:", "cuda:x", "cuda:-1", "cudax", "cuda:1:2", "gpu", True, -1, 1.0])
def test_cupy_refuses_what_is_not_a_cuda_device(device):
    """Not read as some other device: ``"cudax"`` or ``True`` would have been
    device 0 or 1."""
    with pytest.raises(ValueError, match=r"the cupy backend expects a CUDA device \('cuda:0', 0\), got"):
        cupy_backend._device_index(device)


#: A call the cuDNN route takes (see test_the_cudnn_route_takes_half_precision).
CUDNN_CALL = {"slices": 4, "n": 128, "m": 256, "d_k": 64, "d_v": 64, "is_causal": False, "scale": 0.125, "device": 0}


@pytest.fixture
def cudnn_here(monkeypatch):
    """cuDNN's route as if the frontend were here and built every graph:
    what is left is its rules, which these tests check (the graphs
    themselves need a GPU: ``bench/gpu_checks.py cudnn_outputs cudnn_vjp``)."""
    monkeypatch.setattr(cupy_cudnn, "unavailable_reason", lambda: None)
    monkeypatch.setattr(cupy_cudnn, "_forward", lambda call: "forward graph")
    monkeypatch.setattr(cupy_cudnn, "_backward", lambda call: "backward graph")


@pytest.mark.parametrize(
    ("dtype_name", "sizes"),
    [
        ("float16", {}),
        ("bfloat16", {"is_causal": True}),
        ("float16", {"groups": 4, "d_k": 128, "d_v": 32}),
        ("bfloat16", {"lengths": True}),
        ("float16", {"training": True, "is_causal": True, "groups": 2}),
    ],
)
def test_the_cudnn_route_takes_half_precision(cudnn_here, dtype_name, sizes):
    call = cupy_cudnn.plan(dtype_name, **{**CUDNN_CALL, **sizes})
    assert call == cupy_cudnn.CudnnCall(
        dtype_name, **{"groups": 1, "lengths": False, "training": False, **CUDNN_CALL, **sizes}
    )


@pytest.mark.parametrize(
    ("dtype_name", "sizes", "why"),
    [
        ("float32", {}, "float32 is attnx's own kernels' (cuDNN's would be TF32)"),
        ("float64", {}, "cuDNN has no float64 attention"),
        ("float16", {"d_k": 36}, "features cuDNN does not take: not a multiple of 8"),
        ("float16", {"d_v": 136}, "features past 128"),
        ("float16", {"is_causal": True, "n": 300, "m": 200}, "causal queries without keys must give zeros"),
        ("float16", {"scale": object()}, "a scale that is an array"),
        ("float16", {"is_causal": True, "lengths": True}, "cuDNN aligns the diagonal with each length, attnx with m"),
        ("bfloat16", {"lengths": True, "training": True}, "the backward of slices without keys"),
    ],
)
def test_the_cudnn_route_declines_what_it_cannot_do_exactly(cudnn_here, dtype_name, sizes, why):
    assert cupy_cudnn.plan(dtype_name, **{**CUDNN_CALL, **sizes}) is None, why


def cudnn_route(query, key, value, **options):
    """The route's ``(call, lengths)`` for a call of NumPy arrays standing in
    for CuPy's, in the layout attnx computes it (grouped heads, lengths per
    query from ``causal_align``), or None."""
    from attnx.attention import validated_call

    call = validated_call("scaled_dot_product_attention", query, key, value, backend="numpy", **options)
    query, key, value, _, key_lengths, is_causal, batch_shape, _ = call.computed
    return cupy_attention._cudnn_route(
        xp, query, key, value, key_lengths, is_causal, call.scale, batch_shape, device_index=0
    )


def _half(*shape):
    return np.zeros(shape, dtype=np.float16)


def test_the_cudnn_route_pads_each_slice_to_its_key_lengths(cudnn_here):
    call, lengths = cudnn_route(
        _half(3, 4, 20, 64), _half(3, 4, 30, 64), _half(3, 4, 30, 64), key_lengths=np.array([30, 17, 0])
    )
    assert (call.slices, call.groups, call.lengths, call.is_causal) == (12, 1, True, False)
    np.testing.assert_array_equal(lengths, np.repeat([30, 17, 0], 4))


@pytest.mark.parametrize("causal_align", ["key_lengths", "bottom_right"])
def test_the_cudnn_route_decodes_over_caches_of_their_own_lengths(cudnn_here, causal_align):
    """One query a sequence, aligned to its own length or to the last key:
    cuDNN's padding mask, the causal rule keeping every key up to the length."""
    options = {"is_causal": True, "causal_align": causal_align, "key_lengths": np.array([0, 1, 30])}
    call, lengths = cudnn_route(_half(3, 2, 1, 64), _half(3, 2, 30, 64), _half(3, 2, 30, 64), **options)
    assert (call.n, call.lengths, call.is_causal) == (1, True, False)
    np.testing.assert_array_equal(lengths, [0, 0, 1, 1, 30, 30])


@pytest.mark.parametrize(
    "options",
    [
        {"is_causal": True, "causal_align": "key_lengths", "key_lengths": np.array([5, 30, 30])},
        {"is_causal": True, "key_lengths": np.array([5, 30, 30])},
        {"key_lengths": np.array([[5] * 4, [30] * 4, [7, 8, 9, 10]])[:, None, :]},
    ],
    ids=["aligned to each length", "causal with lengths", "a length a query"],
)
def test_the_cudnn_route_declines_lengths_that_differ_within_a_slice(cudnn_here, options):
    assert cudnn_route(_half(3, 2, 4, 64), _half(3, 2, 30, 64), _half(3, 2, 30, 64), **options) is None


def test_the_cudnn_route_declines_lengths_for_grouped_heads(cudnn_here):
    """cuDNN's padding mask holds one length a batch entry, here a key
    slice, which a group's query heads share; lengths may differ between them."""
    q, k = _half(3, 4, 5, 64), _half(3, 1, 30, 64)
    assert cudnn_route(q, k, k)[0].groups == 4
    assert cudnn_route(q, k, k, key_lengths=np.array([30, 0, 2])) is None


def test_the_cudnn_route_asks_nothing_of_single_precision(cudnn_here, monkeypatch):
    """float32 (and float64) are attnx's own kernels': the route declines
    them before counting the lengths, which costs launches on a GPU."""

    def counted(*args, **kwargs):
        raise AssertionError("the lengths were counted")

    monkeypatch.setattr(cupy_attention.natives, "key_counts", counted)
    arrays = (np.zeros((3, 2, 4, 64), dtype=np.float32) for _ in range(3))
    assert cudnn_route(*arrays, key_lengths=np.array([1, 4, 2])) is None


@pytest.mark.parametrize("is_causal", [False, True])
def test_the_cudnn_route_reads_each_key_slice_once_for_its_group(cudnn_here, is_causal):
    call, lengths = cudnn_route(
        _half(2, 8, 16, 64), _half(2, 2, 16, 64), _half(2, 2, 16, 64), enable_gqa=True, is_causal=is_causal
    )
    # Heads that fold into rows (no causal rule to tell them apart) are one slice's rows.
    assert (call.slices, call.groups, call.n) == ((4, 4, 16) if is_causal else (4, 1, 64))
    assert lengths is None


def test_the_cudnn_route_gives_zeros_to_slices_without_keys(cudnn_here, monkeypatch):
    """cuDNN leaves a slice of length 0 undefined; attnx gives it zeros."""
    shapes = []

    def attend(call, query, key, value, lengths):
        shapes.append((query.shape, key.shape, value.shape))
        return np.full((*query.shape[:-1], value.shape[-1]), np.nan, dtype=query.dtype), None

    monkeypatch.setattr(cupy_cudnn, "attend", attend)
    q, k, v = _half(3, 4, 5, 64), _half(1, 4, 30, 64), _half(1, 4, 30, 32)
    call, lengths = cudnn_route(q, k, v, key_lengths=np.array([30, 0, 2]))
    output = cupy_attention._attend_cudnn(xp, call, lengths, q, k, v, (3, 4))
    assert shapes == [((3, 4, 5, 64), (3, 4, 30, 64), (3, 4, 30, 32))]  # lengths a slice: keys laid out for every slice
    assert np.all(output[1] == 0) and np.all(np.isnan(output[[0, 2]]))


def test_the_cudnn_route_says_why_it_cannot_run_without_cudnn():
    reason = cupy_cudnn.unavailable_reason()
    assert reason is None or "cudnn" in reason.lower()


def test_without_cudnn_the_route_declines_every_call(monkeypatch):
    monkeypatch.setattr(cupy_cudnn, "unavailable_reason", lambda: "no frontend")
    call = {"slices": 4, "n": 128, "m": 256, "d_k": 64, "d_v": 64, "is_causal": True, "scale": 0.125, "device": 0}
    assert cupy_cudnn.plan("float16", **call) is None


@pytest.mark.parametrize(
    ("choices", "d", "n", "expected"),
    [
        ((2, 1), 64, 8192, (64, 8, 2)),  # 2 x (64 + 8) floats fit; 128 threads of 2 queries pass the shared memory
        ((2, 1), 128, 8192, (64, 8, 1)),  # 2 x (128 + 8) floats do not fit: one query a thread
        ((2, 1), 64, 40, (32, 8, 2)),  # 40 queries: a block of 32 threads holds 64
        ((4, 2, 1), 32, 8192, (128, 8, 2)),  # 4 x (32 + 8) floats pass the registers
    ],
)
def test_flash_plan_gives_a_thread_several_queries_where_its_registers_hold_them(monkeypatch, choices, d, n, expected):
    monkeypatch.setattr(cupy_flash, "QUERY_CHOICES", choices)
    planned = cupy_flash.plan("float32", d, d, n, n, 8)
    assert (planned.rows, planned.keys, planned.queries) == expected
    source = cupy_flash.kernel_source(planned)
    assert f"#define QPT {expected[2]}\n" in source
    assert cupy_flash.kernel_name(planned).endswith("" if expected[2] == 1 else f"_{expected[2]}")
