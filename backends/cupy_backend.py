"""The CuPy backend: NVIDIA GPUs.  Unavailable, with the reason, without one."""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable, Mapping
from typing import Any

from attnx import Backend, hookimpl
from attnx.backend import GPU_BLOCK_BYTES


class CuPyBackend(Backend):
    name = "cupy"
    array_module = "cupy"
    block_bytes = GPU_BLOCK_BYTES  # a GPU's blocks: launches, not cache, set their size

    _natives: Mapping[str, Callable[..., Any]] | None = None

    def unavailable_reason(self) -> str | None:
        if importlib.util.find_spec("cupy") is None:
            return (
                "cupy is not installed (pip install '.[cupy]' in attnx's clone with CUDA 12, cupy-cuda13x with CUDA 13)"
            )
        try:
            import cupy

            count = cupy.cuda.runtime.getDeviceCount()
        except Exception as exc:  # CUDARuntimeError without a driver, ImportError without CUDA
            return f"no usable CUDA device: {exc}"
        return None if count > 0 else "no CUDA device found"

    @property
    def float_dtypes(self) -> tuple[str, ...]:  # type: ignore[override]
        # bfloat16 where CuPy holds it: CuPy 14 and later, with ml_dtypes installed
        return ("float32", "float64", "float16", *(("bfloat16",) if _has_bfloat16() else ()))

    def version(self) -> str:
        import cupy

        return cupy.__version__

    def devices(self) -> list[Any]:
        import cupy

        return [f"cuda:{i}" for i in range(cupy.cuda.runtime.getDeviceCount())]

    def device(self, device: Any) -> Any:
        # CuPy's own functions take a device index or a cupy.cuda.Device,
        # never a name: "cuda:1" becomes Device(1) here, once for every
        # function that creates arrays from nothing.
        if device is None:
            return None
        import cupy

        return cupy.cuda.Device(_device_index(device))

    def namespace(self) -> Any:
        import array_api_compat.cupy

        return array_api_compat.cupy

    def asarray(self, obj: Any, *, dtype: Any = None, device: Any = None) -> Any:
        import cupy

        index = _device_index(device)
        with cupy.cuda.Device(index):
            return cupy.asarray(obj, dtype=dtype)

    def to_numpy(self, array: Any) -> Any:
        return array.get()

    def implementations(self) -> Mapping[str, Callable[..., Any]]:
        if self._natives is None:
            from functools import partial

            from . import cupy_attention

            self._natives = {
                "scaled_dot_product_attention": partial(cupy_attention.scaled_dot_product_attention, backend=self),
                "vjp(scaled_dot_product_attention)": partial(
                    cupy_attention.scaled_dot_product_attention_vjp, backend=self
                ),
            }
        return self._natives

    def specialize(self, operation: str, arguments: Mapping[str, Any]) -> Callable[..., Any] | None:
        if operation == "scaled_dot_product_attention":
            from . import cupy_attention

            return cupy_attention.call_plan(self, arguments)
        return None

    def synchronize(self, device: Any = None) -> None:
        import cupy

        cupy.cuda.Device(_device_index(device)).synchronize()


@functools.cache
def _has_bfloat16() -> bool:
    if importlib.util.find_spec("cupy") is None:
        return False
    try:
        import array_api_compat.cupy as xp
    except Exception:  # CuPy installed without its CUDA libraries
        return False
    return hasattr(xp, "bfloat16")


def _device_index(device: Any) -> int:
    if device is None:
        import cupy

        return cupy.cuda.Device().id
    if isinstance(device, int) and not isinstance(device, bool) and device >= 0:
        return device
    if hasattr(device, "id"):
        return device.id
    kind, colon, index = str(device).partition(":")  # "cuda:1", and torch.device("cuda:1") by its str
    if kind == "cuda" and (index.isdigit() or not colon):
        return int(index or 0)
    raise ValueError(f"the cupy backend expects a CUDA device ('cuda:0', 0), got {device!r}")


@hookimpl
def attnx_backends() -> list[Backend]:
    return [CuPyBackend()]
