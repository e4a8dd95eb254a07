"""``attnx bench``: time and peak memory of attention across backends.

Each measurement runs in fresh processes (``python -m attnx.benchmark
worker CASE time|memory``): one array library per process, so OpenBLAS's
spinning idle threads never slow PyTorch.  The times come from one process;
the peak memory of one call from another, read from the process's own
high-water mark (``/proc/self/status``'s VmHWM, reset through
``/proc/self/clear_refs`` just before the call; large allocations are forced
to ``mmap`` there so freed memory really leaves, which would slow the timed
process).  On CUDA, PyTorch's own counters are used instead, and for CuPy
a hook on its memory pool counts what the call takes from it.

The report compares, for each size, attnx on each backend with the
baselines a user would otherwise pick, measured in the same run: PyTorch's
``scaled_dot_product_attention`` called directly, the textbook NumPy version,
and ``jax.nn.dot_product_attention`` under ``jit`` (when JAX is installed;
attnx on JAX is jitted too, as JAX's users run it).  FLOPs counted: ``4 * batch * heads * n * m * d`` for attention
(two matrix products), halved for causal masks.
"""

from __future__ import annotations

import json
import math
import os
import platform
import statistics
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from attnx._table import format_table

#: Operations a case can time.  ``sliding_window``: a causal sliding window
#: of :attr:`Case.window` keys through :func:`attnx.flex_attention` and a
#: block mask (made before the timing, as it is reused across calls).
OPERATIONS = (
    "sdpa",
    "sdpa_causal",
    "sdpa+backward",
    "sdpa_causal+backward",
    "multi_head_attention",
    "additive_attention",
    "sliding_window",
    "decode",
)
#: ``decode``: :attr:`Case.queries` new queries (1: a token; more: a chunk
#: of prefill, causal, aligned to the end of each sequence's own keys) of
#: ``heads`` heads over a cache of ``n`` keys of :attr:`Case.kv_heads` heads
#: (grouped where fewer), padded: sequence ``b`` holds ``n - b * n // (2 *
#: batch)`` keys (:func:`cache_lengths`; PyTorch's SDPA gets the padding and
#: the alignment as its mask, :func:`decode_mask`, and ``enable_gqa``).
#: A training step: the forward and its backward (``attnx.vjp``'s on attnx,
#: autograd's on the baselines), the output itself as the cotangent.
BACKWARD = {"sdpa": "sdpa+backward", "sdpa_causal": "sdpa_causal+backward"}
#: Baselines: name -> the library they need.
BASELINES = {
    "numpy-textbook": "numpy",
    "torch-sdpa": "torch",
    "jax-sdpa": "jax",
    "keras-sdpa": "keras",
    "attnx-dense-mask": "numpy",
    "torch-flex": "torch",
    "torch-flex-compiled": "torch",
}
#: The operations each baseline implements.  ``attnx-dense-mask`` is attnx's
#: scaled_dot_product_attention on NumPy with the window as a dense mask;
#: ``torch-flex`` PyTorch's FlexAttention with its own block mask, eager
#: (it materialises the scores on the CPU) and under torch.compile.
BASELINE_OPERATIONS = {
    "numpy-textbook": ("sdpa", "sdpa_causal"),
    "torch-sdpa": ("sdpa", "sdpa_causal", *BACKWARD.values(), "decode"),
    "jax-sdpa": ("sdpa", "sdpa_causal", *BACKWARD.values()),
    "keras-sdpa": ("sdpa", "sdpa_causal"),
    "attnx-dense-mask": ("sliding_window",),
    "torch-flex": ("sliding_window",),
    "torch-flex-compiled": ("sliding_window",),
}
#: Baselines whose memory grows with the whole (B, H, n, n) scores or mask
#: run only where those stay within this many bytes.
DENSE_LIMIT_BYTES = 2 * 2**30
DENSE_BASELINES = ("numpy-textbook", "attnx-dense-mask", "torch-flex")
#: ``attnx bench --grid``: the shapes people use, (batch, n, head dim), 8 heads.
GRID = {"batch": (1, 16, 64), "sizes": (128, 512, 2048, 8192), "head_dim": (64, 128), "heads": 8}
#: Each case is timed over at least this many seconds (and ``repeat`` calls)...
MIN_TIMED_S = 0.25
#: ...and at most this many calls.
MAX_CALLS = 1000
#: The baseline the grid's ratios are taken against.
GRID_BASELINE = "torch-sdpa"


@dataclass(frozen=True)
class Case:
    """One measurement: an implementation on one input size."""

    implementation: str  # "attnx:<backend>" or a baseline name
    operation: str
    batch: int
    heads: int
    n: int
    head_dim: int
    dtype: str = "float32"
    repeat: int = 5
    device: str | None = None
    threads: int | None = None
    #: Dask only: run on a local cluster of this many single-threaded worker processes.
    workers: int | None = None
    #: sliding_window only: keys each query attends before its own.
    window: int = 256
    #: decode only: key/value heads (None: ``heads``) and new queries.
    kv_heads: int | None = None
    queries: int = 1

    @property
    def label(self) -> str:
        """The implementation as reports name it: ``attnx:dask (2 workers)``."""
        return self.implementation + (f" ({self.workers} workers)" if self.workers else "")

    @property
    def flops(self) -> float:
        """FLOPs of the attention proper (projections of multi-head attention not counted)."""
        full = 4.0 * self.batch * self.heads * self.n * self.n * self.head_dim
        if self.operation == "decode":  # every query over the whole cache (padding and causal rule aside)
            return full * self.queries / self.n
        if self.operation == "sliding_window":  # the scores inside the window only
            keys = min(self.n, self.window + 1)
            return full * (keys * self.n - keys * (keys - 1) / 2) / (self.n * self.n)
        if self.operation.endswith("+backward"):  # FlashAttention-2's count: the backward 2.5 forwards
            full *= 3.5
        return full / 2 if self.operation.startswith("sdpa_causal") else full


@dataclass
class Result:
    case: Case
    median_s: float | None = None
    times_s: list[float] = field(default_factory=list)
    peak_bytes: int | None = None
    error: str | None = None

    @property
    def gflops(self) -> float | None:
        return self.case.flops / self.median_s / 1e9 if self.median_s else None


# -- the worker: runs in its own process ------------------------------------------


def _inputs(case: Case) -> tuple[Any, Any, Any, Any, Callable[[], None]]:
    """(query, key, value, library, synchronize) for a case, on its library."""
    import numpy as np

    import attnx

    rng = np.random.default_rng(0)
    shapes = [(case.batch, case.heads, case.n, case.head_dim)] * 3
    if case.operation == "decode":
        cache = (case.batch, case.kv_heads or case.heads, case.n, case.head_dim)
        shapes = [(case.batch, case.heads, case.queries, case.head_dim), cache, cache]
    arrays = [
        rng.standard_normal(shape).astype(np.float32 if case.dtype == "bfloat16" else case.dtype) for shape in shapes
    ]
    library = _library(case)
    if library == "torch":
        import torch

        device = case.device or "cpu"
        tensors = [torch.from_numpy(a).to(device=device, dtype=getattr(torch, case.dtype)) for a in arrays]
        sync = (lambda: torch.cuda.synchronize(device)) if device.startswith("cuda") else (lambda: None)
        return (*tensors, torch, sync)
    if library == "numpy":
        return (*arrays, np, lambda: None)
    if library == "jax":
        import jax

        on_device = [attnx.asarray(a, backend="jax", dtype=case.dtype, device=case.device) for a in arrays]
        return (*on_device, jax, lambda: None)
    if library == "keras":
        # Keras 3 on the backend its users configured, PyTorch when none is
        # (its default, TensorFlow, is rarely installed beside attnx).
        os.environ.setdefault("KERAS_BACKEND", "torch")
        import keras

        converted = [keras.ops.convert_to_tensor(a, dtype=case.dtype) for a in arrays]
        return (*converted, keras, lambda: None)
    if library == "dask":
        import dask.array as da

        # One chunk per batch entry: the batch is the axis the work spreads over.
        chunked = [da.from_array(a, chunks=(1, *a.shape[1:])) for a in arrays]
        if case.workers:  # the inputs live on the workers, as a cluster's users keep them
            import distributed

            chunked = _local_cluster(case.workers).persist(chunked)
            distributed.wait(chunked)
        return (*chunked, None, lambda: None)
    # Any other attnx backend (CuPy, a third party's), in the dtype and on the device asked for.
    converted = [attnx.asarray(a, backend=library, dtype=case.dtype, device=case.device) for a in arrays]
    backend = attnx._registry.get(library)
    return (*converted, None, lambda: backend.synchronize(case.device))


def _local_cluster(workers: int) -> Any:
    """A client of a new :func:`local_cluster`, both closed when this process exits."""
    import atexit

    cluster, client = local_cluster(workers)
    atexit.register(cluster.close)
    atexit.register(client.close)
    return client


def local_cluster(workers: int) -> tuple[Any, Any]:
    """A new ``dask.distributed`` ``LocalCluster`` on loopback, of ``workers``
    processes with one thread each (their nannies hold BLAS to one thread),
    and its client; the caller closes both."""
    import logging

    import distributed

    cluster = distributed.LocalCluster(
        n_workers=workers,
        threads_per_worker=1,
        processes=True,
        host="127.0.0.1",
        dashboard_address=None,
        silence_logs=logging.ERROR,
    )
    return cluster, distributed.Client(cluster)


def _library(case: Case) -> str:
    if case.implementation.startswith("attnx:"):
        return case.implementation.partition(":")[2]
    return BASELINES[case.implementation]


def measured_dtype(case: Case) -> str:
    """The dtype a case really ran in: NumPy has no bfloat16, so the textbook
    baseline asked for it runs in float32."""
    if case.dtype == "bfloat16" and _library(case) == "numpy":
        return "float32"
    return case.dtype


def load_warning(threads: int | None = None) -> str | None:
    """A sentence when the machine is busier than the cores a sweep uses
    (the 1-minute load average above them): its figures will be noisy."""
    try:
        load = os.getloadavg()[0]
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return None
    used = min(threads or cores, cores)
    if load <= used:
        return None
    return f"the machine is busy (load average {load:.1f} over the {used} cores this sweep uses): figures will be noisy"


def textbook_attention(q: Any, k: Any, v: Any, causal: bool = False) -> Any:
    """Attention as the textbooks write it, in NumPy."""
    import numpy as np

    scores = q @ np.swapaxes(k, -1, -2) / np.float32(math.sqrt(q.shape[-1])).astype(q.dtype)
    if causal:
        n = q.shape[-2]
        scores = np.where(np.tril(np.ones((n, n), dtype=bool)), scores, -np.inf)
    scores = scores - scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores)
    weights = weights / weights.sum(axis=-1, keepdims=True)
    return weights @ v


def _callable(case: Case) -> tuple[Callable[[], Any], Callable[[], None]]:
    q, k, v, library, sync = _inputs(case)
    causal = case.operation.startswith("sdpa_causal")
    if case.operation.endswith("+backward"):
        return _training_step(case, q, k, v, library, causal), sync
    if case.operation == "decode":
        return _decode(case, q, k, v, library), sync
    if case.implementation == "numpy-textbook":
        return (lambda: textbook_attention(q, k, v, causal)), sync
    if case.implementation == "jax-sdpa":
        # jax.nn.dot_product_attention under jit, with (B, n, H, d) layout; the
        # result is waited for with block_until_ready.
        jax = library
        swap = [jax.numpy.swapaxes(a, 1, 2) for a in (q, k, v)]
        attend = jax.jit(lambda a, b, c: jax.nn.dot_product_attention(a, b, c, is_causal=causal))
        return (lambda: attend(*swap).block_until_ready()), sync
    if case.implementation == "keras-sdpa":
        # keras.ops.dot_product_attention takes (B, n, H, d), as JAX does.
        keras = library
        swap = [keras.ops.swapaxes(a, 1, 2) for a in (q, k, v)]
        return (lambda: keras.ops.dot_product_attention(*swap, is_causal=causal)), sync
    if case.implementation == "torch-sdpa":
        fused = library.nn.functional.scaled_dot_product_attention
        return (lambda: fused(q, k, v, is_causal=causal)), sync
    if case.operation == "sliding_window":
        return _sliding_window(case, q, k, v, library), sync
    import attnx

    backend = _library(case)
    if case.operation in ("sdpa", "sdpa_causal"):
        return _as_users_run(
            case, lambda q, k, v: attnx.scaled_dot_product_attention(q, k, v, is_causal=causal), q, k, v
        ), sync
    d_model = case.heads * case.head_dim
    device = case.device  # every array on it: attnx's functions make theirs on the backend's default device
    x = attnx.asarray(
        attnx.to_numpy(q).transpose(0, 2, 1, 3).reshape(case.batch, case.n, d_model), backend=backend, device=device
    )
    if case.operation == "multi_head_attention":
        params = attnx.init_multi_head_params(d_model, case.heads, dtype=case.dtype, backend=backend, device=device)
        return _as_users_run(case, lambda x: attnx.multi_head_attention(x, x, x, params, num_heads=case.heads), x), sync
    if case.operation == "additive_attention":
        params = attnx.init_multi_head_params(
            d_model, 1, d_k=case.head_dim, dtype=case.dtype, backend=backend, device=device
        )
        additive = {"w_q": params["w_q"], "w_k": params["w_k"], "w_v": params["b_q"] + 0.1}
        return _as_users_run(case, lambda x: attnx.additive_attention(x, x, x, additive), x), sync
    raise ValueError(f"unknown operation {case.operation!r}; choose from {OPERATIONS}")


def _training_step(case: Case, q: Any, k: Any, v: Any, library: Any, causal: bool) -> Callable[[], Any]:
    """Attention's forward and backward, the output as its own cotangent:
    attnx's through :func:`attnx.vjp` (on every backend), the baselines'
    through their autograd."""
    if case.implementation == "torch-sdpa":
        fused = library.nn.functional.scaled_dot_product_attention
        leaves = [a.detach().requires_grad_() for a in (q, k, v)]

        def torch_step() -> Any:
            output = fused(*leaves, is_causal=causal)
            return library.autograd.grad(output, leaves, output.detach())

        return torch_step
    if case.implementation == "jax-sdpa":
        jax = library
        swap = [jax.numpy.swapaxes(a, 1, 2) for a in (q, k, v)]

        def jax_step(a: Any, b: Any, c: Any) -> Any:
            output, pull_back = jax.vjp(
                lambda a, b, c: jax.nn.dot_product_attention(a, b, c, is_causal=causal), a, b, c
            )
            return pull_back(output)

        jitted = jax.jit(jax_step)
        return lambda: jax.block_until_ready(jitted(*swap))
    if not case.implementation.startswith("attnx:"):
        raise ValueError(f"{case.implementation} has no backward to time; give torch-sdpa or jax-sdpa as baselines")
    import attnx

    def attnx_step(q: Any, k: Any, v: Any) -> Any:
        output, backward = attnx.vjp(attnx.scaled_dot_product_attention, q, k, v, is_causal=causal)
        grads = backward(output)
        return grads["query"], grads["key"], grads["value"]

    return _as_users_run(case, attnx_step, q, k, v)


def cache_lengths(batch: int, cache: int) -> Any:
    """The keys each sequence of a ``decode`` case holds, ``(batch,)``
    integers: the first a full cache, the last about half of one."""
    import numpy as np

    return np.array([cache - entry * cache // (2 * batch) for entry in range(batch)])


def decode_mask(lengths: Any, queries: int, cache: int) -> Any:
    """A ``decode`` case's rule as one boolean mask ``(batch, 1, queries,
    cache)`` (``True``: attended), for a baseline that takes no lengths:
    each sequence's padding, and its queries aligned to the end of its own
    keys (attnx's ``causal_align="key_lengths"``)."""
    import numpy as np

    keys, ends = np.arange(cache), np.asarray(lengths)[:, None, None, None]
    return (keys < ends) & (keys <= np.arange(queries)[:, None] + ends - queries)


def _decode(case: Case, q: Any, k: Any, v: Any, library: Any) -> Callable[[], Any]:
    """New queries over a padded cache (see :data:`OPERATIONS`), causal
    where they are more than one, aligned to each sequence's own keys."""
    lengths = cache_lengths(case.batch, case.n)
    grouped = (case.kv_heads or case.heads) != case.heads
    if case.implementation == "torch-sdpa":
        fused = library.nn.functional.scaled_dot_product_attention
        mask = library.from_numpy(decode_mask(lengths, case.queries, case.n)).to(q.device)
        return lambda: fused(q, k, v, attn_mask=mask, enable_gqa=grouped)
    import attnx

    key_lengths = attnx.asarray(lengths, backend=_library(case), device=case.device)
    aligned = {"is_causal": True, "causal_align": "key_lengths"} if case.queries > 1 else {}
    return _as_users_run(
        case,
        lambda q, k, v: attnx.scaled_dot_product_attention(
            q, k, v, key_lengths=key_lengths, enable_gqa=grouped, **aligned
        ),
        q,
        k,
        v,
    )


def _sliding_window(case: Case, q: Any, k: Any, v: Any, library: Any) -> Callable[[], Any]:
    """A causal sliding window of ``case.window`` keys, by the case's
    implementation; the block masks are made here, before any timing."""
    window, n = case.window, case.n
    if case.implementation in ("torch-flex", "torch-flex-compiled"):
        import warnings

        from torch.nn.attention import flex_attention as flex

        def in_window(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return (kv_idx <= q_idx) & (q_idx - kv_idx <= window)

        block_mask = flex.create_block_mask(in_window, None, None, n, n, device=q.device)
        attend = flex.flex_attention
        if case.implementation == "torch-flex-compiled":
            attend = library.compile(flex.flex_attention)
        warnings.filterwarnings("ignore", "flex_attention called without torch.compile")
        return lambda: attend(q, k, v, block_mask=block_mask)
    import attnx

    if case.implementation == "attnx-dense-mask":
        mask = attnx.masks.sliding_window(n, window=window, backend="numpy")
        return lambda: attnx.scaled_dot_product_attention(q, k, v, mask=mask)
    block_mask = attnx.create_block_mask(
        attnx.mods.sliding_window(window), None, None, n, n, backend=_library(case), device=case.device
    )
    return _as_users_run(case, lambda q, k, v: attnx.flex_attention(q, k, v, None, block_mask), q, k, v)


def _as_users_run(case: Case, function: Callable[..., Any], *arrays: Any) -> Callable[[], Any]:
    """A call of ``function(*arrays)`` as the library's users run it: JAX's
    under ``jax.jit``, waited for with ``block_until_ready`` (its dispatch is
    asynchronous); Dask's built and computed, on a cluster reduced there to
    its sum (its users rarely gather a whole output in one process); the
    others eagerly."""
    backend = _library(case)
    if backend == "jax":
        import jax

        jitted = jax.jit(function)
        return lambda: jax.block_until_ready(jitted(*arrays))  # an array, or a training step's gradients
    if backend == "dask":
        import dask

        def computed() -> Any:
            result = function(*arrays)
            results = result if isinstance(result, tuple) else (result,)
            # On a cluster each output stays where it was computed and only its sum comes back: its
            # users rarely gather a whole output into one process (and persist() would find the same
            # names in memory, computing nothing).
            return dask.compute(*(part.sum() if case.workers else part for part in results))

        return computed
    return lambda: function(*arrays)


def _rss_kib(field_name: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field_name} not in /proc/self/status")


def _peak_extra_bytes(function: Callable[[], Any], sync: Callable[[], None], case: Case) -> int | None:
    """Peak memory one call adds above what the inputs hold."""
    if _library(case) == "torch" and (case.device or "cpu").startswith("cuda"):
        import torch

        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        function()
        sync()
        return torch.cuda.max_memory_allocated() - base
    if _library(case) == "cupy":
        return _cupy_peak_bytes(function, sync)
    if not os.path.exists("/proc/self/clear_refs"):
        return None
    import gc

    gc.collect()
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # reset VmHWM to the current RSS
    except OSError:
        return None
    base = _rss_kib("VmRSS")
    result = function()
    sync()
    peak = _rss_kib("VmHWM")
    del result
    return max(0, peak - base) * 1024


class PoolPeak:
    """Bytes in use from a memory pool and their peak, counted from the pool's
    malloc and free callbacks (CuPy's ``MemoryHook`` protocol)."""

    name = "attnx_pool_peak"

    def __init__(self) -> None:
        self.in_use = self.peak = 0

    def malloc_postprocess(self, **kwargs: Any) -> None:
        self.in_use += kwargs["mem_size"]
        self.peak = max(self.peak, self.in_use)

    def free_postprocess(self, **kwargs: Any) -> None:
        self.in_use -= kwargs["mem_size"]


def _cupy_peak_bytes(function: Callable[[], Any], sync: Callable[[], None]) -> int:
    """Peak bytes one call takes from CuPy's memory pool.  The pool keeps no
    high-water mark, so a memory hook counts its mallocs and frees."""
    from cupy.cuda import memory_hook

    hook_class = type("PoolPeakHook", (PoolPeak, memory_hook.MemoryHook), {})
    hook = hook_class()
    sync()
    with hook:  # registered for this thread while the call runs
        result = function()
        sync()
    del result
    return hook.peak


def run_case(case: Case, what: str = "both") -> Result:
    """Measure one case in this process: its ``"time"``, its ``"memory"``, or ``"both"``."""
    result = Result(case)
    try:
        if case.threads:
            _limit_threads(case.threads)
        function, sync = _callable(case)
        function()  # warm-up: lazy imports, kernel selection, allocator growth
        sync()
        if what in ("memory", "both") and not case.workers:  # a cluster's memory is its workers'
            result.peak_bytes = _peak_extra_bytes(function, sync, case)
        if what == "memory":
            return result
        # At least `repeat` calls and MIN_TIMED_S in all: a median of five
        # sub-millisecond calls is mostly the noise of waking threads.
        while len(result.times_s) < case.repeat or (
            sum(result.times_s) < MIN_TIMED_S and len(result.times_s) < MAX_CALLS
        ):
            start = time.perf_counter()
            function()
            sync()
            result.times_s.append(time.perf_counter() - start)
        result.median_s = statistics.median(result.times_s)
    except Exception as exc:  # reported in the table, never fatal to the sweep
        result.error = f"{type(exc).__name__}: {exc}"
    return result


def _limit_threads(threads: int) -> None:
    try:
        import torch

        torch.set_num_threads(threads)
    except ImportError:
        pass


def _worker(argument: str, what: str) -> None:
    case = Case(**json.loads(argument))
    result = run_case(case, what)
    print(
        json.dumps(
            {
                "median_s": result.median_s,
                "times_s": result.times_s,
                "peak_bytes": result.peak_bytes,
                "error": result.error,
            }
        )
    )


def _run_worker(case: Case, what: str, timeout: float) -> dict[str, Any]:
    env = dict(os.environ)
    env.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")
    if what == "memory":
        # Big buffers through mmap, so freed memory leaves the RSS and the
        # high-water mark sees every allocation.  Only for this process: page
        # faults on every buffer would distort the times.
        env["MALLOC_MMAP_THRESHOLD_"] = "65536"
    if case.threads:
        for name in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            env[name] = str(case.threads)
    command = [sys.executable, "-m", "attnx.benchmark", "worker", json.dumps(asdict(case)), what]
    try:
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s"}
    if done.returncode != 0 or not done.stdout.strip():
        last = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"worker failed: {last}"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def measure(case: Case, timeout: float = 900.0, memory: bool = True) -> Result:
    """Measure ``case`` in fresh processes: one for the time, one for the
    peak memory (on CUDA, where the counters need no allocator setting, one);
    without ``memory``, the time alone."""
    on_gpu = (case.device or "").startswith("cuda")
    timing = _run_worker(case, "both" if on_gpu else "time", timeout)
    if timing.get("error"):
        return Result(case, error=timing["error"])
    if not memory:
        return Result(case, timing["median_s"], timing["times_s"])
    peak = timing if on_gpu else _run_worker(case, "memory", timeout)
    return Result(case, timing["median_s"], timing["times_s"], peak.get("peak_bytes"), peak.get("error"))


# -- the sweep and its report -----------------------------------------------------


def plan(
    backends: Sequence[str],
    operations: Sequence[str],
    sizes: Sequence[int],
    *,
    batch: int | Sequence[int],
    heads: int,
    head_dim: int | Sequence[int],
    dtype: str,
    repeat: int,
    baselines: Sequence[str],
    device: str | None = None,
    threads: int | None = None,
    dask_workers: Sequence[int] = (),
    window: int = 256,
    kv_heads: int | None = None,
    queries: int = 1,
) -> list[Case]:
    """Every case of a sweep; ``batch`` and ``head_dim`` may list several
    values.  With ``dask_workers``, the Dask backend runs once on a local
    cluster of each of those many workers instead of in this process.
    Baselines that hold the whole scores or mask (:data:`DENSE_BASELINES`)
    run only where those fit :data:`DENSE_LIMIT_BYTES`."""
    batches = [batch] if isinstance(batch, int) else list(batch)
    head_dims = [head_dim] if isinstance(head_dim, int) else list(head_dim)
    cases = []
    for operation in operations:
        for b in batches:
            for d in head_dims:
                for n in sizes:
                    implementations = [f"attnx:{name}" for name in backends]
                    implementations += [
                        baseline
                        for baseline in baselines
                        if operation in BASELINE_OPERATIONS[baseline]
                        and (baseline not in DENSE_BASELINES or b * heads * n * n * 4 <= DENSE_LIMIT_BYTES)
                    ]
                    for implementation in implementations:
                        case = Case(
                            implementation,
                            operation,
                            b,
                            heads,
                            n,
                            d,
                            dtype,
                            repeat,
                            device,
                            threads,
                            window=window,
                            kv_heads=kv_heads,
                            queries=queries,
                        )
                        if implementation == "attnx:dask" and dask_workers:
                            cases += [replace(case, workers=workers) for workers in dask_workers]
                        else:
                            cases.append(case)
    return cases


def _progress(total: int) -> Any:
    try:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.completed}/{task.total}"),
            TimeElapsedColumn(),
        )
        return progress, progress.add_task("attnx bench", total=total)
    except ImportError:
        return None, None


def _shape_key(case: Case) -> tuple[Any, ...]:
    """What cases compared with each other share: the operation and its inputs
    (the rounds of :func:`sweep` and the baselines of :func:`ratios`)."""
    return (case.operation, case.n, case.batch, case.heads, case.head_dim, case.dtype, case.kv_heads, case.queries)


def sweep(cases: Sequence[Case], rounds: int = 1) -> list[Result]:
    """Measure every case, each in fresh processes.

    With ``rounds`` above 1, the cases of each shape are timed in turn, round
    after round (A, B, A, B, ...), so that the machine's drift falls on every
    implementation alike; a case's time is then the median of its rounds'
    medians (``times_s`` holds every call), its peak memory that of the first
    round, and an error in any round is the case's."""
    groups: dict[tuple[Any, ...], list[int]] = {}
    for index, case in enumerate(cases):
        groups.setdefault(_shape_key(case), []).append(index)
    measured: list[list[Result]] = [[] for _ in cases]
    progress, task = _progress(len(cases) * rounds)
    if progress is not None:
        progress.start()
    done = 0
    try:
        for indices in groups.values():
            for round_number in range(rounds):
                for index in indices:
                    case = cases[index]
                    done += 1
                    label = f"{case.operation} {case.label} n={case.n}"
                    if rounds > 1:
                        label += f" (round {round_number + 1}/{rounds})"
                    if progress is not None:
                        progress.update(task, description=label)
                    else:
                        print(f"[{done}/{len(cases) * rounds}] {label}", file=sys.stderr)
                    if not any(r.error is not None for r in measured[index]):  # a failed case fails again
                        measured[index].append(measure(case, memory=round_number == 0))
                    if progress is not None:
                        progress.advance(task)
    finally:
        if progress is not None:
            progress.stop()
    return [_combine(case_rounds) for case_rounds in measured]


def _combine(rounds: Sequence[Result]) -> Result:
    """One result from a case's rounds (see :func:`sweep`)."""
    first = rounds[0]
    error = next((r.error for r in rounds if r.error is not None), None)
    if error is not None:
        return replace(first, error=error)
    if len(rounds) == 1:
        return first
    median = statistics.median(r.median_s for r in rounds)  # set wherever no round failed
    times = [t for r in rounds for t in r.times_s]
    return Result(first.case, median, times, first.peak_bytes)


def ratios(results: Sequence[Result]) -> dict[int, float | None]:
    """Each result's time over the fastest baseline's at the same operation,
    size and dtype (baselines measured in the same run)."""
    fastest: dict[tuple, float] = {}
    for r in results:
        if r.case.implementation in BASELINES and r.median_s:
            key = _shape_key(r.case)
            fastest[key] = min(fastest.get(key, math.inf), r.median_s)
    out = {}
    for index, r in enumerate(results):
        key = _shape_key(r.case)
        out[index] = r.median_s / fastest[key] if r.median_s and key in fastest else None
    return out


def grid_rows(results: Sequence[Result], baseline: str = GRID_BASELINE) -> tuple[list[str], list[tuple[str, ...]]]:
    """Headers and rows of the grid report: for each shape, every other
    implementation's time over ``baseline``'s, full and causal side by side."""
    times = {(r.case.label, r.case.operation, _shape(r.case)): r.median_s for r in results}
    shapes = list(dict.fromkeys(_shape(r.case) for r in results))
    others = [i for i in dict.fromkeys(r.case.label for r in results) if i != baseline]
    operations = [op for op in ("sdpa", "sdpa_causal") if any(r.case.operation == op for r in results)]
    headers = ["shape (B, H, n, d)", "dtype"]
    headers += [f"{i} {'causal' if op == 'sdpa_causal' else 'full'}" for i in others for op in operations]
    rows = []
    for shape in shapes:
        row = [f"({shape[0]}, {shape[1]}, {shape[2]}, {shape[3]})", shape[4]]
        for implementation in others:
            for operation in operations:
                mine, theirs = times.get((implementation, operation, shape)), times.get((baseline, operation, shape))
                row.append(f"{mine / theirs:.2f}" if mine and theirs else "")
        rows.append(tuple(row))
    return headers, rows


def _shape(case: Case) -> tuple[int, int, int, int, str]:
    return (case.batch, case.heads, case.n, case.head_dim, case.dtype)


def fit_exponent(sizes: Sequence[float], values: Sequence[float]) -> float | None:
    """Slope of log(value) against log(size), by least squares."""
    points = [(math.log(s), math.log(v)) for s, v in zip(sizes, values) if v and v > 0]
    if len(points) < 2:
        return None
    mean_x = sum(p[0] for p in points) / len(points)
    mean_y = sum(p[1] for p in points) / len(points)
    spread = sum((p[0] - mean_x) ** 2 for p in points)
    return sum((p[0] - mean_x) * (p[1] - mean_y) for p in points) / spread if spread else None


HEADERS = (
    "operation",
    "implementation",
    "shape (B, H, n, d)",
    "dtype",
    "median ms",
    "GFLOP/s",
    "peak extra MiB",
    "x fastest baseline",
)


def table_rows(results: Sequence[Result]) -> list[tuple[str, ...]]:
    relative = ratios(results)
    rows = []
    for index, r in enumerate(results):
        c = r.case
        shape = f"({c.batch}, {c.heads}, {c.n}, {c.head_dim})"
        if c.operation == "decode":  # (B, H/H_kv, queries, cache, d)
            shape = f"({c.batch}, {c.heads}/{c.kv_heads or c.heads}, {c.queries}, {c.n}, {c.head_dim})"
        if r.error:
            rows.append((c.operation, c.label, shape, c.dtype, "error", "", "", r.error[:60]))
            continue
        dtype = measured_dtype(c)
        rows.append(
            (
                c.operation,
                c.label,
                shape,
                dtype if dtype == c.dtype else f"{dtype} (asked {c.dtype}: NumPy has none)",
                f"{r.median_s * 1e3:.2f}",
                f"{r.gflops:.1f}",
                "" if r.peak_bytes is None else f"{r.peak_bytes / 2**20:.1f}",
                "" if relative[index] is None else f"{relative[index]:.2f}",
            )
        )
    return rows


def _markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return [
        "| " + " | ".join(headers) + " |",
        "|" + "---|" * len(headers),
        *("| " + " | ".join(row) + " |" for row in rows),
    ]


def _cpu_model(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The processor's name, where Linux says (empty elsewhere)."""
    try:
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    except OSError:
        pass
    return ""


def _vector_units(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The widest vector instructions the processor has, where Linux says
    (empty elsewhere).  It decides how NumPy's exponential compares with
    PyTorch's: on AVX2 hosts of these VMs ``np.exp`` of float32 took 1.3x
    ``torch.exp``'s time, on AVX-512 ones 0.4x (docs/archive/bench-sessions.md,
    fifty-fourth session), and with it a NumPy training step's ratio to
    PyTorch's."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return ""
    flags = set()
    for line in text.splitlines():
        if line.startswith(("flags", "Features")):  # x86, Arm
            flags.update(line.partition(":")[2].split())
    for flag, name in (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("sve", "SVE"), ("asimd", "NEON")):
        if flag in flags:
            return name
    return ""


def machine_record(command: str) -> dict:
    """What a report's reader needs to know of the run: when, on what, with
    which libraries (``run.json`` beside ``results.json``; the docs'
    performance page names each table's machine and date from it)."""
    import datetime
    from importlib.metadata import PackageNotFoundError, version

    libraries = {}
    for name in ("attnx", "numpy", "torch", "jax", "dask", "cupy"):
        try:
            libraries[name] = version(name)
        except PackageNotFoundError:
            continue
    return {
        "command": command,
        "date": datetime.date.today().isoformat(),
        "machine": {
            "cpu": _cpu_model() or platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "arch": platform.machine(),
            "vector": _vector_units(),
            "idle": _idle_policy(),
            "python": _python(),
        },
        "libraries": libraries,
    }


def _python() -> str:
    """The interpreter, and on a free-threaded build whether the GIL is off:
    the NumPy backend's threads wait differently (spinning) without it."""
    text = f"Python {platform.python_version()}"
    if sysconfig.get_config_var("Py_GIL_DISABLED"):
        text += ", free-threaded, the GIL " + ("on" if sys._is_gil_enabled() else "off")
    return text


def _idle_policy(sysfs: Path = Path("/sys")) -> str:
    """How this machine's idle CPUs wait, where Linux says (empty elsewhere):
    on a VM whose idle vCPUs halt at once (the ``haltpoll`` driver with
    ``guest_halt_poll_ns`` 0), waking the second core costs tens of
    microseconds a hand-over, and attnx's threaded NumPy calls of under a
    millisecond took 1.15x the time they took with the kernel's default
    polling (docs/archive/bench-sessions.md, forty-first session): a reader of the
    report should know which machine it was."""
    try:
        driver = (sysfs / "devices/system/cpu/cpuidle/current_driver").read_text().strip()
    except OSError:
        return ""
    if driver != "haltpoll":
        return f"cpuidle driver {driver}"
    try:
        poll_ns = int((sysfs / "module/haltpoll/parameters/guest_halt_poll_ns").read_text())
    except (OSError, ValueError):
        return "cpuidle driver haltpoll"
    halts = " (an idle vCPU halts at once, and waking it costs tens of microseconds)" if poll_ns == 0 else ""
    return f"cpuidle driver haltpoll, guest_halt_poll_ns {poll_ns}{halts}"


def markdown(results: Sequence[Result], command: str, grid: bool = False, rounds: int = 1) -> str:
    lines = _markdown_table(HEADERS, table_rows(results))
    exponents = []
    for (operation, implementation), points in _series(results).items():
        slope = fit_exponent([p[0] for p in points], [p[1] for p in points])
        if slope is not None:
            exponents.append(f"- {operation}, {implementation}: time grows as n^{slope:.2f}")
    ratio_section = []
    if grid:
        grid_headers, grid_table = grid_rows(results)
        ratio_section = [
            f"Time over {GRID_BASELINE}'s at the same shape, measured in the same run (below 1 = faster):",
            "",
            *_markdown_table(grid_headers, grid_table),
            "",
        ]
    machine = ", ".join(
        part
        for part in (platform.machine(), _vector_units(), f"{os.cpu_count()} CPUs", _idle_policy(), _python())
        if part
    )
    clustered = cluster_rows(results)
    if clustered:
        ratio_section += [
            "Dask on a local cluster (single-threaded worker processes, one chunk per batch entry; "
            "times include building the graph; the output is summed on the workers and only the sum comes back):",
            "",
            *_markdown_table(CLUSTER_HEADERS, clustered),
            "",
        ]
    return "\n".join(
        [
            f"Command: `{command}`",
            "",
            f"Machine: {machine}; "
            "each row measured in its own process (one array library per process, so OpenBLAS's idle "
            "threads cannot slow PyTorch); times are medians of at least `--repeat` calls and 0.25 s, after one warm-up call"
            + (
                f" (each row's time the median of its {rounds} rounds, in which the implementations of a shape "
                "took turns, each in a fresh process)"
                if rounds > 1
                else ""
            )
            + "; FLOPs = "
            "4·B·H·n²·d (halved when causal); peak extra memory = the process's high-water mark during "
            "one call minus its resident memory before it.",
            "",
            *ratio_section,
            *lines,
            "",
            "Fitted exponents (least squares on log time against log n):",
            "",
            *exponents,
            "",
        ]
    )


def _series(results: Sequence[Result], value: str = "time") -> dict[tuple[str, str], list[tuple[int, float]]]:
    """Points (n, value) per operation and line; a sweep over several batch
    sizes or head dims draws one line for each."""
    several = len({(r.case.batch, r.case.head_dim) for r in results}) > 1
    series: dict[tuple[str, str], list[tuple[int, float]]] = {}
    for r in results:
        measured = r.median_s if value == "time" else (r.peak_bytes / 2**20 if r.peak_bytes is not None else None)
        if measured:
            line = r.case.label + (f" B={r.case.batch} d={r.case.head_dim}" if several else "")
            series.setdefault((r.case.operation, line), []).append((r.case.n, measured))
    return series


def plot(results: Sequence[Result], folder: Path) -> list[Path]:
    """Time and peak memory against n, log-log, one line per implementation."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    written = []
    for value, ylabel, filename in (
        ("time", "median time (s)", "time.png"),
        ("memory", "peak extra memory (MiB)", "memory.png"),
    ):
        series = _series(results, value)
        if not series:
            continue
        operations = sorted({op for op, _ in series})
        figure, axes = plt.subplots(1, len(operations), figsize=(6 * len(operations), 4.5), squeeze=False)
        for ax, operation in zip(axes[0], operations):
            for (op, implementation), points in sorted(series.items()):
                if op != operation:
                    continue
                sizes, values = zip(*points)
                slope = fit_exponent(sizes, values)
                label = implementation + (f" (slope {slope:.2f})" if slope is not None else "")
                ax.loglog(sizes, values, "o-", label=label)
            # One labelled tick per measured size, horizontal and apart: the
            # default log ticks put minor labels on top of each other.
            sizes_measured = sorted(
                {size for (op, _), points in series.items() if op == operation for size, _ in points}
            )
            ax.set_xticks(
                sizes_measured,
                labels=[str(size) for size in sizes_measured],
                rotation=45 if len(sizes_measured) > 6 else 0,
            )
            ax.minorticks_off()
            ax.set_xlabel("sequence length n")
            ax.set_ylabel(ylabel)
            ax.set_title(operation)
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=8)
        figure.tight_layout()
        path = folder / filename
        figure.savefig(path, dpi=110)
        plt.close(figure)
        written.append(path)
    return written


def cluster_rows(results: Sequence[Result]) -> list[tuple[str, ...]]:
    """For Dask on local clusters: each shape's time per number of workers,
    and the speed-up over the fewest workers measured (same run)."""
    clustered = [r for r in results if r.case.workers and r.median_s]
    rows = []
    for operation, shape in dict.fromkeys((r.case.operation, _shape(r.case)) for r in clustered):
        same = sorted(
            (r for r in clustered if (r.case.operation, _shape(r.case)) == (operation, shape)),
            key=lambda r: r.case.workers,
        )
        base = same[0]
        for r in same:
            rows.append(
                (
                    operation,
                    f"({r.case.batch}, {r.case.heads}, {r.case.n}, {r.case.head_dim})",
                    str(r.case.workers),
                    f"{r.median_s * 1e3:.1f}",
                    f"{base.median_s / r.median_s:.2f}x over {base.case.workers}",
                )
            )
    return rows


CLUSTER_HEADERS = ("operation", "shape (B, H, n, d)", "workers", "median ms", "speed-up")


def print_table(results: Sequence[Result], grid: bool = False) -> None:
    print(format_table(HEADERS, table_rows(results)))
    clustered = cluster_rows(results)
    if clustered:
        print(
            "\nDask on a local cluster (single-threaded worker processes, one chunk per batch entry, output kept on the workers):"
        )
        print(format_table(CLUSTER_HEADERS, clustered))
    if grid:
        headers, rows = grid_rows(results)
        print(f"\ntime over {GRID_BASELINE}'s, same run (below 1 = faster):")
        print(format_table(tuple(headers), rows))


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["worker"]:
        _worker(args[1], args[2] if len(args) > 2 else "both")
        return
    raise SystemExit("usage: attnx bench ... (python -m attnx.benchmark worker CASE is internal)")


if __name__ == "__main__":
    main()
