//! Our CUDA kernels on the CPU, for the tests: every `.cu` beside this file, compiled by the
//! host's C++ compiler against `emulation/cuda_cpu.h` (model/build.rs), launched through the
//! same parameter arrays and grid and block sizes the launch code builds for a GPU
//! ([`super::launch::Target::Emulated`]). A block's threads run as OS threads; `__shared__`
//! arrays are checked (an index past the end, or a race between two barriers, fails the
//! launch). So the kernels' own code (indexing, tails, grid-stride loops, tiles, barriers, warp
//! shuffles, atomics, FP8 and bf16 rounding) runs in CI before a GPU runs it; what it cannot
//! show is in `emulation/cuda_cpu.h`. Nothing outside a test turns it on.

use std::cell::Cell;
use std::ffi::{CString, c_char, c_int, c_void};

use super::nvrtc::KernelError;

unsafe extern "C" {
    /// `emulation/emulate.cpp`: runs `kernel` over the grid; 0, or 1 with `error` written.
    fn llora_emu_launch(
        kernel: *const c_char,
        grid: *const u32,
        block: *const u32,
        params: *mut *mut c_void,
        patience_ms: u32,
        error: *mut c_char,
        error_len: usize,
    ) -> c_int;
}

/// How long an emulated launch waits at a barrier before failing as one that would hang a GPU.
const PATIENCE_MS: u32 = 20_000;

thread_local! {
    /// Whether CPU tensors launch the emulated kernels on this thread.
    static ACTIVE: Cell<bool> = const { Cell::new(false) };
    /// The most blocks a grid-stride launch takes on this thread (`None`: the GPU's).
    static MAX_BLOCKS: Cell<Option<u32>> = const { Cell::new(None) };
}

/// Whether kernels on CPU tensors launch emulated on this thread.
pub fn active() -> bool {
    ACTIVE.with(Cell::get)
}

/// The grid-stride launches' block limit set by [`with_emulation`], if any.
pub fn max_blocks() -> Option<u32> {
    ACTIVE.with(Cell::get).then(|| MAX_BLOCKS.with(Cell::get)).flatten()
}

#[cfg(test)]
mod golden;
#[cfg(test)]
mod tests;

/// Runs `f` with kernels on CPU tensors launched emulated (on this thread), grid-stride
/// launches taking at most `max_blocks` blocks when given (so that each thread's stride loop
/// runs more than once on a small problem).
#[cfg(test)]
pub fn with_emulation<T>(max_blocks: Option<u32>, f: impl FnOnce() -> T) -> T {
    let before = (ACTIVE.with(|a| a.replace(true)), MAX_BLOCKS.with(|m| m.replace(max_blocks)));
    let out = f();
    ACTIVE.with(|a| a.set(before.0));
    MAX_BLOCKS.with(|m| m.set(before.1));
    out
}

/// Runs `kernel` emulated on the CPU over `grid` blocks of `threads` threads, to its end.
///
/// # Safety
/// As [`super::launch::launch`]: `params` match the kernel's signature, and the tensors they
/// address are on the CPU and large enough for the grid.
pub unsafe fn launch(
    kernel: &'static str,
    grid: (u32, u32, u32),
    threads: u32,
    params: &mut [*mut c_void],
) -> Result<(), KernelError> {
    // SAFETY: the caller's contract.
    unsafe { launch_waiting(kernel, grid, threads, params, PATIENCE_MS) }
}

/// [`launch`] that gives up on a barrier after `patience_ms`.
///
/// # Safety
/// As [`launch`].
unsafe fn launch_waiting(
    kernel: &'static str,
    grid: (u32, u32, u32),
    threads: u32,
    params: &mut [*mut c_void],
    patience_ms: u32,
) -> Result<(), KernelError> {
    let name = CString::new(kernel).expect("kernel names have no NUL");
    let (grid, block) = ([grid.0, grid.1, grid.2], [threads, 1, 1]);
    let mut error = vec![0 as c_char; 512];
    // SAFETY: the caller's contract; the buffers live through the call, which does not keep them.
    let failed = unsafe {
        llora_emu_launch(
            name.as_ptr(),
            grid.as_ptr(),
            block.as_ptr(),
            params.as_mut_ptr(),
            patience_ms,
            error.as_mut_ptr(),
            error.len(),
        )
    };
    if failed == 0 {
        return Ok(());
    }
    // SAFETY: the launcher writes a NUL-terminated message within the buffer.
    let what = unsafe { std::ffi::CStr::from_ptr(error.as_ptr()) }.to_string_lossy().into_owned();
    Err(KernelError::Driver(format!("emulated launch: {what}")))
}
