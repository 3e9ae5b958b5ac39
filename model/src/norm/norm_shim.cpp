// A C ABI over the backward of LibTorch's fused RMSNorm (`_fused_rms_norm_backward`, CUDA only
// in torch 2.9-2.11; tch 0.22 binds its forward, not this), for model/src/norm/cuda.rs. Built
// by model/build.rs against the venv's libtorch; it needs only the dispatcher's declarations,
// so it compiles without CUDA headers (on a CPU the op raises "not implemented", an error).
#include <array>
#include <cstdint>
#include <cstdlib>
#include <tuple>

#include "../shim.h"

#include <ATen/ATen.h>
#include <ATen/ops/_fused_rms_norm_backward.h>

extern "C" {

// dx and dw of y = w * x * rstd over x's last dimension: dy and x [.., d] in x's dtype, rstd as
// `_fused_rms_norm` returned it, w [d] in x's dtype. Fills *dx and *dw with new tensors
// (undefined when not wanted) and returns 0, or returns 1 and sets *err.
int llora_rms_norm_backward(const at::Tensor* dy, const at::Tensor* x, const at::Tensor* rstd, const at::Tensor* w,
                            int want_dx, int want_dw, at::Tensor** dx, at::Tensor** dw, char** err) {
  bool ok = llora_shim::guarded(err, [&] {
    const int64_t d = x->size(-1);
    auto r = at::_fused_rms_norm_backward(*dy, *x, {d}, *rstd, *w, std::array<bool, 2>{want_dx != 0, want_dw != 0});
    *dx = new at::Tensor(std::get<0>(r));
    *dw = new at::Tensor(std::get<1>(r));
  });
  return ok ? 0 : 1;
}

// Frees a message returned through `err`.
void llora_norm_free(char* s) { std::free(s); }

}  // extern "C"
