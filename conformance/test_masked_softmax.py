"""masked_softmax and attnx.masks against explicit definitions."""

from __future__ import annotations

import numpy as np
import pytest

import attnx
from attnx_conformance import reference
from attnx_conformance.helpers import assert_close, rng, rounded

pytestmark = pytest.mark.attnx_operation("masked_softmax")


@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_masked_softmax_matches_reference(attnx_backend, axis):
    be = attnx_backend
    gen = rng(21)
    scores = gen.standard_normal((3, 4, 5)) * 3
    mask = gen.random((3, 4, 5)) < 0.6
    mask[0, 0, :] = False
    moved_mask = np.moveaxis(mask, axis, -1)
    for dtype in be.dtypes:
        got = attnx.masked_softmax(be.array(scores, dtype), mask=be.array(moved_mask), axis=axis)
        expected = reference.softmax(np.moveaxis(rounded(scores, be, dtype), axis, -1), moved_mask)
        assert_close(got, np.moveaxis(expected, -1, axis), be, dtype)


def test_masked_softmax_lengths_and_1d(attnx_backend):
    be = attnx_backend
    gen = rng(22)
    scores = gen.standard_normal((2, 3, 6))
    lengths = np.array([6, 0])
    got = attnx.masked_softmax(be.array(scores, "float64"), key_lengths=be.array(lengths))
    allowed = reference.allowed_mask(3, 6, batch_shape=(2,), key_lengths=lengths)
    assert_close(got, reference.softmax(scores, allowed), be, "float64")
    vector = gen.standard_normal(5)
    assert_close(attnx.masked_softmax(be.array(vector, "float64")), reference.softmax(vector), be, "float64")


def test_masked_softmax_additive_inf(attnx_backend):
    be = attnx_backend
    scores = np.zeros((2, 3))
    additive = np.array([[0.0, -np.inf, 1.0], [-np.inf, -np.inf, -np.inf]])
    got = be.numpy(attnx.masked_softmax(be.array(scores, "float32"), mask=be.array(additive, "float32")))
    assert np.all(got[1] == 0) and got[0, 1] == 0 and np.isclose(got[0].sum(), 1)


@pytest.mark.parametrize("n, m", [(4, 4), (3, 6), (6, 3), (1, 5)])
def test_mask_builders(attnx_backend, n, m):
    be = attnx_backend
    rows, cols = np.arange(n)[:, None], np.arange(m)[None, :]
    cases = {
        "bottom_right": (attnx.masks.causal(n, m, backend=be.name), cols <= rows + (m - n)),
        "top_left": (attnx.masks.causal(n, m, align="top_left", backend=be.name), cols <= rows),
        "window 1": (
            attnx.masks.sliding_window(n, m, 1, backend=be.name),
            (cols <= rows + m - n) & (cols >= rows + m - n - 1),
        ),
        "window (0, 2)": (
            attnx.masks.sliding_window(n, m, (0, 2), backend=be.name),
            (cols >= rows + m - n) & (cols <= rows + m - n + 2),
        ),
        "window (None, 0)": (attnx.masks.sliding_window(n, m, (None, 0), backend=be.name), cols <= rows + m - n),
    }
    for name, (got, expected) in cases.items():
        assert be.backend.owns(got), name
        np.testing.assert_array_equal(be.numpy(got), expected, err_msg=name)
    lengths = be.array(np.array([0, 2, m]))
    np.testing.assert_array_equal(
        be.numpy(attnx.masks.from_lengths(lengths, m)), np.arange(m)[None, :] < np.array([0, 2, m])[:, None]
    )


def test_masks_combine_and_feed_attention(attnx_backend):
    be = attnx_backend
    mask = attnx.masks.causal(5, backend=be.name, device=be.device) & attnx.masks.sliding_window(
        5, window=2, backend=be.name, device=be.device
    )
    x = be.array(rng(23).standard_normal((5, 4)), "float64")
    _, weights = attnx.scaled_dot_product_attention(x, x, x, mask=mask, return_weights=True)
    assert (be.numpy(weights)[~be.numpy(mask)] == 0).all()


def test_a_mask_of_more_dimensions_than_1d_scores_is_refused(attnx_backend):
    be = attnx_backend
    scores = be.array(np.zeros(4), "float32")
    with pytest.raises(
        ValueError, match=r"masked_softmax: mask must broadcast to the scores' shape \(4,\), got shape \(1, 4\)"
    ):
        attnx.masked_softmax(scores, mask=be.array(np.ones((1, 4), dtype=bool)))
    got = attnx.masked_softmax(scores, mask=be.array(np.array([True, True, False, False])))
    assert_close(got, np.array([0.5, 0.5, 0.0, 0.0]), be, "float32")


@pytest.mark.parametrize("axis", [-1, 0])
@pytest.mark.parametrize("with_additive", [False, True], ids=["plain", "additive"])
def test_masked_softmax_leaves_its_input_alone(attnx_backend, axis, with_additive):
    """The scores are the user's: the softmax is computed beside them, never
    in them (an in-place shift once changed NumPy inputs)."""
    be = attnx_backend
    scores = rng(23).standard_normal((4, 5))
    for dtype in be.dtypes:
        given = be.array(scores, dtype)
        before = be.numpy(given).copy()
        mask = be.array(np.zeros(4 if axis == 0 else 5), dtype) if with_additive else None
        attnx.masked_softmax(given, mask=mask, axis=axis)
        np.testing.assert_array_equal(be.numpy(given), before, err_msg=f"{dtype}: the input changed")


def test_minus_inf_scores_mask_as_a_mask_does(attnx_backend):
    """-inf in the scores themselves masks those entries: the same weights as
    an all-True mask gives, and zeros, not NaN, on a row of nothing but -inf."""
    be = attnx_backend
    scores = np.array([[0.0, -np.inf, 1.0], [-np.inf, -np.inf, -np.inf], [2.0, 0.5, -1.0]])
    expected = reference.softmax(scores)
    assert np.all(expected[1] == 0)
    for dtype in be.dtypes:
        plain = attnx.masked_softmax(be.array(scores, dtype))
        assert_close(plain, expected, be, dtype)
        with_mask = attnx.masked_softmax(be.array(scores, dtype), mask=be.array(np.ones((3, 3), dtype=bool)))
        assert_close(with_mask, expected, be, dtype)
