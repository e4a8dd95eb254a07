"""The JAX backend: ``jax.numpy`` arrays on JAX's devices; autograd flows
through (``jax.grad``), and every operation traces under ``jax.jit`` and
``jax.vmap``.

float64 is offered only when JAX's x64 mode is on (``JAX_ENABLE_X64=1`` or
``jax.config.update("jax_enable_x64", True)``): without it JAX silently
makes float32 arrays of float64 data, and attnx refuses what it can't do
exactly.

Its native scaled dot-product attention calls ``jax.nn.dot_product_attention``
on accelerators (where that picks fused kernels) and where it computes
exactly attnx's function: no masks or lengths (JAX gives a fully masked row
the average of the values, attnx zeros) and a causal mask only where both
align it alike (``n == m``).  On the CPU attnx's own algorithm, jitted, runs
instead: at (1, 8, 2048, 64) float32 on 2 cores it took 0.41x the time of
jitted ``jax.nn.dot_product_attention`` (0.47x causal) in one run, though
1.5x at n = 512 (0.66x causal); see ``docs/archive/bench-sessions.md``.
Where attnx would cut the scores into tiles, those run in JAX's loops
with their own backward (:mod:`.jax_flash`), so that ``jax.grad`` keeps
no tile.
"""

from __future__ import annotations

import importlib.util
import math
import sys
from collections.abc import Callable, Mapping
from typing import Any

from attnx import Backend, get_memory_budget, hookimpl, natives
from attnx.backend import GPU_BLOCK_BYTES

#: Platforms whose arrays take a GPU's blocks.
GPU_PLATFORMS = frozenset({"gpu", "cuda", "rocm"})
#: Blocks of a tracer's program on a GPU (see :meth:`JaxBackend.block_bytes_on`).
TRACED_GPU_BLOCK_BYTES = 64 * 2**20


class JaxBackend(Backend):
    name = "jax"
    array_module = "jax"
    supports_autograd = True

    _natives: Mapping[str, Callable[..., Any]] | None = None

    def unavailable_reason(self) -> str | None:
        if importlib.util.find_spec("jax") is None:
            return "jax is not installed (pip install '.[jax]' in attnx's clone)"
        return None

    @property
    def float_dtypes(self) -> tuple[str, ...]:  # type: ignore[override]
        import jax

        wide = ("float64",) if jax.config.jax_enable_x64 else ()
        return ("float32", *wide, "float16", "bfloat16")

    def version(self) -> str:
        from importlib.metadata import version

        return version("jax")

    def devices(self) -> list[Any]:
        import jax

        return list(jax.devices())

    def block_bytes_on(self, device: Any) -> int:
        # Concrete arrays on a GPU take a GPU's blocks, as CuPy's and PyTorch's
        # CUDA tensors': each tile's operations are dispatched one by one, so
        # launches set the cost.  A tracer under jit has no device (None): its
        # program runs on the default backend, as one program, where small
        # tiles cost no dispatch and skip the work outside a band, but each
        # turn of a traced loop (additive attention's chunks, lax.map) costs
        # a few launches.  Measured jitted on an H200 (docs/archive/bench-sessions.md):
        # flex_attention's sliding window of 256 keys, (1, 8, 8192, 64), took
        # 1.60 ms with 4 MiB tiles, 1.61 ms with 64 MiB and 4.29 ms with 512
        # MiB; additive attention at (1, 8, 2048, 64), h = 64, took 39.0 ms in
        # chunks of 4 MiB and 5.46 ms of 64 MiB.  On the CPU 4 MiB is best:
        # 64 MiB made the window 2.3x slower and additive attention 3.6x.
        # SDPA's chunks under a tracer are larger still (attnx's own plan).
        if device is None:
            import jax

            on_gpu = jax.default_backend() in GPU_PLATFORMS
            return TRACED_GPU_BLOCK_BYTES if on_gpu else self.block_bytes
        return GPU_BLOCK_BYTES if getattr(device, "platform", None) in GPU_PLATFORMS else self.block_bytes

    def namespace(self) -> Any:
        # jax.numpy implements the array API standard itself (array-api-compat
        # hands it back unchanged).
        import jax.numpy

        return jax.numpy

    def owns(self, array: Any) -> bool:
        # Concrete arrays are ``jaxlib`` types, tracers ``jax._src`` ones: one
        # isinstance covers both, and needs no import while JAX isn't loaded.
        if "jax" not in sys.modules:
            return False
        import jax

        return isinstance(array, jax.Array)

    def is_concrete(self, array: Any) -> bool:
        import jax

        # Under ``jax.jit`` even a concrete array closed over by the function
        # gives traced results: values are known only outside any trace.
        return not isinstance(array, jax.core.Tracer) and _outside_traces()

    def asarray(self, obj: Any, *, dtype: Any = None, device: Any = None) -> Any:
        import jax
        import jax.numpy as jnp
        import numpy

        # A dtype asked by name that x64 mode lacks was refused by attnx already
        # (the namespace's inspection API says what it can make); data that
        # would come out narrower than it went in is refused here.
        if isinstance(dtype, str):
            dtype = getattr(jnp, dtype)
        if (
            dtype is None
            and isinstance(obj, numpy.ndarray)
            and obj.dtype.itemsize == 8
            and not jax.config.jax_enable_x64
        ):
            # JAX would silently make 32-bit arrays: exact for integers that
            # fit, refused for anything else.
            fits = obj.dtype.kind in "iu" and (obj.size == 0 or (obj.min() >= -(2**31) and obj.max() < 2**31))
            if not fits:
                raise TypeError(
                    f"the jax backend makes {obj.dtype} arrays only in x64 mode "
                    "(JAX_ENABLE_X64=1, or jax.config.update('jax_enable_x64', True)); "
                    "pass dtype='float32' (or 'int32') to convert"
                )
        array = jnp.asarray(obj, dtype=dtype)
        if device is not None:  # a jax Device: attnx turned the name into one (Backend.device)
            array = jax.device_put(array, device)
        return array

    def to_numpy(self, array: Any) -> Any:
        import jax.numpy as jnp
        import numpy

        if array.dtype == jnp.bfloat16:  # NumPy has no bfloat16
            array = array.astype(jnp.float32)
        return numpy.asarray(array)

    def synchronize(self, device: Any = None) -> None:
        import jax

        # JAX dispatches asynchronously: wait for every live array's
        # computation (on ``device``, or everywhere).
        arrays = jax.live_arrays()
        if device is not None:
            device = self.device(device)
            arrays = [a for a in arrays if device in a.devices()]
        jax.block_until_ready(arrays)

    def map_chunks(self, function: Callable[[Any], Any], array: Any, size: int) -> Any:
        # Traced, a loop in Python puts every chunk's operations into the
        # program: additive attention at (1, 8, 2048, 64) with h = 64 traced
        # 14,351 equations, whose first call took 60 s on 2 cores (101 s on an
        # H200).  lax.map traces one chunk and loops over equal ones: 19
        # equations, 1.8 s, and later calls 0.16x the time.  Concrete
        # arrays keep the loop: lax.map would compile its body at each call.
        n = array.shape[-2]
        if n <= size or self.is_concrete(array):
            return super().map_chunks(function, array, size)
        import jax
        import jax.numpy as jnp

        count = n // size
        whole = count * size
        chunks = jnp.reshape(array[..., :whole, :], (*array.shape[:-2], count, size, array.shape[-1]))
        mapped = jnp.moveaxis(jax.lax.map(function, jnp.moveaxis(chunks, -3, 0)), 0, -3)
        joined = jnp.reshape(mapped, (*mapped.shape[:-3], whole, mapped.shape[-1]))
        if whole == n:
            return joined
        return jnp.concatenate([joined, function(array[..., whole:, :])], axis=-2)

    def gradients(self, function: Callable[..., Any], arrays: list[Any]) -> list[Any]:
        import jax

        def total(*xs: Any) -> Any:
            return function(*xs).sum()

        return list(jax.grad(total, argnums=tuple(range(len(arrays))))(*arrays))

    def trace(self, function: Callable[..., Any]) -> Callable[..., Any]:
        import jax

        return jax.jit(function)

    def vectorize(self, function: Callable[..., Any]) -> Callable[..., Any]:
        import jax

        return jax.vmap(function)

    def implementations(self) -> Mapping[str, Callable[..., Any]]:
        if self._natives is None:
            self._natives = {
                "scaled_dot_product_attention": _scaled_dot_product_attention,
                "flex_attention": _flex_attention,
            }
        return self._natives


#: Platforms where ``jax.nn.dot_product_attention`` beats attnx's algorithm.
NATIVE_PLATFORMS = frozenset({"gpu", "cuda", "rocm", "tpu"})


def _scaled_dot_product_attention(
    *,
    query: Any,
    key: Any,
    value: Any,
    mask: Any,
    key_lengths: Any,
    is_causal: bool,
    scale: Any,
    return_weights: bool,
    chunks: Any = None,
    batch_shape: Any = None,
    chunk_size: Any = None,
) -> Any:
    if return_weights:
        return NotImplemented
    import jax

    if jax.default_backend() not in NATIVE_PLATFORMS:
        return _flash(query, key, value, mask, key_lengths, is_causal, scale, chunks, chunk_size, batch_shape)
    # JAX's masked rows differ from attnx's (an average, not zeros), its
    # causal mask aligns to the start, and it returns no weights: decline all
    # of those.  Its layout is (batch, n, heads, d), with exactly four axes.
    if mask is not None or key_lengths is not None:
        return NotImplemented
    n, m = query.shape[-2], key.shape[-2]
    if (is_causal and n != m) or n == 0 or m == 0:
        return NotImplemented
    leading = tuple(query.shape[:-2])
    if len(leading) == 3 and natives.key_groups(query.shape, key.shape, value.shape) > 1:
        # Grouped heads as attnx lays them out (attnx._grouping): query (B, H_kv, G)
        # against keys (B, H_kv, 1), which JAX's own grouped heads read without copying.
        batch, kv_heads, groups = leading
        query = query.reshape(batch, kv_heads * groups, n, query.shape[-1])
        key, value = key[:, :, 0], value[:, :, 0]
    elif query.ndim != 4 or not leading[:2] == tuple(key.shape[:2]) == tuple(value.shape[:2]):
        return NotImplemented
    if value.shape[-1] != query.shape[-1]:
        return NotImplemented  # JAX wants d_v == d_k
    import jax.numpy as jnp

    if query.dtype not in (jnp.float32, jnp.float64):
        return NotImplemented  # JAX computes half precision in its own dtype, attnx in float32
    if not isinstance(scale, float):  # an array (traced, perhaps): fold it into the queries
        query, scale = query * scale, 1.0
    output = jax.nn.dot_product_attention(
        jnp.swapaxes(query, 1, 2),
        jnp.swapaxes(key, 1, 2),
        jnp.swapaxes(value, 1, 2),
        scale=scale,
        is_causal=is_causal,
    )
    return jnp.reshape(jnp.swapaxes(output, 1, 2), (*leading, n, value.shape[-1]))


#: Queries and keys per block of :mod:`.jax_flash`: of (128, 128) to
#: (1024, 1024), the fastest on 2 CPU cores at (1, 2, 8192, 64) causal,
#: jitted forward and backward, and at (1, 8, 2048, 64) and (16, 8, 1024,
#: 64) forward (within the host's noise of the best there).
FLASH_BLOCKS = (512, 256)


def _flash(
    query: Any,
    key: Any,
    value: Any,
    mask: Any,
    key_lengths: Any,
    is_causal: bool,
    scale: Any,
    chunks: Any,
    chunk_size: Any,
    batch_shape: tuple[int, ...],
) -> Any:
    """attnx's tiles in JAX's loops (:mod:`.jax_flash`) where attnx would
    cut the work into tiles (``chunks``): XLA runs them as loops, and
    ``jax.grad`` keeps no tile.  Measured jitted on 2 CPU cores, forward and
    backward of a causal (1, 2, 8192, 64) float32 call: 10.7 MiB of temporaries
    (XLA's memory analysis) where attnx's unrolled tiles took 892 MiB and
    ``jax.nn.dot_product_attention`` 1,540 MiB.  Grouped heads, ``key_lengths``
    and boolean masks too (:func:`_laid_mask`); a real mask, whose gradient
    the generic backward gives, is left to it."""
    if chunks is None or chunk_size is not None or not isinstance(scale, float) or query.ndim < 3:
        # One block (small calls), tiles the user sized for attnx's own algorithm (and the
        # conformance suite's small ones, which would each compile the loops), or a traced
        # scale: the generic algorithm.
        return NotImplemented
    groups = natives.key_groups(query.shape, key.shape, value.shape)
    if groups == 1 and not tuple(query.shape[:-2]) == tuple(key.shape[:-2]) == tuple(value.shape[:-2]):
        return NotImplemented  # keys broadcast over the batch: the generic algorithm
    n, m = query.shape[-2], key.shape[-2]
    if 0 in (n, m) or str(query.dtype) not in ("float32", "float64"):
        return NotImplemented  # half precision computes in float32 in the generic algorithm
    import jax.numpy as jnp

    laid = None if mask is None else _laid_mask(jnp, mask, tuple(batch_shape))
    if laid is NotImplemented:
        return NotImplemented
    counts = None if key_lengths is None else natives.key_counts(jnp, key_lengths, False, tuple(batch_shape), n, m)
    from .jax_flash import attention

    return attention(
        query,
        key,
        value,
        scale=scale,
        is_causal=is_causal,
        blocks=FLASH_BLOCKS,
        groups=groups,
        counts=counts,
        mask=laid,
    )


def _flex_attention(
    *,
    query: Any,
    key: Any,
    value: Any,
    score_mod: Any,
    block_mask: Any,
    scale: Any,
    enable_gqa: bool,
    return_weights: bool,
) -> Any:
    """``flex_attention`` in JAX's loops (:mod:`.jax_flash`) where it is
    traced (``jax.jit``, ``jax.grad``) on the CPU: XLA runs the blocks that
    the block mask leaves non-empty as loops, and ``jax.grad`` keeps no
    tile; the score_mod's tables (what it closes over) get their gradients
    from the loops' backward.  Eager calls keep attnx's tiles, which need
    no compiling, and so do calls whose scores fit one block."""
    import jax

    if return_weights or jax.default_backend() in NATIVE_PLATFORMS or not isinstance(scale, float):
        return NotImplemented
    if not any(isinstance(a, jax.core.Tracer) for a in (query, key, value)):
        return NotImplemented
    batch, heads, n, d_k = query.shape
    kv_heads, m = key.shape[1], key.shape[2]
    if not key.shape[0] == value.shape[0] == batch or 0 in (batch, heads, n, m):
        return NotImplemented  # keys broadcast over the batch, or nothing to compute: attnx's tiles
    if str(query.dtype) not in ("float32", "float64"):
        return NotImplemented  # half precision computes in float32 in the generic algorithm
    if batch * heads * n * m * query.dtype.itemsize <= get_memory_budget("jax"):
        # Scores that attnx holds in one block: nothing to save, and compiling the loops costs
        # more than the block (the conformance suite's small calls would each compile them).
        return NotImplemented
    from .jax_flash import attention, flex_loops

    blocks = FLASH_BLOCKS if block_mask is None else tuple(block_mask.block_size)
    loops = flex_loops(query, m, score_mod, block_mask, blocks)
    groups = heads // kv_heads
    if groups > 1:  # attnx's layout of grouped heads: (B, H_kv, G) queries against (B, H_kv, 1) keys
        query = query.reshape(batch, kv_heads, groups, n, d_k)
        key, value = (a.reshape(batch, kv_heads, 1, m, a.shape[-1]) for a in (key, value))
    output = attention(query, key, value, scale=scale, is_causal=False, blocks=blocks, groups=groups, flex=loops)
    return output.reshape(batch, heads, n, value.shape[-1])


def _laid_mask(jnp: Any, mask: Any, batch_shape: tuple[int, ...]) -> Any:
    """A boolean ``mask`` as :func:`.jax_flash.attention` takes it, ``(S or 1,
    n or 1, m or 1)`` over the call's ``S`` slices: shared by every slice,
    one per slice, or one row of keys per slice (padding, copied per slice:
    small); ``NotImplemented`` for a real mask, or one that would be copied
    whole for every slice it is shared by."""
    if mask.dtype != jnp.bool_:
        return NotImplemented
    mask = mask.reshape((1,) * (len(batch_shape) + 2 - mask.ndim) + tuple(mask.shape))
    lead, core = tuple(mask.shape[:-2]), tuple(mask.shape[-2:])
    if all(size == 1 for size in lead):
        return mask.reshape(1, *core)
    if lead == batch_shape or core[0] == 1:
        return jnp.broadcast_to(mask, (*batch_shape, *core)).reshape(math.prod(batch_shape), *core)
    return NotImplemented


def _outside_traces() -> bool:
    try:
        from jax._src.core import trace_state_clean
    except ImportError:  # not public: where it moves, probe whether a new array is traced
        import jax

        return not isinstance(jax.numpy.zeros(()), jax.core.Tracer)
    return trace_state_clean()


@hookimpl
def attnx_backends() -> list[Backend]:
    return [JaxBackend()]
