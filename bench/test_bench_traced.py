"""attnx as JAX's and PyTorch's users run it: jitted, and compiled.

- ``jit``: attnx on JAX under ``jax.jit`` against ``jax.nn.dot_product_attention``
  under ``jax.jit`` (the baseline), waited for with ``block_until_ready``.
- ``compile``: ``torch.compile(fullgraph=True)`` of attnx on PyTorch against
  the eager call (the baseline), in the steady state (compiled before timing).
"""

from __future__ import annotations

import pytest
from conftest import GRID
from test_bench_attention import flops, inputs

import attnx

SHAPES = {"small": [(1, 8, 512, 64), (1, 8, 2048, 64)], "full": [(b, 8, n, 64) for b in (1, 4) for n in (512, 2048)]}[
    GRID
]
CAUSAL = pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
SHAPE = pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))


def _jax():
    return pytest.importorskip("jax", reason="the jit benchmarks need jax")


def _ready(function):
    """One call to compile, then the timed function, which waits for JAX's result."""
    function().block_until_ready()
    return lambda: function().block_until_ready()


@CAUSAL
@SHAPE
def test_jit_attnx(benchmark, shape, causal):
    jax = _jax()
    q, k, v = inputs("jax", shape)
    attend = jax.jit(lambda q, k, v: attnx.scaled_dot_product_attention(q, k, v, is_causal=causal))
    benchmark.group = f"jit sdpa {'causal' if causal else 'full'} {shape}"
    benchmark.extra_info.update(flops=flops(shape, causal), baseline=False)
    benchmark(_ready(lambda: attend(q, k, v)))


@CAUSAL
@SHAPE
def test_jit_jax_dot_product_attention_baseline(benchmark, shape, causal):
    jax = _jax()
    q, k, v = (jax.numpy.swapaxes(a, 1, 2) for a in inputs("jax", shape))  # JAX's layout: (B, n, H, d)
    attend = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal))
    benchmark.group = f"jit sdpa {'causal' if causal else 'full'} {shape}"
    benchmark.extra_info.update(flops=flops(shape, causal), baseline=True)
    benchmark(_ready(lambda: attend(q, k, v)))


@CAUSAL
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@SHAPE
def test_torch_compile(benchmark, shape, causal, compiled):
    torch = pytest.importorskip("torch", reason="the compile benchmarks need torch")
    q, k, v = inputs("torch", shape)
    lengths = torch.tensor([shape[2] // 2] * shape[0])

    def attend(q, k, v, key_lengths):
        return attnx.scaled_dot_product_attention(q, k, v, key_lengths=key_lengths, is_causal=causal)

    function = torch.compile(attend, fullgraph=True) if compiled else attend
    function(q, k, v, lengths)  # compiles (or warms up) before timing
    benchmark.group = f"compile sdpa+lengths {'causal' if causal else 'full'} {shape}"
    benchmark.extra_info.update(flops=flops(shape, causal), baseline=not compiled)
    benchmark(lambda: function(q, k, v, lengths))
