"""multi_head_attention against the head-by-head reference and torch.nn.MultiheadAttention."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import attnx
from attnx_conformance import reference
from attnx_conformance.helpers import assert_close, rng

pytestmark = pytest.mark.attnx_operation("multi_head_attention")


def params_on(be, params, dtype):
    return {name: be.array(value, dtype) for name, value in params.items()}


CONFIGS = [
    # (d_model, h, h_kv, d_k, d_v, d_query, d_key, d_value, bias, n, m, lead)
    (8, 2, None, None, None, None, None, None, True, 5, 5, (2,)),
    (12, 3, None, 2, 5, 7, 6, 3, True, 4, 6, (2,)),
    (16, 4, 2, None, None, None, None, None, False, 3, 7, ()),
    (12, 6, 2, None, None, None, None, None, True, 4, 5, (2,)),  # groups of 3: a wrong grouping shows
    (8, 4, 1, None, None, None, None, None, True, 1, 4, (2, 1)),
]


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: f"h{c[1]}-kv{c[2]}-n{c[9]}-m{c[10]}")
def test_matches_reference(attnx_backend, config):
    be = attnx_backend
    d_model, h, h_kv, d_k, d_v, d_query, d_key, d_value, bias, n, m, lead = config
    params = attnx.init_multi_head_params(
        d_model,
        h,
        d_k=d_k,
        d_v=d_v,
        d_query=d_query,
        d_key=d_key,
        d_value=d_value,
        num_kv_heads=h_kv,
        bias=bias,
        seed=5,
        dtype="float64",
        backend="numpy",
    )
    if bias:
        params = {
            k: v + rng(6, len(k)).standard_normal(v.shape) * 0.1 if k.startswith("b") else v for k, v in params.items()
        }
    gen = rng(7, n, m)
    q = gen.standard_normal((*lead, n, d_query or d_model))
    k = gen.standard_normal((*lead, m, d_key or d_model))
    v = gen.standard_normal((*lead, m, d_value or d_key or d_model))
    lengths = np.arange(m, m - lead[0], -1) if lead else None
    allowed = reference.allowed_mask(
        n,
        m,
        batch_shape=lead,
        key_lengths=lengths,
        lengths_per="batch" if len(lead) > 1 else "sequence",
        is_causal=True,
    )
    expected, expected_w = reference.multi_head_attention(q, k, v, params, h, h_kv, allowed)
    for dtype in be.dtypes:
        args = [be.array(a, dtype) for a in (q, k, v)]
        kwargs = dict(
            num_heads=h, num_kv_heads=h_kv, is_causal=True, key_lengths=None if lengths is None else be.array(lengths)
        )
        out, w = attnx.multi_head_attention(
            *args, params_on(be, params, dtype), return_weights=True, average_weights=False, **kwargs
        )
        assert_close(out, expected, be, dtype, scale=10)
        assert_close(w, expected_w, be, dtype)
        _, w_mean = attnx.multi_head_attention(*args, params_on(be, params, dtype), return_weights=True, **kwargs)
        assert_close(w_mean, expected_w.mean(axis=-3), be, dtype)


#: Every mask layout with every kind of extra keys, the heads' keys shared
#: (num_kv_heads=1) or not in turn: each layout and each kind of extra keys
#: meets both, in half the calls of the whole grid.
EXTRA_KEYS_CALLS = [
    (layout, bias_kv, add_zero_attn, (None, 1)[index % 2])
    for index, (layout, (bias_kv, add_zero_attn)) in enumerate(
        itertools.product(["full", "keys", "queries", "scalar"], [(True, False), (False, True), (True, True)])
    )
]


@pytest.mark.parametrize("mask_layout, bias_kv, add_zero_attn, num_kv_heads", EXTRA_KEYS_CALLS)
def test_extra_keys_bias_kv_and_zero_attention(attnx_backend, bias_kv, add_zero_attn, num_kv_heads, mask_layout):
    """PyTorch's add_bias_kv and add_zero_attn: keys beyond every mask,
    attended by every query, whatever the mask's shape: (n, m), a row of
    keys (m,), a column of queries (n, 1) or a scalar."""
    be = attnx_backend
    h, n, m = 2, 4, 5
    h_kv = num_kv_heads or h
    params = attnx.init_multi_head_params(8, h, num_kv_heads=num_kv_heads, seed=3, dtype="float64", backend="numpy")
    gen = rng(12)
    if bias_kv:
        params["bias_k"] = gen.standard_normal(h_kv * 4)
        params["bias_v"] = gen.standard_normal(h_kv * 4)
    q, k = gen.standard_normal((2, n, 8)), gen.standard_normal((2, m, 8))
    lengths = np.array([m, 0])  # the second sequence has no key of its own: only the extra ones
    mask = gen.random((n, m)) < 0.7
    mask = {"full": mask, "keys": mask[1], "queries": mask[:, :1], "scalar": np.array(True)}[mask_layout]
    full = np.broadcast_to(mask, (n, m))
    allowed = reference.allowed_mask(n, m, batch_shape=(2,), key_lengths=lengths, mask=full, is_causal=True)
    expected, expected_w = reference.multi_head_attention(q, k, k, params, h, h_kv, allowed, add_zero_attn)
    for dtype in be.dtypes:

        def attend(dtype=dtype, **options):
            return attnx.multi_head_attention(
                *(be.array(a, dtype) for a in (q, k, k)),
                params_on(be, params, dtype),
                num_heads=h,
                num_kv_heads=num_kv_heads,
                mask=be.array(mask),
                add_zero_attn=add_zero_attn,
                **options,
            )

        out, w = attend(key_lengths=be.array(lengths), is_causal=True, return_weights=True, average_weights=False)
        assert_close(out, expected, be, dtype, scale=10)
        assert_close(w, expected_w, be, dtype)
        # The mask alone, as given: not yet broadcast by the padding and causal masks.
        alone = reference.allowed_mask(n, m, batch_shape=(2,), mask=full)
        expected_alone, _ = reference.multi_head_attention(q, k, k, params, h, h_kv, alone, add_zero_attn)
        assert_close(attend(), expected_alone, be, dtype, scale=10)
    assert expected_w.shape[-1] == m + bias_kv + add_zero_attn
    assert np.all(expected_w[1, ..., :m] == 0) and np.allclose(expected_w[1].sum(-1), 1)


def test_per_head_and_additive_masks(attnx_backend):
    be = attnx_backend
    h, n, m = 2, 3, 4
    params = attnx.init_multi_head_params(6, h, seed=1, dtype="float64", backend="numpy")
    gen = rng(8)
    q, k = gen.standard_normal((2, n, 6)), gen.standard_normal((2, m, 6))
    per_head = gen.random((2, h, n, m)) < 0.6
    inputs = (be.array(q, "float64"), be.array(k, "float64"), be.array(k, "float64"), params_on(be, params, "float64"))
    expected, _ = reference.multi_head_attention(q, k, k, params, h, allowed=per_head)
    out = attnx.multi_head_attention(*inputs, num_heads=h, mask=be.array(per_head))
    assert_close(out, expected, be, "float64")
    additive = np.where(per_head[:, 0], 0.0, -np.inf)
    expected, _ = reference.multi_head_attention(q, k, k, params, h, allowed=per_head[:, :1].repeat(h, 1))
    out = attnx.multi_head_attention(*inputs, num_heads=h, mask=be.array(additive, "float64"))
    assert_close(out, expected, be, "float64")


def test_single_head_without_output_projection(attnx_backend):
    be = attnx_backend
    params = attnx.init_multi_head_params(4, 1, seed=2, dtype="float64", backend="numpy")
    del params["w_o"], params["b_o"]
    x = rng(9).standard_normal((3, 5, 4))
    expected, _ = reference.multi_head_attention(x, x, x, params, 1)
    out = attnx.multi_head_attention(*[be.array(x, "float64")] * 3, params_on(be, params, "float64"), num_heads=1)
    assert_close(out, expected, be, "float64")


def test_same_params_on_every_backend(attnx_backend):
    be = attnx_backend
    dtype = be.dtype("float64")
    ours = attnx.init_multi_head_params(8, 2, seed=3, dtype=dtype, backend=be.name)
    theirs = attnx.init_multi_head_params(8, 2, seed=3, dtype="float64", backend="numpy")
    for name in theirs:
        assert be.backend.owns(ours[name])
        np.testing.assert_array_equal(be.numpy(ours[name]), theirs[name].astype(be.numpy(ours[name]).dtype))
    bound = np.sqrt(6 / (8 + 8))
    assert np.abs(theirs["w_q"]).max() <= bound and np.abs(theirs["w_q"]).max() > 0.8 * bound


@pytest.mark.parametrize("bias, kdim", [(True, None), (False, 5)])
def test_matches_torch_multihead_attention(attnx_backend, bias, kdim):
    torch = pytest.importorskip("torch", reason="compares with torch.nn.MultiheadAttention")
    be = attnx_backend
    torch.manual_seed(0)
    module = torch.nn.MultiheadAttention(12, 3, bias=bias, batch_first=True, kdim=kdim, vdim=kdim, dtype=torch.float64)
    if bias:
        torch.nn.init.normal_(module.in_proj_bias)
    gen = rng(10)
    q, k = gen.standard_normal((2, 4, 12)), gen.standard_normal((2, 6, kdim or 12))
    ignore = gen.random((4, 6)) < 0.3  # torch: True = ignore
    expected, expected_w = module(
        torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(k), attn_mask=torch.from_numpy(ignore)
    )
    copied = attnx.MultiHeadAttention.from_torch(module)
    params = {name: be.array(value.detach().numpy(), "float64") for name, value in copied.params.items()}
    out, w = attnx.multi_head_attention(
        be.array(q, "float64"),
        be.array(k, "float64"),
        be.array(k, "float64"),
        params,
        num_heads=3,
        mask=be.array(~ignore),
        return_weights=True,
    )
    assert_close(out, expected.detach().numpy(), be, "float64")
    assert_close(w, expected_w.detach().numpy(), be, "float64")


def test_grouped_query_matches_torch_enable_gqa(attnx_backend):
    torch = pytest.importorskip("torch", reason="compares with PyTorch's enable_gqa")
    be = attnx_backend
    # Six query heads on two key/value heads: groups of three, so sharing
    # by i // 3 (right) and by i % 2 (wrong) give different outputs.
    params = attnx.init_multi_head_params(12, 6, num_kv_heads=2, seed=4, dtype="float64", backend="numpy")
    x = rng(11).standard_normal((2, 5, 12))
    t = {k: torch.from_numpy(v) for k, v in params.items()}
    xt = torch.from_numpy(x)
    split = lambda y, heads: y.reshape(2, 5, heads, -1).transpose(1, 2)  # noqa: E731
    heads = torch.nn.functional.scaled_dot_product_attention(
        split(xt @ t["w_q"] + t["b_q"], 6),
        split(xt @ t["w_k"] + t["b_k"], 2),
        split(xt @ t["w_v"] + t["b_v"], 2),
        enable_gqa=True,
        is_causal=True,
    )
    expected = heads.transpose(1, 2).reshape(2, 5, 12) @ t["w_o"] + t["b_o"]
    out = attnx.multi_head_attention(
        *[be.array(x, "float64")] * 3, params_on(be, params, "float64"), num_heads=6, num_kv_heads=2, is_causal=True
    )
    assert_close(out, expected.numpy(), be, "float64")


ERRORS = [
    ("num_kv_heads", dict(num_heads=4, num_kv_heads=3), ValueError, "num_kv_heads must divide"),
    ("w_q width", dict(num_heads=3), ValueError, "params['w_q']"),
    ("missing w_k", dict(num_heads=2, drop="w_k"), ValueError, "missing 'w_k'"),
    ("bias shape", dict(num_heads=2, bad_bias=True), ValueError, "params['b_q'] must have shape (8,)"),
    ("params type", dict(num_heads=2, params=[1, 2]), TypeError, "params must be a mapping"),
    (
        "bias_k alone",
        dict(num_heads=2, bias_k_only=True),
        ValueError,
        "params['bias_k'] and params['bias_v'] come together",
    ),
    ("add_zero_attn", dict(num_heads=2, add_zero_attn="yes"), TypeError, "add_zero_attn must be True or False"),
]


@pytest.mark.parametrize("name, case, exception, words", ERRORS, ids=[e[0] for e in ERRORS])
def test_bad_input(attnx_backend, name, case, exception, words):
    be = attnx_backend
    case = dict(case)
    params = params_on(be, attnx.init_multi_head_params(8, 2, seed=0, backend="numpy"), "float32")
    if case.pop("drop", None):
        del params["w_k"]
    if case.pop("bad_bias", None):
        params["b_q"] = be.array(np.zeros(3), "float32")
    if case.pop("bias_k_only", None):
        params["bias_k"] = be.array(np.zeros(8), "float32")
    params = case.pop("params", params)
    x = be.array(np.ones((2, 3, 8)), "float32")
    with pytest.raises(exception) as info:
        attnx.multi_head_attention(x, x, x, params, **case)
    assert words in str(info.value) and "multi_head_attention" in str(info.value)


@pytest.mark.parametrize("num_kv_heads", [None, 1], ids=["mha", "mqa"])
@pytest.mark.parametrize("heads_axis", [2, 1], ids=["per-head", "heads-axis-of-1"])
def test_boolean_mask_and_key_lengths_combine(attnx_backend, heads_axis, num_kv_heads):
    """Both masks apply (logical and), with a mask per head or one broadcast
    over the heads, with or without heads sharing keys."""
    be = attnx_backend
    h, n, m = 2, 3, 5
    params = attnx.init_multi_head_params(8, h, num_kv_heads=num_kv_heads, seed=6, dtype="float64", backend="numpy")
    gen = rng(14)
    q, k = gen.standard_normal((2, n, 8)), gen.standard_normal((2, m, 8))
    mask = gen.random((2, heads_axis, n, m)) < 0.6
    lengths = np.array([m, 2])
    allowed = mask & (np.arange(m) < lengths[:, None, None, None])
    expected, expected_w = reference.multi_head_attention(
        q, k, k, params, h, num_kv_heads, allowed=np.broadcast_to(allowed, (2, h, n, m))
    )
    out, w = attnx.multi_head_attention(
        be.array(q, "float64"),
        be.array(k, "float64"),
        be.array(k, "float64"),
        params_on(be, params, "float64"),
        num_heads=h,
        num_kv_heads=num_kv_heads,
        mask=be.array(mask),
        key_lengths=be.array(lengths),
        return_weights=True,
        average_weights=False,
    )
    assert_close(out, expected, be, "float64")
    assert_close(w, expected_w, be, "float64")


def test_module_with_sequence_first_inputs(attnx_backend):
    """batch_first=False takes (n, batch, d) and returns that layout; the weights stay (batch, n, m)."""
    be = attnx_backend
    params = params_on(be, attnx.init_multi_head_params(8, 2, seed=7, dtype="float64", backend="numpy"), "float64")
    x = rng(15).standard_normal((2, 5, 8))  # (batch, n, d)
    batch_first = attnx.MultiHeadAttention(8, 2, params=params)
    sequence_first = attnx.MultiHeadAttention(8, 2, params=params, batch_first=False)
    expected, expected_w = batch_first(be.array(x, "float64"), return_weights=True)
    out, w = sequence_first(be.array(x.transpose(1, 0, 2), "float64"), return_weights=True)
    assert_close(out, be.numpy(expected).transpose(1, 0, 2), be, "float64")
    assert_close(w, be.numpy(expected_w), be, "float64")
