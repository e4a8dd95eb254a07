"""Attention as language models serve it: grouped-query heads
(``enable_gqa``, PyTorch's rule: query head ``h`` reads key/value head
``h // (H / H_kv)``, the float64 reference computing it with repeated keys)
and queries aligned to the end of each sequence's own keys
(``causal_align="key_lengths"``, against a loop over the sequences)."""

from __future__ import annotations

import numpy as np
import pytest

import attnx
from attnx_conformance import reference
from attnx_conformance.helpers import assert_close, rng, rounded

pytestmark = pytest.mark.attnx_operation("scaled_dot_product_attention")

# H_kv differs from B, so that a layout read from the wrong axis is seen
B, H, H_KV = 2, 6, 3
GROUPS = H // H_KV


def _repeated(array):
    """Keys or values ``(..., H_kv, m, d)`` as each query head reads them."""
    return np.repeat(array, GROUPS, axis=-3)


def _inputs(be, n, m, seed=0):
    gen = rng(31, n, m, seed)
    data = [gen.standard_normal(shape) for shape in ((B, H, n, 8), (B, H_KV, m, 8), (B, H_KV, m, 3))]
    return [be.array(a, "float64") for a in data], [rounded(a, be, "float64") for a in data], gen


#: name -> (n, m, call options as NumPy data, reference allowed_mask options);
#: each a way the groups' heads or rows may or may not be told apart.
GROUPED = {
    "decoding, padding per sequence": (1, 9, {"key_lengths": np.array([9, 4])}, {"lengths_per": "batch"}),
    "decoding, causal, a row of keys": (1, 9, {"is_causal": True, "mask": np.arange(9) != 3}, {}),
    "prefill in a chunk, causal, padding": (
        2,
        17,
        {"is_causal": True, "key_lengths": np.array([17, 10])},
        {"lengths_per": "batch"},
    ),
    "causal, as many queries as keys": (5, 5, {"is_causal": True}, {}),
    "a mask per query head": (3, 7, {"mask": "per head"}, {}),
    "lengths per query head": (3, 7, {"key_lengths": np.array([[7, 0, 3, 5, 1, 7], [2, 7, 7, 6, 4, 3]])}, {}),
    "lengths per query": (3, 7, {"key_lengths": "per query"}, {"lengths_per": "query"}),
    "an additive mask of keys": (1, 7, {"mask": np.array([0.0, -np.inf, 0.5, 0.0, -1.0, 0.0, 2.0])}, {}),
    "in tiles, causal, padding": (
        4,
        40,
        {"is_causal": True, "key_lengths": np.array([40, 13]), "chunk_size": (2, 8)},
        {"lengths_per": "batch"},
    ),
}


@pytest.mark.parametrize("case", list(GROUPED))
def test_grouped_heads_read_their_groups_keys(attnx_backend, case):
    be = attnx_backend
    n, m, options, ref_options = GROUPED[case]
    (q, k, v), (qr, kr, vr), gen = _inputs(be, n, m)
    options = dict(options)
    if isinstance(options.get("mask"), str):
        options["mask"] = gen.random((B, H, n, m)) < 0.6
    if isinstance(options.get("key_lengths"), str):
        options["key_lengths"] = gen.integers(0, m + 1, (B, H, n))
    additive = None
    mask = options.get("mask")
    if mask is not None and mask.dtype != bool:
        additive = mask
    allowed = reference.allowed_mask(
        n,
        m,
        batch_shape=(B, H),
        mask=mask if additive is None else None,
        key_lengths=options.get("key_lengths"),
        is_causal=options.get("is_causal", False),
        **ref_options,
    )
    expected, expected_weights = reference.scaled_dot_product_attention(
        qr, _repeated(kr), _repeated(vr), allowed=allowed, additive=additive
    )
    call = {
        name: be.array(value, "float64" if value.dtype.kind == "f" else None)
        if isinstance(value, np.ndarray)
        else value
        for name, value in options.items()
    }
    out = attnx.scaled_dot_product_attention(q, k, v, enable_gqa=True, **call)
    assert tuple(out.shape) == (B, H, n, 3)
    assert_close(out, expected, be, "float64")
    if "chunk_size" not in call:
        out, weights = attnx.scaled_dot_product_attention(q, k, v, enable_gqa=True, return_weights=True, **call)
        assert_close(weights, expected_weights, be, "float64")
        assert_close(out, expected, be, "float64")


def test_grouped_heads_draw_their_query_heads_dropout(attnx_backend):
    """A grouped head's dropout mask is its query head's: the slice
    ``b * H + h``, as if its keys had been repeated."""
    be = attnx_backend
    (q, k, v), (qr, kr, vr), _ = _inputs(be, 1, 9)
    lengths = np.array([9, 5])
    out = attnx.scaled_dot_product_attention(
        q, k, v, enable_gqa=True, key_lengths=be.array(lengths), dropout_p=0.4, dropout_seed=7
    )
    allowed = reference.allowed_mask(1, 9, batch_shape=(B, H), key_lengths=lengths, lengths_per="batch")
    dropout = reference.dropout_multiplier(7, (B, H), 1, 9, 0.4)
    expected = reference.scaled_dot_product_attention(
        qr, _repeated(kr), _repeated(vr), allowed=allowed, dropout=dropout
    )[0]
    assert_close(out, expected, be, "float64")


@pytest.mark.parametrize("chunk_size", [None, (2, 4)], ids=["whole", "in tiles"])
@pytest.mark.parametrize("enable_gqa", [False, True], ids=["heads", "grouped heads"])
def test_queries_aligned_to_their_own_keys_equal_a_loop_over_sequences(attnx_backend, enable_gqa, chunk_size):
    """Three caches of 11, 6 and 2 keys padded to 11, each with its 3 newest
    tokens as queries: one call equals attending each sequence's own keys,
    causal, alone (the last of them with 2 keys: its first query has none)."""
    be = attnx_backend
    n, m = 3, 11
    (q, k, v), (qr, kr, vr), _ = _inputs(be, n, m, seed=1)
    if not enable_gqa:
        k, v = be.array(_repeated(kr), "float64"), be.array(_repeated(vr), "float64")
    lengths = np.array([11, 6])
    out = attnx.scaled_dot_product_attention(
        q,
        k,
        v,
        key_lengths=be.array(lengths),
        is_causal=True,
        causal_align="key_lengths",
        enable_gqa=enable_gqa,
        chunk_size=chunk_size,
    )
    for entry, length in enumerate(lengths):
        alone = attnx.scaled_dot_product_attention(
            q[entry : entry + 1, ...],
            k[entry : entry + 1, :, :length, :],
            v[entry : entry + 1, :, :length, :],
            is_causal=True,
            enable_gqa=enable_gqa,
        )
        assert_close(out[entry : entry + 1, ...], be.numpy(alone), be, "float64")
    allowed = reference.allowed_mask(
        n, m, batch_shape=(B, H), key_lengths=lengths, lengths_per="batch", is_causal=True, causal_align="key_lengths"
    )
    expected = reference.scaled_dot_product_attention(qr, _repeated(kr), _repeated(vr), allowed=allowed)[0]
    assert_close(out, expected, be, "float64")


def test_traced_decoding_equals_eager(attnx_backend):
    """The decoding call under the backend's tracer (``jax.jit``,
    ``torch.compile(fullgraph=True)``), lengths and all traced."""
    be = attnx_backend
    trace = be.backend.trace

    def attend(query, key, value, key_lengths):
        return attnx.scaled_dot_product_attention(
            query, key, value, key_lengths=key_lengths, is_causal=True, causal_align="key_lengths", enable_gqa=True
        )

    traced = trace(attend)
    if traced is None:
        pytest.skip(f"{be.name} declares no tracer")
    (q, k, v), (qr, kr, vr), _ = _inputs(be, 3, 17, seed=3)
    lengths = np.array([17, 5])
    eager = attend(q, k, v, be.array(lengths))
    assert_close(traced(q, k, v, be.array(lengths)), be.numpy(eager), be, "float64")
    allowed = reference.allowed_mask(
        3, 17, batch_shape=(B, H), key_lengths=lengths, lengths_per="batch", is_causal=True, causal_align="key_lengths"
    )
    expected = reference.scaled_dot_product_attention(qr, _repeated(kr), _repeated(vr), allowed=allowed)[0]
    assert_close(eager, expected, be, "float64")


def test_a_sequence_shorter_than_its_queries_gives_zeros_where_none_is_left(attnx_backend):
    be = attnx_backend
    (q, k, v), _, _ = _inputs(be, 4, 6)
    out = attnx.scaled_dot_product_attention(
        q, k, v, key_lengths=be.array(np.array([6, 2])), is_causal=True, causal_align="key_lengths", enable_gqa=True
    )
    rows = be.numpy(out)[1]
    assert np.all(rows[:, :2] == 0) and np.all(np.abs(rows[:, 2:]).sum(axis=-1) > 0)


def test_grouped_gradients_sum_over_each_group(attnx_backend):
    """``attnx.vjp``'s key and value cotangents of grouped heads: the sum
    over the group of each query head's (the chain rule on repeated keys)."""
    be = attnx_backend
    (q, k, v), (qr, kr, vr), gen = _inputs(be, 2, 17, seed=2)
    lengths = np.array([17, 9])
    cotangent = gen.standard_normal((B, H, 2, 3))
    for options in ({"is_causal": True}, {"is_causal": True, "causal_align": "key_lengths"}):
        out, backward = attnx.vjp(
            attnx.scaled_dot_product_attention, q, k, v, key_lengths=be.array(lengths), enable_gqa=True, **options
        )
        grads = backward(be.array(cotangent, "float64"))
        allowed = reference.allowed_mask(2, 17, batch_shape=(B, H), key_lengths=lengths, lengths_per="batch", **options)
        expected = reference.scaled_dot_product_attention_vjp(
            qr, _repeated(kr), _repeated(vr), cotangent, allowed=allowed
        )
        assert_close(grads["query"], expected["query"], be, "float64")
        for name in ("key", "value"):
            summed = expected[name].reshape(B, H_KV, GROUPS, *expected[name].shape[-2:]).sum(axis=2)
            assert tuple(grads[name].shape) == summed.shape
            assert_close(grads[name], summed, be, "float64")


@pytest.mark.parametrize(
    "shapes, options, message",
    [
        (((2, 6, 3, 8), (2, 4, 5, 8), (2, 4, 5, 3)), {"enable_gqa": True}, "got H = 6 and H_kv = 4"),
        (
            ((2, 6, 3, 8), (2, 2, 5, 8), (2, 3, 5, 3)),
            {"enable_gqa": True},
            "value must have shape (..., H_kv, m, d_v) with H_kv = 2",
        ),
        (((3, 8), (5, 8), (5, 3)), {"enable_gqa": True}, "query must have shape (..., H, n, d_k)"),
        (
            ((2, 6, 3, 8), (2, 2, 5, 8), (2, 2, 5, 3)),
            {"is_causal": True, "causal_align": "key_lengths"},
            "give key_lengths",
        ),
        (((2, 6, 3, 8), (2, 6, 5, 8), (2, 6, 5, 3)), {"causal_align": "top"}, "causal_align must be one of"),
    ],
)
def test_grouped_and_aligned_calls_name_what_is_wrong(attnx_backend, shapes, options, message):
    be = attnx_backend
    arrays = [be.array(np.zeros(shape), "float64") for shape in shapes]
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        attnx.scaled_dot_product_attention(*arrays, **options)
