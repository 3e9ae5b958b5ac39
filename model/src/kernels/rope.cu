// RoPE applied to q or k in one pass each way: the forward reads x and writes the rotated x in
// the layout it came in ([batch, seq, heads, head_dim], which attention reads as heads-first
// through a view); the backward rotates the gradient back. HF's rotate_half convention:
// rotate_half(x) = cat(-x2, x1) over the two halves of head_dim.
//
// Reference (model/src/rope/fused.rs `stand_in`, the composite of model/src/rope/mod.rs
// `apply_rope` in LibTorch's bf16 ops, each op's result rounded to bf16):
//   forward:  y1 = bf16(bf16(x1 * c1) + bf16(-(x2 * s1)))   y2 = bf16(bf16(x2 * c2) + bf16(x1 * s2))
//   backward: d1 = bf16(bf16(g1 * c1) + bf16(g2 * s2))      d2 = bf16(bf16(g2 * c2) + bf16(-(g1 * s1)))
// (the backward is autodiff's of the forward: x * cos gives g * cos, rotate_half's cat and
// neg send g * sin's halves back swapped, the second negated). Bit for bit: each product and
// sum is rounded once, as torch rounds each op's output. The tables (cos, sin: [tb, seq,
// head_dim], tb 1 or batch: packed rows carry each row's positions) are the model's, in bf16.
// Compiled by NVRTC after fp8_device.cuh (for load and round_bf16).

extern "C" __global__ void llora_rope_bf16(const __nv_bfloat16* x, const __nv_bfloat16* cos_t,
                                           const __nv_bfloat16* sin_t, __nv_bfloat16* y, long pairs, long half,
                                           long heads, long seq, int table_per_row, int backward) {
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < pairs; i += (long)gridDim.x * blockDim.x) {
        long row = i / half, j = i % half;  // row: one head of one token, over [batch, seq, heads]
        long token = row / heads;           // over [batch, seq]
        long t = (table_per_row != 0 ? token : token % seq) * 2 * half;
        long at = row * 2 * half + j;
        float x1 = load(x, at), x2 = load(x, at + half);
        float c1 = load(cos_t, t + j), c2 = load(cos_t, t + j + half);
        float s1 = load(sin_t, t + j), s2 = load(sin_t, t + j + half);
        float a1 = round_bf16(x1 * c1), a2 = round_bf16(x2 * c2);
        float b1, b2;
        if (backward != 0) {
            b1 = round_bf16(x2 * s2);
            b2 = -round_bf16(x1 * s1);
        } else {
            b1 = -round_bf16(x2 * s1);
            b2 = round_bf16(x1 * s2);
        }
        y[at] = __float2bfloat16_rn(a1 + b1);
        y[at + half] = __float2bfloat16_rn(a2 + b2);
    }
}
