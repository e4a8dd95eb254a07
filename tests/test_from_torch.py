"""MultiHeadAttention.from_torch copies every nn.MultiheadAttention configuration exactly, or refuses."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import attnx

torch = pytest.importorskip("torch")

CONFIGURATIONS = [
    dict(bias=bias, add_bias_kv=bias_kv, add_zero_attn=zero_attn, kdim=kdim, vdim=vdim, batch_first=batch_first)
    for bias, bias_kv, zero_attn, (kdim, vdim), batch_first in itertools.product(
        [True, False], [True, False], [True, False], [(None, None), (5, 3)], [True, False]
    )
]


def _label(config):
    return "-".join(f"{k}={v}" for k, v in config.items())


def _module(config):
    torch.manual_seed(0)
    module = torch.nn.MultiheadAttention(12, 3, dtype=torch.float64, **config).eval()
    with torch.no_grad():  # non-zero biases, so a dropped bias shows
        for name, parameter in module.named_parameters():
            if "bias" in name:
                parameter.normal_()
    return module


def _inputs(config, n=4, m=6, batch=2):
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(batch, n, 12, generator=gen, dtype=torch.float64)
    k = torch.randn(batch, m, config["kdim"] or 12, generator=gen, dtype=torch.float64)
    v = torch.randn(batch, m, config["vdim"] or 12, generator=gen, dtype=torch.float64)
    if not config["batch_first"]:
        q, k, v = (x.transpose(0, 1) for x in (q, k, v))
    return q, k, v


@pytest.mark.parametrize("config", CONFIGURATIONS, ids=_label)
def test_forward_weights_and_gradients_equal_the_torch_module(config):
    module = _module(config)
    copied = attnx.MultiHeadAttention.from_torch(module)
    q, k, v = _inputs(config)
    ignore = torch.rand(4, 6, generator=torch.Generator().manual_seed(2)) < 0.3  # torch: True = ignore
    padding = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])  # the second sequence has 4 keys

    expected, expected_weights = module(q, k, v, attn_mask=ignore, key_padding_mask=padding)
    ours, weights = copied(q, k, v, mask=~ignore, key_lengths=torch.tensor([6, 4]), return_weights=True)
    torch.testing.assert_close(ours, expected, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(weights, expected_weights, rtol=1e-12, atol=1e-12)
    assert weights.shape[-1] == 6 + config["add_bias_kv"] + config["add_zero_attn"]

    cotangent = torch.randn(expected.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    grads = {}
    for label, output in (("torch", lambda: module(q, k, v)[0]), ("attnx", lambda: copied(q, k, v))):
        module.zero_grad()
        (output() * cotangent).sum().backward()
        grads[label] = {name: p.grad.clone() for name, p in module.named_parameters()}
    assert set(grads["attnx"]) == set(grads["torch"])
    for name in grads["torch"]:
        torch.testing.assert_close(grads["attnx"][name], grads["torch"][name], rtol=1e-10, atol=1e-12, msg=name)


def test_unbatched_inputs_in_either_layout():
    for batch_first in (True, False):
        module = _module(
            dict(bias=True, add_bias_kv=True, add_zero_attn=False, kdim=None, vdim=None, batch_first=batch_first)
        )
        x = torch.randn(5, 12, dtype=torch.float64)
        expected, _ = module(x, x, x)
        torch.testing.assert_close(attnx.MultiHeadAttention.from_torch(module)(x), expected, rtol=1e-12, atol=1e-12)


def test_a_module_in_training_mode_drops_weights_as_pytorchs_does():
    """In training mode the copy drops weights with the module's
    probability, by attnx's mask rather than PyTorch's generator: over many
    calls both average to the module's output in eval mode (inverted
    dropout keeps the expectation) and spread alike about it; in eval mode
    the copy is exact again."""
    torch.manual_seed(0)
    module = torch.nn.MultiheadAttention(8, 2, dropout=0.2, batch_first=True, dtype=torch.float64)
    copy = attnx.MultiHeadAttention.from_torch(module)
    assert copy.training and copy.dropout == 0.2
    x = torch.randn(2, 6, 8, dtype=torch.float64)
    calls = 600
    with torch.no_grad():
        ours = torch.stack([copy(x) for _ in range(calls)])
        theirs = torch.stack([module(x, x, x, need_weights=False)[0] for _ in range(calls)])
        expected = module.eval()(x, x, x, need_weights=False)[0]
    for outputs in (ours, theirs):
        error = (outputs.mean(0) - expected).abs().max() / expected.abs().max()
        assert error < 0.05, f"the mean of {calls} calls is off the eval output by {error:.3f} of its largest"
    spread = ours.std(0).mean() / theirs.std(0).mean()
    assert 0.85 < spread < 1.15, f"attnx's outputs spread {spread:.2f} times PyTorch's"
    copy.train(module.training)  # eval now, as the module
    torch.testing.assert_close(copy(x), expected, rtol=1e-12, atol=1e-12)


def test_the_copy_runs_on_numpy_too():
    config = dict(bias=True, add_bias_kv=True, add_zero_attn=True, kdim=5, vdim=3, batch_first=True)
    module = _module(config)
    q, k, v = _inputs(config)
    expected, _ = module(q, k, v)
    copied = attnx.MultiHeadAttention.from_torch(module)
    on_numpy = {name: p.detach().numpy() for name, p in copied.params.items()}
    ours = attnx.multi_head_attention(q.numpy(), k.numpy(), v.numpy(), on_numpy, num_heads=3, add_zero_attn=True)
    np.testing.assert_allclose(ours, expected.detach().numpy(), rtol=1e-12, atol=1e-12)
