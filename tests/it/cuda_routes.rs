//! The CUDA routes' control flow, run by the release binary on the CPU with
//! `LLORA_CUDA_ROUTES_ON_CPU=1` (each CUDA kernel replaced by its LibTorch composite), every
//! process under a time limit: the route choice, first-use checks, fallbacks and counters that
//! a GPU node meets first, here in CI. The second GPU run hung forever in the FP8 routes' check
//! (a lock held while the check re-entered it): these tests fail within their limit instead.

use crate::common;

use std::process::Stdio;
use std::time::Duration;

use wait_timeout::ChildExt;

/// Runs `llora ARGS` from the repository root with `env` added, killed after `limit_s`:
/// (exit success, stdout, stderr). A process over its limit fails the test as hung, with the
/// last lines it logged.
fn llora_within<V: AsRef<std::ffi::OsStr>>(limit_s: u64, env: &[(&str, V)], args: &[&str]) -> (bool, String, String) {
    let dir = tempfile::tempdir().unwrap();
    let (out, err) = (dir.path().join("stdout"), dir.path().join("stderr"));
    let mut cmd = common::llora_command(&common::root(), args);
    cmd.envs(env.iter().map(|(k, v)| (k, v)))
        .stdout(std::fs::File::create(&out).unwrap())
        .stderr(std::fs::File::create(&err).unwrap())
        .stdin(Stdio::null());
    let mut child = cmd.spawn().expect("start llora");
    let status = child.wait_timeout(Duration::from_secs(limit_s)).unwrap();
    let read = |p: &std::path::Path| std::fs::read_to_string(p).unwrap_or_default();
    let Some(status) = status else {
        let _ = child.kill();
        let _ = child.wait();
        let stderr = read(&err);
        let tail: Vec<&str> = stderr.lines().rev().take(20).collect::<Vec<_>>().into_iter().rev().collect();
        panic!("llora {args:?} hung: no exit within {limit_s} s; its last lines:\n{}", tail.join("\n"));
    };
    (status.success(), read(&out), read(&err))
}

const ON_CPU: (&str, &str) = ("LLORA_CUDA_ROUTES_ON_CPU", "1");

fn selftest_checks(part: &str) -> Vec<serde_json::Value> {
    let (ok, stdout, stderr) =
        llora_within(180, &[ON_CPU], &["selftest", "--device", "cpu", "--threads", "1", "--only", part]);
    assert!(ok, "selftest --only {part}: {stderr}");
    let record: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    record["checks"].as_array().unwrap().clone()
}

/// `llora selftest` runs the checks it runs on CUDA, named as there, one part at a time and
/// each within its limit: the FP8 two-pass quantiser and one-pass amax (the check that hung),
/// the fused RMSNorm in both dtypes, and every CUDA attention kernel's route with the packed
/// rows' variable-length one, the multi-tensor AdamW (LibTorch's own CPU kernel), RoPE's and
/// dropout's kernels (their stand-ins) beside LibTorch's dropout redraw; all pass with
/// the CPU's composites standing in.
#[test]
fn selftest_runs_the_cuda_route_checks_on_the_cpu() {
    let named = |checks: &[serde_json::Value], name: &str| {
        let c = checks.iter().find(|c| c["name"] == name).unwrap_or_else(|| panic!("no {name:?} in {checks:?}"));
        assert_eq!(c["ok"], true, "{c}");
    };
    let gemm = selftest_checks("gemm");
    named(&gemm, "FP8 two-pass quantiser and one-pass amax");
    named(&gemm, "FP8 quantise kernel (ours, NVRTC)");
    named(&gemm, "FP8 SwiGLU kernel (ours, NVRTC)");
    let norm = selftest_checks("norm");
    named(&norm, "RMSNorm fused kernels BFloat16");
    named(&norm, "RMSNorm fused kernels Float");
    named(&norm, "FP8 RMSNorm kernel (ours, NVRTC)");
    let attention = selftest_checks("attention");
    for name in [
        "attention cuda-cudnn BFloat16",
        "attention cuda-flash BFloat16",
        "attention cuda-memory-efficient Float",
        "attention cuda-flash-varlen BFloat16 (packed rows)",
    ] {
        named(&attention, name);
    }
    // Every route of the one list is checked in its part, whatever the list holds (a route
    // added to llora_model::diagnostics::all_routes appears here without touching selftest).
    let optimizer = selftest_checks("optimizer");
    named(&optimizer, "optimizer: fused AdamW Float (one multi-tensor launch)");
    let rope = selftest_checks("rope");
    named(&rope, "RoPE kernel (ours, NVRTC)");
    let dropout = selftest_checks("dropout");
    named(&dropout, "dropout kernel (ours, NVRTC)");
    named(&dropout, "dropout mask redrawn in backward");
    let parts = [
        ("gemm", &gemm),
        ("norm", &norm),
        ("attention", &attention),
        ("optimizer", &optimizer),
        ("rope", &rope),
        ("dropout", &dropout),
    ];
    for route in llora_model::diagnostics::all_routes() {
        let (_, checks) = parts.iter().find(|(p, _)| *p == route.part).expect("a part selftest runs");
        named(checks, route.name);
    }
}

/// A short FP8 bench on the CPU: with the switch, every step takes our quantise kernels (their
/// CPU stand-ins) for delayed and current scaling and our SwiGLU kernel,
/// the norm the fused route, RoPE and the adapters' dropout our kernels (their CPU stand-ins),
/// attention cuDNN's route and the optimizer LibTorch's multi-tensor
/// AdamW, and the JSON says so; without it, the f32 quantiser and the per-parameter update. Under `RUST_LOG=debug` the log names each place before it starts (a
/// hang's last line says where it is): every decoder layer built, every weight converted, the
/// FP8 routes' first-use check, and each step phase, in that order.
#[test]
fn bench_names_the_routes_each_step_took_and_logs_where_it_is() {
    let args = [
        "bench",
        "--preset",
        "tiny",
        "--seq-len",
        "32",
        "--threads",
        "1",
        "--warmup",
        "1",
        "--steps",
        "1",
        "--precision",
        "fp8",
        "--fp8-weights",
        "--fp8-activations",
    ];
    let (ok, stdout, stderr) = llora_within(240, &[ON_CPU, ("RUST_LOG", "debug")], &args);
    assert!(ok, "{stderr}");
    let r: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!(r["cuda_routes_on_cpu"], true, "{r}");
    // Delayed and current scaling on our quantise kernels (their CPU stand-ins), SwiGLU's
    // FP8-kept inputs on our SwiGLU kernel: no quantisation left on LibTorch's routes.
    assert_eq!(r["fp8_quantiser_routes"], serde_json::json!([["kernel"], ["kernel"]]), "{r}");
    assert_eq!(r["fp8_quantisations"]["two_pass"], 0, "{r}");
    assert_eq!(r["swiglu"], "kernel", "{r}");
    // The norms wrote their projections' FP8 input (the measured step has scales to use).
    assert_eq!(r["rms_norm_fp8_codes"], true, "{r}");
    // The bench lists every route of the one list, in its order, with what this run took.
    let listed: Vec<&str> = r["route_list"].as_array().unwrap().iter().map(|x| x["name"].as_str().unwrap()).collect();
    let list: Vec<&str> = llora_model::diagnostics::all_routes().iter().map(|route| route.name).collect();
    assert_eq!(listed, list, "{r}");
    let used =
        |name: &str| r["route_list"].as_array().unwrap().iter().find(|x| x["name"] == name).unwrap()["used"].clone();
    assert_eq!(used("FP8 SwiGLU kernel (ours, NVRTC)"), true, "{r}");
    assert_eq!(used("RoPE kernel (ours, NVRTC)"), true, "{r}");
    // The bench's adapters have dropout 0.1 on bf16 inputs: our dropout kernel drew the masks,
    // and took the amax of each dropped input that its adapter's A GEMM keeps in FP8: 4 layers'
    // q, k, v and o adapters, none quantised after an amax pass of its own.
    assert_eq!(used("dropout kernel (ours, NVRTC)"), true, "{r}");
    assert_eq!(r["fp8_quantisations"]["at_writers_amax"], 16, "{r}");
    assert_eq!(r["fp8_quantisations"]["f32"], 0, "{r}");
    assert!(r["fp8_quantisations"]["kernel"].as_u64().unwrap() > 0, "{r}");
    assert_eq!(r["rms_norm"], "cuda-fused", "{r}");
    assert_eq!(r["optimizer"], "fused-adamw", "{r}");
    assert_eq!(used("optimizer: fused AdamW Float (one multi-tensor launch)"), true, "{r}");
    assert!(r["attn_impl"].as_array().unwrap().iter().any(|k| k == "cuda-cudnn"), "{r}");
    let layers = 4; // the tiny preset's

    let place =
        |needle: &str| stderr.find(needle).unwrap_or_else(|| panic!("no {needle:?} in the debug log:\n{stderr}"));
    let built = (0..layers).map(|l| place(&format!("layer={l} of={layers}"))).collect::<Vec<_>>();
    assert!(built.windows(2).all(|w| w[0] < w[1]), "layers logged out of order");
    let converted = place("model: converting a weight to its storage dtype");
    let check = place("first-use check: starting");
    let [fwd, bwd, opt] =
        ["step phase: forward", "step phase: backward", "step phase: all-reduce and optimizer"].map(place);
    assert!(built[0] < converted && converted < check && check < fwd && fwd < bwd && bwd < opt, "order:\n{stderr}");
    assert!(stderr.contains("FP8 two-pass quantiser and one-pass amax: checked against its reference, taken"));
    assert!(stderr.contains("FP8 quantise kernel (ours, NVRTC): checked against its reference, taken"), "{stderr}");
    assert!(stderr.contains("FP8 SwiGLU kernel (ours, NVRTC): checked against its reference, taken"), "{stderr}");
    assert!(stderr.contains("FP8 RMSNorm kernel (ours, NVRTC): checked against its reference, taken"), "{stderr}");
    assert!(stderr.contains("RoPE kernel (ours, NVRTC): checked against its reference, taken"), "{stderr}");
    assert!(stderr.contains("dropout kernel (ours, NVRTC): checked against its reference, taken"), "{stderr}");
    let optimizer = "optimizer: LibTorch's fused AdamW (one multi-tensor launch): checked against its reference, taken";
    assert!(stderr.contains(optimizer), "{stderr}");

    let (ok, stdout, stderr) = llora_within::<&str>(240, &[], &args);
    assert!(ok, "{stderr}");
    let r: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!(r["cuda_routes_on_cpu"], false, "{r}");
    assert_eq!(r["fp8_quantiser_routes"], serde_json::json!([["f32"], ["f32"]]), "{r}");
    assert_eq!(r["rms_norm"], "composite", "{r}");
    assert_eq!(r["swiglu"], "libtorch", "{r}");
    assert_eq!(r["optimizer"], "per-parameter", "{r}");
    assert_eq!(r["rms_norm_fp8_codes"], false, "{r}");
}

/// A value of the switch other than 1 or 0 is reported, not silently taken for either.
#[test]
fn an_unknown_switch_value_is_reported() {
    let (ok, _, stderr) = llora_within(
        120,
        &[("LLORA_CUDA_ROUTES_ON_CPU", "yes")],
        &["selftest", "--device", "cpu", "--threads", "1", "--only", "gemm"],
    );
    assert!(ok, "{stderr}");
    assert!(stderr.contains("LLORA_CUDA_ROUTES_ON_CPU=\"yes\" is neither 1 nor 0"), "{stderr}");
    // Not UTF-8: reported too (it was taken as 0 without a word).
    use std::os::unix::ffi::OsStrExt;
    let env = [("LLORA_CUDA_ROUTES_ON_CPU", std::ffi::OsStr::from_bytes(b"1\xff"))];
    let (ok, _, stderr) = llora_within(120, &env, &["selftest", "--device", "cpu", "--threads", "1", "--only", "gemm"]);
    assert!(ok, "{stderr}");
    assert!(stderr.contains("LLORA_CUDA_ROUTES_ON_CPU=\"1\u{fffd}\" (not UTF-8) is neither 1 nor 0"), "{stderr}");
}
