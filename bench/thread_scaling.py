"""How much a second thread speeds up the pieces of attention on this machine.

    OPENBLAS_THREAD_TIMEOUT=4 python bench/thread_scaling.py [--rounds 15]

Each piece runs the work of (1, 8, 128, 64) float32 attention (the grid's
smallest cell), once as two halves one after the other on one thread, once
as the same two halves on two threads at once (the calling thread and one
worker, as attnx's NumPy backend runs them, BLAS on one thread each), in
interleaved rounds.  Reports the best round of each and the speed-up.  The
NumPy pieces are what attnx's NumPy backend is made of; PyTorch's fused SDPA
(``torch.set_num_threads(1)`` against ``2``) is the anchor.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from threadpoolctl import threadpool_limits

SLICES, N, D = 8, 128, 64


def numpy_pieces() -> dict[str, Callable[[int], object]]:
    """Each piece takes a half (0 or 1) and computes it in place."""
    rng = np.random.default_rng(0)
    half = SLICES // 2
    q, k, v = ([rng.standard_normal((half, N, D), dtype=np.float32) for _ in range(2)] for _ in range(3))
    scores = [-np.abs(rng.standard_normal((half, N, N), dtype=np.float32)) for _ in range(2)]
    out = [np.empty((half, N, N), np.float32) for _ in range(2)]
    return {
        "numpy q @ k^T (sgemm)": lambda i: np.matmul(q[i], k[i].transpose(0, 2, 1), out=out[i]),
        "numpy exp": lambda i: np.exp(scores[i], out=out[i]),
        "numpy row sum": lambda i: scores[i].sum(axis=-1),
    }


def measure(rounds: int, reps: int = 20) -> dict[str, tuple[float, float]]:
    """Best time (us) of each piece on one thread and on two."""
    pool = ThreadPoolExecutor(1)
    results = {}
    with threadpool_limits(1, "blas"):
        for name, piece in numpy_pieces().items():

            def serial(piece: Callable[[int], object] = piece) -> None:
                for _ in range(reps):
                    piece(0)
                    piece(1)

            def parallel(piece: Callable[[int], object] = piece) -> None:
                def half(i: int) -> None:
                    for _ in range(reps):
                        piece(i)

                other = pool.submit(half, 1)
                half(0)
                other.result()

            results[name] = _best(serial, parallel, rounds, reps)
    try:
        import torch
    except ImportError:
        return results
    rng = np.random.default_rng(0)
    tq, tk, tv = (torch.from_numpy(rng.standard_normal((1, SLICES, N, D), dtype=np.float32)) for _ in range(3))

    def on(threads: int) -> Callable[[], None]:
        def call() -> None:
            torch.set_num_threads(threads)
            for _ in range(reps):
                torch.nn.functional.scaled_dot_product_attention(tq, tk, tv)

        return call

    results["torch fused SDPA (whole call)"] = _best(on(1), on(2), rounds, reps)
    return results


def _best(one: Callable[[], None], two: Callable[[], None], rounds: int, reps: int) -> tuple[float, float]:
    best = [float("inf"), float("inf")]
    for _ in range(rounds):
        for slot, function in enumerate((one, two)):
            start = time.perf_counter()
            function()
            best[slot] = min(best[slot], (time.perf_counter() - start) / reps * 1e6)
    return best[0], best[1]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args(argv)
    print(f"the work of ({1}, {SLICES}, {N}, {D}) float32, best of {args.rounds} rounds")
    for name, (one, two) in measure(args.rounds).items():
        print(f"  {name:32s} one thread {one:8.1f} us  two threads {two:8.1f} us  speed-up x{one / two:.2f}")


if __name__ == "__main__":
    main()
