//! `llora eval`: the evaluation loss of a checkpoint (and adapter) on a dataset, or the
//! preference objective's metrics on pairs.

use std::sync::Arc;

use llora_data::parquet_io::{OnBadRow, ReadOptions, read_parquet};
use llora_model::checkpoint::HfCheckpoint;
use serde_json::json;

use crate::engine::eval::{EvalBatching, evaluate, evaluate_pairs};

/// `llora eval`: loads a checkpoint (and adapter), evaluates a parquet file, prints the
/// result as the last line, one JSON object.
pub fn run(args: &crate::cli::EvalArgs) -> anyhow::Result<()> {
    let spec = llora_model::precision::PrecisionSpec {
        compute: args.precision,
        fp8_weights: args.fp8_weights,
        nf4: args.quantize.nf4()?,
        ..Default::default()
    };
    let flag = |key: &str| format!("`{key}`");
    let mut p = crate::config::Problems::new(&flag);
    crate::config::check_precision_flags(&spec, &mut p);
    crate::config::check_threads(&mut p, "--threads", args.threads);
    crate::config::check_workers(&mut p, "--workers", args.workers);
    p.check(args.batch_size >= 1, "--batch-size", &args.batch_size, "must be at least 1");
    let pack_window = args.pack_window.unwrap_or(llora_data::packing::DEFAULT_WINDOW);
    p.check(pack_window >= 1, "--pack-window", &pack_window, "must be at least 1");
    p.check(args.pack || args.pack_window.is_none(), "--pack-window", &pack_window, "only applies with --pack");
    if let Some(dpo) = args.dpo() {
        dpo.check_values(&mut p, ["--dpo-beta", "--dpo-sft-weight"]);
        p.check(!args.pack, "--pack", &true, "does not apply to preference pairs (TRL packs none)");
    }
    p.finish().map_err(|problems| anyhow::anyhow!("invalid llora eval flags:\n  - {}", problems.join("\n  - ")))?;
    let device = args.device.for_local_rank(crate::dist::local_rank()).init(args.threads)?;
    let ckpt = HfCheckpoint::open(&args.model)?;
    let positions = ckpt.config.max_position_embeddings;
    let max_seq_len = args.max_seq_len.unwrap_or(positions);
    anyhow::ensure!(
        max_seq_len <= positions,
        "--max-seq-len {max_seq_len} is past the model's max_position_embeddings = {positions} ({}/config.json): \
         positions beyond it were never trained, and train and generate refuse them too; lower --max-seq-len",
        args.model.display()
    );
    let model = ckpt.load_for_inference(args.adapter.as_deref(), &spec, &device)?;
    let opts = ReadOptions {
        vocab: model.config.vocab_size,
        max_seq_len,
        on_bad_row: if args.skip_bad_rows { OnBadRow::Skip } else { OnBadRow::Error },
    };
    let limit = if args.max_seq_len.is_some() { "--max-seq-len" } else { "the model's max_position_embeddings" };
    // The limit's source and eval's own flag, said where a row is too long (and only there).
    let with_limit = |e: anyhow::Error| {
        if format!("{e:#}").contains(llora_data::TOO_LONG) {
            e.context(format!(
                "rows may hold at most {max_seq_len} tokens ({limit}; --skip-bad-rows skips longer ones)"
            ))
        } else {
            e
        }
    };
    let how = EvalBatching {
        batch_size: args.batch_size,
        workers: args.workers,
        padding: llora_data::batch::Padding::Longest,
        packing: args.pack.then_some(llora_data::packing::Packing { seq_len: max_seq_len, window: pack_window }),
    };
    if let Some(dpo) = args.dpo() {
        let (pairs, report) = llora_data::preference::read_pairs(&args.data, &opts).map_err(with_limit)?;
        anyhow::ensure!(!pairs.is_empty(), "{}: no usable pairs", args.data.display());
        crate::outln!("{}", pairs_line(&model, pairs, report.skipped, how, &dpo, &device)?);
        return Ok(());
    }
    let (samples, report) = read_parquet(&args.data, &opts).map_err(with_limit)?;
    anyhow::ensure!(!samples.is_empty(), "{}: no usable rows", args.data.display());
    let samples = Arc::new(samples);
    let loss = evaluate(&model, &samples, how, &device, &crate::dist::SingleProcess, (0, 1))?;
    let (per_token, per_sample, tokens) = (loss.per_token, loss.per_sample, loss.tokens);
    if !per_token.is_finite() {
        let culprit = match ckpt.first_non_finite()? {
            Some((name, n)) => format!("tensor {name} of {} holds {n} non-finite value(s)", args.model.display()),
            None => "every base weight is finite: check the adapter and --precision".to_string(),
        };
        anyhow::bail!("the eval loss is {per_token}: {culprit}");
    }
    crate::outln!(
        "{}",
        json!({"loss_per_token": per_token, "loss_per_sample": per_sample, "target_tokens": tokens, "samples": samples.len(), "skipped_rows": report.skipped})
    );
    Ok(())
}

/// The preference objective's loss and TRL's statistics over `pairs` (means), with the count
/// of pairs and of skipped rows, as one JSON object.
fn pairs_line(
    model: &llora_model::LlamaForCausalLM,
    pairs: Vec<llora_data::preference::Pair>,
    skipped: usize,
    how: EvalBatching,
    dpo: &crate::config::DpoConfig,
    device: &burn::tensor::Device,
) -> anyhow::Result<serde_json::Value> {
    let pairs = Arc::new(pairs);
    let solo = (device, &crate::dist::SingleProcess as &dyn crate::dist::Collective);
    let eval = evaluate_pairs(model, &pairs, how, &dpo.objective(), solo, (0, 1))?;
    let mut line = serde_json::Map::new();
    line.insert("loss".into(), json!(eval.loss));
    line.extend(eval.stats.named().map(|(k, v)| (k.to_string(), json!(v))));
    line.extend([("pairs".into(), json!(pairs.len())), ("skipped_rows".into(), json!(skipped))]);
    Ok(serde_json::Value::Object(line))
}
