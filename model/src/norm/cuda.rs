//! RMSNorm on CUDA through LibTorch's fused kernels (`_fused_rms_norm` and its backward): one
//! kernel each way, where the composite makes about seven passes over the activations forward
//! and fifteen backward, with f32 temporaries of the whole `[tokens, d]` (the first H100 traces
//! counted RMSNorm's f32 statistics among a bf16 step's casts and elementwise work:
//! docs/performance.md, M5). The kernel is checked against an f64 reference on the first
//! problem of each device and dtype ([`usable`]); where it is missing or fails, the composite
//! runs.
//!
//! Numerics: the kernel accumulates in f32 and rounds `w · x · rstd` once; HF rounds `x · rstd`
//! to the activations' dtype before the gain, so in bf16 the two differ by at most an ulp.

use std::ffi::{c_char, c_int};

unsafe extern "C" {
    fn llora_rms_norm_backward(
        dy: *const torch_sys::C_tensor,
        x: *const torch_sys::C_tensor,
        rstd: *const torch_sys::C_tensor,
        w: *const torch_sys::C_tensor,
        want_dx: c_int,
        want_dw: c_int,
        dx: *mut *mut torch_sys::C_tensor,
        dw: *mut *mut torch_sys::C_tensor,
        err: *mut *mut c_char,
    ) -> c_int;
    fn llora_norm_free(s: *mut c_char);
}

/// `(w · x · rstd, rstd)` over the last dimension, rstd = `1/√(mean(x²) + ε)` in f32.
///
/// # Shapes
/// - x: `[.., d]`; w: `[d]` in x's dtype
/// - output: y as x; rstd `[.., 1]`, f32
pub fn forward(x: &tch::Tensor, w: &tch::Tensor, eps: f64) -> Result<(tch::Tensor, tch::Tensor), tch::TchError> {
    let mut stat = x.size();
    let d = std::mem::replace(stat.last_mut().expect("a norm input has a last dimension"), 1);
    let (y, rstd) = x.f_internal_fused_rms_norm([d].as_slice(), Some(w), eps)?;
    ROUTE.mark_used();
    // One per row, as `[.., 1]` whatever shape the kernel gave it (a view of the same values).
    Ok((y, rstd.f_reshape(stat)?))
}

/// The gradients of [`forward`]'s output under `dy`: dx (with `want_dx`) and dw (with
/// `want_dw`), each in x's dtype.
///
/// # Shapes
/// - dy, x: `[.., d]`; rstd as [`forward`] returned it; w: `[d]` in x's dtype
pub fn backward(
    dy: &tch::Tensor,
    x: &tch::Tensor,
    rstd: &tch::Tensor,
    w: &tch::Tensor,
    [want_dx, want_dw]: [bool; 2],
) -> Result<(Option<tch::Tensor>, Option<tch::Tensor>), tch::TchError> {
    if crate::routes::stands_in(x.device()) {
        // The CPU standing in for CUDA has no fused backward kernel: the norm node's composite.
        return Ok((
            want_dx.then(|| super::composite::dx(dy, x, rstd, w)),
            want_dw.then(|| super::composite::dw(dy, x, rstd, x.kind())),
        ));
    }
    let (mut dx, mut dw, mut err) = (std::ptr::null_mut(), std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: the tensors outlive the call; on success dx and dw are new at::Tensors that tch
    // takes over below, on failure err is a malloc'd message freed once.
    let rc = unsafe {
        llora_rms_norm_backward(
            dy.as_ptr(),
            x.as_ptr(),
            rstd.as_ptr(),
            w.as_ptr(),
            c_int::from(want_dx),
            c_int::from(want_dw),
            &mut dx,
            &mut dw,
            &mut err,
        )
    };
    // SAFETY: on failure `err` is null or the shim's malloc'd message, used only here.
    unsafe { crate::profile::shim_status(c_int::from(rc == 0), err, "fused RMSNorm backward", llora_norm_free) }
        .map_err(tch::TchError::Torch)?;
    // SAFETY: fresh tensors owned by nobody else.
    let own = |p| Some(unsafe { tch::Tensor::from_ptr(p) }).filter(tch::Tensor::defined);
    Ok((own(dx), own(dw)))
}

crate::routes::declare_route! {
    /// The route: the verdict of [`verify`] per device and dtype, and whether [`forward`] ran.
    pub static ROUTE: Verdicts<(tch::Device, tch::Kind)> = &crate::routes::RouteSpec {
        name: "RMSNorm: LibTorch's fused kernels",
        fallback: "the composite runs",
        order: 60,
        part: "norm",
        self_tests: &[
            crate::routes::SelfTest {
                name: "RMSNorm fused kernels BFloat16",
                check: |device| verify(device, tch::Kind::BFloat16),
                passed: "forward and backward match the definition in f64",
            },
            crate::routes::SelfTest {
                name: "RMSNorm fused kernels Float",
                check: |device| verify(device, tch::Kind::Float),
                passed: "forward and backward match the definition in f64",
            },
        ],
        counts_uses: true,
    };
}

/// Whether a norm of `x` takes the fused kernels: x on a device that takes the CUDA routes
/// ([`crate::routes::takes_cuda_routes`]), in a float dtype, and the kernels passed their check
/// there in that dtype (checked once, logged either way).
pub fn usable(x: &tch::Tensor) -> bool {
    let device = x.device();
    if !crate::routes::takes_cuda_routes(device) || !crate::routes::fused_routes() {
        return false;
    }
    let kind = x.kind();
    if !matches!(kind, tch::Kind::Float | tch::Kind::BFloat16 | tch::Kind::Half) {
        return false;
    }
    ROUTE.passed((device, kind), || verify(device, kind))
}

/// Checks the fused forward and backward on `device` in `kind` against the definition in f64
/// on the same rounded inputs: `y = w·x·r`, `dx = r·(dn − n·mean(dn·n))` with `n = x·r`,
/// `dn = dy·w`, and `dw = Σ dy·n`, for 2 × 133 rows of 1024 (norm-wise relative error under
/// 1e-2 in bf16/f16, the rounding of the outputs; 1e-5 in f32).
pub fn verify(device: tch::Device, kind: tch::Kind) -> Result<(), String> {
    let _guard = tch::no_grad_guard();
    let (rows, d, eps) = ([2i64, 133], 1024i64, 1e-5);
    let rand = |shape: &[i64], mean: f64, std: f64| {
        tch::Tensor::f_randn(shape, (tch::Kind::Float, device))
            .and_then(|t| (t * std + mean).f_to_kind(kind))
            .map_err(|e| format!("inputs: {e}"))
    };
    let (x, w, dy) =
        (rand(&[rows[0], rows[1], d], 0.0, 3.0)?, rand(&[d], 1.0, 0.2)?, rand(&[rows[0], rows[1], d], 0.0, 1.0)?);
    let (y, rstd) = forward(&x, &w, eps).map_err(|e| format!("forward: {e}"))?;
    let (dx, dw) = backward(&dy, &x, &rstd, &w, [true, true]).map_err(|e| format!("backward: {e}"))?;
    let (dx, dw) = (dx.ok_or("backward returned no dx")?, dw.ok_or("backward returned no dw")?);
    let f64s = |t: &tch::Tensor| t.to_kind(tch::Kind::Double);
    let (x64, w64, dy64) = (f64s(&x), f64s(&w), f64s(&dy));
    let r = (x64.square().mean_dim(-1, true, tch::Kind::Double) + eps).rsqrt();
    let n = &x64 * &r;
    let dn = &dy64 * &w64;
    let want_dx = (&dn - &n * (&dn * &n).mean_dim(-1, true, tch::Kind::Double)) * &r;
    let want_dw = (&dy64 * &n).reshape([-1, d]).sum_dim_intlist([0i64].as_slice(), false, tch::Kind::Double);
    let tol = if kind == tch::Kind::Float { 1e-5 } else { 1e-2 };
    for (name, got, want) in [("y", &y, &n * &w64), ("dx", &dx, want_dx), ("dw", &dw, want_dw)] {
        if got.kind() != kind || got.size() != want.size() {
            return Err(format!("{name} is {:?} {:?}, expected {kind:?} {:?}", got.kind(), got.size(), want.size()));
        }
        let err = (f64s(got) - &want).norm().double_value(&[]);
        let scale = want.norm().double_value(&[]).max(1e-30);
        let close = err / scale < tol; // false for NaN, which must count as a mismatch
        if !close {
            return Err(format!("{name} differs: error {err:.3e} against {scale:.3e}"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// On the CPU, `_fused_rms_norm` is LibTorch's composite: its forward is the definition, so
    /// the argument plumbing (last-dimension shape, gain, ε, the f32 rstd) is checked here;
    /// its backward has no CPU kernel, and the check reports that as an error, not a panic.
    #[test]
    fn forward_plumbing_on_the_cpu_and_a_missing_backward() {
        let x = tch::Tensor::from_slice(&[3.0f32, 4.0, 1.0, 1.0]).view([2, 1, 2]);
        let w = tch::Tensor::from_slice(&[1.0f32, 2.0]);
        let (y, rstd) = forward(&x, &w, 0.0).unwrap();
        let r = 12.5f32.sqrt();
        let got: Vec<f32> = y.flatten(0, -1).try_into().unwrap();
        let want = [3.0 / r, 8.0 / r, 1.0, 2.0];
        assert!(got.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-6), "{got:?}");
        assert_eq!((rstd.size(), rstd.kind()), (vec![2, 1, 1], tch::Kind::Float));
        let _off = crate::routes::on_cpu_for_this_thread(false);
        let err = verify(tch::Device::Cpu, tch::Kind::Float).unwrap_err();
        assert!(err.starts_with("backward: "), "{err}");
        assert!(!usable(&x), "the CPU keeps the composite");
    }

    /// The route on the CPU standing in for CUDA: the check runs once per dtype (forward
    /// through `_fused_rms_norm`, the backward's composite against the f64 definition) and
    /// passes, so norms take the fused node's plumbing; the composite backward is the
    /// definition, checked by hand on one row.
    #[test]
    fn the_fused_route_runs_on_the_cpu_standing_in() {
        crate::routes::tests::on_cpu_within(60, "fused RMSNorm's first use", || {
            for kind in [tch::Kind::Float, tch::Kind::BFloat16] {
                let x = tch::Tensor::randn([3, 5, 64], (tch::Kind::Float, tch::Device::Cpu)).to_kind(kind);
                // Another test's thread may be running this key's check: then this call takes
                // the composite, and the verdict comes when that check ends.
                let key = (tch::Device::Cpu, kind);
                if !usable(&x) {
                    crate::routes::tests::until(30, || ROUTE.verdict(key).is_some());
                }
                assert_eq!(ROUTE.verdict(key), Some(true), "{kind:?}");
            }
            // One row x = (3, 4), w = (1, 2), ε = 0: r = 1/√12.5, n = x·r; dy = (1, 0):
            // dn = (1, 0), mean(dn·n) = 3r/2, dx = r·(dn − n·3r/2), dw = dy·n = (3r, 0).
            let x = tch::Tensor::from_slice(&[3.0f64, 4.0]).view([1, 1, 2]);
            let w = tch::Tensor::from_slice(&[1.0f64, 2.0]);
            let r = 1.0 / 12.5f64.sqrt();
            let rstd = tch::Tensor::from_slice(&[r]).view([1, 1, 1]);
            let dy = tch::Tensor::from_slice(&[1.0f64, 0.0]).view([1, 1, 2]);
            let (dx, dw) = backward(&dy, &x, &rstd, &w, [true, true]).unwrap();
            let got = |t: Option<tch::Tensor>| {
                Vec::<f64>::try_from(t.unwrap().to_kind(tch::Kind::Double).flatten(0, -1)).unwrap()
            };
            let want_dx = [r * (1.0 - 3.0 * r * 1.5 * r), r * (0.0 - 4.0 * r * 1.5 * r)];
            for (a, b) in got(dx).iter().zip(want_dx).chain(got(dw).iter().zip([3.0 * r, 0.0])) {
                assert!((a - b).abs() < 1e-6, "{a} vs {b}");
            }
        });
    }

    /// On a CUDA device: the fused kernels pass their check in f32 and bf16.
    #[test]
    #[ignore = "needs CUDA"]
    fn cuda_fused_norm_matches_the_definition() {
        assert!(tch::Cuda::is_available(), "needs a CUDA device");
        for kind in [tch::Kind::Float, tch::Kind::BFloat16] {
            assert_eq!(verify(tch::Device::Cuda(0), kind), Ok(()), "{kind:?}");
        }
    }
}
