// SwiGLU with FP8 around it (issue #50 item 3): the forward reads gate and up once, writes
// h = silu(gate) * up in bf16 and, when asked, down_proj's FP8 input (h's codes at a delayed
// scale read from the device, h's amax folded into a device scalar), and keeps gate and up
// for backward as E4M3 codes at their current scales (amax pass first: llora_swiglu_amax);
// the backward reads those codes directly (no dequantised copy in memory) and writes both
// input gradients in one pass.
//
// References (model/src/precision/nodes.rs, SwigluBackward and Kept::keep): torch's bf16
// `silu(gate) * up` (silu in f32 rounded to bf16, the product in f32 rounded to bf16), codes
// as model/src/fp8.rs `quantize_current_on_device` (scale fp8_max / amax), and the gradients
// as torch's autograd of `silu(g) * u` on the dequantised inputs: grad_up = bf16(grad *
// bf16(silu(g))), grad_gate = silu_backward(bf16(grad * u), g). Codes are bit-exact; bf16
// outputs within one bf16 ulp (expf's last bit may differ from torch's). Compiled by NVRTC
// after fp8_device.cuh.

namespace {

// silu(v) in f32 as torch's CUDA kernel computes it: v / (1 + exp(-v)).
__device__ __forceinline__ float silu(float v) { return v / (1.0f + expf(-v)); }

}  // namespace

// amax_bits[0] |= amax(gate), amax_bits[1] |= amax(up) as ordered bits (zero them first).
extern "C" __global__ void llora_swiglu_amax_bf16(const __nv_bfloat16* gate, const __nv_bfloat16* up,
                                                  unsigned int* amax_bits, long n) {
    unsigned int g = 0u, u = 0u;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        g = max(g, abs_bits(load(gate, i)));
        u = max(u, abs_bits(load(up, i)));
    }
    fold_amax(g, &amax_bits[0]);
    __syncthreads();
    fold_amax(u, &amax_bits[1]);
}

// h = silu(gate) * up (bf16, `out`); gate and up as E4M3 codes at their current scales from
// amax_bits (scale_inv[0..2] written by thread 0 of block 0); with h_codes, h's codes at the
// delayed scale *h_scale (format e5m2 or E4M3) and h's amax folded into *h_amax_bits.
extern "C" __global__ void llora_swiglu_fp8_forward_bf16(const __nv_bfloat16* gate, const __nv_bfloat16* up,
                                                         __nv_bfloat16* out, unsigned char* gate_codes,
                                                         unsigned char* up_codes, const unsigned int* amax_bits,
                                                         float* scale_inv, unsigned char* h_codes,
                                                         const float* h_scale, unsigned int* h_amax_bits, long n,
                                                         float e4m3_max, float h_limit, int h_e5m2) {
    float sg = current_scale(amax_bits[0], e4m3_max), su = current_scale(amax_bits[1], e4m3_max);
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        scale_inv[0] = 1.0f / sg;
        scale_inv[1] = 1.0f / su;
    }
    float hs = h_codes != nullptr ? *h_scale : 1.0f;
    unsigned int mine = 0u;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        float g = load(gate, i), u = load(up, i);
        float h = round_bf16(round_bf16(silu(g)) * u);
        out[i] = __float2bfloat16_rn(h);
        gate_codes[i] = encode(g, sg, e4m3_max, false);
        up_codes[i] = encode(u, su, e4m3_max, false);
        if (h_codes != nullptr) {
            mine = max(mine, abs_bits(h));
            h_codes[i] = encode(h, hs, h_limit, h_e5m2 != 0);
        }
    }
    if (h_amax_bits != nullptr) {
        fold_amax(mine, h_amax_bits);
    }
}

// E4M3 code -> float, times its scale_inv, rounded to bf16 (Kept::get: dequantise, cast).
__device__ __forceinline__ float decode_bf16(unsigned char code, float scale_inv) {
    __half_raw raw = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(code), __NV_E4M3);
    return round_bf16(__half2float(__half(raw)) * scale_inv);
}

// grad_gate and grad_up (bf16) from the kept codes and grad (bf16), as SwigluBackward.
extern "C" __global__ void llora_swiglu_fp8_backward_bf16(const unsigned char* gate_codes,
                                                          const unsigned char* up_codes, const float* scale_inv,
                                                          const __nv_bfloat16* grad, __nv_bfloat16* grad_gate,
                                                          __nv_bfloat16* grad_up, long n) {
    float ig = scale_inv[0], iu = scale_inv[1];
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        float g = decode_bf16(gate_codes[i], ig), u = decode_bf16(up_codes[i], iu), d = load(grad, i);
        float sig = 1.0f / (1.0f + expf(-g));
        grad_up[i] = __float2bfloat16_rn(d * round_bf16(silu(g)));
        float du = round_bf16(d * u);
        grad_gate[i] = __float2bfloat16_rn(du * sig * (1.0f + g * (1.0f - sig)));
    }
}
