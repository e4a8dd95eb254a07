"""Peak memory of long sequences on NumPy: counted, not timed.

NumPy reports every buffer it allocates to :mod:`tracemalloc`, so the peak
of one call is exact and the same on every machine.  The limits are the
issue's: 16 MiB for (1, 1, 8192, 64), 64 MiB for a causal (1, 1, 32768,
64), float32, outputs included (2 and 8 MiB).  The plain algorithm would
take 256 MiB and 4 GiB of scores.
"""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import attnx
from attnx_conformance import reference

MiB = 2**20


def peak_bytes(function):
    """Peak traced bytes of ``function()``, after one untraced call (first
    calls import modules and start threads: not the call's memory)."""
    function()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        result = function()
        return tracemalloc.get_traced_memory()[1], result
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize(
    "n, is_causal, limit", [(8192, False, 16 * MiB), (32768, True, 64 * MiB)], ids=["8192-full", "32768-causal"]
)
def test_long_sequences_stay_within_their_memory(n, is_causal, limit):
    gen = np.random.default_rng(0)
    q, k, v = (gen.standard_normal((1, 1, n, 64), dtype=np.float32) for _ in range(3))
    peak, out = peak_bytes(lambda: attnx.scaled_dot_product_attention(q, k, v, is_causal=is_causal))
    assert peak <= limit, f"peak {peak / MiB:.1f} MiB over {limit / MiB:.0f} MiB"
    # and it is attention: a few rows against the formula, in float64
    rows = [0, n // 2, n - 1]
    scores = q[0, 0, rows].astype(np.float64) @ k[0, 0].T.astype(np.float64) / 8.0
    if is_causal:
        scores[np.arange(n)[None, :] > np.array(rows)[:, None]] = -np.inf
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    expected = (weights / weights.sum(-1, keepdims=True)) @ v[0, 0].astype(np.float64)
    np.testing.assert_allclose(out[0, 0, rows], expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("masks", ["key_lengths_per_query", "padding_mask", "full_mask"])
def test_masked_long_sequences_stay_within_their_memory(masks):
    """Masks are cut into the blocks' scores (one row of lengths' factors at
    most per row of scores): a masked (1, 1, 8192, 64) call keeps within the
    same 16 MiB, beside a full boolean mask's own 64 MiB."""
    gen = np.random.default_rng(3)
    n = 8192
    q, k, v = (gen.standard_normal((1, 1, n, 64), dtype=np.float32) for _ in range(3))
    call = {
        "key_lengths_per_query": {"key_lengths": gen.integers(0, n + 1, (1, 1, n))},
        "padding_mask": {"mask": np.arange(n) < n - 100},
        "full_mask": {"mask": gen.random((n, n)) < 0.9},
    }[masks]
    peak, out = peak_bytes(lambda: attnx.scaled_dot_product_attention(q, k, v, **call))
    assert peak <= 16 * MiB, f"peak {peak / MiB:.1f} MiB over 16 MiB"
    assert np.isfinite(out).all()


def test_threads_share_the_budget():
    """More threads, the same budget: each block gets its share."""
    gen = np.random.default_rng(1)
    q, k, v = (gen.standard_normal((4, 8, 2048, 64), dtype=np.float32) for _ in range(3))
    backend = attnx._registry.get("numpy")
    saved = backend.concurrent_blocks
    try:
        backend.concurrent_blocks = 8
        peak, _ = peak_bytes(lambda: attnx.scaled_dot_product_attention(q, k, v))
    finally:
        backend.concurrent_blocks = saved
    output = 4 * 8 * 2048 * 64 * 4
    assert peak - output <= 2 * attnx.get_memory_budget(), f"{(peak - output) / MiB:.1f} MiB beside the output"


@pytest.mark.parametrize("query_heads", [8, 1], ids=["query-per-head", "query-broadcast"])
def test_a_repeated_call_allocates_its_output_and_little_more(monkeypatch, query_heads):
    """The scaled queries go into a buffer kept between calls, as the scores
    do: a fresh one, freed with the output, let glibc give the top of its
    heap back to the system, and every call page-faulted it in again.  One
    thread, so that which thread's buffers exist does not depend on timing."""
    monkeypatch.setattr(attnx._registry.get("numpy"), "concurrent_blocks", 1)
    gen = np.random.default_rng(2)
    q = gen.standard_normal((1, query_heads, 128, 128), dtype=np.float32)
    k, v = (gen.standard_normal((1, 8, 128, 128), dtype=np.float32) for _ in range(2))
    peak, out = peak_bytes(lambda: attnx.scaled_dot_product_attention(q, k, v))
    assert peak <= out.nbytes + 64 * 1024, f"{(peak - out.nbytes) / 1024:.0f} KiB beside the output"
    expected, _ = reference.scaled_dot_product_attention(q, k, v)
    np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-5)


def test_additive_attention_holds_one_block_of_its_intermediate():
    """Additive attention holds its (..., n, m) scores and weights whole,
    but of the (..., chunk, m, h) tanh intermediate only one block: for
    every slice of the batch (4 x 1024 x 1024 x 64 float32 is 1 GiB; a
    chunk of 4 queries is 4 MiB), where chunks once counted one slice (145
    MiB at its peak here)."""
    gen = np.random.default_rng(0)
    batch, n, width, hidden = 4, 1024, 32, 64
    x = gen.standard_normal((batch, n, width)).astype(np.float32)
    params = {
        "w_q": gen.standard_normal((width, hidden)).astype(np.float32),
        "w_k": gen.standard_normal((width, hidden)).astype(np.float32),
        "w_v": gen.standard_normal(hidden).astype(np.float32),
    }
    peak, out = peak_bytes(lambda: attnx.additive_attention(x, x, x, params))
    scores = batch * n * n * 4
    limit = 2 * scores + 2 * attnx.get_memory_budget()
    assert peak <= limit, f"peak {peak / MiB:.1f} MiB over {limit / MiB:.0f} MiB"
    q, k = x[0, :3].astype(np.float64) @ params["w_q"], x[0].astype(np.float64) @ params["w_k"]
    weights = np.exp(np.tanh(q[:, None, :] + k[None, :, :]) @ params["w_v"])
    expected = weights / weights.sum(-1, keepdims=True) @ x[0].astype(np.float64)
    np.testing.assert_allclose(out[0, :3], expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("features", [None, 2, 32], ids=["scalar", "2-features", "32-features"])
def test_kernel_regression_holds_one_block_of_its_kernel(features):
    """Nadaraya-Watson's estimate takes its queries in chunks whose kernel
    ``(chunk, m)`` (``(chunk, m, d)`` of differences past 16 features) fits
    one block: at n = m = 2048 in float64, whole, the kernel and the arrays
    made beside it held 96 MiB at their peak (32 features: 2 GiB)."""
    gen = np.random.default_rng(0)
    n = 2048
    shape = (n,) if features is None else (n, features)
    queries, keys = gen.standard_normal(shape), gen.standard_normal(shape)
    values = gen.standard_normal(n)
    peak, out = peak_bytes(lambda: attnx.nadaraya_watson(queries, keys, values, bandwidth=0.5))
    limit = 4 * attnx.get_memory_budget()
    assert peak <= limit, f"peak {peak / MiB:.1f} MiB over {limit / MiB:.0f} MiB"
    rows = [0, n // 2, n - 1]
    expected, _ = reference.nadaraya_watson(queries[rows], keys, values, bandwidth=0.5)
    np.testing.assert_allclose(out[rows], expected, rtol=1e-10)


@pytest.mark.parametrize("features", [None, 2, 32], ids=["scalar", "2-features", "32-features"])
def test_kernel_regression_with_its_weights_holds_them_and_one_block(features):
    """With ``return_weights=True`` the ``(n, m)`` weights are the output, but
    the kernel is still made a chunk of queries at a time: at n = m = 2048
    in float64 the peak is the weights and their chunks before they are
    joined (64 MiB), and blocks; made whole, it was 96 MiB (32 features: 2
    GiB of differences)."""
    gen = np.random.default_rng(1)
    n = 2048
    shape = (n,) if features is None else (n, features)
    queries, keys = gen.standard_normal(shape), gen.standard_normal(shape)
    values = gen.standard_normal(n)
    peak, (out, weights) = peak_bytes(
        lambda: attnx.nadaraya_watson(queries, keys, values, bandwidth=0.5, return_weights=True)
    )
    limit = 2 * weights.nbytes + 4 * attnx.get_memory_budget()
    assert peak <= limit, f"peak {peak / MiB:.1f} MiB over {limit / MiB:.0f} MiB"
    rows = [0, n // 2, n - 1]
    expected, expected_weights = reference.nadaraya_watson(queries[rows], keys, values, bandwidth=0.5)
    np.testing.assert_allclose(out[rows], expected, rtol=1e-10)
    np.testing.assert_allclose(weights[rows], expected_weights, rtol=1e-10, atol=1e-300)
