"""The Dask backend: lazy, chunked ``dask.array`` arrays, computed on the
threads of one process or on a ``dask.distributed`` cluster.

attnx's operations on Dask arrays return Dask arrays and compute nothing
until the user asks (``.compute()``, ``attnx.to_numpy``); the checks that
need values (``key_lengths`` within ``[0, m]``, a finite ``scale``) are
skipped for them, as for traced arrays.  The chunks may hold NumPy arrays,
or CuPy arrays on GPU workers: the tasks use the namespace of their chunks.

The natives follow the chunks (:mod:`attnx_backends.dask_attention`): batch,
head and query chunks are independent tasks, and chunks of the keys are
reduced with the online-softmax combine (:mod:`attnx.blocks`) in a tree, so
no task ever holds all the keys.  The number of tasks grows with the number
of chunks, never with the number of rows.

:func:`attnx.asarray` makes Dask arrays with ``chunks="auto"``, or with
``$ATTNX_DASK_CHUNKS`` elements per chunk along every axis (an integer:
the conformance suite runs with 1 and 2 to split every axis).
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from attnx import Backend, hookimpl

CHUNKS_ENV = "ATTNX_DASK_CHUNKS"


class DaskBackend(Backend):
    name = "dask"
    array_module = "dask"
    float_dtypes = ("float32", "float64")  # its array API namespace has no float16

    _natives: Mapping[str, Callable[..., Any]] | None = None

    def unavailable_reason(self) -> str | None:
        if importlib.util.find_spec("dask") is None or importlib.util.find_spec("dask.array") is None:
            return "dask is not installed (pip install '.[dask]' in attnx's clone)"
        return None

    def version(self) -> str:
        from importlib.metadata import version

        return version("dask")

    def namespace(self) -> Any:
        # array-api-compat's, with creations that follow the chunks' kind
        from attnx_backends import dask_namespace

        return dask_namespace

    @property
    def chunks(self) -> int | str:
        """How :meth:`asarray` chunks new arrays: ``$ATTNX_DASK_CHUNKS``
        elements along every axis, else ``"auto"`` (Dask's default)."""
        value = os.environ.get(CHUNKS_ENV, "").strip()
        if not value or value == "auto":
            return "auto"
        if not value.isdigit() or int(value) < 1:
            raise ValueError(f"${CHUNKS_ENV} must be 'auto' or a positive integer, got {value!r}")
        return int(value)

    def devices(self) -> list[Any]:
        # The kinds of chunks its arrays hold: NumPy's, and CuPy's where a
        # GPU is there (listed as "cupy"; see dask_namespace).
        kinds: list[Any] = ["cpu"]
        if importlib.util.find_spec("cupy") is not None:
            try:
                import cupy

                if cupy.cuda.runtime.getDeviceCount() > 0:
                    kinds.append(self.xp.Chunks(cupy.empty(0)))
            except Exception:  # CUDARuntimeError without a driver: NumPy's chunks alone
                pass
        return kinds

    def device_of(self, array: Any) -> Any:
        return self.xp.device(array)  # the kind of its chunks: "cpu", or CuPy's

    def asarray(self, obj: Any, *, dtype: Any = None, device: Any = None) -> Any:
        import dask.array as da
        import numpy

        chunks = self.chunks
        if isinstance(device, self.xp.Chunks):  # chunks of another library: CuPy's
            from array_api_compat import array_namespace

            to_kind = array_namespace(device.meta).asarray
            if isinstance(obj, da.Array):  # moved chunk by chunk, lazily
                obj = obj if dtype is None else obj.astype(dtype)
                meta = da.utils.meta_from_array(device.meta, ndim=obj.ndim, dtype=obj.dtype)
                return obj.map_blocks(to_kind, dtype=obj.dtype, meta=meta)
            data = to_kind(obj, dtype=dtype)
            return da.from_array(data, chunks=chunks if data.ndim else (), asarray=False)
        if device not in (None, "cpu"):
            labels = ", ".join(str(kind) for kind in self.devices())
            raise ValueError(f"the dask backend makes arrays of {labels} chunks, got device={device!r}")
        if isinstance(obj, da.Array):
            return obj if dtype is None else obj.astype(dtype)
        data = numpy.asarray(obj, dtype=dtype)
        return da.from_array(data, chunks=chunks if data.ndim else ())

    def to_numpy(self, array: Any) -> Any:
        import numpy
        from array_api_compat import to_device

        computed = array.compute() if hasattr(array, "compute") else array
        return numpy.asarray(to_device(computed, "cpu"))  # CuPy chunks come to the host

    def computations(self) -> contextlib.AbstractContextManager[list[Any]]:
        return _computations()

    def test_chunkings(self) -> Mapping[str, Callable[[Any], Any]]:
        return {
            "chunks of 2": lambda array: array.rechunk(2),
            # a chunk of 1, then of 2: chunks that differ, along every axis
            "uneven": lambda array: array.rechunk(tuple(_uneven(size) for size in array.shape)),
        }

    def implementations(self) -> Mapping[str, Callable[..., Any]]:
        if self._natives is None:
            from . import dask_attention

            self._natives = {
                "scaled_dot_product_attention": dask_attention.scaled_dot_product_attention,
                "vjp(scaled_dot_product_attention)": dask_attention.scaled_dot_product_attention_vjp,
                "nadaraya_watson": dask_attention.nadaraya_watson,
                "causal_conv1d": dask_attention.causal_conv1d,
            }
        return self._natives


@contextlib.contextmanager
def _computations() -> Iterator[list[Any]]:
    """Each graph that Dask's local schedulers start computing inside the
    block, as an entry of the yielded list."""
    from dask.callbacks import Callback

    started: list[Any] = []
    with Callback(start=lambda graph: started.append(len(graph))):
        yield started


@hookimpl
def attnx_backends() -> list[Backend]:
    return [DaskBackend()]


def _uneven(size: int) -> tuple[int, ...]:
    """Chunks of 1, then 2, 2, ... and the rest, covering ``size``."""
    if size <= 1:
        return (size,)
    chunks = [1]
    while sum(chunks) < size:
        chunks.append(min(2, size - sum(chunks)))
    return tuple(chunks)
