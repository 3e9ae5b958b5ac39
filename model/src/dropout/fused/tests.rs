use super::*;
use crate::kernels::args::host_bytes;
use crate::kernels::emulate::with_emulation;
use burn::tensor::{DType, Device, Tensor};

/// bf16 values of `shape` over ±`m` (normal), seeded, with zeros of both signs and a NaN
/// (kept or dropped, it stays NaN: `x · 0`).
fn values(shape: &[i64], m: f64, seed: i64) -> tch::Tensor {
    // Seeding the one CPU generator: tests that expect their own draws hold the same lock.
    let _rng = crate::device::torch_rng_lock();
    tch::manual_seed(seed);
    let x = (tch::Tensor::randn(shape, (tch::Kind::Float, tch::Device::Cpu)) * m).to_kind(tch::Kind::BFloat16);
    let flat = x.view([-1]);
    for (at, v) in [(0, 0.0), (1, -0.0), (2, f64::NAN)] {
        if at < flat.numel() as i64 {
            let _ = flat.narrow(0, at, 1).fill_(v);
        }
    }
    x
}

/// The bf16 bits of `t`, every NaN as one: CUDA's conversion writes 0x7fff where LibTorch's
/// CPU writes 0x7fc0 (both quiet NaNs; the golden digests hold the kernel's own).
fn bits(t: &tch::Tensor) -> Vec<u16> {
    let b = host_bytes(t).unwrap();
    b.chunks_exact(2)
        .map(|h| u16::from_le_bytes([h[0], h[1]]))
        .map(|v| if v & 0x7fff > 0x7f80 { 0x7fc0 } else { v })
        .collect()
}

/// Our CUDA C run on the CPU (the emulation, grid-stride loops taking at most 2 blocks so that
/// they run more than once) equals the stand-in bit for bit: a tensor's own mask at sizes with
/// tails (1, 3, 4·k + 3 elements) and widths that are no multiple of four, and every rank's rows
/// of 2- and 4-rank splits (padding rows among them); the output's buffer is followed by
/// canaries the kernel must leave.
#[test]
fn the_kernel_emulated_equals_its_stand_in() {
    let mut cases: Vec<(Vec<i64>, Option<ContextSplit>)> =
        vec![(vec![1], None), (vec![3], None), (vec![2, 7, 9], None), (vec![3, 33, 64], None), (vec![1031], None)];
    for (seq, size) in [(10, 2), (11, 2), (13, 4), (64, 4)] {
        for rank in 0..size {
            let split = ContextSplit::new(seq, rank, size);
            cases.push((vec![2, split.local_len() as i64, 6], Some(split)));
        }
    }
    for (k, (shape, split)) in cases.into_iter().enumerate() {
        for p in [0.1, 0.5] {
            let x = values(&shape, 30.0, k as i64);
            let n = x.numel() as i64;
            let buffer = tch::Tensor::full([n + 32], 7.0, (tch::Kind::BFloat16, tch::Device::Cpu));
            let got = buffer.narrow(0, 0, n).view(&shape[..]);
            // The amax folded into a lower bound (none of the case's values, NaN aside, reach
            // 2^20), as into an amax other writers share.
            let amax = |v: f32| tch::Tensor::from_slice(&[v]);
            let (got_amax, want_amax) = (amax(0.5), amax(0.5));
            let args =
                DropoutArgs { x: &x, y: &got, seed: 1000 + k as u64, p, split: split.map(rows), amax: Some(&got_amax) };
            assert_eq!(with_emulation(Some(2), || kernel::launch(&args)), Ok(true));
            let want = x.empty_like();
            stand_in(&DropoutArgs { y: &want, amax: Some(&want_amax), ..args });
            let what = format!("{shape:?} {split:?} p {p}");
            assert_eq!(bits(&got), bits(&want), "{what}");
            let (ga, wa) = (got_amax.double_value(&[0]), want_amax.double_value(&[0]));
            assert!(ga == wa || (ga.is_nan() && wa.is_nan()), "{what}: amax {ga} against {wa}");
            assert!(buffer.narrow(0, n, 32).eq(7.0).all().int64_value(&[]) == 1, "{what}: a write past the end");
        }
    }
}

/// The stand-in's mask, against Philox by hand: element (row, local token, column) of a rank
/// is kept exactly when the word at its index in the whole `[rows, seq, width]` mask (the
/// global position from `ContextSplit::local_positions`) is below ⌊(1 − p)·2³²⌋, and padding
/// is kept; without a split element i's word is word i. Ones in, so kept elements are 1/(1 − p).
#[test]
fn the_mask_is_philox_at_each_elements_index_in_the_whole_sequence() {
    let (seed, p, width) = (77u64, 0.4, 3usize);
    let threshold = ((1.0 - p) * 4_294_967_296.0) as u32;
    let kept = |shape: &[i64], split: Option<ContextSplit>| -> Vec<bool> {
        let x = tch::Tensor::ones(shape, (tch::Kind::BFloat16, tch::Device::Cpu));
        let y = x.empty_like();
        stand_in(&DropoutArgs { x: &x, y: &y, seed, p, split: split.map(rows), amax: None });
        Vec::<f32>::try_from(&y.to_kind(tch::Kind::Float).view([-1])).unwrap().iter().map(|&v| v != 0.0).collect()
    };
    let alone = kept(&[50], None);
    assert_eq!(alone, (0..50).map(|i| philox::word(seed, i) < threshold).collect::<Vec<_>>());
    let seq = 13;
    for rank in 0..4 {
        let split = ContextSplit::new(seq, rank, 4);
        let got = kept(&[2, split.local_len() as i64, width as i64], Some(split));
        let mut want = Vec::new();
        for row in 0..2 {
            for pos in split.local_positions() {
                for col in 0..width {
                    let g = ((row * seq + pos) * width + col) as u64;
                    want.push(pos >= seq || philox::word(seed, g) < threshold);
                }
            }
        }
        assert_eq!(got, want, "rank {rank} of 4");
    }
}

/// The route on the CPU standing in for CUDA, inside autodiff, the kernel's CUDA C running
/// (emulated) on bf16: kept elements are bf16(x/(1−p)) and the rest zero; about p of 2¹⁶ are
/// dropped, and as many of each pair of neighbours and of elements four apart (a Philox
/// block's edge) as independent draws drop; the gradient of Σ w·y is w·mask/(1−p) with the
/// forward's mask (redrawn by backward from the seed); two dropouts of one input differ; the
/// route says it was taken; the first-use check passes.
#[test]
fn the_route_drops_scales_and_redraws_its_mask_in_backward() {
    let _on = crate::routes::on_cpu_for_this_thread(true);
    // The verdict first: while another test's first-use check runs, the route is refused.
    assert_eq!(checked_on(tch::Device::Cpu), Ok(()));
    let _rng = crate::device::torch_rng_lock();
    let device = Device::libtorch().autodiff();
    let p = 0.25;
    device.seed(5);
    let n = 1 << 16;
    let x0 = Tensor::<1>::random([n], burn::tensor::Distribution::Normal(0.0, 3.0), &device).cast(DType::BF16);
    let w = Tensor::<1>::random([n], burn::tensor::Distribution::Normal(0.0, 1.0), &device).cast(DType::BF16);
    let f32s = |t: Tensor<1>| t.cast(DType::F32).into_data().to_vec::<f32>().unwrap();
    let x = x0.clone().require_grad();
    let (y, other) =
        with_emulation(Some(2), || (crate::dropout::dropout(x.clone(), p), crate::dropout::dropout(x.clone(), p)));
    let grads = with_emulation(Some(2), || (y.clone() * w.clone()).cast(DType::F32).sum().backward());
    let (xs, ys, ws, gs) = (f32s(x0), f32s(y.inner()), f32s(w), f32s(x.grad(&grads).unwrap()));
    let bf = |v: f32| half::bf16::from_f32(v).to_f32();
    assert!(!xs.contains(&0.0), "a zero input hides whether it was kept");
    let keep: Vec<bool> = ys.iter().map(|y| *y != 0.0).collect();
    for i in 0..n {
        let (want_y, want_g) = if keep[i] { (bf(xs[i] * (1.0 / 0.75)), bf(ws[i] * (1.0 / 0.75))) } else { (0.0, 0.0) };
        assert_eq!((ys[i], gs[i]), (want_y, want_g), "element {i}: x {} w {}", xs[i], ws[i]);
    }
    let rate = |pairs: &[(bool, bool)]| pairs.iter().filter(|(a, b)| !a && !b).count() as f64 / pairs.len() as f64;
    let dropped = keep.iter().filter(|k| !**k).count() as f64 / n as f64;
    assert!((dropped - p).abs() < 0.01, "dropped {dropped}");
    for lag in [1, 4] {
        let pairs: Vec<(bool, bool)> = (0..n - lag).map(|i| (keep[i], keep[i + lag])).collect();
        let both = rate(&pairs);
        assert!((both - p * p).abs() < 0.01, "both of a pair {lag} apart dropped: {both}");
    }
    assert_ne!(f32s(other.inner()), ys, "two draws, two masks");
    assert!(ROUTE.used(), "the route was taken");
}

/// A context-parallel rank's dropout on the route (bf16, the CPU standing in for CUDA, the
/// kernel emulated) keeps exactly its rows of one process's whole-sequence dropout, forward
/// and backward: the test LibTorch's route passes, on the kernel.
#[test]
fn on_the_route_a_split_dropout_is_the_rows_of_the_whole_sequence_dropout() {
    let _on = crate::routes::on_cpu_for_this_thread(true);
    assert_eq!(checked_on(tch::Device::Cpu), Ok(()));
    with_emulation(Some(2), || {
        crate::dropout::tests::split_dropout_is_rows_of_whole(Device::libtorch().autodiff(), DType::BF16)
    });
    assert!(ROUTE.used(), "the route was taken");
}

/// The same on a GPU: our kernel against its stand-in there, and a split rank's rows.
#[test]
#[ignore = "needs CUDA"]
fn on_cuda_the_kernel_equals_its_stand_in_and_a_split_is_the_rows_of_the_whole() {
    assert!(tch::Cuda::is_available(), "this test needs a CUDA device");
    assert_eq!(check(tch::Device::Cuda(0)), Ok(()));
    crate::dropout::tests::split_dropout_is_rows_of_whole(Device::libtorch_cuda(0).autodiff(), DType::BF16);
    assert!(ROUTE.used(), "the route was taken");
}

/// The dropout takes the amax its reader's FP8 copy needs: on the route (bf16, the CPU standing
/// in for CUDA, the kernel emulated) a dropout run inside `offering_amax` hands over the max of
/// its output's |values| (LibTorch's, bit for bit), and the copy quantised at that amax is the
/// copy current scaling makes with its own amax pass (codes and inverse scale, bit for bit; on
/// the kernel's route and, routes off, on LibTorch's); off the route nothing is handed over.
#[test]
fn the_dropout_hands_its_amax_to_the_fp8_copy_of_its_reader() {
    use crate::fp8::{Fp8Format, SharedCodes, amax_on_device, quantize_current_at_amax, quantize_current_on_device};
    let _on = crate::routes::on_cpu_for_this_thread(true);
    assert_eq!(checked_on(tch::Device::Cpu), Ok(()));
    let _rng = crate::device::torch_rng_lock();
    let device = Device::libtorch().autodiff();
    device.seed(21);
    let x = Tensor::<3>::random([2, 9, 40], burn::tensor::Distribution::Normal(0.0, 5.0), &device).cast(DType::BF16);
    let to = SharedCodes::new();
    let y = with_emulation(Some(2), || crate::dropout::offering_amax(&to, || crate::dropout::dropout(x.clone(), 0.3)));
    let y = tch_of(y);
    let amax = to.input_amax(&y).expect("the dropout handed its amax over");
    let own = amax_on_device(&y.to_kind(tch::Kind::Float)).reshape([1]);
    assert_eq!(host_bytes(&amax), host_bytes(&own), "the amax of the dropped input");
    // The quantiser's routes outside the emulation (their first-use check is decided there
    // once for the process; the stand-ins are what the CPU runs).
    for routes in [true, false] {
        let _routes = crate::routes::on_cpu_for_this_thread(routes);
        let (codes, inv) = quantize_current_at_amax(&y, &amax, Fp8Format::E4M3);
        let (want_codes, want_inv) = quantize_current_on_device(&y, Fp8Format::E4M3);
        assert_eq!(host_bytes(&codes), host_bytes(&want_codes), "routes {routes}: codes");
        assert_eq!(host_bytes(&inv), host_bytes(&want_inv), "routes {routes}: inverse scale");
    }
    let _off = crate::routes::on_cpu_for_this_thread(false);
    let none = SharedCodes::new();
    let z = crate::dropout::offering_amax(&none, || crate::dropout::dropout(x.clone(), 0.3));
    assert!(none.input_amax(&tch_of(z)).is_none(), "LibTorch's route takes no amax");
}

/// The LibTorch tensor of an autodiff tensor's value.
fn tch_of(t: Tensor<3>) -> tch::Tensor {
    use burn::backend::{LibTorch, libtorch::TchTensor};
    let Ok(t) = t.inner().try_into_primitive::<LibTorch>() else { panic!("a LibTorch tensor") };
    let t: TchTensor = t;
    t.tensor
}
