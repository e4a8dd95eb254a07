"""Every public operation, thrown wrong shapes, dtypes, ranks, types, sizes and
empty dimensions (hypothesis): it raises a ValueError or TypeError naming
the argument, or returns the right, finite answer.

Each example draws a valid call, then (most of the time) corrupts one
argument.  Whatever attnx does must be one of:

* a ``ValueError`` or ``TypeError`` whose message names the corrupted
  argument (an error in another argument it relates to names that one, so
  any of the call's argument names counts when the corruption made two
  arguments disagree);
* a result of the backend's array type with no NaN or Inf, equal to the
  float64 reference computed from the same (possibly corrupted, but valid)
  arguments.

Any other exception (IndexError, AttributeError, a library's own error) is a
failure: the user would get a message that doesn't say what they did wrong.
``ATTNX_TEST_EXAMPLES=N`` sets the examples per operation.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import attnx
from attnx_conformance import reference
from attnx_conformance.helpers import EXAMPLES, rounded
from attnx_conformance.tolerances import tolerance

pytestmark = pytest.mark.attnx_operation("bad_input")

SETTINGS = settings(
    max_examples=4 * EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

#: Sizes no array can have: their element count overflows int64.
HUGE = st.integers(2**63, 2**80)


@dataclass
class Call:
    """One call: arguments as NumPy data (``None``, scalars, arrays), the
    kinds that say how to corrupt each, and the reference for a valid one."""

    operation: Callable[..., Any]
    arguments: dict[str, Any]
    kinds: dict[str, str]
    reference: Callable[..., Any] | None = None
    #: Arguments passed as Python objects even when NumPy arrays (sizes, lists).
    plain: set[str] = field(default_factory=set)


def _array(draw, shape, dtype=np.float64, low=-3.0, high=3.0):
    seed = draw(st.integers(0, 2**32 - 1))
    data = np.random.default_rng(seed).uniform(low, high, size=shape)
    return data.astype(dtype)


def _dims(draw, count, low=1, high=4):
    return tuple(draw(st.integers(low, high)) for _ in range(count))


# -- valid calls, one builder per operation -----------------------------------

#: How to corrupt the inputs of the attention operations.
QKV_KINDS = {"query": "array", "key": "array", "value": "array"}


@st.composite
def sdpa_call(draw):
    batch = _dims(draw, draw(st.integers(0, 2)))
    n, m, d_k, d_v = _dims(draw, 4)
    arguments = {
        "query": _array(draw, (*batch, n, d_k)),
        "key": _array(draw, (*batch, m, d_k)),
        "value": _array(draw, (*batch, m, d_v)),
        "mask": draw(st.sampled_from([None, _array(draw, (n, m)) > -1.0])),
        "key_lengths": (
            np.asarray(draw(st.lists(st.integers(0, m), min_size=batch[0], max_size=batch[0])), dtype=np.int64)
            if batch and draw(st.booleans())
            else None
        ),
        "is_causal": draw(st.booleans()),
        "scale": draw(st.sampled_from([None, 0.5, 2.0])),
        "return_weights": draw(st.booleans()),
    }
    kinds = {
        **QKV_KINDS,
        "mask": "mask",
        "key_lengths": "optional_array",
        "is_causal": "flag",
        "scale": "scale",
        "return_weights": "flag",
    }

    def expected(query, key, value, mask, key_lengths, is_causal, scale, return_weights):
        lead = np.broadcast_shapes(query.shape[:-2], key.shape[:-2], value.shape[:-2])
        # The documented layouts: (B,) for the first leading dimension, else
        # the leading shape (broadcast), else one length per query.
        lengths_per = "sequence"
        if key_lengths is not None and key_lengths.ndim == 1 and len(lead) > 1 and key_lengths.shape[0] == lead[0]:
            lengths_per = "batch"
        elif key_lengths is not None and key_lengths.ndim == len(lead) + 1:
            lengths_per = "query"
        additive = mask if mask is not None and mask.dtype != bool else None
        allowed = reference.allowed_mask(
            query.shape[-2],
            key.shape[-2],
            batch_shape=lead,
            mask=None if additive is not None else mask,
            key_lengths=key_lengths,
            lengths_per=lengths_per,
            is_causal=is_causal,
        )
        output, weights = reference.scaled_dot_product_attention(
            query, key, value, allowed=allowed, additive=additive, scale=scale
        )
        return (output, weights) if return_weights else output

    return Call(attnx.scaled_dot_product_attention, arguments, kinds, expected)


@st.composite
def masked_softmax_call(draw):
    shape = _dims(draw, draw(st.integers(1, 3)))
    arguments = {"scores": _array(draw, shape), "mask": None, "axis": draw(st.integers(-len(shape), len(shape) - 1))}
    kinds = {"scores": "array", "mask": "mask", "axis": "axis"}

    def expected(scores, mask, axis):
        moved = np.moveaxis(scores, axis, -1)
        if mask is not None and mask.dtype != bool:  # additive
            moved, mask = moved + mask, None
        allowed = None if mask is None else np.broadcast_to(mask, moved.shape)
        return np.moveaxis(reference.softmax(moved, allowed), -1, axis)

    return Call(attnx.masked_softmax, arguments, kinds, expected)


@st.composite
def multi_head_call(draw):
    h_kv = draw(st.integers(1, 2))
    h = h_kv * draw(st.integers(1, 2))
    d_k = draw(st.integers(1, 3))
    d_model = h * d_k
    n, m = _dims(draw, 2)
    batch = _dims(draw, draw(st.integers(0, 1)))
    params = {
        name: _array(draw, tuple(value.shape), low=-1.0, high=1.0)
        for name, value in attnx.init_multi_head_params(d_model, h, num_kv_heads=h_kv, backend="numpy").items()
    }
    arguments = {
        "query": _array(draw, (*batch, n, d_model)),
        "key": _array(draw, (*batch, m, d_model)),
        "value": _array(draw, (*batch, m, d_model)),
        "params": params,
        "num_heads": h,
        "num_kv_heads": h_kv,
        "is_causal": draw(st.booleans()),
        "return_weights": draw(st.booleans()),
    }
    kinds = {
        **QKV_KINDS,
        "params": "params",
        "num_heads": "size",
        "num_kv_heads": "optional_size",  # None: as many as num_heads
        "is_causal": "flag",
        "return_weights": "flag",
    }

    def expected(query, key, value, params, num_heads, num_kv_heads, is_causal, return_weights):
        lead = np.broadcast_shapes(query.shape[:-2], key.shape[:-2], value.shape[:-2])
        allowed = reference.allowed_mask(query.shape[-2], key.shape[-2], batch_shape=lead, is_causal=is_causal)
        output, weights = reference.multi_head_attention(query, key, value, params, num_heads, num_kv_heads, allowed)
        return (output, weights.mean(axis=-3)) if return_weights else output

    return Call(attnx.multi_head_attention, arguments, kinds, expected)


@st.composite
def additive_call(draw):
    n, m, d_q, d_k, d_v, hidden = _dims(draw, 6)
    arguments = {
        "query": _array(draw, (n, d_q)),
        "key": _array(draw, (m, d_k)),
        "value": _array(draw, (m, d_v)),
        "params": {
            "w_q": _array(draw, (d_q, hidden)),
            "w_k": _array(draw, (d_k, hidden)),
            "w_v": _array(draw, (hidden,)),
        },
        "return_weights": draw(st.booleans()),
    }
    kinds = {**QKV_KINDS, "params": "params", "return_weights": "flag"}

    def expected(query, key, value, params, return_weights):
        output, weights = reference.additive_attention(query, key, value, params)
        return (output, weights) if return_weights else output

    return Call(attnx.additive_attention, arguments, kinds, expected)


@st.composite
def bahdanau_call(draw):
    batch, steps, d_s, d_h, hidden = _dims(draw, 5)
    arguments = {
        "decoder_state": _array(draw, (batch, d_s)),
        "annotations": _array(draw, (batch, steps, d_h)),
        "params": {
            "w_q": _array(draw, (d_s, hidden)),
            "w_k": _array(draw, (d_h, hidden)),
            "w_v": _array(draw, (hidden,)),
        },
    }
    kinds = {"decoder_state": "array", "annotations": "array", "params": "params"}

    def expected(decoder_state, annotations, params):
        output, _ = reference.additive_attention(decoder_state[..., None, :], annotations, annotations, params)
        return output[..., 0, :]

    return Call(attnx.bahdanau_context, arguments, kinds, expected)


@st.composite
def nadaraya_watson_call(draw):
    n, m, d = _dims(draw, 3)
    vector = draw(st.booleans())
    arguments = {
        "queries": _array(draw, (n, d) if vector else (n,)),
        "keys": _array(draw, (m, d) if vector else (m,)),
        "values": _array(draw, (m,)),
        "kernel": draw(st.sampled_from(["gaussian", "boxcar", "epanechnikov"])),
        "bandwidth": draw(st.sampled_from([0.5, 1.0, 3.0])),
    }
    kinds = {"queries": "array", "keys": "array", "values": "array", "kernel": "kernel", "bandwidth": "bandwidth"}

    def expected(queries, keys, values, kernel, bandwidth):
        output, weights = reference.nadaraya_watson(queries, keys, values, kernel, bandwidth)
        if (
            kernel == "gaussian"
        ):  # the reference underflows far away, attnx's softmax doesn't: compare where it is defined
            return None
        return output

    return Call(attnx.nadaraya_watson, arguments, kinds, expected)


@st.composite
def flex_call(draw):
    batch, kv_heads, n, m, d, d_v = _dims(draw, 6, 1, 3)
    group = draw(st.integers(1, 2))
    arguments = {
        "query": _array(draw, (batch, kv_heads * group, n, d)),
        "key": _array(draw, (draw(st.sampled_from([1, batch])), kv_heads, m, d)),
        "value": _array(draw, (batch, kv_heads, m, d_v)),
        "enable_gqa": group > 1 or draw(st.booleans()),
        "scale": draw(st.sampled_from([None, 0.5, 2.0])),
        "return_weights": draw(st.booleans()),
    }
    kinds = {**QKV_KINDS, "enable_gqa": "flag", "scale": "scale", "return_weights": "flag"}

    def expected(query, key, value, enable_gqa, scale, return_weights):
        output, weights = reference.flex_attention(query, key, value, scale=scale)
        return (output, weights) if return_weights else output

    return Call(attnx.flex_attention, arguments, kinds, expected)


@st.composite
def rotary_call(draw):
    n, half = _dims(draw, 2)
    lead = _dims(draw, draw(st.integers(0, 2)))
    arguments = {"x": _array(draw, (*lead, n, 2 * half)), "positions": None, "interleaved": draw(st.booleans())}
    return Call(
        attnx.apply_rotary,
        arguments,
        {"x": "array", "positions": "optional_array", "interleaved": "flag"},
        lambda x, positions, interleaved: reference.apply_rotary(x, positions, interleaved=interleaved),
    )


@st.composite
def conv_call(draw):
    c_in, c_out, kernel_size, length = _dims(draw, 4)
    lead = _dims(draw, draw(st.integers(0, 1)))
    arguments = {
        "x": _array(draw, (*lead, c_in, length)),
        "weight": _array(draw, (c_out, c_in, kernel_size)),
        "bias": draw(st.sampled_from([None, _array(draw, (c_out,))])),
        "stride": draw(st.integers(1, 3)),
        "dilation": draw(st.integers(1, 3)),
    }
    kinds = {"x": "array", "weight": "array", "bias": "optional_array", "stride": "size", "dilation": "size"}
    return Call(attnx.causal_conv1d, arguments, kinds, reference.causal_conv1d)


@st.composite
def sinusoidal_call(draw):
    arguments = {
        "num_positions": draw(st.integers(0, 6)),
        "dim": draw(st.integers(1, 6)),
        "base": draw(st.sampled_from([10000.0, 500, 3.5])),
    }
    return Call(
        attnx.sinusoidal_positions,
        arguments,
        {"num_positions": "size", "dim": "size", "base": "positive_real"},
        lambda num_positions, dim, base: reference.sinusoidal_positions(num_positions, dim, float(base)),
        plain={"base"},
    )


@st.composite
def mask_call(draw):
    which = draw(st.sampled_from(["causal", "sliding_window"]))
    arguments = {"n": draw(st.integers(0, 5)), "m": draw(st.integers(0, 5))}
    kinds = {"n": "size", "m": "optional_size"}  # m=None: as many keys as queries
    if which == "sliding_window":
        arguments["window"] = draw(st.integers(0, 3))
        kinds["window"] = "optional_size"  # None: unbounded to the left

    def expected(n, m, window=None):
        m = n if m is None else m
        rows, cols = np.arange(n)[:, None] + (m - n), np.arange(m)[None, :]
        allowed = cols <= rows
        return allowed if window is None else allowed & (cols >= rows - window)

    return Call(getattr(attnx.masks, which), arguments, kinds, expected)


@st.composite
def from_lengths_call(draw):
    m = draw(st.integers(0, 5))
    lengths = np.asarray(draw(st.lists(st.integers(0, m), min_size=1, max_size=4)), dtype=np.int64)
    return Call(
        attnx.masks.from_lengths,
        {"lengths": lengths, "m": m},
        {"lengths": "array", "m": "size"},
        lambda lengths, m: np.arange(m) < lengths[..., None],
    )


@st.composite
def receptive_field_call(draw):
    dilations = draw(st.lists(st.integers(1, 8), min_size=1, max_size=4))
    return Call(
        attnx.receptive_field,
        {"kernel_size": draw(st.integers(1, 4)), "dilations": dilations},
        {"kernel_size": "size", "dilations": "sizes"},
        lambda kernel_size, dilations: 1 + sum((kernel_size - 1) * d for d in dilations),
        plain={"dilations"},
    )


@st.composite
def init_params_call(draw):
    h = draw(st.integers(1, 3))
    return Call(
        attnx.init_multi_head_params,
        {"d_model": h * draw(st.integers(1, 3)), "num_heads": h, "seed": draw(st.integers(0, 5))},
        {"d_model": "size", "num_heads": "size", "seed": "seed"},
        None,
    )


@st.composite
def learned_positions_call(draw):
    return Call(
        attnx.LearnedPositions,
        {"num_positions": draw(st.integers(1, 6)), "dim": draw(st.integers(1, 6)), "seed": draw(st.integers(0, 5))},
        {"num_positions": "size", "dim": "size", "seed": "seed"},
        None,
    )


CALLS = {
    "scaled_dot_product_attention": sdpa_call(),
    "masked_softmax": masked_softmax_call(),
    "multi_head_attention": multi_head_call(),
    "additive_attention": additive_call(),
    "bahdanau_context": bahdanau_call(),
    "nadaraya_watson": nadaraya_watson_call(),
    "flex_attention": flex_call(),
    "apply_rotary": rotary_call(),
    "causal_conv1d": conv_call(),
    "sinusoidal_positions": sinusoidal_call(),
    "masks": mask_call(),
    "masks.from_lengths": from_lengths_call(),
    "receptive_field": receptive_field_call(),
    "init_multi_head_params": init_params_call(),
    "LearnedPositions": learned_positions_call(),
}


# -- corrupting one argument ----------------------------------------------------

NOT_ARRAYS = st.sampled_from(["text", 3, 2.5, [1.0, 2.0], {"a": 1}, object()])


@st.composite
def corrupted(draw, kind, value, lazy=False):
    """A wrong (or surprising but valid) replacement for one argument;
    ``lazy``: the backend's values are not read, so not corrupted either."""
    if kind in ("array", "optional_array", "mask"):
        ways = ["rank", "empty", "dtype", "not_an_array"] + (["none"] if kind == "array" else [])
        how = draw(st.sampled_from(ways + (["not_finite"] if kind == "mask" and not lazy else [])))
        shape = tuple(np.shape(value)) if value is not None else (2, 2)
        if how == "not_finite":  # a real mask holding +inf or NaN: added to the scores, it would give NaN
            data = _array(draw, shape).ravel()
            data[draw(st.integers(0, max(0, data.size - 1)))] = draw(st.sampled_from([math.inf, math.nan]))
            return data.reshape(shape)
        if how == "rank":
            shape = _dims(draw, draw(st.integers(0, 5)), 1, 3)
        elif how == "empty":
            shape = tuple(0 if draw(st.booleans()) else s for s in shape) if shape else (0,)
        elif how == "none":
            return None
        elif how == "not_an_array":
            return draw(NOT_ARRAYS)
        dtype = draw(st.sampled_from(["int32", "int64", "bool", "complex128"])) if how == "dtype" else None
        if dtype is None:
            dtype = np.asarray(value).dtype if value is not None else np.float64
        if np.dtype(dtype).kind in "iu":
            return np.asarray(_array(draw, shape, np.float64, 0, 4), dtype=dtype)
        return _array(draw, shape, np.float64) > 0 if dtype == "bool" else _array(draw, shape).astype(dtype)
    if kind in ("size", "optional_size", "axis", "seed"):
        return draw(st.one_of(st.integers(-(2**40), -1), HUGE, st.sampled_from([2.5, "3", None, True, 0])))
    if kind == "sizes":
        return draw(
            st.one_of(
                st.lists(st.integers(-5, 0), min_size=1, max_size=3), st.lists(HUGE, min_size=1, max_size=2), NOT_ARRAYS
            )
        )
    if kind == "flag":
        return draw(st.sampled_from(["yes", "no", 1, 0, None, 1.0]))
    if kind == "scale":
        return draw(st.sampled_from(["auto", math.nan, math.inf, -math.inf, [1.0], True, {}]))
    if kind == "kernel":
        return draw(st.sampled_from(["cauchy", 5, None, ""]))
    if kind == "bandwidth":
        return draw(st.sampled_from([0.0, -1.0, math.nan, "wide", None, True]))
    if kind == "positive_real":  # NumPy's scalars are real numbers too
        return draw(
            st.sampled_from([0.0, -1.0, math.nan, math.inf, "wide", None, True, np.float32(100.0), np.int64(7)])
        )
    if kind == "params":
        how = draw(st.sampled_from(["not_a_mapping", "missing", "extra", "shape", "dtype"]))
        if how == "not_a_mapping":
            return draw(NOT_ARRAYS)
        params = dict(value)
        name = draw(st.sampled_from(sorted(params)))
        if how == "missing":
            del params[name]
        elif how == "extra":
            params["w_z"] = params[name]
        elif how == "shape":
            params[name] = _array(draw, _dims(draw, draw(st.integers(0, 3)), 1, 5))
        else:
            params[name] = np.asarray(params[name] * 3, dtype=draw(st.sampled_from(["int64", "bool"])))
        return params
    raise AssertionError(kind)


#: :func:`expected_error`'s word for a corrupted value that is a right one.
VALID = "valid"


def expected_error(kind, value):
    """The class of error a corrupted ``value`` of an argument of ``kind``
    must raise where the value alone says which: TypeError for a value of
    the wrong type (text, a bool or a float where an integer goes, None or
    a list where an array goes), ValueError for a number out of range;
    VALID for a surprising value that is a right one (a NumPy scalar for a
    number); None where either may be right (a shape, a dtype, 0, a
    default that may not fit the other arguments)."""
    if kind in ("array", "optional_array", "mask"):
        if value is None:
            return TypeError if kind == "array" else None
        return None if hasattr(value, "shape") else TypeError
    if kind in ("size", "optional_size", "axis", "seed"):
        if value is None and kind == "optional_size":  # its default may not fit the other arguments
            return None
        if isinstance(value, bool) or not isinstance(value, int):
            return TypeError
        if kind == "axis":  # negative axes count from the end; too large ones are named either way
            return None
        # NumPy takes seeds of any size; sizes past what an index can count are refused.
        return ValueError if value < 0 or (value >= 2**63 and kind != "seed") else None
    if kind == "flag":
        return None if isinstance(value, bool) else TypeError
    if kind == "positive_real":
        if isinstance(value, bool) or not isinstance(value, (int, float, np.number)):
            return TypeError
        return VALID if math.isfinite(value) and value > 0 else ValueError
    if kind in ("scale", "bandwidth"):
        return ValueError if isinstance(value, float) else TypeError
    if kind == "kernel":
        return ValueError if isinstance(value, str) else TypeError
    if kind == "params":
        return None if isinstance(value, dict) else TypeError
    return None


# -- the property ---------------------------------------------------------------


def _on_backend(be, value, dtype):
    """A NumPy array (or a mapping of them) as the backend's array in
    ``dtype`` when floating; anything else unchanged."""
    if isinstance(value, dict):
        return {k: _on_backend(be, v, dtype) for k, v in value.items()}
    if isinstance(value, np.ndarray):
        if value.dtype == np.float64:
            return be.array(value, dtype)
        if value.dtype.kind == "c" and value.dtype.name not in _complex_dtypes(be):
            return be.array(value.real, dtype)  # a library without complex numbers: a real array instead
        return be.array(value)
    return value


def _complex_dtypes(be):
    return [name for name in ("complex64", "complex128") if hasattr(be.xp, name)]


def _rounded(be, value, dtype):
    if isinstance(value, dict):
        return {k: _rounded(be, v, dtype) for k, v in value.items()}
    if isinstance(value, np.ndarray) and value.dtype == np.float64:
        return rounded(value, be, dtype)
    return value


def _results(result):
    return list(result) if isinstance(result, tuple) else [result]


@pytest.mark.parametrize("operation", list(CALLS))
def test_bad_input_is_named_or_the_answer_is_right(attnx_backend, operation):
    be = attnx_backend
    dtype = be.dtypes[0]

    @SETTINGS
    @given(call=CALLS[operation], data=st.data())
    def check(call, data):
        arguments = dict(call.arguments)
        corrupt = data.draw(st.sampled_from([None, *call.kinds]), label="argument to corrupt")
        if corrupt is not None:
            arguments[corrupt] = data.draw(corrupted(call.kinds[corrupt], arguments[corrupt], be.lazy), label=corrupt)
        sent = {
            name: value if name in call.plain else _on_backend(be, value, dtype) for name, value in arguments.items()
        }
        takes_backend = operation not in ("receptive_field",)
        if takes_backend and operation in CREATES_ARRAYS:
            sent["backend"] = be.name
        try:
            result = call.operation(**sent)
        except (ValueError, TypeError) as exc:
            message = str(exc)
            named = [corrupt] if corrupt is not None else list(call.kinds)
            assert corrupt is not None, f"a valid call raised: {exc!r}"
            wanted = expected_error(call.kinds[corrupt], arguments[corrupt])
            assert wanted is not VALID, f"{corrupt}={arguments[corrupt]!r} is a right value, and raised {exc!r}"
            assert wanted is None or isinstance(exc, wanted), (
                f"{corrupt}={arguments[corrupt]!r} raised {type(exc).__name__}, not {wanted.__name__}: {exc}"
            )
            if not any(name in message for name in named):
                assert any(name in message for name in call.kinds), f"{exc!r} names no argument (corrupted: {corrupt})"
            return
        if corrupt is not None:
            wanted = expected_error(call.kinds[corrupt], arguments[corrupt])
            assert wanted in (None, VALID), (
                f"{corrupt}={arguments[corrupt]!r} was taken, where a {wanted.__name__} is due"
            )
        _check_result(be, operation, call, arguments, result, dtype)

    check()


CREATES_ARRAYS = ("sinusoidal_positions", "masks", "init_multi_head_params", "LearnedPositions")


def _check_result(be, operation, call, arguments, result, dtype):
    if operation == "receptive_field":
        assert result == call.reference(**arguments)
        return
    if operation == "init_multi_head_params":
        assert all(be.backend.owns(a) for a in result.values())
        return
    if operation == "LearnedPositions":
        table = result.table
        assert be.backend.owns(table) and tuple(table.shape) == (arguments["num_positions"], arguments["dim"])
        assert np.isfinite(be.numpy(table)).all()
        return
    for got in _results(result):
        assert be.backend.owns(got), f"{operation} returned a {type(got).__name__}"
        values = be.numpy(got)
        if values.dtype.kind == "f":
            assert np.isfinite(values).all(), f"{operation}: finite inputs gave NaN or Inf"
    if call.reference is None:
        return
    expected = call.reference(**{name: _rounded(be, value, dtype) for name, value in arguments.items()})
    if expected is None:
        return
    rtol, atol = tolerance(dtype)
    for got, want in zip(_results(result), _results(expected)):
        got = be.numpy(got)
        assert got.shape == np.shape(want), f"{operation}: shape {got.shape}, expected {np.shape(want)}"
        if got.dtype == bool:
            np.testing.assert_array_equal(got, want)
        else:
            np.testing.assert_allclose(got.astype(np.float64), want, rtol=rtol, atol=atol * 10)
