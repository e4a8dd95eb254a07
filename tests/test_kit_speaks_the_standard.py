"""The conformance kit's own helpers use only the array API standard: run
here on array-api-strict, which refuses everything else, so that an
outside library's backend fails the kit only for its own reasons."""

from __future__ import annotations

import warnings

import numpy as np
import pytest

strict = pytest.importorskip("array_api_strict")

from attnx_conformance import test_lazy, test_nadaraya_watson  # noqa: E402


@pytest.fixture(autouse=True)
def oldest_standard():
    """The standard as the oldest version array-api-strict serves, 2022.12:
    what the kit uses must be there (a one-sided ``clip`` is not)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # array-api-strict's: "2022.12 is not fully supported"
        with strict.ArrayAPIStrictFlags(api_version="2022.12"):
            yield


def test_lengths_from_tokens_use_the_standard_alone():
    tokens = strict.asarray(np.array([[3, 1, 0, 0], [2, 0, 0, 0]]))
    lengths = test_lazy._lengths(tokens)
    assert np.asarray(lengths).tolist() == [2, 1]


def test_the_user_kernel_uses_the_standard_alone():
    u = strict.asarray(np.array([0.0, 0.25, 1.0, 3.0]))
    assert np.asarray(test_nadaraya_watson.triangle_kernel(u)).tolist() == [1.0, 0.75, 0.0, 0.0]


def test_closeness_asks_the_backend_where_its_arrays_are():
    """A library whose arrays have no ``.device`` (MLX) says where they are
    through ``Backend.device_of``: the kit's closeness check asks that, not
    the array."""
    import types

    from attnx_conformance.helpers import assert_close

    class NoDevice:  # an array type without .device, as MLX's
        def __init__(self, data):
            self.data, self.dtype, self.shape = data, data.dtype, data.shape

    backend = types.SimpleNamespace(owns=lambda a: isinstance(a, NoDevice), device_of=lambda a: "gpu")
    be = types.SimpleNamespace(
        backend=backend, dtype=lambda name: name, dtype_name=lambda a: a.dtype.name, numpy=lambda a: a.data
    )
    data = np.linspace(0.0, 1.0, 6)
    assert_close(NoDevice(data), data, be, "float64", like=NoDevice(data))
