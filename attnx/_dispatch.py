"""Choosing the backend for a call, and running native or generic code.

Selection order, as in NetworkX: an explicit ``backend=`` (strict: it must
own the inputs), else the backend that owns the input arrays, else the
current backend (:func:`attnx.use_backend`, :func:`attnx.set_backend`,
``$ATTNX_BACKEND``, ``"numpy"``).  Each decision is one DEBUG line on the
``attnx`` logger.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from attnx._config import chosen_backend_name, current_backend
from attnx._registry import registry
from attnx._tracing import run_at_trace_time
from attnx.backend import Backend, device_kind, device_label

logger = logging.getLogger("attnx")

_NOT_ARRAYS = (int, float, complex, bool, str)


def _type_name(array: Any) -> str:
    kind = type(array)
    return f"{kind.__module__}.{kind.__qualname__}"


def resolve(
    operation: str,
    backend: str | None,
    names: Sequence[str],
    arrays: Sequence[Any],
    required: int = 0,
) -> tuple[Backend, str]:
    """The backend that runs ``operation`` on ``arrays``, and why.

    ``names`` are the argument names, used in error messages only.  Every
    argument must be an array of a registered backend, or ``None`` where
    optional: the first ``required`` may not be ``None``.
    """
    owner = owner_name = owner_array = None
    known_types = registry._type_owners  # the hot path: one dict lookup per array
    for index, (name, array) in enumerate(zip(names, arrays)):
        if array is None:
            if index < required:
                raise TypeError(f"{operation}: {name} must be an array, got None")
            continue
        kind = type(array)
        found = known_types.get(kind)
        if found is None:
            found = registry.owner_of(array) if not isinstance(array, _NOT_ARRAYS) else None
        if found is None:
            if backend is not None and registry.get(backend).owns(array):
                continue
            known = ", ".join(registry.names())
            raise TypeError(
                f"{operation}: {name} must be an array of a registered backend ({known}), "
                f"got {_type_name(array)}; convert it with attnx.asarray({name}, backend=...)"
            )
        if owner is None:
            owner, owner_name, owner_array = found, name, array
        elif found is owner:
            if kind in registry._multi_device_types:
                _require_same_device(operation, owner, owner_name, owner_array, name, array)
        else:
            raise TypeError(
                f"{operation}: inputs come from two backends: {owner_name} is a {owner.name!r} "
                f"array but {name} is a {found.name!r} array; convert one with "
                f"attnx.asarray(x, backend=..., device=...)"
            )
    if backend is not None:
        chosen = registry.get(backend)
        if owner is not None and owner is not chosen:
            for name, array in zip(names, arrays):
                if array is not None and not isinstance(array, _NOT_ARRAYS) and not chosen.owns(array):
                    raise TypeError(
                        f"{operation}: backend={backend!r} does not own {name} "
                        f"({_type_name(array)}); convert the inputs with "
                        f"attnx.asarray(x, backend={backend!r}, device=...) "
                        f"(attnx.to_numpy(x) goes back)"
                    )
        return chosen, "backend= argument"
    if owner is not None:
        # Several backends may own one array type (a NumPy-based backend owns
        # NumPy arrays too): the one the user chose wins when it owns them all.
        preferred, how = chosen_backend_name() if registry.is_shared(type(owner_array)) else (None, "")
        if preferred is not None and preferred != owner.name:
            candidate = registry.get(preferred)
            if all(array is None or isinstance(array, _NOT_ARRAYS) or candidate.owns(array) for array in arrays):
                return candidate, f"{how}, owns the inputs too"
        return owner, f"owns {owner_name}"
    return current_backend()


def resolve_creation(operation: str, backend: str | None, device: Any) -> tuple[Backend, str, Any]:
    """For operations that create arrays from nothing: the backend
    (``backend=``, else the current one), why, and ``device`` in its
    library's terms (:meth:`Backend.device`)."""
    chosen, reason = resolve(operation, backend, (), ())
    if isinstance(device, str):
        _require_listed_device(operation, chosen, reason, device)
    return chosen, reason, chosen.device(device)


def _require_listed_device(operation: str, backend: Backend, reason: str, device: str) -> None:
    """A device named by a string is one the backend lists (``"cuda:0"``), or
    the kind of one (``"cuda"``, which the library resolves itself)."""
    labels = [device_label(candidate) for candidate in backend.devices()]
    if device not in labels and device not in {device_kind(label) for label in labels}:
        raise ValueError(
            f"{operation}: device={device!r} is not a device of backend {backend.name!r} ({reason}); "
            f"its devices: {', '.join(labels)}; to make another library's arrays, pass backend="
        )


def _require_same_device(operation: str, owner: Backend, first_name: str, first: Any, name: str, array: Any) -> None:
    # ``.device`` is the standard's attribute; arrays without one have their
    # backend's word for it (a Dask array's: the kind of its chunks).  Those
    # whose device is unknown while they are traced (JAX's tracers) agree with all.
    first_device, device = _device(owner, first), _device(owner, array)
    if device != first_device and device is not None and first_device is not None:
        raise ValueError(
            f"{operation}: inputs lie on two devices: {first_name} on {first_device} but {name} on {device}; "
            f"move one with attnx.asarray(x, device=...)"
        )


def _device(owner: Backend, array: Any) -> Any:
    device = getattr(array, "device", None)
    return device if device is not None or hasattr(array, "device") else owner.device_of(array)


def call(
    operation: str,
    backend: Backend,
    reason: str,
    generic: Callable[..., Any],
    arguments: dict[str, Any],
    generic_options: dict[str, Any] | None = None,
    generic_for: str | None = None,
) -> Any:
    """Run the backend's native implementation of ``operation`` if it has one
    that accepts the call, else ``generic(xp, **arguments, **generic_options)``
    (options for the generic algorithm only, such as the backend's
    ``map_blocks``).  ``generic_for`` names what only the generic algorithm
    does (``"dropout"``: natives' kernels draw their masks their own way):
    the natives are then not asked."""
    if generic_for is not None:
        log_choice(operation, backend.name, reason, f"generic, for {generic_for}")
        return generic(backend.xp, **arguments, **(generic_options or {}))
    native = backend.implementations().get(operation)
    if native is not None:
        result = native(**arguments)
        if result is not NotImplemented:
            log_choice(operation, backend.name, reason, "native")
            return result
    log_choice(operation, backend.name, reason, "generic, native declined" if native is not None else "generic")
    if generic_options:
        return generic(backend.xp, **arguments, **generic_options)
    return generic(backend.xp, **arguments)


@run_at_trace_time  # logging can't be traced: torch.compile logs the choice once, while compiling
def log_choice(operation: str, backend_name: str, reason: str, path: str) -> None:
    if logger.isEnabledFor(logging.DEBUG):
        logger.debug("%s: backend %r (%s), %s", operation, backend_name, reason, path)
