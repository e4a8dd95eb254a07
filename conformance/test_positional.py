"""Positional encodings: references and the properties that make them relative."""

from __future__ import annotations

import numpy as np
import pytest

import attnx
from attnx_conformance import reference
from attnx_conformance.helpers import assert_close, rng, rounded, tolerances

pytestmark = pytest.mark.attnx_operation("positional_encodings")


@pytest.mark.parametrize("num_positions, dim", [(1, 1), (10, 8), (7, 5), (50, 16)])
def test_sinusoidal_matches_reference(attnx_backend, num_positions, dim):
    be = attnx_backend
    for dtype in be.dtypes:
        got = attnx.sinusoidal_positions(num_positions, dim, dtype=dtype, backend=be.name)
        assert_close(got, reference.sinusoidal_positions(num_positions, dim), be, dtype)


def test_sinusoidal_relative_rotation(attnx_backend):
    be = attnx_backend
    dim, delta = 16, 5
    table = be.numpy(attnx.sinusoidal_positions(40, dim, dtype=be.dtype("float64"), backend=be.name))
    for j in range(dim // 2):
        omega = 10000.0 ** (-2 * j / dim)
        c, s = np.cos(delta * omega), np.sin(delta * omega)
        # (sin, cos)(i + delta) = [[c, s], [-s, c]] @ (sin, cos)(i)
        rotation = np.array([[c, s], [-s, c]])
        pairs = table[:, 2 * j : 2 * j + 2]
        np.testing.assert_allclose(pairs[:-delta] @ rotation.T, pairs[delta:], atol=tolerances(be)["atol"] * 10)


@pytest.mark.parametrize(
    "shape, positions",
    [
        ((5, 4), None),
        ((2, 3, 6, 8), None),
        ((3, 2), np.array([3, 0, 7])),
        ((2, 4, 6), np.array([[0, 1, 2, 3], [10, 11, 12, 13]])),
    ],
)
@pytest.mark.parametrize("interleaved", [True, False], ids=["interleaved", "halves"])
def test_rotary_matches_reference(attnx_backend, shape, positions, interleaved):
    be = attnx_backend
    x = rng(50).standard_normal(shape)
    for dtype in be.dtypes:
        pos = None if positions is None else be.array(positions)
        got = attnx.apply_rotary(be.array(x, dtype), pos, interleaved=interleaved)
        exact = be.numpy(be.array(x, dtype)).astype(np.float64)
        assert_close(got, reference.apply_rotary(exact, positions, interleaved=interleaved), be, dtype)


def test_rotary_at_far_positions(attnx_backend):
    """Positions up to 10^6: in float32 the angle p * base^(-2j/d) is off by
    p times the frequency's rounding (8e-3 rad here); attnx takes the angles
    in float64, as the reference does, where the backend has it."""
    be = attnx_backend
    if be.dtype("float64") != "float64":
        pytest.skip(f"{be.name} has no float64 here: its angles are float32's")
    positions = np.array([0, 1_000, 123_457, 999_999])
    x = rng(52).standard_normal((2, 4, 8))
    for dtype in be.dtypes:
        got = attnx.apply_rotary(be.array(x, dtype), be.array(positions))
        exact = be.numpy(be.array(x, dtype)).astype(np.float64)
        # float64's own conditioning: an angle of 10^6 rad is known to 2e-10.
        scale = 1e3 if be.dtype(dtype) == "float64" else 1.0
        assert_close(got, reference.apply_rotary(exact, positions), be, dtype, scale=scale)


def test_rotary_scores_depend_only_on_offset(attnx_backend):
    be = attnx_backend
    gen = rng(51)
    q, k = (rounded(gen.standard_normal(8), be, "float64") for _ in range(2))
    close = tolerances(be, factor=10)
    scores = {}
    for i, j in [(3, 1), (10, 8), (2, 0), (7, 7), (0, 0)]:
        qi = be.numpy(attnx.apply_rotary(be.array(q[None, :], "float64"), be.array(np.array([i]))))
        kj = be.numpy(attnx.apply_rotary(be.array(k[None, :], "float64"), be.array(np.array([j]))))
        scores[(i, j)] = float(qi[0] @ kj[0])
    # The rotation pairs adjacent features (x_{2j}, x_{2j+1}) at angle p * 10000^(-2j/d).
    rotated = be.numpy(attnx.apply_rotary(be.array(q[None, :], "float64"), be.array(np.array([3]))))[0]
    for j in range(4):
        angle = 3 * 10000.0 ** (-2 * j / 8)
        c, s = np.cos(angle), np.sin(angle)
        pair = q[2 * j : 2 * j + 2]
        np.testing.assert_allclose(
            rotated[2 * j : 2 * j + 2], [c * pair[0] - s * pair[1], s * pair[0] + c * pair[1]], **close
        )
    same = {"rel": close["rtol"], "abs": close["atol"]}
    assert scores[(3, 1)] == pytest.approx(scores[(10, 8)], **same) == pytest.approx(scores[(2, 0)], **same)
    assert scores[(7, 7)] == pytest.approx(scores[(0, 0)], **same) == pytest.approx(float(q @ k), **same)
    assert abs(scores[(3, 1)] - scores[(0, 0)]) > 1e-6


def test_rotary_rejects_odd_width(attnx_backend):
    be = attnx_backend
    with pytest.raises(ValueError, match=r"apply_rotary: x must have an even number of features d, got shape \(3, 5\)"):
        attnx.apply_rotary(be.array(np.zeros((3, 5)), "float32"))
    with pytest.raises(TypeError, match=r"apply_rotary: interleaved must be True or False, got 'no'"):
        attnx.apply_rotary(be.array(np.zeros((3, 4)), "float32"), interleaved="no")


def test_learned_positions_same_numbers_everywhere(attnx_backend):
    be = attnx_backend
    ours = attnx.LearnedPositions(12, 4, seed=9, dtype=be.dtype("float64"), backend=be.name, device=be.device)
    theirs = attnx.LearnedPositions(12, 4, seed=9, dtype="float64", backend="numpy")
    np.testing.assert_array_equal(be.numpy(ours.table), theirs.table.astype(be.numpy(ours.table).dtype))
    index = np.array([[0, 11], [5, 5]])
    got = ours(be.array(index))
    assert_close(got, theirs.table[index], be, "float64")
    assert_close(ours(3), theirs.table[:3], be, "float64")


def test_learned_positions_refuse_what_is_not_a_position(attnx_backend):
    be = attnx_backend
    positions = attnx.LearnedPositions(4, 3, backend=be.name, device=be.device)
    with pytest.raises(TypeError, match="LearnedPositions: positions must be an int n or an integer array, got True"):
        positions(True)
    with pytest.raises(TypeError, match="LearnedPositions: positions must be integers, got dtype float32"):
        positions(be.array(np.array([1.0]), "float32"))
    if not be.lazy:  # lazy values are read only when computed
        with pytest.raises(
            ValueError, match=r"LearnedPositions: positions must lie in \[0, 4\), got values from -1 to 2"
        ):
            positions(be.array(np.array([-1, 2])))
