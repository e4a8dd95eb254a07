"""flex_attention against PyTorch's FlexAttention, and its gradients against
a dense float64 formula (PyTorch's own flex has no backward on the CPU)."""

from __future__ import annotations

import subprocess
import sys
import warnings

import numpy as np
import pytest
from array_api_compat import array_namespace

import attnx
from attnx import mods

torch = pytest.importorskip("torch")
flex = pytest.importorskip("torch.nn.attention.flex_attention")

B, H, H_KV, N, M, D = 2, 4, 2, 200, 150, 16
#: Two float32 computations of one function, each summing in its own order
#: (attnx's tiles depend on the memory budget and the threads): twice the
#: conformance suite's float32 tolerance against a float64 reference.
FLOAT32 = {"rtol": 4e-5, "atol": 4e-6}


def _torch_flex(*args, **kwargs):
    with warnings.catch_warnings():  # "called without torch.compile()": eager is the reference here
        warnings.simplefilter("ignore", UserWarning)
        return flex.flex_attention(*args, **kwargs)


def _inputs(dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shapes = ((B, H, N, D), (B, H_KV, M, D), (B, H_KV, M, 8))
    return [torch.randn(shape, generator=generator, dtype=dtype) for shape in shapes]


def _cases(backend):
    """The mods of every case, closing over arrays of ``backend``."""
    generator = np.random.default_rng(1)
    ids = np.sort(generator.integers(0, 5, (B, max(N, M))), axis=1)
    table = generator.standard_normal((H, 33)).astype(np.float32)

    def on(array):
        return attnx.asarray(array, backend=backend)

    def every_third_row_empty(b, h, q_idx, kv_idx):
        return q_idx % 3 != 0

    def minus_inf_outside_window(score, b, h, q_idx, kv_idx):
        keep = (kv_idx <= q_idx) & (q_idx - kv_idx <= 8) & (q_idx % 3 != 0)
        return array_namespace(score).where(keep, score, -float("inf"))

    return {
        "causal": (None, mods.causal),
        "sliding window": (None, mods.sliding_window(32)),
        "document": (None, attnx.and_masks(mods.causal, mods.document(on(ids)))),
        "document from lengths": (None, mods.document_from_lengths(on(np.array([40, 70, 20])), max(N, M))),
        "prefix-LM": (None, mods.prefix_lm(on(np.array([10, 90])))),
        "ALiBi, causal": (mods.alibi(mods.alibi_slopes(H, backend=backend)), mods.causal),
        "soft cap": (mods.soft_cap(2.0), None),
        "relative bias, window": (mods.relative_bias(on(table)), mods.sliding_window(64)),
        "empty rows": (None, attnx.and_masks(mods.sliding_window(8), every_third_row_empty)),
        "empty rows, masked by score_mod's -inf": (minus_inf_outside_window, None),
    }


CASES = _cases("torch")
NUMPY_CASES = _cases("numpy")


@pytest.mark.parametrize("case", sorted(CASES))
def test_equals_pytorch_flex_attention(case):
    """On the torch and the NumPy backend, with a block size that divides
    neither n nor m."""
    score_mod, mask_mod = CASES[case]
    query, key, value = _inputs()
    torch_mask = None if mask_mod is None else flex.create_block_mask(mask_mod, B, H, N, M, device="cpu")
    expected = _torch_flex(query, key, value, score_mod=score_mod, block_mask=torch_mask, enable_gqa=True)
    block_mask = (
        None
        if mask_mod is None
        else attnx.create_block_mask(mask_mod, B, H, N, M, block_size=(48, 64), backend="torch")
    )
    got = attnx.flex_attention(query, key, value, score_mod, block_mask, enable_gqa=True)
    torch.testing.assert_close(got, expected, **FLOAT32)
    score_mod, mask_mod = NUMPY_CASES[case]
    block_mask = None if mask_mod is None else attnx.create_block_mask(mask_mod, B, H, N, M, backend="numpy")
    on_numpy = attnx.flex_attention(*(t.numpy() for t in (query, key, value)), score_mod, block_mask, enable_gqa=True)
    np.testing.assert_allclose(on_numpy, expected.numpy(), **FLOAT32)


def _dense_reference(query, key, value, slopes, table):
    """ALiBi and a relative bias in a causal window of 24, from the formula,
    dense and in float64: softmax over the allowed keys, zeros where none."""
    group = H // H_KV
    key, value = key.repeat_interleave(group, dim=1), value.repeat_interleave(group, dim=1)
    scores = query @ key.transpose(-1, -2) / D**0.5
    i, j = torch.arange(N)[:, None], torch.arange(M)[None, :]
    heads = torch.arange(H)[:, None, None]
    scores = scores + slopes[heads] * (j - i) + table[heads, (i - j).clamp(-16, 16) + 16]
    allowed = (j <= i) & (i - j <= 24) & (i % 5 != 0)
    scores = scores.masked_fill(~allowed, -torch.inf)
    weights = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a row with nothing allowed: zeros
    return weights @ value


def test_gradients_equal_the_dense_formula_including_closed_over_tensors():
    query, key, value = (t.requires_grad_() for t in _inputs(torch.float64, seed=2))
    slopes = mods.alibi_slopes(H, backend="torch", dtype="float64").requires_grad_()
    table = torch.randn(H, 33, dtype=torch.float64, generator=torch.Generator().manual_seed(3)).requires_grad_()
    alibi, relative = mods.alibi(slopes), mods.relative_bias(table)

    def score_mod(score, b, h, q_idx, kv_idx):
        return relative(alibi(score, b, h, q_idx, kv_idx), b, h, q_idx, kv_idx)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx <= 24) & (q_idx % 5 != 0)

    block_mask = attnx.create_block_mask(mask_mod, None, None, N, M, block_size=32, backend="torch")
    got = attnx.flex_attention(query, key, value, score_mod, block_mask, enable_gqa=True)
    expected = _dense_reference(query, key, value, slopes, table)
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)
    upstream = torch.randn(got.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    inputs = (query, key, value, slopes, table)
    got_grads = torch.autograd.grad(got, inputs, upstream)
    expected_grads = torch.autograd.grad(expected, inputs, upstream)
    for name, g, e in zip(("query", "key", "value", "slopes", "table"), got_grads, expected_grads):
        torch.testing.assert_close(g, e, rtol=1e-9, atol=1e-11, msg=lambda m, name=name: f"{name}: {m}")


def test_the_cuda_route_through_pytorch_flex_equals_the_generic_algorithm():
    """The torch backend's native (taken on CUDA) remakes attnx's block mask
    as PyTorch's and passes the mods unchanged: proven here on the CPU, eager."""
    from attnx_backends.torch_backend import pytorch_flex

    query, key, value = _inputs()
    score_mod, mask_mod = CASES["ALiBi, causal"]
    block_mask = attnx.create_block_mask(mask_mod, None, None, N, M, block_size=64, backend="torch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        routed = pytorch_flex(
            query, key, value, score_mod, block_mask, scale=torch.tensor(0.3), enable_gqa=True, compiled=False
        )
    generic = attnx.flex_attention(query, key, value, score_mod, block_mask, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(routed, generic, **FLOAT32)


def test_mods_run_in_pytorch_flex_before_attnx_met_a_tensor():
    """A fresh process whose first tensors reach attnx inside PyTorch's
    FlexAttention: the mods' namespace lookup may change nothing there
    (dynamo refuses side effects in a mod), so it leaves the registry alone."""
    script = """
import warnings
import torch
from torch.nn.attention import flex_attention as flex
from attnx import mods

warnings.simplefilter("ignore", UserWarning)
q, k, v = (torch.randn(1, 4, 64, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
for score_mod in (mods.alibi(mods.alibi_slopes(4, backend="torch")), mods.soft_cap(2.0)):
    flex.flex_attention(q, k, v, score_mod=score_mod)
print("ran")
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() == "ran"
