"""attnx.torch.MultiheadAttention against torch.nn.MultiheadAttention itself:
the same parameters and state_dict keys, the same outputs, weights and
gradients (float64) for every mask PyTorch's layer takes, under
torch.compile, and a model that trains as PyTorch's does."""

from __future__ import annotations

import math
import re
import subprocess
import sys

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
import attnx.torch  # noqa: E402

#: Layouts of the layer: (constructor keywords, what it exercises).
LAYOUTS = {
    "packed projections": {},
    "kdim and vdim": {"kdim": 6, "vdim": 5},
    "a wider vdim alone": {"vdim": 10},
    "no bias": {"bias": False},
    "bias_k and bias_v": {"add_bias_kv": True},
    "a zero key": {"add_zero_attn": True},
    "batch first": {"batch_first": True},
}


def _pair(**options):
    torch.manual_seed(0)
    theirs = torch.nn.MultiheadAttention(8, 2, dtype=torch.float64, **options)
    ours = attnx.torch.MultiheadAttention(8, 2, dtype=torch.float64, **options)
    ours.load_state_dict(theirs.state_dict())
    return ours, theirs


def _inputs(options, batch=3, n=5, m=7, seed=1):
    gen = torch.Generator().manual_seed(seed)
    first = (batch, n) if options.get("batch_first") else (n, batch)
    key_first = (batch, m) if options.get("batch_first") else (m, batch)
    query = torch.randn(*first, 8, generator=gen, dtype=torch.float64)
    key = torch.randn(*key_first, options.get("kdim", 8), generator=gen, dtype=torch.float64)
    value = torch.randn(*key_first, options.get("vdim", 8), generator=gen, dtype=torch.float64)
    return query, key, value


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_the_state_dict_is_pytorchs_both_ways(layout):
    options = LAYOUTS[layout]
    theirs = torch.nn.MultiheadAttention(8, 2, **options)
    ours = attnx.torch.MultiheadAttention(8, 2, **options)
    assert {k: v.shape for k, v in ours.state_dict().items()} == {k: v.shape for k, v in theirs.state_dict().items()}
    theirs.load_state_dict(ours.state_dict())  # and the other way: _pair
    assert [name for name, _ in ours.named_parameters()] == [name for name, _ in theirs.named_parameters()]


def _masks(batch=3, n=5, m=7, heads=2):
    gen = torch.Generator().manual_seed(2)
    padding = torch.zeros(batch, m, dtype=torch.bool)
    padding[1, 4:] = True
    padding[2, :] = True  # a sequence with every key padded: zeros, where PyTorch gives NaN
    future = torch.ones(n, m, dtype=torch.bool).triu(1 + m - n)
    return {
        "none": {},
        "key_padding_mask": {"key_padding_mask": padding[:2].repeat(2, 1)[:batch]},
        "attn_mask, causal": {"attn_mask": future, "is_causal": True},
        "a real attn_mask": {"attn_mask": torch.randn(n, m, generator=gen, dtype=torch.float64)},
        "attn_mask per head": {"attn_mask": torch.rand(batch * heads, n, m, generator=gen) < 0.3},
        "both, boolean": {"attn_mask": future, "key_padding_mask": padding[:2].repeat(2, 1)[:batch]},
        "both, real": {
            "attn_mask": torch.zeros(n, m, dtype=torch.float64).masked_fill(future, -math.inf),
            "key_padding_mask": torch.zeros(batch, m, dtype=torch.float64).masked_fill(
                padding[:2].repeat(2, 1)[:batch], -1e9
            ),
        },
    }


@pytest.mark.parametrize("masks", list(_masks()))
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_outputs_weights_and_gradients_equal_pytorchs(layout, masks):
    options = LAYOUTS[layout]
    ours, theirs = _pair(**options)
    ours.eval(), theirs.eval()
    call = _masks()[masks]
    for average in (True, False):
        inputs = [x.requires_grad_() for x in _inputs(options)]
        out, weights = ours(*inputs, average_attn_weights=average, **call)
        expected, expected_weights = theirs(*inputs, average_attn_weights=average, **call)
        torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
        torch.testing.assert_close(weights, expected_weights, rtol=1e-10, atol=1e-12)
    cotangent = torch.randn_like(out)
    grads = torch.autograd.grad(out, [*inputs, *ours.parameters()], cotangent)
    expected_grads = torch.autograd.grad(expected, [*inputs, *theirs.parameters()], cotangent)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-11)


def test_a_fully_padded_sequence_attends_nothing_and_is_never_nan():
    """A sequence whose every key is padded: zero attention, so its output
    is the output projection's bias (as PyTorch's fused path gives), and
    zero weights."""
    ours, theirs = _pair()
    query, key, value = _inputs({})
    padding = torch.zeros(3, 7, dtype=torch.bool)
    padding[2] = True
    for need_weights in (False, True):
        out, weights = ours(query, key, value, key_padding_mask=padding, need_weights=need_weights)
        expected, _ = theirs(query, key, value, key_padding_mask=padding, need_weights=need_weights)
        torch.testing.assert_close(out[:, :2], expected[:, :2], rtol=1e-10, atol=1e-12)
        bias = ours.out_proj.bias.detach()
        torch.testing.assert_close(out[:, 2], bias.expand_as(out[:, 2]), rtol=0, atol=0)
        assert weights is None or (weights[2] == 0).all()


def test_unbatched_inputs_and_need_weights_false():
    ours, theirs = _pair()
    query, key, value = (x[:, 0] for x in _inputs({}))
    out, weights = ours(query, key, value, need_weights=False)
    expected, _ = theirs(query, key, value, need_weights=False)
    assert weights is None and out.shape == (5, 8)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
    _, weights = ours(query, key, value)
    assert weights.shape == (5, 7)


def test_unbatched_inputs_take_masks_per_head_and_padding():
    ours, theirs = _pair()
    query, key, value = (x[:, 0] for x in _inputs({}))
    gen = torch.Generator().manual_seed(4)
    masks = {
        "attn_mask": torch.rand(2, 5, 7, generator=gen) < 0.3,
        "key_padding_mask": torch.arange(7) >= 5,
    }
    out, weights = ours(query, key, value, average_attn_weights=False, **masks)
    expected, expected_weights = theirs(query, key, value, average_attn_weights=False, **masks)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-10, atol=1e-12)


def _bad_calls():
    """name -> (layer options, query, key, value, call keywords, error, message): inputs PyTorch's layer refuses."""
    x, kv = torch.zeros(5, 3, 8), torch.zeros(7, 3, 8)
    shape_words = "must have shape (L, S) or (N * num_heads, L, S) = (5, 7) or (6, 5, 7)"
    return {
        "a 1-D query": (
            {},
            torch.zeros(8),
            kv,
            kv,
            {},
            ValueError,
            "query must be unbatched (L, E) or batched (L, N, E), got shape (8,)",
        ),
        "a 4-D query": (
            {},
            torch.zeros(5, 3, 1, 8),
            kv,
            kv,
            {},
            ValueError,
            "query must be unbatched (L, E) or batched (L, N, E)",
        ),
        "an unbatched query, batched keys": (
            {},
            x[:, 0],
            kv,
            kv,
            {},
            ValueError,
            "key and value must be 2-D as query is",
        ),
        "the query's features": ({}, torch.zeros(5, 3, 6), kv, kv, {}, ValueError, "query must have 8 features"),
        "the key's features": (
            {"kdim": 6},
            x,
            kv,
            kv,
            {},
            ValueError,
            "key must have 6 features (its last axis), got shape (7, 3, 8)",
        ),
        "key and value of other lengths": (
            {},
            x,
            kv,
            torch.zeros(6, 3, 8),
            {},
            ValueError,
            "key and value must have the same positions",
        ),
        "keys of another batch": (
            {},
            x,
            kv[:, :2],
            kv[:, :2],
            {},
            ValueError,
            "query and key must have the same batch size N",
        ),
        "an attn_mask of H slices": (
            {},
            x,
            kv,
            kv,
            {"attn_mask": torch.zeros(2, 5, 7, dtype=torch.bool)},
            ValueError,
            f"attn_mask {shape_words}, got (2, 5, 7)",
        ),
        "a 4-D attn_mask": (
            {},
            x,
            kv,
            kv,
            {"attn_mask": torch.zeros(3, 2, 5, 7, dtype=torch.bool)},
            ValueError,
            f"attn_mask {shape_words}, got (3, 2, 5, 7)",
        ),
        "an attn_mask of other keys": (
            {},
            x,
            kv,
            kv,
            {"attn_mask": torch.zeros(5, 6)},
            ValueError,
            f"attn_mask {shape_words}, got (5, 6)",
        ),
        "a key_padding_mask of other keys": (
            {},
            x,
            kv,
            kv,
            {"key_padding_mask": torch.zeros(3, 6, dtype=torch.bool)},
            ValueError,
            "key_padding_mask must have shape (N, S) = (3, 7), got (3, 6)",
        ),
        "a 1-D key_padding_mask, batched": (
            {},
            x,
            kv,
            kv,
            {"key_padding_mask": torch.zeros(7, dtype=torch.bool)},
            ValueError,
            "key_padding_mask must have shape (N, S) = (3, 7), got (7,)",
        ),
        "an integer attn_mask": (
            {},
            x,
            kv,
            kv,
            {"attn_mask": torch.zeros(5, 7, dtype=torch.int64)},
            TypeError,
            "attn_mask must be boolean or floating, got torch.int64",
        ),
        "a NumPy query": ({}, x.numpy(), kv, kv, {}, TypeError, "query must be a torch.Tensor, got ndarray"),
    }


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_bad_inputs_are_refused_by_name_as_pytorchs_layer_refuses_them(case):
    """Each call PyTorch's layer refuses (with an AssertionError or a
    RuntimeError of its own), refused before any computation, as a
    ValueError or TypeError naming the argument."""
    options, query, key, value, call, error, message = _bad_calls()[case]
    ours, theirs = (kind(8, 2, **options) for kind in (attnx.torch.MultiheadAttention, torch.nn.MultiheadAttention))
    with pytest.raises((AssertionError, RuntimeError, AttributeError)):  # PyTorch's own errors
        theirs(query, key, value, **call)
    with pytest.raises(error, match="^MultiheadAttention: " + re.escape(message)):
        ours(query, key, value, **call)


#: The wrong calls of a layer (8 features, 2 heads), one at a time: each is refused by PyTorch's layer.
FAULTS = [
    "a 1-D query",
    "a 4-D query",
    "keys of another rank",
    "the query's features",
    "the key's features",
    "the value's features",
    "values of another length",
    "keys of another batch",
    "an attn_mask of the wrong count",
    "a 4-D attn_mask",
    "an attn_mask of other keys",
    "a 1-D key_padding_mask, batched",
    "a key_padding_mask of other keys",
    "an integer attn_mask",
    "an integer key_padding_mask",
]


@st.composite
def _calls(draw):
    """A layer's options and a call of it: right (half the time), or wrong
    in one of the ways PyTorch's layer refuses (:data:`FAULTS`)."""
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    fault = draw(st.sampled_from([None] * len(FAULTS) + FAULTS))
    batch_first, batched = draw(st.booleans()), draw(st.booleans()) or fault == "keys of another batch"
    n, m, batch, kdim = draw(st.integers(1, 4)), draw(st.integers(1, 4)), draw(st.integers(1, 3)), 6
    heads = 2

    def sequence(length, features, lead=batch):
        shape = ((lead, length) if batch_first else (length, lead)) if batched else (length,)
        return torch.randn(*shape, features, generator=gen, dtype=torch.float64)

    query = sequence(n, 8 - (fault == "the query's features"))
    key_batch = batch + (fault == "keys of another batch")
    key = sequence(m, kdim - (fault == "the key's features"), key_batch)
    value = sequence(m + (fault == "values of another length"), 8 - (fault == "the value's features"), key_batch)
    if fault == "a 1-D query":
        query = query.flatten()[:8]
    if fault == "a 4-D query":
        query = query.reshape(*query.shape[:-1], 1, 8)
    if fault == "keys of another rank":
        key, value = key[None], value[None]
    masks = {
        "attn_mask": [(n, m), (batch * heads if batched else heads, n, m)],
        "key_padding_mask": [(batch, m) if batched else (m,)],
    }
    wrong_shapes = {
        "an attn_mask of the wrong count": ("attn_mask", ((batch if batched else 1) * heads + 1, n, m)),
        "a 4-D attn_mask": ("attn_mask", (batch, heads, n, m)),
        "an attn_mask of other keys": ("attn_mask", (n, m + 1)),
        "a 1-D key_padding_mask, batched": ("key_padding_mask", (m,)),
        "a key_padding_mask of other keys": ("key_padding_mask", (batch, m + 1) if batched else (m + 1,)),
    }
    call = {}
    for name, shapes in masks.items():
        shape = draw(st.sampled_from([None, *shapes]))
        if fault in wrong_shapes and wrong_shapes[fault][0] == name:
            shape = wrong_shapes[fault][1]
        if fault == f"an integer {name}" and shape is None:
            shape = shapes[0]
        if shape is not None:
            real = torch.randn(shape, generator=gen, dtype=torch.float64)
            kind = draw(st.sampled_from(["bool", "float"]))
            call[name] = real if kind == "float" else real > 0.5
            if fault == f"an integer {name}":
                call[name] = (real > 0.5).to(torch.int64)
    return fault, {"batch_first": batch_first, "kdim": kdim}, query, key, value, call


@settings(max_examples=150, deadline=None)
@given(_calls())
def test_it_refuses_what_pytorchs_layer_refuses_and_computes_the_rest_alike(drawn):
    """Differential: over calls right and wrong, ours refuses (a ValueError
    or TypeError, nothing else) exactly those PyTorch's layer refuses, and
    where both compute, the outputs agree (where PyTorch's is not NaN: a
    row with no key is zeros in ours)."""
    fault, options, query, key, value, call = drawn
    event(fault or "a right call")
    ours, theirs = _pair(**options)
    try:
        expected = theirs(query, key, value, **call)[0]
    except (AssertionError, RuntimeError, AttributeError, IndexError):  # PyTorch's own errors
        expected = None
    event("PyTorch's layer refuses" if expected is None else "PyTorch's layer computes")
    if expected is None:
        with pytest.raises((ValueError, TypeError)):
            ours(query, key, value, **call)
        return
    out = ours(query, key, value, **call)[0]
    finite = torch.isfinite(expected)
    torch.testing.assert_close(out[finite], expected[finite], rtol=1e-9, atol=1e-11)


def test_grouped_heads_read_their_groups_key_value_head():
    """num_kv_heads, which PyTorch's layer lacks, against its parameters
    used by hand with PyTorch's own grouped SDPA (``enable_gqa``)."""
    torch.manual_seed(3)
    layer = attnx.torch.MultiheadAttention(8, 4, num_kv_heads=2, dtype=torch.float64)
    assert layer.k_proj_weight.shape == (4, 8) and layer.in_proj_bias.shape == (16,)
    with torch.no_grad():
        layer.in_proj_bias.normal_()
    query, key, value = _inputs({})
    out, _ = layer(query, key, value, need_weights=False)
    b_q, b_k, b_v = layer.in_proj_bias.split((8, 4, 4))

    def heads(x, weight, bias, count):  # (L, N, E) -> (N, count, L, 2)
        return (x.transpose(0, 1) @ weight.T + bias).unflatten(-1, (count, 2)).transpose(1, 2)

    grouped = torch.nn.functional.scaled_dot_product_attention(
        heads(query, layer.q_proj_weight, b_q, 4),
        heads(key, layer.k_proj_weight, b_k, 2),
        heads(value, layer.v_proj_weight, b_v, 2),
        enable_gqa=True,
    )
    expected = layer.out_proj(grouped.transpose(1, 2).flatten(-2)).transpose(0, 1)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)


def test_compiled_equals_eager_and_double_converts():
    ours, _ = _pair()
    ours = ours.float().eval()
    query, key, value = (x.float() for x in _inputs({}))
    mask = torch.ones(5, 7, dtype=torch.bool).triu(3)
    eager, _ = ours(query, key, value, attn_mask=mask, need_weights=False)
    compiled = torch.compile(ours, fullgraph=True)
    out, _ = compiled(query, key, value, attn_mask=mask, need_weights=False)
    torch.testing.assert_close(out, eager, rtol=1e-5, atol=1e-6)
    assert ours.double()(*(x.double() for x in (query, key, value)))[0].dtype == torch.float64


def test_training_drops_weights_by_attnx_mask_repeatably():
    ours, _ = _pair(dropout=0.5)
    query, key, value = _inputs({})
    ours.train()
    torch.manual_seed(5)
    first, weights = ours(query, key, value)
    torch.manual_seed(5)
    again, _ = ours(query, key, value)
    torch.testing.assert_close(first, again)
    assert (weights == 0).any()
    ours.eval()
    assert not torch.allclose(ours(query, key, value)[0], first)


def test_importing_attnx_does_not_import_pytorch():
    code = "import sys, attnx; assert 'torch' not in sys.modules; import attnx.torch; assert 'torch' in sys.modules"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).returncode == 0


class _Copier(torch.nn.Module):
    """One attention layer over token embeddings with positions: learns to
    copy a sequence (each position attends its own)."""

    def __init__(self, attention):
        super().__init__()
        self.embed, self.position = torch.nn.Embedding(10, 16), torch.nn.Embedding(6, 16)
        self.attention, self.out = attention, torch.nn.Linear(16, 10)

    def forward(self, tokens):
        x = self.embed(tokens) + self.position(torch.arange(tokens.shape[1]))
        return self.out(self.attention(x, x, x, need_weights=False)[0])


def test_a_model_trains_as_with_pytorchs_layer():
    """The same model, the same start, with either layer: the losses of an
    Adam loop over the copy task fall alike (float32: the curves differ by
    rounding only)."""
    losses = {}
    for name, layer in (("attnx", attnx.torch.MultiheadAttention), ("torch", torch.nn.MultiheadAttention)):
        torch.manual_seed(0)
        model = _Copier(layer(16, 2, batch_first=True))
        optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
        data = torch.Generator().manual_seed(1)
        curve = []
        for _ in range(60):
            tokens = torch.randint(10, (32, 6), generator=data)
            loss = torch.nn.functional.cross_entropy(model(tokens).reshape(-1, 10), tokens.reshape(-1))
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            curve.append(loss.item())
        losses[name] = curve
    assert losses["attnx"][-1] < 0.3 * losses["attnx"][0]
    assert max(abs(a - b) for a, b in zip(losses["attnx"], losses["torch"])) < 1e-3


def _rotated(x, base=10000.0):
    """RoPE from its formula, in PyTorch: pairs ``(x_2j, x_2j+1)`` at
    position ``p`` turned by ``p * base^(-2j/d)``."""
    n, d = x.shape[-2:]
    angle = torch.arange(n, dtype=x.dtype)[:, None] * base ** (-torch.arange(0, d, 2, dtype=x.dtype) / d)
    even, odd = x[..., 0::2], x[..., 1::2]
    turned = torch.stack([even * angle.cos() - odd * angle.sin(), even * angle.sin() + odd * angle.cos()], dim=-1)
    return turned.flatten(-2)


def _heads_by_hand(layer, query, key, value, attend):
    """The layer's projections with PyTorch's own ops, its heads given to
    ``attend(q, k, v)``, and the output projection: the reference for the
    extras' path."""
    params = layer.params()
    heads = []
    for x, name, count in (
        (query, "q", layer.num_heads),
        (key, "k", layer.num_kv_heads),
        (value, "v", layer.num_kv_heads),
    ):
        heads.append(
            (x @ params[f"w_{name}"] + params[f"b_{name}"]).unflatten(-1, (count, layer.head_dim)).transpose(1, 2)
        )
    out = attend(*heads)
    return out.transpose(1, 2).flatten(-2) @ params["w_o"] + params["b_o"]


@pytest.mark.parametrize("num_kv_heads", [4, 2])
def test_rotary_positions_equal_rope_then_pytorchs_sdpa(num_kv_heads):
    """rotary=True: each head's queries and keys turned by RoPE (written
    here from its formula) before attention; outputs and every parameter's
    gradient against PyTorch's SDPA on the heads so turned, with a padding
    mask and grouped heads."""
    torch.manual_seed(0)
    layer = attnx.torch.MultiheadAttention(
        16, 4, batch_first=True, dtype=torch.float64, num_kv_heads=num_kv_heads, rotary=True
    )
    gen = torch.Generator().manual_seed(3)
    query, key, value = (torch.randn(2, n, 16, generator=gen, dtype=torch.float64) for n in (5, 7, 7))
    padding = torch.zeros(2, 7, dtype=torch.bool)
    padding[1, 5:] = True
    out, _ = layer(query, key, value, key_padding_mask=padding, need_weights=False)

    def attend(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(
            _rotated(q), _rotated(k), v, attn_mask=~padding[:, None, None, :], enable_gqa=num_kv_heads != 4
        )

    expected = _heads_by_hand(layer, query, key, value, attend)
    torch.testing.assert_close(out, expected, rtol=1e-10, atol=1e-12)
    cotangent = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    ours = torch.autograd.grad(out, list(layer.parameters()), cotangent)
    want = torch.autograd.grad(expected, list(layer.parameters()), cotangent)
    for mine, theirs in zip(ours, want):
        torch.testing.assert_close(mine, theirs, rtol=1e-9, atol=1e-11)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # the reference's, eager
def test_a_score_mod_and_block_mask_equal_pytorchs_flex_attention():
    """forward(score_mod=, block_mask=): the heads' attention is flex
    attention; against torch.nn.attention.flex_attention on the same heads,
    ALiBi over a causal block mask, with grouped heads and the weights."""
    from torch.nn.attention import flex_attention as torch_flex

    from attnx import mods

    torch.manual_seed(0)
    layer = attnx.torch.MultiheadAttention(16, 4, batch_first=True, dtype=torch.float64, num_kv_heads=2)
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(2, 6, 16, generator=gen, dtype=torch.float64)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], dtype=torch.float64)
    block_mask = attnx.create_block_mask(mods.causal, None, None, 6, 6, block_size=2, backend="torch")
    out, weights = layer(x, x, x, score_mod=mods.alibi(slopes), block_mask=block_mask, average_attn_weights=False)

    def attend(q, k, v):
        causal = torch_flex.create_block_mask(lambda b, h, i, j: i >= j, None, None, 6, 6, device="cpu")
        return torch_flex.flex_attention(
            q, k, v, score_mod=lambda s, b, h, i, j: s + slopes[h] * (j - i), block_mask=causal, enable_gqa=True
        )

    with torch.no_grad():  # PyTorch's flex has no backward on the CPU
        expected = _heads_by_hand(layer, x, x, x, attend)
    torch.testing.assert_close(out.detach(), expected, rtol=1e-10, atol=1e-12)
    out.sum().backward()  # attnx's flex does: gradients reach the layer's parameters
    assert all(parameter.grad is not None for parameter in layer.parameters())
    assert weights.shape == (2, 4, 6, 6) and torch.all(weights.triu(1) == 0)


@pytest.mark.parametrize(
    ("make", "call", "words"),
    [
        (lambda: attnx.torch.MultiheadAttention(8, 2, add_bias_kv=True, rotary=True), None, "rotary"),
        (lambda: attnx.torch.MultiheadAttention(8, 2, rotary=True, num_kv_heads=1, kdim=6), None, None),
        (
            lambda: attnx.torch.MultiheadAttention(8, 2, batch_first=True),
            {"key_padding_mask": torch.zeros(1, 3, dtype=torch.bool), "score_mod": lambda s, b, h, i, j: s},
            "mask_mod",
        ),
        (
            lambda: attnx.torch.MultiheadAttention(8, 2, add_bias_kv=True),
            {"score_mod": lambda s, b, h, i, j: s},
            "can't be combined with add_bias_kv or add_zero_attn",
        ),
        (
            lambda: attnx.torch.MultiheadAttention(8, 2, add_zero_attn=True),
            {"score_mod": lambda s, b, h, i, j: s},
            "can't be combined with add_bias_kv or add_zero_attn",
        ),
        (lambda: attnx.torch.MultiheadAttention(8, 2), {"is_causal": True}, "is_causal=True is a hint"),
    ],
    ids=[
        "rotary with bias_kv",
        "rotary with kdim (allowed)",
        "masks with a score_mod",
        "a score_mod with bias_kv",
        "a score_mod with a zero key",
        "is_causal without its mask",
    ],
)
def test_the_extras_refuse_what_they_cannot_do_exactly(make, call, words):
    if words is None:
        make()
        return
    with pytest.raises(ValueError, match=words):
        layer = make()
        x = torch.zeros(1, 3, 8)
        layer(x, x, x, **call)


@pytest.mark.parametrize(
    ("size", "options", "message"),
    [
        ((8, 3), {}, "embed_dim must be a positive multiple of num_heads, got 8 and 3"),
        ((0, 4), {}, "embed_dim must be a positive multiple of num_heads, got 0 and 4"),
        ((8, 0), {}, "embed_dim must be a positive multiple of num_heads, got 8 and 0"),
        ((8, 4), {"num_kv_heads": 3}, "num_kv_heads must divide num_heads = 4, got 3"),
        ((8, 4), {"num_kv_heads": 0}, "num_kv_heads must divide num_heads = 4, got 0"),
        ((8, 4), {"dropout": -0.1}, "dropout must lie in [0, 1], got -0.1"),
        ((8, 4), {"dropout": 1.5}, "dropout must lie in [0, 1], got 1.5"),
        ((6, 2), {"rotary": True}, "rotary=True needs an even head_dim, got 3"),
        ((8, 2), {"rotary": True, "add_zero_attn": True}, "rotary=True can't be combined with add_bias_kv or"),
    ],
    ids=[
        "heads not dividing",
        "no embedding",
        "no heads",
        "kv heads not dividing",
        "no kv heads",
        "negative dropout",
        "dropout over 1",
        "odd head_dim with rotary",
        "rotary with a zero key",
    ],
)
def test_the_constructor_refuses_what_it_cannot_build_and_names_it(size, options, message):
    with pytest.raises(ValueError, match="^MultiheadAttention: " + re.escape(message)):
        attnx.torch.MultiheadAttention(*size, **options)


def test_each_training_call_draws_a_mask_of_its_own():
    """The dropout seeds come from PyTorch's generator over [0, 2**31 - 1):
    a hundred training calls give a hundred different masks (a seed drawn
    from fewer than a hundred values would repeat one)."""
    ours, _ = _pair(dropout=0.5)
    ours.train()
    query, key, value = _inputs({})
    torch.manual_seed(0)
    masks = {(ours(query, key, value, average_attn_weights=False)[1] == 0).numpy().tobytes() for _ in range(100)}
    assert len(masks) == 100


def test_the_extras_compile_whole_and_equal_eager():
    """torch.compile(fullgraph=True) of the extras' path: rotary heads over
    a padding mask, and flex attention with ALiBi over a causal block mask."""
    from attnx import mods

    torch.manual_seed(0)
    layer = attnx.torch.MultiheadAttention(16, 4, num_kv_heads=2, batch_first=True, rotary=True)
    x = torch.randn(2, 8, 16)
    padding = torch.zeros(2, 8, dtype=torch.bool)
    padding[1, 6:] = True
    block_mask = attnx.create_block_mask(mods.causal, None, None, 8, 8, block_size=4, backend="torch")
    score_mod = mods.alibi(mods.alibi_slopes(4, backend="torch"))

    def both(x, padding):
        masked, _ = layer(x, x, x, key_padding_mask=padding, need_weights=False)
        flexed, _ = layer(x, x, x, score_mod=score_mod, block_mask=block_mask, need_weights=False)
        return masked, flexed

    for got, expected in zip(torch.compile(both, fullgraph=True)(x, padding), both(x, padding)):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
