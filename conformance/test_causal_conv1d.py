"""causal_conv1d against the reference and torch.nn.functional.conv1d; receptive_field measured."""

from __future__ import annotations

import numpy as np
import pytest

import attnx
from attnx_conformance import reference
from attnx_conformance.helpers import assert_close, other_float, rng, rounded

pytestmark = pytest.mark.attnx_operation("causal_conv1d")

CASES = [
    ((3, 10), (4, 3, 2), 1, 1),
    ((2, 3, 17), (5, 3, 3), 2, 1),
    ((2, 2, 12), (2, 2, 2), 1, 4),
    ((1, 1), (1, 1, 3), 3, 2),
    ((4, 1, 9), (2, 1, 1), 2, 1),
    ((2, 5), (3, 2, 3), 1, 1000),  # every tap but the last reaches before the input: only padding
    ((2, 0), (3, 2, 2), 1, 1),  # an empty sequence
]


@pytest.mark.parametrize("x_shape, w_shape, stride, dilation", CASES)
def test_matches_reference(attnx_backend, x_shape, w_shape, stride, dilation):
    be = attnx_backend
    gen = rng(60)
    x, w, b = gen.standard_normal(x_shape), gen.standard_normal(w_shape), gen.standard_normal(w_shape[0])
    for dtype in be.dtypes:
        got = attnx.causal_conv1d(
            be.array(x, dtype), be.array(w, dtype), be.array(b, dtype), stride=stride, dilation=dilation
        )
        expected = reference.causal_conv1d(
            *(rounded(a, be, dtype) for a in (x, w, b)), stride=stride, dilation=dilation
        )
        assert_close(got, expected, be, dtype, scale=10)


@pytest.mark.parametrize("x_shape, w_shape, stride, dilation", CASES)
def test_matches_torch_conv1d(attnx_backend, x_shape, w_shape, stride, dilation):
    torch = pytest.importorskip("torch", reason="compares with torch.nn.functional.conv1d")
    if x_shape[-1] == 0:
        pytest.skip("torch's conv1d refuses an empty sequence (the float64 reference covers it)")
    be = attnx_backend
    gen = rng(61)
    x, w = gen.standard_normal(x_shape), gen.standard_normal(w_shape)
    padded = torch.nn.functional.pad(torch.from_numpy(x), ((w_shape[-1] - 1) * dilation, 0))
    expected = torch.nn.functional.conv1d(padded, torch.from_numpy(w), stride=stride, dilation=dilation)
    got = attnx.causal_conv1d(be.array(x, "float64"), be.array(w, "float64"), stride=stride, dilation=dilation)
    assert_close(got, expected.numpy(), be, "float64")


@pytest.mark.parametrize("kernel_size, dilations", [(2, [1, 2, 4, 8]), (3, [1, 1, 2]), ([2, 3], [3, 1])])
def test_receptive_field_is_the_measured_dependence(attnx_backend, kernel_size, dilations):
    be = attnx_backend
    sizes = [kernel_size] * len(dilations) if isinstance(kernel_size, int) else kernel_size
    length = 40
    gen = rng(62)
    weights = [be.array(gen.uniform(0.5, 1.0, (1, 1, k)), "float64") for k in sizes]

    def stack(x):
        for w, d in zip(weights, dilations):
            x = attnx.causal_conv1d(x, w, dilation=d)
        return x

    last = length - 1
    # Which inputs move the last output?  Batch entry t bumps input t alone.
    bumped = np.eye(length)[:, None, :]  # (length, c_in = 1, length)
    depends = list(be.numpy(stack(be.array(bumped, "float64")))[:, 0, last] != 0)
    measured = last - int(np.argmax(depends)) + 1
    assert all(depends[last - measured + 1 :])
    assert attnx.receptive_field(kernel_size, dilations) == measured


def test_bad_input(attnx_backend):
    be = attnx_backend
    x = be.array(np.zeros((2, 3, 8)), "float32")
    with pytest.raises(ValueError, match=r"causal_conv1d: x must have shape \(..., c_in, length\) with c_in = 4"):
        attnx.causal_conv1d(x, be.array(np.zeros((2, 4, 2)), "float32"))
    with pytest.raises(ValueError, match="dilation must be a positive integer, got 0"):
        attnx.causal_conv1d(x, be.array(np.zeros((2, 3, 2)), "float32"), dilation=0)
    other = other_float(be)
    with pytest.raises(TypeError, match=f"weight has dtype {other} but x has float32"):
        attnx.causal_conv1d(x, be.array(np.zeros((2, 3, 2)), other))
    for weight_shape in [(2, 3, 2, 1), (2, 3)]:
        with pytest.raises(ValueError, match=r"causal_conv1d: weight must have shape \(c_out, c_in, kernel_size\)"):
            attnx.causal_conv1d(x, be.array(np.zeros(weight_shape), "float32"))
    weight = be.array(np.zeros((2, 3, 2)), "float32")
    for bias_shape in [(1,), (3,), (2, 1), ()]:  # one bias per output channel, no broadcasting
        with pytest.raises(ValueError, match=r"causal_conv1d: bias must have shape \(c_out,\) = \(2,\)"):
            attnx.causal_conv1d(x, weight, be.array(np.zeros(bias_shape), "float32"))


def test_defaults_are_stride_1_and_dilation_1(attnx_backend):
    be = attnx_backend
    gen = rng(63)
    x, w = gen.standard_normal((2, 3, 9)), gen.standard_normal((4, 3, 3))
    got = attnx.causal_conv1d(be.array(x, "float64"), be.array(w, "float64"))
    assert_close(got, reference.causal_conv1d(x, w, stride=1, dilation=1), be, "float64")


@pytest.mark.parametrize(
    "kernel_size, dilations, words",
    [([2, 0], [1, 2], r"kernel_size\[1\] must be a positive integer, got 0"), ([2], [1, 2], "one per layer")],
)
def test_receptive_field_names_the_layer_it_refuses(attnx_backend, kernel_size, dilations, words):
    with pytest.raises(ValueError, match=words):
        attnx.receptive_field(kernel_size, dilations)
