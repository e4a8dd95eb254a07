"""Tolerances per dtype: the one place they are stated."""

from __future__ import annotations

#: dtype name -> (rtol, atol) for results compared with the float64 reference
#: computed from the same (rounded) inputs.
TOLERANCES: dict[str, tuple[float, float]] = {
    "float64": (1e-10, 1e-12),
    "float32": (2e-5, 2e-6),
    "float16": (2e-2, 2e-3),
    "bfloat16": (6e-2, 2e-2),
}


def tolerance(dtype: str) -> tuple[float, float]:
    return TOLERANCES[dtype]
