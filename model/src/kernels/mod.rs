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
pub mod dropout;
pub mod emulate;
pub mod fp8_quantize;
pub mod launch;
pub mod nvrtc;
pub mod rmsnorm_fp8;
pub mod rope;
pub mod swiglu_fp8;

pub use nvrtc::KernelError;

#[cfg(test)]
mod tests {
    use super::nvrtc::{Image, Source, compile_image};
    use super::*;

    /// Every kernel source llora compiles.
    const SOURCES: &[Source] =
        &[fp8_quantize::SOURCE, swiglu_fp8::SOURCE, rmsnorm_fp8::SOURCE, rope::SOURCE, dropout::SOURCE];

    /// The architectures CI compiles every source for (Hopper, Blackwell).
    const CI_ARCHES: &[(i32, i32)] = &[(9, 0), (10, 0)];

    /// What CI holds every kernel to: each source compiles with NVRTC on a machine without a
    /// GPU, for Hopper and Blackwell, to PTX (defining every kernel the launch code looks up)
    /// and to CUBIN (an ELF image naming each of them), the two images a device loads.
    #[test]
    fn every_kernel_compiles_with_nvrtc_for_each_architecture() {
        for source in SOURCES {
            for (major, minor) in CI_ARCHES {
                let arch = format!("compute_{major}{minor}");
                let Ok(Image::Ptx(ptx)) = compile_image(source, &arch) else {
                    panic!("{}: no PTX for {arch}", source.name)
                };
                let sm = format!("sm_{major}{minor}");
                let cubin = match compile_image(source, &sm) {
                    Ok(Image::Cubin(c)) => c,
                    other => panic!("{}: no CUBIN for {sm}: {other:?}", source.name),
                };
                assert_eq!(&cubin[..4], b"\x7fELF", "{}: CUBIN for {sm}", source.name);
                for kernel in source.kernels {
                    assert!(
                        ptx.contains(&format!(".entry {kernel}(")),
                        "{}: no kernel {kernel} for {arch}",
                        source.name
                    );
                    let named = cubin.windows(kernel.len()).any(|w| w == kernel.as_bytes());
                    assert!(named, "{}: no kernel {kernel} in the {sm} CUBIN", source.name);
                }
            }
        }
    }

    /// `ptxas -v` (the torch wheel's, from the nvidia-cuda-nvcc package setup.sh installs) over
    /// every kernel for Hopper and Blackwell: none spills a register, each fits a 256-thread block
    /// in an SM's 64K registers. The table it prints is docs/gpu.md's kernel table.
    #[test]
    fn ptxas_finds_no_spills_in_any_kernel() {
        let root = nvrtc::nvidia_root().expect("the torch wheel's nvidia folder");
        let ptxas = ["cuda_nvcc/bin/ptxas", "cu13/bin/ptxas"].iter().map(|p| root.join(p)).find(|p| p.is_file());
        let ptxas = ptxas.unwrap_or_else(|| panic!("no ptxas under {}: run ./scripts/setup.sh", root.display()));
        let dir = tempfile::tempdir().unwrap();
        println!(
            "| kernel | arch | registers | shared memory B | stack B | spill stores B | spill loads B |\n|---|---|---|---|---|---|---|"
        );
        for source in SOURCES {
            for (major, minor) in CI_ARCHES {
                let Ok(Image::Ptx(ptx)) = compile_image(source, &format!("compute_{major}{minor}")) else {
                    panic!("no PTX")
                };
                let file = dir.path().join(format!("{}.ptx", source.name));
                std::fs::write(&file, ptx).unwrap();
                let out = std::process::Command::new(&ptxas)
                    .args(["-v", &format!("--gpu-name=sm_{major}{minor}"), "-o", "/dev/null"])
                    .arg(&file)
                    .output()
                    .unwrap();
                let log = String::from_utf8_lossy(&out.stderr);
                assert!(out.status.success(), "ptxas on {}: {log}", source.name);
                for (kernel, usage) in ptxas_usage(&log) {
                    let [regs, smem, stack, stores, loads] = usage;
                    println!("| {kernel} | sm_{major}{minor} | {regs} | {smem} | {stack} | {stores} | {loads} |");
                    assert_eq!((stores, loads), (0, 0), "{kernel} spills on sm_{major}{minor}");
                    assert!(regs * i64::from(launch::THREADS) <= 65536, "{kernel}: {regs} registers a thread");
                }
            }
        }
    }

    /// Each function's (registers, shared memory, stack frame, spill stores, spill loads) from
    /// `ptxas -v`'s log.
    fn ptxas_usage(log: &str) -> Vec<(String, [i64; 5])> {
        let number = |line: &str, before: &str| -> i64 {
            line.split(before)
                .next()
                .and_then(|l| l.split_whitespace().last())
                .and_then(|n| n.parse().ok())
                .unwrap_or(0)
        };
        let mut out: Vec<(String, [i64; 5])> = Vec::new();
        for line in log.lines() {
            if let Some(name) = line.split("Compiling entry function '").nth(1) {
                out.push((
                    name.trim_end_matches(['\'', ' ']).split('\'').next().unwrap_or_default().to_string(),
                    [0; 5],
                ));
            } else if let Some((_, usage)) = out.last_mut() {
                if line.contains("bytes stack frame") {
                    usage[2] = number(line, " bytes stack frame");
                    usage[3] = number(line, " bytes spill stores");
                    usage[4] = number(line, " bytes spill loads");
                } else if line.contains("Used ") {
                    usage[0] = number(line, " registers");
                    usage[1] = number(line, " bytes smem");
                }
            }
        }
        out
    }
}
