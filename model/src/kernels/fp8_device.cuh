// Device helpers every FP8 kernel of ours shares: loads of the input dtypes, one FP8 code
// (scale, clamp, round to nearest-even), the ordered bits of |v| and a block's amax folded
// into a device scalar, and the scale of current scaling. Not a .cu of its own: each kernel
// source is compiled as this text followed by its own (`Source::text` in the Rust that
// launches it), so that every source still compiles alone with the flags of
// model/src/kernels/mod.rs and the helpers are written once.

#include <cuda_bf16.h>
#include <cuda_fp8.h>

namespace {

// Threads per block (the launch code uses the same number).
constexpr int kThreads = 256;

// float(x) for the input dtypes the launch code allows.
__device__ __forceinline__ float load(const float* x, long i) { return x[i]; }
__device__ __forceinline__ float load(const __nv_bfloat16* x, long i) { return __bfloat162float(x[i]); }

// One code: x * scale clamped to [-limit, limit] (NaN stays NaN), rounded to nearest-even.
__device__ __forceinline__ unsigned char encode(float v, float scale, float limit, bool e5m2) {
    float s = v * scale;
    if (!isnan(s)) {
        s = fminf(fmaxf(s, -limit), limit);
    }
    __nv_fp8_interpretation_t kind = e5m2 ? __NV_E5M2 : __NV_E4M3;
    return static_cast<unsigned char>(__nv_cvt_float_to_fp8(s, __NV_SATFINITE, kind));
}

// |v| as an ordered integer: for non-negative floats the bit patterns order as the values do,
// and every NaN with its sign cleared orders above +inf, so a max over them is NaN-propagating.
__device__ __forceinline__ unsigned int abs_bits(float v) {
    return __float_as_uint(v) & 0x7fffffffu;
}

// The block's largest abs_bits, folded into *amax_bits by one atomicMax.
__device__ void fold_amax(unsigned int mine, unsigned int* amax_bits) {
    __shared__ unsigned int warp_max[kThreads / 32];
    for (int offset = 16; offset > 0; offset >>= 1) {
        mine = max(mine, __shfl_down_sync(0xffffffffu, mine, offset));
    }
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (lane == 0) {
        warp_max[warp] = mine;
    }
    __syncthreads();
    if (warp == 0) {
        mine = lane < blockDim.x / 32 ? warp_max[lane] : 0u;
        for (int offset = 16; offset > 0; offset >>= 1) {
            mine = max(mine, __shfl_down_sync(0xffffffffu, mine, offset));
        }
        if (lane == 0) {
            atomicMax(amax_bits, mine);
        }
    }
}

// Current scaling's scale from an amax held as ordered bits: fp8_max / amax in one f32
// division, and 1 where the amax is zero, infinite or NaN (model/src/fp8.rs `current_scale`).
__device__ __forceinline__ float current_scale(unsigned int amax_bits, float limit) {
    float amax = __uint_as_float(amax_bits);
    float scale = limit / amax;
    return (isnan(scale) || isinf(scale) || scale == 0.0f) ? 1.0f : scale;
}

// Nearest bf16 of v, as float: what a bf16 tensor op's result holds.
__device__ __forceinline__ float round_bf16(float v) { return __bfloat162float(__float2bfloat16_rn(v)); }

}  // namespace
