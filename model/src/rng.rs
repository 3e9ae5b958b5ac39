//! LibTorch's default CPU generator, kept where it was across a first-use check
//! ([`keeping_cpu_generator`]; the state taken and put back by `rng_shim.cpp`, as tch binds
//! neither call). The dropout masks' seeds are drawn from that generator, one per mask, after
//! each block reseeds it; a check that draws from it (random test inputs) in the middle of a
//! block would move every later seed of that block. Checks run at a route's first use: in
//! the first step of a run, and again in the first step after a resume, so without this a
//! resumed run's first step would drop other elements than the uninterrupted run's.

use std::ffi::{c_char, c_void};

unsafe extern "C" {
    fn llora_cpu_rng_get_state(err: *mut *mut c_char) -> *mut c_void;
    fn llora_cpu_rng_set_state(state: *mut c_void, err: *mut *mut c_char) -> bool;
    fn llora_cpu_rng_free(state: *mut c_void);
    fn llora_rng_error_free(s: *mut c_char);
}

/// The shim's error message, freed.
///
/// # Safety
/// `err` is NULL or a message the shim allocated, not used afterwards.
unsafe fn take_error(err: *mut c_char) -> String {
    if err.is_null() {
        return "no message".into();
    }
    // SAFETY: the caller's contract: a NUL-terminated string the shim malloc'd.
    let text = unsafe { std::ffi::CStr::from_ptr(err) }.to_string_lossy().into_owned();
    // SAFETY: as above; freed once, by the shim's own free.
    unsafe { llora_rng_error_free(err) };
    text
}

/// Runs `f` and puts LibTorch's CPU generator back where it was before, also when `f`
/// unwinds. A state that cannot be taken or put back is logged, and `f` still runs.
pub(crate) fn keeping_cpu_generator<T>(f: impl FnOnce() -> T) -> T {
    let mut err = std::ptr::null_mut();
    // SAFETY: the shim writes a state or NULL and, on NULL, an error message.
    let state = unsafe { llora_cpu_rng_get_state(&mut err) };
    if state.is_null() {
        // SAFETY: the message the shim just wrote.
        tracing::warn!("the CPU generator's state could not be taken: {}", unsafe { take_error(err) });
        return f();
    }
    let _restore = Restore(state);
    f()
}

/// Puts a taken state back when dropped, then frees it.
struct Restore(*mut c_void);

impl Drop for Restore {
    fn drop(&mut self) {
        let mut err = std::ptr::null_mut();
        // SAFETY: a state the shim returned, put back and freed once, here.
        unsafe {
            if !llora_cpu_rng_set_state(self.0, &mut err) {
                tracing::warn!("the CPU generator's state could not be put back: {}", take_error(err));
            }
            llora_cpu_rng_free(self.0);
        }
    }
}

#[cfg(test)]
mod tests {
    /// Draws inside the scope (and inside one that panics) leave the generator where it was:
    /// the draw after them is the draw a run without them makes.
    #[test]
    fn the_generator_is_where_it_was_after_the_scope() {
        let _rng = crate::device::torch_rng_lock();
        let draw = || tch::Tensor::randn([4], (tch::Kind::Float, tch::Device::Cpu));
        tch::manual_seed(5);
        let without = draw();
        tch::manual_seed(5);
        let _ = super::keeping_cpu_generator(draw);
        let panicked = std::panic::catch_unwind(|| {
            super::keeping_cpu_generator(|| {
                let _ = draw();
                panic!("a check that panics")
            })
        });
        assert!(panicked.is_err());
        assert!(draw().equal(&without), "the draws inside moved the generator");
        tch::manual_seed(5);
        let _ = draw();
        assert!(!draw().equal(&without), "a draw outside moves it");
    }
}
