//! LibTorch's multi-tensor AdamW (`_fused_adamw_`, what `torch.optim.AdamW(fused=True)` runs):
//! one kernel launch updates every parameter, its moments and its clipped gradient, where the
//! per-parameter update (`trainer/src/engine/optim.rs`) queues about 17 small ops a parameter:
//! on an H200 the optimizer of one 70B layer's FP8 step spent 3.9 ms, 0.3 of them busy, in 245
//! launches the host queued after the step's wait (docs/gpu.md).
//!
//! A CUDA route like the others (`crate::routes`): taken on a device that takes the CUDA routes,
//! checked there on first use against AdamW's definition computed in f64 on the host, the
//! per-parameter update when the check fails (logged). LibTorch has the kernel on the CPU as
//! well, so under `LLORA_CUDA_ROUTES_ON_CPU=1` the CPU runs this route, kernel included, and CI
//! runs its control flow: the shim, the lists, the in-place ownership and the check.
//!
//! Beside it, the clip's gradient norms by LibTorch's multi-tensor `_foreach_norm` ([`l2_norms`]),
//! a stock op on every device (no route, no check of its own).
//!
//! The kernel writes its tensors in place, which Burn's value semantics allow only on a buffer
//! nothing else holds: [`exclusive`] hands over a tensor's own buffer when burn-tch would reuse
//! it too (its storage held once), else a copy.

use std::ffi::{c_char, c_int};

use burn::backend::LibTorch;
use burn::backend::libtorch::TchTensor;
use burn::tensor::Tensor;
use tch::{Device, Kind};

use crate::params::ParamMut;

unsafe extern "C" {
    fn llora_fused_adamw(
        params: *const *const torch_sys::C_tensor,
        grads: *const *const torch_sys::C_tensor,
        exp_avgs: *const *const torch_sys::C_tensor,
        exp_avg_sqs: *const *const torch_sys::C_tensor,
        n: i64,
        step: *const torch_sys::C_tensor,
        lr: f64,
        beta1: f64,
        beta2: f64,
        weight_decay: f64,
        eps: f64,
        grad_scale: *const torch_sys::C_tensor,
        err: *mut *mut c_char,
    ) -> c_int;
    fn llora_foreach_norms(
        tensors: *const *const torch_sys::C_tensor,
        n: i64,
        out: *mut *mut torch_sys::C_tensor,
        err: *mut *mut c_char,
    ) -> c_int;
    fn llora_fused_adamw_free(s: *mut c_char);
}

/// AdamW's hyperparameters for one step, as `torch.optim.AdamW` takes them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWHyper {
    /// Learning rate of this step.
    pub lr: f64,
    /// β₁ and β₂.
    pub betas: [f64; 2],
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// ε in the denominator.
    pub eps: f64,
}

/// The tensors of one multi-tensor update, the i-th of each list belonging together.
#[derive(Debug, Default)]
pub(crate) struct Lists {
    /// The parameters, written in place.
    pub(crate) params: Vec<tch::Tensor>,
    /// Their gradients, multiplied by the step's factor in place when it is not 1.
    pub(crate) grads: Vec<tch::Tensor>,
    /// First moments, written in place.
    pub(crate) exp_avgs: Vec<tch::Tensor>,
    /// Second moments, written in place.
    pub(crate) exp_avg_sqs: Vec<tch::Tensor>,
}

/// One AdamW step in place over `lists` at step `t` (1-based, the bias corrections' exponent),
/// each gradient multiplied by `grad_factor` first (the clip coefficient).
///
/// # Shapes
/// - the i-th parameter, gradient and moments: one shape (any), one dtype, contiguous; all on
///   one device
pub(crate) fn step(lists: &Lists, t: u64, h: &AdamWHyper, grad_factor: f64) -> Result<(), String> {
    let n = lists.params.len();
    let lens = [lists.grads.len(), lists.exp_avgs.len(), lists.exp_avg_sqs.len()];
    if lens.iter().any(|&l| l != n) {
        return Err(format!("fused AdamW: {n} parameters but {lens:?} gradients / moments"));
    }
    let Some(first) = lists.params.first() else { return Ok(()) };
    let device = first.device();
    let scalar = |v: f64| tch::Tensor::f_full([0i64; 0].as_slice(), v, (Kind::Float, device));
    let step = scalar(t as f64).map_err(|e| format!("fused AdamW: step tensor: {e}"))?;
    // The kernel divides by the scale (AMP's unscaling): 1/c multiplies by c.
    let scale = (grad_factor != 1.0).then(|| scalar(1.0 / grad_factor)).transpose().map_err(|e| e.to_string())?;
    let ptrs = |ts: &[tch::Tensor]| ts.iter().map(|t| t.as_ptr()).collect::<Vec<_>>();
    let (p, g, m, v) = (ptrs(&lists.params), ptrs(&lists.grads), ptrs(&lists.exp_avgs), ptrs(&lists.exp_avg_sqs));
    let mut err = std::ptr::null_mut();
    let [b1, b2] = h.betas;
    // SAFETY: every pointer is a live tensor of `lists` or of this frame for the whole call; on
    // failure `err` is a malloc'd message freed once below.
    let rc = unsafe {
        llora_fused_adamw(
            p.as_ptr(),
            g.as_ptr(),
            m.as_ptr(),
            v.as_ptr(),
            n as i64,
            step.as_ptr(),
            h.lr,
            b1,
            b2,
            h.weight_decay,
            h.eps,
            scale.as_ref().map_or(std::ptr::null(), |s| s.as_ptr()),
            &mut err,
        )
    };
    // SAFETY: on failure `err` is null or the shim's malloc'd message, used only here.
    unsafe { crate::profile::shim_status(c_int::from(rc == 0), err, "fused AdamW", llora_fused_adamw_free) }?;
    ROUTE.mark_used();
    Ok(())
}

crate::routes::declare_route! {
    /// The route: its verdict per device, and whether a run took it.
    pub static ROUTE: Verdicts<Device> = &crate::routes::RouteSpec {
        name: "optimizer: LibTorch's fused AdamW (one multi-tensor launch)",
        fallback: "the per-parameter update runs",
        order: 80,
        part: "optimizer",
        self_tests: &[crate::routes::SelfTest {
            name: "optimizer: fused AdamW Float (one multi-tensor launch)",
            check: verify,
            passed: "three steps of 41 parameters match AdamW's definition in f64",
        }],
        counts_uses: true,
    };
}

/// Whether f32 parameters on `device` take the fused update: a device that takes the CUDA
/// routes (or any, when `anywhere`), the fused routes not switched off, and the kernel passed
/// its check there (run once, logged either way).
pub fn fused_adamw_usable(device: Device, anywhere: bool) -> bool {
    (anywhere || crate::routes::takes_cuda_routes(device))
        && crate::routes::fused_routes()
        && ROUTE.passed(device, || verify(device))
}

/// The LibTorch tensor of a plain (non-autodiff) `t`, for an in-place op: `t`'s own buffer when
/// nothing else holds it (burn-tch's own rule for reusing a buffer) and it is contiguous, else a
/// contiguous copy; `None` off LibTorch. The flag says whether it is a copy.
fn exclusive<const D: usize>(t: Tensor<D>) -> Option<(tch::Tensor, bool)> {
    let t: TchTensor = t.try_into_primitive::<LibTorch>().ok()?;
    if t.can_mut() && t.tensor.is_contiguous() {
        return Some((t.tensor, false));
    }
    Some((t.tensor.copy(), true))
}

/// The LibTorch tensor of a plain (non-autodiff) `t` to read from (its own buffer, however many
/// hold it; contiguous); `None` off LibTorch.
fn shared<const D: usize>(t: Tensor<D>) -> Option<tch::Tensor> {
    let t: TchTensor = t.try_into_primitive::<LibTorch>().ok()?;
    Some(t.tensor.contiguous())
}

/// A plain (non-autodiff) Burn tensor over `t`, which nothing else may hold.
fn from_exclusive<const D: usize>(t: tch::Tensor) -> Tensor<D> {
    Tensor::from_primitive::<LibTorch>(TchTensor::new(t))
}

/// Each tensor's L2 norm, accumulated and returned in f32 whatever its dtype, by LibTorch's
/// multi-tensor `_foreach_norm` (what `torch.nn.utils.clip_grad_norm_` runs): on CUDA a launch
/// per chunk of tensors, where a norm per tensor queues two (a 70B step's 640 adapter
/// gradients, 1,280 launches). `Ok(None)` off LibTorch or for no tensors.
///
/// # Shapes
/// - tensors: `[n_i]` each, any float dtype, one device; output: `[k]` f32 for k tensors
pub fn l2_norms(tensors: &[Tensor<1>]) -> Result<Option<Tensor<1>>, String> {
    let Some(list) = tensors.iter().map(|t| shared(t.clone())).collect::<Option<Vec<_>>>() else { return Ok(None) };
    if list.is_empty() {
        return Ok(None);
    }
    let ptrs: Vec<_> = list.iter().map(|t| t.as_ptr()).collect();
    let (mut out, mut err) = (std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: every pointer is a live tensor of `list` for the whole call; on success `out` is a
    // fresh at::Tensor owned by nobody else, on failure `err` a malloc'd message freed once below.
    let rc = unsafe { llora_foreach_norms(ptrs.as_ptr(), ptrs.len() as i64, &mut out, &mut err) };
    // SAFETY: as above.
    unsafe { crate::profile::shim_status(c_int::from(rc == 0), err, "gradient norms", llora_fused_adamw_free) }?;
    // SAFETY: the shim's fresh tensor, taken over once.
    Ok(Some(from_exclusive(unsafe { tch::Tensor::from_ptr(out) })))
}

/// One parameter's part in [`fused_adamw_update`]: the parameter, its gradient and its two
/// moments (flattened, on the plain backend; f32; zeros for a fresh parameter).
pub struct AdamWItem<'a> {
    /// The parameter, written in place.
    pub param: ParamMut<'a>,
    /// Its gradient, before the clip.
    pub grad: Tensor<1>,
    /// Its first moment.
    pub exp_avg: Tensor<1>,
    /// Its second moment.
    pub exp_avg_sq: Tensor<1>,
}

/// One AdamW step over `items` in one launch at step `t` (1-based), each gradient multiplied by
/// `clip` first. Each parameter, moment and (when clipped) gradient is handed to the kernel as
/// its own buffer, written in place ([`exclusive`]; one something else holds is copied, counted
/// in the debug log). Returns the moments after the step, in the order of `items`, and the
/// kernel's result: every parameter is put back either way.
///
/// # Shapes
/// - each item: grad, exp_avg, exp_avg_sq `[n]` for a parameter of n values; f32 on one
///   LibTorch device
pub fn fused_adamw_update(
    items: Vec<AdamWItem<'_>>,
    t: u64,
    h: &AdamWHyper,
    clip: f64,
) -> (Vec<[Tensor<1>; 2]>, Result<(), String>) {
    let mut lists = Lists::default();
    let (mut taken, mut copies) = (Vec::with_capacity(items.len()), 0);
    let mut own = |t: Tensor<1>, list: &mut Vec<tch::Tensor>| match exclusive(t) {
        Some((t, copied)) => {
            copies += usize::from(copied);
            list.push(t);
            Ok(())
        }
        None => Err("fused AdamW: a tensor off LibTorch".to_string()),
    };
    let mut handed = Ok(());
    for AdamWItem { mut param, grad, exp_avg, exp_avg_sq } in items {
        let (value, shape) = param.take_flat();
        handed = handed
            .and(own(value, &mut lists.params))
            .and(own(exp_avg, &mut lists.exp_avgs))
            .and(own(exp_avg_sq, &mut lists.exp_avg_sqs));
        // The kernel writes the clipped gradient back: only then must the buffer be ours.
        if clip == 1.0 {
            handed = handed
                .and(shared(grad).map(|g| lists.grads.push(g)).ok_or("fused AdamW: a gradient off LibTorch".into()));
        } else {
            handed = handed.and(own(grad, &mut lists.grads));
        }
        taken.push((param, shape));
    }
    if copies > 0 {
        tracing::debug!(copies, "fused AdamW: buffers held elsewhere were copied");
    }
    let result = handed.and_then(|()| step(&lists, t, h, clip));
    let Lists { params, exp_avgs, exp_avg_sqs, .. } = lists;
    for ((mut param, shape), p) in taken.into_iter().zip(params) {
        param.put_flat(from_exclusive(p), shape);
    }
    let moments = exp_avgs.into_iter().zip(exp_avg_sqs).map(|(m, v)| [from_exclusive(m), from_exclusive(v)]).collect();
    (moments, result)
}

/// Checks the fused update on `device` against AdamW's definition (`torch.optim.AdamW`'s
/// update, in f64 on the host from the same f32 inputs): three steps of 41 parameters (sizes 1
/// to 1480, and one of 70,000, more than a launch's chunk; more tensors than one launch takes),
/// each step's learning rate and clip factor different. The parameters' total change, the
/// moments and the clipped gradients must agree norm-wise within 1e-4, 1e-5, 1e-6.
pub fn verify(device: Device) -> Result<(), String> {
    check_kernel(device, step)
}

/// [`verify`] of `kernel`, a function with [`step`]'s contract.
fn check_kernel(
    device: Device,
    kernel: impl Fn(&Lists, u64, &AdamWHyper, f64) -> Result<(), String>,
) -> Result<(), String> {
    let _no_grad = tch::no_grad_guard();
    let sizes: Vec<usize> = (1..=40).map(|i| i * 37).chain([70_000]).collect();
    // Deterministic values in [-1, 1) (no generator draw: a check must not shift a run's
    // random stream).
    let values = |seed: usize, len: usize| -> Vec<f32> {
        (0..len).map(|i| (((i * 7919 + seed * 104_729) % 2003) as f32) / 1001.5 - 1.0).collect()
    };
    let on_device = |v: &[f32]| tch::Tensor::from_slice(v).to_device(device);
    let h = |lr: f64| AdamWHyper { lr, betas: [0.9, 0.999], weight_decay: 0.1, eps: 1e-8 };
    let schedule = [(1e-2, 1.0), (5e-3, 0.25), (2e-3, 0.5)];
    let p0: Vec<Vec<f32>> = sizes.iter().enumerate().map(|(i, &n)| values(i, n)).collect();
    let mut lists = Lists {
        params: p0.iter().map(|p| on_device(p)).collect(),
        exp_avgs: sizes.iter().map(|&n| tch::Tensor::zeros([n as i64], (Kind::Float, device))).collect(),
        exp_avg_sqs: sizes.iter().map(|&n| tch::Tensor::zeros([n as i64], (Kind::Float, device))).collect(),
        grads: vec![],
    };
    let mut want = Reference::new(&p0);
    let mut last_grads = vec![];
    for (k, &(lr, factor)) in schedule.iter().enumerate() {
        let grads: Vec<Vec<f32>> = sizes.iter().enumerate().map(|(i, &n)| values(1000 * (k + 1) + i, n)).collect();
        lists.grads = grads.iter().map(|g| on_device(g)).collect();
        kernel(&lists, k as u64 + 1, &h(lr), factor)?;
        want.step(&grads, k as i32 + 1, &h(lr), factor);
        last_grads = grads.iter().map(|g| g.iter().map(|&x| f64::from(x) * factor).collect()).collect();
    }
    let change: Vec<Vec<f64>> = want.p.iter().zip(&p0).map(|(p, p0)| diff(p, p0)).collect();
    let got_change = read(&lists.params)?.iter().zip(&p0).map(|(p, p0)| diff(p, p0)).collect::<Vec<_>>();
    compare("parameters' change", &got_change, &change, 1e-4)?;
    compare("first moments", &read(&lists.exp_avgs)?, &want.m, 1e-5)?;
    compare("second moments", &read(&lists.exp_avg_sqs)?, &want.v, 1e-5)?;
    compare("clipped gradients", &read(&lists.grads)?, &last_grads, 1e-6)
}

/// AdamW by its definition, in f64: `p ← p·(1 − lr·wd)`, `m ← β₁m + (1−β₁)g`,
/// `v ← β₂v + (1−β₂)g²`, `p ← p − lr/(1−β₁ᵗ) · m / (√v/√(1−β₂ᵗ) + ε)`.
struct Reference {
    p: Vec<Vec<f64>>,
    m: Vec<Vec<f64>>,
    v: Vec<Vec<f64>>,
}

impl Reference {
    fn new(p0: &[Vec<f32>]) -> Self {
        let p: Vec<Vec<f64>> = p0.iter().map(|p| p.iter().map(|&x| f64::from(x)).collect()).collect();
        let zeros: Vec<Vec<f64>> = p.iter().map(|p| vec![0.0; p.len()]).collect();
        Self { p, m: zeros.clone(), v: zeros }
    }

    fn step(&mut self, grads: &[Vec<f32>], t: i32, h: &AdamWHyper, factor: f64) {
        let [b1, b2] = h.betas;
        let (c1, c2) = (1.0 - b1.powi(t), (1.0 - b2.powi(t)).sqrt());
        for (((p, m), v), g) in self.p.iter_mut().zip(&mut self.m).zip(&mut self.v).zip(grads) {
            for i in 0..p.len() {
                let g = f64::from(g[i]) * factor;
                m[i] = b1 * m[i] + (1.0 - b1) * g;
                v[i] = b2 * v[i] + (1.0 - b2) * g * g;
                p[i] = p[i] * (1.0 - h.lr * h.weight_decay) - h.lr / c1 * m[i] / (v[i].sqrt() / c2 + h.eps);
            }
        }
    }
}

fn diff(a: &[f64], b: &[f32]) -> Vec<f64> {
    a.iter().zip(b).map(|(a, &b)| a - f64::from(b)).collect()
}

fn read(ts: &[tch::Tensor]) -> Result<Vec<Vec<f64>>, String> {
    ts.iter()
        .map(|t| Vec::<f64>::try_from(t.to_kind(Kind::Double).flatten(0, -1)).map_err(|e| format!("read back: {e}")))
        .collect()
}

/// Norm-wise relative error of `got` against `want` over all tensors, under `tol`.
fn compare(what: &str, got: &[Vec<f64>], want: &[Vec<f64>], tol: f64) -> Result<(), String> {
    let pairs = got.iter().flatten().zip(want.iter().flatten());
    let (err, scale) = pairs.fold((0.0, 0.0), |(e, s), (a, b)| (e + (a - b) * (a - b), s + b * b));
    let rel = err.sqrt() / scale.sqrt().max(1e-30);
    if rel.is_nan() || rel >= tol {
        return Err(format!("{what} differ from AdamW's definition: relative error {rel:.3e} (bound {tol:.0e})"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// LibTorch's CPU kernel passes the check, and the check has teeth: the same kernel fed a
    /// wrong weight decay, a bias correction stuck at step 1, or the clip factor left out fails
    /// it, naming what differs.
    #[test]
    fn the_cpu_kernel_passes_the_check_and_drifted_kernels_fail_it() {
        verify(Device::Cpu).unwrap();
        let no_decay = |l: &Lists, t, h: &AdamWHyper, f| step(l, t, &AdamWHyper { weight_decay: 0.0, ..*h }, f);
        let stuck_at_one = |l: &Lists, _t, h: &AdamWHyper, f| step(l, 1, h, f);
        let unclipped = |l: &Lists, t, h: &AdamWHyper, _f| step(l, t, h, 1.0);
        for (what, err) in [
            ("no weight decay", check_kernel(Device::Cpu, no_decay)),
            ("t stuck at 1", check_kernel(Device::Cpu, stuck_at_one)),
            ("clip left out", check_kernel(Device::Cpu, unclipped)),
        ] {
            let err = err.expect_err(what);
            assert!(err.contains("differ from AdamW's definition"), "{what}: {err}");
        }
    }

    /// Inputs the kernel refuses come back as errors, never a panic or an abort: lists of
    /// different lengths, and a gradient of another dtype than its parameter (LibTorch's own
    /// message through the shim). An empty update is nothing to do.
    #[test]
    fn refused_inputs_are_errors() {
        let f32s = |n: i64| tch::Tensor::zeros([n], (Kind::Float, Device::Cpu));
        let h = AdamWHyper { lr: 1e-3, betas: [0.9, 0.999], weight_decay: 0.0, eps: 1e-8 };
        step(&Lists::default(), 1, &h, 1.0).unwrap();
        let short = Lists { params: vec![f32s(3)], grads: vec![], exp_avgs: vec![f32s(3)], exp_avg_sqs: vec![f32s(3)] };
        assert!(step(&short, 1, &h, 1.0).unwrap_err().contains("1 parameters but [0, 1, 1]"));
        let mixed = Lists {
            params: vec![f32s(3)],
            grads: vec![f32s(3).to_kind(Kind::Double)],
            exp_avgs: vec![f32s(3)],
            exp_avg_sqs: vec![f32s(3)],
        };
        let err = step(&mixed, 1, &h, 1.0).unwrap_err();
        assert!(err.contains("Float") || err.contains("Double"), "{err}");
    }

    /// Where the route runs: under the default policy on devices that take the CUDA routes
    /// (the CPU only under the switch), and anywhere when asked, the CPU's kernel then checked.
    #[test]
    fn the_route_runs_where_the_cuda_routes_do_or_where_asked() {
        let _off = crate::routes::on_cpu_for_this_thread(false);
        assert!(!fused_adamw_usable(Device::Cpu, false));
        assert!(fused_adamw_usable(Device::Cpu, true));
        assert_eq!(ROUTE.verdict(Device::Cpu), Some(true));
        let _on = crate::routes::on_cpu_for_this_thread(true);
        assert!(fused_adamw_usable(Device::Cpu, false));
    }

    /// A buffer held once is handed over as it is (the kernel writes the tensor in place); one
    /// held twice is copied, and writing the copy leaves the other holder's values alone.
    #[test]
    fn only_a_buffer_held_once_is_handed_over() {
        let device = burn::tensor::Device::libtorch();
        let t = Tensor::<1>::from_floats([1.0, 2.0, 3.0], &device);
        let (alone, copied) = exclusive(t).unwrap();
        assert!(!copied);
        let back: Tensor<1> = from_exclusive(alone);
        let kept = back.clone();
        let (mut other, copied) = exclusive(back).unwrap();
        assert!(copied, "a clone holds the buffer");
        let _ = other.fill_(7.0);
        assert_eq!(kept.into_data().to_vec::<f32>().unwrap(), [1.0, 2.0, 3.0]);
    }

    /// [`l2_norms`] on `device` against each norm computed in f64 on the host: 41 tensors of
    /// f32 and bf16 values (lengths 0 to 70,000: more than one chunk of a multi-tensor launch,
    /// and tensors beyond one launch's list), each within 1e-6 of its own; bf16 ones accumulated
    /// in f32 (70,000 ones: √70000 = 264.575…, which bf16 would round to 264.0).
    fn norms_match_f64_on(device: Device) {
        let _rng = crate::device::torch_rng_lock();
        let lens = (0..41i64).map(|i| if i == 40 { 70_000 } else { i * 997 % 5_000 });
        let host: Vec<tch::Tensor> = lens
            .enumerate()
            .map(|(i, n)| match i % 3 {
                2 => tch::Tensor::ones([n], (Kind::BFloat16, Device::Cpu)),
                _ => tch::Tensor::randn([n], (Kind::Float, Device::Cpu)) * (i as f64 + 0.5),
            })
            .collect();
        let want: Vec<f64> = host
            .iter()
            .map(|t| Vec::<f64>::try_from(t.to_kind(Kind::Double)).unwrap().iter().map(|v| v * v).sum::<f64>().sqrt())
            .collect();
        let burn: Vec<Tensor<1>> = host.iter().map(|t| from_exclusive(t.to_device(device))).collect();
        let got = l2_norms(&burn).unwrap().unwrap().into_data().to_vec::<f32>().unwrap();
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!((f64::from(*g) - w).abs() <= 1e-6 * w.max(1.0), "tensor {i}: {g} vs {w}");
        }
        assert!(l2_norms(&[]).unwrap().is_none());
    }

    /// On the CPU (LibTorch's per-tensor loop behind the same op).
    #[test]
    fn each_norm_is_its_tensors_in_f32_whatever_the_dtype() {
        norms_match_f64_on(Device::Cpu);
    }

    /// On a CUDA device: the multi-tensor kernel's norms.
    #[test]
    #[ignore = "needs CUDA"]
    fn cuda_norms_match_f64() {
        assert!(tch::Cuda::is_available(), "needs a CUDA device");
        norms_match_f64_on(Device::Cuda(0));
    }

    /// On a CUDA device: the kernel passes its check (41 tensors, more than one launch takes,
    /// and one over a launch's chunk), and the default policy takes it there.
    #[test]
    #[ignore = "needs CUDA"]
    fn cuda_fused_adamw_matches_the_definition() {
        assert!(tch::Cuda::is_available(), "needs a CUDA device");
        assert_eq!(verify(Device::Cuda(0)), Ok(()));
        assert!(fused_adamw_usable(Device::Cuda(0), false));
    }
}
