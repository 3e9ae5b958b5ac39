// What LibTorch llora runs with, for model/src/device.rs: the version of the headers it was
// compiled against (the library it links must be that build) and torch's own build summary
// (`at::show_config()`: CUDA runtime, cuDNN, CPU capability). Built by model/build.rs.
#include <cstdlib>
#include <cstring>
#include <string>

#include <ATen/Version.h>
#include <torch/version.h>

extern "C" {

// The LibTorch version llora was built against, e.g. "2.9.0" (static storage).
const char* llora_torch_version() { return TORCH_VERSION; }

// at::show_config(), malloc'd (free with llora_torch_info_free); NULL if it throws.
char* llora_torch_config() {
  try {
    std::string s = at::show_config();
    char* out = static_cast<char*>(std::malloc(s.size() + 1));
    if (out != nullptr) std::memcpy(out, s.c_str(), s.size() + 1);
    return out;
  } catch (...) {
    return nullptr;
  }
}

// Frees a string returned by llora_torch_config.
void llora_torch_info_free(char* s) { std::free(s); }

}  // extern "C"
