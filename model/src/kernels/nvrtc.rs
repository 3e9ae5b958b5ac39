//! NVRTC for our kernels: finding the torch wheel's NVIDIA packages (the library, the headers),
//! loading the library once per process, and compiling a source to PTX or CUBIN.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// A CUDA C source of this folder and the kernels it defines (`extern "C"` names).
#[derive(Debug, Clone, Copy)]
pub struct Source {
    /// The file name, for logs and NVRTC's diagnostics.
    pub name: &'static str,
    /// Its text.
    pub text: &'static str,
    /// The kernels the launch code looks up in it.
    pub kernels: &'static [&'static str],
}

/// Why a kernel of ours cannot run (the caller takes the LibTorch route and logs this).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum KernelError {
    /// No NVRTC library was found or loaded.
    #[error("NVRTC is not available: {0}")]
    NoNvrtc(String),
    /// NVRTC refused a source.
    #[error("NVRTC cannot compile {file} for {arch}: {log}")]
    Compile {
        /// The source's file name.
        file: &'static str,
        /// The architecture asked for.
        arch: String,
        /// NVRTC's log (or its error).
        log: String,
    },
    /// The tensors handed to a launch are not what the kernel reads and writes.
    #[error("{kernel}: {what}")]
    Arguments {
        /// The kernel.
        kernel: &'static str,
        /// What is wrong, naming the argument.
        what: String,
    },
    /// The driver refused to load or launch a kernel.
    #[error("CUDA driver: {0}")]
    Driver(String),
}

/// The `nvidia` folder of the torch wheel LibTorch was loaded from (`LLORA_NVIDIA_ROOT`
/// overrides): `<site-packages>/torch/lib/libtorch_cpu.so` gives `<site-packages>/nvidia`.
pub fn nvidia_root() -> Option<PathBuf> {
    if let Some(root) = std::env::var_os("LLORA_NVIDIA_ROOT") {
        return Some(PathBuf::from(root));
    }
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    let lib = maps.lines().filter_map(|l| l.split_whitespace().nth(5)).find(|p| p.ends_with("/libtorch_cpu.so"))?;
    let site = Path::new(lib).parent()?.parent()?.parent()?;
    Some(site.join("nvidia")).filter(|p| p.is_dir())
}

/// The folders of `root/*/<sub>`, sorted (`include` for headers, `lib` for libraries).
fn package_dirs(root: &Path, sub: &str) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(root)
        .into_iter()
        .flatten()
        .flatten()
        .map(|e| e.path().join(sub))
        .filter(|p| p.is_dir())
        .collect();
    out.sort();
    out
}

/// The NVRTC library under `root` (`*/lib/libnvrtc.so.<major>`, the newest major).
fn nvrtc_library(root: &Path) -> Option<PathBuf> {
    let is_nvrtc = |p: &PathBuf| {
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        name.strip_prefix("libnvrtc.so.").is_some_and(|v| v.chars().all(|c| c.is_ascii_digit()))
    };
    let libs = package_dirs(root, "lib").into_iter().flat_map(|d| std::fs::read_dir(d).into_iter().flatten().flatten());
    libs.map(|e| e.path()).filter(is_nvrtc).max()
}

/// Loads NVRTC once per process: the wheel's library opened by path into the global namespace,
/// where cudarc's own lookup by name (`libnvrtc.so.13`, `.so.12`) then finds it.
fn load_nvrtc() -> Result<&'static Path, KernelError> {
    static LOADED: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    let loaded = LOADED.get_or_init(|| {
        let root = nvidia_root().ok_or("no torch wheel's `nvidia` folder found (set LLORA_NVIDIA_ROOT)")?;
        let path = nvrtc_library(&root).ok_or_else(|| format!("no libnvrtc.so.* under {}/*/lib", root.display()))?;
        let flags = libc::RTLD_NOW | libc::RTLD_GLOBAL;
        let c_path = std::ffi::CString::new(path.as_os_str().as_encoded_bytes()).map_err(|e| e.to_string())?;
        // SAFETY: dlopen of a library path; the handle is kept for the process's life.
        let handle = unsafe { libc::dlopen(c_path.as_ptr(), flags) };
        if handle.is_null() {
            return Err(format!("cannot load {}", path.display()));
        }
        Ok(path)
    });
    loaded.as_deref().map_err(|e| KernelError::NoNvrtc(e.clone()))
}

/// What NVRTC makes of a source.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Image {
    /// PTX for a virtual architecture (`compute_90`): the driver compiles it when loading (a
    /// driver older than NVRTC's PTX version cannot).
    Ptx(String),
    /// Machine code for one real architecture (`sm_90`): loaded as it is.
    Cubin(Vec<u8>),
}

/// `source` compiled for `arch`: CUBIN for a real architecture (`sm_90`), PTX for a virtual one
/// (`compute_90`). Errors carry NVRTC's log.
pub fn compile_image(source: &Source, arch: &str) -> Result<Image, KernelError> {
    load_nvrtc()?;
    let root = nvidia_root().ok_or_else(|| KernelError::NoNvrtc("no NVIDIA package folder".into()))?;
    let mut options = vec![
        format!("--gpu-architecture={arch}"),
        "-default-device".into(),
        "-std=c++17".into(),
        // No multiply-add contracted, as the CPU emulation compiles them (-ffp-contract=off):
        // the two then round alike; our kernels are memory-bound, an FMA saves them nothing.
        "--fmad=false".into(),
    ];
    options.extend(package_dirs(&root, "include").into_iter().map(|p| format!("--include-path={}", p.display())));
    let error = |log: String| KernelError::Compile { file: source.name, arch: arch.into(), log };
    let cubin = arch.starts_with("sm_");
    // cudarc panics where a library symbol is missing: that is an error here, not a crash.
    std::panic::catch_unwind(|| run_nvrtc(source, &options, cubin))
        .unwrap_or_else(|panic| Err(panic_message(&panic)))
        .map_err(error)
}

/// One NVRTC program: created, compiled with `options`, its PTX or CUBIN taken, destroyed.
fn run_nvrtc(source: &Source, options: &[String], cubin: bool) -> Result<Image, String> {
    use cudarc::nvrtc::{result, sys};
    let text = std::ffi::CString::new(source.text).map_err(|e| e.to_string())?;
    let name = std::ffi::CString::new(source.name).map_err(|e| e.to_string())?;
    let prog = result::create_program(&text, Some(&name)).map_err(|e| format!("{e:?}"))?;
    // SAFETY: `prog` was just created and is destroyed once below; the buffers are sized by
    // NVRTC's own size calls.
    let made = unsafe {
        match result::compile_program(prog, options) {
            Err(e) => {
                let log = result::get_program_log(prog)
                    .map(|l| std::ffi::CStr::from_ptr(l.as_ptr()).to_string_lossy().into_owned());
                Err(log.unwrap_or_else(|_| format!("{e:?}")))
            }
            Ok(()) if cubin => {
                let mut size = 0usize;
                sys::nvrtcGetCUBINSize(prog, &mut size).result().map_err(|e| format!("{e:?}"))?;
                let mut image = vec![0u8; size];
                sys::nvrtcGetCUBIN(prog, image.as_mut_ptr().cast()).result().map_err(|e| format!("{e:?}"))?;
                Ok(Image::Cubin(image))
            }
            Ok(()) => result::get_ptx(prog)
                .map(|p| Image::Ptx(std::ffi::CStr::from_ptr(p.as_ptr()).to_string_lossy().into_owned()))
                .map_err(|e| format!("{e:?}")),
        }
    };
    // SAFETY: created above, destroyed once.
    let _ = unsafe { result::destroy_program(prog) };
    made
}

/// The message a caught panic carried (a route's first-use check, a kernel's compile or load).
pub fn panic_message(payload: &Box<dyn std::any::Any + Send>) -> String {
    payload
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_else(|| "a panic without a message".into())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A source with an error fails with NVRTC's log naming it (the check above can fail).
    #[test]
    fn a_broken_source_fails_with_the_log() {
        let broken =
            Source { name: "broken.cu", text: "extern \"C\" __global__ void k() { undeclared(); }", kernels: &[] };
        match compile_image(&broken, "compute_90") {
            Err(KernelError::Compile { file: "broken.cu", log, .. }) => assert!(log.contains("undeclared"), "{log}"),
            other => panic!("expected a compile error, got {other:?}"),
        }
    }
}
