"""Scaled dot-product attention: attnx on each backend, PyTorch's SDPA, textbook NumPy."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import GRID, timed
from overhead import checked_torch_sdpa

import attnx
from attnx.benchmark import cache_lengths, decode_mask, textbook_attention

# (batch, heads, n, head dim)
SHAPES = {
    "small": [(1, 8, 128, 64), (1, 8, 512, 64), (4, 8, 512, 64), (1, 8, 2048, 64)],
    "full": [(b, 8, n, d) for b in (1, 4) for n in (128, 512, 2048, 8192) for d in (64, 128)],
}[GRID]


#: The torch backend, for PyTorch's baselines: timed with the same wait for
#: queued GPU work as attnx's torch rows (on the CPU a call that returns at
#: once, but a call all the same, which tiny inputs notice).
def _torch_backend():
    try:
        return attnx._registry.get("torch")
    except (ValueError, RuntimeError):  # not installed: its tests skip
        return None


TORCH = _torch_backend()


def flops(shape, causal):
    b, h, n, d = shape
    return 4.0 * b * h * n * n * d / (2 if causal else 1)


def inputs(backend_name, shape, dtype="float32"):
    rng = np.random.default_rng(0)
    arrays = [rng.standard_normal(shape).astype(np.float32) for _ in range(3)]
    return [attnx.asarray(a, backend=backend_name, dtype=dtype) for a in arrays]


def _dtypes():
    return ["float32", "float16", "bfloat16"] if GRID == "full" else ["float32"]


@pytest.mark.parametrize("dtype", _dtypes())
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_attnx(benchmark, backend, shape, causal, dtype):
    if dtype not in backend.float_dtypes:
        pytest.skip(f"{backend.name} has no {dtype}")
    q, k, v = inputs(backend.name, shape, dtype)
    benchmark.group = f"sdpa {'causal' if causal else 'full'} {shape} {dtype}"
    benchmark.extra_info.update(flops=flops(shape, causal), baseline=False)
    timed(benchmark, lambda: attnx.scaled_dot_product_attention(q, k, v, is_causal=causal), backend)


@pytest.mark.parametrize("dtype", _dtypes())
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_torch_sdpa_baseline(benchmark, shape, causal, dtype):
    torch = pytest.importorskip("torch")
    q, k, v = inputs("torch", shape, dtype)
    benchmark.group = f"sdpa {'causal' if causal else 'full'} {shape} {dtype}"
    benchmark.extra_info.update(flops=flops(shape, causal), baseline=True)
    timed(benchmark, lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal), TORCH)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_numpy_textbook_baseline(benchmark, shape, causal):
    if shape[2] > 2048:
        pytest.skip("the textbook version's (n, n) scores need too much memory here")
    q, k, v = inputs("numpy", shape)
    benchmark.group = f"sdpa {'causal' if causal else 'full'} {shape} float32"
    benchmark.extra_info.update(flops=flops(shape, causal), baseline=True)
    timed(benchmark, lambda: textbook_attention(q, k, v, causal))


# -- decoding: new queries over a padded cache of grouped key/value heads ----------------

# (batch, query heads, key/value heads, new queries, cache length, head dim)
DECODE = {
    "small": [(1, 32, 8, 1, 4096, 128), (1, 32, 8, 16, 4096, 128)],
    "full": [
        (1, 32, 8, 1, 16384, 128),
        (8, 32, 8, 1, 2048, 128),
        (4, 32, 32, 1, 4096, 128),
        (1, 32, 8, 128, 4096, 128),
    ],
}[GRID]


def decode_inputs(backend_name, shape):
    """Query, key, value and the cache's lengths, as ``attnx bench
    --operations decode`` makes them (:func:`attnx.benchmark.cache_lengths`)."""
    batch, heads, kv_heads, queries, cache, d = shape
    rng = np.random.default_rng(0)
    shapes = [(batch, heads, queries, d), (batch, kv_heads, cache, d), (batch, kv_heads, cache, d)]
    arrays = [attnx.asarray(rng.standard_normal(s).astype(np.float32), backend=backend_name) for s in shapes]
    return (*arrays, cache_lengths(batch, cache))


def _decode_benchmark(benchmark, shape, baseline):
    benchmark.group = "decode (B, H, H_kv, queries, cache, d) = " + str(shape)
    batch, heads, _, queries, cache, d = shape
    benchmark.extra_info.update(flops=4.0 * batch * heads * queries * cache * d, baseline=baseline)


@pytest.mark.parametrize("shape", DECODE, ids=lambda s: "x".join(map(str, s)))
def test_attnx_decode(benchmark, backend, shape):
    q, k, v, lengths = decode_inputs(backend.name, shape)
    lengths = attnx.asarray(lengths, backend=backend.name)
    _decode_benchmark(benchmark, shape, baseline=False)
    options = {
        "key_lengths": lengths,
        "is_causal": True,
        "causal_align": "key_lengths",
        "enable_gqa": shape[1] != shape[2],
    }
    timed(benchmark, lambda: attnx.scaled_dot_product_attention(q, k, v, **options), backend)


@pytest.mark.parametrize("shape", DECODE, ids=lambda s: "x".join(map(str, s)))
def test_torch_sdpa_decode_baseline(benchmark, shape):
    """PyTorch's SDPA with the cache's padding and the causal rule as its mask."""
    torch = pytest.importorskip("torch")
    q, k, v, lengths = decode_inputs("torch", shape)
    mask = torch.from_numpy(decode_mask(lengths, queries=shape[3], cache=shape[4]))
    _decode_benchmark(benchmark, shape, baseline=True)
    fused = torch.nn.functional.scaled_dot_product_attention
    timed(benchmark, lambda: fused(q, k, v, attn_mask=mask, enable_gqa=shape[1] != shape[2]), TORCH)


# -- the cost of dispatch and checks on tiny inputs ------------------------------------

TINY = (1, 1, 16, 16)


def test_tiny_attnx(benchmark, backend):
    q, k, v = inputs(backend.name, TINY)
    benchmark.group = f"tiny {TINY} on {backend.name}"
    benchmark.extra_info.update(flops=flops(TINY, False), baseline=False)
    timed(benchmark, lambda: attnx.scaled_dot_product_attention(q, k, v), backend)


def test_tiny_torch_direct(benchmark):
    torch = pytest.importorskip("torch")
    q, k, v = inputs("torch", TINY)
    benchmark.group = f"tiny {TINY} on torch"
    benchmark.extra_info.update(flops=flops(TINY, False), baseline=True)
    timed(benchmark, lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v), TORCH)


def test_tiny_torch_checked(benchmark):
    """A wrapper that validates every call (``overhead.checked_torch_sdpa``)."""
    pytest.importorskip("torch")
    q, k, v = inputs("torch", TINY)
    benchmark.group = f"tiny {TINY} on torch"
    benchmark.extra_info.update(flops=flops(TINY, False), baseline=False)
    timed(benchmark, lambda: checked_torch_sdpa(q, k, v), TORCH)


def test_tiny_numpy_textbook(benchmark):
    q, k, v = inputs("numpy", TINY)
    benchmark.group = f"tiny {TINY} on numpy"
    benchmark.extra_info.update(flops=flops(TINY, False), baseline=True)
    timed(benchmark, lambda: textbook_attention(q, k, v))


def inplace_attention(q, k, v, causal=False):
    """The best plain-NumPy version we know: one head at a time, in place."""
    out = np.empty(q.shape[:-1] + (v.shape[-1],), dtype=q.dtype)
    scale = np.float32(1 / np.sqrt(q.shape[-1])).astype(q.dtype)
    n = q.shape[-2]
    future = ~np.tril(np.ones((n, n), dtype=bool)) if causal else None
    for index in np.ndindex(*q.shape[:-2]):
        scores = (q[index] * scale) @ k[index].T
        if causal:
            scores[future] = -np.inf
        scores -= scores.max(axis=-1, keepdims=True)
        np.exp(scores, out=scores)
        out[index] = (scores @ v[index]) / scores.sum(axis=-1, keepdims=True)
    return out


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_numpy_inplace_baseline(benchmark, shape, causal):
    q, k, v = inputs("numpy", shape)
    benchmark.group = f"sdpa {'causal' if causal else 'full'} {shape} float32"
    benchmark.extra_info.update(flops=flops(shape, causal), baseline=True)
    timed(benchmark, lambda: inplace_attention(q, k, v, causal))


# -- padded batches: lengths, and the same as a padding mask ----------------------------

PADDED = (4, 8, 512, 64)


def padding(backend_name, shape):
    """Lengths of 100%, 75%, 50% and 25% of the keys by batch entry, and the
    same as a boolean ``(B, 1, 1, m)`` padding mask."""
    n = shape[2]
    lengths = np.resize(np.array([n, 3 * n // 4, n // 2, n // 4]), shape[0])
    mask = (np.arange(n) < lengths[:, None])[:, None, None, :]
    return attnx.asarray(lengths, backend=backend_name), attnx.asarray(mask, backend=backend_name)


@pytest.mark.parametrize("given", ["key_lengths", "mask"])
def test_padded_attnx(benchmark, backend, given):
    q, k, v = inputs(backend.name, PADDED)
    lengths, mask = padding(backend.name, PADDED)
    call = {"key_lengths": lengths} if given == "key_lengths" else {"mask": mask}
    benchmark.group = f"sdpa padded {PADDED} float32"
    benchmark.extra_info.update(flops=flops(PADDED, False), baseline=False)
    timed(benchmark, lambda: attnx.scaled_dot_product_attention(q, k, v, **call), backend)


def test_padded_torch_sdpa_baseline(benchmark):
    torch = pytest.importorskip("torch")
    q, k, v = inputs("torch", PADDED)
    _, mask = padding("torch", PADDED)
    benchmark.group = f"sdpa padded {PADDED} float32"
    benchmark.extra_info.update(flops=flops(PADDED, False), baseline=True)
    timed(benchmark, lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask), TORCH)
