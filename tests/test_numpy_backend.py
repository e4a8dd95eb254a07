"""The NumPy backend's threaded map_blocks."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import attnx
from attnx_backends.numpy_backend import NumPyBackend


def test_map_blocks_keeps_order_and_uses_threads():
    backend = NumPyBackend()
    backend.concurrent_blocks = 2
    names = set()

    def work(item):
        names.add(threading.current_thread().name)
        return item * item

    assert backend.map_blocks(work, range(10)) == [i * i for i in range(10)]
    assert any(name.startswith("attnx-numpy") for name in names)


def test_map_blocks_inside_a_worker_runs_inline():
    backend = NumPyBackend()
    backend.concurrent_blocks = 2
    inner = backend.map_blocks(lambda outer: backend.map_blocks(lambda i: (outer, i), range(3)), range(4))
    assert inner == [[(outer, i) for i in range(3)] for outer in range(4)]


def test_one_thread_is_sequential(monkeypatch):
    monkeypatch.setenv("ATTNX_NUM_THREADS", "1")
    backend = NumPyBackend()
    assert backend.concurrent_blocks == 1
    assert backend.map_blocks(lambda i: threading.current_thread() is threading.main_thread(), range(3)) == [True] * 3


@pytest.mark.parametrize(
    "n, kwargs",
    [(40, {"key_lengths": np.array([40, 33]), "chunk_size": (7, 9)}), (256, {})],
    ids=["generic-masked", "native"],
)
def test_threaded_chunks_equal_sequential_chunks(monkeypatch, n, kwargs):
    """Blocks run on the backend's threads, in the generic algorithm (masked
    calls) and in the native one, and compute what one thread computes."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 3, n, 8)) for _ in range(3))
    backend = attnx._registry.get("numpy")
    monkeypatch.setattr(backend, "concurrent_blocks", 2)
    workers = set()
    original = backend.map_blocks

    def recording(function, items):
        def run(item):
            workers.add(threading.current_thread().name)
            return function(item)

        return original(run, items)

    monkeypatch.setattr(backend, "map_blocks", recording)
    threaded = attnx.scaled_dot_product_attention(q, k, v, is_causal=True, **kwargs)
    assert workers and all(name.startswith("attnx-numpy") for name in workers), workers
    lengths = kwargs.get("key_lengths")
    plain = attnx.scaled_dot_product_attention(q, k, v, is_causal=True, key_lengths=lengths, return_weights=True)[0]
    np.testing.assert_allclose(threaded, plain, rtol=1e-12, atol=1e-14)


def test_read_only_arrays_are_never_updated_in_place():
    """Writeability is per NumPy array (broadcast views are read-only), not
    per type: a writeable array asked first must not vouch for a view."""
    from attnx._masking import can_mutate

    assert can_mutate(np.ones((2, 3)))
    assert not can_mutate(np.broadcast_to(np.ones(3), (2, 3)))
