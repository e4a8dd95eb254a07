"""The generic algorithms' branches that NumPy never takes.

NumPy's intermediates are writeable, so the masked softmax updates them in
place; tensors that record gradients (and libraries whose arrays can't be
written, JAX's) take the other branch.  Here the generic algorithms run
directly on PyTorch tensors that require gradients, against NumPy float64
formulas.
"""

from __future__ import annotations

import numpy as np
import pytest

from attnx import _masking
from attnx.attention import sdpa_generic

torch = pytest.importorskip("torch")
xp = pytest.importorskip("array_api_compat.torch")


def tensor(data):
    return torch.tensor(data, requires_grad=data.dtype.kind == "f")


def _softmax(scores, allowed):
    scores = np.where(allowed, scores, -np.inf)
    top = np.max(scores, axis=-1, keepdims=True)
    exp = np.exp(scores - np.where(np.isfinite(top), top, 0.0))
    total = exp.sum(-1, keepdims=True)
    return exp / np.where(total == 0, 1.0, total)


def test_masked_softmax_without_in_place_updates():
    gen = np.random.default_rng(0)
    scores, allowed = gen.standard_normal((2, 3, 5)), gen.random((2, 3, 5)) < 0.6
    allowed[0, 0] = False
    additive = np.where(gen.random((3, 5)) < 0.2, -np.inf, gen.standard_normal((3, 5)))
    assert not _masking.can_mutate(tensor(scores))
    got = _masking.softmax(xp, tensor(scores), tensor(allowed), tensor(additive))
    np.testing.assert_allclose(got.detach().numpy(), _softmax(scores + additive, allowed), rtol=1e-12, atol=1e-15)
    plain = _masking.softmax(xp, tensor(scores))
    np.testing.assert_allclose(plain.detach().numpy(), _softmax(scores, np.ones_like(allowed)), rtol=1e-12)


@pytest.mark.parametrize("chunks", [None, (2, 3)])
def test_attention_without_in_place_updates(chunks):
    gen = np.random.default_rng(1)
    q, k, v = gen.standard_normal((2, 5, 4)), gen.standard_normal((2, 7, 4)), gen.standard_normal((2, 7, 3))
    allowed = gen.random((5, 7)) < 0.7
    arguments = {name: tensor(a) for name, a in zip(("query", "key", "value"), (q, k, v))}
    out = sdpa_generic(
        xp,
        **arguments,
        mask=tensor(allowed),
        key_lengths=None,
        is_causal=False,
        scale=0.5,
        return_weights=False,
        chunks=chunks,
    )
    expected = _softmax(q @ k.swapaxes(-1, -2) * 0.5, allowed) @ v
    np.testing.assert_allclose(out.detach().numpy(), expected, rtol=1e-12, atol=1e-15)


def test_widest_float_asks_the_device():
    """PyTorch's "mps" device has no float64, which array-api-compat's
    inspection API does not say: the widest float is found by making one on
    the device.  Here, array-api-strict's namespace with a creation that
    refuses float64 on one device, as PyTorch's does on "mps"."""
    import types

    import array_api_strict

    from attnx import _checks

    def zeros(shape, *, dtype=None, device=None):
        if dtype == array_api_strict.float64 and device == "no-float64":
            raise TypeError("Cannot convert a MPS Tensor to float64 dtype as the MPS framework doesn't support float64")
        return array_api_strict.zeros(shape, dtype=dtype)

    namespace = types.SimpleNamespace(
        __name__="refuses_float64_on_one_device",
        float32=array_api_strict.float32,
        float64=array_api_strict.float64,
        zeros=zeros,
    )
    assert _checks.widest_float(namespace, "no-float64") == array_api_strict.float32
    assert _checks.widest_float(namespace, "other") == array_api_strict.float64
    assert _checks.widest_float(namespace) == array_api_strict.float64


def test_a_namespace_whose_inspection_api_fails_is_named_with_the_backend():
    """ndonnx 0.23 asks dtypes() for a ``kind``: its bare TypeError escaped
    from every call that named a dtype, naming neither library nor call."""
    import types

    from attnx import _checks

    class Info:
        def dtypes(self, *, kind):
            return {}

    xp = types.SimpleNamespace(__name__="brokenlib", __array_namespace_info__=Info, float32="float32")
    with pytest.raises(
        TypeError, match=r"asarray: backend 'broken': brokenlib.__array_namespace_info__\(\).dtypes\(\) failed"
    ):
        _checks.require_dtype_name("asarray", xp, "broken", "float32")
