"""The CuPy native's blocking (``attnx_backends.cupy_attention.attend``), on
the CPU: the same code run over NumPy arrays with the row softmax written in
NumPy from the kernel's contract.  The kernel itself needs a GPU; the
conformance suite on CuPy (``attnx conformance cupy``) checks the whole
there, and ``bench/gpu_checks.py native`` times it."""

from __future__ import annotations

import array_api_compat.numpy as xp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from attnx_backends import cupy_attention
from attnx_conformance import reference


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
    shared_keys=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_blocks_compute_the_reference(
    batch, n, m, is_causal, lengths, mask_kind, chunks, budget, dtype, shared_keys, seed
):
    """Every plan (whole rows, blocks of keys joined by the online softmax,
    causal blocks of rows, a budget of a few scores) against the float64
    reference, with masks (shared by every slice, or with entries per batch,
    per head or per slice), key lengths of each layout, keys and values
    shared by every slice (broadcast over the batch) and rows that have no
    key at all."""
    rng = np.random.default_rng(seed)
    d_k, d_v = 3, 2
    query = rng.standard_normal((*batch, n, d_k)).astype(dtype)
    key_batch = () if shared_keys else batch
    key = rng.standard_normal((*key_batch, m, d_k)).astype(dtype)
    value = rng.standard_normal((*key_batch, m, d_v)).astype(dtype)
    batch_shape = batch
    key_lengths, lengths_per = None, "sequence"
    if lengths == "batch_first" and batch:
        key_lengths, lengths_per = rng.integers(0, m + 1, size=batch[0]), "batch"
    elif lengths == "sequence":
        key_lengths = rng.integers(0, m + 1, size=batch)
    elif lengths == "query":
        key_lengths, lengths_per = rng.integers(0, m + 1, size=(*batch, n)), "query"
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


@pytest.mark.parametrize(
    ("slices", "n", "m", "is_causal", "budget", "expected"),
    [
        (8, 8192, 8192, False, 512 * 2**20, (2, 8192, 8192)),  # whole rows: two slices a block
        (8, 8192, 8192, True, 512 * 2**20, (8, 2048, 8192)),  # causal, 2**29 scores: four blocks of rows
        (128, 1024, 1024, True, 512 * 2**20, (128, 512, 1024)),  # 2**27: two
        (8, 2048, 2048, True, 512 * 2**20, (8, 2048, 2048)),  # 2**25: one
        (8, 100, 2**24, False, 2**20, (1, 64, 4096)),  # rows too long for the budget: blocks of keys
        (8, 100, 2**24, False, 1024, (1, 64, 512)),  # never fewer keys than MIN_KEYS
        (8, 8192, 8192, False, 512 * 2**20, (1, 8192, 8192)),  # 8 bytes a score: a real mask per slice
    ],
)
def test_plan(slices, n, m, is_causal, budget, expected):
    bytes_per_score = 8 if expected == (1, 8192, 8192) else 4
    assert cupy_attention.plan(slices, n, m, bytes_per_score, is_causal, budget, None) == expected


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


@pytest.mark.parametrize(("mask_dtype", "bytes_per_score"), [(np.float32, 8), (np.bool_, 5)])
def test_blocks_with_a_mask_per_slice_hold_it_and_their_scores_within_the_budget(mask_dtype, bytes_per_score):
    """Each block's entries of a mask with leading axes are taken beside its
    scores: the plan counts both against the memory budget."""
    rng = np.random.default_rng(5)
    query, key, value = (rng.standard_normal((8, 64, 4)).astype(np.float32) for _ in range(3))
    mask = (rng.random((8, 64, 64)) < 0.7).astype(mask_dtype)
    budget = 8 * 64 * 64 * 4  # every slice's float32 scores at once, had the mask taken no room
    sizes = []

    def recording_row_softmax(scores, limits, first_key):
        sizes.append(scores.size)
        return numpy_row_softmax(scores, limits, first_key)

    arguments = dict(query=query, key=key, value=value, mask=mask, key_lengths=None, is_causal=False, scale=0.5)
    cupy_attention.attend(xp, recording_row_softmax, **arguments, batch_shape=(8,), budget=budget, chunks=None)
    assert sizes and max(sizes) * bytes_per_score <= budget
