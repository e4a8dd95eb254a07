"""The rest of the family on each backend (no baseline: attnx is the only implementation)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import timed

import attnx

N = 512


@pytest.fixture
def data(backend):
    rng = np.random.default_rng(0)
    return lambda *shape: attnx.asarray(rng.standard_normal(shape).astype(np.float32), backend=backend.name)


def test_multi_head_attention(benchmark, backend, data):
    x = data(2, N, 256)
    params = attnx.init_multi_head_params(256, 8, backend=backend.name)
    benchmark.group = f"multi_head_attention (2, {N}, 256), 8 heads"
    timed(benchmark, lambda: attnx.multi_head_attention(x, x, x, params, num_heads=8, is_causal=True), backend)


def test_additive_attention(benchmark, backend, data):
    q, k = data(2, N, 64), data(2, N, 64)
    params = {"w_q": data(64, 32), "w_k": data(64, 32), "w_v": data(32)}
    benchmark.group = f"additive_attention (2, {N}, 64), h=32"
    timed(benchmark, lambda: attnx.additive_attention(q, k, k, params), backend)


def test_nadaraya_watson(benchmark, backend, data):
    queries, keys, values = data(N, 4), data(4 * N, 4), data(4 * N, 8)
    benchmark.group = f"nadaraya_watson {N} queries, {4 * N} keys"
    timed(benchmark, lambda: attnx.nadaraya_watson(queries, keys, values, bandwidth=0.5), backend)


def test_apply_rotary(benchmark, backend, data):
    x = data(2, 8, N, 64)
    benchmark.group = f"apply_rotary (2, 8, {N}, 64)"
    timed(benchmark, lambda: attnx.apply_rotary(x), backend)


def test_sinusoidal_positions(benchmark, backend):
    benchmark.group = f"sinusoidal_positions ({N * 4}, 512)"
    timed(benchmark, lambda: attnx.sinusoidal_positions(N * 4, 512, backend=backend.name), backend)


def test_causal_conv1d(benchmark, backend, data):
    x, w = data(4, 32, 4 * N), data(32, 32, 2)
    benchmark.group = f"causal_conv1d (4, 32, {4 * N}), k=2, dilation 4"
    timed(benchmark, lambda: attnx.causal_conv1d(x, w, dilation=4), backend)
