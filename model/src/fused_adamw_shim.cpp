// A C ABI over LibTorch's multi-tensor ops of the optimizer step, for model/src/fused_adamw.rs
// (tch 0.22 binds neither): AdamW (`_fused_adamw_`, the kernel behind
// `torch.optim.AdamW(fused=True)`) and the gradients' norms before it (`_foreach_norm`, what
// `torch.nn.utils.clip_grad_norm_` runs).
// Built by model/build.rs against the venv's libtorch; it needs only the dispatcher's
// declarations. LibTorch has the kernel on CUDA and, since 2.4, on the CPU.
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <vector>

#include "shim.h"

#include <ATen/ATen.h>
#include <ATen/ops/_foreach_norm.h>
#include <ATen/ops/_fused_adamw.h>
#include <ATen/ops/stack.h>

namespace {

std::vector<at::Tensor> list(const at::Tensor* const* ts, int64_t n) {
  std::vector<at::Tensor> out;
  out.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out.push_back(*ts[i]);
  return out;
}

}  // namespace

extern "C" {

// One AdamW step over n parameters, in place: params, grads, exp_avgs and exp_avg_sqs hold n
// tensors each (the i-th of each list the same shape and dtype), `step` a 0-d f32 tensor on
// their device holding t (already counted), `grad_scale` NULL or a 0-d f32 tensor every
// gradient is divided by first (the divided gradient is written back). Returns 0, or 1 with
// *err set.
int llora_fused_adamw(const at::Tensor* const* params, const at::Tensor* const* grads, const at::Tensor* const* exp_avgs,
                      const at::Tensor* const* exp_avg_sqs, int64_t n, const at::Tensor* step, double lr, double beta1,
                      double beta2, double weight_decay, double eps, const at::Tensor* grad_scale, char** err) {
  bool ok = llora_shim::guarded(err, [&] {
    auto p = list(params, n), g = list(grads, n), m = list(exp_avgs, n), v = list(exp_avg_sqs, n);
    std::vector<at::Tensor> steps(static_cast<size_t>(n), *step);
    std::optional<at::Tensor> scale;
    if (grad_scale != nullptr) scale = *grad_scale;
    at::_fused_adamw_(p, g, m, v, {}, steps, lr, beta1, beta2, weight_decay, eps, /*amsgrad=*/false,
                      /*maximize=*/false, scale, std::nullopt);
  });
  return ok ? 0 : 1;
}

// The L2 norm of each of n tensors (any shapes and floating dtypes, one device), accumulated
// and returned in f32: *out a new [n] f32 tensor on their device (n >= 1). Returns 0, or 1
// with *err set.
int llora_foreach_norms(const at::Tensor* const* tensors, int64_t n, at::Tensor** out, char** err) {
  bool ok = llora_shim::guarded(err, [&] {
    auto norms = at::_foreach_norm(list(tensors, n), 2, at::kFloat);
    *out = new at::Tensor(at::stack(norms));
  });
  return ok ? 0 : 1;
}

// Frees a message returned through `err`.
void llora_fused_adamw_free(char* s) { std::free(s); }

}  // extern "C"
