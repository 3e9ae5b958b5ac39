//! Dropout's fused route: on a device taking the CUDA routes, a bf16 input's dropout is our
//! kernel (`kernels/dropout.cu`), which draws each element's mask bit from Philox inside the
//! pass that reads the input and writes the dropped input: one launch each way and no mask in
//! memory, where LibTorch's route runs `bernoulli_` (writing a byte mask) and then the product
//! (reading it). Backward runs the kernel again on the gradient with the same seed. Under
//! context parallelism the kernel takes each local element's index in the whole sequence, so a
//! rank draws its rows of one process's mask without drawing the rest (LibTorch's route draws
//! the whole mask and slices it). Its masks are Philox's, not `bernoulli_`'s: the same
//! distribution, other bits. Checked on first use against its stand-in (the host's Philox
//! mask, then LibTorch's product), logged either way; elsewhere LibTorch's route runs (status
//! on GPUs: docs/gpu.md).

use crate::context_parallel::ContextSplit;
use crate::kernels::dropout::{self as kernel, DropoutArgs, SplitRows};

use super::philox;

/// What the kernel's first-use check is called, in logs and in `llora selftest`.
pub const CHECK: &str = "dropout kernel (ours, NVRTC)";

crate::routes::declare_route! {
    /// The route: the verdict of [`check`] per device, and whether a dropout ran our kernel.
    pub static ROUTE: Verdicts<tch::Device> = &crate::routes::RouteSpec {
        name: CHECK,
        fallback: "dropout draws its mask with LibTorch's bernoulli_, then multiplies",
        order: 78,
        part: "dropout",
        self_tests: &[crate::routes::SelfTest {
            name: CHECK,
            check: checked_on,
            passed: "the kernel's dropout equals the host's Philox mask times the input bit for bit, split rows too",
        }],
        counts_uses: true,
    };
}

/// Whether dropout of `x` takes our kernel: bf16 on a device taking the CUDA routes with
/// `LLORA_CUDA_FUSED_ROUTES` on, the kernel checked there.
pub(crate) fn takes_kernel(x: &tch::Tensor) -> bool {
    let device = x.device();
    x.kind() == tch::Kind::BFloat16
        && crate::routes::takes_cuda_routes(device)
        && crate::routes::fused_routes()
        && ROUTE.passed(device, || check(device))
}

/// [`check`] on `device` once per process, its result kept (`llora selftest`).
pub fn checked_on(device: tch::Device) -> Result<(), String> {
    ROUTE.check(device, || check(device))
}

/// `x · keep / (1 − p)` with the Philox mask of `seed` (this rank's rows of the whole
/// sequence's under `split`), on the kernel where it launches, else its stand-in; a kernel
/// failure is logged and the stand-in runs. With `amax` (`[1]` f32, zero or a lower bound)
/// the output's amax is folded into it in the same pass.
///
/// # Shapes
/// - x: any; with a split `[.., split.local_len(), width]`; output: as x, contiguous
pub(crate) fn apply(
    x: &tch::Tensor,
    (seed, p): (u64, f64),
    split: Option<ContextSplit>,
    amax: Option<&tch::Tensor>,
) -> tch::Tensor {
    let x = x.contiguous();
    let y = x.empty_like();
    let args = DropoutArgs { x: &x, y: &y, seed, p, split: split.map(rows), amax };
    if x.kind() != tch::Kind::BFloat16 {
        // A gradient in another dtype: the same mask through LibTorch's product.
        stand_in(&args);
        return y;
    }
    match kernel::launch(&args) {
        Ok(true) => ROUTE.mark_used(),
        // A CPU tensor (standing in for CUDA): the stand-in is what the route runs there.
        Ok(false) => {
            stand_in(&args);
            ROUTE.mark_used();
        }
        Err(e) => {
            tracing::warn!("our dropout kernel failed, the same mask runs through LibTorch: {e}");
            stand_in(&args);
        }
    }
    y
}

/// The kernel's description of a context-parallel split.
fn rows(split: ContextSplit) -> SplitRows {
    let [first, second] = split.local_ranges();
    SplitRows { chunk: split.chunk() as i64, starts: [first.start as i64, second.start as i64], seq: split.seq as i64 }
}

/// What the kernel computes, with the mask drawn on the host (the CPU stand-in and the
/// check's reference): the keep-mask of [`keep_mask`] through LibTorch's
/// `native_dropout_backward` (`x · mask · scale`), and the amax folded in as LibTorch's max of
/// `|y|` (NaN where y holds one).
pub(crate) fn stand_in(a: &DropoutArgs<'_>) {
    let _no_grad = tch::no_grad_guard();
    let mask = keep_mask(a).to_device(a.x.device());
    let out = tch::Tensor::native_dropout_backward(a.x, &mask, 1.0 / (1.0 - a.p));
    a.y.shallow_clone().copy_(&out);
    if let Some(amax) = a.amax {
        let mine = crate::fp8::amax_on_device(&out.to_kind(tch::Kind::Float)).reshape([1]);
        amax.shallow_clone().copy_(&amax.maximum(&mine));
    }
}

/// The kernel's mask of `a.x`'s elements, drawn on the host: element i's word is word
/// g % 4 of Philox block g / 4, g its index in the whole sequence's mask (`dropout.cu`).
fn keep_mask(a: &DropoutArgs<'_>) -> tch::Tensor {
    let size = a.x.size();
    let n = a.x.numel();
    let (local, width, split) = match a.split {
        Some(s) => (2 * s.chunk as usize, *size.last().unwrap_or(&1) as usize, s),
        None => (1, n.max(1), SplitRows { chunk: 1, starts: [0, 0], seq: 1 }),
    };
    let (chunk, seq) = (split.chunk as usize, split.seq as usize);
    let threshold = a.threshold();
    let key = philox::key(a.seed);
    let mut keep = vec![true; n];
    let mut block: Option<(u64, [u32; 4])> = None;
    for (i, k) in keep.iter_mut().enumerate() {
        let (col, token) = (i % width, i / width);
        let (l, row) = (token % local, token / local);
        let gpos = if l < chunk { split.starts[0] as usize + l } else { split.starts[1] as usize + l - chunk };
        if gpos >= seq {
            continue;
        }
        let g = ((row * seq + gpos) * width + col) as u64;
        let counter = g >> 2;
        let words = match block {
            Some((c, w)) if c == counter => w,
            _ => {
                let w = philox::philox4x32_10(philox::block_counter(g), key);
                block = Some((counter, w));
                w
            }
        };
        *k = words[(g & 3) as usize] < threshold;
    }
    tch::Tensor::from_slice(&keep).view(&size[..])
}

/// Checks the kernel against its stand-in on `device`: bf16 x of `[2, 6, 10]` over ±40 with
/// zeros of both signs, p 0.3, a tensor's own mask (with its amax) and a context-parallel
/// rank's rows (rank 1 of 2 on an 11-token sequence: a padding row), bit for bit. Calls the
/// kernel and the reference directly, never the route (no verdict re-entered).
pub fn check(device: tch::Device) -> Result<(), String> {
    let _guard = tch::no_grad_guard();
    let v: Vec<f32> = (0..120).map(|i| ((i * 7919) % 4001) as f32 / 4001.0 * 80.0 - 40.0).collect();
    let x = tch::Tensor::from_slice(&v).to_kind(tch::Kind::BFloat16).to_device(device).view([2, 6, 10]);
    let _ = x.narrow(2, 0, 1).fill_(-0.0);
    let amax = |d| tch::Tensor::zeros([1], (tch::Kind::Float, d));
    for split in [None, Some(rows(ContextSplit::new(11, 1, 2)))] {
        let (got, want) = (x.empty_like(), x.empty_like());
        let (got_amax, want_amax) = (amax(device), amax(device));
        let amax_of = |t| split.is_none().then_some(t);
        let args = DropoutArgs { x: &x, y: &got, seed: 0x5eed_0123_4567_89ab, p: 0.3, split, amax: amax_of(&got_amax) };
        if !kernel::launch(&args).map_err(|e| e.to_string())? {
            // Nothing launches on this device: the stand-in is the route; compare it to itself.
            stand_in(&args);
        }
        stand_in(&DropoutArgs { y: &want, amax: amax_of(&want_amax), ..args });
        let bytes = crate::kernels::args::host_bytes;
        let same = bytes(&got) == bytes(&want) && bytes(&got_amax) == bytes(&want_amax);
        if !same {
            return Err(format!(
                "the dropout {} differs from the host's Philox mask",
                split.map_or("alone", |_| "of a split")
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
