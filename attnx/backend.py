"""The interface a backend implements.

A backend tells attnx how to reach one array library: its array API
namespace, whether it can run here, which devices it has, how to move data
to and from NumPy, and how to wait for queued device work.  It may also
offer native implementations that replace attnx's generic algorithm for some
operations.  See the "Writing a backend" page of the docs (docs/extending/backend.md).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from types import ModuleType
from typing import Any

from attnx._tracing import run_at_trace_time

__all__ = ["GPU_BLOCK_BYTES", "Backend", "device_label"]

#: Bytes of scores in one block of the chunked algorithms on a GPU.  Each
#: block costs some 40 kernel launches, about 1 ms of Python and the array
#: library whatever its size: with a CPU's 4 MiB blocks an H100 waited on
#: them (CuPy: 200 ms for a (1, 8, 8192, 64) call that takes 10 ms in one
#: block).  From 512 MiB the calls measured were within 4% of 1 GiB blocks
#: (docs/archive/bench-sessions.md, "GPU").
GPU_BLOCK_BYTES = 512 * 2**20


def device_label(device: Any) -> str:
    """A device's name as ``attnx backends`` lists it: ``"cuda:0"``, and
    ``"device1"`` for ``Device('device1')``-like reprs."""
    text = str(device)
    if text.endswith("')") and "('" in text:
        return text.partition("('")[2][:-2]
    return text


def device_kind(label: str) -> str:
    """The kind of device a label names: ``"cuda"`` for ``"cuda:0"``."""
    return label.partition(":")[0]


class Backend:
    """Base class for attnx backends.

    Subclasses set :attr:`name` and :attr:`array_module` and implement
    :meth:`namespace`, :meth:`asarray` and :meth:`to_numpy`; the other methods
    have working defaults.

    Attributes
    ----------
    name : str
        The name users pass as ``backend=``.
    array_module : str
        Top-level module of the array library (``"torch"``).  The default
        :meth:`owns` compares it with the module of an array's type, which
        needs no import of the library.
    float_dtypes : tuple of str
        Floating dtypes the backend supports; the conformance suite tests each.
    supports_autograd : bool
        Whether gradients flow through attnx operations (the conformance suite
        then checks them).
    """

    name: str = ""
    array_module: str = ""
    float_dtypes: tuple[str, ...] = ("float32", "float64")
    supports_autograd: bool = False
    #: How many blocks :meth:`map_blocks` runs at once: the chunked algorithms
    #: divide their block size by it, so memory stays within the budget.
    concurrent_blocks: int = 1
    #: Bytes of scores one block of the chunked algorithms holds at most, and
    #: the memory budget for scores where the user set none
    #: (:func:`attnx.set_memory_budget`).  4 MiB keeps a CPU's blocks in its
    #: cache; a GPU backend sets more, since every block costs it some dozens
    #: of kernel launches whatever its size (CuPy: :data:`GPU_BLOCK_BYTES`).
    #: A backend whose arrays live on devices of both kinds says so per
    #: device in :meth:`block_bytes_on`.
    block_bytes: int = 4 * 2**20

    _xp: ModuleType | None = None

    # -- availability -----------------------------------------------------
    def unavailable_reason(self) -> str | None:
        """Why the backend cannot run here, or None when it can.

        Called once and cached; keep it cheap (``importlib.util.find_spec``
        rather than an import where possible).
        """
        return None

    def version(self) -> str | None:
        """Version of the array library, or None when unavailable."""
        return None

    def devices(self) -> list[Any]:
        """Devices arrays can live on, default first."""
        return ["cpu"]

    def device(self, device: Any) -> Any:
        """``device`` in the library's own terms, for the functions that create
        arrays from nothing (``device=`` of :func:`attnx.asarray`, masks,
        positions, parameters).

        A name that :meth:`devices` lists (by :func:`device_label`, so
        ``"device1"`` for ``Device('device1')``) becomes that device object,
        and so does a kind of device (``"cpu"`` for JAX's ``"cpu:0"``): the
        first of that kind, as ``jax.devices("cpu")[0]``. Anything else
        (``None``, the library's own device objects, names the library reads
        itself, such as PyTorch's ``"cuda"``) passes unchanged.
        """
        if isinstance(device, str):
            objects = [candidate for candidate in self.devices() if not isinstance(candidate, str)]
            for candidate in objects:
                if device_label(candidate) == device:
                    return candidate
            for candidate in objects:
                if device_kind(device_label(candidate)) == device:
                    return candidate
        return device

    def block_bytes_on(self, device: Any) -> int:
        """Bytes of scores one block holds for arrays on ``device`` (an
        array's own device, as :func:`array_api_compat.device` gives it, or
        None for the default): :attr:`block_bytes` unless overridden.  The
        PyTorch backend gives CUDA tensors :data:`GPU_BLOCK_BYTES`, and the
        JAX backend its arrays on GPU devices (not its tracers, which have
        no device under jit)."""
        return self.block_bytes

    # -- arrays -----------------------------------------------------------
    def namespace(self) -> ModuleType:
        """The array API namespace (usually from ``array_api_compat``):
        every algorithm, and :mod:`attnx.blocks` given this backend's
        arrays, computes through it, also before any call has dispatched to
        this backend (the Dask backend's makes arrays of its inputs' chunks,
        which array-api-compat's Dask namespace does not)."""
        raise NotImplementedError

    @property
    def xp(self) -> ModuleType:
        """The array API namespace, imported on first use."""
        xp = self._xp
        if xp is None:
            xp = self._xp = self.namespace()
        return xp

    def owns(self, array: Any) -> bool:
        """Whether ``array`` belongs to this backend.

        Called once per array type (attnx caches the answer), so it must not
        depend on the array's values.
        """
        return top_module(type(array)) == self.array_module

    def device_of(self, array: Any) -> Any:
        """The device of one of this backend's arrays that has no ``.device``
        attribute, as the namespace's creation functions take it in
        ``device=`` (attnx makes every array with the device of the arrays
        it goes with): array-api-compat's answer by default.  The Dask
        backend answers the kind of the array's chunks, so that the arrays
        attnx makes hold CuPy chunks where the inputs do."""
        from array_api_compat import device

        return device(array)

    def asarray(self, obj: Any, *, dtype: Any = None, device: Any = None) -> Any:
        """Convert ``obj`` (a NumPy array, a nested sequence, a scalar) to this
        backend's array type, with ``dtype`` given by name or as a dtype."""
        raise NotImplementedError

    def to_numpy(self, array: Any) -> Any:
        """Copy ``array`` to a NumPy array on the host."""
        raise NotImplementedError

    def is_concrete(self, array: Any) -> bool:
        """Whether ``array``'s values can be read now, cheaply.

        False for arrays being traced (``jax.jit``, ``torch.compile``,
        vectorizing maps) and for lazy ones (Dask): attnx then skips the checks
        that need values (``key_lengths`` within ``[0, m]``, a finite
        ``scale``, a real mask free of ``+inf`` and NaN), since reading them
        would fail, break the trace or compute the graph.  The default asks :func:`array_api_compat.is_lazy_array`.
        """
        from array_api_compat import is_lazy_array

        return not is_lazy_array(array)

    def synchronize(self, device: Any = None) -> None:
        """Wait for queued work on ``device`` (for timing); no-op on the CPU."""

    def map_blocks(self, function: Callable[[Any], Any], items: Iterable[Any]) -> list[Any]:
        """``[function(item) for item in items]``, possibly run concurrently.

        The chunked algorithms hand their independent blocks (a group of
        (batch, head) slices and a range of queries each) to this method.  The default runs them one after another; a
        CPU backend whose library releases the GIL may run them on threads (the
        NumPy backend does).  Results come back in the order of ``items``.
        """
        return [function(item) for item in items]

    def map_chunks(self, function: Callable[[Any], Any], array: Any, size: int) -> Any:
        """``function`` of ``array`` in chunks of ``size`` along axis -2,
        the results joined along axis -2.

        ``function`` maps a chunk of shape ``(..., c, d)`` to an array of
        shape ``(..., c, e)``, for any ``c``.  The default calls it on each
        chunk in turn (the last may be shorter) and joins the results with
        ``concat``.  A library with a traced loop overrides it (JAX:
        ``lax.map`` under ``jax.jit``), so that a traced program holds one
        chunk's operations rather than each chunk's: additive attention
        and Nadaraya-Watson hand their chunks of queries to it.
        """
        n = array.shape[-2]
        chunks = [function(array[..., start : min(start + size, n), :]) for start in range(0, max(n, 1), size)]
        return chunks[0] if len(chunks) == 1 else self.xp.concat(chunks, axis=-2)

    def custom_vjp(
        self,
        forward: Callable[..., tuple[Any, tuple[Any, ...]]],
        backward: Callable[[tuple[Any, ...], Any, tuple[Any, ...], Any], tuple[Any, ...]],
        arrays: tuple[Any, ...],
    ) -> Any:
        """``forward(*arrays)``'s output, differentiated by ``backward``
        where the library has autograd (``jax.custom_vjp``,
        ``torch.autograd.Function``).

        ``forward(*arrays)`` returns ``(output, residuals)``, a tuple of
        arrays the backward needs beyond the inputs and the output (the
        tiled attention's row statistics); ``backward(arrays, output,
        residuals, cotangent)`` returns one cotangent per array, None for
        one that has none (integers, booleans).  attnx's tiled algorithms
        hand themselves to it, so that autograd keeps their inputs, output
        and residuals instead of every tile's intermediates.  The default,
        for libraries without autograd, returns ``forward(*arrays)[0]``.
        """
        return forward(*arrays)[0]

    def gradients(self, function: Callable[..., Any], arrays: list[Any]) -> list[Any]:
        """Gradients of ``sum(function(*arrays))`` with respect to each array.

        Only for backends with :attr:`supports_autograd`; the conformance
        suite uses it to check gradients against finite differences.
        """
        raise NotImplementedError(f"backend {self.name!r} does not support autograd")

    # -- transforms (for the conformance suite) ------------------------------
    def trace(self, function: Callable[..., Any]) -> Callable[..., Any] | None:
        """``function`` compiled by the library's tracer (``jax.jit``,
        ``torch.compile``), or None where the library has none.

        The conformance suite checks that every operation, traced with its
        array arguments (masks, ``key_lengths``, a 0-d ``scale``) as traced
        inputs, equals the eager call.
        """
        return None

    def vectorize(self, function: Callable[..., Any]) -> Callable[..., Any] | None:
        """``function`` mapped over the first axis of every argument
        (``jax.vmap``, ``torch.func.vmap``), or None where the library has no
        such map.  The conformance suite checks it equals the eager call on
        the whole batch."""
        return None

    def test_chunkings(self) -> Mapping[str, Callable[[Any], Any]]:
        """For chunked libraries: ways to cut an array into chunks, by name,
        for the conformance suite (empty for the others, the default).

        Each callable takes an array of this backend and returns the same
        values cut another way.  The suite runs each reference test with its
        inputs cut by one of them, taking turns over the tests (or all by the
        one ``attnx conformance NAME --chunking CHUNKING`` names), so that a
        wrong path for several chunks fails a reference test, not only a
        laziness check.  Give several chunks per axis, and uneven ones."""
        return {}

    def computations(self) -> AbstractContextManager[list[Any]] | None:
        """For lazy libraries: a context manager that yields a list and adds
        an entry to it for each computation the library starts inside it;
        None for eager libraries (the default).  The conformance suite checks
        that attnx builds lazy results without computing anything."""
        return None

    # -- native implementations ---------------------------------------------
    def implementations(self) -> Mapping[str, Callable[..., Any]]:
        """Native implementations that replace the generic algorithms.

        Maps an operation name (``"scaled_dot_product_attention"``) to a
        callable.  attnx calls it after validating the inputs, with the same
        keyword arguments as the generic algorithm (see each operation's
        "Native implementations" note).  It returns the result, or
        ``NotImplemented`` to decline that call, in which case the generic
        algorithm runs.  A native implementation must compute the same
        function as the generic one; the conformance suite checks that.
        """
        return {}

    def specialize(self, operation: str, arguments: Mapping[str, Any]) -> Callable[..., Any] | None:
        """A plan: this backend's computation of one call, for attnx to reuse.

        attnx asks after validating a call whose signature allows a plan
        (``scaled_dot_product_attention`` without ``mask`` or
        ``key_lengths``, with a float or default ``scale``), with the
        keyword arguments its native implementation would get.  The plan is
        a function of the call's arrays alone, positionally (``query, key,
        value``).  attnx calls it for this call and for every later call
        whose arrays have the same types, shapes, dtypes and devices and
        whose other arguments are equal, without validating again: it must
        compute what the native would for any such arrays, and bake in no
        state of attnx (the memory budget), since it is not asked again
        when that changes: a plan that depends on it reads it at each call.
        None (the default) declines: such calls are
        validated and dispatched each time.  Worth it where the checks cost
        a noticeable part of the work (small inputs on a fused kernel, calls
        of a few hundred microseconds).
        """
        return None

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"


@run_at_trace_time
def top_module(kind: type) -> str:
    """The top-level package that defines the type ``kind`` (``"torch"``
    for ``torch.nn.Parameter``): called, not traced, by ``torch.compile``,
    whose Dynamo cannot read a ``Parameter`` class's ``__module__``."""
    return kind.__module__.partition(".")[0]
