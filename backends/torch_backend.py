"""The PyTorch backend: CPU and CUDA tensors; autograd flows through.

Its native scaled dot-product attention calls
``torch.nn.functional.scaled_dot_product_attention`` (which picks a fused
flash kernel when it can) with attnx's masks translated to PyTorch's; on
CUDA its native ``flex_attention`` calls PyTorch's compiled FlexAttention.
"""

from __future__ import annotations

import importlib.util
import math
import weakref
from collections.abc import Callable, Mapping
from typing import Any

from attnx import Backend, hookimpl, natives
from attnx.backend import GPU_BLOCK_BYTES


class TorchBackend(Backend):
    name = "torch"
    array_module = "torch"
    float_dtypes = ("float32", "float64", "float16", "bfloat16")
    supports_autograd = True

    _natives: Mapping[str, Callable[..., Any]] | None = None

    def unavailable_reason(self) -> str | None:
        if importlib.util.find_spec("torch") is None:
            return "torch is not installed (pip install '.[torch]' in attnx's clone)"
        return None

    def version(self) -> str:
        from importlib.metadata import version

        return version("torch")

    def devices(self) -> list[Any]:
        import torch

        cuda = [f"cuda:{i}" for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
        return ["cpu", *cuda]

    def block_bytes_on(self, device: Any) -> int:
        # CUDA's blocks are launch-bound as CuPy's are; other devices keep
        # the CPU's cache-sized blocks (none other was measured).
        return GPU_BLOCK_BYTES if str(device).startswith("cuda") else self.block_bytes  # "cuda:0", torch.device

    def namespace(self) -> Any:
        import array_api_compat.torch

        return array_api_compat.torch

    def asarray(self, obj: Any, *, dtype: Any = None, device: Any = None) -> Any:
        import torch

        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        if type(obj).__module__ == "numpy" and not obj.flags.writeable:
            obj = obj.copy()  # torch warns on read-only buffers
        return torch.as_tensor(obj, dtype=dtype, device=device)

    def to_numpy(self, array: Any) -> Any:
        import torch

        array = array.detach().cpu()
        if array.dtype == torch.bfloat16:  # NumPy has no bfloat16
            array = array.float()
        return array.numpy()

    def synchronize(self, device: Any = None) -> None:
        import torch

        # Without CUDA initialised no GPU work can be queued; and the check is
        # cheap where ``is_available()`` costs microseconds per call.
        if torch.cuda.is_initialized():
            torch.cuda.synchronize(device)

    def is_concrete(self, array: Any) -> bool:
        import torch

        # Under torch.compile tensors are symbolic; under torch.func.vmap a
        # batched tensor's values can't be read (``.item()`` raises).
        if torch.compiler.is_compiling():
            return False
        return not _is_batched(array)

    def trace(self, function: Callable[..., Any]) -> Callable[..., Any]:
        import torch

        return torch.compile(function, fullgraph=True, dynamic=False)

    def vectorize(self, function: Callable[..., Any]) -> Callable[..., Any]:
        import torch

        return torch.func.vmap(function)

    def gradients(self, function: Callable[..., Any], arrays: list[Any]) -> list[Any]:
        import torch

        leaves = [a.detach().clone().requires_grad_(True) for a in arrays]
        with torch.enable_grad():  # asked for gradients: under torch.no_grad too
            total = function(*leaves).sum()
        return list(torch.autograd.grad(total, leaves, allow_unused=True))

    def custom_vjp(self, forward: Callable[..., Any], backward: Callable[..., Any], arrays: tuple[Any, ...]) -> Any:
        import torch

        if not torch.is_grad_enabled() or not any(array.requires_grad for array in arrays):
            return forward(*arrays)[0]  # nothing to differentiate: no tape to keep
        from attnx_backends.torch_function import CustomVJP

        return CustomVJP.apply(forward, backward, *arrays)[0]

    def implementations(self) -> Mapping[str, Callable[..., Any]]:
        if self._natives is None:
            self._natives = {
                "scaled_dot_product_attention": _scaled_dot_product_attention,
                "flex_attention": _flex_attention,
            }
        return self._natives

    def specialize(self, operation: str, arguments: Mapping[str, Any]) -> Callable[..., Any] | None:
        if operation == "scaled_dot_product_attention":
            return _sdpa_plan(**arguments)
        return None


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
    # PyTorch's fused kernels are memory-efficient themselves: ``chunks`` is moot.
    if return_weights:
        return NotImplemented  # PyTorch's kernels don't return the weights
    leading = _leading_shape(query, key, value, batch_shape)
    if leading is None:
        return NotImplemented  # nothing to attend: the generic algorithm's zeros
    n, m = query.shape[-2], key.shape[-2]
    if not isinstance(scale, float):  # a tensor (traced, or with a gradient): fold it into the queries
        query, scale = query * scale, 1.0
    if mask is None and key_lengths is None and (not is_causal or n == m):
        attn_mask = None  # lets PyTorch pick its fused kernels
    else:
        # The one mask rule of attnx, expressed as PyTorch's single mask.  An
        # import here, not a global loaded elsewhere: nothing to load first,
        # and its microsecond is small beside building the mask.
        import array_api_compat.torch as xp

        attn_mask = natives.combined_mask(
            xp,
            mask=mask,
            key_lengths=key_lengths,
            is_causal=is_causal,
            batch_shape=tuple(leading),
            n=n,
            m=m,
            dtype=query.dtype,
            device=query.device,
        )
        if attn_mask.ndim < 2:  # a scalar or a row of keys: PyTorch's SDPA reads the mask's last two axes
            attn_mask = attn_mask.expand(n, m)
        is_causal = False
    return _kernel(query.shape, key.shape, value.shape, leading, is_causal, scale)(query, key, value, attn_mask)


def _sdpa_plan(
    *, query: Any, key: Any, value: Any, mask: Any, key_lengths: Any, is_causal: bool, scale: Any, **options: Any
) -> Callable[..., Any] | None:
    """The native above as a function of ``(query, key, value)`` for every
    call of these shapes, where it needs no per-call mask; else None."""
    if mask is not None or key_lengths is not None or options["return_weights"] or not isinstance(scale, float):
        return None
    leading = _leading_shape(query, key, value, options["batch_shape"])
    if leading is None or (is_causal and query.shape[-2] != key.shape[-2]):
        return None
    return _kernel(query.shape, key.shape, value.shape, leading, is_causal, scale)


def _leading_shape(query: Any, key: Any, value: Any, batch_shape: Any) -> Any:
    """The inputs' broadcast leading shape; None where there is nothing to
    attend (no query, key or slice)."""
    q_shape, k_shape = query.shape, key.shape  # torch.Size: tuples already
    leading = q_shape[:-2]
    if not leading == k_shape[:-2] == value.shape[:-2]:
        import torch

        leading = tuple(batch_shape or torch.broadcast_shapes(leading, k_shape[:-2], value.shape[:-2]))
    if q_shape[-2] == 0 or k_shape[-2] == 0 or 0 in leading:
        return None
    return leading


def _kernel(
    q_shape: Any, k_shape: Any, v_shape: Any, leading: Any, is_causal: bool, scale: float
) -> Callable[..., Any]:
    """PyTorch's SDPA for inputs of these shapes, as a function of
    ``(query, key, value, attn_mask=None)``."""
    fused = _fused_attention or _load()
    n, d_k, m, d_v = q_shape[-2], q_shape[-1], k_shape[-2], v_shape[-1]
    if d_k and scale == 1.0 / math.sqrt(d_k):
        scale = None  # PyTorch's own default, computed alike: the keyword costs a microsecond per call
    if leading == q_shape[:-2] == k_shape[:-2] == v_shape[:-2] and 1 <= len(leading) <= 2:
        if scale is None and not is_causal:
            return fused  # its own signature is (query, key, value, attn_mask=None)
        # Positional (attn_mask, dropout_p, is_causal): keywords cost a microsecond here.
        if scale is None:
            return lambda query, key, value, attn_mask=None: fused(query, key, value, attn_mask, 0.0, is_causal)
        return lambda query, key, value, attn_mask=None: fused(
            query, key, value, attn_mask, 0.0, is_causal, scale=scale
        )

    if leading == q_shape[:-2] and natives.key_groups(q_shape, k_shape, v_shape) > 1:
        # Grouped heads, as attnx lays them out (attnx._grouping): query (..., H_kv, G)
        # against keys (..., H_kv, 1).  PyTorch's enable_gqa reads them without copying.
        batch, kv_heads, heads = math.prod(leading[:-2]), leading[-2], leading[-2] * leading[-1]

        def grouped(query: Any, key: Any, value: Any, attn_mask: Any = None) -> Any:
            query = query.reshape(batch, heads, n, d_k)
            key, value = key.reshape(batch, kv_heads, m, d_k), value.reshape(batch, kv_heads, m, d_v)
            if attn_mask is not None:
                attn_mask = attn_mask.expand(*leading, n, m).reshape(batch, heads, n, m)
            output = fused(query, key, value, attn_mask, 0.0, is_causal, scale=scale, enable_gqa=True)
            return output.reshape(*leading, n, d_v)

        return grouped

    # PyTorch's fused CPU kernels want (batch, heads, n, d): other layouts (no
    # leading dimension, broadcast heads, 5-D grouped heads) fall back to a
    # slow path that materialises the scores, so flatten the leading shape.
    # The slice count spelled out: -1 is ambiguous for an empty feature axis.
    slices = math.prod(leading)

    def flattened(query: Any, key: Any, value: Any, attn_mask: Any = None) -> Any:
        query = query.expand(*leading, n, d_k).reshape(1, slices, n, d_k)
        key = key.expand(*leading, m, d_k).reshape(1, slices, m, d_k)
        value = value.expand(*leading, m, d_v).reshape(1, slices, m, d_v)
        if attn_mask is not None:
            attn_mask = attn_mask.expand(*leading, n, m).reshape(1, slices, n, m)
        output = fused(query, key, value, attn_mask, 0.0, is_causal, scale=scale)
        return output.reshape(*leading, n, d_v)

    return flattened


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
    # PyTorch's FlexAttention is fused and faster where it compiles kernels
    # (CUDA); on the CPU it has no backward, and eager it materialises the
    # scores: attnx's tiles are the better path there.
    if return_weights or query.device.type != "cuda" or not _compiles_on_cuda(query, value, block_mask):
        return NotImplemented
    return pytorch_flex(query, key, value, score_mod, block_mask, scale=scale, enable_gqa=enable_gqa)


#: What PyTorch's compiled FlexAttention takes on CUDA (2.11, H100): heads
#: of 16 or more ("NYI: embedding dimension ... must be at least 16"), block
#: masks whose blocks are a multiple of its kernels' tiles (powers of two up
#: to 128), and the dtypes Triton's matrix products take (float64 fails to
#: compile).  Elsewhere attnx's tiles compute the same exactly.
FLEX_MIN_HEAD_DIM = 16
FLEX_BLOCK_MULTIPLE = 128
FLEX_DTYPES = ("float32", "float16", "bfloat16")


def _compiles_on_cuda(query: Any, value: Any, block_mask: Any) -> bool:
    """Whether PyTorch's compiled FlexAttention takes this call on CUDA."""
    if str(query.dtype).removeprefix("torch.") not in FLEX_DTYPES:
        return False
    if min(query.shape[-1], value.shape[-1]) < FLEX_MIN_HEAD_DIM:
        return False
    return block_mask is None or all(size % FLEX_BLOCK_MULTIPLE == 0 for size in block_mask.block_size)


#: PyTorch's block masks made from attnx's, per (attnx block mask, device).
_torch_block_masks: weakref.WeakKeyDictionary[Any, dict[str, Any]] = weakref.WeakKeyDictionary()
_compiled_flex: list[Any] = []


def pytorch_flex(
    query: Any,
    key: Any,
    value: Any,
    score_mod: Any,
    block_mask: Any,
    *,
    scale: Any,
    enable_gqa: bool,
    compiled: bool = True,
) -> Any:
    """attnx's ``flex_attention`` through ``torch.nn.attention.flex_attention``
    (compiled unless ``compiled=False``): the same mods, and attnx's block
    mask remade as PyTorch's from its ``mask_mod`` (once per device)."""
    from torch.nn.attention import flex_attention as flex

    torch_mask = None
    if block_mask is not None:
        per_device = _torch_block_masks.setdefault(block_mask, {})
        torch_mask = per_device.get(str(query.device))
        if torch_mask is None:
            batch, heads, n, m = block_mask.shape
            torch_mask = per_device[str(query.device)] = flex.create_block_mask(
                block_mask.mask_mod, batch, heads, n, m, device=query.device, BLOCK_SIZE=block_mask.block_size
            )
    if not isinstance(scale, float):  # a tensor: PyTorch's flex takes a float, so fold it into the queries
        query, scale = query * scale, 1.0
    if compiled and not _compiled_flex:
        import torch

        # Static: a float a mod closes over (soft_cap's cap) or the scale stays
        # a constant of the kernel, where dynamic it would become a tensor read
        # inside the mod, which PyTorch 2.11's lowering of FlexAttention refuses.
        _compiled_flex.append(torch.compile(flex.flex_attention, dynamic=False))
    function = _compiled_flex[0] if compiled else flex.flex_attention
    return function(query, key, value, score_mod=score_mod, block_mask=torch_mask, scale=scale, enable_gqa=enable_gqa)


# Imported on first use, then looked up as globals: a per-call import costs
# microseconds that small inputs notice.
_fused_attention: Any = None


def _load() -> Any:
    global _fused_attention
    from torch.nn.functional import scaled_dot_product_attention

    _fused_attention = scaled_dot_product_attention
    return _fused_attention


def _is_batched(array: Any) -> bool:
    try:
        from torch._C._functorch import is_batchedtensor
    except ImportError:  # private: where it moves, assume the values can be read
        return False
    return is_batchedtensor(array)


@hookimpl
def attnx_backends() -> list[Backend]:
    return [TorchBackend()]
