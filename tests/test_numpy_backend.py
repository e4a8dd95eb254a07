"""The NumPy backend's threaded map_blocks."""

from __future__ import annotations

import math
import signal
import threading
import time
import types

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import attnx
from attnx_backends import numpy_backend
from attnx_backends.numpy_backend import NumPyBackend
from attnx_conformance import reference


def test_map_blocks_keeps_order_and_uses_threads():
    backend = NumPyBackend()
    backend.concurrent_blocks = 2
    names = set()

    def work(item):
        names.add(threading.current_thread().name)
        time.sleep(0.002)  # long enough that no thread takes every block alone
        return item * item

    assert backend.map_blocks(work, range(10)) == [i * i for i in range(10)]
    # The calling thread takes blocks too: it would otherwise wait idle.
    assert any(name.startswith("attnx-numpy") for name in names)
    assert threading.main_thread().name in names


def test_map_blocks_raises_the_blocks_error_and_gives_blas_its_threads_back():
    from threadpoolctl import threadpool_info

    backend = NumPyBackend()
    backend.concurrent_blocks = 2
    before = [library["num_threads"] for library in threadpool_info() if library["user_api"] == "blas"]

    def work(item):
        if item == 5:
            raise KeyError(item)
        return item

    with pytest.raises(KeyError, match="5"):
        backend.map_blocks(work, range(10))
    assert [library["num_threads"] for library in threadpool_info() if library["user_api"] == "blas"] == before
    assert backend.map_blocks(work, range(3)) == [0, 1, 2]  # the pool still works


def test_map_blocks_keeps_no_block_alive_after_the_call():
    """The helper threads drop the function they ran (and the arrays its
    closure holds) when the call returns."""
    import gc
    import weakref

    backend = NumPyBackend()
    backend.concurrent_blocks = 2
    alive = []

    def call():
        arrays = [np.ones(3) for _ in range(4)]
        alive.extend(weakref.ref(array) for array in arrays)
        return backend.map_blocks(lambda i: float(arrays[i].sum()), range(4))

    assert call() == [3.0] * 4
    gc.collect()
    assert all(ref() is None for ref in alive)


@pytest.mark.skipif(not hasattr(signal, "setitimer"), reason="needs signal.setitimer (POSIX)")
@pytest.mark.parametrize("interrupt_at", ["join", "start"])
def test_an_interrupted_call_leaves_no_helper_running_into_the_next(monkeypatch, interrupt_at):
    """Ctrl-C (KeyboardInterrupt) while the calling thread waits for a
    helper, or just after it starts one: the call ends only when every block
    a helper began has, and raises the interrupt.  Were it to return at once,
    the helper's end would be counted by the next call, which would return
    before its own blocks were written (outputs left as ``np.empty`` made
    them), or hang once a lock was released twice."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    backend = NumPyBackend()
    backend.concurrent_blocks = 2
    begun, finished = [], []

    def work(pause):
        if threading.current_thread() is not threading.main_thread():
            begun.append(pause)
        time.sleep(pause)
        finished.append(pause)
        return pause

    def interrupt(*_):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        if interrupt_at == "start":
            start = numpy_backend._Helper.start

            def start_then_interrupt(self, function):
                start(self, function)
                raise KeyboardInterrupt  # as a signal arriving just after the helper was handed its blocks

            monkeypatch.setattr(numpy_backend._Helper, "start", start_then_interrupt)
            pauses = [0.3] * 4
        else:
            # The calling thread takes the 0.1 s block, the helper the 0.4 s
            # one; at 0.2 s the calling thread is waiting for the helper.
            signal.setitimer(signal.ITIMER_REAL, 0.2)
            pauses = [0.1, 0.4]
        with pytest.raises(KeyboardInterrupt):
            backend.map_blocks(work, pauses)
        ended = list(finished)
        assert all(pause in ended for pause in begun), "the call ended before a helper's block did"
        time.sleep(0.5)
        assert finished == ended, "a block ran on after its call had ended"
        if interrupt_at == "start":  # the helper took no block after the interrupt
            assert len(ended) <= 1
        monkeypatch.undo()
        finished.clear()
        assert backend.map_blocks(work, [0.0, 0.2, 0.0]) == [0.0, 0.2, 0.0]
        assert sorted(finished) == [0.0, 0.0, 0.2], "the next call returned before its blocks ended"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_map_blocks_from_two_threads_at_once():
    """A call while another holds the helper threads runs its blocks on its
    own thread, and both get their own results."""
    backend = NumPyBackend()
    backend.concurrent_blocks = 2
    results = {}

    def call(offset):
        results[offset] = backend.map_blocks(lambda i: time.sleep(0.001) or i + offset, range(20))

    callers = [threading.Thread(target=call, args=(offset,)) for offset in (0, 100, 200)]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert results == {offset: [i + offset for i in range(20)] for offset in (0, 100, 200)}


@pytest.mark.parametrize("gil_enabled", [True, False], ids=["with-gil-sleeps", "free-threaded-spins"])
def test_map_blocks_waits_for_every_block_whether_it_spins_or_sleeps(monkeypatch, gil_enabled):
    """Without a GIL the waits spin for SPIN_SECONDS, then sleep; with one
    they sleep at once.  Either way every block ends before map_blocks
    returns: blocks shorter and longer than the spin, helpers idle for less
    and for more than it."""
    looks = []

    def perf_counter():
        looks.append(None)
        return time.perf_counter()

    monkeypatch.setattr(numpy_backend, "_gil_enabled", lambda: gil_enabled)
    monkeypatch.setattr(numpy_backend, "SPIN_SECONDS", 0.001)
    monkeypatch.setattr(numpy_backend, "time", types.SimpleNamespace(perf_counter=perf_counter))
    backend = NumPyBackend()
    backend.concurrent_blocks = 3
    ended = []

    def work(pause):
        time.sleep(pause)
        ended.append(pause)
        return pause

    pauses = [0.0, 0.004, 0.0, 0.003, 0.0]
    for idle in (0.0, 0.005):
        time.sleep(idle)
        assert backend.map_blocks(work, pauses) == pauses
        assert sorted(ended) == sorted(pauses)
        ended.clear()
    assert bool(looks) is not gil_enabled


def test_calls_from_several_threads_at_once_each_get_their_own_result():
    """Threaded native calls from four threads at once (on a free-threaded
    CPython truly at once): one call holds the helpers, the others run
    their blocks inline, every thread has its own scratch buffers, and
    each result is its own call's."""
    rng = np.random.default_rng(7)
    shape = (2, 4, 96, 16)  # 8 slices of 96 x 96 scores: planned on threads
    inputs = [[rng.standard_normal(shape).astype(np.float32) for _ in range(3)] for _ in range(4)]
    expected = [[_reference(*qkv, is_causal=is_causal) for is_causal in (False, True)] for qkv in inputs]
    start, errors = threading.Barrier(len(inputs)), []

    def call(index):
        start.wait()
        try:
            for attempt in range(20):
                is_causal = bool(attempt % 2)
                output = attnx.scaled_dot_product_attention(*inputs[index], is_causal=is_causal)
                if not np.allclose(output, expected[index][is_causal], rtol=1e-4, atol=1e-5):
                    errors.append((index, attempt))
        except BaseException as error:  # a thread's error would otherwise be only a warning
            errors.append((index, error))

    callers = [threading.Thread(target=call, args=(index,)) for index in range(len(inputs))]
    for caller in callers:
        caller.start()
    for caller in callers:
        caller.join()
    assert errors == []


def test_map_blocks_inside_a_worker_runs_inline():
    backend = NumPyBackend()
    backend.concurrent_blocks = 2
    inner = backend.map_blocks(lambda outer: backend.map_blocks(lambda i: (outer, i), range(3)), range(4))
    assert inner == [[(outer, i) for i in range(3)] for outer in range(4)]


def test_one_thread_is_sequential(monkeypatch):
    monkeypatch.setenv("ATTNX_NUM_THREADS", "1")
    backend = NumPyBackend()
    assert backend.concurrent_blocks == 1
    assert backend.map_blocks(lambda i: threading.current_thread() is threading.main_thread(), range(3)) == [True] * 3


@pytest.mark.parametrize(
    "n, kwargs",
    [
        # A mask of one (n, m) per batch entry, on 3 heads: the native declines it.
        (40, {"mask": np.random.default_rng(1).random((2, 1, 40, 40)) < 0.7, "chunk_size": (7, 9)}),
        (40, {"key_lengths": np.array([40, 33]), "chunk_size": (7, 9)}),
        (256, {}),
    ],
    ids=["generic-masked", "native-masked", "native"],
)
def test_threaded_chunks_equal_sequential_chunks(monkeypatch, n, kwargs):
    """Blocks run on the backend's threads, in the generic algorithm (masks
    the native declines) and in the native one, and compute what one thread
    computes."""
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((2, 3, n, 8)) for _ in range(3))
    backend = attnx._registry.get("numpy")
    monkeypatch.setattr(backend, "concurrent_blocks", 2)
    workers = set()
    original = backend.map_blocks

    def recording(function, items):
        def run(item):
            workers.add(threading.current_thread().name)
            return function(item)

        return original(run, items)

    monkeypatch.setattr(backend, "map_blocks", recording)
    threaded = attnx.scaled_dot_product_attention(q, k, v, is_causal=True, **kwargs)
    # Which threads took the blocks is the pool's business (the calling
    # thread takes some, and may take all of a short call): that they went
    # through map_blocks, the test above shows that it uses threads.
    assert workers, "no block ran through map_blocks"
    masks = {name: kwargs.get(name) for name in ("mask", "key_lengths")}
    plain = attnx.scaled_dot_product_attention(q, k, v, is_causal=True, return_weights=True, **masks)[0]
    np.testing.assert_allclose(threaded, plain, rtol=1e-12, atol=1e-14)


def test_read_only_arrays_are_never_updated_in_place():
    """Writeability is per NumPy array (broadcast views are read-only), not
    per type: a writeable array asked first must not vouch for a view."""
    from attnx._masking import can_mutate

    assert can_mutate(np.ones((2, 3)))
    assert not can_mutate(np.broadcast_to(np.ones(3), (2, 3)))


def _reference(q, k, v, is_causal=False, *, mask=None, key_lengths=None):
    """The conformance kit's float64 attention (causal: query i sees keys up
    to i + m - n, the last query every key), with a call's masks (lengths
    one per batch entry, or one per query where they have a query axis)."""
    batch = np.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    n, m = q.shape[-2], k.shape[-2]
    real = mask is not None and mask.dtype != bool
    allowed = reference.allowed_mask(
        n,
        m,
        batch_shape=batch,
        mask=None if real else mask,
        key_lengths=key_lengths,
        lengths_per="query" if key_lengths is not None and key_lengths.ndim == len(batch) + 1 else "batch",
        is_causal=is_causal,
    )
    return reference.scaled_dot_product_attention(q, k, v, allowed=allowed, additive=mask if real else None)[0]


@pytest.mark.filterwarnings("error")  # nothing of the unshifted run reaches the user
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_native_runs_again_shifted_only_the_tasks_whose_unshifted_sums_fail(monkeypatch, dtype, is_causal):
    """The native takes exponentials unshifted, and runs again, shifted by
    the rows' maxima, the tasks whose sums of weights show that this was not
    exact.  Batch entry 0 has ordinary inputs; in entry 1 queries and keys
    point the same way, with scores beyond the largest exponential (200 in
    float32, 1250 in float64); in entry 2 only queries 64-125 and keys 126
    and 127 do (in their future when causal, and masked: inf times 0); in
    entry 3 queries point against the keys, and every exponential underflows
    to 0."""
    rng = np.random.default_rng(1)
    n, d = 256, 64
    q, k, v = (rng.standard_normal((4, 2, n, d)).astype(dtype) for _ in range(3))
    direction = np.zeros(d, dtype=dtype)
    direction[0] = {"float32": 40, "float64": 100}[dtype]  # scores of length**2 / 8
    q[1] += direction
    k[1] += direction
    q[2, :, 64:126] += direction
    k[2, :, 126:128] += direction
    q[3] -= direction
    k[3] += direction
    runs = _recorded_blocks(monkeypatch, lambda *args: args[-1])  # shifted
    got = attnx.scaled_dot_product_attention(q, k, v, is_causal=is_causal, chunk_size=(64, 128))
    expected = _reference(q, k, v, is_causal)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got[0], expected[0], **TOLERANCE[dtype])
    # Scores in the hundreds carry float32's rounding into the weights (the
    # reference reads the same rounded inputs, but rounds no score).
    np.testing.assert_allclose(got[1:], expected[1:], rtol=1e-3, atol=1e-4)
    # 4 entries by 2 heads by 4 blocks of 64 rows, unshifted; again, entries
    # 1 and 3 and the block of rows 64-127 of entry 2.
    assert runs.count(False) == 32
    assert runs.count(True) == 8 + 2 + 8


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_native_shifts_rows_whose_values_would_overflow_unshifted(dtype):
    """Equal scores of 4 and values near the dtype's largest: unshifted, the
    sums of exponentials (e^4 each) times the values overflow; shifted by
    their maximum (weights of 1) they do not."""
    rng = np.random.default_rng(2)
    n, d = 128, 64
    q = np.full((1, 2, n, d), 2**-0.5, dtype=dtype)  # scores 64 / 2 / sqrt(64) = 4
    large = {"float32": 1e36, "float64": 1e305}[dtype]
    v = (large * rng.uniform(1, 2, (1, 2, n, d))).astype(dtype)
    got = attnx.scaled_dot_product_attention(q, q, v, chunk_size=(64, 128))
    expected = np.broadcast_to(v.astype(np.float64).mean(axis=-2, keepdims=True), v.shape)
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, expected, rtol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_native_shifts_rows_whose_weights_would_make_small_values_subnormal(dtype):
    """Scores near the logarithm of the smallest normal number (about -80 in
    float32, -700 in float64) and small values (1e-6 in float32, 1e-12 in
    float64): unshifted, every weight is near the smallest normal, and its
    products with the values subnormal, with few digits left; shifted by
    their maximum (weights near 1) they are exact."""
    rng = np.random.default_rng(3)
    n, d = 128, 64
    level = {"float32": -80.0, "float64": -700.0}[dtype]
    q = np.full((1, 2, n, d), 1.0, dtype=dtype)
    k = np.full((1, 2, n, d), level / d**0.5, dtype=dtype)  # scores q.k / sqrt(d) = level
    k += rng.uniform(0, 0.5 / d**0.5, k.shape).astype(dtype)  # unequal weights
    small = {"float32": 1e-6, "float64": 1e-12}[dtype]
    v = (small * rng.standard_normal((1, 2, n, d))).astype(dtype)
    got = attnx.scaled_dot_product_attention(q, k, v, chunk_size=(64, 128))
    tolerance = TOLERANCE[dtype]
    np.testing.assert_allclose(got, _reference(q, k, v), rtol=tolerance["rtol"], atol=small * tolerance["atol"])


def _recorded_blocks(monkeypatch, record):
    """A list that gets ``record(*arguments)`` of each call of the native's
    ``_attend_block`` (``arguments[-1]``: whether it is shifted)."""
    from attnx_backends import numpy_attention

    calls = []
    original = numpy_attention._attend_block

    def recording(*arguments):
        calls.append(record(*arguments))
        return original(*arguments)

    monkeypatch.setattr(numpy_attention, "_attend_block", recording)
    return calls


def _recorded_key_stops(monkeypatch):
    """A list that gets the last key (``c1``) of each product of scores the
    native computes."""
    from attnx_backends import numpy_attention

    stops = []
    original = numpy_attention._products

    def recording(query, key_t, buffer, c0, c1, *layout):
        stops.append(c1)
        return original(query, key_t, buffer, c0, c1, *layout)

    monkeypatch.setattr(numpy_attention, "_products", recording)
    return stops


TOLERANCE = {"float32": {"rtol": 2e-5, "atol": 2e-6}, "float64": {"rtol": 1e-10, "atol": 1e-12}}


def _small_inputs(seed=0, shape=(2, 3, 6, 4)):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(np.float32) for _ in range(3)]


def test_small_calls_are_checked_once_then_planned(monkeypatch):
    from attnx import _dispatch
    from attnx._registry import registry

    registry._plans.clear()
    attnx.scaled_dot_product_attention(*_small_inputs(shape=(1, 2, 3, 4)))  # the registry meets ndarray
    resolved = []
    resolve = _dispatch.resolve
    monkeypatch.setattr(_dispatch, "resolve", lambda *args: resolved.append(1) or resolve(*args))
    for seed in range(3):
        inputs = _small_inputs(seed)
        output = attnx.scaled_dot_product_attention(*inputs)
        np.testing.assert_allclose(output, _reference(*inputs), rtol=1e-5, atol=1e-6)
    assert len(resolved) == 1


@pytest.mark.parametrize("argument", ["mask", "key_lengths", "chunk_size"])
def test_the_native_plans_no_call_whose_masks_or_chunks_may_change(argument):
    """A plan serves every later call of one signature, which holds shapes
    and dtypes, not a mask's or lengths' values: the native makes plans for
    unmasked calls only (attnx asks for none otherwise; another caller of
    ``specialize`` may)."""
    query, key, value = _small_inputs(shape=(1, 2, 6, 4))
    arguments = {
        "query": query, "key": key, "value": value, "mask": None, "key_lengths": None, "chunk_size": None,
        "scale": 0.5, "is_causal": False, "return_weights": False, "batch_shape": (1, 2),
    }  # fmt: skip
    backend = attnx._registry.get("numpy")
    assert backend.specialize("scaled_dot_product_attention", arguments) is not None
    given = {"mask": np.ones((6, 6), dtype=bool), "key_lengths": np.array([3]), "chunk_size": (2, 2)}
    arguments[argument] = given[argument]
    assert backend.specialize("scaled_dot_product_attention", arguments) is None


def test_a_small_plan_keeps_to_a_budget_lowered_later(monkeypatch):
    """The plan reads the memory budget at every call: below the scores'
    size it runs the blocks a full call would, not its one block."""
    from attnx_backends import numpy_attention

    inputs = _small_inputs()
    attnx.scaled_dot_product_attention(*inputs)
    attnx.scaled_dot_product_attention(*inputs)  # planned now

    def one_block(*args):
        raise AssertionError("one block of scores beyond the memory budget")

    with attnx.memory_budget(6 * 6 * 4):  # one slice's scores, not six
        monkeypatch.setattr(numpy_attention, "_attend_small", one_block)
        output = attnx.scaled_dot_product_attention(*inputs)
    np.testing.assert_allclose(output, _reference(*inputs), rtol=1e-5, atol=1e-6)
    monkeypatch.undo()
    np.testing.assert_allclose(attnx.scaled_dot_product_attention(*inputs), output, rtol=1e-6, atol=1e-7)


def test_threaded_calls_are_planned_and_plan_their_blocks_at_each_call(monkeypatch):
    """Calls above one block's size are planned too (checked once), and the
    plan's native reads the memory budget at every call."""
    from attnx import _dispatch
    from attnx_backends import numpy_attention

    shape = (1, 2, 300, 8)  # 180,000 scores: tasks on threads, not one block
    attnx.scaled_dot_product_attention(*_small_inputs(shape=(1, 2, 3, 4)))  # the registry meets ndarray
    attnx.scaled_dot_product_attention(*_small_inputs(shape=shape))  # checked, and planned
    resolved, budgets = [], []
    resolve, plan = _dispatch.resolve, numpy_attention.plan
    monkeypatch.setattr(_dispatch, "resolve", lambda *args: resolved.append(1) or resolve(*args))
    monkeypatch.setattr(numpy_attention, "plan", lambda *args: budgets.append(args[-1]) or plan(*args))
    for seed, budget in ((1, None), (2, 300 * 64 * 4), (3, None)):
        inputs = _small_inputs(seed, shape=shape)
        if budget is None:
            output = attnx.scaled_dot_product_attention(*inputs)
        else:
            with attnx.memory_budget(budget):
                output = attnx.scaled_dot_product_attention(*inputs)
        np.testing.assert_allclose(output, _reference(*inputs), rtol=1e-5, atol=1e-6)
    assert resolved == []
    default = attnx.get_memory_budget()
    assert budgets == [default, 300 * 64 * 4, default]


def test_small_plans_hold_no_arrays():
    import gc
    import weakref

    query, key, value = _small_inputs(shape=(1, 1, 5, 3))
    attnx.scaled_dot_product_attention(query, key, value)
    attnx.scaled_dot_product_attention(query, key, value)
    alive = [weakref.ref(a) for a in (query, key, value)]
    del query, key, value
    gc.collect()
    assert all(ref() is None for ref in alive)


@pytest.mark.parametrize("length", [None, 40.0], ids=["unshifted", "running-maximum"])
def test_wide_causal_tasks_attend_their_rows_in_blocks(monkeypatch, length):
    """Causal tasks of ``SPLIT_WIDTH`` (slices times d_k) attend rows 0-63 and
    64-99 separately, each to the keys up to its own diagonal (m > n: the
    diagonal is shifted by m - n, and the keys take two blocks: m >
    KEY_CHUNK), with their exponentials unshifted or shifted."""
    from attnx_backends import numpy_attention

    rng = np.random.default_rng(2)
    n, m = 100, 4100
    q, k = (rng.standard_normal((16, 1, count, 32)).astype(np.float32) for count in (n, m))
    v = rng.standard_normal((16, 1, m, 16)).astype(np.float32)
    if length is not None:  # scores up to 40 * 40 / sqrt(32): the running maximum's path
        q *= length / np.linalg.norm(q, axis=-1, keepdims=True)
        k *= length / np.linalg.norm(k, axis=-1, keepdims=True)
    # One thread, and a budget for 16 slices a task: tasks aren't split for threads.
    monkeypatch.setattr(attnx._registry.get("numpy"), "concurrent_blocks", 1)
    blocks = _recorded_blocks(monkeypatch, lambda query, *args: query.shape[:2])
    with attnx.memory_budget(64 * 2**20):
        got = attnx.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert {rows for slices, rows in blocks} == {64, 36}, blocks
    assert min(slices for slices, _ in blocks) * 32 >= numpy_attention.SPLIT_WIDTH
    expected = _reference(q, k, v, is_causal=True)
    tolerance = TOLERANCE["float32"] if length is None else {"rtol": 1e-3, "atol": 1e-4}
    np.testing.assert_allclose(got, expected, **tolerance)


@settings(max_examples=300, deadline=None)
@given(n=st.integers(1, 3000), extra_keys=st.integers(0, 3000), count=st.integers(2, 8))
def test_causal_spans_cover_the_rows_in_spans_of_equal_work(n, extra_keys, count):
    """``count`` spans, last rows first, that cover rows 0..n once; each at
    least MIN_ROWS / 2 rows (narrower products lose a third of their speed);
    each computes ``rows * (r1 + m - n)`` scores, within rounding of the
    others.  None only where spans of equal work would be narrower."""
    from attnx_backends import numpy_attention as native

    m = n + extra_keys
    spans = native.causal_spans(n, m, count)
    if spans is None:
        # Even rows alone would give the narrowest span (the last, which
        # sees the most keys) no more rows than the others.
        assert n < count * native.MIN_ROWS // 2 or _narrowest_equal_span(n, m, count) < native.MIN_ROWS // 2 + 1
        return
    assert len(spans) == count
    assert [r0 for r0, _ in spans] == [r1 for _, r1 in spans[1:]] + [0] and spans[0][1] == n
    assert min(r1 - r0 for r0, r1 in spans) >= native.MIN_ROWS // 2
    work = [(r1 - r0) * (r1 + m - n) for r0, r1 in spans]
    # A boundary moved by half a row changes a span's work by half a row of keys.
    assert max(work) - min(work) <= 2 * m


def _narrowest_equal_span(n, m, count):
    """The rows of the last of ``count`` spans of equal work, unrounded: by
    bisection on the first boundaries, independently of the native's own."""
    offset = m - n

    def last_rows(work):
        r0 = 0.0
        for _ in range(count - 1):
            r0 = (r0 - offset + ((r0 + offset) ** 2 + 4 * work) ** 0.5) / 2
        return n - r0, (n - r0) * (n + offset) - work

    low, high = 0.0, float(n * m)
    for _ in range(100):
        middle = (low + high) / 2
        low, high = (middle, high) if last_rows(middle)[1] > 0 else (low, middle)
    return last_rows(low)[0]


@pytest.mark.parametrize(
    "n, m, dtype, spans",
    [(128, 128, "float32", {(79, 128), (0, 79)}), (128, 200, "float64", {(74, 128), (0, 74)})],
    ids=["square", "more-keys"],
)
def test_causal_calls_of_a_task_a_thread_attend_spans_of_rows_over_every_slice(monkeypatch, n, m, dtype, spans):
    """On two threads, a causal call of one task a thread takes two tasks of
    every slice, rows 0-78 to the keys up to their diagonal and rows 79-127
    to all of them, of about equal work (m > n: the diagonal moves by m -
    n), and computes the reference's attention."""
    rng = np.random.default_rng(4)
    q = rng.standard_normal((1, 8, n, 64)).astype(dtype)
    k, v = (rng.standard_normal((1, 8, m, 64)).astype(dtype) for _ in range(2))
    monkeypatch.setattr(attnx._registry.get("numpy"), "concurrent_blocks", 2)

    def span(query, key_t, value, output, totals, scale, is_causal, r0, *rest):
        return query.shape[0], r0, r0 + query.shape[1]

    blocks = _recorded_blocks(monkeypatch, span)
    got = attnx.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert sorted(blocks) == sorted((8, r0, r1) for r0, r1 in spans)
    np.testing.assert_allclose(got, _reference(q, k, v, is_causal=True), **TOLERANCE[dtype])


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(64, 300),
    extra_keys=st.integers(0, 100),
    heads=st.integers(1, 16),
    threads=st.integers(2, 4),
    d=st.sampled_from([8, 64]),
)
def test_causal_calls_on_any_threads_equal_the_reference(n, extra_keys, heads, threads, d):
    """Causal calls of every plan the threads give (spans, tasks of rows,
    blocks of MIN_ROWS inside them) compute the reference's attention."""
    rng = np.random.default_rng(n + heads)
    m = n + extra_keys
    q = rng.standard_normal((1, heads, n, d))
    k, v = (rng.standard_normal((1, heads, m, d)) for _ in range(2))
    backend = attnx._registry.get("numpy")
    before, backend.concurrent_blocks = backend.concurrent_blocks, threads
    try:
        got = attnx.scaled_dot_product_attention(q, k, v, is_causal=True)
    finally:
        backend.concurrent_blocks = before
    np.testing.assert_allclose(got, _reference(q, k, v, is_causal=True), **TOLERANCE["float64"])


@pytest.mark.filterwarnings("error")  # nothing of the unshifted run reaches the user
def test_causal_spans_run_again_shifted_where_a_slice_overflows_unshifted(monkeypatch):
    """A span covers every slice: where one slice's scores are beyond the
    largest exponential (entry 1, queries and keys pointing the same way),
    each span whose rows overflow runs again, shifted, and every slice comes
    out right; the spans of a call with ordinary scores run once."""
    rng = np.random.default_rng(5)
    q, k, v = (rng.standard_normal((2, 4, 128, 64)).astype(np.float32) for _ in range(3))
    monkeypatch.setattr(attnx._registry.get("numpy"), "concurrent_blocks", 2)
    runs = _recorded_blocks(monkeypatch, lambda *args: args[-1])  # shifted
    attnx.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert runs == [False, False]
    runs.clear()
    direction = np.zeros(64, dtype=np.float32)
    direction[0] = 40  # scores of 40**2 / 8 = 200: e^200 overflows float32
    q[1, :, 100:] += direction
    k[1, :, :4] += direction
    got = attnx.scaled_dot_product_attention(q, k, v, is_causal=True)
    # Rows 100-127 overflow: they are in the last span only.
    assert runs == [False, False, True]
    expected = _reference(q, k, v, is_causal=True)
    np.testing.assert_allclose(got[0], expected[0], **TOLERANCE["float32"])
    np.testing.assert_allclose(got[1], expected[1], rtol=1e-3, atol=1e-4)


@settings(max_examples=100, deadline=None)
@given(
    blocks=st.lists(
        st.tuples(st.integers(1, 12), st.integers(0, 12), st.integers(1, 6), st.integers(0, 12), st.integers(1, 6)),
        min_size=2,
        max_size=8,
    )
)
def test_causal_bands_are_shared_only_by_blocks_of_one_geometry(blocks):
    """The native keeps each block's causal band by its size and where the
    diagonal crosses it: every band it hands out, cached or not, is the
    causal rule's future for that block (key ``j`` after query ``i + m - n``),
    queries by keys or, as tiles held keys first see it, keys by queries."""
    from attnx_backends import numpy_attention

    for n, r0, rows, b0, width in blocks:
        r0 = min(r0, n - 1)
        r1 = min(n, r0 + rows)
        m = max(n, b0 + width)
        queries, keys = np.arange(r0, r1)[:, None], np.arange(b0, b0 + width)[None, :]
        for held_keys_first in (False, True):
            future = numpy_attention._band(n, m, r0, r1, b0, b0 + width, bool, held_keys_first)
            np.testing.assert_array_equal(future.T if held_keys_first else future, keys > queries + (m - n))


@settings(max_examples=300, deadline=None)
@given(
    slices=st.integers(1, 128),
    n=st.integers(1, 20_000),
    m=st.integers(1, 20_000),
    itemsize=st.sampled_from([4, 8]),
    is_causal=st.booleans(),
    threads=st.integers(1, 8),
    budget=st.integers(1, 2**28),
)
def test_native_plan_keeps_each_thread_within_its_share_of_the_budget(
    slices, n, m, itemsize, is_causal, threads, budget
):
    """Each task's scores fit ``budget / threads`` (issue 15: threads share
    the budget), unless the plan is at its floor (one slice, keys down to
    512, rows down to MIN_ROWS); rows are halved no further than that, so
    no block has fewer than MIN_ROWS / 2 rows that the query has (narrower
    products lose a third of their speed); with threads and work enough for
    them, every thread gets a task."""
    from attnx_backends import numpy_attention as native

    per_task, rows, key_chunk = native.plan(slices, n, m, itemsize, is_causal, threads, budget)
    assert 1 <= per_task <= slices and 1 <= rows <= min(n, native.MAX_ROWS) and 1 <= key_chunk <= m
    assert rows > min(n - 1, native.MIN_ROWS // 2)
    if per_task * rows * key_chunk * itemsize > budget // threads:
        assert per_task == 1 and rows <= native.MIN_ROWS and key_chunk <= 512
    row_blocks = -(-n // rows)
    if threads > 1 and slices * n * m >= native.PARALLEL_SCORES:
        assert -(-slices // per_task) * row_blocks >= min(threads, slices * row_blocks)


# -- masked calls in the native ---------------------------------------------


def _mask_layouts(rng, batch, n, m):
    """Masks in every layout the native takes: views of the user's array,
    whole or in runs of slices, or copies of one row of keys per slice."""
    return {
        # (B, 1, 1, m) on B x H slices: one row of keys per slice, copied.
        "padding_mask": (np.arange(m) < np.array([m, m // 3, 1])[:, None])[:, None, None, :],
        # (B, H, n, m): a view, with rows that may attend nothing.
        "full_mask": rng.random((*batch, n, m)) < np.linspace(0, 0.9, n)[:, None],
        # (n, m), float64 on float32 scores: cast to the scores' dtype, as attnx's rule says.
        "additive_shared": np.where(rng.random((n, m)) < 0.3, -np.inf, rng.standard_normal((n, m))),
        "keys_row": rng.random(m) < 0.8,
        # (B, 1, 1, 1): one flag per entry, broadcast over queries and keys, one entry masked whole.
        "per_entry_flag": np.array([True, False, True])[:, None, None, None],
        # (B, 1, n, m) and a (H, n, m) bias on B x H slices: views in runs of H slices.
        "per_entry_mask": rng.random((batch[0], 1, n, m)) < 0.7,
        "per_head_bias": rng.standard_normal((batch[1], n, m)),
        # One length per sequence, one of them 0: a task with no key to attend.
        "lengths": np.array([0, m // 3, m]),
        # One per query, some 0: rows with no key, beside rows with some.
        "lengths_per_query": rng.integers(0, m + 1, (*batch, n)) * (rng.random((*batch, n)) < 0.8),
    }


@pytest.mark.filterwarnings("error")  # nothing of the unshifted run reaches the user
@pytest.mark.parametrize("chunk_size", [None, (64, 96)], ids=["planned", "key-blocks"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("layout", list(_mask_layouts(np.random.default_rng(0), (3, 2), 1, 1)))
def test_native_takes_masked_calls_and_equals_the_reference(monkeypatch, layout, dtype, is_causal, chunk_size):
    """Masks and key_lengths in the native, on two threads: rows with no key
    (a sequence of length 0, rows of the mask all False) give zeros, and
    over several key blocks (``key-blocks``) a row whose first blocks are
    all masked joins the running sums without NaN."""
    rng = np.random.default_rng(3)
    batch, n, m = (3, 2), 200, 260
    q, k, v = (rng.standard_normal((*batch, count, 32)).astype(dtype) for count in (n, m, m))
    masks = _mask_layouts(rng, batch, n, m)
    name = "key_lengths" if layout.startswith("lengths") else "mask"
    call = {name: masks[layout]}
    monkeypatch.setattr(attnx._registry.get("numpy"), "concurrent_blocks", 2)
    blocks = _recorded_blocks(monkeypatch, lambda *args: args[-1])
    got = attnx.scaled_dot_product_attention(q, k, v, is_causal=is_causal, chunk_size=chunk_size, **call)
    assert blocks, "the native declined the call"
    expected = _reference(q, k, v, is_causal=is_causal, **call)
    np.testing.assert_allclose(got, expected, **TOLERANCE[dtype])


@pytest.mark.filterwarnings("error")  # nothing of the unshifted run reaches the user
@pytest.mark.parametrize("chunk_size", [None, (64, 96)], ids=["planned", "key-blocks"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("layout", list(_mask_layouts(np.random.default_rng(0), (3, 2), 1, 1)))
def test_masked_calls_that_overflow_unshifted_run_again_shifted_and_equal_the_reference(
    monkeypatch, layout, is_causal, chunk_size
):
    """Scores far above exp's range overflow the unshifted sums, so every
    task runs again shifted: there the masks forbid keys by -inf before the
    running maximum, and a row whose first key blocks are all masked joins
    the running sums later without NaN."""
    rng = np.random.default_rng(12)
    batch, n, m = (3, 2), 200, 260
    q, k, v = (rng.standard_normal((*batch, count, 32)) for count in (n, m, m))
    q *= 1000  # scores in the thousands: exp overflows in float64
    masks = _mask_layouts(rng, batch, n, m)
    call = {"key_lengths" if layout.startswith("lengths") else "mask": masks[layout]}
    monkeypatch.setattr(attnx._registry.get("numpy"), "concurrent_blocks", 2)
    runs = _recorded_blocks(monkeypatch, lambda *args: args[-1])  # shifted
    got = attnx.scaled_dot_product_attention(q, k, v, is_causal=is_causal, chunk_size=chunk_size, **call)
    assert True in runs
    expected = _reference(q, k, v, is_causal=is_causal, **call)
    np.testing.assert_allclose(got, expected, **TOLERANCE["float64"])


def test_native_takes_small_masked_calls_in_one_block(monkeypatch):
    """Calls too small for threads take every mask layout in one block,
    broadcast over the whole call, the values' leading axes included."""
    from attnx_backends import numpy_attention

    rng = np.random.default_rng(4)
    q, k = (rng.standard_normal((1, 2, 6, 4)) for _ in range(2))
    v = rng.standard_normal((3, 2, 6, 5))  # only the values have the batch
    small = []
    original = numpy_attention._attend_small_masked
    monkeypatch.setattr(numpy_attention, "_attend_small_masked", lambda *a: small.append(1) or original(*a))
    for layout, mask in _mask_layouts(rng, (3, 2), 6, 6).items():
        call = {"key_lengths" if layout.startswith("lengths") else "mask": mask}
        for is_causal in (False, True):
            got = attnx.scaled_dot_product_attention(q, k, v, is_causal=is_causal, **call)
            expected = _reference(q, k, v, is_causal=is_causal, **call)
            np.testing.assert_allclose(got, expected, **TOLERANCE["float64"], err_msg=f"{layout} causal={is_causal}")
    assert len(small) == 2 * len(_mask_layouts(rng, (3, 2), 6, 6))


@pytest.mark.parametrize(
    "batch, mask_shape, run",
    [
        ((2, 3), (2, 1), 3),
        ((2, 3), (1, 3), 3),
        ((3,), (3,), 3),
        ((2, 3), (2, 3), 6),
        ((2, 2, 3), (2, 1, 3), 3),
        ((2, 2, 3), (1, 1, 3), 3),
        ((2, 3), (1, 1), 6),
    ],
    ids=["per-entry", "per-head", "merged", "full", "three-axes", "three-axes-per-head", "shared"],
)
def test_native_cuts_blocks_where_a_mask_s_slices_stop_being_one_view(monkeypatch, batch, mask_shape, run):
    """A (B, 1, n, m) mask, or a (1, H, n, m) bias, on B x H slices is not one
    view of the slices laid end to end: it is laid out in runs of H slices,
    views of the user's array, and a task of more slices is cut at the runs'
    ends (one thread with a large budget: one task of every slice)."""
    from attnx_backends import numpy_masks

    rng = np.random.default_rng(5)
    n = 256  # (3, 256, 256) scores: more than a small call's one block
    q, k, v = (rng.standard_normal((*batch, n, 16)) for _ in range(3))
    mask = rng.random((*mask_shape, n, n)) < 0.5
    laid = numpy_masks.CallMasks(mask, None, batch, n, n).allowed
    assert np.shares_memory(laid.array, mask) and laid.run == run
    monkeypatch.setattr(attnx._registry.get("numpy"), "concurrent_blocks", 1)
    blocks = _recorded_blocks(monkeypatch, lambda query, *args: query.shape[0])
    with attnx.memory_budget(2**30):
        got = attnx.scaled_dot_product_attention(q, k, v, mask=mask, chunk_size=None)
    assert blocks == [run] * (math.prod(batch) // run)
    np.testing.assert_allclose(got, _reference(q, k, v, mask=mask), **TOLERANCE["float64"])


def test_padding_masks_on_slices_that_do_not_merge_are_copied_and_need_no_cut(monkeypatch):
    """A (B, 1, 1, m) padding mask on B x H slices is one row of keys per
    slice: copied (small beside the scores), in one run of every slice, so
    a task's block is not cut at the heads' ends."""
    from attnx_backends import numpy_masks

    rng = np.random.default_rng(5)
    n = 256
    q, k, v = (rng.standard_normal((2, 3, n, 16)) for _ in range(3))
    mask = (np.arange(n) < np.array([n, 100])[:, None])[:, None, None, :]
    laid = numpy_masks.CallMasks(mask, None, (2, 3), n, n).allowed
    assert not np.shares_memory(laid.array, mask) and laid.run == 6
    monkeypatch.setattr(attnx._registry.get("numpy"), "concurrent_blocks", 1)
    blocks = _recorded_blocks(monkeypatch, lambda query, *args: query.shape[0])
    with attnx.memory_budget(2**30):
        got = attnx.scaled_dot_product_attention(q, k, v, mask=mask, chunk_size=None)
    assert blocks == [6]
    np.testing.assert_allclose(got, _reference(q, k, v, mask=mask), **TOLERANCE["float64"])


@pytest.mark.parametrize("mask_dtype", ["float32", "float64"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_a_real_mask_reaches_blocks_in_the_scores_dtype(mask_dtype, dtype):
    """attnx's rule: a real mask takes the scores' dtype, then adds.  A
    block gets a view of the user's mask where the dtypes agree, a cast
    where they don't."""
    from attnx_backends import numpy_masks

    mask = np.random.default_rng(10).standard_normal((2, 8, 8)).astype(mask_dtype)
    masks = numpy_masks.CallMasks(mask, None, (2,), 8, 8).slices(0, 2)
    additive, allowed, kept = masks.block(0, 8, 0, 8, 0, np.dtype(dtype), None)
    assert allowed is None and kept is None and additive.dtype == dtype
    assert np.shares_memory(additive, mask) == (mask_dtype == dtype)
    np.testing.assert_array_equal(additive, mask.astype(dtype))


@pytest.mark.filterwarnings("error")  # nothing of the unshifted run reaches the user
@pytest.mark.parametrize("is_causal", [False, True])
def test_rows_with_no_key_need_no_second_run_and_rows_that_underflow_do(monkeypatch, is_causal):
    """Padded queries that attend nothing (a (B, 1, n, m) mask of valid
    queries and keys) sum to 0 unshifted: they are zeros, and no task runs
    again for them.  Rows whose keys are all allowed but far below the
    others (an additive -1e30: every exponential underflows) sum to 0 too,
    and run again: shifted, they attend their keys evenly."""
    rng = np.random.default_rng(8)
    n, lengths = 256, np.array([256, 100, 0])
    q, k, v = (rng.standard_normal((3, 4, n, 32)) for _ in range(3))
    valid = np.arange(n) < lengths[:, None]
    mask = (valid[:, :, None] & valid[:, None, :])[:, None]
    monkeypatch.setattr(attnx._registry.get("numpy"), "concurrent_blocks", 2)
    runs = _recorded_blocks(monkeypatch, lambda *args: args[-1])  # shifted
    got = attnx.scaled_dot_product_attention(q, k, v, mask=mask, is_causal=is_causal)
    assert runs and True not in runs
    np.testing.assert_allclose(got, _reference(q, k, v, mask=mask, is_causal=is_causal), **TOLERANCE["float64"])
    assert not got[1, :, 100:].any() and not got[2].any()
    if is_causal:  # even rows may attend their diagonal key only, odd rows the next key only: their future
        rows = np.arange(n)
        diagonal = np.zeros((n, n), dtype=bool)
        diagonal[rows, np.minimum(rows + rows % 2, n - 1)] = True
        runs.clear()
        got = attnx.scaled_dot_product_attention(q, k, v, mask=diagonal, is_causal=True)
        assert True not in runs
        np.testing.assert_allclose(got[:, :, ::2], v[:, :, ::2], **TOLERANCE["float64"])
        assert not got[:, :, 1:-1:2].any()
    runs.clear()
    additive = np.where(mask, 0.0, -np.inf)
    additive[0, :, 5] = -1e30  # query 5 of entry 0: its keys are allowed, but underflow unshifted
    got = attnx.scaled_dot_product_attention(q, k, v, mask=additive, is_causal=is_causal)
    assert True in runs
    np.testing.assert_allclose(got, _reference(q, k, v, mask=additive, is_causal=is_causal), **TOLERANCE["float64"])
    np.testing.assert_allclose(got[0, :, 5], v[0, :, : 6 if is_causal else n].mean(axis=-2), **TOLERANCE["float64"])


@pytest.mark.parametrize("padding", ["key_lengths", "boolean", "boolean_at_block_edge", "additive", "additive_shifts"])
def test_padding_masks_act_only_on_blocks_past_their_first_hole(monkeypatch, padding):
    """Key blocks before a padding mask's first forbidden (or, real, shifted)
    key, and before every length, take no mask at all: lengths of 150 need
    none (the keys stop there), a padding mask that also forbids key 100
    acts from the block that holds it (key 96 instead: from the block that
    begins there, none before)."""
    from attnx_backends import numpy_masks

    rng = np.random.default_rng(9)
    q, k, v = (rng.standard_normal((1, 2, 256, 32)) for _ in range(3))
    lengths = np.array([150])
    kept = np.arange(256) < 150
    kept[96 if padding == "boolean_at_block_edge" else 100] = False
    additive = np.where(kept, 0.0, -np.inf)
    if padding == "additive_shifts":
        additive[70] = 0.5  # shifts key 70
    call = {
        "key_lengths": {"key_lengths": lengths},
        "boolean": {"mask": kept},
        "boolean_at_block_edge": {"mask": kept},
        "additive": {"mask": additive},
        "additive_shifts": {"mask": additive},
    }[padding]
    masked = []
    original = numpy_masks.BlockMasks.block

    def recording(self, r0, r1, c0, c1, *args):
        found = original(self, r0, r1, c0, c1, *args)
        masked.append((c1, any(part is not None for part in found)))
        return found

    monkeypatch.setattr(numpy_masks.BlockMasks, "block", recording)
    got = attnx.scaled_dot_product_attention(q, k, v, chunk_size=(64, 32), **call)
    first_holes = {
        "key_lengths": 150,
        "boolean": 100,
        "boolean_at_block_edge": 96,
        "additive": 100,
        "additive_shifts": 70,
    }
    assert masked and all(applied == (c1 > first_holes[padding]) for c1, applied in masked), masked
    np.testing.assert_allclose(got, _reference(q, k, v, **call), **TOLERANCE["float64"])


@pytest.mark.parametrize("padding", ["key_lengths", "boolean", "additive"])
def test_native_computes_no_key_past_every_length(monkeypatch, padding):
    """A padded batch costs its lengths: a task's products stop at the
    longest length among its rows, and a sequence of length 0 takes none
    (its task of one slice gives zeros, and need not run again shifted).
    So do padding masks, one row of keys per slice, boolean or -inf."""
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal((3, 1, 256, 64)).astype(np.float32) for _ in range(3))
    lengths = np.array([100, 37, 0])
    kept = np.arange(256) < lengths[:, None, None, None]
    kept[0, ..., 50] = False  # a hole before the last key: the mask still reaches key 99
    call = {
        "key_lengths": {"key_lengths": lengths},
        "boolean": {"mask": kept},
        "additive": {"mask": np.where(kept, rng.standard_normal(kept.shape), -np.inf)},
    }[padding]
    monkeypatch.setattr(attnx._registry.get("numpy"), "concurrent_blocks", 2)
    stops = _recorded_key_stops(monkeypatch)
    runs = _recorded_blocks(monkeypatch, lambda *args: args[-1])  # shifted
    got = attnx.scaled_dot_product_attention(q, k, v, **call)
    assert sorted(set(stops)) == [37, 100]
    assert runs == [False] * 3  # zeros for length 0 are exact: nothing runs again
    np.testing.assert_allclose(got, _reference(q, k, v, **call), **TOLERANCE["float32"])
    assert not got[2].any()


def test_lengths_per_query_stop_each_block_of_rows_at_its_own_longest(monkeypatch):
    """With a length per query, a block of rows computes the keys up to the
    longest length among its own rows, not among the call's."""
    rng = np.random.default_rng(11)
    q, k, v = (rng.standard_normal((1, 1, 256, 32)) for _ in range(3))
    lengths = np.where(np.arange(256) < 128, 40, 200)[None, None]  # (1, 1, n)
    stops = _recorded_key_stops(monkeypatch)
    got = attnx.scaled_dot_product_attention(q, k, v, key_lengths=lengths, chunk_size=(128, 256))
    assert sorted(stops) == [40, 200]
    np.testing.assert_allclose(got, _reference(q, k, v, key_lengths=lengths), **TOLERANCE["float64"])


@settings(max_examples=25, deadline=None)
@given(
    batch=st.tuples(st.integers(1, 3), st.integers(1, 4)),
    n=st.integers(1, 300),
    m=st.integers(1, 300),
    layout=st.sampled_from(list(_mask_layouts(np.random.default_rng(0), (1, 1), 1, 1))),
    is_causal=st.booleans(),
    threads=st.integers(1, 3),
    chunks=st.one_of(st.none(), st.tuples(st.integers(1, 128), st.integers(1, 128))),
)
def test_masked_calls_of_any_plan_equal_the_reference(batch, n, m, layout, is_causal, threads, chunks):
    """Every mask layout the native takes, on any threads and blocks, computes
    the reference's attention (calls it declines, the generic algorithm's)."""
    rng = np.random.default_rng(n * m + batch[1])
    q = rng.standard_normal((*batch, n, 16))
    k, v = (rng.standard_normal((*batch, m, 16)) for _ in range(2))
    mask = _mask_layouts(rng, batch, n, m)[layout]
    if layout in ("padding_mask", "per_entry_flag", "lengths"):  # one per batch entry
        mask = mask[np.arange(batch[0]) % 3]
    call = {"key_lengths" if layout.startswith("lengths") else "mask": mask}
    backend = attnx._registry.get("numpy")
    before, backend.concurrent_blocks = backend.concurrent_blocks, threads
    try:
        got = attnx.scaled_dot_product_attention(q, k, v, is_causal=is_causal, chunk_size=chunks, **call)
    finally:
        backend.concurrent_blocks = before
    expected = _reference(q, k, v, is_causal=is_causal, **call)
    np.testing.assert_allclose(got, expected, **TOLERANCE["float64"])


@pytest.mark.parametrize("is_causal", [False, True])
def test_grouped_heads_read_each_key_slice_in_place(monkeypatch, is_causal):
    """Grouped heads that do not fold into rows (the causal rule over as many
    queries as keys; a mask per head): the native reads each key/value slice
    for its group's query slices, never broadcast into a copy per head,
    and computes what repeated keys give."""
    from attnx_backends import numpy_attention

    laid_out = []
    as_slices = numpy_attention._as_slices
    monkeypatch.setattr(
        numpy_attention, "_as_slices", lambda array, *rest: laid_out.append(array.shape) or as_slices(array, *rest)
    )
    gen = np.random.default_rng(7)
    q, k, v = (
        gen.standard_normal((2, 6, 300, 16)),
        gen.standard_normal((2, 2, 300, 16)),
        gen.standard_normal((2, 2, 300, 8)),
    )
    mask = gen.random((2, 6, 300, 300)) < 0.9
    out = attnx.scaled_dot_product_attention(q, k, v, is_causal=is_causal, mask=mask, enable_gqa=True)
    assert all(shape[-3:-1] != (1, 300) for shape in laid_out)  # no key or value broadcast to the query heads
    expected = attnx.scaled_dot_product_attention(
        q, np.repeat(k, 3, axis=1), np.repeat(v, 3, axis=1), is_causal=is_causal, mask=mask
    )
    np.testing.assert_allclose(out, expected, rtol=1e-12, atol=1e-12)
