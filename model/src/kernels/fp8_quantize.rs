//! Launching `fp8_quantize.cu`: FP8 codes of a bf16 or f32 tensor, optionally its transpose,
//! and its amax, in one read of the input ([`quantize`]). The argument checks ([`check`]) run
//! anywhere; launching needs CUDA tensors (the CUDA test: `a_launch_equals_the_libtorch_route`;
//! status on GPUs: docs/gpu.md).

use std::ffi::c_void;

use super::launch::{MAX_GRID_YZ, THREADS, address, arg, ceil_div, grid_stride, launch as launch_kernel, target};
use super::nvrtc::{KernelError, Source};
use crate::fp8::format::Fp8Format;

/// The kernels' source.
pub const SOURCE: Source = Source {
    name: "fp8_quantize.cu",
    text: concat!(include_str!("fp8_device.cuh"), include_str!("fp8_quantize.cu")),
    kernels: &[
        "llora_fp8_quantize_f32",
        "llora_fp8_quantize_bf16",
        "llora_fp8_quantize_transpose_f32",
        "llora_fp8_quantize_transpose_bf16",
        "llora_fp8_amax_f32",
        "llora_fp8_amax_bf16",
        "llora_fp8_quantize_current_f32",
        "llora_fp8_quantize_current_bf16",
    ],
};

/// The transpose tile's side, as the source has it.
const TILE: i64 = 32;

/// What one quantisation reads and writes.
#[derive(Debug)]
pub struct QuantizeArgs<'a> {
    /// The input: f32 or bf16, contiguous.
    pub x: &'a tch::Tensor,
    /// The codes, `x`'s shape, in `format`'s dtype, contiguous.
    pub out: &'a tch::Tensor,
    /// The codes transposed (`x` 2-D `[rows, cols]`: `[cols, rows]`), when asked.
    pub out_t: Option<&'a tch::Tensor>,
    /// A one-element f32 tensor the amax of `x` is folded into (max with what it holds, which
    /// must be ≥ 0: zero it first for this tensor's amax alone).
    pub amax: Option<&'a tch::Tensor>,
    /// The scale (finite, > 0).
    pub scale: f32,
    /// E4M3 or E5M2.
    pub format: Fp8Format,
}

/// The kernel a valid [`QuantizeArgs`] launches, and its problem size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch {
    /// The kernel's name in [`SOURCE`].
    pub kernel: &'static str,
    /// `[rows, cols]` for the transposing kernel, `[1, n]` otherwise.
    pub dims: [i64; 2],
}

/// Checks what the kernel will read and write: dtypes, shapes, contiguity, scale; all on one
/// device. Runs on any device (the CPU tests check it); [`quantize`] also needs CUDA.
pub fn check(a: &QuantizeArgs<'_>) -> Result<Launch, KernelError> {
    let refuse = |what: String| KernelError::Arguments { kernel: "fp8_quantize", what };
    let fail = |what: String| Err(refuse(what));
    let bf16 = match a.x.kind() {
        tch::Kind::BFloat16 => true,
        tch::Kind::Float => false,
        other => return fail(format!("x is {other:?}: f32 or bf16 only")),
    };
    let contiguous = |name: &str, t: &tch::Tensor| -> Result<(), KernelError> {
        if t.is_contiguous() {
            Ok(())
        } else {
            Err(refuse(format!("{name} is not contiguous (strides {:?})", t.stride())))
        }
    };
    contiguous("x", a.x)?;
    contiguous("out", a.out)?;
    if a.out.kind() != a.format.kind() || a.out.size() != a.x.size() {
        return fail(format!(
            "out is {:?} {:?}: want {:?} {:?} (x's shape, the format's codes)",
            a.out.kind(),
            a.out.size(),
            a.format.kind(),
            a.x.size()
        ));
    }
    if !(a.scale.is_finite() && a.scale > 0.0) {
        return fail(format!("scale {} is not a finite number > 0", a.scale));
    }
    if let Some(amax) = a.amax
        && (amax.kind() != tch::Kind::Float || amax.numel() != 1 || amax.device() != a.x.device())
    {
        return fail(format!(
            "amax is {:?} {:?} on {:?}: want one f32 on x's device",
            amax.kind(),
            amax.size(),
            amax.device()
        ));
    }
    if a.out.device() != a.x.device() {
        return fail(format!("out is on {:?}, x on {:?}", a.out.device(), a.x.device()));
    }
    let suffix = if bf16 { "bf16" } else { "f32" };
    let Some(out_t) = a.out_t else {
        let kernel = if bf16 { "llora_fp8_quantize_bf16" } else { "llora_fp8_quantize_f32" };
        return Ok(Launch { kernel, dims: [1, a.x.numel() as i64] });
    };
    let [rows, cols] = a.x.size()[..] else { return fail(format!("a transpose needs a 2-D x, not {:?}", a.x.size())) };
    contiguous("out_t", out_t)?;
    if out_t.kind() != a.format.kind() || out_t.size() != [cols, rows] || out_t.device() != a.x.device() {
        return fail(format!(
            "out_t is {:?} {:?}: want {:?} [{cols}, {rows}] on x's device",
            out_t.kind(),
            out_t.size(),
            a.format.kind()
        ));
    }
    let kernel =
        if suffix == "bf16" { "llora_fp8_quantize_transpose_bf16" } else { "llora_fp8_quantize_transpose_f32" };
    // One block per tile: rows of tiles on the grid's y, which CUDA caps.
    if ceil_div(rows, TILE) > MAX_GRID_YZ || ceil_div(cols, TILE) > i64::from(i32::MAX) {
        return fail(format!(
            "a transpose of [{rows}, {cols}] needs a grid of {} x {} tiles: CUDA takes at most {MAX_GRID_YZ} in y",
            ceil_div(cols, TILE),
            ceil_div(rows, TILE)
        ));
    }
    Ok(Launch { kernel, dims: [rows, cols] })
}

/// What current scaling reads and writes: the codes at `fp8_max / amax(x)` (1 where the amax
/// is zero or not finite), the scale computed on the device.
#[derive(Debug)]
pub struct CurrentArgs<'a> {
    /// The input: f32 or bf16, contiguous.
    pub x: &'a tch::Tensor,
    /// The codes, `x`'s shape, in `format`'s dtype, contiguous.
    pub out: &'a tch::Tensor,
    /// One f32: x's amax, written (a scratch the passes share).
    pub amax: &'a tch::Tensor,
    /// One f32: `1 / scale`, written.
    pub scale_inv: &'a tch::Tensor,
    /// E4M3 or E5M2.
    pub format: Fp8Format,
}

/// Checks current scaling's arguments: those of [`check`] for x and out, and the two scalars.
pub fn check_current(a: &CurrentArgs<'_>) -> Result<&'static str, KernelError> {
    let plain = QuantizeArgs { x: a.x, out: a.out, out_t: None, amax: Some(a.amax), scale: 1.0, format: a.format };
    let kernel = if check(&plain)?.kernel.ends_with("bf16") {
        "llora_fp8_quantize_current_bf16"
    } else {
        "llora_fp8_quantize_current_f32"
    };
    let e = super::args::Expect { kernel, device: a.x.device(), shape: &[1] };
    e.tensor("amax", a.amax, tch::Kind::Float, None)?;
    let inv = a.scale_inv;
    if inv.kind() != tch::Kind::Float || inv.numel() != 1 || inv.device() != a.x.device() {
        let what =
            format!("scale_inv is {:?} {:?} on {:?}: want one f32 on x's device", inv.kind(), inv.size(), inv.device());
        return Err(KernelError::Arguments { kernel, what });
    }
    Ok(kernel)
}

/// Current scaling on x's CUDA device in two launches (the amax, then the codes), on the
/// default stream, nothing read back: `Ok(true)`. `Ok(false)` for a CPU tensor: nothing
/// launched, the caller runs the stand-in (`fp8::stand_ins`).
pub fn quantize_current(a: &CurrentArgs<'_>) -> Result<bool, KernelError> {
    current_launches(a, false)
}

/// [`quantize_current`] with `a.amax` already holding x's amax (taken by the op that wrote x):
/// the codes' launch alone.
pub fn quantize_current_at_amax(a: &CurrentArgs<'_>) -> Result<bool, KernelError> {
    current_launches(a, true)
}

/// [`quantize_current`]'s launches, the amax's left out where `amax_known`.
fn current_launches(a: &CurrentArgs<'_>, amax_known: bool) -> Result<bool, KernelError> {
    let kernel = check_current(a)?;
    let Some(at) = target(a.x, kernel)? else { return Ok(false) };
    let mut n = a.x.numel() as i64;
    if n == 0 {
        let _ = a.scale_inv.shallow_clone().fill_(1.0);
        return Ok(true);
    }
    let blocks = grid_stride(n);
    let (mut x, mut out, mut amax, mut inv) =
        (address(Some(a.x)), address(Some(a.out)), address(Some(a.amax)), address(Some(a.scale_inv)));
    if !amax_known {
        let _ = a.amax.shallow_clone().zero_();
        let amax_kernel = if kernel.ends_with("bf16") { "llora_fp8_amax_bf16" } else { "llora_fp8_amax_f32" };
        // SAFETY: (x, amax bits, n) as the amax kernel takes them; checked above.
        unsafe {
            launch_kernel(&SOURCE, at, amax_kernel, blocks, THREADS, &mut [arg(&mut x), arg(&mut amax), arg(&mut n)])?
        };
    }
    let (mut limit, mut e5m2) = (a.format.max(), i32::from(a.format == Fp8Format::E5M2));
    let mut p =
        [arg(&mut x), arg(&mut out), arg(&mut amax), arg(&mut inv), arg(&mut n), arg(&mut limit), arg(&mut e5m2)];
    // SAFETY: the current-scaling kernel's parameters in order and type; checked above.
    unsafe { launch_kernel(&SOURCE, at, kernel, blocks, THREADS, &mut p)? };
    Ok(true)
}

/// Quantises as `a` says on its CUDA device, on the device's default stream (LibTorch's
/// current stream: llora never sets another), without waiting for it: `Ok(true)`. `Ok(false)`
/// for a CPU tensor: nothing launched, the caller runs the stand-in (`fp8::stand_ins`).
pub fn quantize(a: &QuantizeArgs<'_>) -> Result<bool, KernelError> {
    let launch = check(a)?;
    let Some(at) = target(a.x, launch.kernel)? else { return Ok(false) };
    let [rows, cols] = launch.dims;
    if rows * cols == 0 {
        return Ok(true);
    }
    let (mut x, mut out, mut out_t, mut amax) =
        (address(Some(a.x)), address(Some(a.out)), address(a.out_t), address(a.amax));
    let (mut scale, mut max, mut e5m2) = (a.scale, a.format.max(), i32::from(a.format == Fp8Format::E5M2));
    let (mut rows, mut cols, mut n) = (rows, cols, rows * cols);
    let (grid, mut params): ((u32, u32, u32), Vec<*mut c_void>) = if a.out_t.is_some() {
        let grid = (ceil_div(cols, TILE) as u32, ceil_div(rows, TILE) as u32, 1);
        let p = vec![arg(&mut x), arg(&mut out), arg(&mut out_t), arg(&mut amax), arg(&mut rows), arg(&mut cols)];
        (grid, p)
    } else {
        (grid_stride(n), vec![arg(&mut x), arg(&mut out), arg(&mut amax), arg(&mut n)])
    };
    params.extend([arg(&mut scale), arg(&mut max), arg(&mut e5m2)]);
    // SAFETY: the arguments match the kernel's signature in order and type (checked above:
    // dtypes, shapes, contiguity, one device), and the tensors outlive the launch's enqueue.
    unsafe { launch_kernel(&SOURCE, at, launch.kernel, grid, THREADS, &mut params)? };
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::args::host_bytes;
    use tch::{Kind, Tensor};

    fn args<'a>(x: &'a Tensor, out: &'a Tensor) -> QuantizeArgs<'a> {
        QuantizeArgs { x, out, out_t: None, amax: None, scale: 2.0, format: Fp8Format::E4M3 }
    }

    fn refused_current(a: CurrentArgs<'_>, word: &str) {
        match check_current(&a) {
            Err(KernelError::Arguments { what, .. }) => assert!(what.contains(word), "{what}"),
            other => panic!("expected a refusal naming {word}, got {other:?}"),
        }
    }

    /// Valid arguments pick the kernel by dtype and transpose; each wrong argument is refused
    /// naming it: dtype, shape, contiguity, the transpose's shape, the amax, the scale.
    #[test]
    fn the_launch_checks_name_each_wrong_argument() {
        let cpu = (Kind::Float, tch::Device::Cpu);
        let x = Tensor::zeros([3, 5], cpu);
        let codes = |shape: &[i64]| Tensor::zeros(shape, (Fp8Format::E4M3.kind(), tch::Device::Cpu));
        let (out, out_t) = (codes(&[3, 5]), codes(&[5, 3]));
        assert_eq!(check(&args(&x, &out)).unwrap(), Launch { kernel: "llora_fp8_quantize_f32", dims: [1, 15] });
        let xb = x.to_kind(Kind::BFloat16);
        let t = check(&QuantizeArgs { out_t: Some(&out_t), ..args(&xb, &out) }).unwrap();
        assert_eq!(t, Launch { kernel: "llora_fp8_quantize_transpose_bf16", dims: [3, 5] });
        let refused = |a: QuantizeArgs<'_>, word: &str| match check(&a) {
            Err(KernelError::Arguments { what, .. }) => assert!(what.contains(word), "{what}"),
            other => panic!("expected a refusal naming {word}, got {other:?}"),
        };
        let half = x.to_kind(Kind::Half);
        refused(args(&half, &out), "x is Half");
        refused(args(&x, &codes(&[15])), "out is");
        refused(args(&x, &Tensor::zeros([3, 5], cpu)), "out is Float");
        let strided = Tensor::zeros([5, 3], cpu).tr();
        refused(args(&strided, &out), "x is not contiguous");
        refused(QuantizeArgs { out_t: Some(&out), ..args(&x, &out) }, "out_t is");
        let flat = Tensor::zeros([15], cpu);
        refused(QuantizeArgs { out_t: Some(&out_t), ..args(&flat, &codes(&[15])) }, "2-D");
        let wide = Tensor::zeros([2], cpu);
        refused(QuantizeArgs { amax: Some(&wide), ..args(&x, &out) }, "amax");
        // One row of tiles past CUDA's grid y.
        let (tall, rows) = (Tensor::zeros([65535 * 32 + 1, 1], cpu), 65535 * 32 + 1);
        let (tall_out, tall_t) = (codes(&[rows, 1]), codes(&[1, rows]));
        refused(QuantizeArgs { out_t: Some(&tall_t), ..args(&tall, &tall_out) }, "at most 65535 in y");
        let fits = Tensor::zeros([65535 * 32, 1], cpu);
        let (fits_out, fits_t) = (codes(&[65535 * 32, 1]), codes(&[1, 65535 * 32]));
        assert!(check(&QuantizeArgs { out_t: Some(&fits_t), ..args(&fits, &fits_out) }).is_ok());
        refused(QuantizeArgs { scale: 0.0, ..args(&x, &out) }, "scale");
        refused(QuantizeArgs { scale: f32::NAN, ..args(&x, &out) }, "scale");
        let one = Tensor::zeros([1], cpu);
        let current = |amax, scale_inv| CurrentArgs { x: &x, out: &out, amax, scale_inv, format: Fp8Format::E4M3 };
        assert_eq!(check_current(&current(&one, &one)).unwrap(), "llora_fp8_quantize_current_f32");
        refused_current(current(&wide, &one), "amax");
        refused_current(current(&one, &wide), "scale_inv");
        // CPU tensors pass the checks but never reach a launch: nothing is written.
        let ones = Tensor::ones([3, 5], cpu);
        assert_eq!(quantize(&args(&ones, &out)), Ok(false));
        assert_eq!(quantize_current(&current(&one, &Tensor::zeros([], cpu))), Ok(false));
        assert_eq!(out.to_kind(Kind::Float).abs().max().double_value(&[]), 0.0, "a CPU launch wrote codes");
    }

    /// The kernel against LibTorch's route (`quantize_via_f32`'s arithmetic: scale in f32,
    /// clamp, cast) bit for bit, codes, transpose and amax, over edge values (NaN, ±inf, past
    /// the clamp, denormals, zeros) at odd sizes, both formats, both input dtypes.
    #[test]
    #[ignore = "needs CUDA"]
    fn a_launch_equals_the_libtorch_route() {
        assert!(tch::Cuda::is_available(), "this test needs a CUDA device");
        let dev = tch::Device::Cuda(0);
        for (rows, cols) in [(1, 1), (7, 33), (129, 65), (1000, 3)] {
            let x = Tensor::randn([rows, cols], (Kind::Float, dev)) * 300.0;
            let edges = [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 1e6, -1e6, 1e-40, -1e-45, 0.0];
            let flat = x.view([-1]);
            for (i, v) in edges.iter().enumerate().take((rows * cols) as usize) {
                let _ = flat.get(i as i64).fill_(*v);
            }
            for kind in [Kind::Float, Kind::BFloat16] {
                for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
                    let xk = x.to_kind(kind);
                    let scale = 0.75f32;
                    let want = (xk.to_kind(Kind::Float) * f64::from(scale))
                        .clamp(-f64::from(format.max()), f64::from(format.max()))
                        .to_kind(format.kind());
                    let out = Tensor::empty([rows, cols], (format.kind(), dev));
                    let out_t = Tensor::empty([cols, rows], (format.kind(), dev));
                    let amax = Tensor::zeros([1], (Kind::Float, dev));
                    quantize(&QuantizeArgs {
                        x: &xk,
                        out: &out,
                        out_t: Some(&out_t),
                        amax: Some(&amax),
                        scale,
                        format,
                    })
                    .unwrap();
                    let bits = |t: &Tensor| host_bytes(t).unwrap();
                    let what = format!("{rows}x{cols} {kind:?} {format:?}");
                    assert_eq!(bits(&out), bits(&want), "codes, {what}");
                    assert_eq!(bits(&out_t), bits(&want.tr().contiguous()), "transposed codes, {what}");
                    let (cur, cur_want) = (out.empty_like(), out.empty_like());
                    let scratch = || (Tensor::zeros([1], (Kind::Float, dev)), Tensor::zeros([1], (Kind::Float, dev)));
                    let ((a1, i1), (a2, i2)) = (scratch(), scratch());
                    let finite = xk.nan_to_num(0.0, 0.0, 0.0);
                    quantize_current(&CurrentArgs { x: &finite, out: &cur, amax: &a1, scale_inv: &i1, format })
                        .unwrap();
                    crate::fp8::stand_ins::quantize::current(&CurrentArgs {
                        x: &finite,
                        out: &cur_want,
                        amax: &a2,
                        scale_inv: &i2,
                        format,
                    });
                    assert_eq!(bits(&cur), bits(&cur_want), "current-scaling codes, {what}");
                    assert_eq!(bits(&i1), bits(&i2), "current scaling's inverse scale, {what}");
                    let want_amax = xk.to_kind(Kind::Float).abs().max().double_value(&[]);
                    let got = amax.double_value(&[0]);
                    assert!(
                        got == want_amax || (got.is_nan() && want_amax.is_nan()),
                        "amax {got} vs {want_amax}, {what}"
                    );
                }
            }
        }
    }
}
