//! The `llora` command line: one subcommand per job, configs with `--set` overrides.

use std::path::PathBuf;

use clap::{Args, Parser, Subcommand, ValueEnum};

use crate::config::Override;

/// llora: LoRA fine-tuning for Llama-architecture models (Burn + LibTorch), MLPerf-style.
#[derive(Debug, Parser)]
#[command(name = "llora", version, propagate_version = true)]
pub struct Cli {
    /// Log line format on stderr; `RUST_LOG` sets the level (default `info`).
    #[arg(long, value_enum, default_value_t = LogFormat::Pretty, global = true)]
    pub log_format: LogFormat,
    /// The job to run.
    #[command(subcommand)]
    pub command: Command,
}

/// How tracing events are printed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum LogFormat {
    /// Human-readable lines.
    Pretty,
    /// One JSON object per line, for log collectors.
    Json,
}

/// `llora` subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Fine-tune with LoRA until the eval loss reaches the target (or max_steps).
    Train(TrainArgs),
    /// Evaluation loss of a model (+ adapter) on a dataset, printed last as one JSON line.
    Eval(EvalArgs),
    /// Data tools: synthesise, prepare, inspect.
    Data {
        /// What to do.
        #[command(subcommand)]
        command: DataCommand,
    },
    /// MLPerf tools: repeated seeded runs and scoring.
    Mlperf {
        /// What to do.
        #[command(subcommand)]
        command: MlperfCommand,
    },
    /// Export base + adapters merged as an HF checkpoint (`--merged`).
    Export(ExportArgs),
    /// Continue a prompt, or answer a conversation, with a model (+ adapter): KV-cached
    /// decoding, greedy unless `--temperature`; the text streams to stdout.
    Generate(GenerateArgs),
    /// Time LoRA training steps of a preset on random tokens (the peer benchmark's recipe and
    /// JSON fields); prints one JSON line last.
    Bench(BenchArgs),
    /// The memory one rank needs for a config, before anything is allocated, and the cheapest
    /// recipe that fits a device (`--device-memory`).
    Plan(PlanArgs),
    /// Check the kernels and collectives training depends on, on one device, against plain
    /// references (what scripts/gpu-check.sh runs); prints one JSON line last.
    Selftest(SelftestArgs),
    /// Draw the loss curves of several runs on one SVG plot and print each run's samples to
    /// the target (e.g. fp32 against fp8).
    Plot(PlotArgs),
    /// Inspect configurations.
    Config {
        /// What to do with the config.
        #[command(subcommand)]
        command: ConfigCommand,
    },
}

/// `llora selftest`.
#[derive(Debug, Args)]
pub struct SelftestArgs {
    /// `cpu`, `cuda:N`, or `cuda` (the launcher's local rank).
    #[arg(long, default_value = "cpu")]
    pub device: llora_model::device::DeviceSpec,
    /// Intra-op threads (0 = one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Run one group of checks: `gemm`, `attention`, `norm` or `optimizer` (CUDA only),
    /// `dropout` or `all-reduce`.
    #[arg(long, value_parser = ["gemm", "attention", "norm", "rope", "optimizer", "dropout", "all-reduce"])]
    pub only: Option<String>,
}

/// A config file plus overrides, shared by every subcommand that takes a config.
#[derive(Debug, Clone, Args)]
pub struct ConfigArgs {
    /// TOML config file; the embedded `configs/tiny-cpu.toml` when omitted.
    pub config: Option<PathBuf>,
    /// Override one config key, e.g. `--set optim.lr=1e-4` (repeatable, applied in order).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub overrides: Vec<Override>,
}

/// `llora train`.
#[derive(Debug, Args)]
pub struct TrainArgs {
    /// The run's configuration.
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Continue the interrupted run in this run directory from its checkpoint (`resume/`),
    /// with the config saved there (`--set` still applies; a config file may not be given).
    #[arg(long, value_name = "RUN_DIR", conflicts_with = "config")]
    pub resume: Option<PathBuf>,
    /// Replace the earlier run in `run.dir` instead of writing beside it (`run.dir-2`, ...):
    /// its outputs are kept aside until this run saves its first checkpoint or its results,
    /// and put back if it fails before.
    #[arg(long, conflicts_with = "resume")]
    pub overwrite: bool,
}

/// `llora eval`.
#[derive(Debug, Args)]
pub struct EvalArgs {
    /// HF checkpoint directory (config.json + safetensors).
    #[arg(long)]
    pub model: PathBuf,
    /// PEFT adapter directory (adapter_config.json + adapter_model.safetensors).
    #[arg(long)]
    pub adapter: Option<PathBuf>,
    /// MLPerf-schema parquet file (`input_ids`, `labels`).
    #[arg(long)]
    pub data: PathBuf,
    /// Rows longer than this are bad rows: the model's `max_position_embeddings` unless set; a
    /// larger value is refused (positions past it were never trained; train and generate
    /// refuse them too).
    #[arg(long)]
    pub max_seq_len: Option<usize>,
    /// Sequences (rows, with `--pack`) per forward pass.
    #[arg(long, default_value_t = 1)]
    pub batch_size: usize,
    /// Pack whole samples into rows of `--max-seq-len` tokens, each attending only to itself
    /// (`data.packing`); the loss is each sample's own, as unpacked.
    #[arg(long)]
    pub pack: bool,
    /// Samples packed together with `--pack` (`data.pack_window`; its default unless set).
    #[arg(long)]
    pub pack_window: Option<usize>,
    /// `cpu`, `cuda:N` or `flex`.
    #[arg(long, default_value = "cpu")]
    pub device: llora_model::device::DeviceSpec,
    /// Intra-op threads (0 = one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Skip bad rows (counted) instead of failing on the first.
    #[arg(long)]
    pub skip_bad_rows: bool,
    /// Threads preparing evaluation batches (0 = on the evaluating thread).
    #[arg(long, default_value_t = 1)]
    pub workers: usize,
    /// Compute as training in this precision does (`fp32`, `bf16`, `fp8`); FP8 scales come
    /// from each tensor's own amax (a PEFT adapter carries no delayed-scaling history).
    #[arg(long, default_value = "fp32", value_parser = parse_compute)]
    pub precision: llora_model::precision::Compute,
    /// The frozen base's storage (`--quantize nf4`: QLoRA).
    #[command(flatten)]
    pub quantize: QuantizeArgs,
    /// Keep frozen base weights as FP8 + scale (needs `--precision fp8`).
    #[arg(long)]
    pub fp8_weights: bool,
    /// Preference pairs instead (`llora data prepare --format preference`): DPO with this β
    /// (`dpo.beta`, 0.1 unless set); prints TRL's metrics, means over the pairs, the reference
    /// being the base with the adapter off. Any `--dpo-*` flag selects it.
    #[arg(long)]
    pub dpo_beta: Option<f64>,
    /// The preference loss (`dpo.loss`; sigmoid unless set).
    #[arg(long, value_enum)]
    pub dpo_loss: Option<crate::config::DpoLoss>,
    /// The chosen completions' NLL added with this weight (`dpo.sft_weight`; 0 unless set).
    #[arg(long)]
    pub dpo_sft_weight: Option<f64>,
}

impl EvalArgs {
    /// The preference objective the `--dpo-*` flags ask for, or `None` for the
    /// language-model loss.
    pub fn dpo(&self) -> Option<crate::config::DpoConfig> {
        let asked = self.dpo_beta.is_some() || self.dpo_loss.is_some() || self.dpo_sft_weight.is_some();
        let d = crate::config::DpoConfig::default();
        asked.then(|| crate::config::DpoConfig {
            beta: self.dpo_beta.unwrap_or(d.beta),
            loss: self.dpo_loss.unwrap_or(d.loss),
            sft_weight: self.dpo_sft_weight.unwrap_or(d.sft_weight),
            ..d
        })
    }
}

/// `llora data ...`.
#[derive(Debug, Subcommand)]
pub enum DataCommand {
    /// Write a synthetic GovReport-shaped corpus: raw text (jsonl), MLPerf parquet, tokenizer.json.
    Synth(SynthArgs),
    /// Tokenise report/summary pairs (jsonl, parquet or Arrow with `input`/`output`) into the
    /// MLPerf parquet schema with the MLPerf template.
    Prepare(PrepareArgs),
    /// Rows, length histogram, target tokens and every bad row of a parquet/Arrow file; exits
    /// non-zero when any row is bad.
    Inspect(InspectArgs),
    /// Loader throughput: training batches with each worker count, evaluation passes with each
    /// eval-worker count; prints a table.
    Bench(DataBenchArgs),
    /// Tokenisation throughput of `data prepare` (MLPerf template, all cores) on a generated
    /// English-like GovReport-sized text corpus; prints a table.
    BenchTokenizer(TokenizerBenchArgs),
}

/// `llora data bench-tokenizer`.
#[derive(Debug, Args)]
pub struct TokenizerBenchArgs {
    /// The tokenizer.json (e.g. Llama 2's, from scripts/llama2-tokenizer.sh).
    #[arg(long)]
    pub tokenizer: PathBuf,
    /// Reports (GovReport's train split has ~17.5k).
    #[arg(long, default_value_t = 17_000)]
    pub docs: usize,
    /// Words per report (GovReport's mean is ~9k).
    #[arg(long, default_value_t = 9_000)]
    pub words: usize,
    /// Words per summary (GovReport's mean is ~550).
    #[arg(long, default_value_t = 550)]
    pub summary_words: usize,
}

/// `llora data bench`.
#[derive(Debug, Args)]
pub struct DataBenchArgs {
    /// Training file (parquet or Arrow IPC, MLPerf schema).
    #[arg(long)]
    pub train: PathBuf,
    /// Evaluation file.
    #[arg(long)]
    pub eval: PathBuf,
    /// Training worker counts to time.
    #[arg(long, value_delimiter = ',', default_value = "0,1,2,4")]
    pub workers: Vec<usize>,
    /// Evaluation worker counts to time.
    #[arg(long, value_delimiter = ',', default_value = "1,4")]
    pub eval_workers: Vec<usize>,
    /// Global batches drawn per training measurement.
    #[arg(long, default_value_t = 200)]
    pub steps: usize,
    /// Sequences per global batch (micro-batch 1).
    #[arg(long, default_value_t = 8)]
    pub global_batch: usize,
    /// Rows must be at most this long.
    #[arg(long, default_value_t = 8192)]
    pub max_seq_len: usize,
    /// Token ids must be below this.
    #[arg(long, default_value_t = 32000)]
    pub vocab: usize,
}

/// `llora data synth`.
#[derive(Debug, Args)]
pub struct SynthArgs {
    /// Output directory.
    #[arg(long)]
    pub out: PathBuf,
    /// Training samples.
    #[arg(long, default_value_t = 2048)]
    pub train: usize,
    /// Evaluation samples.
    #[arg(long, default_value_t = 173)]
    pub eval: usize,
    /// Longest sequence (reports take a log-uniform share of it).
    #[arg(long, default_value_t = 8192)]
    pub max_seq_len: usize,
    /// Vocabulary size.
    #[arg(long, default_value_t = 32000)]
    pub vocab: usize,
    /// Topics (each with its own word distribution and abstract).
    #[arg(long, default_value_t = 8)]
    pub topics: usize,
    /// Seed.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Write the corpus as Llama-3-style conversations instead (`messages` rows, a tokenizer
    /// with Llama 3's special tokens and chat template) for `llora data prepare --format chat`.
    #[arg(long)]
    pub chat: bool,
    /// Replace an existing `--out` (swapped in once the new one is complete).
    #[arg(long)]
    pub overwrite: bool,
}

/// `llora data prepare`.
#[derive(Debug, Args)]
pub struct PrepareArgs {
    /// Raw rows: `.jsonl`, parquet or Arrow IPC; the columns depend on `--format`.
    #[arg(long)]
    pub input: PathBuf,
    /// HF `tokenizer.json`, or an HF tokenizer directory (`--format chat` needs its
    /// `tokenizer_config.json`, which holds the chat template).
    #[arg(long)]
    pub tokenizer: PathBuf,
    /// What the rows hold: `mlperf` (SCROLLS `input`/`output`, the benchmark's template),
    /// `chat` (`messages`: [{role, content}], rendered with the tokenizer's chat template, loss
    /// on assistant turns), `completion` (`prompt`/`completion`, loss on the completion) or
    /// `preference` (`prompt`/`chosen`/`rejected`, text or messages, as TRL's DPOTrainer
    /// tokenises them; written as pairs for `train.objective = "dpo"`).
    #[arg(long, value_enum, default_value_t = DataFormat::Mlperf)]
    pub format: DataFormat,
    /// Skip (and count) rows that cannot be used (`chat`/`completion`) instead of stopping at
    /// the first one.
    #[arg(long)]
    pub skip_bad_rows: bool,
    /// Output parquet.
    #[arg(long)]
    pub out: PathBuf,
    /// Longer samples are dropped and counted.
    #[arg(long, default_value_t = 8192)]
    pub max_seq_len: usize,
    /// Replace an existing `--out` (swapped in once the new one is complete).
    #[arg(long)]
    pub overwrite: bool,
}

/// `llora generate`.
#[derive(Debug, Args)]
pub struct GenerateArgs {
    /// Base HF checkpoint directory.
    #[arg(long)]
    pub model: PathBuf,
    /// PEFT adapter directory (a run's `adapter/`).
    #[arg(long)]
    pub adapter: Option<PathBuf>,
    /// `tokenizer.json` or an HF tokenizer directory (`--chat` needs its chat template).
    #[arg(long)]
    pub tokenizer: PathBuf,
    /// Text to continue (the tokenizer adds its beginning-of-text token).
    #[arg(long, conflicts_with = "chat", required_unless_present = "chat")]
    pub prompt: Option<String>,
    /// A conversation to answer: a JSON list of `{"role", "content"}`, rendered with the chat
    /// template and its generation prompt.
    #[arg(long)]
    pub chat: Option<PathBuf>,
    /// At most this many new tokens (fewer when an end-of-turn / end-of-text token comes).
    #[arg(long, default_value_t = 256)]
    pub max_new_tokens: usize,
    /// Sampling temperature; 0 is greedy (the most likely token each step).
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// Nucleus sampling: draw from the most likely tokens holding this much probability.
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f64,
    /// Seed of the sampling stream.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Print one JSON object (ids, text, timings) instead of streaming the text.
    #[arg(long)]
    pub json: bool,
    /// Compute as training in this precision does: `fp32`, or `bf16` (bf16 weights,
    /// activations and key/value cache; f32 norm statistics, RoPE tables, softmax and adapters,
    /// as transformers + PEFT run a bf16 model), or `fp8`.
    #[arg(long, default_value = "fp32", value_parser = parse_compute)]
    pub precision: llora_model::precision::Compute,
    /// The frozen base's storage (`--quantize nf4`: QLoRA).
    #[command(flatten)]
    pub quantize: QuantizeArgs,
    /// `cpu` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    pub device: llora_model::device::DeviceSpec,
    /// Intra-op threads (0 = one per core).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
}

/// `llora data prepare --format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DataFormat {
    /// SCROLLS GovReport `input`/`output` with the MLPerf template.
    Mlperf,
    /// Conversations (`messages`) through the tokenizer's chat template.
    Chat,
    /// `prompt`/`completion` pairs.
    Completion,
    /// Preference pairs `prompt`/`chosen`/`rejected` (text, or lists of messages through the
    /// chat template), tokenised as TRL's `DPOTrainer` does, for `train.objective = "dpo"`.
    Preference,
}

/// `llora data inspect`.
#[derive(Debug, Args)]
pub struct InspectArgs {
    /// Parquet or Arrow IPC file in the MLPerf schema.
    pub file: PathBuf,
    /// Token ids must be below this.
    #[arg(long, default_value_t = 32000)]
    pub vocab: usize,
    /// Rows must be at most this long; also the row length of the packing report.
    #[arg(long, default_value_t = 8192)]
    pub max_seq_len: usize,
    /// Samples packed together in the packing report (`data.pack_window`).
    #[arg(long, default_value_t = llora_data::packing::DEFAULT_WINDOW)]
    pub pack_window: usize,
}

/// `llora mlperf ...`.
#[derive(Debug, Subcommand)]
pub enum MlperfCommand {
    /// Run the config N times with seeds `run.seed`, `run.seed + 1`, ...; logs go to
    /// `OUT/result_<i>.txt` (run directories `OUT/run_<i>`), then the set is scored.
    Run(MlperfRunArgs),
    /// Score a results directory: olympic mean of run_stop − run_start over the
    /// `result_<n>.txt` files (× `scaling.json`), with a per-run table; last line JSON.
    Score {
        /// Directory with `result_<n>.txt` (and optionally `scaling.json`).
        dir: PathBuf,
    },
    /// Run the official MLPerf Training compliance checker (mlperf-logging 4.1.68) on one
    /// result log; exit 0 only when it reports SUCCESS. Installs the checker on first use.
    Check {
        /// The result log (`:::MLLOG` lines).
        log: PathBuf,
        /// The training ruleset to check against.
        #[arg(long, default_value = crate::compliance::DEFAULT_RULESET)]
        ruleset: String,
    },
}

/// `llora mlperf run`.
#[derive(Debug, Args)]
pub struct MlperfRunArgs {
    /// The run's configuration.
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Number of runs (MLPerf: 10; the score's olympic mean needs at least 3).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(3..))]
    pub runs: u32,
    /// Results directory.
    #[arg(long)]
    pub out: PathBuf,
}

/// `llora plan`.
#[derive(Debug, Args)]
pub struct PlanArgs {
    /// The config and overrides.
    #[command(flatten)]
    pub config: ConfigArgs,
    /// Data-parallel ranks (default: the launcher's WORLD_SIZE, else 1).
    #[arg(long)]
    pub world: Option<usize>,
    /// Memory of one device (or of the host for `run.device = "cpu"`) with its unit, e.g.
    /// `80GiB`, `141GB` (a number without a unit is refused). With it, `llora plan` exits 3
    /// when the config does not fit (0 when it does, 1 on an error).
    #[arg(long, value_parser = parse_bytes)]
    pub device_memory: Option<f64>,
    /// Print one JSON object instead of the tables.
    #[arg(long)]
    pub json: bool,
}

/// Bytes from `80GiB`, `141GB`, `512MiB`, `2.5TiB` or `1000000B`: a bare number is refused
/// (80 could mean bytes or GiB; the unit says which).
pub fn parse_bytes(s: &str) -> Result<f64, String> {
    let t = s.trim();
    let split = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num.trim().parse().map_err(|_| format!("{s:?} is not a size like 80GiB or 141GB"))?;
    let scale = match unit.trim() {
        "" => return Err(format!("{s:?} has no unit: write 80GiB, 141GB or a number of bytes with B")),
        "B" => 1.0,
        "KB" => 1e3,
        "MB" => 1e6,
        "GB" => 1e9,
        "TB" => 1e12,
        "K" | "KiB" => 1024.0,
        "M" | "MiB" => 1024f64.powi(2),
        "G" | "GiB" => 1024f64.powi(3),
        "T" | "TiB" => 1024f64.powi(4),
        u => return Err(format!("unknown unit {u:?} in {s:?}: use B, KB, MB, GB, TB, KiB, MiB, GiB or TiB")),
    };
    if !(n > 0.0 && n.is_finite()) {
        return Err(format!("{s:?}: the size must be positive"));
    }
    Ok(n * scale)
}

/// A finite number (not NaN or an infinity).
pub fn parse_finite(s: &str) -> Result<f64, String> {
    s.trim().parse::<f64>().ok().filter(|x| x.is_finite()).ok_or_else(|| format!("{s:?} is not a finite number"))
}

/// `llora bench`: a [`crate::config::Config`] as training reads it, whose defaults are the
/// peer's recipe (`scripts/peer/step_bench.py`); the flags below `--trace` set config keys.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Micro-batches of `--batch` per rank and step (gradient accumulation). Under a launcher
    /// (torchrun) every rank runs them and the gradients are all-reduced: world / cp × accum ×
    /// batch sequences per step.
    #[arg(long, default_value_t = 1)]
    pub accum: usize,
    /// Instead of training steps, time an all-reduce (sum) of this many f32 values over the
    /// launcher's ranks, `--steps` times after `--warmup` (the 70B's LoRA gradients: 44.6 M).
    #[arg(long, default_value_t = 0)]
    pub allreduce_values: usize,
    /// Instead of training steps, load this HF checkpoint directory in `--precision` (and
    /// `--fp8-weights`) and report the peak RSS of loading against its bound: the runtime's
    /// RSS before loading + the weights as stored + the largest tensor in f32.
    #[arg(long)]
    pub load: Option<PathBuf>,
    /// Timed steps.
    #[arg(long, default_value_t = 10)]
    pub steps: usize,
    /// Untimed warm-up steps.
    #[arg(long, default_value_t = 2)]
    pub warmup: usize,
    /// Also append the JSON line to this file.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Free-form label copied into the JSON.
    #[arg(long)]
    pub tag: Option<String>,
    /// Writes a Chrome/Perfetto trace (LibTorch's Kineto profiler: CPU ops, and CUDA kernels on
    /// a GPU) of one extra training step after the timed ones, to this file (with several
    /// ranks, each its own: `NAME.rankR.EXT` beside it).
    #[arg(long)]
    pub trace: Option<PathBuf>,
    /// The flags that spell config keys (`crate::commands::bench::settings::FLAGS`).
    #[command(flatten)]
    pub keys: crate::commands::bench::settings::KeyFlags,
    /// The frozen base's storage (`--quantize nf4`: QLoRA).
    #[command(flatten)]
    pub quantize: QuantizeArgs,
    /// Any other config key, e.g. `--set precision.amax_history_len=16` (repeatable; after the
    /// flags).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<Override>,
}

/// `llora plot`.
#[derive(Debug, Args)]
pub struct PlotArgs {
    /// Run directories (each with its `metrics.jsonl`), optionally labelled `LABEL=DIR`.
    #[arg(required = true, value_name = "[LABEL=]RUN_DIR")]
    pub runs: Vec<String>,
    /// The SVG file to write.
    #[arg(long)]
    pub out: PathBuf,
    /// Target eval loss, drawn as a line.
    #[arg(long, default_value_t = 0.925, value_parser = parse_finite)]
    pub target: f64,
    /// Replace an existing `--out` file (without it, an existing file is refused).
    #[arg(long)]
    pub overwrite: bool,
}

/// `llora export`.
#[derive(Debug, Args)]
pub struct ExportArgs {
    /// Fold the adapters into the base weights (`W + (α/r)·B·A`) and write a plain HF
    /// checkpoint that transformers loads without PEFT. Required: it is the one export
    /// (adapters are already written in PEFT format by `llora train`).
    #[arg(long, required = true)]
    pub merged: bool,
    /// Base HF checkpoint directory.
    #[arg(long)]
    pub model: PathBuf,
    /// PEFT adapter directory.
    #[arg(long)]
    pub adapter: PathBuf,
    /// Output directory (created; must not hold a checkpoint already).
    #[arg(long)]
    pub out: PathBuf,
    /// The dtype of the merged weights: `f32`, `bf16` or `f16` (default: each tensor's own,
    /// the base checkpoint's).
    #[arg(long, value_parser = ["f32", "bf16", "f16"])]
    pub dtype: Option<String>,
}

/// `llora config ...`.
#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Print the fully resolved config (defaults, file and overrides) as TOML.
    Show(ConfigArgs),
}

/// `--precision`: the config's names (serde's), so the CLI and the TOML accept the same words.
fn parse_compute(s: &str) -> Result<llora_model::precision::Compute, String> {
    serde_json::from_value(serde_json::Value::String(s.to_string())).map_err(|e| e.to_string())
}

/// How the frozen base is stored, as `model.quantize` / `model.double_quant` set it in a config.
#[derive(Debug, Clone, Copy, Args)]
pub struct QuantizeArgs {
    /// `none`, or `nf4`: the frozen linear weights in 4-bit NormalFloat (QLoRA), quantised one
    /// tensor at a time as they load and dequantised for each GEMM (fp32 or bf16 compute).
    #[arg(long, default_value = "none", value_enum)]
    pub quantize: crate::config::Quantize,
    /// With `--quantize nf4`: quantise the block scales too (QLoRA's double quantisation;
    /// `true` unless set).
    #[arg(long, action = clap::ArgAction::Set)]
    pub double_quant: Option<bool>,
    /// With `--quantize nf4`: values per block scale, as the run's `model.quant_block_size` (64,
    /// QLoRA's and bitsandbytes', unless set): a base quantised with other blocks is another base.
    #[arg(long)]
    pub quant_block_size: Option<usize>,
}

impl QuantizeArgs {
    /// The NF4 storage asked for, if any; `--double-quant` and `--quant-block-size` without
    /// `--quantize nf4` are refused (they would be ignored).
    pub fn nf4(&self) -> anyhow::Result<Option<llora_model::precision::Nf4Spec>> {
        if self.quantize != crate::config::Quantize::Nf4 {
            anyhow::ensure!(
                self.double_quant.is_none() && self.quant_block_size.is_none(),
                "--double-quant and --quant-block-size only apply with --quantize nf4 (without it the base is \
                 not quantised): add --quantize nf4 or drop them"
            );
            return Ok(None);
        }
        let d = llora_model::precision::Nf4Spec::default();
        Ok(Some(llora_model::precision::Nf4Spec {
            block: self.quant_block_size.unwrap_or(d.block),
            double: self.double_quant.unwrap_or(d.double),
        }))
    }
}

impl QuantizeArgs {
    /// The config keys these flags set (`model.quantize`, `model.double_quant`,
    /// `model.quant_block_size`), after [`QuantizeArgs::nf4`]'s check.
    pub fn overrides(&self) -> anyhow::Result<Vec<Override>> {
        let Some(nf4) = self.nf4()? else { return Ok(Vec::new()) };
        let set = |key: &str, value: toml::Value| Override { key: key.to_string(), value };
        Ok(vec![
            set("model.quantize", toml::Value::String("nf4".into())),
            set("model.double_quant", toml::Value::Boolean(nf4.double)),
            set("model.quant_block_size", toml::Value::Integer(nf4.block as i64)),
        ])
    }
}
