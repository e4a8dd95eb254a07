"""The NumPy backend: CPU, always available, the default.

NumPy's elementwise operations use one core; its matrix products use all
of them through BLAS.  So :meth:`NumPyBackend.map_blocks` runs the blocks of
the chunked algorithms on threads (NumPy releases the GIL), with BLAS held to
one thread per block meanwhile: every core then works on the exponentials too.
``ATTNX_NUM_THREADS`` sets the number of threads (1 turns this off).

On a free-threaded CPython (3.13t and later, the GIL off) a thread waiting
for blocks or for their end spins a while before it sleeps, as OpenMP's
threads do: a sleeping thread's vCPU halts, and waking it costs tens of
microseconds on the VMs this was measured on (docs/archive/bench-sessions.md).  With a
GIL the waits sleep at once: a spinning thread would hold the GIL that the
working threads need between their NumPy calls.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

from attnx import Backend, hookimpl

THREADS_ENV = "ATTNX_NUM_THREADS"
#: How long a waiting thread spins before it sleeps, where there is no GIL:
#: at (1, 8, 128, 64) float32 on 2 cores, 50 us gained nothing, 300 us and
#: 1 ms 10-18% of a call's time (docs/archive/bench-sessions.md, twenty-third session).
SPIN_SECONDS = 0.0005
# CPython before 3.13 has a GIL, always on; 3.13t can turn it back on at
# run time (an extension that does not declare itself free-threading safe).
_gil_enabled = getattr(sys, "_is_gil_enabled", lambda: True)


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
        self._helpers: list[_Helper] = []
        self._helpers_pid = os.getpid()
        self._blas: Any = None
        self._blas_loaded = False
        self._lock = threading.Lock()
        # Held by the call whose blocks the helpers run: a call meanwhile,
        # from another thread or from inside a block, runs its own inline.
        self._busy = threading.Lock()
        self._natives: Mapping[str, Callable[..., Any]] | None = None

    def map_blocks(self, function: Callable[[Any], Any], items: Iterable[Any]) -> list[Any]:
        items = list(items)
        if self.concurrent_blocks < 2 or len(items) < 2:
            return [function(item) for item in items]
        helpers, blas = self._threads()
        # Without threadpoolctl BLAS threads would oversubscribe: sequential.
        if blas is None or not self._busy.acquire(blocking=False):
            return [function(item) for item in items]
        try:
            return _run_blocks(function, items, helpers[: len(items) - 1], blas)
        finally:
            self._busy.release()

    def _threads(self) -> tuple[list[_Helper], Any]:
        """The helper threads (``concurrent_blocks - 1``: the calling thread
        runs blocks too) and BLAS's thread controls."""
        with self._lock:
            if not self._blas_loaded:
                try:
                    from threadpoolctl import ThreadpoolController

                    self._blas = ThreadpoolController().select(user_api="blas")
                except ImportError:
                    self._blas = None
                self._blas_loaded = True
            if self._helpers_pid != os.getpid():  # threads don't survive a fork
                self._helpers, self._helpers_pid = [], os.getpid()
            while len(self._helpers) < self.concurrent_blocks - 1:
                self._helpers.append(_Helper(f"attnx-numpy_{len(self._helpers)}"))
            return self._helpers[: self.concurrent_blocks - 1], self._blas

    def implementations(self) -> Mapping[str, Callable[..., Any]]:
        if self._natives is None:
            from functools import partial

            from . import numpy_attention, numpy_backward

            self._natives = {
                "scaled_dot_product_attention": partial(numpy_attention.scaled_dot_product_attention, backend=self),
                "vjp(scaled_dot_product_attention)": partial(
                    numpy_backward.scaled_dot_product_attention_vjp, backend=self
                ),
            }
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


def _run_blocks(function: Callable[[Any], Any], items: list[Any], helpers: list[_Helper], blas: Any) -> list[Any]:
    """``function`` of each item, on the calling thread and ``helpers``."""
    results: list[Any] = [None] * len(items)
    # Blocks are taken by list.pop, atomic with or without the GIL: a lock
    # here costs some 8 us a call, its holder's wake-up when both threads
    # reach it at once.
    pending = list(enumerate(items))[::-1]

    def drain() -> None:
        # Each thread takes the next block until none is left: the calling
        # thread works too, so a call of two blocks on two cores hands over
        # one and none waits idle.
        try:
            while pending:
                try:
                    index, item = pending.pop()
                except IndexError:  # another thread took the last
                    return
                results[index] = function(item)
        except BaseException:
            pending.clear()  # the other threads take no more
            raise

    with _one_blas_thread(blas):
        try:
            for helper in helpers:
                helper.start(drain)
            drain()
        except BaseException:
            pending.clear()  # an interrupt between blocks: the helpers take no more
            raise
        finally:  # the helpers finish before BLAS gets its threads back, and before the next call
            errors = [error for error in (helper.join() for helper in helpers) if error is not None]
    if errors:
        raise errors[0]
    return results


class _Helper:
    """A thread that runs one function at a time for :func:`_run_blocks`,
    handed over by a pair of locks: a round trip cost some 14 us on the VMs
    where this was measured, against 31 us through a ``ThreadPoolExecutor``,
    whose futures and queue are Python code that holds the GIL while the
    calling thread needs it.  On a host slower to wake a halted vCPU the
    round trip took 75-100 us, and ``map_blocks`` of two empty blocks
    96-129 us: 15-28 us with a free-threaded CPython's spinning waits
    (docs/archive/bench-sessions.md)."""

    def __init__(self, name: str) -> None:
        self._go, self._done = threading.Lock(), threading.Lock()
        self._go.acquire()
        self._done.acquire()
        self._function: Callable[[], None] | None = None
        self._error: BaseException | None = None
        self._running = False
        threading.Thread(target=self._serve, name=name, daemon=True).start()

    def _serve(self) -> None:
        while True:
            _acquire(self._go)
            try:
                self._function()  # type: ignore[misc]
            except BaseException as error:  # handed to the caller by join
                self._error = error
            self._done.release()

    def start(self, function: Callable[[], None]) -> None:
        # No Python signal handler runs between these statements: CPython
        # runs them at function entry, loop jumps and after calls, so an
        # interrupt (KeyboardInterrupt) comes before the first, when nothing
        # is started, or after the release, when join knows to wait.
        self._function = function
        self._running = True
        self._go.release()

    def join(self) -> BaseException | None:
        """Wait for the function to return; its error, if it raised one, or
        an interrupt (KeyboardInterrupt) that came meanwhile.  The wait goes
        on through interrupts: a call that ended before its helper would
        leave ``_done`` to be released after it, and the next call's join
        would take that release for its own and return before its blocks
        were written."""
        interrupt = None
        while self._running:
            try:
                _acquire(self._done)
                self._running = False
            except BaseException as error:  # a signal's exception, raised inside the wait
                interrupt = interrupt or error
        # Dropped here: the function's closure holds the call's arrays.
        error, self._error, self._function = self._error, None, None
        return interrupt or error


def _acquire(lock: threading.Lock) -> None:
    """``lock.acquire()``, spinning first for at most SPIN_SECONDS where
    the GIL is off (see the module's docstring)."""
    if not _gil_enabled():
        deadline = time.perf_counter() + SPIN_SECONDS
        while time.perf_counter() < deadline:
            if lock.acquire(blocking=False):
                return
    lock.acquire()


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
