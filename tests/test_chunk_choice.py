"""Which algorithm and which blocks attention picks (sizes only, nothing timed)."""

from __future__ import annotations

import numpy as np
import pytest

import attnx
from attnx._tiling import BLOCK_BYTES, batch_groups, bytes_per_block, slices_per_block
from attnx.attention import choose_chunks

XP = attnx._registry.get("numpy").xp


def chunks(shape, *, causal=False, dtype=np.float32, **kwargs):
    q = np.zeros(shape, dtype=dtype)
    return choose_chunks(
        XP,
        q.dtype,
        shape[-2],
        shape[-2],
        shape[:-2],
        kwargs.get("chunk_size"),
        kwargs.get("return_weights", False),
        causal,
        kwargs.get("workers", 1),
        kwargs.get("block_bytes", BLOCK_BYTES),
    )


def test_small_problems_use_the_plain_algorithm():
    assert chunks((1, 1, 16, 16)) is None
    assert chunks((1, 8, 128, 64)) is None


def test_large_problems_are_chunked_within_the_block_size():
    rows, keys = chunks((1, 1, 8192, 64))
    assert rows * keys * 4 <= BLOCK_BYTES and rows >= 128
    rows, keys = chunks((1, 8, 4096, 64))
    assert rows * keys * 4 <= BLOCK_BYTES and rows >= 128
    assert slices_per_block(XP, np.float32, (rows, keys), 8) * rows * keys * 4 <= BLOCK_BYTES


def test_the_plan_is_per_slice_not_divided_by_the_batch():
    """A large batch keeps blocks of efficient height: it is split into
    groups of slices instead (4-row blocks made 79,985 tasks on Dask)."""
    rows, keys = chunks((64, 8, 1024, 64))
    assert (rows, keys) == (1024, 1024)  # one slice's scores, 4 MiB: a block of its own
    assert slices_per_block(XP, np.float32, (rows, keys), 64 * 8) * rows * keys * 4 <= BLOCK_BYTES
    assert chunks((16, 8, 1024, 64), causal=True)[0] >= 64


def test_concurrent_workers_share_mid_sized_problems():
    # within the budget, but blocks to share: eight heads give each worker a block of whole rows
    assert chunks((1, 8, 128, 64), workers=2) == (128, 128)
    assert chunks((1, 8, 64, 64), workers=2) is None  # too small to pay for threads
    assert chunks((1, 1, 256, 64), workers=2) is None
    assert chunks((1, 1, 1024, 64), workers=2) == (512, 1024)
    assert chunks((1, 1, 1024, 64), workers=16) == (64, 1024)  # never thinner than 64 rows
    rows, _ = chunks((1, 8, 2048, 64), workers=2)
    assert rows <= 1024


@pytest.mark.parametrize("workers", [2, 4, 8])
def test_batch_groups_give_every_worker_a_block(workers):
    """Where the rows make fewer blocks than there are workers (one block of
    128 rows here), the batch is cut into groups so that each worker has one."""
    groups, rows = batch_groups(XP, np.float32, (8, 4), 128, 128, 128, workers)
    assert rows == 128 and len(groups) >= workers
    assert [start for start, _ in groups] == list(range(0, 8, 8 // workers))


def test_blocks_in_flight_share_the_block_and_the_budget():
    assert bytes_per_block(1, 2**22) == 2**22
    assert bytes_per_block(4, 2**22) == 2**20
    with attnx.memory_budget(2**21):  # a budget below the block: it is shared
        assert bytes_per_block(2, 2**22) == 2**20


def test_causal_blocks_are_thinner():
    assert chunks((1, 1, 8192, 64), causal=True)[0] <= chunks((1, 1, 8192, 64))[0]
    assert chunks((1, 8, 512, 64), causal=True)[0] == 64


def test_budget_and_explicit_chunk_size():
    with attnx.memory_budget(2**40):
        assert chunks((1, 8, 2048, 64)) is None
    assert chunks((1, 1, 16, 16), chunk_size=4) == (4, 16)
    assert chunks((1, 1, 16, 16), chunk_size=(4, 8)) == (4, 8)
    assert chunks((1, 1, 2048, 64), return_weights=True) is None
    with pytest.raises(ValueError, match="set_memory_budget: the memory budget must be a positive number of bytes"):
        attnx.set_memory_budget(0)
    with pytest.raises(TypeError, match=r"memory_budget: the memory budget \(nbytes\) must be an integer, got '1GB'"):
        attnx.memory_budget("1GB").__enter__()
    with pytest.raises(TypeError, match=r"the memory budget \(nbytes\) must be an integer, got True"):
        attnx.set_memory_budget(True)
    with attnx.memory_budget(np.int64(2**40)):  # NumPy's integers are integers
        assert attnx.get_memory_budget() == 2**40 and type(attnx.get_memory_budget()) is int
    with attnx.memory_budget(1):  # the least budget there is: blocks at their floor, not an error
        assert attnx.get_memory_budget() == 1


def test_a_backends_block_size_is_its_default_budget():
    """A GPU backend's larger blocks (``Backend.block_bytes``) are its default
    budget and its block size; a budget the user sets caps both."""
    gpu = 256 * 2**20
    assert chunks((1, 8, 2048, 64), block_bytes=gpu) is None  # 128 MiB of scores: one plain call
    rows, keys = chunks((1, 8, 8192, 64), block_bytes=gpu)
    slices = slices_per_block(XP, np.float32, (rows, keys), 8, block_bytes=gpu)
    assert BLOCK_BYTES < slices * rows * keys * 4 <= gpu
    with attnx.memory_budget(8 * 2**20):
        rows, keys = chunks((1, 8, 8192, 64), block_bytes=gpu)
        assert slices_per_block(XP, np.float32, (rows, keys), 8, block_bytes=gpu) * rows * keys * 4 <= 8 * 2**20


def test_the_default_budget_is_the_backends():
    numpy_backend = attnx._registry.get("numpy")
    assert attnx.get_memory_budget() == attnx.get_memory_budget("numpy") == numpy_backend.block_bytes == 4 * 2**20

    class Wide(type(numpy_backend)):
        block_bytes = 2**30

    assert attnx.get_memory_budget(Wide()) == 2**30
    with attnx.memory_budget(2**20):
        assert attnx.get_memory_budget(Wide()) == attnx.get_memory_budget() == 2**20


def test_pytorch_s_cuda_tensors_get_a_gpu_s_blocks():
    """One backend, two kinds of device: CUDA tensors' blocks are launch-bound
    as CuPy's, the CPU's stay cache-sized (no GPU is needed to ask)."""
    torch = pytest.importorskip("torch")
    from attnx.backend import GPU_BLOCK_BYTES

    assert GPU_BLOCK_BYTES == 512 * 2**20  # measured: within 4% of 1 GiB blocks (docs/archive/bench-sessions.md, "GPU")
    assert attnx.get_memory_budget("torch") == attnx.get_memory_budget("torch", torch.device("cpu")) == BLOCK_BYTES
    for device in ("cuda:0", torch.device("cuda", 1)):
        assert attnx.get_memory_budget("torch", device) == GPU_BLOCK_BYTES
    with attnx.memory_budget(2**20):
        assert attnx.get_memory_budget("torch", "cuda:0") == 2**20


def test_jax_s_gpus_get_a_gpu_s_blocks():
    """JAX's GPU devices (``platform`` "gpu") take a GPU's blocks, its CPU
    devices the CPU's: read from the device, whatever the machine has."""
    jax = pytest.importorskip("jax")
    from attnx.backend import GPU_BLOCK_BYTES

    class GpuDevice:  # the attribute JAX's CUDA devices carry
        platform = "gpu"

    assert attnx.get_memory_budget("jax", jax.devices("cpu")[0]) == BLOCK_BYTES
    assert attnx.get_memory_budget("jax", GpuDevice()) == GPU_BLOCK_BYTES


def test_jax_under_jit_plans_for_the_default_backend(monkeypatch):
    """A tracer has no device (None under jit); its program runs on the
    default backend.  On the CPU it keeps the CPU's 4 MiB tiles; on a GPU it
    takes 64 MiB, not a GPU's 512 MiB for concrete arrays: on an H200 the
    jitted window took 1.60 ms in 4 MiB tiles, 1.61 ms in 64 MiB and 4.29 ms
    in 512 MiB, and additive attention's traced loop 39.0 ms in chunks of 4
    MiB against 5.46 ms (docs/archive/bench-sessions.md)."""
    jax = pytest.importorskip("jax")
    from attnx_backends.jax_backend import TRACED_GPU_BLOCK_BYTES

    seen = []

    def length_of_program(platform):
        monkeypatch.setattr(jax, "default_backend", lambda: platform)
        seen.append(attnx.get_memory_budget("jax", None))
        query = jax.numpy.zeros((1, 8, 2048, 16), dtype=jax.numpy.float32)
        window = attnx.create_block_mask(attnx.mods.sliding_window(256), None, None, 2048, 2048, backend="jax")

        def call(q):  # with dropout: attnx's own tiles (traced on the CPU, a call without runs in JAX's loops)
            return attnx.flex_attention(q, q, q, block_mask=window, dropout_p=0.1, dropout_seed=0)

        traced = jax.make_jaxpr(call)(query)
        return len(traced.eqns)

    assert length_of_program("gpu") < length_of_program("cpu")
    assert seen == [TRACED_GPU_BLOCK_BYTES, BLOCK_BYTES]
    assert TRACED_GPU_BLOCK_BYTES == 64 * 2**20


def test_the_generic_algorithms_plan_on_the_arrays_device(monkeypatch):
    """flex_attention's steps, create_block_mask's tiles, the attention's
    chunks and additive attention's follow the block size the backend gives
    the arrays' device."""
    numpy_backend = attnx._registry.get("numpy")
    asked = []

    def block_bytes_on(device):
        asked.append(device)
        return 64

    evaluated = []

    def counted_causal(b, h, q_idx, kv_idx):
        evaluated.append(q_idx.shape)
        return q_idx >= kv_idx

    n = 1024
    query = np.zeros((1, 1, n, 8), dtype=np.float32)
    wide = attnx.create_block_mask(counted_causal, None, None, n, n)
    made_in = len(evaluated)
    monkeypatch.setattr(numpy_backend, "block_bytes_on", block_bytes_on)
    assert len(attnx.create_block_mask(counted_causal, None, None, n, n).kinds) and len(evaluated) > 2 * made_in
    evaluated.clear()
    attnx.flex_attention(query, query, query, block_mask=wide)
    assert len(evaluated) == n // 128  # one row of blocks a step: its diagonal block masked
    assert set(asked) == {"cpu"}
    asked.clear()
    attnx.scaled_dot_product_attention(query, query, query, is_causal=True)
    assert asked == ["cpu", "cpu"]  # the attention's plan, then the NumPy native's budget
    asked.clear()
    params = {"w_q": np.ones((8, 3), np.float32), "w_k": np.ones((8, 3), np.float32), "w_v": np.ones(3, np.float32)}
    attnx.additive_attention(query[0], query[0], query[0], params)
    assert asked == ["cpu"]  # its chunks of queries


def test_a_loop_a_tracer_unrolls_takes_larger_chunks(monkeypatch):
    """Where a tracer unrolls the default map_chunks (PyTorch's, here under
    torch.func.vmap, whose batched tensors count as traced), each chunk is
    compiled on its own: the chunks hold UNROLLED_CHUNK_BYTES at least, not
    the CPU's 4 MiB (Nadaraya-Watson at n = m = 16384 compiled 256 chunks
    in 102 s, 16 in 31 s).  JAX's own traced loop keeps its blocks."""
    torch = pytest.importorskip("torch")
    jax = pytest.importorskip("jax")
    from attnx._tiling import UNROLLED_CHUNK_BYTES

    sizes = {}

    def spy(name):
        backend = attnx._registry.get(name)
        original = backend.map_chunks

        def map_chunks(function, array, size):
            sizes.setdefault(name, []).append(size)
            return original(function, array, size)

        monkeypatch.setattr(backend, "map_chunks", map_chunks)

    m = 2**17  # 512 KiB of float32 kernel a query: 8 queries to 4 MiB, 32 to 16 MiB
    for name in ("torch", "jax"):
        spy(name)
    keys = np.linspace(0.0, 1.0, m, dtype=np.float32)
    queries = np.linspace(0.0, 1.0, 40, dtype=np.float32)
    tk, tq = torch.from_numpy(keys), torch.from_numpy(queries)
    attnx.nadaraya_watson(tq, tk, tk)
    torch.func.vmap(lambda q: attnx.nadaraya_watson(q, tk, tk))(tq[None])
    jk, jq = jax.numpy.asarray(keys), jax.numpy.asarray(queries)
    jax.jit(lambda q: attnx.nadaraya_watson(q, jk, jk))(jq)
    assert sizes == {"torch": [8, UNROLLED_CHUNK_BYTES // (4 * m)], "jax": [8]}
    assert UNROLLED_CHUNK_BYTES // (4 * m) == 32
