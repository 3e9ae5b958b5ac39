//! CUDA kernels of our own, compiled at run time with NVRTC: fusions LibTorch's op
//! set cannot express without temporaries (FP8 quantisation with its amax and transpose in
//! one read). Each kernel's CUDA C source sits beside the Rust that launches it
//! (`fp8_quantize.cu` + `fp8_quantize.rs`), after the device helpers every source shares
//! (`fp8_device.cuh`, prepended to it in its [`Source`]): compiled with
//! `--gpu-architecture=compute_90 -default-device -std=c++17 --fmad=false` and `-I` of the
//! NVIDIA include folders beside the torch wheel, nothing else.
//!
//! The same sources run on the CPU in the tests ([`emulate`]): compiled by the host's C++
//! compiler against `emulation/cuda_cpu.h` (model/build.rs picks up every `.cu` here), launched
//! through the launch code below with its parameter arrays and grid and block sizes, and held
//! to their CPU stand-ins bit for bit; `scripts/sanitize-kernels.sh` runs them under
//! ThreadSanitizer and AddressSanitizer + UndefinedBehaviorSanitizer.
//!
//! NVRTC and the driver come from the machine (cudarc, loaded dynamically): `libnvrtc` from
//! the torch wheel's NVIDIA packages (`<site-packages>/nvidia/*/lib`, found from where
//! LibTorch was loaded, or `LLORA_NVIDIA_ROOT`), `libcuda` from the driver. So llora builds on
//! a machine without CUDA, CI compiles every kernel on the CPU (`tests` below), and a GPU node
//! compiles each once per process. Launching is CUDA-only (status on GPUs: docs/gpu.md); a
//! launch on CPU tensors launches nothing, and the route runs the kernel's CPU stand-in
//! (`fp8::stand_ins`). No file here names a route.

pub mod args;
pub mod emulate;
pub mod fp8_quantize;
pub mod launch;
pub mod nvrtc;
pub mod rmsnorm_fp8;
pub mod swiglu_fp8;

pub use nvrtc::KernelError;

#[cfg(test)]
mod tests {
    use super::nvrtc::{Source, compile};
    use super::*;

    /// Every kernel source llora compiles.
    const SOURCES: &[Source] = &[fp8_quantize::SOURCE, swiglu_fp8::SOURCE, rmsnorm_fp8::SOURCE];

    /// The virtual architectures CI compiles every source for (Hopper, Blackwell).
    const CI_ARCHES: &[&str] = &["compute_90", "compute_100"];

    /// What CI holds every kernel to: each source compiles with NVRTC for Hopper and Blackwell
    /// on a machine without a GPU, and its PTX defines every kernel the launch code looks up.
    #[test]
    fn every_kernel_compiles_with_nvrtc_for_each_architecture() {
        for source in SOURCES {
            for arch in CI_ARCHES {
                let ptx = compile(source, arch).unwrap_or_else(|e| panic!("{e}"));
                for kernel in source.kernels {
                    assert!(
                        ptx.contains(&format!(".entry {kernel}(")),
                        "{}: no kernel {kernel} for {arch}",
                        source.name
                    );
                }
            }
        }
    }
}
