//! Quantisation: a tensor to FP8 codes at a scale (given on the host, or its own amax's on the
//! device: current scaling), back to f32, and amaxes. Each call takes the fastest route its
//! device passed the first-use check of (our NVRTC kernel, LibTorch's two passes, or through an
//! f32 copy: the same codes), and is counted by route ([`take_quantiser_counts`]).
//!
//! Quantising with a scale saturates first, as Transformer Engine does: `q = cast(clamp(x·s,
//! ±max))`, and `x ≈ float(q) · (1/s)`.

use super::format::Fp8Format;
use crate::kernels::KernelError;
use crate::kernels::args::host_bytes;
use crate::kernels::fp8_quantize::{self, CurrentArgs, QuantizeArgs};

/// Saturating quantisation on a LibTorch tensor: `clamp(x·scale, ±max)` cast to the 1-byte
/// dtype of `format` (NaN stays NaN).
///
/// On CUDA, for f32 and bf16 inputs, in two passes with no f32 temporary ([`quantize_clamped`],
/// once [`cuda_routes_checked`]); otherwise cast to f32, scale, clamp and cast (four passes; on
/// the CPU the faster: its two-pass route runs through temporaries and scalar cast loops). Both
/// give the same codes. Each call is counted by route ([`take_quantiser_counts`]).
pub fn quantize_tch(x: &tch::Tensor, scale: f32, format: Fp8Format) -> tch::Tensor {
    through_routes(
        x,
        kernel_route(x).then_some(|| quantize_kernel(x, scale, format, None)),
        || quantize_clamped(x, Scale::Host(scale), format),
        || quantize_via_f32(x, Scale::Host(scale), format),
    )
}

/// The quantiser's route chain, written once: `kernel` (our kernel, where `x` takes it) unless
/// it fails, else LibTorch's two passes where `x`'s device passed their check and they run,
/// else through an f32 copy. All give the same codes; the route taken is counted.
fn through_routes<T>(
    x: &tch::Tensor,
    kernel: Option<impl FnOnce() -> Result<T, KernelError>>,
    two_pass: impl FnOnce() -> Result<T, tch::TchError>,
    via_f32: impl FnOnce() -> T,
) -> T {
    match kernel.map(|k| k()) {
        Some(Ok(done)) => {
            count(Route::Kernel);
            return done;
        }
        Some(Err(e)) => tracing::warn!("our FP8 quantise kernel failed, the LibTorch route runs: {e}"),
        None => {}
    }
    if two_pass_route(x)
        && let Ok(done) = two_pass()
    {
        count(Route::TwoPass);
        return done;
    }
    count(Route::ViaF32);
    via_f32()
}

/// [`quantize_tch`] and `x`'s amax (a 0-dim f32 tensor, as [`amax_on_device`]): in one read
/// of `x` on our kernel where it runs, else the amax and then the quantiser's route.
pub fn quantize_and_amax(x: &tch::Tensor, scale: f32, format: Fp8Format) -> (tch::Tensor, tch::Tensor) {
    if kernel_route(x) && x.numel() > 0 {
        let amax = tch::Tensor::zeros([1], (tch::Kind::Float, x.device()));
        if let Ok(out) = quantize_kernel(x, scale, format, Some(&amax)) {
            count(Route::Kernel);
            return (out, amax.reshape([] as [i64; 0]));
        }
    }
    let amax = amax_on_device(x);
    (quantize_tch(x, scale, format), amax)
}

/// [`quantize_tch`] on our kernel (`kernels/fp8_quantize.cu`): one read of x, no temporary;
/// with `amax` (`[1]` f32, zeroed), x's amax folded into it in the same read.
fn quantize_kernel(
    x: &tch::Tensor,
    scale: f32,
    format: Fp8Format,
    amax: Option<&tch::Tensor>,
) -> Result<tch::Tensor, KernelError> {
    let x = x.contiguous();
    let out = tch::Tensor::empty(x.size(), (format.kind(), x.device()));
    let args = QuantizeArgs { x: &x, out: &out, out_t: None, amax, scale, format };
    if !fp8_quantize::quantize(&args)? {
        super::stand_ins::quantize::delayed(&args);
    }
    Ok(out)
}

/// What our quantise kernel's first-use check is called, in logs and in `llora selftest`.
pub const KERNEL_CHECK: &str = "FP8 quantise kernel (ours, NVRTC)";

crate::routes::declare_route! {
    /// The verdict of [`check_kernel`] per device.
    static KERNEL: Verdicts<tch::Device> = &crate::routes::RouteSpec {
        name: KERNEL_CHECK,
        fallback: "the LibTorch quantiser runs",
        order: 20,
        part: "gemm",
        self_tests: &[crate::routes::SelfTest {
            name: KERNEL_CHECK,
            check: kernel_checked_on,
            passed: "codes, transpose and amax equal the f32 route's, bit for bit",
        }],
        counts_uses: false,
    };
}

/// Whether `x` takes our quantise kernel: f32 or bf16 on a device taking the CUDA routes (with
/// `LLORA_CUDA_FUSED_ROUTES` on) where the kernel passed [`check_kernel`] (once per device).
fn kernel_route(x: &tch::Tensor) -> bool {
    let device = x.device();
    matches!(x.kind(), tch::Kind::Float | tch::Kind::BFloat16)
        && crate::routes::takes_cuda_routes(device)
        && crate::routes::fused_routes()
        && KERNEL.passed(device, || check_kernel(device))
}

/// The values the first-use checks quantise (4103 f32s on the host): 4096 spread over
/// ±40 at a step no power of two divides, then NaN, ±∞, ±1e30 (past any clamp) and ±0.
fn check_values() -> tch::Tensor {
    let mut xs: Vec<f32> = (0..4096).map(|i| ((i * 7919) % 4001) as f32 / 50.0 - 40.0).collect();
    xs.extend([f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1e30, -1e30, 0.0, -0.0]);
    tch::Tensor::from_slice(&xs)
}

/// [`check_kernel`] on `device` once per process, its result kept (`llora selftest`).
pub fn kernel_checked_on(device: tch::Device) -> Result<(), String> {
    KERNEL.check(device, || check_kernel(device))
}

/// Checks our quantise kernel against the f32 route bit for bit on `device`: codes, their
/// transpose and the amax of bf16 and f32 inputs holding values past the clamp bound, NaN,
/// ±∞ and zeros of both signs, in both formats, at a size that is no multiple of a block.
/// Calls the kernel and the f32 route directly, never [`quantize_tch`] (no route re-entered).
pub fn check_kernel(device: tch::Device) -> Result<(), String> {
    let _guard = tch::no_grad_guard();
    let host = check_values().view([11, 373]);
    for kind in [tch::Kind::BFloat16, tch::Kind::Float] {
        let x = host.to_kind(kind).to_device(device);
        for (format, scale) in [(Fp8Format::E4M3, 3.7f32), (Fp8Format::E5M2, 1.0 / 64.0)] {
            let what = format!("{kind:?} {format:?}");
            let (out, out_t) = (x.empty_like().to_kind(format.kind()), x.tr().contiguous().to_kind(format.kind()));
            let amax = tch::Tensor::zeros([1], (tch::Kind::Float, device));
            let args = QuantizeArgs { x: &x, out: &out, out_t: Some(&out_t), amax: Some(&amax), scale, format };
            if !fp8_quantize::quantize(&args).map_err(|e| format!("{what}: {e}"))? {
                super::stand_ins::quantize::delayed(&args);
            }
            let want = quantize_via_f32(&x, Scale::Host(scale), format);
            if host_bytes(&out) != host_bytes(&want) || host_bytes(&out_t) != host_bytes(&want.tr().contiguous()) {
                return Err(format!("{what}: codes differ from the f32 route"));
            }
            let (got, reference) = (amax.double_value(&[0]), amax_abs_max(&x).double_value(&[]));
            if got.to_bits() != reference.to_bits() && !(got.is_nan() && reference.is_nan()) {
                return Err(format!("{what}: amax {got} against {reference}"));
            }
            check_current_kernel(&x, format).map_err(|e| format!("{what}, current scaling: {e}"))?;
        }
    }
    Ok(())
}

/// Current scaling on our kernels against the f32 route with the scale computed as
/// [`current_scale`] does: codes and inverse scale bit for bit, on x as given, on x without
/// its NaN (a finite amax: scale ≠ 1) and on zeros (scale 1); also the codes' launch alone at
/// an amax handed over (its writer's: [`quantize_current_at_amax`]).
fn check_current_kernel(x: &tch::Tensor, format: Fp8Format) -> Result<(), String> {
    let finite = x.nan_to_num(0.0, 0.0, 0.0);
    for x in [x.shallow_clone(), finite.shallow_clone(), finite.zeros_like()] {
        let (codes, scale_inv) = quantize_current_kernel(&x, format, None).map_err(|e| e.to_string())?;
        let (scale, want_inv) = current_scale(&x, format);
        let want = quantize_via_f32(&x, Scale::Device { s: &scale, inv: &want_inv }, format);
        let given = amax_on_device(&x).reshape([1]);
        let (at_codes, at_inv) = quantize_current_kernel(&x, format, Some(&given)).map_err(|e| e.to_string())?;
        let same = |a: &tch::Tensor, b: &tch::Tensor| host_bytes(a) == host_bytes(b);
        if !same(&codes, &want) || !same(&scale_inv, &want_inv) || !same(&at_codes, &want) || !same(&at_inv, &want_inv)
        {
            return Err(format!(
                "codes or inverse scale differ from the f32 route (amax {})",
                amax_abs_max(&x).double_value(&[])
            ));
        }
    }
    Ok(())
}

/// FP8 quantisations since the last [`take_quantiser_counts`], by route.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct QuantiserCounts {
    /// On our kernel (one read, no temporary).
    pub kernel: usize,
    /// Through the two-pass route (clamp in the input's dtype, one multiply stored as FP8).
    pub two_pass: usize,
    /// Through an f32 copy (cast, scale, clamp, cast).
    pub via_f32: usize,
    /// Of those, current scalings at the amax their input's writer took (no amax pass).
    pub at_writers_amax: usize,
}

impl QuantiserCounts {
    /// The routes taken, by name (`llora bench` reports them per step).
    pub fn routes(self) -> Vec<&'static str> {
        let mut out = Vec::new();
        if self.kernel > 0 {
            out.push("kernel");
        }
        if self.two_pass > 0 {
            out.push("two-pass");
        }
        if self.via_f32 > 0 {
            out.push("f32");
        }
        out
    }
}

thread_local! {
    /// This thread's quantisations (a step's forward and backward run on the thread calling them).
    static QUANTISED: std::cell::Cell<QuantiserCounts> =
        const { std::cell::Cell::new(QuantiserCounts { kernel: 0, two_pass: 0, via_f32: 0, at_writers_amax: 0 }) };
}

/// The quantisers, as [`QuantiserCounts`] counts them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Route {
    Kernel,
    TwoPass,
    ViaF32,
}

fn count(route: Route) {
    QUANTISED.with(|c| {
        let mut n = c.get();
        match route {
            Route::Kernel => n.kernel += 1,
            Route::TwoPass => n.two_pass += 1,
            Route::ViaF32 => n.via_f32 += 1,
        }
        c.set(n);
    });
}

/// This thread's quantisations by route since the last call, and resets them.
pub fn take_quantiser_counts() -> QuantiserCounts {
    QUANTISED.with(|c| c.replace(QuantiserCounts::default()))
}

/// Whether `x` takes the two-pass quantiser: f32 or bf16 on a device whose routes passed.
fn two_pass_route(x: &tch::Tensor) -> bool {
    matches!(x.kind(), tch::Kind::Float | tch::Kind::BFloat16) && cuda_routes_checked(x.device())
}

/// What the FP8 routes' check is called, in logs and in `llora selftest`.
pub const CUDA_ROUTES_CHECK: &str = "FP8 two-pass quantiser and one-pass amax";

crate::routes::declare_route! {
    /// The verdict of [`check_cuda_routes`] per device.
    static CUDA_ROUTES: Verdicts<tch::Device> = &crate::routes::RouteSpec {
        name: CUDA_ROUTES_CHECK,
        fallback: "the f32 route runs",
        order: 10,
        part: "gemm",
        self_tests: &[crate::routes::SelfTest {
            name: CUDA_ROUTES_CHECK,
            check: cuda_routes_checked_on,
            passed: "codes and amaxes equal the f32 route's, bit for bit",
        }],
        counts_uses: false,
    };
}

/// Whether `device` takes the CUDA routes ([`crate::routes::takes_cuda_routes`]) and its
/// two-pass quantiser and one-pass amax passed [`check_cuda_routes`] there (run once per
/// device, logged either way). The check quantises, which asks this again: it gets `false`,
/// the f32 route it compares with.
pub fn cuda_routes_checked(device: tch::Device) -> bool {
    crate::routes::takes_cuda_routes(device)
        && crate::routes::fused_routes()
        && CUDA_ROUTES.passed(device, || check_cuda_routes(device))
}

/// [`check_cuda_routes`] on `device` once per process, its result kept (`llora selftest` reports
/// it; training asks [`cuda_routes_checked`]).
pub fn cuda_routes_checked_on(device: tch::Device) -> Result<(), String> {
    CUDA_ROUTES.check(device, || check_cuda_routes(device))
}

/// Checks the two-pass quantiser ([`quantize_clamped`]) against the f32 route bit for bit on
/// `device`, for bf16 and f32 inputs holding values past the clamp bound, NaN and ±∞, in both
/// formats; and the ∞-norm amax against `abs().max()` (NaN and ∞ included).
pub fn check_cuda_routes(device: tch::Device) -> Result<(), String> {
    let _guard = tch::no_grad_guard();
    let host = check_values();
    for kind in [tch::Kind::BFloat16, tch::Kind::Float] {
        let x = host.to_kind(kind).to_device(device);
        for (format, scale) in [(Fp8Format::E4M3, 3.7f32), (Fp8Format::E5M2, 1.0 / 64.0)] {
            let fast = quantize_clamped(&x, Scale::Host(scale), format)
                .map_err(|e| format!("two-pass {kind:?} {format:?}: {e}"))?;
            let want = quantize_via_f32(&x, Scale::Host(scale), format);
            if fast.kind() != format.kind() || host_bytes(&fast) != host_bytes(&want) {
                return Err(format!("two-pass {kind:?} {format:?}: codes differ from the f32 route"));
            }
        }
        for probe in [x.narrow(0, 0, 4096), x.narrow(0, 4096, 7)] {
            let (scale, scale_inv) = current_scale(&probe, Fp8Format::E4M3);
            let on_device = Scale::Device { s: &scale, inv: &scale_inv };
            let fast = quantize_clamped(&probe, on_device, Fp8Format::E4M3)
                .map_err(|e| format!("two-pass current scaling {kind:?}: {e}"))?;
            if host_bytes(&fast) != host_bytes(&quantize_via_f32(&probe, on_device, Fp8Format::E4M3)) {
                return Err(format!("two-pass current scaling {kind:?}: codes differ from the f32 route"));
            }
        }
        for probe in [x.shallow_clone(), x.narrow(0, 0, 4096), x.narrow(0, 4097, 3)] {
            let (got, want) = (amax_norm(&probe).double_value(&[]), amax_abs_max(&probe).double_value(&[]));
            if got.to_bits() != want.to_bits() && !(got.is_nan() && want.is_nan()) {
                return Err(format!("one-pass amax {kind:?}: {got} against {want}"));
            }
        }
    }
    Ok(())
}

/// A per-tensor scale `s` (codes = x·s): known on the host (delayed scaling), or as 0-dim f32
/// tensors `s` and `1/s` on x's device (current scaling: never read back).
#[derive(Clone, Copy)]
enum Scale<'a> {
    Host(f32),
    Device { s: &'a tch::Tensor, inv: &'a tch::Tensor },
}

/// [`quantize_tch`] as two passes: x clamped to `±max/s` in its own dtype, then one multiply
/// that reads it, scales it in f32 (the scale is a 1-element f32 tensor, so the multiply's
/// common dtype is f32) and stores the product cast to FP8: on CUDA one kernel
/// (TensorIterator casts as it stores), on the CPU through an f32 temporary. The codes are the
/// f32 route's bit for bit: an unclamped value gives the same f32 product; a clamped one gives
/// the bound rounded to x's dtype (within 2⁻⁹) times the scale, within 2⁻⁸ of ±max, which both
/// formats round to ±max, as the f32 route's saturated value; NaN stays NaN.
fn quantize_clamped(x: &tch::Tensor, scale: Scale<'_>, format: Fp8Format) -> Result<tch::Tensor, tch::TchError> {
    let max = f64::from(format.max());
    let out = tch::Tensor::f_empty(x.size(), (format.kind(), x.device()))?;
    match scale {
        Scale::Host(s) => {
            let bound = max / f64::from(s);
            let s = tch::Tensor::f_full([1], f64::from(s), (tch::Kind::Float, x.device()))?;
            x.f_clamp(-bound, bound)?.f_mul_out(&out, &s)
        }
        Scale::Device { s, inv } => {
            let bound = inv.f_mul_scalar(max)?;
            let clamped = x.f_clamp_tensor(Some(&bound.f_neg()?), Some(&bound))?;
            clamped.f_mul_out(&out, &s.f_view([1])?)
        }
    }
}

/// [`quantize_tch`] through an f32 copy: cast, scale, clamp, cast.
fn quantize_via_f32(x: &tch::Tensor, scale: Scale<'_>, format: Fp8Format) -> tch::Tensor {
    let max = f64::from(format.max());
    // One f32 temporary, scaled and clamped in place (a 70B MLP weight is 0.94 GB in f32), and
    // never x itself: `to_kind` of an f32 tensor to f32 is that tensor. A bf16 input is scaled
    // in f32: scaling in bf16 would round once before the FP8 cast rounds again.
    let mut scaled = match (x.kind() == tch::Kind::Float, scale) {
        (true, Scale::Host(s)) => x * f64::from(s),
        (true, Scale::Device { s, .. }) => x * s,
        (false, scale) => {
            let mut t = x.to_kind(tch::Kind::Float);
            let _ = match scale {
                Scale::Host(s) => t.g_mul_scalar_(f64::from(s)),
                Scale::Device { s, .. } => t.g_mul_(s),
            };
            t
        }
    };
    let _ = scaled.clamp_(-max, max);
    scaled.to_kind(format.kind())
}

/// An inverse scale `1/s` that codes are multiplied by: an f32 on the host (delayed scaling)
/// or a 0-dim f32 tensor on the codes' device (current scaling).
pub trait ScaleInv {
    /// `x · self`, in place.
    fn scale_in_place(&self, x: &mut tch::Tensor);
}

impl ScaleInv for f32 {
    fn scale_in_place(&self, x: &mut tch::Tensor) {
        let _ = x.g_mul_scalar_(f64::from(*self));
    }
}

impl ScaleInv for &tch::Tensor {
    fn scale_in_place(&self, x: &mut tch::Tensor) {
        let _ = x.g_mul_(self);
    }
}

/// `float(q) · scale_inv` in f32.
///
/// # Shapes
/// - q: any, FP8 codes; output: as q, f32
pub fn dequantize(q: &tch::Tensor, scale_inv: impl ScaleInv) -> tch::Tensor {
    // In place on the f32 copy (a second one would double a weight's peak); codes are never
    // f32, so the copy is never q itself.
    let mut x = q.to_kind(tch::Kind::Float);
    scale_inv.scale_in_place(&mut x);
    x
}

/// Current scaling without reading anything back: `x` quantised with `max / amax(x)` (1 where
/// the amax is zero or not finite, as [`super::scale_for_amax`] with margin 0), the scale
/// computed on the device. Returns the codes and `1 / scale` as a 0-dim f32 tensor on `x`'s
/// device: the same f32 arithmetic as quantising with the scale `scale_for_amax` gives the
/// amax read back ([`amax_tch`]), so the same codes.
pub fn quantize_current_on_device(x: &tch::Tensor, format: Fp8Format) -> (tch::Tensor, tch::Tensor) {
    current_through_routes(x, format, None)
}

/// [`quantize_current_on_device`] with `x`'s amax (`[1]` f32 on x's device, ≥ 0 or NaN)
/// taken by the op that wrote `x` (the adapters' dropout on our kernel): no amax pass of its
/// own. The same codes and inverse scale as [`quantize_current_on_device`] (the same amax;
/// under a context-parallel amax group it is reduced over the group first, as there).
pub fn quantize_current_at_amax(x: &tch::Tensor, amax: &tch::Tensor, format: Fp8Format) -> (tch::Tensor, tch::Tensor) {
    QUANTISED.with(|c| c.set(QuantiserCounts { at_writers_amax: c.get().at_writers_amax + 1, ..c.get() }));
    current_through_routes(x, format, Some(amax))
}

/// Current scaling through the quantiser's routes, at x's own amax or at `known` (`[1]` f32).
fn current_through_routes(
    x: &tch::Tensor,
    format: Fp8Format,
    known: Option<&tch::Tensor>,
) -> (tch::Tensor, tch::Tensor) {
    // Our kernel takes the amax inside its launch: under a context-parallel amax group the
    // LibTorch route, whose amax is a pass of its own, reduced over the group.
    let kernel = kernel_route(x) && x.numel() > 0 && !super::amax_group::active();
    // The LibTorch routes' scale, computed on the device only when one of them runs.
    let scales = std::cell::OnceCell::new();
    let scales_of = || {
        scales.get_or_init(|| match known {
            Some(amax) => scale_of_amax(super::amax_group::reduced(amax.reshape([] as [i64; 0])), format),
            None => current_scale(x, format),
        })
    };
    through_routes(
        x,
        kernel.then_some(|| quantize_current_kernel(x, format, known)),
        || {
            let (scale, scale_inv) = scales_of();
            Ok((quantize_clamped(x, Scale::Device { s: scale, inv: scale_inv }, format)?, scale_inv.shallow_clone()))
        },
        || {
            let (scale, scale_inv) = scales_of();
            (quantize_via_f32(x, Scale::Device { s: scale, inv: scale_inv }, format), scale_inv.shallow_clone())
        },
    )
}

/// [`quantize_current_on_device`] on our kernels (`kernels/fp8_quantize.cu`): an amax pass
/// (none where `known` holds the amax already), then one pass writing the codes at the scale
/// computed on the device.
fn quantize_current_kernel(
    x: &tch::Tensor,
    format: Fp8Format,
    known: Option<&tch::Tensor>,
) -> Result<(tch::Tensor, tch::Tensor), KernelError> {
    let x = x.contiguous();
    let out = tch::Tensor::empty(x.size(), (format.kind(), x.device()));
    let amax = known.map_or_else(|| tch::Tensor::zeros([1], (tch::Kind::Float, x.device())), |a| a.reshape([1]));
    let scale_inv = tch::Tensor::zeros([] as [i64; 0], (tch::Kind::Float, x.device()));
    let args = CurrentArgs { x: &x, out: &out, amax: &amax, scale_inv: &scale_inv, format };
    let launched = match known {
        Some(_) => fp8_quantize::quantize_current_at_amax(&args)?,
        None => fp8_quantize::quantize_current(&args)?,
    };
    if !launched {
        match known {
            Some(_) => super::stand_ins::quantize::current_at_amax(&args),
            None => super::stand_ins::quantize::current(&args),
        }
    }
    Ok((out, scale_inv))
}

/// `(max / amax(x), its inverse)` as 0-dim f32 tensors on x's device, read by nobody; 1 where
/// the amax is zero or not finite.
fn current_scale(x: &tch::Tensor, format: Fp8Format) -> (tch::Tensor, tch::Tensor) {
    scale_of_amax(super::amax_group::reduced(amax_on_device(x)), format)
}

/// [`current_scale`] of an amax already taken (0-dim f32).
fn scale_of_amax(amax: tch::Tensor, format: Fp8Format) -> (tch::Tensor, tch::Tensor) {
    // `max / amax` as one f32 division (the host's `fp8_max / amax`). Few ops on purpose: on a
    // small model the host's launches are the bottleneck. An amax of 0 gives +inf and a NaN
    // amax NaN, both 1 after nan_to_num; an infinite amax gives 0, made 1 by adding (s == 0).
    let mut scale = amax.full_like(f64::from(format.max())) / &amax;
    let _ = scale.nan_to_num_(1.0, 1.0, 1.0);
    let _ = scale.g_add_(&scale.eq(0.0));
    let scale_inv = scale.reciprocal();
    (scale, scale_inv)
}

/// `max |x|` as an f32 (NaN if x holds a NaN; 0 for an empty tensor), over the whole sequence
/// inside [`super::amax_group::with_amax_group`].
pub fn amax_tch(x: &tch::Tensor) -> f32 {
    // A scale chosen now (a role's first use): the whole sequence's amax under context
    // parallelism (crate::fp8::amax_group).
    super::amax_group::reduced(amax_on_device(x)).double_value(&[]) as f32
}

/// `max |x|` as a 0-dim f32 tensor on x's device, read by nobody (NaN if x holds a NaN; 0 for
/// an empty tensor). On CUDA one reduction pass (the ∞-norm, once [`cuda_routes_checked`]),
/// where `abs().max()` writes a copy of x first; on the CPU `abs().max()`, 8x faster there than
/// torch's ∞-norm. Either is exact (the max of x's own values).
pub fn amax_on_device(x: &tch::Tensor) -> tch::Tensor {
    if x.numel() == 0 {
        return tch::Tensor::zeros([] as [i64; 0], (tch::Kind::Float, x.device()));
    }
    if cuda_routes_checked(x.device()) { amax_norm(x) } else { amax_abs_max(x) }
}

/// `max |x|` as the ∞-norm over every dimension, in f32.
fn amax_norm(x: &tch::Tensor) -> tch::Tensor {
    let every_dim: Vec<i64> = (0..x.dim() as i64).collect();
    x.norm_scalaropt_dim(f64::INFINITY, every_dim.as_slice(), false).to_kind(tch::Kind::Float)
}

/// `max |x|` through a copy of `|x|`, in f32.
fn amax_abs_max(x: &tch::Tensor) -> tch::Tensor {
    x.abs().max().to_kind(tch::Kind::Float)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fp8::format::checks::{assert_codes_match, same_value};
    use crate::fp8::recipe::scale_for_amax;
    use tch::{Kind, Tensor};

    /// Quantising never writes to its input, whatever the route, the scale's home (host or
    /// device) and the input's dtype. (`to_kind` of an f32 tensor to f32 is the tensor itself:
    /// scaling "the f32 copy" in place scaled the caller's activations, so the adapters kept in
    /// FP8 under `fp8_activations` with f32 activations saw x·s.)
    #[test]
    fn quantising_leaves_its_input_untouched() {
        for on_cpu in [false, true] {
            let _on = crate::routes::on_cpu_for_this_thread(on_cpu);
            for kind in [Kind::Float, Kind::BFloat16] {
                let x = Tensor::from_slice(&[1.0f32, -2.0, 3.0, 1e-3]).to_kind(kind);
                let before = host_bytes(&x).unwrap();
                let _ = quantize_current_on_device(&x, Fp8Format::E4M3);
                let _ = quantize_tch(&x, 7.0, Fp8Format::E5M2);
                let _ = quantize_and_amax(&x, 7.0, Fp8Format::E4M3);
                assert_eq!(host_bytes(&x).unwrap(), before, "{kind:?}, CUDA routes on the CPU: {on_cpu}");
            }
        }
    }

    /// NaN stays NaN (with its sign bit), infinities overflow like torch, and the scaled
    /// quantiser saturates to ±max instead.
    #[test]
    fn nan_infinity_and_saturation() {
        for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
            let xs = [f32::NAN, -f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1e6, -1e6];
            assert_codes_match(&xs, format);
            let q = quantize_tch(&Tensor::from_slice(&xs), 1.0, format);
            let codes = Vec::<u8>::try_from(&q.view_dtype(Kind::Uint8)).unwrap();
            assert_eq!(codes, format.quantize_slice(&xs, 1.0));
            let back = format.dequantize_slice(&codes, 1.0);
            assert!(back[0].is_nan() && back[1].is_nan());
            assert_eq!(&back[2..], &[format.max(), -format.max(), format.max(), -format.max()]);
        }
        assert_eq!(Fp8Format::E4M3.encode(f32::INFINITY), 0x7F);
        assert_eq!(Fp8Format::E5M2.encode(f32::NEG_INFINITY), 0xFC);
        assert_eq!(Fp8Format::E4M3.encode(464.0), 0x7E); // the tie above 448 rounds to even (448)
        assert!(Fp8Format::E4M3.decode(Fp8Format::E4M3.encode(465.0)).is_nan());
    }

    /// 1,048,576 random values: half random bit patterns (every class of f32), half spread
    /// over 2^-24 .. 2^24; the plain cast and the scaled, saturating quantiser both match.
    #[test]
    fn a_million_random_values_match_torch() {
        let n = 1 << 20;
        let mut state = 0x9E37_79B9_7F4A_7C15u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let xs: Vec<f32> = (0..n)
            .map(|i| {
                let r = next();
                if i % 2 == 0 {
                    f32::from_bits(r as u32)
                } else {
                    let mantissa = (r >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
                    mantissa * 2f32.powi(((r >> 8) % 49) as i32 - 24)
                }
            })
            .collect();
        for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
            assert_codes_match(&xs, format);
            let scale = 3.7;
            let q = quantize_tch(&Tensor::from_slice(&xs), scale, format);
            let codes = Vec::<u8>::try_from(&q.view_dtype(Kind::Uint8)).unwrap();
            let want = format.quantize_slice(&xs, scale);
            let bad = codes.iter().zip(&want).filter(|(a, b)| a != b).count();
            assert_eq!(bad, 0, "{format:?}: {bad} of {n} scaled codes differ from the emulation");
            let deq = Vec::<f32>::try_from(&dequantize(&q, 1.0 / scale)).unwrap();
            let emu = format.dequantize_slice(&want, 1.0 / scale);
            assert!(deq.iter().zip(&emu).all(|(a, b)| same_value(*a, *b)));
        }
    }

    /// bf16 inputs (the activations and gradients of bf16 compute) quantise to the emulation's
    /// codes of their f32 values, through both routes: the two-pass one (clamped in bf16) and
    /// the f32 one. Values spread over 2⁻³⁰..2³⁰ with NaN, ±∞ and values on both sides of the
    /// clamp bound ±max/scale, at scales that put the bound at, below and above 1.
    #[test]
    fn bf16_inputs_quantise_as_the_emulation_through_both_routes() {
        let mut xs: Vec<f32> = (0..20_000)
            .map(|i| {
                let m = 1.0 + (i % 97) as f32 / 97.0;
                let sign = if i % 3 == 0 { -1.0 } else { 1.0 };
                sign * m * 2f32.powi((i % 61) - 30)
            })
            .collect();
        xs.extend([f32::NAN, -f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 0.0, -0.0]);
        for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
            for scale in [3.7f32, 1.0 / 1024.0, 65536.0, format.max()] {
                let bound = format.max() / scale;
                let mut ys = xs.clone();
                // Around the bound: a few bf16 steps either side.
                ys.extend((-8..=8).flat_map(|k| [bound * (1.0 + k as f32 / 256.0), -bound * (1.0 + k as f32 / 256.0)]));
                let x = Tensor::from_slice(&ys).to_kind(Kind::BFloat16);
                let values = Vec::<f32>::try_from(&x.to_kind(Kind::Float)).unwrap();
                let want = format.quantize_slice(&values, scale);
                let bits = |t: &Tensor| Vec::<u8>::try_from(&t.view_dtype(Kind::Uint8)).unwrap();
                let two_pass = quantize_clamped(&x, Scale::Host(scale), format).unwrap();
                assert_eq!(two_pass.kind(), format.kind());
                for (route, got) in
                    [("two-pass", bits(&two_pass)), ("f32", bits(&quantize_via_f32(&x, Scale::Host(scale), format)))]
                {
                    let bad: Vec<_> = got.iter().zip(&want).zip(&values).filter(|((a, b), _)| a != b).take(3).collect();
                    assert!(bad.is_empty(), "{format:?} scale {scale} {route}: {bad:?}");
                }
            }
        }
    }

    /// Both amaxes (the ∞-norm of CUDA, `abs().max()` of the CPU) are the largest magnitude
    /// (from a negative value too), NaN when a NaN is present, ∞ with an infinity, 0 for zeros
    /// and for an empty tensor; and the CUDA routes' own check passes where it can run here.
    #[test]
    fn amax_is_the_largest_magnitude_or_nan() {
        for route in [amax_norm, amax_abs_max, amax_on_device] {
            let amax = |xs: &[f32], kind| {
                let x = Tensor::from_slice(xs).to_kind(kind);
                if xs.is_empty() { amax_on_device(&x) } else { route(&x) }.double_value(&[])
            };
            for kind in [Kind::Float, Kind::BFloat16] {
                assert_eq!(amax(&[1.0, -7.5, 3.0], kind), 7.5);
                assert!(amax(&[1.0, f32::NAN, -9.0], kind).is_nan());
                assert!(amax(&[f32::NAN, 1.0], kind).is_nan());
                assert_eq!(amax(&[1.0, f32::NEG_INFINITY], kind), f64::INFINITY);
                assert_eq!(amax(&[0.0, -0.0], kind), 0.0);
                assert_eq!(amax(&[], kind), 0.0);
            }
            let x = Tensor::randn([64, 33], (Kind::Float, tch::Device::Cpu)).to_kind(Kind::BFloat16);
            assert_eq!(route(&x).double_value(&[]), x.abs().max().to_kind(Kind::Float).double_value(&[]));
            assert_eq!(route(&x).kind(), Kind::Float);
        }
        assert_eq!(check_cuda_routes(tch::Device::Cpu), Ok(()));
        let _off = crate::routes::on_cpu_for_this_thread(false);
        assert!(!cuda_routes_checked(tch::Device::Cpu), "the CPU keeps its own routes");
    }

    /// The CUDA route logic on the CPU (`LLORA_CUDA_ROUTES_ON_CPU`): the first quantisation
    /// runs the routes' check, which quantises and takes the amax itself and so asks for the
    /// verdict being made (a lock held across the check would deadlock here).
    /// It ends within the time limit, passes, and later quantisations take our kernel's route
    /// (delayed and current scaling, its CPU stand-in here) and the ∞-norm amax, counted, with
    /// the f32 route's codes.
    #[test]
    fn the_cuda_routes_check_runs_once_on_the_cpu_without_deadlock() {
        crate::routes::tests::on_cpu_within(60, "FP8 routes' first use", || {
            let x = (tch::Tensor::randn([257, 64], (tch::Kind::Float, tch::Device::Cpu)) * 300.0)
                .to_kind(tch::Kind::BFloat16);
            let _ = take_quantiser_counts();
            let codes = quantize_tch(&x, 1.5, Fp8Format::E4M3);
            let (current, _) = quantize_current_on_device(&x, Fp8Format::E5M2);
            let counts = take_quantiser_counts();
            assert_eq!(cuda_routes_checked_on(tch::Device::Cpu), Ok(()));
            assert!(cuda_routes_checked(tch::Device::Cpu));
            let bits = |t: &tch::Tensor| Vec::<u8>::try_from(&t.view_dtype(tch::Kind::Uint8).flatten(0, -1)).unwrap();
            assert_eq!(bits(&codes), bits(&quantize_via_f32(&x, Scale::Host(1.5), Fp8Format::E4M3)));
            let (scale, _) = current_scale(&x, Fp8Format::E5M2);
            assert_eq!(
                bits(&current),
                bits(&quantize_via_f32(&x, Scale::Device { s: &scale, inv: &scale.reciprocal() }, Fp8Format::E5M2))
            );
            assert_eq!(
                counts,
                QuantiserCounts { kernel: 2, two_pass: 0, via_f32: 0, at_writers_amax: 0 },
                "the checks' own quantisations are not counted"
            );
            assert_eq!(counts.routes(), ["kernel"]);
            // Both took our kernels (their CPU stand-ins), which passed their own check.
            assert_eq!(kernel_checked_on(tch::Device::Cpu), Ok(()));
            assert_eq!(amax_on_device(&x).double_value(&[]), amax_norm(&x).double_value(&[]));
        });
    }

    /// On a CUDA device the two-pass quantiser and the one-pass amax pass their check, so
    /// training takes them.
    #[test]
    #[ignore = "needs CUDA"]
    fn cuda_fp8_routes_pass_their_check() {
        assert!(tch::Cuda::is_available(), "needs a CUDA device");
        assert_eq!(check_cuda_routes(tch::Device::Cuda(0)), Ok(()));
        assert!(cuda_routes_checked(tch::Device::Cuda(0)));
    }

    /// Hand-derived delayed scaling: history 3, E4M3 (max 448).
    /// Current scaling computed on the device gives the host path's codes and factor, bit for
    /// bit: random bf16 and f32 tensors, all zeros, one holding an infinity, one a NaN, and an
    /// amax so small that max/amax overflows.
    #[test]
    fn current_scaling_on_the_device_equals_the_host_path() {
        let opts = (tch::Kind::Float, tch::Device::Cpu);
        let cases = [
            tch::Tensor::randn([64, 33], opts) * 7.0,
            (tch::Tensor::randn([5, 40], opts) * 1e-3).to_kind(tch::Kind::BFloat16),
            tch::Tensor::zeros([4, 4], opts),
            tch::Tensor::from_slice(&[1.0f32, f32::INFINITY, -2.0]),
            tch::Tensor::from_slice(&[1.0f32, f32::NAN, -2.0]),
            tch::Tensor::from_slice(&[1e-44f32, -1e-45]),
        ];
        for (i, x) in cases.iter().enumerate() {
            for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
                // The host's current scaling: the scale from the amax read back.
                let host_scale = scale_for_amax(amax_tch(x), format.max(), 0).unwrap_or(1.0);
                let (host_data, host_scale_inv) = (quantize_tch(x, host_scale, format), 1.0 / host_scale);
                let (codes, scale_inv) = quantize_current_on_device(x, format);
                let bits =
                    |t: &tch::Tensor| Vec::<u8>::try_from(&t.view_dtype(tch::Kind::Uint8).flatten(0, -1)).unwrap();
                assert_eq!(bits(&codes), bits(&host_data), "case {i} {format:?}: codes");
                // CUDA's two-pass route, run here: the same codes.
                let (scale, inv) = current_scale(x, format);
                if matches!(x.kind(), tch::Kind::Float | tch::Kind::BFloat16) {
                    let two_pass = quantize_clamped(x, Scale::Device { s: &scale, inv: &inv }, format).unwrap();
                    assert_eq!(bits(&two_pass), bits(&host_data), "case {i} {format:?}: two-pass codes");
                }
                let s = scale_inv.double_value(&[]) as f32;
                assert_eq!(
                    s.to_bits(),
                    host_scale_inv.to_bits(),
                    "case {i} {format:?}: 1/scale {s} vs {}",
                    host_scale_inv
                );
                let back = dequantize(&codes, &scale_inv);
                let want = dequantize(&host_data, host_scale_inv);
                let same = back.isnan().eq_tensor(&want.isnan()).all().int64_value(&[]) == 1
                    && back
                        .nan_to_num(0.0, None, None)
                        .eq_tensor(&want.nan_to_num(0.0, None, None))
                        .all()
                        .int64_value(&[])
                        == 1;
                assert!(same, "case {i} {format:?}: dequantised values differ");
            }
        }
    }
}
