"""JAX's tiled SDPA in its own loops (backends/jax_flash.py): the same
function as attnx's algorithm, and a jitted backward that keeps no tile."""

from __future__ import annotations

import numpy as np
import pytest

import attnx
from attnx.attention import sdpa_generic
from attnx_conformance import reference

jax = pytest.importorskip("jax")
jnp = jax.numpy

SHAPE = (1, 2, 8192, 64)


def _temporaries(attention, shape):
    """XLA's temporaries for the jitted gradient of ``attention``'s sum."""
    inputs = [jnp.ones(shape, jnp.float32) for _ in range(3)]
    gradient = jax.jit(jax.grad(lambda q, k, v: attention(q, k, v).sum(), (0, 1, 2)))
    return gradient.lower(*inputs).compile().memory_analysis().temp_size_in_bytes


def _generic(q, k, v, *, is_causal, scale, chunks=None):
    """attnx's algorithm itself, in attnx's tiles where ``chunks`` are given."""
    arguments = {"mask": None, "key_lengths": None, "return_weights": False, "chunks": chunks}
    return sdpa_generic(jnp, query=q, key=k, value=v, is_causal=is_causal, scale=scale, **arguments)


def _scores_bytes(shape):
    """One float32 score matrix of ``(B, H, n, d)`` inputs."""
    return shape[0] * shape[1] * shape[2] ** 2 * 4


def test_the_jitted_backward_keeps_no_tile():
    """Under ``jax.jit(jax.grad(...))`` the causal SDPA's temporaries stay
    within the issue's 64 MiB at (1, 2, 8192, 64), an eighth of one score
    matrix; attnx's tiles unrolled into the program and differentiated by
    JAX hold more than the matrix itself (at a smaller size, which compiles
    faster), so the measure can tell."""
    if jax.default_backend() != "cpu":
        pytest.skip("the loops serve the CPU; accelerators run jax.nn.dot_product_attention")
    flash = _temporaries(lambda q, k, v: attnx.scaled_dot_product_attention(q, k, v, is_causal=True), SHAPE)
    assert flash <= 64 * 2**20, f"{flash / 2**20:.1f} MiB of temporaries"
    small = (1, 2, 1024, 64)
    unrolled = _temporaries(lambda q, k, v: _generic(q, k, v, is_causal=True, scale=0.125, chunks=(256, 1024)), small)
    assert unrolled > _scores_bytes(small) / 2, f"{unrolled / 2**20:.1f} MiB: the measure should see the tiles"


@pytest.mark.parametrize(("n", "m", "is_causal"), [(9, 4, True), (5, 7, False)])
def test_blocks_that_divide_nothing_give_attnxs_function(n, m, is_causal):
    """Padded blocks, rows with no key (causal n > m): the outputs and the
    gradients of the generic algorithm."""
    from attnx_backends.jax_flash import attention

    rng = np.random.default_rng(n * m)
    q, k, v, cotangent = (
        jnp.asarray(rng.standard_normal(shape), jnp.float32)
        for shape in ((2, 3, n, 4), (2, 3, m, 4), (2, 3, m, 5), (2, 3, n, 5))
    )

    flash_output, flash_backward = jax.vjp(
        lambda q, k, v: attention(q, k, v, scale=0.5, is_causal=is_causal, blocks=(3, 2)), q, k, v
    )
    output, backward = jax.vjp(lambda q, k, v: _generic(q, k, v, is_causal=is_causal, scale=0.5), q, k, v)
    np.testing.assert_allclose(flash_output, output, rtol=1e-5, atol=1e-6)
    for got, expected in zip(flash_backward(cotangent), backward(cotangent)):
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(("n", "m"), [(12, 12), (8, 12)], ids=["n = m", "n < m"])
def test_the_causal_loops_never_visit_a_block_wholly_in_the_future(n, m):
    """The forward reads, for each block of queries, only the blocks of keys
    its last query reaches, and the backward visits, for each block of keys,
    only the blocks of queries that reach it: with NaN in the values of the
    last block of keys (blocks of 4), the rows that never reach it keep
    their finite outputs and query gradients (a visited block, all of it
    masked, would have made them NaN: 0 times NaN)."""
    from attnx_backends.jax_flash import attention

    rng = np.random.default_rng(n + m)
    q, cotangent = (jnp.asarray(rng.standard_normal((1, 2, n, 4)), jnp.float32) for _ in range(2))
    k, v = (jnp.asarray(rng.standard_normal((1, 2, m, 4)), jnp.float32) for _ in range(2))
    poisoned = v.at[..., m - 4 :, :].set(jnp.nan)
    rows = n - 4  # the rows whose last key, i + m - n, lies before the last block

    def attend(q, k, v):
        return attention(q, k, v, scale=0.5, is_causal=True, blocks=(4, 4))

    results = []
    for values in (v, poisoned):
        output, backward = jax.vjp(attend, q, k, values)
        results.append((np.asarray(output)[..., :rows, :], np.asarray(backward(cotangent)[0])[..., :rows, :]))
    (output, d_query), (poisoned_output, poisoned_d_query) = results
    assert np.isfinite(poisoned_output).all() and np.isfinite(poisoned_d_query).all()
    np.testing.assert_array_equal(poisoned_output, output)
    np.testing.assert_array_equal(poisoned_d_query, d_query)


RULES = {  # a call's masks, by (B, H, n, m), each with rows that attend nothing, and how the reference reads them
    "lengths": lambda rng, b, h, n, m: ({"key_lengths": np.array([m // 2, 0])}, {"lengths_per": "batch"}),
    "lengths_per_query": lambda rng, b, h, n, m: (
        {"key_lengths": rng.integers(0, m + 1, (b, h, n)) * (np.arange(n) != 2)},
        {"lengths_per": "query"},
    ),
    "causal_lengths": lambda rng, b, h, n, m: (
        {"key_lengths": np.array([m - 1, 0]), "is_causal": True},
        {"lengths_per": "batch"},
    ),
    "aligned_lengths": lambda rng, b, h, n, m: (
        {"key_lengths": np.array([m, n - 3]), "is_causal": True, "causal_align": "key_lengths"},
        {"lengths_per": "batch"},
    ),
    "padding_mask": lambda rng, b, h, n, m: (
        {"mask": (rng.random((b, 1, 1, m)) < 0.7) & (np.arange(b) == 0)[:, None, None, None]},
        {},
    ),
    "shared_mask": lambda rng, b, h, n, m: ({"mask": (rng.random((n, m)) < 0.6) & (np.arange(n) != 2)[:, None]}, {}),
    "mask_per_slice": lambda rng, b, h, n, m: (
        {"mask": (rng.random((b, h, n, m)) < 0.6) & (np.arange(n) != 2)[:, None]},
        {},
    ),
}


@pytest.mark.parametrize("grouped", [False, True], ids=["heads", "grouped"])
@pytest.mark.parametrize("rule", list(RULES))
def test_masks_lengths_and_grouped_heads_run_in_the_loops(monkeypatch, rule, grouped):
    """Lengths in every layout, both causal alignments, boolean masks and
    grouped heads run in the loops too (blocks of 4 x 3 over n = 9, m = 13):
    under ``jax.jit`` the outputs and ``jax.vjp``'s cotangents are the
    float64 reference's, with zeros for a row that attends nothing."""
    if jax.default_backend() != "cpu":
        pytest.skip("the loops serve the CPU; accelerators run jax.nn.dot_product_attention")
    import attnx_backends.jax_backend as jax_backend
    import attnx_backends.jax_flash as jax_flash

    calls = []
    attention = jax_flash.attention
    monkeypatch.setattr(jax_flash, "attention", lambda *a, **k: calls.append(k) or attention(*a, **k))
    monkeypatch.setattr(jax_backend, "FLASH_BLOCKS", (4, 3))
    b, h, n, m, d = 2, 4, 9, 13, 4
    kv_heads = 2 if grouped else h
    rng = np.random.default_rng(list(RULES).index(rule))
    q, cotangent = (rng.standard_normal((b, h, n, d)) for _ in range(2))
    k, v = (rng.standard_normal((b, kv_heads, m, d)) for _ in range(2))
    options, read_as = RULES[rule](rng, b, h, n, m)
    on_jax = {name: jnp.asarray(value) if isinstance(value, np.ndarray) else value for name, value in options.items()}

    def attend(q, k, v):
        return attnx.scaled_dot_product_attention(q, k, v, enable_gqa=grouped, **on_jax)

    with attnx.memory_budget(256):  # attnx's plan cuts the work into tiles, which the loops take
        output, backward = jax.vjp(jax.jit(attend), *(jnp.asarray(a, jnp.float32) for a in (q, k, v)))
        grads = backward(jnp.asarray(cotangent, jnp.float32))
    assert calls, "the loops should take the call"  # grouped heads, or a group's heads folded into rows

    allowed = reference.allowed_mask(
        n,
        m,
        batch_shape=(b, h),
        mask=options.get("mask"),
        key_lengths=options.get("key_lengths"),
        is_causal=options.get("is_causal", False),
        causal_align=options.get("causal_align", "bottom_right"),
        **read_as,
    )
    assert not allowed.any(axis=-1).all(), "some row should attend nothing"
    k_all, v_all = (np.repeat(a, h // kv_heads, axis=1) for a in (k, v))
    expected, _ = reference.scaled_dot_product_attention(q, k_all, v_all, allowed=allowed)
    expected_grads = reference.scaled_dot_product_attention_vjp(q, k_all, v_all, cotangent, allowed=allowed)
    np.testing.assert_allclose(np.asarray(output), expected, rtol=2e-5, atol=2e-5)
    for got, name in zip(grads, ("query", "key", "value")):
        want = expected_grads[name]
        if name != "query":  # each key/value head's cotangent, summed over the query heads that read it
            want = want.reshape(b, kv_heads, h // kv_heads, m, d).sum(axis=2)
        np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5, err_msg=name)


@pytest.mark.parametrize(
    "options",
    [
        {"key_lengths": np.array([SHAPE[2] // 2]), "is_causal": True},
        {"mask": np.arange(SHAPE[2]) < SHAPE[2] - 100},
        {"enable_gqa": True, "is_causal": True},
    ],
    ids=["causal_lengths", "padding_mask", "grouped"],
)
def test_the_jitted_backward_of_masked_and_grouped_calls_keeps_no_tile(options):
    """Padding (lengths or a mask) and grouped heads within the same 64 MiB
    at (1, 2, 8192, 64): attnx's unrolled tiles, differentiated by JAX,
    held 643 MiB, 1,050 MiB and 598 MiB at (2, 8, 2048, 64)."""
    if jax.default_backend() != "cpu":
        pytest.skip("the loops serve the CPU; accelerators run jax.nn.dot_product_attention")
    on_jax = {name: jnp.asarray(value) if isinstance(value, np.ndarray) else value for name, value in options.items()}
    grouped = options.get("enable_gqa", False)
    inputs = [jnp.ones(SHAPE, jnp.float32)] + [jnp.ones((1, 1 if grouped else 2, *SHAPE[2:]), jnp.float32)] * 2
    gradient = jax.jit(jax.grad(lambda q, k, v: attnx.scaled_dot_product_attention(q, k, v, **on_jax).sum(), (0, 1, 2)))
    held = gradient.lower(*inputs).compile().memory_analysis().temp_size_in_bytes
    assert held <= 64 * 2**20, f"{held / 2**20:.1f} MiB of temporaries"


def _dense_flex(q, k, v, score_mod, mask_mod, scale):
    """FlexAttention from its definition, dense, in JAX (differentiated by
    ``jax.grad`` as a reference): query head ``h`` reads key/value head
    ``h // G``, the score_mod on the scaled scores, the mask_mod after, and
    zeros for a row that attends nothing."""
    batch, heads, n, _ = q.shape
    group = heads // k.shape[1]
    k, v = (jnp.repeat(a, group, axis=1) for a in (k, v))
    scores = jnp.einsum("bhnd,bhmd->bhnm", q, k) * scale
    b, h, i, j = (
        jnp.arange(batch).reshape(-1, 1, 1, 1),
        jnp.arange(heads).reshape(1, -1, 1, 1),
        jnp.arange(n).reshape(1, 1, -1, 1),
        jnp.arange(k.shape[2]).reshape(1, 1, 1, -1),
    )
    if score_mod is not None:
        scores = score_mod(scores, b, h, i, j)
    if mask_mod is not None:
        scores = jnp.where(mask_mod(b, h, i, j), scores, -jnp.inf)
    largest = scores.max(axis=-1, keepdims=True)
    exponentials = jnp.exp(scores - jnp.where(jnp.isfinite(largest), largest, 0.0))
    total = exponentials.sum(axis=-1, keepdims=True)
    return jnp.einsum("bhnm,bhmd->bhnd", exponentials / jnp.where(total > 0, total, 1.0), v)


def _flex_case(name, rng):
    """``(heads, kv_heads, batch_sizes_of_the_block_mask, mask_mod, table, make_score_mod)``."""
    from attnx import mods

    def causal_but_row_two(b, h, q_idx, kv_idx):  # a row that attends nothing
        return (kv_idx <= q_idx) & (q_idx != 2)

    def shifted_by_batch(b, h, q_idx, kv_idx):  # reads b: a block mask per batch entry
        return kv_idx <= q_idx + 6 * b

    def own_mod(table):  # closes over a real array, and masks with -inf
        return lambda score, b, h, q_idx, kv_idx: jnp.where(kv_idx > q_idx + 9, -jnp.inf, score * table[h])

    ids = jnp.asarray(np.repeat(np.arange(4), 7)[:28])
    cases = {
        "causal": (4, 4, (None, None), causal_but_row_two, None, None),
        "window_alibi": (4, 4, (None, None), mods.sliding_window(5), rng.uniform(0.1, 1, 4), mods.alibi),
        "relative_bias": (4, 4, None, None, rng.standard_normal((4, 7)), mods.relative_bias),
        "grouped_soft_cap": (4, 2, (None, None), mods.causal, None, lambda _: mods.soft_cap(2.0)),
        "per_batch_own_mod": (4, 2, (2, None), shifted_by_batch, rng.uniform(0.5, 2, 4), own_mod),
        "document": (2, 2, (None, None), mods.document(ids), None, None),
    }
    return cases[name]


@pytest.mark.parametrize(
    "name", ["causal", "window_alibi", "relative_bias", "grouped_soft_cap", "per_batch_own_mod", "document"]
)
def test_flex_attention_runs_in_the_loops_when_traced(monkeypatch, name):
    """Traced on the CPU, ``flex_attention`` runs in the loops: the blocks
    the block mask leaves non-empty (blocks of 8 over n = 20, m = 28: empty,
    partial and full ones), mods of attnx and of the user's own (closing
    over a real array, giving -inf), grouped heads, a row that attends
    nothing.  Under ``jax.jit(jax.grad(...))`` the output and the gradients
    of the query, key, value and the score_mod's table equal those of the
    dense formula differentiated by JAX."""
    if jax.default_backend() != "cpu":
        pytest.skip("the loops serve the CPU")
    import attnx_backends.jax_flash as jax_flash

    taken = []
    flex_loops = jax_flash.flex_loops
    monkeypatch.setattr(jax_flash, "flex_loops", lambda *a: taken.append(a) or flex_loops(*a))
    rng = np.random.default_rng(len(name))
    heads, kv_heads, sizes, mask_mod, table, make_mod = _flex_case(name, rng)
    batch, n, m, d = 2, 20, 28, 4
    q = jnp.asarray(rng.standard_normal((batch, heads, n, d)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((batch, kv_heads, m, d)), jnp.float32) for _ in range(2))
    table = jnp.asarray(np.zeros(1) if table is None else table, jnp.float32)
    block_mask = None
    if sizes is not None:
        block_mask = attnx.create_block_mask(mask_mod, *sizes, n, m, block_size=8, backend="jax")

    def loss(attend, q, k, v, table):
        score_mod = None if make_mod is None else make_mod(table)
        output = attend(q, k, v, score_mod)
        return (output * jnp.cos(output)).sum(), output

    def ours(q, k, v, score_mod):
        return attnx.flex_attention(q, k, v, score_mod, block_mask, enable_gqa=heads != kv_heads)

    def dense(q, k, v, score_mod):
        return _dense_flex(q, k, v, score_mod, mask_mod, 0.5)

    differentiated = (0, 1, 2, 3)
    with attnx.memory_budget(256):  # scores larger than one block: the loops take them
        gradient = jax.jit(jax.value_and_grad(lambda *a: loss(ours, *a), differentiated, has_aux=True))
        (_, got), grads = gradient(q, k, v, table)
    (_, want), expected = jax.value_and_grad(lambda *a: loss(dense, *a), differentiated, has_aux=True)(q, k, v, table)
    assert taken, "the loops should take the traced call"
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-5, atol=2e-5)
    for name_of, g, e in zip(("query", "key", "value", "table"), grads, expected):
        np.testing.assert_allclose(np.asarray(g), np.asarray(e), rtol=1e-4, atol=2e-5, err_msg=name_of)


@pytest.mark.parametrize("with_alibi", [False, True], ids=["causal", "causal_alibi"])
def test_the_jitted_backward_of_flex_attention_keeps_no_tile(with_alibi):
    """``flex_attention`` with a causal block mask (and ALiBi, whose slopes
    get their gradient) within the same 64 MiB at (1, 2, 8192, 64): attnx's
    tiles unrolled into the program held 261-275 MiB at (1, 2, 4096, 64)."""
    if jax.default_backend() != "cpu":
        pytest.skip("the loops serve the CPU")
    from attnx import mods

    n = SHAPE[2]
    block_mask = attnx.create_block_mask(mods.causal, None, None, n, n, backend="jax")

    def loss(q, k, v, slopes):
        score_mod = mods.alibi(slopes) if with_alibi else None
        return attnx.flex_attention(q, k, v, score_mod, block_mask).sum()

    inputs = [jnp.ones(SHAPE, jnp.float32) for _ in range(3)] + [jnp.ones(SHAPE[1], jnp.float32)]
    gradient = jax.jit(jax.grad(loss, (0, 1, 2, 3)))
    held = gradient.lower(*inputs).compile().memory_analysis().temp_size_in_bytes
    assert held <= 64 * 2**20, f"{held / 2**20:.1f} MiB of temporaries"
