"""Argument checks shared by every operation: one home for each rule.

Every check runs before any computation and raises the exception users
expect (``ValueError`` for shapes and values, ``TypeError`` for types),
naming the operation, the argument, what was expected and what came.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import array_api_compat

from attnx._registry import registry


def device_of(array: Any) -> Any:
    """The device an array lives on, for any array API library: its
    ``.device`` (the standard's attribute, read directly so torch.compile
    traces it without warnings), else its backend's answer
    (:meth:`attnx.Backend.device_of`: a Dask array's chunks' kind)."""
    device = getattr(array, "device", None)
    if device is not None:
        return device
    owner = registry.owner_of(array)
    return owner.device_of(array) if owner is not None else array_api_compat.device(array)


def namespace_of(array: Any) -> Any:
    """The array API namespace of ``array``: its backend's (one dict lookup,
    which torch.compile traces without warnings), else array-api-compat's."""
    owner = registry._type_owners.get(type(array))
    if owner is not None:
        return owner.xp
    # A type not met yet: its owner is found without caching it, since a mod
    # may run inside PyTorch's FlexAttention, whose traces change nothing
    # outside themselves.  The owner's namespace, not array-api-compat's: the
    # Dask backend's makes arrays of its inputs' chunks (array-api-compat's
    # refuses a device of CuPy chunks).
    owners = registry.owners_of(array)
    return owners[0].xp if owners else array_api_compat.array_namespace(array)


def common_namespace(*arrays: Any) -> Any:
    """The namespace of arrays that share one: their backend's (the Dask
    backend's makes arrays of its inputs' chunks), else array-api-compat's
    answer, which names the namespaces of arrays that mix them."""
    xp = namespace_of(arrays[0])
    if any(namespace_of(array) is not xp for array in arrays[1:]):
        return array_api_compat.array_namespace(*arrays)
    return xp


def shape_of(array: Any) -> tuple[int, ...]:
    return tuple(array.shape)


def dtype_label(dtype: Any) -> str:
    """``"float32"`` for every library's float32: ``torch.float32``,
    ``numpy.float32`` (the scalar type), ``np.dtype("float32")``,
    ``array_api_strict.float32`` or the name itself."""
    if isinstance(dtype, str):
        return dtype
    if isinstance(dtype, type):  # NumPy's scalar types: numpy.float32
        return dtype.__name__
    name = getattr(dtype, "name", None)  # NumPy dtypes
    if isinstance(name, str):
        return name
    return str(dtype).rpartition(".")[2]


#: The real floating dtypes attnx knows by name.
FLOAT_DTYPE_NAMES = ("float16", "bfloat16", "float32", "float64")

#: The dtypes attnx knows by name: the standard's, and the half precisions.
DTYPE_NAMES = frozenset(
    ("bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")
    + FLOAT_DTYPE_NAMES
    + ("complex64", "complex128")
)


def require_dtype_name(operation: str, xp: Any, backend_name: str, dtype: Any, *, floating: bool = False) -> str:
    """The name of ``dtype`` (any library's dtype object, or a name), checked
    to be a dtype of ``xp`` that it can make here (JAX has float64 only in x64
    mode), and a real floating one with ``floating=True`` (what creates
    weights or encodings: an integer table would hold rounded values); a
    TypeError naming ``dtype`` otherwise."""
    name = dtype_label(dtype)
    if name not in DTYPE_NAMES or not hasattr(xp, name):
        raise TypeError(f"{operation}: dtype {dtype!r} is not a dtype of the {backend_name!r} backend")
    if floating and name not in FLOAT_DTYPE_NAMES:
        raise TypeError(
            f"{operation}: dtype must be a real floating-point dtype ({', '.join(FLOAT_DTYPE_NAMES)}), got {name}"
        )
    offered = _offered_dtypes(xp, f"{operation}: backend {backend_name!r}: ")
    if offered is not None and name in _STANDARD_DTYPES and name not in offered:
        raise TypeError(
            f"{operation}: dtype {name} is not available on the {backend_name!r} backend here "
            f"(it offers {', '.join(sorted(offered))})"
        )
    return name


#: The dtypes of the standard, which its inspection API lists when available.
_STANDARD_DTYPES = DTYPE_NAMES - {"float16", "bfloat16"}


def _offered_dtypes(xp: Any, where: str = "") -> frozenset[str] | None:
    """Names of the dtypes ``xp`` can make now (the standard's inspection
    API), or None where the namespace has no inspection API.  Not cached: JAX
    changes its answer when x64 mode is switched."""
    info = getattr(xp, "__array_namespace_info__", None)
    if info is None:
        return None
    try:
        return frozenset(info().dtypes())
    except Exception as exc:
        # The standard gives dtypes() defaults for every argument; a library
        # that asks for one fails here inside any call that names a dtype,
        # and its bare error named neither the library nor the call.
        raise TypeError(
            f"{where}{getattr(xp, '__name__', type(xp).__name__)}.__array_namespace_info__().dtypes() "
            f"failed, which the array API standard defines with no required argument: "
            f"{type(exc).__name__}: {exc}"
        ) from exc


#: Per (namespace, device): whether float64 arrays can be made there.
_FLOAT64_ON: dict[tuple[str, str], bool] = {}


def index_dtype(xp: Any) -> Any:
    """The namespace's default integer for indices (the standard's inspection
    API): int64, or int32 where that is all it makes (JAX without x64, which
    would warn at each int64 asked for)."""
    try:
        return xp.__array_namespace_info__().default_dtypes()["indexing"]
    except (AttributeError, KeyError, TypeError):  # a namespace older than the 2023.12 standard
        return xp.int64


def widest_float(xp: Any, device: Any = None) -> Any:
    """float64 where ``xp`` can make it now (on ``device``), else float32.

    The standard's inspection API answers for the namespace (JAX's changes
    with its x64 mode); a device without float64 that it does not report
    (PyTorch's "mps", which array-api-compat's answer leaves out) is found
    by making one there, once per device."""
    offered = _offered_dtypes(xp)
    if offered is not None and "float64" not in offered:
        return xp.float32
    if device is None:
        return xp.float64
    key = (getattr(xp, "__name__", str(xp)), str(device))
    if key not in _FLOAT64_ON:
        try:
            xp.zeros((), dtype=xp.float64, device=device)
            _FLOAT64_ON[key] = True
        except (TypeError, ValueError, RuntimeError, NotImplementedError):
            _FLOAT64_ON[key] = False
    return xp.float64 if _FLOAT64_ON[key] else xp.float32


def dtype_name(array: Any) -> str:
    """The :func:`dtype_label` of an array's dtype."""
    return dtype_label(array.dtype)


def require_ndim(operation: str, name: str, array: Any, min_ndim: int, layout: str) -> None:
    if array.ndim < min_ndim:
        raise ValueError(
            f"{operation}: {name} must have shape {layout} (at least {min_ndim} dimensions), "
            f"got shape {shape_of(array)}"
        )


#: dtype type -> {dtype: kind}: one table per library.
_KINDS: dict[type, dict[Any, str]] = {}


def _kind(xp: Any, dtype: Any) -> str:
    # Cached in plain dicts (torch.compile traces through them; an lru_cache
    # it warns about), one per dtype type: dtypes of two libraries are never
    # compared with each other (array-api-strict warns), and a traced lookup
    # hashes only its own library's dtypes (PyTorch 2.11's compiler can't
    # hash NumPy's, which a process that also ran NumPy would hold).
    kinds = _KINDS.get(type(dtype))
    if kinds is None:
        kinds = _KINDS[type(dtype)] = {}
    kind = kinds.get(dtype)
    if kind is None:
        kind = kinds[dtype] = _classify(xp, dtype)
    return kind


def _classify(xp: Any, dtype: Any) -> str:
    if xp.isdtype(dtype, "real floating"):
        return "float"
    if xp.isdtype(dtype, "bool"):
        return "bool"
    if xp.isdtype(dtype, "integral"):
        return "int"
    if "bfloat16" in str(dtype):  # not in the standard, but a real float
        return "float"
    return "other"


def is_float_dtype(xp: Any, dtype: Any) -> bool:
    """Fast, cached: whether ``dtype`` is a real floating dtype."""
    return _kind(xp, dtype) == "float"


def dtype_kind(xp: Any, array: Any) -> str:
    """``"float"``, ``"int"``, ``"bool"`` or ``"other"`` (cached per dtype)."""
    return _kind(xp, array.dtype)


def require_float(operation: str, xp: Any, name: str, array: Any) -> None:
    if _kind(xp, array.dtype) != "float":
        raise TypeError(f"{operation}: {name} must have a real floating-point dtype, got {dtype_name(array)}")


def require_same_dtype(operation: str, names: tuple[str, ...], arrays: tuple[Any, ...]) -> None:
    first = arrays[0].dtype
    for name, array in zip(names[1:], arrays[1:]):
        if array.dtype != first:
            raise TypeError(
                f"{operation}: {name} has dtype {dtype_name(array)} but {names[0]} has {dtype_name(arrays[0])}; "
                f"cast them to one dtype"
            )


def is_unknown(size: Any) -> bool:
    """Whether an array's size along an axis is unknown until it is computed:
    ``None`` (the standard's spelling) or NaN (Dask's, after a boolean
    selection)."""
    return size is None or (isinstance(size, float) and size != size)


def known(*sizes: Any) -> bool:
    """Whether every size is known (see :func:`is_unknown`).  Checks compare
    sizes only when they are: an unknown size agrees with anything."""
    return not any(is_unknown(size) for size in sizes)


def require_known(operation: str, needed_by: str, named: dict[str, Any], axes: tuple[int, ...] | None = None) -> None:
    """A ValueError naming the first array of ``named`` with an unknown size
    (see :func:`is_unknown`) along ``axes`` (all by default), the axis, and
    what needs it."""
    for name, array in named.items():
        if array is None:
            continue
        shape = array.shape
        if None not in shape and float not in map(type, shape):  # every size known (an unknown one is None or NaN)
            continue
        for axis in range(array.ndim) if axes is None else axes:
            if is_unknown(array.shape[axis]):
                raise ValueError(
                    f"{operation}: {name} has an unknown size along axis {axis % array.ndim} (shape {shape_of(array)}), "
                    f"which {needed_by} needs; compute the sizes first (Dask: {name}.compute_chunk_sizes())"
                )


def broadcast(operation: str, named_shapes: dict[str, tuple[int, ...]], what: str = "shapes") -> tuple[int, ...]:
    """Broadcast shapes, or a ValueError naming the arguments that clash
    (``what`` says which part of their shapes these are).  An unknown size
    (:func:`is_unknown`) broadcasts against 1 and another unknown size (it
    stays unknown), not against a known one: no library can line up the
    blocks of the two (Dask's chunks) before both are computed."""
    shapes = list(named_shapes.values())
    first = shapes[0]
    if all(shape == first for shape in shapes):
        return tuple(first)
    ndim = max([len(shape) for shape in shapes] + [0])  # no max(default=): torch.compile can't trace it
    result = [1] * ndim
    for shape in shapes:
        for axis, size in enumerate(shape, start=ndim - len(shape)):
            if size == 1:
                continue
            if result[axis] != 1 and known(size) != known(result[axis]):
                described = ", ".join(f"{name} {tuple(s)}" for name, s in named_shapes.items())
                raise ValueError(
                    f"{operation}: {what} can't be broadcast while a size is unknown: {described}; "
                    f"compute the sizes first (Dask: array.compute_chunk_sizes())"
                )
            if known(size, result[axis]) and result[axis] not in (1, size):
                described = ", ".join(f"{name} {tuple(s)}" for name, s in named_shapes.items())
                raise ValueError(f"{operation}: {what} do not broadcast: {described}")
            result[axis] = size
    return tuple(result)


def broadcasts_to(operation: str, name: str, shape: tuple[int, ...], target: tuple[int, ...]) -> bool:
    """Whether ``shape`` broadcasts to ``target`` without growing it: the
    rule of a mask or a bias against its scores, of a mod's result against
    its tile."""
    try:
        return broadcast(operation, {name: shape, "target": target}) == tuple(target)
    except ValueError:
        return False


QKV = ("query", "key", "value")
#: What :func:`broadcast` compares in attention: the shapes before ``(n, d)``.
LEADING = "leading shapes (...)"


def leading_shape(
    query: Any, key: Any, value: Any, operation: str = "", names: tuple[str, str, str] = QKV
) -> tuple[int, ...]:
    """The broadcast leading shape ``(...)`` of ``query (..., n, d)``,
    ``key (..., m, d)`` and ``value (..., m, d_v)``, or a ValueError naming
    them (as ``names`` says the caller's arguments are called)."""
    return broadcast(operation, dict(zip(names, (query.shape[:-2], key.shape[:-2], value.shape[:-2]))), LEADING)


def require_query_key_value(
    operation: str,
    xp: Any,
    query: Any,
    key: Any,
    value: Any,
    layouts: tuple[str, str, str],
    names: tuple[str, str, str] = QKV,
) -> None:
    """Each of query, key, value (called ``names`` by the caller) a real
    floating array with at least two dimensions (``layouts`` say which), and
    as many values as keys."""
    for name, array, layout in zip(names, (query, key, value), layouts):
        require_ndim(operation, name, array, 2, layout)
        require_float(operation, xp, name, array)
    if key.shape[-2] != value.shape[-2]:
        raise ValueError(
            f"{operation}: {names[2]} must have m = {key.shape[-2]} positions (from {names[1]}), got shape {shape_of(value)}"
        )


def call_users_function(
    operation: str, name: str, chosen: Any, function: Any, arguments: tuple[Any, ...], on: str
) -> Any:
    """``function(*arguments)``: the user's code (a kernel, a mod), whose
    failure, or a result that isn't an array of the ``chosen`` backend, is
    an error naming ``name`` and what it was called ``on``."""
    try:
        result = function(*arguments)
    except Exception as error:  # the user's code: any failure is the function's
        raise TypeError(
            f"{operation}: {name} failed on {on} of the {chosen.name!r} backend: {type(error).__name__}: {error}"
        ) from error
    if not hasattr(result, "shape") or not hasattr(result, "dtype") or not chosen.owns(result):
        raise TypeError(
            f"{operation}: {name} must return an array of the {chosen.name!r} backend, "
            f"got {type(result).__module__}.{type(result).__name__}"
        )
    return result


def require_flag(operation: str, name: str, value: Any) -> bool:
    """``value`` if it is a bool; a TypeError naming the flag otherwise
    (``"no"`` is truthy: accepting it would silently do the opposite)."""
    if not isinstance(value, bool):
        raise TypeError(f"{operation}: {name} must be True or False, got {value!r} ({type(value).__name__})")
    return value


def require_scale(operation: str, xp: Any, scale: Any, d_k: int, dtype: Any) -> Any:
    """The scale: a finite Python float (``1 / sqrt(d_k)`` when None), or a
    0-d real array of the inputs' backend (traced or not, so gradients reach
    it) cast to the dtype the scores are computed in for inputs of ``dtype``.

    A Python float keeps NumPy 2 from promoting float32 inputs (NEP 50), and
    so does the cast of an array.  An array's finiteness is checked only when
    its value can be read (:func:`values_known`).
    """
    if scale is None:
        return 1.0 / math.sqrt(d_k) if d_k else 1.0
    if isinstance(scale, bool) or not (isinstance(scale, numbers.Real) or getattr(scale, "ndim", None) == 0):
        raise TypeError(f"{operation}: scale must be a real number or None, got {scale!r} ({type(scale).__name__})")
    if isinstance(scale, numbers.Real):
        value = float(scale)
        if not math.isfinite(value):
            raise ValueError(f"{operation}: scale must be finite, got {value}")
        # Past float32's range it would become inf in the scores' dtype (the
        # one comparison keeps small calls' checks short).
        if abs(value) > FLOAT32_MAX:
            require_finite_in(operation, "scale", xp, value, accumulation_dtype(xp, dtype))
        return value
    if _kind(xp, scale.dtype) not in ("float", "int"):
        raise TypeError(
            f"{operation}: scale must be a real number or None, got a 0-d array of dtype {dtype_name(scale)}"
        )
    if values_known(scale) and not bool(xp.isfinite(scale)):
        raise ValueError(f"{operation}: scale must be finite, got {scale!r}")
    compute = accumulation_dtype(xp, dtype)
    if scale.dtype == compute:
        return scale
    if values_known(scale) and _kind(xp, scale.dtype) == "float":  # a float64 scale for float32 scores
        require_finite_in(operation, "scale", xp, float(scale), compute)
    return xp.astype(scale, compute)


#: float32's range: numbers within it need no look at the computation's dtype.
FLOAT32_MAX = 3.4028234663852886e38
FLOAT32_SMALLEST_NORMAL = 1.1754943508222875e-38


def require_finite_in(
    operation: str, name: str, xp: Any, value: float, compute: Any, *, positive: bool = False
) -> None:
    """A ValueError naming ``name`` when the Python number ``value`` becomes
    inf in ``compute``, the dtype it is computed in (or, ``positive``, when
    it falls below its smallest normal number, on the way to 0)."""
    info = xp.finfo(compute)
    largest, smallest = float(info.max), float(info.smallest_normal)
    if abs(value) > largest or (positive and value < smallest):
        limits = f"between {smallest:.7g} and {largest:.7g}" if positive else f"at most {largest:.7g} in magnitude"
        raise ValueError(
            f"{operation}: {name} must be finite{' and normal' if positive else ''} in {dtype_label(compute)}, "
            f"the dtype it is computed in ({limits}), got {value!r}"
        )


def scale_array(scale: Any) -> Any:
    """``scale`` if it is an array (for the backend and device checks of the
    inputs), else None."""
    if scale is None or isinstance(scale, (float, int, numbers.Real)) or getattr(scale, "ndim", None) is None:
        return None
    return scale


def values_known(array: Any) -> bool:
    """Whether ``array``'s values can be read now: not while it is traced
    (``jax.jit``, ``torch.compile``, vectorizing maps) nor when it is lazy
    (Dask), as its backend's :meth:`~attnx.Backend.is_concrete` says.  Checks
    that need values run only then."""
    return registry.is_concrete(array)


def traced(array: Any) -> bool:
    """Whether ``array`` is being traced into a program (``jax.jit``,
    ``torch.compile``, vectorizing maps): its values unknown, and its
    library not a lazy one (Dask's arrays are graphs of tasks, each a
    dispatch of its own; a lazy backend declares :meth:`~attnx.Backend.computations`)."""
    owner = registry.owner_of(array)
    return owner is not None and not owner.is_concrete(array) and owner.computations() is None


#: Sizes beyond this cannot index an array (NumPy's and PyTorch's int64 limit).
MAX_SIZE = 2**63 - 1


def require_size(operation: str, names: str, *sizes: int) -> None:
    """A ValueError naming ``names`` when the array they describe would have
    more elements than any array can (their product over int64)."""
    total = 1
    for size in sizes:
        total *= size
    if total > MAX_SIZE:
        raise ValueError(
            f"{operation}: {names} = {' x '.join(map(str, sizes))} would need more than 2**63 - 1 elements"
        )


def require_int(operation: str, name: str, value: Any) -> int:
    """``value`` as an int (anything with ``__index__`` but a bool); a
    TypeError naming ``name`` otherwise."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise TypeError(f"{operation}: {name} must be an integer, got {value!r} ({type(value).__name__})")
    return int(value.__index__())


def require_positive_real(operation: str, name: str, value: Any) -> float:
    """``value`` as a float: a real number (NumPy's scalars too, not a bool;
    a TypeError otherwise), finite and positive (a ValueError otherwise)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{operation}: {name} must be a real number, got {value!r} ({type(value).__name__})")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{operation}: {name} must be a positive finite number, got {value!r}")
    return float(value)


def require_positive_int(operation: str, name: str, value: Any, *, allow_zero: bool = False) -> int:
    value = require_int(operation, name, value)
    if value < 0 or (value == 0 and not allow_zero):
        expected = "a non-negative" if allow_zero else "a positive"
        raise ValueError(f"{operation}: {name} must be {expected} integer, got {value}")
    require_size(operation, name, value)
    return value


def accumulation_dtype(xp: Any, dtype: Any) -> Any:
    """float32 for half-precision inputs, the input dtype otherwise."""
    if dtype == xp.float32 or dtype == xp.float64:
        return dtype
    return xp.float32


def in_accumulation_dtype(xp: Any, *arrays: Any) -> tuple[Any, list[Any]]:
    """The :func:`accumulation_dtype` of the first array's dtype, and the
    arrays in it (cast only where it differs: half precision)."""
    compute = accumulation_dtype(xp, arrays[0].dtype)
    if compute == arrays[0].dtype:
        return compute, list(arrays)
    return compute, [xp.astype(array, compute) for array in arrays]
