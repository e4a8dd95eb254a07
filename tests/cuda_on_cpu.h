// CUDA's device built-ins on the CPU, for tests/cuda_on_cpu.py.  Each thread
// of a block is a fiber (ucontext) with a stack of its own, run in turn on
// one thread of the CPU: a fiber runs until it waits at __syncthreads() or a
// warp's shuffle, then the next; a barrier lets its fibers on when all have
// arrived.  A round in which no fiber moves is a deadlock (a barrier in
// divergent code), caught at once.  Blocks run one after another, so that a
// kernel's __shared__ variables (static here) hold one block's state at a
// time.  Enough of CUDA for attnx's kernels, no more: what a kernel uses
// beyond it fails to compile, which is the signal to add it here.
#include <ucontext.h>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
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

inline uint3 threadIdx;
inline uint3 blockIdx;
inline dim3 blockDim;
inline dim3 gridDim;

namespace emu {

struct Failure : std::runtime_error {
    using std::runtime_error::runtime_error;
};

struct Fiber {
    ucontext_t context;
    std::unique_ptr<char[]> stack;
    int index = 0;
    bool done = false;
};

inline ucontext_t scheduler;
inline Fiber* current = nullptr;
inline const std::function<void()>* kernel = nullptr;
inline std::string failure;
inline bool aborting = false;  // a fiber failed: the others unwind at their next wait
inline long moves = 0;         // barriers passed and fibers finished: a round without any is a deadlock
inline const char* waiting_at = "";
inline unsigned char* dynamic_shared = nullptr;

inline void yield() { swapcontext(&current->context, &scheduler); }

class Barrier {
  public:
    explicit Barrier(int count) : count_(count) {}
    void wait(const char* where) {
        if (aborting) throw Failure("another thread failed");
        const long generation = generation_;
        if (++arrived_ == count_) {
            arrived_ = 0;
            ++generation_;
            ++moves;
            return;
        }
        while (generation_ == generation) {
            waiting_at = where;
            yield();
            if (aborting) throw Failure("another thread failed");
        }
    }

  private:
    const int count_;
    int arrived_ = 0;
    long generation_ = 0;
};

inline Barrier* block_barrier = nullptr;
inline std::vector<std::unique_ptr<Barrier>> warp_barriers;
inline std::vector<int> warp_sizes;
inline unsigned long long exchange[64][32];  // a slot a lane, for the shuffles

inline void run_fiber() {
    try {
        (*kernel)();
    } catch (const std::exception& error) {
        if (failure.empty()) failure = error.what();
        aborting = true;
    }
    current->done = true;
    ++moves;
}  // returns to the scheduler (uc_link)

// Runs ``body`` over the grid, a block at a time, each block's threads as
// fibers; returns "" or the first failure's message.
inline std::string run(dim3 grid, dim3 block, size_t shared_bytes, const std::function<void()>& body) {
    const int threads = (int)(block.x * block.y * block.z);
    if (threads > 2048) return "a block of more than 2048 threads";
    gridDim = grid;
    blockDim = block;
    kernel = &body;
    failure.clear();
    aborting = false;
    std::vector<unsigned char> shared(shared_bytes + 16);
    dynamic_shared = shared.data() + (16 - reinterpret_cast<std::uintptr_t>(shared.data()) % 16) % 16;
    Barrier whole_block(threads);
    block_barrier = &whole_block;
    warp_barriers.clear();
    warp_sizes.clear();
    for (int first = 0; first < threads; first += 32) {
        warp_sizes.push_back(std::min(32, threads - first));
        warp_barriers.push_back(std::make_unique<Barrier>(warp_sizes.back()));
    }
    const size_t stack_bytes = 256 * 1024;
    std::vector<Fiber> fibers(threads);
    for (int t = 0; t < threads; ++t) {
        fibers[t].index = t;
        fibers[t].stack.reset(new char[stack_bytes]);
    }
    for (unsigned z = 0; z < grid.z; ++z)
        for (unsigned y = 0; y < grid.y; ++y)
            for (unsigned x = 0; x < grid.x; ++x) {
                blockIdx = {x, y, z};
                std::memset(shared.data(), 0xff, shared.size());  // NaN, until written
                for (auto& fiber : fibers) {
                    getcontext(&fiber.context);
                    fiber.context.uc_stack.ss_sp = fiber.stack.get();
                    fiber.context.uc_stack.ss_size = stack_bytes;
                    fiber.context.uc_link = &scheduler;
                    fiber.done = false;
                    makecontext(&fiber.context, run_fiber, 0);
                }
                for (int live = threads; live > 0;) {
                    const long before = moves;
                    for (auto& fiber : fibers) {
                        if (fiber.done) continue;
                        current = &fiber;
                        threadIdx = {(unsigned)fiber.index % block.x, (unsigned)fiber.index / block.x % block.y,
                                     (unsigned)fiber.index / (block.x * block.y)};
                        swapcontext(&scheduler, &fiber.context);
                    }
                    live = (int)std::count_if(fibers.begin(), fibers.end(), [](const Fiber& f) { return !f.done; });
                    if (live > 0 && moves == before && !aborting) {
                        failure = std::string(waiting_at) + ": not every thread arrived (a barrier in divergent code?)";
                        aborting = true;  // the next round unwinds every fiber
                    }
                }
                if (!failure.empty()) return failure;
            }
    return "";
}

}  // namespace emu

inline int emu_thread() { return emu::current->index; }

inline void __syncthreads() { emu::block_barrier->wait("__syncthreads"); }

// A warp's shuffle: every lane of the warp writes its value, then reads its
// source lane's.  A full mask in a partial warp fails.
template <typename T>
inline T emu_shuffle(unsigned mask, T value, int source, int width, const char* name) {
    if (mask != 0xffffffffu) throw emu::Failure(std::string(name) + ": only the full mask is emulated");
    const int warp = emu_thread() / 32, lane = emu_thread() % 32;
    if (emu::warp_sizes[warp] != 32)
        throw emu::Failure(std::string(name) + ": the full mask in a warp of fewer than 32 threads");
    const int segment = lane / width * width;
    if (source < segment || source >= segment + width) source = lane;  // CUDA: outside the segment, its own value
    std::memcpy(&emu::exchange[warp][lane], &value, sizeof(T));
    emu::warp_barriers[warp]->wait(name);
    T result;
    std::memcpy(&result, &emu::exchange[warp][source], sizeof(T));
    emu::warp_barriers[warp]->wait(name);
    return result;
}
template <typename T>
inline T __shfl_xor_sync(unsigned mask, T value, int lane_mask, int width = 32) {
    return emu_shuffle(mask, value, (emu_thread() % 32) ^ lane_mask, width, "__shfl_xor_sync");
}
template <typename T>
inline T __shfl_down_sync(unsigned mask, T value, unsigned delta, int width = 32) {
    return emu_shuffle(mask, value, emu_thread() % 32 + (int)delta, width, "__shfl_down_sync");
}
template <typename T>
inline T __shfl_sync(unsigned mask, T value, int source, int width = 32) {
    const int lane = emu_thread() % 32;
    return emu_shuffle(mask, value, lane / width * width + source % width, width, "__shfl_sync");
}
inline void __syncwarp(unsigned mask = 0xffffffffu) {
    if (mask != 0xffffffffu) throw emu::Failure("__syncwarp: only the full mask is emulated");
    emu::warp_barriers[emu_thread() / 32]->wait("__syncwarp");
}

// Fibers take turns only at barriers: an atomic is a plain read and write.
template <typename T>
inline T atomicMax(T* address, T value) {
    const T old = *address;
    *address = std::max(old, value);
    return old;
}
template <typename T>
inline T atomicAdd(T* address, T value) {
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
