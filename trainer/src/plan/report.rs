//! What `llora plan` prints: the tables, the advice when nothing fits, and the JSON.

use super::*;

/// The plan as JSON: the budget, the per-token lists and, with a device size, the recipe.
pub fn to_json(s: &Shape, device_bytes: Option<f64>) -> Value {
    let b = budget(s);
    let mb = |x: f64| (x / MB * 10.0).round() / 10.0;
    let kept = kept_per_token(s);
    let min = minimum_per_token(s);
    let list =
        |l: &[Saved]| l.iter().map(|k| json!({"tensor": k.name, "bytes": k.bytes, "why": k.why})).collect::<Vec<_>>();
    let mut out = json!({
        "world": s.world, "context_parallel": s.context_parallel, "micro_batch": s.micro_batch, "seq_len": s.seq_len,
        "recompute_layers": s.recompute_layers, "shard_frozen_weights": s.shard_frozen_weights,
        "peak_mb": mb(b.peak),
        "budget": b.lines.iter().map(|x| json!({"term": x.name, "mb": mb(x.bytes), "note": x.note})).collect::<Vec<_>>(),
        "kept_bytes_per_token_per_block": per_token(&kept), "kept": list(&kept),
        "minimum_bytes_per_token_per_block": per_token(&min), "minimum": list(&min),
        "kept_over_minimum": (per_token(&kept) / per_token(&min) * 1000.0).round() / 1000.0,
    });
    if let Some(dev) = device_bytes {
        out["device_mb"] = mb(dev).into();
        out["fits"] = (b.peak <= dev).into();
        out["cheapest"] = match cheapest_recipe(s, dev) {
            Some((c, cb)) => {
                json!({"recompute_layers": c.recompute_layers, "shard_frozen_weights": c.shard_frozen_weights,
                       "fp8_weights_one_layout": c.precision.fp8_weights_one_layout,
                       "context_parallel": c.context_parallel, "peak_mb": mb(cb.peak)})
            }
            None => Value::Null,
        };
    }
    out
}

/// The human-readable plan.
pub(crate) fn report(s: &Shape, device: Option<f64>) -> String {
    use std::fmt::Write;
    let b = budget(s);
    let c = &s.model;
    let mut o = String::new();
    let _ = writeln!(
        o,
        "# {} layers, d {}, {} tokens per micro-batch, {} {}, {} rank(s), context_parallel {}, recompute_layers {}, \
         shard_frozen_weights {}",
        c.num_hidden_layers,
        c.hidden_size,
        s.micro_batch * s.seq_len,
        s.precision.compute.name(),
        match (s.precision.fp8_weights, s.precision.fp8_activations) {
            (true, true) => "+ FP8 weights and activations",
            (true, false) => "+ FP8 weights",
            (false, true) => "+ FP8 activations",
            _ => "",
        },
        s.world,
        s.context_parallel,
        s.recompute_layers,
        s.shard_frozen_weights
    );
    let _ = writeln!(o, "| term | MB per rank | how |\n|---|---|---|");
    for l in &b.lines {
        let _ = writeln!(o, "| {} | {:.0} | {} |", l.name, l.bytes / MB, l.note);
    }
    let _ = writeln!(
        o,
        "| **peak** | **{:.0}** | {} |",
        b.peak / MB,
        match s.target {
            Target::Cpu => "process RSS",
            Target::Cuda => "device memory",
        }
    );
    let (kept, min) = (kept_per_token(s), minimum_per_token(s));
    // The minimum is LoRA's (frozen weights need no input kept for their gradients).
    if !s.full_fine_tuning {
        minimum_table(&mut o, &kept, &min);
    }
    if let Some(dev) = device {
        let verdict = if b.peak <= dev { "fits" } else { "does NOT fit" };
        let _ = writeln!(o, "\nthis recipe needs {:.1} GiB of {:.1} GiB: {verdict}", b.peak / GB, dev / GB);
        match cheapest_recipe(s, dev) {
            Some((r, rb)) => {
                let mut layout = if r.precision.fp8_weights_one_layout != s.precision.fp8_weights_one_layout {
                    ", precision.fp8_weights_one_layout = true".to_string()
                } else {
                    String::new()
                };
                if r.context_parallel != s.context_parallel {
                    layout += &format!(", train.context_parallel = {}", r.context_parallel);
                }
                let _ = writeln!(
                    o,
                    "cheapest recipe that fits: train.recompute_layers = {}, train.shard_frozen_weights = {}{layout} ({:.1} GiB)",
                    r.recompute_layers,
                    r.shard_frozen_weights,
                    rb.peak / GB
                );
            }
            None => {
                let sharded = if s.world > 1 { " with sharded frozen weights" } else { "" };
                let _ = writeln!(
                    o,
                    "no recipe fits: every block recomputed{sharded} still needs more; {}",
                    no_fit_advice(s)
                );
            }
        }
    }
    o
}

/// The saved activations llora keeps per token against the least LoRA's backward needs.
fn minimum_table(o: &mut String, kept: &[Saved], min: &[Saved]) {
    use std::fmt::Write;
    let _ = writeln!(
        o,
        "\nsaved activations per token per block: llora keeps {:.0} B, the minimum is {:.0} B ({:.2}x)",
        per_token(kept),
        per_token(min),
        per_token(kept) / per_token(min)
    );
    let _ = writeln!(o, "| minimum keeps | B per token | for |\n|---|---|---|");
    for k in min {
        let _ = writeln!(o, "| {} | {:.0} | {} |", k.name, k.bytes, k.why);
    }
}

/// What else could make `s` fit when no recipe does: only the changes it has not made.
pub(super) fn no_fit_advice(s: &Shape) -> String {
    if s.full_fine_tuning {
        // Its weights, gradients and moments are f32 on every rank, whatever the recipe.
        return "full fine-tuning keeps every weight, its gradient and two AdamW moments in f32 on each rank: \
                train adapters instead (model.trainable = \"lora\", with an NF4 base: model.quantize = \"nf4\"), \
                or use shorter sequences"
            .into();
    }
    let p = &s.precision;
    let mut ways = vec!["use more ranks (and split each sequence over them: train.context_parallel)".to_string()];
    if !(p.compute == Compute::Fp8 && p.fp8_weights) {
        ways.push(
            "FP8 weights (precision.compute = \"fp8\", precision.fp8_weights = true, in one layout: \
             precision.fp8_weights_one_layout = true)"
                .into(),
        );
    } else if !p.fp8_weights_one_layout {
        ways.push("FP8 weights in one layout (precision.fp8_weights_one_layout = true)".into());
    }
    ways.push("shorter sequences".into());
    let last = ways.pop().unwrap_or_default();
    format!("{} or {last}", ways.join(", "))
}
