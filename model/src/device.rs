//! Choosing the compute device: one binary runs on a CPU, a CUDA GPU or the pure-Rust backend.
//!
//! Burn 0.22 dispatches backends at run time from the [`Device`]; this module turns the
//! config's `run.device` string into one and sets the thread count the backend uses.

pub use crate::profile::{shim_status, to_host};
use std::fmt;
use std::str::FromStr;

use burn::tensor::Device;
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// Where tensors live: `cpu` and `cuda:N` run on LibTorch, `flex` on burn-flex (pure Rust).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeviceSpec {
    /// LibTorch on the CPU (the default, and what tests use).
    Cpu,
    /// LibTorch on CUDA device N (the PyPI torch wheel is the CUDA build).
    Cuda(usize),
    /// LibTorch on the CUDA device of this process's local rank (`cuda:LOCAL_RANK`): one config
    /// for every rank of a data-parallel job. See [`DeviceSpec::for_local_rank`].
    CudaLocal,
    /// burn-flex, Burn's pure-Rust CPU backend (needs the `flex` cargo feature).
    Flex,
}

/// What [`DeviceSpec::from_str`] accepts, for error messages.
pub const DEVICE_CHOICES: &str = "\"cpu\", \"cuda\" (cuda:LOCAL_RANK), \"cuda:N\" (N = 0, 1, ...) or \"flex\"";

impl FromStr for DeviceSpec {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "cpu" => Ok(Self::Cpu),
            "flex" => Ok(Self::Flex),
            "cuda" => Ok(Self::CudaLocal),
            _ => match s.strip_prefix("cuda:").map(str::parse::<usize>) {
                Some(Ok(n)) => Ok(Self::Cuda(n)),
                _ => Err(format!("unknown device {s:?}: expected {DEVICE_CHOICES}")),
            },
        }
    }
}

impl fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Cpu => f.write_str("cpu"),
            Self::Cuda(n) => write!(f, "cuda:{n}"),
            Self::CudaLocal => f.write_str("cuda"),
            Self::Flex => f.write_str("flex"),
        }
    }
}

impl Serialize for DeviceSpec {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for DeviceSpec {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl DeviceSpec {
    /// The backend that executes on this device, for start-up logs.
    pub fn backend_name(&self) -> String {
        match self {
            Self::Cpu | Self::Cuda(_) | Self::CudaLocal => libtorch_summary(),
            Self::Flex => "burn-flex (pure Rust)".into(),
        }
    }

    /// Whether this is a CUDA device.
    pub fn is_cuda(&self) -> bool {
        matches!(self, Self::Cuda(_) | Self::CudaLocal)
    }

    /// The concrete device of the process with local rank `local_rank`: `cuda` becomes
    /// `cuda:LOCAL_RANK`; every other device is itself.
    pub fn for_local_rank(self, local_rank: usize) -> Self {
        match self {
            Self::CudaLocal => Self::Cuda(local_rank),
            other => other,
        }
    }

    /// Creates the Burn device (without autodiff) and sets the intra-op thread count.
    ///
    /// `threads == 0` keeps the backend's default (one per core). Fails when the device is not
    /// available: no CUDA on this machine, or `flex` without the cargo feature.
    pub fn init(&self, threads: usize) -> anyhow::Result<Device> {
        match self {
            Self::Cpu => {
                set_torch_threads(threads);
                keep_freed_memory();
                Ok(Device::libtorch())
            }
            Self::CudaLocal => Self::Cuda(0).init(threads),
            Self::Cuda(n) => {
                let count = tch::Cuda::device_count();
                if count == 0 {
                    anyhow::bail!(
                        "device cuda:{n} asked for, but LibTorch sees no CUDA device on this machine \
                         ({}); use the device \"cpu\"",
                        libtorch_summary()
                    );
                }
                if (*n as i64) >= count {
                    anyhow::bail!(
                        "device cuda:{n} asked for, but LibTorch sees {count} CUDA device(s) on this machine; \
                         use a device index below {count} (or \"cuda\": cuda:LOCAL_RANK under a launcher)"
                    );
                }
                // Kernels that take no tensor, cuBLAS handles and NCCL communicators use the
                // current device: each rank's must be its own GPU, not GPU 0.
                crate::profile::set_current_device(*n).map_err(anyhow::Error::msg)?;
                set_torch_threads(threads);
                Ok(Device::libtorch_cuda(*n))
            }
            Self::Flex => flex_device(threads),
        }
    }

    /// The number of intra-op threads the backend will use after [`DeviceSpec::init`].
    pub fn effective_threads(&self, threads: usize) -> usize {
        match self {
            Self::Cpu | Self::Cuda(_) | Self::CudaLocal => tch::get_num_threads().max(1) as usize,
            Self::Flex if threads > 0 => threads,
            Self::Flex => std::thread::available_parallelism().map_or(1, |n| n.get()),
        }
    }
}

fn set_torch_threads(threads: usize) {
    if threads > 0 {
        tch::set_num_threads(threads as i32);
        // Inter-op parallelism only helps graph executors; one thread keeps runs reproducible.
        // LibTorch accepts this once per process (a second call throws), and a run can init
        // twice (the demo's pre-training, then the run itself).
        static INTEROP: std::sync::Once = std::sync::Once::new();
        INTEROP.call_once(|| tch::set_num_interop_threads(1));
    }
}

#[cfg(feature = "flex")]
fn flex_device(_threads: usize) -> anyhow::Result<Device> {
    Ok(Device::flex())
}

#[cfg(not(feature = "flex"))]
fn flex_device(_threads: usize) -> anyhow::Result<Device> {
    anyhow::bail!(
        "run.device = \"flex\" needs llora built with the `flex` cargo feature \
         (cargo build --release --features flex)"
    )
}

/// Makes the allocator keep freed pages for reuse instead of returning them to the kernel
/// (jemalloc's decay off): every step reuses the same memory, with no page faults.
///
/// The price: jemalloc merges adjacent freed extents only when it purges them, so with purging
/// off a step whose tensors change sizes (FP8: dequantised weights, quantised copies) can map
/// more than its live peak; purging on maps less but pays page faults every step
/// (docs/performance.md, M12).
/// A `MALLOC_CONF` that sets a decay (e.g. `MALLOC_CONF=dirty_decay_ms:1000`) is left in
/// effect, for users who prefer the smaller RSS.
fn keep_freed_memory() {
    if std::env::var("MALLOC_CONF").is_ok_and(|c| c.contains("decay_ms")) {
        return;
    }
    #[cfg(target_os = "linux")]
    // SAFETY: these mallctl names take an ssize_t; they only change purging policy.
    unsafe {
        for name in [&b"arenas.dirty_decay_ms\0"[..], b"arenas.muzzy_decay_ms\0"] {
            let _ = tikv_jemalloc_ctl::raw::write(name, -1isize);
        }
        // Arenas that exist already keep the decay they were created with.
        let arenas: u32 = tikv_jemalloc_ctl::raw::read(b"arenas.narenas\0").unwrap_or(0);
        for i in 0..arenas {
            for kind in ["dirty", "muzzy"] {
                let name = format!("arena.{i}.{kind}_decay_ms\0");
                let _ = tikv_jemalloc_ctl::raw::write(name.as_bytes(), -1isize);
            }
        }
    }
}

unsafe extern "C" {
    fn llora_torch_version() -> *const std::ffi::c_char;
    fn llora_torch_config() -> *mut std::ffi::c_char;
    fn llora_torch_info_free(s: *mut std::ffi::c_char);
}

/// Holds LibTorch's CPU generator for a test. The generator is one per process and tests run
/// on parallel threads: every test that seeds it (and expects the same draws twice), or draws
/// from it while another may be seeding, holds this one lock; both crates' tests take it here.
pub fn torch_rng_lock() -> std::sync::MutexGuard<'static, ()> {
    static LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// The LibTorch version llora was built against, e.g. `"2.9.0"` (the library it links and
/// loads must be that build: `torch_info.cpp`).
pub fn libtorch_version() -> &'static str {
    // SAFETY: a pointer to the static string literal TORCH_VERSION.
    unsafe { std::ffi::CStr::from_ptr(llora_torch_version()) }.to_str().unwrap_or("unknown")
}

/// LibTorch's own build summary (`at::show_config()`: compiler, CPU capability, CUDA, cuDNN).
pub fn libtorch_config() -> String {
    // SAFETY: a malloc'd NUL-terminated string (or NULL), freed once here.
    unsafe {
        let p = llora_torch_config();
        if p.is_null() {
            return String::new();
        }
        let s = std::ffi::CStr::from_ptr(p).to_string_lossy().into_owned();
        llora_torch_info_free(p);
        s
    }
}

/// The CUDA version LibTorch was built with (`"12.8"`), `None` for a CPU-only build: read off
/// its build summary's `CUDA_VERSION=` setting (present with or without a GPU).
pub fn libtorch_cuda() -> Option<String> {
    build_setting(&libtorch_config(), "CUDA_VERSION")
}

/// The value of `KEY=value` in a LibTorch build summary's `Build settings` line.
fn build_setting(config: &str, key: &str) -> Option<String> {
    config
        .split([',', '\n'])
        .find_map(|part| part.trim().trim_start_matches("- Build settings: ").strip_prefix(key)?.strip_prefix('='))
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty())
}

/// `LibTorch 2.9.0, CUDA 12.8` or `LibTorch 2.9.0, CPU only`: for `--version`, start-up logs
/// and benchmark JSON.
pub fn libtorch_summary() -> String {
    match libtorch_cuda() {
        Some(cuda) => format!("LibTorch {}, CUDA {cuda}", libtorch_version()),
        None => format!("LibTorch {}, CPU only", libtorch_version()),
    }
}

/// Returns the allocator's freed pages to the kernel now (all arenas). Loading interleaves
/// long-lived stored weights with short-lived f32 buffers, which would otherwise stay
/// resident (docs/performance.md, M13).
pub fn release_free_memory() {
    #[cfg(target_os = "linux")]
    // SAFETY: `arena.<MALLCTL_ARENAS_ALL>.purge` takes no argument and only returns free pages.
    unsafe {
        // 4096 is MALLCTL_ARENAS_ALL.
        let name = b"arena.4096.purge\0";
        tikv_jemalloc_sys::mallctl(
            name.as_ptr().cast(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            std::ptr::null_mut(),
            0,
        );
    }
}

/// The allocator's view of the CPU heap, in bytes.
#[derive(Debug, Clone, Copy, Default)]
pub struct HeapBytes {
    /// Handed out and not had back: what the process's tensors (and other heap objects)
    /// occupy, without freed memory kept for reuse.
    pub in_use: usize,
    /// Resident pages the allocator holds: in use, plus freed pages it keeps for reuse. The
    /// process's RSS is this plus the runtime's libraries and non-heap mappings.
    pub resident: usize,
}

/// The allocator's heap statistics now; `None` when they are unavailable.
pub fn heap_bytes() -> Option<HeapBytes> {
    #[cfg(target_os = "linux")]
    {
        // Statistics are snapshots refreshed by advancing the epoch.
        tikv_jemalloc_ctl::epoch::advance().ok()?;
        Some(HeapBytes {
            in_use: tikv_jemalloc_ctl::stats::allocated::read().ok()?,
            resident: tikv_jemalloc_ctl::stats::resident::read().ok()?,
        })
    }
    #[cfg(not(target_os = "linux"))]
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The version the headers name is the version of the library loaded: torch's runtime
    /// `at::show_config()` (compiled into libtorch_cpu.so) names it too; and the build settings
    /// of a summary are read as torch prints them.
    #[test]
    fn names_the_libtorch_it_runs_with() {
        let v = libtorch_version();
        assert!(v.split('.').count() == 3 && v.split('.').all(|p| p.parse::<u32>().is_ok()), "{v}");
        let config = libtorch_config();
        assert!(config.contains("PyTorch built with"), "{config}");
        assert!(config.contains(&format!("TORCH_VERSION={v}")), "{config}");
        assert_eq!(build_setting(&config, "TORCH_VERSION").as_deref(), Some(v));
        let summary = "PyTorch built with:\n  - GCC 13.3\n  - Build settings: BLAS_INFO=mkl, CUDA_VERSION=12.8, \
                       CUDNN_VERSION=9.8.0, TORCH_VERSION=2.9.0, USE_CUDA=ON, \n";
        assert_eq!(build_setting(summary, "CUDA_VERSION").as_deref(), Some("12.8"));
        assert_eq!(build_setting(summary, "BLAS_INFO").as_deref(), Some("mkl"));
        assert_eq!(build_setting("  - Build settings: BLAS_INFO=mkl, USE_CUDA=OFF, \n", "CUDA_VERSION"), None);
    }

    #[test]
    fn parses_and_prints_every_form() {
        for (s, d) in [
            ("cpu", DeviceSpec::Cpu),
            ("flex", DeviceSpec::Flex),
            ("cuda:3", DeviceSpec::Cuda(3)),
            ("cuda", DeviceSpec::CudaLocal),
        ] {
            assert_eq!(s.parse::<DeviceSpec>().unwrap(), d);
            assert_eq!(d.to_string(), s);
        }
    }

    #[test]
    fn rejects_unknown_devices_with_the_choices() {
        assert_eq!(DeviceSpec::CudaLocal.for_local_rank(5), DeviceSpec::Cuda(5));
        assert_eq!(DeviceSpec::Cpu.for_local_rank(5), DeviceSpec::Cpu);
        for bad in ["gpu", "cuda:x", "cuda:-1", "CPU", ""] {
            let err = bad.parse::<DeviceSpec>().unwrap_err();
            assert!(err.contains(DEVICE_CHOICES), "{err}");
        }
    }
}
