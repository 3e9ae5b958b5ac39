//! Loading and launching our kernels on a CUDA device, shared by every kernel's launch code:
//! each [`Source`] is compiled for the device's architecture and loaded once per device and
//! process in the device's primary context (LibTorch's), and launched on the default stream
//! (LibTorch's current stream: llora never sets another). CUDA-only (status on GPUs:
//! docs/gpu.md).

use std::collections::HashMap;
use std::ffi::{CString, c_void};
use std::sync::{Arc, Mutex};

use cudarc::driver::{result, sys};

use super::nvrtc::{KernelError, Source, compile};

/// A source loaded on one device: its functions by name.
struct Loaded {
    functions: HashMap<&'static str, usize>,
}

/// What loading gave for each (source, CUDA device index).
type PerDevice = HashMap<(&'static str, usize), Result<Arc<Loaded>, KernelError>>;

/// The loaded kernels of `source` on CUDA device `index`, loaded on first use. Compiling runs
/// outside the lock (it may take seconds, and nothing in it takes this lock); two threads
/// that both compile keep the first result.
fn loaded(source: &'static Source, index: usize) -> Result<Arc<Loaded>, KernelError> {
    static LOADED: Mutex<Option<PerDevice>> = Mutex::new(None);
    let key = (source.name, index);
    if let Some(found) = LOADED.lock().unwrap_or_else(|e| e.into_inner()).get_or_insert_default().get(&key) {
        return found.clone();
    }
    let made = load(source, index).map(Arc::new);
    if let Err(e) = &made {
        tracing::warn!(
            device = index,
            source = source.name,
            "our kernels are off on this device (the LibTorch routes run): {e}"
        );
    }
    let mut table = LOADED.lock().unwrap_or_else(|e| e.into_inner());
    table.get_or_insert_default().entry(key).or_insert(made).clone()
}

/// Compiles `source` for device `index`'s architecture and loads it in the device's primary
/// context, made current on this thread.
fn load(source: &'static Source, index: usize) -> Result<Loaded, KernelError> {
    let driver = |e: cudarc::driver::DriverError| KernelError::Driver(format!("{e:?}"));
    let attempt = || -> Result<Loaded, KernelError> {
        result::init().map_err(driver)?;
        let dev = result::device::get(index as i32).map_err(driver)?;
        // SAFETY: a valid device handle; attributes are plain integers.
        let (major, minor) = unsafe {
            let attr = |a| result::device::get_attribute(dev, a).map_err(driver);
            (
                attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
                attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
            )
        };
        let ptx = compile(source, &format!("compute_{major}{minor}"))?;
        let ptx = CString::new(ptx).map_err(|e| KernelError::Driver(e.to_string()))?;
        // SAFETY: the primary context is retained for the process (never released, as
        // LibTorch keeps it); the PTX is a NUL-terminated image NVRTC made.
        let module = unsafe {
            let ctx = result::primary_ctx::retain(dev).map_err(driver)?;
            result::ctx::set_current(ctx).map_err(driver)?;
            result::module::load_data(ptx.as_ptr() as *const c_void).map_err(driver)?
        };
        let mut functions = HashMap::new();
        for name in source.kernels {
            // SAFETY: `module` was just loaded and is never unloaded.
            let f = unsafe { result::module::get_function(module, CString::new(*name).expect("no NUL")) };
            functions.insert(*name, f.map_err(driver)? as usize);
        }
        Ok(Loaded { functions })
    };
    std::panic::catch_unwind(attempt).unwrap_or_else(|p| Err(KernelError::Driver(super::nvrtc::panic_message(&p))))
}

/// Threads per block of every kernel (`kThreads` in fp8_device.cuh).
pub const THREADS: u32 = 256;

/// Most blocks of a grid-stride launch (enough to fill any current GPU several times over).
const MAX_BLOCKS: i64 = 65535;

/// CUDA's largest grid y and z (x may reach 2^31 - 1).
pub const MAX_GRID_YZ: i64 = 65535;

/// The grid of a grid-stride launch over `n` elements: one thread each, up to [`MAX_BLOCKS`]
/// blocks (fewer where the CPU emulation's tests ask, so that the stride loops run), at least
/// one.
pub fn grid_stride(n: i64) -> (u32, u32, u32) {
    let most = super::emulate::max_blocks().map_or(MAX_BLOCKS, i64::from);
    (ceil_div(n, i64::from(THREADS)).clamp(1, most.min(MAX_BLOCKS)) as u32, 1, 1)
}

/// `a / b` rounded up (`a` ≥ 0, `b` > 0).
pub fn ceil_div(a: i64, b: i64) -> i64 {
    (a + b - 1) / b
}

/// A kernel parameter: the address of its value, as `cuLaunchKernel` takes each.
pub fn arg<T>(value: &mut T) -> *mut c_void {
    value as *mut T as *mut c_void
}

/// The raw device address of a tensor's data (0 for none: the kernels read 0 as "not asked").
pub fn address(t: Option<&tch::Tensor>) -> u64 {
    t.map_or(0, |t| t.data_ptr() as u64)
}

/// Where a kernel launches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// A CUDA device, by index.
    Cuda(usize),
    /// The CPU, through the kernels' emulation ([`super::emulate`]; tests only).
    Emulated,
}

/// Launches `kernel` of `source` on `target`: on a CUDA device on the default stream, without
/// waiting for it; emulated on the CPU, to its end.
///
/// # Safety
/// `params` must match the kernel's signature in order and type, and every tensor they
/// address must be on the target's device, large enough for the grid, and alive until the
/// launch is enqueued (LibTorch's later ops on them are ordered after it on the same stream).
pub unsafe fn launch(
    source: &'static Source,
    target: Target,
    kernel: &'static str,
    grid: (u32, u32, u32),
    threads: u32,
    params: &mut [*mut c_void],
) -> Result<(), KernelError> {
    let index = match target {
        Target::Cuda(index) => index,
        // SAFETY: the caller's contract, the same as for a GPU.
        Target::Emulated => return unsafe { super::emulate::launch(kernel, grid, threads, params) },
    };
    let f = *loaded(source, index)?
        .functions
        .get(kernel)
        .ok_or_else(|| KernelError::Arguments { kernel, what: format!("no such kernel in {}", source.name) })?
        as sys::CUfunction;
    // SAFETY: the caller's contract above.
    unsafe { result::launch_kernel(f, grid, (threads, 1, 1), 0, std::ptr::null_mut(), params) }
        .map_err(|e| KernelError::Driver(format!("{kernel}: {e:?}")))
}

/// Where a kernel on `t` launches: its CUDA device; the emulation for a CPU tensor where a test
/// asked for it; `Ok(None)` for any other CPU tensor (nothing launches: the caller runs the
/// kernel's CPU stand-in, which it does only where the CPU stands in for CUDA); or why a
/// kernel cannot run on it.
pub fn target(t: &tch::Tensor, kernel: &'static str) -> Result<Option<Target>, KernelError> {
    match t.device() {
        tch::Device::Cuda(index) => Ok(Some(Target::Cuda(index))),
        tch::Device::Cpu => Ok(super::emulate::active().then_some(Target::Emulated)),
        other => Err(KernelError::Arguments { kernel, what: format!("tensors are on {other:?}: CUDA only") }),
    }
}
