// Our CUDA C on the CPU: what our kernels use of CUDA, written for the host compiler, so that
// each .cu file (after fp8_device.cuh) compiles unchanged with g++ and runs on the CPU in the
// tests. No NVIDIA code: the definitions follow the CUDA C++ Programming Guide's semantics.
//
// - A launch runs the grid's blocks one after another and a block's threads as OS threads (so
//   ThreadSanitizer sees them), each with its own threadIdx / blockIdx.
// - __syncthreads is a barrier of the block's threads; __shfl_down_sync a per-warp exchange
//   between two barriers of the warp's lanes; atomicMax a compare-and-swap loop.
// - __shared__ arrays are block-wide: statics (blocks run in turn). In the tests' build they are
//   checked arrays (cuda_cpu_shared.h): an index past the end, or two threads touching one
//   element with no __syncthreads between (a write and another access), fail the launch.
// - FP8 (E4M3, E5M2) and bf16 conversions in software with CUDA's rounding (to nearest even),
//   saturation (SATFINITE: to the largest finite value) and canonical NaN (0x7F for FP8, 0x7FFF
//   for bf16: the sign of a NaN is not kept, where torch's casts keep it).
//
// What it cannot show: timing, races between blocks (they run in turn), expf's last bit
// (NVVM's expf against the C library's), misaligned-access faults, the driver's JIT. The
// kernels are compiled with -ffp-contract=off here and --fmad=false by NVRTC, so that no
// multiply-add is contracted on either side.
#pragma once

#include <math.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

// CUDA's qualifiers: host functions here.
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#ifndef LLORA_EMU_CHECKED_SHARED
#define __shared__ static
#endif

namespace llora_emu {

// A thread's coordinates.
struct uint3 {
    unsigned int x = 0, y = 0, z = 0;
};

// The launch of the running kernel, per OS thread.
struct ThreadState {
    uint3 thread, block, block_dim, grid_dim;
    // The block's barrier and this thread's warp (opaque: emulate.cpp).
    void* block_barrier = nullptr;
    void* warp = nullptr;
    // 0 .. threads per block - 1.
    unsigned int linear = 0;
};

inline thread_local ThreadState current;

// __syncthreads and __shfl_down_sync's exchange, in emulate.cpp.
void sync_block();
unsigned long long shuffle_down(unsigned long long value, unsigned int delta);
// Records the launch's first failure (a bad index, a race, a barrier not reached by all).
void fail(const char* what);

// Calls kernel `f` with its arguments read from `params`, as cuLaunchKernel reads them: the
// address of each argument's value, in the signature's order and types.
template <typename... A, std::size_t... I>
void call_with(void (*f)(A...), void** params, std::index_sequence<I...>) {
    f(*static_cast<std::remove_reference_t<A>*>(params[I])...);
}
template <typename... A>
void call(void (*f)(A...), void** params) {
    call_with(f, params, std::index_sequence_for<A...>{});
}

}  // namespace llora_emu

#define threadIdx (::llora_emu::current.thread)
#define blockIdx (::llora_emu::current.block)
#define blockDim (::llora_emu::current.block_dim)
#define gridDim (::llora_emu::current.grid_dim)

inline void __syncthreads() { ::llora_emu::sync_block(); }

template <typename T>
inline T __shfl_down_sync(unsigned int mask, T value, unsigned int delta) {
    static_assert(sizeof(T) <= 8, "a shuffle moves at most 64 bits");
    if (mask != 0xffffffffu) {
        ::llora_emu::fail("__shfl_down_sync with a partial mask: the emulation runs full warps only");
    }
    unsigned long long bits = 0;
    std::memcpy(&bits, &value, sizeof(T));
    bits = ::llora_emu::shuffle_down(bits, delta);
    T out;
    std::memcpy(&out, &bits, sizeof(T));
    return out;
}

inline unsigned int atomicMax(unsigned int* address, unsigned int value) {
    unsigned int old = __atomic_load_n(address, __ATOMIC_RELAXED);
    while (old < value &&
           !__atomic_compare_exchange_n(address, &old, value, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
    return old;
}

inline unsigned int __float_as_uint(float v) {
    unsigned int u;
    std::memcpy(&u, &v, 4);
    return u;
}

inline float __uint_as_float(unsigned int u) {
    float v;
    std::memcpy(&v, &u, 4);
    return v;
}

// CUDA's min/max overloads for the integer types the kernels mix.
inline unsigned int max(unsigned int a, unsigned int b) { return a > b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline long max(long a, long b) { return a > b ? a : b; }
inline unsigned int min(unsigned int a, unsigned int b) { return a < b ? a : b; }
inline int min(int a, int b) { return a < b ? a : b; }
inline long min(long a, long b) { return a < b ? a : b; }
// expf, sqrtf, fminf, fmaxf: the C library's, in the global namespace (math.h).
using std::isinf;
using std::isnan;

// ---- bf16 -------------------------------------------------------------------------------------

struct __nv_bfloat16 {
    unsigned short bits;
};

inline float __bfloat162float(__nv_bfloat16 h) { return __uint_as_float(static_cast<unsigned int>(h.bits) << 16); }

// Nearest bf16, ties to even; NaN as CUDA's canonical 0x7FFF.
inline __nv_bfloat16 __float2bfloat16_rn(float v) {
    unsigned int u = __float_as_uint(v);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return {0x7fff};
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return {static_cast<unsigned short>(u >> 16)};
}

// ---- FP8 --------------------------------------------------------------------------------------

typedef unsigned char __nv_fp8_storage_t;
enum __nv_fp8_interpretation_t { __NV_E4M3, __NV_E5M2 };
enum __nv_saturation_t { __NV_NOSAT, __NV_SATFINITE };

namespace llora_emu {

// A format's exponent bias, mantissa bits and largest finite code (sign clear).
struct Fp8Layout {
    int bias, mantissa;
    unsigned char max_code;
};

inline Fp8Layout layout(__nv_fp8_interpretation_t kind) {
    // E4M3 (the "fn" variant: no infinity, 0x7F NaN, largest 448 = 0x7E); E5M2 (IEEE-like:
    // 0x7C infinity, largest 57344 = 0x7B).
    return kind == __NV_E4M3 ? Fp8Layout{7, 3, 0x7e} : Fp8Layout{15, 2, 0x7b};
}

// The code of |v| (finite, >= 0), rounded to nearest even, before saturation: `max_code + 1`
// or more means past the largest finite value.
inline unsigned int magnitude_code(float a, Fp8Layout f) {
    if (a == 0.0f) {
        return 0;
    }
    int e;
    std::frexp(a, &e);  // a = m * 2^e, m in [0.5, 1)
    int exponent = e - 1;
    int min_exponent = 1 - f.bias;
    // Subnormals share the smallest normal's quantum.
    int quantum = (exponent < min_exponent ? min_exponent : exponent) - f.mantissa;
    // Exact: a power-of-two scaling of a float that stays in range.
    float k = std::nearbyint(std::ldexp(a, -quantum));
    unsigned int units = static_cast<unsigned int>(k);
    if (exponent < min_exponent) {
        return units;  // 2^mantissa, if it rounded up, is the smallest normal's code
    }
    unsigned int top = 1u << f.mantissa;
    if (units == 2 * top) {
        units = top;
        exponent += 1;
    }
    return static_cast<unsigned int>(exponent + f.bias) << f.mantissa | (units - top);
}

}  // namespace llora_emu

// One FP8 code of v: round to nearest even; with SATFINITE past the largest finite value (inf
// included) gives it, without it infinity (E5M2) or NaN (E4M3); NaN gives 0x7F.
inline __nv_fp8_storage_t __nv_cvt_float_to_fp8(float v, __nv_saturation_t sat, __nv_fp8_interpretation_t kind) {
    if (std::isnan(v)) {
        return 0x7f;
    }
    llora_emu::Fp8Layout f = llora_emu::layout(kind);
    unsigned char sign = std::signbit(v) ? 0x80 : 0x00;
    float a = std::fabs(v);
    unsigned int code = std::isinf(a) ? 0x100u : llora_emu::magnitude_code(a, f);
    if (code > f.max_code) {
        if (sat == __NV_SATFINITE) {
            code = f.max_code;
        } else {
            code = kind == __NV_E4M3 ? 0x7fu : 0x7cu;
        }
    }
    return static_cast<__nv_fp8_storage_t>(sign | code);
}

// An f16 value as CUDA's FP8 decode gives it (every FP8 value is exact in f16: kept as float).
struct __half_raw {
    float value;
};
struct __half {
    float value;
    __half(__half_raw r) : value(r.value) {}
};
inline float __half2float(__half h) { return h.value; }

inline __half_raw __nv_cvt_fp8_to_halfraw(__nv_fp8_storage_t code, __nv_fp8_interpretation_t kind) {
    llora_emu::Fp8Layout f = llora_emu::layout(kind);
    float sign = (code & 0x80) ? -1.0f : 1.0f;
    unsigned int bits = code & 0x7fu, exponent = bits >> f.mantissa, units = bits & ((1u << f.mantissa) - 1);
    bool nan = kind == __NV_E4M3 ? bits == 0x7fu : bits > 0x7cu;
    if (nan) {
        return {NAN};
    }
    if (kind == __NV_E5M2 && bits == 0x7cu) {
        return {sign * INFINITY};
    }
    float value = exponent == 0 ? std::ldexp(static_cast<float>(units), 1 - f.bias - f.mantissa)
                                : std::ldexp(static_cast<float>((1u << f.mantissa) | units),
                                             static_cast<int>(exponent) - f.bias - f.mantissa);
    return {sign * value};
}

#ifdef LLORA_EMU_CHECKED_SHARED
#include "cuda_cpu_shared.h"
#endif
