"""Traced and vectorized operations equal eager ones, for backends that
declare how to trace (:meth:`attnx.Backend.trace`: ``jax.jit``,
``torch.compile``) and how to vectorize (:meth:`attnx.Backend.vectorize`:
``jax.vmap``, ``torch.func.vmap``).

Masks, ``key_lengths`` and a 0-d ``scale`` go in as traced arguments, never
as constants: their values are unknown while tracing, so attnx must neither
read them nor branch on them.
"""

from __future__ import annotations

import numpy as np
import pytest

import attnx
from attnx_conformance import reference
from attnx_conformance.helpers import rng, rounded, tolerances, under_budget

pytestmark = pytest.mark.attnx_operation("transforms")


def _require(be, capability):
    """Skip, before any input is built, where the backend declares no
    tracer (``trace``) or vectorizing map (``vectorize``): an unrelated
    failure must not show as a failure of transforms it never had."""
    if getattr(be.backend, capability)(lambda x: x) is None:
        pytest.skip(f"{be.name} declares no {'tracer' if capability == 'trace' else 'vectorizing map'}")


def _traced(be, function):
    traced = be.backend.trace(function)
    if traced is None:
        pytest.skip(f"{be.name} declares no tracer")
    return traced


def _vectorized(be, function):
    vectorized = be.backend.vectorize(function)
    if vectorized is None:
        pytest.skip(f"{be.name} declares no vectorizing map")
    return vectorized


def _same(be, got, expected, factor=1.0):
    np.testing.assert_allclose(
        be.numpy(got).astype(np.float64), np.asarray(expected, np.float64), **tolerances(be, factor=factor)
    )


def _sdpa_inputs(be, batch=2, n=5, m=7):
    gen = rng(90, n, m)
    data = {
        "query": gen.standard_normal((batch, 3, n, 4)),
        "key": gen.standard_normal((batch, 3, m, 4)),
        "value": gen.standard_normal((batch, 3, m, 2)),
    }
    mask = gen.random((batch, 1, n, m)) < 0.7
    lengths = np.array([m, 2, 0, 4][:batch])
    return data, mask, lengths


SDPA_CASES = {
    "plain": {},
    "causal": {"is_causal": True},
    "mask": {"mask": True},
    "additive mask": {"mask": "additive"},
    "key_lengths": {"key_lengths": True},
    "scale array": {"scale": True},
    "all, chunked": {"mask": True, "key_lengths": True, "scale": True, "is_causal": True, "chunk_size": (2, 3)},
    "weights": {"mask": True, "key_lengths": True, "return_weights": True},
}


@pytest.mark.parametrize("case", list(SDPA_CASES))
def test_traced_sdpa_equals_eager_and_reference(attnx_backend, case):
    _require(attnx_backend, "trace")
    be = attnx_backend
    spec = SDPA_CASES[case]
    dtype = be.dtype("float64")
    data, mask, lengths = _sdpa_inputs(be)
    arrays = {name: be.array(value, dtype) for name, value in data.items()}
    if spec.get("mask") == "additive":
        mask_array = be.array(np.where(mask, 0.5, -np.inf), dtype)
    elif spec.get("mask"):
        mask_array = be.array(mask)
    else:
        mask_array = None
    lengths_array = be.array(lengths) if spec.get("key_lengths") else None
    scale_array = be.array(np.asarray(0.4), dtype) if spec.get("scale") else None
    options = {k: spec[k] for k in ("is_causal", "chunk_size", "return_weights") if k in spec}

    def attend(query, key, value, mask, key_lengths, scale):
        return attnx.scaled_dot_product_attention(
            query, key, value, mask=mask, key_lengths=key_lengths, scale=scale, **options
        )

    args = (arrays["query"], arrays["key"], arrays["value"], mask_array, lengths_array, scale_array)
    eager = attend(*args)
    traced = _traced(be, attend)(*args)
    returns_weights = options.get("return_weights", False)
    for got, want in zip(traced if returns_weights else [traced], eager if returns_weights else [eager]):
        assert be.backend.owns(got)
        _same(be, got, be.numpy(want))
    n, m = data["query"].shape[-2], data["key"].shape[-2]
    allowed = reference.allowed_mask(
        n,
        m,
        batch_shape=(2, 3),
        key_lengths=lengths if lengths_array is not None else None,
        lengths_per="batch",
        mask=mask if spec.get("mask") is True else None,
        is_causal=options.get("is_causal", False),
    )
    additive = np.where(mask, 0.5, -np.inf) if spec.get("mask") == "additive" else None
    q, k, v = (rounded(data[name], be, dtype) for name in ("query", "key", "value"))
    expected, _ = reference.scaled_dot_product_attention(
        q, k, v, allowed=allowed, additive=additive, scale=0.4 if scale_array is not None else None
    )
    _same(be, traced[0] if returns_weights else traced, expected, factor=10)


def _family(be, dtype):
    """Each public operation but SDPA, as a function of arrays only (what a
    tracer gets), with its arguments."""
    gen = rng(91)
    x = be.array(gen.standard_normal((2, 5, 8)), dtype)
    mha_params = attnx.init_multi_head_params(
        8, 2, num_kv_heads=1, seed=1, dtype=dtype, backend=be.name, device=be.device
    )
    add_params = {
        "w_q": be.array(gen.standard_normal((8, 6)), dtype),
        "w_k": be.array(gen.standard_normal((8, 6)), dtype),
        "w_v": be.array(gen.standard_normal(6), dtype),
    }
    lengths = be.array(np.array([5, 2]))
    # A sliding window of 3 keys in blocks of 2 (empty, full and partial
    # ones), made outside the traced function as a user makes it.
    window = attnx.create_block_mask(
        attnx.mods.sliding_window(3), None, None, 7, 7, block_size=2, backend=be.name, device=be.device
    )
    heads = tuple(be.array(gen.standard_normal((2, 2, 7, 4)), dtype) for _ in range(3))
    return {
        "multi_head_attention": (
            lambda x, lengths, w_q: attnx.multi_head_attention(
                x, x, x, {**mha_params, "w_q": w_q}, num_heads=2, num_kv_heads=1, key_lengths=lengths, is_causal=True
            ),
            (x, lengths, mha_params["w_q"]),
        ),
        "additive_attention": (
            lambda x, lengths: attnx.additive_attention(x, x, x, add_params, key_lengths=lengths),
            (x, lengths),
        ),
        # Under a budget (BUDGETS), through the backend's map_chunks.
        "additive_attention, queries in chunks": (
            lambda x, lengths: attnx.additive_attention(x, x, x, add_params, key_lengths=lengths),
            (x, lengths),
        ),
        "flex_attention": (
            lambda q, k, v: attnx.flex_attention(q, k, v, score_mod=attnx.mods.soft_cap(2.0), block_mask=window),
            heads,
        ),
        "masked_softmax": (lambda x, lengths: attnx.masked_softmax(x, key_lengths=lengths), (x, lengths)),
        "nadaraya_watson": (
            lambda q, k, v: attnx.nadaraya_watson(q, k, v, bandwidth=0.7),
            tuple(be.array(gen.standard_normal(s), dtype) for s in (4, 9, 9)),
        ),
        # Under a budget (BUDGETS), through the backend's map_chunks.
        "nadaraya_watson, queries in chunks": (
            lambda q, k, v: attnx.nadaraya_watson(q, k, v, bandwidth=0.7),
            tuple(be.array(gen.standard_normal(s), dtype) for s in ((5, 2), (9, 2), (9, 3))),
        ),
        # The weights, in the same chunks (BUDGETS).
        "nadaraya_watson, weights in chunks": (
            lambda q, k, v: attnx.nadaraya_watson(q, k, v, bandwidth=0.7, return_weights=True)[1],
            tuple(be.array(gen.standard_normal(s), dtype) for s in ((5, 2), (9, 2), (9, 3))),
        ),
        "apply_rotary": (
            lambda x, positions: attnx.apply_rotary(x, positions),
            (x, be.array(np.array([3, 0, 7, 1, 2]))),
        ),
        "causal_conv1d": (
            lambda x, w, b: attnx.causal_conv1d(x, w, b, dilation=2),
            (
                be.array(gen.standard_normal((2, 3, 9)), dtype),
                be.array(gen.standard_normal((4, 3, 2)), dtype),
                be.array(gen.standard_normal(4), dtype),
            ),
        ),
    }


#: Cases run under a memory budget of so many bytes.  Additive attention's
#: queries take 480 bytes each in float64 (2 x 5 keys x h = 6): its 5 queries
#: go in chunks of 2 (of 4 in float32), the last shorter, through the
#: backend's map_chunks (a traced loop where it overrides it).  Nadaraya-
#: Watson's take 72 bytes each in float64 (9 keys): its 5 queries go in
#: chunks of 2 the same way, with the weights returned too.
BUDGETS = {
    "additive_attention, queries in chunks": 960,
    "nadaraya_watson, queries in chunks": 144,
    "nadaraya_watson, weights in chunks": 144,
}

OPERATIONS = [
    "multi_head_attention",
    "additive_attention",
    "additive_attention, queries in chunks",
    "flex_attention",
    "masked_softmax",
    "nadaraya_watson",
    "nadaraya_watson, queries in chunks",
    "nadaraya_watson, weights in chunks",
    "apply_rotary",
    "causal_conv1d",
]


@pytest.mark.parametrize("operation", OPERATIONS)
def test_traced_operation_equals_eager(attnx_backend, operation):
    _require(attnx_backend, "trace")
    be = attnx_backend
    function, args = _family(be, be.dtype("float64"))[operation]
    with under_budget(BUDGETS.get(operation)):
        eager = function(*args)
        traced = _traced(be, function)(*args)
    _same(be, traced, be.numpy(eager))


@pytest.mark.parametrize("chunk_size", [None, (2, 3)], ids=["plain", "chunked"])
def test_vectorized_sdpa_equals_a_loop(attnx_backend, chunk_size):
    """Each example with its own mask, key lengths and scale."""
    _require(attnx_backend, "vectorize")
    be = attnx_backend
    dtype = be.dtype("float64")
    data, mask, lengths = _sdpa_inputs(be, batch=4)
    scales = np.array([0.3, 0.5, 0.7, 1.1])

    def attend(query, key, value, mask, key_lengths, scale):
        return attnx.scaled_dot_product_attention(
            query, key, value, mask=mask, key_lengths=key_lengths, scale=scale, is_causal=True, chunk_size=chunk_size
        )

    args = [be.array(data[name], dtype) for name in ("query", "key", "value")]
    args += [be.array(mask), be.array(lengths), be.array(scales, dtype)]
    vectorized = _vectorized(be, attend)(*args)
    for i in range(4):
        one = attend(
            *(be.array(data[name][i], dtype) for name in ("query", "key", "value")),
            be.array(mask[i]),
            be.array(lengths[i]),
            be.array(scales[i], dtype),
        )
        _same(be, vectorized[i], be.numpy(one))


@pytest.mark.parametrize("operation", OPERATIONS)
def test_vectorized_operation_equals_a_loop(attnx_backend, operation):
    _require(attnx_backend, "vectorize")
    be = attnx_backend
    function, args = _family(be, be.dtype("float64"))[operation]
    batch = 2
    stacked = [be.array(np.stack([be.numpy(a)] * batch)) for a in args]
    with under_budget(BUDGETS.get(operation)):
        vectorized = _vectorized(be, function)(*stacked)
        expected = be.numpy(function(*args))
    for i in range(batch):
        _same(be, vectorized[i], expected)


def test_gradients_reach_a_traced_scale(attnx_backend):
    """A 0-d ``scale`` is a differentiable input like the others, traced or not."""
    _require(attnx_backend, "trace")
    be = attnx_backend
    if not be.backend.supports_autograd:
        pytest.skip(f"{be.name} does not declare autograd")
    dtype = be.dtype("float64")
    data, mask, lengths = _sdpa_inputs(be)
    args = [be.array(data[name], dtype) for name in ("query", "key", "value")] + [be.array(np.asarray(0.4), dtype)]
    mask, lengths = be.array(mask), be.array(lengths)  # closed over: constants of the trace

    def attend(query, key, value, scale):
        return attnx.scaled_dot_product_attention(
            query, key, value, mask=mask, key_lengths=lengths, scale=scale, is_causal=True
        )

    eager = be.backend.gradients(attend, args)
    traced = be.backend.gradients(_traced(be, attend), args)
    assert len(traced) == 4 and all(g is not None for g in traced)
    assert float(be.numpy(eager[3])) != 0.0
    for got, want in zip(traced, eager):
        _same(be, got, be.numpy(want), factor=10)
