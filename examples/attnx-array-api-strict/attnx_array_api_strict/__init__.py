"""attnx backend for array-api-strict, the standard's strict reference library.

Everything a third-party backend needs: a :class:`attnx.Backend` subclass and
one hook implementation, registered in ``pyproject.toml`` under the
``attnx.backends`` entry-point group.  Run the conformance suite on it with
``attnx conformance array_api_strict``.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from attnx import Backend, hookimpl


class ArrayAPIStrictBackend(Backend):
    name = "array_api_strict"
    array_module = "array_api_strict"  # matches array_api_strict._array_object.Array
    float_dtypes = ("float32", "float64")

    def unavailable_reason(self) -> str | None:
        if importlib.util.find_spec("array_api_strict") is None:
            return "array-api-strict is not installed"
        return None

    def version(self) -> str:
        from importlib.metadata import version

        return version("array-api-strict")

    def devices(self) -> list[Any]:
        import array_api_strict

        return list(array_api_strict.__array_namespace_info__().devices())

    def namespace(self) -> Any:
        # The library *is* an array API namespace: no compat layer needed.
        import array_api_strict

        return array_api_strict

    def asarray(self, obj: Any, *, dtype: Any = None, device: Any = None) -> Any:
        import array_api_strict as xp
        import numpy as np

        if isinstance(dtype, str):
            dtype = getattr(xp, dtype)
        data = np.asarray(obj)
        if dtype is None:  # keep NumPy's dtype (int32 stays int32)
            dtype = getattr(xp, data.dtype.name)
        # Through a flat list and a reshape, so empty and 0-d arrays keep their shape.
        flat = xp.asarray(data.ravel().tolist(), dtype=dtype, device=device)
        return xp.reshape(flat, data.shape)

    def to_numpy(self, array: Any) -> Any:
        import numpy as np

        return np.from_dlpack(array)


@hookimpl
def attnx_backends() -> list[Backend]:
    return [ArrayAPIStrictBackend()]
