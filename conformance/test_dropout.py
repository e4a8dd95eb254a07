"""Dropout on the attention weights on every backend: exactly the mask the
contract defines (a hash of the seed and each weight's position, written
here in NumPy's unsigned 32-bit arithmetic), in the forward and in the
backward, in tiles of any size."""

from __future__ import annotations

import numpy as np
import pytest

import attnx
from attnx import mods
from attnx_conformance import reference
from attnx_conformance.helpers import assert_close, rng, rounded

pytestmark = pytest.mark.attnx_operation("dropout")

B, H, N, M, D = 2, 3, 7, 9, 4
P, SEED = 0.3, 2**33 + 2**31 + 12345  # a seed wider than 32 bits: its low 32 count, the top one set

CASES = {
    # name: (keyword arguments, key lengths, is_causal)
    "one block": ({}, None, False),
    "in tiles, causal, padding with an empty row": ({"chunk_size": (4, 5)}, [9, 0], True),
}


def _inputs(be, dtype, n=N, m=M, kv_heads=H):
    gen = rng(61, n, m, kv_heads)
    shapes = ((B, H, n, D), (B, kv_heads, m, D), (B, kv_heads, m, 5), (B, H, n, 5))
    exact = [rounded(gen.standard_normal(shape), be, dtype) for shape in shapes]
    return [be.array(a, dtype) for a in exact], exact


@pytest.mark.parametrize("case", sorted(CASES))
def test_sdpa_drops_the_weights_the_contract_names(attnx_backend, case):
    be = attnx_backend
    dtype = be.dtype("float64")
    kwargs, lengths, is_causal = CASES[case]
    (query, key, value, _), (q, k, v, _) = _inputs(be, dtype)
    key_lengths = None if lengths is None else np.array(lengths)
    output = attnx.scaled_dot_product_attention(
        query,
        key,
        value,
        is_causal=is_causal,
        key_lengths=None if key_lengths is None else be.array(key_lengths),
        dropout_p=P,
        dropout_seed=SEED,
        **kwargs,
    )
    allowed = reference.allowed_mask(
        N, M, batch_shape=(B, H), key_lengths=key_lengths, lengths_per="batch", is_causal=is_causal
    )
    dropout = reference.dropout_multiplier(SEED, (B, H), N, M, P)
    expected, _ = reference.scaled_dot_product_attention(q, k, v, allowed=allowed, dropout=dropout)
    assert_close(output, expected, be, dtype, like=query)


def test_the_weights_returned_are_those_after_dropout(attnx_backend):
    be = attnx_backend
    dtype = be.dtype("float64")
    (query, key, value, _), (q, k, v, _) = _inputs(be, dtype)
    output, weights = attnx.scaled_dot_product_attention(
        query, key, value, return_weights=True, dropout_p=P, dropout_seed=be.array(np.asarray(SEED % 2**31))
    )
    dropout = reference.dropout_multiplier(SEED % 2**31, (B, H), N, M, P)
    expected, expected_weights = reference.scaled_dot_product_attention(q, k, v, dropout=dropout)
    assert_close(output, expected, be, dtype, like=query)
    assert_close(weights, expected_weights, be, dtype, like=query)
    kept = be.numpy(weights) > 0
    assert 0.5 < kept.mean() < 0.9, "about 1 - p of the weights are kept"


def test_flex_and_grouped_heads_draw_the_same_mask(attnx_backend):
    """The mask is a function of (batch, head, query, key): flex attention
    with grouped heads and a block mask drops the weights SDPA drops on the
    same (B, H, n, m) weights."""
    be = attnx_backend
    dtype = be.dtype("float64")
    (query, key, value, _), (q, k, v, _) = _inputs(be, dtype, kv_heads=1)
    block_mask = attnx.create_block_mask(mods.causal, None, None, N, M, block_size=(2, 3), device=be.device)
    output = attnx.flex_attention(query, key, value, None, block_mask, enable_gqa=True, dropout_p=P, dropout_seed=SEED)
    allowed = np.arange(M)[None, :] <= np.arange(N)[:, None]  # flex's causal rule: top left
    dropout = reference.dropout_multiplier(SEED, (B, H), N, M, P)
    expected, _ = reference.scaled_dot_product_attention(q, k, v, allowed=allowed, dropout=dropout)
    assert_close(output, expected, be, dtype, like=query)


@pytest.mark.parametrize("chunk_size", [None, (3, 4)], ids=["one block", "in tiles"])
def test_the_backward_makes_the_same_mask_again(attnx_backend, chunk_size):
    be = attnx_backend
    dtype = be.dtype("float64")
    (query, key, value, cotangent), (q, k, v, d_out) = _inputs(be, dtype)
    output, backward = attnx.vjp(
        attnx.scaled_dot_product_attention,
        query,
        key,
        value,
        is_causal=True,
        chunk_size=chunk_size,
        dropout_p=P,
        dropout_seed=SEED,
    )
    grads = backward(cotangent)
    allowed = reference.allowed_mask(N, M, batch_shape=(B, H), is_causal=True)
    dropout = reference.dropout_multiplier(SEED, (B, H), N, M, P)
    expected = reference.scaled_dot_product_attention_vjp(q, k, v, d_out, allowed=allowed, dropout=dropout)
    for name, array in (("query", query), ("key", key), ("value", value)):
        assert_close(grads[name], expected[name], be, dtype, like=array, scale=4.0)


def test_multi_head_attention_drops_each_heads_weights(attnx_backend):
    """Grouped heads (``num_kv_heads``) count their weights by query head:
    the weights multi-head attention returns are its heads' softmax times
    the contract's mask over (batch, head)."""
    be = attnx_backend
    dtype = be.dtype("float64")
    params = attnx.init_multi_head_params(8, 4, num_kv_heads=2, seed=0, dtype=dtype, backend=be.name, device=be.device)
    x = be.array(rounded(rng(62).standard_normal((B, N, 8)), be, dtype), dtype)
    arguments = {"num_heads": 4, "num_kv_heads": 2, "return_weights": True, "average_weights": False}
    _, weights = attnx.multi_head_attention(x, x, x, params, **arguments)
    _, dropped = attnx.multi_head_attention(x, x, x, params, **arguments, dropout_p=P, dropout_seed=SEED)
    expected = be.numpy(weights).astype(np.float64) * reference.dropout_multiplier(SEED, (B, 4), N, N, P)
    assert_close(dropped, expected, be, dtype, like=x)


def test_everything_dropped_gives_zeros(attnx_backend):
    be = attnx_backend
    (query, key, value, _), _ = _inputs(be, be.dtype("float64"))
    output = attnx.scaled_dot_product_attention(query, key, value, dropout_p=1.0, dropout_seed=0)
    assert not np.any(be.numpy(output)), "with dropout_p=1 every weight is dropped"


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"dropout_p": 0.5}, ValueError, "needs dropout_seed"),
        ({"dropout_p": 1.5, "dropout_seed": 0}, ValueError, r"dropout_p must be in \[0, 1\]"),
        ({"dropout_p": "0.1", "dropout_seed": 0}, TypeError, "dropout_p must be a float"),
        ({"dropout_p": 0.1, "dropout_seed": 1.5}, TypeError, "dropout_seed must be an int or a 0-d integer array"),
    ],
    ids=["no seed", "p above 1", "p a string", "a float seed"],
)
def test_bad_dropout_arguments_are_named(attnx_backend, kwargs, error, message):
    be = attnx_backend
    (query, key, value, _), _ = _inputs(be, be.dtype("float64"))
    for operation in (attnx.scaled_dot_product_attention, attnx.flex_attention):
        with pytest.raises(error, match=message):
            operation(query, key, value, **kwargs)


def test_a_traced_seed_draws_the_eager_mask(attnx_backend):
    """Under the library's tracer (``jax.jit``, ``torch.compile``) the seed
    may be a traced 0-d array: the mask is the one an int seed draws."""
    be = attnx_backend
    traced = be.backend.trace(
        lambda q, k, v, seed: attnx.scaled_dot_product_attention(
            q, k, v, is_causal=True, chunk_size=(3, 4), dropout_p=P, dropout_seed=seed
        )
    )
    if traced is None:
        pytest.skip(f"{be.name} has no tracer")
    dtype = be.dtype("float64")
    (query, key, value, _), _ = _inputs(be, dtype)
    seed = 2**31 + 5  # as a 0-d array it wraps to its low 32 bits, as an int does
    eager = attnx.scaled_dot_product_attention(
        query, key, value, is_causal=True, chunk_size=(3, 4), dropout_p=P, dropout_seed=seed
    )
    seed_array = be.array(np.asarray(seed - 2**32, dtype=np.int32))
    assert_close(traced(query, key, value, seed_array), be.numpy(eager).astype(np.float64), be, dtype, like=query)
