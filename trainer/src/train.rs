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
use std::sync::Arc;

use llora_data::Sample;
use llora_data::batch::{Collated, Padding, eval_batches, train_batches};
use llora_data::loader::ShardedOrder;
use llora_data::parquet_io::{OnBadRow, ReadOptions, read_parquet};
use llora_data::synth::{Synth, SynthConfig};
use llora_model::checkpoint::{HfCheckpoint, save_hf_checkpoint, save_peft_adapter};
use llora_model::{LlamaConfig, LlamaForCausalLM, LoraSpec};
use serde_json::json;
use tracing::{debug_span, info};

use crate::collective::{Collective, SingleProcess};
use crate::config::{Config, PretrainConfig};
use crate::mllog::{MlLogger, now_ms};
use crate::optim::{AdamW, clip_coefficient, lr_at};
use crate::resume;

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
    train: Arc<Vec<Sample>>,
    eval: Arc<Vec<Sample>>,
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
        return Ok(Datasets {
            train: Arc::new(synth.samples(0, syn.train_samples)),
            eval: Arc::new(synth.samples(1, syn.eval_samples)),
        });
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
    Ok(Datasets { train: Arc::new(read(&d.train, "data.train")?), eval: Arc::new(read(&d.eval, "data.eval")?) })
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
                        == (
                            want.hidden_size,
                            want.num_hidden_layers,
                            want.num_attention_heads,
                            want.num_key_value_heads
                        ),
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

/// A collated micro-batch as device tensors.
///
/// # Shapes
/// - output: (input_ids, labels), each `[batch, seq]`
fn upload(c: Collated, device: &Device) -> (Tensor<2, Int>, Tensor<2, Int>) {
    (
        Tensor::from_data(TensorData::new(c.input_ids, [c.batch, c.seq]), device),
        Tensor::from_data(TensorData::new(c.labels, [c.batch, c.seq]), device),
    )
}

/// How the config pads micro-batches.
fn padding(config: &Config) -> Padding {
    match config.data.padding.as_str() {
        "max_length" => Padding::MaxLength(config.data.max_seq_len),
        _ => Padding::Longest,
    }
}

/// Evaluation loss over a whole set, as (per-token mean, per-sample mean, target tokens);
/// batches are prepared by `workers` threads.
pub fn evaluate(
    model: &LlamaForCausalLM,
    samples: &Arc<Vec<Sample>>,
    batch_size: usize,
    workers: usize,
    padding: Padding,
    device: &Device,
) -> (f64, f64, usize) {
    let (mut sum, mut tokens, mut per_sample) = (0f64, 0usize, 0f64);
    for batch in eval_batches(samples.clone(), batch_size, padding, workers) {
        let (ids, labels) = upload(batch, device);
        let sums = model.loss(ids, labels, false);
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
/// are clipped by their global L2 norm and AdamW updates the adapters. Returns the loss, the
/// pre-clip gradient norm and where the time went; a non-finite loss or norm is an error and
/// leaves the adapters untouched.
pub fn train_step(
    model: &mut LlamaForCausalLM,
    optim: &mut AdamW,
    collective: &impl Collective,
    micro_batches: Vec<(Tensor<2, Int>, Tensor<2, Int>)>,
    global_tokens: usize,
    lr: f64,
    clip_grad_norm: f64,
) -> anyhow::Result<StepStats> {
    // A batch with no target token has zero loss and zero gradient, not 0/0.
    let norm = global_tokens.max(1) as f64;
    let mut grads_acc: Vec<Option<Tensor<1>>> = Vec::new();
    let mut loss_sum = 0f64;
    let (mut forward_s, mut backward_s) = (0.0, 0.0);
    for (ids, labels) in micro_batches {
        let t = Instant::now();
        let loss = {
            let _span = debug_span!("forward").entered();
            let sums = model.loss(ids, labels, true);
            sums.loss_sum.sum().div_scalar(norm)
        };
        // Reading the loss waits for the forward (asynchronous devices), so the split is real.
        loss_sum += loss.clone().into_scalar::<f32>() as f64;
        forward_s += t.elapsed().as_secs_f64();
        let t = Instant::now();
        let _span = debug_span!("backward").entered();
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
        backward_s += t.elapsed().as_secs_f64();
    }
    let t = Instant::now();
    let _span = debug_span!("optimizer").entered();
    let grads: Vec<Tensor<1>> =
        grads_acc.into_iter().map(|g| g.expect("every trainable parameter gets a gradient")).collect();
    let grads = collective.all_reduce_sum(grads);
    let loss_sum = collective.all_reduce_scalar(loss_sum);
    let total_norm = grads.iter().map(|g| g.clone().square().sum().into_scalar::<f32>() as f64).sum::<f64>().sqrt();
    if !loss_sum.is_finite() || !total_norm.is_finite() {
        bail!("loss {loss_sum} / gradient norm {total_norm} is not finite; run aborted");
    }
    let coef = clip_coefficient(total_norm, clip_grad_norm);
    optim.begin_step();
    for ((name, mut param), g) in model.trainable_params_mut().into_iter().zip(grads) {
        optim.update(&name, &mut param, g.mul_scalar(coef), lr);
    }
    model.update_fp8_scales();
    Ok(StepStats {
        loss: loss_sum,
        grad_norm: total_norm,
        forward_s,
        backward_s,
        optimizer_s: t.elapsed().as_secs_f64(),
    })
}

/// What one optimizer step gave and where its time went.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepStats {
    /// Mean target-token loss over the global batch.
    pub loss: f64,
    /// Global L2 norm of the gradients before clipping.
    pub grad_norm: f64,
    /// Seconds in forward passes (all micro-batches).
    pub forward_s: f64,
    /// Seconds in backward passes and gradient accumulation.
    pub backward_s: f64,
    /// Seconds in reduction, clipping and AdamW.
    pub optimizer_s: f64,
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
    let samples = Arc::new(samples);
    let (per_token, per_sample, tokens) =
        evaluate(&model, &samples, args.batch_size, args.workers, Padding::Longest, &device);
    println!(
        "{}",
        json!({"loss_per_token": per_token, "loss_per_sample": per_sample, "target_tokens": tokens, "samples": samples.len(), "skipped_rows": report.skipped})
    );
    Ok(())
}

/// `llora export --merged`: base + adapter folded into one HF checkpoint.
pub fn export_merged(args: &crate::cli::ExportArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        !args.out.join("config.json").exists(),
        "{} already holds a checkpoint; choose a new --out directory",
        args.out.display()
    );
    let device = llora_model::device::DeviceSpec::Cpu.init(0)?;
    let ckpt = HfCheckpoint::open(&args.model).with_context(|| format!("--model {}", args.model.display()))?;
    let mut model = ckpt.load_model(None, false, &device)?;
    let spec = llora_model::checkpoint::load_peft_adapter(&mut model, &args.adapter, &device)
        .with_context(|| format!("loading the adapter {}", args.adapter.display()))?;
    let merged = model.adapters().len();
    model.merge_adapters();
    save_hf_checkpoint(&mut model, &args.out)?;
    info!(modules = merged, rank = spec.rank, alpha = spec.alpha, out = %args.out.display(), "merged checkpoint written");
    println!("{}", json!({"out": args.out.display().to_string(), "merged_modules": merged}));
    Ok(())
}

/// `metrics.jsonl`: one JSON record per step and per evaluation, appended and flushed.
struct Metrics {
    file: std::fs::File,
    /// (samples, train loss) and (samples, eval loss), for the plot.
    train: Vec<(f64, f64)>,
    eval: Vec<(f64, f64)>,
}

impl Metrics {
    fn open(path: &std::path::Path, append: bool) -> anyhow::Result<Self> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(append)
            .write(true)
            .truncate(!append)
            .open(path)
            .with_context(|| format!("cannot open {}", path.display()))?;
        Ok(Self { file, train: Vec::new(), eval: Vec::new() })
    }

    fn write(&mut self, record: serde_json::Value) {
        if let (Some(s), Some(l)) = (record["samples"].as_f64(), record["loss"].as_f64()) {
            self.train.push((s, l));
        }
        if let (Some(s), Some(l)) = (record["samples"].as_f64(), record["eval_loss"].as_f64()) {
            self.eval.push((s, l));
        }
        // Metrics are for people; a full disk must not end the run (the result log reports it).
        let _ = writeln!(self.file, "{record}");
    }
}

/// Model FLOPs of one training sequence of `len` tokens with the PaLM convention (attention
/// counted non-causal): forward 2·N + 4·L·d·len per token; backward of frozen linears needs
/// only input gradients (2·N), trainable ones weight gradients too (4·N), attention 8·L·d·len.
fn train_flops(c: &LlamaConfig, len: usize, full: bool) -> f64 {
    let n = (c.num_parameters() - c.vocab_size * c.hidden_size) as f64;
    let attn = (c.num_hidden_layers * c.num_attention_heads * c.head_dim * len) as f64;
    let per_token = if full { 6.0 * n } else { 4.0 * n } + 12.0 * attn;
    per_token * len as f64
}

/// Progress output: an indicatif bar on a terminal, periodic tracing lines otherwise.
struct Progress {
    bar: Option<indicatif::ProgressBar>,
    every: usize,
}

impl Progress {
    fn new(config: &Config, start: usize) -> Self {
        use std::io::IsTerminal;
        let show = match config.logging.progress.as_str() {
            "always" => true,
            "never" => false,
            _ => std::io::stderr().is_terminal(),
        };
        let bar = show.then(|| {
            let bar = indicatif::ProgressBar::new(config.schedule.max_steps as u64);
            bar.set_style(
                indicatif::ProgressStyle::with_template(
                    "{elapsed_precise} [{bar:30}] step {pos}/{len} {msg} ETA {eta}",
                )
                .expect("valid template")
                .progress_chars("=> "),
            );
            bar.set_position(start as u64);
            bar
        });
        Self { bar, every: config.logging.every_steps }
    }

    fn step(&self, step: usize, samples: usize, loss: f64, lr: f64, grad_norm: f64, tok_s: f64) {
        match &self.bar {
            Some(bar) => {
                bar.set_position(step as u64);
                bar.set_message(format!("samples {samples} loss {loss:.4} lr {lr:.2e} {tok_s:.0} tok/s"));
            }
            None if step.is_multiple_of(self.every) || step == 1 => {
                info!(
                    step,
                    samples,
                    loss = format!("{loss:.4}"),
                    lr = format!("{lr:.2e}"),
                    grad_norm = format!("{grad_norm:.3}"),
                    tok_per_s = format!("{tok_s:.0}"),
                    "train"
                );
            }
            None => {}
        }
    }

    /// Runs `f` (which logs) with the bar hidden, so lines do not tear it.
    fn print<R>(&self, f: impl FnOnce() -> R) -> R {
        match &self.bar {
            Some(bar) => bar.suspend(f),
            None => f(),
        }
    }

    fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

/// A run stopped by SIGINT/SIGTERM after saving its checkpoint; `llora` exits with 130 for it,
/// as shells do for Ctrl-C, so schedulers can tell it from a failure.
#[derive(Debug, thiserror::Error)]
#[error("interrupted after step {step}; checkpoint saved in {}; continue with `llora train --resume {}`", checkpoint.display(), run_dir.display())]
pub struct Interrupted {
    /// Steps completed (and saved).
    pub step: usize,
    /// The checkpoint directory written.
    pub checkpoint: std::path::PathBuf,
    /// The run directory to pass to `--resume`.
    pub run_dir: std::path::PathBuf,
}

/// SIGINT/SIGTERM as a flag checked between steps; the handlers are removed on drop.
struct StopSignal {
    flag: std::sync::Arc<std::sync::atomic::AtomicBool>,
    ids: Vec<signal_hook::SigId>,
}

impl StopSignal {
    fn install() -> anyhow::Result<Self> {
        use signal_hook::consts::{SIGINT, SIGTERM};
        let flag = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let mut ids = Vec::new();
        for sig in [SIGINT, SIGTERM] {
            // A second signal while the checkpoint is being written exits at once (130).
            ids.push(signal_hook::flag::register_conditional_shutdown(sig, 130, flag.clone())?);
            ids.push(signal_hook::flag::register(sig, flag.clone())?);
        }
        Ok(Self { flag, ids })
    }

    fn raised(&self) -> bool {
        self.flag.load(std::sync::atomic::Ordering::Relaxed)
    }
}

impl Drop for StopSignal {
    fn drop(&mut self) {
        for id in self.ids.drain(..) {
            signal_hook::low_level::unregister(id);
        }
    }
}

/// Forward + backward passes on random tokens of the run's shape, then the gradients are
/// dropped: the adapters, the optimizer and the data order are untouched.
fn warm_up(model: &LlamaForCausalLM, config: &Config, device: &Device) {
    let (b, s) = (config.train.micro_batch_size, config.data.max_seq_len);
    for _ in 0..config.train.warmup_batches {
        let ids = Tensor::<2, Int>::random(
            [b, s],
            burn::tensor::Distribution::Uniform(0.0, model.config.vocab_size as f64),
            device,
        );
        let labels = ids.clone();
        let loss = model.loss(ids, labels, true).loss_sum.sum();
        drop(loss.backward());
    }
}

/// Runs `llora train` with a validated config; `config_name` is reported in logs.
pub fn run(config: &Config, config_name: &str) -> anyhow::Result<Outcome> {
    run_from(config, config_name, None)
}

/// `llora train --resume DIR`: continues the run whose checkpoint is in `DIR` (its run
/// directory) with the config saved there, `overrides` applied on top.
pub fn resume(dir: &std::path::Path, overrides: &[crate::config::Override]) -> anyhow::Result<(Outcome, Config)> {
    let ckpt = resume::load(dir)?;
    let name = ckpt.dir.join("config.toml").display().to_string();
    let mut config = Config::from_toml_str(&name, &ckpt.config_toml, overrides)?;
    // The run continues where its files are, even if the directory was moved.
    config.run.dir = ckpt.dir.parent().map_or_else(|| dir.to_path_buf(), std::path::Path::to_path_buf);
    info!(checkpoint = %ckpt.dir.display(), step = ckpt.progress.step, samples = ckpt.progress.samples, "resuming");
    Ok((run_from(&config, &name, Some(ckpt))?, config))
}

fn run_from(config: &Config, config_name: &str, mut resumed: Option<resume::Checkpoint>) -> anyhow::Result<Outcome> {
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
    if let (Some(pt), Some(path), None) = (&config.model.pretrain, &config.model.path, &resumed)
        && !path.join("config.json").is_file()
    {
        pretrain(config, pt, path)?;
    }
    // Fail before any work when inputs are absent: a 70B run should not load 140 GB first.
    if let Some(p) = &config.model.path {
        anyhow::ensure!(
            p.is_dir(),
            "model.path = {}: no such directory (download the HF checkpoint there, or set model.path)",
            p.display()
        );
    }
    for (key, p) in [("data.train", &config.data.train), ("data.eval", &config.data.eval)] {
        if let Some(p) = p {
            anyhow::ensure!(p.is_file(), "{key} = {}: no such file", p.display());
        }
    }

    let precision = config.precision.spec();

    let run_dir = &config.run.dir;
    std::fs::create_dir_all(run_dir).with_context(|| format!("cannot create run.dir {}", run_dir.display()))?;
    let result_log = run_dir.join("result_0.txt");
    // A resumed run appends to its log; that log then tells the story of an interrupted run,
    // which the MLPerf rules do not accept as a result (they time uninterrupted runs).
    let mut ml =
        if resumed.is_some() { MlLogger::append(&result_log, false)? } else { MlLogger::create(&result_log, false)? };
    let gbs = config.train.global_batch_size;
    let mbs = config.train.micro_batch_size;
    let accum = config.train.gradient_accumulation_steps();
    let full = config.model.trainable == "all";
    let spec = LoraSpec {
        rank: config.lora.rank,
        alpha: config.lora.alpha,
        dropout: config.lora.dropout,
        targets: config.lora.targets.clone(),
    };
    let base_name = config
        .model
        .path
        .as_ref()
        .map_or_else(|| config.model.preset.clone().unwrap_or_default(), |p| p.display().to_string());
    let config_toml = config.to_toml();

    // ---- init: everything before run_start (model, adapters, optimizer, warm-up) ----------------
    let fresh = resumed.is_none();
    if fresh {
        ml.event("cache_clear", true);
        ml.start("init_start", json!(null));
        ml.event("submission_benchmark", "llama2_70b_lora");
        ml.event("submission_org", config.mlperf.org.clone());
        ml.event("submission_division", config.mlperf.division.clone());
        ml.event("submission_status", "onprem");
        ml.event("submission_platform", config.mlperf.platform.clone());
        ml.event("seed", config.run.seed);
    }
    let train_device = device.clone().autodiff();
    train_device.seed(config.run.seed);
    let mut model = load_model(config, &spec, &train_device)?;
    model.set_precision(&precision)?;
    let vocab = model.config.vocab_size;
    let n_lora = model.num_lora_parameters();
    info!(base_parameters = model.config.num_parameters(), lora_parameters = n_lora, "model ready");
    let mut optim = AdamW::new(config.optim.clone());
    let collective = SingleProcess;
    let mut progress = resume::Progress::default();
    if let Some(ckpt) = resumed.as_mut() {
        ckpt.restore(&mut model, &mut optim, &device)?;
        progress = ckpt.progress.clone();
    } else {
        // Warm-up passes must not leave amaxes of random tokens in the scaling state.
        let scales = model.fp8_scales();
        warm_up(&model, config, &train_device);
        model.set_fp8_scales(&scales)?;
    }
    if fresh {
        // The dataset sizes are logged after run_start: the rules forbid touching the data before.
        for (k, v) in [
            ("global_batch_size", json!(gbs)),
            ("micro_batch_size", json!(mbs)),
            ("gradient_accumulation_steps", json!(accum)),
            ("opt_base_learning_rate", json!(config.optim.lr)),
            ("opt_adamw_weight_decay", json!(config.optim.weight_decay)),
            ("opt_gradient_clip_norm", json!(config.optim.clip_grad_norm)),
            (
                "opt_learning_rate_warmup_factor",
                json!(config.schedule.warmup_steps as f64 / config.schedule.max_steps as f64),
            ),
            ("opt_learning_rate_training_steps", json!(config.schedule.max_steps)),
            ("lora_rank", json!(config.lora.rank)),
            ("lora_alpha", json!(config.lora.alpha)),
            ("target_accuracy", json!(config.eval.target_loss)),
            // What ran: the linear GEMMs in `precision.compute`; attention (QKᵀ, softmax, PV)
            // and the gradient reduction always in f32.
            ("lowest_numerical_precision_in_linear", json!(precision.compute.name())),
            ("lowest_numerical_precision_in_attn", json!("fp32")),
            ("lowest_numerical_precision_in_comm", json!("fp32")),
            ("tensor_parallelism", json!(1)),
            ("pipeline_parallelism", json!(1)),
            ("context_parallelism", json!(1)),
            ("expert_parallelism", json!(1)),
            ("config_filename", json!(config_name)),
        ] {
            ml.event(k, v);
        }
        ml.end("init_stop", json!(null));
        // ---- run: the clock starts -------------------------------------------------------------
        ml.start("run_start", json!(null));
        progress.run_start_ms = now_ms();
    }
    let data = load_datasets(config, vocab)?;
    if fresh {
        ml.event("train_samples", data.train.len());
        ml.event("eval_samples", data.eval.len());
    }
    info!(train = data.train.len(), eval = data.eval.len(), "data ready");
    let order = ShardedOrder::new(data.train.len(), config.run.seed, 0, 1, true, progress.position)?;
    let mut batches = train_batches(data.train.clone(), order, gbs, mbs, padding(config), config.data.train_workers);
    let interval = config.eval_interval_samples();
    let skip = config.eval_skip_first();
    let mut metrics = Metrics::open(&run_dir.join("metrics.jsonl"), !fresh)?;
    let stop = StopSignal::install()?;
    let bar = Progress::new(config, progress.step);

    let mut status = "aborted";
    ml.start("block_start", json!({"samples_count": progress.samples}));
    let t_train = Instant::now();
    let mut tokens_here = 0usize;
    for step in progress.step..config.schedule.max_steps {
        let lr = lr_at(step, config.optim.lr, &config.schedule);
        // The whole global batch first: its target-token count normalises every micro-batch.
        let (micro_batches, global_tokens, batch_tokens, flops, position) = {
            let _span = debug_span!("data", step = step + 1).entered();
            let batch = batches.next().expect("the training stream is endless");
            let batch_tokens: usize = batch.lengths.iter().sum();
            let flops: f64 = batch.lengths.iter().map(|&n| train_flops(&model.config, n, full)).sum();
            // Dropout masks: a seed per (run seed, step) makes them independent of how far a
            // resumed run has come.
            train_device.seed(config.run.seed.wrapping_mul(1_000_003).wrapping_add(step as u64));
            let micro: Vec<_> = batch.micro_batches.into_iter().map(|m| upload(m, &train_device)).collect();
            (micro, batch.target_tokens, batch_tokens, flops, batch.position_after)
        };
        let t_step = Instant::now();
        let (loss_sum, total_norm) = match train_step(
            &mut model,
            &mut optim,
            &collective,
            micro_batches,
            global_tokens,
            lr,
            config.optim.clip_grad_norm,
        ) {
            Ok(r) => (r.loss, r.grad_norm),
            Err(e) => {
                bar.finish();
                ml.end("run_stop", json!({"samples_count": progress.samples, "status": "aborted"}));
                return Err(e.context(format!("step {}", step + 1)));
            }
        };
        let step_s = t_step.elapsed().as_secs_f64();
        progress.step = step + 1;
        progress.samples += gbs;
        progress.tokens_seen += batch_tokens;
        progress.position = position;
        tokens_here += batch_tokens;
        let samples = progress.samples;

        let tok_s = tokens_here as f64 / t_train.elapsed().as_secs_f64();
        let tflops = flops / step_s / 1e12;
        bar.step(step + 1, samples, loss_sum, lr, total_norm, tok_s);
        let mfu = (config.logging.peak_tflops > 0.0).then(|| tflops / config.logging.peak_tflops);
        metrics.write(json!({"step": step + 1, "samples": samples, "loss": loss_sum, "lr": lr, "grad_norm": total_norm, "tokens_per_s": tok_s, "step_s": step_s, "model_tflops_per_s": tflops, "mfu": mfu}));

        // `interval` is a whole number of global batches (Config::eval_interval_samples).
        if samples % interval == 0 {
            progress.evals_done += 1;
            if progress.evals_done > skip {
                ml.event_with("train_loss", loss_sum, json!({"samples_count": samples}));
                ml.end("block_stop", json!({"samples_count": samples}));
                ml.start("eval_start", json!({"samples_count": samples}));
                let (per_token, per_sample, _) = {
                    let _span = debug_span!("eval", samples).entered();
                    evaluate(
                        &model.valid(),
                        &data.eval,
                        config.eval.batch_size,
                        config.data.eval_workers,
                        padding(config),
                        &device,
                    )
                };
                let eval_loss = if config.eval.averaging == "per_token" { per_token } else { per_sample };
                ml.event_with("eval_accuracy", eval_loss, json!({"samples_count": samples}));
                ml.end("eval_stop", json!({"samples_count": samples}));
                bar.print(|| {
                    info!(samples, eval_loss = format!("{eval_loss:.4}"), target = config.eval.target_loss, "eval")
                });
                metrics.write(json!({"step": step + 1, "samples": samples, "eval_loss": eval_loss}));
                progress.last_eval = Some(eval_loss);
                if eval_loss <= config.eval.target_loss {
                    status = "success";
                    break;
                }
                ml.start("block_start", json!({"samples_count": samples}));
            }
        }
        let periodic = config.run.checkpoint_every > 0 && (step + 1) % config.run.checkpoint_every == 0;
        if periodic || stop.raised() {
            let adapter = (!full).then_some((&spec, base_name.as_str()));
            let dir = resume::save(run_dir, &config_toml, &progress, &mut model, &optim, adapter)?;
            bar.print(|| info!(step = step + 1, dir = %dir.display(), "checkpoint saved"));
            if stop.raised() {
                bar.finish();
                return Err(Interrupted { step: step + 1, checkpoint: dir, run_dir: run_dir.to_path_buf() }.into());
            }
        }
    }
    bar.finish();
    let run_stop = now_ms();
    let samples = progress.samples;
    if status != "success" {
        ml.end("block_stop", json!({"samples_count": samples}));
    }
    ml.end("run_stop", json!({"samples_count": samples, "status": status}));
    let ttt = run_stop.saturating_sub(progress.run_start_ms) as f64 / 1000.0;
    let saved = if full {
        let dir = run_dir.join("checkpoint");
        save_hf_checkpoint(&mut model, &dir)?;
        dir
    } else {
        let dir = run_dir.join("adapter");
        save_peft_adapter(&model, &spec, &dir, &base_name)?;
        dir
    };
    let plot = run_dir.join("loss.svg");
    let curve =
        crate::plot::Curve { label: config_name.to_string(), train: metrics.train.clone(), eval: metrics.eval.clone() };
    if let Err(e) = crate::plot::loss_svg(&plot, &[curve], config.eval.target_loss) {
        tracing::warn!("cannot draw {}: {e:#}", plot.display());
    }
    let last_eval = progress.last_eval;
    info!(status, samples, time_to_train_s = format!("{ttt:.1}"), result_log = %result_log.display(), saved = %saved.display(), plot = %plot.display(), "run finished");
    println!(
        "status: {status}  samples: {samples}  eval_loss: {}  time_to_train: {:.1} s ({:.2} min){}",
        last_eval.map_or("n/a".into(), |l| format!("{l:.4}")),
        ttt,
        ttt / 60.0,
        if fresh { "" } else { " (resumed: includes the interruption)" }
    );
    Ok(Outcome { status, samples, eval_loss: last_eval, time_to_train_s: ttt, result_log })
}

#[cfg(test)]
mod tests {
    #![allow(deprecated)] // Device::libtorch: burn-tch is deprecated upstream, and it is our backend.
    use super::*;
    use crate::collective::SingleProcess;
    use crate::config::OptimConfig;

    /// A global batch whose labels are all -100 gives loss 0 and gradient norm 0, not 0/0.
    #[test]
    fn batch_without_targets_is_finite() {
        let device = Device::libtorch().autodiff();
        device.seed(1);
        let config = LlamaConfig::preset("demo").unwrap();
        let mut model = LlamaForCausalLM::random(&config, Some(&LoraSpec::default()), false, &device);
        let mut optim = AdamW::new(OptimConfig::default());
        let ids = Tensor::<2, Int>::from_data(TensorData::new(vec![1i64, 5, 9, 13], [1, 4]), &device);
        let labels = Tensor::<2, Int>::from_data(TensorData::new(vec![llora_data::IGNORE_INDEX; 4], [1, 4]), &device);
        let s = train_step(&mut model, &mut optim, &SingleProcess, vec![(ids, labels)], 0, 1e-3, 0.3).unwrap();
        assert_eq!((s.loss, s.grad_norm), (0.0, 0.0));
        for (name, p) in model.trainable_params_mut() {
            let v = p.flat().into_data().convert::<f32>().to_vec::<f32>().unwrap();
            assert!(v.iter().all(|x| x.is_finite()), "{name} is not finite");
        }
    }
}
