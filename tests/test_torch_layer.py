"""attnx.torch.MultiheadAttention against torch.nn.MultiheadAttention itself:
the same parameters and state_dict keys, the same outputs, weights and
gradients (float64) for every mask PyTorch's layer takes, under
torch.compile, and a model that trains as PyTorch's does."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
import attnx.torch  # noqa: E402

#: Layouts of the layer: (constructor keywords, what it exercises).
LAYOUTS = {
    "packed projections": {},
    "kdim and vdim": {"kdim": 6, "vdim": 5},
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
