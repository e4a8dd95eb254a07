"""additive_attention and bahdanau_context against the score-by-score reference."""

from __future__ import annotations

import numpy as np
import pytest

import attnx
import attnx.additive
from attnx_conformance import reference
from attnx_conformance.helpers import assert_close, rng, rounded

pytestmark = pytest.mark.attnx_operation("additive_attention")


def make(be, dtype, q_shape, k_shape, d_v, hidden, seed=0):
    gen = rng(30, seed)
    data = {
        "q": gen.standard_normal(q_shape),
        "k": gen.standard_normal(k_shape),
        "v": gen.standard_normal((*k_shape[:-1], d_v)),
        "w_q": gen.standard_normal((q_shape[-1], hidden)),
        "w_k": gen.standard_normal((k_shape[-1], hidden)),
        "w_v": gen.standard_normal(hidden),
    }
    on_backend = {name: be.array(value, dtype) for name, value in data.items()}
    exact = {name: rounded(value, be, dtype) for name, value in data.items()}
    return on_backend, exact


@pytest.mark.parametrize(
    "q_shape, k_shape", [((3, 4), (5, 6)), ((2, 1, 4), (2, 7, 3)), ((2, 5, 4), (1, 5, 4)), ((5, 4), (3, 2, 7, 3))]
)
def test_matches_reference(attnx_backend, q_shape, k_shape):
    be = attnx_backend
    for dtype in be.dtypes:
        arrays, exact = make(be, dtype, q_shape, k_shape, 2, 8)
        params = {n: arrays[n] for n in ("w_q", "w_k", "w_v")}
        out, w = attnx.additive_attention(arrays["q"], arrays["k"], arrays["v"], params, return_weights=True)
        expected, expected_w = reference.additive_attention(exact["q"], exact["k"], exact["v"], exact)
        assert_close(out, expected, be, dtype, scale=10)
        assert_close(w, expected_w, be, dtype)


def test_half_precision_is_computed_in_float32(attnx_backend):
    """Scores of 120,000 (three hidden units of weight 40,000, each tanh at 1)
    are inf in float16, and inf - inf is NaN; computed in float32 they are
    equal, so each of the 5 keys weighs 1/5 (as 1/70,000 each for 70,000 keys,
    whose float16 sum of weights would be inf too)."""
    be = attnx_backend
    values = np.arange(5.0)[:, None]
    for dtype in be.dtypes:
        query, key = be.array(np.ones((1, 2)), dtype), be.array(np.zeros((5, 2)), dtype)
        params = {"w_q": be.array(np.full((2, 3), 10.0), dtype), "w_k": be.array(np.ones((2, 3)), dtype)}
        params["w_v"] = be.array(np.full(3, 40_000.0), dtype)
        output, weights = attnx.additive_attention(query, key, be.array(values, dtype), params, return_weights=True)
        assert be.dtype_name(output) == dtype and be.dtype_name(weights) == dtype
        assert_close(weights, np.full((1, 5), 0.2), be, dtype)
        assert_close(output, values.mean(axis=0, keepdims=True), be, dtype)


def test_masks_and_chunking(attnx_backend):
    be = attnx_backend
    arrays, exact = make(be, "float64", (2, 9, 3), (2, 6, 5), 4, 7, seed=1)
    params = {n: arrays[n] for n in ("w_q", "w_k", "w_v")}
    lengths = np.array([6, 2])
    mask = rng(31).random((9, 6)) < 0.7
    allowed = reference.allowed_mask(9, 6, batch_shape=(2,), key_lengths=lengths, mask=mask)
    expected, expected_w = reference.additive_attention(exact["q"], exact["k"], exact["v"], exact, allowed)
    # Two queries a chunk: 2 slices x 6 keys x h = 7 in float64, twice.
    with attnx.memory_budget(2 * 2 * 6 * 7 * 8):
        out, w = attnx.additive_attention(
            arrays["q"],
            arrays["k"],
            arrays["v"],
            params,
            mask=be.array(mask),
            key_lengths=be.array(lengths),
            return_weights=True,
        )
    assert_close(out, expected, be, "float64")
    assert_close(w, expected_w, be, "float64")


def test_bahdanau_context(attnx_backend):
    be = attnx_backend
    arrays, exact = make(be, "float64", (3, 4), (3, 6, 5), 5, 8, seed=2)
    params = {n: arrays[n] for n in ("w_q", "w_k", "w_v")}
    lengths = np.array([6, 1, 0])
    context, w = attnx.bahdanau_context(
        arrays["q"], arrays["k"], params, key_lengths=be.array(lengths), return_weights=True
    )
    allowed = reference.allowed_mask(1, 6, batch_shape=(3,), key_lengths=lengths)
    expected, expected_w = reference.additive_attention(exact["q"][:, None, :], exact["k"], exact["k"], exact, allowed)
    assert_close(context, expected[:, 0], be, "float64")
    assert_close(w, expected_w[:, 0], be, "float64")
    assert np.all(be.numpy(context)[2] == 0)


def test_bad_params(attnx_backend):
    be = attnx_backend
    arrays, _ = make(be, "float32", (3, 4), (5, 6), 2, 8)
    params = {"w_q": arrays["w_q"], "w_k": arrays["w_q"], "w_v": arrays["w_v"]}
    with pytest.raises(
        ValueError, match=r"additive_attention: params\['w_k'\] must have shape \(d_key, h\) = \(6, 8\), got \(4, 8\)"
    ):
        attnx.additive_attention(arrays["q"], arrays["k"], arrays["v"], params)


def test_leading_dimensions_only_value_has_shape_the_weights_too(attnx_backend):
    be = attnx_backend
    arrays, exact = make(be, "float64", (3, 4), (5, 6), 2, 8, seed=3)
    value = rng(32).standard_normal((2, 5, 2))
    params = {n: arrays[n] for n in ("w_q", "w_k", "w_v")}
    out, w = attnx.additive_attention(arrays["q"], arrays["k"], be.array(value, "float64"), params, return_weights=True)
    expected, expected_w = reference.additive_attention(exact["q"], exact["k"], value, exact)
    assert_close(out, expected, be, "float64")
    assert_close(w, expected_w, be, "float64")
    assert tuple(w.shape) == (2, 3, 5)


def test_a_w_k_of_the_wrong_width_is_refused(attnx_backend):
    be = attnx_backend
    arrays, _ = make(be, "float32", (3, 4), (5, 6), 2, 8)
    for columns in (9, 7):
        params = {"w_q": arrays["w_q"], "w_k": be.array(np.zeros((6, columns)), "float32"), "w_v": arrays["w_v"]}
        with pytest.raises(
            ValueError, match=rf"params\['w_k'\] must have shape \(d_key, h\) = \(6, 8\), got \(6, {columns}\)"
        ):
            attnx.additive_attention(arrays["q"], arrays["k"], arrays["v"], params)
