"""Which algorithm and which blocks attention picks (sizes only, nothing timed)."""

from __future__ import annotations

import numpy as np
import pytest

import attnx
from attnx._tiling import BLOCK_BYTES, slices_per_block
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
    with pytest.raises(
        TypeError, match=r"memory_budget: the memory budget must be an integer number of bytes, got '1GB'"
    ):
        attnx.memory_budget("1GB").__enter__()


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
