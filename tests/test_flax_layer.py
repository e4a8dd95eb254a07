"""attnx.flax.MultiHeadAttention against flax.nnx.MultiHeadAttention itself:
the same parameters and layout, the same outputs and parameter gradients
for the masks and heads Flax's layer takes, under nnx.jit and nnx.grad,
the autoregressive cache, and a model that trains as Flax's does."""

from __future__ import annotations

import re
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

flax = pytest.importorskip("flax")
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import attnx.flax  # noqa: E402

#: Layouts of the layer: constructor keywords beside num_heads=4, in_features=8.
LAYOUTS = {
    "self-attention": {},
    "grouped heads": {"num_kv_heads": 2},
    "kv features and out features": {"in_kv_features": 6, "out_features": 5, "qkv_features": 12},
    "no bias": {"use_bias": False},
}


def _pair(**options):
    """Flax's layer and ours, ours holding Flax's parameters."""
    theirs = nnx.MultiHeadAttention(num_heads=4, in_features=8, decode=False, rngs=nnx.Rngs(0), **options)
    ours = attnx.flax.MultiHeadAttention(num_heads=4, in_features=8, decode=False, rngs=nnx.Rngs(1), **options)
    nnx.update(ours, nnx.state(theirs, nnx.Param))
    return ours, theirs


def _inputs(options, batch=3, n=5, m=7, seed=0):
    gen = np.random.default_rng(seed)
    kv = options.get("in_kv_features", 8)
    return (
        jnp.asarray(gen.standard_normal((batch, n, 8)), jnp.float32),
        jnp.asarray(gen.standard_normal((batch, m, kv)), jnp.float32),
        jnp.asarray(gen.standard_normal((batch, m, kv)), jnp.float32),
    )


def test_the_layers_have_the_same_parameters_in_the_same_layout():
    theirs = nnx.MultiHeadAttention(num_heads=4, in_features=8, num_kv_heads=2, decode=False, rngs=nnx.Rngs(0))
    ours = attnx.flax.MultiHeadAttention(num_heads=4, in_features=8, num_kv_heads=2, decode=False, rngs=nnx.Rngs(0))
    shapes = jax.tree.map(lambda a: a.shape, nnx.state(ours, nnx.Param))
    assert shapes == jax.tree.map(lambda a: a.shape, nnx.state(theirs, nnx.Param))
    # the same initialisation from the same seed
    same = jax.tree.map(
        lambda a, b: bool(jnp.array_equal(a, b)), nnx.state(ours, nnx.Param), nnx.state(theirs, nnx.Param)
    )
    assert all(jax.tree.leaves(same))


#: Each layout and each mask, in pairs (every one of the 20 took a minute of CI for little more).
CASES = [
    ("self-attention", "none"),
    ("grouped heads", "padding mask"),
    ("kv features and out features", "per head mask"),
    ("no bias", "causal, n != m"),
    ("grouped heads", "causal, n = m"),
    ("grouped heads", "causal, n != m"),
]


@pytest.mark.parametrize(("layout", "masking"), CASES)
def test_outputs_and_parameter_gradients_equal_flax_s(layout, masking):
    """Outputs, and every parameter's gradient under nnx.grad (jitted: JAX
    compiles eager calls one primitive at a time), within float32 rounding
    of Flax's own layer holding the same parameters."""
    options = LAYOUTS[layout]
    ours, theirs = _pair(**options)
    q, k, v = _inputs(options, m=5 if masking == "causal, n = m" else 7)
    call = {}
    m = k.shape[-2]
    if masking == "padding mask":
        call["mask"] = (jnp.arange(m) < jnp.array([7, 3, 1])[:, None])[:, None, None, :]
    if masking == "per head mask":
        call["mask"] = jnp.asarray(np.random.default_rng(2).random((3, 4, 5, m)) < 0.7) | (jnp.arange(m) == 0)
    if masking.startswith("causal"):
        call["is_causal"] = True

    def loss(layer):
        return jnp.sum(jnp.sin(layer(q, k, v, **call)))

    forward, gradient = nnx.jit(lambda layer: layer(q, k, v, **call)), nnx.jit(nnx.grad(loss))
    np.testing.assert_allclose(forward(ours), forward(theirs), rtol=2e-5, atol=2e-5)
    ours_grads, theirs_grads = gradient(ours), gradient(theirs)
    for name, (mine, flax_s) in _leaves(ours_grads, theirs_grads).items():
        np.testing.assert_allclose(mine, flax_s, rtol=2e-4, atol=2e-5, err_msg=name)


def _leaves(first, second):
    flat_first = dict(nnx.to_flat_state(first))
    flat_second = dict(nnx.to_flat_state(second))
    assert sorted(flat_first) == sorted(flat_second)
    return {"/".join(map(str, path)): (flat_first[path][...], flat_second[path][...]) for path in flat_first}


def test_under_nnx_jit_it_equals_eager_and_attnx_computes_it(monkeypatch):
    ours, _ = _pair(num_kv_heads=2)
    q, k, v = _inputs({})
    calls = []
    original = attnx.flax.scaled_dot_product_attention
    monkeypatch.setattr(
        attnx.flax, "scaled_dot_product_attention", lambda *a, **kw: calls.append(kw) or original(*a, **kw)
    )
    eager = ours(q, k, v)
    jitted = nnx.jit(lambda layer, *arrays: layer(*arrays))(ours, q, k, v)
    np.testing.assert_allclose(jitted, eager, rtol=1e-6, atol=1e-6)
    assert len(calls) == 2 and calls[0]["enable_gqa"]  # grouped heads, in attnx's call


def test_the_autoregressive_cache_decodes_as_flax_s():
    """decode=True: one token a step over the cache Flax's layer keeps, the
    same outputs as Flax's layer step by step."""
    layers = []
    for kind in (nnx.MultiHeadAttention, attnx.flax.MultiHeadAttention):
        layer = kind(num_heads=4, in_features=8, num_kv_heads=2, decode=True, rngs=nnx.Rngs(0))
        layer.init_cache((2, 6, 8))
        layers.append(layer)
    x = jnp.asarray(np.random.default_rng(3).standard_normal((2, 6, 8)), jnp.float32)
    for step in range(6):
        token = x[:, step : step + 1]
        np.testing.assert_allclose(layers[1](token), layers[0](token), rtol=2e-5, atol=2e-5, err_msg=str(step))


def test_a_fully_padded_sequence_gets_the_output_bias():
    """attnx's rule, where Flax's layer averages the values: a query with no
    key to attend gets zeros before the output projection."""
    ours, _ = _pair()
    q, k, v = _inputs({})
    mask = jnp.zeros((3, 1, 1, 7), dtype=bool).at[0].set(True)
    out = ours(q, k, v, mask=mask)
    np.testing.assert_allclose(out[1:], jnp.broadcast_to(ours.out.bias[...], out[1:].shape), atol=1e-7)


def test_dropout_is_attnx_s_and_repeats_under_the_same_key():
    layer = attnx.flax.MultiHeadAttention(
        num_heads=4, in_features=8, dropout_rate=0.5, broadcast_dropout=False, decode=False, rngs=nnx.Rngs(0)
    )
    q, k, v = _inputs({})
    first = layer(q, k, v, deterministic=False, rngs=nnx.Rngs(dropout=7))
    again = layer(q, k, v, deterministic=False, rngs=nnx.Rngs(dropout=7))
    other = layer(q, k, v, deterministic=False, rngs=nnx.Rngs(dropout=8))
    np.testing.assert_array_equal(first, again)
    assert not np.allclose(first, other)
    np.testing.assert_allclose(layer(q, k, v, deterministic=True), layer(q, k, v, deterministic=True))


@pytest.mark.parametrize("batch", [(), (2, 3)], ids=["unbatched", "two batch axes"])
def test_the_attention_takes_any_batch_axes_as_flax_s(batch):
    """``dot_product_attention``'s ``(..., n, H, d)``: no batch axis, or
    several, as ``flax.nnx.dot_product_attention`` takes them."""
    gen = np.random.default_rng(4)
    q, k, v = (jnp.asarray(gen.standard_normal((*batch, length, 4, 8)), jnp.float32) for length in (5, 7, 7))
    mask = jnp.asarray(gen.random((*batch, 4, 5, 7)) < 0.7) | (jnp.arange(7) == 0)
    for call in ({}, {"mask": mask}):
        expected = nnx.dot_product_attention(q, k, v, **call)
        np.testing.assert_allclose(attnx.flax.dot_product_attention(q, k, v, **call), expected, rtol=2e-5, atol=2e-5)


def _bad_calls():
    """name -> (query, key, value, call keywords, message): inputs Flax's own function refuses."""
    q, k = jnp.zeros((2, 5, 4, 8)), jnp.zeros((2, 7, 4, 8))
    return {
        "a 1-D query": (jnp.zeros(8), k, k, {}, "query, key and value must be (..., n, H, d) arrays of one rank"),
        "keys of another rank": (
            q,
            k[0],
            k[0],
            {},
            "query, key and value must be (..., n, H, d) arrays of one rank, got shapes (2, 5, 4, 8), (7, 4, 8)",
        ),
        "keys of another batch": (q, k[:1], k[:1], {}, "query, key and value must have the same batch axes (...)"),
        "values of other positions": (q, k, k[:, :6], {}, "key and value must have the same (..., m, H_kv)"),
        "keys of other features": (q, k[..., :6], k, {}, "key must have d_k = 8 features (from query), got shape"),
        "a bias of other keys": (
            q,
            k,
            k,
            {"bias": jnp.zeros((2, 4, 5, 6))},
            "bias must broadcast to the scores' shape (..., H, n, m) = (2, 4, 5, 7), got shape (2, 4, 5, 6)",
        ),
    }


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_bad_inputs_are_refused_by_name_as_flax_refuses_them(case):
    query, key, value, call, message = _bad_calls()[case]
    with pytest.raises((ValueError, TypeError)):
        nnx.dot_product_attention(query, key, value, **call)
    with pytest.raises(ValueError, match="^attnx.flax: " + re.escape(message)):
        attnx.flax.dot_product_attention(query, key, value, **call)


#: The wrong calls of ``dot_product_attention`` (``(..., n, H, d)``), one at a time.
FAULTS = [
    "a 2-D query",
    "keys of another rank",
    "keys of another batch",
    "values of other positions",
    "values of other heads",
    "keys of other features",
    "key heads that do not divide the query's",
    "a bias of other keys",
    "a bias of other heads",
    "a mask of other keys",
    "a mask of other queries",
]


@st.composite
def _attention_calls(draw):
    """``(fault, query, key, value, call)``: a right call (half the time),
    or one wrong in one of the ways of :data:`FAULTS`."""
    gen = np.random.default_rng(draw(st.integers(0, 2**16)))
    fault = draw(st.sampled_from([None] * len(FAULTS) + FAULTS))
    batch = draw(st.sampled_from([(), (2,), (2, 3)]))
    n, m, d = draw(st.integers(1, 4)), draw(st.integers(1, 4)), 4
    heads = draw(st.sampled_from([1, 2, 4]))
    kv_heads = draw(st.sampled_from([h for h in (1, 2, 4) if heads % h == 0]))
    if fault == "key heads that do not divide the query's":
        heads, kv_heads = 3, 2

    def array(*shape):
        return jnp.asarray(gen.standard_normal(shape), jnp.float32)

    key_batch = (*batch[:-1], batch[-1] + 1) if fault == "keys of another batch" and batch else batch
    query = array(*batch, n, heads, d)
    key = array(*key_batch, m, kv_heads, d - (fault == "keys of other features"))
    value = array(
        *key_batch, m + (fault == "values of other positions"), kv_heads + (fault == "values of other heads"), d
    )
    if fault == "keys of another batch" and not batch:
        key, value = key[None], value[None]  # then of another rank too, which Flax refuses as well
    if fault == "a 2-D query":
        query = query.reshape(-1, d)
    if fault == "keys of another rank":
        key, value = key[None], value[None]
    scores = (*batch, heads, n, m)
    call = {}
    for name in ("bias", "mask"):
        shape = draw(st.sampled_from([None, scores, (*batch, 1, 1, m), (n, m), (heads, 1, m)]))
        wrong = {
            "a bias of other keys": ("bias", (*batch, heads, n, m + 1)),
            "a bias of other heads": ("bias", (*batch, heads + 1, n, m)),
            "a mask of other keys": ("mask", (*batch, 1, n, m + 1)),
            "a mask of other queries": ("mask", (n + 1, m)),
        }
        if fault in wrong and wrong[fault][0] == name:
            shape = wrong[fault][1]
        if shape is not None:
            values = array(*shape)
            # Every query keeps its first key: Flax gives a row of no key the mean of the values, attnx zeros.
            call[name] = values if name == "bias" else (values > 0) | (jnp.arange(shape[-1]) == 0)
    if draw(st.booleans()) and n <= m:  # Flax's causal rule, from the first key: every query keeps one
        call["is_causal"] = True
    return fault, query, key, value, call


def _grows(shape, scores):
    """Whether an array of ``shape`` added to the scores makes them larger."""
    try:
        return np.broadcast_shapes(shape, scores) != scores
    except ValueError:
        return False  # not broadcastable at all: refused by both


@settings(max_examples=25, deadline=None)
@given(_attention_calls())
def test_dot_product_attention_refuses_what_flaxs_refuses_and_computes_the_rest_alike(drawn):
    """Differential: over calls right and wrong, ours refuses (a ValueError
    or TypeError, nothing else) exactly those ``nnx.dot_product_attention``
    refuses, and where both compute, the outputs agree.  One difference, by
    design: a bias or mask that would grow the scores (one key, a bias of
    two) Flax broadcasts the scores up to, and attnx refuses."""
    fault, query, key, value, call = drawn
    event(fault or "a right call")
    well_formed = query.ndim >= 3 and key.ndim == query.ndim
    scores = (*query.shape[:-3], query.shape[-2], query.shape[-3], key.shape[-3]) if well_formed else ()
    if well_formed and any(_grows(call[name].shape, scores) for name in ("bias", "mask") if name in call):
        # One key (or query) and a bias or mask of more: Flax broadcasts the scores up to it and
        # attends keys that are not there; attnx refuses to grow them.
        event("a bias or mask that grows the scores")
        with pytest.raises(ValueError, match="must broadcast to the scores' shape"):
            attnx.flax.dot_product_attention(query, key, value, **call)
        return
    try:
        expected = nnx.dot_product_attention(query, key, value, **call)
    except (ValueError, TypeError, AssertionError, IndexError):  # Flax's and jax.numpy's own errors
        expected = None
    event("Flax refuses" if expected is None else "Flax computes")
    if expected is None:
        with pytest.raises((ValueError, TypeError)):
            attnx.flax.dot_product_attention(query, key, value, **call)
        return
    got = attnx.flax.dot_product_attention(query, key, value, **call)
    np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-5)


def test_each_dropout_key_draws_a_mask_of_its_own():
    """The dropout seeds come from the key over [0, 2**31 - 1): a hundred
    keys give a hundred different masks (a seed drawn from fewer than a
    hundred values would repeat one)."""
    q, k, v = _inputs({})
    q, k, v = (x.reshape(3, -1, 4, 2) for x in (q, k, v))

    @jax.jit
    def attend(key):
        return attnx.flax.dot_product_attention(
            q, k, v, dropout_rng=key, dropout_rate=0.5, broadcast_dropout=False, deterministic=False
        )

    outputs = {np.asarray(attend(jax.random.key(i))).tobytes() for i in range(100)}
    assert len(outputs) == 100


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (
            lambda: attnx.flax.MultiHeadAttention(num_heads=2, in_features=8, dropout_rate=0.1, rngs=nnx.Rngs(0)),
            "broadcast_dropout=False",
        ),
        (lambda: attnx.flax.dot_product_attention(*[jnp.ones((1, 2, 2, 4))] * 3, precision="highest"), "precision"),
    ],
    ids=["broadcast dropout", "precision"],
)
def test_what_attnx_cannot_do_exactly_is_refused_by_name(make, words):
    with pytest.raises(ValueError, match=words):
        make()


def test_a_transformer_layer_trains_as_with_flax_s():
    """A one-layer model copying its input sequence, trained with
    nnx.Optimizer (Adam) under nnx.jit: the loss falls, and its curve
    follows the curve of the same model with Flax's layer."""

    class Copier(nnx.Module):
        def __init__(self, attention, rngs):
            self.embed = nnx.Embed(10, 16, rngs=rngs)
            self.attention = attention(num_heads=4, in_features=16, decode=False, rngs=rngs)
            self.head = nnx.Linear(16, 10, rngs=rngs)

        def __call__(self, tokens):
            x = self.embed(tokens)
            return self.head(x + self.attention(x))

    tokens = jnp.asarray(np.random.default_rng(4).integers(0, 10, (16, 8)))
    curves = []
    for attention in (nnx.MultiHeadAttention, attnx.flax.MultiHeadAttention):
        model = Copier(attention, nnx.Rngs(0))
        optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

        @nnx.jit
        def step(model, optimizer):
            def loss(model):
                return optax.softmax_cross_entropy_with_integer_labels(model(tokens), tokens).mean()

            value, grads = nnx.value_and_grad(loss)(model)
            optimizer.update(model, grads)
            return value

        curves.append([float(step(model, optimizer)) for _ in range(30)])
    theirs, ours = curves
    assert ours[-1] < 0.5 * ours[0]
    np.testing.assert_allclose(ours, theirs, rtol=1e-3, atol=1e-3)


def test_import_attnx_does_not_import_flax():
    code = "import sys, attnx; assert 'flax' not in sys.modules; import attnx.flax; assert 'flax' in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
