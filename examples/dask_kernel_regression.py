"""Nadaraya-Watson regression over a training set larger than any worker's memory.

Starts a dask.distributed LocalCluster on loopback (worker processes with a
memory limit), makes 10^8 noisy training points of y = sin(x) lazily, in
chunks, and estimates the regression at a few queries: each chunk of the
training set gives a partial state per chunk of queries, and the states
combine in a tree (attnx.blocks), so no worker ever holds the whole set.
The cluster is stopped at the end. About 35 s on 2 CPU cores at the
default 10^8 points; it prints one line of summary.

    python examples/dask_kernel_regression.py [--points 100000000] [--workers 2]
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import sys
import time

if importlib.util.find_spec("distributed") is None:
    sys.exit("this example needs dask.distributed: pip install '.[dask]' in attnx's clone")

import dask.array as da  # noqa: E402
import numpy as np  # noqa: E402
from dask.distributed import Client, LocalCluster  # noqa: E402

import attnx  # noqa: E402


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--points", type=int, default=100_000_000, help="training points")
    parser.add_argument("--chunk", type=int, default=1_000_000, help="training points per chunk")
    parser.add_argument("--workers", type=int, default=2, help="worker processes")
    parser.add_argument("--memory-limit", default="600MiB", help="memory limit of each worker")
    args = parser.parse_args(argv)
    with (
        LocalCluster(
            n_workers=args.workers,
            threads_per_worker=1,
            host="127.0.0.1",
            dashboard_address=None,
            memory_limit=args.memory_limit,
            silence_logs=logging.ERROR,
        ) as cluster,
        Client(cluster) as client,
    ):
        # Made on the workers, chunk by chunk: 2 x 8 bytes per point, never in one place.
        x = da.random.default_rng(0).uniform(-3, 3, size=args.points, chunks=args.chunk)
        y = da.sin(x) + 0.3 * da.random.default_rng(1).standard_normal(args.points, chunks=args.chunk)
        queries = da.from_array(np.linspace(-2.5, 2.5, 11), chunks=11)
        estimate = attnx.nadaraya_watson(queries, x, y, bandwidth=0.05)  # lazy: nothing computed yet
        tasks = len(dict(estimate.__dask_graph__()))
        start = time.perf_counter()
        values = estimate.compute()
        seconds = time.perf_counter() - start
        error = float(np.max(np.abs(values - np.sin(np.linspace(-2.5, 2.5, 11)))))
        total = 16 * args.points / 2**30
        print(
            f"{args.points:,} training points ({total:.1f} GiB, {x.numblocks[0]} chunks) on {args.workers} workers "
            f"of {args.memory_limit}: {tasks} tasks, {seconds:.1f} s; largest error against sin: {error:.4f}"
        )
        del client  # closed, with the cluster, as the block ends
    print("cluster stopped")
    return error


if __name__ == "__main__":
    main()
