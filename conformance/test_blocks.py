"""attnx.blocks, the online softmax's building blocks, on every backend's arrays.

Keys split any way, their partial states combined in any order (pairwise or
stacked), must give attention as the float64 reference computes it; a query
that attends nothing gets zeros.  Backends whose own algorithms cut work by
key blocks (the Dask backend's) rest on these.
"""

from __future__ import annotations

import numpy as np
import pytest

import attnx
from attnx import blocks
from attnx.kernel_regression import combine_states_along, finish_state, kernel_state
from attnx_conformance import reference
from attnx_conformance.helpers import assert_close, rng, rounded

pytestmark = pytest.mark.attnx_operation("blocks")

#: Key splits of m = 11: (start, stop) of each part.
SPLITS = {"whole": [(0, 11)], "halves": [(0, 5), (5, 11)], "uneven": [(0, 1), (1, 4), (4, 10), (10, 11)]}


def _on(be, arrays, dtype="float64"):
    return [be.array(a, dtype) for a in arrays]


@pytest.mark.parametrize("split", sorted(SPLITS))
@pytest.mark.parametrize("masks", ["none", "causal", "boolean and additive"])
def test_states_of_split_keys_combine_to_attention(attnx_backend, split, masks):
    be = attnx_backend
    gen = rng(70)
    q, k, v = gen.standard_normal((2, 7, 4)), gen.standard_normal((2, 11, 4)), gen.standard_normal((2, 11, 3))
    allowed_np = gen.random((7, 11)) < 0.6
    allowed_np[2] = False  # a row with nothing to attend
    additive_np = gen.standard_normal((2, 7, 11))
    query, key, value = _on(be, (q, k, v))
    states = []
    for start, stop in SPLITS[split]:
        block_masks = ()
        if masks == "boolean and additive":
            block_masks = (be.array(allowed_np[:, start:stop]), be.array(additive_np[..., start:stop], "float64"))
        states.append(
            blocks.attend_block(
                query,
                key[..., start:stop, :],
                value[..., start:stop, :],
                scale=0.5,
                mask=block_masks,
                is_causal=masks == "causal",
                offset=(0, start),
                scores_shape=(7, 11),
            )
        )
    pairwise = states[0]
    for state in reversed(states[1:]):  # any order: combine is commutative and associative
        pairwise = blocks.combine(state, pairwise)
    stacked = blocks.combine_along(be.xp.stack(states, axis=0), 0)
    exact = [rounded(a, be, be.dtype("float64")) for a in (q, k, v)]
    allowed = additive = None
    if masks == "causal":
        allowed = reference.allowed_mask(7, 11, batch_shape=(2,), is_causal=True)
    if masks == "boolean and additive":
        allowed, additive = np.broadcast_to(allowed_np, (2, 7, 11)), additive_np
    expected, _ = reference.scaled_dot_product_attention(*exact, allowed=allowed, additive=additive, scale=0.5)
    for state in (pairwise, stacked):
        assert_close(blocks.finish(state), expected, be, be.dtype("float64"))


#: Query splits of n = 7, for the backward's blocks.
ROW_SPLITS = {"whole": [(0, 7)], "uneven": [(0, 3), (3, 4), (4, 7)]}


@pytest.mark.parametrize("split", ["whole", "uneven"])
@pytest.mark.parametrize("masks", ["none", "causal", "boolean and additive"])
def test_gradients_of_blocks_sum_to_attentions(attnx_backend, split, masks):
    """attend_block_vjp's parts, summed over the blocks of keys (queries)
    and of queries (keys, values), are the float64 chain rule's gradients;
    a row with nothing to attend gets zeros."""
    be = attnx_backend
    gen = rng(74)
    q, k, v = gen.standard_normal((2, 7, 4)), gen.standard_normal((2, 11, 4)), gen.standard_normal((2, 11, 3))
    cotangent = gen.standard_normal((2, 7, 3))
    allowed_np = gen.random((7, 11)) < 0.6
    allowed_np[2] = False  # a row with nothing to attend
    additive_np = gen.standard_normal((2, 7, 11))
    query, key, value, d_output = _on(be, (q, k, v, cotangent))
    is_causal = masks == "causal"

    def block_masks(rows, cols):
        if masks != "boolean and additive":
            return ()
        return (
            be.array(allowed_np[rows[0] : rows[1], cols[0] : cols[1]]),
            be.array(additive_np[..., rows[0] : rows[1], cols[0] : cols[1]], "float64"),
        )

    place = {"is_causal": is_causal, "scores_shape": (7, 11), "scale": 0.5}
    d_query, d_key, d_value, d_scale = [], 0, 0, 0
    for rows in ROW_SPLITS[split]:
        q_rows, d_rows = query[..., rows[0] : rows[1], :], d_output[..., rows[0] : rows[1], :]
        states = [
            blocks.attend_block(
                q_rows,
                key[..., c0:c1, :],
                value[..., c0:c1, :],
                mask=block_masks(rows, (c0, c1)),
                offset=(rows[0], c0),
                **place,
            )
            for c0, c1 in SPLITS["uneven"]
        ]
        state = blocks.combine_along(be.xp.stack(states, axis=0), 0)
        key_parts, value_parts, row_part = [], [], 0
        for c0, c1 in SPLITS["uneven"]:
            parts = blocks.attend_block_vjp(
                q_rows,
                key[..., c0:c1, :],
                value[..., c0:c1, :],
                d_rows,
                state,
                mask=block_masks(rows, (c0, c1)),
                offset=(rows[0], c0),
                **place,
            )
            row_part = row_part + parts[0]
            key_parts.append(parts[1])
            value_parts.append(parts[2])
            d_scale = d_scale + be.xp.sum(parts[3])
        d_query.append(row_part)
        d_key = d_key + be.xp.concat(key_parts, axis=-2)
        d_value = d_value + be.xp.concat(value_parts, axis=-2)
    exact = [rounded(a, be, be.dtype("float64")) for a in (q, k, v, cotangent)]
    allowed = additive = None
    if is_causal:
        allowed = reference.allowed_mask(7, 11, batch_shape=(2,), is_causal=True)
    if masks == "boolean and additive":
        allowed, additive = np.broadcast_to(allowed_np, (2, 7, 11)), additive_np
    expected = reference.scaled_dot_product_attention_vjp(*exact, allowed=allowed, additive=additive, scale=0.5)
    got = {"query": be.xp.concat(d_query, axis=-2), "key": d_key, "value": d_value, "scale": d_scale}
    for name, gradient in got.items():
        assert_close(gradient, expected[name], be, be.dtype("float64"))
    assert np.all(be.numpy(got["query"])[:, 2] == 0) if masks == "boolean and additive" else True


def test_a_block_in_the_causal_future_attends_nothing(attnx_backend):
    be = attnx_backend
    # An odd d_v: the state is d_v + 1 wide (d_v | 1 is that only when d_v is even).
    query, key, value = _on(be, [rng(71).standard_normal(shape) for shape in ((3, 4), (5, 4), (5, 3))])
    state = blocks.attend_block(query, key, value, scale=1.0, is_causal=True, offset=(0, 10), scores_shape=(10, 15))
    got = be.numpy(state)
    assert got.shape == (3, 5)
    assert np.all(got[:, :4] == 0) and np.all(got[:, 4] == -np.inf)
    assert np.all(be.numpy(blocks.finish(state)) == 0)


def test_minus_inf_scores_attend_nothing(attnx_backend):
    """A user's scores of -inf mask, as an additive mask's do: a row of
    nothing else attends nothing, and its state combines with others'."""
    be = attnx_backend
    scores = np.array([[0.5, -np.inf, 1.0], [-np.inf, -np.inf, -np.inf]])
    value = rng(72).standard_normal((3, 2))
    state = blocks.from_scores(*_on(be, (scores, value)))
    expected = reference.softmax(scores) @ value
    assert_close(blocks.finish(state), expected, be, be.dtype("float64"))
    other = blocks.from_scores(*_on(be, (np.zeros((2, 1)), np.ones((1, 2)))))
    both = reference.softmax(np.concatenate([scores, np.zeros((2, 1))], axis=1)) @ np.concatenate(
        [value, np.ones((1, 2))]
    )
    assert_close(blocks.finish(blocks.combine(state, other)), both, be, be.dtype("float64"))


def test_kernel_states_over_split_training_data(attnx_backend):
    be = attnx_backend
    gen = rng(72)
    train_x, train_y, queries = gen.uniform(-2, 2, 30), gen.standard_normal(30), np.linspace(-3, 3, 6)
    x, y, q = _on(be, (train_x, train_y, queries))
    for kernel in ("gaussian", "epanechnikov"):
        states = [kernel_state(q, x[a:b], y[a:b], kernel=kernel, bandwidth=0.4) for a, b in ((0, 7), (7, 30))]
        got = finish_state(blocks.combine(*states), y)
        expected = attnx.to_numpy(attnx.nadaraya_watson(queries, train_x, train_y, kernel=kernel, bandwidth=0.4))
        assert_close(got, expected, be, be.dtype("float64"))


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # NumPy's, on the way to -inf
@pytest.mark.parametrize("d", [None, 2])
def test_kernel_states_combine_past_the_float_range(attnx_backend, d):
    """Split keys, every one farther than the float range allows in
    bandwidths: one state finishes to the nearest key's value by itself, and
    the states of the parts, with their nearest distances, combine to it
    (``blocks.combine`` alone would give zeros: every score is -inf)."""
    be = attnx_backend
    train_x, train_y, queries = np.arange(8.0), np.arange(8.0) ** 2, np.array([0.2, 2.9, 4.5, 7.6])
    expected = np.array([0.0, 9.0, 20.5, 49.0])  # 4.5: keys 4 and 5 tie
    if d is not None:  # near the same distances, along a diagonal, where a tie would be the roots' rounding
        queries[2], expected[2] = 4.4, 16.0
        train_x, queries = (np.stack([a / np.sqrt(d)] * d, axis=-1) for a in (train_x, queries))
    x, y, q = _on(be, (train_x, train_y, queries))
    bandwidth = 1e-200 if be.dtype_name(x) == "float64" else 1e-30  # squares past 1e398 and 1e58
    assert_close(finish_state(kernel_state(q, x, y, bandwidth=bandwidth), y), expected, be, be.dtype("float64"))
    parts = [
        kernel_state(q, x[a:b, ...], y[a:b], bandwidth=bandwidth, return_nearest=True) for a, b in ((0, 3), (3, 8))
    ]
    xp = be.xp
    state, nearest = combine_states_along(xp.stack([p[0] for p in parts]), xp.stack([p[1] for p in parts]), 0)
    assert_close(finish_state(state, y), expected, be, be.dtype("float64"))
    third = queries[2] if d is None else queries[2, 0] * np.sqrt(d)
    assert_close(nearest, np.array([0.2, 0.1, abs(third - round(third)), 0.6]), be, be.dtype("float64"), scale=1e3)
    assert_close(parts[0][1], np.array([0.2, 0.9, third - 2, 5.6]), be, be.dtype("float64"), scale=1e3)


def test_states_of_no_key_before_any_call_are_made_on_the_inputs_device(attnx_backend):
    """attnx.blocks and the kernel states take their namespace from their
    arrays: their owner's, also before any call has taught attnx the arrays'
    type.  (Two cases failed on Dask arrays of CuPy chunks on a GPU, where
    they ran first in their process: array-api-compat's Dask namespace, then
    used, refuses a device of CuPy chunks.)  A part of the data with no key
    makes its state from nothing: on the queries' device."""
    be = attnx_backend
    queries = be.array(np.linspace(-1, 1, 4))
    no_key = queries[:0]
    attnx._registry._forget_types()
    xp = attnx._checks.namespace_of(queries)
    assert xp is attnx._registry.owner_of(queries).xp
    state, nearest = kernel_state(queries, no_key, no_key, return_nearest=True)
    empty = blocks.from_scores(be.array(np.zeros((4, 0))), be.array(np.zeros((0, 3))))
    device = attnx._checks.device_of(queries)
    assert attnx._checks.device_of(state) == attnx._checks.device_of(nearest) == device
    assert attnx._checks.device_of(empty) == device
    assert np.all(be.numpy(nearest) == np.inf)
    assert not np.any(be.numpy(finish_state(state, no_key))) and not np.any(be.numpy(blocks.finish(empty)))


def test_kernel_states_with_nearest_combine_as_blocks_do(attnx_backend):
    """Within the float range, combine_states_along is blocks.combine_along;
    an empty part changes nothing."""
    be = attnx_backend
    gen = rng(75)
    train_x, train_y, queries = gen.uniform(-2, 2, 30), gen.standard_normal(30), np.linspace(-3, 3, 6)
    x, y, q = _on(be, (train_x, train_y, queries))
    xp = be.xp
    for kernel in ("gaussian", "epanechnikov"):
        parts = [
            kernel_state(q, x[a:b], y[a:b], kernel=kernel, bandwidth=0.4, return_nearest=True)
            for a, b in ((0, 7), (7, 7), (7, 30))
        ]
        state, nearest = combine_states_along(xp.stack([p[0] for p in parts]), xp.stack([p[1] for p in parts]), 0)
        expected = attnx.to_numpy(attnx.nadaraya_watson(queries, train_x, train_y, kernel=kernel, bandwidth=0.4))
        assert_close(finish_state(state, y), expected, be, be.dtype("float64"))
        assert_close(nearest, np.abs(queries[:, None] - train_x[None, :]).min(axis=1), be, be.dtype("float64"))
        assert np.isinf(be.numpy(parts[1][1])).all()


@pytest.mark.parametrize("layout", ["batch", "sequence", "query"])
def test_lengths_mask_in_every_layout(attnx_backend, layout):
    be = attnx_backend
    gen = rng(73)
    lengths = {
        "batch": gen.integers(0, 7, size=2),
        "sequence": gen.integers(0, 7, size=(2, 3)),
        "query": gen.integers(0, 7, size=(2, 3, 5)),
    }[layout]
    got = blocks.lengths_mask(be.array(lengths), (2, 3), 5, 6)
    expected = reference.allowed_mask(5, 6, batch_shape=(2, 3), key_lengths=lengths, lengths_per=layout)
    np.testing.assert_array_equal(np.broadcast_to(be.numpy(got), (2, 3, 5, 6)), expected)


def _bad_block_calls():
    def state(shape):
        return lambda be: be.array(np.zeros(shape), "float64")

    q, k, v = state((2, 3, 4)), state((2, 5, 4)), state((2, 5, 6))
    return {
        "attend_block, key's d_k": (
            lambda be: blocks.attend_block(q(be), state((2, 5, 3))(be), v(be), scale=1.0),
            r"attend_block: key must have shape \(\.\.\., cols, d_k\) with d_k = 4",
        ),
        "attend_block, value's rows": (
            lambda be: blocks.attend_block(q(be), k(be), state((2, 4, 6))(be), scale=1.0),
            r"attend_block: value must have m = 5 positions \(from key\)",
        ),
        "attend_block, leading shapes": (
            lambda be: blocks.attend_block(q(be), state((3, 5, 4))(be), state((3, 5, 6))(be), scale=1.0),
            r"attend_block: leading shapes \(\.\.\.\) do not broadcast: query \(2,\), key \(3,\)",
        ),
        "from_scores, value's rows": (
            lambda be: blocks.from_scores(state((3, 5))(be), state((4, 2))(be)),
            r"from_scores: value must have shape \(\.\.\., m, d_v\) with m = 5 \(from scores\)",
        ),
        "from_weights, a vector": (
            lambda be: blocks.from_weights(state((5,))(be), state((5, 2))(be)),
            r"from_weights: weights must have shape \(\.\.\., n, m\)",
        ),
        "combine, widths": (
            lambda be: blocks.combine(state((2, 3, 8))(be), state((2, 3, 5))(be)),
            r"combine: states must have one width d_v \+ 2, got first \(2, 3, 8\), second \(2, 3, 5\)",
        ),
        "combine, leading shapes": (
            lambda be: blocks.combine(state((2, 3, 8))(be), state((3, 3, 8))(be)),
            r"combine: states' shapes \(\.\.\., n\) do not broadcast: first \(2, 3\), second \(3, 3\)",
        ),
        "combine_along, an axis past the end": (
            lambda be: blocks.combine_along(state((2, 3, 8))(be), 5),
            r"combine_along: axis must lie in \[-3, 3\), got 5",
        ),
        "combine_along, an axis before the first": (
            lambda be: blocks.combine_along(state((2, 3, 8))(be), -4),
            r"combine_along: axis must lie in \[-3, 3\), got -4",
        ),
        "combine_along, the state's own axis": (
            lambda be: blocks.combine_along(state((2, 3, 8))(be), -1),
            r"combine_along: axis must not be the last \(the state's own\), got 2",
        ),
        "finish, no room for the sum and maximum": (
            lambda be: blocks.finish(state((3, 1))(be)),
            r"finish: state must be a state of shape \(\.\.\., n, d_v \+ 2\), got \(3, 1\)",
        ),
    }


BAD_BLOCK_CALLS = _bad_block_calls()


@pytest.mark.parametrize("case", sorted(BAD_BLOCK_CALLS))
def test_bad_blocks_are_named(attnx_backend, case):
    """Shapes that don't fit: a ValueError naming the argument, not the library's broadcasting error."""
    call, words = BAD_BLOCK_CALLS[case]
    with pytest.raises(ValueError, match=words):
        call(attnx_backend)
