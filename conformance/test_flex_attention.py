"""flex_attention, create_block_mask and the mods of attnx.mods on every backend.

The mods are written once, closing over the backend's own arrays where they
need tables (slopes, document ids); the reference computes each mask and
score change from its definition in float64 NumPy.  Shapes are chosen to
catch the usual slips: n != m, grouped-query heads, block sizes that divide
neither n nor m, rows with nothing to attend.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from array_api_compat import array_namespace

import attnx
from attnx import mods
from attnx_conformance import reference
from attnx_conformance.helpers import assert_close, rng, rounded

pytestmark = pytest.mark.attnx_operation("flex_attention")

B, H, H_KV, N, M, D = 2, 4, 2, 19, 23, 6
BLOCK = (8, 5)


def _indexable(be):
    """Skip where the backend's arrays can't be indexed by an n-d integer
    array (Dask's): a mod of the user's own that reads a table as
    ``limits[b]`` needs it (attnx.mods' read theirs with ``take``)."""
    table, index = be.array(np.arange(3)), be.xp.reshape(be.array(np.arange(2)), (1, 2))
    try:
        table[index]
    except Exception as error:  # the library's own refusal, reported as the reason
        pytest.skip(f"{be.name} arrays can't be indexed by an n-d integer array ({type(error).__name__}: {error})")


def _block_mask(be, mask_mod, *sizes, **kwargs):
    """A block mask on the device under test, where the mod's tables live."""
    return attnx.create_block_mask(mask_mod, *sizes, device=be.device, **kwargs)


def _document_ids():
    gen = rng(90)
    return np.sort(gen.integers(0, 4, size=(B, max(N, M))), axis=1)


#: name -> (builder(be) -> (score_mod, mask_mod), reference score, reference mask)
#: The reference functions take NumPy index grids b, h, i (query), j (key).
SLOPES = np.array([0.5, 0.25, 0.125, 0.0625])
TABLE = rng(91).standard_normal((H, 7))
PREFIX = np.array([3, 8])
LENGTHS = np.array([5, 9, 4])
DOC_OF_LENGTHS = np.repeat(np.arange(4), [5, 9, 4, 5])

CASES = {
    "no mods": (lambda be: (None, None), None, None),
    "causal": (lambda be: (None, mods.causal), None, lambda b, h, i, j: j <= i),
    "sliding window": (
        lambda be: (None, mods.sliding_window(4)),
        None,
        lambda b, h, i, j: (j <= i) & (i - j <= 4),
    ),
    "document": (
        lambda be: (None, mods.document(be.array(_document_ids()))),
        None,
        lambda b, h, i, j: _document_ids()[b, i] == _document_ids()[b, j],
    ),
    "document from lengths, causal": (
        lambda be: (None, attnx.and_masks(mods.causal, mods.document_from_lengths(be.array(LENGTHS), max(N, M)))),
        None,
        lambda b, h, i, j: (j <= i) & (DOC_OF_LENGTHS[i] == DOC_OF_LENGTHS[j]),
    ),
    "prefix-LM per batch entry": (
        lambda be: (None, mods.prefix_lm(be.array(PREFIX))),
        None,
        lambda b, h, i, j: (j < PREFIX[b]) | (j <= i),
    ),
    "ALiBi": (
        lambda be: (mods.alibi(be.array(SLOPES, "float64")), None),
        lambda s, b, h, i, j: s + SLOPES[h] * (j - i),
        None,
    ),
    "soft cap, causal": (
        lambda be: (mods.soft_cap(1.5), mods.causal),
        lambda s, b, h, i, j: 1.5 * np.tanh(s / 1.5),
        lambda b, h, i, j: j <= i,
    ),
    "relative bias, sliding window": (
        lambda be: (mods.relative_bias(be.array(TABLE, "float64")), mods.sliding_window(6)),
        lambda s, b, h, i, j: s + TABLE[h, np.clip(i - j, -3, 3) + 3],
        lambda b, h, i, j: (j <= i) & (i - j <= 6),
    ),
    "or of masks, rows with nothing": (
        lambda be: (
            None,
            attnx.and_masks(attnx.or_masks(mods.sliding_window(2), mods.prefix_lm(4)), lambda b, h, q, kv: q % 3 != 0),
        ),
        None,
        lambda b, h, i, j: (((j <= i) & (i - j <= 2)) | (j < 4) | (j <= i)) & (i % 3 != 0),
    ),
    "a mask_mod of the positions alone, 2-D": (
        lambda be: (None, lambda b, h, q_idx, kv_idx: (q_idx[0, 0, ...] + 2 * kv_idx[0, 0, ...]) % 3 != 0),
        None,
        lambda b, h, i, j: (i + 2 * j) % 3 != 0,
    ),
    "-inf from score_mod, rows with nothing": (
        lambda be: (_minus_inf_outside_window, None),
        lambda s, b, h, i, j: np.where((j <= i) & (i - j <= 4) & (i % 3 != 0), s, -np.inf),
        None,
    ),
}


def _minus_inf_outside_window(score, b, h, q_idx, kv_idx):
    """Masking done by the score: -inf outside a causal window of 4 and on
    every third row, which then has nothing to attend (zeros, as a mask_mod's)."""
    xp = array_namespace(score)
    keep = (kv_idx <= q_idx) & (q_idx - kv_idx <= 4) & (q_idx % 3 != 0)
    return xp.where(keep, score, -float("inf"))


#: The cases also checked with return_weights=True (the dense path).
WITH_WEIGHTS = (
    "no mods",
    "soft cap, causal",
    "or of masks, rows with nothing",
    "-inf from score_mod, rows with nothing",
)


def _inputs(be, dtype, n=N, m=M, width=D, value_width=3):
    gen = rng(92)
    shapes = ((B, H, n, width), (B, H_KV, m, width), (B, H_KV, m, value_width))
    data = [gen.standard_normal(shape) for shape in shapes]
    return [be.array(a, dtype) for a in data], [rounded(a, be, dtype) for a in data]


@pytest.mark.parametrize("case", sorted(CASES))
def test_flex_attention_matches_the_definition(attnx_backend, case):
    be = attnx_backend
    build, score, allowed = CASES[case]
    dtype = be.dtype("float64")
    (query, key, value), exact = _inputs(be, dtype)
    score_mod, mask_mod = build(be)
    block_mask = None if mask_mod is None else _block_mask(be, mask_mod, B, H, N, M, block_size=BLOCK)
    grids = np.meshgrid(np.arange(B), np.arange(H), np.arange(N), np.arange(M), indexing="ij")
    expected, expected_weights = reference.flex_attention(
        *exact, score=score, allowed=None if allowed is None else allowed(*grids)
    )
    output = attnx.flex_attention(query, key, value, score_mod, block_mask, enable_gqa=True)
    assert_close(output, expected, be, dtype, like=query)
    if case in WITH_WEIGHTS:
        output, weights = attnx.flex_attention(
            query, key, value, score_mod, block_mask, enable_gqa=True, return_weights=True
        )
        assert_close(output, expected, be, dtype, like=query)
        assert_close(weights, expected_weights, be, dtype, like=query)


#: Heads this wide, blocks of the default 128 and more than one block each
#: way: the shapes fused kernels take (PyTorch's compiled FlexAttention on
#: CUDA wants heads of 16 or more and blocks of a multiple of 128), so a
#: backend that hands flex_attention to one is checked through it too.
FUSED_WIDTH, FUSED_N, FUSED_M = 16, 200, 230
FUSED_CASES = ("no mods", "causal", "sliding window", "ALiBi", "soft cap, causal")
#: ALiBi's slopes here, in the inputs' dtype (score_mod keeps it): a sixteenth
#: of the paper's, so that over 230 keys the biases stay near the dot
#: products (a bias of 115 would scale float32's rounding with it).
FUSED_SLOPES = SLOPES / 16


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("case", FUSED_CASES)
def test_flex_attention_at_the_shapes_fused_kernels_take(attnx_backend, case, dtype):
    be = attnx_backend
    _eager(be)
    build, score, allowed = CASES[case]
    dtype = be.dtype(dtype)
    sizes = dict(n=FUSED_N, m=FUSED_M, width=FUSED_WIDTH, value_width=FUSED_WIDTH)
    (query, key, value), exact = _inputs(be, dtype, **sizes)
    score_mod, mask_mod = build(be)
    if case == "ALiBi":
        score_mod = mods.alibi(be.array(FUSED_SLOPES, dtype))

        def score(s, b, h, i, j):
            return s + FUSED_SLOPES[h] * (j - i)

    block_mask = None if mask_mod is None else _block_mask(be, mask_mod, B, H, FUSED_N, FUSED_M)
    grids = np.meshgrid(np.arange(B), np.arange(H), np.arange(FUSED_N), np.arange(FUSED_M), indexing="ij")
    expected, _ = reference.flex_attention(*exact, score=score, allowed=None if allowed is None else allowed(*grids))
    output = attnx.flex_attention(query, key, value, score_mod, block_mask, enable_gqa=True)
    assert_close(output, expected, be, dtype, like=query)


def _eager(be):
    """Skip lazy backends: fused kernels are eager natives' business, and a
    lazy backend's chunks (Dask's, in chunks of 2 in CI: some 90,000 tasks
    at these sizes) are checked by the smaller cases."""
    if be.lazy:
        pytest.skip(f"{be.name} is lazy: the shapes fused kernels take are checked on eager backends")


@pytest.mark.parametrize("budget", [None, 64], ids=["rows of blocks joined", "one row of blocks a step"])
def test_float32_sliding_window_with_many_tiles(attnx_backend, budget):
    """float32, blocks of 4 queries and 3 keys: many tiles, merged runs; in
    the default block several rows of blocks make one step (each key block
    visited if any row needs it, masked unless every row finds it full), in
    64 bytes one row does."""
    be = attnx_backend
    (query, key, value), exact = _inputs(be, "float32")
    block_mask = _block_mask(be, mods.sliding_window(7), None, None, N, M, block_size=(4, 3))
    grids = np.meshgrid(np.arange(B), np.arange(H), np.arange(N), np.arange(M), indexing="ij")
    expected, _ = reference.flex_attention(*exact, allowed=(grids[3] <= grids[2]) & (grids[2] - grids[3] <= 7))
    with attnx.memory_budget(budget) if budget else contextlib.nullcontext():
        output = attnx.flex_attention(query, key, value, None, block_mask, enable_gqa=True)
    assert_close(output, expected, be, "float32")


def test_block_mask_records_empty_partial_and_full_blocks(attnx_backend):
    be = attnx_backend
    _indexable(be)
    limits = be.array(np.array([5, 30]))  # entry 0: keys < 5 + 2h; entry 1: every key, causal

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx < limits[b] + 2 * h) & (kv_idx <= q_idx + 3)

    block_mask = _block_mask(be, mask_mod, B, H, N, M, block_size=BLOCK)
    b, h, i, j = np.meshgrid(np.arange(B), np.arange(H), np.arange(N), np.arange(M), indexing="ij")
    dense = (j < np.array([5, 30])[b] + 2 * h) & (j <= i + 3)
    expected = np.zeros((B, H, 3, 5), dtype=int)
    for index in np.ndindex(*expected.shape):
        *lead, qb, kb = index
        block = dense[(*lead, slice(qb * 8, qb * 8 + 8), slice(kb * 5, kb * 5 + 5))]
        expected[index] = 2 if block.all() else 1 if block.any() else 0
    assert be.backend.owns(block_mask.kinds)
    np.testing.assert_array_equal(be.numpy(block_mask.kinds), expected)
    assert block_mask.shape == (B, H, N, M) and block_mask.block_size == BLOCK
    if not be.lazy:
        assert block_mask.sparsity == pytest.approx((expected == 0).mean())
    # A block full for one (b, h) and empty for another is masked for both.
    (query, key, value), exact = _inputs(be, be.dtype("float64"))
    reference_output, _ = reference.flex_attention(*exact, allowed=dense)
    output = attnx.flex_attention(query, key, value, None, block_mask, enable_gqa=True)
    assert_close(output, reference_output, be, be.dtype("float64"))


BAD_MODS = {
    "score_mod returns integers": (
        TypeError,
        "score_mod must return scores of their own dtype",
        lambda be: dict(score_mod=lambda s, b, h, q, kv: be.xp.astype(s, be.xp.int32)),
    ),
    "score_mod returns a wider tile": (
        ValueError,
        "score_mod must return an array broadcastable",
        lambda be: dict(score_mod=lambda s, b, h, q, kv: be.xp.concat([s, s], axis=-1)),
    ),
    "score_mod fails on index arrays": (
        TypeError,
        "score_mod failed on index arrays",
        lambda be: dict(score_mod=lambda s, b, h, q, kv: s + [0.0, 1.0][q]),
    ),
    "mask_mod returns floats": (
        TypeError,
        "mask_mod must return a boolean array",
        lambda be: dict(
            block_mask=_block_mask(be, lambda b, h, q, kv: be.xp.astype(kv <= q, be.xp.float32), None, None, N, M)
        ),
    ),
    "block mask for other sizes": (
        ValueError,
        rf"created for \(B, H, Q_LEN, KV_LEN\) = \(None, None, {N - 1}, {M}\).*\(B, H, n, m\) = \({B}, {H}, {N}, {M}\)",
        lambda be: dict(block_mask=_block_mask(be, mods.causal, None, None, N - 1, M)),
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_MODS))
def test_bad_mods_get_one_clear_error(attnx_backend, case):
    be = attnx_backend
    error, message, arguments = BAD_MODS[case]
    (query, key, value), _ = _inputs(be, "float32")
    with pytest.raises(error, match=message):
        kwargs = arguments(be)
        attnx.flex_attention(query, key, value, enable_gqa=True, **kwargs)


def test_gradients_reach_the_inputs_and_what_a_mod_closes_over(attnx_backend):
    from attnx_conformance.test_gradients import check_gradients

    be = attnx_backend
    block_mask = _block_mask(be, mods.sliding_window(1), None, None, 3, 4, block_size=2)

    def attention(q, k, v, slopes):
        return attnx.flex_attention(q, k, v, mods.alibi(slopes), block_mask, enable_gqa=True)

    gen = rng(93)
    arrays = [gen.standard_normal(shape) for shape in ((1, 2, 3, 2), (1, 1, 4, 2), (1, 1, 4, 2), (2,))]
    check_gradients(be, attention, arrays)


def test_gradients_at_the_shapes_fused_kernels_take(attnx_backend):
    from attnx_conformance.test_gradients import check_gradients

    be = attnx_backend
    _eager(be)
    block_mask = _block_mask(be, mods.causal, None, None, 5, 7)

    def attention(q, k, v, slopes):
        return attnx.flex_attention(q, k, v, mods.alibi(slopes), block_mask, enable_gqa=True)

    gen = rng(94)
    shapes = ((1, 2, 5, FUSED_WIDTH), (1, 1, 7, FUSED_WIDTH), (1, 1, 7, FUSED_WIDTH), (2,))
    check_gradients(be, attention, [gen.standard_normal(shape) for shape in shapes])


def _paper_slopes(heads):
    """ALiBi's slopes as the paper's code computes them (ofirpress/attention_with_linear_biases)."""

    def power_of_two(count):
        start = 2 ** (-(2 ** -(np.log2(count) - 3)))
        return [start * start**i for i in range(count)]

    if np.log2(heads).is_integer():
        return power_of_two(heads)
    closest = 2 ** int(np.floor(np.log2(heads)))
    return power_of_two(closest) + power_of_two(2 * closest)[0::2][: heads - closest]


@pytest.mark.parametrize("heads", [1, 6, 8, 12, 16, 24])  # from 16 heads the exponents are not integers
def test_alibi_slopes_follow_the_paper(attnx_backend, heads):
    be = attnx_backend
    slopes = mods.alibi_slopes(heads, dtype=be.dtype("float64"), backend=be.name, device=be.device)
    assert_close(slopes, np.array(_paper_slopes(heads)), be, be.dtype("float64"))


def test_a_block_mask_no_index_can_count_is_refused_by_name(attnx_backend):
    """Each size is a valid int64, their product is not: refused at once, not
    after evaluating the mod over some of the 2**80 elements."""
    with pytest.raises(ValueError, match=r"B x H x Q_LEN x KV_LEN = 2 x 1 x 1099511627776 x 1099511627776 would need"):
        attnx.create_block_mask(mods.causal, 2, None, 2**40, 2**40, backend=attnx_backend.name)


@pytest.mark.parametrize(
    "q_shape, kv_shape",
    [((1, 0, 3, 2), (1, 1, 4, 2)), ((0, 2, 3, 2), (1, 2, 4, 2)), ((2, 2, 0, 2), (2, 2, 4, 2))],
    ids=["no heads", "no batch", "no queries"],
)
@pytest.mark.parametrize("return_weights", [False, True])
def test_empty_inputs_give_empty_outputs(attnx_backend, q_shape, kv_shape, return_weights):
    """Found by the bad-input properties on Dask: no heads made a reduction over nothing."""
    be = attnx_backend
    query, key = be.array(np.ones(q_shape), "float32"), be.array(np.ones(kv_shape), "float32")
    result = attnx.flex_attention(query, key, key, enable_gqa=True, return_weights=return_weights)
    output = result[0] if return_weights else result
    batch = max(q_shape[0], kv_shape[0]) if 0 not in (q_shape[0], kv_shape[0]) else 0
    assert be.numpy(output).shape == (batch, q_shape[1], q_shape[2], kv_shape[3])
    if return_weights:
        assert be.numpy(result[1]).shape == (batch, q_shape[1], q_shape[2], kv_shape[2])


BAD_BLOCK_MASK_ARGUMENTS = {
    "B of 0": ((mods.causal, 0, None, 8, 8), {}, ValueError, "B must be a positive integer, got 0"),
    "H a bool": ((mods.causal, None, True, 8, 8), {}, TypeError, "H must be an integer, got True"),
    "Q_LEN a float": ((mods.causal, None, None, 8.0, 8), {}, TypeError, r"Q_LEN must be an integer, got 8\.0"),
    "KV_LEN negative": ((mods.causal, None, None, 8, -1), {}, ValueError, "KV_LEN must be a positive integer"),
    "block_size of 0": (
        (mods.causal, None, None, 8, 8),
        {"block_size": 0},
        ValueError,
        "block_size must be a positive",
    ),
    "block_size of three": (
        (mods.causal, None, None, 8, 8),
        {"block_size": (1, 2, 3)},
        ValueError,
        r"block_size must be an int or a \(q_block, kv_block\) pair",
    ),
    "mask_mod not callable": ((3, None, None, 8, 8), {}, TypeError, "mask_mod must be a callable"),
    "mask_mod returns a bool": (
        (lambda b, h, q, kv: True, None, None, 8, 8),
        {},
        TypeError,
        "mask_mod must return an array of the",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_BLOCK_MASK_ARGUMENTS))
def test_bad_block_mask_arguments_are_named(attnx_backend, case):
    arguments, keywords, error, message = BAD_BLOCK_MASK_ARGUMENTS[case]
    with pytest.raises(error, match=f"create_block_mask: {message}"):
        attnx.create_block_mask(*arguments, backend=attnx_backend.name, **keywords)


@pytest.mark.parametrize("axis", ["B", "H"])
def test_a_block_mask_for_every_entry_whose_mod_reads_b_or_h_is_refused(attnx_backend, axis):
    """B=None (H=None) records the blocks of entry 0 alone: a mod that reads b
    (h) would have the other entries' blocks skipped or left unmasked."""
    be = attnx_backend
    (query, key, value), _ = _inputs(be, "float32")
    if axis == "B":
        mask_mod = mods.prefix_lm(be.array(np.array([0, M])))
    else:

        def mask_mod(b, h, q_idx, kv_idx):
            return kv_idx <= q_idx + h

    block_mask = _block_mask(be, mask_mod, None, None, N, M, block_size=BLOCK)
    size = B if axis == "B" else H
    with pytest.raises(
        ValueError, match=rf"created with {axis}=None.*reads {axis.lower()}.*create it with {axis}={size}"
    ):
        attnx.flex_attention(query, key, value, None, block_mask, enable_gqa=True)
    sizes = (B, None) if axis == "B" else (None, H)
    fitting = _block_mask(be, mask_mod, *sizes, N, M, block_size=BLOCK)
    b, h, i, j = np.meshgrid(np.arange(B), np.arange(H), np.arange(N), np.arange(M), indexing="ij")
    allowed = ((j < np.array([0, M])[b]) | (j <= i)) if axis == "B" else (j <= i + h)
    _, exact = _inputs(be, "float32")
    expected, _ = reference.flex_attention(*exact, allowed=allowed)
    assert_close(attnx.flex_attention(query, key, value, None, fitting, enable_gqa=True), expected, be, "float32")


def _table_mismatches():
    """(call, message): each mod of attnx.mods made for another batch, other
    heads or fewer positions than the call's.  Refused before the mod runs,
    so on every backend (indexing short of a table's end would take the
    entries of another call silently)."""
    return {
        "alibi slopes for 8 heads": (
            lambda be, q: attnx.flex_attention(
                q, q, q, mods.alibi(mods.alibi_slopes(8, backend=be.name, device=be.device))
            ),
            rf"flex_attention: score_mod alibi\(slopes\) has slopes for 8 heads, but the call has H = {H}",
        ),
        "relative_bias for 3 heads": (
            lambda be, q: attnx.flex_attention(q, q, q, mods.relative_bias(be.array(np.zeros((3, 5)), "float32"))),
            rf"score_mod relative_bias\(table\) has table for 3 heads, but the call has H = {H}",
        ),
        "prefix_lm of 3 lengths, B = 2": (
            lambda be, q: _block_mask(be, mods.prefix_lm(be.array(np.array([1, 2, 3]))), B, None, N, N),
            rf"create_block_mask: mask_mod prefix_lm\(prefix_length\) has prefix_length for 3 batch entries, but the call has B = {B}",
        ),
        "document ids of 6 positions, in and_masks": (
            lambda be, q: _block_mask(
                be,
                attnx.and_masks(mods.causal, mods.document(be.array(np.zeros((B, 6), dtype=np.int64)))),
                B,
                None,
                N,
                N,
            ),
            rf"mask_mod document\(document_ids\) has document_ids for 6 positions, but the call has max\(n, m\) = {N}",
        ),
        "document ids of 3 entries, in or_masks, at flex_attention": (
            lambda be, q: attnx.flex_attention(
                q,
                q,
                q,
                None,
                _block_mask(
                    be,
                    attnx.or_masks(mods.causal, mods.document(be.array(np.zeros((3, N), dtype=np.int64)))),
                    None,
                    None,
                    N,
                    N,
                ),
            ),
            rf"flex_attention: block_mask's mask_mod document\(document_ids\) has document_ids for 3 batch entries, but the call has B = {B}",
        ),
    }


TABLE_MISMATCHES = _table_mismatches()


@pytest.mark.parametrize("case", sorted(TABLE_MISMATCHES))
def test_a_mod_made_for_another_call_is_refused(attnx_backend, case):
    call, message = TABLE_MISMATCHES[case]
    query = attnx_backend.array(np.ones((B, H, N, D)), "float32")
    with pytest.raises(ValueError, match=message):
        call(attnx_backend, query)


def test_a_block_masks_gradients_come_from_attnxs_tiled_backward(attnx_backend):
    """Without a ``score_mod``, flex attention hands its tiles to the
    backend's ``custom_vjp`` (a ``torch.autograd.Function`` on PyTorch):
    the library's autograd runs attnx's tiled backward over the block
    mask's empty (skipped), partial and full blocks, grouped heads and a
    row that attends nothing, which must equal the chain rule."""
    from attnx_conformance.test_gradients import check_cotangents

    be = attnx_backend
    dtype = be.dtype("float64")

    def band(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx - 4) & (q_idx - kv_idx <= 9) & (q_idx != 3)

    block_mask = _block_mask(be, band, None, None, N, M, block_size=(4, 5))
    kinds = set(np.unique(be.numpy(block_mask.kinds)).tolist())
    assert kinds == {0, 1, 2}, f"the case needs empty, partial and full blocks, got kinds {kinds}"
    _, exact = _inputs(be, dtype)
    gen = rng(95)
    cotangent = rounded(gen.standard_normal((B, H, N, 3)), be, dtype)
    grids = np.meshgrid(np.arange(B), np.arange(H), np.arange(N), np.arange(M), indexing="ij")
    group = H // H_KV
    query, key, value = exact
    expected = reference.scaled_dot_product_attention_vjp(
        query, np.repeat(key, group, axis=1), np.repeat(value, group, axis=1), cotangent, allowed=band(*grids)
    )
    per_head = [expected[name].reshape(B, H_KV, group, M, -1).sum(axis=2) for name in ("key", "value")]
    check_cotangents(
        be,
        lambda q, k, v: attnx.flex_attention(q, k, v, None, block_mask, enable_gqa=True),
        exact,
        cotangent,
        [expected["query"], *per_head],
    )
