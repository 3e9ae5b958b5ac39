// RMSNorm writing the next GEMM's FP8 input (issue #50 item 4): one block per row reads the
// row twice (sum of squares, then the output) and writes the bf16 output, the row's f32
// 1/rms (what the norm's backward keeps) and, when asked, the output's FP8 codes at a delayed
// scale read from the device with the output's amax folded into a device scalar: the q/k/v
// (or gate/up) GEMMs then read codes made once, not quantised again per projection.
//
// Reference (model/src/norm/composite.rs): inv_rms = 1 / sqrt(mean(float(x)^2) + eps) in f32,
// y = bf16(bf16(float(x) * inv_rms) * w) (HF's LlamaRMSNorm order). The codes are bit-exact
// for the kernel's own y; y within one bf16 ulp and inv_rms within 1e-6 relative of the
// reference (the sum's order differs). Compiled by NVRTC after fp8_device.cuh.

namespace {

// The block's sum of `mine`, returned to every thread.
__device__ float block_sum(float mine) {
    __shared__ float warp_sum[kThreads / 32];
    __shared__ float total;
    for (int offset = 16; offset > 0; offset >>= 1) {
        mine += __shfl_down_sync(0xffffffffu, mine, offset);
    }
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (lane == 0) {
        warp_sum[warp] = mine;
    }
    __syncthreads();
    if (warp == 0) {
        mine = lane < blockDim.x / 32 ? warp_sum[lane] : 0.0f;
        for (int offset = 16; offset > 0; offset >>= 1) {
            mine += __shfl_down_sync(0xffffffffu, mine, offset);
        }
        if (lane == 0) {
            total = mine;
        }
    }
    __syncthreads();
    return total;
}

}  // namespace

// Row blockIdx.x of x [rows, cols] (bf16) normalised with gain w [cols] (bf16) into y; its
// 1/rms into inv_rms[row]; with y_codes, y's codes at *y_scale and y's amax into *y_amax_bits.
extern "C" __global__ void llora_rmsnorm_fp8_forward_bf16(const __nv_bfloat16* x, const __nv_bfloat16* w,
                                                          __nv_bfloat16* y, float* inv_rms,
                                                          unsigned char* y_codes, const float* y_scale,
                                                          unsigned int* y_amax_bits, long cols, float eps,
                                                          float limit, int e5m2) {
    long base = blockIdx.x * cols;
    float sq = 0.0f;
    for (long c = threadIdx.x; c < cols; c += blockDim.x) {
        float v = load(x, base + c);
        sq += v * v;
    }
    float r = 1.0f / sqrtf(block_sum(sq) / (float)cols + eps);
    if (threadIdx.x == 0) {
        inv_rms[blockIdx.x] = r;
    }
    float scale = y_codes != nullptr ? *y_scale : 1.0f;
    unsigned int mine = 0u;
    for (long c = threadIdx.x; c < cols; c += blockDim.x) {
        __nv_bfloat16 out = __float2bfloat16_rn(round_bf16(load(x, base + c) * r) * load(w, c));
        y[base + c] = out;
        if (y_codes != nullptr) {
            float v = __bfloat162float(out);
            mine = max(mine, abs_bits(v));
            y_codes[base + c] = encode(v, scale, limit, e5m2 != 0);
        }
    }
    if (y_amax_bits != nullptr) {
        fold_amax(mine, y_amax_bits);
    }
}
