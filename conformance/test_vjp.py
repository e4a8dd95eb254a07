"""``attnx.vjp`` on every backend: the backward of attention, walked over
the forward's tiles in the array API, against the float64 chain rule."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest

import attnx
from attnx_conformance import reference
from attnx_conformance.helpers import assert_close, rng, rounded, tolerances

pytestmark = pytest.mark.attnx_operation("vjp")

CASES = [
    # (name, n, m, key/value heads, is_causal, key lengths, chunk_size): few
    # cases, each many features, since each tile shape compiles on JAX
    ("n != m, one tile", 5, 7, 3, False, None, None),
    ("causal, more queries than keys (empty rows)", 9, 4, 3, True, None, None),
    ("causal, grouped heads and padding with an empty row, in tiles", 7, 9, 1, True, [9, 0], (3, 4)),
]


@pytest.mark.parametrize(
    ("name", "n", "m", "kv_heads", "is_causal", "lengths", "chunk_size"), CASES, ids=[c[0] for c in CASES]
)
def test_attention_gradients_equal_the_chain_rule(attnx_backend, name, n, m, kv_heads, is_causal, lengths, chunk_size):
    be = attnx_backend
    dtype = be.dtype("float64")
    gen = rng(58, n, m)
    data = {
        "query": gen.standard_normal((2, 3, n, 4)),
        "key": gen.standard_normal((2, kv_heads, m, 4)),
        "value": gen.standard_normal((2, kv_heads, m, 5)),
        "cotangent": gen.standard_normal((2, 3, n, 5)),
    }
    data = {k: rounded(v, be, dtype) for k, v in data.items()}
    scale = 0.6
    key_lengths = None if lengths is None else np.array(lengths)
    arrays = {k: be.array(v, dtype) for k, v in data.items()}
    output, backward = attnx.vjp(
        attnx.scaled_dot_product_attention,
        arrays["query"],
        arrays["key"],
        arrays["value"],
        is_causal=is_causal,
        key_lengths=None if key_lengths is None else be.array(key_lengths),
        scale=be.array(np.asarray(scale), dtype),
        chunk_size=chunk_size,
    )
    grads = backward(arrays["cotangent"])
    allowed = reference.allowed_mask(
        n, m, batch_shape=(2, 3), key_lengths=key_lengths, lengths_per="batch", is_causal=is_causal
    )
    expected = reference.scaled_dot_product_attention_vjp(
        data["query"], data["key"], data["value"], data["cotangent"], allowed=allowed, scale=scale
    )
    assert sorted(grads) == ["key", "query", "scale", "value"]
    for argument in ("query", "key", "value"):
        assert_close(grads[argument], expected[argument], be, dtype, like=arrays[argument], scale=4.0)
    assert_close(grads["scale"], expected["scale"], be, dtype, scale=16.0)


@pytest.mark.parametrize(
    ("mask_shape", "chunk_size"),
    [((5, 7), (2, 3)), ((2, 1, 1, 7), None)],
    ids=["(n, m) in tiles, -inf entries", "padding-like (B, 1, 1, m)"],
)
def test_a_real_mask_gets_the_scores_gradient(attnx_backend, mask_shape, chunk_size):
    """An additive mask's gradient is the scores', summed where it
    broadcasts; its ``-inf`` entries get none."""
    be = attnx_backend
    dtype = be.dtype("float64")
    gen = rng(67, len(mask_shape))
    data = {
        "query": gen.standard_normal((2, 3, 5, 4)),
        "key": gen.standard_normal((2, 3, 7, 4)),
        "value": gen.standard_normal((2, 3, 7, 2)),
        "mask": np.where(gen.random(mask_shape) < 0.8, gen.standard_normal(mask_shape), -np.inf),
        "cotangent": gen.standard_normal((2, 3, 5, 2)),
    }
    data["mask"][..., 0] = 0.0  # every row attends a key
    data = {k: rounded(v, be, dtype) for k, v in data.items()}
    arrays = {k: be.array(v, dtype) for k, v in data.items()}
    output, backward = attnx.vjp(
        attnx.scaled_dot_product_attention,
        arrays["query"],
        arrays["key"],
        arrays["value"],
        mask=arrays["mask"],
        chunk_size=chunk_size,
    )
    grads = backward(arrays["cotangent"])
    finite = np.isfinite(data["mask"])
    expected = reference.scaled_dot_product_attention_vjp(
        data["query"],
        data["key"],
        data["value"],
        data["cotangent"],
        allowed=finite,
        additive=np.where(finite, data["mask"], 0.0),
    )
    assert sorted(grads) == ["key", "mask", "query", "value"]
    for argument in ("query", "key", "value"):
        assert_close(grads[argument], expected[argument], be, dtype, like=arrays[argument], scale=4.0)
    assert_close(grads["mask"], expected["additive"], be, dtype, like=arrays["mask"], scale=4.0)


def test_softmax_gradients_equal_the_chain_rule(attnx_backend):
    be = attnx_backend
    dtype = be.dtype("float64")
    gen = rng(59)
    scores, cotangent = (rounded(gen.standard_normal((2, 4, 6)), be, dtype) for _ in range(2))
    lengths = np.array([6, 0])
    weights, backward = attnx.vjp(attnx.masked_softmax, be.array(scores, dtype), key_lengths=be.array(lengths))
    grads = backward(be.array(cotangent, dtype))
    expected_weights = reference.softmax(scores, np.arange(6) < lengths[:, None, None])
    expected = expected_weights * (cotangent - np.sum(cotangent * expected_weights, axis=-1, keepdims=True))
    assert_close(grads["scores"], expected, be, dtype)


NW_CASES = [
    # (name, query shape, key shape, value shape, kernel, memory budget): vector
    # positions in chunks of queries, scalar ones with the compact kernels
    ("gaussian, vectors, chunks of queries", (9, 3), (11, 3), (11, 2), "gaussian", 256),
    ("epanechnikov, scalars", (7,), (12,), (12,), "epanechnikov", None),
    ("boxcar, scalars: the values alone move", (7,), (12,), (12, 2), "boxcar", None),
]


@pytest.mark.parametrize(
    ("name", "query_shape", "key_shape", "value_shape", "kernel", "budget"), NW_CASES, ids=[c[0] for c in NW_CASES]
)
def test_nadaraya_watson_gradients_equal_the_chain_rule(
    attnx_backend, name, query_shape, key_shape, value_shape, kernel, budget
):
    be = attnx_backend
    dtype = be.dtype("float64")
    gen = rng(60, len(query_shape))
    data = {
        "queries": gen.standard_normal(query_shape),
        "keys": gen.standard_normal(key_shape),
        "values": gen.standard_normal(value_shape),
    }
    data = {k: rounded(v, be, dtype) for k, v in data.items()}
    arrays = {k: be.array(v, dtype) for k, v in data.items()}
    bandwidth = 1.5
    with attnx.memory_budget(budget) if budget else contextlib.nullcontext():
        estimate, backward = attnx.vjp(
            attnx.nadaraya_watson, **arrays, kernel=kernel, bandwidth=be.array(np.asarray(bandwidth), dtype)
        )
        cotangent = rounded(gen.standard_normal(tuple(estimate.shape)), be, dtype)
        grads = backward(be.array(cotangent, dtype))
    expected = reference.nadaraya_watson_vjp(**data, cotangent=cotangent, kernel=kernel, bandwidth=bandwidth)
    assert sorted(grads) == ["bandwidth", "keys", "queries", "values"]
    for argument in ("queries", "keys", "values"):
        assert_close(grads[argument], expected[argument], be, dtype, like=arrays[argument], scale=4.0)
    assert_close(grads["bandwidth"], np.asarray(expected["bandwidth"]), be, dtype, scale=16.0)


CONV_CASES = [
    # (name, x shape, kernel size, stride, dilation, bias)
    ("taps past the input, a bias", (2, 3, 4, 6), 3, 1, 3, True),
    ("stride and dilation", (3, 2, 11), 3, 2, 2, False),
]


@pytest.mark.parametrize(
    ("name", "x_shape", "kernel_size", "stride", "dilation", "bias"), CONV_CASES, ids=[c[0] for c in CONV_CASES]
)
def test_causal_conv1d_gradients_equal_the_chain_rule(
    attnx_backend, name, x_shape, kernel_size, stride, dilation, bias
):
    be = attnx_backend
    dtype = be.dtype("float64")
    gen = rng(61, kernel_size)
    data = {"x": gen.standard_normal(x_shape), "weight": gen.standard_normal((5, x_shape[-2], kernel_size))}
    if bias:
        data["bias"] = gen.standard_normal(5)
    data = {k: rounded(v, be, dtype) for k, v in data.items()}
    arrays = {k: be.array(v, dtype) for k, v in data.items()}
    output, backward = attnx.vjp(attnx.causal_conv1d, **arrays, stride=stride, dilation=dilation)
    cotangent = rounded(gen.standard_normal(tuple(output.shape)), be, dtype)
    grads = backward(be.array(cotangent, dtype))
    expected = reference.causal_conv1d_vjp(**data, cotangent=cotangent, stride=stride, dilation=dilation)
    assert sorted(grads) == sorted(expected)
    for argument in expected:
        assert_close(grads[argument], expected[argument], be, dtype, like=arrays[argument], scale=4.0)


@pytest.mark.parametrize("interleaved", [True, False], ids=["pairs side by side", "halves"])
def test_apply_rotary_gradients_equal_the_chain_rule(attnx_backend, interleaved):
    """Real positions, one row per batch entry broadcast over the heads, get theirs too."""
    be = attnx_backend
    dtype = be.dtype("float64")
    gen = rng(62, interleaved)
    x, cotangent = (rounded(gen.standard_normal((2, 3, 5, 6)), be, dtype) for _ in range(2))
    positions = rounded(gen.standard_normal((2, 1, 5)) * 4, be, dtype)
    rotated, backward = attnx.vjp(
        attnx.apply_rotary, be.array(x, dtype), be.array(positions, dtype), interleaved=interleaved
    )
    grads = backward(be.array(cotangent, dtype))
    expected = reference.apply_rotary_vjp(x, cotangent, positions, interleaved=interleaved)
    assert sorted(grads) == ["positions", "x"]
    assert_close(grads["x"], expected["x"], be, dtype, scale=4.0)
    assert_close(grads["positions"], expected["positions"], be, dtype, scale=16.0)


@pytest.mark.parametrize("positions", [4, np.array([[1, 3], [3, 0]])], ids=["the first rows", "rows read twice"])
def test_learned_positions_gradients_sum_into_the_rows_read(attnx_backend, positions):
    be = attnx_backend
    dtype = be.dtype("float64")
    embedding = attnx.LearnedPositions(6, 3, dtype=dtype, backend=be.name, device=be.device)
    looked_up = positions if isinstance(positions, int) else be.array(positions)
    rows, backward = attnx.vjp(embedding, looked_up)
    cotangent = rounded(rng(63).standard_normal(tuple(rows.shape)), be, dtype)
    grads = backward(be.array(cotangent, dtype))
    assert sorted(grads) == ["table"]
    expected = reference.learned_positions_vjp(6, positions, cotangent)
    assert_close(grads["table"], expected, be, dtype, like=embedding.table)


@pytest.mark.parametrize(
    ("name", "num_kv_heads", "extras"),
    [
        ("grouped heads, causal, padding with an empty row", 1, False),
        ("bias_k, bias_v and a zero key, per-head mask", 2, True),
        ("a real mask per head with -inf, padding", 2, "real"),
    ],
)
def test_multi_head_gradients_equal_finite_differences_of_the_reference(attnx_backend, name, num_kv_heads, extras):
    """Each argument's gradient, projected on a random direction, against the
    float64 reference's central difference along it (the reference is
    linear in no argument, so a wrong gradient shows); a real mask's too."""
    be = attnx_backend
    dtype = be.dtype("float64")
    gen = rng(64, num_kv_heads)
    d_model, h, n, m = 8, 4, 5, 6
    d_k = d_model // h
    data = {
        "query": gen.standard_normal((2, n, d_model)),
        "key": gen.standard_normal((2, m, d_model)),
        "value": gen.standard_normal((2, m, d_model)),
    }
    params = {
        "w_q": gen.standard_normal((d_model, h * d_k)) / 2,
        "w_k": gen.standard_normal((d_model, num_kv_heads * d_k)) / 2,
        "w_v": gen.standard_normal((d_model, num_kv_heads * d_k)) / 2,
        "w_o": gen.standard_normal((h * d_k, d_model)) / 2,
        "b_q": gen.standard_normal(h * d_k),
        "b_o": gen.standard_normal(d_model),
    }
    if extras is True:
        params.update(bias_k=gen.standard_normal(num_kv_heads * d_k), bias_v=gen.standard_normal(num_kv_heads * d_k))
    if extras == "real":  # per head, a key forbidden by -inf, and padding
        data["mask"] = gen.standard_normal((2, h, n, m))
        data["mask"][..., 1] = -np.inf
    data = {k: rounded(v, be, dtype) for k, v in data.items()}
    params = {k: rounded(v, be, dtype) for k, v in params.items()}
    if extras == "real":
        lengths = np.array([m, 4])
        allowed = reference.allowed_mask(n, m, batch_shape=(2,), key_lengths=lengths)
        options = {"key_lengths": be.array(lengths), "mask": be.array(data["mask"], dtype)}
    elif extras:  # per head: each head its own pattern
        allowed = gen.random((2, h, n, m)) < 0.7
        options = {"mask": be.array(allowed), "add_zero_attn": True}
    else:
        lengths = np.array([m, 0])
        allowed = reference.allowed_mask(n, m, batch_shape=(2,), key_lengths=lengths, is_causal=True)
        options = {"key_lengths": be.array(lengths), "is_causal": True}
    output, backward = attnx.vjp(
        attnx.multi_head_attention,
        *(be.array(data[k], dtype) for k in ("query", "key", "value")),
        {k: be.array(v, dtype) for k, v in params.items()},
        num_heads=h,
        num_kv_heads=num_kv_heads,
        **options,
    )
    cotangent = rounded(gen.standard_normal((2, n, d_model)), be, dtype)
    grads = backward(be.array(cotangent, dtype))
    if extras == "real":  # the forbidden key: its mask entries get no gradient (a difference there is NaN)
        assert np.all(be.numpy(grads["mask"])[..., 1] == 0)
        grads["mask"] = be.xp.take(grads["mask"], be.array(np.array([0, 2, 3, 4, 5])), axis=-1)
        data["mask"] = data["mask"][..., [0, 2, 3, 4, 5]]

    def loss(query, key, value, params, mask=None):
        if mask is not None:  # the forbidden key back in
            mask = np.concatenate([mask[..., :1], np.full((*mask.shape[:-1], 1), -np.inf), mask[..., 1:]], axis=-1)
        out, _ = reference.multi_head_attention(
            query, key, value, params, h, num_kv_heads, allowed=allowed, add_zero_attn=extras is True, additive=mask
        )
        return float((out * cotangent).sum())

    _directional_check(be, grads, loss, {**data, "params": params}, gen)


def _fetched(be, grads):
    """Every gradient in ``grads`` (a dict, with a nested ``"params"``
    dict) as NumPy arrays, from one concatenation: one computation on a
    lazy backend, where fetching each would compute the backward again."""
    paths = [(name,) for name in grads if name != "params"] + [("params", p) for p in grads.get("params", {})]
    arrays = [grads[path[0]] if len(path) == 1 else grads["params"][path[1]] for path in paths]
    xp = be.xp
    flat = be.numpy(xp.concat([xp.reshape(array, (-1,)) for array in arrays])).astype(np.float64)
    fetched, at = {}, 0
    for path, array in zip(paths, arrays):
        size = int(np.prod(array.shape))
        fetched[path] = flat[at : at + size].reshape(tuple(array.shape))
        at += size
    return fetched


def _directional_check(be, grads, loss, arguments, gen):
    """Each array in ``arguments`` (a dict, with a nested ``"params"``
    dict): its gradient in ``grads`` projected on a random direction against
    the central difference of the float64 ``loss`` along it."""
    step = 1e-6
    rtol, atol = tolerances(be, "float64", factor=4.0).values()
    fetched = _fetched(be, grads)
    paths = [(name,) for name in arguments if name != "params"] + [("params", p) for p in arguments.get("params", {})]
    for path in paths:
        holder = arguments if len(path) == 1 else arguments["params"]
        base = holder[path[-1]]
        direction = gen.standard_normal(np.shape(base))
        values = []
        for sign in (1, -1):
            holder[path[-1]] = base + sign * step * direction
            values.append(loss(**arguments))
        holder[path[-1]] = base
        expected = (values[0] - values[1]) / (2 * step)
        projected = float((fetched[path] * direction).sum())
        assert projected == pytest.approx(expected, rel=max(rtol, 1e-6), abs=max(atol, 1e-6)), path


def test_additive_gradients_equal_finite_differences_of_the_reference(attnx_backend):
    """A real mask with ``-inf`` entries (a row attends one key) and padding
    that leaves a sequence no key: every argument's gradient, the mask's too."""
    be = attnx_backend
    dtype = be.dtype("float64")
    gen = rng(65)
    arguments = {
        "query": gen.standard_normal((2, 4, 3)),
        "key": gen.standard_normal((2, 5, 2)),
        "value": gen.standard_normal((2, 5, 3)),
        "mask": np.where(gen.random((4, 5)) < 0.8, gen.standard_normal((4, 5)), -np.inf),
        "params": {
            "w_q": gen.standard_normal((3, 6)),
            "w_k": gen.standard_normal((2, 6)),
            "w_v": gen.standard_normal(6),
        },
    }
    arguments["mask"][0, :] = [-np.inf, 0.5, -np.inf, -np.inf, -np.inf]
    arguments = {
        k: (rounded(v, be, dtype) if k != "params" else {p: rounded(a, be, dtype) for p, a in v.items()})
        for k, v in arguments.items()
    }
    lengths = np.array([5, 0])
    allowed = reference.allowed_mask(4, 5, batch_shape=(2,), key_lengths=lengths)
    output, backward = attnx.vjp(
        attnx.additive_attention,
        *(be.array(arguments[k], dtype) for k in ("query", "key", "value")),
        {p: be.array(a, dtype) for p, a in arguments["params"].items()},
        mask=be.array(arguments["mask"], dtype),
        key_lengths=be.array(lengths),
    )
    cotangent = rounded(gen.standard_normal((2, 4, 3)), be, dtype)
    grads = backward(be.array(cotangent, dtype))
    assert sorted(grads) == ["key", "mask", "params", "query", "value"]
    assert sorted(grads["params"]) == ["w_k", "w_q", "w_v"]

    def loss(query, key, value, mask, params):
        finite = np.isfinite(mask)
        out, _ = reference.additive_attention(
            query, key, value, params, allowed=allowed & finite, bias=np.where(finite, mask, 0.0)
        )
        return float((out * cotangent).sum())

    _directional_check(be, grads, loss, arguments, gen)  # a -inf entry moves nothing: its gradient is 0


def test_bahdanau_gradients_equal_finite_differences_of_the_reference(attnx_backend):
    be = attnx_backend
    dtype = be.dtype("float64")
    gen = rng(66)
    arguments = {
        "decoder_state": gen.standard_normal((3, 4)),
        "annotations": gen.standard_normal((3, 5, 2)),
        "params": {
            "w_q": gen.standard_normal((4, 6)),
            "w_k": gen.standard_normal((2, 6)),
            "w_v": gen.standard_normal(6),
        },
    }
    arguments = {
        k: (rounded(v, be, dtype) if k != "params" else {p: rounded(a, be, dtype) for p, a in v.items()})
        for k, v in arguments.items()
    }
    lengths = np.array([5, 1, 3])
    context, backward = attnx.vjp(
        attnx.bahdanau_context,
        be.array(arguments["decoder_state"], dtype),
        be.array(arguments["annotations"], dtype),
        {p: be.array(a, dtype) for p, a in arguments["params"].items()},
        key_lengths=be.array(lengths),
    )
    cotangent = rounded(gen.standard_normal((3, 2)), be, dtype)
    grads = backward(be.array(cotangent, dtype))
    assert sorted(grads) == ["annotations", "decoder_state", "params"]
    allowed = reference.allowed_mask(1, 5, batch_shape=(3,), key_lengths=lengths)

    def loss(decoder_state, annotations, params):
        out, _ = reference.additive_attention(
            decoder_state[:, None, :], annotations, annotations, params, allowed=allowed
        )
        return float((out[:, 0, :] * cotangent).sum())

    _directional_check(be, grads, loss, arguments, gen)


@pytest.mark.parametrize("dropout_p", [0.0, 0.25], ids=["no dropout", "dropout"])
def test_flex_gradients_walk_the_block_masks_blocks(attnx_backend, dropout_p):
    """``attnx.vjp(attnx.flex_attention, ...)`` over a block mask with
    empty (skipped), partial and full blocks and a row that attends
    nothing, grouped heads sharing a broadcast batch's keys, a 0-d scale
    and dropout: the chain rule on the dense formula."""
    be = attnx_backend
    dtype = be.dtype("float64")
    batch, heads, kv_heads, n, m = 2, 4, 2, 11, 13

    def band(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx - 2) & (q_idx - kv_idx <= 5) & (q_idx != 3)

    block_mask = attnx.create_block_mask(band, None, None, n, m, block_size=(2, 3), device=be.device)
    assert set(np.unique(be.numpy(block_mask.kinds)).tolist()) == {0, 1, 2}
    gen = rng(60, n, m)
    data = {
        "query": gen.standard_normal((batch, heads, n, 4)),
        "key": gen.standard_normal((1, kv_heads, m, 4)),
        "value": gen.standard_normal((1, kv_heads, m, 3)),
        "cotangent": gen.standard_normal((batch, heads, n, 3)),
    }
    data = {k: rounded(v, be, dtype) for k, v in data.items()}
    arrays = {k: be.array(v, dtype) for k, v in data.items()}
    seed = 11
    output, backward = attnx.vjp(
        attnx.flex_attention,
        arrays["query"],
        arrays["key"],
        arrays["value"],
        None,
        block_mask,
        enable_gqa=True,
        scale=be.array(np.asarray(0.7), dtype),
        dropout_p=dropout_p,
        dropout_seed=seed,
    )
    grads = backward(arrays["cotangent"])
    group = heads // kv_heads
    grids = np.meshgrid(np.arange(batch), np.arange(heads), np.arange(n), np.arange(m), indexing="ij")
    dropout = reference.dropout_multiplier(seed, (batch, heads), n, m, dropout_p) if dropout_p else None
    expected = reference.scaled_dot_product_attention_vjp(
        data["query"],
        np.repeat(data["key"], group, axis=1),
        np.repeat(data["value"], group, axis=1),
        data["cotangent"],
        allowed=band(*grids),
        scale=0.7,
        dropout=dropout,
    )
    assert sorted(grads) == ["key", "query", "scale", "value"]
    assert_close(grads["query"], expected["query"], be, dtype, like=arrays["query"], scale=4.0)
    for name in ("key", "value"):  # (1, H, m, d), the batch summed: now the query heads of each group
        summed = expected[name].reshape(1, kv_heads, group, m, -1).sum(axis=2)
        assert_close(grads[name], summed, be, dtype, like=arrays[name], scale=4.0)
    assert_close(grads["scale"], expected["scale"], be, dtype, scale=16.0)


@pytest.mark.parametrize("mod", ["alibi", "relative_bias", "soft_cap"])
def test_flex_gradients_reach_the_score_mods_tables(attnx_backend, mod):
    """``attnx.vjp`` of flex attention with the score_mods of attnx.mods
    that carry their backward: ALiBi's slopes and a relative bias's table
    (per head, distances past its reach clipped) get their gradients under
    ``"score_mod"``, and the soft cap's derivative reaches the inputs;
    against central differences of the float64 reference."""
    be = attnx_backend
    dtype = be.dtype("float64")
    batch, heads, kv_heads, n, m = 2, 4, 2, 7, 9
    gen = rng(63, len(mod))
    arguments = {
        "query": gen.standard_normal((batch, heads, n, 4)),
        "key": gen.standard_normal((batch, kv_heads, m, 4)) * 2.0,  # scores past the cap
        "value": gen.standard_normal((batch, kv_heads, m, 3)),
    }
    if mod == "alibi":
        arguments["params"] = {"slopes": gen.random(heads)}
    if mod == "relative_bias":  # R = 3: distances of up to 8 clipped
        arguments["params"] = {"table": gen.standard_normal((heads, 7))}
    arguments = {
        k: (rounded(v, be, dtype) if k != "params" else {p: rounded(a, be, dtype) for p, a in v.items()})
        for k, v in arguments.items()
    }
    block_mask = attnx.create_block_mask(attnx.mods.causal, None, None, n, m, block_size=(2, 3), device=be.device)
    score_mod = {
        "alibi": lambda: attnx.mods.alibi(be.array(arguments["params"]["slopes"], dtype)),
        "relative_bias": lambda: attnx.mods.relative_bias(be.array(arguments["params"]["table"], dtype)),
        "soft_cap": lambda: attnx.mods.soft_cap(1.5),
    }[mod]()
    output, backward = attnx.vjp(
        attnx.flex_attention,
        *(be.array(arguments[k], dtype) for k in ("query", "key", "value")),
        score_mod,
        block_mask,
        enable_gqa=True,
    )
    cotangent = rounded(gen.standard_normal((batch, heads, n, 3)), be, dtype)
    grads = backward(be.array(cotangent, dtype))
    tables = mod != "soft_cap"
    assert sorted(grads) == (["key", "query", "score_mod", "value"] if tables else ["key", "query", "value"])
    if tables:
        grads["params"] = grads.pop("score_mod")  # the shape _directional_check reads
    allowed = np.arange(m)[None, :] <= np.arange(n)[:, None]

    def loss(query, key, value, params=None):
        def score(scores, b, h, i, j):
            if mod == "alibi":
                return scores + params["slopes"][h] * (j - i)
            if mod == "relative_bias":
                return scores + params["table"][h, np.clip(i - j, -3, 3) + 3]
            return 1.5 * np.tanh(scores / 1.5)

        out, _ = reference.flex_attention(query, key, value, score=score, allowed=allowed)
        return float((out * cotangent).sum())

    _directional_check(be, grads, loss, arguments, gen)


def test_a_score_mod_of_your_own_goes_to_the_librarys_autograd(attnx_backend):
    """``attnx.vjp`` with a score_mod of the user's own: where the backend
    has autograd, the library differentiates it, and the cotangents equal
    those attnx's own backward gives the same mod from attnx.mods (ALiBi,
    checked against central differences above); where it has none, it is
    refused by name."""
    be = attnx_backend
    dtype = be.dtype("float64")
    gen = rng(64)
    arrays = [
        be.array(rounded(gen.standard_normal(shape), be, dtype), dtype)
        for shape in ((2, 4, 5, 3), (2, 2, 6, 3), (2, 2, 6, 2))
    ]
    slopes = be.array(rounded(gen.random(4), be, dtype), dtype)
    xp = be.xp

    def own_alibi(score, b, h, q_idx, kv_idx):
        per_head = xp.reshape(xp.take(slopes, xp.reshape(h, (-1,)), axis=0), h.shape)
        return score + per_head * xp.astype(kv_idx - q_idx, score.dtype)

    block_mask = attnx.create_block_mask(attnx.mods.causal, None, None, 5, 6, block_size=(2, 3), device=be.device)
    if not be.backend.supports_autograd:
        with pytest.raises(
            TypeError, match=rf"own_alibi, a function of your own, on '{be.name}', which has no autograd"
        ):
            attnx.vjp(attnx.flex_attention, *arrays, own_alibi, block_mask, enable_gqa=True)
        return
    output, backward = attnx.vjp(attnx.flex_attention, *arrays, own_alibi, block_mask, enable_gqa=True)
    expected_output, expected_backward = attnx.vjp(
        attnx.flex_attention, *arrays, attnx.mods.alibi(slopes), block_mask, enable_gqa=True
    )
    assert_close(output, be.numpy(expected_output), be, dtype)
    cotangent = be.array(rounded(gen.standard_normal((2, 4, 5, 2)), be, dtype), dtype)
    grads, expected = backward(cotangent), expected_backward(cotangent)
    assert sorted(grads) == ["key", "query", "value"]
    for name in grads:
        assert_close(grads[name], be.numpy(expected[name]), be, dtype)
