// LibTorch's default CPU generator's state, taken and put back, for model/src/device.rs
// (`CpuRngState`): a first-use check that draws from the generator (random test inputs) must
// leave it where it was, or the dropout seeds drawn after it in the same block differ from a
// run where the check ran earlier (a resumed run's first step against the uninterrupted run's).
// tch binds neither call. Built by model/build.rs.
#include <mutex>

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/core/Generator.h>
#include <ATen/core/Tensor.h>

#include "shim.h"

extern "C" {

// The generator's state as a new tensor (free with llora_cpu_rng_free or hand it back to
// llora_cpu_rng_set_state); NULL with *err set if LibTorch throws.
void* llora_cpu_rng_get_state(char** err) {
  at::Tensor* out = nullptr;
  llora_shim::guarded(err, [&] {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    out = new at::Tensor(gen.get_state());
  });
  return out;
}

// Puts a state taken by llora_cpu_rng_get_state back; false with *err set if LibTorch throws.
bool llora_cpu_rng_set_state(void* state, char** err) {
  return llora_shim::guarded(err, [&] {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(*static_cast<at::Tensor*>(state));
  });
}

// Frees a state taken by llora_cpu_rng_get_state.
void llora_cpu_rng_free(void* state) { delete static_cast<at::Tensor*>(state); }

// Frees an error message of this shim.
void llora_rng_error_free(char* s) { std::free(s); }

}  // extern "C"
