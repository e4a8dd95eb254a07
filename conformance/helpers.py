"""Assertions shared by the conformance tests."""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from hypothesis import HealthCheck, settings

from attnx_conformance.tolerances import tolerance

RNG_SEED = 20261121

#: Examples per property: 25 keeps the suite quick; ``ATTNX_TEST_EXAMPLES=1000``
#: makes a longer hunt for rare inputs.
EXAMPLES = int(os.environ.get("ATTNX_TEST_EXAMPLES", "25"))
#: The properties' settings.  No example database: running the suite leaves
#: nothing in the user's folder.
PROPERTY_SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


def rng(*salt: int) -> np.random.Generator:
    return np.random.default_rng([RNG_SEED, *salt])


def rounded(data: np.ndarray, be: Any, dtype: str) -> np.ndarray:
    """``data`` as the backend will see it in ``dtype``, back in float64: the
    reference gets the same rounded inputs, so tolerances measure the
    computation, not the input rounding."""
    return be.numpy(be.array(data, be.dtype(dtype))).astype(np.float64)


def assert_close(
    actual: Any, expected: np.ndarray, be: Any, dtype: str, *, like: Any = None, scale: float = 1.0
) -> None:
    """``actual`` is ``be``'s array, of ``dtype`` (:meth:`be.dtype`: float64
    means the widest the backend has), on ``like``'s device, with no NaN, and
    equal to ``expected`` within the dtype's tolerance."""
    dtype = be.dtype(dtype)
    assert be.backend.owns(actual), (
        f"result is a {type(actual).__module__}.{type(actual).__name__}, not a {be.name} array"
    )
    assert be.dtype_name(actual) == dtype, f"result dtype {actual.dtype}, expected {dtype}"
    if like is not None:  # the backend says where its arrays are: not every library's have .device
        device_of = be.backend.device_of
        assert str(device_of(actual)) == str(device_of(like)), "result on another device"
    got = be.numpy(actual).astype(np.float64)
    assert got.shape == expected.shape, f"shape {got.shape}, expected {expected.shape}"
    assert not np.isnan(got).any(), "result has NaN"
    rtol, atol = tolerance(dtype)
    np.testing.assert_allclose(got, expected, rtol=rtol, atol=atol * scale)


def tolerances(be: Any, dtype: str = "float64", factor: float = 1.0) -> dict[str, float]:
    """``rtol``/``atol`` keywords for ``np.testing.assert_allclose`` in
    ``dtype`` on ``be`` (its widest float dtype where float64 is missing),
    widened by ``factor``."""
    rtol, atol = tolerance(be.dtype(dtype))
    return {"rtol": rtol * factor, "atol": atol * factor}


#: Placeholder for :func:`other_float` in tables of cases.
OTHER_FLOAT = "<a float dtype other than float32>"


def other_float(be: Any) -> str:
    """A float dtype of ``be`` other than float32 (float64 first), for checks
    that mix dtypes; skips the test where the backend has only float32."""
    import pytest

    for dtype in ("float64", "float16", "bfloat16"):
        if dtype in be.dtypes:
            return dtype
    pytest.skip(f"{be.name} has no float dtype but float32")


def under_budget(budget: int | None) -> Any:
    """:func:`attnx.memory_budget` of ``budget`` bytes, or no budget where
    None.  A budget small enough makes an operation that plans its chunks by
    it run in several, the last shorter (additive attention's queries,
    through :meth:`attnx.Backend.map_chunks`).  Entered around a traced
    call, not inside the traced function: tracers can't set it."""
    import contextlib

    import attnx

    return attnx.memory_budget(budget) if budget is not None else contextlib.nullcontext()
