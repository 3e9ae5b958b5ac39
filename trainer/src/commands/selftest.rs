//! `llora selftest`: the kernels and collectives llora's training step depends on, each run on
//! one device and compared with a plain reference, printed as one JSON line. It is what
//! `scripts/gpu-check.sh` runs on a GPU node (no Rust toolchain there) and, on the CPU, in CI.
//!
//! Checks: a bf16 GEMM (the route the linear layers take) against f64; both FP8 GEMMs of a
//! layer on `_scaled_mm` (no fallback) against the dequantised GEMM; on CUDA the two-pass FP8
//! quantiser against the f32 route; every fused attention
//! kernel of the device, forward and backward, against plain LibTorch ops (the kernels tried
//! in turn in training; at least one bf16 kernel must pass; on CUDA also the variable-length
//! flash kernel of packed rows, under a block-diagonal mask); on CUDA LibTorch's fused RMSNorm
//! kernels against the definition in f64; on CUDA LibTorch's multi-tensor AdamW against its
//! definition in f64; dropout's mask redrawn in
//! backward equal to the forward's; an all-reduce on a real c10d group (NCCL on a GPU) and its
//! bus bandwidth. Each check says whether the run depends on it (`required`).
//!
//! With `LLORA_CUDA_ROUTES_ON_CPU=1` and `--device cpu` the CUDA routes' checks run on the CPU,
//! each CUDA kernel replaced by its LibTorch composite: their control flow, not their kernels.

use std::time::Instant;

use burn::tensor::{Device, Tensor};
use llora_model::device::DeviceSpec;
use llora_model::diagnostics::{FusedKernel, verify_attention_kernel as verify};
use llora_model::fp8::gemm::check_layer_gemms;
use serde_json::{Value, json};
use tch::Kind;

use crate::cli::SelftestArgs;
use crate::dist::{Collective, ReduceOp};

/// One check's outcome.
struct Check {
    name: String,
    ok: bool,
    /// Whether training depends on it (a failed optional check only says which kernel
    /// training will not use).
    required: bool,
    detail: String,
}

impl Check {
    fn new(name: impl Into<String>, required: bool, result: Result<String, String>) -> Self {
        let (ok, detail) = match result {
            Ok(d) => (true, d),
            Err(d) => (false, d),
        };
        Self { name: name.into(), ok, required, detail }
    }
}

/// Runs the checks `args` asks for and returns the JSON record.
pub fn run(args: &SelftestArgs) -> anyhow::Result<Value> {
    let spec = args.device;
    let device = spec.init(args.threads)?;
    let dev = llora_model::precision::tch_device(&device)
        .ok_or_else(|| anyhow::anyhow!("llora selftest needs a LibTorch device (cpu or cuda:N), not {spec}"))?;
    let only = |name: &str| args.only.as_deref().is_none_or(|o| o == name);
    let mut checks = Vec::new();
    // The CUDA routes' checks run on CUDA, and on the CPU standing in for it
    // (LLORA_CUDA_ROUTES_ON_CPU=1: the same control flow, the kernels as composites).
    let cuda_routes = llora_model::diagnostics::takes_cuda_routes(dev);
    // The checks this device does not run, named: a part with none run is not "ok".
    let mut skipped: Vec<String> = Vec::new();
    if only("gemm") {
        checks.push(Check::new("bf16 GEMM", true, bf16_gemm(dev)));
        checks.push(Check::new("FP8 GEMMs on _scaled_mm", true, check_layer_gemms(dev)));
    }
    if only("attention") {
        checks.extend(attention(dev, cuda_routes));
        if !cuda_routes {
            skipped.push("attention CUDA kernels (cudnn, flash, efficient)".into());
        }
    }
    // Every CUDA route from the one list, in its part: training falls back to the route's
    // reference without it, so none is required.
    for route in llora_model::diagnostics::all_routes().iter().filter(|r| only(r.part)) {
        if !cuda_routes {
            skipped.push(route.name.into());
            continue;
        }
        let t = Instant::now();
        let result =
            (route.check)(dev).map(|()| format!("{} ({:.0} ms)", route.passed, t.elapsed().as_secs_f64() * 1e3));
        checks.push(Check::new(route.name, false, result));
    }
    if only("dropout") {
        checks.push(Check::new("dropout mask redrawn in backward", true, dropout_redraw(&device)));
    }
    if only("all-reduce") {
        checks.push(Check::new("all-reduce", true, all_reduce(&spec, dev)));
    }
    let failed: Vec<&str> = checks.iter().filter(|c| c.required && !c.ok).map(|c| c.name.as_str()).collect();
    Ok(json!({
        "device": spec.to_string(),
        "libtorch": llora_model::device::libtorch_summary(),
        "ok": failed.is_empty(),
        "failed": failed,
        "skipped": skipped.iter().map(|name| json!({"name": name, "why": SKIPPED_WHY})).collect::<Vec<_>>(),
        "checks": checks.iter().map(|c| json!({"name": c.name, "ok": c.ok, "required": c.required, "detail": c.detail})).collect::<Vec<_>>(),
    }))
}

/// Why a check is skipped on this device.
const SKIPPED_WHY: &str = "CUDA only (LLORA_CUDA_ROUTES_ON_CPU=1 runs its control flow on the CPU)";

/// Largest |got − want| over the largest |want|.
fn rel_err(got: &tch::Tensor, want: &tch::Tensor) -> f64 {
    let want = want.to_kind(Kind::Double);
    let err = (got.to_kind(Kind::Double) - &want).abs().max().double_value(&[]);
    err / want.abs().max().double_value(&[]).max(1e-30)
}

/// Waits for the device's queued work (CUDA kernels run asynchronously).
fn sync(dev: tch::Device) {
    if let tch::Device::Cuda(i) = dev {
        tch::Cuda::synchronize(i as i64);
    }
}

/// A bf16 GEMM the way llora's linear layers run it on `dev` (torch's bf16 GEMM, or through f32
/// on CPUs without one) against f64 on the same rounded operands; and its rate on a square GEMM.
fn bf16_gemm(dev: tch::Device) -> Result<String, String> {
    let _guard = tch::no_grad_guard();
    let bf16 = |shape: [i64; 2]| tch::Tensor::randn(shape, (Kind::Float, dev)).to_kind(Kind::BFloat16);
    let mm = |a: &tch::Tensor, b: &tch::Tensor| {
        if llora_model::precision::bf16::operand_kind(Kind::BFloat16, dev) == Kind::BFloat16 {
            a.matmul(b)
        } else {
            llora_model::precision::bf16::mm_via_f32(a, b, Kind::BFloat16)
        }
    };
    let (a, b) = (bf16([256, 512]), bf16([512, 384]));
    let err = rel_err(&mm(&a, &b), &a.to_kind(Kind::Double).matmul(&b.to_kind(Kind::Double)));
    if err > 1.0 / 128.0 {
        return Err(format!("relative error {err:.2e} (bf16 output rounding allows 7.8e-3)"));
    }
    let n = if dev.is_cuda() { 8192 } else { 1024 };
    let (a, b) = (bf16([n, n]), bf16([n, n]));
    let _ = mm(&a, &b);
    sync(dev);
    let t = Instant::now();
    let reps = if dev.is_cuda() { 20 } else { 2 };
    for _ in 0..reps {
        let _ = mm(&a, &b);
    }
    sync(dev);
    let tflops = 2.0 * (n as f64).powi(3) * reps as f64 / t.elapsed().as_secs_f64() / 1e12;
    Ok(format!("relative error {err:.2e}; {n}x{n}x{n}: {tflops:.2} TFLOP/s"))
}

/// Every fused kernel of the device against plain LibTorch, at a Llama 2 70B head shape (64
/// query heads on 8 K/V heads of 128) in bf16 and, for the f32 kernel, f32.
fn attention(dev: tch::Device, cuda_routes: bool) -> Vec<Check> {
    let cases: &[(FusedKernel, Kind)] = if cuda_routes {
        &[
            (FusedKernel::CudaCudnn, Kind::BFloat16),
            (FusedKernel::CudaFlash, Kind::BFloat16),
            (FusedKernel::CudaEfficient, Kind::BFloat16),
            (FusedKernel::CudaEfficient, Kind::Float),
        ]
    } else {
        &[(FusedKernel::CpuFlash, Kind::BFloat16), (FusedKernel::CpuFlash, Kind::Float)]
    };
    let mut out = Vec::new();
    for &(kernel, kind) in cases {
        let t = Instant::now();
        let result = verify(kernel, dev, kind, 64, 8, 128)
            .map(|()| format!("forward and backward match plain LibTorch ({:.0} ms)", t.elapsed().as_secs_f64() * 1e3));
        // Training tries the CUDA bf16 kernels in turn: one of them is enough.
        let required = !cuda_routes || kind == Kind::Float;
        out.push(Check::new(format!("attention {} {kind:?}", kernel.name()), required, result));
    }
    if cuda_routes {
        let any = out.iter().any(|c| c.ok && c.name.contains("BFloat16"));
        let result = if any { Ok("at least one fused bf16 kernel passed".into()) } else { Err("none passed".into()) };
        out.push(Check::new("attention bf16 fused kernel available", true, result));
    }
    out
}

/// Dropout of ones under autodiff: the gradient of Σ y, made from the mask redrawn in
/// backward, must equal y (mask / (1 − p)) element for element; about 1 − p of them kept.
fn dropout_redraw(device: &Device) -> Result<String, String> {
    let p = 0.25;
    let train = device.clone().autodiff();
    train.seed(11);
    let x = Tensor::<1>::ones([1 << 16], &train).require_grad();
    let y = llora_model::diagnostics::dropout(x.clone(), p);
    let grads = y.clone().sum().backward();
    let g = x.grad(&grads).ok_or("no gradient reached x")?;
    let values = |t: Tensor<1>| t.into_data().try_to_vec::<f32>().map_err(|e| format!("{e:?}"));
    let (y, g) = (values(y.inner())?, values(g)?);
    let differ = y.iter().zip(&g).filter(|(a, b)| a != b).count();
    let kept = y.iter().filter(|&&v| v != 0.0).count() as f64 / y.len() as f64;
    if differ > 0 || (kept - (1.0 - p)).abs() > 0.02 {
        return Err(format!("{differ} of {} gradients differ from the forward's mask; {kept:.3} kept", y.len()));
    }
    Ok(format!("backward's mask equals forward's; {kept:.3} kept (p {p})"))
}

/// An all-reduce over the launcher's ranks (torchrun), or over a c10d group of this process
/// alone: the sum checked exactly, then the bus bandwidth of 64 MB all-reduces, 2·(n−1)/n ·
/// bytes / time, of host buffers (an NCCL one copies to the GPU and back: the rate of the
/// losses' and statistics' sums) and of a tensor on `dev` started and waited for as the
/// gradient buckets are (`engine/grad_reduce.rs`: in place on the GPU for NCCL).
fn all_reduce(spec: &DeviceSpec, dev: tch::Device) -> Result<String, String> {
    let dist = crate::dist::init(&crate::dist::DistConfig::default(), spec.is_cuda()).map_err(|e| format!("{e:#}"))?;
    let (label, comm): (String, std::sync::Arc<dyn Collective>) = if dist.world.size > 1 {
        (format!("{} ranks", dist.world.size), dist.comm.clone())
    } else {
        let (backend, comm) = crate::dist::single_process_group(spec.is_cuda()).map_err(|e| format!("{e:#}"))?;
        (format!("one process, {backend}"), comm)
    };
    let (n, rank) = (comm.world_size(), comm.rank());
    if let (DeviceSpec::Cuda(want), Some(bound)) = (spec, comm.bound_device())
        && *want != bound
    {
        return Err(format!("rank {rank}'s NCCL group is bound to cuda:{bound}, its device is cuda:{want}"));
    }
    let mut buf = vec![(rank + 1) as f32; 1024];
    comm.all_reduce_f32(&mut buf, ReduceOp::Sum).map_err(|e| e.to_string())?;
    let want = (n * (n + 1) / 2) as f32;
    if buf.iter().any(|&v| v != want) {
        return Err(format!("sum over {n} ranks gave {} instead of {want}", buf[0]));
    }
    let mut big = vec![1.0f32; 16 << 20];
    comm.all_reduce_f32(&mut big, ReduceOp::Sum).map_err(|e| e.to_string())?;
    let reps = 5;
    let t = Instant::now();
    for _ in 0..reps {
        comm.all_reduce_f32(&mut big, ReduceOp::Sum).map_err(|e| e.to_string())?;
    }
    let s = t.elapsed().as_secs_f64() / reps as f64;
    let bytes = (big.len() * 4) as f64;
    let busbw = |s: f64| if n > 1 { 2.0 * (n - 1) as f64 / n as f64 * bytes / s / 1e9 } else { 0.0 };
    let on_device = device_sums(comm.as_ref(), dev, reps)?;
    // Ended here, on success, while CUDA is up (without it the process aborts at exit).
    comm.shutdown().map_err(|e| e.to_string())?;
    Ok(format!(
        "{label}: sums exact; 64 MB of host buffers in {:.2} ms, bus bandwidth {:.1} GB/s; on {dev:?} \
         (the gradient buckets' path) {:.2} ms, {:.1} GB/s",
        s * 1e3,
        busbw(s),
        on_device * 1e3,
        busbw(on_device)
    ))
}

/// Seconds per started-and-waited sum of 64 MB of f32 ones on `dev` (checked exact once).
fn device_sums(comm: &dyn Collective, dev: tch::Device, reps: usize) -> Result<f64, String> {
    let n = comm.world_size() as f64;
    let ones = || tch::Tensor::ones([16 << 20], (Kind::Float, dev));
    let sum = |x: &tch::Tensor| -> Result<tch::Tensor, String> {
        let pending = comm.start_all_reduce_sum(x).map_err(|e| e.to_string())?;
        comm.wait_all_reduce_sum(pending).map_err(|e| e.to_string())
    };
    let got = sum(&ones())?;
    if got.ne(n).any().int64_value(&[]) != 0 || got.device() != dev {
        return Err(format!("the device sum over {n} ranks is not {n} everywhere on {dev:?}"));
    }
    let x = ones();
    let t = Instant::now();
    for _ in 0..reps {
        let _ = sum(&x)?;
    }
    sync(dev);
    Ok(t.elapsed().as_secs_f64() / reps as f64)
}

/// `llora selftest` as the command line runs it: on this rank's device, printing the record
/// (rank 0 only under a launcher), failing when a check failed.
pub fn command(args: SelftestArgs) -> anyhow::Result<()> {
    let spec = args.device;
    let args = crate::cli::SelftestArgs { device: spec.for_local_rank(crate::dist::local_rank()), ..args };
    let record = run(&args)?;
    // Under a launcher only rank 0 prints.
    if std::env::var("RANK").map_or(true, |r| r == "0") {
        crate::outln!("{record}");
        let skipped = record["skipped"].as_array().map_or(0, Vec::len);
        if record["checks"].as_array().is_some_and(Vec::is_empty) && skipped > 0 {
            let part = args.only.as_deref().unwrap_or("all");
            tracing::warn!("selftest --only {part}: nothing checked on {spec}: skipped: {SKIPPED_WHY}");
        }
    }
    anyhow::ensure!(record["ok"] == true, "self-test failed: {}", record["failed"]);
    Ok(())
}
