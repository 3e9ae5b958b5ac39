//! `llora bench`'s step budgets on the CPU: host-device syncs and ops per step, and the phases'
//! times adding up, in fp32, bf16 and FP8 with recompute.

use crate::common;
use common::{llora, text};

/// The launch and synchronisation budgets of a training step, held on the CPU so that a new
/// per-layer readback or a cast storm is caught without a GPU: one host-device
/// synchronisation per optimizer step in fp32 and bf16 (loss and gradient norms read together),
/// two in FP8 (plus delayed scaling's amaxes, once), none more with accumulation or recomputed
/// blocks; a bf16 step dispatches at most 1.15x the ops of an fp32 one, an FP8 step 2x (its
/// step's end reads every layer's amaxes in one concatenation: with a stack, a mask and a max
/// per role of every layer it took 2.15x). The
/// `--trace` of the extra step is a Chrome trace, and an existing trace file is refused.
#[test]
fn step_budgets_of_syncs_and_ops_hold_on_the_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("trace.json");
    let bench = |extra: &[&str]| -> serde_json::Value {
        let mut args =
            vec!["bench", "--preset", "tiny", "--seq-len", "64", "--threads", "1", "--warmup", "1", "--steps", "1"];
        args.extend(extra);
        let out = llora(&args);
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{extra:?}: {stderr}");
        serde_json::from_str(stdout.lines().last().unwrap()).unwrap()
    };
    let fp32 = bench(&[]);
    let bf16 = bench(&["--precision", "bf16", "--accum", "3", "--trace", trace.to_str().unwrap()]);
    let fp8 = bench(&["--precision", "fp8", "--fp8-weights", "--fp8-activations", "--recompute-layers", "1"]);
    let syncs = |r: &serde_json::Value| r["host_syncs_per_step"].as_u64().unwrap();
    let ops_of = |r: &serde_json::Value| r["ops_per_step"].as_u64().unwrap() as f64;
    assert_eq!(syncs(&fp32), 1, "{fp32}");
    assert_eq!(syncs(&bf16), 1, "three micro-batches, still one read: {bf16}");
    assert!(syncs(&fp8) <= 2, "{fp8}");
    // bf16 ran 3 micro-batches: compare per micro-batch.
    let per_micro = ops_of(&bf16) / 3.0;
    assert!(per_micro <= 1.15 * ops_of(&fp32), "bf16 {per_micro} ops per micro-batch vs fp32 {}", ops_of(&fp32));
    assert!(ops_of(&fp8) <= 2.0 * ops_of(&fp32), "FP8 {} ops vs fp32 {}", ops_of(&fp8), ops_of(&fp32));
    // The phases are timed with recomputed blocks too (the forward to the loss; it read 0.0).
    for r in [&fp32, &bf16, &fp8] {
        let phase = |k: &str| r[k].as_f64().unwrap();
        let (fwd, bwd, opt) = (phase("fwd_s_median"), phase("bwd_s_median"), phase("opt_s_median"));
        assert!(fwd > 0.0 && bwd > 0.0, "{r}");
        assert!(fwd + bwd + opt <= phase("step_s_median") + 3e-4, "phases exceed the step: {r}");
    }
    let events: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let names: std::collections::BTreeSet<&str> =
        events["traceEvents"].as_array().unwrap().iter().filter_map(|e| e["name"].as_str()).collect();
    assert!(names.contains("aten::mm") || names.contains("aten::matmul"), "{names:?}");
    let out = llora(&["bench", "--preset", "tiny", "--seq-len", "16", "--trace", trace.to_str().unwrap()]);
    assert!(!out.status.success() && text(&out).1.contains("--trace"), "{}", text(&out).1);
}
