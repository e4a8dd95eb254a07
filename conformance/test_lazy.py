"""What every lazy backend must do: build results without computing.

For backends whose :meth:`~attnx.Backend.computations` watches the
computations their library starts (Dask's does).  Each operation is called
on lazy inputs: nothing may be computed while the result is built
(``key_lengths`` derived from the data included), and the result is a lazy
array of the inputs' type.  Where the arrays are chunked (they have
``.chunks`` and ``.rechunk``, as Dask's and Cubed's do), every input is
split several ways (one chunk; chunks of 1 and of 2 along every axis), the
output of attention keeps the query's chunks, and the values equal the
same call on NumPy arrays.
"""

from __future__ import annotations

import numpy as np
import pytest
from array_api_compat import array_namespace

import attnx
from attnx_conformance.helpers import assert_close, rng

#: Elements per chunk along every axis; None: one chunk.
CHUNKINGS = [None, 1, 2]


def _watch(be):
    watch = be.backend.computations()
    if watch is None:
        pytest.skip(f"{be.name} is not lazy (it declares no computations() watch)")
    return watch


def _lazy(be, data, dtype=None, chunking=None):
    array = be.array(data, dtype) if dtype is not None else be.array(data)
    if hasattr(array, "rechunk") and hasattr(array, "chunks"):
        array = array.rechunk(-1 if chunking is None else chunking)
    elif chunking is not None:
        pytest.skip(f"{be.name}'s arrays have no chunks to split")
    return array


def _inputs(seed):
    gen = rng(90, seed)
    return {
        "query": gen.standard_normal((2, 3, 5, 4)),
        "key": gen.standard_normal((2, 3, 6, 4)),
        "value": gen.standard_normal((2, 3, 6, 3)),
        "tokens": gen.integers(1, 9, size=(2, 6)) * (np.arange(6) < np.array([[4], [6]])),
        "scores": gen.standard_normal((2, 5, 6)),
    }


def _lengths(tokens):
    # derived from the (lazy) data, never computed while building; in the
    # standard's words alone (no .sum method, no sum of booleans)
    xp = array_namespace(tokens)
    return xp.sum(xp.astype(tokens != 0, xp.int32), axis=-1)


def _sdpa(arrays, xp):
    return attnx.scaled_dot_product_attention(arrays["query"], arrays["key"], arrays["value"])


def _sdpa_masked(arrays, xp):
    lengths = _lengths(arrays["tokens"])
    return attnx.scaled_dot_product_attention(
        arrays["query"], arrays["key"], arrays["value"], key_lengths=lengths, mask=arrays["scores"][:, None] > -1
    )


def _sdpa_causal(arrays, xp):
    return attnx.scaled_dot_product_attention(arrays["query"], arrays["key"], arrays["value"], is_causal=True)


def _sdpa_weights(arrays, xp):
    lengths = _lengths(arrays["tokens"])
    return attnx.scaled_dot_product_attention(
        arrays["query"], arrays["key"], arrays["value"], key_lengths=lengths, return_weights=True
    )[1]


def _masked_softmax(arrays, xp):
    return attnx.masked_softmax(arrays["scores"], key_lengths=_lengths(arrays["tokens"]))


def _multi_head(arrays, xp):
    q = xp.reshape(xp.permute_dims(arrays["query"], (0, 2, 1, 3)), (2, 5, 12))
    k = xp.reshape(xp.permute_dims(arrays["key"], (0, 2, 1, 3)), (2, 6, 12))
    params = attnx.init_multi_head_params(12, 3, seed=1, dtype="float64", backend="numpy")
    params = {name: _convert(value, q) for name, value in params.items()}
    return attnx.multi_head_attention(q, k, k, params, num_heads=3, key_lengths=_lengths(arrays["tokens"]))


def _additive(arrays, xp):
    gen = rng(91)
    params = {
        "w_q": gen.standard_normal((4, 7)),
        "w_k": gen.standard_normal((4, 7)),
        "w_v": gen.standard_normal(7),
    }
    params = {name: _convert(value, arrays["query"]) for name, value in params.items()}
    query, key, value = (arrays[name][:, 0] for name in ("query", "key", "value"))
    return attnx.additive_attention(query, key, value, params, key_lengths=_lengths(arrays["tokens"]))


def _nadaraya_watson(arrays, xp):
    keys = xp.reshape(arrays["key"][..., 0], (-1,))
    values = xp.reshape(arrays["value"][..., 0], (-1,))
    return attnx.nadaraya_watson(keys[:7] * 0.5, keys, xp.sin(keys) + values, bandwidth=0.7)


def _causal_conv1d(arrays, xp):
    x = xp.reshape(arrays["key"], (2, 3, 24))
    return attnx.causal_conv1d(x, xp.reshape(arrays["value"][0, :, :3, :], (3, 3, 3)), dilation=2)


def _rotary(arrays, xp):
    return attnx.apply_rotary(arrays["query"])


def _from_lengths(arrays, xp):
    return attnx.masks.from_lengths(_lengths(arrays["tokens"]), 6)


def _flex(arrays, xp):
    window = attnx.create_block_mask(attnx.mods.sliding_window(2), None, None, 5, 6, block_size=2)
    return attnx.flex_attention(arrays["query"], arrays["key"], arrays["value"], attnx.mods.soft_cap(1.0), window)


OPERATIONS = {
    "flex_attention": _flex,
    "scaled_dot_product_attention": _sdpa,
    "scaled_dot_product_attention masked": _sdpa_masked,
    "scaled_dot_product_attention causal": _sdpa_causal,
    "scaled_dot_product_attention weights": _sdpa_weights,
    "masked_softmax": _masked_softmax,
    "multi_head_attention": _multi_head,
    "additive_attention": _additive,
    "nadaraya_watson": _nadaraya_watson,
    "causal_conv1d": _causal_conv1d,
    "apply_rotary": _rotary,
    "masks.from_lengths": _from_lengths,
}


def _convert(value, like):
    # Parameters made on NumPy go to the backend and device of the inputs
    # (a Dask array's device: the kind of its chunks).
    backend = attnx._registry.owner_of(like).name
    return attnx.asarray(attnx.to_numpy(value), backend=backend, device=attnx._checks.device_of(like))


@pytest.mark.attnx_operation("lazy")
@pytest.mark.parametrize("chunking", CHUNKINGS, ids=["one chunk", "chunks of 1", "chunks of 2"])
@pytest.mark.parametrize("operation", sorted(OPERATIONS))
def test_builds_without_computing(attnx_backend, operation, chunking):
    be = attnx_backend
    watch = _watch(be)
    data = _inputs(0)
    arrays = {
        name: _lazy(be, value, None if value.dtype.kind == "i" else "float64", chunking) for name, value in data.items()
    }
    build = OPERATIONS[operation]
    with watch as started:
        result = build(arrays, be.xp)
    assert started == [], f"{operation} computed {len(started)} graph(s) while building its result"
    assert type(result) is type(arrays["query"]), f"{operation} returned a {type(result).__name__}"
    assert not be.backend.is_concrete(result), f"{operation} returned a concrete array"
    with attnx.use_backend("numpy"):
        expected = build(dict(data), attnx._registry.get("numpy").xp)
    if be.dtype_name(result) == "bool":
        np.testing.assert_array_equal(be.numpy(result), attnx.to_numpy(expected))
    else:
        assert_close(result, attnx.to_numpy(expected), be, be.dtype("float64"))


@pytest.mark.attnx_operation("lazy")
@pytest.mark.parametrize("chunking", [1, 2])
def test_attention_keeps_the_query_chunks(attnx_backend, chunking):
    be = attnx_backend
    _watch(be)
    data = _inputs(1)
    query, key, value = (_lazy(be, data[name], "float64", chunking) for name in ("query", "key", "value"))
    if not hasattr(query, "chunks"):
        pytest.skip(f"{be.name}'s arrays have no chunks")
    for is_causal in (False, True):
        output = attnx.scaled_dot_product_attention(query, key, value, is_causal=is_causal)
        assert output.chunks[:-1] == query.chunks[:-1], (output.chunks, query.chunks)
