"""The NumPy backend: CPU, always available, the default."""

from __future__ import annotations

from typing import Any

from attnx import Backend, hookimpl


class NumPyBackend(Backend):
    name = "numpy"
    array_module = "numpy"
    float_dtypes = ("float32", "float64", "float16")

    def version(self) -> str:
        import numpy

        return numpy.__version__

    def namespace(self) -> Any:
        import array_api_compat.numpy

        return array_api_compat.numpy

    def asarray(self, obj: Any, *, dtype: Any = None, device: Any = None) -> Any:
        import numpy

        if device not in (None, "cpu"):
            raise ValueError(f"the numpy backend has only the 'cpu' device, got {device!r}")
        return numpy.asarray(obj, dtype=dtype)

    def to_numpy(self, array: Any) -> Any:
        import numpy

        return numpy.asarray(array)


@hookimpl
def attnx_backends() -> list[Backend]:
    return [NumPyBackend()]
