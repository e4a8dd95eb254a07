"""The NumPy backend: CPU, always available, the default.

NumPy's elementwise operations use one core; its matrix products use all
of them through BLAS.  So :meth:`NumPyBackend.map_blocks` runs the blocks of
the chunked algorithms on threads (NumPy releases the GIL), with BLAS held to
one thread per block meanwhile: every core then works on the exponentials too.
``ATTNX_NUM_THREADS`` sets the number of threads (1 turns this off).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import Any

from attnx import Backend, hookimpl

THREADS_ENV = "ATTNX_NUM_THREADS"


def _default_threads() -> int:
    if os.environ.get(THREADS_ENV):
        return max(1, int(os.environ[THREADS_ENV]))
    try:
        return max(1, min(8, len(os.sched_getaffinity(0))))
    except AttributeError:  # not on Linux
        return max(1, min(8, os.cpu_count() or 1))


class NumPyBackend(Backend):
    name = "numpy"
    array_module = "numpy"
    float_dtypes = ("float32", "float64", "float16")

    def __init__(self) -> None:
        self.concurrent_blocks = _default_threads()
        self._pool: Any = None
        self._blas: Any = None
        self._lock = threading.Lock()
        self._worker = threading.local()
        self._natives: Mapping[str, Callable[..., Any]] | None = None

    def map_blocks(self, function: Callable[[Any], Any], items: Iterable[Any]) -> list[Any]:
        items = list(items)
        # Sequential for one block, one thread, or a call from inside a worker
        # (waiting there on the same pool could deadlock).
        if self.concurrent_blocks < 2 or len(items) < 2 or getattr(self._worker, "active", False):
            return [function(item) for item in items]
        pool, blas = self._threads()
        if blas is None:
            return [function(item) for item in items]
        results: list[Any] = [None] * len(items)
        # Blocks are taken by list.pop, atomic with or without the GIL: a
        # lock here costs some 8 us a call, its holder's wake-up when both
        # threads reach it at once.
        pending = list(enumerate(items))[::-1]
        worker = self._worker

        def drain() -> None:
            # Each thread takes the next block until none is left: the
            # calling thread works too, so a call of two blocks on two cores
            # hands over one (some 20 us each) and none waits idle.
            worker.active = True
            try:
                while pending:
                    try:
                        index, item = pending.pop()
                    except IndexError:  # the other thread took the last
                        return
                    results[index] = function(item)
            except BaseException:
                pending.clear()  # the other threads take no more
                raise
            finally:
                worker.active = False

        with _one_blas_thread(blas):
            helpers = [pool.submit(drain) for _ in range(min(self.concurrent_blocks, len(items)) - 1)]
            try:
                drain()
            finally:  # the helpers finish before BLAS gets its threads back
                for helper in helpers:
                    # Waits without raising: concurrent.futures.wait costs
                    # some 20 us more a call, a twentieth of a small one.
                    helper.exception()
            for helper in helpers:
                helper.result()
        return results

    def _threads(self) -> tuple[Any, Any]:
        with self._lock:
            if self._pool is None:
                try:
                    from threadpoolctl import ThreadpoolController

                    self._blas = ThreadpoolController().select(user_api="blas")
                except ImportError:  # without it BLAS threads would oversubscribe: stay sequential
                    self._blas = None
                # The calling thread runs blocks too: one worker fewer.
                self._pool = ThreadPoolExecutor(self.concurrent_blocks - 1, thread_name_prefix="attnx-numpy")
        return self._pool, self._blas

    def implementations(self) -> Mapping[str, Callable[..., Any]]:
        if self._natives is None:
            from functools import partial

            from . import numpy_attention

            sdpa = partial(numpy_attention.scaled_dot_product_attention, backend=self)
            self._natives = {"scaled_dot_product_attention": sdpa}
        return self._natives

    def specialize(self, operation: str, arguments: Mapping[str, Any]) -> Callable[..., Any] | None:
        if operation == "scaled_dot_product_attention":
            from . import numpy_attention

            return numpy_attention.call_plan(self, arguments)
        return None

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


@contextmanager
def _one_blas_thread(blas: Any) -> Iterator[None]:
    """BLAS on one thread per call while blocks run on several.  The same as
    ``blas.limit(limits=1)``, at half its cost (5 us against 11 us here:
    it matters on calls of a few hundred microseconds)."""
    libraries = blas.lib_controllers
    before = [library.num_threads for library in libraries]
    for library in libraries:
        library.set_num_threads(1)
    try:
        yield
    finally:
        for library, threads in zip(libraries, before):
            library.set_num_threads(threads)


@hookimpl
def attnx_backends() -> list[Backend]:
    return [NumPyBackend()]
