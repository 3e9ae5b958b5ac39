use super::*;
use crate::kernels::args::host_bytes;
use crate::kernels::emulate::with_emulation;
use burn::tensor::{DType, Device, Distribution};

/// bf16 values of `shape` over ±`m` (normal), seeded.
fn values(shape: &[i64], m: f64, seed: i64) -> tch::Tensor {
    // Seeding the one CPU generator: tests that expect their own draws hold the same lock.
    let _rng = crate::device::torch_rng_lock();
    tch::manual_seed(seed);
    (tch::Tensor::randn(shape, (tch::Kind::Float, tch::Device::Cpu)) * m).to_kind(tch::Kind::BFloat16)
}

/// Our CUDA C run on the CPU (the emulation, grid-stride loops taking at most 2 blocks so that
/// they run more than once) equals the stand-in bit for bit, both ways, with tables shared by
/// the rows and one a row, at head dims with tails (10: halves of 5) and Llama's (128); the
/// output's buffer is followed by canaries the kernel must leave.
#[test]
fn the_kernel_emulated_equals_its_stand_in() {
    for (k, [b, s, h, hd]) in [[1, 1, 1, 2], [2, 5, 3, 10], [3, 33, 2, 128], [1, 7, 5, 64]].into_iter().enumerate() {
        let x = values(&[b, s, h, hd], 30.0, k as i64);
        for tb in [1, b] {
            let (cos, sin) =
                (values(&[tb, s, 1, hd], 1.0, 100 + k as i64), values(&[tb, s, 1, hd], 1.0, 200 + k as i64));
            for direction in [Direction::Forward, Direction::Backward] {
                let n = b * s * h * hd;
                let buffer = tch::Tensor::full([n + 32], 7.0, (tch::Kind::BFloat16, tch::Device::Cpu));
                let got = buffer.narrow(0, 0, n).view([b, s, h, hd]);
                let args = RopeArgs { x: &x, cos: &cos, sin: &sin, y: &got, direction };
                assert_eq!(with_emulation(Some(2), || rope::launch(&args)), Ok(true));
                let want = x.empty_like();
                stand_in(&RopeArgs { y: &want, ..args });
                let what = format!("{:?} tb {tb} {direction:?}", [b, s, h, hd]);
                assert_eq!(host_bytes(&got), host_bytes(&want), "{what}");
                assert!(buffer.narrow(0, n, 32).eq(7.0).all().int64_value(&[]) == 1, "{what}: a write past the end");
            }
        }
    }
}

/// The route on the CPU standing in for CUDA, inside autodiff, the kernel's CUDA C itself
/// running (emulated): q's rotation equals `apply_rope`'s composite (Burn's elementwise ops and
/// their autodiff: the independent reference) bit for bit, and its gradient in value (zeros of
/// either sign equal), with one table for all rows and one a row (packed rows); the route says
/// it was taken; the first-use check passes.
#[test]
fn the_route_equals_the_composite_and_its_autodiff() {
    let _on = crate::routes::on_cpu_for_this_thread(true);
    route_equals_composite(&Device::libtorch().autodiff());
    assert_eq!(check(tch::Device::Cpu), Ok(()));
}

/// The same on a GPU: our kernel in the route, against LibTorch's elementwise ops there.
#[test]
#[ignore = "needs CUDA"]
fn on_cuda_the_route_equals_the_composite_and_its_autodiff() {
    assert!(tch::Cuda::is_available(), "this test needs a CUDA device");
    route_equals_composite(&Device::libtorch_cuda(0).autodiff());
    assert_eq!(check(tch::Device::Cuda(0)), Ok(()));
}

fn route_equals_composite(device: &Device) {
    let _rng = crate::device::torch_rng_lock();
    device.seed(11);
    let (b, h, s, hd) = (2, 3, 9, 16);
    let x0 = Tensor::<4>::random([b, s, h, hd], Distribution::Normal(0.0, 4.0), device).cast(DType::BF16);
    let g = Tensor::<4>::random([b, h, s, hd], Distribution::Normal(0.0, 1.0), device).cast(DType::BF16);
    let (cos, sin) = super::super::rope_tables(s, hd, 10000.0, None, device);
    let per_row = |t: Tensor<4>| Tensor::cat(vec![t.clone(), t.flip([2])], 0);
    for (cos, sin) in [(cos.clone(), sin.clone()), (per_row(cos), per_row(sin))] {
        let (cos, sin) = (cos.cast(DType::BF16), sin.cast(DType::BF16));
        let run = |fused: bool| {
            let x = x0.clone().swap_dims(1, 2).require_grad();
            let y = if fused {
                with_emulation(Some(2), || super::super::apply_rope(x.clone(), cos.clone(), sin.clone()))
            } else {
                composite(x.clone(), cos.clone(), sin.clone())
            };
            let grads = with_emulation(Some(2), || (y.clone() * g.clone()).cast(DType::F32).sum().backward());
            (bits(y), x.grad(&grads).unwrap().cast(DType::F32).into_data().into_vec::<f32>().unwrap())
        };
        let (fused, reference) = (run(true), run(false));
        assert_eq!(fused.0, reference.0, "the rotation");
        assert_eq!(fused.1, reference.1, "the gradient (as values)");
    }
    assert!(ROUTE.used(), "the route was taken");
}

/// `apply_rope`'s composite, never the route.
fn composite(x: Tensor<4>, cos: Tensor<4>, sin: Tensor<4>) -> Tensor<4> {
    let _off = crate::routes::on_cpu_for_this_thread(false);
    super::super::apply_rope(x, cos, sin)
}

fn bits(t: Tensor<4>) -> Vec<u16> {
    t.cast(DType::F32)
        .into_data()
        .into_vec::<f32>()
        .unwrap()
        .iter()
        .map(|v| half::bf16::from_f32(*v).to_bits())
        .collect()
}
