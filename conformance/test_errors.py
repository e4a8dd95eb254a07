"""Bad input raises the same exception on every backend, before computing."""

from __future__ import annotations

import numpy as np
import pytest

import attnx
from attnx_conformance.helpers import OTHER_FLOAT, other_float

pytestmark = pytest.mark.attnx_operation("scaled_dot_product_attention")

F = "float32"
GOOD = {"query": ((2, 3, 4), F), "key": ((2, 5, 4), F), "value": ((2, 5, 6), F)}

# (description, overrides of shapes/dtypes or extra kwargs, exception, words the message must contain)
CASES = [
    ("query rank", {"query": ((4,), F)}, ValueError, ["query", "(..., n, d_k)", "(4,)"]),
    ("d_k mismatch", {"key": ((2, 5, 3), F)}, ValueError, ["key", "d_k = 4", "(2, 5, 3)"]),
    ("key/value length", {"value": ((2, 4, 6), F)}, ValueError, ["value", "m = 5", "(2, 4, 6)"]),
    (
        "batch clash",
        {"key": ((3, 5, 4), F), "value": ((3, 5, 6), F)},
        ValueError,
        ["broadcast", "query (2,)", "key (3,)"],
    ),
    ("integer query", {"query": ((2, 3, 4), "int32")}, TypeError, ["query", "floating", "int32"]),
    (
        "all integer",
        {"query": ((2, 3, 4), "int32"), "key": ((2, 5, 4), "int32"), "value": ((2, 5, 6), "int32")},
        TypeError,
        ["query", "floating", "int32"],
    ),
    ("mixed dtypes", {"key": ((2, 5, 4), OTHER_FLOAT)}, TypeError, ["key", OTHER_FLOAT, "float32"]),
    ("mask shape", {"mask": ((2, 3, 7), "bool")}, ValueError, ["mask", "(2, 3, 5)", "(2, 3, 7)"]),
    ("mask dtype", {"mask": ((3, 5), "int32")}, TypeError, ["mask", "boolean", "int32"]),
    ("lengths dtype", {"key_lengths": ((2,), F)}, TypeError, ["key_lengths", "integer"]),
    ("lengths shape", {"key_lengths": ((4,), "int64")}, ValueError, ["key_lengths", "(4,)"]),
    (
        "lengths grow the batch",  # one per query, for 2 sequences where the batch has 1
        {"query": ((1, 3, 4), F), "key": ((1, 5, 4), F), "value": ((1, 5, 6), F), "key_lengths": ((2, 3), "int64")},
        ValueError,
        ["key_lengths", "(2, 3)"],
    ),
    ("lengths too large", {"key_lengths": (np.array([5, 6]), None)}, ValueError, ["key_lengths", "[0, m]", "6"]),
    ("negative lengths", {"key_lengths": (np.array([-1, 2]), None)}, ValueError, ["key_lengths", "-1"]),
    # A real mask is added to the scores: +inf or NaN there would make rows NaN.
    ("mask +inf", {"mask": (np.where(np.eye(3, 5) > 0, np.inf, 0).astype(F), None)}, ValueError, ["mask", "+inf"]),
    ("mask NaN", {"mask": (np.where(np.eye(3, 5) > 0, np.nan, 0).astype(F), None)}, ValueError, ["mask", "NaN"]),
    # Finite in a float64 mask, +inf in the float32 scores it is added to.
    (
        "float64 mask past float32",
        {"mask": (np.where(np.eye(3, 5) > 0, 1e300, 0.0), None)},
        ValueError,
        ["mask", "in float32", "1e+300"],
    ),
]
#: Cases found by reading values: lazy arrays' values are not read (that would compute them).
VALUE_CASES = {"lengths too large", "negative lengths", "mask +inf", "mask NaN", "float64 mask past float32"}


def _build(be, spec):
    shape, dtype = spec
    if dtype == OTHER_FLOAT:
        dtype = other_float(be)
    if isinstance(shape, np.ndarray):
        return be.array(shape)
    data = np.ones(shape)
    return be.array(data, dtype) if dtype != "bool" else be.array(data > 0)


@pytest.mark.parametrize("description, overrides, exception, words", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises(attnx_backend, description, overrides, exception, words):
    if description in VALUE_CASES and attnx_backend.lazy:
        pytest.skip("lazy arrays' values are read only when computed: attnx doesn't check them")
    if "float64" in description and "float64" not in attnx_backend.dtypes:
        pytest.skip(f"{attnx_backend.name} makes no float64 arrays here")
    specs = {**GOOD, **overrides}
    arrays = {name: _build(attnx_backend, spec) for name, spec in specs.items()}
    with pytest.raises(exception) as info:
        attnx.scaled_dot_product_attention(**arrays)
    for word in words:
        word = other_float(attnx_backend) if word == OTHER_FLOAT else word
        assert word in str(info.value), f"{word!r} not in {str(info.value)!r}"
    assert "scaled_dot_product_attention" in str(info.value)


def test_explicit_backend_that_does_not_own_the_inputs(attnx_backend):
    be = attnx_backend
    other = "numpy" if be.name != "numpy" else None
    if other is None:
        pytest.skip("the numpy backend owns numpy arrays")
    arrays = [np.ones((3, 4), dtype=np.float32)] * 3
    with pytest.raises(TypeError, match="attnx.asarray"):
        attnx.scaled_dot_product_attention(*arrays, backend=be.name)
    mixed = [be.array(np.ones((3, 4)), "float32"), arrays[1], arrays[2]]
    with pytest.raises(TypeError, match="two backends"):
        attnx.scaled_dot_product_attention(*mixed)


def test_inputs_on_two_devices(attnx_backend):
    be = attnx_backend
    devices = [attnx.backend.device_label(d) for d in be.backend.devices()]
    if len(devices) < 2:
        pytest.skip(f"{be.name} has one device here")
    under_test = [be.device] if be.device in devices else []
    first, second = (under_test + [d for d in devices if d not in under_test])[:2]
    data = np.ones((2, 3, 4))
    on_first = attnx.asarray(data, backend=be.name, dtype="float32", device=first)
    on_second = attnx.asarray(data, backend=be.name, dtype="float32", device=second)
    with pytest.raises(ValueError, match=r"two devices: query on .* but key on"):
        attnx.scaled_dot_product_attention(on_first, on_second, on_first)


# (keyword arguments, exception, words the message must contain)
BAD_ARGUMENTS = [
    ({"scale": "auto"}, TypeError, ["scale", "'auto'"]),
    ({"scale": float("nan")}, ValueError, ["scale", "finite"]),
    ({"scale": True}, TypeError, ["scale"]),
    # Finite in Python, inf in the float32 scores: it would give NaN.
    ({"scale": 1e300}, ValueError, ["scale", "finite in float32", "1e+300"]),
    ({"is_causal": "yes"}, TypeError, ["is_causal", "'yes'"]),
    ({"is_causal": 1}, TypeError, ["is_causal"]),
    ({"return_weights": "no"}, TypeError, ["return_weights", "'no'"]),
    ({"chunk_size": 0}, ValueError, ["chunk_size"]),
    ({"chunk_size": (4, 2, 1)}, ValueError, ["chunk_size"]),
]


@pytest.mark.parametrize("kwargs, exception, words", BAD_ARGUMENTS, ids=lambda c: str(c))
def test_bad_arguments_are_named(attnx_backend, kwargs, exception, words):
    arrays = {name: _build(attnx_backend, spec) for name, spec in GOOD.items()}
    with pytest.raises(exception) as info:
        attnx.scaled_dot_product_attention(**arrays, **kwargs)
    for word in words:
        assert word in str(info.value), f"{word!r} not in {str(info.value)!r}"


@pytest.mark.attnx_operation("multi_head_attention")
@pytest.mark.parametrize("flag", ["is_causal", "return_weights", "average_weights"])
def test_multi_head_flags_must_be_bools(attnx_backend, flag):
    be = attnx_backend
    params = {k: be.array(v, "float32") for k, v in attnx.init_multi_head_params(8, 2, backend="numpy").items()}
    x = be.array(np.ones((2, 3, 8)), "float32")
    with pytest.raises(TypeError, match=f"multi_head_attention: {flag} must be True or False, got 'no'"):
        attnx.multi_head_attention(x, x, x, params, num_heads=2, **{flag: "no"})


@pytest.mark.attnx_operation("multi_head_attention")
def test_a_wrong_w_q_width_is_reported_naming_w_q(attnx_backend):
    be = attnx_backend
    params = {k: be.array(v, "float32") for k, v in attnx.init_multi_head_params(8, 2, backend="numpy").items()}
    params["w_q"] = be.array(np.ones((8, 12)), "float32")  # h*d_k = 12: d_k = 6, where w_k says 4
    x = be.array(np.ones((2, 3, 8)), "float32")
    with pytest.raises(ValueError) as info:
        attnx.multi_head_attention(x, x, x, params, num_heads=2)
    message = str(info.value)
    assert "params['w_q']" in message and "(8, 12)" in message and "d_k = 6" in message and "d_k = 4" in message
    params["w_q"], params["w_k"] = be.array(np.ones((8, 8)), "float32"), be.array(np.ones((8, 7)), "float32")
    with pytest.raises(ValueError, match=r"h_kv = 2 gives d_k = 3\.5"):  # no whole d_k fits w_k
        attnx.multi_head_attention(x, x, x, params, num_heads=2)


def _dtype_objects():
    objects = [("numpy dtype", np.dtype("float64")), ("numpy scalar type", np.float64), ("name", "float64")]
    try:
        import torch
    except ImportError:
        return objects
    return [*objects, ("torch dtype", torch.float64)]


@pytest.mark.attnx_operation("asarray")
@pytest.mark.parametrize("label, dtype", _dtype_objects(), ids=[label for label, _ in _dtype_objects()])
def test_asarray_reads_any_library_s_dtype_by_its_name(attnx_backend, label, dtype):
    be = attnx_backend
    if "float64" not in be.dtypes:  # refused, never silently narrowed
        with pytest.raises(TypeError, match="float64"):
            attnx.asarray(np.arange(3), backend=be.name, dtype=dtype, device=be.device)
        return
    converted = attnx.asarray(np.arange(3), backend=be.name, dtype=dtype, device=be.device)
    assert be.backend.owns(converted) and be.dtype_name(converted) == "float64"
    np.testing.assert_array_equal(be.numpy(converted), [0.0, 1.0, 2.0])


@pytest.mark.attnx_operation("asarray")
@pytest.mark.parametrize("dtype", ["floaty", 5, "bfloat17"])
def test_asarray_refuses_what_is_not_a_dtype(attnx_backend, dtype):
    with pytest.raises(TypeError, match=r"asarray: dtype .* is not a dtype of the"):
        attnx.asarray(np.arange(3), backend=attnx_backend.name, dtype=dtype)


@pytest.mark.attnx_operation("positional_encodings")
@pytest.mark.parametrize(
    "create, names",
    [
        (lambda be: attnx.masks.causal(2**40, 2**40, backend=be), "n x m"),
        (lambda be: attnx.masks.sliding_window(2**40, 2**40, 1, backend=be), "n x m"),
        (lambda be: attnx.sinusoidal_positions(2**40, 2**30, backend=be), "num_positions x dim"),
        (lambda be: attnx.LearnedPositions(2**40, 2**30, backend=be), "num_positions x dim"),
    ],
    ids=["causal", "sliding_window", "sinusoidal_positions", "LearnedPositions"],
)
def test_sizes_whose_product_no_array_can_hold_are_refused_by_name(attnx_backend, create, names):
    """Each size is a valid int64, their product is not: refused before allocating."""
    with pytest.raises(ValueError, match=rf"{names} = {2**40} x \d+ would need more than 2\*\*63 - 1 elements"):
        create(attnx_backend.name)


@pytest.mark.attnx_operation("positional_encodings")
@pytest.mark.parametrize(
    "create",
    [
        lambda be, dtype: attnx.sinusoidal_positions(4, 6, dtype=dtype, backend=be),
        lambda be, dtype: attnx.LearnedPositions(4, 6, dtype=dtype, backend=be),
        lambda be, dtype: attnx.init_multi_head_params(8, 2, dtype=dtype, backend=be),
        lambda be, dtype: attnx.MultiHeadAttention(8, 2, dtype=dtype, backend=be),
        lambda be, dtype: attnx.mods.alibi_slopes(4, dtype=dtype, backend=be),
    ],
    ids=["sinusoidal_positions", "LearnedPositions", "init_multi_head_params", "MultiHeadAttention", "alibi_slopes"],
)
@pytest.mark.parametrize("dtype", ["int32", "bool"])
def test_what_creates_real_values_refuses_other_dtypes(attnx_backend, create, dtype):
    """Weights, encodings and slopes in integers would be rounded (to zeros, mostly): refused, not made."""
    with pytest.raises(TypeError, match=rf"dtype must be a real floating-point dtype .*, got {dtype}"):
        create(attnx_backend.name, dtype)


def test_an_eager_backend_s_arrays_are_concrete(attnx_backend):
    """The checks that read values (``key_lengths`` within ``[0, m]``, a
    finite ``scale``, no ``+inf`` in a real mask) run only where
    ``is_concrete`` says an array's values can be read.  A backend that
    declares no lazy ``computations()`` but answers False for an array made
    from known data switches them off without a word: with array-api-compat's
    default, every ndonnx array counted as lazy, and ``key_lengths=[9]`` for
    3 keys returned an answer."""
    be = attnx_backend
    if be.backend.computations() is not None:
        pytest.skip(f"{be.name} is lazy by its own declaration (computations())")
    made = be.array(np.ones((2, 3)), be.dtype("float32"))
    assert be.backend.is_concrete(made), (
        f"{be.name}'s is_concrete() answers False for an array asarray() just made from known data, so attnx "
        "never checks its values (key lengths, scale, masks); override Backend.is_concrete"
    )
    query = be.array(np.ones((2, 1, 4)), be.dtype("float32"))
    key = be.array(np.ones((2, 3, 4)), be.dtype("float32"))
    with pytest.raises(ValueError, match="key_lengths"):  # 9 keys of 3
        attnx.scaled_dot_product_attention(query, key, key, key_lengths=be.array(np.array([9, 9])))
