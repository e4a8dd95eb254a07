"""Bad input raises the same exception on every backend, before computing."""

from __future__ import annotations

import numpy as np
import pytest

import attnx

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
    ("integer query", {"query": ((2, 3, 4), "int64")}, TypeError, ["query", "floating", "int64"]),
    ("mixed dtypes", {"key": ((2, 5, 4), "float64")}, TypeError, ["key", "float64", "float32"]),
    ("mask shape", {"mask": ((2, 3, 7), "bool")}, ValueError, ["mask", "(2, 3, 5)", "(2, 3, 7)"]),
    ("mask dtype", {"mask": ((3, 5), "int32")}, TypeError, ["mask", "boolean", "int32"]),
    ("lengths dtype", {"key_lengths": ((2,), F)}, TypeError, ["key_lengths", "integer"]),
    ("lengths shape", {"key_lengths": ((4,), "int64")}, ValueError, ["key_lengths", "(4,)"]),
    ("lengths too large", {"key_lengths": (np.array([5, 6]), None)}, ValueError, ["key_lengths", "[0, m]", "6"]),
    ("negative lengths", {"key_lengths": (np.array([-1, 2]), None)}, ValueError, ["key_lengths", "-1"]),
]


def _build(be, spec):
    shape, dtype = spec
    if isinstance(shape, np.ndarray):
        return be.array(shape)
    data = np.ones(shape)
    return be.array(data, dtype) if dtype != "bool" else be.array(data > 0)


@pytest.mark.parametrize("description, overrides, exception, words", CASES, ids=[c[0] for c in CASES])
def test_bad_input_raises(attnx_backend, description, overrides, exception, words):
    specs = {**GOOD, **overrides}
    arrays = {name: _build(attnx_backend, spec) for name, spec in specs.items()}
    with pytest.raises(exception) as info:
        attnx.scaled_dot_product_attention(**arrays)
    for word in words:
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
