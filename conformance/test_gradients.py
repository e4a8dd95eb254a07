"""Gradients, for backends that declare autograd: against finite differences."""

from __future__ import annotations

import numpy as np
import pytest

import attnx
from attnx_conformance import reference
from attnx_conformance.helpers import assert_close, rng, rounded, tolerances, under_budget

pytestmark = pytest.mark.attnx_operation("gradients")


def finite_difference(function, arrays, eps):
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


#: Central differences: (step, rtol, atol) per dtype.  In float32 (a backend
#: without float64) a larger step keeps rounding (~1e-7 / step) and the
#: truncation error (~step**2) both near 1e-4.
FINITE_DIFFERENCES = {"float64": (1e-6, 1e-5, 1e-7), "float32": (1e-2, 1e-2, 1e-3)}


def check_gradients(be, operation, arrays, **kwargs):
    """attnx's gradients on ``be`` equal central finite differences of the
    same operation on ``be``, in its widest float dtype (float64 where it has
    it)."""
    if not be.backend.supports_autograd:
        pytest.skip(f"{be.name} does not declare autograd")
    dtype = be.dtype("float64")
    if dtype not in FINITE_DIFFERENCES:
        pytest.skip(f"{be.name}'s widest float dtype, {dtype}, is too coarse for finite differences")
    eps, rtol, atol = FINITE_DIFFERENCES[dtype]
    arrays = [rounded(a, be, dtype) for a in arrays]  # as the backend rounds them

    def on_backend(*xs):
        return operation(*xs, **kwargs)

    def on_numpy(*xs):
        return be.numpy(operation(*(be.array(x, dtype) for x in xs), **kwargs)).astype(np.float64)

    got = be.backend.gradients(on_backend, [be.array(a, dtype) for a in arrays])
    expected = finite_difference(on_numpy, arrays, eps)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(be.numpy(g), e, rtol=rtol, atol=atol)


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


def _family_cases():
    gen = rng(5)
    mha_params = {
        k: gen.standard_normal(v.shape) * 0.5
        for k, v in attnx.init_multi_head_params(4, 2, seed=0, dtype="float64", backend="numpy").items()
    }
    nw_values = gen.standard_normal((5, 2))
    add_params = {"w_q": gen.standard_normal((3, 4)), "w_k": gen.standard_normal((2, 4)), "w_v": gen.standard_normal(4)}
    return {
        "multi_head_attention": (
            lambda be: (
                lambda x, w_q: attnx.multi_head_attention(
                    x, x, x, {**_on(be, mha_params), "w_q": w_q}, num_heads=2, is_causal=True
                )
            ),
            [gen.standard_normal((3, 4)), mha_params["w_q"]],
        ),
        "additive_attention": (
            lambda be: lambda q, k, w_v: attnx.additive_attention(q, k, k, {**_on(be, add_params), "w_v": w_v}),
            [gen.standard_normal((2, 3)), gen.standard_normal((4, 2)), add_params["w_v"]],
        ),
        "nadaraya_watson": (
            lambda be: lambda q, k, v: attnx.nadaraya_watson(q, k, v, bandwidth=0.8),
            [gen.standard_normal(3), gen.standard_normal(5), gen.standard_normal(5)],
        ),
        "nadaraya_watson, vector keys, learned width": (
            lambda be: (
                lambda q, k, bandwidth: attnx.nadaraya_watson(q, k, be.array(nw_values, "float64"), bandwidth=bandwidth)
            ),
            [gen.standard_normal((3, 2)), gen.standard_normal((5, 2)), np.array(0.9)],
        ),
        "apply_rotary": (lambda be: lambda x: attnx.apply_rotary(x), [gen.standard_normal((3, 4))]),
        "causal_conv1d": (
            lambda be: lambda x, w, b: attnx.causal_conv1d(x, w, b, dilation=2),
            [gen.standard_normal((2, 6)), gen.standard_normal((3, 2, 2)), gen.standard_normal(3)],
        ),
        "nadaraya_watson, queries in chunks": (  # under BUDGETS' budget
            lambda be: lambda q, k, v: attnx.nadaraya_watson(q, k, v, bandwidth=0.8),
            [gen.standard_normal(5), gen.standard_normal(5), gen.standard_normal(5)],
        ),
        "nadaraya_watson, weights in chunks": (  # under BUDGETS' budget; two columns of the weights
            lambda be: lambda q, k: attnx.nadaraya_watson(q, k, k, bandwidth=0.8, return_weights=True)[1][:, :2],
            [gen.standard_normal(5), gen.standard_normal(5)],
        ),
        "additive_attention, queries in chunks": (  # under BUDGETS' budget
            lambda be: lambda q, k, w_v: attnx.additive_attention(q, k, k, {**_on(be, add_params), "w_v": w_v}),
            [gen.standard_normal((5, 3)), gen.standard_normal((4, 2)), add_params["w_v"]],
        ),
    }


def _on(be, params):
    return {k: be.array(v, "float64") for k, v in params.items()}


#: Cases run under a memory budget of so many bytes.  Additive attention's
#: queries take 128 bytes each in float64 (4 keys x h = 4): its 5 queries go
#: in chunks of 2 (of 4 in float32), the last shorter; Nadaraya-Watson's
#: take 40 bytes each (5 keys), in chunks of 2 under 80.
BUDGETS = {
    "additive_attention, queries in chunks": 256,
    "nadaraya_watson, queries in chunks": 80,
    "nadaraya_watson, weights in chunks": 80,
}


@pytest.mark.parametrize("operation", list(_family_cases()))
def test_family_gradients(attnx_backend, operation):
    make, arrays = _family_cases()[operation]
    with under_budget(BUDGETS.get(operation)):
        check_gradients(attnx_backend, make(attnx_backend), arrays)


@pytest.mark.parametrize("path", ["call", "weights-path", "generic", "chunked"])
def test_sdpa_gradients_equal_pytorchs_own(attnx_backend, path):
    torch = pytest.importorskip("torch", reason="compares with PyTorch's own gradients")
    be = attnx_backend
    if not be.backend.supports_autograd:
        pytest.skip(f"{be.name} does not declare autograd")
    gen = rng(6)
    arrays = [gen.standard_normal(s) for s in ((2, 3, 5, 4), (2, 3, 6, 4), (2, 3, 6, 3))]
    mask = gen.random((5, 6)) < 0.7

    def ours(q, k, v):
        if path in ("generic", "chunked"):  # on torch the call runs PyTorch's own SDPA: check attnx's algorithm
            from attnx.attention import sdpa_generic

            arguments = dict(query=q, key=k, value=v, mask=be.array(mask), key_lengths=None, is_causal=False)
            chunks = (2, 4) if path == "chunked" else None
            return sdpa_generic(be.xp, **arguments, scale=0.5, return_weights=False, chunks=chunks)
        result = attnx.scaled_dot_product_attention(q, k, v, mask=be.array(mask), return_weights=path == "weights-path")
        return result[0] if path == "weights-path" else result

    got = be.backend.gradients(ours, [be.array(a, "float64") for a in arrays])
    arrays = [rounded(a, be, "float64") for a in arrays]  # as the backend sees them
    leaves = [torch.tensor(a, requires_grad=True) for a in arrays]
    torch.nn.functional.scaled_dot_product_attention(*leaves, attn_mask=torch.from_numpy(mask)).sum().backward()
    for g, leaf in zip(got, leaves):
        np.testing.assert_allclose(be.numpy(g), leaf.grad.numpy(), **tolerances(be, factor=10))


def check_cotangents(be, function, arrays, cotangent, expected):
    """The gradients the backend's autograd gives of ``function(*arrays)``
    through attnx's tiled backward (its ``custom_vjp``), for ``cotangent``
    (the sum of their product), equal ``expected`` (a list, one an array;
    None: not compared)."""
    if not be.backend.supports_autograd:
        pytest.skip(f"{be.name} does not declare autograd")
    if type(be.backend).custom_vjp is attnx.Backend.custom_vjp:
        pytest.skip(f"{be.name} has no custom_vjp: its autograd differentiates the tiles themselves (checked above)")
    dtype = be.dtype("float64")
    cotangent = be.array(cotangent, dtype)
    arrays = [be.array(a, dtype) for a in arrays]
    got = be.backend.gradients(lambda *xs: function(*xs) * cotangent, arrays)
    for grad, want, array in zip(got, expected, arrays):
        if want is not None:
            assert_close(grad, want, be, dtype, like=array, scale=4.0)


TILED_CASES = [
    # (name, n, m, key/value heads, is_causal, key lengths, real mask, chunks)
    ("causal, more queries than keys (empty rows)", 9, 4, 3, True, None, False, (2, 3)),
    ("causal, grouped heads, padding with an empty row", 7, 9, 1, True, [9, 0], False, (3, 4)),
    ("a real mask with -inf, a 0-d scale", 5, 7, 3, False, None, True, (2, 3)),
]


@pytest.mark.parametrize(
    ("name", "n", "m", "kv_heads", "is_causal", "lengths", "real_mask", "chunks"),
    TILED_CASES,
    ids=[case[0] for case in TILED_CASES],
)
def test_tiled_attention_differentiates_by_its_own_backward(
    attnx_backend, name, n, m, kv_heads, is_causal, lengths, real_mask, chunks
):
    """attnx's tiled SDPA hands itself to the backend's ``custom_vjp`` (a
    ``torch.autograd.Function`` on PyTorch): the library's autograd then
    runs attnx's tiled backward, which must equal the chain rule."""
    from attnx.attention import sdpa_generic

    be = attnx_backend
    dtype = be.dtype("float64")
    gen = rng(59, n, m)
    shapes = ((2, 3, n, 4), (2, kv_heads, m, 4), (2, kv_heads, m, 5))
    data = [rounded(gen.standard_normal(shape), be, dtype) for shape in shapes]
    cotangent = rounded(gen.standard_normal((2, 3, n, 5)), be, dtype)
    key_lengths = None if lengths is None else np.array(lengths)
    additive = None
    if real_mask:
        additive = rounded(np.where(gen.random((n, m)) < 0.8, gen.standard_normal((n, m)), -np.inf), be, dtype)
        additive[:, 0] = 0.0  # every row attends a key
        data += [additive, np.asarray(0.6)]
    allowed = reference.allowed_mask(
        n, m, batch_shape=(2, 3), key_lengths=key_lengths, lengths_per="batch", is_causal=is_causal
    )
    if additive is not None:
        allowed = allowed & np.isfinite(additive)
    scale = 0.6 if real_mask else 0.5
    expected = reference.scaled_dot_product_attention_vjp(
        *data[:3],
        cotangent,
        allowed=allowed,
        additive=None if additive is None else np.where(np.isfinite(additive), additive, 0.0),
        scale=scale,
    )

    def attention(q, k, v, mask=None, scale_array=None):
        return sdpa_generic(
            be.xp,
            query=q,
            key=k,
            value=v,
            mask=mask,
            key_lengths=None if key_lengths is None else be.array(key_lengths),
            is_causal=is_causal,
            scale=scale if scale_array is None else scale_array,
            return_weights=False,
            chunks=chunks,
            custom_vjp=be.backend.custom_vjp,
        )

    names = ["query", "key", "value", "additive", "scale"][: len(data)]
    check_cotangents(be, attention, data, cotangent, [expected[name] for name in names])
