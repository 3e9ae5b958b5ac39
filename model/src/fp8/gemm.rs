//! FP8 GEMMs on torch's `_scaled_mm`: FP8 tensor cores on CUDA (sm_89 and newer), oneDNN on
//! the CPU. Both take FP8 codes and their per-tensor dequantisation scales, accumulate in f32
//! and write the output dtype asked for (bf16 for bf16 activations).
//!
//! What torch refuses on CUDA, checked before calling so that the run goes on: dimensions that
//! are not multiples of 16, two E5M2 operands, a first operand that is not row-major or a
//! second that is not column-major, a GPU without FP8 tensor cores (torch's error). Those GEMMs
//! fall back to f32 on the dequantised operands (the same values, so the same result up to
//! summation order), are counted ([`take_gemm_counts`], reported by `llora bench`), and the
//! first one is logged with its reason.
//!
//! On the CPU the GEMM takes whichever of `_scaled_mm` and the emulated recipe (the f32 GEMM of
//! the dequantised operands, the same values) a one-time probe measured faster, `_scaled_mm`
//! only when it is at least twice as fast, so that the choice cannot flip between runs on one
//! machine: on a Sapphire Rapids (AMX) CPU torch's CPU `_scaled_mm` ran at 0.04-0.06 GFLOP/s
//! against 17.6 for the f32 GEMM, which made an FP8 training step 300x slower than fp32.

use std::cell::Cell;
use std::sync::{Once, OnceLock};

use tch::{Kind, Tensor};

use crate::fp8::tensor::Fp8Tensor;
use crate::fp8::{Fp8Format, quantize_tch};

/// FP8 GEMMs run since the last [`take_gemm_counts`], by path.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GemmCounts {
    /// Through `_scaled_mm` (FP8 tensor cores on CUDA, oneDNN on the CPU).
    pub scaled_mm: usize,
    /// Emulated on the CPU by choice ([`cpu_path`]): the f32 GEMM of the dequantised operands.
    pub emulated: usize,
    /// Fallen back to f32 because `_scaled_mm` refused the operands (see the module doc).
    pub fallback: usize,
}

thread_local! {
    /// FP8 GEMMs on this thread. Per thread because a step's forward and backward run on the
    /// thread that calls them.
    static COUNTS: Cell<GemmCounts> = const { Cell::new(GemmCounts { scaled_mm: 0, emulated: 0, fallback: 0 }) };
}
static WARNED: Once = Once::new();

/// How FP8 GEMMs run on the CPU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CpuPath {
    /// torch's CPU `_scaled_mm`.
    ScaledMm,
    /// The f32 GEMM of the dequantised operands.
    Emulated,
}

impl CpuPath {
    /// The name `llora bench` reports.
    pub fn name(self) -> &'static str {
        match self {
            Self::ScaledMm => "_scaled_mm",
            Self::Emulated => "emulated (f32 GEMM of the dequantised operands)",
        }
    }
}

/// The CPU path and the probe's seconds for one 128³ GEMM: (path, `_scaled_mm`, emulated).
static CPU_PROBE: OnceLock<(CpuPath, f64, f64)> = OnceLock::new();

/// The CPU's FP8 GEMM path, measured once per process (best of 3 on a 128³ problem): which of
/// the two is faster differs by CPU (docs/performance.md, M3).
pub fn cpu_path() -> (CpuPath, f64, f64) {
    *CPU_PROBE.get_or_init(|| {
        let _guard = tch::no_grad_guard();
        // Values from no generator: the probe runs inside the first FP8 forward, and drawing
        // from torch's generator there would change that step's dropout masks.
        let r = |shift: i64| {
            Tensor::arange(128 * 128, (Kind::Float, tch::Device::Cpu))
                .g_add_scalar(shift as f64)
                .fmod(17.0)
                .reshape([128, 128])
                - 8.0
        };
        let a = quantize_tch(&r(0), 16.0, Fp8Format::E4M3);
        let w = quantize_tch(&r(5), 16.0, Fp8Format::E4M3);
        let (a, b) = (Fp8Tensor::host(a, 1.0 / 16.0), Fp8Tensor::host(w, 1.0 / 16.0).t());
        let (a, b) = (&a, &b);
        let best = |f: &dyn Fn() -> Option<Tensor>| {
            (0..3)
                .map(|_| {
                    let t = std::time::Instant::now();
                    f().map(|_| t.elapsed().as_secs_f64()).unwrap_or(f64::INFINITY)
                })
                .fold(f64::INFINITY, f64::min)
        };
        let t_scaled = best(&|| scaled_mm(a, b, Kind::BFloat16, false).ok());
        let t_emulated = best(&|| Some(emulated(a, b, Kind::BFloat16)));
        let path = if t_scaled * 2.0 <= t_emulated { CpuPath::ScaledMm } else { CpuPath::Emulated };
        tracing::debug!(path = path.name(), t_scaled, t_emulated, "CPU FP8 GEMM path");
        (path, t_scaled, t_emulated)
    })
}

/// The f32 GEMM of the dequantised operands, cast to `out`, `b` taken a column block at a time.
///
/// # Shapes
/// - a: `[m, k]`; b: `[k, n]`; output: `[m, n]`
fn emulated(a: &Fp8Tensor, b: &Fp8Tensor, out: Kind) -> Tensor {
    let x = a.dequantize();
    crate::precision::blocked::by_column_blocks(a.codes().size()[0], b.codes(), out, |blk| {
        x.f_matmul(&b.dequantize_part(blk)).map(|y| y.to_kind(out))
    })
    .expect("a GEMM of valid shapes")
}

/// FP8 GEMMs this thread ran since the last call, by path.
pub fn take_gemm_counts() -> GemmCounts {
    COUNTS.take()
}

fn count(f: impl FnOnce(&mut GemmCounts)) {
    let mut c = COUNTS.get();
    f(&mut c);
    COUNTS.set(c);
}

/// Why torch's CUDA `_scaled_mm` would refuse `a · b`, if it would (the CPU kernel takes any
/// shape and layout).
fn refused_on_cuda(a: &Tensor, b: &Tensor) -> Option<String> {
    let (sa, sb) = (a.size(), b.size());
    if sa.iter().chain(&sb).any(|n| n % 16 != 0) {
        return Some(format!("dimensions {sa:?} x {sb:?} are not all multiples of 16"));
    }
    if a.kind() == Kind::Float8e5m2 && b.kind() == Kind::Float8e5m2 {
        return Some("both operands are E5M2".into());
    }
    if a.stride()[1] != 1 || b.stride()[0] != 1 {
        return Some("the first operand must be row-major and the second column-major".into());
    }
    None
}

/// `(a · a.inv_scale) @ (b · b.inv_scale)` in `out`, accumulated in f32. `fast_accum` lets
/// Hopper accumulate in the tensor cores' reduced-precision accumulator between promotions
/// (Transformer Engine's choice for the forward GEMM; the gradient GEMMs do not).
///
/// # Shapes
/// - a: `[m, k]` FP8, row-major
/// - b: `[k, n]` FP8, column-major on CUDA (the transpose of a contiguous `[n, k]`)
/// - output: `[m, n]` in `out`
pub fn fp8_gemm(a: &Fp8Tensor, b: &Fp8Tensor, out: Kind, fast_accum: bool) -> Tensor {
    let device = a.codes().device();
    if device == tch::Device::Cpu && cpu_path().0 == CpuPath::Emulated {
        count(|c| c.emulated += 1);
        return emulated(a, b, out);
    }
    let refused = if device.is_cuda() { refused_on_cuda(a.codes(), b.codes()) } else { None };
    let refused = match refused {
        Some(why) => why,
        None => match scaled_mm(a, b, out, fast_accum) {
            Ok(y) => {
                count(|c| c.scaled_mm += 1);
                return y;
            }
            Err(e) => e.to_string(),
        },
    };
    count(|c| c.fallback += 1);
    WARNED.call_once(|| tracing::warn!("FP8 GEMM falls back to f32 on the dequantised operands: {refused}"));
    a.dequantize().matmul(&b.dequantize()).to_kind(out)
}

/// `_scaled_mm` itself, on column blocks of `b` on the CPU (its CPU kernel converts both
/// operands to f32: [`super::blocked`]).
fn scaled_mm(a: &Fp8Tensor, b: &Fp8Tensor, out: Kind, fast_accum: bool) -> Result<Tensor, tch::TchError> {
    let device = a.codes().device();
    let (sa, sb) = (a.inv_scale().on_device(device), b.inv_scale().on_device(device));
    let call =
        |b: &Tensor| a.codes().f_internal_scaled_mm(b, &sa, &sb, None::<Tensor>, None::<Tensor>, out, fast_accum);
    if device.is_cuda() {
        return call(b.codes());
    }
    crate::precision::blocked::by_column_blocks(a.codes().size()[0], b.codes(), out, call)
}

/// A layer's forward (E4M3 x E4M3) and input-gradient (E5M2 x E4M3) GEMMs on `device`, in the
/// layouts llora keeps, against the dequantised f32 GEMMs: neither may fall back, and each must
/// be within one bf16 rounding (1/128 of the largest value). For tests and `llora selftest`.
pub fn check_layer_gemms(device: tch::Device) -> Result<String, String> {
    let _guard = tch::no_grad_guard();
    let r = |shape: [i64; 2]| Tensor::randn(shape, (Kind::Float, device));
    let x = quantize_tch(&r([64, 128]), 16.0, Fp8Format::E4M3);
    let w = quantize_tch(&r([256, 128]), 64.0, Fp8Format::E4M3);
    let g = quantize_tch(&r([64, 256]), 1024.0, Fp8Format::E5M2);
    let _ = take_gemm_counts();
    let (xq, wq, gq) =
        (Fp8Tensor::host(x, 1.0 / 16.0), Fp8Tensor::host(w, 1.0 / 64.0), Fp8Tensor::host(g, 1.0 / 1024.0));
    let y = fp8_gemm(&xq, &wq.t(), Kind::BFloat16, true);
    let dx = fp8_gemm(&gq, &wq.col_major(), Kind::BFloat16, false);
    let counts = take_gemm_counts();
    if counts.fallback > 0 {
        return Err(format!("{} of 2 GEMMs fell back from _scaled_mm", counts.fallback));
    }
    let rel = |got: &Tensor, want: &Tensor| {
        let err = (got.to_kind(Kind::Float) - want).abs().max().double_value(&[]);
        err / want.abs().max().double_value(&[]).max(1e-30)
    };
    let wd = wq.dequantize();
    let ey = rel(&y, &xq.dequantize().matmul(&wd.tr()));
    let edx = rel(&dx, &gq.dequantize().matmul(&wd));
    if ey > 1.0 / 128.0 || edx > 1.0 / 128.0 {
        return Err(format!("relative error y {ey:.2e}, dx {edx:.2e} (bf16 output allows 7.8e-3)"));
    }
    let path = if counts.emulated > 0 { cpu_path().0.name() } else { "_scaled_mm" };
    Ok(format!("2 GEMMs on {path}; relative error y {ey:.2e}, dx {edx:.2e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `_scaled_mm` equals the f32 GEMM of the dequantised operands (f32 out: up to summation
    /// order; bf16 out: that rounded once), for E4M3 x E4M3 and E5M2 x E4M3 (the dx GEMM), a
    /// column-major second operand, and a shape CUDA would refuse.
    #[test]
    fn scaled_mm_equals_the_dequantised_gemm() {
        tch::manual_seed(5);
        // The last shape is cut into column blocks on the CPU.
        for (m, k, n) in
            [(32, 64, 48), (7, 33, 5), (4, 4096, 4097 + (crate::precision::blocked::BLOCK_ELEMENTS / 4096))]
        {
            for a_format in [Fp8Format::E4M3, Fp8Format::E5M2] {
                let a = quantize_tch(&Tensor::randn([m, k], (Kind::Float, tch::Device::Cpu)), 8.0, a_format);
                let w = quantize_tch(&Tensor::randn([n, k], (Kind::Float, tch::Device::Cpu)), 64.0, Fp8Format::E4M3);
                let (a, b) = (Fp8Tensor::host(a, 0.125), Fp8Tensor::host(w, 1.0 / 64.0).t());
                let (a, b) = (&a, &b);
                let want = a.dequantize().matmul(&b.dequantize());
                let scale = want.abs().max().double_value(&[]);
                // torch's CPU kernel itself, and the path `fp8_gemm` takes on this CPU.
                let direct = |out, fast| scaled_mm(a, b, out, fast).unwrap();
                let chosen = |out, fast| {
                    let _ = take_gemm_counts();
                    let y = fp8_gemm(a, b, out, fast);
                    let c = take_gemm_counts();
                    assert_eq!((c.scaled_mm + c.emulated, c.fallback), (1, 0), "{c:?}");
                    y
                };
                for (name, y) in [("_scaled_mm", direct(Kind::Float, false)), ("fp8_gemm", chosen(Kind::Float, false))]
                {
                    let err = (&y - &want).abs().max().double_value(&[]);
                    assert!(
                        err <= 1e-5 * scale,
                        "{name} {a_format:?} {m}x{k}x{n}: f32 out off by {err:e} of {scale:e}"
                    );
                }
                for (name, y) in
                    [("_scaled_mm", direct(Kind::BFloat16, true)), ("fp8_gemm", chosen(Kind::BFloat16, true))]
                {
                    assert_eq!(y.kind(), Kind::BFloat16);
                    let err = (y.to_kind(Kind::Float) - &want).abs().max().double_value(&[]);
                    assert!(
                        err <= scale / 256.0,
                        "{name} {a_format:?} {m}x{k}x{n}: bf16 out off by {err:e} of {scale:e}"
                    );
                }
            }
        }
    }

    /// The probe measured both CPU paths and picked `_scaled_mm` only where it is at least twice
    /// as fast as the emulation.
    #[test]
    fn the_cpu_path_is_never_slower_than_the_emulation() {
        let (path, t_scaled, t_emulated) = cpu_path();
        assert!(t_scaled > 0.0 && t_emulated > 0.0 && t_emulated.is_finite(), "{t_scaled} {t_emulated}");
        assert_eq!(path == CpuPath::ScaledMm, t_scaled * 2.0 <= t_emulated);
        eprintln!("CPU FP8 GEMM: {} (_scaled_mm {t_scaled:.2e} s, emulated {t_emulated:.2e} s)", path.name());
    }

    /// What CUDA refuses is named before calling it.
    #[test]
    fn cuda_refusals_are_named() {
        let codes = |r, c, f: Fp8Format| quantize_tch(&Tensor::ones([r, c], (Kind::Float, tch::Device::Cpu)), 1.0, f);
        let e4 = codes(32, 16, Fp8Format::E4M3);
        assert_eq!(refused_on_cuda(&e4, &e4.tr()), None);
        assert!(refused_on_cuda(&codes(8, 16, Fp8Format::E4M3), &e4.tr()).unwrap().contains("multiples of 16"));
        let e5 = codes(32, 16, Fp8Format::E5M2);
        assert!(refused_on_cuda(&codes(32, 32, Fp8Format::E5M2), &e5).unwrap().contains("E5M2"));
        assert!(refused_on_cuda(&e4.tr(), &e4.tr()).unwrap().contains("row-major"));
    }

    /// On a CUDA device: `_scaled_mm` runs (no fallback) on the layer's layouts and equals the
    /// dequantised GEMM.
    #[test]
    #[ignore = "needs CUDA"]
    fn scaled_mm_runs_on_cuda() {
        assert!(tch::Cuda::is_available(), "needs a CUDA device");
        let verdict = check_layer_gemms(tch::Device::Cuda(0));
        assert!(verdict.is_ok(), "{verdict:?}");
    }
}
