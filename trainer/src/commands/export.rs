//! `llora export --merged`: base + adapter folded into one HF checkpoint.

use anyhow::Context;
use llora_model::checkpoint::HfCheckpoint;
use serde_json::json;
use tracing::info;

/// `llora export --merged`: base + adapter folded into one HF checkpoint.
pub fn run(args: &crate::cli::ExportArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        !args.out.join("config.json").exists(),
        "{} already holds a checkpoint; choose a new --out directory",
        args.out.display()
    );
    crate::paths::ensure_new_output("--out", &args.out, None)?;
    crate::paths::ensure_not_an_input("--out", &args.out, &[("--model", &args.model), ("--adapter", &args.adapter)])?;
    let dtype = args.dtype.as_deref().map(|d| match d {
        "bf16" => llora_model::ExportDtype::BF16,
        "f16" => llora_model::ExportDtype::F16,
        _ => llora_model::ExportDtype::F32,
    });
    let ckpt = HfCheckpoint::open(&args.model).with_context(|| format!("--model {}", args.model.display()))?;
    let spec = llora_model::read_peft_config(&args.adapter)?.spec;
    // An adapter trained on a quantised base (QLoRA) learned to correct that base, not the
    // full-precision one it is folded into here: the merged model is not the one trained.
    let trained_on = llora_model::base_quantization(&args.adapter)?;
    if let Some(q) = &trained_on {
        tracing::warn!(
            adapter = %args.adapter.display(),
            "the adapter was trained on a quantised base ({q}); it is merged into the full-precision --model, \
             a model that differs from the one trained by the base's rounding: its loss differs a little (README, \
             QLoRA), so check it with `llora eval` before serving it"
        );
    }
    let mut done = None;
    // Written beside --out and renamed into place whole: a failure leaves nothing behind.
    crate::paths::write_dir_atomic(&args.out, |tmp| {
        done = Some(
            llora_model::export_merged(&ckpt, &args.adapter, tmp, dtype)
                .with_context(|| format!("merging the adapter {}", args.adapter.display()))?,
        );
        Ok(())
    })?;
    let done = done.expect("written");
    info!(modules = done.merged_modules, rank = spec.rank, alpha = spec.alpha, out = %args.out.display(),
        bytes = done.bytes, "merged checkpoint written, tensor by tensor");
    crate::outln!(
        "{}",
        json!({"out": args.out.display().to_string(), "merged_modules": done.merged_modules, "tensors": done.tensors,
               "bytes": done.bytes, "adapter_trained_on_quantised_base": trained_on, "largest_tensor_f32_mb": ckpt.largest_tensor_elements() as f64 * 4.0 / (1 << 20) as f64,
               "peak_rss_mb": crate::engine::observe::peak_rss_mb()})
    );
    Ok(())
}
