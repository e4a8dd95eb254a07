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
    d_k, d_v = 3, 2
    query = rng.standard_normal((*batch, n, d_k)).astype(dtype)
    # Keys and values with the batch's leading axes, none, its last, or ones: broadcast over the rest.
    key_batch = {"same": batch, "none": (), "last": batch[-1:], "ones": (1,) * len(batch)}[keys_batch]
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
