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
