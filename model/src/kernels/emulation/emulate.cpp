// The launcher of our kernels on the CPU (cuda_cpu.h): a grid's blocks one after another, a
// block's threads as OS threads, with __syncthreads, warp shuffles and the launch's failures.
// Called from model/src/kernels/emulate.rs with the parameter array launch.rs builds for
// cuLaunchKernel, so the Rust side's marshalling runs as on a GPU.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "cuda_cpu.h"

namespace llora_emu {

namespace {

// How long a thread waits at a barrier before the launch is failed as one that never
// completes (a __syncthreads some threads skip hangs a GPU): set per launch.
std::chrono::milliseconds g_patience{20000};

// CUDA's limits on a launch.
constexpr unsigned long long kMaxThreadsPerBlock = 1024, kMaxGridX = 2147483647ull, kMaxGridYZ = 65535;

std::atomic<unsigned long long> g_epoch{1};

// The launch's first failure, and a lock for writing it.
std::mutex g_fail_lock;
std::string g_failure;

// A barrier of `count` threads that gives up (and fails the launch) after kBarrierPatience.
class Barrier {
  public:
    // `block`: a block's __syncthreads, whose completion starts a new epoch for the checked
    // shared memory (a warp's barrier does not: it orders no shared memory).
    Barrier(unsigned count, bool block) : count_(count), block_(block) {}

    void wait(const char* what) {
        std::unique_lock<std::mutex> hold(lock_);
        unsigned long long generation = generation_;
        if (++arrived_ == count_ || broken_) {
            arrived_ = 0;
            generation_ += 1;
            if (block_) {
                g_epoch.fetch_add(1);
            }
            woken_.notify_all();
            return;
        }
        if (!woken_.wait_for(hold, g_patience, [&] { return generation_ != generation || broken_; })) {
            broken_ = true;
            woken_.notify_all();
            hold.unlock();
            fail(what);
        }
    }

  private:
    std::mutex lock_;
    std::condition_variable woken_;
    unsigned count_, arrived_ = 0;
    bool block_;
    unsigned long long generation_ = 0;
    bool broken_ = false;
};

// A warp: its lanes' barrier and the slots a shuffle exchanges through.
struct Warp {
    explicit Warp(unsigned lanes) : lanes(lanes), barrier(lanes, false) {}
    unsigned lanes;
    Barrier barrier;
    unsigned long long slots[32] = {};
};

// The grid: one OS thread per thread of a block, each running its place in every block in
// turn (blocks one after another, a barrier between them, so a block's __shared__ statics are
// its own while it runs).
void run_grid(void (*kernel)(void**), void** params, uint3 grid_dim, uint3 block_dim) {
    unsigned threads = block_dim.x * block_dim.y * block_dim.z;
    Barrier barrier(threads, true), between_blocks(threads, true);
    std::vector<std::unique_ptr<Warp>> warps;
    for (unsigned first = 0; first < threads; first += 32) {
        warps.push_back(std::make_unique<Warp>(std::min(32u, threads - first)));
    }
    std::vector<std::thread> running;
    running.reserve(threads);
    for (unsigned i = 0; i < threads; ++i) {
        running.emplace_back([&, i] {
            ThreadState& me = current;
            me.thread = {i % block_dim.x, (i / block_dim.x) % block_dim.y, i / (block_dim.x * block_dim.y)};
            me.block_dim = block_dim;
            me.grid_dim = grid_dim;
            me.block_barrier = &barrier;
            me.warp = warps[i / 32].get();
            me.linear = i;
            for (unsigned z = 0; z < grid_dim.z; ++z) {
                for (unsigned y = 0; y < grid_dim.y; ++y) {
                    for (unsigned x = 0; x < grid_dim.x; ++x) {
                        me.block = {x, y, z};
                        kernel(params);
                        between_blocks.wait("a block's threads did not all end (a __syncthreads some skipped)");
                    }
                }
            }
        });
    }
    for (std::thread& t : running) {
        t.join();
    }
}

}  // namespace

unsigned long long epoch() { return g_epoch.load(); }

std::mutex& shared_lock() {
    static std::mutex lock;
    return lock;
}

void fail(const char* what) {
    std::lock_guard<std::mutex> hold(g_fail_lock);
    if (g_failure.empty()) {
        g_failure = what;
    }
}

void sync_block() {
    static_cast<Barrier*>(current.block_barrier)->wait("a __syncthreads that not every thread of the block reached");
}

unsigned long long shuffle_down(unsigned long long value, unsigned int delta) {
    Warp& warp = *static_cast<Warp*>(current.warp);
    unsigned lane = current.linear % 32;
    warp.slots[lane] = value;
    warp.barrier.wait("a warp shuffle that not every lane of the warp reached");
    unsigned long long out = lane + delta < warp.lanes ? warp.slots[lane + delta] : value;
    warp.barrier.wait("a warp shuffle that not every lane of the warp reached");
    return out;
}

}  // namespace llora_emu

// The trampoline of each kernel by name (made by model/build.rs from the sources).
extern "C" void (*llora_emu_find(const char* name))(void**);

// Runs `kernel` over the grid with `params` as cuLaunchKernel takes them (the address of each
// argument's value), a barrier not completed within `patience_ms` failing it. Returns 0, or 1
// with the failure written to `error` (NUL-terminated): an unknown kernel, a launch past
// CUDA's limits, or what the launch found.
extern "C" int llora_emu_launch(const char* kernel, const unsigned grid[3], const unsigned block[3], void** params,
                                unsigned patience_ms, char* error, size_t error_len) {
    using namespace llora_emu;
    // Shared memory is static and the failure global: one launch at a time.
    static std::mutex one_at_a_time;
    std::lock_guard<std::mutex> hold(one_at_a_time);
    g_patience = std::chrono::milliseconds(patience_ms);
    auto refuse = [&](const std::string& what) {
        std::snprintf(error, error_len, "%s: %s", kernel, what.c_str());
        return 1;
    };
    void (*f)(void**) = llora_emu_find(kernel);
    if (f == nullptr) {
        return refuse("no such kernel in the emulated sources");
    }
    unsigned long long threads = 1ull * block[0] * block[1] * block[2];
    if (threads == 0 || threads > kMaxThreadsPerBlock || grid[0] == 0 || grid[1] == 0 || grid[2] == 0 ||
        grid[0] > kMaxGridX || grid[1] > kMaxGridYZ || grid[2] > kMaxGridYZ) {
        return refuse("launch of grid (" + std::to_string(grid[0]) + ", " + std::to_string(grid[1]) + ", " +
                      std::to_string(grid[2]) + ") x block (" + std::to_string(block[0]) + ", " +
                      std::to_string(block[1]) + ", " + std::to_string(block[2]) +
                      ") past CUDA's limits (1024 threads a block; grid y and z 65535)");
    }
    {
        std::lock_guard<std::mutex> clear(g_fail_lock);
        g_failure.clear();
    }
    run_grid(f, params, {grid[0], grid[1], grid[2]}, {block[0], block[1], block[2]});
    std::lock_guard<std::mutex> read(g_fail_lock);
    return g_failure.empty() ? 0 : refuse(g_failure);
}
