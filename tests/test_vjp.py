"""attnx.vjp: the tiled array-API backward against PyTorch's autograd, its
refusals, its memory, and under jax.jit."""

from __future__ import annotations

import contextlib
import copy
import itertools

import numpy as np
import pytest

import attnx

torch = pytest.importorskip("torch")

_PARAMS = attnx.init_multi_head_params(4, 2, seed=0, dtype="float64")

GRID = list(
    itertools.product(
        [(5, 7), (9, 4)],  # (n, m): fewer queries than keys, and more
        [False, True],  # is_causal
        [None, (4, 0)],  # key lengths (entry 1 attends nothing)
        [1, 3],  # key/value heads for 3 query heads
        [None, (2, 3)],  # chunk_size: one tile, many tiles
    )
)


def _torch_gradients(q, k, v, cotangent, *, is_causal, lengths, scale):
    """PyTorch's autograd through its own SDPA, float64, the masks as one boolean mask."""
    n, m = q.shape[-2], k.shape[-2]
    allowed = torch.ones((q.shape[0], 1, n, m), dtype=torch.bool)
    if is_causal:  # attnx's alignment: the last query with the last key
        allowed &= torch.arange(m)[None, :] <= torch.arange(n)[:, None] + (m - n)
    if lengths is not None:  # one length per sequence, (B,), or per query, (B, 1, n)
        allowed &= torch.arange(m) < torch.tensor(np.asarray(lengths)).reshape(q.shape[0], 1, -1, 1)
    leaves = [torch.tensor(a, requires_grad=True) for a in (q, k, v)]
    scale_leaf = torch.tensor(scale, dtype=torch.float64, requires_grad=True)
    key, value = (torch.repeat_interleave(a, q.shape[1] // a.shape[1], dim=1) for a in leaves[1:])
    scores = (leaves[0] @ key.transpose(-1, -2)) * scale_leaf
    weights = torch.softmax(scores.masked_fill(~allowed, -torch.inf), -1).nan_to_num(0.0)
    (weights @ value).backward(torch.tensor(cotangent))
    return [leaf.grad.numpy() for leaf in leaves] + [scale_leaf.grad.item()]


@pytest.mark.parametrize(("sizes", "is_causal", "lengths", "kv_heads", "chunk_size"), GRID)
def test_gradients_equal_pytorch_s_autograd(sizes, is_causal, lengths, kv_heads, chunk_size):
    n, m = sizes
    gen = np.random.default_rng([58, n, m, kv_heads])
    q, k, v = (
        gen.standard_normal((2, 3, n, 4)),
        gen.standard_normal((2, kv_heads, m, 4)),
        gen.standard_normal((2, kv_heads, m, 5)),
    )
    cotangent = gen.standard_normal((2, 3, n, 5))
    key_lengths = None if lengths is None else np.minimum(lengths, m)
    _, backward = attnx.vjp(
        attnx.scaled_dot_product_attention,
        q,
        k,
        v,
        is_causal=is_causal,
        key_lengths=key_lengths,
        scale=np.asarray(0.7),
        chunk_size=chunk_size,
    )
    grads = backward(cotangent)
    expected = _torch_gradients(q, k, v, cotangent, is_causal=is_causal, lengths=key_lengths, scale=0.7)
    for name, want in zip(("query", "key", "value"), expected):
        np.testing.assert_allclose(grads[name], want, rtol=1e-10, atol=1e-12)
        assert grads[name].shape == {"query": q, "key": k, "value": v}[name].shape
    np.testing.assert_allclose(float(grads["scale"]), expected[3], rtol=1e-10)


@pytest.mark.parametrize(
    ("batch", "heads", "kv_heads", "is_causal", "lengths", "budget"),
    [
        # one key/value slice for two threads: its rows shared out, each share's sums added after
        (1, 1, 1, False, None, None),
        # eight key/value slices, two a task, each serving three query slices (causal grouped heads
        # do not fold into rows): in tiles of two query slices (a budget of 512 bytes) a tile would
        # span two groups, so they take one
        (2, 12, 4, True, None, 512),
        # one key/value slice serving three query slices, a budget smaller than one tile: tiles of one
        (1, 3, 1, True, None, 64),
        # twelve slices, three a task, in tiles of two, cut where the lengths' slices end (a batch
        # entry's two heads)
        (6, 2, 2, False, [9, 0, 3, 7, 5, 1], 512),
        # a length for each query: each range of rows reads its own
        (2, 2, 2, False, [[[7, 0, 3, 9, 5, 1, 2]], [[1, 2, 0, 0, 9, 7, 3]]], None),
    ],
)
def test_numpy_s_backward_shares_its_work_among_threads(
    monkeypatch, batch, heads, kv_heads, is_causal, lengths, budget
):
    """NumPy's native backward on two threads hands out at least two tasks,
    and their gradients, summed where they share a slice, are PyTorch's."""
    backend = attnx._registry.get("numpy")
    monkeypatch.setattr(backend, "concurrent_blocks", 2)
    gen = np.random.default_rng([58, batch, heads])
    q, k, v = (
        gen.standard_normal((batch, heads, 7, 4)),
        gen.standard_normal((batch, kv_heads, 9, 4)),
        gen.standard_normal((batch, kv_heads, 9, 5)),
    )
    cotangent = gen.standard_normal((batch, heads, 7, 5))
    _, backward = attnx.vjp(
        attnx.scaled_dot_product_attention,
        q,
        k,
        v,
        key_lengths=None if lengths is None else np.array(lengths),
        scale=np.asarray(0.7),
        is_causal=is_causal,
        chunk_size=(2, 3),
        enable_gqa=kv_heads != heads,
    )
    tasks = []
    map_blocks = backend.map_blocks

    def counted(function, items):
        items = list(items)
        tasks.append(len(items))
        return map_blocks(function, items)

    monkeypatch.setattr(backend, "map_blocks", counted)
    with attnx.memory_budget(budget) if budget else contextlib.nullcontext():
        grads = backward(cotangent)
    assert tasks and tasks[0] >= 2, tasks
    expected = _torch_gradients(q, k, v, cotangent, is_causal=is_causal, lengths=lengths, scale=0.7)
    for name, want in zip(("query", "key", "value"), expected):
        np.testing.assert_allclose(grads[name], want, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(float(grads["scale"]), expected[3], rtol=1e-10)


def test_keys_shared_by_the_batch_get_gradients_summed_over_it():
    """Keys and values of one batch entry, broadcast against a batch of
    queries: their gradients are summed over the batch, in their own shape,
    as PyTorch's autograd sums an expanded leaf's."""
    gen = np.random.default_rng([58, 1])
    q, k, v = (gen.standard_normal(shape) for shape in ((2, 3, 9, 4), (1, 3, 7, 4), (1, 3, 7, 5)))
    cotangent = gen.standard_normal((2, 3, 9, 5))
    _, backward = attnx.vjp(attnx.scaled_dot_product_attention, q, k, v, scale=np.asarray(0.7))
    grads = backward(cotangent)
    expected = _torch_gradients(q, k, v, cotangent, is_causal=False, lengths=None, scale=0.7)
    for name, want in zip(("query", "key", "value"), expected):
        np.testing.assert_allclose(grads[name], want, rtol=1e-10, atol=1e-12)
    assert grads["key"].shape == k.shape and grads["value"].shape == v.shape


def test_a_float_scale_gets_no_gradient_and_dtypes_are_kept():
    q = np.ones((1, 3, 4), dtype=np.float32)
    out, backward = attnx.vjp(attnx.scaled_dot_product_attention, q, q, q, scale=0.5)
    grads = backward(np.ones_like(out))
    assert sorted(grads) == ["key", "query", "value"]
    assert {g.dtype for g in grads.values()} == {np.dtype(np.float32)}
    assert all(g.flags.writeable for g in grads.values()), "arrays of their own, as NumPy's functions give"


@pytest.mark.parametrize(
    ("call", "error", "words"),
    [
        (
            lambda q: attnx.vjp(attnx.sinusoidal_positions, 4, 8),
            TypeError,
            "can't differentiate sinusoidal_positions",
        ),
        (
            lambda q: attnx.vjp(attnx.scaled_dot_product_attention, q, q, q, return_weights=True),
            ValueError,
            "masked_softmax",
        ),
        (
            lambda q: attnx.vjp(attnx.scaled_dot_product_attention, q, q, q)[1](np.ones((1, 3, 2))),
            ValueError,
            "cotangent must have the output's shape",
        ),
        (
            lambda q: attnx.vjp(attnx.scaled_dot_product_attention, q, q, q)[1](np.ones((1, 3, 4), np.float32)),
            TypeError,
            "dtype",
        ),
        (
            lambda q: attnx.vjp(attnx.scaled_dot_product_attention, q, q, q)[1]([[0.0]]),
            TypeError,
            "cotangent must be an array",
        ),
    ],
    ids=[
        "not differentiable yet",
        "weights",
        "cotangent shape",
        "cotangent dtype",
        "cotangent type",
    ],
)
def test_what_vjp_cannot_do_exactly_is_refused_by_name(call, error, words):
    with pytest.raises(error, match=words):
        call(np.ones((1, 3, 4)))


def test_the_backward_never_holds_the_scores():
    """(1, 1, 8192, 64) causal, float32: the scores are 256 MiB; the backward
    holds tiles within the memory budget, the inputs' gradients and the
    forward's output."""
    from test_memory import MiB, peak_bytes

    gen = np.random.default_rng(0)
    q, k, v = (gen.standard_normal((1, 1, 8192, 64), dtype=np.float32) for _ in range(3))
    out, backward = attnx.vjp(attnx.scaled_dot_product_attention, q, k, v, is_causal=True)
    cotangent = np.ones_like(out)
    peak, grads = peak_bytes(lambda: backward(cotangent))
    assert peak < 64 * MiB, peak / MiB  # gradients 6 MiB; tiles of 4 MiB, a few alive at once
    assert np.isfinite(grads["query"]).all()


def test_under_jax_jit_the_backward_equals_eager():
    jax = pytest.importorskip("jax")
    gen = np.random.default_rng(3)
    q, k, v, g = (jax.numpy.asarray(gen.standard_normal((2, 2, 6, 4)), dtype="float32") for _ in range(4))

    def gradients(q, k, v, g):
        return attnx.vjp(attnx.scaled_dot_product_attention, q, k, v, is_causal=True, chunk_size=(2, 3))[1](g)

    eager, traced = gradients(q, k, v, g), jax.jit(gradients)(q, k, v, g)
    for name in ("query", "key", "value"):
        np.testing.assert_allclose(np.asarray(traced[name]), np.asarray(eager[name]), rtol=1e-5, atol=1e-6)
    expected = jax.vjp(lambda q, k, v: attnx.scaled_dot_product_attention(q, k, v, is_causal=True), q, k, v)[1](g)
    for name, want in zip(("query", "key", "value"), expected):
        np.testing.assert_allclose(np.asarray(eager[name]), np.asarray(want), rtol=1e-4, atol=1e-5)


def _torch_nadaraya_watson(q, k, v, bandwidth, kernel):
    """The estimate in PyTorch, float64, from the formula: each kernel of ``u = |q - k| / b``."""
    if k.ndim == 1:
        u = (q[:, None] - k[None, :]).abs() / bandwidth
    else:
        u = ((q[:, None, :] - k[None, :, :]) ** 2).sum(-1).sqrt() / bandwidth
    if kernel == "gaussian":
        values = torch.exp(-u * u / 2)
    elif kernel == "epanechnikov":
        values = (0.75 * (1 - u * u)).clamp(min=0)
    else:
        values = (u <= 1).double()
    totals = values.sum(-1, keepdim=True)
    weights = values / torch.where(totals == 0, torch.ones_like(totals), totals)
    return weights @ v if v.ndim == 2 else weights @ v


NW_GRID = list(
    itertools.product(
        ["gaussian", "epanechnikov", "boxcar"],
        [((6,), (9,), (9,)), ((6, 3), (9, 3), (9, 2)), ((5, 20), (7, 20), (7,))],  # scalar, vector, wide positions
        [None, 256],  # memory budget: one chunk of queries, or many
    )
)


@pytest.mark.parametrize(("kernel", "shapes", "budget"), NW_GRID)
def test_nadaraya_watson_gradients_equal_pytorch_s_autograd(kernel, shapes, budget):
    gen = np.random.default_rng(len(shapes[0]))
    q, k, v = (gen.standard_normal(shape) for shape in shapes)
    bandwidth = 2.5 if shapes[0] == (5, 20) else 1.3  # wide positions: some keys within the compact kernels
    with attnx.memory_budget(budget) if budget else contextlib.nullcontext():
        out, backward = attnx.vjp(attnx.nadaraya_watson, q, k, v, kernel=kernel, bandwidth=np.asarray(bandwidth))
        cotangent = gen.standard_normal(out.shape)
        grads = backward(cotangent)
    leaves = [torch.tensor(a, requires_grad=True) for a in (q, k, v, np.asarray(bandwidth))]
    expected = _torch_nadaraya_watson(*leaves, kernel)
    np.testing.assert_allclose(out, expected.detach().numpy(), rtol=1e-12, atol=1e-12)
    torch_grads = torch.autograd.grad(expected, leaves, torch.tensor(cotangent), allow_unused=True)
    for name, want in zip(("queries", "keys", "values", "bandwidth"), torch_grads):
        want = np.zeros(()) if want is None else want.numpy()
        np.testing.assert_allclose(grads[name], want, rtol=1e-10, atol=1e-12, err_msg=name)


def test_nadaraya_watson_gradients_keep_dtypes_and_a_float_bandwidth_gets_none():
    x = np.linspace(0, 5, 20, dtype=np.float32)
    out, backward = attnx.vjp(attnx.nadaraya_watson, x[:4], x, np.sin(x), bandwidth=0.5)
    grads = backward(np.ones_like(out))
    assert sorted(grads) == ["keys", "queries", "values"]
    assert {g.dtype for g in grads.values()} == {np.dtype(np.float32)}


@pytest.mark.parametrize(
    ("options", "error", "words"),
    [
        ({"kernel": lambda u: 1.0 / (1.0 + u)}, TypeError, "kernel of your own"),
        ({"return_weights": True}, ValueError, "two outputs"),
        ({"bandwidth": -1.0}, ValueError, "bandwidth must be positive"),
    ],
    ids=["own kernel", "weights", "bad bandwidth"],
)
def test_what_the_nadaraya_watson_vjp_cannot_do_is_refused_by_name(options, error, words):
    x = np.linspace(0, 1, 5)
    with pytest.raises(error, match=words):
        attnx.vjp(attnx.nadaraya_watson, x, x, x, **options)


@pytest.mark.parametrize(
    ("kernel_size", "stride", "dilation", "length", "bias"),
    [
        (3, 1, 1, 10, True),
        (3, 2, 2, 11, False),
        (2, 3, 4, 13, True),
        (4, 1, 8, 5, True),
        (1, 2, 1, 7, False),
        (3, 1, 1, 1, True),
        (3, 4, 1, 12, True),
    ],
)
def test_causal_conv1d_gradients_equal_pytorch_s_conv1d(kernel_size, stride, dilation, length, bias):
    """Against ``torch.nn.functional.conv1d`` on the left-padded input, through PyTorch's autograd."""
    gen = np.random.default_rng(kernel_size * 100 + length)
    x, weight = gen.standard_normal((2, 3, 4, length)), gen.standard_normal((5, 4, kernel_size))
    b = gen.standard_normal(5) if bias else None
    out, backward = attnx.vjp(attnx.causal_conv1d, x, weight, b, stride=stride, dilation=dilation)
    cotangent = gen.standard_normal(out.shape)
    grads = backward(cotangent)
    leaves = [torch.tensor(a, requires_grad=True) for a in (x, weight) + ((b,) if bias else ())]
    padded = torch.nn.functional.pad(leaves[0].reshape(-1, 4, length), ((kernel_size - 1) * dilation, 0))
    expected = torch.nn.functional.conv1d(
        padded, leaves[1], leaves[2] if bias else None, stride=stride, dilation=dilation
    ).reshape(out.shape)
    np.testing.assert_allclose(out, expected.detach().numpy(), rtol=1e-12, atol=1e-12)
    names = ["x", "weight"] + (["bias"] if bias else [])
    assert sorted(grads) == sorted(names)
    for name, want in zip(names, torch.autograd.grad(expected, leaves, torch.tensor(cotangent))):
        np.testing.assert_allclose(grads[name], want.numpy(), rtol=1e-11, atol=1e-12, err_msg=name)


def _torch_rotary(x, positions, interleaved):
    """RoPE in PyTorch, from its rotation: pairs side by side, or halves (GPT-NeoX's)."""
    d = x.shape[-1]
    angles = positions[..., None] * 10000.0 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    cos, sin = torch.cos(angles), torch.sin(angles)
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack([a * cos - b * sin, b * cos + a * sin], -1).reshape(x.shape)
    a, b = x[..., : d // 2], x[..., d // 2 :]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)


@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("positions", ["default", "integers", "real, per batch entry"])
def test_apply_rotary_gradients_equal_pytorch_s_autograd(interleaved, positions):
    gen = np.random.default_rng(7)
    x = gen.standard_normal((2, 3, 5, 8))
    given = {
        "default": None,
        "integers": np.array([3, 1, 4, 1, 5]),
        "real, per batch entry": gen.standard_normal((2, 1, 5)) * 3,
    }[positions]
    out, backward = attnx.vjp(attnx.apply_rotary, x, given, interleaved=interleaved)
    cotangent = gen.standard_normal(out.shape)
    grads = backward(cotangent)
    leaves = [torch.tensor(x, requires_grad=True)]
    if given is None:
        torch_positions = torch.arange(5, dtype=torch.float64)
    else:
        torch_positions = torch.tensor(given, dtype=torch.float64, requires_grad=given.dtype.kind == "f")
        if given.dtype.kind == "f":
            leaves.append(torch_positions)
    expected = _torch_rotary(leaves[0], torch_positions, interleaved)
    np.testing.assert_allclose(out, expected.detach().numpy(), rtol=1e-12, atol=1e-12)
    names = ["x", "positions"][: len(leaves)]
    assert sorted(grads) == sorted(names)
    for name, want in zip(names, torch.autograd.grad(expected, leaves, torch.tensor(cotangent))):
        np.testing.assert_allclose(grads[name], want.numpy(), rtol=1e-11, atol=1e-12, err_msg=name)


def test_learned_positions_gradients_equal_pytorch_s_embedding():
    embedding = attnx.LearnedPositions(10, 4, dtype="float64")
    positions = np.array([[1, 3, 3], [9, 0, 1]])
    rows, backward = attnx.vjp(embedding, positions)
    cotangent = np.random.default_rng(3).standard_normal(rows.shape)
    table = torch.tensor(embedding.table, requires_grad=True)
    expected = torch.nn.functional.embedding(torch.tensor(positions), table)
    np.testing.assert_array_equal(rows, expected.detach().numpy())
    (want,) = torch.autograd.grad(expected, [table], torch.tensor(cotangent))
    np.testing.assert_allclose(backward(cotangent)["table"], want.numpy(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"bias": False, "is_causal": True},
        {"add_bias_kv": True, "add_zero_attn": True, "padding": True},
        {"kdim": 5, "vdim": 7, "padding": True},
    ],
    ids=["plain", "no bias, causal", "bias_kv, zero_attn, padding", "kdim and vdim"],
)
def test_multi_head_gradients_equal_torch_multihead_attention_s(options):
    """Against ``torch.nn.MultiheadAttention`` (batch first, float64) under
    autograd: the inputs' gradients and every parameter's, by attnx's names."""
    options = dict(options)
    is_causal, padding = options.pop("is_causal", False), options.pop("padding", False)
    torch.manual_seed(0)
    module = torch.nn.MultiheadAttention(8, 2, batch_first=True, dtype=torch.float64, **options).eval()
    if module.bias_k is not None:
        torch.nn.init.normal_(module.bias_k)
        torch.nn.init.normal_(module.bias_v)
    gen = np.random.default_rng(5)
    q = gen.standard_normal((2, 5, 8))
    k = gen.standard_normal((2, 6, options.get("kdim", 8)))
    v = gen.standard_normal((2, 6, options.get("vdim", 8)))
    lengths = np.array([6, 3]) if padding else None
    ours = attnx.MultiHeadAttention.from_torch(module)
    params = {name: p.detach().numpy().copy() for name, p in ours.params.items()}
    n, m = 5, 6
    out, backward = attnx.vjp(
        attnx.multi_head_attention,
        q,
        k,
        v,
        params,
        num_heads=2,
        key_lengths=lengths,
        is_causal=is_causal,
        add_zero_attn=module.add_zero_attn,
    )
    cotangent = gen.standard_normal(out.shape)
    grads = backward(cotangent)
    leaves = [torch.tensor(a, requires_grad=True) for a in (q, k, v)]
    attn_mask = None
    if is_causal:  # attnx's alignment, n = 5 queries over m = 6 keys: True is ignored, as PyTorch's
        attn_mask = torch.arange(m)[None, :] > torch.arange(n)[:, None] + (m - n)
    key_padding_mask = None if lengths is None else torch.arange(m)[None, :] >= torch.tensor(lengths)[:, None]
    expected, _ = module(*leaves, key_padding_mask=key_padding_mask, attn_mask=attn_mask, need_weights=False)
    np.testing.assert_allclose(out, expected.detach().numpy(), rtol=1e-10, atol=1e-12)
    parameters = list(module.parameters())
    want = torch.autograd.grad(expected, leaves + parameters, torch.tensor(cotangent))
    for name, expected_grad in zip(("query", "key", "value"), want):
        np.testing.assert_allclose(grads[name], expected_grad.numpy(), rtol=1e-9, atol=1e-11, err_msg=name)
    # The module's gradients by attnx's names: from_torch of a module holding them (its mapping is linear).
    holder = copy.deepcopy(module)
    with torch.no_grad():
        for parameter, gradient in zip(holder.parameters(), want[3:]):
            parameter.copy_(gradient)
    expected_params = attnx.MultiHeadAttention.from_torch(holder).params
    assert sorted(grads["params"]) == sorted(expected_params)
    for name, expected_grad in expected_params.items():
        np.testing.assert_allclose(
            grads["params"][name], expected_grad.detach().numpy(), rtol=1e-9, atol=1e-11, err_msg=name
        )


def _torch_additive(q, k, v, w_q, w_k, w_v, allowed=None, bias=None):
    """Additive attention in PyTorch from its formula: ``softmax(tanh(q W_q + k W_k) w_v + bias) v``."""
    scores = torch.tanh((q @ w_q)[..., :, None, :] + (k @ w_k)[..., None, :, :]) @ w_v
    if bias is not None:
        scores = scores + bias
    if allowed is not None:
        scores = scores.masked_fill(~allowed, -torch.inf)
    return torch.softmax(scores, -1).nan_to_num(0.0) @ v


@pytest.mark.parametrize("budget", [None, 512], ids=["one chunk", "a query a chunk"])
@pytest.mark.parametrize("case", ["plain", "key lengths with an empty row", "real mask", "boolean mask, broadcast"])
def test_additive_gradients_equal_pytorch_s_autograd(case, budget):
    gen = np.random.default_rng(11)
    q, k, v = gen.standard_normal((2, 5, 4)), gen.standard_normal((2, 7, 3)), gen.standard_normal((2, 7, 6))
    params = {"w_q": gen.standard_normal((4, 8)), "w_k": gen.standard_normal((3, 8)), "w_v": gen.standard_normal(8)}
    options, allowed, bias = {}, None, None
    if case == "key lengths with an empty row":
        options["key_lengths"] = np.array([7, 0])
        allowed = torch.arange(7)[None, None, :] < torch.tensor([7, 0])[:, None, None]
    elif case == "real mask":
        bias = gen.standard_normal((5, 7))
        options["mask"] = bias
    elif case == "boolean mask, broadcast":
        options["mask"] = gen.random((1, 5, 7)) < 0.6
        allowed = torch.tensor(options["mask"])
    with attnx.memory_budget(budget) if budget else contextlib.nullcontext():
        out, backward = attnx.vjp(attnx.additive_attention, q, k, v, params, **options)
        cotangent = gen.standard_normal(out.shape)
        grads = backward(cotangent)
    leaves = [torch.tensor(a, requires_grad=True) for a in (q, k, v, params["w_q"], params["w_k"], params["w_v"])]
    if bias is not None:
        leaves.append(torch.tensor(bias, requires_grad=True))
    expected = _torch_additive(*leaves[:6], allowed=allowed, bias=leaves[6] if bias is not None else None)
    np.testing.assert_allclose(out, expected.detach().numpy(), rtol=1e-12, atol=1e-12)
    got = [grads["query"], grads["key"], grads["value"], *(grads["params"][p] for p in ("w_q", "w_k", "w_v"))]
    assert sorted(grads) == sorted(["query", "key", "value", "params"] + (["mask"] if bias is not None else []))
    if bias is not None:
        got.append(grads["mask"])
    for index, (ours, want) in enumerate(zip(got, torch.autograd.grad(expected, leaves, torch.tensor(cotangent)))):
        np.testing.assert_allclose(ours, want.numpy(), rtol=1e-10, atol=1e-12, err_msg=str(index))


def test_bahdanau_gradients_equal_pytorch_s_autograd():
    gen = np.random.default_rng(12)
    state, annotations = gen.standard_normal((3, 4)), gen.standard_normal((3, 6, 5))
    params = {"w_q": gen.standard_normal((4, 8)), "w_k": gen.standard_normal((5, 8)), "w_v": gen.standard_normal(8)}
    lengths = np.array([6, 2, 4])
    context, backward = attnx.vjp(attnx.bahdanau_context, state, annotations, params, key_lengths=lengths)
    cotangent = gen.standard_normal(context.shape)
    grads = backward(cotangent)
    leaves = [
        torch.tensor(a, requires_grad=True) for a in (state, annotations, params["w_q"], params["w_k"], params["w_v"])
    ]
    allowed = torch.arange(6)[None, None, :] < torch.tensor(lengths)[:, None, None]
    expected = _torch_additive(leaves[0][:, None, :], leaves[1], leaves[1], *leaves[2:], allowed=allowed)[:, 0, :]
    np.testing.assert_allclose(context, expected.detach().numpy(), rtol=1e-12, atol=1e-12)
    got = [grads["decoder_state"], grads["annotations"], *(grads["params"][p] for p in ("w_q", "w_k", "w_v"))]
    for index, (ours, want) in enumerate(zip(got, torch.autograd.grad(expected, leaves, torch.tensor(cotangent)))):
        np.testing.assert_allclose(ours, want.numpy(), rtol=1e-10, atol=1e-12, err_msg=str(index))


@pytest.mark.parametrize("mask_shape", [(5, 7), (2, 1, 5, 7), (2, 3, 5, 7), (1, 7), (3, 1, 1), (5, 1)])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("chunk_size", [None, (2, 3)], ids=["one tile", "tiles"])
def test_a_real_mask_s_gradient_equals_pytorch_s_autograd(mask_shape, is_causal, chunk_size):
    """Every broadcast of an additive mask, ``-inf`` entries included, in one tile and in many."""
    gen = np.random.default_rng(len(mask_shape) * 10 + is_causal)
    q, k, v = gen.standard_normal((2, 3, 5, 4)), gen.standard_normal((2, 1, 7, 4)), gen.standard_normal((2, 1, 7, 6))
    mask = gen.standard_normal(mask_shape)
    if mask_shape[-1] == 7:
        mask = np.where(gen.random(mask_shape) < 0.85, mask, -np.inf)
    out, backward = attnx.vjp(
        attnx.scaled_dot_product_attention, q, k, v, mask=mask, is_causal=is_causal, chunk_size=chunk_size
    )
    cotangent = gen.standard_normal(out.shape)
    grads = backward(cotangent)
    leaves = [torch.tensor(a, requires_grad=True) for a in (q, k, v, mask)]
    scores = leaves[0] @ leaves[1].transpose(-1, -2) / 2 + leaves[3]
    if is_causal:  # attnx's alignment: the last query with the last key
        scores = scores.masked_fill(~(torch.arange(7)[None, :] <= torch.arange(5)[:, None] + 2), -torch.inf)
    expected = torch.softmax(scores, -1).nan_to_num(0.0) @ leaves[2]
    np.testing.assert_allclose(out, expected.detach().numpy(), rtol=1e-12, atol=1e-12)
    assert sorted(grads) == ["key", "mask", "query", "value"]
    for name, want in zip(
        ("query", "key", "value", "mask"), torch.autograd.grad(expected, leaves, torch.tensor(cotangent))
    ):
        assert not np.isnan(grads[name]).any(), name
        np.testing.assert_allclose(grads[name], np.nan_to_num(want.numpy()), rtol=1e-10, atol=1e-12, err_msg=name)


@pytest.mark.parametrize(
    "case",
    ["shared (n, m)", "per head, with bias_kv, zero_attn and padding", "causal, grouped heads"],
)
def test_a_real_mask_s_gradient_through_multi_head_attention(case):
    """A real (additive) mask's gradient through the heads' layout: against
    ``torch.nn.MultiheadAttention``'s float ``attn_mask`` under autograd
    (``(N * H, L, S)`` per head), and with grouped heads against the
    float64 chain rule's, each query head's mask summed where it broadcasts."""
    gen = np.random.default_rng(8)
    n, m = 5, 6
    q, k, v = gen.standard_normal((2, n, 8)), gen.standard_normal((2, m, 8)), gen.standard_normal((2, m, 8))
    if case == "causal, grouped heads":
        params = attnx.init_multi_head_params(8, 4, num_kv_heads=2, seed=1, dtype="float64")
        mask = gen.standard_normal((1, 4, n, m))
        out, backward = attnx.vjp(
            attnx.multi_head_attention, q, k, v, params, num_heads=4, num_kv_heads=2, mask=mask, is_causal=True
        )
        cotangent = gen.standard_normal(out.shape)
        got = backward(cotangent)["mask"]
        step = 1e-6  # central differences of the float64 forward, along a random direction
        direction = gen.standard_normal(mask.shape)

        def loss(shift):
            return np.sum(
                cotangent
                * attnx.multi_head_attention(
                    q, k, v, params, num_heads=4, num_kv_heads=2, mask=mask + shift * direction, is_causal=True
                )
            )

        assert got.shape == mask.shape
        np.testing.assert_allclose(np.sum(got * direction), (loss(step) - loss(-step)) / (2 * step), rtol=1e-6)
        causal_future = np.arange(m)[None, :] > np.arange(n)[:, None] + (m - n)
        assert np.all(got[..., causal_future] == 0)  # forbidden by the causal rule: no weight, no gradient
        return
    per_head = case.startswith("per head")
    options = {"add_bias_kv": True, "add_zero_attn": True} if per_head else {}
    torch.manual_seed(0)
    module = torch.nn.MultiheadAttention(8, 2, batch_first=True, dtype=torch.float64, **options).eval()
    if module.bias_k is not None:
        torch.nn.init.normal_(module.bias_k)
        torch.nn.init.normal_(module.bias_v)
    mask = gen.standard_normal((2, 2, n, m) if per_head else (n, m))
    lengths = np.array([6, 3]) if per_head else None
    params = {name: p.detach().numpy().copy() for name, p in attnx.MultiHeadAttention.from_torch(module).params.items()}
    out, backward = attnx.vjp(
        attnx.multi_head_attention,
        q,
        k,
        v,
        params,
        num_heads=2,
        mask=mask,
        key_lengths=lengths,
        add_zero_attn=module.add_zero_attn,
    )
    cotangent = gen.standard_normal(out.shape)
    got = backward(cotangent)["mask"]
    torch_mask = torch.tensor(mask.reshape(4, n, m) if per_head else mask, requires_grad=True)
    key_padding_mask = None  # as a float mask, as the attn_mask is (PyTorch deprecates mixing them)
    if lengths is not None:
        padded = torch.arange(m)[None, :] >= torch.tensor(lengths)[:, None]
        key_padding_mask = torch.zeros(padded.shape, dtype=torch.float64).masked_fill(padded, -torch.inf)
    expected, _ = module(
        *(torch.tensor(a) for a in (q, k, v)),
        attn_mask=torch_mask,
        key_padding_mask=key_padding_mask,
        need_weights=False,
    )
    np.testing.assert_allclose(out, expected.detach().numpy(), rtol=1e-10, atol=1e-12)
    (want,) = torch.autograd.grad(expected, [torch_mask], torch.tensor(cotangent))
    assert got.shape == mask.shape
    np.testing.assert_allclose(got, want.numpy().reshape(mask.shape), rtol=1e-9, atol=1e-11)


def test_a_score_mod_of_your_own_differentiates_under_torch_no_grad():
    """attnx.vjp hands a user's own score_mod to PyTorch's autograd, which
    is asked for gradients whatever grad mode the caller is in."""
    torch = pytest.importorskip("torch")
    generator = torch.Generator().manual_seed(64)
    q, k, v = (torch.randn((1, 2, 9, 4), generator=generator, dtype=torch.float64) for _ in range(3))

    def halved(score, b, h, q_idx, kv_idx):
        return score / 2

    output, backward = attnx.vjp(attnx.flex_attention, q, k, v, halved)
    expected = backward(output)
    with torch.no_grad():
        output, backward = attnx.vjp(attnx.flex_attention, q, k, v, halved)
        got = backward(output)
    for name in ("query", "key", "value"):
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=0)
