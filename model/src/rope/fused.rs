//! RoPE's fused route: on a device taking the CUDA routes, bf16 q and k are rotated by our
//! kernel (`kernels/rope.cu`) in one pass each way, where the composite of
//! [`super::apply_rope`] runs six elementwise ops forward (two halves, a negation, a cat, two
//! products and a sum) and as many backward. The kernel rounds each product and sum to bf16 as
//! those ops do, so it equals them bit for bit (the backward up to the sign of a zero: autodiff
//! adds the halves' zero padding). Checked on first use against the LibTorch route (logged
//! either way); elsewhere the composite runs (status on GPUs: docs/gpu.md).

use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::backend::libtorch::TchTensor;
use burn::backend::tensor::FloatTensor;
use burn::backend::{Autodiff, Backend, Dispatch, LibTorch, backend_extension};
use burn::tensor::Tensor;

use crate::kernels::rope::{self, Direction, RopeArgs};

/// What the kernel's first-use check is called, in logs and in `llora selftest`.
pub const CHECK: &str = "RoPE kernel (ours, NVRTC)";

crate::routes::declare_route! {
    /// The route: the verdict of [`check`] per device, and whether a forward ran our kernel.
    pub static ROUTE: Verdicts<tch::Device> = &crate::routes::RouteSpec {
        name: CHECK,
        fallback: "RoPE runs as LibTorch's elementwise ops",
        order: 75,
        part: "rope",
        self_tests: &[crate::routes::SelfTest {
            name: CHECK,
            check: checked_on,
            passed: "the rotation and its gradient equal the LibTorch route's bit for bit",
        }],
        counts_uses: true,
    };
}

/// Whether RoPE of `x` takes our kernel: bf16 on a LibTorch device taking the CUDA routes with
/// `LLORA_CUDA_FUSED_ROUTES` on, the kernel checked there.
pub fn takes_kernel(x: &Tensor<4>) -> bool {
    let Some(device) = crate::precision::tch_device(&x.device()) else { return false };
    x.dtype() == burn::tensor::DType::BF16
        && crate::routes::takes_cuda_routes(device)
        && crate::routes::fused_routes()
        && ROUTE.passed(device, || check(device))
}

/// [`check`] on `device` once per process, its result kept (`llora selftest`).
pub fn checked_on(device: tch::Device) -> Result<(), String> {
    ROUTE.check(device, || check(device))
}

/// RoPE of `x` on the fused route (see the module doc), tracked by autodiff.
///
/// # Shapes
/// - x: `[batch, heads, seq, head_dim]`, bf16
/// - cos, sin: `[1 or batch, 1, seq, head_dim]`, bf16
/// - output: as x (the same layout)
pub fn rope(x: Tensor<4>, cos: Tensor<4>, sin: Tensor<4>) -> Tensor<4> {
    // The kernel's layout is tokens-first: [b, s, h, hd] (q and k are views of that already).
    let x = x.swap_dims(1, 2);
    let (cos, sin) = (cos.swap_dims(1, 2), sin.swap_dims(1, 2));
    let y = <Dispatch as RopeBackend>::rope(x.into_dispatch(), cos.into_dispatch(), sin.into_dispatch());
    Tensor::<4>::from_dispatch(y).swap_dims(1, 2)
}

/// Backend extension: the fused rotation.
#[backend_extension(Autodiff, LibTorch)]
pub trait RopeBackend: Backend {
    /// See [`rope`] (tokens-first layout: x `[b, s, h, hd]`, tables `[tb, s, 1, hd]`).
    fn rope(x: FloatTensor<Self>, cos: FloatTensor<Self>, sin: FloatTensor<Self>) -> FloatTensor<Self>;
}

/// One rotation of `x` (tokens-first) by the tables, on the kernel where it launches, else its
/// stand-in; a kernel failure is logged and the stand-in runs.
///
/// # Shapes
/// - x: `[b, s, h, hd]` bf16; cos, sin: `[tb, s, 1, hd]` bf16; output: as x, contiguous
fn rotate(x: &tch::Tensor, cos: &tch::Tensor, sin: &tch::Tensor, direction: Direction) -> tch::Tensor {
    let (x, cos, sin) = (x.contiguous(), cos.contiguous(), sin.contiguous());
    let y = x.empty_like();
    let args = RopeArgs { x: &x, cos: &cos, sin: &sin, y: &y, direction };
    match rope::launch(&args) {
        Ok(true) => ROUTE.mark_used(),
        // A CPU tensor (standing in for CUDA): the stand-in is what the route runs there.
        Ok(false) => {
            stand_in(&args);
            ROUTE.mark_used();
        }
        Err(e) => {
            tracing::warn!("our RoPE kernel failed, LibTorch's ops run: {e}");
            stand_in(&args);
        }
    }
    y
}

/// What the kernel computes, in LibTorch's bf16 ops (the CPU stand-in and the check's
/// reference): forward `x·cos + cat(−x₂, x₁)·sin`, backward `g·cos + cat((g·sin)₂, −(g·sin)₁)`.
pub(crate) fn stand_in(a: &RopeArgs<'_>) {
    let half = a.x.size()[3] / 2;
    let halves = |t: &tch::Tensor| (t.narrow(3, 0, half), t.narrow(3, half, half));
    let out = match a.direction {
        Direction::Forward => {
            let (x1, x2) = halves(a.x);
            a.x * a.cos + tch::Tensor::cat(&[-x2, x1], 3) * a.sin
        }
        Direction::Backward => {
            let (t1, t2) = halves(&(a.x * a.sin));
            a.x * a.cos + tch::Tensor::cat(&[t2, -t1], 3)
        }
    };
    a.y.shallow_clone().copy_(&out);
}

impl RopeBackend for LibTorch {
    fn rope(x: TchTensor, cos: TchTensor, sin: TchTensor) -> TchTensor {
        TchTensor::new(rotate(&x.tensor, &cos.tensor, &sin.tensor, Direction::Forward))
    }
}

/// Autodiff node of the rotation: it keeps the tables (shared with the model's cache), not x.
#[derive(Debug)]
struct RopeBackward;

impl Backward<LibTorch, 1> for RopeBackward {
    type State = (TchTensor, TchTensor);

    fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _checkpointer: &mut Checkpointer) {
        let [node] = ops.parents;
        let grad = grads.consume::<LibTorch>(&ops.node);
        if let Some(node) = node {
            let (cos, sin) = &ops.state;
            let dx = rotate(&grad.tensor, &cos.tensor, &sin.tensor, Direction::Backward);
            grads.register::<LibTorch>(node.id, TchTensor::new(dx));
        }
    }
}

impl<C: CheckpointStrategy> RopeBackend for Autodiff<LibTorch, C> {
    fn rope(x: FloatTensor<Self>, cos: FloatTensor<Self>, sin: FloatTensor<Self>) -> FloatTensor<Self> {
        // The tables are constants (the model's cache): untracked.
        let (cos, sin) = (cos.into_primitive(), sin.into_primitive());
        match RopeBackward.prepare::<C>([x.node()]).compute_bound().stateful() {
            OpsKind::Tracked(prep) => {
                let y = rotate(&x.into_primitive().tensor, &cos.tensor, &sin.tensor, Direction::Forward);
                prep.finish((cos, sin), TchTensor::new(y))
            }
            OpsKind::UnTracked(prep) => {
                let y = rotate(&x.into_primitive().tensor, &cos.tensor, &sin.tensor, Direction::Forward);
                prep.finish(TchTensor::new(y))
            }
        }
    }
}

/// Checks the kernel against the LibTorch route on `device`: bf16 x of `[2, 5, 3, 10]` over
/// ±40 (a head_dim whose halves are no power of two) with tables shared by the rows and one a
/// row (packed rows), both directions, bit for bit (zeros of either sign equal). Calls the
/// kernel and the reference directly, never the route (no verdict re-entered).
pub fn check(device: tch::Device) -> Result<(), String> {
    let _guard = tch::no_grad_guard();
    let values = |n: i64, k: i64, m: f32| -> tch::Tensor {
        let v: Vec<f32> = (0..n).map(|i| ((i * k) % 4001) as f32 / 4001.0 * 2.0 * m - m).collect();
        tch::Tensor::from_slice(&v).to_kind(tch::Kind::BFloat16).to_device(device)
    };
    let x = values(300, 7919, 40.0).view([2, 5, 3, 10]);
    for tb in [1, 2] {
        let (cos, sin) =
            (values(tb * 50, 104_729, 1.0).view([tb, 5, 1, 10]), values(tb * 50, 7, 1.0).view([tb, 5, 1, 10]));
        for direction in [Direction::Forward, Direction::Backward] {
            let (got, want) = (x.empty_like(), x.empty_like());
            let args = RopeArgs { x: &x, cos: &cos, sin: &sin, y: &got, direction };
            if !rope::launch(&args).map_err(|e| e.to_string())? {
                // Nothing launches on this device: the stand-in is the route; compare it to itself.
                stand_in(&args);
            }
            stand_in(&RopeArgs { y: &want, ..args });
            if got.eq_tensor(&want).all().int64_value(&[]) != 1 {
                return Err(format!("{direction:?} with {tb} table row(s) differs from the LibTorch route"));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
