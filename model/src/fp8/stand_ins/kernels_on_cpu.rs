//! Every kernel of ours run on the CPU (`kernels::emulate`: its CUDA C compiled by the host's
//! compiler), through its launch code, against its stand-in here (the LibTorch route it must
//! equal), bit for bit where the kernel promises it; outputs in buffers followed by canaries,
//! so a write past the end fails. Here rather than beside the kernels: kernels name no
//! stand-in.

use tch::{Kind, Tensor};

use crate::fp8::format::Fp8Format;
use crate::fp8::stand_ins;
use crate::kernels::args::{DelayedCodes, host_bytes};
use crate::kernels::emulate::with_emulation;
use crate::kernels::{fp8_quantize, rmsnorm_fp8, swiglu_fp8};

/// Bytes after every output, which a launch must leave as they were.
const CANARY: i64 = 64;
/// The canaries' byte.
const CANARY_BYTE: i64 = 0xA5;

/// An output tensor of `shape` and `kind` in a buffer whose tail holds canaries.
struct Guarded {
    buffer: Tensor,
    view: Tensor,
}

impl Guarded {
    fn new(shape: &[i64], kind: Kind) -> Self {
        let n: i64 = shape.iter().product();
        let size = kind.elt_size_in_bytes() as i64;
        let buffer = Tensor::full([n * size + CANARY], CANARY_BYTE, (Kind::Uint8, tch::Device::Cpu));
        let view = buffer.narrow(0, 0, n * size).view_dtype(kind).view(shape);
        let _ = view.shallow_clone().zero_();
        Self { buffer, view }
    }

    /// Fails if anything wrote past the view.
    fn check(&self, what: &str) {
        let tail = self.buffer.narrow(0, self.buffer.size()[0] - CANARY, CANARY);
        assert!(tail.eq(CANARY_BYTE).all().int64_value(&[]) == 1, "{what}: a write past the end of the output");
    }
}

/// Inputs of `shape` in `kind`: normal values times 300 with edge values among them (NaN of
/// both signs, ±inf, past the FP8 clamp, near E4M3's largest, f32 denormals, ±0).
fn edgy(shape: &[i64], kind: Kind, seed: i64) -> Tensor {
    tch::manual_seed(seed);
    let x = Tensor::randn(shape, (Kind::Float, tch::Device::Cpu)) * 300.0;
    let edges =
        [f64::NAN, -f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 1e6, -1e6, 448.1, -447.9, 1e-40, -1e-45, 0.0, -0.0];
    let flat = x.view([-1]);
    for (i, v) in edges.iter().enumerate().take(x.numel()) {
        let _ = flat.get((i * 7 % x.numel()) as i64).fill_(*v);
    }
    x.to_kind(kind)
}

/// The codes of the kernel and of the stand-in, equal byte for byte except where the input is a
/// negative NaN: torch's cast keeps its sign (0xFF), CUDA's conversion makes NaN canonical (0x7F).
fn assert_codes_equal(got: &Tensor, want: &Tensor, x: &Tensor, what: &str) {
    let (got, want) = (host_bytes(got).unwrap(), host_bytes(want).unwrap());
    let xf = Vec::<f32>::try_from(&x.to_kind(Kind::Float).reshape([-1])).unwrap();
    let mut negative_nans = 0;
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        let negative_nan = i < xf.len() && xf[i].is_nan() && xf[i].is_sign_negative();
        if negative_nan && (*g, *w) == (0x7F, 0xFF) {
            negative_nans += 1;
            continue;
        }
        assert_eq!(g, w, "{what}: code {i} (input {:?})", xf.get(i));
    }
    let _ = negative_nans;
}

/// An amax as the kernel leaves it against the stand-in's (NaN equals NaN).
fn assert_same_value(got: &Tensor, want: &Tensor, what: &str) {
    let (g, w) = (got.double_value(&[0]), want.double_value(&[0]));
    assert!(g == w || (g.is_nan() && w.is_nan()), "{what}: {g} vs {w}");
}

/// `got` within one bf16 ulp of `want` everywhere (NaN where NaN).
fn assert_within_a_bf16_ulp(got: &Tensor, want: &Tensor, what: &str) {
    let g = Vec::<f32>::try_from(&got.to_kind(Kind::Float).reshape([-1])).unwrap();
    let w = Vec::<f32>::try_from(&want.to_kind(Kind::Float).reshape([-1])).unwrap();
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        let ulp = (b.abs().max(f32::MIN_POSITIVE) * 2f32.powi(-7)).max(f32::MIN_POSITIVE);
        assert!((a.is_nan() && b.is_nan()) || a == b || (a - b).abs() <= ulp, "{what}: element {i}: {a} vs {b}");
    }
}

/// Shapes with tails (not a multiple of 32 or 256), a single element, and one whose grid-stride
/// loops run more than once with two blocks.
const SHAPES: [[i64; 2]; 5] = [[1, 1], [7, 33], [129, 65], [3, 1000], [33, 32]];

/// The quantiser with delayed scaling, transposing or not, both formats and input dtypes: codes,
/// transpose and amax equal the stand-in's (`quantize_via_f32`'s arithmetic) bit for bit.
#[test]
fn the_quantiser_equals_its_stand_in() {
    for (k, shape) in SHAPES.iter().enumerate() {
        for kind in [Kind::Float, Kind::BFloat16] {
            for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
                let x = edgy(shape, kind, k as i64);
                let t = [shape[1], shape[0]];
                let (out, out_t, amax) = (
                    Guarded::new(shape, format.kind()),
                    Guarded::new(&t, format.kind()),
                    Guarded::new(&[1], Kind::Float),
                );
                let (want, want_t) = (
                    Tensor::zeros(shape, (format.kind(), tch::Device::Cpu)),
                    Tensor::zeros(t, (format.kind(), tch::Device::Cpu)),
                );
                let want_amax = Tensor::zeros([1], (Kind::Float, tch::Device::Cpu));
                let args = |o, ot, a| fp8_quantize::QuantizeArgs {
                    x: &x,
                    out: o,
                    out_t: Some(ot),
                    amax: Some(a),
                    scale: 0.75,
                    format,
                };
                let ran = with_emulation(Some(2), || fp8_quantize::quantize(&args(&out.view, &out_t.view, &amax.view)));
                assert_eq!(ran, Ok(true));
                stand_ins::quantize::delayed(&args(&want, &want_t, &want_amax));
                let what = format!("{shape:?} {kind:?} {format:?}");
                assert_codes_equal(&out.view, &want, &x, &what);
                assert_codes_equal(&out_t.view, &want_t, &x.tr(), &format!("{what} transposed"));
                assert_same_value(&amax.view, &want_amax, &format!("{what} amax"));
                let plain = Guarded::new(shape, format.kind());
                let args =
                    fp8_quantize::QuantizeArgs { x: &x, out: &plain.view, out_t: None, amax: None, scale: 3.0, format };
                with_emulation(Some(2), || fp8_quantize::quantize(&args)).unwrap();
                stand_ins::quantize::delayed(&fp8_quantize::QuantizeArgs { out: &want, ..args });
                assert_codes_equal(&plain.view, &want, &x, &format!("{what} untransposed"));
                for (g, name) in [(&out, "codes"), (&out_t, "transpose"), (&amax, "amax"), (&plain, "untransposed")] {
                    g.check(&format!("{what} {name}"));
                }
            }
        }
    }
}

/// Current scaling (the amax pass, then the codes at `max / amax` computed on the device): codes,
/// inverse scale and amax equal the stand-in's bit for bit, on finite inputs (an infinite amax
/// makes the scale 1 on both sides) and on all zeros.
#[test]
fn current_scaling_equals_its_stand_in() {
    for (k, shape) in SHAPES.iter().enumerate() {
        for kind in [Kind::Float, Kind::BFloat16] {
            for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
                for x in [
                    edgy(shape, kind, k as i64).nan_to_num(0.0, 1e4, -1e4),
                    Tensor::zeros(shape, (kind, tch::Device::Cpu)),
                ] {
                    let (out, amax, inv) = (
                        Guarded::new(shape, format.kind()),
                        Guarded::new(&[1], Kind::Float),
                        Guarded::new(&[1], Kind::Float),
                    );
                    let want = [
                        Tensor::zeros(shape, (format.kind(), tch::Device::Cpu)),
                        Tensor::zeros([1], (Kind::Float, tch::Device::Cpu)),
                        Tensor::zeros([1], (Kind::Float, tch::Device::Cpu)),
                    ];
                    let args = |out, amax, scale_inv| fp8_quantize::CurrentArgs { x: &x, out, amax, scale_inv, format };
                    assert_eq!(
                        with_emulation(Some(2), || fp8_quantize::quantize_current(&args(
                            &out.view, &amax.view, &inv.view
                        ))),
                        Ok(true)
                    );
                    stand_ins::quantize::current(&args(&want[0], &want[1], &want[2]));
                    let what = format!("{shape:?} {kind:?} {format:?}");
                    assert_codes_equal(&out.view, &want[0], &x, &what);
                    assert_eq!(host_bytes(&inv.view), host_bytes(&want[2]), "{what}: inverse scale");
                    assert_same_value(&amax.view, &want[1], &format!("{what} amax"));
                    for g in [&out, &amax, &inv] {
                        g.check(&what);
                    }
                }
            }
        }
    }
}

/// RMSNorm writing the next GEMM's codes, one block per row (rows of 1 to 1000 values: the
/// column loop runs up to four times, with tails): y within one bf16 ulp of the stand-in, 1/rms
/// within 1e-6 relative (the sums' order differs), and the codes and amax exactly those of the
/// kernel's own y.
#[test]
fn rmsnorm_equals_its_stand_in() {
    for (k, shape) in [[1, 1], [7, 33], [3, 1000], [2, 257]].iter().enumerate() {
        let x = (edgy(shape, Kind::Float, k as i64).nan_to_num(0.0, 0.0, 0.0).clamp(-1e3, 1e3) / 100.0)
            .to_kind(Kind::BFloat16);
        let w = (Tensor::randn([shape[1]], (Kind::Float, tch::Device::Cpu)) * 0.1 + 1.0).to_kind(Kind::BFloat16);
        for format in [Fp8Format::E4M3, Fp8Format::E5M2] {
            let (y, r, codes, amax) = (
                Guarded::new(shape, Kind::BFloat16),
                Guarded::new(&[shape[0], 1], Kind::Float),
                Guarded::new(shape, format.kind()),
                Guarded::new(&[1], Kind::Float),
            );
            let scale = Tensor::from_slice(&[17.0f32]);
            let c = DelayedCodes { codes: &codes.view, scale: &scale, amax: &amax.view, format };
            let args =
                rmsnorm_fp8::ForwardArgs { x: &x, w: &w, y: &y.view, inv_rms: &r.view, eps: 1e-5, y_codes: Some(c) };
            assert_eq!(with_emulation(None, || rmsnorm_fp8::forward(&args)), Ok(true));
            let (want_y, want_r) = (y.view.zeros_like(), r.view.zeros_like());
            stand_ins::rmsnorm(&rmsnorm_fp8::ForwardArgs { y: &want_y, inv_rms: &want_r, y_codes: None, ..args });
            let what = format!("{shape:?} {format:?}");
            assert_within_a_bf16_ulp(&y.view, &want_y, &format!("{what} y"));
            let rel = ((&r.view - &want_r).abs() / want_r.abs()).max().double_value(&[]);
            assert!(rel <= 1e-6, "{what}: 1/rms {rel:e} relative");
            let (own, own_amax) = (codes.view.zeros_like(), Tensor::zeros([1], (Kind::Float, tch::Device::Cpu)));
            stand_ins::write_delayed_codes(
                &y.view,
                &DelayedCodes { codes: &own, scale: &scale, amax: &own_amax, format },
            );
            assert_codes_equal(&codes.view, &own, &y.view, &format!("{what} codes of its y"));
            assert_same_value(&amax.view, &own_amax, &format!("{what} amax of its y"));
            for g in [&y, &r, &codes, &amax] {
                g.check(&what);
            }
        }
    }
}

/// SwiGLU's forward and backward (gate and up kept as E4M3 codes at their current scales):
/// h and the gradients within one bf16 ulp of the stand-in (expf's last bit), the kept codes,
/// their inverse scales and amaxes bit for bit, h's codes those of the kernel's own h.
#[test]
fn swiglu_equals_its_stand_in() {
    for (k, shape) in SHAPES.iter().enumerate() {
        let input = |s: i64| {
            (edgy(shape, Kind::Float, s).nan_to_num(0.0, 0.0, 0.0).clamp(-2e3, 2e3) / 300.0).to_kind(Kind::BFloat16)
        };
        let (gate, up) = (input(k as i64), input(k as i64 + 50));
        let g = |kind: Kind| Guarded::new(shape, kind);
        let (out, gq, uq, hq) =
            (g(Kind::BFloat16), g(Fp8Format::E4M3.kind()), g(Fp8Format::E4M3.kind()), g(Fp8Format::E5M2.kind()));
        let (inv, amax, h_amax) =
            (Guarded::new(&[2], Kind::Float), Guarded::new(&[2], Kind::Float), Guarded::new(&[1], Kind::Float));
        let h_scale = Tensor::from_slice(&[3.0f32]);
        let h = DelayedCodes { codes: &hq.view, scale: &h_scale, amax: &h_amax.view, format: Fp8Format::E5M2 };
        let args = swiglu_fp8::ForwardArgs {
            gate: &gate,
            up: &up,
            out: &out.view,
            gate_codes: &gq.view,
            up_codes: &uq.view,
            scale_inv: &inv.view,
            amax: &amax.view,
            h: Some(h),
        };
        assert_eq!(with_emulation(Some(2), || swiglu_fp8::forward(&args)), Ok(true));
        let want: Vec<Tensor> =
            [&out.view, &gq.view, &uq.view, &inv.view, &amax.view].iter().map(|t| t.zeros_like()).collect();
        stand_ins::swiglu_forward(&swiglu_fp8::ForwardArgs {
            out: &want[0],
            gate_codes: &want[1],
            up_codes: &want[2],
            scale_inv: &want[3],
            amax: &want[4],
            h: None,
            ..args
        });
        let what = format!("{shape:?}");
        assert_within_a_bf16_ulp(&out.view, &want[0], &format!("{what} h"));
        assert_codes_equal(&gq.view, &want[1], &gate, &format!("{what} gate codes"));
        assert_codes_equal(&uq.view, &want[2], &up, &format!("{what} up codes"));
        assert_eq!(host_bytes(&inv.view), host_bytes(&want[3]), "{what}: inverse scales");
        assert_eq!(host_bytes(&amax.view), host_bytes(&want[4]), "{what}: amaxes");
        let (own, own_amax) = (hq.view.zeros_like(), Tensor::zeros([1], (Kind::Float, tch::Device::Cpu)));
        stand_ins::write_delayed_codes(
            &out.view,
            &DelayedCodes { codes: &own, scale: &h_scale, amax: &own_amax, format: Fp8Format::E5M2 },
        );
        assert_codes_equal(&hq.view, &own, &out.view, &format!("{what} h codes"));
        assert_same_value(&h_amax.view, &own_amax, &format!("{what} h amax"));
        let grad = input(k as i64 + 99);
        let (gg, gu) = (g(Kind::BFloat16), g(Kind::BFloat16));
        let back = swiglu_fp8::BackwardArgs {
            gate_codes: &gq.view,
            up_codes: &uq.view,
            scale_inv: &inv.view,
            grad: &grad,
            grad_gate: &gg.view,
            grad_up: &gu.view,
        };
        assert_eq!(with_emulation(Some(2), || swiglu_fp8::backward(&back)), Ok(true));
        let (wg, wu) = (gg.view.zeros_like(), gu.view.zeros_like());
        stand_ins::swiglu_backward(&swiglu_fp8::BackwardArgs { grad_gate: &wg, grad_up: &wu, ..back });
        assert_within_a_bf16_ulp(&gg.view, &wg, &format!("{what} grad_gate"));
        assert_within_a_bf16_ulp(&gu.view, &wu, &format!("{what} grad_up"));
        for g in [&out, &gq, &uq, &hq, &inv, &amax, &h_amax, &gg, &gu] {
            g.check(&what);
        }
    }
}
