"""A training step's memory and time through attnx's tiled flex attention.

    python bench/training_memory.py [--sizes 16384 65536] [--window 256] [--heads 2]

Forward and backward of ``flex_attention`` with a causal block mask, or a
sliding window of ``--window`` keys, at (1, heads, n, 64) float32: on
PyTorch's CPU through its autograd (``loss.backward()``, attnx's
``torch.autograd.Function``), on NumPy through ``attnx.vjp``.  Each case
runs in a process of its own, with big buffers mapped so that freed memory
leaves the resident set (as ``attnx bench`` measures memory); reported:
the process's high-water mark above what it held before the step, and the
step's time (which the mapping slows: time the step with ``attnx bench``
where it matters).  Linear work in n shows as the time growing 4x when n
does; quadratic as 16x.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time


def _kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def worker(library: str, n: int, window: int, heads: int) -> dict[str, float]:
    import numpy as np

    import attnx
    from attnx import mods

    mask_mod = mods.sliding_window(window) if window else mods.causal
    block_mask = attnx.create_block_mask(mask_mod, None, None, n, n, backend=library)
    arrays = [np.random.default_rng(i).standard_normal((1, heads, n, 64), dtype=np.float32) for i in range(3)]
    if library == "torch":
        import torch

        leaves = [torch.from_numpy(a).requires_grad_() for a in arrays]

        def step() -> None:
            output = attnx.flex_attention(*leaves, None, block_mask)
            output.backward(output.detach())

    else:

        def step() -> None:
            output, backward = attnx.vjp(attnx.flex_attention, *arrays, None, block_mask)
            backward(output)

    before = _kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # reset the high-water mark
    start = time.perf_counter()
    step()
    seconds = time.perf_counter() - start
    return {"extra_mib": (_kib("VmHWM") - before) / 1024, "seconds": seconds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[16384, 65536])
    parser.add_argument("--window", type=int, default=256, help="keys back; 0 for the causal mask")
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--libraries", nargs="+", default=["numpy", "torch"])
    parser.add_argument("--worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        library, n, window, heads = args.worker
        print(json.dumps(worker(library, int(n), int(window), int(heads))))
        return
    environment = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    mask = f"sliding window {args.window}" if args.window else "causal"
    print(f"flex_attention, {mask}, (1, {args.heads}, n, 64) float32, forward + backward")
    for library in args.libraries:
        previous = None
        for n in args.sizes:
            command = [sys.executable, __file__, "--worker", library, str(n), str(args.window), str(args.heads)]
            done = subprocess.run(command, capture_output=True, text=True, env=environment, check=True)
            result = json.loads(done.stdout.strip().splitlines()[-1])
            growth = f", {result['seconds'] / previous[1]:.1f}x the time of n = {previous[0]}" if previous else ""
            print(f"  {library:6} n = {n:6}: {result['extra_mib']:7.0f} MiB extra, {result['seconds']:6.2f} s{growth}")
            previous = (n, result["seconds"])


if __name__ == "__main__":
    main()
