// LibTorch's current CUDA stream of a device, for our kernels' launches (kernels/launch.rs):
// c10's C++ API has no C binding in tch. Built against the CUDA headers of the venv's nvidia
// wheels (model/build.rs); where they are missing it reports that instead.

#include <cstdio>
#include <exception>

#ifdef LLORA_WITH_CUDA_HEADERS
#include <c10/cuda/CUDAStream.h>
#endif

// Writes device `device`'s current stream to *stream: 0, or 1 with the reason in `error`.
extern "C" int llora_current_cuda_stream(int device, void** stream, char* error, size_t error_len) {
#ifdef LLORA_WITH_CUDA_HEADERS
    try {
        *stream = c10::cuda::getCurrentCUDAStream(static_cast<c10::DeviceIndex>(device)).stream();
        return 0;
    } catch (const std::exception& e) {
        std::snprintf(error, error_len, "%s", e.what());
        return 1;
    }
#else
    (void)device;
    *stream = nullptr;
    std::snprintf(error, error_len, "llora was built without the CUDA headers (run ./scripts/setup.sh)");
    return 1;
#endif
}
