"""Dask arrays whose chunks are CuPy arrays (GPU workers): each operation
computes CuPy chunks equal to the same call on the CuPy arrays themselves.

Needs a GPU: skipped, with the reason, where CuPy or a device is missing
(run by ``bash bench/gpu_session.sh checks`` on a lent GPU).
"""

from __future__ import annotations

import numpy as np
import pytest

import attnx

da = pytest.importorskip("dask.array")
cp = pytest.importorskip("cupy", reason="cupy is not installed: Dask arrays of CuPy chunks need a GPU")
try:
    DEVICES = cp.cuda.runtime.getDeviceCount()
except Exception as exc:  # CUDARuntimeError without a driver
    pytest.skip(f"no usable CUDA device: {exc}", allow_module_level=True)
if not DEVICES:
    pytest.skip("no CUDA device found", allow_module_level=True)


def _lazy(array):
    """The array in Dask chunks of about half of each axis, CuPy inside."""
    return da.from_array(array, chunks=tuple(max(1, size // 2) for size in array.shape), asarray=False)


def _arrays():
    gen = np.random.default_rng(0)
    q, k, v = (cp.asarray(gen.standard_normal((2, 4, 64, 16))) for _ in range(3))
    return {
        "q": q,
        "k": k,
        "v": v,
        "lengths": cp.asarray([40, 64]),
        "query_lengths": cp.asarray(gen.integers(0, 65, size=(2, 4, 64))),
        "mask": cp.asarray(gen.random((64, 64)) < 0.8),
        "bias": cp.asarray(gen.standard_normal((64, 64))),
        "x": cp.asarray(gen.standard_normal((2, 64, 32))),
        "signal": cp.asarray(gen.standard_normal((2, 3, 64))),
        "weight": cp.asarray(gen.standard_normal((5, 3, 3))),
        "points": cp.asarray(gen.standard_normal((64, 2))),
        "targets": cp.asarray(gen.standard_normal(64)),
    }


MULTI_HEAD = dict(d_model=32, num_heads=4, dtype="float64", backend="cupy")
ADDITIVE = {"w_q": (16, 8), "w_k": (16, 8), "w_v": (8,)}

#: name -> (the call, the arrays it takes by name, parameters made on CuPy)
CASES = {
    "sdpa": (lambda q, k, v: attnx.scaled_dot_product_attention(q, k, v), "q k v"),
    "sdpa causal": (lambda q, k, v: attnx.scaled_dot_product_attention(q, k, v, is_causal=True), "q k v"),
    "sdpa boolean mask": (lambda q, k, v, mask: attnx.scaled_dot_product_attention(q, k, v, mask=mask), "q k v mask"),
    "sdpa additive mask": (lambda q, k, v, bias: attnx.scaled_dot_product_attention(q, k, v, mask=bias), "q k v bias"),
    "sdpa key_lengths": (
        lambda q, k, v, lengths: attnx.scaled_dot_product_attention(q, k, v, key_lengths=lengths),
        "q k v lengths",
    ),
    "sdpa key_lengths per query, causal": (
        lambda q, k, v, query_lengths: attnx.scaled_dot_product_attention(
            q, k, v, key_lengths=query_lengths, is_causal=True
        ),
        "q k v query_lengths",
    ),
    "sdpa key_lengths per query": (
        lambda q, k, v, query_lengths: attnx.scaled_dot_product_attention(q, k, v, key_lengths=query_lengths),
        "q k v query_lengths",
    ),
    "sdpa weights": (
        lambda q, k, v: attnx.scaled_dot_product_attention(q, k, v, return_weights=True)[1],
        "q k v",
    ),
    "sdpa weights, key_lengths": (
        lambda q, k, v, lengths: attnx.scaled_dot_product_attention(q, k, v, key_lengths=lengths, return_weights=True)[
            1
        ],
        "q k v lengths",
    ),
    "masked_softmax": (lambda bias, mask: attnx.masked_softmax(bias, mask=mask), "bias mask"),
    "multi_head_attention": (
        lambda x, params: attnx.multi_head_attention(x, x, x, params, num_heads=4),
        "x",
    ),
    "multi_head_attention causal": (
        lambda x, params: attnx.multi_head_attention(x, x, x, params, num_heads=4, is_causal=True),
        "x",
    ),
    "additive_attention": (lambda q, k, v, params: attnx.additive_attention(q, k, v, params), "q k v"),
    "nadaraya_watson": (lambda points, targets: attnx.nadaraya_watson(points, points, targets), "points targets"),
    "nadaraya_watson boxcar": (
        lambda points, targets: attnx.nadaraya_watson(points, points, targets, kernel="boxcar", bandwidth=2.0),
        "points targets",
    ),
    "causal_conv1d": (lambda signal, weight: attnx.causal_conv1d(signal, weight, dilation=2), "signal weight"),
    "apply_rotary": (lambda q: attnx.apply_rotary(q), "q"),
    "flex_attention, sliding window": (
        lambda q, k, v: attnx.flex_attention(q, k, v, block_mask=_window(q)),
        "q k v",
    ),
    "flex_attention, soft cap": (
        lambda q, k, v: attnx.flex_attention(q, k, v, attnx.mods.soft_cap(5.0)),
        "q k v",
    ),
}


def _window(query):
    """A sliding window's block mask, made on the query's backend."""
    backend = "dask" if isinstance(query, da.Array) else "cupy"
    return attnx.create_block_mask(attnx.mods.sliding_window(8), None, None, 64, 64, block_size=16, backend=backend)


def _params(name):
    if name.startswith("multi_head_attention"):
        return attnx.init_multi_head_params(**MULTI_HEAD)
    if name == "additive_attention":
        gen = np.random.default_rng(1)
        return {key: cp.asarray(gen.standard_normal(shape)) for key, shape in ADDITIVE.items()}
    return None


@pytest.mark.parametrize("case", sorted(CASES))
def test_dask_arrays_of_cupy_chunks_compute_what_cupy_does(case):
    function, names = CASES[case]
    arrays = _arrays()
    eager = [arrays[name] for name in names.split()]
    params = _params(case)
    extra_eager = () if params is None else (params,)
    extra_lazy = () if params is None else ({key: _lazy(value) for key, value in params.items()},)
    expected = function(*eager, *extra_eager)
    result = function(*(_lazy(a) for a in eager), *extra_lazy)
    assert isinstance(result, da.Array)
    computed = result.compute(scheduler="synchronous")  # a failing task's traceback reaches attnx's frames
    assert isinstance(computed, cp.ndarray), f"{case}: chunks of {type(computed).__module__}"
    np.testing.assert_allclose(cp.asnumpy(computed), cp.asnumpy(expected), rtol=1e-10, atol=1e-12)


def test_dask_lists_cupy_chunks_as_a_device_and_makes_them():
    """``device="cupy"`` of the Dask backend: arrays of CuPy chunks, made by
    attnx.asarray as a user would, and brought back by attnx.to_numpy."""
    assert "cupy" in [str(device) for device in attnx._registry.get("dask").devices()]
    data = np.arange(6.0).reshape(2, 3)
    lazy = attnx.asarray(data, backend="dask", device="cupy")
    assert isinstance(lazy, da.Array) and isinstance(lazy.compute(), cp.ndarray)
    np.testing.assert_array_equal(attnx.to_numpy(lazy), data)


def test_chunks_of_two_kinds_are_refused_before_computing():
    arrays = _arrays()
    q, k, v = (_lazy(arrays[name]) for name in "qkv")
    on_host = da.from_array(cp.asnumpy(arrays["mask"]), chunks=32)
    with pytest.raises(ValueError, match=r"inputs lie on two devices: query on cupy but mask on cpu"):
        attnx.scaled_dot_product_attention(q, k, v, mask=on_host)
