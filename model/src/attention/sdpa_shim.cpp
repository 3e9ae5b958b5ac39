// A C ABI over the forwards of LibTorch's fused CUDA attention kernels that tch 0.22 does not
// bind (flash attention, dense and variable-length, and cuDNN SDPA: tch binds their backwards
// only), for model/src/attention/cuda.rs. Built by model/build.rs with the `cc` crate against
// the venv's libtorch, as tch builds its own wrapper. Only the dispatcher's op declarations are used, so
// it compiles without CUDA headers and runs wherever libtorch does (on a CPU the ops raise
// "not implemented", which comes back as an error).
//
// Every entry point catches C++ exceptions (../shim.h) and returns the message (malloc'd; the
// caller frees it with llora_sdpa_free), so a kernel that refuses its inputs is a Rust error.
// Tensors come back as `new at::Tensor`, which tch takes over (tch::Tensor::from_ptr).
#include <cstdint>
#include <cstdlib>
#include <optional>
#include <tuple>

#include "../shim.h"

#include <ATen/ATen.h>
#include <ATen/ops/_flash_attention_forward.h>
#include <ATen/ops/_scaled_dot_product_cudnn_attention.h>
#include <ATen/ops/_scaled_dot_product_flash_attention.h>

extern "C" {

// What a forward returns, in the order the matching `_backward` op takes them.
struct LloraSdpaOut {
  at::Tensor* out;
  at::Tensor* logsumexp;
  at::Tensor* cum_seq_q;
  at::Tensor* cum_seq_k;
  int64_t max_q;
  int64_t max_k;
  at::Tensor* philox_seed;
  at::Tensor* philox_offset;
};

// Causal or full attention with scale 1/sqrt(head_dim) and no dropout. kernel 0 = flash
// attention, 1 = cuDNN SDPA. q [batch, heads, seq, head_dim]; k, v [batch, kv_heads, seq,
// head_dim] (both kernels take kv_heads dividing heads). Returns 0 and fills *res, or returns
// 1 and sets *err.
int llora_sdpa_forward(int kernel, const at::Tensor* q, const at::Tensor* k, const at::Tensor* v, int causal,
                       LloraSdpaOut* res, char** err) {
  bool ok = llora_shim::guarded(err, [&] {
    auto r = kernel == 0
                 ? at::_scaled_dot_product_flash_attention(*q, *k, *v, 0.0, causal != 0, false, std::nullopt)
                 : at::_scaled_dot_product_cudnn_attention(*q, *k, *v, std::nullopt, true, 0.0, causal != 0,
                                                            false, std::nullopt);
    res->out = new at::Tensor(std::get<0>(r));
    res->logsumexp = new at::Tensor(std::get<1>(r));
    res->cum_seq_q = new at::Tensor(std::get<2>(r));
    res->cum_seq_k = new at::Tensor(std::get<3>(r));
    res->max_q = std::get<4>(r).guard_int(__FILE__, __LINE__);
    res->max_k = std::get<5>(r).guard_int(__FILE__, __LINE__);
    res->philox_seed = new at::Tensor(std::get<6>(r));
    res->philox_offset = new at::Tensor(std::get<7>(r));
  });
  return ok ? 0 : 1;
}

// What the variable-length flash forward returns, in the order `_flash_attention_backward` takes
// them after q, k, v (the cumulative lengths and longest length are the caller's own).
struct LloraVarlenOut {
  at::Tensor* out;
  at::Tensor* logsumexp;
  at::Tensor* philox_seed;
  at::Tensor* philox_offset;
};

// Flash attention over sequences laid end to end (packed documents): q [tokens, heads,
// head_dim], k, v [tokens, kv_heads, head_dim]; `cu_seq` (int32 [sequences + 1], on q's
// device) the offset of each sequence's first token, then the token count; `max_len` the
// longest sequence. Each sequence attends only within itself (causal or not), scale
// 1/sqrt(head_dim), no dropout. `window_left` >= 0 (causal only): a query also sees at most
// that many keys before its own position (flash attention's window, right side 0); < 0: no
// window. Returns 0 and fills *res, or returns 1 and sets *err.
int llora_flash_varlen_forward(const at::Tensor* q, const at::Tensor* k, const at::Tensor* v,
                               const at::Tensor* cu_seq, int64_t max_len, int causal, int64_t window_left,
                               LloraVarlenOut* res, char** err) {
  bool ok = llora_shim::guarded(err, [&] {
    std::optional<int64_t> left, right;
    if (window_left >= 0) {
      left = window_left;
      right = 0;
    }
    auto r = at::_flash_attention_forward(*q, *k, *v, *cu_seq, *cu_seq, max_len, max_len, 0.0, causal != 0, false,
                                          std::nullopt, left, right);
    res->out = new at::Tensor(std::get<0>(r));
    res->logsumexp = new at::Tensor(std::get<1>(r));
    res->philox_seed = new at::Tensor(std::get<2>(r));
    res->philox_offset = new at::Tensor(std::get<3>(r));
  });
  return ok ? 0 : 1;
}

// Frees a message returned through `err`.
void llora_sdpa_free(char* s) { std::free(s); }

}  // extern "C"
