// CUDA's device built-ins on the CPU, for tests/cuda_on_cpu.py: each thread
// of a block is a std::thread, a block's threads meet at __syncthreads() and a
// warp's at its shuffles, and blocks run one after another, so that a
// kernel's __shared__ variables (static here) hold one block's state at a
// time.  Enough of CUDA for attnx's kernels, no more: what a kernel uses
// beyond it fails to compile, which is the signal to add it here.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstddef>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))

struct uint3 { unsigned x, y, z; };
struct dim3 { unsigned x, y, z; };
struct __align__(16) float4 { float x, y, z, w; };
struct __align__(8) float2 { float x, y; };
struct __align__(16) double2 { double x, y; };
struct __align__(16) int4 { int x, y, z, w; };

namespace emu {

struct Failure : std::runtime_error {
    using std::runtime_error::runtime_error;
};

inline std::atomic<bool> failed{false};

// A barrier that gives up after a while: a __syncthreads() that not every
// thread reaches deadlocks a GPU; here it fails the launch.
class Barrier {
  public:
    explicit Barrier(int count) : count_(count) {}
    void wait(const char* where) {
        std::unique_lock<std::mutex> lock(mutex_);
        const long generation = generation_;
        if (++arrived_ == count_) {
            arrived_ = 0;
            ++generation_;
            ready_.notify_all();
            return;
        }
        // Waits in slices, so that a thread that failed elsewhere ends the others' waits.
        const auto deadline = std::chrono::steady_clock::now() + patience();
        while (!ready_.wait_for(lock, std::chrono::milliseconds(20), [&] { return generation_ != generation; })) {
            if (failed.load()) throw Failure("another thread failed");
            if (std::chrono::steady_clock::now() > deadline)
                throw Failure(std::string(where) + ": not every thread arrived (a barrier in divergent code?)");
        }
    }

  private:
    static std::chrono::milliseconds patience() {
        const char* seconds = std::getenv("ATTNX_CUDA_ON_CPU_SECONDS");
        return std::chrono::milliseconds(seconds ? (long)(1000 * std::atof(seconds)) : 20000);
    }
    std::mutex mutex_;
    std::condition_variable ready_;
    const int count_;
    int arrived_ = 0;
    long generation_ = 0;
};

struct Block {
    dim3 size;
    Barrier* threads;
    std::vector<Barrier*> warps;
    std::vector<int> warp_sizes;
    unsigned long long exchange[64][32];  // a slot a lane, for the shuffles
};

inline thread_local int linear_thread = 0;
inline thread_local Block* block = nullptr;
inline unsigned char* dynamic_shared = nullptr;
inline std::mutex atomics;

}  // namespace emu

inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline dim3 blockDim;
inline dim3 gridDim;

inline void __syncthreads() { emu::block->threads->wait("__syncthreads"); }

// A warp's shuffle: every lane of the warp writes its value, then reads its
// source lane's.  A source outside the warp (a partial last warp) fails.
template <typename T>
inline T emu_shuffle(unsigned mask, T value, int source, int width, const char* name) {
    if (mask != 0xffffffffu) throw emu::Failure(std::string(name) + ": only the full mask is emulated");
    const int warp = emu::linear_thread / 32, lane = emu::linear_thread % 32;
    if (emu::block->warp_sizes[warp] != 32)
        throw emu::Failure(std::string(name) + ": the full mask in a warp of fewer than 32 threads");
    const int segment = lane / width * width;
    if (source < segment || source >= segment + width) source = lane;  // CUDA: outside the segment, its own value
    std::memcpy(&emu::block->exchange[warp][lane], &value, sizeof(T));
    emu::block->warps[warp]->wait(name);
    T result;
    std::memcpy(&result, &emu::block->exchange[warp][source], sizeof(T));
    emu::block->warps[warp]->wait(name);
    return result;
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T value, int lane_mask, int width = 32) {
    const int lane = emu::linear_thread % 32;
    return emu_shuffle(mask, value, (lane ^ lane_mask), width, "__shfl_xor_sync");
}
template <typename T>
inline T __shfl_down_sync(unsigned mask, T value, unsigned delta, int width = 32) {
    const int lane = emu::linear_thread % 32;
    return emu_shuffle(mask, value, lane + (int)delta, width, "__shfl_down_sync");
}
template <typename T>
inline T __shfl_sync(unsigned mask, T value, int source, int width = 32) {
    const int lane = emu::linear_thread % 32;
    return emu_shuffle(mask, value, lane / width * width + source % width, width, "__shfl_sync");
}
inline void __syncwarp(unsigned mask = 0xffffffffu) {
    (void)mask;
    const int warp = emu::linear_thread / 32;
    emu::block->warps[warp]->wait("__syncwarp");
}

template <typename T>
inline T atomicMax(T* address, T value) {
    std::lock_guard<std::mutex> lock(emu::atomics);
    const T old = *address;
    *address = std::max(old, value);
    return old;
}
template <typename T>
inline T atomicAdd(T* address, T value) {
    std::lock_guard<std::mutex> lock(emu::atomics);
    const T old = *address;
    *address = old + value;
    return old;
}

inline float __int_as_float(unsigned bits) { float f; std::memcpy(&f, &bits, 4); return f; }
inline double __longlong_as_double(unsigned long long bits) { double d; std::memcpy(&d, &bits, 8); return d; }
inline float __expf(float x) { return std::exp(x); }
inline float exp2f(float x) { return std::exp2(x); }
inline float __fdividef(float a, float b) { return a / b; }
using std::exp;

namespace emu {

// Runs ``kernel`` over the grid, a block at a time, each block's threads at
// once; returns "" or the first failure's message.
inline std::string run(dim3 grid, dim3 block_size, size_t shared_bytes, const std::function<void()>& kernel) {
    const int threads = (int)(block_size.x * block_size.y * block_size.z);
    gridDim = grid;
    blockDim = block_size;
    std::vector<unsigned char> shared(shared_bytes + 16);
    dynamic_shared = shared.data() + (16 - reinterpret_cast<std::uintptr_t>(shared.data()) % 16) % 16;
    Barrier threads_barrier(threads), block_end(threads);
    Block state{block_size, &threads_barrier, {}, {}, {}};
    std::deque<Barrier> warp_barriers;  // not moved as it grows: barriers hold a mutex
    for (int first = 0; first < threads; first += 32) {
        const int lanes = std::min(32, threads - first);
        warp_barriers.emplace_back(lanes);
        state.warp_sizes.push_back(lanes);
    }
    if (warp_barriers.size() > 64) return "a block of more than 2048 threads";
    for (auto& barrier : warp_barriers) state.warps.push_back(&barrier);
    std::mutex failure_lock;
    std::string failure;
    failed = false;
    std::vector<std::thread> pool;
    for (int t = 0; t < threads; ++t) {
        pool.emplace_back([&, t] {
            linear_thread = t;
            emu::block = &state;
            threadIdx = {(unsigned)t % block_size.x, (unsigned)t / block_size.x % block_size.y,
                         (unsigned)t / (block_size.x * block_size.y)};
            for (unsigned z = 0; z < grid.z; ++z)
                for (unsigned y = 0; y < grid.y; ++y)
                    for (unsigned x = 0; x < grid.x; ++x) {
                        if (t == 0) std::memset(shared.data(), 0xff, shared.size());  // NaN, until written
                        try {
                            block_end.wait("the block's start");
                            blockIdx = {x, y, z};
                            kernel();
                            block_end.wait("the block's end");
                        } catch (const std::exception& error) {
                            std::lock_guard<std::mutex> lock(failure_lock);
                            if (failure.empty()) failure = error.what();
                            failed = true;
                            return;
                        }
                    }
        });
    }
    for (auto& thread : pool) thread.join();
    return failure;
}

}  // namespace emu
