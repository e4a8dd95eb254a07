"""attnx on a real dask.distributed cluster: worker processes on loopback,
started here and stopped at the end."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

import attnx
from attnx_conformance import reference

da = pytest.importorskip("dask.array")
distributed = pytest.importorskip("distributed")
from attnx.benchmark import local_cluster  # noqa: E402


@pytest.fixture(scope="module")
def client():
    cluster, client = local_cluster(2)  # worker processes on loopback, as `attnx bench --dask-workers` starts them
    try:
        yield client
    finally:
        client.close()
        cluster.close()


def _reference(query, key, value, key_lengths=None):
    """The conformance kit's float64 attention; ``key_lengths`` one per batch entry."""
    allowed = reference.allowed_mask(
        query.shape[-2], key.shape[-2], batch_shape=query.shape[:-2], key_lengths=key_lengths, lengths_per="batch"
    )
    return reference.scaled_dot_product_attention(query, key, value, allowed=allowed)[0]


def _lazy_inputs(shape, chunks, seed):
    # Random chunks with fixed seeds: a recomputed task makes the same numbers.
    return [da.random.default_rng(seed + i).standard_normal(shape, chunks=chunks) for i in range(3)]


def test_attention_with_lazy_padding_on_a_cluster(client):
    query, key, value = _lazy_inputs((4, 2, 64, 16), (2, 2, 32, 16), seed=0)
    tokens = da.random.default_rng(9).integers(0, 5, size=(4, 64), chunks=(2, 32))
    key_lengths = (tokens > 0).sum(axis=-1)  # derived from the data, lazily
    output = attnx.scaled_dot_product_attention(query, key, value, key_lengths=key_lengths)
    assert isinstance(output, da.Array)
    got = client.compute(output).result()
    q, k, v, lengths = client.compute([query, key, value, key_lengths], sync=True)
    np.testing.assert_allclose(got, _reference(q, k, v, lengths), rtol=1e-10, atol=1e-12)


def test_a_worker_killed_mid_computation_changes_nothing(client):
    # 32 tasks of attention, each a few tens of milliseconds.
    query, key, value = _lazy_inputs((8, 4, 1024, 64), (1, 4, 1024, 64), seed=10)
    query, key, value = (a.astype("float32") for a in (query, key, value))
    output = attnx.scaled_dot_product_attention(query, key, value)
    pids = client.run(os.getpid)  # worker address -> process id
    future = client.compute(output)
    deadline = time.monotonic() + 60
    while not _some_task_done(client) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not future.done(), "the computation finished before a worker could be killed"
    victim = sorted(pids)[0]
    os.kill(pids[victim], signal.SIGKILL)  # no goodbye: the scheduler learns it from the lost connection
    got = future.result(timeout=120)
    # Its nanny started a new worker process, at a new address.
    assert victim not in set(client.scheduler_info()["workers"])
    q, k, v = client.compute([query, key, value], sync=True)
    np.testing.assert_allclose(got, _reference(q, k, v).astype(np.float32), rtol=2e-4, atol=2e-5)


def _some_task_done(client) -> bool:
    def count(dask_scheduler):
        return sum(
            task.state == "memory" and "attnx-sdpa-block" in str(task.key) for task in dask_scheduler.tasks.values()
        )

    return client.run_on_scheduler(count) > 0
