"""Plans: a backend's computation for one signature of a call, reused.

attnx's checks, its choice of backend and the native's choice of kernel
depend on the arrays' types, shapes, dtypes and devices and on the other
arguments, never on values.  A backend may hand attnx a *plan* for one
such signature (:meth:`attnx.Backend.specialize`); later calls with the
same signature go straight to it, as ``jax.jit`` reuses one compilation
per shapes and dtypes.  That matters where the checks cost a noticeable
part of the arithmetic: PyTorch computes a (1, 1, 16, 16) attention in
7 us, and validating and dispatching it took 11 us more; NumPy computes a
(1, 8, 128, 64) one on two threads in about 550 us, of which they took 20.

The first call of a signature (once the registry has met the arrays'
type) is validated in full and asks for the plan,
so every error is raised as before; a call that differs in anything but
values (a dtype, a size, a flag, an array's library or device) has another
signature.  The plans live in the registry, which drops them whenever a
backend comes or goes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from attnx._dispatch import log_choice
from attnx._registry import registry
from attnx.backend import Backend

#: Array types owned by one backend, which makes plans: only calls whose
#: first array is of one of them look for a plan (a set lookup for the others).
#: Types enter when the registry first meets them; where several backends
#: own a type, the user's choice of backend decides, not the arrays.
planning_types = registry._planning_types

#: Signatures kept at most.  A workload calls few shapes; one that calls
#: more starts the store again and pays for its checks as before.
MAX_PLANS = 256


def lookup(
    operation: str, arrays: Sequence[Any], options: tuple[Any, ...]
) -> tuple[Callable[..., Any] | None, tuple[Any, ...] | None]:
    """``(plan, signature)`` of a call with ``arrays`` (its query, key and
    value) and the other arguments ``options`` (hashable, one meaning per value: ``True``, never
    ``1``), whose first array is of a type in :data:`planning_types`.  The
    plan is None where none was made for the signature yet; the signature is
    None where it can't be had (an argument that isn't an array)."""
    query, key, value = arrays  # spelled out: a loop costs a fifth of a microsecond more
    try:
        # fmt: off
        signature = (
            operation, options,
            type(query), query.shape, query.dtype,
            type(key), key.shape, key.dtype,
            type(value), value.shape, value.dtype,
        )
        # fmt: on
        if type(query) in registry._multi_device_types:  # elsewhere every array of a type lies on its one device
            signature += tuple(getattr(array, "device", None) for array in arrays)
        entry = registry._plans.get(signature)
    except (AttributeError, TypeError):  # not an array, or unhashable: the checks will say what
        return None, None
    if entry is None:
        return None, signature
    plan, backend_name, reason = entry
    log_choice(operation, backend_name, reason, "native")
    return plan, signature


def make(
    operation: str, signature: tuple[Any, ...], backend: Backend, reason: str, arguments: dict[str, Any]
) -> Callable[..., Any] | None:
    """Ask ``backend`` for a plan of this validated call (its native's
    ``arguments``) and keep it for ``signature``; None where it has none."""
    plan = backend.specialize(operation, arguments)
    if plan is None:
        return None
    plans = registry._plans
    if len(plans) >= MAX_PLANS:
        plans.clear()
    try:
        plans[signature] = (plan, backend.name, reason)
    except TypeError:  # something unhashable: this call runs the plan, the next asks again
        pass
    log_choice(operation, backend.name, reason, "native")
    return plan
