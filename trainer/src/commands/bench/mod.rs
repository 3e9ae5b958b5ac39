//! `llora bench`: timed LoRA training steps of a preset on random tokens, with the recipe and
//! the JSON fields of the peer `scripts/peer/step_bench.py` (PyTorch + HF transformers + PEFT), so
//! that the two can be compared line by line (`scripts/bench-vs-peft.sh`).
//!
//! Recipe, as the peer's: random base, LoRA r 16 / α 32 / dropout 0.1 on q,k,v,o, AdamW
//! lr 4e-4 wd 1e-4 (torch defaults otherwise), global-norm clip 0.3, random token ids with the
//! first half of each sequence masked (-100), loss = mean over target tokens.

pub mod settings;

use std::path::{Path, PathBuf};
use std::time::Instant;

use burn::tensor::{Device, Int, Tensor, TensorData};
use llora_model::device::{DeviceSpec, HeapBytes};
use llora_model::fp8::gemm::take_gemm_counts;
use llora_model::{BuildOptions, LlamaConfig, LlamaForCausalLM};
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

use crate::cli::BenchArgs;
use crate::config::Config;
use crate::engine::observe::peak_rss_mb;
use crate::engine::optim::AdamW;
use crate::engine::step::{MicroBatch, StepOptions, train_step};

/// CPU seconds (user + system) of this process, from `/proc/self/stat` (USER_HZ = 100).
fn cpu_seconds() -> f64 {
    let Ok(stat) = std::fs::read_to_string("/proc/self/stat") else { return 0.0 };
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|x| x.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}

/// (busy, total) jiffies over all CPUs, to tell how much of the machine other processes used.
fn proc_stat() -> Option<(f64, f64)> {
    let text = std::fs::read_to_string("/proc/stat").ok()?;
    let v: Vec<f64> = text.lines().next()?.split_whitespace().skip(1).filter_map(|x| x.parse().ok()).collect();
    let idle = v.get(3)? + v.get(4).copied().unwrap_or(0.0);
    let total: f64 = v.iter().sum();
    Some((total - idle, total))
}

fn loadavg() -> Option<Vec<f64>> {
    let text = std::fs::read_to_string("/proc/loadavg").ok()?;
    Some(text.split_whitespace().take(3).filter_map(|x| x.parse().ok()).collect())
}

/// Linear-interpolated quantile `p` of `xs`, as the peer computes it.
fn quantile(xs: &[f64], p: f64) -> f64 {
    let mut s = xs.to_vec();
    s.sort_by(f64::total_cmp);
    if s.len() == 1 {
        return s[0];
    }
    let pos = p * (s.len() - 1) as f64;
    let lo = pos.floor() as usize;
    let hi = (lo + 1).min(s.len() - 1);
    s[lo] + (s[hi] - s[lo]) * (pos - lo as f64)
}

/// Random ids uniform in `[0, vocab)`; labels = ids with the first half of each row -100.
///
/// # Shapes
/// - output: (input_ids, labels), each `[batch, seq]`
fn random_batch(
    rng: &mut impl Rng,
    batch: usize,
    seq: usize,
    vocab: usize,
    device: &Device,
) -> (Tensor<2, Int>, llora_model::Labels, usize) {
    let ids: Vec<i64> = (0..batch * seq).map(|_| rng.random_range(0..vocab as i64)).collect();
    let labels: Vec<i64> = ids.iter().enumerate().map(|(j, &t)| if j % seq < seq / 2 { -100 } else { t }).collect();
    // Position t predicts label t+1, so the last position of a row has no target.
    let targets = batch * (seq - seq / 2 - 1);
    (
        Tensor::from_data(TensorData::new(ids, [batch, seq]), device),
        llora_model::Labels::from_host(labels, [batch, seq], device),
        targets,
    )
}

/// What one bench runs: its own counts and outputs, and the run's config.
pub struct Bench<'a> {
    /// The command line (the bench's own counts and outputs).
    pub args: &'a BenchArgs,
    /// The peer's recipe with the flags' and `--set`'s keys ([`settings::config`]).
    pub config: Config,
}

impl Bench<'_> {
    /// Tokens per sequence (`data.max_seq_len`).
    fn seq_len(&self) -> usize {
        self.config.data.max_seq_len
    }

    /// Sequences per micro-batch (`train.micro_batch_size`).
    fn batch(&self) -> usize {
        self.config.train.micro_batch_size
    }

    /// Ranks sharing one sequence (`train.context_parallel`).
    fn cp(&self) -> usize {
        self.config.train.context_parallel
    }

    /// The device as `run.device` names it.
    fn device(&self) -> DeviceSpec {
        self.config.run.device
    }
}

/// Runs the benchmark on the launcher's ranks (one process without one) and returns the peer's
/// JSON record on rank 0 (None on the others).
pub fn run(args: &BenchArgs) -> anyhow::Result<Option<Value>> {
    let extra = [args.quantize.overrides()?, args.set.clone()].concat();
    let bench = Bench { args, config: settings::config(&args.keys, &extra, args.accum)? };
    validate(&bench)?;
    let config = &bench.config;
    let dist = crate::dist::init_with_context(&config.dist, bench.device().is_cuda(), bench.cp(), "--cp")?;
    let device = dist.device(bench.device())?;
    let record = match &args.load {
        Some(dir) => load(&bench, device, dir)?,
        None if args.allreduce_values > 0 => allreduce(&bench, &dist)?,
        None => train(&bench, device, &dist)?,
    };
    let main = dist.is_main();
    dist.shutdown()?;
    Ok(main.then_some(record))
}

/// Checks the bench's own counts, the preset's context length and which flags the chosen bench
/// reads (the config's keys were checked as training checks them).
fn validate(bench: &Bench) -> anyhow::Result<()> {
    let (args, config) = (bench.args, &bench.config);
    let flag = |key: &str| format!("`{key}`");
    let mut p = crate::config::Problems::new(&flag);
    for (name, value) in [("--accum", args.accum), ("--steps", args.steps)] {
        p.check(value >= 1, name, &value, "must be at least 1");
    }
    // --load and --allreduce-values replace the training steps: what only those read is refused.
    let load = args.load.is_some();
    let other_mode = if load { Some("--load") } else { (args.allreduce_values > 0).then_some("--allreduce-values") };
    if let Some(mode) = other_mode {
        let why = format!("times training steps; {mode} replaces them: drop one of the two");
        p.check(bench.cp() == 1, "--cp", &bench.cp(), &why);
    }
    let why = "--load times loading a checkpoint, --allreduce-values a collective: one bench at a time";
    p.check(!(load && args.allreduce_values > 0), "--allreduce-values", &args.allreduce_values, why);
    if let Some(Ok(c)) = config.model.preset.as_deref().map(LlamaConfig::preset) {
        let max = c.max_position_embeddings;
        let why = format!("must be at most the preset's {max} positions");
        p.check(bench.seq_len() <= max, "--seq-len", &bench.seq_len(), &why);
    }
    if let Some(trace) = &args.trace {
        p.check(!trace.exists(), "--trace", trace, "already exists: llora never writes over a file");
    }
    p.finish().map_err(|problems| anyhow::anyhow!("invalid llora bench flags:\n  - {}", problems.join("\n  - ")))
}

/// The largest [`llora_model::device::heap_bytes`] (in use, and allocator-resident) seen by a
/// thread sampling them every millisecond while the sampler lives: the memory tensors
/// occupied at the step's peak, and what the allocator held for them including freed memory
/// it keeps; the RSS high-water mark adds the runtime's libraries to the latter.
struct HeapPeak {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<HeapBytes>>,
}

impl HeapPeak {
    fn start() -> Self {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = stop.clone();
        let thread = std::thread::spawn(move || {
            let mut peak = HeapBytes::default();
            while !flag.load(std::sync::atomic::Ordering::Relaxed) {
                let now = llora_model::device::heap_bytes().unwrap_or_default();
                peak.in_use = peak.in_use.max(now.in_use);
                peak.resident = peak.resident.max(now.resident);
                std::thread::sleep(std::time::Duration::from_millis(1));
            }
            peak
        });
        Self { stop, thread: Some(thread) }
    }

    /// Stops sampling and returns the peaks in MB: (in use, allocator-resident).
    fn finish(mut self) -> (f64, f64) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        let peak = self.thread.take().and_then(|t| t.join().ok()).unwrap_or_default();
        let mb = |b: usize| b as f64 / (1 << 20) as f64;
        (mb(peak.in_use), mb(peak.resident))
    }
}

/// One decoder block's memory, measured with the allocator's in-use bytes: what its forward
/// keeps for backward, and its transient peaks (above what is held once its forward is done).
#[derive(Debug, Clone, Copy)]
struct BlockMemory {
    /// Bytes the forward leaves allocated besides its output: the tensors saved for backward.
    saved: usize,
    /// Peak in use during the forward, above what it leaves allocated.
    transient_fwd: usize,
    /// Peak in use during the backward, above what the forward left allocated.
    transient_bwd: usize,
}

/// Runs block 0 of `model` alone on a random `[batch, seq, d]` input in the activations'
/// dtype, forward with autodiff, then the backward of `sum(y · g)` for a random `g`, sampling
/// the heap as [`HeapPeak`] does. `None` for a sharded model (its blocks' weights exist only
/// while gathered) or where the allocator has no statistics.
fn block_memory(model: &LlamaForCausalLM, batch: usize, seq: usize, device: &Device) -> Option<BlockMemory> {
    use burn::tensor::{DType, Distribution};
    if model.is_sharded() {
        return None;
    }
    let layer = model.layers.first()?;
    let in_use = || llora_model::device::heap_bytes().map(|h| h.in_use);
    let d = model.config.hidden_size;
    // Under context parallelism the block runs this rank's share of the sequence.
    let local = model.context.as_ref().map_or(seq, |cp| cp.split(seq).local_len());
    let x = Tensor::<3>::random([batch, local, d], Distribution::Normal(0.0, 1.0), device)
        .cast(model.activations)
        .require_grad();
    let g = Tensor::<3>::random([batch, local, d], Distribution::Normal(0.0, 1.0), device);
    let at = model.positions([batch, seq], None, device).ok()?;
    let before = in_use()?;
    let peak = HeapPeak::start();
    let y = layer.forward(x, &at, true);
    let after_fwd = in_use()?;
    let fwd_peak = (peak.finish().0 * (1 << 20) as f64) as usize;
    let y_bytes = batch * local * d * y.dtype().size();
    let loss = (y.cast(DType::F32) * g).sum();
    let peak = HeapPeak::start();
    drop(loss.backward());
    let bwd_peak = (peak.finish().0 * (1 << 20) as f64) as usize;
    Some(BlockMemory {
        saved: after_fwd.saturating_sub(before + y_bytes),
        transient_fwd: fwd_peak.saturating_sub(after_fwd),
        transient_bwd: bwd_peak.saturating_sub(after_fwd),
    })
}

/// Resident set size of this process now, in MB (`VmRSS`).
fn rss_mb() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    Some(line.split_whitespace().nth(1)?.parse::<f64>().ok()? / 1024.0)
}

/// Loads a checkpoint in the asked precision and compares the peak RSS with the loading bound.
fn load(bench: &Bench, spec: DeviceSpec, dir: &std::path::Path) -> anyhow::Result<Value> {
    let threads = bench.config.run.threads;
    let device = spec.init(threads)?;
    // The runtime's own memory (LibTorch's libraries and allocator) before any weight.
    drop(Tensor::<1>::zeros([1], &device));
    let baseline = rss_mb().unwrap_or(0.0);
    let t = Instant::now();
    let ckpt = llora_model::checkpoint::HfCheckpoint::open(dir)?;
    let precision = bench.config.precision_spec();
    let model = ckpt.load_model(&BuildOptions { precision: Some(precision), ..Default::default() }, &device)?;
    let load_s = t.elapsed().as_secs_f64();
    let mb = |bytes: usize| bytes as f64 / (1 << 20) as f64;
    let stored = mb(model.base_weight_bytes());
    let largest = mb(ckpt.largest_tensor_elements() * 4);
    let peak = peak_rss_mb().unwrap_or(f64::NAN);
    let bound = baseline + stored + largest;
    let r1 = |x: f64| (x * 10.0).round() / 10.0;
    Ok(json!({
        "load": dir.display().to_string(), "dtype": precision.compute.name(), "fp8_weights": precision.fp8_weights,
        "checkpoint_mb": r1(mb(ckpt.file_bytes())), "parameters": model.config.num_parameters(),
        "baseline_rss_mb": r1(baseline), "stored_weights_mb": r1(stored), "largest_tensor_f32_mb": r1(largest),
        "bound_mb": r1(bound), "peak_rss_mb": r1(peak), "peak_over_bound": (peak / bound * 1000.0).round() / 1000.0,
        "load_s": (load_s * 100.0).round() / 100.0, "threads": bench.device().effective_threads(threads),
    }))
}

/// Median time of an f32 sum all-reduce of `--allreduce-values` values.
fn allreduce(bench: &Bench, dist: &crate::dist::Dist) -> anyhow::Result<Value> {
    let args = bench.args;
    let comm = dist.comm.as_ref();
    let mut buf = vec![1f32; args.allreduce_values];
    let mut times = Vec::new();
    for i in 0..args.warmup + args.steps {
        comm.barrier()?;
        let t = Instant::now();
        comm.all_reduce_f32(&mut buf, crate::dist::ReduceOp::Sum)?;
        if i >= args.warmup {
            times.push(t.elapsed().as_secs_f64());
        }
    }
    let med = quantile(&times, 0.5);
    let bytes = (args.allreduce_values * 4) as f64;
    Ok(json!({
        "allreduce_values": args.allreduce_values, "world": comm.world_size(), "backend": comm.backend(),
        "allreduce_s_median": (med * 1e4).round() / 1e4, "allreduce_s_min": (quantile(&times, 0.0) * 1e4).round() / 1e4,
        "allreduce_s_max": (quantile(&times, 1.0) * 1e4).round() / 1e4,
        // Bus bandwidth as nccl-tests defines it for all-reduce: bytes · 2(w−1)/w per second.
        "busbw_gb_per_s": (bytes * 2.0 * (comm.world_size() as f64 - 1.0) / comm.world_size() as f64 / med / 1e7).round() / 100.0,
        "threads": bench.device().effective_threads(bench.config.run.threads),
    }))
}

/// One training step of the bench on fresh random tokens. Every rank draws the whole global
/// batch from the same generator and trains its share, so any world size sees the same data.
/// On CUDA the phases are timed with the device waited for at each boundary.
fn bench_step(
    bench: &Bench,
    config: &LlamaConfig,
    dist: &crate::dist::Dist,
    model: &mut LlamaForCausalLM,
    optim: &mut AdamW,
    rng: &mut impl Rng,
    device: &Device,
) -> anyhow::Result<crate::engine::step::StepStats> {
    // Under context parallelism the ranks of a group train the same sequences.
    let (rank, world) = dist.data_share();
    let accum = bench.args.accum;
    let mut all: Vec<_> = (0..accum * world)
        .map(|_| random_batch(rng, bench.batch(), bench.seq_len(), config.vocab_size, device))
        .collect();
    let targets: usize = all.iter().map(|b| b.2).sum();
    let mine: Vec<MicroBatch> = all
        .drain(..)
        .skip(rank * accum)
        .take(accum)
        .map(|(ids, labels, _)| MicroBatch { ids, labels, packed: None, seed: None })
        .collect();
    let run = &bench.config;
    let opts = StepOptions {
        lr: run.optim.lr,
        clip_grad_norm: run.optim.clip_grad_norm,
        recompute_layers: run.train.recompute_layers,
        sync_phases: bench.device().is_cuda(),
        bucket_bytes: run.dist.bucket_bytes(),
    };
    train_step(model, optim, dist.comm.as_ref(), mine, targets, opts)
}

/// The bench's model, as built, and what building it took.
struct Built {
    config: LlamaConfig,
    precision: llora_model::precision::PrecisionSpec,
    model: LlamaForCausalLM,
    /// `llora plan`'s prediction for this run.
    plan: crate::plan::Budget,
    /// Base-weight bytes of one decoder layer as stored (f32, bf16 or FP8 + scale).
    weight_bytes: usize,
    build_s: f64,
    /// RSS before building and its high-water mark after, heap in use before and after (MiB).
    rss: (Option<f64>, Option<f64>),
    heap: (f64, f64),
}

/// Heap bytes in use, MiB (0 where jemalloc's statistics are not compiled in).
fn heap_mb() -> f64 {
    llora_model::device::heap_bytes().unwrap_or_default().in_use as f64 / (1 << 20) as f64
}

/// Builds the model as training does (`model.path` or `model.preset`, with `[lora]` and the
/// precision) on `device` (autodiff), and the plan's prediction for the bench's batches.
fn build(bench: &Bench, dist: &crate::dist::Dist, device: &Device) -> anyhow::Result<Built> {
    let run = &bench.config;
    let (rss_before, heap_before) = (rss_mb(), heap_mb());
    let t_build = Instant::now();
    let mut shape = crate::plan::shape_of(run, dist.world.size)?;
    let seq = bench.seq_len();
    // random_batch: the second half of each row, but its last position, has a target.
    shape.target_fraction = (seq - seq / 2 - 1) as f64 / seq as f64;
    shape.threads = bench.device().effective_threads(run.run.threads);
    let plan = crate::plan::budget(&shape);
    let sharding = dist.sharding(run.train.shard_frozen_weights);
    let mut model = crate::engine::setup::load_model(run, &run.lora, sharding, device)?;
    model.context = dist.context_parallel();
    let layer0 = model.layers.first().map_or(Vec::new(), |l| l.linears());
    let weight_bytes = layer0.iter().map(|(_, l)| l.base_weight_bytes()).sum();
    let build_s = t_build.elapsed().as_secs_f64();
    let (rss, heap) = ((rss_before, peak_rss_mb()), (heap_before, heap_mb()));
    Ok(Built {
        config: model.config.clone(),
        precision: run.precision_spec(),
        model,
        plan,
        weight_bytes,
        build_s,
        rss,
        heap,
    })
}

/// What the warm-up and timed steps measured.
#[derive(Default)]
struct Timed {
    /// Per timed step: wall, forward, backward and optimizer seconds, CPU utilisation.
    step_s: Vec<f64>,
    fwd_s: Vec<f64>,
    bwd_s: Vec<f64>,
    opt_s: Vec<f64>,
    util: Vec<f64>,
    loss: f64,
    /// Where the machine stood when the timed steps began.
    window: Option<Window>,
    /// Bytes the linear layers and SwiGLU saved for backward in the last step.
    saved_bytes: usize,
    /// FP8 GEMMs of the last step: on `_scaled_mm`, and fallen back to f32.
    fp8_gemms: llora_model::fp8::gemm::GemmCounts,
    /// FP8 quantisations of each step, by route (our kernel, two-pass, or through f32).
    quantiser: Vec<llora_model::fp8::QuantiserCounts>,
    /// Seconds per layer in the context-parallel K/V exchange (forward and backward), per timed step.
    exchange_s: Vec<f64>,
}

/// /proc/stat's (busy, total) jiffies, this process's CPU seconds and the time, at one moment.
type Window = (Option<(f64, f64)>, f64, Instant);

/// What every step of a bench uses besides the model: its arguments, the ranks, the optimizer,
/// the random batches' generator and the device.
struct Stepper<'a> {
    bench: &'a Bench<'a>,
    dist: &'a crate::dist::Dist,
    optim: AdamW,
    rng: rand_chacha::ChaCha8Rng,
    device: Device,
}

impl Stepper<'_> {
    /// One optimizer step of `built`'s model on fresh random batches.
    fn step(&mut self, built: &mut Built) -> anyhow::Result<crate::engine::step::StepStats> {
        bench_step(self.bench, &built.config, self.dist, &mut built.model, &mut self.optim, &mut self.rng, &self.device)
    }
}

/// The bench's warm-up and timed steps.
fn timed_steps(stepper: &mut Stepper, built: &mut Built) -> anyhow::Result<Timed> {
    let (args, dist) = (stepper.bench.args, stepper.dist);
    let mut t = Timed { loss: f64::NAN, ..Timed::default() };
    for step in 0..args.warmup + args.steps {
        let (c0, t0) = (cpu_seconds(), Instant::now());
        let _ = llora_model::precision::take_saved_bytes();
        let _ = take_gemm_counts();
        let _ = llora_model::fp8::take_quantiser_counts();
        let _ = dist.context.as_ref().map(|c| c.take_spent_s());
        let s = stepper.step(built)?;
        let exchange_s = dist.context.as_ref().map_or(0.0, |c| c.take_spent_s());
        t.saved_bytes = llora_model::precision::take_saved_bytes();
        t.fp8_gemms = take_gemm_counts();
        t.quantiser.push(llora_model::fp8::take_quantiser_counts());
        let (dt, dc) = (t0.elapsed().as_secs_f64(), cpu_seconds() - c0);
        t.loss = s.loss;
        if step + 1 == args.warmup.max(1) {
            t.window = Some((proc_stat(), cpu_seconds(), Instant::now()));
        }
        let timed = step >= args.warmup;
        if timed {
            t.step_s.push(dt);
            t.fwd_s.push(s.forward_s);
            t.bwd_s.push(s.backward_s);
            t.opt_s.push(s.optimizer_s);
            t.util.push(dc / dt);
            t.exchange_s.push(exchange_s / built.config.num_hidden_layers.max(1) as f64);
        }
        eprintln!(
            "# step {step} {} {dt:.3}s (fwd {:.3} bwd {:.3} opt {:.3}) loss {:.4} cpu_util {:.2}",
            if timed { "timed" } else { "warm" },
            s.forward_s,
            s.backward_s,
            s.optimizer_s,
            t.loss,
            dc / dt
        );
    }
    Ok(t)
}

impl Timed {
    /// Other processes' share of the machine (cores) during the timed steps: a noisy bench
    /// says so.
    fn other_cores(&self) -> Option<f64> {
        let (ps0, pc0, pw0) = self.window?;
        let (ps0, ps1) = (ps0?, proc_stat()?);
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get()) as f64;
        let busy = (ps1.0 - ps0.0) / (ps1.1 - ps0.1).max(1.0) * cores;
        let ours = (cpu_seconds() - pc0) / pw0.elapsed().as_secs_f64();
        Some((busy - ours).max(0.0))
    }

    /// The timing fields of the record, as the peer names them: `tokens` are this rank's per
    /// step (`tokens_per_s`), `world` ranks run alike (`world_tokens_per_s`).
    fn to_json(&self, tokens: f64, world: usize, flops_per_step: f64) -> Value {
        let r4 = |x: f64| (x * 1e4).round() / 1e4;
        let (step_s, med) = (&self.step_s, quantile(&self.step_s, 0.5));
        json!({
            "step_s_median": r4(med), "step_s_min": r4(quantile(step_s, 0.0)), "step_s_max": r4(quantile(step_s, 1.0)),
            "step_s_p25": r4(quantile(step_s, 0.25)), "step_s_p75": r4(quantile(step_s, 0.75)),
            "fwd_s_median": r4(quantile(&self.fwd_s, 0.5)), "bwd_s_median": r4(quantile(&self.bwd_s, 0.5)),
            "opt_s_median": r4(quantile(&self.opt_s, 0.5)),
            "tokens_per_s": (tokens / med * 100.0).round() / 100.0,
            "world_tokens_per_s": (tokens * world as f64 / med * 100.0).round() / 100.0,
            "final_loss": (self.loss * 1e5).round() / 1e5,
            "gflops_per_s": (flops_per_step / med / 1e9 * 100.0).round() / 100.0,
            "cpu_util_median": (quantile(&self.util, 0.5) * 100.0).round() / 100.0,
            "other_procs_cpu_cores": self.other_cores().map(|x| (x * 100.0).round() / 100.0),
            "step_times": step_s.iter().map(|&x| r4(x)).collect::<Vec<_>>(),
            "cp_exchange_s_per_layer_median": (quantile(&self.exchange_s, 0.5) * 1e6).round() / 1e6,
        })
    }

    /// The FP8 fields of the record: which GEMMs and quantiser routes the steps took.
    fn fp8_json(&self, cuda: bool) -> Value {
        let g = &self.fp8_gemms;
        json!({
            "fp8_gemms_scaled_mm": g.scaled_mm, "fp8_gemms_emulated": g.emulated, "fp8_gemms_fallback": g.fallback,
            // Which FP8 GEMM the CPU runs, and the probe's seconds for one 128³ GEMM of each.
            "fp8_cpu_gemm": (g.emulated + g.scaled_mm > 0 && !cuda).then(|| {
                let (path, t_scaled, t_emulated) = llora_model::fp8::gemm::cpu_path();
                json!({"path": path.name(), "scaled_mm_s": t_scaled, "emulated_s": t_emulated})
            }),
            // The FP8 quantiser route(s) each step took, and the last step's quantisations by route.
            "fp8_quantiser_routes": self.quantiser.iter().map(|c| c.routes()).collect::<Vec<_>>(),
            "fp8_quantisations": self.quantiser.last().map(|c| json!({"kernel": c.kernel, "two_pass": c.two_pass, "f32": c.via_f32, "at_writers_amax": c.at_writers_amax})),
            // The CPU took the CUDA routes (LLORA_CUDA_ROUTES_ON_CPU=1): control flow, not kernels.
            "cuda_routes_on_cpu": !cuda && llora_model::diagnostics::on_cpu(),
        })
    }
}

/// MiB, one decimal.
fn mib(bytes: f64) -> f64 {
    (bytes / (1 << 20) as f64 * 10.0).round() / 10.0
}

/// One decimal.
fn r1(x: f64) -> f64 {
    (x * 10.0).round() / 10.0
}

/// Joins JSON objects into one (later keys win).
fn merged(parts: impl IntoIterator<Item = Value>) -> Value {
    let mut out = serde_json::Map::new();
    for part in parts {
        if let Value::Object(m) = part {
            out.extend(m);
        }
    }
    Value::Object(out)
}

/// After the timed steps: one step counted (the op observer costs time, so it never runs in a
/// timed step), and one traced when `--trace` asks (on the GPU's timeline too when `cuda`).
fn extra_steps(
    stepper: &mut Stepper,
    built: &mut Built,
    cuda: bool,
) -> anyhow::Result<llora_model::diagnostics::Counts> {
    let counter = llora_model::diagnostics::Counter::start().map_err(anyhow::Error::msg)?;
    stepper.step(built)?;
    let counts = counter.finish();
    if let Some(path) = stepper.bench.args.trace.as_deref().map(|p| trace_path(p, stepper.dist)) {
        anyhow::ensure!(!path.exists(), "--trace: {} already exists: llora never writes over a file", path.display());
        let trace = llora_model::diagnostics::Trace::start(cuda).map_err(anyhow::Error::msg)?;
        stepper.step(built)?;
        trace.finish(&path).map_err(anyhow::Error::msg)?;
        // Kineto reports some failures to write (a rename) in its log only.
        anyhow::ensure!(
            path.is_file(),
            "--trace: the profiler wrote no trace at {} (see its log above)",
            path.display()
        );
    }
    Ok(counts)
}

/// Where this rank writes `--trace PATH`: PATH itself in one process, `STEM.rankR.EXT` beside
/// it with several ranks (one profiler per process: ranks writing one file lost it).
fn trace_path(path: &Path, dist: &crate::dist::Dist) -> PathBuf {
    if dist.world.size <= 1 {
        return path.to_path_buf();
    }
    let stem = path.file_stem().map_or_else(|| "trace".into(), |s| s.to_string_lossy().into_owned());
    let ext = path.extension().map(|e| format!(".{}", e.to_string_lossy())).unwrap_or_default();
    path.with_file_name(format!("{stem}.rank{}{ext}", dist.world.rank))
}

/// Timed LoRA steps of a preset on random tokens.
fn train(bench: &Bench, device_spec: DeviceSpec, dist: &crate::dist::Dist) -> anyhow::Result<Value> {
    let (args, run) = (bench.args, &bench.config);
    let (seq_len, batch, cp) = (bench.seq_len(), bench.batch(), bench.cp());
    anyhow::ensure!(seq_len >= 4, "--seq-len must be at least 4");
    let la0 = loadavg();
    let device = device_spec.init(run.run.threads)?;
    let train_device = device.clone().autodiff();
    train_device.seed(run.run.seed);
    let mut built = build(bench, dist, &train_device)?;
    let heap_peak = HeapPeak::start();
    let optim = AdamW::new(run.optim.clone());
    let rng = rand_chacha::ChaCha8Rng::seed_from_u64(run.run.seed + 1);
    let mut stepper = Stepper { bench, dist, optim, rng, device: train_device.clone() };
    let cuda_index = match device_spec {
        DeviceSpec::Cuda(n) => Some(n),
        _ => None,
    };
    if let Some(n) = cuda_index {
        llora_model::diagnostics::reset_device_peaks(n).map_err(anyhow::Error::msg)?;
    }
    let timed = timed_steps(&mut stepper, &mut built)?;
    let (heap_peak, heap_resident_peak) = heap_peak.finish();
    // The caching allocator's peaks over warm-up and timed steps (what `llora plan` predicts).
    let device_peaks =
        cuda_index.map(llora_model::diagnostics::device_peaks).transpose().map_err(anyhow::Error::msg)?;
    // Read before the extra counted/traced steps and the one-block measurement below (the
    // profiler's buffers are not the step's memory).
    let peak_rss = peak_rss_mb();
    let counts = extra_steps(&mut stepper, &mut built, cuda_index.is_some())?;
    let Built { config, precision, model, plan, .. } = &built;
    let block = block_memory(model, batch, seq_len, &train_device);
    // Per rank: its accum × batch sequences (a 1/cp share of each under context parallelism:
    // the balanced chunks give every rank of a group the same work).
    let seqs = batch * args.accum;
    let adapters = crate::flops::Adapters::of(model);
    let flops = crate::flops::Flops::sequence(config, adapters, seq_len, model.trains_base())
        .times(seqs as u64)
        .to_json(config, adapters);
    let per_step = flops["flops_per_step"].as_f64().unwrap_or(0.0);
    let mut breakdown = flops.as_object().cloned().unwrap_or_default();
    breakdown.remove("flops_per_step");
    let shape = json!({
        "preset": run.model.preset, "model_path": run.model.path, "seq_len": seq_len, "batch": batch, "dtype": precision.compute.name(),
        "accum": args.accum, "world": dist.world.size, "context_parallel": cp,
        "recompute_layers": run.train.recompute_layers, "collectives": dist.comm.backend(),
        "fp8_activations": precision.fp8_activations, "fp8_weights": precision.fp8_weights,
        "fp8_weights_one_layout": precision.fp8_weights_one_layout, "dora": run.lora.dora,
        "adapter_compute": precision.for_adapters().compute.name(),
        "nf4": precision.nf4.map(|n| json!({"block": n.block, "double": n.double})),
        "trainable_params": model.num_trainable_parameters(),
        "total_params": model.config.num_parameters() + model.num_lora_parameters(),
        "flops_per_step": per_step, "flops_breakdown": breakdown,
        "warmup": args.warmup, "steps": args.steps,
        "threads": bench.device().effective_threads(run.run.threads),
        "trace": args.trace.as_deref().map(|p| trace_path(p, dist).display().to_string()),
        "phases_synchronised": cuda_index.is_some(),
    });
    let memory = json!({
        // Covered tensors: inputs kept by the linear layers (LoRA's A and B) and by SwiGLU.
        "saved_act_bytes_per_layer": timed.saved_bytes / config.num_hidden_layers.max(1),
        // One decoder block run alone (see `block_memory`); null for a sharded model.
        "transient_peak_bytes_per_layer": block.map(|b| b.transient_fwd.max(b.transient_bwd)),
        "block_memory": block.map(|b| json!({
            "saved_bytes": b.saved, "transient_fwd_bytes": b.transient_fwd, "transient_bwd_bytes": b.transient_bwd,
        })),
        "device_peak_allocated_mb": device_peaks.map(|(a, _)| mib(a as f64)),
        "device_peak_reserved_mb": device_peaks.map(|(_, r)| mib(r as f64)),
        "base_weight_bytes_per_layer": built.weight_bytes,
        "peak_rss_mb": peak_rss.map(r1),
        "planned_peak_mb": mib(plan.peak),
        "planned_mb": plan.lines.iter().map(|l| (l.name.to_string(), json!(mib(l.bytes)))).collect::<serde_json::Map<_, _>>(),
        "rss_before_build_mb": built.rss.0.map(r1), "rss_hwm_after_build_mb": built.rss.1.map(r1),
        "heap_in_use_before_build_mb": r1(built.heap.0), "heap_in_use_after_build_mb": r1(built.heap.1),
        "peak_heap_in_use_mb": r1(heap_peak), "peak_heap_resident_mb": r1(heap_resident_peak),
    });
    let run = run_json(&counts, la0, built.build_s);
    // This rank's tokens: under context parallelism the group's ranks share each sequence.
    let tokens = (seqs * seq_len) as f64 / cp.max(1) as f64;
    Ok(merged([
        shape,
        timed.to_json(tokens, dist.world.size, per_step / cp.max(1) as f64),
        memory,
        timed.fp8_json(cuda_index.is_some()),
        run,
        routes(),
    ]))
}

/// What ran: ops and syncs per step, the implementation and its versions, the machine's load.
fn run_json(counts: &llora_model::diagnostics::Counts, loadavg_start: Option<Vec<f64>>, build_s: f64) -> Value {
    json!({
        // Per optimizer step, counted on one extra step (`llora_model::diagnostics`): LibTorch ops
        // dispatched, and host-device synchronisations (scalar reads + llora's host reads).
        "ops_per_step": counts.ops, "host_syncs_per_step": counts.host_syncs,
        "impl": format!("llora (burn 0.22.1 + {})", llora_model::device::libtorch_summary()),
        "loadavg_start": loadavg_start, "loadavg_end": loadavg(),
        "build_s": (build_s * 100.0).round() / 100.0,
        "versions": {"llora": env!("CARGO_PKG_VERSION"), "burn": "0.22.1", "torch": llora_model::device::libtorch_version(),
            "cuda": llora_model::device::libtorch_cuda()},
    })
}

/// The kernel routes the run took (CUDA's, or their CPU stand-ins under
/// `LLORA_CUDA_ROUTES_ON_CPU=1`); the FP8 quantisers' are in `fp8_quantiser_routes`.
fn routes() -> Value {
    json!({
        "attn_impl": llora_model::diagnostics::attention_kernels_used(),
        "rms_norm": if llora_model::diagnostics::RMS_NORM_FUSED_ROUTE.used() { "cuda-fused" } else { "composite" },
        // SwiGLU with FP8-kept inputs: our kernel (kernels/swiglu_fp8.cu) or LibTorch's ops.
        "swiglu": if llora_model::diagnostics::SWIGLU_FP8_ROUTE.used() { "kernel" } else { "libtorch" },
        "optimizer": if llora_model::diagnostics::FUSED_ADAMW_ROUTE.used() { "fused-adamw" } else { "per-parameter" },
        // Whether the norms wrote their projections' FP8 input (kernels/rmsnorm_fp8.cu).
        "rms_norm_fp8_codes": llora_model::diagnostics::RMS_NORM_FP8_ROUTE.used(),
        // Every CUDA route of the one list (llora_model::diagnostics::all_routes), and whether this run took
        // it (null: the route does not count its uses).
        "route_list": llora_model::diagnostics::all_routes()
            .iter()
            .map(|r| json!({"name": r.name, "part": r.part, "used": r.used}))
            .collect::<Vec<_>>(),
    })
}

/// `llora bench` as the command line runs it: prints the record (rank 0 only under a
/// launcher), tagged with `--tag` and appended to `--out` when given.
pub fn command(args: &BenchArgs) -> anyhow::Result<()> {
    // Under a launcher only rank 0 prints and appends the record.
    let Some(mut record) = run(args)? else { return Ok(()) };
    if let Some(tag) = &args.tag {
        record["tag"] = tag.clone().into();
    }
    let line = record.to_string();
    crate::outln!("{line}");
    if let Some(out) = &args.out {
        use std::io::Write;
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(out)
            .map_err(|e| anyhow::anyhow!("cannot open {}: {e}", out.display()))?;
        writeln!(f, "{line}").map_err(|e| anyhow::anyhow!("cannot write {}: {e}", out.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_interpolate_like_the_peer() {
        assert_eq!(quantile(&[3.0, 1.0, 2.0, 4.0], 0.5), 2.5);
        assert_eq!(quantile(&[3.0, 1.0, 2.0, 4.0], 0.25), 1.75);
        assert_eq!(quantile(&[5.0], 0.75), 5.0);
    }
}
