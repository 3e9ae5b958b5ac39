//! Loading and launching our kernels on a CUDA device, shared by every kernel's launch code:
//! each [`Source`] is compiled for the device's own architecture (CUBIN; PTX for the driver to
//! compile where that fails, logged) and loaded once per device and process in the device's
//! primary context (LibTorch's); each launch makes that context current and runs on
//! LibTorch's current stream of the device, and in a first-use check waits for the kernel and
//! checks its error ([`with_checked_launches`]). The driver calls go through [`Driver`], so the
//! CPU tests run this sequence against a fake. CUDA-only (status on GPUs: docs/gpu.md).

use std::cell::Cell;
use std::collections::HashMap;
use std::ffi::{CString, c_char, c_void};
use std::sync::{Arc, Mutex};

use cudarc::driver::{result, sys};

use super::nvrtc::{Image, KernelError, Source, compile_image};

/// A source loaded on one device: the context it was loaded in, its functions by name, and
/// which image loaded.
struct Loaded {
    ctx: usize,
    functions: HashMap<&'static str, usize>,
    image: &'static str,
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
    match &made {
        Ok(l) => tracing::info!(device = index, source = source.name, image = l.image, "our kernels loaded"),
        Err(e) => tracing::warn!(
            device = index,
            source = source.name,
            "our kernels are off on this device (the LibTorch routes run): {e}"
        ),
    }
    let mut table = LOADED.lock().unwrap_or_else(|e| e.into_inner());
    table.get_or_insert_default().entry(key).or_insert(made).clone()
}

/// The first image of `source` that compiles and loads for a device of compute capability
/// `(major, minor)`: CUBIN for its own architecture (`sm_XY`: no JIT), else PTX for the driver
/// to compile (`compute_XY`; a driver older than NVRTC's PTX version cannot, and then the
/// kernels are off). Each failure is logged; both failing is an error naming both.
pub fn load_first<M>(
    source: &str,
    (major, minor): (i32, i32),
    compile: impl Fn(&str) -> Result<Image, KernelError>,
    load: impl Fn(&Image) -> Result<M, KernelError>,
) -> Result<(M, &'static str), KernelError> {
    let mut failures = Vec::new();
    for (arch, kind) in [(format!("sm_{major}{minor}"), "cubin"), (format!("compute_{major}{minor}"), "ptx")] {
        match compile(&arch).and_then(|image| load(&image)) {
            Ok(module) => return Ok((module, kind)),
            Err(e) => {
                tracing::warn!(source, arch, "our kernels: the {kind} image did not load: {e}");
                failures.push(format!("{kind} ({arch}): {e}"));
            }
        }
    }
    Err(KernelError::Driver(format!("{source}: no image loaded: {}", failures.join("; "))))
}

/// Compiles `source` for device `index` and loads it in the device's primary context (retained
/// for the process, as LibTorch keeps it), made current on this thread.
fn load(source: &'static Source, index: usize) -> Result<Loaded, KernelError> {
    let driver = |e: cudarc::driver::DriverError| KernelError::Driver(format!("{e:?}"));
    let attempt = || -> Result<Loaded, KernelError> {
        result::init().map_err(driver)?;
        let dev = result::device::get(index as i32).map_err(driver)?;
        // SAFETY: a valid device handle; attributes are plain integers.
        let capability = unsafe {
            let attr = |a| result::device::get_attribute(dev, a).map_err(driver);
            (
                attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
                attr(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?,
            )
        };
        // SAFETY: retaining the primary context of a valid device.
        let ctx = unsafe { result::primary_ctx::retain(dev) }.map_err(driver)?;
        // SAFETY: the context was just retained and is never released.
        unsafe { result::ctx::set_current(ctx) }.map_err(driver)?;
        let load_image = |image: &Image| -> Result<sys::CUmodule, KernelError> {
            let bytes: Vec<u8> = match image {
                Image::Cubin(b) => b.clone(),
                Image::Ptx(p) => {
                    CString::new(p.as_str()).map_err(|e| KernelError::Driver(e.to_string()))?.into_bytes_with_nul()
                }
            };
            // SAFETY: a CUBIN image or a NUL-terminated PTX text NVRTC made, loaded in the
            // current context; the driver copies it.
            unsafe { result::module::load_data(bytes.as_ptr() as *const c_void) }.map_err(driver)
        };
        let (module, image) = load_first(source.name, capability, |arch| compile_image(source, arch), load_image)?;
        let mut functions = HashMap::new();
        for name in source.kernels {
            // SAFETY: `module` was just loaded and is never unloaded.
            let f = unsafe { result::module::get_function(module, CString::new(*name).expect("no NUL")) };
            functions.insert(*name, f.map_err(driver)? as usize);
        }
        Ok(Loaded { ctx: ctx as usize, functions, image })
    };
    std::panic::catch_unwind(attempt).unwrap_or_else(|p| Err(KernelError::Driver(super::nvrtc::panic_message(&p))))
}

/// The driver calls a launch makes (the CUDA driver's, or a test's fake).
pub trait Driver {
    /// Makes context `ctx` current on this thread.
    fn make_current(&self, ctx: usize) -> Result<(), KernelError>;
    /// LibTorch's current stream of device `index`.
    fn current_stream(&self, index: usize) -> Result<usize, String>;
    /// Enqueues kernel `f` on `stream`.
    ///
    /// # Safety
    /// As [`launch`].
    unsafe fn launch(
        &self,
        f: usize,
        grid: (u32, u32, u32),
        threads: u32,
        stream: usize,
        params: &mut [*mut c_void],
    ) -> Result<(), KernelError>;
    /// Waits for `stream`'s work; the error of a kernel that faulted.
    fn synchronize(&self, stream: usize) -> Result<(), KernelError>;
}

/// The CUDA driver (cudarc) and LibTorch's streams (`stream_shim.cpp`).
struct Cuda;

unsafe extern "C" {
    /// `stream_shim.cpp`: device `device`'s current stream; 0, or 1 with `error` written.
    fn llora_current_cuda_stream(device: i32, stream: *mut *mut c_void, error: *mut c_char, len: usize) -> i32;
}

impl Driver for Cuda {
    fn make_current(&self, ctx: usize) -> Result<(), KernelError> {
        // SAFETY: a primary context retained by `load` and never released.
        unsafe { result::ctx::set_current(ctx as sys::CUcontext) }.map_err(|e| KernelError::Driver(format!("{e:?}")))
    }

    fn current_stream(&self, index: usize) -> Result<usize, String> {
        let (mut stream, mut error) = (std::ptr::null_mut(), vec![0 as c_char; 256]);
        // SAFETY: the shim writes a pointer and a NUL-terminated message within the buffers.
        let failed = unsafe { llora_current_cuda_stream(index as i32, &mut stream, error.as_mut_ptr(), error.len()) };
        if failed == 0 {
            return Ok(stream as usize);
        }
        // SAFETY: NUL-terminated by the shim.
        Err(unsafe { std::ffi::CStr::from_ptr(error.as_ptr()) }.to_string_lossy().into_owned())
    }

    unsafe fn launch(
        &self,
        f: usize,
        grid: (u32, u32, u32),
        threads: u32,
        stream: usize,
        params: &mut [*mut c_void],
    ) -> Result<(), KernelError> {
        // SAFETY: the caller's contract ([`launch`]).
        unsafe {
            result::launch_kernel(f as sys::CUfunction, grid, (threads, 1, 1), 0, stream as sys::CUstream, params)
        }
        .map_err(|e| KernelError::Driver(format!("{e:?}")))
    }

    fn synchronize(&self, stream: usize) -> Result<(), KernelError> {
        // SAFETY: a stream of the current context (LibTorch's, or 0: the default stream).
        unsafe { result::stream::synchronize(stream as sys::CUstream) }
            .map_err(|e| KernelError::Driver(format!("the kernel faulted: {e:?}")))
    }
}

thread_local! {
    /// Whether launches on this thread wait for their kernel and check its error.
    static CHECKED: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` with every launch on this thread waited for and its error checked (a first-use
/// check's: a fault is then that check's failure, not a later op's).
pub fn with_checked_launches<T>(f: impl FnOnce() -> T) -> T {
    let before = CHECKED.with(|c| c.replace(true));
    let out = f();
    CHECKED.with(|c| c.set(before));
    out
}

/// One launch through `driver`: the kernel's context made current, LibTorch's current stream
/// (the default stream where it cannot be read, logged), then, in a checked launch, a wait
/// and the kernel's error.
///
/// # Safety
/// As [`launch`].
unsafe fn launch_with(
    driver: &dyn Driver,
    (ctx, f): (usize, usize),
    index: usize,
    grid: (u32, u32, u32),
    threads: u32,
    params: &mut [*mut c_void],
) -> Result<(), KernelError> {
    driver.make_current(ctx)?;
    let stream = driver.current_stream(index).unwrap_or_else(|e| {
        tracing::warn!(device = index, "our kernels: LibTorch's current stream unknown ({e}): the default stream");
        0
    });
    // SAFETY: the caller's contract.
    unsafe { driver.launch(f, grid, threads, stream, params)? };
    if CHECKED.with(Cell::get) {
        driver.synchronize(stream)?;
    }
    Ok(())
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

/// Launches `kernel` of `source` on `target`: on a CUDA device on LibTorch's current stream,
/// without waiting for it (but in [`with_checked_launches`]); emulated on the CPU, to its end.
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
    let module = loaded(source, index)?;
    let f = *module
        .functions
        .get(kernel)
        .ok_or_else(|| KernelError::Arguments { kernel, what: format!("no such kernel in {}", source.name) })?;
    // SAFETY: the caller's contract above.
    unsafe { launch_with(&Cuda, (module.ctx, f), index, grid, threads, params) }
        .map_err(|e| KernelError::Driver(format!("{kernel}: {e}")))
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    /// CUBIN first; where it fails to compile or load, PTX, each failure named; both failing is
    /// one error naming both.
    #[test]
    fn a_device_loads_cubin_then_ptx() {
        let compile = |arch: &str| {
            Ok(if arch.starts_with("sm_") { Image::Cubin(arch.as_bytes().to_vec()) } else { Image::Ptx(arch.into()) })
        };
        let cubin_loads = |image: &Image| Ok(format!("{image:?}"));
        assert_eq!(load_first("k.cu", (9, 0), compile, cubin_loads).unwrap().1, "cubin");
        let no_cubin = |image: &Image| match image {
            Image::Cubin(_) => Err(KernelError::Driver("CUDA_ERROR_NO_BINARY_FOR_GPU".into())),
            Image::Ptx(p) => Ok(p.clone()),
        };
        assert_eq!(load_first("k.cu", (10, 0), compile, no_cubin).unwrap(), ("compute_100".to_string(), "ptx"));
        let old_driver = |image: &Image| -> Result<String, KernelError> {
            Err(KernelError::Driver(format!(
                "{} refused",
                if matches!(image, Image::Cubin(_)) { "cubin" } else { "ptx" }
            )))
        };
        let err = load_first("k.cu", (9, 0), compile, old_driver).unwrap_err().to_string();
        assert!(err.contains("cubin (sm_90): CUDA driver: cubin refused") && err.contains("ptx (compute_90)"), "{err}");
        let nvrtc_refuses_sm = |arch: &str| {
            if arch.starts_with("sm_") {
                Err(KernelError::Compile { file: "k.cu", arch: arch.into(), log: "no sm".into() })
            } else {
                Ok(Image::Ptx(arch.into()))
            }
        };
        assert_eq!(load_first("k.cu", (9, 0), nvrtc_refuses_sm, cubin_loads).unwrap().1, "ptx");
    }

    /// A driver that records its calls, and can fail one.
    #[derive(Default)]
    struct Fake {
        calls: RefCell<Vec<String>>,
        stream: Option<usize>,
        fault: bool,
    }

    impl Driver for Fake {
        fn make_current(&self, ctx: usize) -> Result<(), KernelError> {
            self.calls.borrow_mut().push(format!("current {ctx}"));
            Ok(())
        }
        fn current_stream(&self, index: usize) -> Result<usize, String> {
            self.calls.borrow_mut().push(format!("stream of {index}"));
            self.stream.ok_or_else(|| "no CUDA GPUs are available".to_string())
        }
        unsafe fn launch(
            &self,
            f: usize,
            grid: (u32, u32, u32),
            threads: u32,
            stream: usize,
            params: &mut [*mut c_void],
        ) -> Result<(), KernelError> {
            self.calls.borrow_mut().push(format!("launch {f} {grid:?} x {threads} on {stream} with {}", params.len()));
            Ok(())
        }
        fn synchronize(&self, stream: usize) -> Result<(), KernelError> {
            self.calls.borrow_mut().push(format!("synchronize {stream}"));
            if self.fault {
                Err(KernelError::Driver("the kernel faulted: CUDA_ERROR_ILLEGAL_ADDRESS".into()))
            } else {
                Ok(())
            }
        }
    }

    /// A launch makes the kernel's context current, takes LibTorch's current stream of its
    /// device (the default stream, 0, where that cannot be read), and only in a checked launch
    /// (a first-use check's) waits for the kernel, its fault then the launch's error.
    #[test]
    fn a_launch_makes_its_context_current_takes_torchs_stream_and_checks_when_asked() {
        let run = |fake: &Fake| {
            let mut x = 0u64;
            // SAFETY: the fake driver reads nothing.
            unsafe { launch_with(fake, (7, 99), 1, (3, 1, 1), 256, &mut [arg(&mut x)]) }
        };
        let fake = Fake { stream: Some(42), ..Fake::default() };
        run(&fake).unwrap();
        assert_eq!(*fake.calls.borrow(), ["current 7", "stream of 1", "launch 99 (3, 1, 1) x 256 on 42 with 1"]);
        let fake = Fake { stream: None, fault: true, ..Fake::default() };
        run(&fake).unwrap();
        assert_eq!(fake.calls.borrow()[2], "launch 99 (3, 1, 1) x 256 on 0 with 1", "the default stream");
        let err = with_checked_launches(|| run(&fake)).unwrap_err().to_string();
        assert!(err.contains("ILLEGAL_ADDRESS"), "{err}");
        assert_eq!(fake.calls.borrow().last().unwrap(), "synchronize 0");
        assert!(!CHECKED.with(Cell::get), "checked launches end with their scope");
    }

    /// On a machine without a GPU the stream shim answers with an error, not a crash.
    #[test]
    fn the_stream_shim_reports_a_missing_gpu() {
        if tch::Cuda::is_available() {
            return;
        }
        assert!(Cuda.current_stream(0).is_err());
    }
}
