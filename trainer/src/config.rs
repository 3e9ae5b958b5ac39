//! The one configuration tree: TOML schema, `--set` override target and validation, in one place.
//!
//! A run is described by a TOML file (see `configs/`) whose every section and key is a field
//! below; unknown keys are errors, absent keys take the documented default. `--set a.b=v`
//! overrides are applied to the parsed TOML before it is typed, so they go through exactly the
//! same checks as the file. [`Config::validate`] then checks ranges and cross-field rules once,
//! at start-up, and reports every problem with the key, the value and what is allowed.

use std::fmt;
use std::path::{Path, PathBuf};

use llora_data::batch::Padding;
pub use llora_data::parquet_io::OnBadRow;
use llora_model::LoraSpec;
use llora_model::device::DeviceSpec;
pub use llora_model::fp8::AmaxAlgo;
pub use llora_model::precision::Compute;
use llora_model::precision::{AdapterCompute, PrecisionSpec};
use serde::{Deserialize, Serialize};

/// The embedded default config (`configs/tiny-cpu.toml`): tiny Llama, synthetic data, CPU.
pub const TINY_CPU_TOML: &str = include_str!("../../configs/tiny-cpu.toml");
/// The name the embedded default is reported under.
pub const TINY_CPU_NAME: &str = "tiny-cpu.toml (embedded)";

/// `model.trainable`: which parameters train.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Trainable {
    /// The adapters only; the base stays frozen.
    Lora,
    /// Every parameter (full fine-tuning; used to pre-train the demo base).
    All,
}

/// `data.padding`: what micro-batches are padded to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PadTo {
    /// The longest row of the micro-batch.
    Longest,
    /// `data.max_seq_len` (fixed shapes).
    MaxLength,
}

impl PadTo {
    /// The loader's padding rule for sequences of at most `max_seq_len` tokens.
    pub fn padding(self, max_seq_len: usize) -> Padding {
        match self {
            Self::Longest => Padding::Longest,
            Self::MaxLength => Padding::MaxLength(max_seq_len),
        }
    }
}

/// `eval.averaging`: how token losses become the eval loss.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Averaging {
    /// Mean over samples of each sample's mean token loss (the MLPerf reference's metric).
    PerSample,
    /// Mean over all target tokens.
    PerToken,
}

/// `mlperf.division`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Division {
    /// Reference model, data and hyperparameter rules.
    Closed,
    /// Anything goes.
    Open,
}

impl Division {
    /// The value of `submission_division`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Closed => "closed",
            Self::Open => "open",
        }
    }
}

/// `logging.progress`: when the progress bar shows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ProgressBar {
    /// On a terminal.
    Auto,
    /// Always.
    Always,
    /// Never (a log line every `logging.every_steps`).
    Never,
}

/// A complete llora run configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Base model: where its weights come from.
    pub model: ModelConfig,
    /// Low-rank adapters.
    pub lora: LoraSpec,
    /// Training and evaluation data.
    pub data: DataConfig,
    /// AdamW on the trainable parameters.
    pub optim: OptimConfig,
    /// Learning-rate schedule.
    pub schedule: ScheduleConfig,
    /// Batch geometry and the objective.
    pub train: TrainConfig,
    /// Preference tuning's objective, with `train.objective = "dpo"`.
    pub dpo: DpoConfig,
    /// Evaluation cadence, metric and stopping target.
    pub eval: EvalConfig,
    /// Numerical precision: the model crate's spec as the `[precision]` section writes it
    /// (its `nf4` is `[model]`'s: read the whole with [`Config::precision_spec`]).
    pub precision: PrecisionSpec,
    /// Device, threads, seed, output directory.
    pub run: RunConfig,
    /// MLPerf submission metadata for the `:::MLLOG` result log.
    pub mlperf: MlperfConfig,
    /// Progress and metrics output.
    pub logging: LoggingConfig,
    /// Data-parallel ranks: collective backend, timeout, rendezvous.
    pub dist: crate::dist::DistConfig,
}

/// `[model]`: the base model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelConfig {
    /// HF checkpoint directory (`config.json` + safetensors); relative to the config file.
    pub path: Option<PathBuf>,
    /// Architecture preset, used when `path` is not set (random init) and to check a checkpoint.
    pub preset: Option<String>,
    /// Which parameters train: `"lora"` (adapters only) or `"all"` (full fine-tuning).
    pub trainable: Trainable,
    /// Pre-train a base into `path` first when it holds no checkpoint yet (CPU demo).
    pub pretrain: Option<PretrainConfig>,
    /// How the frozen base weights are stored: `"none"` (as `[precision]` says) or `"nf4"`
    /// (QLoRA: 4-bit NormalFloat, quantised one tensor at a time as it loads).
    pub quantize: Quantize,
    /// With `quantize = "nf4"`: quantise the block scales too (QLoRA's double quantisation).
    pub double_quant: bool,
    /// With `quantize = "nf4"`: values per block scale (QLoRA's and bitsandbytes' 64).
    pub quant_block_size: usize,
}

/// `model.quantize`: the storage of the frozen base weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Quantize {
    /// As `[precision]` stores them (f32, bf16, or FP8 with `fp8_weights`).
    #[default]
    None,
    /// NF4 codes with blockwise scales (QLoRA).
    Nf4,
}

impl Default for ModelConfig {
    fn default() -> Self {
        let nf4 = llora_model::precision::Nf4Spec::default();
        Self {
            path: None,
            preset: None,
            trainable: Trainable::Lora,
            pretrain: None,
            quantize: Quantize::None,
            double_quant: nf4.double,
            quant_block_size: nf4.block,
        }
    }
}

impl ModelConfig {
    /// The NF4 storage these settings ask for, if any.
    pub fn nf4(&self) -> Option<llora_model::precision::Nf4Spec> {
        (self.quantize == Quantize::Nf4)
            .then_some(llora_model::precision::Nf4Spec { block: self.quant_block_size, double: self.double_quant })
    }

    /// Records what is wrong with these model settings (`[model.pretrain]` needs a corpus from `data`).
    pub fn check(&self, p: &mut Problems<'_>, data: &DataConfig) {
        let one_of = |v: &str, set: &[&str]| set.contains(&v);
        let m = self;
        p.check(
            m.path.is_some() || m.preset.is_some(),
            "model.path",
            &m.path,
            "set model.path (an HF checkpoint directory) or model.preset (random initialisation)",
        );
        if let Some(preset) = &m.preset {
            p.check(
                one_of(preset, MODEL_PRESETS),
                "model.preset",
                preset,
                &format!("must be one of {}", quoted(MODEL_PRESETS)),
            );
        }
        let nf4 = llora_model::precision::Nf4Spec::default();
        if m.quantize != Quantize::Nf4 {
            let only =
                "only applies with model.quantize = \"nf4\" (the base is not quantised): set it, or drop this key";
            p.check(m.quant_block_size == nf4.block, "model.quant_block_size", &m.quant_block_size, only);
            p.check(m.double_quant == nf4.double, "model.double_quant", &m.double_quant, only);
        }
        if let Some(pt) = &m.pretrain {
            p.check(
                m.path.is_some() && m.preset.is_some(),
                "model.pretrain",
                &"[model.pretrain]",
                "needs model.path (where the base is saved) and model.preset (what to pre-train)",
            );
            p.check(
                data.synthetic.is_some() || (data.train.is_some() && data.eval.is_some()),
                "model.pretrain",
                &"[model.pretrain]",
                "needs a corpus: a [data.synthetic] section, or data.train and data.eval",
            );
            p.check(pt.steps >= 1, "model.pretrain.steps", &pt.steps, "must be at least 1");
            p.check(pt.lr.is_finite() && pt.lr > 0.0, "model.pretrain.lr", &pt.lr, "must be a finite number > 0");
        }
    }
}

/// `[model.pretrain]`: how to make the base checkpoint when `model.path` has none.
///
/// Full fine-tuning of the randomly initialised `model.preset` on a synthetic corpus like
/// `[data.synthetic]` but drawn from `corpus_seed` (other topics and abstracts, or the same
/// ones with the same seed), or, when the data are files, on `data.train` itself (evaluated on
/// `data.eval`), until its eval loss reaches `target_loss` or `steps` run out; the result is
/// saved to `model.path` as an HF checkpoint and reused by later runs. LoRA then has the rest
/// to learn.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PretrainConfig {
    /// Optimizer steps at most.
    pub steps: usize,
    /// Peak learning rate (cosine to 0 over `steps`).
    pub lr: f64,
    /// Seed of the pre-training corpus (a synthetic one; files are read as they are).
    pub corpus_seed: u64,
    /// Stop once the pre-training eval loss is at or below this.
    pub target_loss: f64,
}

impl Default for PretrainConfig {
    fn default() -> Self {
        Self { steps: 600, lr: 3e-3, corpus_seed: 1000, target_loss: 0.5 }
    }
}

/// Architecture presets `model.preset` accepts (the model crate's list).
pub const MODEL_PRESETS: &[&str] = llora_model::PRESETS;

/// Records what is wrong with the `[lora]` section: the model crate's spec, written as it is
/// (one definition, one check: [`LoraSpec::problems`]).
pub fn check_lora(l: &LoraSpec, p: &mut Problems<'_>) {
    for problem in l.problems() {
        p.push(&format!("lora.{}", problem.key), &problem.value, &problem.allowed);
    }
}

/// Module names `lora.targets` accepts (`qkv_proj` on fused-QKV checkpoints).
pub const LORA_TARGETS: &[&str] = llora_model::TARGET_MODULES;

/// `[data]`: the datasets and their loaders.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    /// Training set: MLPerf-schema parquet or Arrow file; relative to the config file.
    pub train: Option<PathBuf>,
    /// Evaluation set, same formats.
    pub eval: Option<PathBuf>,
    /// Longest sequence in tokens; longer rows are bad rows.
    pub max_seq_len: usize,
    /// Prefetch threads for training batches (0 = load on the training thread).
    pub train_workers: usize,
    /// Prefetch threads for evaluation batches.
    pub eval_workers: usize,
    /// Micro-batch padding: `"longest"` (to the longest row) or `"max_length"` (to
    /// `max_seq_len`: fixed shapes, as CUDA graphs need).
    pub padding: PadTo,
    /// What a bad row does: `"error"` stops with file/row/reason, `"skip"` counts and warns.
    pub on_bad_row: OnBadRow,
    /// Sample packing: whole samples placed into rows of `max_seq_len` tokens, each attending
    /// only to itself with its positions from 0 (`llora_data::packing`); a row of the schedule
    /// (`train.global_batch`, `eval.every_samples`) is then a packed row.
    pub packing: bool,
    /// Samples packed together (the bound on what packing holds at once).
    pub pack_window: usize,
    /// Generate a synthetic GovReport-shaped corpus instead of reading `train`/`eval`.
    pub synthetic: Option<SyntheticConfig>,
}

/// `[data.synthetic]`: the generated corpus (see `llora_data::synth`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SyntheticConfig {
    /// Training samples.
    pub train_samples: usize,
    /// Evaluation samples (every evaluation covers all of them).
    pub eval_samples: usize,
    /// Topics the reports are written about.
    pub topics: usize,
    /// Tokens of each topic's fixed abstract in the summary.
    pub summary_len: usize,
    /// Report tokens copied into the summary.
    pub copy_len: usize,
    /// Seed of the corpus (independent of `run.seed`, so every run sees the same data).
    pub seed: u64,
}

impl Default for SyntheticConfig {
    /// The corpus shape of the data crate's defaults, written once there.
    fn default() -> Self {
        let llora_data::synth::SynthConfig { topics, summary_len, copy_len, seed, .. } = Default::default();
        Self { train_samples: 1024, eval_samples: 32, topics, summary_len, copy_len, seed }
    }
}

impl Default for DataConfig {
    fn default() -> Self {
        Self {
            train: None,
            eval: None,
            max_seq_len: 8192,
            train_workers: 2,
            eval_workers: 1,
            padding: PadTo::Longest,
            on_bad_row: OnBadRow::Error,
            packing: false,
            pack_window: llora_data::packing::DEFAULT_WINDOW,
            synthetic: None,
        }
    }
}

impl DataConfig {
    /// How rows are packed, when they are.
    pub fn packing(&self) -> Option<llora_data::packing::Packing> {
        self.packing.then_some(llora_data::packing::Packing { seq_len: self.max_seq_len, window: self.pack_window })
    }

    /// Records what is wrong with these data settings.
    pub fn check(&self, p: &mut Problems<'_>) {
        let d = self;
        p.check(
            d.max_seq_len >= 2,
            "data.max_seq_len",
            &d.max_seq_len,
            "must be at least 2 (one input and one target token)",
        );
        check_workers(p, "data.train_workers", d.train_workers);
        check_workers(p, "data.eval_workers", d.eval_workers);
        p.check(d.pack_window >= 1, "data.pack_window", &d.pack_window, "must be at least 1");
        match &d.synthetic {
            Some(syn) => {
                p.check(
                    d.train.is_none() && d.eval.is_none(),
                    "data.synthetic",
                    &"[data.synthetic]",
                    "excludes data.train and data.eval: use one or the other",
                );
                p.check(
                    syn.train_samples >= 1,
                    "data.synthetic.train_samples",
                    &syn.train_samples,
                    "must be at least 1",
                );
                p.check(syn.eval_samples >= 1, "data.synthetic.eval_samples", &syn.eval_samples, "must be at least 1");
                p.check(syn.topics >= 1, "data.synthetic.topics", &syn.topics, "must be at least 1");
            }
            None => {
                p.check(
                    d.train.is_some(),
                    "data.train",
                    &d.train,
                    "set data.train (MLPerf-schema parquet) or a [data.synthetic] section",
                );
                p.check(
                    d.eval.is_some(),
                    "data.eval",
                    &d.eval,
                    "set data.eval (MLPerf-schema parquet) or a [data.synthetic] section",
                );
            }
        }
    }
}

/// `[optim]`: AdamW with PyTorch's conventions (decoupled weight decay).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OptimConfig {
    /// Peak learning rate.
    pub lr: f64,
    /// Adam betas (beta1, beta2).
    pub betas: [f64; 2],
    /// Adam epsilon.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// Global gradient-norm clip (0 disables clipping).
    pub clip_grad_norm: f64,
    /// Whether the update runs as LibTorch's multi-tensor AdamW (one launch for all parameters).
    pub fused: FusedOptim,
}

impl Default for OptimConfig {
    fn default() -> Self {
        Self {
            lr: 4e-4,
            betas: [0.9, 0.999],
            eps: 1e-8,
            weight_decay: 1e-4,
            clip_grad_norm: 0.3,
            fused: FusedOptim::Auto,
        }
    }
}

/// `optim.fused`: where the update runs as LibTorch's multi-tensor AdamW (`_fused_adamw_`, as
/// `torch.optim.AdamW(fused=True)`) rather than a few ops per parameter. Wherever it runs, it
/// is first checked against AdamW's definition on that device, and a refusal is logged and
/// falls back to the per-parameter update.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FusedOptim {
    /// Where the CUDA routes run: on CUDA (and on the CPU under `LLORA_CUDA_ROUTES_ON_CPU=1`).
    Auto,
    /// On any LibTorch device (LibTorch has the kernel on the CPU too).
    On,
    /// Never: the per-parameter update everywhere.
    Off,
}

impl OptimConfig {
    /// Records what is wrong with these optimizer settings.
    pub fn check(&self, p: &mut Problems<'_>) {
        let o = self;
        p.check(o.lr.is_finite() && o.lr > 0.0, "optim.lr", &o.lr, "must be a finite number > 0");
        for (i, b) in o.betas.iter().enumerate() {
            p.check((0.0..1.0).contains(b), &format!("optim.betas[{i}]"), b, "must be in [0, 1)");
        }
        // AdamW runs in f32: a smaller ε is 0 there (or a subnormal), and 0/0 is NaN at step 2.
        p.check(
            o.eps.is_finite() && o.eps >= f64::from(f32::MIN_POSITIVE),
            "optim.eps",
            &o.eps,
            "must be a finite number >= 1.2e-38 (the smallest normal f32: AdamW computes in f32)",
        );
        p.check(
            o.weight_decay.is_finite() && o.weight_decay >= 0.0,
            "optim.weight_decay",
            &o.weight_decay,
            "must be a finite number >= 0",
        );
        p.check(
            o.clip_grad_norm.is_finite() && o.clip_grad_norm >= 0.0,
            "optim.clip_grad_norm",
            &o.clip_grad_norm,
            "must be >= 0 (0 disables clipping)",
        );
    }
}

/// `[schedule]`: linear warm-up, then cosine decay to 0 at `max_steps`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ScheduleConfig {
    /// Optimizer steps at most; the cosine reaches 0 here.
    pub max_steps: usize,
    /// Linear warm-up steps from 0 to `optim.lr`.
    pub warmup_steps: usize,
}

impl Default for ScheduleConfig {
    fn default() -> Self {
        Self { max_steps: 1024, warmup_steps: 0 }
    }
}

impl ScheduleConfig {
    /// Records what is wrong with this schedule.
    pub fn check(&self, p: &mut Problems<'_>) {
        let s = self;
        p.check(s.max_steps >= 1, "schedule.max_steps", &s.max_steps, "must be at least 1");
        p.check(
            s.warmup_steps < s.max_steps.max(1),
            "schedule.warmup_steps",
            &s.warmup_steps,
            &format!("must be below schedule.max_steps ({})", s.max_steps),
        );
    }
}

/// `[train]`: batch geometry.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// Sequences per optimizer step, over all data-parallel ranks.
    pub global_batch_size: usize,
    /// Sequences per forward/backward on one rank; the rest is gradient accumulation
    /// (global_batch_size / (micro_batch_size × ranks) micro-batches per rank and step; the
    /// number of ranks is the launcher's, see `[dist]`).
    pub micro_batch_size: usize,
    /// Decoder blocks, from the first, that keep only their input in forward and run their
    /// forward again in backward (activation recomputation): 0 = none; the number of layers or
    /// more = all. Same masks and FP8 scales, so the same results, for less memory.
    pub recompute_layers: usize,
    /// ZeRO-3 for the frozen base: each data-parallel rank keeps 1/ranks of every frozen linear
    /// weight (in its storage dtype) and all-gathers a block's weights for its forward and
    /// again for its backward. LoRA weights, AdamW state, norms, embedding and LM head stay
    /// replicated. Same results as unsharded.
    pub shard_frozen_weights: bool,
    /// Context parallelism: each sequence's tokens split over this many consecutive ranks
    /// (load-balanced chunks for the causal mask, K/V all-gathered in attention), dividing each
    /// rank's activations by it; the launcher's ranks are data-parallel groups × this. 1 = off.
    pub context_parallel: usize,
    /// Warm-up forward+backward passes on random tokens before `run_start` (kernel selection,
    /// allocator growth, as NVIDIA's and AMD's submissions do); they touch neither the dataset
    /// nor the adapters.
    pub warmup_batches: usize,
    /// `"sft"` (the target tokens' cross-entropy) or `"dpo"` (preference pairs, `[dpo]`; the
    /// batch sizes then count pairs).
    pub objective: Objective,
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            global_batch_size: 8,
            micro_batch_size: 1,
            recompute_layers: 0,
            shard_frozen_weights: false,
            context_parallel: 1,
            warmup_batches: 0,
            objective: Objective::Sft,
        }
    }
}

/// `train.objective`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Objective {
    /// Supervised fine-tuning: the target tokens' cross-entropy.
    Sft,
    /// Direct preference optimisation on pairs (`[dpo]`), the reference the base with the
    /// adapters off (TRL's `DPOTrainer` with a fresh PEFT adapter).
    Dpo,
}

/// `[dpo]`: the preference objective (TRL's `DPOConfig` names in brackets).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DpoConfig {
    /// How far the policy may move from the reference (`beta`; IPO's τ).
    pub beta: f64,
    /// `"sigmoid"` (DPO), `"ipo"` (per-token averaged) or `"hinge"` (`loss_type`).
    pub loss: DpoLoss,
    /// Weight of the chosen completions' per-token NLL added to it (`loss_type` + `"sft"` with
    /// this `loss_weights` entry); 0 = none.
    pub sft_weight: f64,
    /// The reference's log-probabilities of every pair computed once before training
    /// (`precompute_ref_log_probs`) and cached beside `data.train`, instead of a reference
    /// forward in every step.
    pub precompute_reference: bool,
}

impl Default for DpoConfig {
    fn default() -> Self {
        Self { beta: 0.1, loss: DpoLoss::Sigmoid, sft_weight: 0.0, precompute_reference: false }
    }
}

/// `dpo.loss`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum DpoLoss {
    /// `−log σ(β·Δ)`.
    Sigmoid,
    /// `(Δ̄ − 1/(2β))²`, log-ratios averaged per token.
    Ipo,
    /// `max(0, 1 − β·Δ)`.
    Hinge,
}

impl DpoConfig {
    /// Records what is wrong with β and the SFT weight, under the names `[beta, sft_weight]`
    /// (a config's keys, or `llora eval`'s flags).
    pub fn check_values(&self, p: &mut Problems<'_>, [beta, sft_weight]: [&str; 2]) {
        p.check(self.beta > 0.0 && self.beta.is_finite(), beta, &self.beta, "must be a finite number > 0");
        let sft_ok = self.sft_weight >= 0.0 && self.sft_weight.is_finite();
        p.check(sft_ok, sft_weight, &self.sft_weight, "must be a finite number >= 0");
    }

    /// The model crate's objective, with the base as the reference (the trainer sets the
    /// adapters training started from instead, with `lora.init_from`).
    pub fn objective(&self) -> llora_model::PreferenceObjective {
        use llora_model::PreferenceLoss as L;
        let main = match self.loss {
            DpoLoss::Sigmoid => L::Sigmoid,
            DpoLoss::Ipo => L::Ipo,
            DpoLoss::Hinge => L::Hinge,
        };
        let mut losses = vec![(main, 1.0)];
        if self.sft_weight > 0.0 {
            losses.push((L::Sft, self.sft_weight));
        }
        llora_model::PreferenceObjective { beta: self.beta, losses, reference: llora_model::Reference::Base }
    }
}

impl TrainConfig {
    /// Records what is wrong with these batch settings.
    pub fn check(&self, p: &mut Problems<'_>) {
        let t = self;
        p.check(t.global_batch_size >= 1, "train.global_batch_size", &t.global_batch_size, "must be at least 1");
        p.check(t.micro_batch_size >= 1, "train.micro_batch_size", &t.micro_batch_size, "must be at least 1");
        p.check(
            (1..=64).contains(&t.context_parallel),
            "train.context_parallel",
            &t.context_parallel,
            "must be in 1..=64 (ranks sharing one sequence)",
        );
        p.check(
            t.global_batch_size.is_multiple_of(t.micro_batch_size.max(1)),
            "train.global_batch_size",
            &t.global_batch_size,
            &format!("must be a multiple of train.micro_batch_size = {} (and of it × ranks)", t.micro_batch_size),
        );
    }
}

/// `[eval]`: when to evaluate, how to average, when to stop.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct EvalConfig {
    /// Evaluate every this many training samples (rounded up to a multiple of the global batch).
    pub every_samples: usize,
    /// Stop with success at the first evaluation whose loss is at or below this.
    pub target_loss: f64,
    /// Evaluations skipped at the start; absent means MLPerf's floor(0.125·GBS + 2).
    pub skip_first: Option<usize>,
    /// `"per_sample"` (mean of each sample's mean token loss, the reference's HF Trainer at
    /// eval batch 1) or `"per_token"` (all target tokens weighted equally).
    pub averaging: Averaging,
    /// Sequences per evaluation forward pass.
    pub batch_size: usize,
}

impl Default for EvalConfig {
    fn default() -> Self {
        Self {
            every_samples: 384,
            target_loss: 0.925,
            skip_first: None,
            averaging: Averaging::PerSample,
            batch_size: 1,
        }
    }
}

impl EvalConfig {
    /// Records what is wrong with these evaluation settings.
    pub fn check(&self, p: &mut Problems<'_>) {
        let e = self;
        p.check(e.every_samples >= 1, "eval.every_samples", &e.every_samples, "must be at least 1");
        p.check(
            e.target_loss.is_finite() && e.target_loss > 0.0,
            "eval.target_loss",
            &e.target_loss,
            "must be a finite number > 0",
        );
        p.check(e.batch_size >= 1, "eval.batch_size", &e.batch_size, "must be at least 1");
    }
}

/// Records what is wrong with a precision (the model crate's one check,
/// [`PrecisionSpec::problems`]), and reduced precision on a device that cannot run it.
pub fn check_precision(spec: &PrecisionSpec, p: &mut Problems<'_>, device: &DeviceSpec) {
    for problem in spec.problems() {
        p.push(&problem.key, &problem.value, &problem.allowed);
    }
    let reduced = spec.compute != Compute::Fp32 || spec.fp8_activations;
    p.check(
        !reduced || *device != DeviceSpec::Flex,
        "precision.compute",
        &spec.compute,
        "bf16/fp8 compute and fp8_activations need a LibTorch device (run.device = \"cpu\" or \"cuda:N\")",
    );
}

/// The command flags that set precision keys, for reporting [`PrecisionSpec::problems`] of a
/// precision asked for by flags (`llora bench`, `eval`, `generate`) in the flags' names. A key
/// before any key it begins (`fp8_weights_one_layout` before `fp8_weights`).
const PRECISION_FLAGS: [(&str, &str); 7] = [
    ("precision.fp8_weights_one_layout", "--fp8-weights-one-layout"),
    ("precision.adapter_compute", "--adapter-compute"),
    ("precision.fp8_weights", "--fp8-weights"),
    ("precision.fp8_activations", "--fp8-activations"),
    ("precision.compute", "--precision"),
    ("model.quant_block_size", "--quant-block-size"),
    ("model.quantize", "--quantize"),
];

/// Records what is wrong with the precision some command flags ask for, each problem and
/// what it needs named by the flags ([`PrecisionSpec::problems`] is the one check).
pub fn check_precision_flags(spec: &PrecisionSpec, p: &mut Problems<'_>) {
    let flags = |text: &str| PRECISION_FLAGS.iter().fold(text.to_string(), |t, (key, flag)| t.replace(key, flag));
    for problem in spec.problems() {
        p.push(&flags(&problem.key), &problem.value, &flags(&problem.allowed));
    }
}

/// `[run]`: where and how this process runs.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RunConfig {
    /// `"cpu"`, `"cuda:N"` or `"flex"`.
    pub device: DeviceSpec,
    /// Intra-op threads (0 = one per core).
    pub threads: usize,
    /// Seed for initialisation, dropout and data order.
    pub seed: u64,
    /// Output directory (logs, checkpoints, adapters); relative to the working directory.
    pub dir: PathBuf,
    /// Save a resumable checkpoint every this many optimizer steps (0 = none, except on
    /// SIGINT/SIGTERM).
    pub checkpoint_every: usize,
    /// How many step-numbered checkpoints to keep (the newest); resuming falls back to an older
    /// one when the newest is damaged.
    pub keep_checkpoints: usize,
    /// Whether a fresh `llora train` continues the interrupted run it finds in `run.dir`.
    pub resume: ResumeMode,
}

impl Default for RunConfig {
    fn default() -> Self {
        Self {
            device: DeviceSpec::Cpu,
            threads: 0,
            seed: 0,
            dir: PathBuf::from("runs/default"),
            checkpoint_every: 0,
            keep_checkpoints: 2,
            resume: ResumeMode::Launcher,
        }
    }
}

impl RunConfig {
    /// Records what is wrong with these run settings.
    pub fn check(&self, p: &mut Problems<'_>) {
        let r = self;
        check_threads(p, "run.threads", r.threads);
        p.check(r.keep_checkpoints >= 1, "run.keep_checkpoints", &r.keep_checkpoints, "must be at least 1");
        p.check(!r.dir.as_os_str().is_empty(), "run.dir", &r.dir, "must be a directory path");
    }
}

/// `run.resume`: what a fresh `llora train` does with an interrupted run in `run.dir`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ResumeMode {
    /// Resume it from its newest intact checkpoint, when its config is this one's.
    Auto,
    /// Refuse to start (continue it with `llora train --resume DIR`).
    Never,
    /// `auto` when a launcher started llora (torchrun or SLURM, which restart or requeue
    /// jobs by themselves), `never` when a person did.
    Launcher,
}

impl ResumeMode {
    /// Whether interrupted runs are resumed, here and now.
    pub fn is_auto(self) -> bool {
        match self {
            Self::Auto => true,
            Self::Never => false,
            Self::Launcher => crate::dist::World::launched(),
        }
    }
}

/// `[mlperf]`: submission metadata written to the result log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct MlperfConfig {
    /// `submission_org`.
    pub org: String,
    /// `submission_platform`.
    pub platform: String,
    /// `submission_division`: `"closed"` or `"open"`.
    pub division: Division,
    /// After `run_stop`, run the official compliance checker on the result log (`llora mlperf
    /// check`); a rejected log fails the run.
    pub check: bool,
}

impl Default for MlperfConfig {
    fn default() -> Self {
        Self { org: "llora".into(), platform: "cpu".into(), division: Division::Closed, check: false }
    }
}

impl MlperfConfig {
    /// Records what is wrong with these MLPerf log settings.
    pub fn check(&self, p: &mut Problems<'_>) {
        let ml = self;
        p.check(!ml.org.trim().is_empty(), "mlperf.org", &ml.org, "must not be empty");
        p.check(!ml.platform.trim().is_empty(), "mlperf.platform", &ml.platform, "must not be empty");
    }
}

/// `[logging]`: what the run prints and records.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LoggingConfig {
    /// Print a progress line every this many optimizer steps when not on a TTY.
    pub every_steps: usize,
    /// Progress bar: `"auto"` (on a TTY), `"always"` or `"never"`.
    pub progress: ProgressBar,
    /// Peak dense TFLOP/s of one device, for the MFU column of `metrics.jsonl`. 0: the bf16
    /// peak of a GPU llora knows by name (H100, H200, B200, MI300X, MI355X), else no MFU
    /// (achieved TFLOP/s is reported either way).
    pub peak_tflops: f64,
    /// Write TensorBoard event files (`RUN_DIR/tensorboard/`) with the scalars of
    /// `metrics.jsonl`: `tensorboard --logdir runs`.
    pub tensorboard: bool,
}

impl Default for LoggingConfig {
    fn default() -> Self {
        Self { every_steps: 10, progress: ProgressBar::Auto, peak_tflops: 0.0, tensorboard: true }
    }
}

impl LoggingConfig {
    /// Records what is wrong with these logging settings.
    pub fn check(&self, p: &mut Problems<'_>) {
        let lg = self;
        p.check(lg.every_steps >= 1, "logging.every_steps", &lg.every_steps, "must be at least 1");
        p.check(
            lg.peak_tflops >= 0.0 && lg.peak_tflops.is_finite(),
            "logging.peak_tflops",
            &lg.peak_tflops,
            "must be a finite number ≥ 0",
        );
    }
}

/// A config that failed to load or validate; `Display` lists every problem.
#[derive(Debug, thiserror::Error)]
pub struct ConfigError {
    /// Where the config came from (a path, or the embedded default's name).
    pub source_name: String,
    /// One line per problem, each naming the key.
    pub problems: Vec<String>,
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let n = self.problems.len();
        write!(f, "invalid config {} ({n} problem{}):", self.source_name, if n == 1 { "" } else { "s" })?;
        for p in &self.problems {
            write!(f, "\n  - {p}")?;
        }
        Ok(())
    }
}

impl ConfigError {
    fn one(source_name: &str, problem: String) -> Self {
        Self { source_name: source_name.into(), problems: vec![problem] }
    }
}

/// One `--set section.key=value` override, parsed.
#[derive(Debug, Clone, PartialEq)]
pub struct Override {
    /// Dotted key path, e.g. `optim.lr`.
    pub key: String,
    /// The value: a TOML value (`1e-4`, `true`, `[1, 2]`, `"x"`) or else a bare string.
    pub value: toml::Value,
}

/// Why a `--set` value TOML refused is no bare word to take as a string: a list or table
/// whose strings lost their quotes (shells strip them), or an integer out of range.
fn not_a_word(key: &str, raw: &str) -> Option<String> {
    if raw.starts_with('[') || raw.starts_with('{') {
        let example = if key == "lora.targets" { r#"["q_proj", "v_proj"]"# } else { r#"["a", "b"]"# };
        return Some(format!(
            "{raw} is not a TOML list or table: its strings need quotes, which the shell strips unless the whole \
             argument is quoted, e.g. --set '{key}={example}'"
        ));
    }
    let digits = raw.strip_prefix(['+', '-']).unwrap_or(raw);
    if !digits.is_empty() && digits.chars().all(|c| c.is_ascii_digit() || c == '_') {
        return Some(format!("{raw} is out of range for an integer (at most {})", i64::MAX));
    }
    None
}

impl std::str::FromStr for Override {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (key, raw) = s.split_once('=').ok_or_else(|| format!("--set {s:?}: expected section.key=value"))?;
        let key = key.trim();
        if key.is_empty() || key.split('.').any(|part| part.trim().is_empty()) {
            return Err(format!("--set {s:?}: the key must be dotted names like optim.lr"));
        }
        // A bare word such as `cuda:0` or `runs/x` is not TOML; taking it as a string saves
        // users from quoting inside shell quotes. A list, a table or a number that is not TOML
        // is not a word: taken as a string it would be wrong in a way that names nothing.
        let parsed = toml::from_str::<toml::Table>(&format!("v = {raw}")).ok().and_then(|mut t| t.remove("v"));
        let value = match parsed {
            Some(value) => value,
            None => {
                if let Some(why) = not_a_word(key, raw.trim()) {
                    return Err(format!("--set {s:?}: {why}"));
                }
                toml::Value::String(raw.to_string())
            }
        };
        Ok(Self { key: key.to_string(), value })
    }
}

impl Config {
    /// Joins the world this config trains in: its `[dist]`, its device, its
    /// `train.context_parallel` (what `llora train`, `--resume` and `llora mlperf run` start with).
    pub fn join_world(&self) -> anyhow::Result<crate::dist::Dist> {
        let cp = self.train.context_parallel;
        crate::dist::init_with_context(&self.dist, self.run.device.is_cuda(), cp, "train.context_parallel")
    }
}

impl Config {
    /// Loads `path` (or the embedded `tiny-cpu.toml` when `None`), applies `overrides`, validates.
    ///
    /// Relative paths (`model.path`, `data.train`, `data.eval`, `run.dir`) are relative to the
    /// working directory, whether they come from a file, the embedded default or `--set`: one
    /// rule, the same as for any command-line path.
    pub fn load(path: Option<&Path>, overrides: &[Override]) -> Result<Self, ConfigError> {
        let (name, text) = match path {
            Some(p) => {
                let text = std::fs::read_to_string(p)
                    .map_err(|e| ConfigError::one(&p.display().to_string(), format!("cannot read config file: {e}")))?;
                (p.display().to_string(), text)
            }
            None => (TINY_CPU_NAME.to_string(), TINY_CPU_TOML.to_string()),
        };
        Self::parse(&name, &text, overrides)
    }

    /// Parses TOML text, applies overrides and validates: every config a run uses (a file, the
    /// embedded default, a checkpoint's saved config on `--resume`) comes through here.
    pub fn parse(name: &str, text: &str, overrides: &[Override]) -> Result<Self, ConfigError> {
        let config = Self::from_toml_str(name, text, overrides)?;
        config.validate().map_err(|problems| ConfigError { source_name: name.to_string(), problems })?;
        Ok(config)
    }

    /// This config with `overrides` applied, validated again (`name`: where it came from).
    pub fn with_overrides(&self, name: &str, overrides: &[Override]) -> Result<Self, ConfigError> {
        if overrides.is_empty() {
            return Ok(self.clone());
        }
        Self::parse(name, &self.to_toml(), overrides)
    }

    /// Parses TOML text and applies overrides, without validation (see [`Config::parse`]).
    pub(crate) fn from_toml_str(name: &str, text: &str, overrides: &[Override]) -> Result<Self, ConfigError> {
        let mut table: toml::Table = toml::from_str(text)
            .map_err(|e| ConfigError::one(name, format!("TOML syntax: {}", e.to_string().trim_end())))?;
        for o in overrides {
            apply_override(&mut table, o).map_err(|e| ConfigError::one(name, e))?;
        }
        serde_path_to_error::deserialize(toml::Value::Table(table.clone())).map_err(|e| {
            let key = e.path().to_string();
            // toml appends "in `section`" on a new line; the key already says where.
            let inner = e.into_inner().to_string().lines().next().unwrap_or_default().to_string();
            let key = full_key(&key, &inner);
            let from_set = overrides.iter().any(|o| o.key == key || o.key.starts_with(&format!("{key}.")));
            let origin = if from_set { " (from --set)" } else { "" };
            let what = enum_given_no_word(&table, &key, &inner).unwrap_or_else(|| format!(": {}", inner.trim_end()));
            ConfigError::one(name, format!("config key `{key}`{origin}{what}"))
        })
    }

    /// The resolved config as TOML, as `llora config show` prints it.
    pub fn to_toml(&self) -> String {
        toml::to_string_pretty(self).expect("a Config always serialises")
    }

    /// The model's precision: `[precision]`, with the base stored as `model.quantize` says.
    pub fn precision_spec(&self) -> PrecisionSpec {
        PrecisionSpec { nf4: self.model.nf4(), ..self.precision }
    }

    /// Evaluations skipped before the first one that counts (MLPerf: floor(0.125·GBS + 2)).
    pub fn eval_skip_first(&self) -> usize {
        self.eval.skip_first.unwrap_or_else(|| (0.125 * self.train.global_batch_size as f64 + 2.0).floor() as usize)
    }

    /// Training samples between evaluations: `eval.every_samples` rounded up to whole steps.
    pub fn eval_interval_samples(&self) -> usize {
        let gbs = self.train.global_batch_size.max(1);
        self.eval.every_samples.div_ceil(gbs) * gbs
    }

    /// Range and cross-field checks, section by section (each section's `check` sits beside its
    /// type); every problem names its key, value and what is allowed.
    pub fn validate(&self) -> Result<(), Vec<String>> {
        let mut p = Problems::new(&config_key);
        self.model.check(&mut p, &self.data);
        check_lora(&self.lora, &mut p);
        self.data.check(&mut p);
        self.optim.check(&mut p);
        self.schedule.check(&mut p);
        self.train.check(&mut p);
        self.eval.check(&mut p);
        check_precision(&self.precision_spec(), &mut p, &self.run.device);
        self.check_keys_that_would_be_ignored(&mut p);
        if self.model.quantize == Quantize::Nf4 {
            let m = &self.model;
            let why = "model.quantize = \"nf4\" stores frozen weights: it needs model.trainable = \"lora\"";
            p.check(m.trainable == Trainable::Lora, "model.trainable", &"all", why);
            let why =
                "an NF4 base (model.quantize = \"nf4\") needs a LibTorch device (run.device = \"cpu\" or \"cuda:N\")";
            p.check(self.run.device != DeviceSpec::Flex, "run.device", &self.run.device.to_string(), why);
        }
        if self.train.context_parallel > 1 {
            let why =
                "context parallelism runs attention on LibTorch's kernels: it needs run.device = \"cpu\" or \"cuda:N\"";
            p.check(self.run.device != DeviceSpec::Flex, "run.device", &self.run.device.to_string(), why);
            // Each rank holds part of every sequence: the trainable embedding and head would need
            // their gradients summed over the group, which only the adapters' path does.
            let why = "full fine-tuning is not supported under context parallelism (train.context_parallel > 1): \
                       train adapters (model.trainable = \"lora\") or set train.context_parallel = 1";
            p.check(self.model.trainable == Trainable::Lora, "model.trainable", &"all", why);
        }
        let why = "dist.share_device = true runs several ranks on one GPU, which NCCL refuses: set dist.backend = \"gloo\" (or \"auto\")";
        p.check(
            !(self.dist.share_device && self.dist.backend == crate::dist::BackendChoice::Nccl),
            "dist.backend",
            &"nccl",
            why,
        );
        let b = self.dist.bucket_mb;
        let why = "the gradient buckets' size in MiB: 0 (reduce after the backward) or more, 25 as PyTorch DDP";
        p.check(b.is_finite() && b >= 0.0, "dist.bucket_mb", &b, why);
        if self.train.objective == Objective::Dpo {
            self.check_dpo(&mut p);
        }
        self.run.check(&mut p);
        self.mlperf.check(&mut p);
        self.logging.check(&mut p);
        p.finish()
    }
}

impl Config {
    /// Keys set to a value nothing reads in this config (as the NF4 keys without NF4): a
    /// user who sets one expects it to act, so it is refused, naming what it needs.
    /// What preference tuning does not compose with yet, each refused by its key.
    fn check_dpo(&self, p: &mut Problems<'_>) {
        let d = &self.dpo;
        d.check_values(p, ["dpo.beta", "dpo.sft_weight"]);
        let not_yet = |what: &str| format!("is not supported with train.objective = \"dpo\" yet ({what})");
        let t = &self.train;
        p.check(
            t.context_parallel == 1,
            "train.context_parallel",
            &t.context_parallel,
            &not_yet("pairs are whole rows: set it to 1"),
        );
        p.check(t.recompute_layers == 0, "train.recompute_layers", &t.recompute_layers, &not_yet("set it to 0"));
        p.check(!t.shard_frozen_weights, "train.shard_frozen_weights", &true, &not_yet("set it to false"));
        let why = "preference tuning trains adapters: the reference is the base with the adapters off";
        p.check(self.model.trainable == Trainable::Lora, "model.trainable", &"all", why);
        p.check(self.data.packing().is_none(), "data.packing", &true, &not_yet("pairs are not packed, as in TRL"));
        let why =
            "the MLPerf checker judges the benchmark's supervised job, not a preference run: set mlperf.check = false";
        p.check(!self.mlperf.check, "mlperf.check", &true, why);
    }

    fn check_keys_that_would_be_ignored(&self, p: &mut Problems<'_>) {
        if self.train.objective != Objective::Dpo {
            let (d, default) = (&self.dpo, DpoConfig::default());
            let only = "only applies with train.objective = \"dpo\": set it, or drop this key";
            p.check(d.beta == default.beta, "dpo.beta", &d.beta, only);
            p.check(d.loss == default.loss, "dpo.loss", &word(d.loss), only);
            p.check(d.sft_weight == default.sft_weight, "dpo.sft_weight", &d.sft_weight, only);
            let pre = d.precompute_reference;
            p.check(pre == default.precompute_reference, "dpo.precompute_reference", &pre, only);
        }
        let (spec, default) = (&self.precision.amax, llora_model::fp8::AmaxSpec::default());
        if self.precision.compute != Compute::Fp8 {
            let only = "only applies with precision.compute = \"fp8\" (delayed scaling of the FP8 GEMMs' inputs; \
                        stored FP8 activations take current scaling): set it, or drop this key";
            p.check(spec.history_len == default.history_len, "precision.amax_history_len", &spec.history_len, only);
            p.check(spec.algo == default.algo, "precision.amax_compute_algo", &word(spec.algo), only);
            p.check(spec.margin == default.margin, "precision.amax_margin", &spec.margin, only);
        }
        if self.model.trainable == Trainable::All {
            let why = "only applies with model.trainable = \"lora\" (full fine-tuning has no adapters): drop this key";
            let compute = self.precision.adapter_compute;
            p.check(compute == AdapterCompute::Auto, "precision.adapter_compute", &word(compute), why);
            // What shapes the adapters beyond their size (which every config carries a default of).
            let l = &self.lora;
            p.check(!l.dora, "lora.dora", &l.dora, why);
            p.check(!l.rslora, "lora.rslora", &l.rslora, why);
            p.check(l.rank_pattern.is_empty(), "lora.rank_pattern", &"{...}", why);
            p.check(l.alpha_pattern.is_empty(), "lora.alpha_pattern", &"{...}", why);
            p.check(l.layers.is_none(), "lora.layers_to_transform", &"[...]", why);
            let from = l.init_from.as_ref().map(|d| d.display().to_string());
            p.check(from.is_none(), "lora.init_from", &from.unwrap_or_default(), why);
        }
    }
}

/// An enum value as a config file spells it (its serde name).
fn word(value: impl Serialize) -> String {
    serde_json::to_value(value).ok().and_then(|v| v.as_str().map(str::to_string)).unwrap_or_default()
}

/// Problems found in values, each named by where the value came from: a config key, or the
/// command flag that sets the same value (one validation for both).
pub struct Problems<'a> {
    name: &'a dyn Fn(&str) -> String,
    list: Vec<String>,
}

impl<'a> Problems<'a> {
    /// An empty list whose values are named by `name(key)`.
    pub fn new(name: &'a dyn Fn(&str) -> String) -> Self {
        Self { name, list: Vec::new() }
    }

    /// Records that `key` = `value` is not `allowed`, unless `ok`.
    pub fn check(&mut self, ok: bool, key: &str, value: &dyn fmt::Debug, allowed: &str) {
        if !ok {
            self.push(key, &format!("{value:?}"), allowed);
        }
    }

    /// Records that `key` = `value` (already formatted) is not `allowed`.
    pub fn push(&mut self, key: &str, value: &str, allowed: &str) {
        self.list.push(format!("{} = {value}: {allowed}", (self.name)(key)));
    }

    /// `Ok` when nothing was recorded, else every problem.
    pub fn finish(self) -> Result<(), Vec<String>> {
        if self.list.is_empty() { Ok(()) } else { Err(self.list) }
    }
}

/// How a config file names a key: ``config key `lora.rank` ``.
pub fn config_key(key: &str) -> String {
    format!("config key `{key}`")
}

/// `"a", "b"` for error messages.
fn quoted(set: &[&str]) -> String {
    set.iter().map(|s| format!("{s:?}")).collect::<Vec<_>>().join(", ")
}

/// The most intra-op threads or loader workers a value may ask for: 4 per core of this
/// machine, at least 16 (more only oversubscribes; 100000 hung in thread creation).
pub fn max_threads() -> usize {
    (4 * std::thread::available_parallelism().map_or(1, |n| n.get())).max(16)
}

/// Intra-op threads: 0 (one per core) up to [`max_threads`].
pub fn check_threads(p: &mut Problems<'_>, key: &str, threads: usize) {
    let max = max_threads();
    p.check(
        threads <= max,
        key,
        &threads,
        &format!("must be in 0..={max} (0 = one per core; 4 per core of this machine at most)"),
    );
}

/// Loader worker threads: 0 (on the calling thread) up to [`max_threads`].
pub fn check_workers(p: &mut Problems<'_>, key: &str, workers: usize) {
    let max = max_threads();
    p.check(workers <= max, key, &workers, &format!("must be in 0..={max} (4 per core of this machine at most)"));
}

/// An enum key given a number, a bool or an array ("invalid type: unit variant, expected string
/// only", which names neither the value nor the words): ` = VALUE: expected one of WORDS, in
/// quotes`, the words being what the same key given the value's text as a string is told.
fn enum_given_no_word(table: &toml::Table, key: &str, message: &str) -> Option<String> {
    if !message.contains("expected string only") {
        return None;
    }
    let (parents, last) = key.rsplit_once('.').map_or((None, key), |(p, l)| (Some(p), l));
    let mut section = table;
    for part in parents.into_iter().flat_map(|p| p.split('.')) {
        section = section.get(part)?.as_table()?;
    }
    let value = section.get(last)?.clone();
    let mut probe = table.clone();
    let mut cur = &mut probe;
    for part in parents.into_iter().flat_map(|p| p.split('.')) {
        cur = cur.get_mut(part)?.as_table_mut()?;
    }
    cur.insert(last.to_string(), toml::Value::String(value.to_string()));
    let told = serde_path_to_error::deserialize::<_, Config>(toml::Value::Table(probe)).err()?.into_inner().to_string();
    // serde: "unknown variant `16`, expected one of `a`, `b`, `c`" (or "`a` or `b`", or "`a`").
    let words = told.split_once("`, expected ")?.1.lines().next()?.trim_end();
    let first = words.split('`').nth(1)?;
    Some(format!(" = {value}: expected {words}, in quotes (e.g. --set {key}=\"{first}\")"))
}

/// serde reports an unknown field at its parent's path; name the field itself.
fn full_key(path: &str, message: &str) -> String {
    let parent = if path == "." { "" } else { path };
    match message.strip_prefix("unknown field `").and_then(|m| m.split_once('`')) {
        // serde_path_to_error already ends the path with the unknown key in some versions.
        Some((field, _)) if parent == field || parent.ends_with(&format!(".{field}")) => parent.to_string(),
        Some((field, _)) if parent.is_empty() => field.to_string(),
        Some((field, _)) => format!("{parent}.{field}"),
        None => parent.to_string(),
    }
}

fn apply_override(table: &mut toml::Table, o: &Override) -> Result<(), String> {
    let parts: Vec<&str> = o.key.split('.').map(str::trim).collect();
    let (last, parents) = parts.split_last().expect("Override keys are never empty");
    let mut cur = table;
    for (i, part) in parents.iter().enumerate() {
        let entry = cur.entry(part.to_string()).or_insert_with(|| toml::Value::Table(Default::default()));
        cur = entry
            .as_table_mut()
            .ok_or_else(|| format!("--set {}: `{}` is a value, not a section", o.key, parts[..=i].join(".")))?;
    }
    cur.insert(last.to_string(), o.value.clone());
    Ok(())
}

/// Every rank publishes its resolved config; each compares it with rank 0's, and all learn
/// which ranks differ. A mismatch is an error on every rank naming the ranks and the keys.
pub fn check_same_config(comm: &dyn crate::dist::Collective, config_toml: &str) -> Result<(), crate::dist::DistError> {
    let diff = |reference: &str| differing_keys(reference, config_toml);
    match crate::dist::agree_with_rank_0(comm, "config", config_toml, diff)? {
        None => Ok(()),
        Some(detail) => Err(crate::dist::DistError::ConfigMismatch(format!(
            "{detail}: every rank must run the same config and --set overrides (ranks were started with a config \
             different from rank 0's)"
        ))),
    }
}

/// Dotted keys whose values differ between two TOML documents.
pub fn differing_keys(a: &str, b: &str) -> Vec<String> {
    fn flatten(prefix: &str, v: &toml::Value, out: &mut std::collections::BTreeMap<String, String>) {
        match v {
            toml::Value::Table(t) => {
                for (k, v) in t {
                    let key = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
                    flatten(&key, v, out);
                }
            }
            other => {
                out.insert(prefix.to_string(), other.to_string());
            }
        }
    }
    let parse = |s: &str| {
        let mut out = std::collections::BTreeMap::new();
        if let Ok(v) = toml::from_str::<toml::Value>(s) {
            flatten("", &v, &mut out);
        }
        out
    };
    let (a, b) = (parse(a), parse(b));
    let mut keys: Vec<String> = a.keys().chain(b.keys()).filter(|k| a.get(*k) != b.get(*k)).cloned().collect();
    keys.sort();
    keys.dedup();
    keys
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ov(s: &str) -> Override {
        s.parse().unwrap()
    }

    fn load_str(text: &str, overrides: &[Override]) -> Result<Config, ConfigError> {
        // Every test config needs data; the synthetic corpus is the one that needs no file.
        let text = format!("[data.synthetic]\n{text}");
        let c = Config::from_toml_str("test.toml", &text, overrides)?;
        c.validate().map_err(|problems| ConfigError { source_name: "test.toml".into(), problems })?;
        Ok(c)
    }

    #[test]
    fn embedded_default_is_valid() {
        let c = Config::load(None, &[]).unwrap();
        assert_eq!(c.run.device, DeviceSpec::Cpu);
    }

    #[test]
    fn defaults_are_the_mlperf_reference_hyperparameters() {
        // Values from the benchmark's rules and reference hyper-parameters, typed in independently.
        let c = Config::default();
        assert_eq!((c.lora.rank, c.lora.alpha, c.lora.dropout), (16, 32.0, 0.1));
        assert_eq!((c.optim.lr, c.optim.betas, c.optim.eps), (4e-4, [0.9, 0.999], 1e-8));
        assert_eq!((c.optim.weight_decay, c.optim.clip_grad_norm), (1e-4, 0.3));
        assert_eq!((c.schedule.max_steps, c.schedule.warmup_steps), (1024, 0));
        assert_eq!((c.train.global_batch_size, c.train.micro_batch_size), (8, 1));
        assert_eq!((c.eval.every_samples, c.eval.target_loss), (384, 0.925));
    }

    #[test]
    fn mlperf_eval_cadence() {
        let mut c = Config::default();
        // GBS 8: skip floor(1 + 2) = 3 evaluations, so the first is at 4 × 384 = 1536 samples.
        assert_eq!(c.eval_skip_first(), 3);
        assert_eq!(c.eval_interval_samples(), 384);
        c.train.global_batch_size = 7;
        // 384 is not a multiple of 7: round up to 385; skip floor(0.875 + 2) = 2.
        assert_eq!(c.eval_interval_samples(), 385);
        assert_eq!(c.eval_skip_first(), 2);
        c.train.global_batch_size = 32;
        assert_eq!(c.eval_skip_first(), 6);
    }

    #[test]
    fn unknown_key_is_named() {
        let err = load_str("[optim]\nlr = 1e-3\nlearning_rate = 2\n", &[]).unwrap_err().to_string();
        assert!(err.contains("`optim.learning_rate`"), "{err}");
        assert!(err.contains("expected one of"), "{err}");
        let err = load_str("[optimizer]\nlr = 1\n", &[]).unwrap_err().to_string();
        assert!(err.contains("`optimizer`"), "{err}");
    }

    #[test]
    fn wrong_type_names_key_and_value() {
        let err = load_str("[model]\npreset = \"tiny\"\n[lora]\nrank = \"sixteen\"\n", &[]).unwrap_err().to_string();
        assert!(err.contains("`lora.rank`") && err.contains("sixteen"), "{err}");
    }

    #[test]
    fn out_of_range_lists_every_problem() {
        let err = load_str("[model]\npreset = \"tiny\"\n[lora]\ndropout = 1.5\n[optim]\nlr = -1.0\n", &[]).unwrap_err();
        assert_eq!(err.problems.len(), 2, "{err}");
        let s = err.to_string();
        assert!(s.contains("`lora.dropout` = 1.5: must be in [0, 1)"), "{s}");
        assert!(s.contains("`optim.lr` = -1.0"), "{s}");
    }

    #[test]
    fn overrides_apply_and_are_typed() {
        let c = load_str(
            "[model]\npreset = \"tiny\"\n",
            &[ov("optim.lr=1e-3"), ov("run.device=cuda:1"), ov("lora.targets=q_proj,v_proj"), ov("eval.skip_first=0")],
        )
        .unwrap();
        assert_eq!(c.optim.lr, 1e-3);
        assert_eq!(c.run.device, DeviceSpec::Cuda(1));
        assert_eq!(c.lora.targets, ["q_proj", "v_proj"]);
        assert_eq!(c.eval.skip_first, Some(0));
        let err = load_str("[model]\npreset = \"tiny\"\n", &[ov("optim.lr=fast")]).unwrap_err().to_string();
        assert!(err.contains("`optim.lr` (from --set)") && err.contains("fast"), "{err}");
        let err = load_str("[model]\npreset = \"tiny\"\n", &[ov("optim.lr.x=1")]).unwrap_err().to_string();
        // `optim.lr` is absent from the file, so the override makes it a section: a type error.
        assert!(err.contains("`optim.lr` (from --set)") && err.contains("expected f64"), "{err}");
        let err = load_str("[optim]\nlr = 1.0\n", &[ov("optim.lr.x=1")]).unwrap_err().to_string();
        assert!(err.contains("`optim.lr` is a value"), "{err}");
        let err = load_str("", &[ov("run.device=tpu")]).unwrap_err().to_string();
        assert!(err.contains("`run.device`") && err.contains("tpu"), "{err}");
    }

    /// A list whose strings the shell unquoted, and an integer past i64, are refused naming
    /// the fix, where taken as strings they were split into wrong module
    /// names or reported as "invalid type: string"; quoted lists and bare words still work.
    #[test]
    fn overrides_that_are_no_words_say_how_to_write_them() {
        let err = "lora.targets=[q_proj,v_proj]".parse::<Override>().unwrap_err();
        assert!(err.contains(r#"--set 'lora.targets=["q_proj", "v_proj"]'"#) && err.contains("shell"), "{err}");
        let err = "data.synthetic={topics=3".parse::<Override>().unwrap_err();
        assert!(err.contains("not a TOML list or table"), "{err}");
        let err = "train.micro_batch_size=99999999999999999999".parse::<Override>().unwrap_err();
        assert!(err.contains("out of range for an integer") && err.contains("9223372036854775807"), "{err}");
        let c = load_str(
            "[model]\npreset = \"tiny\"\n",
            &[ov(r#"lora.targets=["q_proj", "v_proj"]"#), ov("run.dir=runs/x")],
        );
        let c = c.unwrap();
        assert_eq!((c.lora.targets.len(), c.run.dir.to_str()), (2, Some("runs/x")));
    }

    #[test]
    fn batch_geometry_must_divide() {
        let err = load_str("[model]\npreset = \"tiny\"\n[train]\nglobal_batch_size = 6\nmicro_batch_size = 4\n", &[])
            .unwrap_err()
            .to_string();
        assert!(err.contains("`train.global_batch_size` = 6"), "{err}");
    }

    /// Strings that mean enums are serde enums: a wrong one is refused by name, with the choices.
    #[test]
    fn enum_keys_refuse_unknown_values() {
        let err = load_str("[model]\npreset = \"tiny\"\n", &[ov("precision.compute=fp16")]).unwrap_err().to_string();
        assert!(
            err.contains("`precision.compute` (from --set)") && err.contains("fp16") && err.contains("fp8"),
            "{err}"
        );
        let err = load_str("[model]\npreset = \"tiny\"\n[eval]\naveraging = \"mean\"\n", &[]).unwrap_err().to_string();
        assert!(err.contains("`eval.averaging`") && err.contains("per_sample"), "{err}");
        let c = load_str("[model]\npreset = \"tiny\"\n", &[ov("data.padding=max_length"), ov("model.trainable=all")])
            .unwrap();
        assert_eq!((c.data.padding, c.model.trainable), (PadTo::MaxLength, Trainable::All));
    }

    #[test]
    fn override_syntax_errors() {
        assert!("optim.lr".parse::<Override>().is_err());
        assert!("=3".parse::<Override>().is_err());
        assert!("optim..lr=3".parse::<Override>().is_err());
        assert_eq!(ov("run.dir=runs/x").value, toml::Value::String("runs/x".into()));
        assert_eq!(ov("run.dir=\"a b\"").value, toml::Value::String("a b".into()));
    }

    #[test]
    fn show_round_trips() {
        let c = Config::load(None, &[ov("optim.lr=0.01")]).unwrap();
        let again = Config::from_toml_str("shown", &c.to_toml(), &[]).unwrap();
        assert_eq!(c, again);
    }

    /// `lora.rank_pattern`, `alpha_pattern`, `layers_to_transform` reach the adapters' spec; a key that is no regular expression and a rank of 0 are refused, named.
    #[test]
    fn lora_patterns_reach_the_spec_and_bad_ones_are_named() {
        let ov = |s: &str| s.parse::<Override>().unwrap();
        let c = Config::load(
            None,
            &[
                ov(r#"lora.rank_pattern={"q_proj"=4}"#),
                ov(r#"lora.alpha_pattern={"o_proj"=8.0}"#),
                ov("lora.layers_to_transform=[0]"),
            ],
        )
        .unwrap();
        let spec = c.lora.clone();
        assert_eq!(spec.module_spec("model.layers.0.self_attn.q_proj").unwrap().rank, 4);
        assert_eq!(spec.module_spec("model.layers.0.self_attn.o_proj").unwrap().alpha, 8.0);
        assert!(spec.adapts("model.layers.0.self_attn.q_proj") && !spec.adapts("model.layers.1.self_attn.q_proj"));
        let err = Config::load(None, &[ov(r#"lora.rank_pattern={"(q"=4, "k_proj"=0}"#)]).unwrap_err().to_string();
        assert!(
            err.contains("lora.rank_pattern") && err.contains("(q") && err.contains("lora.rank_pattern.k_proj"),
            "{err}"
        );
    }

    /// `model.quantize = "nf4"` reaches the model's precision (QLoRA's defaults: blocks of 64,
    /// double quantisation), and is refused with FP8 compute, full fine-tuning or a block size
    /// bitsandbytes lacks, each naming the key.
    #[test]
    fn nf4_settings_reach_the_model_or_are_refused() {
        let ov = |s: &str| s.parse::<Override>().unwrap();
        let c = Config::load(None, &[ov("model.quantize=\"nf4\""), ov("model.preset=\"tiny\"")]).unwrap();
        assert_eq!(c.precision_spec().nf4, Some(llora_model::precision::Nf4Spec { block: 64, double: true }));
        assert_eq!(Config::load(None, &[]).unwrap().precision_spec().nf4, None);
        // Each names the key to change, with its value as the config spells it (not `Nf4`).
        for (extra, named) in [
            ("precision.compute=\"fp8\"", "`precision.compute` = \"fp8\""),
            ("model.trainable=\"all\"", "`model.trainable` = \"all\""),
            ("model.quant_block_size=48", "`model.quant_block_size` = 48"),
            ("model.quant_block_size=0", "`model.quant_block_size` = 0"),
        ] {
            let err = Config::load(None, &[ov("model.quantize=\"nf4\""), ov(extra)]).unwrap_err().to_string();
            assert!(err.contains(named) && err.contains("nf4") && !err.contains("Nf4"), "{extra}: {err}");
        }
    }

    /// Keys nothing would read are refused naming key, value and what they need: the amax
    /// keys outside FP8 compute (with fp8_activations too: current scaling), adapter_compute
    /// under full fine-tuning; the same values where they act are taken.
    #[test]
    fn values_nothing_reads_are_refused() {
        let ov = |s: &str| s.parse::<Override>().unwrap();
        let amax = [
            ("precision.amax_history_len=16", "`precision.amax_history_len` = 16"),
            ("precision.amax_compute_algo=\"most_recent\"", "`precision.amax_compute_algo` = \"most_recent\""),
            ("precision.amax_margin=2", "`precision.amax_margin` = 2"),
        ];
        for (set, named) in amax {
            for compute in ["fp32", "bf16"] {
                let sets =
                    [ov(&format!("precision.compute=\"{compute}\"")), ov("precision.fp8_activations=true"), ov(set)];
                let err = Config::load(None, &sets).unwrap_err().to_string();
                assert!(err.contains(named) && err.contains("precision.compute = \"fp8\""), "{set}: {err}");
            }
            let fp8 = Config::load(None, &[ov("precision.compute=\"fp8\""), ov(set)]).unwrap();
            assert_ne!(fp8.precision.amax, llora_model::fp8::AmaxSpec::default(), "{set} is taken under FP8");
        }
        let all = [ov("model.trainable=\"all\""), ov("precision.compute=\"bf16\"")];
        for (value, named) in [("bf16", "\"bf16\""), ("fp32", "\"fp32\"")] {
            let sets = [all[0].clone(), all[1].clone(), ov(&format!("precision.adapter_compute=\"{value}\""))];
            let err = Config::load(None, &sets).unwrap_err().to_string();
            assert!(
                err.contains(&format!("`precision.adapter_compute` = {named}")) && err.contains("model.trainable"),
                "{err}"
            );
            let lora = Config::load(None, &[all[1].clone(), sets[2].clone()]).unwrap();
            assert_ne!(lora.precision.adapter_compute, AdapterCompute::Auto);
        }
    }

    /// Full fine-tuning under context parallelism is refused at load (rank 1 panicked in its
    /// Preference tuning refuses by key what it does not compose with yet (each message names
    /// the way on), and a β that is not positive; the supervised objective is untouched.
    #[test]
    fn dpo_refuses_what_it_does_not_compose_with_by_key() {
        let ov = |s: &str| s.parse::<Override>().unwrap();
        let dpo = [ov("train.objective=\"dpo\""), ov("mlperf.check=false")];
        assert!(Config::load(None, &dpo).is_ok());
        for (set, key) in [
            ("train.context_parallel=2", "`train.context_parallel`"),
            ("train.recompute_layers=1", "`train.recompute_layers`"),
            ("train.shard_frozen_weights=true", "`train.shard_frozen_weights`"),
            ("data.packing=true", "`data.packing`"),
            ("model.trainable=\"all\"", "`model.trainable`"),
            ("mlperf.check=true", "`mlperf.check`"),
            ("dpo.beta=0", "`dpo.beta`"),
            ("dpo.sft_weight=-1", "`dpo.sft_weight`"),
        ] {
            let err = Config::load(None, &[dpo[0].clone(), dpo[1].clone(), ov(set)]).unwrap_err().to_string();
            assert!(err.contains(key), "{set}: {err}");
        }
        assert!(Config::load(None, &[ov("train.context_parallel=2")]).is_ok(), "the supervised objective is untouched");
        let err = Config::load(None, &[ov("dpo.beta=0.5")]).unwrap_err().to_string();
        assert!(err.contains("`dpo.beta`") && err.contains("only applies with train.objective"), "{err}");
        let objective = DpoConfig { sft_weight: 0.5, loss: DpoLoss::Ipo, ..DpoConfig::default() }.objective();
        use llora_model::PreferenceLoss as L;
        assert_eq!(objective.losses, vec![(L::Ipo, 1.0), (L::Sft, 0.5)]);
    }

    /// Ranks sharing one GPU talk over Gloo: NCCL asked for with `dist.share_device` is refused by
    /// key (NCCL itself fails later with "duplicate GPU"); Gloo and `auto` are accepted.
    #[test]
    fn a_shared_gpu_refuses_nccl_by_key() {
        let ov = |s: &str| s.parse::<Override>().unwrap();
        let err =
            Config::load(None, &[ov("dist.share_device=true"), ov("dist.backend=\"nccl\"")]).unwrap_err().to_string();
        assert!(err.contains("`dist.backend` = \"nccl\"") && err.contains("dist.share_device = true"), "{err}");
        for backend in ["gloo", "auto"] {
            assert!(
                Config::load(None, &[ov("dist.share_device=true"), ov(&format!("dist.backend=\"{backend}\""))]).is_ok()
            );
        }
    }

    /// first step: "lm_head.weight got no gradient"), naming both keys.
    #[test]
    fn full_fine_tuning_under_context_parallelism_is_refused() {
        let ov = |s: &str| s.parse::<Override>().unwrap();
        let err = Config::load(None, &[ov("model.trainable=\"all\""), ov("train.context_parallel=2")])
            .unwrap_err()
            .to_string();
        assert!(err.contains("`model.trainable` = \"all\"") && err.contains("train.context_parallel"), "{err}");
        assert!(!err.contains("   "), "no run of spaces inside the message: {err}");
        assert!(Config::load(None, &[ov("model.trainable=\"all\"")]).is_ok());
        // What shapes adapters is refused where there are none, by key.
        for (set, key) in [
            ("lora.dora=true", "`lora.dora`"),
            ("lora.rslora=true", "`lora.rslora`"),
            ("lora.layers_to_transform=[0]", "`lora.layers_to_transform`"),
            (r#"lora.rank_pattern={"q_proj"=4}"#, "`lora.rank_pattern`"),
            (r#"lora.init_from="runs/x/adapter""#, "`lora.init_from`"),
        ] {
            let err = Config::load(None, &[ov("model.trainable=\"all\""), ov(set)]).unwrap_err().to_string();
            assert!(err.contains(key) && err.contains("full fine-tuning has no adapters"), "{set}: {err}");
        }
        assert!(Config::load(None, &[ov("train.context_parallel=2")]).is_ok());
    }

    /// An enum key given no word (a number, a bool, a list) is told its value and the words
    /// it takes, from --set and from a file ("invalid type: unit variant, expected string
    /// only" named neither).
    #[test]
    fn enum_keys_given_no_word_name_the_value_and_the_words() {
        let ov = |s: &str| s.parse::<Override>().unwrap();
        for (set, want) in [
            ("precision.compute=16", "`precision.compute` (from --set) = 16: expected one of `fp32`, `bf16`, `fp8`"),
            ("precision.adapter_compute=true", "= true: expected one of `auto`, `fp32`, `bf16`, in quotes"),
            ("data.padding=3", "`data.padding` (from --set) = 3: expected `longest` or `max_length`"),
        ] {
            let err = Config::load(None, &[ov(set)]).unwrap_err().to_string();
            assert!(err.contains(want) && !err.contains("unit variant"), "{set}: {err}");
        }
        let err = load_str("[model]\npreset = \"tiny\"\n[precision]\ncompute = [1]\n", &[]).unwrap_err().to_string();
        assert!(err.contains("`precision.compute` = [1]: expected one of"), "{err}");
    }

    /// `precision.fp8_weights_one_layout` reaches the model's precision with FP8 weights, and
    /// without them is refused naming both keys.
    #[test]
    fn one_layout_needs_fp8_weights() {
        let ov = |s: &str| s.parse::<Override>().unwrap();
        let fp8 = [ov("precision.compute=\"fp8\""), ov("precision.fp8_weights=true")];
        let c =
            Config::load(None, &[fp8[0].clone(), fp8[1].clone(), ov("precision.fp8_weights_one_layout=true")]).unwrap();
        assert!(c.precision_spec().fp8_weights_one_layout);
        assert!(!Config::load(None, &fp8).unwrap().precision_spec().fp8_weights_one_layout);
        let err = Config::load(None, &[ov("precision.fp8_weights_one_layout=true")]).unwrap_err().to_string();
        assert!(
            err.contains("precision.fp8_weights_one_layout") && err.contains("precision.fp8_weights = true"),
            "{err}"
        );
    }

    /// `lora.rslora` reaches the adapters: α/√r instead of α/r.
    #[test]
    fn rslora_sets_the_adapter_scale() {
        let plain = Config::load(None, &[]).unwrap().lora.clone();
        let ov = |s: &str| s.parse::<Override>().unwrap();
        let rs = Config::load(None, &[ov("lora.rslora=true"), ov("lora.rank=16"), ov("lora.alpha=32")])
            .unwrap()
            .lora
            .clone();
        assert_eq!((plain.rslora, rs.rslora), (false, true));
        assert_eq!(rs.scale(), 8.0);
        assert_eq!(plain.scale(), plain.alpha / plain.rank as f64);
    }

    #[test]
    fn differing_keys_are_listed() {
        let a = "[optim]\nlr = 1.0\n[run]\nseed = 1\n";
        let b = "[optim]\nlr = 2.0\n[run]\nseed = 1\nthreads = 1\n";
        assert_eq!(differing_keys(a, b), ["optim.lr", "run.threads"]);
        assert!(differing_keys(a, a).is_empty());
    }
}
