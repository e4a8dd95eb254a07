"""attnx.natives: the rules a backend's native implementation shares with
attnx, against the conformance kit's references."""

from __future__ import annotations

import contextlib
import inspect

import array_api_compat.numpy as xp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attnx
from attnx import natives
from attnx_conformance import reference


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 7),
    m=st.integers(1, 7),
    batch=st.integers(1, 3),
    is_causal=st.booleans(),
    with_lengths=st.booleans(),
    mask_kind=st.sampled_from([None, "bool", "real"]),
    block=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_combined_mask_is_the_reference_s_rule_as_one_array(
    n, m, batch, is_causal, with_lengths, mask_kind, block, seed
):
    """Boolean where every mask is, else real: the additive mask where the
    boolean rules allow a key, -inf where they don't; None with no mask; the
    block of rows and keys asked for."""
    rng = np.random.default_rng(seed)
    key_lengths = rng.integers(0, m + 1, size=batch) if with_lengths else None
    mask = None
    if mask_kind == "bool":
        mask = rng.random((batch, n, m)) < 0.7
    elif mask_kind == "real":
        mask = rng.standard_normal((batch, n, m)).astype(np.float32)
    rows, cols = ((n // 2, n), (m // 3, m)) if block else (None, None)
    got = natives.combined_mask(
        xp,
        mask=mask,
        key_lengths=key_lengths,
        is_causal=is_causal,
        batch_shape=(batch,),
        n=n,
        m=m,
        dtype=np.float32,
        rows=rows,
        cols=cols,
    )
    if mask is None and key_lengths is None and not is_causal:
        assert got is None
        return
    allowed = reference.allowed_mask(
        n,
        m,
        batch_shape=(batch,),
        mask=mask if mask_kind == "bool" else None,
        key_lengths=key_lengths,
        lengths_per="batch",
        is_causal=is_causal,
    )
    if mask_kind == "real":
        expected = np.where(allowed, mask, -np.inf).astype(np.float32)
    else:
        expected = allowed
    r0, r1 = rows or (0, n)
    c0, c1 = cols or (0, m)
    expected = expected[..., r0:r1, c0:c1]
    assert got.dtype == expected.dtype
    np.testing.assert_array_equal(np.broadcast_to(got, expected.shape), expected)


def test_combined_mask_takes_a_real_mask_s_dtype_by_default():
    mask = np.zeros((2, 3), dtype=np.float64)
    got = natives.combined_mask(xp, mask=mask, key_lengths=None, is_causal=True, batch_shape=(), n=2, m=3)
    assert got.dtype == np.float64
    np.testing.assert_array_equal(got, [[0, 0, -np.inf], [0, 0, 0]])


@pytest.mark.parametrize(
    "shape, lengths_per",
    [((2,), "batch"), ((2, 1), "sequence"), ((1, 3), "sequence"), ((), "sequence"), ((2, 3, 4), "query")],
    ids=["batch-first", "per-sequence", "broadcast-batch", "one-for-all", "per-query"],
)
@pytest.mark.parametrize("rows", [None, (1, 3)])
def test_aligned_lengths_are_the_reference_s_lengths_in_every_layout(shape, lengths_per, rows):
    """Keys before the aligned length are the keys the reference's rule
    allows, whichever layout the lengths came in, for all queries or a block
    of them."""
    n, m, batch = 4, 5, (2, 3)
    key_lengths = np.random.default_rng(0).integers(0, m + 1, size=shape)
    aligned = natives.aligned_lengths(xp, key_lengths, batch, n, rows=rows)
    r0, r1 = rows or (0, n)
    assert len(np.broadcast_shapes(aligned.shape, (*batch, r1 - r0, 1))) == len(batch) + 2
    expected = reference.allowed_mask(n, m, batch_shape=batch, key_lengths=key_lengths, lengths_per=lengths_per)
    np.testing.assert_array_equal(
        np.broadcast_to(np.arange(m) < aligned, (*batch, r1 - r0, m)), expected[..., r0:r1, :]
    )


@settings(max_examples=200, deadline=None)
@given(
    n=st.integers(1, 7),
    m=st.integers(1, 7),
    is_causal=st.booleans(),
    layout=st.sampled_from([None, "batch", "sequence", "query"]),
    strict=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_key_counts_are_the_reference_s_rule_as_one_number_per_query(n, m, is_causal, layout, strict, seed):
    """The causal rule and the key lengths of every layout keep the first
    ``count`` keys of each row: exactly what the reference allows; in the
    array API alone (array-api-strict) too."""
    batch = (2, 3)
    shape = {"batch": (2,), "sequence": batch, "query": (*batch, n)}.get(layout)
    key_lengths = None if layout is None else np.random.default_rng(seed).integers(0, m + 1, size=shape)
    namespace = xp
    if strict:
        import array_api_strict as namespace

        key_lengths = None if key_lengths is None else namespace.asarray(key_lengths)
    counts = natives.key_counts(namespace, key_lengths, is_causal, batch, n, m)
    if key_lengths is None and not is_causal:
        assert counts is None
        return
    counts = np.asarray(counts)
    key_lengths = None if key_lengths is None else np.asarray(key_lengths)
    assert counts.dtype == np.int64 and counts.max() <= m
    allowed = reference.allowed_mask(
        n, m, batch_shape=batch, key_lengths=key_lengths, lengths_per=layout or "sequence", is_causal=is_causal
    )
    np.testing.assert_array_equal(np.arange(m) < np.broadcast_to(counts, (*batch, n))[..., None], allowed)


@pytest.mark.parametrize(
    "shape, budget, threads",
    [((1, 2, 16, 8), None, 1), ((4, 8, 256, 16), 2**18, 1), ((1, 8, 128, 16), None, 2)],
    ids=["fits", "over-budget", "shared-by-threads"],
)
def test_planned_chunks_are_the_chunks_attnx_hands_a_native(monkeypatch, shape, budget, threads):
    """What a native receives as ``chunks`` for a call, ``planned_chunks``
    gives for the same sizes: None where the scores fit the budget and are
    not shared among threads, else blocks within the budget."""
    backend = attnx._registry.get("numpy")
    monkeypatch.setattr(backend, "concurrent_blocks", threads)
    received = []
    native = backend.implementations()["scaled_dot_product_attention"]

    def recording(**arguments):
        received.append(arguments["chunks"])
        return native(**arguments)

    monkeypatch.setattr(backend, "_natives", {"scaled_dot_product_attention": recording})
    monkeypatch.setattr(backend, "specialize", lambda operation, arguments: None)
    q = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    with attnx.memory_budget(budget) if budget else contextlib.nullcontext():
        attnx.scaled_dot_product_attention(q, q, q)
        planned = natives.planned_chunks(backend, q.dtype, shape[-2], shape[-2], shape[:-2])
    assert received == [planned]
    if budget is None and threads == 1:
        assert planned is None
    else:
        query_chunk, key_chunk = planned
        assert query_chunk * key_chunk * 4 <= (budget or backend.block_bytes)


def test_combined_mask_gives_a_real_mask_the_scores_dtype():
    """A float64 mask for float32 scores comes back in float32 when the
    native says so (``dtype``), and in its own dtype when it does not."""
    mask = np.zeros((3, 4))
    options = dict(key_lengths=None, is_causal=False, batch_shape=(2,), n=3, m=4)
    assert natives.combined_mask(xp, mask=mask, dtype=np.float32, **options).dtype == np.float32
    assert natives.combined_mask(xp, mask=mask, **options).dtype == np.float64


@pytest.mark.parametrize(
    ("function", "keywords"),
    [
        (attnx.blocks.attend_block, ("scale", "mask", "is_causal", "offset")),
        (attnx.blocks.from_scores, ("allowed", "additive", "xp")),
        (attnx.mods.alibi_slopes, ("dtype", "backend", "device")),
    ],
)
def test_options_of_the_building_blocks_are_keyword_only(function, keywords):
    """Options are passed by name, so that new ones can come without
    changing what a positional call means (and a keyword-only marker
    turned positional-only would go unnoticed otherwise)."""
    parameters = inspect.signature(function).parameters
    assert all(parameters[name].kind is inspect.Parameter.KEYWORD_ONLY for name in keywords)
