"""The Dask backend's own promises: work follows the chunks, unknown sizes.

The conformance suite proves its values and its laziness; these tests
check how the graph is cut, against float64 NumPy references.
"""

from __future__ import annotations

import numpy as np
import pytest

import attnx
from attnx_conformance import reference

da = pytest.importorskip("dask.array")
from dask.core import get_dependencies  # noqa: E402


def _reference(query, key, value, is_causal=False):
    allowed = reference.allowed_mask(query.shape[-2], key.shape[-2], is_causal=is_causal)
    return reference.scaled_dot_product_attention(query, key, value, allowed=allowed)[0]


def _inputs(shape_q, shape_k, d_v, seed=0):
    gen = np.random.default_rng(seed)
    return gen.standard_normal(shape_q), gen.standard_normal(shape_k), gen.standard_normal((*shape_k[:-1], d_v))


def _tasks(array):
    return len(dict(array.__dask_graph__()))


def _depth(graph):
    """The longest chain of tasks in ``graph``, each waiting on the last."""
    depths = {}

    def depth(task):
        if task not in depths:
            depths[task] = 1 + max((depth(one) for one in get_dependencies(graph, task)), default=0)
        return depths[task]

    return max(depth(task) for task in graph)


@pytest.mark.parametrize("is_causal", [False, True])
def test_tasks_grow_with_chunks_not_rows(is_causal):
    counts = []
    for n in (64, 512):
        q, k, v = _inputs((4, 2, n, 8), (4, 2, n, 8), 8)
        lazy = [da.from_array(a, chunks=(2, 2, n // 4, 8)) for a in (q, k, v)]
        output = attnx.scaled_dot_product_attention(*lazy, is_causal=is_causal)
        counts.append(_tasks(output))
        np.testing.assert_allclose(output.compute(), _reference(q, k, v, is_causal), rtol=1e-10, atol=1e-12)
    assert counts[0] == counts[1]


def test_a_batch_in_eight_chunks_is_a_small_graph():
    # The case: (64, 8, 1024, 64) in 8 batch chunks once made 79,985 tasks.
    shape = (64, 8, 1024, 64)
    lazy = [da.zeros(shape, chunks=(8, 8, 1024, 64), dtype="float32") for _ in range(3)]
    output = attnx.scaled_dot_product_attention(*lazy)
    assert output.chunks[0] == (8,) * 8
    assert _tasks(output) <= 8 * 8  # inputs, blocks, combine and finish: a few per batch chunk


def test_keys_split_over_chunks_are_combined_in_a_tree():
    q, k, v = _inputs((1, 16, 8), (1, 4096, 8), 4, seed=1)
    output = attnx.scaled_dot_product_attention(
        da.from_array(q), da.from_array(k, chunks=(1, 128, 8)), da.from_array(v, chunks=(1, 128, 4))
    )
    graph = dict(output.__dask_graph__())
    # A tree over the 32 key chunks: no task waits on more than a few others
    # (one holding them all would gather every key in one place).
    fan_in = max(len(get_dependencies(graph, name)) for name in graph)
    assert fan_in <= 8
    np.testing.assert_allclose(output.compute(), _reference(q, k, v), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("is_causal", [False, True])
def test_the_backward_follows_the_chunks_and_sums_in_trees(is_causal):
    """attnx.vjp on queries and keys in 16 chunks each: every gradient is
    summed over the other side's chunks in a tree (no task waits on more
    than 8 others: one waiting on all 16 would gather a whole side), the
    graph grows with the chunks and not with the rows, and the gradients
    are the float64 chain rule's."""
    counts = []
    for n in (128, 256):
        q, k, v = _inputs((1, 2, n, 8), (1, 2, n, 8), 4, seed=4)
        cotangent = np.random.default_rng(5).standard_normal((1, 2, n, 4))
        chunks = (1, 2, n // 16, 8)
        lazy = [da.from_array(a, chunks=chunks[:-1] + (a.shape[-1],)) for a in (q, k, v)]
        # A budget that cuts the scores into attnx's own tiles, which the chunks overrule
        with attnx.memory_budget(2**14):
            _, backward = attnx.vjp(attnx.scaled_dot_product_attention, *lazy, is_causal=is_causal)
            grads = backward(da.from_array(cotangent, chunks=chunks[:-1] + (4,)))
        for name in ("query", "key", "value"):
            graph = dict(grads[name].__dask_graph__())
            assert max(len(get_dependencies(graph, task)) for task in graph) <= 8, name
            assert _depth(graph) <= 12, name  # a tree over 16 chunks, not a chain along them
        counts.append(_tasks(grads["key"]))
    allowed = reference.allowed_mask(n, n, batch_shape=(1, 2), is_causal=is_causal)
    expected = reference.scaled_dot_product_attention_vjp(q, k, v, cotangent, allowed=allowed)
    for name in ("query", "key", "value"):
        np.testing.assert_allclose(grads[name].compute(), expected[name], rtol=1e-9, atol=1e-11)
    assert counts[0] == counts[1]


def test_a_cache_chunked_along_its_length_decodes_without_gathering_it():
    """Decoding one token of 8 query heads over 2 key/value heads, the cache
    in 32 chunks along its length, padded per sequence: the grouped heads
    fold into rows and the key chunks combine in a tree, no task holding
    the whole cache."""
    gen = np.random.default_rng(3)
    q, k, v = (
        gen.standard_normal((2, 8, 1, 16)),
        gen.standard_normal((2, 2, 4096, 16)),
        gen.standard_normal((2, 2, 4096, 4)),
    )
    lengths = np.array([4096, 1000])
    output = attnx.scaled_dot_product_attention(
        da.from_array(q),
        da.from_array(k, chunks=(2, 2, 128, 16)),
        da.from_array(v, chunks=(2, 2, 128, 4)),
        key_lengths=da.from_array(lengths),
        is_causal=True,
        causal_align="key_lengths",
        enable_gqa=True,
    )
    graph = dict(output.__dask_graph__())
    assert max(len(get_dependencies(graph, name)) for name in graph) <= 8
    allowed = reference.allowed_mask(1, 4096, batch_shape=(2, 8), key_lengths=lengths, lengths_per="batch")
    expected = reference.scaled_dot_product_attention(
        q, np.repeat(k, 4, axis=1), np.repeat(v, 4, axis=1), allowed=allowed
    )[0]
    np.testing.assert_allclose(output.compute(), expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("batch", [(2,), (2, 3)])
def test_chunk_size_sets_the_chunks(batch):
    q, k, v = _inputs((*batch, 100, 8), (*batch, 90, 8), 8, seed=2)
    output = attnx.scaled_dot_product_attention(*(da.from_array(a) for a in (q, k, v)), chunk_size=(32, 40))
    assert output.chunks[-2] == (32, 32, 32, 4)
    # a block per chunk of queries and of keys: 4 x 3 (90 keys in 40s)
    graph = output.__dask_graph__()
    (blocks,) = [name for name in graph.layers if name.startswith("attnx-sdpa-block")]
    rows_and_keys = {key[1 + len(batch) : 3 + len(batch)] for key in graph.layers[blocks].get_output_keys()}
    assert sorted(rows_and_keys) == [(i, j) for i in range(4) for j in range(3)]
    np.testing.assert_allclose(output.compute(), _reference(q, k, v), rtol=1e-10, atol=1e-12)


def test_unknown_sizes_where_the_plan_does_not_need_them():
    q, k, v = _inputs((6, 10, 8), (6, 12, 8), 5, seed=3)
    lazy = [da.from_array(a, chunks=(2, 3, 8)) for a in (q, k, v)]
    sequences = np.array([1, 0, 1, 1, 0, 1], bool)
    picked = [a[da.from_array(sequences, chunks=2)] for a in lazy]
    output = attnx.scaled_dot_product_attention(*picked)
    assert np.isnan(output.shape[0])
    np.testing.assert_allclose(output.compute(), _reference(q[sequences], k[sequences], v[sequences]), rtol=1e-10)
    # The causal rule needs n and m alone: a batch of unknown size is no matter (issue 59), whole or in tiles.
    for chunk_size in (None, (4, 5)):
        output = attnx.scaled_dot_product_attention(*picked, is_causal=True, chunk_size=chunk_size)
        assert np.isnan(output.shape[0])
        expected = attnx.scaled_dot_product_attention(q[sequences], k[sequences], v[sequences], is_causal=True)
        np.testing.assert_allclose(output.compute(), expected, rtol=1e-10)
    keys = np.arange(12) % 4 > 0
    lazy_keys = da.from_array(keys, chunks=3)
    output = attnx.scaled_dot_product_attention(lazy[0], lazy[1][:, lazy_keys], lazy[2][:, lazy_keys])
    np.testing.assert_allclose(output.compute(), _reference(q, k[:, keys], v[:, keys]), rtol=1e-10)
    gen = np.random.default_rng(4)
    train_x, queries = gen.standard_normal(40), np.linspace(-1, 1, 5)
    train_y = np.sin(train_x)
    selected = train_x > 0
    lazy_selected = da.from_array(selected, chunks=10)
    estimate = attnx.nadaraya_watson(
        da.from_array(queries),
        da.from_array(train_x, chunks=10)[lazy_selected],
        da.from_array(train_y, chunks=10)[lazy_selected],
    )
    expected = attnx.nadaraya_watson(queries, train_x[selected], train_y[selected])
    np.testing.assert_allclose(estimate.compute(), expected, rtol=1e-12)
    signal, weight = gen.standard_normal((6, 3, 20)), gen.standard_normal((4, 3, 3))
    picked = da.from_array(signal, chunks=(2, 2, 7))[da.from_array(sequences, chunks=2)]
    convolved = attnx.causal_conv1d(picked, da.from_array(weight), dilation=2)
    assert np.isnan(convolved.shape[0])
    expected = attnx.causal_conv1d(signal[sequences], weight, dilation=2)
    np.testing.assert_allclose(convolved.compute(), expected, rtol=1e-12)
    features = gen.standard_normal((6, 5, 8))
    picked = da.from_array(features, chunks=(2, 5, 8))[da.from_array(sequences, chunks=2)]
    for interleaved, expected in [(True, reference.apply_rotary), (False, reference.apply_rotary_halves)]:
        rotated = attnx.apply_rotary(picked, interleaved=interleaved)
        np.testing.assert_allclose(rotated.compute(), expected(features[sequences]), rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda q, k, v: attnx.scaled_dot_product_attention(q, k, v, is_causal=True), ["key", "axis 1", "is_causal"]),
        (
            lambda q, k, v: attnx.scaled_dot_product_attention(q, k, v, key_lengths=da.from_array(np.arange(6))),
            ["key", "axis 1", "mask"],
        ),
        (
            lambda q, k, v: attnx.causal_conv1d(da.swapaxes(k, 1, 2), da.ones((2, 8, 3))),
            ["x", "axis 2", "output length"],
        ),
    ],
)
def test_unknown_sizes_where_they_are_needed_are_named(call, words):
    q, k, v = (da.from_array(a, chunks=(2, 3, 8)) for a in _inputs((6, 10, 8), (6, 12, 8), 8))
    keys = da.from_array(np.arange(12) % 4 > 0, chunks=3)
    with pytest.raises(ValueError, match="compute_chunk_sizes") as info:
        call(q, k[:, keys], v[:, keys])
    for word in words:
        assert word in str(info.value)


def test_an_unknown_size_broadcasts_against_one_not_against_a_known_size():
    q, k, v = _inputs((6, 10, 8), (6, 12, 8), 5, seed=6)
    lazy = [da.from_array(a, chunks=(2, 3, 8)) for a in (q, k, v)]
    sequences = np.array([1, 0, 1, 1, 0, 1], bool)
    picked = lazy[0][da.from_array(sequences, chunks=2)]
    # Dask can't line up chunks of unknown size with known ones: named by attnx, not by dask's unify_chunks.
    with pytest.raises(ValueError, match="compute_chunk_sizes") as info:
        attnx.scaled_dot_product_attention(picked, lazy[1], lazy[2])
    assert "leading shapes (...)" in str(info.value) and "query (nan,)" in str(info.value)
    assert "key (6,)" in str(info.value)
    output = attnx.scaled_dot_product_attention(picked, lazy[1][:1], lazy[2][:1])
    np.testing.assert_allclose(output.compute(), _reference(q[sequences], k[:1], v[:1]), rtol=1e-10)


def test_kernel_regression_over_many_chunks_of_training_data():
    gen = np.random.default_rng(5)
    size = 1_000_000
    train_x = da.random.default_rng(6).standard_normal(size, chunks=100_000)
    train_y = da.sin(train_x) + 0.1 * da.random.default_rng(7).standard_normal(size, chunks=100_000)
    queries = np.sort(gen.uniform(-2, 2, 16))
    estimate = attnx.nadaraya_watson(da.from_array(queries, chunks=8), train_x, train_y, bandwidth=0.05)
    assert _tasks(estimate) < 120  # per chunk of data, not per point
    np.testing.assert_allclose(estimate.compute(), np.sin(queries), atol=0.05)


@pytest.mark.parametrize(("queries", "keys"), [(0, 1), (3, 0), (0, 0)])
def test_kernel_regression_with_no_query_or_no_key(queries, keys):
    """Found by the conformance suite's hypothesis run: the generic path
    asked Dask for a maximum over an empty query axis."""
    import dask.array as da

    q, k = np.linspace(0, 1, queries), np.linspace(0, 1, keys)
    lazy = attnx.nadaraya_watson(da.from_array(q, chunks=2), da.from_array(k, chunks=2), da.from_array(k, chunks=2))
    np.testing.assert_array_equal(lazy.compute(), attnx.nadaraya_watson(q, k, k))


def test_the_namespace_makes_chunks_of_the_kind_its_device_names():
    """For a Dask array of CuPy chunks the device is ``Chunks(meta)``, and
    the namespace's creations take it (the values: tests/test_dask_cupy.py
    on a GPU).  Here the kind is NumPy's own, through the same code: each
    creation keeps its values, names its arrays apart from the NumPy ones
    (Dask names an arange by its numbers alone, whatever ``like=`` asks),
    and takes ``chunks=``."""
    from attnx_backends import dask_namespace as xp

    kind = xp.Chunks(np.empty((0,), dtype=np.float32))
    assert kind == xp.Chunks(np.empty((0, 0))) and repr(kind) == "Chunks(numpy.ndarray)"
    assert xp.device(da.ones(3)) == "cpu" and attnx._checks.device_of(da.ones(3)) == "cpu"
    made = {
        "arange": (xp.arange(2, 7, device=kind, chunks=2), xp.arange(2, 7, device="cpu", chunks=2), np.arange(2, 7)),
        "zeros": (xp.zeros((2, 3), device=kind), xp.zeros((2, 3), device="cpu"), np.zeros((2, 3))),
        "ones": (xp.ones(4, dtype=xp.int8, device=kind), xp.ones(4, dtype=xp.int8, device="cpu"), np.ones(4, np.int8)),
        "full": (xp.full(2, -np.inf, device=kind), xp.full(2, -np.inf, device="cpu"), np.full(2, -np.inf)),
        "asarray": (xp.asarray(1.5, device=kind), xp.asarray(1.5, device="cpu"), np.asarray(1.5)),
    }
    for name, (of_kind, of_numpy, expected) in made.items():
        assert of_kind.name != of_numpy.name, name
        np.testing.assert_array_equal(of_kind.compute(), expected)
        assert of_kind.dtype == expected.dtype, name
    assert made["arange"][0].chunks == ((2, 2, 1),)


def test_a_dask_array_moves_to_another_chunk_kind_lazily():
    """``attnx.asarray(x, backend="dask", device="cupy")`` of a Dask array
    moves its chunks one by one when computed, never at the call (here the
    kind is NumPy's own, through the same code)."""
    from attnx_backends import dask_namespace as xp

    backend = attnx._registry.get("dask")
    lazy = da.from_array(np.arange(6.0).reshape(2, 3), chunks=1)
    with backend.computations() as started:
        moved = backend.asarray(lazy, dtype="float32", device=xp.Chunks(np.empty(0)))
    assert started == [] and moved.dtype == np.float32 and moved.chunks == lazy.chunks
    np.testing.assert_array_equal(moved.compute(), np.arange(6.0).reshape(2, 3))


class _OtherChunks(np.ndarray):
    """Chunks of a kind that is not NumPy's (its module is this one), for the
    chunk-kind rules without a GPU: Dask keeps the subclass as the meta."""


def test_an_empty_array_is_rechunked_in_chunks_of_its_own_kind():
    """Dask remakes an empty array's chunks with NumPy's ``empty``, whatever
    its kind, and a NumPy chunk then met CuPy ones in the SDPA native's
    tasks where d_k or d_v is 0 (six conformance cases on a GPU).  The
    namespace's ``rechunk`` keeps the kind; a non-empty array is Dask's
    own rechunk."""
    from attnx_backends import dask_namespace as xp

    empty = da.from_array(np.ones((4, 0)).view(_OtherChunks), chunks=(2, -1), asarray=False)
    assert isinstance(xp.device(empty), xp.Chunks)
    rechunked = xp.rechunk(empty, {0: -1})
    assert rechunked.chunks == ((4,), (0,)) and rechunked.dtype == empty.dtype
    assert xp.device(rechunked) == xp.device(empty)
    full = da.from_array(np.ones((4, 2)).view(_OtherChunks), chunks=(2, -1), asarray=False)
    assert xp.rechunk(full, {0: -1}).name == full.rechunk({0: -1}).name
    assert xp.rechunk(empty, {0: 2}) is empty  # nothing to change


def test_the_namespace_is_the_backends_before_any_call_dispatched_one():
    """``kernel_state`` and :mod:`attnx.blocks` take their namespace
    from their arrays.  For a Dask array of other chunks (CuPy's on a GPU,
    where two conformance cases failed when they ran first in their
    process) it must be the Dask backend's, whose creations keep the chunks'
    kind, also before any call has taught the registry the array's type:
    array-api-compat's Dask namespace refuses that kind as a device."""
    from attnx.kernel_regression import finish_state, kernel_state
    from attnx_backends import dask_namespace as xp

    attnx._registry._forget_types()
    queries, keys = (da.from_array(np.linspace(0, 1, n).view(_OtherChunks), chunks=2, asarray=False) for n in (3, 0))
    state, nearest = kernel_state(queries, keys, keys, return_nearest=True)
    # (The state's kind is NumPy's here: Dask joins NumPy subclasses with
    # NumPy's concatenate, and CuPy arrays with CuPy's.)
    assert xp.device(nearest) == xp.device(queries)
    np.testing.assert_array_equal(nearest.compute(), np.full(3, np.inf))
    assert not np.any(finish_state(state, keys).compute())


@pytest.mark.parametrize(("value", "chunks"), [("2", ((2, 2, 1),)), (" auto ", ((5,),)), ("", ((5,),))])
def test_new_arrays_are_chunked_as_the_environment_says(monkeypatch, value, chunks):
    monkeypatch.setenv("ATTNX_DASK_CHUNKS", value)
    assert attnx.asarray(np.ones(5), backend="dask").chunks == chunks


@pytest.mark.parametrize("value", ["0", "-3", "two", "2.5"])
def test_a_bad_chunk_size_in_the_environment_is_named(monkeypatch, value):
    monkeypatch.setenv("ATTNX_DASK_CHUNKS", value)
    with pytest.raises(ValueError, match=rf"\$ATTNX_DASK_CHUNKS must be 'auto' or a positive integer, got '{value}'"):
        attnx.asarray(np.ones(3), backend="dask")
