"""tests/cuda_on_cpu.py, which runs the CuPy backend's CUDA kernels on the
CPU for test_cupy_native: it computes what CUDA would, and refuses what a
GPU would get wrong."""

from __future__ import annotations

import cuda_on_cpu
import numpy as np
import pytest

pytestmark = pytest.mark.skipif(cuda_on_cpu.UNAVAILABLE is not None, reason=str(cuda_on_cpu.UNAVAILABLE))

# Each block sums its slice of ``values`` by a warp's shuffles and shared
# memory, and writes its index and thread count; a thread per value.
BLOCK_SUMS = r"""
extern "C" __global__ void block_sums(const float* values, float* sums, int* blocks, const int count) {
    __shared__ float partial[32];
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    float value = i < count ? values[i] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) value += __shfl_xor_sync(0xffffffff, value, o);
    if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = value;
    __syncthreads();
    if (threadIdx.x == 0) {
        float total = 0.0f;
        for (int w = 0; w < blockDim.x / 32; ++w) total += partial[w];
        sums[blockIdx.x] = total;
        blocks[2 * blockIdx.x] = blockIdx.x;
        blocks[2 * blockIdx.x + 1] = blockDim.x * gridDim.x;
    }
}
"""


def test_a_kernel_computes_what_cuda_would():
    values = np.arange(300, dtype=np.float32)
    sums, blocks = np.zeros(5, dtype=np.float32), np.zeros(10, dtype=np.int32)
    kernel = cuda_on_cpu.RawKernel(BLOCK_SUMS, "block_sums")
    kernel((5,), (64,), (values, sums, blocks, np.int32(300)))
    np.testing.assert_array_equal(sums, np.add.reduceat(values, np.arange(0, 300, 64)))
    np.testing.assert_array_equal(blocks, np.ravel([(b, 320) for b in range(5)]))


# Thread t writes element t of a dynamic shared array, reads its
# neighbour's after the barrier; thread 0 writes one more, ``extra`` past the
# last.
NEIGHBOURS = r"""
extern "C" __global__ void neighbours(float* output, const int extra, const int skip) {
    extern __shared__ __align__(16) float row[];
    const int t = threadIdx.x;
    row[t] = (float)(t * t);
    if (skip == 0 || t != 3) __syncthreads();
    output[t] = row[(t + 1) % blockDim.x];
    if (t == 0) output[blockDim.x + extra] = 1.0f;
}
"""


def test_dynamic_shared_memory_is_the_launchs():
    output = np.zeros(9, dtype=np.float32)
    cuda_on_cpu.RawKernel(NEIGHBOURS, "neighbours")((1,), (8,), (output, np.int32(0), np.int32(0)), shared_mem=32)
    expected = np.append(np.roll(np.arange(8), -1) ** 2, 1).astype(np.float32)
    np.testing.assert_array_equal(output, expected)


def test_a_write_past_an_arrays_end_fails():
    kernel = cuda_on_cpu.RawKernel(NEIGHBOURS, "neighbours")
    with pytest.raises(cuda_on_cpu.KernelFailure, match="wrote past an end of 'float \\*'"):
        kernel((1,), (8,), (np.zeros(9, dtype=np.float32), np.int32(1), np.int32(0)), shared_mem=32)


def test_a_barrier_that_a_thread_skips_fails():
    kernel = cuda_on_cpu.RawKernel(NEIGHBOURS, "neighbours")
    with pytest.raises(cuda_on_cpu.KernelFailure, match="__syncthreads: not every thread arrived"):
        kernel((1,), (8,), (np.zeros(9, dtype=np.float32), np.int32(0), np.int32(1)), shared_mem=32)


def test_a_full_mask_shuffle_in_a_partial_warp_fails():
    kernel = cuda_on_cpu.RawKernel(BLOCK_SUMS, "block_sums")
    arguments = (np.ones(40, dtype=np.float32), np.zeros(1, dtype=np.float32), np.zeros(2, dtype=np.int32))
    with pytest.raises(cuda_on_cpu.KernelFailure, match="fewer than 32 threads"):
        kernel((1,), (40,), (*arguments, np.int32(40)))


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (
            (np.ones(4), np.zeros(1, np.float32), np.zeros(2, np.int32), np.int32(4)),
            "'const float \\*' given ndarray of float64",
        ),
        ((np.ones(4, np.float32), np.zeros(1, np.float32), np.zeros(2, np.int32), 4), "'const int' given a Python int"),
        ((np.ones(4, np.float32), np.zeros(1, np.float32), np.zeros(2, np.int32), np.int64(4)), "given int64 of int64"),
        (
            (np.ones((4, 2), np.float32)[:, 0], np.zeros(1, np.float32), np.zeros(2, np.int32), np.int32(4)),
            "not C-ordered",
        ),
        ((np.ones(4, np.float32), np.zeros(1, np.float32), np.int32(4)), "takes 4 arguments, got 3"),
    ],
)
def test_arguments_a_gpu_would_misread_are_refused(arguments, message):
    with pytest.raises(TypeError, match=message):
        cuda_on_cpu.RawKernel(BLOCK_SUMS, "block_sums")((1,), (32,), arguments)
