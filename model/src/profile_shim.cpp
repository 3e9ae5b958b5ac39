// LibTorch's own instruments for model/src/profile.rs, which has the why: the Kineto profiler
// (a Chrome/Perfetto trace of CPU ops and CUDA kernels, as torch.profiler writes it), a
// RecordFunction observer that counts the ops dispatched and the host-device synchronisations
// (scalar reads), and the CUDA caching allocator's statistics and current device through the
// device-generic at::accelerator API (no CUDA headers needed). Built by model/build.rs.
//
// Every entry point catches C++ exceptions and returns the message (malloc'd; freed with
// llora_profile_free), so a profiler that cannot start is a Rust error, never an abort.
#include <atomic>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <set>
#include <string>

#include <ATen/DeviceAccelerator.h>
#include <ATen/record_function.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/version.h>

#include "shim.h"

namespace {

using llora_shim::guarded;

// Counted per thread: a step dispatches its ops (forward, Burn's backward, the optimizer) from
// the thread that runs it, and other threads' work (tests running beside it) stays out.
thread_local bool counting = false;
thread_local int64_t ops = 0;
thread_local int64_t scalar_reads = 0;
// Depth inside `_scaled_mm`: its CPU kernel reads its two scale operands as scalars, which its
// CUDA kernel reads on the device; those reads are not the step's synchronisations.
thread_local int scaled_mm_depth = 0;
std::atomic<bool> observer_installed{false};

bool is_scaled_mm(const at::RecordFunction& fn) { return std::strcmp(fn.name(), "aten::_scaled_mm") == 0; }

std::unique_ptr<at::ObserverContext> on_op(const at::RecordFunction& fn) {
  if (!counting) return nullptr;
  ops += 1;
  if (is_scaled_mm(fn)) scaled_mm_depth += 1;
  // item(), double_value, the truthiness of a tensor: the host waits for the device.
  if (scaled_mm_depth == 0 && std::strcmp(fn.name(), "aten::_local_scalar_dense") == 0) scalar_reads += 1;
  return nullptr;
}

void on_op_end(const at::RecordFunction& fn, at::ObserverContext*) {
  if (counting && is_scaled_mm(fn) && scaled_mm_depth > 0) scaled_mm_depth -= 1;
}

}  // namespace

extern "C" {

void llora_profile_free(char* s) { std::free(s); }

// Starts the Kineto profiler on this thread's ops (and CUDA kernels when `cuda`).
int llora_trace_start(int cuda, char** err) {
  return guarded(err, [&] {
    using torch::profiler::impl::ActivityType;
    using torch::profiler::impl::ProfilerConfig;
    using torch::profiler::impl::ProfilerState;
    std::set<ActivityType> activities{ActivityType::CPU};
    if (cuda != 0) activities.insert(ActivityType::CUDA);
    ProfilerConfig config(ProfilerState::KINETO, /*report_input_shapes=*/true);
    torch::autograd::profiler::prepareProfiler(config, activities);
    torch::autograd::profiler::enableProfiler(config, activities);
  });
}

// Stops the profiler and writes its Chrome trace (JSON) to `path`.
int llora_trace_stop(const char* path, char** err) {
  return guarded(err, [&] {
    auto result = torch::autograd::profiler::disableProfiler();
    if (!result) throw std::runtime_error("the profiler returned no result");
    result->save(std::string(path));
  });
}

// Starts (or restarts from zero) counting the ops and scalar reads of the calling thread.
int llora_count_start(char** err) {
  return guarded(err, [&] {
    if (!observer_installed.exchange(true)) {
      at::addGlobalCallback(at::RecordFunctionCallback(&on_op, &on_op_end).scopes({at::RecordScope::FUNCTION}));
    }
    ops = 0;
    scalar_reads = 0;
    scaled_mm_depth = 0;
    counting = true;
  });
}

// Stops counting on the calling thread; its counts since llora_count_start.
void llora_count_stop(int64_t* op_count, int64_t* scalar_read_count) {
  counting = false;
  *op_count = ops;
  *scalar_read_count = scalar_reads;
}

// The caching allocator's peak allocated and reserved bytes on accelerator `device` since the
// last reset (`reset`: reset the peaks now instead). 0 on success.
int llora_device_memory(int device, int reset, int64_t* peak_allocated, int64_t* peak_reserved, char** err) {
  return guarded(err, [&] {
#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 10
    // The device-generic allocator statistics are checked from torch 2.10 on.
    throw std::runtime_error("device memory statistics need LibTorch 2.10 or later (setup.sh --torch 2.11.0)");
#else
    auto index = static_cast<c10::DeviceIndex>(device);
    if (reset != 0) {
      at::accelerator::resetPeakStats(index);
      return;
    }
    auto stats = at::accelerator::getDeviceStats(index);
    const auto all = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
    *peak_allocated = stats.allocated_bytes[all].peak;
    *peak_reserved = stats.reserved_bytes[all].peak;
#endif
  });
}

// Makes accelerator `device` this thread's current device (cudaSetDevice): kernels that take
// no tensor and the NCCL communicator then use it, not device 0.
int llora_set_device(int device, char** err) {
  return guarded(err, [&] { at::accelerator::setDeviceIndex(static_cast<c10::DeviceIndex>(device)); });
}


}  // extern "C"
