"""nadaraya_watson against the kernel-by-kernel reference."""

from __future__ import annotations

import numpy as np
import pytest
from array_api_compat import array_namespace
from hypothesis import given
from hypothesis import strategies as st

import attnx
from attnx_conformance import reference
from attnx_conformance.helpers import PROPERTY_SETTINGS, assert_close, rng, rounded, tolerances, under_budget

pytestmark = pytest.mark.attnx_operation("nadaraya_watson")


def _inputs(seed, d, d_v, far):
    """7 queries and 20 keys of ``d`` features (scalars where None), values
    of width ``d_v``; the query ``far`` far from every key (zeros for the
    compact kernels)."""
    gen = rng(seed)
    keys = gen.uniform(0, 5, (20,) if d is None else (20, d))
    queries = gen.uniform(-1, 6, (7,) if d is None else (7, d))
    queries[far] = 100.0
    values = gen.standard_normal((20,) if d_v is None else (20, d_v))
    return queries, keys, values


@pytest.mark.parametrize("kernel", ["gaussian", "boxcar", "epanechnikov"])
@pytest.mark.parametrize("d, d_v", [(None, None), (None, 3), (2, None), (3, 2), (20, 2)])
def test_matches_reference(attnx_backend, kernel, d, d_v):
    _assert_weights_match_reference(attnx_backend, _inputs(40, d, d_v, far=0), kernel)


def _assert_weights_match_reference(be, inputs, kernel, budget=None):
    """Estimates and weights (``return_weights=True``) as the reference's, in
    each of the backend's dtypes, under ``budget`` if given; the far query
    (the first) left out for the gaussian, whose reference underflows."""
    for dtype in be.dtypes:
        args = [be.array(a, dtype) for a in inputs]
        with under_budget(budget):
            out, w = attnx.nadaraya_watson(*args, kernel=kernel, bandwidth=0.7, return_weights=True)
        exact = [rounded(a, be, dtype) for a in inputs]
        expected, expected_w = reference.nadaraya_watson(*exact, kernel=kernel, bandwidth=0.7)
        if kernel == "gaussian":  # the reference underflows far away; attnx's softmax doesn't
            out, w, expected, expected_w = out[1:, ...], w[1:, ...], expected[1:], expected_w[1:]
        assert_close(out, expected, be, dtype, scale=10)
        assert_close(w, expected_w, be, dtype)


@pytest.mark.parametrize("kernel", ["gaussian", "boxcar", "epanechnikov"])
@pytest.mark.parametrize("d, d_v", [(None, None), (2, 3), (20, None)])
def test_estimates_in_chunks_of_queries_match_reference(attnx_backend, kernel, d, d_v):
    """Under a budget of 480 bytes the 7 queries' kernels, 160 bytes a query
    in float64 (20 keys; 3,200 with 20 features, a difference each), go in
    chunks of 3 (of 6 in float32; of 1 with 20 features), the last shorter:
    each estimate as the reference's, the far query's included."""
    be = attnx_backend
    queries, keys, values = _inputs(41, d, d_v, far=5)
    for dtype in be.dtypes:
        args = [be.array(a, dtype) for a in (queries, keys, values)]
        with under_budget(480):
            out = attnx.nadaraya_watson(*args, kernel=kernel, bandwidth=0.7)
        exact = [rounded(a, be, dtype) for a in (queries, keys, values)]
        expected, _ = reference.nadaraya_watson(*exact, kernel=kernel, bandwidth=0.7)
        if kernel == "gaussian":  # the reference's weights underflow far away: its softmax, shifted
            scores = -0.5 * (np.linalg.norm((exact[1] - exact[0][5]).reshape(20, -1), axis=-1) / 0.7) ** 2
            weights = np.exp(scores - scores.max())
            expected[5] = np.tensordot(weights / weights.sum(), exact[2], axes=(0, 0))
        assert_close(out, expected, be, dtype, scale=10)


@pytest.mark.parametrize("kernel", ["gaussian", "boxcar", "epanechnikov"])
@pytest.mark.parametrize("d, d_v", [(None, None), (2, 3), (20, None)])
def test_weights_in_chunks_of_queries_match_reference(attnx_backend, kernel, d, d_v):
    """With the weights returned, the same budget cuts the queries into the
    same chunks (each chunk's kernel made and normalised alone): weights and
    estimates as the reference's."""
    _assert_weights_match_reference(attnx_backend, _inputs(42, d, d_v, far=0), kernel, budget=480)


@PROPERTY_SETTINGS
@given(
    n=st.integers(1, 9),
    m=st.integers(0, 9),
    features=st.sampled_from([None, 1, 3, 18]),
    d_v=st.sampled_from([None, 2]),
    kernel=st.sampled_from(["gaussian", "boxcar", "epanechnikov"]),
    budget=st.sampled_from([8, 100, 700]),
    seed=st.integers(0, 2**32 - 1),
)
def test_estimates_do_not_depend_on_the_chunks(attnx_backend, n, m, features, d_v, kernel, budget, seed):
    """Queries in chunks of any size (a budget of 8 bytes: one query a
    chunk), no keys at all included, give the estimates (and the weights)
    of one chunk."""
    be = attnx_backend
    gen = np.random.default_rng(seed)
    shape = (lambda rows: (rows,)) if features is None else (lambda rows: (rows, features))
    queries, keys = gen.uniform(-2, 2, shape(n)), gen.uniform(-2, 2, shape(m))
    values = gen.standard_normal((m,) if d_v is None else (m, d_v))
    args = [be.array(a, "float64") for a in (queries, keys, values)]
    whole = attnx.nadaraya_watson(*args, kernel=kernel, bandwidth=0.6)
    whole_weights = attnx.nadaraya_watson(*args, kernel=kernel, bandwidth=0.6, return_weights=True)
    with under_budget(budget):
        chunked = attnx.nadaraya_watson(*args, kernel=kernel, bandwidth=0.6)
        chunked_weights = attnx.nadaraya_watson(*args, kernel=kernel, bandwidth=0.6, return_weights=True)
    np.testing.assert_allclose(be.numpy(chunked), be.numpy(whole), **tolerances(be))
    for got, expected in zip(chunked_weights, whole_weights):  # the estimate, then the weights
        np.testing.assert_allclose(be.numpy(got), be.numpy(expected), **tolerances(be))


@pytest.mark.parametrize("kernel, expected", [("boxcar", [0.5, 0.5, 0.0]), ("epanechnikov", [1.0, 0.0, 0.0])])
def test_compact_kernels_at_exactly_one_bandwidth(attnx_backend, kernel, expected):
    """A key exactly one bandwidth away is inside the boxcar (|u| <= 1) and at
    the epanechnikov kernel's zero."""
    be = attnx_backend
    for dtype in be.dtypes:
        queries, keys, values = (be.array(a, dtype) for a in ([0.0], [0.0, 0.5, 1.5], [1.0, 3.0, 7.0]))
        estimate, weights = attnx.nadaraya_watson(
            queries, keys, values, kernel=kernel, bandwidth=0.5, return_weights=True
        )
        assert_close(weights, np.array([expected]), be, dtype)
        assert_close(estimate, np.array([np.dot(expected, [1.0, 3.0, 7.0])]), be, dtype)


def triangle_kernel(u):
    """``max(0, 1 - u)``, a user's kernel.  It takes its namespace from
    ``u``: a lazy backend's natives call it on their chunks (NumPy's,
    CuPy's), not on the backend's arrays.  In the standard's oldest words
    (operators and ``astype``): a one-sided ``clip`` is 2023.12's, which
    some libraries lack."""
    return (1.0 - u) * array_namespace(u).astype(u < 1.0, u.dtype)


def test_callable_kernel_and_learned_width(attnx_backend):
    be = attnx_backend
    gen = rng(41)
    keys = np.sort(gen.uniform(0, 5, 30))
    values = 2 * np.sin(keys) + keys**0.8
    queries = np.linspace(0, 5, 6)
    out = attnx.nadaraya_watson(
        *(be.array(a, "float64") for a in (queries, keys, values)), kernel=triangle_kernel, bandwidth=0.5
    )
    expected, _ = reference.nadaraya_watson(queries, keys, values, kernel=lambda u: max(0.0, 1 - u), bandwidth=0.5)
    assert_close(out, expected, be, "float64")
    w = 1.7  # softmax(-((q - k) w)^2 / 2) is the gaussian kernel with bandwidth 1/w
    scores = -(((queries[:, None] - keys[None, :]) * w) ** 2) / 2
    expected = reference.softmax(scores) @ values
    out = attnx.nadaraya_watson(
        *(be.array(a, "float64") for a in (queries, keys, values)), bandwidth=be.array(np.array(1 / w), "float64")
    )
    assert_close(out, expected, be, "float64")


def test_a_query_far_from_every_key_gets_the_nearest_key_s_value(attnx_backend):
    """The gaussian reaches every key: far away the nearest one dominates (a
    softmax of -u^2 / 2), in half precision too, whose squared distances
    overflow past 256 (it is computed in float32)."""
    be = attnx_backend
    queries, keys, values = np.array([0.3, 50.0, 500.0]), np.linspace(0, 1, 5), np.arange(5.0)
    for dtype in be.dtypes:
        q, k, v = (rounded(a, be, dtype) for a in (queries, keys, values))
        expected = reference.softmax(-((q[:, None] - k[None, :]) ** 2) / 2) @ v
        assert np.allclose(expected[1:], 4.0)
        for return_weights in (False, True):
            got = attnx.nadaraya_watson(
                *(be.array(a, dtype) for a in (queries, keys, values)), return_weights=return_weights
            )
            estimate = got[0] if return_weights else got
            assert be.dtype_name(estimate) == dtype
            assert_close(estimate, expected, be, dtype)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # NumPy's, on the way to -inf
@pytest.mark.parametrize("d", [None, 2])
def test_a_bandwidth_past_the_float_range_gives_the_nearest_key_s_value(attnx_backend, d):
    """The gaussian's limit as the bandwidth shrinks: the nearest key's value,
    the mean of the nearest where keys tie.  Here every squared scaled
    distance is past the float range (1e58 in float32, 1e398 in float64),
    so a softmax of ``-(d / b)^2 / 2`` as written would see ``-inf``
    everywhere."""
    be = attnx_backend
    keys = np.array([0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0])
    queries = np.array([0.25, 1.5, 5.875, 3.0, -4.0])  # 1.5: two keys tie
    values = np.arange(16.0).reshape(8, 2) ** 1.5
    if d is not None:  # the same distances, along a diagonal
        keys, queries = (np.stack([a / np.sqrt(2)] * d, axis=-1) for a in (keys, queries))
    for dtype in be.dtypes:
        q, k, v = (rounded(a, be, dtype) for a in (queries, keys, values))
        distances = np.abs(q[:, None] - k[None, :]) if d is None else np.linalg.norm(q[:, None] - k[None, :], axis=-1)
        nearest = distances == distances.min(axis=1, keepdims=True)
        expected = (nearest @ v) / nearest.sum(axis=1, keepdims=True)
        bandwidth = 1e-200 if dtype == "float64" else 1e-30
        for return_weights in (False, True):
            got = attnx.nadaraya_watson(
                *(be.array(a, dtype) for a in (queries, keys, values)),
                bandwidth=bandwidth,
                return_weights=return_weights,
            )
            assert_close(got[0] if return_weights else got, expected, be, dtype)
            if return_weights:
                assert_close(got[1], nearest / nearest.sum(axis=1, keepdims=True), be, dtype)


def test_bad_input(attnx_backend):
    be = attnx_backend
    keys = be.array(np.zeros((5, 2)), "float64")
    with pytest.raises(ValueError, match=r"nadaraya_watson: queries must have shape \(n, 2\)"):
        attnx.nadaraya_watson(be.array(np.zeros(3), "float64"), keys, be.array(np.zeros(5), "float64"))
    with pytest.raises(ValueError, match="bandwidth must be positive"):
        attnx.nadaraya_watson(
            be.array(np.zeros((3, 2)), "float64"), keys, be.array(np.zeros(5), "float64"), bandwidth=0
        )
    for bandwidth in (float("inf"), float("nan")):
        with pytest.raises(ValueError, match="bandwidth must be positive and finite"):
            attnx.nadaraya_watson(
                be.array(np.zeros((3, 2)), "float64"), keys, be.array(np.zeros(5), "float64"), bandwidth=bandwidth
            )
    # 0 and inf in float32: a query on a key would get 0 / 0.
    for bandwidth in (1e-50, 1e300):
        with pytest.raises(ValueError, match=r"bandwidth must be finite and normal in float32, .*, got 1e"):
            attnx.nadaraya_watson(
                *(be.array(np.zeros(shape), "float32") for shape in ((3, 2), (5, 2), (5,))), bandwidth=bandwidth
            )
    with pytest.raises(ValueError, match="kernel must be one of"):
        attnx.nadaraya_watson(
            be.array(np.zeros((3, 2)), "float64"), keys, be.array(np.zeros(5), "float64"), kernel="cauchy"
        )


def test_callable_kernels_are_tried_before_the_call(attnx_backend):
    """A callable kernel is tried on a few scaled distances first: one that
    doesn't give weights (an array of the distances' shape, non-negative and
    finite) is named before anything is computed."""
    be = attnx_backend
    data = [be.array(np.linspace(0, 1, size), "float32") for size in (3, 5, 5)]
    with pytest.raises(ValueError, match=r"kernel must return an array of the distances' own shape.*\(1, 3\)"):
        attnx.nadaraya_watson(*data, kernel=lambda u: u[:1, :])
    with pytest.raises(TypeError, match=r"kernel must return an array of the '.*' backend, got builtins.list"):
        attnx.nadaraya_watson(*data, kernel=lambda u: [1.0])
    with pytest.raises(TypeError, match="kernel failed on scaled distances .* ZeroDivisionError"):
        attnx.nadaraya_watson(*data, kernel=lambda u: 1 / 0)
    with pytest.raises(TypeError, match="bandwidth must be a positive float or a 0-d array, got True"):
        attnx.nadaraya_watson(*data, bandwidth=True)
    if be.lazy:  # lazy values are read only when computed
        return
    with pytest.raises(ValueError, match=r"kernel must return non-negative, finite values.*-3\.0"):
        attnx.nadaraya_watson(*data, kernel=lambda u: 1.0 - u * u)  # Epanechnikov without its clip
    with pytest.raises(ValueError, match=r"bandwidth must be positive, got -0\.5"):
        attnx.nadaraya_watson(*data, bandwidth=be.array(np.array(-0.5), "float32"))
