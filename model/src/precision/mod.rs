//! Reduced-precision training: bf16 or FP8 (Transformer Engine's "hybrid" recipe) around the
//! linear layers, activations saved for backward in 8 bits, and frozen base weights in FP8.
//!
//! ```text
//!   forward   y  = Q₄₃(x; sₓ) · Q₄₃(W; s_w)ᵀ        Q₄₃: E4M3 quantise-dequantise
//!   backward  dx = Q₅₂(g; s_g) · Q₄₃(W; s_w)         Q₅₂: E5M2
//!             dW = Q₅₂(g; s_g)ᵀ · Q₄₃(x; sₓ)          (trainable W only: LoRA's A and B)
//! ```
//! Each scale comes from [`DelayedScaling`] (one per tensor role and layer). The frozen base
//! layers' `y` and `dx` GEMMs run on torch's `_scaled_mm` ([`scaled_mm`]: FP8 tensor cores on
//! CUDA sm_89+, oneDNN on the CPU), f32 accumulation, output in the activations' dtype. `dW`
//! exists only for trainable weights (LoRA's, which run in bf16: [`PrecisionSpec::for_adapters`];
//! an FP8 trainable weight, in tests, takes an f32 GEMM on the dequantised operands, which is
//! what an FP8 GEMM with f32 accumulation computes up to summation order).
//!
//! What is stored, and in which dtype:
//! - `compute = "fp8"`: a linear layer whose weight is trainable keeps its input for the
//!   weight gradient. With `fp8_activations` it keeps the E4M3 codes it computed with (1 byte,
//!   bit-identical gradients); without, the f32 input, quantised again in backward.
//! - `fp8_activations` also stores the SwiGLU inputs (gate and up, the MLP's largest saved
//!   tensors) as E4M3 with a per-tensor scale from their own amax (current scaling: the
//!   amax is at hand when they are written), and, for `compute` fp32/bf16, linear inputs.
//! - `fp8_weights` (with `compute = "fp8"`): frozen base weights are quantised once after
//!   loading (E4M3, scale from their exact amax) and the f32 copy is dropped; `compute =
//!   "bf16"` keeps frozen weights in bf16.
//!
//! Everything here is a LibTorch backend extension (CPU and CUDA); other backends run fp32.
//!
//! Files, one concern each (each uses only files below it in this list): `nodes.rs` the ops as
//! autodiff nodes (the quantised linear layer of a parameter or of a stored frozen weight,
//! DoRA's weight terms, SwiGLU); `linear.rs` one linear layer's precision and scaling state and
//! its GEMMs on LibTorch tensors (the weight is the layer's: `lora.rs` `BaseWeight`, one enum,
//! passed in as a `LinearWeight`; its delayed-scaling states are `fp8/recipe.rs`'s); `weights.rs` frozen
//! weights stored in bf16, FP8 or NF4, and converting one to its storage (`nf4.rs` the format); the FP8
//! GEMM is `fp8/gemm.rs`; `bf16.rs`, `blocked.rs` GEMM helpers; `swiglu_route.rs` SwiGLU's FP8 route on our kernel; `spec.rs` what runs in which dtype.

pub mod bf16;
pub mod blocked;
mod linear;
pub mod nf4;
mod nodes;
mod spec;
pub mod swiglu_route;
pub(crate) mod weights;

pub use crate::fp8::scaling_state::{LinearScales, Role};
pub use linear::{LinearPrecision, LinearWeight, read_amaxes};
pub use nodes::{
    PrecisionBackend, frozen_linear, precision_linear, precision_linear_reading, stored_row_terms, swiglu,
    take_saved_bytes, weight_row_terms,
};

pub use crate::shard::FrozenWeight;
pub use spec::{AdapterCompute, Compute, Nf4Spec, PrecisionSpec, Storage};
pub use weights::{Nf4Scales, StoredWeight};

/// The LibTorch device behind a Burn device, if it is one.
pub fn tch_device(device: &burn::tensor::Device) -> Option<tch::Device> {
    use burn::backend::{DispatchDevice, LibTorchDevice};
    match device.clone().inner().as_dispatch() {
        DispatchDevice::LibTorch(LibTorchDevice::Cpu) => Some(tch::Device::Cpu),
        DispatchDevice::LibTorch(LibTorchDevice::Cuda(n)) => Some(tch::Device::Cuda(*n)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use burn::tensor::Tensor;

    use super::*;
    use crate::fp8::{AmaxSpec, Fp8Format, SharedCodes};
    use crate::lora::LoraLinear;
    use burn::tensor::{Device, Distribution, TensorData, Tolerance};

    fn fp8_spec(fp8_activations: bool, fp8_weights: bool) -> PrecisionSpec {
        PrecisionSpec {
            compute: Compute::Fp8,
            fp8_activations,
            fp8_weights,
            amax: AmaxSpec::default(),
            ..Default::default()
        }
    }

    fn host(t: &Tensor<2>) -> Vec<f32> {
        t.to_data().into_vec::<f32>().unwrap()
    }

    fn amax(xs: &[f32]) -> f32 {
        xs.iter().fold(0.0f32, |m, x| m.max(x.abs()))
    }

    /// Keeping a layer's input in FP8 (`fp8_activations`) changes what backward reads, never
    /// the forward: under fp32 and bf16 compute on f32 activations the output, and the input
    /// itself, equal those without it bit for bit (the kept codes were once made by scaling
    /// the f32 input in place: an adapter's GEMM then read x·s).
    #[test]
    fn inputs_kept_in_fp8_leave_the_forward_alone() {
        let _rng = crate::device::torch_rng_lock();
        let device = Device::libtorch().autodiff();
        device.seed(4);
        let x0 = Tensor::<2>::random([6, 8], Distribution::Normal(0.0, 2.0), &device);
        let w = Tensor::<2>::random([4, 8], Distribution::Normal(0.0, 0.3), &device).require_grad();
        for compute in [Compute::Fp32, Compute::Bf16] {
            let y = |fp8_activations: bool| {
                let x = x0.clone().require_grad();
                let q =
                    Arc::new(LinearPrecision::new(PrecisionSpec { compute, fp8_activations, ..Default::default() }));
                let y = precision_linear(x.clone().unsqueeze::<3>(), w.clone(), &q, true).squeeze::<2>();
                let y = host(&y.cast(burn::tensor::DType::F32));
                (y, host(&x))
            };
            let (plain, kept) = (y(false), y(true));
            assert_eq!(kept.1, host(&x0), "{compute:?}: the input changed");
            assert_eq!(kept.0, plain.0, "{compute:?}: the output changed");
        }
    }

    /// Quantise-dequantise on the host with the scalar emulation.
    fn qdq(xs: &[f32], scale: f32, f: Fp8Format) -> Vec<f32> {
        f.dequantize_slice(&f.quantize_slice(xs, scale), 1.0 / scale)
    }

    /// `a [n, k] · bᵀ ([m, k])` on the host, in f64.
    fn matmul_t(a: &[f32], b: &[f32], n: usize, k: usize, m: usize) -> Vec<f32> {
        let mut out = vec![0.0f32; n * m];
        for i in 0..n {
            for j in 0..m {
                out[i * m + j] = (0..k).map(|l| f64::from(a[i * k + l]) * f64::from(b[j * k + l])).sum::<f64>() as f32;
            }
        }
        out
    }

    fn transpose(a: &[f32], r: usize, c: usize) -> Vec<f32> {
        (0..c * r).map(|i| a[(i % r) * c + i / r]).collect()
    }

    fn assert_close(got: &[f32], want: &[f32], what: &str) {
        let scale = amax(want).max(1e-12);
        let err = got.iter().zip(want).fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(err / scale < 2e-6, "{what}: max error {err:e} against max |value| {scale:e}");
    }

    /// One step of the hybrid recipe through the op equals a host computation built from the
    /// scalar emulation: E4M3 input and weight (scales from their first amax), E5M2 gradient.
    #[test]
    fn fp8_linear_matches_the_emulated_recipe() {
        let _rng = crate::device::torch_rng_lock();
        let device = Device::libtorch().autodiff();
        device.seed(3);
        let (n, k, m) = (6, 16, 8);
        let x0 = Tensor::<2>::random([n, k], Distribution::Normal(0.0, 1.5), &device);
        let w0 = Tensor::<2>::random([m, k], Distribution::Normal(0.0, 0.2), &device);
        let g0 = Tensor::<2>::random([n, m], Distribution::Normal(0.0, 1e-3), &device);
        for fp8_activations in [false, true] {
            let quant = Arc::new(LinearPrecision::new(fp8_spec(fp8_activations, false)));
            let (x, w) = (x0.clone().require_grad(), w0.clone().require_grad());
            let _ = crate::fp8::gemm::take_gemm_counts();
            let y = precision_linear(x.clone().unsqueeze::<3>(), w.clone(), &quant, true).squeeze::<2>();
            let grads = (y.clone() * g0.clone()).sum().backward();
            let (dx, dw) = (x.grad(&grads).unwrap(), w.grad(&grads).unwrap());
            // y and dx ran as FP8 GEMMs (on the CPU: `_scaled_mm` or its emulation, whichever
            // the probe chose); dW (a trainable FP8 weight) is emulated in f32.
            let c = crate::fp8::gemm::take_gemm_counts();
            assert_eq!((c.scaled_mm + c.emulated, c.fallback), (2, 0), "{c:?}");

            let (xh, wh, gh) = (host(&x0), host(&w0), host(&g0));
            let xq = qdq(&xh, 448.0 / amax(&xh), Fp8Format::E4M3);
            let wq = qdq(&wh, 448.0 / amax(&wh), Fp8Format::E4M3);
            let gq = qdq(&gh, 57344.0 / amax(&gh), Fp8Format::E5M2);
            assert_close(&host(&y.clone().inner()), &matmul_t(&xq, &wq, n, k, m), "y");
            assert_close(&host(&dx), &matmul_t(&gq, &transpose(&wq, m, k), n, m, k), "dx");
            assert_close(&host(&dw), &matmul_t(&transpose(&gq, n, m), &transpose(&xq, n, k), m, n, k), "dW");
            // The quantisation is visible: f32 would differ by far more than the tolerance.
            let exact = matmul_t(&xh, &wh, n, k, m);
            let diff = host(&y.inner()).iter().zip(&exact).fold(0.0f32, |a, (p, q)| a.max((p - q).abs()));
            assert!(diff > 1e-3 * amax(&exact), "FP8 output equals f32 ({diff:e})");
            // A trainable weight keeps its input: 1 byte + scale in FP8, else 4 bytes.
            let _ = take_saved_bytes();
            let _y = precision_linear(x0.clone().unsqueeze::<3>(), w0.clone().require_grad(), &quant, true);
            assert_eq!(take_saved_bytes(), if fp8_activations { n * k + 4 } else { n * k * 4 });
        }
    }

    /// Delayed scaling on our kernel's route (its CPU stand-in, the switch on for this thread):
    /// three training steps give the LibTorch routes' outputs, gradients and next scales bit
    /// for bit, the amaxes taken in the codes' pass and recorded, the kernel counted.
    #[test]
    fn delayed_scaling_on_the_kernel_route_equals_the_libtorch_routes() {
        let _rng = crate::device::torch_rng_lock();
        let device = Device::libtorch().autodiff();
        device.seed(6);
        let (n, k, m) = (9, 24, 16);
        let x0 = Tensor::<2>::random([n, k], Distribution::Normal(0.0, 1.5), &device);
        let w0 = Tensor::<2>::random([m, k], Distribution::Normal(0.0, 0.2), &device);
        let g0 = Tensor::<2>::random([n, m], Distribution::Normal(0.0, 1e-3), &device);
        let run = |on: bool| {
            let _switch = crate::routes::on_cpu_for_this_thread(on);
            let quant = Arc::new(LinearPrecision::new(fp8_spec(true, false)));
            let _ = crate::fp8::take_quantiser_counts();
            let mut last = Vec::new();
            for _ in 0..3 {
                let (x, w) = (x0.clone().require_grad(), w0.clone().require_grad());
                let y = precision_linear(x.clone().unsqueeze::<3>(), w.clone(), &quant, true).squeeze::<2>();
                let grads = (y.clone() * g0.clone()).sum().backward();
                last = [host(&y.inner()), host(&x.grad(&grads).unwrap()), host(&w.grad(&grads).unwrap())].concat();
                quant.update();
            }
            let s = quant.scales.lock().unwrap();
            last.extend([s.input.scale, s.weight.scale, s.grad.scale]);
            (last.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), crate::fp8::take_quantiser_counts())
        };
        let (plain, plain_counts) = run(false);
        let (kernel, kernel_counts) = run(true);
        assert_eq!(plain_counts.kernel, 0);
        // Each step quantises x and W forward, the gradient and W again backward, all on the
        // kernel (the saved input is kept as its FP8 codes); the first with scales read first.
        assert_eq!(kernel_counts.kernel, 12, "{kernel_counts:?}");
        assert!(kernel == plain, "outputs, gradients or scales differ on the kernel's route");
    }

    /// Three projections of one input (q, k, v) handed one [`SharedCodes`] quantise the input
    /// once per step where without it they quantise it three times, and give the same outputs,
    /// gradients and next scales bit for bit over three steps (the scales, made from one amax
    /// history, stay equal); a handle at another scale is not taken.
    #[test]
    fn projections_of_one_input_share_its_codes() {
        let _rng = crate::device::torch_rng_lock();
        let device = Device::libtorch().autodiff();
        device.seed(8);
        let (n, k, m) = (9, 24, 16);
        let x0 = Tensor::<2>::random([n, k], Distribution::Normal(0.0, 1.5), &device);
        let ws: Vec<_> = (0..3).map(|_| Tensor::<2>::random([m, k], Distribution::Normal(0.0, 0.2), &device)).collect();
        let g0 = Tensor::<2>::random([n, m], Distribution::Normal(0.0, 1e-3), &device);
        let run = |share: bool| {
            let quants: Vec<_> = (0..3).map(|_| Arc::new(LinearPrecision::new(fp8_spec(true, false)))).collect();
            let mut out = Vec::new();
            let mut counts = Vec::new();
            for _ in 0..3 {
                let x = x0.clone().require_grad();
                let _ = crate::fp8::take_quantiser_counts();
                let codes = share.then(SharedCodes::new);
                let ys: Vec<Tensor<2>> = quants
                    .iter()
                    .zip(&ws)
                    .map(|(q, w)| {
                        precision_linear_reading(x.clone().unsqueeze::<3>(), w.clone(), q, true, codes.as_ref())
                            .squeeze::<2>()
                    })
                    .collect();
                let c = crate::fp8::take_quantiser_counts();
                counts.push(c.kernel + c.two_pass + c.via_f32);
                let loss = ys
                    .iter()
                    .fold(Tensor::<2>::zeros([n, m], &device).sum(), |acc, y| acc + (y.clone() * g0.clone()).sum());
                let grads = loss.backward();
                out = ys
                    .iter()
                    .map(|y| host(&y.clone().inner()))
                    .chain([host(&x.grad(&grads).unwrap())])
                    .collect::<Vec<_>>()
                    .concat();
                quants.iter().for_each(|q| q.update());
            }
            out.extend(quants.iter().map(|q| q.scales.lock().unwrap().input.scale));
            (out.iter().map(|v| v.to_bits()).collect::<Vec<_>>(), counts)
        };
        let (apart, apart_counts) = run(false);
        let (shared, shared_counts) = run(true);
        assert!(shared == apart, "sharing the input's codes changed outputs, gradients or scales");
        // Forward quantisations after the first step (which reads each amax first, makes each
        // scale then and shares nothing): x for each projection and each one's W (a
        // parameter) apart; x once shared.
        assert_eq!((&apart_counts[1..], &shared_counts[1..]), (&[6, 6][..], &[4, 4][..]));
        // Codes handed over at another scale are not taken: the layer quantises at its own.
        let q = Arc::new(LinearPrecision::new(fp8_spec(true, false)));
        let y = |x: Tensor<2>, codes: Option<&SharedCodes>| {
            host(&precision_linear_reading(x.unsqueeze::<3>(), ws[0].clone(), &q, true, codes).squeeze::<2>().inner())
        };
        let _ = y(x0.clone(), None);
        q.update();
        let scale = q.ready_input_scale(true).unwrap();
        let zeros = || tch::Tensor::zeros([n as i64, k as i64], (Fp8Format::E4M3.kind(), tch::Device::Cpu));
        let handed = |at: f32| {
            let codes = SharedCodes::new();
            codes.offer(crate::fp8::Fp8Tensor::host(zeros(), 1.0 / at), tch::Tensor::from(1.0f32), at);
            codes
        };
        let own = y(x0.clone(), None);
        assert_eq!(y(x0.clone(), Some(&handed(scale * 2.0))), own);
        assert_ne!(y(x0.clone(), Some(&handed(scale))), own, "codes at its scale are taken");
    }

    /// On bf16 activations (as training in FP8 runs them) the FP8 GEMMs write bf16: y and dx
    /// are the emulated recipe's, rounded once to bf16.
    #[test]
    fn fp8_linear_on_bf16_activations_writes_bf16() {
        let _rng = crate::device::torch_rng_lock();
        use burn::tensor::DType;
        let device = Device::libtorch().autodiff();
        device.seed(4);
        let (n, k, m) = (32, 48, 16);
        let x0 = Tensor::<2>::random([n, k], Distribution::Normal(0.0, 1.5), &device).cast(DType::BF16);
        let w0 = Tensor::<2>::random([m, k], Distribution::Normal(0.0, 0.2), &device);
        let g0 = Tensor::<2>::random([n, m], Distribution::Normal(0.0, 1e-3), &device).cast(DType::BF16);
        let quant = Arc::new(LinearPrecision::new(fp8_spec(true, false)));
        let x = x0.clone().require_grad();
        let y = precision_linear(x.clone().unsqueeze::<3>(), w0.clone(), &quant, true).squeeze::<2>();
        assert_eq!(y.dtype(), DType::BF16);
        let grads = (y.clone() * g0.clone()).sum().backward();
        let dx = x.grad(&grads).unwrap();
        assert_eq!(dx.dtype(), DType::BF16);
        let f32_host = |t: Tensor<2>| host(&t.cast(DType::F32));
        let (xh, wh, gh) = (f32_host(x0), host(&w0), f32_host(g0));
        let xq = qdq(&xh, 448.0 / amax(&xh), Fp8Format::E4M3);
        let wq = qdq(&wh, 448.0 / amax(&wh), Fp8Format::E4M3);
        let gq = qdq(&gh, 57344.0 / amax(&gh), Fp8Format::E5M2);
        for (got, want, what) in [
            (f32_host(y.inner()), matmul_t(&xq, &wq, n, k, m), "y"),
            (f32_host(dx), matmul_t(&gq, &transpose(&wq, m, k), n, m, k), "dx"),
        ] {
            // One bf16 rounding: within half an ulp (2^-9 relative) of each value.
            for (a, b) in got.iter().zip(&want) {
                assert!((a - b).abs() <= b.abs() * 2f32.powi(-8) + 1e-30, "{what}: {a} against {b}");
            }
        }
    }

    /// Delayed scaling in use: step 2 quantises with the scale from step 1's amax, so a larger
    /// input saturates at step 1's range.
    #[test]
    fn the_next_step_uses_the_previous_amax() {
        let device = Device::libtorch().autodiff();
        let quant = Arc::new(LinearPrecision::new(fp8_spec(false, false)));
        let w = Tensor::<2>::from_data(TensorData::new(vec![1.0f32], [1, 1]), &device);
        let run = |v: f32| {
            host(
                &precision_linear(
                    Tensor::<3>::from_data(TensorData::new(vec![v, -v / 2.0], [1, 2, 1]), &device),
                    w.clone(),
                    &quant,
                    true,
                )
                .reshape([2, 1])
                .inner(),
            )
        };
        assert_eq!(run(2.0), vec![2.0, -1.0]);
        quant.update();
        // Scale 448/2 = 224: 4·224 saturates to 448 → 2; −2·224 = −448 is exact.
        assert_eq!(run(4.0), vec![2.0, -2.0]);
        quant.update();
        assert_eq!(quant.scales.lock().unwrap().input.scale, 448.0 / 4.0);
        assert_eq!(run(4.0), vec![4.0, -2.0]);
    }

    /// The fused SwiGLU equals Burn's composite in value and gradients (f32 storage), keeps
    /// 2 tensors, and with FP8 storage keeps 1 byte per element at a gradient error of the
    /// order of E4M3's resolution.
    #[test]
    fn swiglu_matches_composite_and_stores_fp8() {
        let _rng = crate::device::torch_rng_lock();
        let device = Device::libtorch().autodiff();
        device.seed(5);
        let shape = [2, 7, 24];
        let g0 = Tensor::<3>::random(shape, Distribution::Normal(0.0, 2.0), &device);
        let u0 = Tensor::<3>::random(shape, Distribution::Normal(0.0, 1.0), &device);
        let w = Tensor::<3>::random(shape, Distribution::Normal(0.0, 1.0), &device);
        let run = |fused: Option<Storage>| {
            let (g, u) = (g0.clone().require_grad(), u0.clone().require_grad());
            let out = match fused {
                Some(storage) => swiglu(g.clone(), u.clone(), storage, None),
                None => burn::tensor::activation::silu(g.clone()) * u.clone(),
            };
            let grads = (out.clone() * w.clone()).sum().backward();
            (out.inner(), g.grad(&grads).unwrap(), u.grad(&grads).unwrap())
        };
        let _ = take_saved_bytes();
        let reference = run(None);
        let fused = run(Some(Storage::F32));
        assert_eq!(take_saved_bytes(), 2 * 2 * 7 * 24 * 4);
        let tol = Tolerance::<f32>::relative(1e-5).set_absolute(1e-6);
        fused.0.into_data().assert_approx_eq::<f32>(&reference.0.clone().into_data(), tol);
        fused.1.into_data().assert_approx_eq::<f32>(&reference.1.clone().into_data(), tol);
        fused.2.into_data().assert_approx_eq::<f32>(&reference.2.clone().into_data(), tol);
        let fp8 = run(Some(Storage::Fp8));
        assert_eq!(take_saved_bytes(), 2 * (2 * 7 * 24 + 4));
        for (got, want) in [(fp8.1, reference.1), (fp8.2, reference.2)] {
            let rel = (got - want.clone()).abs().max().into_scalar::<f32>() / want.abs().max().into_scalar::<f32>();
            assert!(rel > 1e-4 && rel < 0.1, "FP8-stored gradient error {rel}");
        }
    }

    /// FP8 frozen weights: 1 byte per element + scale, the f32 copy gone, the forward equal to
    /// the weight quantised with its exact amax; bf16 keeps 2 bytes.
    #[test]
    fn frozen_weights_are_stored_in_fp8() {
        let _rng = crate::device::torch_rng_lock();
        let device = Device::libtorch().autodiff();
        device.seed(9);
        let w = Tensor::<2>::random([12, 20], Distribution::Normal(0.0, 0.05), &device);
        let x = Tensor::<2>::random([3, 20], Distribution::Normal(0.0, 1.0), &device);
        let mut linear = LoraLinear::new(w.clone(), false);
        assert_eq!(linear.base_weight_bytes(), 12 * 20 * 4);
        linear.set_precision(&fp8_spec(true, true), &device);
        assert_eq!(linear.base_weight_bytes(), 12 * 20 + 4);
        assert!(linear.weight.param().is_none(), "the f32 parameter is gone");
        assert_eq!(linear.dims(), [12, 20]);
        let (wh, xh) = (host(&w), host(&x));
        let wq = qdq(&wh, 448.0 / amax(&wh), Fp8Format::E4M3);
        assert_eq!(host(&linear.base_weight(&device)), wq);
        let y = linear.forward(x.clone().unsqueeze::<3>(), true).squeeze::<2>();
        let xq = qdq(&xh, 448.0 / amax(&xh), Fp8Format::E4M3);
        assert_close(&host(&y.inner()), &matmul_t(&xq, &wq, 3, 20, 12), "y");

        // Converted two rows at a time: the same codes and scale as in one piece.
        let spec = fp8_spec(true, true);
        let chunked = StoredWeight::store_in_chunks(&spec, &wh, [12, 20], tch::Device::Cpu, 40).unwrap();
        assert_eq!(Vec::<f32>::try_from(&chunked.dequantize().flatten(0, -1)).unwrap(), wq);
        // Converted where it lies (a random weight drawn on its device): the same codes and
        // scale; bf16 the same rounding; NF4 left to the host quantiser.
        let on_device = tch::Tensor::from_slice(&wh).reshape([12, 20]);
        let stored = StoredWeight::store_on_device(&spec, &on_device).unwrap();
        assert_eq!(Vec::<f32>::try_from(&stored.dequantize().flatten(0, -1)).unwrap(), wq);
        let bf16 = PrecisionSpec { compute: Compute::Bf16, ..Default::default() };
        let (a, b) = (
            StoredWeight::store_on_device(&bf16, &on_device).unwrap().dequantize(),
            StoredWeight::store(&bf16, &wh, [12, 20], tch::Device::Cpu).unwrap().dequantize(),
        );
        assert!(a.equal(&b) && a.kind() == tch::Kind::Float, "bf16 on the device differs from the host path");
        let nf4 = PrecisionSpec { nf4: Some(Nf4Spec { block: 64, double: true }), ..bf16 };
        assert!(StoredWeight::store_on_device(&nf4, &on_device).is_none());
        assert!(StoredWeight::store_on_device(&PrecisionSpec::default(), &on_device).is_none(), "f32 stays f32");

        let mut bf = LoraLinear::new(w, false);
        bf.set_precision(&PrecisionSpec { compute: Compute::Bf16, ..Default::default() }, &device);
        assert_eq!(bf.base_weight_bytes(), 12 * 20 * 2);
    }
}
