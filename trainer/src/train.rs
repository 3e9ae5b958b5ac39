//! `llora train`: LoRA fine-tuning to a target eval loss, logged the MLPerf way.
//!
//! The step reads top to bottom like nanoGPT's: set the LR, gather one global batch, run its
//! micro-batches forward and backward with the loss normalised by the global target-token
//! count, clip, step, log; evaluate on the MLPerf cadence and stop at the target.

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, bail};
use burn::module::Module;
use burn::tensor::{Device, Int, Tensor, TensorData};
use llora_data::loader::{Position, ShardedOrder};
use llora_data::parquet_io::{OnBadRow, ReadOptions, read_parquet};
use llora_data::synth::{Synth, SynthConfig};
use llora_data::{IGNORE_INDEX, Sample};
use llora_model::checkpoint::{HfCheckpoint, save_hf_checkpoint, save_peft_adapter};
use llora_model::loss::causal_lm_loss;
use llora_model::{LlamaConfig, LlamaForCausalLM, LoraSpec};
use serde_json::json;
use tracing::info;

use crate::config::{Config, PretrainConfig};
use crate::mllog::{MlLogger, now_ms};
use crate::optim::{AdamW, clip_coefficient, lr_at};

/// How a run ended.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// `success` (target reached) or `aborted` (max_steps, or a NaN/Inf).
    pub status: &'static str,
    /// Training samples consumed.
    pub samples: usize,
    /// Last evaluation loss, if any evaluation ran.
    pub eval_loss: Option<f64>,
    /// run_stop − run_start, seconds.
    pub time_to_train_s: f64,
    /// The MLPerf result log.
    pub result_log: PathBuf,
}

/// The training and evaluation sets.
struct Datasets {
    train: Vec<Sample>,
    eval: Vec<Sample>,
}

fn load_datasets(config: &Config, vocab: usize) -> anyhow::Result<Datasets> {
    let d = &config.data;
    if let Some(syn) = &d.synthetic {
        let synth = Synth::new(SynthConfig {
            vocab,
            max_seq_len: d.max_seq_len,
            topics: syn.topics,
            summary_len: syn.summary_len,
            copy_len: syn.copy_len,
            seed: syn.seed,
        })
        .context("data.synthetic")?;
        return Ok(Datasets { train: synth.samples(0, syn.train_samples), eval: synth.samples(1, syn.eval_samples) });
    }
    let on_bad_row: OnBadRow = d.on_bad_row.parse().map_err(anyhow::Error::msg)?;
    let opts = ReadOptions { vocab, max_seq_len: d.max_seq_len, on_bad_row };
    let read = |p: &Option<PathBuf>, key: &str| -> anyhow::Result<Vec<Sample>> {
        let path = p.as_ref().with_context(|| format!("{key} is not set"))?;
        anyhow::ensure!(path.is_file(), "{key} = {}: no such file", path.display());
        let (rows, _) = read_parquet(path, &opts)?;
        anyhow::ensure!(!rows.is_empty(), "{key} = {}: no usable rows", path.display());
        Ok(rows)
    };
    Ok(Datasets { train: read(&d.train, "data.train")?, eval: read(&d.eval, "data.eval")? })
}

/// The base model with adapters, from a checkpoint or a preset.
fn load_model(config: &Config, spec: &LoraSpec, device: &Device) -> anyhow::Result<LlamaForCausalLM> {
    let full = config.model.trainable == "all";
    let lora = (!full).then_some(spec);
    match &config.model.path {
        Some(path) => {
            let ckpt = HfCheckpoint::open(path).with_context(|| format!("model.path = {}", path.display()))?;
            if let Some(preset) = &config.model.preset {
                let want = LlamaConfig::preset(preset)?;
                let got = &ckpt.config;
                anyhow::ensure!(
                    (got.hidden_size, got.num_hidden_layers, got.num_attention_heads, got.num_key_value_heads)
                        == (want.hidden_size, want.num_hidden_layers, want.num_attention_heads, want.num_key_value_heads),
                    "model.path {} is not a {preset} checkpoint (d {}, {} layers, {} heads, {} KV heads)",
                    path.display(),
                    got.hidden_size,
                    got.num_hidden_layers,
                    got.num_attention_heads,
                    got.num_key_value_heads
                );
            }
            ckpt.load_model(lora, full, device)
        }
        None => {
            let preset = config.model.preset.as_deref().expect("validated: path or preset");
            Ok(LlamaForCausalLM::random(&LlamaConfig::preset(preset)?, lora, full, device))
        }
    }
}

/// Pads a micro-batch to its longest row (pad id 0, label −100: padding takes no loss, and
/// right padding cannot leak into earlier positions under a causal mask).
///
/// # Shapes
/// - output: (input_ids, labels), each `[batch, longest]`
fn collate(samples: &[&Sample], device: &Device) -> (Tensor<2, Int>, Tensor<2, Int>) {
    let s = samples.iter().map(|x| x.input_ids.len()).max().unwrap_or(1);
    let mut ids = Vec::with_capacity(samples.len() * s);
    let mut labels = Vec::with_capacity(samples.len() * s);
    for x in samples {
        ids.extend(x.input_ids.iter().map(|&t| t as i64));
        ids.extend(std::iter::repeat_n(0i64, s - x.input_ids.len()));
        labels.extend(&x.labels);
        labels.extend(std::iter::repeat_n(IGNORE_INDEX, s - x.labels.len()));
    }
    let b = samples.len();
    (
        Tensor::from_data(TensorData::new(ids, [b, s]), device),
        Tensor::from_data(TensorData::new(labels, [b, s]), device),
    )
}

/// Evaluation loss over a whole set, as (per-token mean, per-sample mean, target tokens).
pub fn evaluate(model: &LlamaForCausalLM, samples: &[Sample], batch_size: usize, device: &Device) -> (f64, f64, usize) {
    let (mut sum, mut tokens, mut per_sample) = (0f64, 0usize, 0f64);
    for chunk in samples.chunks(batch_size.max(1)) {
        let refs: Vec<&Sample> = chunk.iter().collect();
        let (ids, labels) = collate(&refs, device);
        let sums = causal_lm_loss(model.forward(ids, false), labels);
        let s: Vec<f32> = sums.loss_sum.into_data().convert::<f32>().try_into_vec::<f32>().expect("f32");
        let t: Vec<f32> = sums.tokens.into_data().convert::<f32>().try_into_vec::<f32>().expect("f32");
        for (s, t) in s.iter().zip(&t) {
            sum += *s as f64;
            tokens += *t as usize;
            per_sample += *s as f64 / (*t as f64).max(1.0);
        }
    }
    (sum / tokens.max(1) as f64, per_sample / samples.len().max(1) as f64, tokens)
}

/// One optimizer step over a global batch given as collated micro-batches.
///
/// Each micro-batch's loss is its sum of token losses divided by `global_tokens`, the target
/// tokens of the whole global batch, so the accumulated gradient is that of the per-token mean
/// over the global batch however it is split (not a mean of per-micro-batch means). Gradients
/// are clipped by their global L2 norm and AdamW updates the adapters. Returns the loss and the
/// pre-clip gradient norm; a non-finite value is an error and leaves the adapters untouched.
pub fn train_step(
    model: &mut LlamaForCausalLM,
    optim: &mut AdamW,
    micro_batches: Vec<(Tensor<2, Int>, Tensor<2, Int>)>,
    global_tokens: usize,
    lr: f64,
    clip_grad_norm: f64,
) -> anyhow::Result<(f64, f64)> {
    // A batch with no target token has zero loss and zero gradient, not 0/0.
    let norm = global_tokens.max(1) as f64;
    let mut grads_acc: Vec<Option<Tensor<1>>> = Vec::new();
    let mut loss_sum = 0f64;
    for (ids, labels) in micro_batches {
        let sums = causal_lm_loss(model.forward(ids, true), labels);
        let loss = sums.loss_sum.sum().div_scalar(norm);
        loss_sum += loss.clone().into_scalar::<f32>() as f64;
        let grads = loss.backward();
        let params = model.trainable_params_mut();
        if grads_acc.is_empty() {
            grads_acc = vec![None; params.len()];
        }
        for (acc, (_, p)) in grads_acc.iter_mut().zip(&params) {
            if let Some(g) = p.grad_flat(&grads) {
                *acc = Some(match acc.take() {
                    Some(a) => a + g,
                    None => g,
                });
            }
        }
    }
    let grads: Vec<Tensor<1>> = grads_acc.into_iter().map(|g| g.expect("every trainable parameter gets a gradient")).collect();
    let total_norm = grads.iter().map(|g| g.clone().square().sum().into_scalar::<f32>() as f64).sum::<f64>().sqrt();
    if !loss_sum.is_finite() || !total_norm.is_finite() {
        bail!("loss {loss_sum} / gradient norm {total_norm} is not finite; run aborted");
    }
    let coef = clip_coefficient(total_norm, clip_grad_norm);
    optim.begin_step();
    for ((name, mut param), g) in model.trainable_params_mut().into_iter().zip(grads) {
        optim.update(&name, &mut param, g.mul_scalar(coef), lr);
    }
    Ok((loss_sum, total_norm))
}

/// Makes the base checkpoint `model.path` by full fine-tuning `model.preset` on a synthetic
/// corpus of other topics (see [`PretrainConfig`]), then moves it into place.
fn pretrain(config: &Config, pt: &PretrainConfig, path: &std::path::Path) -> anyhow::Result<()> {
    info!(path = %path.display(), steps = pt.steps, "no base checkpoint yet: pre-training one (full fine-tuning, synthetic corpus)");
    let mut c = config.clone();
    c.model.path = None;
    c.model.pretrain = None;
    c.model.trainable = "all".into();
    c.optim.lr = pt.lr;
    c.schedule = crate::config::ScheduleConfig { max_steps: pt.steps, warmup_steps: 0 };
    c.eval.target_loss = pt.target_loss;
    if let Some(syn) = c.data.synthetic.as_mut() {
        syn.seed = pt.corpus_seed;
    }
    c.run.dir = path.with_extension("pretrain-run");
    let outcome = run(&c, "model.pretrain")?;
    anyhow::ensure!(
        outcome.status == "success",
        "pre-training stopped at eval loss {:?} above model.pretrain.target_loss = {} after {} steps; raise model.pretrain.steps",
        outcome.eval_loss,
        pt.target_loss,
        pt.steps
    );
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).with_context(|| format!("cannot create {}", parent.display()))?;
    }
    // The checkpoint was written completely in the run directory; one rename publishes it.
    std::fs::rename(c.run.dir.join("checkpoint"), path)
        .with_context(|| format!("cannot move the pre-trained base to {}", path.display()))?;
    info!(path = %path.display(), "pre-trained base saved");
    Ok(())
}

/// `llora eval`: loads a checkpoint (and adapter), evaluates a parquet file, prints the
/// result as the last line, one JSON object.
pub fn eval_command(args: &crate::cli::EvalArgs) -> anyhow::Result<()> {
    let device = args.device.init(args.threads)?;
    let ckpt = HfCheckpoint::open(&args.model)?;
    let mut model = ckpt.load_model(None, false, &device)?;
    if let Some(adapter) = &args.adapter {
        llora_model::checkpoint::load_peft_adapter(&mut model, adapter, &device)
            .with_context(|| format!("loading the adapter {}", adapter.display()))?;
    }
    let opts = ReadOptions {
        vocab: model.config.vocab_size,
        max_seq_len: args.max_seq_len,
        on_bad_row: if args.skip_bad_rows { OnBadRow::Skip } else { OnBadRow::Error },
    };
    let (samples, report) = read_parquet(&args.data, &opts)?;
    anyhow::ensure!(!samples.is_empty(), "{}: no usable rows", args.data.display());
    let (per_token, per_sample, tokens) = evaluate(&model, &samples, args.batch_size, &device);
    println!(
        "{}",
        json!({"loss_per_token": per_token, "loss_per_sample": per_sample, "target_tokens": tokens, "samples": samples.len(), "skipped_rows": report.skipped})
    );
    Ok(())
}

/// One `metrics.jsonl` record per logged step.
fn write_metrics(file: &mut std::fs::File, record: serde_json::Value) {
    let _ = writeln!(file, "{record}");
}

/// Runs `llora train` with a validated config; `config_name` is reported in logs.
pub fn run(config: &Config, config_name: &str) -> anyhow::Result<Outcome> {
    let device = config
        .run
        .device
        .init(config.run.threads)
        .with_context(|| format!("cannot start on run.device = \"{}\"", config.run.device))?;
    info!(
        config = config_name,
        backend = config.run.device.backend_name(),
        device = %config.run.device,
        threads = config.run.device.effective_threads(config.run.threads),
        "llora {} starting",
        env!("CARGO_PKG_VERSION")
    );
    if let (Some(pt), Some(path)) = (&config.model.pretrain, &config.model.path)
        && !path.join("config.json").is_file()
    {
        pretrain(config, pt, path)?;
    }
    // Fail before any work when inputs are absent: a 70B run should not load 140 GB first.
    if let Some(p) = &config.model.path {
        anyhow::ensure!(p.is_dir(), "model.path = {}: no such directory (download the HF checkpoint there, or set model.path)", p.display());
    }
    for (key, p) in [("data.train", &config.data.train), ("data.eval", &config.data.eval)] {
        if let Some(p) = p {
            anyhow::ensure!(p.is_file(), "{key} = {}: no such file", p.display());
        }
    }

    let precision = match config.precision.compute.as_str() {
        "fp32" => "fp32",
        other => bail!("precision.compute = {other:?} is not implemented yet (issue #6); use \"fp32\""),
    };

    let run_dir = &config.run.dir;
    std::fs::create_dir_all(run_dir).with_context(|| format!("cannot create run.dir {}", run_dir.display()))?;
    let result_log = run_dir.join("result_0.txt");
    let mut ml = MlLogger::create(&result_log, false)?;
    let gbs = config.train.global_batch_size;
    let mbs = config.train.micro_batch_size;
    let accum = config.train.gradient_accumulation_steps();
    let spec = LoraSpec {
        rank: config.lora.rank,
        alpha: config.lora.alpha,
        dropout: config.lora.dropout,
        targets: config.lora.targets.clone(),
    };

    // ---- init: everything before run_start (model, adapters, optimizer) ----------------------
    ml.event("cache_clear", true);
    ml.start("init_start", json!(null));
    ml.event("submission_benchmark", "llama2_70b_lora");
    ml.event("submission_org", config.mlperf.org.clone());
    ml.event("submission_division", config.mlperf.division.clone());
    ml.event("submission_status", "onprem");
    ml.event("submission_platform", config.mlperf.platform.clone());
    ml.event("seed", config.run.seed);
    let train_device = device.clone().autodiff();
    train_device.seed(config.run.seed);
    let mut model = load_model(config, &spec, &train_device)?;
    let vocab = model.config.vocab_size;
    let n_lora = model.num_lora_parameters();
    info!(base_parameters = model.config.num_parameters(), lora_parameters = n_lora, "model ready");
    let mut optim = AdamW::new(config.optim.clone());
    // The dataset sizes are logged after run_start: the rules forbid touching the data before.
    for (k, v) in [
        ("global_batch_size", json!(gbs)),
        ("micro_batch_size", json!(mbs)),
        ("gradient_accumulation_steps", json!(accum)),
        ("opt_base_learning_rate", json!(config.optim.lr)),
        ("opt_adamw_weight_decay", json!(config.optim.weight_decay)),
        ("opt_gradient_clip_norm", json!(config.optim.clip_grad_norm)),
        ("opt_learning_rate_warmup_factor", json!(config.schedule.warmup_steps as f64 / config.schedule.max_steps as f64)),
        ("opt_learning_rate_training_steps", json!(config.schedule.max_steps)),
        ("lora_rank", json!(config.lora.rank)),
        ("lora_alpha", json!(config.lora.alpha)),
        ("target_accuracy", json!(config.eval.target_loss)),
        ("lowest_numerical_precision_in_linear", json!(precision)),
        ("lowest_numerical_precision_in_attn", json!(precision)),
        ("lowest_numerical_precision_in_comm", json!(precision)),
        ("tensor_parallelism", json!(1)),
        ("pipeline_parallelism", json!(1)),
        ("context_parallelism", json!(1)),
        ("expert_parallelism", json!(1)),
        ("config_filename", json!(config_name)),
    ] {
        ml.event(k, v);
    }
    ml.end("init_stop", json!(null));

    // ---- run: the clock starts -----------------------------------------------------------------
    ml.start("run_start", json!(null));
    let run_start = now_ms();
    let data = load_datasets(config, vocab)?;
    ml.event("train_samples", data.train.len());
    ml.event("eval_samples", data.eval.len());
    info!(train = data.train.len(), eval = data.eval.len(), "data ready");
    let mut order = ShardedOrder::new(data.train.len(), config.run.seed, 0, 1, true, Position::default())?;
    let interval = config.eval_interval_samples();
    let skip = config.eval_skip_first();
    let mut metrics = std::fs::File::create(run_dir.join("metrics.jsonl"))
        .with_context(|| format!("cannot create {}", run_dir.join("metrics.jsonl").display()))?;

    let mut samples = 0usize;
    let mut evals_done = 0usize;
    let mut last_eval = None;
    let mut status = "aborted";
    ml.start("block_start", json!({"samples_count": 0}));
    let t_train = Instant::now();
    let mut tokens_seen = 0usize;
    for step in 0..config.schedule.max_steps {
        let lr = lr_at(step, config.optim.lr, &config.schedule);
        // The whole global batch first: its target-token count normalises every micro-batch.
        let batch: Vec<&Sample> = (0..gbs).map(|_| &data.train[order.next_index()]).collect();
        let global_tokens: usize = batch.iter().map(|s| s.target_tokens()).sum();
        tokens_seen += batch.iter().map(|s| s.input_ids.len()).sum::<usize>();
        // Dropout masks: a seed per (run seed, step) makes them independent of how far a
        // resumed run has come.
        train_device.seed(config.run.seed.wrapping_mul(1_000_003).wrapping_add(step as u64));
        let micro_batches: Vec<_> = batch.chunks(mbs).map(|m| collate(m, &train_device)).collect();
        let (loss_sum, total_norm) = match train_step(&mut model, &mut optim, micro_batches, global_tokens, lr, config.optim.clip_grad_norm) {
            Ok(r) => r,
            Err(e) => {
                ml.end("run_stop", json!({"samples_count": samples, "status": "aborted"}));
                return Err(e.context(format!("step {}", step + 1)));
            }
        };
        samples += gbs;

        let elapsed = t_train.elapsed().as_secs_f64();
        if (step + 1) % config.logging.every_steps == 0 || step == 0 {
            info!(step = step + 1, samples, loss = format!("{loss_sum:.4}"), lr = format!("{lr:.2e}"), grad_norm = format!("{total_norm:.3}"), tok_per_s = format!("{:.0}", tokens_seen as f64 / elapsed), "train");
        }
        write_metrics(&mut metrics, json!({"step": step + 1, "samples": samples, "loss": loss_sum, "lr": lr, "grad_norm": total_norm, "tokens_per_s": tokens_seen as f64 / elapsed}));

        // `interval` is a whole number of global batches (Config::eval_interval_samples).
        if samples % interval == 0 {
            evals_done += 1;
            if evals_done > skip {
                ml.event_with("train_loss", loss_sum, json!({"samples_count": samples}));
                ml.end("block_stop", json!({"samples_count": samples}));
                ml.start("eval_start", json!({"samples_count": samples}));
                let eval_model = model.valid();
                let (per_token, per_sample, _) = evaluate(&eval_model, &data.eval, config.eval.batch_size, &device);
                let eval_loss = if config.eval.averaging == "per_token" { per_token } else { per_sample };
                ml.event_with("eval_accuracy", eval_loss, json!({"samples_count": samples}));
                ml.end("eval_stop", json!({"samples_count": samples}));
                info!(samples, eval_loss = format!("{eval_loss:.4}"), target = config.eval.target_loss, "eval");
                write_metrics(&mut metrics, json!({"step": step + 1, "samples": samples, "eval_loss": eval_loss}));
                last_eval = Some(eval_loss);
                if eval_loss <= config.eval.target_loss {
                    status = "success";
                    break;
                }
                ml.start("block_start", json!({"samples_count": samples}));
            }
        }
    }
    let run_stop = now_ms();
    if status != "success" {
        ml.end("block_stop", json!({"samples_count": samples}));
    }
    ml.end("run_stop", json!({"samples_count": samples, "status": status}));
    let ttt = (run_stop - run_start) as f64 / 1000.0;
    let saved = if config.model.trainable == "all" {
        let dir = run_dir.join("checkpoint");
        save_hf_checkpoint(&mut model, &dir)?;
        dir
    } else {
        let dir = run_dir.join("adapter");
        let base_name = config.model.path.as_ref().map_or_else(|| config.model.preset.clone().unwrap_or_default(), |p| p.display().to_string());
        save_peft_adapter(&model, &spec, &dir, &base_name)?;
        dir
    };
    info!(status, samples, time_to_train_s = format!("{ttt:.1}"), result_log = %result_log.display(), saved = %saved.display(), "run finished");
    println!(
        "status: {status}  samples: {samples}  eval_loss: {}  time_to_train: {:.1} s ({:.2} min)",
        last_eval.map_or("n/a".into(), |l| format!("{l:.4}")),
        ttt,
        ttt / 60.0
    );
    Ok(Outcome { status, samples, eval_loss: last_eval, time_to_train_s: ttt, result_log })
}
