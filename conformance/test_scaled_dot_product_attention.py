"""scaled_dot_product_attention against the float64 reference."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import attnx
from attnx.attention import sdpa_generic
from attnx_conformance import reference
from attnx_conformance.helpers import assert_close, rng, rounded

pytestmark = pytest.mark.attnx_operation("scaled_dot_product_attention")

# (query leading, key/value leading, n, m, d_k, d_v)
SHAPES = [
    ((), (), 4, 4, 8, 8),
    ((), (), 1, 1, 1, 1),
    ((2,), (2,), 1, 6, 4, 3),
    ((2,), (2,), 5, 1, 4, 3),
    ((2, 3), (2, 3), 4, 7, 8, 5),
    ((2, 4), (2, 1), 3, 5, 8, 8),  # one key/value head serving four query heads
    ((3, 2, 2), (1, 2), 2, 3, 4, 2),
]


def make_inputs(be, dtype, q_lead, kv_lead, n, m, d_k, d_v, seed=0):
    gen = rng(seed, n, m, d_k)
    q = gen.standard_normal((*q_lead, n, d_k))
    k = gen.standard_normal((*kv_lead, m, d_k))
    v = gen.standard_normal((*kv_lead, m, d_v))
    arrays = [be.array(a, dtype) for a in (q, k, v)]
    return arrays, [rounded(a, be, dtype) for a in (q, k, v)]


def dtypes_of(be):
    return be.dtypes


@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_matches_reference_over_shapes_and_dtypes(attnx_backend, shape):
    be = attnx_backend
    for dtype in be.dtypes:
        (q, k, v), (qr, kr, vr) = make_inputs(be, dtype, *shape)
        out, weights = attnx.scaled_dot_product_attention(q, k, v, return_weights=True)
        expected, expected_w = reference.scaled_dot_product_attention(qr, kr, vr)
        assert_close(out, expected, be, dtype, like=q)
        assert_close(weights, expected_w, be, dtype, like=q)
        assert_close(attnx.scaled_dot_product_attention(q, k, v), expected, be, dtype)


def _mask_cases(gen, batch, n, m):
    """(name, kwargs builder from be, reference allowed/additive builder)."""
    boolean = gen.random((*batch, n, m)) < 0.7
    boolean[..., 0, :] = False  # a fully masked row
    additive = np.where(gen.random((n, m)) < 0.3, -np.inf, gen.standard_normal((n, m)))
    per_batch = np.array([m, 2])[: batch[0]]
    per_query = gen.integers(0, m + 1, size=(*batch, n))
    return {
        "boolean": (dict(mask=boolean), dict(mask=boolean)),
        "additive": (dict(mask=additive), dict(additive=additive)),
        "causal": (dict(is_causal=True), dict(is_causal=True)),
        "lengths_per_batch": (dict(key_lengths=per_batch), dict(key_lengths=per_batch, lengths_per="batch")),
        "lengths_per_query": (dict(key_lengths=per_query), dict(key_lengths=per_query, lengths_per="query")),
        "causal_lengths_boolean": (
            dict(is_causal=True, key_lengths=per_batch, mask=boolean),
            dict(is_causal=True, key_lengths=per_batch, lengths_per="batch", mask=boolean),
        ),
        "all_masked": (dict(mask=np.zeros((n, m), dtype=bool)), dict(mask=np.zeros((n, m), dtype=bool))),
        "causal_additive": (dict(is_causal=True, mask=additive), dict(is_causal=True, additive=additive)),
        # Masks of fewer than two axes broadcast as any other: a row of keys, a scalar added to every score.
        "keys_row": (dict(mask=boolean[0, 0, 1]), dict(mask=boolean[0, 0, 1])),
        "additive_scalar": (dict(mask=np.array(1.5)), dict(additive=np.array(1.5))),
    }


CASES = list(_mask_cases(rng(1), (2, 3), 4, 6))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("n, m", [(4, 6), (6, 4), (5, 5)])
def test_masks_match_reference(attnx_backend, case, n, m):
    be = attnx_backend
    batch = (2, 3)
    kwargs, ref_kwargs = _mask_cases(rng(1), batch, n, m)[case]
    for dtype in be.dtypes:
        (q, k, v), (qr, kr, vr) = make_inputs(be, dtype, batch, batch, n, m, 8, 4)
        call = {}
        for name, value in kwargs.items():
            if isinstance(value, np.ndarray):
                value = be.array(value, dtype if value.dtype.kind == "f" else None)
            call[name] = value
        out, weights = attnx.scaled_dot_product_attention(q, k, v, return_weights=True, **call)
        additive = ref_kwargs.pop("additive", None)
        allowed = reference.allowed_mask(n, m, batch_shape=batch, **ref_kwargs)
        ref_kwargs["additive"] = additive
        if additive is not None:
            additive = rounded(additive, be, dtype)
        expected, expected_w = reference.scaled_dot_product_attention(qr, kr, vr, allowed=allowed, additive=additive)
        assert_close(weights, expected_w, be, dtype)
        assert_close(out, expected, be, dtype)
        assert_close(attnx.scaled_dot_product_attention(q, k, v, **call), expected, be, dtype)


def test_fully_masked_rows_give_zeros(attnx_backend):
    be = attnx_backend
    (q, k, v), _ = make_inputs(be, "float32", (2,), (2,), 3, 4, 4, 4)
    lengths = be.array(np.array([0, 2]))
    out, weights = attnx.scaled_dot_product_attention(q, k, v, key_lengths=lengths, return_weights=True)
    out, weights = be.numpy(out), be.numpy(weights)
    assert np.all(out[0] == 0) and np.all(weights[0] == 0)
    assert np.allclose(weights[1].sum(-1), 1) and np.all(weights[1][:, 2:] == 0)


def test_scale_argument(attnx_backend):
    be = attnx_backend
    (q, k, v), (qr, kr, vr) = make_inputs(be, "float64", (2,), (2,), 3, 5, 4, 2)
    out = attnx.scaled_dot_product_attention(q, k, v, scale=0.3)
    expected, _ = reference.scaled_dot_product_attention(qr, kr, vr, scale=0.3)
    assert_close(out, expected, be, "float64")


def test_a_scale_array_beyond_the_scores_dtype_is_refused(attnx_backend):
    """A float64 0-d scale of 1e300 for float32 inputs would be inf in the
    float32 scores: refused where its value can be read, as a float's is."""
    be = attnx_backend
    if "float64" not in be.dtypes or be.lazy:
        pytest.skip(f"{be.name} has no readable float64 scale here")
    q = be.array(np.ones((2, 3, 4)), "float32")
    with pytest.raises(ValueError, match=r"scale must be finite in float32"):
        attnx.scaled_dot_product_attention(q, q, q, scale=be.array(np.array(1e300), "float64"))


@pytest.mark.parametrize("chunked", [False, True], ids=["plain", "chunked"])
def test_stable_with_large_scores(attnx_backend, chunked):
    """Scores far beyond float16's largest number (65504): half precision is
    computed in float32, every dtype stays finite and right."""
    be = attnx_backend
    gen = rng(7)
    q = gen.standard_normal((2, 3, 4)) * 300
    k = gen.standard_normal((2, 5, 4)) * 300
    v = gen.standard_normal((2, 5, 3))
    for dtype in be.dtypes:
        args = [be.array(a, dtype) for a in (q, k, v)]
        qr, kr, vr = (rounded(a, be, dtype) for a in (q, k, v))
        assert np.abs(qr @ kr.swapaxes(-1, -2)).max() > 1e5
        expected, expected_w = reference.scaled_dot_product_attention(qr, kr, vr, scale=1.0)
        if chunked:
            out = attnx.scaled_dot_product_attention(*args, scale=1.0, chunk_size=(2, 2))
        else:
            out, weights = attnx.scaled_dot_product_attention(*args, scale=1.0, return_weights=True)
            # near-one-hot rows: compare with an absolute tolerance
            np.testing.assert_allclose(be.numpy(weights).astype(np.float64), expected_w, atol=1e-2, err_msg=dtype)
        assert be.dtype_name(out) == dtype, f"{dtype} inputs gave a {be.dtype_name(out)} result"
        got = be.numpy(out).astype(np.float64)
        assert np.isfinite(got).all(), f"{dtype}: not finite"
        np.testing.assert_allclose(got, expected, atol=2e-2, err_msg=dtype)


def test_native_override_equals_generic(attnx_backend):
    be = attnx_backend
    if "scaled_dot_product_attention" not in be.backend.implementations():
        pytest.skip(f"{be.name} has no native scaled_dot_product_attention")
    lengths = be.array(np.array([7, 3]))
    broadcast_heads = make_inputs(be, "float64", (2, 4), (2, 1), 5, 7, 8, 3)[0]
    fused_layout = make_inputs(be, "float64", (2, 3), (2, 3), 6, 6, 4, 4)[0]  # what fused kernels take
    calls = [
        (broadcast_heads, kwargs) for kwargs in ({}, {"is_causal": True}, {"key_lengths": lengths, "is_causal": True})
    ]
    calls += [(fused_layout, {"is_causal": is_causal}) for is_causal in (False, True)]
    for (q, k, v), kwargs in calls:
        native = attnx.scaled_dot_product_attention(q, k, v, scale=0.5, **kwargs)
        generic = sdpa_generic(
            be.xp,
            query=q,
            key=k,
            value=v,
            mask=None,
            key_lengths=kwargs.get("key_lengths"),
            is_causal=kwargs.get("is_causal", False),
            scale=0.5,
            return_weights=False,
        )
        assert_close(native, be.numpy(generic), be, "float64")


#: ``(n, m, chunk_size)``: tiles that divide neither axis, tiles of whole
#: rows or keys, tiles of one query and key.
CHUNKINGS = [(9, 11, (4, 3)), (11, 6, (3, 4)), (7, 7, (2, 7)), (5, 5, 1)]
#: Memory budgets: none (the slices in one group), and one so small that
#: the batch splits into groups of slices.
BUDGETS = {"one-group": None, "batch-split": 200}


def _chunked_call(index: int, case: str, step: int):
    n, m, chunks = CHUNKINGS[(index + step) % len(CHUNKINGS)]
    budget = list(BUDGETS)[(step + index // len(CHUNKINGS)) % len(BUDGETS)]
    return pytest.param(case, n, m, chunks, BUDGETS[budget], id=f"{case}-{n}-{m}-{budget}")


#: Each mask case in two chunkings, in turn, so that each chunking meets half
#: the cases, and under both budgets, one with each chunking, so that each
#: chunking meets both budgets too.  The whole grid cost a minute on JAX,
#: whose every new tile shape compiles; the pairs of chunkings under both
#: budgets cost twice what these do, for no case, chunking or budget that
#: these miss.
CHUNKED_CALLS = [_chunked_call(index, case, step) for index, case in enumerate(CASES) for step in (0, 1)]


@pytest.mark.parametrize("case, n, m, chunks, budget", CHUNKED_CALLS)
def test_chunked_equals_plain(attnx_backend, case, n, m, chunks, budget):
    """The memory-efficient algorithm computes the plain algorithm's function,
    also where a small memory budget splits the batch into groups of slices
    (each mask and layout of key_lengths then follows its group)."""
    be = attnx_backend
    batch = (2, 3)
    kwargs, _ = _mask_cases(rng(2), batch, n, m)[case]
    (q, k, v), _ = make_inputs(be, "float64", batch, batch, n, m, 4, 3, seed=3)
    call = {
        name: be.array(value, "float64" if value.dtype.kind == "f" else None)
        if isinstance(value, np.ndarray)
        else value
        for name, value in kwargs.items()
    }
    plain = attnx.scaled_dot_product_attention(q, k, v, return_weights=True, **call)[0]
    with attnx.memory_budget(budget) if budget else contextlib.nullcontext():
        chunked = attnx.scaled_dot_product_attention(q, k, v, chunk_size=chunks, **call)
    arguments = dict(
        query=q,
        key=k,
        value=v,
        mask=call.get("mask"),
        key_lengths=call.get("key_lengths"),
        is_causal=call.get("is_causal", False),
        scale=0.5,
        return_weights=False,
    )
    pair = chunks if isinstance(chunks, tuple) else (chunks, chunks)
    with attnx.memory_budget(budget) if budget else contextlib.nullcontext():
        generic = sdpa_generic(be.xp, **arguments, chunks=pair)
    plain_scaled = sdpa_generic(be.xp, **arguments)
    assert_close(chunked, be.numpy(plain), be, "float64")
    assert_close(generic, be.numpy(plain_scaled), be, "float64")


class BlockSpy:
    """Stands in for a backend's ``map_blocks`` and records the blocks: the
    proof that the chunked algorithm ran, with how many query blocks."""

    def __init__(self, backend):
        self.backend, self.calls = backend, []

    def __call__(self, function, items):
        items = list(items)
        self.calls.append(items)
        return [function(item) for item in items]


def _generic_only(be):
    if "scaled_dot_product_attention" in be.backend.implementations():
        pytest.skip(f"{be.name}'s native scaled_dot_product_attention plans its own memory use")


def test_chunked_algorithm_runs_its_blocks(attnx_backend):
    be = attnx_backend
    (q, k, v), (qr, kr, vr) = make_inputs(be, "float64", (2,), (2,), 7, 9, 4, 3)
    spy = BlockSpy(be.backend)
    arguments = dict(query=q, key=k, value=v, mask=None, key_lengths=None, is_causal=True, scale=0.5)
    out = sdpa_generic(be.xp, **arguments, return_weights=False, chunks=(3, 4), map_blocks=spy)
    assert [[r0 for _, r0 in items] for items in spy.calls] == [[0, 3, 6]], (
        "the chunked algorithm did not run its three query blocks"
    )
    expected, _ = reference.scaled_dot_product_attention(
        qr, kr, vr, allowed=reference.allowed_mask(7, 9, batch_shape=(2,), is_causal=True), scale=0.5
    )
    assert_close(out, expected, be, "float64")


def test_chunk_size_takes_the_chunked_algorithm(attnx_backend, monkeypatch):
    be = attnx_backend
    _generic_only(be)
    spy = BlockSpy(be.backend)
    monkeypatch.setattr(be.backend, "map_blocks", spy)
    (q, k, v), _ = make_inputs(be, "float64", (2,), (2,), 9, 5, 4, 3)
    attnx.scaled_dot_product_attention(q, k, v, chunk_size=(4, 2))
    assert [[r0 for _, r0 in items] for items in spy.calls] == [[0, 4, 8]]


def test_memory_budget_selects_chunks(attnx_backend, monkeypatch):
    be = attnx_backend
    (q, k, v), (qr, kr, vr) = make_inputs(be, "float32", (2,), (2,), 64, 64, 8, 8)
    expected, _ = reference.scaled_dot_product_attention(
        qr, kr, vr, allowed=reference.allowed_mask(64, 64, batch_shape=(2,), is_causal=True)
    )
    spy = BlockSpy(be.backend)
    monkeypatch.setattr(be.backend, "map_blocks", spy)
    with attnx.memory_budget(1024):  # far below 2 * 64 * 64 * 4 bytes
        out = attnx.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert_close(out, expected, be, "float32")
    if "scaled_dot_product_attention" not in be.backend.implementations():
        assert spy.calls, "over the budget, the chunked algorithm must run"
    spy.calls.clear()
    with attnx.memory_budget(2**30):
        attnx.scaled_dot_product_attention(q[:, :4, :], k[:, :4, :], v[:, :4, :])
    assert spy.calls == [], "within the budget, small inputs take the plain algorithm"
    with pytest.raises(ValueError, match="chunk_size can't be combined with return_weights"):
        attnx.scaled_dot_product_attention(q, k, v, chunk_size=8, return_weights=True)


def test_chunked_after_fully_masked_block_with_very_negative_scores(attnx_backend):
    """A row whose first key block is masked and whose later scores are hugely
    negative: a finite additive mask still defines a softmax there."""
    be = attnx_backend
    n, m = 2, 8
    # -1e4 in float64; in float32 scores that large keep too few digits for the tolerance
    additive = np.full((n, m), -1e4 if be.dtype("float64") == "float64" else -1e2)
    additive[:, :4] = -np.inf
    (q, k, v), (qr, kr, vr) = make_inputs(be, "float64", (), (), n, m, 4, 3, seed=5)
    expected, _ = reference.scaled_dot_product_attention(qr, kr, vr, additive=additive)
    out = attnx.scaled_dot_product_attention(q, k, v, mask=be.array(additive, "float64"), chunk_size=(1, 4))
    assert_close(out, expected, be, "float64")


@pytest.mark.parametrize("n, m", [(0, 3), (3, 0), (0, 0)])
def test_empty_queries_or_keys(attnx_backend, n, m):
    """No queries: an empty output; no keys: nothing to attend, so zeros."""
    be = attnx_backend
    (q, k, v), _ = make_inputs(be, "float32", (2,), (2,), n, m, 4, 5)
    for kwargs in ({}, {"chunk_size": 2}, {"is_causal": True}):
        out = attnx.scaled_dot_product_attention(q, k, v, **kwargs)
        assert_close(out, np.zeros((2, n, 5)), be, "float32")
    out, weights = attnx.scaled_dot_product_attention(q, k, v, return_weights=True)
    assert_close(weights, np.zeros((2, n, m)), be, "float32")
    assert_close(attnx.masked_softmax(be.array(np.zeros((2, n, m)), "float32")), np.zeros((2, n, m)), be, "float32")


@pytest.mark.parametrize("d_k, d_v", [(4, 0), (0, 3), (0, 0)])
@pytest.mark.parametrize("leading", [(), (2,), (2, 3)], ids=str)
def test_empty_feature_dimensions(attnx_backend, leading, d_k, d_v):
    """No features: scores of zero (uniform weights) where d_k = 0, and an
    empty output where d_v = 0, at any number of leading dimensions."""
    be = attnx_backend
    (q, k, v), (qr, kr, vr) = make_inputs(be, "float64", leading, leading, 3, 4, d_k, d_v, seed=9)
    for kwargs in ({}, {"is_causal": True}, {"chunk_size": 2}):
        allowed = reference.allowed_mask(3, 4, batch_shape=leading, is_causal=kwargs.get("is_causal", False))
        expected, _ = reference.scaled_dot_product_attention(qr, kr, vr, allowed=allowed, scale=1.0)
        out = attnx.scaled_dot_product_attention(q, k, v, **kwargs)
        assert tuple(out.shape) == (*leading, 3, d_v)
        assert_close(out, expected, be, "float64")


def test_leading_dimensions_only_value_has_shape_the_weights_too(attnx_backend):
    """Weights come from query and key, but broadcast to the leading shape of
    all three, as the output does."""
    be = attnx_backend
    gen = rng(13)
    q, k, v = gen.standard_normal((3, 4)), gen.standard_normal((5, 4)), gen.standard_normal((2, 5, 3))
    out, weights = attnx.scaled_dot_product_attention(*(be.array(a, "float64") for a in (q, k, v)), return_weights=True)
    expected, expected_w = reference.scaled_dot_product_attention(q, k, v)
    assert_close(out, expected, be, "float64")
    assert_close(weights, expected_w, be, "float64")
    assert tuple(weights.shape) == (2, 3, 5)
