"""Gradients, for backends that declare autograd: against finite differences."""

from __future__ import annotations

import numpy as np
import pytest

import attnx
from attnx_conformance.helpers import rng

pytestmark = pytest.mark.attnx_operation("scaled_dot_product_attention")


def finite_difference(function, arrays, eps=1e-6):
    grads = []
    for index, array in enumerate(arrays):
        grad = np.zeros_like(array)
        for position in np.ndindex(*array.shape):
            plus = [a.copy() for a in arrays]
            minus = [a.copy() for a in arrays]
            plus[index][position] += eps
            minus[index][position] -= eps
            grad[position] = (function(*plus).sum() - function(*minus).sum()) / (2 * eps)
        grads.append(grad)
    return grads


def check_gradients(be, operation, arrays, **kwargs):
    """attnx's gradients on ``be`` equal central finite differences in float64."""
    if not be.backend.supports_autograd:
        pytest.skip(f"{be.name} does not declare autograd")

    def on_backend(*xs):
        return operation(*xs, **kwargs)

    def on_numpy(*xs):
        return be.numpy(operation(*(be.array(x, "float64") for x in xs), **kwargs))

    got = be.backend.gradients(on_backend, [be.array(a, "float64") for a in arrays])
    expected = finite_difference(on_numpy, arrays)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(be.numpy(g), e, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kwargs", [{}, {"is_causal": True}, {"return_weights": False, "scale": 0.7}])
def test_sdpa_gradients(attnx_backend, kwargs):
    gen = rng(3)
    arrays = [gen.standard_normal(s) for s in ((2, 3, 4), (2, 5, 4), (2, 5, 2))]
    check_gradients(attnx_backend, attnx.scaled_dot_product_attention, arrays, **kwargs)


def test_sdpa_gradients_through_weights_path(attnx_backend):
    gen = rng(4)
    arrays = [gen.standard_normal(s) for s in ((3, 4), (5, 4), (5, 2))]

    def output_via_generic(q, k, v):
        return attnx.scaled_dot_product_attention(q, k, v, is_causal=True, return_weights=True)[0]

    check_gradients(attnx_backend, output_via_generic, arrays)
