"""flex_attention's arguments, create_block_mask's and the block-mask plot
(the values are proven by the conformance suite and the PyTorch tests)."""

from __future__ import annotations

import numpy as np
import pytest

import attnx
from attnx import mods

Q = np.zeros((1, 4, 8, 2), dtype=np.float32)
KV = np.zeros((1, 2, 8, 2), dtype=np.float32)


@pytest.mark.parametrize(
    ("call", "error", "message"),
    [
        (lambda: attnx.flex_attention(Q[0], Q[0], Q[0]), ValueError, r"query must have shape \(B, H, n, d\)"),
        (lambda: attnx.flex_attention(Q, KV, KV), ValueError, "pass enable_gqa=True"),
        (
            lambda: attnx.flex_attention(Q, KV[:, :1].repeat(3, 1), KV[:, :1].repeat(3, 1), enable_gqa=True),
            ValueError,
            "multiple of the key/value heads",
        ),
        (lambda: attnx.flex_attention(Q, Q, Q[..., :1, :]), ValueError, "value must have shape"),
        (
            lambda: attnx.flex_attention(Q, np.zeros((1, 4, 8, 3), np.float32), Q),  # keys wider than queries
            ValueError,
            r"key must have shape \(B, H_kv, m, d\) with d = 2 \(from query\), got \(1, 4, 8, 3\)",
        ),
        (lambda: attnx.flex_attention(Q, Q, Q, score_mod="alibi"), TypeError, "score_mod must be a callable"),
        (
            lambda: attnx.flex_attention(Q, Q, Q, block_mask=np.ones((8, 8), bool)),
            TypeError,
            "block_mask must be a BlockMask",
        ),
        (lambda: attnx.flex_attention(Q, Q, Q, enable_gqa=1), TypeError, "enable_gqa must be True or False"),
        (lambda: attnx.create_block_mask(mods.causal, 0, None, 8, 8), ValueError, "B must be a positive integer"),
        (
            lambda: attnx.create_block_mask(mods.causal, None, None, 8, 8, block_size=(4, 4, 4)),
            ValueError,
            "block_size must be an int or",
        ),
        (lambda: attnx.create_block_mask("causal", None, None, 8, 8), TypeError, "mask_mod must be a callable"),
        (lambda: attnx.and_masks(mods.causal, None), TypeError, "got NoneType at position 1"),
        (lambda: mods.sliding_window(-1), ValueError, "window must be a non-negative integer"),
        (lambda: mods.soft_cap(0.0), ValueError, "cap must be a positive finite number"),
        (lambda: mods.soft_cap(float("inf")), ValueError, "cap must be a positive finite number"),
        (lambda: mods.soft_cap("1.5"), TypeError, r"cap must be a real number, got '1.5' \(str\)"),
        (lambda: mods.soft_cap(True), TypeError, "cap must be a real number, got True"),
        (lambda: mods.relative_bias(np.zeros(4)), ValueError, "odd length"),
        (lambda: mods.document(np.zeros(4)), TypeError, "document_ids must have an integer dtype"),
        (lambda: mods.relative_bias(np.zeros((2, 2, 3))), ValueError, "table must have 1 dimension or 2 dimensions"),
        (lambda: mods.alibi_slopes(8, dtype="int32"), TypeError, "dtype must be a real floating-point dtype"),
    ],
)
def test_bad_arguments_get_clear_errors(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_the_mods_of_a_block_mask_are_checked_when_it_is_made():
    with pytest.raises(
        ValueError, match=r"mask_mod must return an array broadcastable to the tile's shape \(1, 1, 2, 2\)"
    ):
        attnx.create_block_mask(lambda b, h, q, kv: np.ones((3, 3), bool), None, None, 8, 8)


def test_a_block_mask_is_drawn_block_by_block():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    block_mask = attnx.create_block_mask(mods.sliding_window(3), None, 2, 10, 12, block_size=(4, 3))
    ax = attnx.plot.block_mask(block_mask, head=1)
    image = ax.get_images()[0]
    np.testing.assert_array_equal(image.get_array(), block_mask.kinds[0, 0])
    assert image.get_extent() == [0, 12, 12, 0]  # blocks at their place in the scores
    assert "skipped" in ax.get_title()
    with pytest.raises(ValueError, match=r"head must lie in \[0, 2\), got 2"):
        attnx.plot.block_mask(block_mask, head=2)
    with pytest.raises(TypeError, match=r"head must be an integer, got 1\.0"):
        attnx.plot.block_mask(block_mask, head=1.0)


def test_a_block_mask_is_drawn_for_the_batch_entry_and_head_asked():
    """Blocks kept once for every batch entry or head (a mask_mod that reads
    neither) are drawn for any of them; blocks that differ, for the one asked."""
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shared = attnx.create_block_mask(mods.sliding_window(3), 2, 2, 10, 16, block_size=4)
    assert shared.kinds.shape[:2] == (1, 1)
    ax = attnx.plot.block_mask(shared, batch=1, head=1)
    np.testing.assert_array_equal(ax.get_images()[0].get_array(), shared.kinds[0, 0])
    np.testing.assert_allclose(ax.figure.get_size_inches(), (6, 6 * 10 / 16))
    plt.close(ax.figure)

    def by_entry_or_head(b, h, q, kv):
        return (q >= kv) & (kv < 4 + 4 * b + 4 * h)

    per_entry = attnx.create_block_mask(by_entry_or_head, 2, None, 8, 8, block_size=4)
    per_head = attnx.create_block_mask(by_entry_or_head, None, 2, 8, 8, block_size=4)
    assert per_entry.kinds.shape[:2] == (2, 1) and per_head.kinds.shape[:2] == (1, 2)
    for index in (0, 1):
        for ax, kinds in (
            (attnx.plot.block_mask(per_entry, batch=index), per_entry.kinds[index, 0]),
            (attnx.plot.block_mask(per_head, head=index), per_head.kinds[0, index]),
        ):
            np.testing.assert_array_equal(ax.get_images()[0].get_array(), kinds)
            plt.close(ax.figure)
    assert not np.array_equal(per_entry.kinds[0], per_entry.kinds[1])  # the drawings differ
    with pytest.raises(ValueError, match=r"head must lie in \[0, 1\), got 1"):
        attnx.plot.block_mask(per_entry, head=1)  # no heads: one for all
    unbatched = attnx.create_block_mask(mods.sliding_window(3), None, None, 10, 12)
    with pytest.raises(ValueError, match=r"batch must lie in \[0, 1\), got 1"):
        attnx.plot.block_mask(unbatched, batch=1)


def test_rows_of_blocks_join_into_steps_while_the_block_holds_them():
    """One head of 2048 queries in blocks of 128 under a sliding window: a
    row of blocks holds 128 x 256 scores, far below a block (4 MiB shared by
    the threads), so rows join into steps of up to 512 queries, each step's
    mask evaluated once, and never fewer steps than threads.  A budget of 64
    bytes keeps one row of blocks (two key blocks, apart) a step."""
    n, rows = 2048, 16
    threads = attnx._registry.get("numpy").concurrent_blocks
    evaluated = []

    def counted_window(b, h, q_idx, kv_idx):
        evaluated.append(q_idx.shape)
        return mods.sliding_window(128)(b, h, q_idx, kv_idx)

    block_mask = attnx.create_block_mask(counted_window, None, None, n, n)
    query = np.random.default_rng(0).standard_normal((1, 1, n, 16)).astype(np.float32)
    evaluated.clear()
    joined = attnx.flex_attention(query, query, query, block_mask=block_mask)
    assert len(evaluated) == min(rows, max(4, threads))
    evaluated.clear()
    with attnx.memory_budget(64):
        one_row = attnx.flex_attention(query, query, query, block_mask=block_mask)
    assert len(evaluated) == 2 * rows - 1
    np.testing.assert_allclose(joined, one_row, atol=1e-6)


def test_mods_are_probed_once_per_call_signature():
    """The checks that try a mod on a 2 x 2 tile before the work (a
    score_mod; a mask_mod whose block mask broadcasts over batch or heads)
    run once for each size, dtype and device: each cost some 160 us a call
    on PyTorch's tensors, more on CUDA's."""
    calls = {"score": 0, "mask": 0}

    def counted_cap(score, b, h, q_idx, kv_idx):
        calls["score"] += 1
        return mods.soft_cap(20.0)(score, b, h, q_idx, kv_idx)

    def counted_window(b, h, q_idx, kv_idx):
        calls["mask"] += 1
        return mods.sliding_window(4)(b, h, q_idx, kv_idx)

    block_mask = attnx.create_block_mask(counted_window, None, None, 8, 8, block_size=4)
    query = np.random.default_rng(0).standard_normal((2, 4, 8, 2)).astype(np.float32)
    counts = []
    for inputs in (query, query, query[:1], query.astype(np.float64)):
        calls.update(score=0, mask=0)
        attnx.flex_attention(inputs, inputs, inputs, counted_cap, block_mask)
        counts.append((calls["score"], calls["mask"]))
    first, again, fewer_entries, float64 = counts
    assert again == (first[0] - 1, first[1] - 1)  # the probes alone are skipped
    assert fewer_entries[0] == first[0] and float64[0] == first[0]  # new sizes, a new dtype: probed again


@pytest.mark.parametrize("budget", [2**17, 2**19, 2**21])
def test_create_block_mask_evaluates_the_mod_in_tiles_as_large_as_the_budget_holds(budget):
    """Tiles of whole blocks whose mask (8 bytes an element: a mod's integer
    intermediates) fits the memory budget, and no smaller than it allows."""
    tiles = []

    def causal(b, h, q_idx, kv_idx):
        tiles.append((q_idx.shape[-2], kv_idx.shape[-1]))
        return q_idx >= kv_idx

    with attnx.memory_budget(budget):
        attnx.create_block_mask(causal, None, None, 1000, 1000, block_size=128)
    elements = budget // 8
    (rows, cols), *rest = tiles[1:]  # the first call probes the mod's shape
    assert all(r * c <= elements for r, c in tiles[1:])
    assert cols == 1000 or 128 * (cols + 128) > elements  # as many blocks of keys as fit
    assert rows == 1000 or (rows + 128) * cols > elements  # then as many blocks of queries
    assert rows % 128 == 0 or rows == 1000


def test_create_block_mask_evaluates_a_blocks_worth_at_least_under_a_tiny_budget():
    """A budget below one block's mask still evaluates a block's worth of
    elements at a time: with fewer keys than a block, more rows."""
    tiles = []

    def causal(b, h, q_idx, kv_idx):
        tiles.append((q_idx.shape[-2], kv_idx.shape[-1]))
        return q_idx >= kv_idx

    with attnx.memory_budget(2**10):
        attnx.create_block_mask(causal, None, None, 1000, 50, block_size=128)
    assert tiles[1] == (256, 50)  # 128 x 128 elements hold 256 rows of 50 keys (whole blocks of 128 rows)


def test_soft_cap_takes_numpy_s_scalars():
    """A NumPy float32 is a real number (numbers.Real), as a Python float is."""
    scores = np.array([[-40.0, 0.5, 40.0]], dtype=np.float32)
    capped = mods.soft_cap(np.float32(30.0))(scores, None, None, None, None)
    np.testing.assert_allclose(capped, 30.0 * np.tanh(scores / 30.0), rtol=1e-6)


@pytest.mark.parametrize("budget", [2**10, 2**17, 2**19])
def test_a_block_mask_made_in_tiles_is_the_one_made_whole(budget):
    """However many tiles the memory budget cuts the mod's evaluation into,
    every key block is covered once: the kinds are those of one tile."""
    whole = attnx.create_block_mask(mods.sliding_window(300), None, 2, 1000, 1100, block_size=128)
    with attnx.memory_budget(budget):
        tiled = attnx.create_block_mask(mods.sliding_window(300), None, 2, 1000, 1100, block_size=128)
    assert tiled.kinds.shape == whole.kinds.shape == (1, 1, 8, 9)
    np.testing.assert_array_equal(tiled.kinds, whole.kinds)


def test_a_table_for_more_positions_than_the_call_has_is_taken():
    """Document ids for 64 positions serve a call of 32: only fewer positions
    than the call's are refused."""
    ids = np.repeat(np.arange(8), 8)  # 64 positions, 8 documents
    q = np.random.default_rng(3).standard_normal((1, 2, 32, 4)).astype(np.float32)
    block_mask = attnx.create_block_mask(mods.document(ids), None, None, 32, 32, block_size=8)
    got = attnx.flex_attention(q, q, q, block_mask=block_mask)
    same_document = ids[:32, None] == ids[None, :32]
    expected = attnx.scaled_dot_product_attention(q, q, q, mask=same_document)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)


def test_a_mod_that_reads_the_head_is_evaluated_for_every_head_within_the_budget():
    tiles = []

    def by_head(b, h, q_idx, kv_idx):
        tiles.append((q_idx.shape[-2], kv_idx.shape[-1]))
        return kv_idx <= q_idx + h

    with attnx.memory_budget(2**19):
        attnx.create_block_mask(by_head, None, 4, 1000, 1000, block_size=128)
    assert all(4 * rows * cols * 8 <= 2**19 for rows, cols in tiles[1:])  # 4 heads' masks at 8 bytes an element


@pytest.mark.parametrize("library", ["numpy", "torch", "jax"])
def test_a_mod_written_for_pytorch_s_flex_runs_unchanged_where_its_indices_promote_the_scores(library):
    """ALiBi as PyTorch's documentation writes it, ``score + slopes[h] *
    (kv_idx - q_idx)``: NumPy makes float32 times int64 float64, where
    PyTorch and JAX keep float32.  It runs on every library, in float32, the
    same function (issue 59); a mod returning integers is still refused."""
    pytest.importorskip(library)
    gen = np.random.default_rng(3)
    q, k, v = (gen.standard_normal((1, 2, 5, 4)).astype(np.float32) for _ in range(3))
    slopes = np.array([0.5, 0.25], dtype=np.float32)
    arrays = [attnx.asarray(a, backend=library) for a in (q, k, v, slopes)]
    table = arrays[3]

    def alibi(score, b, h, q_idx, kv_idx):
        return score + table[h] * (kv_idx - q_idx)

    output = attnx.flex_attention(*arrays[:3], alibi)
    assert attnx.to_numpy(output).dtype == np.float32
    bias = slopes[:, None, None] * (np.arange(5)[None, None, :] - np.arange(5)[None, :, None])
    scores = q.astype(np.float64) @ np.swapaxes(k, -1, -2) / 2 + bias
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    expected = weights / weights.sum(-1, keepdims=True) @ v
    np.testing.assert_allclose(attnx.to_numpy(output), expected, rtol=1e-5, atol=1e-6)
    with pytest.raises(TypeError, match="own dtype float32, got int"):
        attnx.flex_attention(*arrays[:3], lambda score, b, h, q_idx, kv_idx: q_idx - kv_idx)
