"""A backend's first call in a fresh interpreter computes what later ones do.

Backends load what they need on first use (imports, kernels, caches).  In one
test process every call but the first finds that done, so a path that
assumes another path ran first passes the rest of the suite.  Here each case
is the first computation of a new interpreter, which finds the backend by its
entry point as a user's program would; backends registered only in the test
process are skipped.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import attnx
from attnx import mods
from attnx_conformance import reference
from attnx_conformance.helpers import assert_close, rng, rounded

B, H, N, M, D, D_V = 2, 3, 5, 7, 4, 6
F = "float32"
#: The exit status of an interpreter that doesn't have the backend.
NOT_REGISTERED = 3


def _inputs() -> dict[str, np.ndarray]:
    gen = rng(120)
    mask = gen.random((N, M)) < 0.7
    mask[0] = False  # a row with nothing to attend: zeros
    return {
        "query": gen.standard_normal((B, H, N, D)),
        "key": gen.standard_normal((B, H, M, D)),
        "value": gen.standard_normal((B, H, M, D_V)),
        "mask": mask,
        "key_lengths": np.array([M, 3]).reshape(B, 1),
        "points": gen.uniform(0, 5, 9),
        "targets": gen.standard_normal(9),
    }


def _attention(be: Any, arrays: dict[str, Any], **options: Any) -> Any:
    return attnx.scaled_dot_product_attention(arrays["query"], arrays["key"], arrays["value"], **options)


def _causal_blocks(be: Any, arrays: dict[str, Any]) -> Any:
    block_mask = attnx.create_block_mask(mods.causal, B, H, N, M, device=be.device)
    return attnx.flex_attention(arrays["query"], arrays["key"], arrays["value"], block_mask=block_mask)


def _regression(be: Any, arrays: dict[str, Any]) -> Any:
    return attnx.nadaraya_watson(arrays["points"][:4], arrays["points"], arrays["targets"], bandwidth=0.7)


#: name -> (operation, the first call (be, the backend's arrays), its float64 reference (exact NumPy inputs))
CASES: dict[str, tuple[str, Callable[..., Any], Callable[..., np.ndarray]]] = {
    "attention": (
        "scaled_dot_product_attention",
        lambda be, arrays: _attention(be, arrays),
        lambda x: reference.scaled_dot_product_attention(x["query"], x["key"], x["value"])[0],
    ),
    "attention with a mask and key_lengths": (
        "scaled_dot_product_attention",
        lambda be, arrays: _attention(be, arrays, mask=arrays["mask"], key_lengths=arrays["key_lengths"]),
        lambda x: reference.scaled_dot_product_attention(
            x["query"],
            x["key"],
            x["value"],
            allowed=reference.allowed_mask(
                N, M, batch_shape=(B, H), mask=x["mask"], key_lengths=x["key_lengths"].astype(int)
            ),
        )[0],
    ),
    "causal attention, n != m": (
        "scaled_dot_product_attention",
        lambda be, arrays: _attention(be, arrays, is_causal=True),
        lambda x: reference.scaled_dot_product_attention(
            x["query"], x["key"], x["value"], allowed=reference.allowed_mask(N, M, batch_shape=(B, H), is_causal=True)
        )[0],
    ),
    "flex_attention with a causal block mask": (
        "flex_attention",
        _causal_blocks,
        lambda x: reference.flex_attention(
            x["query"], x["key"], x["value"], allowed=np.broadcast_to(np.tri(N, M, dtype=bool), (B, H, N, M))
        )[0],
    ),
    "nadaraya_watson": (
        "nadaraya_watson",
        _regression,
        lambda x: reference.nadaraya_watson(x["points"][:4], x["points"], x["targets"], bandwidth=0.7)[0],
    ),
}


def _backend_arrays(be: Any) -> dict[str, Any]:
    """The inputs as the backend's arrays: floats in float32, the rest as they are."""
    return {name: be.array(data, F if data.dtype.kind == "f" else None) for name, data in _inputs().items()}


def run_first_call(name: str, device: str, case: str, path: str) -> int:
    """The subprocess's side: ``case`` on backend ``name``, its result saved
    to ``path`` as float64 NumPy; :data:`NOT_REGISTERED` where this
    interpreter doesn't have the backend."""
    from attnx_conformance.plugin import BackendUnderTest

    if name not in attnx._registry.names():
        return NOT_REGISTERED
    backend = attnx._registry.get(name)
    be = BackendUnderTest(name, backend, device or None, tuple(backend.float_dtypes))
    with attnx.use_backend(name):
        result = CASES[case][1](be, _backend_arrays(be))
        np.save(path, be.numpy(result).astype(np.float64))
    return 0


SCRIPT = (
    "import sys; from attnx_conformance import test_fresh_interpreter as t; sys.exit(t.run_first_call(*sys.argv[1:]))"
)


@pytest.mark.parametrize(
    "case",
    [pytest.param(name, marks=pytest.mark.attnx_operation(operation)) for name, (operation, *_) in CASES.items()],
)
def test_first_call_in_a_fresh_interpreter(attnx_backend, case, tmp_path):
    be = attnx_backend
    path = tmp_path / "result.npy"
    command = [sys.executable, "-c", SCRIPT, be.name, be.device or "", case, str(path)]
    finished = subprocess.run(command, capture_output=True, text=True, timeout=300)
    if finished.returncode == NOT_REGISTERED:
        pytest.skip(f"{be.name} is registered in this process only: a fresh interpreter doesn't find it")
    assert finished.returncode == 0, f"the first call failed in a fresh interpreter:\n{finished.stderr[-3000:]}"
    exact = {name: rounded(data, be, F) if data.dtype.kind == "f" else data for name, data in _inputs().items()}
    expected = CASES[case][2](exact)
    # The saved result is float64 NumPy: compared as the backend's float32 array.
    assert_close(be.array(np.load(path), F), expected, be, F)
