// FP8 quantisation in one pass over the input: each element scaled, clamped to the format's
// largest finite value (NaN kept) and rounded to nearest-even into E4M3 or E5M2 codes, the
// codes written row-major and, when asked, transposed; the absolute maximum of the input
// (NaN if it holds one) folded into a device scalar with one atomic per block. Current scaling
// in two passes (amax, then codes at fp8_max / amax computed on the device: nothing read back).
//
// The reference it must equal bit for bit is llora's LibTorch route (model/src/fp8.rs,
// `quantize_via_f32`): float(x) * scale, clamp to [-max, max], cast. Compiled at run time by
// NVRTC (model/src/kernels/mod.rs) after fp8_device.cuh (its helpers: load, encode, abs_bits,
// fold_amax); only cuda_fp8.h / cuda_bf16.h from the CUDA headers beside the torch wheel.

namespace {

// Side of the square tile the transposing kernel moves through shared memory.
constexpr int kTile = 32;

// Row-major codes of n elements, grid-stride; amax_bits may be null.
template <typename T>
__device__ void quantize(const T* x, unsigned char* out, unsigned int* amax_bits, long n, float scale, float limit,
                         bool e5m2) {
    unsigned int mine = 0u;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        float v = load(x, i);
        mine = max(mine, abs_bits(v));
        out[i] = encode(v, scale, limit, e5m2);
    }
    if (amax_bits != nullptr) {
        fold_amax(mine, amax_bits);
    }
}

// Codes of a [rows, cols] row-major input, row-major into `out` and transposed ([cols, rows]
// row-major) into `out_t`, through a shared tile so both writes are coalesced; one block per
// kTile x kTile tile, kThreads threads.
template <typename T>
__device__ void quantize_transpose(const T* x, unsigned char* out, unsigned char* out_t, unsigned int* amax_bits,
                                   long rows, long cols, float scale, float limit, bool e5m2) {
    __shared__ unsigned char tile[kTile][kTile + 1];
    long r0 = blockIdx.y * (long)kTile, c0 = blockIdx.x * (long)kTile;
    unsigned int mine = 0u;
    for (int k = threadIdx.x; k < kTile * kTile; k += blockDim.x) {
        int r = k / kTile, c = k % kTile;
        if (r0 + r < rows && c0 + c < cols) {
            long i = (r0 + r) * cols + (c0 + c);
            float v = load(x, i);
            mine = max(mine, abs_bits(v));
            unsigned char code = encode(v, scale, limit, e5m2);
            out[i] = code;
            tile[r][c] = code;
        }
    }
    __syncthreads();
    for (int k = threadIdx.x; k < kTile * kTile; k += blockDim.x) {
        int c = k / kTile, r = k % kTile;
        if (r0 + r < rows && c0 + c < cols) {
            out_t[(c0 + c) * rows + (r0 + r)] = tile[r][c];
        }
    }
    if (amax_bits != nullptr) {
        fold_amax(mine, amax_bits);
    }
}

}  // namespace

extern "C" __global__ void llora_fp8_quantize_f32(const float* x, unsigned char* out, unsigned int* amax_bits,
                                                  long n, float scale, float limit, int e5m2) {
    quantize(x, out, amax_bits, n, scale, limit, e5m2 != 0);
}

extern "C" __global__ void llora_fp8_quantize_bf16(const __nv_bfloat16* x, unsigned char* out,
                                                   unsigned int* amax_bits, long n, float scale, float limit,
                                                   int e5m2) {
    quantize(x, out, amax_bits, n, scale, limit, e5m2 != 0);
}

extern "C" __global__ void llora_fp8_quantize_transpose_f32(const float* x, unsigned char* out,
                                                            unsigned char* out_t, unsigned int* amax_bits,
                                                            long rows, long cols, float scale, float limit,
                                                            int e5m2) {
    quantize_transpose(x, out, out_t, amax_bits, rows, cols, scale, limit, e5m2 != 0);
}

extern "C" __global__ void llora_fp8_quantize_transpose_bf16(const __nv_bfloat16* x, unsigned char* out,
                                                             unsigned char* out_t, unsigned int* amax_bits,
                                                             long rows, long cols, float scale, float limit,
                                                             int e5m2) {
    quantize_transpose(x, out, out_t, amax_bits, rows, cols, scale, limit, e5m2 != 0);
}

// Current scaling, pass 1: *amax_bits |= amax(x) as ordered bits (zero it first).
template <typename T>
__device__ void amax_only(const T* x, unsigned int* amax_bits, long n) {
    unsigned int mine = 0u;
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        mine = max(mine, abs_bits(load(x, i)));
    }
    fold_amax(mine, amax_bits);
}

// Current scaling, pass 2: codes at limit / amax (current_scale), the inverse scale written by
// thread 0 of block 0 (model/src/fp8.rs `current_scale`: 1 where the amax is 0 or not finite).
template <typename T>
__device__ void quantize_current(const T* x, unsigned char* out, const unsigned int* amax_bits, float* scale_inv,
                                 long n, float limit, bool e5m2) {
    float scale = current_scale(*amax_bits, limit);
    if (blockIdx.x == 0 && threadIdx.x == 0) {
        *scale_inv = 1.0f / scale;
    }
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < n; i += (long)gridDim.x * blockDim.x) {
        out[i] = encode(load(x, i), scale, limit, e5m2);
    }
}

extern "C" __global__ void llora_fp8_amax_f32(const float* x, unsigned int* amax_bits, long n) {
    amax_only(x, amax_bits, n);
}

extern "C" __global__ void llora_fp8_amax_bf16(const __nv_bfloat16* x, unsigned int* amax_bits, long n) {
    amax_only(x, amax_bits, n);
}

extern "C" __global__ void llora_fp8_quantize_current_f32(const float* x, unsigned char* out,
                                                          const unsigned int* amax_bits, float* scale_inv, long n,
                                                          float limit, int e5m2) {
    quantize_current(x, out, amax_bits, scale_inv, n, limit, e5m2 != 0);
}

extern "C" __global__ void llora_fp8_quantize_current_bf16(const __nv_bfloat16* x, unsigned char* out,
                                                           const unsigned int* amax_bits, float* scale_inv, long n,
                                                           float limit, int e5m2) {
    quantize_current(x, out, amax_bits, scale_inv, n, limit, e5m2 != 0);
}
