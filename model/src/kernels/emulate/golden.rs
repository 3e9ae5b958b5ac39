//! Fixed inputs for every kernel, run through its launch code on one device: on the CPU (the
//! emulation) their outputs' digests are `golden.txt`'s, so a change to a kernel or to the
//! emulation that moves any output is seen; on a GPU (the CUDA test, which the next GPU run's
//! `gpu-check.sh` runs with the bundle's other CUDA tests) the device's outputs equal the
//! emulation's, run beside them in the same process, and the same digests: the CPU and the GPU
//! tied together.

use tch::{Kind, Tensor};

use super::with_emulation;
use crate::fp8::format::Fp8Format;
use crate::kernels::args::{DelayedCodes, host_bytes};
use crate::kernels::{dropout, fp8_quantize, rmsnorm_fp8, rope, swiglu_fp8};

/// The digests, one line each: `case/output fnv1a64`.
const GOLDEN: &str = include_str!("golden.txt");

/// Values a kernel meets, without a random generator (the same on every machine): a sine
/// sweep times 300 with NaN, ±inf, past the clamp, a denormal and zero among them.
fn fixed(shape: &[i64], kind: Kind, dev: tch::Device, phase: f64) -> Tensor {
    let n: i64 = shape.iter().product();
    let mut v: Vec<f32> = (0..n).map(|i| ((0.37 * i as f64 + phase).sin() * 300.0) as f32).collect();
    for (k, e) in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 1e6, -1e6, 1e-40, 0.0].into_iter().enumerate() {
        if (k as i64) < n {
            v[k * 5 % n as usize] = e;
        }
    }
    Tensor::from_slice(&v).view(shape).to_kind(kind).to_device(dev)
}

/// Each case's outputs on `dev` (CUDA, or the CPU through the emulation), by name.
pub fn outputs(dev: tch::Device) -> Vec<(String, Tensor)> {
    let mut out = Vec::new();
    let run = |f: &mut dyn FnMut()| if dev == tch::Device::Cpu { with_emulation(Some(2), f) } else { f() };
    for (kind, format) in [(Kind::Float, Fp8Format::E4M3), (Kind::BFloat16, Fp8Format::E5M2)] {
        let x = fixed(&[65, 40], kind, dev, 0.0);
        let (codes, t, amax) = (
            x.zeros_like().to_kind(format.kind()),
            Tensor::zeros([40, 65], (format.kind(), dev)),
            Tensor::zeros([1], (Kind::Float, dev)),
        );
        let a =
            fp8_quantize::QuantizeArgs { x: &x, out: &codes, out_t: Some(&t), amax: Some(&amax), scale: 0.75, format };
        run(&mut || assert_eq!(fp8_quantize::quantize(&a), Ok(true)));
        let name = format!("quantize-{kind:?}-{format:?}");
        out.extend([
            (format!("{name}/codes"), codes),
            (format!("{name}/transpose"), t),
            (format!("{name}/amax"), amax),
        ]);
        let finite = x.nan_to_num(0.0, 1e4, -1e4);
        let (codes, amax, inv) = (
            codes_like(&finite, format),
            Tensor::zeros([1], (Kind::Float, dev)),
            Tensor::zeros([1], (Kind::Float, dev)),
        );
        let a = fp8_quantize::CurrentArgs { x: &finite, out: &codes, amax: &amax, scale_inv: &inv, format };
        run(&mut || assert_eq!(fp8_quantize::quantize_current(&a), Ok(true)));
        let name = format!("current-{kind:?}-{format:?}");
        out.extend([
            (format!("{name}/codes"), codes),
            (format!("{name}/amax"), amax),
            (format!("{name}/scale_inv"), inv),
        ]);
    }
    out.extend(rmsnorm(dev, &run));
    out.extend(swiglu(dev, &run));
    out.extend(rotary(dev, &run));
    out.extend(dropped(dev, &run));
    out
}

fn codes_like(x: &Tensor, format: Fp8Format) -> Tensor {
    Tensor::zeros(x.size(), (format.kind(), x.device()))
}

fn rmsnorm(dev: tch::Device, run: &dyn Fn(&mut dyn FnMut())) -> Vec<(String, Tensor)> {
    let x = (fixed(&[3, 1000], Kind::Float, dev, 1.0).nan_to_num(0.0, 0.0, 0.0).clamp(-1e3, 1e3) / 100.0)
        .to_kind(Kind::BFloat16);
    let w = (fixed(&[1000], Kind::Float, dev, 2.0).nan_to_num(0.0, 0.0, 0.0).clamp(-300.0, 300.0) / 3000.0 + 1.0)
        .to_kind(Kind::BFloat16);
    let (y, r, codes, amax) = (
        x.zeros_like(),
        Tensor::zeros([3, 1], (Kind::Float, dev)),
        codes_like(&x, Fp8Format::E4M3),
        Tensor::zeros([1], (Kind::Float, dev)),
    );
    let scale = Tensor::from_slice(&[17.0f32]).to_device(dev);
    let c = DelayedCodes { codes: &codes, scale: &scale, amax: &amax, format: Fp8Format::E4M3 };
    let a = rmsnorm_fp8::ForwardArgs { x: &x, w: &w, y: &y, inv_rms: &r, eps: 1e-5, y_codes: Some(c) };
    run(&mut || assert_eq!(rmsnorm_fp8::forward(&a), Ok(true)));
    vec![
        ("rmsnorm/y".into(), y),
        ("rmsnorm/inv_rms".into(), r),
        ("rmsnorm/codes".into(), codes),
        ("rmsnorm/amax".into(), amax),
    ]
}

fn swiglu(dev: tch::Device, run: &dyn Fn(&mut dyn FnMut())) -> Vec<(String, Tensor)> {
    let input = |phase: f64| {
        (fixed(&[7, 333], Kind::Float, dev, phase).nan_to_num(0.0, 0.0, 0.0).clamp(-2e3, 2e3) / 300.0)
            .to_kind(Kind::BFloat16)
    };
    let (gate, up, grad) = (input(3.0), input(4.0), input(5.0));
    let (h, gq, uq, hq) = (
        gate.zeros_like(),
        codes_like(&gate, Fp8Format::E4M3),
        codes_like(&gate, Fp8Format::E4M3),
        codes_like(&gate, Fp8Format::E5M2),
    );
    let (inv, amax, h_amax) = (
        Tensor::zeros([2], (Kind::Float, dev)),
        Tensor::zeros([2], (Kind::Float, dev)),
        Tensor::zeros([1], (Kind::Float, dev)),
    );
    let h_scale = Tensor::from_slice(&[3.0f32]).to_device(dev);
    let hc = DelayedCodes { codes: &hq, scale: &h_scale, amax: &h_amax, format: Fp8Format::E5M2 };
    let a = swiglu_fp8::ForwardArgs {
        gate: &gate,
        up: &up,
        out: &h,
        gate_codes: &gq,
        up_codes: &uq,
        scale_inv: &inv,
        amax: &amax,
        h: Some(hc),
    };
    run(&mut || assert_eq!(swiglu_fp8::forward(&a), Ok(true)));
    let (gg, gu) = (gate.zeros_like(), gate.zeros_like());
    let b = swiglu_fp8::BackwardArgs {
        gate_codes: &gq,
        up_codes: &uq,
        scale_inv: &inv,
        grad: &grad,
        grad_gate: &gg,
        grad_up: &gu,
    };
    run(&mut || assert_eq!(swiglu_fp8::backward(&b), Ok(true)));
    [
        ("h", h),
        ("gate_codes", gq),
        ("up_codes", uq),
        ("h_codes", hq),
        ("scale_inv", inv),
        ("amax", amax),
        ("h_amax", h_amax),
        ("grad_gate", gg),
        ("grad_up", gu),
    ]
    .into_iter()
    .map(|(n, t)| (format!("swiglu/{n}"), t))
    .collect()
}

fn rotary(dev: tch::Device, run: &dyn Fn(&mut dyn FnMut())) -> Vec<(String, Tensor)> {
    let bf16 = |shape: &[i64], phase: f64, m: f64| {
        (fixed(shape, Kind::Float, dev, phase).nan_to_num(0.0, 0.0, 0.0).clamp(-300.0, 300.0) * (m / 300.0))
            .to_kind(Kind::BFloat16)
    };
    let x = bf16(&[2, 7, 3, 20], 6.0, 40.0);
    let (cos, sin) = (bf16(&[2, 7, 1, 20], 7.0, 1.0), bf16(&[2, 7, 1, 20], 8.0, 1.0));
    let mut out = Vec::new();
    for (name, direction) in [("forward", rope::Direction::Forward), ("backward", rope::Direction::Backward)] {
        let y = x.zeros_like();
        let a = rope::RopeArgs { x: &x, cos: &cos, sin: &sin, y: &y, direction };
        run(&mut || assert_eq!(rope::launch(&a), Ok(true)));
        out.push((format!("rope/{name}"), y));
    }
    out
}

fn dropped(dev: tch::Device, run: &dyn Fn(&mut dyn FnMut())) -> Vec<(String, Tensor)> {
    let x = fixed(&[3, 6, 10], Kind::BFloat16, dev, 9.0);
    // Rank 0 of 2 on 11 tokens: chunks 0 and 3, the last position padding.
    let split = dropout::SplitRows { chunk: 3, starts: [0, 9], seq: 11 };
    // The finite values' amax: the fixed input's NaN and infinities made 0.
    let finite = x.nan_to_num(0.0, 0.0, 0.0);
    let amax = Tensor::zeros([1], (Kind::Float, dev));
    let mut out = Vec::new();
    for (name, x, split, amax) in
        [("alone", &x, None, None), ("split", &x, Some(split), None), ("amax", &finite, None, Some(&amax))]
    {
        let y = x.zeros_like();
        let a = dropout::DropoutArgs { x, y: &y, seed: 0x0123_4567_89ab_cdef, p: 0.1, split, amax };
        run(&mut || assert_eq!(dropout::launch(&a), Ok(true)));
        out.push((format!("dropout/{name}"), y));
    }
    out.push(("dropout/amax-of-y".into(), amax));
    out
}

/// FNV-1a over a tensor's bytes: enough to tell outputs apart, the same on every machine.
fn digest(t: &Tensor) -> String {
    let bytes = host_bytes(t).expect("a tensor LibTorch can copy");
    format!("{:016x}", bytes.iter().fold(0xcbf29ce484222325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100000001b3)))
}

/// `golden.txt`'s digests by output name.
fn golden() -> std::collections::BTreeMap<&'static str, &'static str> {
    GOLDEN.lines().filter(|l| !l.starts_with('#') && !l.is_empty()).filter_map(|l| l.split_once(' ')).collect()
}

/// Outputs whose last bit may differ between devices: bf16 results of `expf` and of sums in
/// another order (within a bf16 ulp; compared so on a GPU, by digest only on the CPU).
fn rounding_may_differ(name: &str) -> bool {
    ["rmsnorm/y", "rmsnorm/inv_rms", "swiglu/h", "swiglu/grad_gate", "swiglu/grad_up"].contains(&name)
}

/// Outputs made from those (codes and amaxes of y and h): a code may be one FP8 step off where
/// its value is; compared as values within an E5M2 step (a quarter) on a GPU.
fn derived_from_rounding(name: &str) -> bool {
    ["rmsnorm/codes", "rmsnorm/amax", "swiglu/h_codes", "swiglu/h_amax"].contains(&name)
}

/// The emulation's outputs on the fixed inputs have `golden.txt`'s digests (`LLORA_WRITE_GOLDEN=1`
/// rewrites the file: after a deliberate change, reviewed).
#[test]
fn the_emulation_gives_the_golden_outputs() {
    let got: Vec<(String, String)> = outputs(tch::Device::Cpu).iter().map(|(n, t)| (n.clone(), digest(t))).collect();
    if std::env::var_os("LLORA_WRITE_GOLDEN").is_some() {
        let text: String = got.iter().map(|(n, d)| format!("{n} {d}\n")).collect();
        let path = concat!(env!("CARGO_MANIFEST_DIR"), "/src/kernels/emulate/golden.txt");
        std::fs::write(
            path,
            format!("# Digests of the kernels' outputs on fixed inputs (kernels/emulate/golden.rs).\n{text}"),
        )
        .unwrap();
        return;
    }
    let want = golden();
    assert_eq!(want.len(), got.len(), "golden.txt has {} outputs, the cases {}", want.len(), got.len());
    for (name, d) in &got {
        assert_eq!(want.get(name.as_str()), Some(&d.as_str()), "{name}: the output moved");
    }
}

/// On a GPU: each output equals the emulation's, run here too (codes, transposes, amaxes and
/// scales bit for bit; bf16 results within a bf16 ulp), and the bit-exact ones have the golden
/// digests.
#[test]
#[ignore = "needs CUDA"]
fn the_device_gives_the_emulations_outputs() {
    assert!(tch::Cuda::is_available(), "this test needs a CUDA device");
    let (gpu, cpu) = (outputs(tch::Device::Cuda(0)), outputs(tch::Device::Cpu));
    let want = golden();
    for ((name, g), (_, c)) in gpu.iter().zip(&cpu) {
        let g = g.to_device(tch::Device::Cpu);
        if rounding_may_differ(name) {
            let (a, b) = (g.to_kind(Kind::Float), c.to_kind(Kind::Float));
            let ulp = b.abs().clamp_min(f64::from(f32::MIN_POSITIVE)) * 2f64.powi(-7);
            let off = (&a - &b).abs().gt_tensor(&ulp).logical_and(&a.eq_tensor(&b).logical_not()).sum(Kind::Int64);
            assert_eq!(off.int64_value(&[]), 0, "{name}: past a bf16 ulp of the emulation");
        } else if derived_from_rounding(name) {
            let (a, b) = (g.to_kind(Kind::Float), c.to_kind(Kind::Float));
            let off = (&a - &b).abs().gt_tensor(&(b.abs() * 0.25 + 1e-6)).sum(Kind::Int64);
            assert_eq!(off.int64_value(&[]), 0, "{name}: past an FP8 step of the emulation");
        } else {
            assert_eq!(host_bytes(&g), host_bytes(c), "{name}: the device differs from the emulation");
            assert_eq!(want.get(name.as_str()).copied(), Some(digest(&g).as_str()), "{name}: not the golden digest");
        }
    }
}
