//! The emulator's own checks.

use tch::{Kind, Tensor};

use crate::kernels::KernelError;

/// The emulator's own checks, on kernels written to break them (`emulation/checks.cu`): a
/// missing __syncthreads (a race on a shared tile), a shared index past its array (a block of
/// more threads than the kernel's per-warp partials hold), a __syncthreads only some threads
/// reach, and a launch past CUDA's limits each fail the launch, naming it; the correct kernel
/// passes.
#[test]
fn the_emulator_catches_races_bad_indices_and_bad_launches() {
    let launch = |kernel: &'static str, threads: u32, grid: (u32, u32, u32)| {
        let out = Tensor::zeros([4096], (Kind::Float, tch::Device::Cpu));
        let mut address = out.data_ptr() as u64;
        let mut p = [super::super::launch::arg(&mut address)];
        // SAFETY: each check kernel takes one float pointer to at least its grid's threads.
        unsafe { super::launch_waiting(kernel, grid, threads, &mut p, 300) }
    };
    assert_eq!(launch("llora_check_reverse_tile", 64, (2, 1, 1)), Ok(()));
    let err = |r: Result<(), KernelError>| format!("{:?}", r.expect_err("a failure"));
    assert!(err(launch("llora_check_reverse_tile_unsynced", 64, (1, 1, 1))).contains("race on __shared__"));
    assert!(
        err(launch("llora_check_per_warp_partials", 512, (1, 1, 1))).contains("__shared__ index 8 past an array of 8")
    );
    assert_eq!(launch("llora_check_per_warp_partials", 256, (1, 1, 1)), Ok(()));
    assert!(err(launch("llora_check_partial_sync", 64, (1, 1, 1))).contains("not every thread"));
    assert!(err(launch("llora_check_reverse_tile", 2048, (1, 1, 1))).contains("past CUDA's limits"));
    assert!(err(launch("llora_check_reverse_tile", 64, (1, 70000, 1))).contains("past CUDA's limits"));
    assert!(err(launch("llora_no_such_kernel", 64, (1, 1, 1))).contains("no such kernel"));
}
