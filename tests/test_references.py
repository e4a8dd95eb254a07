"""The conformance kit's references checked against each other: a reference
that could not tell two conventions apart would pass a backend of either."""

from __future__ import annotations

import numpy as np

from attnx_conformance import reference


def test_rotary_layouts_pair_other_features():
    """The two references differ (a test of one layout can't pass for the
    other) and are the same rotation up to a permutation of the features."""
    x = np.random.default_rng(52).standard_normal((5, 8))
    halves = reference.apply_rotary_halves(x)
    assert np.abs(halves - reference.apply_rotary(x)).max() > 0.1
    order = np.arange(8).reshape(2, 4).T.ravel()  # 0, 4, 1, 5, ...: the halves' pairs side by side
    np.testing.assert_allclose(reference.apply_rotary(x[:, order])[:, np.argsort(order)], halves, rtol=1e-12)
