"""Plans (``attnx._plans``): a call's signature is checked once, then runs
the backend's plan.  The torch backend is the one that makes plans."""

from __future__ import annotations

import gc
import logging
import math
import weakref

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attnx
from attnx import _dispatch, _plans
from attnx._registry import registry

torch = pytest.importorskip("torch")
from attnx_backends.torch_backend import TorchBackend  # noqa: E402

SDPA = attnx.scaled_dot_product_attention


@pytest.fixture(autouse=True)
def no_plans():
    registry._plans.clear()
    yield
    registry._plans.clear()


def _tensors(leading=(1, 2), n=5, m=5, d_k=4, d_v=3, dtype=torch.float32, seed=0):
    generator = torch.Generator().manual_seed(seed)
    shapes = ((*leading, n, d_k), (*leading, m, d_k), (*leading, m, d_v))
    return [torch.randn(shape, generator=generator, dtype=dtype) for shape in shapes]


def _formula(query, key, value, is_causal=False, scale=None):
    """float64 softmax(q k^T s) v, causal aligned to the end, from the formula."""
    query, key, value = (np.asarray(a.detach(), dtype=np.float64) for a in (query, key, value))
    n, m = query.shape[-2], key.shape[-2]
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = query @ np.swapaxes(key, -1, -2) * scale
    if is_causal:
        scores = np.where(np.arange(m) <= np.arange(n)[:, None] + (m - n), scores, -np.inf)
    top = scores.max(axis=-1, keepdims=True)
    weights = np.exp(scores - np.where(np.isfinite(top), top, 0.0))
    total = weights.sum(axis=-1, keepdims=True)
    return (weights / np.where(total > 0, total, 1.0)) @ value  # a row with no key: zeros


def _counting(monkeypatch, owner, name):
    calls = []
    original = getattr(owner, name)

    def counted(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)

    monkeypatch.setattr(owner, name, counted)
    return calls


def test_a_signature_is_checked_once_then_runs_its_plan(monkeypatch):
    SDPA(*_tensors(n=2, m=2))  # the registry meets torch's tensors: their owner makes plans
    resolved = _counting(monkeypatch, _dispatch, "resolve")
    specialized = _counting(monkeypatch, TorchBackend, "specialize")
    for seed in range(3):  # new tensors, one signature
        query, key, value = _tensors(seed=seed)
        torch.testing.assert_close(
            SDPA(query, key, value), torch.nn.functional.scaled_dot_product_attention(query, key, value)
        )
    assert (len(resolved), len(specialized)) == (1, 1)
    SDPA(*_tensors(n=6, m=6))  # another shape, another signature
    assert (len(resolved), len(specialized)) == (2, 2)


def test_a_planned_call_logs_its_choice_as_the_first(caplog):
    tensors = _tensors()
    with caplog.at_level(logging.DEBUG, logger="attnx"):
        SDPA(*tensors)
        SDPA(*tensors)
    assert caplog.messages == ["scaled_dot_product_attention: backend 'torch' (owns query), native"] * 2


SIGNATURES = st.fixed_dictionaries(
    {
        "leading": st.sampled_from([(1, 2), (2,), (), (2, 1, 2)]),
        "n": st.sampled_from([3, 5]),
        "m": st.sampled_from([3, 5]),
        "d_k": st.sampled_from([2, 4]),
        "dtype": st.sampled_from([torch.float32, torch.float64]),
        "is_causal": st.booleans(),
        "scale": st.sampled_from([None, 0.5, 1.0 / math.sqrt(4)]),
    }
)


@settings(max_examples=30, deadline=None)
@given(calls=st.lists(SIGNATURES, min_size=2, max_size=12))
def test_any_sequence_of_calls_computes_each_call(calls):
    """Whatever came before, each call computes its own attention: a plan
    is never taken for a call that differs in a flag, scale, size or dtype."""
    registry._plans.clear()
    for index, call in enumerate(calls):
        is_causal, scale = call.pop("is_causal"), call.pop("scale")
        tensors = _tensors(**call, seed=index)
        output = SDPA(*tensors, is_causal=is_causal, scale=scale)
        tolerance = 1e-5 if call["dtype"] == torch.float32 else 1e-12
        expected = _formula(*tensors, is_causal=is_causal, scale=scale)
        np.testing.assert_allclose(output.numpy(), expected, rtol=tolerance, atol=tolerance)
        assert output.dtype == call["dtype"]


BAD_CALLS = {
    "key of another dtype": lambda q, k, v: dict(key=k.double()),
    "key of another size": lambda q, k, v: dict(key=k[..., :3]),
    "value of another length": lambda q, k, v: dict(value=torch.cat([v, v], dim=-2)),
    "key from NumPy": lambda q, k, v: dict(key=k.numpy()),
    "no key": lambda q, k, v: dict(key=None),
    "is_causal=1": lambda q, k, v: dict(is_causal=1),
    "return_weights='yes'": lambda q, k, v: dict(return_weights="yes"),
    "scale=nan": lambda q, k, v: dict(scale=float("nan")),
    "scale=True": lambda q, k, v: dict(scale=True),
    "backend='numpy'": lambda q, k, v: dict(backend="numpy"),
}


@pytest.mark.parametrize("case", list(BAD_CALLS))
def test_a_bad_call_after_a_plan_is_refused_as_before(case):
    query, key, value = _tensors()
    arguments = {"query": query, "key": key, "value": value, **BAD_CALLS[case](query, key, value)}
    with pytest.raises((TypeError, ValueError)) as cold:
        SDPA(**arguments)
    SDPA(query, key, value)  # the good call's plan
    SDPA(query, key, value)
    assert registry._plans
    with pytest.raises(cold.type) as planned:
        SDPA(**arguments)
    assert str(planned.value) == str(cold.value)


def test_a_backend_coming_or_going_drops_the_plans():
    SDPA(*_tensors())
    assert registry._plans

    class Plugin:
        @attnx.hookimpl
        def attnx_backends(self):
            return []

    name = attnx.register_plugin(Plugin(), name="empty-plugin")
    assert not registry._plans
    SDPA(*_tensors())
    attnx.unregister_plugin(name)
    assert not registry._plans


def test_plans_hold_no_arrays():
    query, key, value = _tensors()
    SDPA(query, key, value)
    alive = weakref.ref(query)
    del query
    gc.collect()
    assert alive() is None


def test_the_store_is_bounded(monkeypatch):
    monkeypatch.setattr(_plans, "MAX_PLANS", 4)
    for n in range(1, 11):
        SDPA(*_tensors(n=n, m=n))
        assert 1 <= len(registry._plans) <= 4


@pytest.mark.parametrize("dynamic", [False, True])
def test_compiled_calls_after_plans_equal_eager_ones(dynamic):
    def function(query, key, value):
        return SDPA(query, key, value, is_causal=True)

    for n in (4, 6):  # plans first, then compiled calls of the same and of another shape
        tensors = _tensors(n=n, m=n)
        eager = function(*tensors)
        compiled = torch.compile(function, fullgraph=True, dynamic=dynamic)
        torch.testing.assert_close(compiled(*tensors), eager)
        torch.testing.assert_close(compiled(*_tensors(n=n + 1, m=n + 1)), function(*_tensors(n=n + 1, m=n + 1)))


def test_new_plans_do_not_make_compiled_code_compile_again():
    """dynamo guards on what traced code reads: compiled calls don't look
    for plans, so plans made later by eager calls leave the graph alone."""
    from torch._dynamo.testing import CompileCounter

    counter = CompileCounter()
    compiled = torch.compile(SDPA, backend=counter, fullgraph=True)
    tensors = _tensors(n=8, m=8)
    compiled(*tensors)
    compiled(*tensors)
    compiles = counter.frame_count
    for n in range(2, 7):  # eager calls of new signatures: each makes a plan
        SDPA(*_tensors(n=n, m=n))
        SDPA(*_tensors(n=n, m=n))
        torch.testing.assert_close(compiled(*tensors), SDPA(*tensors))
    assert counter.frame_count == compiles
