//! Launching `rmsnorm_fp8.cu`: RMSNorm's forward writing its bf16 output, the rows' f32
//! 1/rms and, when asked, the output's FP8 codes for the next GEMMs ([`forward`]). The
//! argument checks run anywhere; launching needs CUDA tensors (the CUDA test:
//! `a_launch_equals_the_libtorch_route`; status on GPUs: docs/gpu.md).

pub use super::args::DelayedCodes;
use super::args::{Expect, codes_params};
use super::launch::{THREADS, address, arg, launch, target};
use super::nvrtc::{KernelError, Source};

/// The kernel's source (after the shared device helpers).
pub const SOURCE: Source = Source {
    name: "rmsnorm_fp8.cu",
    text: concat!(include_str!("fp8_device.cuh"), include_str!("rmsnorm_fp8.cu")),
    kernels: &["llora_rmsnorm_fp8_forward_bf16"],
};

/// What the forward reads and writes, all contiguous on one device.
///
/// # Shapes
/// - x, y: `[rows, d]` bf16; w: `[d]` bf16; inv_rms: `[rows, 1]` f32
#[derive(Debug)]
pub struct ForwardArgs<'a> {
    /// The input.
    pub x: &'a tch::Tensor,
    /// The gain.
    pub w: &'a tch::Tensor,
    /// The output, written.
    pub y: &'a tch::Tensor,
    /// 1/rms per row, written (what the norm's backward keeps).
    pub inv_rms: &'a tch::Tensor,
    /// ε inside the square root (finite, ≥ 0).
    pub eps: f64,
    /// The output's codes, when the next GEMMs run in FP8.
    pub y_codes: Option<DelayedCodes<'a>>,
}

/// Checks the arguments: dtypes, shapes, contiguity, one device, ε, rows within a grid.
pub fn check(a: &ForwardArgs<'_>) -> Result<(), KernelError> {
    let kernel = "llora_rmsnorm_fp8_forward_bf16";
    let refuse = |what: String| Err(KernelError::Arguments { kernel, what });
    let [rows, d] = a.x.size()[..] else { return refuse(format!("x is {:?}: want [rows, d]", a.x.size())) };
    let shape = [rows, d];
    let e = Expect { kernel, device: a.x.device(), shape: &shape };
    let (bf16, f32) = (tch::Kind::BFloat16, tch::Kind::Float);
    e.tensor("x", a.x, bf16, None)?;
    e.tensor("w", a.w, bf16, Some(&[d]))?;
    e.tensor("y", a.y, bf16, None)?;
    e.tensor("inv_rms", a.inv_rms, f32, Some(&[rows, 1]))?;
    if let Some(c) = &a.y_codes {
        c.check(&e, "y")?;
    }
    if !(a.eps.is_finite() && a.eps >= 0.0) {
        return refuse(format!("eps {} is not a finite number >= 0", a.eps));
    }
    if rows > i64::from(i32::MAX) {
        return refuse(format!("{rows} rows: at most {} (one block per row)", i32::MAX));
    }
    Ok(())
}

/// The forward on x's CUDA device, on the default stream, without waiting: `Ok(true)`.
/// `Ok(false)` for a CPU tensor: nothing launched, the caller runs the stand-in
/// (`fp8::stand_ins`).
pub fn forward(a: &ForwardArgs<'_>) -> Result<bool, KernelError> {
    check(a)?;
    let Some(at) = target(a.x, SOURCE.kernels[0])? else { return Ok(false) };
    let [rows, mut cols] = [a.x.size()[0], a.x.size()[1]];
    if rows * cols == 0 {
        return Ok(true);
    }
    let (mut x, mut w, mut y, mut r) =
        (address(Some(a.x)), address(Some(a.w)), address(Some(a.y)), address(Some(a.inv_rms)));
    let ([mut yq, mut ys, mut ya], mut limit, mut e5m2) = codes_params(a.y_codes.as_ref());
    let mut eps = a.eps as f32;
    let mut p = [
        arg(&mut x),
        arg(&mut w),
        arg(&mut y),
        arg(&mut r),
        arg(&mut yq),
        arg(&mut ys),
        arg(&mut ya),
        arg(&mut cols),
        arg(&mut eps),
        arg(&mut limit),
        arg(&mut e5m2),
    ];
    // SAFETY: the kernel's parameters in order and type, checked above; one block per row.
    unsafe { launch(&SOURCE, at, SOURCE.kernels[0], (rows as u32, 1, 1), THREADS, &mut p)? };
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fp8::format::Fp8Format;
    use crate::kernels::args::{assert_refused, host_bytes};
    use tch::{Kind, Tensor};

    struct Problem {
        x: Tensor,
        w: Tensor,
        y: Tensor,
        r: Tensor,
    }

    impl Problem {
        fn new([rows, d]: [i64; 2], dev: tch::Device) -> Self {
            let f = (Kind::Float, dev);
            Self {
                x: (Tensor::randn([rows, d], f) * 2.0).to_kind(Kind::BFloat16),
                w: (Tensor::randn([d], f) * 0.1 + 1.0).to_kind(Kind::BFloat16),
                y: Tensor::zeros([rows, d], (Kind::BFloat16, dev)),
                r: Tensor::zeros([rows, 1], f),
            }
        }

        fn args(&self) -> ForwardArgs<'_> {
            ForwardArgs { x: &self.x, w: &self.w, y: &self.y, inv_rms: &self.r, eps: 1e-5, y_codes: None }
        }
    }

    /// Each wrong argument is refused naming it; valid CPU arguments never launch.
    #[test]
    fn the_launch_checks_name_each_wrong_argument() {
        let p = Problem::new([3, 8], tch::Device::Cpu);
        assert!(check(&p.args()).is_ok());
        let flat = p.x.view([-1]);
        assert_refused(check(&ForwardArgs { x: &flat, ..p.args() }), "want [rows, d]");
        let f32 = p.x.to_kind(Kind::Float);
        assert_refused(check(&ForwardArgs { x: &f32, ..p.args() }), "x is Float");
        assert_refused(check(&ForwardArgs { w: &p.x, ..p.args() }), "w is BFloat16 [3, 8]");
        assert_refused(check(&ForwardArgs { inv_rms: &p.r.view([3]), ..p.args() }), "inv_rms");
        let strided = Tensor::zeros([8, 3], (Kind::BFloat16, tch::Device::Cpu)).tr();
        assert_refused(check(&ForwardArgs { y: &strided, ..p.args() }), "y is not contiguous");
        assert_refused(check(&ForwardArgs { eps: f64::NAN, ..p.args() }), "eps");
        let codes = Tensor::zeros([3, 8], (Fp8Format::E4M3.kind(), tch::Device::Cpu));
        let c = DelayedCodes { codes: &codes, scale: &p.r, amax: &p.r, format: Fp8Format::E4M3 };
        assert_refused(check(&ForwardArgs { y_codes: Some(c), ..p.args() }), "y scale");
        assert_eq!(forward(&p.args()), Ok(false), "a CPU tensor: nothing launched");
    }

    /// With the CPU standing in for CUDA: the route writes HF's LlamaRMSNorm output exactly
    /// (written here in plain ops), its 1/rms, codes that decode to y within E4M3's half-ulp
    /// and y's amax.
    #[test]
    fn the_cpu_stand_in_writes_what_the_norm_computes() {
        let p = Problem::new([5, 24], tch::Device::Cpu);
        let (codes, scale, amax) = (
            Tensor::zeros([5, 24], (Fp8Format::E4M3.kind(), tch::Device::Cpu)),
            Tensor::from_slice(&[4.0f32]),
            Tensor::zeros([1], (Kind::Float, tch::Device::Cpu)),
        );
        let c = DelayedCodes { codes: &codes, scale: &scale, amax: &amax, format: Fp8Format::E4M3 };
        crate::fp8::stand_ins::rmsnorm(&ForwardArgs { y_codes: Some(c), ..p.args() });
        // HF's LlamaRMSNorm in plain ops: (x.float() * rsqrt(mean(x²) + eps)).to(bf16) * w.
        let xf = p.x.to_kind(Kind::Float);
        let r = (xf.square().mean_dim(-1, true, Kind::Float) + 1e-5).rsqrt();
        let y = (&xf * &r).to_kind(Kind::BFloat16) * &p.w;
        assert_eq!((&y - &p.y).abs().max().double_value(&[]), 0.0);
        assert!(((&r - &p.r) / &r).abs().max().double_value(&[]) < 1e-6);
        let decoded = codes.to_kind(Kind::Float) * 0.25;
        let yf = y.to_kind(Kind::Float);
        assert!((&decoded - &yf).abs().max().double_value(&[]) <= yf.abs().max().double_value(&[]) * 2f64.powi(-4));
        assert_eq!(amax.double_value(&[0]), yf.abs().max().double_value(&[]));
    }

    /// The kernel against the LibTorch route on a GPU: inv_rms within 1e-6 relative, y within
    /// one bf16 ulp, the codes bit for bit those of the kernel's own y, the amax exact, at
    /// odd widths and a zero row (1/rms = 1/√ε).
    #[test]
    #[ignore = "needs CUDA"]
    fn a_launch_equals_the_libtorch_route() {
        assert!(tch::Cuda::is_available(), "this test needs a CUDA device");
        let dev = tch::Device::Cuda(0);
        for shape in [[1, 1], [7, 33], [64, 8192], [3, 1000]] {
            let (mine, want) = (Problem::new(shape, dev), Problem::new(shape, dev));
            let _ = mine.x.get(0).zero_();
            want.x.shallow_clone().copy_(&mine.x);
            want.w.shallow_clone().copy_(&mine.w);
            let scale = Tensor::from_slice(&[8.0f32]).to_device(dev);
            let codes = Tensor::zeros(shape, (Kind::Float, dev)).to_kind(Fp8Format::E4M3.kind());
            let amax = Tensor::zeros([1], (Kind::Float, dev));
            let c = DelayedCodes { codes: &codes, scale: &scale, amax: &amax, format: Fp8Format::E4M3 };
            forward(&ForwardArgs { y_codes: Some(c), ..mine.args() }).unwrap();
            crate::fp8::stand_ins::rmsnorm(&want.args());
            let rel = ((&mine.r - &want.r) / &want.r).abs().max().double_value(&[]);
            assert!(rel < 1e-6, "inv_rms off by {rel}, {shape:?}");
            let (y, y_want) = (mine.y.to_kind(Kind::Float), want.y.to_kind(Kind::Float));
            let off = ((&y - &y_want).abs() - y_want.abs() * 2f64.powi(-7)).max().double_value(&[]);
            assert!(off <= 1e-30, "y, {shape:?}");
            let bits = |t: &Tensor| host_bytes(t).unwrap();
            let c = DelayedCodes { codes: &codes, scale: &scale, amax: &amax, format: Fp8Format::E4M3 };
            let (own, own_amax) = (codes.empty_like(), amax.zeros_like());
            crate::fp8::stand_ins::write_delayed_codes(&mine.y, &DelayedCodes { codes: &own, amax: &own_amax, ..c });
            assert_eq!(bits(&codes), bits(&own), "codes, {shape:?}");
            assert_eq!(amax.double_value(&[0]), y.abs().max().double_value(&[]), "amax, {shape:?}");
        }
    }
}
