"""Launching the CuPy backend's CUDA kernels: the one place that makes a
``cupy.RawKernel``, and the argument every kernel takes the same way.

Each kernel's shell (:func:`cupy_flash.attend`, :func:`cupy_tiled.attend`,
:func:`cupy_tiled_backward.attend`, the row softmax) lays its arrays out
with ``arrays`` (CuPy) and launches with ``run`` (:func:`run`).  The tests
hand them NumPy and ``tests/cuda_on_cpu.py``'s launcher, so that the shells
run on the CPU exactly as they run on a GPU.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

#: ``run(source, name, shared_bytes, grid, block, arguments)``: launches
#: kernel ``name`` of CUDA ``source``.
Run = Callable[[str, str, int, Any, Any, Any], None]


def cupy_arrays() -> Any:
    """CuPy, the shells' array module on a GPU."""
    import cupy

    return cupy


def run(source: str, name: str, shared_bytes: int, grid: Any, block: Any, arguments: Any) -> None:
    """Launches kernel ``name`` of ``source`` on the current device with
    ``shared_bytes`` of dynamic shared memory (asked for past CUDA's 48 KiB,
    once a kernel and device)."""
    import cupy

    kernel = _compiled(source, name, shared_bytes, cupy.cuda.Device().id)
    kernel(grid, block, arguments, shared_mem=shared_bytes)


@functools.cache
def _compiled(source: str, name: str, shared_bytes: int, device: int) -> Any:
    import cupy

    kernel = cupy.RawKernel(source, name)
    if shared_bytes > 48 * 1024:
        with cupy.cuda.Device(device):
            kernel.max_dynamic_shared_size_bytes = shared_bytes
    return kernel


def padded(size: int, multiple: int) -> int:
    """``size`` rounded up to a whole number of ``multiple``: the kernels'
    features padded to vectors, and to what their threads share out."""
    return -(-size // multiple) * multiple


def limits_argument(limits: Any, arrays: Any) -> tuple[Any, bool]:
    """``(limits, has_limits)`` as the kernels take them: C-ordered int32,
    or where there are none an int32 array they never read (on a GPU one a
    device, made once: an allocation a call costs small calls)."""
    if limits is not None:
        return arrays.ascontiguousarray(limits, dtype=arrays.int32), True
    if arrays.__name__ == "cupy":
        return _no_limits(arrays.cuda.Device().id), False
    return arrays.zeros((1,), dtype=arrays.int32), False


@functools.cache
def _no_limits(device: int) -> Any:
    import cupy

    with cupy.cuda.Device(device):
        return cupy.zeros((1,), dtype=cupy.int32)
