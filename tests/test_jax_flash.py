"""JAX's tiled SDPA in its own loops (backends/jax_flash.py): the same
function as attnx's algorithm, and a jitted backward that keeps no tile."""

from __future__ import annotations

import numpy as np
import pytest

import attnx
from attnx.attention import sdpa_generic

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
