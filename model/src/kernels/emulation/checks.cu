// Kernels written to break the CPU emulation's checks (emulate/tests.rs): compiled for the CPU
// only (model/build.rs), never by NVRTC. Each takes one float pointer to 1024 values.

namespace {

constexpr int kWarps = 8;

// Each thread writes its id into a tile; with `synced`, reads a neighbour's after a barrier.
__device__ void reverse_tile(float* out, bool synced) {
    __shared__ float tile[1024];
    int i = threadIdx.x;
    tile[i] = (float)i;
    if (synced) {
        __syncthreads();
    }
    out[blockIdx.x * blockDim.x + i] = tile[blockDim.x - 1 - i];
}

}  // namespace

extern "C" __global__ void llora_check_reverse_tile(float* out) { reverse_tile(out, true); }

// A missing __syncthreads: thread i reads what thread blockDim - 1 - i wrote, unordered.
extern "C" __global__ void llora_check_reverse_tile_unsynced(float* out) { reverse_tile(out, false); }

// Per-warp partials sized for 256 threads (kWarps): a larger block indexes past them.
extern "C" __global__ void llora_check_per_warp_partials(float* out) {
    __shared__ float partial[kWarps];
    if (threadIdx.x % 32 == 0) {
        partial[threadIdx.x / 32] = 1.0f;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        out[0] = partial[0];
    }
}

// A __syncthreads half the block skips (a GPU hangs).
extern "C" __global__ void llora_check_partial_sync(float* out) {
    if (threadIdx.x < blockDim.x / 2) {
        __syncthreads();
    }
    out[threadIdx.x] = 1.0f;
}
