"""The CuPy backend's half-precision attention: cuDNN's fused SDPA, through
NVIDIA's ``cudnn`` frontend (``nvidia-cudnn-frontend``), forward and
backward.

attnx's own kernels (:mod:`cupy_flash`, :mod:`cupy_attention`) compute on
the GPU's float units; half precision reached them cast to float32, at
float32's speed.  cuDNN's fused attention does both products on the tensor
cores with float32 accumulation, the online softmax in registers
(FlashAttention-2's plan), and it is what PyTorch's and JAX's own SDPA call
on recent GPUs: a well-kept library made for exactly this, where a kernel
of attnx's own would chase it.  attnx's generic algorithm stays the
reference it is tested against.

The route takes float16 and bfloat16 calls (:data:`IO_TYPES`) without a
``mask`` or ``chunk_size``, with a float ``scale`` and features cuDNN takes
(:data:`FEATURES`):

- the causal rule in attnx's alignment (query ``i`` attends keys ``j <= i +
  m - n``: cuDNN's bottom-right diagonal) where every query has a key
  (``n <= m``);
- grouped heads: cuDNN's batch is the key/value slices, its heads the
  ``groups`` query slices that read each (:func:`attnx.natives.key_groups`),
  so no key is copied;
- ``key_lengths`` that are one number a slice, as cuDNN's padding mask
  (``seq_len_kv``), without the causal rule: cuDNN aligns a diagonal with
  each sequence's own length, attnx's with ``m``.  cuDNN leaves a slice of
  length 0 undefined; the caller gives its rows zeros, as attnx does;
- with ``training``, the forward keeps each row's log-sum-exp (cuDNN's
  stats) for cuDNN's backward (:func:`attend_backward`), which
  :func:`attnx.vjp` calls; lengths are left to attnx's generic backward
  there.

Anything else, or a machine without the frontend or the cuDNN library,
goes to attnx's own kernels, which compute it exactly as before
(:func:`unavailable_reason` says why).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

#: Feature sizes cuDNN's fused attention takes: multiples of 8 up to 128
#: (Ampere and later; Hopper takes up to 256, which attnx does not ask).
FEATURES = range(8, 129, 8)

#: The inputs' dtypes the route takes, by attnx's name: cuDNN's data type's name.
IO_TYPES = {"float16": "HALF", "bfloat16": "BFLOAT16"}


@dataclasses.dataclass(frozen=True)
class CudnnCall:
    """One graph (a forward, and with ``training`` its backward): queries
    ``(slices, groups, n, d_k)``, keys ``(slices, 1, m, d_k)`` and values
    ``(slices, 1, m, d_v)`` of ``dtype_name``, each key slice read by
    ``groups`` query slices; ``lengths``: each slice's keys (cuDNN's padding
    mask); the causal rule and the scale (a graph's constant)."""

    dtype_name: str
    slices: int
    groups: int
    n: int
    m: int
    d_k: int
    d_v: int
    is_causal: bool
    lengths: bool
    scale: float
    device: int
    training: bool


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
    groups: int = 1,
    lengths: bool = False,
    training: bool = False,
) -> CudnnCall | None:
    """The cuDNN call for these sizes, or None where the route does not take
    them (see the module's note) or can't run here.  ``slices`` counts the
    key/value slices."""
    if (
        dtype_name not in IO_TYPES
        or not isinstance(scale, float)
        or d_k not in FEATURES
        or d_v not in FEATURES
        or (is_causal and n > m)
        or (lengths and (is_causal or training))
        or unavailable_reason() is not None
    ):
        return None
    call = CudnnCall(dtype_name, slices, groups, n, m, d_k, d_v, is_causal, lengths, scale, device, training)
    if _forward(call) is None or (training and _backward(call) is None):
        return None
    return call


@functools.cache
def _handle(device: int) -> int:
    import cudnn
    import cupy

    with cupy.cuda.Device(device):
        return cudnn.create_handle()


def _new_graph(call: CudnnCall) -> tuple[Any, Callable[..., Any]]:
    """An empty graph of ``call``'s types, and a function that declares one
    of its C-ordered tensors ``(name, dims, data type)``; the data type is
    the inputs' unless given."""
    import cudnn

    io_type = getattr(cudnn.data_type, IO_TYPES[call.dtype_name])
    graph = cudnn.pygraph(
        io_data_type=io_type,
        intermediate_data_type=cudnn.data_type.FLOAT,
        compute_data_type=cudnn.data_type.FLOAT,
        handle=_handle(call.device),
    )

    def tensor(name: str, dims: list[int], data_type: Any = io_type) -> Any:
        return graph.tensor(name=name, dim=dims, stride=_c_strides(dims), data_type=data_type)

    return graph, tensor


def _c_strides(dims: list[int]) -> list[int]:
    strides, size = [], 1
    for dim in reversed(dims):
        strides.insert(0, size)
        size *= dim
    return strides


def _shapes(call: CudnnCall) -> dict[str, list[int]]:
    """Each tensor's dims, cuDNN's (batch, heads, sequence, features)."""
    s, g = call.slices, call.groups
    return {
        "query": [s, g, call.n, call.d_k],
        "key": [s, 1, call.m, call.d_k],
        "value": [s, 1, call.m, call.d_v],
        "output": [s, g, call.n, call.d_v],
        "stats": [s, g, call.n, 1],
        "lengths": [s, 1, 1, 1],
    }


def _causal(call: CudnnCall) -> dict[str, Any]:
    import cudnn

    if not call.is_causal:
        return {}
    return {"diagonal_alignment": cudnn.diagonal_alignment.BOTTOM_RIGHT, "diagonal_band_right_bound": 0}


def _built(graph: Any, tensors: dict[str, Any]) -> tuple[Any, dict[str, Any], int] | None:
    """``(graph, tensors, workspace bytes)`` once cuDNN has plans for it;
    None where its heuristics find no engine for these sizes."""
    import cudnn

    try:
        graph.validate()
        graph.build_operation_graph()
        graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        graph.check_support()
        graph.build_plans()
    except Exception:  # cudnnGraphNotSupportedError, or a RuntimeError from the backend
        return None
    return graph, tensors, graph.get_workspace_size()


@functools.lru_cache(maxsize=64)
def _forward(call: CudnnCall) -> tuple[Any, dict[str, Any], int] | None:
    """The forward's graph, built once a call's sizes (see :func:`_built`)."""
    import cudnn
    import cupy

    shapes = _shapes(call)
    with cupy.cuda.Device(call.device):
        graph, tensor = _new_graph(call)
        tensors = {name: tensor(name, shapes[name]) for name in ("query", "key", "value")}
        padding = {}
        if call.lengths:
            tensors["query_lengths"] = tensor("query_lengths", shapes["lengths"], cudnn.data_type.INT32)
            tensors["lengths"] = tensor("lengths", shapes["lengths"], cudnn.data_type.INT32)
            padding = {
                "use_padding_mask": True,
                "seq_len_q": tensors["query_lengths"],
                "seq_len_kv": tensors["lengths"],
            }
        output, stats = graph.sdpa(
            name="sdpa",
            q=tensors["query"],
            k=tensors["key"],
            v=tensors["value"],
            generate_stats=call.training,
            attn_scale=call.scale,
            **padding,
            **_causal(call),
        )
        output.set_output(True).set_dim(shapes["output"]).set_stride(_c_strides(shapes["output"]))
        tensors["output"] = output
        if call.training:
            stats.set_output(True).set_dim(shapes["stats"]).set_stride(_c_strides(shapes["stats"]))
            tensors["stats"] = stats.set_data_type(cudnn.data_type.FLOAT)
        return _built(graph, tensors)


@functools.lru_cache(maxsize=64)
def _backward(call: CudnnCall) -> tuple[Any, dict[str, Any], int] | None:
    """The backward's graph, built once a call's sizes (see :func:`_built`)."""
    import cudnn
    import cupy

    shapes = _shapes(call)
    with cupy.cuda.Device(call.device):
        graph, tensor = _new_graph(call)
        tensors = {name: tensor(name, shapes[name]) for name in ("query", "key", "value", "output")}
        tensors["d_output"] = tensor("d_output", shapes["output"])
        tensors["stats"] = tensor("stats", shapes["stats"], cudnn.data_type.FLOAT)
        gradients = graph.sdpa_backward(
            name="sdpa_backward",
            q=tensors["query"],
            k=tensors["key"],
            v=tensors["value"],
            o=tensors["output"],
            dO=tensors["d_output"],
            stats=tensors["stats"],
            attn_scale=call.scale,
            **_causal(call),
        )
        for name, gradient in zip(("d_query", "d_key", "d_value"), gradients):
            shape = shapes[name[2:]]
            tensors[name] = gradient.set_output(True).set_dim(shape).set_stride(_c_strides(shape))
        return _built(graph, tensors)


def attend(call: CudnnCall, query: Any, key: Any, value: Any, lengths: Any = None) -> tuple[Any, Any]:
    """``(output, stats)``: the attention of CuPy arrays laid out as ``call``
    says (any shapes of those sizes; inputs not C-ordered are copied first),
    one cuDNN launch on the current stream.  The output has the queries'
    leading shape; stats (float32, ``(..., n, 1)``) only with
    ``call.training``, else None.  ``lengths``: each key slice's, int32
    ``(slices,)``, where ``call.lengths``."""
    import cupy

    graph, tensors, workspace_bytes = _forward(call)
    query, key, value = c_ordered(query, key, value)
    output = cupy.empty((*query.shape[:-1], call.d_v), dtype=query.dtype)
    buffers = {"query": query, "key": key, "value": value, "output": output}
    if call.lengths:
        buffers["lengths"] = cupy.ascontiguousarray(lengths, dtype=cupy.int32)
        buffers["query_lengths"] = cupy.full((call.slices,), call.n, dtype=cupy.int32)
    if call.training:
        buffers["stats"] = cupy.empty((*query.shape[:-1], 1), dtype=cupy.float32)
    _execute(call, graph, tensors, buffers, workspace_bytes)
    return output, buffers.get("stats")


def attend_backward(
    call: CudnnCall, query: Any, key: Any, value: Any, output: Any, d_output: Any, stats: Any
) -> tuple[Any, Any, Any]:
    """``(d_query, d_key, d_value)``, in the shapes of ``query``, ``key`` and
    ``value``: cuDNN's backward of :func:`attend`'s call, from its output
    and stats and the output's cotangent ``d_output``."""
    import cupy

    graph, tensors, workspace_bytes = _backward(call)
    query, key, value, output, d_output = c_ordered(
        query, key, value, output, d_output.astype(output.dtype, copy=False)
    )
    buffers = {"query": query, "key": key, "value": value, "output": output, "d_output": d_output, "stats": stats}
    for name, like in (("d_query", query), ("d_key", key), ("d_value", value)):
        buffers[name] = cupy.empty_like(like)
    _execute(call, graph, tensors, buffers, workspace_bytes)
    return buffers["d_query"], buffers["d_key"], buffers["d_value"]


def c_ordered(*arrays: Any) -> list[Any]:
    """The arrays C-ordered, as cuDNN's tensors are declared: copies of those that aren't."""
    import cupy

    return [array if array.flags.c_contiguous else cupy.ascontiguousarray(array) for array in arrays]


def _execute(
    call: CudnnCall, graph: Any, tensors: dict[str, Any], buffers: dict[str, Any], workspace_bytes: int
) -> None:
    """Runs ``graph`` on the arrays ``buffers`` (by the name of their
    tensors), on the current stream."""
    import cupy

    # cuDNN's forward usually asks no workspace; one it asks comes from CuPy's pool, a call's own.
    workspace = cupy.empty((workspace_bytes,), dtype=cupy.uint8) if workspace_bytes else None
    graph.execute(
        {tensors[name]: array.data.ptr for name, array in buffers.items()},
        0 if workspace is None else workspace.data.ptr,
        handle=_handle_on_stream(call.device, cupy.cuda.get_current_stream().ptr),
    )


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
