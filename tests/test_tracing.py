"""attnx under the transforms of JAX and PyTorch, written as their users write them.

The conformance suite checks traced and vectorized calls on every backend
(``conformance/test_transforms.py``); these tests are the user's view:
``jax.jit``/``vmap``/``grad`` with arguments and closures, several host
devices, ``torch.compile(fullgraph=True)`` with the default compiler,
``torch.func.vmap``/``grad``.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import attnx
from attnx._tracing import DYNAMO_CONSTANT_MARK
from attnx.attention import sdpa_generic
from attnx_conformance import reference


def _reference(q, k, v, allowed, scale):
    """The conformance kit's float64 softmax(q k^T s) v with a boolean mask;
    zeros where nothing is allowed."""
    return reference.scaled_dot_product_attention(q, k, v, allowed=allowed, scale=scale)[0]


def _inputs(batch=2, heads=3, n=6, m=6, d=4, seed=0):
    gen = np.random.default_rng(seed)
    q = gen.standard_normal((batch, heads, n, d)).astype(np.float32)
    k = gen.standard_normal((batch, heads, m, d)).astype(np.float32)
    v = gen.standard_normal((batch, heads, m, d)).astype(np.float32)
    lengths = np.array([m, 2, 0, 5][:batch], dtype=np.int32)
    causal = np.arange(m)[None, :] <= np.arange(n)[:, None] + (m - n)
    allowed = causal & (np.arange(m) < lengths[:, None, None, None])
    return q, k, v, lengths, allowed


def _prints_ok(script, **environment):
    """Run ``script`` in a fresh interpreter (with ``environment`` added to
    this one's), which must end well and print "ok"."""
    done = subprocess.run(
        [sys.executable, "-c", script], env={**os.environ, **environment}, capture_output=True, text=True
    )
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


# -- JAX ------------------------------------------------------------------


@pytest.fixture
def jax():
    return pytest.importorskip("jax", reason="the JAX tests need jax (pip install '.[jax]' in attnx's clone)")


def test_jit_with_lengths_and_scale_as_arguments(jax):
    jnp = jax.numpy
    q, k, v, lengths, allowed = _inputs()

    @jax.jit
    def attend(q, k, v, key_lengths, scale):
        return attnx.scaled_dot_product_attention(q, k, v, key_lengths=key_lengths, scale=scale, is_causal=True)

    out = attend(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(lengths), jnp.asarray(0.3))
    assert isinstance(out, jax.Array) and out.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(out), _reference(q, k, v, allowed, 0.3), rtol=2e-5, atol=2e-6)


def test_jit_closing_over_keys_values_and_lengths(jax):
    jnp = jax.numpy
    q, k, v, lengths, allowed = _inputs(n=3)
    keys, values, key_lengths = jnp.asarray(k), jnp.asarray(v), jnp.asarray(lengths)
    attend = jax.jit(lambda q: attnx.scaled_dot_product_attention(q, keys, values, key_lengths=key_lengths))
    out = attend(jnp.asarray(q))
    lengths_only = np.arange(6) < lengths[:, None, None, None]
    np.testing.assert_allclose(
        np.asarray(out), _reference(q, k, v, np.broadcast_to(lengths_only, (2, 3, 3, 6)), 0.5), rtol=2e-5, atol=2e-6
    )


def test_jit_chunked_path_plans_from_shapes(jax):
    """With a small memory budget the chunked algorithm runs under jit too."""
    jnp = jax.numpy
    q, k, v, lengths, allowed = _inputs(n=40, m=40, seed=1)
    with attnx.memory_budget(256):
        attend = jax.jit(
            lambda q, k, v, lengths: attnx.scaled_dot_product_attention(q, k, v, key_lengths=lengths, is_causal=True)
        )
        out = attend(*(jnp.asarray(a) for a in (q, k, v, lengths)))
    np.testing.assert_allclose(np.asarray(out), _reference(q, k, v, allowed, 0.5), rtol=2e-5, atol=2e-6)


def test_jit_loops_over_sdpa_s_tiles(jax):
    """Under jit on the CPU the chunked SDPA runs its tiles in JAX's loops
    (``backends/jax_flash.py``), not as a copy of a tile's operations each:
    a memory budget that cuts the work into many more tiles leaves the
    program's length as it was (unrolled, a causal (1, 8, 8192, 64) call
    compiled in 47 s with 4 MiB tiles), and it computes the same attention."""
    if jax.default_backend() != "cpu":
        pytest.skip("the loops serve the CPU; accelerators run jax.nn.dot_product_attention")
    jnp = jax.numpy
    q = jax.random.normal(jax.random.key(0), (1, 8, 2048, 64), dtype=jnp.float32)

    def attend():  # a new function each time: JAX keeps the trace of one it has seen
        return lambda q: attnx.scaled_dot_product_attention(q, q, q, is_causal=True)

    traced = len(jax.make_jaxpr(attend())(q).eqns)
    with attnx.memory_budget(2**16):
        capped = len(jax.make_jaxpr(attend())(q).eqns)
        expected = np.asarray(jax.jit(attend())(q))
    assert capped == traced
    np.testing.assert_allclose(np.asarray(jax.jit(attend())(q)), expected, rtol=2e-5, atol=2e-6)


def test_jit_loops_over_additive_attention_s_chunks(jax):
    """Under jit additive attention's chunks of queries are one lax.map over
    equal chunks (and a call for the shorter last one), not a copy of the
    chunk's operations each: the program's length does not grow with the
    queries.  Unrolled, (1, 8, 2048, 64) with h = 64 was 14,351 equations,
    its first call took 60 s on 2 cores and later ones 6.4 s; looped, 1.8 s
    and 1.0 s (docs/archive/bench-sessions.md)."""
    jnp = jax.numpy
    gen = np.random.default_rng(7)
    params = {"w_q": gen.standard_normal((4, 6)), "w_k": gen.standard_normal((4, 6)), "w_v": gen.standard_normal(6)}
    on_jax = {name: jnp.asarray(value, dtype=jnp.float32) for name, value in params.items()}

    def attend():  # a new function each time: JAX keeps the trace of one it has seen
        return lambda x: attnx.additive_attention(x, x, x, on_jax)

    lengths = {}
    for n in (10, 100):
        x = gen.standard_normal((2, n, 4))
        # 2 x 10 keys x h = 6 x 4 bytes a query at n = 10: chunks of 3, the last of 1.
        with attnx.memory_budget(3 * 2 * n * 6 * 4):
            lengths[n] = len(jax.make_jaxpr(attend())(jnp.asarray(x, dtype=jnp.float32)).eqns)
            out = jax.jit(attend())(jnp.asarray(x, dtype=jnp.float32))
        expected, _ = reference.additive_attention(x, x, x, params)
        np.testing.assert_allclose(np.asarray(out), expected, rtol=2e-5, atol=2e-6)
    assert lengths[10] == lengths[100]


def test_traced_means_a_program_not_a_lazy_graph(jax):
    """``_checks.traced``: JAX's tracers, not its concrete arrays, nor NumPy's,
    nor Dask's lazy arrays (each task a dispatch of its own)."""
    from attnx import _checks

    seen = []
    jax.jit(lambda x: seen.append(_checks.traced(x)) or x)(jax.numpy.ones(2))
    jax.vmap(lambda x: seen.append(_checks.traced(x)) or x)(jax.numpy.ones(2))
    assert seen == [True, True]
    assert not _checks.traced(jax.numpy.ones(2)) and not _checks.traced(np.ones(2))
    da = pytest.importorskip("dask.array")
    assert not _checks.traced(da.ones(2))


def test_vmap_over_examples_with_their_own_lengths(jax):
    jnp = jax.numpy
    q, k, v, lengths, allowed = _inputs(batch=4)
    per_example = jax.vmap(
        lambda q, k, v, length: attnx.scaled_dot_product_attention(q, k, v, key_lengths=length, is_causal=True)
    )
    out = per_example(*(jnp.asarray(a) for a in (q, k, v, lengths)))
    np.testing.assert_allclose(np.asarray(out), _reference(q, k, v, allowed, 0.5), rtol=2e-5, atol=2e-6)


def test_grad_reaches_inputs_and_scale(jax):
    jnp = jax.numpy
    q, k, v, lengths, _ = _inputs()

    def loss(q, k, v, scale):
        out = attnx.scaled_dot_product_attention(q, k, v, key_lengths=jnp.asarray(lengths), scale=scale)
        return (out**2).sum()

    args = [jnp.asarray(a, dtype=jnp.float32) for a in (q, k, v)] + [jnp.asarray(0.4)]
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args)
    step = 1e-2
    plus = loss(*args[:3], args[3] + step)
    minus = loss(*args[:3], args[3] - step)
    assert float(grads[3]) == pytest.approx(float((plus - minus) / (2 * step)), rel=1e-2)
    assert all(np.isfinite(np.asarray(g)).all() for g in grads)


def test_jax_float64_only_in_x64_mode(jax):
    if jax.config.jax_enable_x64:
        pytest.skip("x64 mode is on in this process")
    with pytest.raises(TypeError, match="float64.*x64"):
        attnx.asarray(np.ones(3), backend="jax")
    with pytest.raises(TypeError, match="float64 is not available on the 'jax' backend"):
        attnx.asarray(np.ones(3), backend="jax", dtype="float64")
    assert "float64" not in attnx._registry.get("jax").float_dtypes


def test_jax_takes_64_bit_integers_only_where_32_bits_hold_them(jax):
    """Without x64 mode JAX makes int32 arrays of int64 data: attnx takes what
    survives that exactly and refuses the rest, as it refuses float64."""
    if jax.config.jax_enable_x64:
        pytest.skip("x64 mode is on in this process")
    kept = [np.array([-(2**31), 0, 2**31 - 1]), np.zeros((0, 3), np.int64), np.array([7], np.uint64)]
    for data in kept:
        made = attnx.asarray(data, backend="jax")
        assert made.shape == data.shape and made.dtype.itemsize == 4
        np.testing.assert_array_equal(np.asarray(made), data)
    for data in (np.array([0, 2**31]), np.array([-(2**31) - 1, 0]), np.array([2**40], np.uint64)):
        with pytest.raises(TypeError, match=r"makes u?int64 arrays only in x64 mode"):
            attnx.asarray(data, backend="jax")
    assert attnx.asarray(np.array([2**31]), backend="jax", dtype="float32").dtype == jax.numpy.float32


def test_jit_on_a_host_with_two_devices(jax):
    """Arrays made outside a jitted function, on a host with several devices."""
    script = textwrap.dedent(
        """
        import jax, jax.numpy as jnp, numpy as np, attnx
        assert len(jax.devices()) == 2, jax.devices()
        gen = np.random.default_rng(0)
        q, k, v = (jnp.asarray(gen.standard_normal((2, 4, 3)), dtype=jnp.float32) for _ in range(3))
        mask = jnp.asarray(gen.random((4, 4)) < 0.7)
        eager = attnx.scaled_dot_product_attention(q, k, v, mask=mask)
        jitted = jax.jit(lambda q: attnx.scaled_dot_product_attention(q, k, v, mask=mask))(q)
        np.testing.assert_allclose(np.asarray(jitted), np.asarray(eager), rtol=1e-5, atol=1e-6)
        other = jax.device_put(k, jax.devices()[1])
        try:
            attnx.scaled_dot_product_attention(q, other, v)
        except ValueError as error:
            assert "two devices" in str(error), error
        else:
            raise AssertionError("arrays on two devices were accepted")
        print("ok")
        """
    )
    _prints_ok(script, XLA_FLAGS="--xla_force_host_platform_device_count=2")


# -- PyTorch --------------------------------------------------------------


@pytest.fixture
def torch():
    return pytest.importorskip("torch", reason="the PyTorch tests need torch")


def test_torch_compile_fullgraph_sdpa_with_masks(torch):
    q, k, v, lengths, allowed = _inputs()
    gen = np.random.default_rng(3)
    task = gen.random((6, 6)) < 0.8

    @torch.compile(fullgraph=True)
    def attend(q, k, v, mask, key_lengths, scale):
        return attnx.scaled_dot_product_attention(
            q, k, v, mask=mask, key_lengths=key_lengths, is_causal=True, scale=scale
        )

    tensors = [torch.from_numpy(a) for a in (q, k, v)]
    out = attend(*tensors, torch.from_numpy(task), torch.from_numpy(lengths).long(), torch.tensor(0.3))
    np.testing.assert_allclose(out.numpy(), _reference(q, k, v, allowed & task, 0.3), rtol=2e-5, atol=2e-6)


def test_torch_compile_fullgraph_multi_head_attention(torch):
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8)
    lengths = torch.tensor([5, 3])
    params = attnx.init_multi_head_params(8, 2, seed=0, backend="torch")

    def layer(x, lengths):
        return attnx.multi_head_attention(x, x, x, params, num_heads=2, key_lengths=lengths, is_causal=True)

    compiled = torch.compile(layer, fullgraph=True)
    torch.testing.assert_close(compiled(x, lengths), layer(x, lengths), rtol=2e-5, atol=2e-6)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # the reference, eager
def test_torch_compile_fullgraph_flex_attention_as_pytorch_s_users_write_it(torch):
    """A block mask made outside, a score_mod made inside the compiled
    function (a closure over a tensor, as in a module's forward), rows of
    blocks joined into steps: equal to PyTorch's own flex_attention with the
    same mods.  Dynamo could trace neither ``max(..., default=)`` nor a
    store keyed by a closure made while it traced."""
    from torch.nn.attention import flex_attention as pytorch

    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 300, 16) for _ in range(3))
    slopes = torch.tensor([0.5, 0.25])
    window = attnx.create_block_mask(attnx.mods.sliding_window(64), None, None, 300, 300, backend="torch")

    @torch.compile(fullgraph=True)
    def attend(q, k, v):
        def alibi(score, b, h, q_idx, kv_idx):
            return score - slopes[h] * (q_idx - kv_idx)

        return attnx.flex_attention(q, k, v, score_mod=alibi, block_mask=window)

    def in_window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx <= 64)

    expected = pytorch.flex_attention(
        q,
        k,
        v,
        score_mod=lambda score, b, h, q_idx, kv_idx: score - slopes[h] * (q_idx - kv_idx),
        block_mask=pytorch.create_block_mask(in_window, None, None, 300, 300, device="cpu"),
    )
    torch.testing.assert_close(attend(q, k, v), expected, rtol=2e-5, atol=2e-6)


@pytest.mark.filterwarnings("error::UserWarning")
def test_torch_compile_in_a_process_that_also_ran_numpy(torch, monkeypatch):
    """attnx's dtype caches hold NumPy's dtypes once NumPy has run; a
    compiled PyTorch call must not trace through them (PyTorch 2.11's
    compiler can't hash a NumPy dtype), nor through array-api-compat's
    ``lru_cache`` when tensors meet attnx first in a compiled call (dynamo
    warned of it)."""
    from attnx import _masking

    monkeypatch.setattr(_masking, "_WRITEABLE", {})  # as in a process where no tensor ran eagerly
    scores = np.random.default_rng(4).standard_normal((2, 5, 9))
    lengths = np.array([5, 2])
    expected = attnx.masked_softmax(scores, key_lengths=lengths)
    compiled = torch.compile(lambda s, n: attnx.masked_softmax(s, key_lengths=n), fullgraph=True)
    np.testing.assert_allclose(compiled(torch.from_numpy(scores), torch.from_numpy(lengths)).numpy(), expected)


_COMPILED_FIRST = """
import torch, attnx, attnx.torch
from attnx import mods
q, k, v = (torch.randn(1, 2, 128, 16, requires_grad=True) for _ in range(3))
slopes = torch.tensor([0.5, 0.25], requires_grad=True)
causal = attnx.create_block_mask(mods.causal, None, None, 128, 128, block_size=64, backend="torch")
attention = torch.compile(lambda q, k, v, s: attnx.flex_attention(q, k, v, mods.alibi(s), causal), fullgraph=True)
attention(q, k, v, slopes).sum().backward()
assert all(t.grad is not None for t in (q, k, v, slopes))
layer = attnx.torch.MultiheadAttention(32, 4, batch_first=True, num_kv_heads=2, dropout=0.1)
x = torch.randn(2, 20, 32)
torch.compile(lambda x: layer(x, x, x, need_weights=False)[0], fullgraph=True)(x).sum().backward()
assert all(p.grad is not None for p in layer.parameters())
"""


def test_first_calls_compiled_in_a_fresh_process(torch):
    """Calls whose first run in the process is compiled (fullgraph), with
    gradients: Dynamo once refused to trace the class statement of attnx's
    ``autograd.Function`` (made on first use), to read the scores that a
    mod's closed-over table made (whether they could be updated in place),
    and to read a ``Parameter`` class's module (who owns the array)."""
    result = subprocess.run([sys.executable, "-c", _COMPILED_FIRST], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]


def test_torch_func_vmap_and_grad(torch):
    q, k, v, lengths, allowed = _inputs(batch=4)
    q, k, v = (torch.from_numpy(a).double() for a in (q, k, v))
    scales = torch.tensor([0.3, 0.5, 0.7, 1.1], dtype=torch.float64)

    def attend(q, k, v, length, scale):
        return attnx.scaled_dot_product_attention(q, k, v, key_lengths=length, scale=scale, is_causal=True)

    out = torch.func.vmap(attend)(q, k, v, torch.from_numpy(lengths).long(), scales)
    for i in range(4):
        expected = _reference(q[i].numpy(), k[i].numpy(), v[i].numpy(), allowed[i], float(scales[i]))
        np.testing.assert_allclose(out[i].numpy(), expected, rtol=1e-10, atol=1e-12)
    # A tensor scale keeps its gradient (it used to go through float() and lose it).
    length = torch.tensor(lengths[0]).long()
    grad = torch.func.grad(lambda s: attend(q[0], k[0], v[0], length, s).square().sum())(scales[0])
    leaf = scales[0].clone().requires_grad_(True)
    attend(q[0], k[0], v[0], length, leaf).square().sum().backward()
    assert grad.item() != 0.0 and grad.item() == pytest.approx(leaf.grad.item(), rel=1e-12)


def test_a_numpy_user_s_process_imports_neither_pytorch_nor_jax():
    """``_tracing.compiling`` looks PyTorch up, and the JAX backend's ``owns``
    JAX, never importing them: a NumPy user's arrays have one owner, and
    their calls keep their plans (a compiled graph's don't)."""
    script = textwrap.dedent(
        """
        import sys
        import numpy as np
        import attnx
        from attnx import _tracing
        from attnx._registry import registry
        q = np.ones((1, 2, 4, 3), np.float32)
        for _ in range(3):  # the first meets NumPy's type, the second plans, the third runs the plan
            attnx.scaled_dot_product_attention(q, q, q)
        assert not _tracing.compiling()
        assert "torch" not in sys.modules and "jax" not in sys.modules, sorted(sys.modules)
        assert [backend.name for backend in registry.owners_of(q)] == ["numpy"]
        assert len(registry._plans) == 1, registry._plans
        print("ok")
        """
    )
    _prints_ok(script)


def test_trace_time_mark_is_torchs_own(torch):
    """attnx marks its bookkeeping for dynamo without importing torch: the mark
    must stay the one ``torch.compiler.assume_constant_result`` sets."""

    def function():
        return 1

    torch.compiler.assume_constant_result(function)
    assert getattr(function, DYNAMO_CONSTANT_MARK, False) is True


@pytest.fixture
def jax_native(jax, monkeypatch):
    """The JAX backend's native, which runs ``jax.nn.dot_product_attention`` on
    accelerators, allowed on the CPU: a list that records, call by call,
    whether it computed (True) or declined (False)."""
    from attnx_backends import jax_backend

    monkeypatch.setattr(jax_backend, "NATIVE_PLATFORMS", frozenset({"cpu"}))
    routed = []

    def recorded(**arguments):
        result = jax_backend._scaled_dot_product_attention(**arguments)
        routed.append(result is not NotImplemented)
        return result

    monkeypatch.setattr(attnx._registry.get("jax"), "_natives", {"scaled_dot_product_attention": recorded})
    return routed


#: (query, key, value) shapes and is_causal the JAX native computes as attnx does.
ROUTED = [
    ((2, 3, 6, 4), (2, 3, 6, 4), (2, 3, 6, 4), False),
    ((2, 3, 6, 4), (2, 3, 6, 4), (2, 3, 6, 4), True),
    ((1, 2, 3, 4), (1, 2, 7, 4), (1, 2, 7, 4), False),
    ((1, 2, 7, 4), (1, 2, 3, 4), (1, 2, 3, 4), False),
    # grouped heads as enable_gqa lays them out: 3 query heads per key head
    ((2, 2, 3, 5, 4), (2, 2, 1, 5, 4), (2, 2, 1, 5, 4), True),
]

#: Calls it declines, since JAX would compute something else or refuse them,
#: each with what makes it differ.
DECLINED = {
    "causal with more keys": (((1, 2, 3, 4), (1, 2, 7, 4), (1, 2, 7, 4)), {"is_causal": True}),
    "causal with fewer keys": (((1, 2, 7, 4), (1, 2, 3, 4), (1, 2, 3, 4)), {"is_causal": True}),
    "a boolean mask": (((1, 2, 6, 4),) * 3, {"mask": np.tri(6, dtype=bool)}),
    "an additive mask": (((1, 2, 6, 4),) * 3, {"mask": np.zeros((6, 6), np.float32)}),
    "key_lengths": (((2, 2, 6, 4),) * 3, {"key_lengths": np.array([6, 2], np.int32)}),
    "returned weights": (((1, 2, 6, 4),) * 3, {"return_weights": True}),
    "three axes": (((2, 6, 4),) * 3, {}),
    "two axes": (((6, 4),) * 3, {}),
    "five axes": (((1, 1, 2, 6, 4),) * 3, {}),
    "a broadcast batch": (((1, 2, 6, 4), (3, 2, 6, 4), (3, 2, 6, 4)), {}),
    "broadcast heads": (((1, 2, 6, 4), (1, 1, 6, 4), (1, 1, 6, 4)), {}),
    "values with their own batch": (((1, 2, 6, 4), (1, 2, 6, 4), (3, 2, 6, 4)), {}),
    "values broadcast over the batch": (((3, 2, 6, 4), (3, 2, 6, 4), (1, 2, 6, 4)), {}),
    "a wider value": (((1, 2, 6, 4), (1, 2, 6, 4), (1, 2, 6, 5)), {}),
    "no queries": (((1, 2, 0, 4), (1, 2, 6, 4), (1, 2, 6, 4)), {}),
    "no keys": (((1, 2, 6, 4), (1, 2, 0, 4), (1, 2, 0, 4)), {}),
}


def _arrays(jnp, shapes, dtype="float32", seed=0):
    gen = np.random.default_rng(seed)
    data = [gen.standard_normal(shape).astype(np.float32) for shape in shapes]
    return data, [jnp.asarray(a, dtype=dtype) for a in data]


@pytest.mark.parametrize("query_shape, key_shape, value_shape, is_causal", ROUTED)
def test_jax_native_computes_attnx_s_function_where_it_routes(
    jax_native, jax, query_shape, key_shape, value_shape, is_causal
):
    """Where attnx hands a call to ``jax.nn.dot_product_attention`` it must
    give attnx's result: eager, jitted with the scale an argument (folded
    into the queries), vmapped, and its gradients."""
    jnp = jax.numpy
    (q, k, v), arrays = _arrays(jnp, (query_shape, key_shape, value_shape))
    causal = np.tri(query_shape[-2], key_shape[-2], dtype=bool) if is_causal else None
    for scale in (None, 0.3):
        out = attnx.scaled_dot_product_attention(*arrays, is_causal=is_causal, scale=scale)
        expected = reference.scaled_dot_product_attention(q, k, v, allowed=causal, scale=scale)[0]
        np.testing.assert_allclose(np.asarray(out), expected, rtol=2e-5, atol=2e-6)
    attend = jax.jit(
        lambda q, k, v, scale: attnx.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)
    )
    out = attend(*arrays, jnp.asarray(0.7))
    expected = reference.scaled_dot_product_attention(q, k, v, allowed=causal, scale=0.7)[0]
    np.testing.assert_allclose(np.asarray(out), expected, rtol=2e-5, atol=2e-6)
    per_example = jax.vmap(lambda q, k, v: attnx.scaled_dot_product_attention(q, k, v, is_causal=is_causal))
    np.testing.assert_allclose(
        np.asarray(per_example(*(a[None] for a in arrays))[0]),
        reference.scaled_dot_product_attention(q, k, v, allowed=causal)[0],
        rtol=2e-5,
        atol=2e-6,
    )
    assert jax_native == [True] * 4  # each call above, vmap's too, ran the native

    def loss(attention):
        return lambda q, k, v: (attention(query=q, key=k, value=v) ** 2).sum()

    # scale 0.5: attnx's default, 1 / sqrt(d_k) with d_k = 4
    arguments = dict(mask=None, key_lengths=None, is_causal=is_causal, scale=0.5, return_weights=False)
    gradients = jax.grad(loss(functools.partial(attnx.scaled_dot_product_attention, is_causal=is_causal)), (0, 1, 2))
    generic = jax.grad(loss(functools.partial(sdpa_generic, jnp, **arguments)), (0, 1, 2))
    for routed, own in zip(gradients(*arrays), generic(*arrays)):
        np.testing.assert_allclose(np.asarray(routed), np.asarray(own), rtol=1e-4, atol=1e-5)
    assert jax_native == [True] * 5


@pytest.mark.parametrize("why", sorted(DECLINED))
def test_jax_native_declines_what_jax_computes_otherwise(jax_native, jax, why):
    """A fully masked row is zeros in attnx and an average in JAX, whose causal
    mask aligns to the first key, and which neither returns weights nor
    broadcasts: such calls go to attnx's own algorithm, and are right."""
    jnp = jax.numpy
    shapes, options = DECLINED[why]
    (q, k, v), arrays = _arrays(jnp, shapes)
    n, m = shapes[0][-2], shapes[1][-2]
    allowed = np.ones((n, m), bool)
    if options.get("is_causal"):
        allowed = np.tri(n, m, m - n, dtype=bool)  # aligned to the last key, as PyTorch's is
    mask = options.get("mask")
    additive = None
    if mask is not None and mask.dtype == bool:
        allowed = mask
    elif mask is not None:
        additive = mask
    if "key_lengths" in options:
        allowed = allowed & (np.arange(m) < options["key_lengths"][:, None, None, None])
    given = {name: jnp.asarray(value) if isinstance(value, np.ndarray) else value for name, value in options.items()}
    result = attnx.scaled_dot_product_attention(*arrays, **given)
    expected, weights = reference.scaled_dot_product_attention(q, k, v, allowed=allowed, additive=additive)
    if options.get("return_weights"):
        result, returned = result
        np.testing.assert_allclose(np.asarray(returned), weights, rtol=2e-5, atol=2e-6)
    np.testing.assert_allclose(np.asarray(result), expected, rtol=2e-5, atol=2e-6)
    assert jax_native == [False]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_jax_native_declines_half_precision(jax_native, jax, dtype):
    """JAX computes half precision in its own dtype, attnx in float32."""
    jnp = jax.numpy
    (q, k, v), arrays = _arrays(jnp, ((1, 2, 6, 4),) * 3, dtype=dtype)
    out = attnx.scaled_dot_product_attention(*arrays)
    assert out.dtype == jnp.dtype(dtype) and jax_native == [False]
    narrowed = [np.asarray(a.astype(jnp.float32)) for a in arrays]
    expected = reference.scaled_dot_product_attention(*narrowed)[0]
    np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), expected, rtol=2e-2, atol=2e-2)


def test_jax_native_declines_on_the_cpu(jax):
    """On the CPU attnx's own algorithm, jitted, was the faster."""
    from attnx_backends import jax_backend

    if jax.default_backend() != "cpu":
        pytest.skip(f"JAX runs on {jax.default_backend()} here")
    arrays = _arrays(jax.numpy, ((1, 2, 6, 4),) * 3)[1]
    arguments = dict(mask=None, key_lengths=None, is_causal=False, scale=0.5, return_weights=False)
    assert (
        jax_backend._scaled_dot_product_attention(query=arrays[0], key=arrays[1], value=arrays[2], **arguments)
        is NotImplemented
    )


def test_jax_synchronize_waits_for_queued_work(jax):
    backend = attnx._registry.get("jax")
    x = jax.numpy.ones((1024, 1024))
    results = [x @ x for _ in range(4)]  # dispatched asynchronously
    backend.synchronize()
    assert all(result.is_ready() for result in results)
    backend.synchronize("cpu:0")  # a device as `attnx backends` lists it
