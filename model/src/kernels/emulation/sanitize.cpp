// Our kernels on the CPU under ThreadSanitizer or AddressSanitizer + UndefinedBehaviorSanitizer
// (scripts/sanitize-kernels.sh builds this with the emulator and the sources model/build.rs
// generates): each kernel launched as its Rust launch code launches it (256 threads a block;
// grid-stride grids of ceil(n / 256) blocks, and of 2 so the stride loops run; one 32 x 32 tile
// a block for the transpose; one block a row for RMSNorm; ceil(n / 4 / 256) for dropout's
// four elements a thread) on buffers of exactly the problem's
// size, so a read or write past one, a race between a block's threads on global memory, or
// undefined behaviour in the kernels' arithmetic is reported. Exit status 0 when every launch
// ran and reported nothing itself; the sanitizers' reports fail the run on their own.

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

extern "C" int llora_emu_launch(const char* kernel, const unsigned grid[3], const unsigned block[3], void** params,
                                unsigned patience_ms, char* error, size_t error_len);

namespace {

constexpr unsigned kThreads = 256;
int g_failures = 0;

// Launches `kernel` with `args` (the addresses of its arguments' values).
void run(const char* kernel, unsigned gx, unsigned gy, std::vector<void*> args) {
    unsigned grid[3] = {gx, gy, 1}, block[3] = {kThreads, 1, 1};
    char error[512] = {};
    if (llora_emu_launch(kernel, grid, block, args.data(), 20000, error, sizeof error) != 0) {
        std::fprintf(stderr, "sanitize-kernels: %s\n", error);
        ++g_failures;
    } else {
        std::printf("ran %s on %u x %u blocks\n", kernel, gx, gy);
    }
}

unsigned stride_blocks(long n) { return static_cast<unsigned>((n + kThreads - 1) / kThreads); }

// Values with the edges the kernels treat specially: NaN, infinities, past the clamp, denormals.
std::vector<float> values(long n) {
    std::vector<float> v(n);
    for (long i = 0; i < n; ++i) {
        v[i] = std::sin(0.37f * i) * 300.0f;
    }
    float edges[] = {NAN, INFINITY, -INFINITY, 1e6f, -1e6f, 1e-40f, 0.0f};
    for (long i = 0; i < n && i < 7; ++i) {
        v[i * 5 % n] = edges[i];
    }
    return v;
}

// bf16 of each value (truncated: any bit pattern is a valid input).
std::vector<unsigned short> bf16(const std::vector<float>& v) {
    std::vector<unsigned short> out(v.size());
    for (size_t i = 0; i < v.size(); ++i) {
        unsigned int u;
        std::memcpy(&u, &v[i], 4);
        out[i] = static_cast<unsigned short>(u >> 16);
    }
    return out;
}

void quantize(long rows, long cols) {
    long n = rows * cols;
    std::vector<float> x = values(n);
    std::vector<unsigned short> xb = bf16(x);
    std::vector<unsigned char> out(n), out_t(n);
    unsigned int amax = 0;
    float scale_inv = 0, scale = 0.75f, limit = 448.0f;
    int e5m2 = 0;
    void *px = x.data(), *pxb = xb.data(), *po = out.data(), *pot = out_t.data(), *pa = &amax, *pi = &scale_inv;
    for (void** input : {&px, &pxb}) {
        bool b = input == &pxb;
        for (unsigned blocks : {stride_blocks(n), 2u}) {
            run(b ? "llora_fp8_quantize_bf16" : "llora_fp8_quantize_f32", blocks, 1,
                {input, &po, &pa, &n, &scale, &limit, &e5m2});
            run(b ? "llora_fp8_amax_bf16" : "llora_fp8_amax_f32", blocks, 1, {input, &pa, &n});
            run(b ? "llora_fp8_quantize_current_bf16" : "llora_fp8_quantize_current_f32", blocks, 1,
                {input, &po, &pa, &pi, &n, &limit, &e5m2});
        }
        unsigned gx = static_cast<unsigned>((cols + 31) / 32), gy = static_cast<unsigned>((rows + 31) / 32);
        run(b ? "llora_fp8_quantize_transpose_bf16" : "llora_fp8_quantize_transpose_f32", gx, gy,
            {input, &po, &pot, &pa, &rows, &cols, &scale, &limit, &e5m2});
    }
}

void rmsnorm(long rows, long cols) {
    std::vector<unsigned short> x = bf16(values(rows * cols)), w = bf16(values(cols)), y(rows * cols);
    std::vector<float> inv_rms(rows);
    std::vector<unsigned char> codes(rows * cols);
    float y_scale = 17.0f, eps = 1e-5f, limit = 448.0f;
    unsigned int y_amax = 0;
    int e5m2 = 0;
    void *px = x.data(), *pw = w.data(), *py = y.data(), *pr = inv_rms.data(), *pc = codes.data(), *ps = &y_scale,
         *pa = &y_amax, *none = nullptr;
    run("llora_rmsnorm_fp8_forward_bf16", static_cast<unsigned>(rows), 1,
        {&px, &pw, &py, &pr, &pc, &ps, &pa, &cols, &eps, &limit, &e5m2});
    run("llora_rmsnorm_fp8_forward_bf16", static_cast<unsigned>(rows), 1,
        {&px, &pw, &py, &pr, &none, &none, &none, &cols, &eps, &limit, &e5m2});
}

void swiglu(long n) {
    std::vector<unsigned short> gate = bf16(values(n)), up = bf16(values(n)), out(n), grad = bf16(values(n));
    std::vector<unsigned short> grad_gate(n), grad_up(n);
    std::vector<unsigned char> gq(n), uq(n), hq(n);
    unsigned int amax[2] = {0, 0}, h_amax = 0;
    float scale_inv[2] = {0, 0}, h_scale = 3.0f, e4m3_max = 448.0f, h_limit = 57344.0f;
    int h_e5m2 = 1;
    void *pg = gate.data(), *pu = up.data(), *po = out.data(), *pgq = gq.data(), *puq = uq.data(), *pa = amax,
         *psi = scale_inv, *phq = hq.data(), *phs = &h_scale, *pha = &h_amax, *pd = grad.data(),
         *pgg = grad_gate.data(), *pgu = grad_up.data();
    for (unsigned blocks : {stride_blocks(n), 2u}) {
        run("llora_swiglu_amax_bf16", blocks, 1, {&pg, &pu, &pa, &n});
        run("llora_swiglu_fp8_forward_bf16", blocks, 1,
            {&pg, &pu, &po, &pgq, &puq, &pa, &psi, &phq, &phs, &pha, &n, &e4m3_max, &h_limit, &h_e5m2});
        run("llora_swiglu_fp8_backward_bf16", blocks, 1, {&pgq, &puq, &psi, &pd, &pgg, &pgu, &n});
    }
}

// RoPE both ways over [b, s, h, hd], tables one a row (per_row) or shared, grid-stride with two
// blocks so the loop runs more than once.
void rope(long b, long s, long h, long hd, int per_row) {
    long tb = per_row != 0 ? b : 1, half = hd / 2, pairs = b * s * h * half;
    std::vector<unsigned short> x = bf16(values(b * s * h * hd)), y(b * s * h * hd);
    std::vector<unsigned short> c = bf16(values(tb * s * hd)), sn = bf16(values(tb * s * hd));
    void *px = x.data(), *pc = c.data(), *ps = sn.data(), *py = y.data();
    for (int backward = 0; backward < 2; ++backward) {
        run("llora_rope_bf16", 2, 1, {&px, &pc, &ps, &py, &pairs, &half, &h, &s, &per_row, &backward});
    }
}

// Dropout over n elements, the tensor's own mask (its amax taken) and a split's rows ([rows,
// 2 * chunk, width], padding past seq; no amax), grid-stride with ceil(n / 4 / 256) blocks and
// with two.
void dropout(long rows, long chunk, long width, long seq) {
    long local = 2 * chunk, n = rows * local * width, one = 1, zero = 0, g1 = 3 * chunk;
    std::vector<unsigned short> x = bf16(values(n)), y(n);
    unsigned long long seed = 0x0123456789abcdefull;
    unsigned int threshold = 3865470566u;  // (1 - 0.1) * 2^32
    float scale = 1.0f / 0.9f;
    unsigned int amax = 0;
    void *px = x.data(), *py = y.data(), *pa = &amax, *none = nullptr;
    for (unsigned blocks : {stride_blocks((n + 3) / 4), 2u}) {
        run("llora_dropout_bf16", blocks, 1,
            {&px, &py, &n, &one, &n, &one, &zero, &zero, &one, &seed, &threshold, &scale, &pa});
        run("llora_dropout_bf16", blocks, 1,
            {&px, &py, &n, &local, &width, &chunk, &zero, &g1, &seq, &seed, &threshold, &scale, &none});
    }
}

}  // namespace

int main() {
    quantize(65, 40);
    quantize(1, 1);
    rmsnorm(3, 1000);
    rmsnorm(2, 7);
    swiglu(1000);
    swiglu(1);
    rope(2, 33, 3, 128, 1);
    rope(1, 5, 2, 10, 0);
    dropout(3, 4, 9, 14);
    dropout(1, 1, 1, 1);
    std::vector<float> out(512);
    void* po = out.data();
    run("llora_check_reverse_tile", 2, 1, {&po});
    if (g_failures > 0) {
        std::fprintf(stderr, "sanitize-kernels: %d launch(es) failed\n", g_failures);
        return 1;
    }
    return 0;
}
