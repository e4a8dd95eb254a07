"""Invariants of attention, checked with hypothesis on every backend."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import attnx
from attnx_conformance import reference
from attnx_conformance.helpers import PROPERTY_SETTINGS, assert_close, rounded, tolerances

pytestmark = pytest.mark.attnx_operation("scaled_dot_product_attention")


@st.composite
def problems(draw, causal=st.booleans(), min_n=1):
    batch = draw(st.sampled_from([(), (1,), (2,), (2, 3)]))
    n, m = draw(st.integers(min_n, 6)), draw(st.integers(1, 6))
    d_k, d_v = draw(st.integers(1, 5)), draw(st.integers(1, 5))
    seed = draw(st.integers(0, 2**32 - 1))
    gen = np.random.default_rng(seed)
    q = gen.standard_normal((*batch, n, d_k)) * draw(st.sampled_from([0.1, 1.0, 10.0]))
    k = gen.standard_normal((*batch, m, d_k))
    v = gen.standard_normal((*batch, m, d_v))
    mask = gen.random((n, m)) < draw(st.floats(0.0, 1.0)) if draw(st.booleans()) else None
    return q, k, v, mask, draw(causal)


def _run(be, q, k, v, mask, causal, dtype="float64"):
    args = [be.array(a, dtype) for a in (q, k, v)]
    mask_arr = None if mask is None else be.array(mask)
    out, w = attnx.scaled_dot_product_attention(*args, mask=mask_arr, is_causal=causal, return_weights=True)
    return be.numpy(out), be.numpy(w)


def _allowed(mask, causal, n, m):
    allowed = np.ones((n, m), dtype=bool) if mask is None else mask.copy()
    if causal:
        allowed &= np.arange(m)[None, :] <= np.arange(n)[:, None] + (m - n)
    return allowed


@PROPERTY_SETTINGS
@given(problem=problems())
def test_weights_are_a_distribution_or_zero(attnx_backend, problem):
    q, k, v, mask, causal = problem
    out, w = _run(attnx_backend, q, k, v, mask, causal)
    allowed = _allowed(mask, causal, q.shape[-2], k.shape[-2])
    assert (w >= 0).all() and not np.isnan(out).any()
    sums = w.sum(-1)
    has_keys = np.broadcast_to(allowed.any(-1), sums.shape)
    np.testing.assert_allclose(sums[has_keys], 1.0, **tolerances(attnx_backend, factor=0.1))
    assert (sums[~has_keys] == 0).all() and (np.moveaxis(out, -1, 0)[:, ~has_keys] == 0).all()
    assert (w[..., ~allowed] == 0).all(), "masked weights must be exactly zero"


@PROPERTY_SETTINGS
@given(problem=problems(causal=st.just(True), min_n=2), data=st.data())
def test_causal_output_ignores_the_future(attnx_backend, problem, data):
    q, k, v, _, _ = problem
    n, m = q.shape[-2], k.shape[-2]
    # Queries 0..split see keys up to split + (m - n): change every key after
    # that (there is always one, as split < n - 1), and they must not move.
    split = data.draw(st.integers(0, n - 2), label="split")
    first_future = max(0, split + (m - n) + 1)
    out, _ = _run(attnx_backend, q, k, v, None, True)
    k2, v2 = k.copy(), v.copy()
    k2[..., first_future:, :] += 5.0
    v2[..., first_future:, :] -= 3.0
    out2, _ = _run(attnx_backend, q, k2, v2, None, True)
    np.testing.assert_array_equal(out[..., : split + 1, :], out2[..., : split + 1, :])


@PROPERTY_SETTINGS
@given(problem=problems(causal=st.just(False)), seed=st.integers(0, 1000))
def test_self_attention_is_permutation_equivariant(attnx_backend, problem, seed):
    x, _, _, _, _ = problem
    perm = np.random.default_rng(seed).permutation(x.shape[-2])
    out, _ = _run(attnx_backend, x, x, x, None, False)
    out_perm, _ = _run(attnx_backend, x[..., perm, :], x[..., perm, :], x[..., perm, :], None, False)
    np.testing.assert_allclose(out_perm, out[..., perm, :], **tolerances(attnx_backend))


@PROPERTY_SETTINGS
@given(problem=problems(), shift=st.floats(-50, 50))
def test_adding_a_constant_to_a_row_changes_nothing(attnx_backend, problem, shift):
    q, k, v, mask, causal = problem
    be = attnx_backend
    n, m = q.shape[-2], k.shape[-2]
    args = [be.array(a, "float64") for a in (q, k, v)]
    base = np.zeros((n, m))
    row_shift = base + shift * np.arange(1, n + 1)[:, None] / n
    out0 = attnx.scaled_dot_product_attention(*args, mask=be.array(base), is_causal=causal)
    out1 = attnx.scaled_dot_product_attention(*args, mask=be.array(row_shift), is_causal=causal)
    np.testing.assert_allclose(be.numpy(out1), be.numpy(out0), **tolerances(be, factor=10))


@PROPERTY_SETTINGS
@given(problem=problems(), query_chunk=st.integers(1, 7), key_chunk=st.integers(1, 7), with_lengths=st.booleans())
def test_chunked_algorithm_computes_the_plain_one(attnx_backend, problem, query_chunk, key_chunk, with_lengths):
    """The memory-efficient algorithm (any block sizes) equals the plain one."""
    from attnx.attention import sdpa_generic

    q, k, v, mask, causal = problem
    be = attnx_backend
    args = dict(zip(("query", "key", "value"), (be.array(a, "float64") for a in (q, k, v))))
    lengths = None
    if with_lengths and q.ndim > 2:
        lengths = be.array(np.arange(q.shape[0]) % (k.shape[-2] + 1))
    common = dict(mask=None if mask is None else be.array(mask), key_lengths=lengths, is_causal=causal, scale=0.7)
    plain = sdpa_generic(be.xp, **args, **common, return_weights=False)
    chunked = sdpa_generic(be.xp, **args, **common, return_weights=False, chunks=(query_chunk, key_chunk))
    np.testing.assert_allclose(be.numpy(chunked), be.numpy(plain), **tolerances(be))


@st.composite
def block_plans(draw):
    """Attention whose blocks fall everywhere: batch and head shapes that
    broadcast, sizes the chunks do not divide, and memory budgets that split
    the batch, the heads and the rows into many blocks."""
    batch, key_batch = draw(
        st.sampled_from([((), ()), ((3,), (3,)), ((3,), ()), ((2, 3), (2, 3)), ((2, 3), (2, 1)), ((3, 2), (1, 2))])
    )
    n, m = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    d_k, d_v = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    causal = draw(st.booleans())
    chunk_size = draw(st.one_of(st.none(), st.integers(1, 10), st.tuples(st.integers(1, 10), st.integers(1, 10))))
    budget = draw(st.sampled_from([None, 64, 300, 2000]))
    gen = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    q = gen.standard_normal((*batch, n, d_k))
    k = gen.standard_normal((*key_batch, m, d_k))
    v = gen.standard_normal((*key_batch, m, d_v))
    return q, k, v, causal, chunk_size, budget


@PROPERTY_SETTINGS
@given(problem=block_plans())
def test_every_block_plan_computes_attention(attnx_backend, problem):
    """However the work is cut (explicit chunks, a memory budget that splits
    the batch and the rows, broadcast heads), the result is attention: the
    float64 reference, written from the formula.  A native implementation
    with its own plan is held to the same."""
    be = attnx_backend
    q, k, v, causal, chunk_size, budget = problem
    n, m = q.shape[-2], k.shape[-2]
    batch_shape = np.broadcast_shapes(q.shape[:-2], k.shape[:-2])
    allowed = np.broadcast_to(_allowed(None, causal, n, m), (*batch_shape, n, m))
    expected, _ = reference.scaled_dot_product_attention(
        *(rounded(a, be, "float64") for a in (q, k, v)), allowed=allowed, scale=0.5
    )
    args = [be.array(a, "float64") for a in (q, k, v)]
    with contextlib.ExitStack() as stack:
        if budget is not None:
            stack.enter_context(attnx.memory_budget(budget))
        out = attnx.scaled_dot_product_attention(*args, is_causal=causal, scale=0.5, chunk_size=chunk_size)
    assert_close(out, expected, be, "float64")


@st.composite
def call_sequences(draw, dtypes):
    """Calls drawn from few signatures, so that signatures repeat."""
    signature = st.tuples(
        st.sampled_from([(), (2,), (1, 2)]),  # leading shape
        st.sampled_from([2, 3]),  # n
        st.sampled_from([2, 3]),  # m
        st.sampled_from([2, 4]),  # d_k
        st.sampled_from(dtypes),
        st.booleans(),  # is_causal
        st.sampled_from([None, 0.5]),  # scale
    )
    return draw(st.lists(signature, min_size=2, max_size=10)), draw(st.integers(0, 2**32 - 1))


@PROPERTY_SETTINGS
@given(data=st.data())
def test_each_call_of_a_sequence_computes_its_own_attention(attnx_backend, data):
    """Whatever calls came before, each computes its own attention: a
    backend's plans (:meth:`attnx.Backend.specialize`) serve only calls of
    their own signature."""
    be = attnx_backend
    calls, seed = data.draw(call_sequences(be.dtypes), label="calls")
    gen = np.random.default_rng(seed)
    for batch, n, m, d_k, dtype, causal, scale in calls:
        q, k, v = (gen.standard_normal((*batch, rows, d_k)) for rows in (n, m, m))
        out = attnx.scaled_dot_product_attention(
            *(be.array(a, dtype) for a in (q, k, v)), is_causal=causal, scale=scale
        )
        rounded_inputs = (rounded(a, be, dtype) for a in (q, k, v))
        allowed = _allowed(None, causal, n, m)
        expected, _ = reference.scaled_dot_product_attention(*rounded_inputs, allowed=allowed, scale=scale)
        assert_close(out, expected, be, dtype)
