"""The CuPy backend's half-precision attention: cuDNN's fused SDPA, through
NVIDIA's ``cudnn`` frontend (``nvidia-cudnn-frontend``).

attnx's own kernels (:mod:`cupy_flash`, :mod:`cupy_attention`) compute on
the GPU's float units; half precision reached them cast to float32, at
float32's speed.  cuDNN's fused attention does both products on the tensor
cores with float32 accumulation, the online softmax in registers
(FlashAttention-2's plan), and it is what PyTorch's and JAX's own SDPA call
on recent GPUs: a well-kept library made for exactly this, where a kernel
of attnx's own would chase it.  attnx's generic algorithm stays the
reference it is tested against.

The route takes float16 calls without a ``mask``, ``key_lengths`` or
``chunk_size``, with a float ``scale``, the causal rule in attnx's
alignment (query ``i`` attends keys ``j <= i + m - n``: cuDNN's
bottom-right diagonal) where every query has a key (``n <= m``), and
features cuDNN takes (:data:`FEATURES`).  Anything else, or a machine
without the frontend or the cuDNN library, goes to attnx's own kernels,
which compute it exactly as before (:func:`unavailable_reason` says why).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

#: Feature sizes cuDNN's fused attention takes: multiples of 8 up to 128
#: (Ampere and later; Hopper takes up to 256, which attnx does not ask).
FEATURES = range(8, 129, 8)


@dataclasses.dataclass(frozen=True)
class CudnnCall:
    """One graph: its sizes, as ``(slices, n, d)`` arrays, the causal rule
    and the scale (a graph's constant)."""

    slices: int
    n: int
    m: int
    d_k: int
    d_v: int
    is_causal: bool
    scale: float
    device: int


@functools.cache
def unavailable_reason() -> str | None:
    """Why the route can't run here (the frontend or the cuDNN library
    missing), or None where it can."""
    try:
        import cudnn  # noqa: F401  (the frontend loads libcudnn as it is imported)
    except Exception as exc:  # ImportError, or OSError where libcudnn is missing
        return f"cuDNN's frontend is not usable ({type(exc).__name__}: {exc}); pip install '.[cudnn]' in attnx's clone"
    return None


def plan(
    dtype_name: str,
    *,
    slices: int,
    n: int,
    m: int,
    d_k: int,
    d_v: int,
    is_causal: bool,
    scale: Any,
    device: int,
) -> CudnnCall | None:
    """The cuDNN call for these sizes, or None where the route does not take
    them (see the module's note) or can't run here."""
    if (
        dtype_name != "float16"
        or not isinstance(scale, float)
        or d_k not in FEATURES
        or d_v not in FEATURES
        or (is_causal and n > m)
        or unavailable_reason() is not None
    ):
        return None
    call = CudnnCall(slices, n, m, d_k, d_v, is_causal, scale, device)
    return call if _graph(call) is not None else None


@functools.cache
def _handle(device: int) -> int:
    import cudnn
    import cupy

    with cupy.cuda.Device(device):
        return cudnn.create_handle()


@functools.lru_cache(maxsize=64)
def _graph(call: CudnnCall) -> tuple[Any, Any, Any, Any, Any, int] | None:
    """``(graph, query, key, value, output, workspace bytes)``, built once a
    call's sizes; None where cuDNN's heuristics find no engine for them."""
    import cudnn
    import cupy

    half, single = cudnn.data_type.HALF, cudnn.data_type.FLOAT
    with cupy.cuda.Device(call.device):
        graph = cudnn.pygraph(
            io_data_type=half, intermediate_data_type=single, compute_data_type=single, handle=_handle(call.device)
        )

        def slices_of(name: str, rows: int, features: int) -> Any:
            # (slices, 1, rows, features): cuDNN's (batch, heads, sequence, features), C-ordered.
            size = rows * features
            return graph.tensor(
                name=name, dim=[call.slices, 1, rows, features], stride=[size, size, features, 1], data_type=half
            )

        query = slices_of("query", call.n, call.d_k)
        key = slices_of("key", call.m, call.d_k)
        value = slices_of("value", call.m, call.d_v)
        causal = (
            {"diagonal_alignment": cudnn.diagonal_alignment.BOTTOM_RIGHT, "diagonal_band_right_bound": 0}
            if call.is_causal
            else {}
        )
        output, _ = graph.sdpa(
            name="sdpa", q=query, k=key, v=value, generate_stats=False, attn_scale=call.scale, **causal
        )
        size = call.n * call.d_v
        output.set_output(True).set_dim([call.slices, 1, call.n, call.d_v]).set_stride(
            [size, size, call.d_v, 1]
        ).set_data_type(half)
        try:
            graph.validate()
            graph.build_operation_graph()
            graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
            graph.check_support()
            graph.build_plans()
        except Exception:  # cudnnGraphNotSupportedError, or a RuntimeError from the backend
            return None
        return graph, query, key, value, output, graph.get_workspace_size()


def attend(call: CudnnCall, query: Any, key: Any, value: Any, output_shape: tuple[int, ...]) -> Any:
    """The attention of float16 CuPy arrays laid out as ``(slices, n, d_k)``,
    ``(slices, m, d_k)`` and ``(slices, m, d_v)`` (any leading shape of
    ``slices`` elements) as ``call`` plans it: ``output_shape``, one cuDNN
    launch on the current stream.  Inputs not C-ordered are copied first."""
    import cupy

    graph, query_t, key_t, value_t, output_t, workspace_bytes = _graph(call)
    query, key, value = (
        array if array.flags.c_contiguous else cupy.ascontiguousarray(array) for array in (query, key, value)
    )
    output = cupy.empty(output_shape, dtype=query.dtype)
    # cuDNN's forward usually asks no workspace; one it asks comes from CuPy's pool, a call's own.
    workspace = cupy.empty((workspace_bytes,), dtype=cupy.uint8) if workspace_bytes else None
    buffers = {query_t: query.data.ptr, key_t: key.data.ptr, value_t: value.data.ptr, output_t: output.data.ptr}
    graph.execute(
        buffers,
        0 if workspace is None else workspace.data.ptr,
        handle=_handle_on_stream(call.device, cupy.cuda.get_current_stream().ptr),
    )
    return output


#: Each device's handle's stream: cuDNN's cudnnSetStream queries the driver
#: at every call, so it is called only where the stream changed.
_streams: dict[int, int] = {}


def _handle_on_stream(device: int, stream: int) -> int:
    import cudnn

    handle = _handle(device)
    if _streams.get(device) != stream:
        cudnn.set_stream(handle=handle, stream=stream)
        _streams[device] = stream
    return handle
