"""The GPU items of ``docs/archive/bench-sessions.md`` ("For the next lent GPU"), timed in
one process against baselines measured in the same run.

    python bench/gpu_checks.py [window] [family] [jax] [additive] [breakdown] [native] [native_outputs] [masks] [host_profile] [flash] [flash_outputs] [flash_times] [flash_rule] [flash_queries] [cudnn_outputs] [cudnn_times] [cudnn_vjp] [decode_times] [launch_cost] [vjp] [tiled_outputs] [tiled_times]   # on a machine with CUDA, CuPy and PyTorch

Each row is :func:`attnx.benchmark.run_case`, as ``attnx bench`` times it
(the median of at least 5 synchronised calls and 0.25 s, and the peak
memory); a baseline is the same case under the memory budget that gives
the plan attnx made before the change measured:

- flex_attention on CuPy, a causal sliding window of 256 keys (``window``): rows of
  blocks joined into steps (the default) against one row of blocks a step
  (a budget of one row's scores, 128 x 384 keys x 8 heads x 4 bytes);
- flex_attention on PyTorch's CUDA tensors in float64 (attnx's own tiles:
  PyTorch's compiled flex takes no float64): the GPU's blocks against the
  CPU's 4 MiB;
- multi-head and additive attention on PyTorch's CUDA tensors and on CuPy
  (``family``);
- flex_attention on JAX's GPU under ``jit`` (``jax``): the blocks a
  tracer plans with, 4 MiB (today's) against larger, with the first
  call's compile; additive attention's likewise (``additive``), its
  chunks of queries in ``lax.map``;
- where SDPA on CuPy spends its time (``breakdown``): each pass of a
  textbook attention, and one with the row softmax fused into a kernel;
- the CuPy native of SDPA with that kernel (``native``): its outputs
  against the generic algorithm's, its time against the generic
  algorithm's and PyTorch's SDPA, and causal calls by their blocks of rows.
- the native with masks that have a leading axis per slice (``masks``),
  against the generic algorithm and PyTorch's SDPA given the same mask;
  where its host time goes at n = 512 (``host_profile``, cProfile).
- the fused kernel (``flash``): its outputs against the generic
  algorithm's (``flash_outputs``), its time against attend's blocks and
  PyTorch's SDPA (``flash_times``), and its blocks' rows and tiles' keys;
  where it beats the blocks, small calls and small budgets (``flash_rule``,
  the measurements behind ``cupy_attention.prefers_fused``).
- half precision through cuDNN's fused attention (``cudnn_outputs``: float16
  and bfloat16, grouped heads, key lengths, what the route declines; its
  outputs against float32 through attnx's own kernels), its time against
  PyTorch's SDPA (``cudnn_times``), and ``attnx.vjp`` through cuDNN's
  backward (``cudnn_vjp``: gradients against float32's, then time and
  memory against PyTorch's autograd); ``attnx.vjp`` in float32 and float64
  (``vjp``); the cost of a launch (``launch_cost``); decoding, float32 in
  attend's blocks against the fused kernel (``decode_times``).
- the tiled fused kernel (``attnx_backends.cupy_tiled``, float32, a
  thread's 4 x 4 scores): its outputs against the float64 reference
  (``tiled_outputs``, in each tiling), its time against the fused kernel
  of a query a thread and PyTorch's SDPA on issue 61's shapes
  (``tiled_times``).

The window's anchor is PyTorch's compiled FlexAttention, in the same run.
Dask arrays of CuPy chunks are checked by ``tests/test_dask_cupy.py``.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import sys
from typing import Any

import attnx
from attnx.backend import GPU_BLOCK_BYTES
from attnx.benchmark import Case, run_case

MiB = 2**20
#: One row of 128-query blocks of a window of 256 keys (3 key blocks), 8 heads, float32.
ONE_ROW_BYTES = 128 * 384 * 8 * 4


def row(name: str, case: Case, budget: int | None = None) -> dict[str, Any]:
    with attnx.memory_budget(budget) if budget else contextlib.nullcontext():
        result = run_case(case)
    line = {
        "row": name,
        "implementation": case.implementation,
        "operation": case.operation,
        "shape": [case.batch, case.heads, case.n, case.head_dim],
        "dtype": case.dtype,
        "budget_mib": None if budget is None else round(budget / MiB, 2),
        "median_ms": None if result.median_s is None else round(result.median_s * 1e3, 3),
        "calls": len(result.times_s),
        "peak_mib": None if result.peak_bytes is None else round(result.peak_bytes / MiB, 1),
        "error": result.error,
    }
    print(json.dumps(line), flush=True)
    return line


def ratio(line: dict[str, Any], baseline: dict[str, Any]) -> None:
    if line["median_ms"] and baseline["median_ms"]:
        print(f"  {line['row']}: {line['median_ms'] / baseline['median_ms']:.3f}x {baseline['row']}", flush=True)


CUDA = "cuda:0"


def window() -> None:
    shape = dict(operation="sliding_window", batch=1, heads=8, n=8192, head_dim=64, device=CUDA, repeat=10)
    anchor = row("torch-flex-compiled window", Case("torch-flex-compiled", **shape))
    on_torch = row("torch window (PyTorch's compiled flex)", Case("attnx:torch", **shape))
    joined = row("cupy window, joined rows", Case("attnx:cupy", **shape))
    one_row = row("cupy window, one row a step", Case("attnx:cupy", **shape), ONE_ROW_BYTES)
    for line in (on_torch, joined, one_row):
        ratio(line, anchor)
    ratio(joined, one_row)
    gpu = row("torch float64 window, GPU blocks", Case("attnx:torch", dtype="float64", **shape))
    cpu = row("torch float64 window, CPU blocks", Case("attnx:torch", dtype="float64", **shape), 4 * MiB)
    ratio(gpu, cpu)


def family() -> None:
    for operation in ("multi_head_attention", "additive_attention"):
        for n in (2048, 8192):
            shape = dict(operation=operation, batch=1, heads=8, n=n, head_dim=64, device=CUDA, repeat=10)
            on_torch = row(f"torch {operation} {n}", Case("attnx:torch", **shape))
            on_cupy = row(f"cupy {operation} {n}", Case("attnx:cupy", **shape))
            ratio(on_cupy, on_torch)


@contextlib.contextmanager
def tracer_blocks(size: int) -> Any:
    """The JAX backend's blocks for a tracer (no device under jit): the
    CPU's ``block_bytes``, set to ``size`` here."""
    backend = attnx._registry.get("jax")
    before = backend.block_bytes
    backend.block_bytes = size
    try:
        yield
    finally:
        backend.block_bytes = before


def jitted(name: str, call: Any, query: Any, size: int) -> None:
    """One row: ``call`` jitted with a tracer's blocks of ``size`` bytes,
    its program's equations, first call (the compile) and median of 10."""
    import time

    import jax

    with tracer_blocks(size):
        function = lambda q: call(q)  # noqa: E731 (a new function: JAX keeps traces it has seen)
        equations = len(jax.make_jaxpr(function)(query).eqns)
        attend = jax.jit(lambda q: call(q))
        start = time.perf_counter()
        attend(query).block_until_ready()
        first = time.perf_counter() - start
        times = []
        for _ in range(10):
            start = time.perf_counter()
            attend(query).block_until_ready()
            times.append(time.perf_counter() - start)
    line = {
        "row": f"jax {name} jitted, tracer blocks {size // MiB} MiB",
        "first_call_s": round(first, 2),
        "median_ms": round(sorted(times)[5] * 1e3, 3),
        "equations": equations,
    }
    print(json.dumps(line), flush=True)


def jax_tracer(n: int = 8192) -> None:
    """On JAX's default device (the GPU there), jitted, flex_attention's
    sliding window with a tracer's blocks of 4, 64 and 512 MiB (the
    thirty-third session's run gave a GPU's tracers 64 MiB); each first call
    holds the compile, and the program's length is its equations.  The
    window eagerly too, where the GPU's blocks apply.  Additive attention's
    blocks are the ``additive`` stage's."""
    import time

    import jax

    shape = (1, 8, n, 64)
    query = jax.random.normal(jax.random.key(0), shape, dtype=jax.numpy.float32)
    block_mask = attnx.create_block_mask(attnx.mods.sliding_window(256), None, None, n, n, backend="jax")
    for size in (4 * MiB, 64 * MiB, GPU_BLOCK_BYTES):
        jitted("window", lambda q: attnx.flex_attention(q, q, q, block_mask=block_mask), query, size)
    # Not jitted: concrete arrays, each tile's operations dispatched one by one.
    for name, budget in (("GPU blocks", GPU_BLOCK_BYTES), ("CPU blocks", 4 * MiB)):
        with attnx.memory_budget(budget):
            attnx.flex_attention(query, query, query, block_mask=block_mask).block_until_ready()
            times = []
            for _ in range(5):
                start = time.perf_counter()
                attnx.flex_attention(query, query, query, block_mask=block_mask).block_until_ready()
                times.append(time.perf_counter() - start)
        print(
            json.dumps({"row": f"jax window eager, {name}", "median_ms": round(sorted(times)[2] * 1e3, 3)}), flush=True
        )


def additive() -> None:
    """Additive attention on JAX's GPU, jitted, h = 64: its chunks of
    queries through ``lax.map`` (``JaxBackend.map_chunks``), with a tracer's
    blocks of 4 MiB (the CPU's, today's), 64 MiB and 512 MiB.  Before
    ``lax.map``, at n = 2048: 4 MiB compiled in 101 s and ran in 6.52 ms,
    64 MiB in 3.39 s and 4.63 ms, and 512 MiB's compile passed 3 minutes."""
    import jax

    query = jax.random.normal(jax.random.key(0), (1, 8, 8192, 64), dtype=jax.numpy.float32)
    params = {"w_q": query[0, 0, :64] * 0.1, "w_k": query[0, 1, :64] * 0.1, "w_v": query[0, 2, 0] * 0.1}
    for n, size in ((2048, 4 * MiB), (2048, 64 * MiB), (8192, 64 * MiB), (8192, 4 * MiB), (2048, GPU_BLOCK_BYTES)):
        part = query[:, :, :n]
        jitted(f"additive {n}", lambda q: attnx.additive_attention(q, q, q, params), part, size)


def breakdown() -> None:
    """Where attnx's SDPA on CuPy spends its time, (1, 8, 8192, 64) float32:
    PyTorch's SDPA and attnx's as ``attnx bench`` times them, then each
    pass of a textbook softmax attention on the whole (8, 8192, 8192)
    scores (cupyx.profiler.benchmark, GPU time), and the same with the row
    softmax fused into one kernel."""
    import cupy as cp
    from cupyx.profiler import benchmark

    case = dict(operation="sdpa", batch=1, heads=8, n=8192, head_dim=64, device=CUDA, repeat=10)
    torch_sdpa = row("torch-sdpa", Case("torch-sdpa", **case))
    on_cupy = row("attnx:cupy sdpa", Case("attnx:cupy", **case))
    ratio(on_cupy, torch_sdpa)
    gen = cp.random.default_rng(0)
    q, k, v = (gen.standard_normal((8, 8192, 64), dtype=cp.float32) for _ in range(3))
    scale = 64**-0.5
    scores = (q * scale) @ k.swapaxes(-1, -2)
    exp_scores = cp.exp(scores - scores.max(-1, keepdims=True))
    from attnx_backends.cupy_attention import cupy_row_softmax  # the CuPy native's kernel

    def fused_softmax(s):
        return s, cupy_row_softmax(s.reshape(8 * 8192, 8192), None, 0)[1]

    def textbook():
        s = (q * scale) @ k.swapaxes(-1, -2)
        e = cp.exp(s - s.max(-1, keepdims=True))
        return (e @ v) / e.sum(-1, keepdims=True)

    def fused():
        s, totals = fused_softmax((q * scale) @ k.swapaxes(-1, -2))
        return (s @ v) / totals.reshape(8, 8192, 1)

    expected = textbook()
    error = float(cp.abs(fused() - expected).max())
    passes = {
        "scores: (q * scale) @ k.T": lambda: (q * scale) @ k.swapaxes(-1, -2),
        "row max": lambda: scores.max(-1, keepdims=True),
        "exp(s - max), a new array": lambda: cp.exp(scores - scores.max(-1, keepdims=True)),
        "row sum": lambda: exp_scores.sum(-1, keepdims=True),
        "exp_scores @ v": lambda: exp_scores @ v,
        "fused row softmax (in place on a copy)": lambda: fused_softmax(scores.copy()),
        "copy of the scores (to subtract from the line above)": lambda: scores.copy(),
        "textbook attention": textbook,
        "attention with the fused row softmax": fused,
    }
    for name, function in passes.items():
        result = benchmark(function, n_repeat=20, n_warmup=3)
        gpu_ms = float(result.gpu_times.mean()) * 1e3
        print(json.dumps({"row": name, "gpu_ms": round(gpu_ms, 3)}), flush=True)
    print(json.dumps({"row": "fused against textbook, max abs difference", "value": error}), flush=True)


@contextlib.contextmanager
def generic_on_cupy() -> Any:
    """attnx's generic algorithm on CuPy: the backend's natives set aside."""
    backend = attnx._registry.get("cupy")
    backend._natives = {}
    attnx._registry._plans.clear()  # a plan made before holds the native
    backend.specialize = lambda operation, arguments: None
    try:
        yield
    finally:
        backend._natives = None  # built again at the next call
        del backend.specialize
        attnx._registry._plans.clear()


def native_outputs() -> None:
    """The CuPy native of SDPA (``attnx_backends.cupy_attention``): its
    outputs against the generic algorithm's on CuPy (masks, key lengths,
    causal, a chunk_size that joins blocks of keys, float64 and float16)."""
    import cupy as cp

    gen = cp.random.default_rng(0)

    def inputs(shape, dtype="float32"):
        return [gen.standard_normal(shape, dtype=cp.float32).astype(dtype) for _ in range(3)]

    n, m = 300, 257
    q = inputs((2, 4, n, 64))[0]
    k, v = inputs((2, 4, m, 64))[:2]
    q64, k64, v64 = (a.astype(cp.float64) for a in (q, k, v))
    square_k, square_v = inputs((2, 4, n, 64))[:2]
    long_k, long_v = inputs((2, 1, 2000, 64))[:2]
    cases = {
        "plain": (q, k, v, {}),
        "causal": (q, square_k, square_v, {"is_causal": True}),
        "causal, n > m": (q, k, v, {"is_causal": True}),
        "key_lengths": (q, k, v, {"key_lengths": cp.asarray([0, 100])}),
        "key_lengths per query": (q, k, v, {"key_lengths": gen.integers(0, m + 1, (2, 4, n))}),
        "boolean mask": (q, k, v, {"mask": gen.random((n, m)) < 0.5}),
        "additive mask": (q, k, v, {"mask": gen.standard_normal((n, m), dtype=cp.float32)}),
        "additive scalar mask": (q, k, v, {"mask": cp.asarray(1.5)}),
        "row of keys": (q, k, v, {"mask": gen.random(m) < 0.5, "is_causal": True}),
        "boolean mask of each slice": (q, k, v, {"mask": gen.random((2, 4, n, m)) < 0.5}),
        "padding mask (2, 1, 1, m)": (q, k, v, {"mask": gen.random((2, 1, 1, m)) < 0.5, "is_causal": True}),
        "per-head bias (4, n, m), budget 64 KiB": (
            q,
            k,
            v,
            {"mask": gen.standard_normal((4, n, m), dtype=cp.float32), "budget": 2**16},
        ),
        "chunk_size (64, 100)": (q, k, v, {"chunk_size": (64, 100), "is_causal": True}),
        "chunk_size (64, 100), lengths 0 and 100": (
            q,
            k,
            v,
            {"chunk_size": (64, 100), "key_lengths": cp.asarray([0, 100])},
        ),
        "float64": (q64, k64, v64, {"is_causal": True, "key_lengths": cp.asarray([3, 257])}),
        "float16": (*(a.astype(cp.float16) for a in (q, k, v)), {"is_causal": True}),
        # Rows longer than a 64 KiB budget holds: blocks of 512 keys, joined.
        "2000 keys, budget 64 KiB, lengths 0 and 1500": (
            q[:, :1, :100],
            long_k,
            long_v,
            {"key_lengths": cp.asarray([0, 1500]), "budget": 2**16},
        ),
    }
    for name, (query, key, value, options) in cases.items():
        options = dict(options)
        budget = options.pop("budget", None)
        try:
            with attnx.memory_budget(budget) if budget else contextlib.nullcontext():
                got = attnx.scaled_dot_product_attention(query, key, value, **options)
                with generic_on_cupy():
                    expected = attnx.scaled_dot_product_attention(query, key, value, **options)
            scale = float(cp.abs(expected.astype(cp.float64)).max()) or 1.0
            error = float(cp.abs(got.astype(cp.float64) - expected.astype(cp.float64)).max()) / scale
            finite = bool(cp.isfinite(got).all())
            line = {"row": f"native against generic: {name}", "relative_error": error, "finite": finite}
        except Exception as exc:  # every case reports
            line = {"row": f"native against generic: {name}", "error": repr(exc)}
        print(json.dumps(line), flush=True)


def native() -> None:
    """The CuPy native of SDPA: its outputs (:func:`native_outputs`), then its
    time against the generic algorithm's and PyTorch's SDPA, each in this
    process; the kernel by its threads per row; causal calls by the blocks
    of rows they are cut into."""
    import cupy as cp

    from attnx_backends import cupy_attention

    native_outputs()
    gen = cp.random.default_rng(1)

    def inputs(shape):
        return [gen.standard_normal(shape, dtype=cp.float32) for _ in range(3)]

    # Host and GPU time of one call (cupyx.profiler.benchmark, means of 30):
    # a call whose host time exceeds its GPU time is launch-bound.
    from cupyx.profiler import benchmark

    for size, causal in ((512, False), (512, True), (2048, True), (8192, False)):
        q1 = inputs((1, 8, size, 64))[0]
        for name, context in (("native", contextlib.nullcontext), ("generic", generic_on_cupy)):
            with context():
                result = benchmark(
                    attnx.scaled_dot_product_attention,
                    (q1, q1, q1),
                    {"is_causal": causal},
                    n_repeat=30,
                    n_warmup=3,
                )
            line = {
                "row": f"profile {name} n={size} causal={causal}",
                "host_ms": round(float(result.cpu_times.mean()) * 1e3, 3),
                "gpu_ms": round(float(result.gpu_times.mean()) * 1e3, 3),
            }
            print(json.dumps(line), flush=True)
    # The kernel alone by its threads per row, on 512 MiB of scores.
    per_thread = cupy_attention.SCORES_PER_THREAD
    cupy_attention.SCORES_PER_THREAD = 1  # MAX_THREADS then sets them
    for width in (512, 1024, 8192):
        scores = gen.standard_normal((2**27 // width, width), dtype=cp.float32)
        for threads in (64, 128, 256, 512, 1024):
            cupy_attention.MAX_THREADS = threads
            result = benchmark(cupy_attention.cupy_row_softmax, (scores, None, 0), n_repeat=20, n_warmup=2)
            gpu_ms = round(float(result.gpu_times.mean()) * 1e3, 3)
            line = {"row": f"kernel width {width}, at most {threads} threads", "gpu_ms": gpu_ms}
            print(json.dumps(line), flush=True)
        del scores
    cupy_attention.MAX_THREADS, cupy_attention.SCORES_PER_THREAD = 512, per_thread
    for batch, heads, size in ((1, 8, 512), (1, 8, 2048), (1, 8, 8192), (16, 8, 1024)):
        for operation in ("sdpa", "sdpa_causal"):
            shape = dict(operation=operation, batch=batch, heads=heads, n=size, head_dim=64, device=CUDA, repeat=10)
            anchor = row(f"torch-sdpa {operation} {batch}x{size}", Case("torch-sdpa", **shape))
            fused = row(f"cupy native {operation} {batch}x{size}", Case("attnx:cupy", **shape))
            with generic_on_cupy():
                generic = row(f"cupy generic {operation} {batch}x{size}", Case("attnx:cupy", **shape))
            ratio(fused, anchor)
            ratio(generic, anchor)
            ratio(fused, generic)
    rule = cupy_attention.CAUSAL_BLOCKS
    for batch, size in ((1, 2048), (1, 8192), (16, 1024)):
        shape = dict(operation="sdpa_causal", batch=batch, heads=8, n=size, head_dim=64, device=CUDA, repeat=10)
        lines = {}
        for splits in (1, 2, 4, 8):
            cupy_attention.CAUSAL_BLOCKS = ((0, splits),)
            name = f"cupy native causal {batch}x{size}, {splits} blocks of rows"
            lines[splits] = row(name, Case("attnx:cupy", **shape))
        cupy_attention.CAUSAL_BLOCKS = rule
        lines["rule"] = row(f"cupy native causal {batch}x{size}, the rule's blocks", Case("attnx:cupy", **shape))
        for splits in (1, 2, 8, "rule"):
            ratio(lines[splits], lines[4])
    shape = dict(operation="sdpa", batch=1, heads=8, n=8192, head_dim=64, device=CUDA, repeat=10, dtype="float16")
    anchor = row("torch-sdpa float16 8192", Case("torch-sdpa", **shape))
    ratio(row("cupy native float16 8192", Case("attnx:cupy", **shape)), anchor)


@contextlib.contextmanager
def flash_choices(
    rows: tuple[int, ...] | None = None, keys: tuple[int, ...] | None = None, *, fused: bool = True
) -> Any:
    """Every call without a mask sent to the fused kernel (``fused``), with
    its choices of block rows and tile keys, or to attend's blocks (not
    ``fused``), for a while."""
    from attnx_backends import cupy_attention, cupy_flash

    saved = cupy_flash.ROW_CHOICES, cupy_flash.KEY_CHOICES, cupy_attention.FUSED_SCORES
    cupy_flash.ROW_CHOICES = () if not fused else saved[0] if rows is None else rows
    cupy_flash.KEY_CHOICES = saved[1] if keys is None else keys
    cupy_attention.FUSED_SCORES = 2**62  # every call
    try:
        yield
    finally:
        cupy_flash.ROW_CHOICES, cupy_flash.KEY_CHOICES, cupy_attention.FUSED_SCORES = saved


def flash_outputs() -> None:
    """The fused kernel's own cases: each call's output against the generic
    algorithm's, and whether the kernel took it."""
    import cupy as cp

    from attnx_backends import cupy_flash

    launches = []
    kernel = cupy_flash.attend

    def counted(flash, *args):
        launches.append(flash)
        return kernel(flash, *args)

    gen = cp.random.default_rng(4)

    def normal(*shape, dtype="float32"):
        return gen.standard_normal(shape, dtype=cp.float32).astype(dtype)

    q, k, v = normal(2, 4, 300, 64), normal(2, 4, 257, 64), normal(2, 4, 257, 64)
    infinite_key = k.copy()
    infinite_key[0, 0, 5, 0] = cp.inf
    minus_infinite_query = q.copy()
    minus_infinite_query[1, 2, 7, :] = -cp.inf
    nan_value = v.copy()
    nan_value[:, :, 200:, :] = cp.nan
    wide = normal(2, 300, 4, 64)  # (B, n, H, d): its transpose is not C-ordered
    cases = {
        "d 128": (normal(2, 4, 300, 128), normal(2, 4, 257, 128), normal(2, 4, 257, 128), {}),
        "d 128, causal": (normal(2, 4, 300, 128), normal(2, 4, 300, 128), normal(2, 4, 300, 128), {"is_causal": True}),
        "d_k 40, d_v 24": (normal(3, 5, 77, 40), normal(3, 5, 91, 40), normal(3, 5, 91, 24), {}),
        "d_k 40, d_v 24, causal n > m": (
            normal(3, 5, 120, 40),
            normal(3, 5, 91, 40),
            normal(3, 5, 91, 24),
            {"is_causal": True},
        ),
        "causal n < m": (normal(2, 4, 100, 64), normal(2, 4, 1000, 64), normal(2, 4, 1000, 64), {"is_causal": True}),
        "causal n > m": (normal(2, 4, 1000, 64), k, v, {"is_causal": True}),
        "float64 d 64, causal": (*(normal(2, 4, 300, 64, dtype="float64") for _ in range(3)), {"is_causal": True}),
        "float64 d_k 3, d_v 2": (
            normal(2, 9, 3, dtype="float64"),
            normal(2, 11, 3, dtype="float64"),
            normal(2, 11, 2, dtype="float64"),
            {},
        ),
        "float16, causal": (*(normal(2, 4, 300, 64, dtype="float16") for _ in range(3)), {"is_causal": True}),
        "n 1, m 1": (normal(1, 1, 1, 64), normal(1, 1, 1, 64), normal(1, 1, 1, 64), {}),
        "key lengths 0 and 100": (q, k, v, {"key_lengths": cp.asarray([0, 100])}),
        "key lengths per query, causal": (
            q,
            normal(2, 4, 300, 64),
            normal(2, 4, 300, 64),
            {"is_causal": True, "key_lengths": gen.integers(0, 301, (2, 4, 300))},
        ),
        "keys shared by the heads (2, 1, m, d)": (q, k[:, :1], v[:, :1], {}),
        "transposed query (B, n, H, d) -> (B, H, n, d)": (cp.swapaxes(wide, 1, 2), k, v, {}),
        "features sliced, q[..., :48] of 64": (q[..., :48], k[..., :48], v, {}),
        "scale 0.3": (q, k, v, {"scale": 0.3}),
        "scale a 0-d array": (q, k, v, {"scale": cp.asarray(0.3, dtype=cp.float32)}),
        "+inf in a key": (q, infinite_key, v, {}),
        "-inf query row": (minus_infinite_query, k, v, {}),
        "NaN values past the key lengths": (q, k, nan_value, {"key_lengths": cp.asarray([200, 150])}),
        "70,000 slices (a grid past 65,535)": (
            normal(70000, 16, 8),
            normal(70000, 16, 8),
            normal(70000, 16, 8),
            {"is_causal": True},
        ),
        "batch and heads (2, 3, 4)": (
            normal(2, 3, 4, 50, 16),
            normal(2, 3, 4, 60, 16),
            normal(2, 3, 4, 60, 16),
            {"is_causal": True},
        ),
    }
    cupy_flash.attend = counted
    try:
        for name, (query, key, value, options) in cases.items():
            launches.clear()
            try:
                with flash_choices():  # the kernel, wherever the rule would send the call
                    got = attnx.scaled_dot_product_attention(query, key, value, **options)
                fused = list(launches)
                with generic_on_cupy():
                    expected = attnx.scaled_dot_product_attention(query, key, value, **options)
                got64, expected64 = got.astype(cp.float64), expected.astype(cp.float64)
                both_nan = cp.isnan(got64) & cp.isnan(expected64)
                nan_mismatch = int((cp.isnan(got64) != cp.isnan(expected64)).sum())
                finite = cp.isfinite(expected64)
                size = float(cp.abs(cp.where(finite, expected64, 0)).max()) or 1.0
                error = float(cp.abs(cp.where(both_nan | ~finite, 0, got64 - expected64)).max()) / size
                line = {
                    "row": f"flash against generic: {name}",
                    "relative_error": error,
                    "nan_mismatches": nan_mismatch,
                    "nans": int(both_nan.sum()),
                    "zeros_rows": int((cp.abs(got64).sum(axis=-1) == 0).sum()),
                    "fused": [cupy_flash.kernel_name(plan) for plan in fused],
                }
            except Exception as exc:  # every case reports
                line = {"row": f"flash against generic: {name}", "error": repr(exc)}
            print(json.dumps(line), flush=True)
    finally:
        cupy_flash.attend = kernel


def flash_times() -> None:
    """The fused kernel's time against attend's blocks and PyTorch's SDPA,
    each in this process (every call sent to each)."""
    from attnx_backends import cupy_flash

    for batch, size, d in (
        (1, 512, 64),
        (1, 2048, 64),
        (1, 8192, 64),
        (16, 1024, 64),
        (64, 128, 64),
        (1, 2048, 128),
        (1, 128, 64),
    ):
        for operation in ("sdpa", "sdpa_causal"):
            shape = dict(operation=operation, batch=batch, heads=8, n=size, head_dim=d, device=CUDA, repeat=10)
            label = f"{operation} ({batch}, 8, {size}, {d})"
            plan = cupy_flash.plan("float32", d, d, size, size, batch * 8)
            anchor = row(f"torch-sdpa {label}", Case("torch-sdpa", **shape))
            with flash_choices():
                fused = row(f"cupy flash {label} {cupy_flash.kernel_name(plan)}", Case("attnx:cupy", **shape))
            with flash_choices(fused=False):
                blocked = row(f"cupy blocks {label}", Case("attnx:cupy", **shape))
            ratio(fused, anchor)
            ratio(blocked, anchor)
            ratio(fused, blocked)


@contextlib.contextmanager
def thread_queries(queries: tuple[int, ...], keys: tuple[int, ...]) -> Any:
    """The fused kernel's choices of queries a thread and keys a tile, for a while."""
    from attnx_backends import cupy_flash

    saved = cupy_flash.QUERY_CHOICES, cupy_flash.KEY_CHOICES
    cupy_flash.QUERY_CHOICES, cupy_flash.KEY_CHOICES = queries, keys
    try:
        yield
    finally:
        cupy_flash.QUERY_CHOICES, cupy_flash.KEY_CHOICES = saved


def flash_queries() -> None:
    """Several queries a thread in the fused kernel (float32): its outputs in
    flash_outputs' cases with two queries a thread, then its time against
    one query a thread and PyTorch's SDPA, every call sent to the kernel."""
    from attnx_backends import cupy_flash

    with thread_queries((2, 1), (4,)):
        flash_outputs()
    choices = (((1,), (8,)), ((2, 1), (8,)), ((2, 1), (4,)))
    for batch, size, d in ((1, 8192, 64), (16, 1024, 64), (1, 2048, 64), (1, 512, 64), (1, 2048, 128)):
        for operation in ("sdpa", "sdpa_causal"):
            shape = dict(operation=operation, batch=batch, heads=8, n=size, head_dim=d, device=CUDA, repeat=10)
            label = f"{operation} ({batch}, 8, {size}, {d})"
            anchor = row(f"torch-sdpa {label}", Case("torch-sdpa", **shape))
            lines = []
            for queries, keys in choices:
                with flash_choices(), thread_queries(queries, keys):
                    name = cupy_flash.kernel_name(cupy_flash.plan("float32", d, d, size, size, batch * 8))
                    lines.append(row(f"cupy flash {label} {name}", Case("attnx:cupy", **shape)))
                ratio(lines[-1], anchor)
                ratio(lines[-1], lines[0])


def flash_rule() -> None:
    """Where the fused kernel beats attend's blocks: small calls (their
    scores' count), and calls whose blocks the memory budget cuts small
    (their rounds of launches), each pair in this process."""
    from attnx_backends import cupy_attention

    cases = [
        (1, 8, 256, None),
        (1, 1, 512, None),
        (4, 8, 256, None),
        (1, 2, 1024, None),
        (1, 8, 2048, 16 * MiB),
        (1, 8, 2048, 4 * MiB),
        (1, 8, 2048, 1 * MiB),
        (16, 8, 1024, 64 * MiB),
        (16, 8, 1024, 16 * MiB),
        (1, 8, 8192, 64 * MiB),
        (1, 8, 8192, 16 * MiB),
        (1, 8, 8192, 1 * MiB),
    ]
    for batch, heads, size, budget in cases:
        for operation in ("sdpa", "sdpa_causal"):
            shape = dict(operation=operation, batch=batch, heads=heads, n=size, head_dim=64, device=CUDA, repeat=5)
            per_block, rows, keys = cupy_attention.plan(
                batch * heads, size, size, 4, operation == "sdpa_causal", budget or GPU_BLOCK_BYTES, None
            )
            rounds = -(-batch * heads // per_block) * -(-size // rows) * -(-size // keys)
            label = (
                f"{operation} ({batch}, {heads}, {size}, 64), budget {budget and budget // MiB} MiB, {rounds} rounds"
            )
            with flash_choices():
                fused = row(f"cupy flash {label}", Case("attnx:cupy", **shape), budget)
            with flash_choices(fused=False):
                blocked = row(f"cupy blocks {label}", Case("attnx:cupy", **shape), budget)
            ratio(fused, blocked)


def flash() -> None:
    """The fused kernel (``attnx_backends.cupy_flash``): its outputs
    (:func:`flash_outputs`, then :func:`native_outputs`, whose calls without
    a mask it now takes), its time against attend's blocks and PyTorch's
    SDPA in this process, and its blocks' rows and tiles' keys."""
    from attnx_backends import cupy_flash

    flash_outputs()
    native_outputs()
    flash_times()
    for batch, size, operation in ((1, 8192, "sdpa"), (1, 8192, "sdpa_causal"), (16, 1024, "sdpa"), (1, 512, "sdpa")):
        shape = dict(operation=operation, batch=batch, heads=8, n=size, head_dim=64, device=CUDA, repeat=10)
        lines = {}
        for rows in (128, 64, 32):
            for keys in (32, 16, 8):
                with flash_choices(rows=(rows,), keys=(keys,)):
                    plan = cupy_flash.plan("float32", 64, 64, size, size, batch * 8)
                    if plan is None or (plan.rows, plan.keys) != (rows, keys):
                        continue
                    name = f"cupy flash {operation} ({batch}, 8, {size}, 64), {rows} rows, {keys} keys"
                    lines[rows, keys] = row(name, Case("attnx:cupy", **shape))
        best = min((line for line in lines.values() if line["median_ms"]), key=lambda line: line["median_ms"])
        for line in lines.values():
            ratio(line, best)


def synchronized_ms(call: Any, synchronize: Any, repeat: int = 20) -> float:
    """The median of ``repeat`` calls, each waited for (after three
    unmeasured), in ms: host and GPU time together, as ``attnx bench``
    times a call."""
    import time

    for _ in range(3):
        call()
    synchronize()
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        synchronize()
        times.append(time.perf_counter() - start)
    return round(sorted(times)[repeat // 2] * 1e3, 3)


def masks() -> None:
    """The CuPy native with masks that have leading axes of their own (a
    ``(B, 1, 1, m)`` padding mask, a ``(B, 1, n, m)`` boolean mask, a
    per-head bias ``(1, H, n, m)``), each block's entries taken by integer
    indexing: its time against the generic algorithm's and PyTorch's SDPA
    with the same mask (as a tensor over the same memory), each in this
    process, and its output against both."""
    import cupy as cp
    import torch

    gen = cp.random.default_rng(2)
    synchronize = cp.cuda.Device().synchronize
    cases = {
        "(16, 8, 1024, 64), padding mask (16, 1, 1, m)": ((16, 8, 1024, 64), (16, 1, 1, 1024), "bool"),
        "(16, 8, 1024, 64), boolean mask (16, 1, n, m)": ((16, 8, 1024, 64), (16, 1, 1024, 1024), "bool"),
        "(2, 8, 4096, 64), padding mask (2, 1, 1, m)": ((2, 8, 4096, 64), (2, 1, 1, 4096), "bool"),
        "(1, 8, 2048, 64), per-head bias (1, 8, n, m)": ((1, 8, 2048, 64), (1, 8, 2048, 2048), "float32"),
        "(1, 8, 2048, 64), shared bias (n, m)": ((1, 8, 2048, 64), (2048, 2048), "float32"),
    }
    for name, (shape, mask_shape, mask_dtype) in cases.items():
        q, k, v = (gen.standard_normal(shape, dtype=cp.float32) for _ in range(3))
        if mask_dtype == "bool":  # every row keeps its first key: no row without a key in torch's either
            mask = gen.random(mask_shape) < 0.7
            mask[..., 0] = True
        else:
            mask = gen.standard_normal(mask_shape, dtype=cp.float32)
        tq, tk, tv, tmask = (torch.from_dlpack(a) for a in (q, k, v, mask))

        def native(q=q, k=k, v=v, mask=mask):
            return attnx.scaled_dot_product_attention(q, k, v, mask=mask)

        def anchor(q=tq, k=tk, v=tv, mask=tmask):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)

        got = native()
        with generic_on_cupy():
            expected = native()
            generic_ms = synchronized_ms(native, synchronize)
        torch_out = cp.from_dlpack(anchor())
        size = float(cp.abs(expected).max())
        line = {
            "row": f"masks: {name}",
            "native_ms": synchronized_ms(native, synchronize),
            "generic_ms": generic_ms,
            "torch_sdpa_ms": synchronized_ms(anchor, torch.cuda.synchronize),
            "error_to_generic": float(cp.abs(got - expected).max()) / size,
            "error_to_torch": float(cp.abs(got - torch_out).max()) / size,
        }
        line["native/generic"] = round(line["native_ms"] / line["generic_ms"], 3)
        line["native/torch"] = round(line["native_ms"] / line["torch_sdpa_ms"], 3)
        print(json.dumps(line), flush=True)
        del q, k, v, mask, tq, tk, tv, tmask, got, expected, torch_out


def host_profile() -> None:
    """Where the CuPy native's host time goes at (1, 8, 512, 64), full and
    causal, where the call is launch-bound: cProfile over 200 calls, the
    functions by their own time, beside the generic algorithm's total."""
    import cProfile
    import io
    import pstats

    import cupy as cp

    q = cp.random.default_rng(3).standard_normal((1, 8, 512, 64), dtype=cp.float32)
    for causal in (False, True):
        for name, context in (("native", contextlib.nullcontext), ("generic", generic_on_cupy)):
            with context():
                for _ in range(20):
                    attnx.scaled_dot_product_attention(q, q, q, is_causal=causal)
                cp.cuda.Device().synchronize()
                profile = cProfile.Profile()
                profile.enable()
                for _ in range(200):
                    attnx.scaled_dot_product_attention(q, q, q, is_causal=causal)
                profile.disable()
                cp.cuda.Device().synchronize()
            text = io.StringIO()
            stats = pstats.Stats(profile, stream=text)
            total_us = stats.total_tt / 200 * 1e6
            print(json.dumps({"row": f"host profile {name} causal={causal}", "us_a_call": round(total_us, 1)}))
            if name == "native":
                stats.sort_stats("tottime").print_stats(25)
                print(text.getvalue(), flush=True)


@contextlib.contextmanager
def without_cudnn() -> Any:
    """The CuPy native with its cuDNN route set aside: half precision in
    attnx's own kernels (computed in float32), as before the route."""
    from attnx_backends import cupy_cudnn

    plan = cupy_cudnn.plan
    cupy_cudnn.plan = lambda *args, **kwargs: None
    attnx._registry._plans.clear()  # plans made with the route hold it
    try:
        yield
    finally:
        cupy_cudnn.plan = plan
        attnx._registry._plans.clear()


def half_dtype(name: str) -> Any:
    """CuPy's dtype of that name: bfloat16 is ml_dtypes' (CuPy 14 and later)."""
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    import cupy as cp

    return getattr(cp, name)


def cudnn_cases() -> dict[str, tuple[Any, ...]]:
    """The cuDNN route's cases: ``name: (dtype, query, key, value, options)``,
    in float32 (each check casts them), from issue 61's list: n != m, causal
    both ways, d 128, grouped heads, key lengths (0 among them), and what the
    route declines."""
    import cupy as cp

    gen = cp.random.default_rng(5)

    def normal(*shape):
        return gen.standard_normal(shape, dtype=cp.float32)

    def lengths(*values):
        return cp.asarray(values, dtype=cp.int64)

    return {
        "(2, 4, 300, 64) m 257": ("float16", normal(2, 4, 300, 64), normal(2, 4, 257, 64), normal(2, 4, 257, 64), {}),
        "(2, 4, 300, 64) causal": ("float16", *(normal(2, 4, 300, 64) for _ in range(3)), {"is_causal": True}),
        "bfloat16 causal": ("bfloat16", *(normal(2, 4, 300, 64) for _ in range(3)), {"is_causal": True}),
        "causal n 100 < m 1000": (
            "float16",
            normal(2, 4, 100, 64),
            normal(2, 4, 1000, 64),
            normal(2, 4, 1000, 64),
            {"is_causal": True},
        ),
        "causal n 1 < m 4096 (decoding)": (
            "float16",
            normal(4, 8, 1, 128),
            normal(4, 8, 4096, 128),
            normal(4, 8, 4096, 128),
            {"is_causal": True},
        ),
        "decoding over caches, lengths 0, 1, 3000, 4096": (
            "float16",
            normal(4, 8, 1, 128),
            normal(4, 8, 4096, 128),
            normal(4, 8, 4096, 128),
            {"is_causal": True, "key_lengths": lengths(0, 1, 3000, 4096), "causal_align": "key_lengths"},
        ),
        "padding, lengths per sequence (B,)": (
            "bfloat16",
            normal(3, 4, 200, 64),
            normal(3, 4, 300, 64),
            normal(3, 4, 300, 64),
            {"key_lengths": lengths(300, 17, 0)},
        ),
        "grouped heads 8/2 (enable_gqa)": (
            "float16",
            normal(2, 8, 256, 64),
            normal(2, 2, 256, 64),
            normal(2, 2, 256, 64),
            {"enable_gqa": True, "is_causal": True},
        ),
        "d 128, scale 0.3": ("float16", *(normal(1, 8, 512, 128) for _ in range(3)), {"scale": 0.3}),
        "d_k 64, d_v 32": ("float16", normal(2, 4, 200, 64), normal(2, 4, 300, 64), normal(2, 4, 300, 32), {}),
        "keys shared by heads": ("float16", normal(2, 4, 256, 64), normal(2, 1, 256, 64), normal(2, 1, 256, 64), {}),
        "n 1, m 1": ("float16", normal(1, 1, 1, 64), normal(1, 1, 1, 64), normal(1, 1, 1, 64), {}),
        "(16, 8, 1024, 64) causal": ("float16", *(normal(16, 8, 1024, 64) for _ in range(3)), {"is_causal": True}),
        "(1, 8, 8192, 64)": ("float16", *(normal(1, 8, 8192, 64) for _ in range(3)), {}),
        "causal n 1000 > m 257 (declined)": (
            "float16",
            normal(2, 4, 1000, 64),
            normal(2, 4, 257, 64),
            normal(2, 4, 257, 64),
            {"is_causal": True},
        ),
        "causal with key lengths (declined)": (
            "float16",
            *(normal(2, 4, 100, 64) for _ in range(3)),
            {"is_causal": True, "key_lengths": lengths(100, 50)},
        ),
        "d 40 (declined)": ("float16", *(normal(2, 4, 100, 40) for _ in range(3)), {}),
    }


def cudnn_taken(query: Any, key: Any, value: Any, options: dict[str, Any], training: bool = False) -> bool:
    """Whether the cuDNN route takes this call (the layout attnx computes it in)."""
    import array_api_compat.cupy as xp

    from attnx.attention import validated_call
    from attnx_backends import cupy_attention

    call = validated_call("scaled_dot_product_attention", query, key, value, **options)
    query, key, value, mask, key_lengths, is_causal, batch_shape, _ = call.computed
    if mask is not None:
        return False
    route = cupy_attention._cudnn_route(
        xp, query, key, value, key_lengths, is_causal, call.scale, batch_shape, device_index=0, training=training
    )
    return route is not None


def cudnn_outputs() -> None:
    """float16 and bfloat16 through cuDNN's SDPA (``attnx_backends.cupy_cudnn``):
    each call's output against the same inputs in float32 through attnx's
    own kernels, and whether the route took it."""
    import cupy as cp

    from attnx_backends import cupy_cudnn

    print(json.dumps({"row": "cudnn route", "unavailable": cupy_cudnn.unavailable_reason()}), flush=True)
    if cupy_cudnn.unavailable_reason() is None:
        import cudnn

        print(
            json.dumps({"row": "cudnn versions", "frontend": cudnn.__version__, "backend": cudnn.backend_version()}),
            flush=True,
        )
    from attnx._registry import registry

    print(json.dumps({"row": "cupy float dtypes", "declared": registry.get("cupy").float_dtypes}), flush=True)
    for name, (dtype, q, k, v, options) in cudnn_cases().items():
        try:
            q, k, v = (a.astype(half_dtype(dtype)) for a in (q, k, v))
            taken = cudnn_taken(q, k, v, options)
            got = attnx.scaled_dot_product_attention(q, k, v, **options)
            again = attnx.scaled_dot_product_attention(q, k, v, **options)  # a plan's, where attnx makes one
            want = attnx.scaled_dot_product_attention(*(a.astype(cp.float32) for a in (q, k, v)), **options)
            error = float(cp.max(cp.abs(got.astype(cp.float32) - want))) / max(float(cp.max(cp.abs(want))), 1e-30)
            line = {
                "row": f"cudnn outputs {name}",
                "taken": taken,
                "dtype": str(got.dtype),
                "shape": list(got.shape),
                "error_of_max": f"{error:.2e}",
                "nan": bool(cp.isnan(got.astype(cp.float32)).any()),
                "second_call_equal": bool(cp.array_equal(got, again)),
            }
        except Exception as exc:
            line = {"row": f"cudnn outputs {name}", "error": repr(exc)[:500]}
        print(json.dumps(line), flush=True)


def cudnn_vjp() -> None:
    """``attnx.vjp`` of half-precision SDPA through cuDNN's backward: the
    gradients against the same call's in float32 (attnx's generic backward),
    then time and peak memory against PyTorch's autograd of its own SDPA in
    float16 on the same GPU."""
    import cupy as cp

    for name, (dtype, q, k, v, options) in cudnn_cases().items():
        try:
            g = cp.random.default_rng(9).standard_normal((*q.shape[:-1], v.shape[-1]), dtype=cp.float32)
            half = [a.astype(half_dtype(dtype)) for a in (q, k, v, g)]
            taken = cudnn_taken(*half[:3], options, training=True)
            _, backward = attnx.vjp(attnx.scaled_dot_product_attention, *half[:3], **options)
            grads = backward(half[3])
            _, backward32 = attnx.vjp(
                attnx.scaled_dot_product_attention, *(a.astype(cp.float32) for a in half[:3]), **options
            )
            want = backward32(half[3].astype(cp.float32))
            errors = {
                key: f"{float(cp.max(cp.abs(grads[key].astype(cp.float32) - want[key]))) / max(float(cp.max(cp.abs(want[key]))), 1e-30):.2e}"
                for key in ("query", "key", "value")
            }
            line = {
                "row": f"cudnn vjp {name}",
                "taken": taken,
                "dtypes": sorted({str(x.dtype) for x in grads.values()}),
                "error_of_max": errors,
                "nan": any(bool(cp.isnan(x.astype(cp.float32)).any()) for x in grads.values()),
            }
        except Exception as exc:
            line = {"row": f"cudnn vjp {name}", "error": repr(exc)[:500]}
        print(json.dumps(line), flush=True)

    for batch, size, d in ((1, 2048, 64), (16, 1024, 64), (1, 8192, 64), (1, 8192, 128)):
        for causal in (False, True):
            label = f"({batch}, 8, {size}, {d}) causal={causal} float16"
            vjp_against_torch(f"cudnn vjp time {label}", (batch, 8, size, d), causal, "float16", repeat=10)


def vjp_against_torch(row: str, shape: tuple[int, ...], causal: bool, dtype: str, repeat: int) -> None:
    """``attnx.vjp`` of SDPA on CuPy, forward and backward, against PyTorch's
    autograd of its own SDPA on the same GPU, inputs of ``shape`` in
    ``dtype``: each one's time (the median of ``repeat`` steps) and peak
    memory, printed as ``row``."""
    import cupy as cp
    import torch
    from cupy.cuda import memory_hook

    from attnx.benchmark import PoolPeak

    q, k, v, g = (cp.random.default_rng(i).standard_normal(shape, dtype=cp.float32).astype(dtype) for i in range(4))

    def step():
        _, backward = attnx.vjp(attnx.scaled_dot_product_attention, q, k, v, is_causal=causal)
        return backward(g)

    hook = type("PoolPeakHook", (PoolPeak, memory_hook.MemoryHook), {})()
    cp.cuda.Device().synchronize()
    with hook:
        step()
        cp.cuda.Device().synchronize()
    ms = synchronized_ms(step, cp.cuda.Device().synchronize, repeat=repeat)
    torch_dtype = getattr(torch, dtype)
    tq, tk, tv = (torch.randn(shape, device="cuda", dtype=torch_dtype, requires_grad=True) for _ in range(3))
    tg = torch.randn(shape, device="cuda", dtype=torch_dtype)

    def torch_step():
        out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
        return torch.autograd.grad(out, (tq, tk, tv), tg)

    torch_step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch_step()
    torch.cuda.synchronize()
    torch_peak = torch.cuda.max_memory_allocated() - base
    torch_ms = synchronized_ms(torch_step, torch.cuda.synchronize, repeat=repeat)
    line = {
        "row": row,
        "cupy_ms": ms,
        "torch_ms": torch_ms,
        "ratio": round(ms / torch_ms, 2),
        "cupy_peak_mib": round(hook.peak / MiB, 1),
        "torch_peak_mib": round(torch_peak / MiB, 1),
    }
    print(json.dumps(line), flush=True)


def cudnn_times() -> None:
    """Issue 61's shapes: float16 through cuDNN, float16 in attnx's own
    kernels, and PyTorch's SDPA on the same GPU; then float32's cells."""
    shapes = ((1, 2048, 64), (1, 8192, 64), (1, 2048, 128), (1, 8192, 128), (16, 1024, 64))
    for batch, size, d in shapes:
        for operation in ("sdpa", "sdpa_causal"):
            shape = dict(operation=operation, batch=batch, heads=8, n=size, head_dim=d, device=CUDA, repeat=10)
            label = f"{operation} ({batch}, 8, {size}, {d}) float16"
            anchor = row(f"torch-sdpa {label}", Case("torch-sdpa", dtype="float16", **shape))
            routed = row(f"cupy cudnn {label}", Case("attnx:cupy", dtype="float16", **shape))
            ratio(routed, anchor)
            if size == 2048:
                with without_cudnn():
                    own = row(f"cupy own kernels {label}", Case("attnx:cupy", dtype="float16", **shape))
                ratio(own, anchor)
    for batch, size, d in (*shapes, (1, 128, 64)):
        for operation in ("sdpa", "sdpa_causal"):
            shape = dict(operation=operation, batch=batch, heads=8, n=size, head_dim=d, device=CUDA, repeat=10)
            label = f"{operation} ({batch}, 8, {size}, {d}) float32"
            anchor = row(f"torch-sdpa {label}", Case("torch-sdpa", **shape))
            ratio(row(f"cupy {label}", Case("attnx:cupy", **shape)), anchor)


@contextlib.contextmanager
def fused_for_few_queries() -> Any:
    """The CuPy native as before the forty-ninth session: its fused kernel
    for a call of few queries too, one thread walking each query's keys."""
    from attnx_backends import cupy_attention

    saved = cupy_attention.FUSED_MIN_QUERIES
    cupy_attention.FUSED_MIN_QUERIES = 0
    attnx._registry._plans.clear()
    try:
        yield
    finally:
        cupy_attention.FUSED_MIN_QUERIES = saved
        attnx._registry._plans.clear()


@contextlib.contextmanager
def tiled_forward() -> Any:
    """float32 calls without a mask sent to the tiled kernel, for a while
    (``cupy_attention.TILED_FORWARD``), split keys included."""
    from attnx_backends import cupy_attention

    saved, cupy_attention.TILED_FORWARD = cupy_attention.TILED_FORWARD, True
    attnx._registry._plans.clear()
    try:
        yield
    finally:
        cupy_attention.TILED_FORWARD = saved
        attnx._registry._plans.clear()


def decode_times() -> None:
    """Issue 59's decoding shapes (a token a sequence over a padded cache,
    ``attnx bench --operations decode``) on CuPy against PyTorch's SDPA on
    the same GPU: float32 in attend's blocks (the route of a call of few
    queries, ``cupy_attention.FUSED_MIN_QUERIES``) against the fused kernel,
    which took them before; float16 through cuDNN's padding mask."""
    shapes = ((1, 32, 8, 16384, 128), (8, 32, 8, 2048, 128), (4, 32, 32, 4096, 128))
    for batch, heads, kv_heads, cache, d in shapes:
        for dtype in ("float32", "float16"):
            shape = dict(operation="decode", batch=batch, heads=heads, kv_heads=kv_heads, n=cache, head_dim=d)
            shape.update(dtype=dtype, device=CUDA, repeat=20)
            label = f"decode ({batch}, {heads}/{kv_heads}, 1, {cache}, {d}) {dtype}"
            anchor = row(f"torch-sdpa {label}", Case("torch-sdpa", **shape))
            ratio(row(f"cupy {label}", Case("attnx:cupy", **shape)), anchor)
            if dtype == "float32":
                with fused_for_few_queries():
                    ratio(row(f"cupy fused kernel {label}", Case("attnx:cupy", **shape)), anchor)
                with tiled_forward():
                    ratio(row(f"cupy tiled, split keys {label}", Case("attnx:cupy", **shape)), anchor)


def launch_cost() -> None:
    """CuPy's cost of one kernel launch from Python (an empty RawKernel, 2,000
    launches then one wait), and of one small fused call, in microseconds."""
    import time

    import cupy as cp

    empty = cp.RawKernel('extern "C" __global__ void nothing(int x) {}', "nothing")
    empty((1,), (32,), (cp.int32(0),))
    cp.cuda.Device().synchronize()
    start = time.perf_counter()
    for _ in range(2000):
        empty((1,), (32,), (cp.int32(0),))
    cp.cuda.Device().synchronize()
    print(
        json.dumps({"row": "cupy empty RawKernel launch", "us": round((time.perf_counter() - start) / 2000 * 1e6, 2)})
    )
    q = cp.random.default_rng(1).standard_normal((1, 8, 128, 64), dtype=cp.float32)
    for causal in (False, True):
        ms = synchronized_ms(
            lambda causal=causal: attnx.scaled_dot_product_attention(q, q, q, is_causal=causal),
            cp.cuda.Device().synchronize,
            repeat=200,
        )
        print(
            json.dumps({"row": f"cupy (1, 8, 128, 64) causal={causal} one call", "us": round(ms * 1e3, 1)}), flush=True
        )


def vjp() -> None:
    """``attnx.vjp`` of SDPA on CuPy: its gradients against the float64
    reference (NumPy), and its time and peak memory against PyTorch's
    autograd of its own SDPA on the same GPU."""
    import cupy as cp
    import numpy as np

    from attnx_conformance import reference

    rng = np.random.default_rng(2)
    for name, (n, m, options) in {
        "n 77, m 130": (77, 130, {}),
        "causal n 77, m 130": (77, 130, {"is_causal": True}),
        "causal n 130, m 77 (rows without keys)": (130, 77, {"is_causal": True}),
        "key lengths 0 and 37": (64, 100, {"key_lengths": np.asarray([[0], [37]])}),
    }.items():
        q, k, v, g = (rng.standard_normal((2, 3, rows, 16)) for rows in (n, m, m, n))
        args = {kw: cp.asarray(a) if isinstance(a, np.ndarray) else a for kw, a in options.items()}
        try:
            output, backward = attnx.vjp(
                attnx.scaled_dot_product_attention, cp.asarray(q), cp.asarray(k), cp.asarray(v), **args
            )
            grads = backward(cp.asarray(g))
            allowed = reference.allowed_mask(n, m, batch_shape=(2, 3), **options)
            want = reference.scaled_dot_product_attention_vjp(q, k, v, g, allowed=allowed)
            errors = {
                key: float(np.max(np.abs(cp.asnumpy(grads[key]) - want[key]))) for key in ("query", "key", "value")
            }
            print(
                json.dumps(
                    {
                        "row": f"cupy vjp float64 {name}",
                        "max_abs_errors": errors,
                        "nan": any(bool(cp.isnan(x).any()) for x in grads.values()),
                    }
                ),
                flush=True,
            )
        except Exception as exc:
            print(json.dumps({"row": f"cupy vjp float64 {name}", "error": repr(exc)[:500]}), flush=True)

    for batch, size in ((1, 2048), (16, 1024), (1, 8192)):
        for causal in (False, True):
            label = f"({batch}, 8, {size}, 64) causal={causal} float32"
            vjp_against_torch(f"vjp {label}", (batch, 8, size, 64), causal, "float32", repeat=5)


TILED_CASES = (
    # (slices, n, m, d_k, d_v, causal, key lengths)
    (8, 2048, 2048, 64, 64, False, False),
    (8, 2048, 2048, 64, 64, True, False),
    (3, 100, 77, 64, 48, False, True),  # blocks and tiles cut short, lengths of 0 included
    (2, 5, 300, 128, 128, True, False),  # causal with n < m: the last queries' keys
    (2, 300, 5, 33, 7, True, True),  # n > m: queries before the first key get zeros
    (16, 1024, 1024, 128, 128, True, True),
    (1, 1, 4096, 64, 64, False, False),  # decoding: one query
)


def tiled_outputs() -> None:
    """The tiled fused kernel (``attnx_backends.cupy_tiled``, float32) on the
    GPU against the float64 reference from the same inputs, in each of
    :data:`TILINGS`, and its backward's gradients: blocks and tiles cut
    short, causal calls with n above and below m, key lengths."""
    import cupy as cp
    import numpy as np

    from attnx_backends import cupy_tiled, cupy_tiled_backward
    from attnx_conformance import reference

    rng = np.random.default_rng(61)
    for (slices, n, m, d_k, d_v, causal, lengths), tiling in itertools.product(TILED_CASES, TILINGS):
        name = f"cupy tiled {tiling} ({slices}, {n}, {m}, {d_k}, {d_v}) causal={causal} lengths={lengths}"
        try:
            q, k = (rng.standard_normal((slices, rows, d_k)).astype(np.float32) for rows in (n, m))
            v = rng.standard_normal((slices, m, d_v)).astype(np.float32)
            limits = rng.integers(0, m + 1, size=(slices, n)).astype(np.int32) if lengths else None
            if limits is not None:
                limits[0, : min(n, 3)] = 0
            with tile_choices((tiling,)):  # split keys where the call's blocks leave the GPU idle, as decoding
                tiled = cupy_tiled.plan("float32", d_k, d_v, n, m, slices, target_blocks=cupy_tiled.device_blocks(0))
            if tiled is None:
                continue
            name += f" splits={tiled.splits}"
            got = cupy_tiled.attend(
                tiled,
                *(cp.asarray(a) for a in (q, k, v)),
                None if limits is None else cp.asarray(limits),
                d_k**-0.5,
                causal,
            )
            allowed = reference.allowed_mask(n, m, batch_shape=(slices,), is_causal=causal)
            if limits is not None:
                allowed = allowed & (np.arange(m) < limits[..., None])
            want, _ = reference.scaled_dot_product_attention(q, k, v, allowed=allowed, scale=d_k**-0.5)
            got = cp.asnumpy(got)
            line = {"row": name, "max_abs_error": float(np.max(np.abs(got - want))), "nan": bool(np.isnan(got).any())}
            if tiling == TILINGS[0]:  # the backward's kernels have one tiling: from the forward's statistics
                g = rng.standard_normal((slices, n, d_v)).astype(np.float32)
                arrays = [cp.asarray(a) for a in (q, k, v)]
                limits_gpu = None if limits is None else cp.asarray(limits)
                output, stats = cupy_tiled.attend(tiled, *arrays, limits_gpu, d_k**-0.5, causal, with_stats=True)
                plans = cupy_tiled_backward.plans("float32", d_k, d_v, n, m, slices)
                grads = cupy_tiled_backward.attend(
                    plans, *arrays, output, stats, cp.asarray(g), limits_gpu, d_k**-0.5, causal
                )
                wants = reference.scaled_dot_product_attention_vjp(q, k, v, g, allowed=allowed, scale=d_k**-0.5)
                for key_name, grad in zip(("query", "key", "value"), grads):
                    grad = cp.asnumpy(grad)
                    line[f"d_{key_name}_max_abs_error"] = float(np.max(np.abs(grad - wants[key_name])))
                    line["nan"] = line["nan"] or bool(np.isnan(grad).any())
        except Exception as exc:
            line = {"row": name, "error": repr(exc)[:500]}
        print(json.dumps(line), flush=True)


@contextlib.contextmanager
def tile_choices(choices: tuple[tuple[int, int], ...]) -> Any:
    """The tiled kernel's choices of a thread's queries and keys, for a while."""
    from attnx_backends import cupy_tiled

    saved, cupy_tiled.TILE_CHOICES = cupy_tiled.TILE_CHOICES, choices
    try:
        yield
    finally:
        cupy_tiled.TILE_CHOICES = saved


#: A thread's (queries, keys of a tile) that tiled_times compares.
TILINGS = ((4, 4), (2, 4), (2, 8), (4, 8))


def tiled_times() -> None:
    """Issue 61's float32 shapes: the tiled fused kernel, in each of
    :data:`TILINGS`, against the fused kernel of a query a thread
    (``cupy_flash``) on the same laid-out arrays, and PyTorch's SDPA, each
    call waited for, in this process."""
    from functools import partial

    import cupy as cp
    import torch

    from attnx_backends import cupy_flash, cupy_tiled

    for batch, size, d in ((1, 2048, 64), (1, 8192, 64), (1, 2048, 128), (1, 8192, 128), (16, 1024, 64), (1, 128, 64)):
        slices = batch * 8
        q, k, v = (cp.random.standard_normal((slices, size, d), dtype=cp.float32) for _ in range(3))
        tq, tk, tv = (torch.as_tensor(a, device="cuda").reshape(batch, 8, size, d) for a in (q, k, v))
        tilings = []
        for choice in TILINGS:
            with tile_choices((choice,)):
                tilings.append(cupy_tiled.plan("float32", d, d, size, size, slices))
        flash = cupy_flash.plan("float32", d, d, size, size, slices)
        wait = cp.cuda.Device().synchronize
        for causal in (False, True):
            line = {"row": f"tiled ({batch}, 8, {size}, {d}) causal={causal} float32"}
            try:
                sdpa = torch.nn.functional.scaled_dot_product_attention
                line["torch_ms"] = synchronized_ms(partial(sdpa, tq, tk, tv, is_causal=causal), torch.cuda.synchronize)
                if flash is not None:
                    call = partial(cupy_flash.attend, flash, q, k, v, None, d**-0.5, causal)
                    line[cupy_flash.kernel_name(flash) + "_ms"] = synchronized_ms(call, wait)
                for tiled in filter(None, tilings):
                    call = partial(cupy_tiled.attend, tiled, q, k, v, None, d**-0.5, causal)
                    line[cupy_tiled.kernel_name(tiled) + "_ms"] = milliseconds = synchronized_ms(call, wait)
                    line[cupy_tiled.kernel_name(tiled) + "_over_torch"] = round(milliseconds / line["torch_ms"], 3)
            except Exception as exc:
                line["error"] = repr(exc)[:500]
            print(json.dumps(line), flush=True)
            # The whole call, attnx's dispatch and layout included, each way.
            operation = "sdpa_causal" if causal else "sdpa"
            shape = dict(operation=operation, batch=batch, heads=8, n=size, head_dim=d, device=CUDA, repeat=10)
            label = f"{operation} ({batch}, 8, {size}, {d})"
            default = row(f"cupy {label}", Case("attnx:cupy", **shape))
            with tiled_forward():
                ratio(row(f"cupy tiled {label}", Case("attnx:cupy", **shape)), default)


if __name__ == "__main__":
    functions = {
        "window": window,
        "family": family,
        "jax": jax_tracer,
        "additive": additive,
        "breakdown": breakdown,
        "native": native,
        "native_outputs": native_outputs,
        "masks": masks,
        "host_profile": host_profile,
        "flash": flash,
        "flash_outputs": flash_outputs,
        "flash_times": flash_times,
        "flash_rule": flash_rule,
        "flash_queries": flash_queries,
        "cudnn_outputs": cudnn_outputs,
        "cudnn_times": cudnn_times,
        "cudnn_vjp": cudnn_vjp,
        "launch_cost": launch_cost,
        "decode_times": decode_times,
        "vjp": vjp,
        "tiled_outputs": tiled_outputs,
        "tiled_times": tiled_times,
    }
    for stage in sys.argv[1:] or ["window", "family"]:  # in the order named: the first is the surest to finish
        try:
            functions[stage]()
        except Exception as exc:  # one stage's failure leaves the others' figures
            print(json.dumps({"stage": stage, "error": repr(exc)}), flush=True)
