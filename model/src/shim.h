// What every C ABI shim of llora shares (model/build.rs compiles the model's, trainer/build.rs
// the c10d one with this folder on its include path): a message copied
// for Rust (malloc'd; each shim exports a `_free` for it) and a guard that turns any C++
// exception into that message, so a LibTorch op that refuses its inputs is a Rust error, never
// an abort across the FFI boundary.
#pragma once

#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>

namespace llora_shim {

// `s` copied into malloc'd memory (NULL if that fails).
inline char* dup(const std::string& s) {
  char* out = static_cast<char*>(std::malloc(s.size() + 1));
  if (out != nullptr) std::memcpy(out, s.c_str(), s.size() + 1);
  return out;
}

// Runs `f`: true when it returned, false when it threw (the message then in *err).
template <typename F>
bool guarded(char** err, F&& f) {
  try {
    f();
    return true;
  } catch (const std::exception& e) {
    if (err != nullptr) *err = dup(e.what());
  } catch (...) {
    if (err != nullptr) *err = dup("unknown C++ exception");
  }
  return false;
}

}  // namespace llora_shim
