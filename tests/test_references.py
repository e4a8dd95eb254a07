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


def test_named_kernels_are_the_references_kernels():
    """attnx.kernel_regression.KERNELS, public, as functions of the scaled
    distance: nadaraya_watson computes the gaussian from the distances
    instead, so nothing else would see this one go wrong."""
    from attnx.kernel_regression import KERNELS

    u = np.linspace(0.0, 3.0, 13)
    assert sorted(KERNELS) == sorted(reference.KERNELS)
    for name, kernel in KERNELS.items():
        expected = [reference.KERNELS[name](float(x)) for x in u]
        np.testing.assert_allclose(kernel(np, u), expected, rtol=1e-12, atol=1e-15, err_msg=name)
