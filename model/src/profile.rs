//! What a step costs besides its arithmetic, measured with LibTorch's own instruments
//! (`profile_shim.cpp`): a Kineto trace of the ops and CUDA kernels (the file torch.profiler
//! writes, for chrome://tracing or Perfetto), the number of ops dispatched and of host-device
//! synchronisations, and the CUDA caching allocator's peaks.
//!
//! Why count on the CPU: on a GPU a step is fast only if the host keeps queueing kernels ahead
//! of the device. Every value the host reads back (a loss, a norm, an amax) makes it wait for
//! the device to drain, and every op is a launch of a few microseconds: both can be counted on
//! any device, so CI catches a new per-layer readback or a cast storm without a GPU.
//!
//! A host-device synchronisation is counted where the host reads tensor data: LibTorch's scalar
//! reads (`aten::_local_scalar_dense`: `item()`, tch's `double_value`), seen by the op observer,
//! plus llora's own bulk reads, which go through [`to_host`] (Burn's `into_data` copies through
//! no op the observer sees).

use std::cell::Cell;
use std::ffi::{CStr, CString, c_char, c_int};
use std::path::Path;
use std::sync::Mutex;

use burn::tensor::{Tensor, TensorData};

unsafe extern "C" {
    fn llora_profile_free(s: *mut c_char);
    fn llora_trace_start(cuda: c_int, err: *mut *mut c_char) -> c_int;
    fn llora_trace_stop(path: *const c_char, err: *mut *mut c_char) -> c_int;
    fn llora_count_start(err: *mut *mut c_char) -> c_int;
    fn llora_count_stop(ops: *mut i64, scalar_reads: *mut i64);
    fn llora_device_memory(
        device: c_int,
        reset: c_int,
        peak_allocated: *mut i64,
        peak_reserved: *mut i64,
        err: *mut *mut c_char,
    ) -> c_int;
    fn llora_set_device(device: c_int, err: *mut *mut c_char) -> c_int;
}

/// A C shim's (status, message) as a Result: `ok != 0` is success; otherwise `err` is the
/// shim's malloc'd message (or null), released with the shim's own `free`. The shims of
/// llora-model and llora-trainer (c10d) share this convention.
///
/// # Safety
/// `err` is null or a NUL-terminated string that `free` releases, not used after this call.
pub unsafe fn shim_status(
    ok: c_int,
    err: *mut c_char,
    what: &str,
    free: unsafe extern "C" fn(*mut c_char),
) -> Result<(), String> {
    if ok != 0 {
        return Ok(());
    }
    if err.is_null() {
        return Err(format!("{what} failed without a message"));
    }
    // SAFETY: the shim wrote a NUL-terminated malloc'd string, freed once here by its owner.
    let msg = unsafe { CStr::from_ptr(err) }.to_string_lossy().into_owned();
    unsafe { free(err) };
    Err(msg)
}

/// This shim's (status, message) as a Result.
fn check(ok: c_int, err: *mut c_char) -> Result<(), String> {
    // SAFETY: `err` comes from this shim, which mallocs it for llora_profile_free.
    unsafe { shim_status(ok, err, "LibTorch", llora_profile_free) }
}

/// One trace at a time: Kineto has one profiler per process.
static TRACING: Mutex<bool> = Mutex::new(false);

/// A running Kineto trace of this thread's ops (and, with `cuda`, the device's kernels).
pub struct Trace {
    _private: (),
}

impl Trace {
    /// Starts the profiler; an error when it cannot (another trace runs, no Kineto).
    pub fn start(cuda: bool) -> Result<Self, String> {
        let mut running = TRACING.lock().unwrap_or_else(|e| e.into_inner());
        if *running {
            return Err("a trace is already running in this process".into());
        }
        let mut err = std::ptr::null_mut();
        // SAFETY: plain call; err receives a malloc'd message on failure.
        check(unsafe { llora_trace_start(c_int::from(cuda), &mut err) }, err)?;
        *running = true;
        Ok(Self { _private: () })
    }

    /// Stops the profiler and writes the Chrome trace JSON to `path`.
    pub fn finish(self, path: &Path) -> Result<(), String> {
        let c = CString::new(path.to_string_lossy().as_bytes())
            .map_err(|_| format!("{}: a trace path cannot hold a NUL byte", path.display()))?;
        let mut err = std::ptr::null_mut();
        // SAFETY: a valid C string; err receives a malloc'd message on failure.
        let r = check(unsafe { llora_trace_stop(c.as_ptr(), &mut err) }, err);
        *TRACING.lock().unwrap_or_else(|e| e.into_inner()) = false;
        r.map_err(|e| format!("cannot write the trace {}: {e}", path.display()))
    }
}

thread_local! {
    /// This thread's reads through [`to_host`] since its counting started, and whether it counts
    /// (per thread, as the op observer counts: see `profile_shim.cpp`).
    static HOST_READS: Cell<u64> = const { Cell::new(0) };
    static COUNTING: Cell<bool> = const { Cell::new(false) };
}

/// Ops dispatched and host-device synchronisations over a stretch of work.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counts {
    /// LibTorch ops dispatched (every op the dispatcher ran, nested ones included).
    pub ops: u64,
    /// Host-device synchronisations: scalar reads plus [`to_host`] reads.
    pub host_syncs: u64,
}

/// Counting of the calling thread's ops and synchronisations (the thread that runs the step).
pub struct Counter {
    /// Counts belong to the thread that started them.
    _not_send: std::marker::PhantomData<*const ()>,
}

impl Counter {
    /// Starts counting from zero (installs LibTorch's op observer on first use).
    pub fn start() -> Result<Self, String> {
        let mut err = std::ptr::null_mut();
        // SAFETY: plain call; err receives a malloc'd message on failure.
        check(unsafe { llora_count_start(&mut err) }, err)?;
        HOST_READS.set(0);
        COUNTING.set(true);
        Ok(Self { _not_send: std::marker::PhantomData })
    }

    /// Stops counting; what was counted since [`Counter::start`].
    pub fn finish(self) -> Counts {
        let (mut ops, mut scalar_reads) = (0i64, 0i64);
        // SAFETY: two valid out-pointers.
        unsafe { llora_count_stop(&mut ops, &mut scalar_reads) };
        COUNTING.set(false);
        let reads = HOST_READS.get();
        Counts { ops: ops.max(0) as u64, host_syncs: scalar_reads.max(0) as u64 + reads }
    }
}

/// A tensor's values on the host: the one door through which llora's step code reads Burn
/// tensor data in bulk, so that each read is counted as a host-device synchronisation.
pub fn to_host<const D: usize, K: burn::tensor::kind::Basic>(t: Tensor<D, K>) -> TensorData {
    count_host_read();
    t.into_data()
}

/// Counts one host read of device data made outside [`to_host`] (a LibTorch tensor copied to
/// the CPU by llora's own code).
pub fn count_host_read() {
    if COUNTING.get() {
        HOST_READS.set(HOST_READS.get() + 1);
    }
}

/// The CUDA caching allocator's peaks on device `index` since the last [`reset_device_peaks`]:
/// (allocated by tensors, reserved from the driver), in bytes.
pub fn device_peaks(index: usize) -> Result<(u64, u64), String> {
    let (mut allocated, mut reserved, mut err) = (0i64, 0i64, std::ptr::null_mut());
    // SAFETY: valid out-pointers; err receives a malloc'd message on failure.
    check(unsafe { llora_device_memory(index as c_int, 0, &mut allocated, &mut reserved, &mut err) }, err)?;
    Ok((allocated.max(0) as u64, reserved.max(0) as u64))
}

/// Restarts the caching allocator's peak statistics on device `index`.
pub fn reset_device_peaks(index: usize) -> Result<(), String> {
    let (mut a, mut r, mut err) = (0i64, 0i64, std::ptr::null_mut());
    // SAFETY: valid out-pointers; err receives a malloc'd message on failure.
    check(unsafe { llora_device_memory(index as c_int, 1, &mut a, &mut r, &mut err) }, err)
}

/// Makes CUDA device `index` this thread's current device (kernels that take no tensor, cuBLAS
/// handles and NCCL communicators then live there, not on device 0).
pub fn set_current_device(index: usize) -> Result<(), String> {
    let mut err = std::ptr::null_mut();
    // SAFETY: plain call; err receives a malloc'd message on failure.
    check(unsafe { llora_set_device(index as c_int, &mut err) }, err)
        .map_err(|e| format!("cannot make cuda:{index} the current device: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::tensor::Device;

    /// Counts against hand-counted work: an item read is one sync, a `to_host` read is one, and
    /// a chain of n elementwise ops dispatches at least n ops.
    #[test]
    fn counts_scalar_reads_host_reads_and_ops() {
        let t = tch::Tensor::from_slice(&[1.0f32, 2.0, 3.0]);
        let c = Counter::start().unwrap();
        let mut x = t.shallow_clone();
        for _ in 0..10 {
            x = &x + 1.0;
        }
        let quiet = c.finish();
        assert_eq!(quiet.host_syncs, 0, "{quiet:?}");
        assert!(quiet.ops >= 10, "{quiet:?}");
        let c = Counter::start().unwrap();
        let s = x.sum(tch::Kind::Float).double_value(&[]);
        let burn = Tensor::<1>::from_floats([1.0, 2.0], &Device::libtorch());
        let v = to_host(burn).to_vec::<f32>().unwrap();
        let counted = c.finish();
        assert_eq!((s, v), (36.0, vec![1.0, 2.0]));
        assert_eq!(counted.host_syncs, 2, "{counted:?}");
        // Not counting: reads are free again.
        let _ = to_host(Tensor::<1>::from_floats([1.0], &Device::libtorch()));
        assert_eq!(HOST_READS.get(), 1);
    }

    /// A trace of a few ops is a Chrome trace JSON naming them.
    #[test]
    fn trace_writes_a_chrome_trace() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("trace.json");
        let trace = Trace::start(false).unwrap();
        assert!(Trace::start(false).is_err(), "one trace at a time");
        let a = tch::Tensor::ones([64, 64], (tch::Kind::Float, tch::Device::Cpu));
        let _ = a.matmul(&a).sum(tch::Kind::Float);
        trace.finish(&path).unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        let json: serde_json::Value = serde_json::from_str(&text).unwrap();
        let names: Vec<&str> =
            json["traceEvents"].as_array().unwrap().iter().filter_map(|e| e["name"].as_str()).collect();
        assert!(names.contains(&"aten::matmul") || names.contains(&"aten::mm"), "{names:?}");
    }

    /// Without a GPU, the allocator statistics and device selection say why they cannot work.
    #[test]
    fn device_statistics_without_a_gpu_are_errors() {
        if tch::Cuda::is_available() {
            eprintln!("SKIPPED: a CUDA device is present (the GPU path runs in selftest)");
            return;
        }
        assert!(device_peaks(0).is_err());
        assert!(set_current_device(0).is_err());
    }
}
