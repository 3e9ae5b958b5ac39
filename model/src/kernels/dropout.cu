// Inverted dropout in one pass, its mask drawn inside the kernel from a counter-based generator
// (Philox4x32-10, as cuRAND and Transformer Engine draw theirs): y = x * keep / (1 - p). The
// mask is never written: backward runs the same kernel on the gradient with the same seed,
// which draws the same bits. LibTorch's route draws a byte mask with bernoulli_ (a pass that
// writes it), then multiplies (a pass that reads x and the mask): two launches and a mask of a
// byte per element, here one launch.
//
// Which bits: element i of the local tensor [rows, local, width] sits at global position
// gpos of its row's sequence (context parallelism holds two chunks of it: local positions
// below `chunk` are global g0 + l, the rest g1 + (l - chunk)); its mask word is word
// (g % 4) of philox(counter = g / 4, key = seed) where g = (row * seq + gpos) * width + col,
// kept when the word is below `threshold` = floor((1 - p) * 2^32). Positions at or past
// `seq` (a split's padding) are kept. Without a split: rows = local = chunk = seq = 1 and
// width = the element count, so g = i.
//
// With `amax_bits` (else null) the output's amax is folded into it (max of |y| as ordered bits,
// NaN above all, fp8_device.cuh's fold_amax): the amax an FP8 copy of y at current scaling
// needs, taken here instead of in a pass of its own.
//
// Reference (model/src/dropout/fused.rs `stand_in`: the mask from the host's Philox in
// model/src/dropout/philox.rs, then LibTorch's native_dropout_backward, x * mask * scale in
// f32 rounded once to bf16; the amax LibTorch's max of |y|): bit for bit, zeros' signs and NaNs
// included.
// Compiled by NVRTC after fp8_device.cuh (for load and kThreads).

namespace {

// One Philox4x32-10 block: the four words of counter (c0, c1, 0, 0) under key (k0, k1).
__device__ __forceinline__ void philox(unsigned int c0, unsigned int c1, unsigned int k0, unsigned int k1,
                                       unsigned int& w0, unsigned int& w1, unsigned int& w2, unsigned int& w3) {
    unsigned int c2 = 0u, c3 = 0u;
    for (int round = 0; round < 10; ++round) {
        if (round > 0) {
            k0 += 0x9E3779B9u;
            k1 += 0xBB67AE85u;
        }
        unsigned long long p0 = 0xD2511F53ull * (unsigned long long)c0;
        unsigned long long p1 = 0xCD9E8D57ull * (unsigned long long)c2;
        unsigned int hi0 = (unsigned int)(p0 >> 32), lo0 = (unsigned int)p0;
        unsigned int hi1 = (unsigned int)(p1 >> 32), lo1 = (unsigned int)p1;
        unsigned int n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
        c0 = n0;
        c1 = lo1;
        c2 = n2;
        c3 = lo0;
    }
    w0 = c0;
    w1 = c1;
    w2 = c2;
    w3 = c3;
}

}  // namespace

// Each thread takes four consecutive elements (one Philox block where the width is a multiple
// of four, as every model's is; a block is drawn again only where an element's counter
// differs from the one before it).
extern "C" __global__ void llora_dropout_bf16(const __nv_bfloat16* x, __nv_bfloat16* y, long n, long local,
                                              long width, long chunk, long g0, long g1, long seq,
                                              unsigned long long seed, unsigned int threshold, float scale,
                                              unsigned int* amax_bits) {
    unsigned int k0 = (unsigned int)seed, k1 = (unsigned int)(seed >> 32);
    unsigned int mine = 0u;
    long quads = (n + 3) / 4;
    for (long q = blockIdx.x * (long)blockDim.x + threadIdx.x; q < quads; q += (long)gridDim.x * blockDim.x) {
        unsigned long long have = ~0ull;
        // The block's words in registers (an array indexed at run time would live in local memory).
        unsigned int w0 = 0u, w1 = 0u, w2 = 0u, w3 = 0u;
        for (long i = 4 * q; i < 4 * q + 4 && i < n; ++i) {
            long col = i % width, token = i / width;
            long l = token % local, row = token / local;
            long gpos = l < chunk ? g0 + l : g1 + (l - chunk);
            float keep = 1.0f;
            if (gpos < seq) {
                unsigned long long g = (unsigned long long)((row * seq + gpos) * width + col);
                unsigned long long counter = g >> 2;
                if (counter != have) {
                    philox((unsigned int)counter, (unsigned int)(counter >> 32), k0, k1, w0, w1, w2, w3);
                    have = counter;
                }
                unsigned int lane = (unsigned int)(g & 3ull);
                unsigned int word = lane == 0u ? w0 : lane == 1u ? w1 : lane == 2u ? w2 : w3;
                keep = word < threshold ? 1.0f : 0.0f;
            }
            __nv_bfloat16 out = __float2bfloat16_rn(load(x, i) * keep * scale);
            y[i] = out;
            mine = max(mine, abs_bits(__bfloat162float(out)));
        }
    }
    if (amax_bits != nullptr) {
        fold_amax(mine, amax_bits);
    }
}
