//! `llora train`: the recipe. LoRA fine-tuning to a target eval loss, logged the MLPerf way,
//! on one process or on many data-parallel ranks.
//!
//! [`run`] reads top to bottom like nanoGPT's loop: set up, then step, maybe evaluate, maybe
//! checkpoint, until the target or `max_steps`; then finish. The [`Trainer`] owns everything the
//! loop touches; the step itself and evaluation are components in [`crate::engine::step`]; what
//! happened is emitted as [`RunEvent`]s to the run's records (the result log, whose event order
//! is [`RunLog`]'s, metrics and progress); what is saved and restored is [`TrainState`].

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use burn::module::Module;
use burn::tensor::{Device, Int, Tensor};
use llora_data::Sample;
use llora_data::batch::{Geometry, RowOrder, StepBatch, train_batches};
use llora_data::loader::SampleOrder;
use llora_data::packing::PackedOrder;
use llora_data::parquet_io::{ReadOptions, read_parquet};
use llora_data::prefetch::Prefetched;
use llora_data::synth::{Synth, SynthConfig};
use llora_model::checkpoint::{HfCheckpoint, save_hf_checkpoint};
use llora_model::peft::save_peft_adapter;
use llora_model::shard::Sharding;
use llora_model::{BuildOptions, LlamaConfig, LlamaForCausalLM, LoraSpec};
use tracing::{debug_span, info};

use crate::config::{Averaging, Config, Override, PretrainConfig, Trainable};
use crate::dist::{Dist, ReduceOp};
use crate::engine::events::{Observer, RunEvent, StepReport};
use crate::engine::mllog::{MlperfKeys, RunLog, now_ms};
use crate::engine::observe::{Metrics, Progress, StopSignal};
use crate::engine::optim::{AdamW, lr_at};
use crate::engine::resume::{self, Checkpoint, TrainState};
use crate::engine::run_dir;
use crate::engine::step::{
    EvalBatching, MicroBatch, StepOptions, StepStats, dropout_seed, evaluate, train_step, upload,
};

pub use crate::engine::events::RunStatus;

/// How a run ended.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// Target reached, or not.
    pub status: RunStatus,
    /// Training samples consumed.
    pub samples: usize,
    /// Last evaluation loss, if any evaluation ran.
    pub eval_loss: Option<f64>,
    /// run_stop − run_start, seconds.
    pub time_to_train_s: f64,
    /// The MLPerf result log (written by rank 0).
    pub result_log: PathBuf,
}

/// Runs `llora train` with a validated config on `dist`'s ranks; `config_name` is reported in
/// logs. The run writes to `run.dir` or, when that holds an earlier run, where
/// [`run_dir::claim`] says (`overwrite`: replacing it); with `run.resume = "auto"` it continues
/// the interrupted run of this config it finds there.
pub fn run(config: &Config, config_name: &str, dist: &Dist, overwrite: bool) -> anyhow::Result<Outcome> {
    // Ranks agree on the config, run.dir included, before rank 0 decides for all of them.
    crate::config::check_same_config(dist.comm.as_ref(), &config.to_toml())?;
    check_same_data(config, dist)?;
    let policy = run_dir::Policy {
        overwrite,
        auto_resume: config.run.resume.is_auto(),
        restarted: dist.world.attempt > 0,
        job: dist.world.job.as_deref().map(run_dir::job_hash),
    };
    let compatible = |dir: &Path| -> anyhow::Result<()> {
        let (saved, step) = resume::peek(dir)?;
        resume::check_compatible(&saved, config, step)
    };
    let claim = run_dir::claim(&config.run.dir, policy, &compatible, dist.comm.as_ref())?;
    if claim.finished() {
        return finished_outcome(claim.dir());
    }
    if let (Some(job), true) = (&dist.world.job, dist.is_main()) {
        run_dir::mark_job(claim.dir(), job)?;
    }
    if claim.resumes() {
        let checkpoint = resume::load(claim.dir())?;
        let saved =
            Config::parse(&checkpoint.dir.join("config.toml").display().to_string(), &checkpoint.config_toml, &[])?;
        resume::check_compatible(&saved, config, checkpoint.progress.step)
            .with_context(|| format!("cannot resume {}", claim.dir().display()))?;
        let mut config = config.clone();
        config.run.dir = claim.dir().to_path_buf();
        if dist.is_main() {
            info!(
                dir = %config.run.dir.display(),
                checkpoint = %checkpoint.dir.display(),
                "run.resume = \"{}\": run.dir holds an interrupted run of this config; continuing it",
                if config.run.resume == crate::config::ResumeMode::Auto { "auto" } else { "launcher" }
            );
        }
        let resumed = Resumed { checkpoint, config, name: config_name.to_string() };
        return continue_run(resumed, dist, claim);
    }
    let mut config = config.clone();
    config.run.dir = claim.dir().to_path_buf();
    let mut t = Trainer::setup(&config, config_name, dist, None, claim)?;
    t.train()
}

/// The outcome of the finished run in `dir`, read from its result log (a restarted attempt
/// reports it instead of training again).
fn finished_outcome(dir: &Path) -> anyhow::Result<Outcome> {
    let result_log = dir.join(run_dir::RESULT_LOG);
    let r = crate::mlperf::read_result(&result_log)?;
    let status = if r.converged() { RunStatus::Success } else { RunStatus::Aborted };
    info!(
        dir = %dir.display(),
        status = status.name(),
        "this job's run finished in an earlier attempt; nothing to train"
    );
    Ok(Outcome {
        status,
        samples: r.samples.unwrap_or(0) as usize,
        eval_loss: None,
        time_to_train_s: r.minutes.unwrap_or(0.0) * 60.0,
        result_log,
    })
}

/// A checkpoint to resume from, with the config it was saved with (`--set` applied, validated).
pub struct Resumed {
    /// The checkpoint.
    pub checkpoint: Checkpoint,
    /// The run's config.
    pub config: Config,
    /// Where the config came from, for logs.
    pub name: String,
}

/// `llora train --resume DIR`: reads the newest intact checkpoint in the run directory `dir`
/// and its config with `overrides` applied on top, through the same validation as any config.
pub fn load_resume(dir: &Path, overrides: &[Override]) -> anyhow::Result<Resumed> {
    // No checkpoint in the directory of a live run: the live run is the answer (only then:
    // under a launcher, rank 0 may already hold the lock of the run every rank resumes).
    let checkpoint = resume::load(dir).map_err(|e| run_dir::refuse_if_live(dir).err().unwrap_or(e))?;
    let name = checkpoint.dir.join("config.toml").display().to_string();
    let mut config = Config::parse(&name, &checkpoint.config_toml, overrides)?;
    // The run continues where its files are, even if the directory was moved.
    let home = checkpoint.run_dir();
    run_dir::check_resumable(&home)?;
    let saved = Config::parse(&name, &checkpoint.config_toml, &[])?;
    resume::check_overrides(&saved, &config, overrides, checkpoint.progress.step)
        .with_context(|| format!("cannot resume {}", home.display()))?;
    config.run.dir = home;
    Ok(Resumed { checkpoint, config, name })
}

/// The ranks agree on the data files they will read (the same paths may hold other files on
/// other nodes), before anything is claimed or trained.
fn check_same_data(config: &Config, dist: &Dist) -> anyhow::Result<()> {
    let files: Vec<(&str, &Path)> = [("data.train", &config.data.train), ("data.eval", &config.data.eval)]
        .into_iter()
        .filter_map(|(key, path)| path.as_deref().map(|p| (key, p)))
        .collect();
    Ok(crate::dist::check_same_data(dist.comm.as_ref(), &files)?)
}

/// Continues a run from its checkpoint on `dist`'s ranks (any world size: the data order is global).
pub fn resume(resumed: Resumed, dist: &Dist) -> anyhow::Result<Outcome> {
    crate::config::check_same_config(dist.comm.as_ref(), &resumed.config.to_toml())?;
    check_same_data(&resumed.config, dist)?;
    let claim = run_dir::Claim::resumed(resumed.config.run.dir.clone(), dist.is_main())?;
    continue_run(resumed, dist, claim)
}

/// The resumed run, once the ranks agree on its config.
fn continue_run(resumed: Resumed, dist: &Dist, claim: run_dir::Claim) -> anyhow::Result<Outcome> {
    let Resumed { checkpoint, config, name } = resumed;
    info!(checkpoint = %checkpoint.dir.display(), step = checkpoint.progress.step, samples = checkpoint.progress.samples, "resuming");
    let mut t = Trainer::setup(&config, &name, dist, Some(checkpoint), claim)?;
    t.train()
}

/// Everything the training loop touches.
pub struct Trainer<'a> {
    config: &'a Config,
    name: String,
    dist: &'a Dist,
    /// The device without autodiff (evaluation).
    device: Device,
    /// The same device with autodiff (training).
    train_device: Device,
    model: LlamaForCausalLM,
    state: TrainState,
    spec: LoraSpec,
    base_name: String,
    config_toml: String,
    resumed: bool,
    eval_set: Arc<Vec<Sample>>,
    batches: Prefetched<StepBatch>,
    /// The run's records, each an observer of its events.
    records: Records,
    result_log: PathBuf,
    stop: StopSignal,
    /// Tokens and wall time since this process started training (for tokens/s).
    tokens_here: usize,
    t_train: Instant,
    /// Dense bf16 peak TFLOP/s of one device, for MFU: `logging.peak_tflops`, else the known
    /// peak of the GPU's name (`flops::gpu_peak_tflops`); `None`: MFU is not reported.
    peak_tflops: Option<f64>,
    /// The run directory; what `--overwrite` replaced is deleted once this run saved something.
    claim: run_dir::Claim,
}

/// The peak MFU is measured against: `logging.peak_tflops` when set, else on a CUDA device the
/// dense bf16 peak of a GPU llora knows by name (logged once on the main rank).
fn peak_tflops(config: &Config, device: &llora_model::device::DeviceSpec, main: bool) -> Option<f64> {
    if config.logging.peak_tflops > 0.0 {
        return Some(config.logging.peak_tflops);
    }
    let llora_model::device::DeviceSpec::Cuda(index) = device else { return None };
    let name = crate::flops::gpu_name(*index)?;
    let found = crate::flops::gpu_peak_tflops(&name);
    if main {
        match found {
            Some((bf16, fp8)) => {
                info!(gpu = %name, bf16_tflops = bf16, fp8_tflops = fp8, "MFU against the GPU's dense bf16 peak")
            }
            None => info!(gpu = %name, "no known peak for this GPU: set logging.peak_tflops for an MFU column"),
        }
    }
    found.map(|(bf16, _)| bf16)
}

impl Trainer<'_> {
    /// The loop (see [`Self::steps`]); whatever fails in it ends the result log with an
    /// aborted `run_stop`, except an interruption, which a resumed run continues.
    pub fn train(&mut self) -> anyhow::Result<Outcome> {
        let outcome = self.steps();
        if let Err(e) = &outcome {
            let event = match e.is::<Interrupted>() {
                true => RunEvent::Interrupted,
                false => RunEvent::Stop {
                    samples: self.state.progress.samples,
                    status: RunStatus::Aborted,
                    time_ms: now_ms(),
                },
            };
            self.records.emit(event);
        }
        outcome
    }

    /// Step, maybe evaluate, maybe checkpoint, until the target or `max_steps`.
    fn steps(&mut self) -> anyhow::Result<Outcome> {
        let status = loop {
            if self.state.progress.step >= self.config.schedule.max_steps {
                break RunStatus::Aborted;
            }
            let stop = self.step()?;
            kill_point(self.state.progress.step);
            if self.eval_due() && self.evaluate()? {
                break RunStatus::Success;
            }
            if stop || self.checkpoint_due() {
                let dir = self.checkpoint()?;
                if stop {
                    let (step, run_dir) = (self.state.progress.step, self.config.run.dir.clone());
                    return Err(Interrupted { step, checkpoint: dir, run_dir }.into());
                }
            }
        };
        self.finish(status)
    }
}

/// Fault injection for the resume tests: with `LLORA_FAULT_KILL_AT_STEP=N` the process
/// SIGKILLs itself once step N has run (its metrics written, its checkpoint not), as a lost
/// node dies: a kill point chosen by step, so a failing test replays exactly.
fn kill_point(step: usize) {
    static AT: std::sync::OnceLock<Option<usize>> = std::sync::OnceLock::new();
    let at = *AT.get_or_init(|| std::env::var("LLORA_FAULT_KILL_AT_STEP").ok()?.parse().ok());
    if at == Some(step) {
        // SAFETY: getpid and kill have no preconditions; SIGKILL ends the process here.
        unsafe {
            libc::kill(libc::getpid(), libc::SIGKILL);
        }
    }
}

impl<'a> Trainer<'a> {
    /// Everything before the first step (the ranks have agreed on `config`), in the result
    /// log's order: device, `init_start`, model and adapters, optimizer (or the checkpoint's
    /// state), warm-up, every rank ready, `run_start`, data.
    pub fn setup(
        config: &'a Config,
        name: &str,
        dist: &'a Dist,
        resumed: Option<Checkpoint>,
        claim: run_dir::Claim,
    ) -> anyhow::Result<Self> {
        let (device_spec, device) = start_device(config, name, dist)?;
        check_inputs(config, dist.world.size)?;
        let geometry = geometry(config, dist.data_share())?;
        let fresh = resumed.is_none();
        let start_step = resumed.as_ref().map_or(0, |c| c.progress.step);
        let mut records = Records::open(config, name, dist, geometry, (!fresh).then_some(start_step))?;
        records.emit(RunEvent::Init);
        let spec = config.lora.clone();
        let train_device = device.clone().autodiff();
        train_device.seed(config.run.seed);
        let (model, mut state) = match ready_model(config, &spec, dist, resumed, &device, &train_device) {
            Ok(ready) => ready,
            Err(e) => {
                // Nothing ran: a fresh run leaves no outputs, so that the corrected rerun
                // takes this run.dir rather than the next free one.
                if fresh {
                    records.discard(config, dist.is_main());
                }
                return Err(e);
            }
        };
        // Every rank is ready before the clock starts.
        dist.comm.barrier()?;
        if fresh {
            state.progress.run_start_ms = now_ms();
        }
        records.emit(RunEvent::Start { time_ms: state.progress.run_start_ms });
        let samples = state.progress.samples;
        let data = records.stop_on_error(samples, load_datasets(config, model.config.vocab_size))?;
        records.emit(data_event(config, &data));
        info!(train = data.train.len(), eval = data.eval.len(), "data ready");
        let batches = records.stop_on_error(samples, batches(config, &data, &state.progress, geometry, fresh))?;
        records.emit(RunEvent::Block { samples });
        let base_name = config
            .model
            .path
            .as_ref()
            .map_or_else(|| config.model.preset.clone().unwrap_or_default(), |p| p.display().to_string());
        Ok(Self {
            config,
            name: name.to_string(),
            dist,
            device,
            train_device,
            model,
            state,
            spec,
            base_name,
            config_toml: config.to_toml(),
            resumed: !fresh,
            eval_set: data.eval,
            batches,
            records,
            result_log: config.run.dir.join(run_dir::RESULT_LOG),
            stop: StopSignal::install()?,
            tokens_here: 0,
            t_train: Instant::now(),
            peak_tflops: peak_tflops(config, &device_spec, dist.is_main()),
            claim,
        })
    }

    /// One optimizer step on the next global batch; returns whether the ranks agreed to stop
    /// (SIGINT/SIGTERM on any of them). A failed step ends the result log as aborted.
    fn step(&mut self) -> anyhow::Result<bool> {
        let (config, comm) = (self.config, self.dist.comm.as_ref());
        let step = self.state.progress.step;
        let lr = lr_at(step, config.optim.lr, &config.schedule);
        let batch = {
            let _span = debug_span!("data", step = step + 1).entered();
            self.batches.next().expect("the training stream is endless")
        };
        let full = config.model.trainable == Trainable::All;
        let batch_tokens: usize = batch.lengths.iter().sum();
        let adapters = crate::flops::Adapters::of(&self.model);
        let flops: f64 = batch
            .lengths
            .iter()
            .map(|&n| crate::flops::Flops::sequence(&self.model.config, adapters, n, full).total() as f64)
            .sum();
        let micro: Vec<MicroBatch> = batch
            .micro_batches
            .into_iter()
            .enumerate()
            .map(|(i, m)| {
                let seed = Some(dropout_seed(config.run.seed, step, batch.first_micro + i));
                MicroBatch { seed, ..upload(m, &self.train_device) }
            })
            .collect();
        let t_step = Instant::now();
        let opts = StepOptions {
            lr,
            clip_grad_norm: config.optim.clip_grad_norm,
            recompute_layers: config.train.recompute_layers,
            sync_phases: false,
        };
        let stats = train_step(&mut self.model, &mut self.state.optim, comm, micro, batch.target_tokens, opts)
            .and_then(|s| {
                // Ranks stop together, after the same step, or their collectives would not match.
                let mut stop = [f64::from(u8::from(self.stop.raised()))];
                comm.all_reduce_f64(&mut stop, ReduceOp::Max)?;
                Ok((s, stop[0] > 0.0))
            });
        let (s, stop): (StepStats, bool) = stats.with_context(|| format!("step {}", step + 1))?;
        if !s.loss.is_finite() || !s.grad_norm.is_finite() {
            anyhow::bail!(
                "step {}: the loss is {} and the gradient norm {}: training cannot go on from non-finite values \
                 (a non-finite base weight, an lr too high for this run, or fp8 scales out of range); \
                 the last checkpoint is still in {}",
                step + 1,
                s.loss,
                s.grad_norm,
                config.run.dir.display()
            );
        }
        let step_s = t_step.elapsed().as_secs_f64();
        let p = &mut self.state.progress;
        p.step = step + 1;
        p.samples += config.train.global_batch_size;
        p.tokens_seen += batch_tokens;
        p.position = batch.position_after;
        self.tokens_here += batch_tokens;
        let tok_s = self.tokens_here as f64 / self.t_train.elapsed().as_secs_f64();
        // Model FLOPs of the whole global batch over the step's wall time, per rank.
        let tflops = flops / step_s / 1e12 / self.dist.world.size as f64;
        let report = StepReport {
            step: p.step,
            samples: p.samples,
            loss: s.loss,
            lr,
            grad_norm: s.grad_norm,
            tokens_per_s: tok_s,
            step_s,
            tflops,
            mfu: self.peak_tflops.map(|peak| tflops / peak),
            target_tokens: batch.target_tokens,
            documents: config.data.packing.then_some(batch.lengths.len()),
        };
        self.records.emit(RunEvent::Step(&report));
        Ok(stop)
    }

    /// Whether this step ends an evaluation interval that counts (MLPerf skips the first few).
    fn eval_due(&mut self) -> bool {
        // `interval` is a whole number of global batches (Config::eval_interval_samples).
        if !self.state.progress.samples.is_multiple_of(self.config.eval_interval_samples()) {
            return false;
        }
        self.state.progress.evals_done += 1;
        self.state.progress.evals_done > self.config.eval_skip_first()
    }

    /// Evaluates on the whole eval set (sharded across ranks) and logs it; true at the target.
    fn evaluate(&mut self) -> anyhow::Result<bool> {
        let (config, samples) = (self.config, self.state.progress.samples);
        self.records.emit(RunEvent::EvalStart { samples });
        let loss = {
            let _span = debug_span!("eval", samples).entered();
            let how = EvalBatching {
                batch_size: config.eval.batch_size,
                workers: config.data.eval_workers,
                padding: config.data.padding.padding(config.data.max_seq_len),
                packing: config.data.packing(),
            };
            evaluate(
                &self.model.valid(),
                &self.eval_set,
                how,
                &self.device,
                self.dist.comm.as_ref(),
                self.dist.data_share(),
            )?
        };
        let eval_loss = match config.eval.averaging {
            Averaging::PerToken => loss.per_token,
            Averaging::PerSample => loss.per_sample,
        };
        let (step, target) = (self.state.progress.step, config.eval.target_loss);
        self.records.emit(RunEvent::Eval { step, samples, eval_loss, target });
        self.state.progress.last_eval = Some(eval_loss);
        let reached = eval_loss <= target;
        if !reached {
            self.records.emit(RunEvent::Block { samples });
        }
        Ok(reached)
    }

    fn checkpoint_due(&self) -> bool {
        let every = self.config.run.checkpoint_every;
        every > 0 && self.state.progress.step.is_multiple_of(every)
    }

    /// Rank 0 writes a resumable checkpoint; every rank waits for it, so none runs ahead of (or
    /// exits before) a checkpoint the job may resume from.
    fn checkpoint(&mut self) -> anyhow::Result<PathBuf> {
        self.verify_replicas()?;
        let mut dir = crate::engine::checkpoints::root(&self.config.run.dir);
        if self.dist.is_main() {
            let adapter =
                (self.config.model.trainable == Trainable::Lora).then_some((&self.spec, self.base_name.as_str()));
            let keep = self.config.run.keep_checkpoints;
            dir = resume::save(&self.config.run.dir, keep, &self.config_toml, &self.state, &mut self.model, adapter)?;
            self.claim.settle();
            self.records.emit(RunEvent::Checkpoint { step: self.state.progress.step, dir: &dir });
        }
        self.dist.comm.barrier()?;
        Ok(dir)
    }

    /// Checks that every rank holds the same trainable parameters (their f64 sums and sums of
    /// squares agree exactly): a replica that drifted (a nondeterministic kernel, a rank fed
    /// other data) would otherwise train on silently.
    fn verify_replicas(&mut self) -> anyhow::Result<()> {
        let comm = self.dist.comm.as_ref();
        if comm.world_size() == 1 {
            return Ok(());
        }
        let (mut sum, mut sq) = (0f64, 0f64);
        for (_, p) in self.model.trainable_params_mut() {
            let v = p.flat().into_data().convert::<f32>().try_into_vec::<f32>().expect("f32");
            for x in v {
                sum += f64::from(x);
                sq += f64::from(x) * f64::from(x);
            }
        }
        let all = comm.all_gather_f64(&[sum, sq])?;
        let differ: Vec<usize> = (1..comm.world_size()).filter(|r| all[2 * r..2 * r + 2] != all[..2]).collect();
        anyhow::ensure!(
            differ.is_empty(),
            "after step {}: the trainable parameters of ranks {differ:?} differ from rank 0's (checksums {all:?})",
            self.state.progress.step
        );
        Ok(())
    }

    /// The run's final weights (rank 0): the adapters in PEFT format, or the full HF checkpoint,
    /// written beside their place and renamed into it whole.
    fn save_outputs(&mut self) -> anyhow::Result<std::path::PathBuf> {
        let run_dir = &self.config.run.dir;
        Ok(match self.config.model.trainable {
            Trainable::All => {
                let dir = run_dir.join(run_dir::FULL_CHECKPOINT);
                let model = &mut self.model;
                crate::paths::write_dir_atomic(&dir, |tmp| save_hf_checkpoint(model, tmp))?;
                dir
            }
            Trainable::Lora => {
                let dir = run_dir.join(run_dir::ADAPTER);
                let (model, spec, base) = (&self.model, &self.spec, &self.base_name);
                crate::paths::write_dir_atomic(&dir, |tmp| save_peft_adapter(model, spec, tmp, base))?;
                dir
            }
        })
    }

    /// Rank 0 saves the adapters (or the full checkpoint), each swapped in whole, then logs
    /// `run_stop` stamped with the training's end (a run whose log has a `run_stop` always has
    /// its adapters: a kill while saving leaves an interrupted run that `--resume` completes),
    /// then draws the loss plot.
    fn finish(&mut self, status: RunStatus) -> anyhow::Result<Outcome> {
        self.verify_replicas()?;
        let run_stop = now_ms();
        let samples = self.state.progress.samples;
        let saved = if self.dist.is_main() { Some(self.save_outputs()?) } else { None };
        self.records.emit(RunEvent::Stop { samples, status, time_ms: run_stop });
        let ttt = run_stop.saturating_sub(self.state.progress.run_start_ms) as f64 / 1000.0;
        let last_eval = self.state.progress.last_eval;
        let outcome = Outcome {
            status,
            samples,
            eval_loss: last_eval,
            time_to_train_s: ttt,
            result_log: self.result_log.clone(),
        };
        let Some(saved) = saved else { return Ok(outcome) };
        let run_dir = &self.config.run.dir;
        self.claim.settle();
        let plot = run_dir.join(run_dir::PLOT);
        let curve = crate::plot::Curve {
            label: self.name.clone(),
            train: self.records.metrics.train.clone(),
            eval: self.records.metrics.eval.clone(),
        };
        if let Err(e) = crate::plot::loss_svg(&plot, &[curve], self.config.eval.target_loss) {
            tracing::warn!("cannot draw {}: {e:#}", plot.display());
        }
        info!(status = status.name(), samples, time_to_train_s = format!("{ttt:.1}"), result_log = %self.result_log.display(),
            saved = %saved.display(), plot = %plot.display(), "run finished");
        crate::outln!(
            "status: {}  samples: {samples}  eval_loss: {}  time_to_train: {:.1} s ({:.2} min){}  run.dir: {}",
            status.name(),
            last_eval.map_or("n/a".into(), |l| format!("{l:.4}")),
            ttt,
            ttt / 60.0,
            if self.resumed { " (resumed: includes the interruption)" } else { "" },
            run_dir.display()
        );
        if self.config.mlperf.check {
            let verdict = crate::compliance::check(&self.result_log, crate::compliance::DEFAULT_RULESET)?;
            anyhow::ensure!(
                verdict.passed,
                "{}: the MLPerf compliance checker rejected the result log:\n{}",
                self.result_log.display(),
                verdict.output
            );
            info!(result_log = %self.result_log.display(), "the MLPerf compliance checker accepts the result log");
        }
        Ok(outcome)
    }
}

/// The train command's first step: when `[model.pretrain]` asks for a base and `model.path`
/// holds none yet, makes it (full fine-tuning of `model.preset`, a run of its own) before the
/// run that needs it; nothing otherwise.
pub fn prepare_base(config: &Config, world: usize) -> anyhow::Result<()> {
    let (Some(pt), Some(path)) = (&config.model.pretrain, &config.model.path) else { return Ok(()) };
    if path.join("config.json").is_file() {
        return Ok(());
    }
    anyhow::ensure!(
        world == 1,
        "model.path = {} holds no checkpoint and [model.pretrain] would make one: pre-train it with a single \
         process first (`llora train` without a launcher), then start the {world} ranks",
        path.display()
    );
    // The pre-trained base is renamed into place at the end: find a clash before the work.
    anyhow::ensure!(
        crate::paths::is_free(path),
        "model.path = {} exists but holds no config.json (not an HF checkpoint); [model.pretrain] makes a base \
         only where nothing is: point model.path at a checkpoint or at a new directory",
        path.display()
    );
    check_data_files(config)?;
    // Before pre-training too: a base still to be made is planned from model.preset.
    crate::plan::check_fits(config, world)?;
    pretrain(config, pt, path)
}

/// Fails before any work when inputs are absent (a 70B run should not load 140 GB first) or
/// the run cannot fit.
fn check_inputs(config: &Config, world: usize) -> anyhow::Result<()> {
    if let Some(p) = &config.model.path {
        anyhow::ensure!(
            p.is_dir(),
            "model.path = {}: no such directory (download the HF checkpoint there, or set model.path{})",
            p.display(),
            if config.model.pretrain.is_some() { "; `llora train` makes it from [model.pretrain]" } else { "" }
        );
    }
    check_data_files(config)?;
    crate::plan::check_fits(config, world)
}

fn check_data_files(config: &Config) -> anyhow::Result<()> {
    for (key, p) in [("data.train", &config.data.train), ("data.eval", &config.data.eval)] {
        if let Some(p) = p {
            anyhow::ensure!(p.is_file(), "{key} = {}: no such file", p.display());
        }
    }
    Ok(())
}

/// Starts this rank's device and says what runs where (main rank).
fn start_device(config: &Config, name: &str, dist: &Dist) -> anyhow::Result<(llora_model::device::DeviceSpec, Device)> {
    let (world, comm) = (&dist.world, dist.comm.as_ref());
    let device_spec = dist.device(config.run.device);
    let device = device_spec
        .init(config.run.threads)
        .with_context(|| format!("cannot start on run.device = \"{}\" (rank {})", config.run.device, world.rank))?;
    if dist.is_main() {
        info!(
            config = name,
            backend = %device_spec.backend_name(),
            device = %device_spec,
            threads = device_spec.effective_threads(config.run.threads),
            ranks = world.size,
            collectives = comm.backend(),
            "llora {} starting",
            env!("CARGO_PKG_VERSION")
        );
    }
    Ok((device_spec, device))
}

/// How a global batch splits over the ranks and their micro-batches.
///
/// `(rank, world)` is this rank's data-parallel share: under context parallelism the ranks of
/// one group read the same sequences.
fn geometry(config: &Config, (rank, world): (usize, usize)) -> anyhow::Result<Geometry> {
    let t = &config.train;
    let g = Geometry { global: t.global_batch_size, micro: t.micro_batch_size, rank, world };
    let ranks = if t.context_parallel > 1 { "data-parallel groups (ranks / train.context_parallel)" } else { "ranks" };
    let per_step = crate::plan::checked_product(&[("train.micro_batch_size", g.micro), (ranks, g.world)])?;
    anyhow::ensure!(
        g.global.is_multiple_of(per_step),
        "train.global_batch_size = {} must be a multiple of train.micro_batch_size × ranks = {} × {} = {per_step}",
        g.global,
        g.micro,
        g.world,
    );
    Ok(g)
}

/// The model with its adapters and the state training starts from: the checkpoint's, or fresh
/// after the warm-up passes.
fn ready_model(
    config: &Config,
    spec: &LoraSpec,
    dist: &Dist,
    resumed: Option<Checkpoint>,
    device: &Device,
    train_device: &Device,
) -> anyhow::Result<(LlamaForCausalLM, TrainState)> {
    let sharding = dist.sharding(config.train.shard_frozen_weights);
    let mut model = load_model(config, spec, sharding, train_device)?;
    model.context = dist.context_parallel();
    info!(
        base_parameters = model.config.num_parameters(),
        lora_parameters = model.num_lora_parameters(),
        base_weight_mb = model.base_weight_bytes() >> 20,
        frozen_weights = if model.is_sharded() { "sharded" } else { "replicated" },
        "model ready"
    );
    let mut state = TrainState { progress: resume::Progress::default(), optim: AdamW::new(config.optim.clone()) };
    match resumed {
        Some(mut ckpt) => ckpt.restore(&mut model, &mut state, device)?,
        None => {
            // Warm-up passes must not leave amaxes of random tokens in the scaling state.
            let scales = model.fp8_scales();
            warm_up(&model, config, train_device)?;
            model.set_fp8_scales(&scales)?;
        }
    }
    Ok((model, state))
}

/// The datasets' sizes in the schedule's unit: documents, or packed rows (the training set
/// packed in file order; the shuffled epochs' rows differ by a few).
fn data_event(config: &Config, data: &Datasets) -> RunEvent<'static> {
    let (train, eval) = (data.train.len(), data.eval.len());
    let Some(packing) = config.data.packing() else { return RunEvent::Data { train, eval, packed_documents: None } };
    let rows = |set: &[Sample]| {
        let lengths: Vec<usize> = set.iter().map(|s| s.input_ids.len()).collect();
        llora_data::packing::stats(&lengths, packing).rows
    };
    RunEvent::Data { train: rows(&data.train), eval: rows(&data.eval), packed_documents: Some((train, eval)) }
}

/// The training stream from where `progress` stands: one global order for every rank, each
/// taking its micro-batches of every global batch; packed into rows when the config packs.
fn batches(
    config: &Config,
    data: &Datasets,
    progress: &resume::Progress,
    geometry: Geometry,
    fresh: bool,
) -> anyhow::Result<Prefetched<StepBatch>> {
    let position = progress.position;
    let order = SampleOrder::new(data.train.len(), config.run.seed, true, position).with_context(|| {
        let source = config.data.train.as_ref().map_or("data.synthetic".into(), |p| p.display().to_string());
        let n = data.train.len();
        match fresh {
            true => format!("the training data ({source}: {n} samples)"),
            false => format!(
                "the training data ({source}: {n} samples) does not fit the checkpoint's data position (epoch {}, \
                 sample {}): was the file changed since the run started?",
                position.epoch, position.index
            ),
        }
    })?;
    let order = match config.data.packing() {
        None => RowOrder::Samples(order),
        Some(packing) => {
            let lengths = Arc::new(data.train.iter().map(|s| s.input_ids.len()).collect());
            RowOrder::Packed(PackedOrder::new(order, lengths, packing, position.packed_rows)?)
        }
    };
    let padding = config.data.padding.padding(config.data.max_seq_len);
    Ok(train_batches(data.train.clone(), order, geometry, padding, config.data.train_workers))
}

/// The run's records: the MLPerf result log, `metrics.jsonl` and the progress bar, each an
/// [`Observer`] of the run's events (silent on ranks other than 0).
struct Records {
    log: RunLog,
    metrics: Metrics,
    bar: Progress,
}

impl Records {
    /// Opens the records of a run in `config.run.dir`: fresh, or continuing a run resumed at
    /// step `resumed_at` (the result log appended to, `metrics.jsonl` cut to that step).
    fn open(
        config: &Config,
        name: &str,
        dist: &Dist,
        geometry: Geometry,
        resumed_at: Option<usize>,
    ) -> anyhow::Result<Self> {
        let (run_dir, main) = (&config.run.dir, dist.is_main());
        if main {
            std::fs::create_dir_all(run_dir).with_context(|| format!("cannot create run.dir {}", run_dir.display()))?;
        }
        let keys = MlperfKeys::of(config, dist.world.nodes(), geometry.accumulation(), name);
        // A resumed run appends to its log; that log then tells the story of an interrupted
        // run, which the MLPerf rules do not accept as a result (they time uninterrupted runs).
        let log = RunLog::open(&run_dir.join(run_dir::RESULT_LOG), main, resumed_at.is_some(), keys)?;
        let metrics = Metrics::open(&run_dir.join(run_dir::METRICS), resumed_at, main)?;
        let bar = Progress::new(config, resumed_at.unwrap_or(0), main);
        Ok(Self { log, metrics, bar })
    }

    /// Removes what a fresh run's records wrote (rank 0), when it failed before `run_start`.
    fn discard(self, config: &Config, main: bool) {
        drop(self);
        if main {
            for name in [run_dir::RESULT_LOG, run_dir::METRICS] {
                let _ = std::fs::remove_file(config.run.dir.join(name));
            }
        }
    }

    /// Tells every record what happened.
    fn emit(&mut self, event: RunEvent<'_>) {
        self.log.observe(&event);
        self.metrics.observe(&event);
        self.bar.observe(&event);
    }

    /// `r`, with the run stopped (aborted) first when it is an error: whatever fails after
    /// `run_start` ends the result log.
    fn stop_on_error<T>(&mut self, samples: usize, r: anyhow::Result<T>) -> anyhow::Result<T> {
        if r.is_err() {
            self.emit(RunEvent::Stop { samples, status: RunStatus::Aborted, time_ms: now_ms() });
        }
        r
    }
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
    let opts = ReadOptions { vocab, max_seq_len: d.max_seq_len, on_bad_row: d.on_bad_row };
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
fn load_model(
    config: &Config,
    spec: &LoraSpec,
    sharding: Option<Sharding>,
    device: &Device,
) -> anyhow::Result<LlamaForCausalLM> {
    let full = config.model.trainable == Trainable::All;
    let opts = BuildOptions {
        lora: (!full).then_some(spec),
        trainable: full,
        precision: Some(config.precision_spec()),
        sharding,
    };
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
            ckpt.load_model(&opts, device)
        }
        None => {
            let preset = config.model.preset.as_deref().expect("validated: path or preset");
            LlamaForCausalLM::random(&LlamaConfig::preset(preset)?, &opts, device)
        }
    }
}

/// Makes the base checkpoint `model.path` by full fine-tuning `model.preset` on the
/// pre-training corpus (see [`PretrainConfig`]), then moves it into place.
fn pretrain(config: &Config, pt: &PretrainConfig, path: &std::path::Path) -> anyhow::Result<()> {
    info!(path = %path.display(), steps = pt.steps, "no base checkpoint yet: pre-training one (full fine-tuning)");
    let mut c = config.clone();
    c.model.path = None;
    c.model.pretrain = None;
    c.model.trainable = Trainable::All;
    c.optim.lr = pt.lr;
    c.schedule = crate::config::ScheduleConfig { max_steps: pt.steps, warmup_steps: 0 };
    c.eval.target_loss = pt.target_loss;
    // Not an MLPerf run: its log is no result to check (the run after it is).
    c.mlperf.check = false;
    if let Some(syn) = c.data.synthetic.as_mut() {
        syn.seed = pt.corpus_seed;
    }
    c.run.dir = path.with_extension("pretrain-run");
    // Only pre-training writes there, for a base that does not exist yet: what a stopped
    // pre-training left is scratch.
    if c.run.dir.exists() {
        std::fs::remove_dir_all(&c.run.dir)
            .with_context(|| format!("cannot remove the unfinished pre-training run {}", c.run.dir.display()))?;
    }
    let outcome = run(&c, "model.pretrain", &Dist::single(), false)?;
    anyhow::ensure!(
        outcome.status == RunStatus::Success,
        "pre-training stopped at eval loss {} above model.pretrain.target_loss = {} after {} steps; raise model.pretrain.steps",
        outcome.eval_loss.map_or("(none: no evaluation ran)".to_string(), |l| format!("{l:.4}")),
        pt.target_loss,
        pt.steps
    );
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).with_context(|| format!("cannot create {}", parent.display()))?;
    }
    // The checkpoint was written completely in the run directory; one rename publishes it.
    std::fs::rename(c.run.dir.join(run_dir::FULL_CHECKPOINT), path)
        .with_context(|| format!("cannot move the pre-trained base to {}", path.display()))?;
    info!(path = %path.display(), "pre-trained base saved");
    Ok(())
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

/// Forward + backward passes on random tokens of the run's shape, then the gradients are
/// dropped: the adapters, the optimizer and the data order are untouched.
fn warm_up(model: &LlamaForCausalLM, config: &Config, device: &Device) -> anyhow::Result<()> {
    let (b, s) = (config.train.micro_batch_size, config.data.max_seq_len);
    for _ in 0..config.train.warmup_batches {
        let ids = Tensor::<2, Int>::random(
            [b, s],
            burn::tensor::Distribution::Uniform(0.0, model.config.vocab_size as f64),
            device,
        );
        let labels = ids.clone();
        // The step's own path (block-wise when recomputing or sharded), so the warm-up
        // allocates what the steps will.
        drop(model.recomputed_backward(ids, labels, None, 1.0, config.train.recompute_layers, || ())?);
    }
    Ok(())
}
