//! The [`Trainer`] and all its methods: [`Trainer::setup`] (everything before the first step,
//! as named steps in `setup.rs`), then [`Trainer::train`]: step, maybe evaluate, maybe
//! checkpoint, until the target or `max_steps`, then finish (outputs, `run_stop`, plot, the
//! compliance check).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use burn::module::Module;
use burn::tensor::Device;
use llora_data::Sample;
use llora_data::batch::StepBatch;
use llora_data::prefetch::Prefetched;
use llora_model::checkpoint::save_hf_checkpoint;
use llora_model::save_peft_adapter;
use llora_model::{LlamaForCausalLM, LoraSpec};
use tracing::{debug_span, info};

use crate::config::{Averaging, Config, Objective, Trainable};
use crate::dist::{Dist, ReduceOp};
use crate::engine::claim;
use crate::engine::eval::{EvalBatching, evaluate, evaluate_pairs};
use crate::engine::events::RunStatus;
use crate::engine::events::{RunEvent, StepReport};
use crate::engine::mllog::now_ms;
use crate::engine::optim::lr_at;
use crate::engine::outcome::{Interrupted, Outcome};
use crate::engine::outputs;
use crate::engine::records::Records;
use crate::engine::resume::Checkpoint;
use crate::engine::resume::{self, TrainState};
use crate::engine::setup::{Data, batches, data_event, geometry, load_data, peak_tflops, ready_model, start_device};
use crate::engine::step::{MicroBatch, StepOptions, dropout_seed, preference_step, train_step, upload};
use crate::engine::stop_signal::StopSignal;

/// What an evaluation runs over.
enum EvalSet {
    /// Held-out samples (the target tokens' loss).
    Samples(Arc<Vec<Sample>>),
    /// Held-out preference pairs (the preference objective's loss and rewards).
    Pairs(Arc<Vec<llora_data::preference::Pair>>),
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
    eval_set: EvalSet,
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
    claim: claim::Claim,
    /// Preference tuning's objective (`[dpo]`, with its reference).
    objective: llora_model::PreferenceObjective,
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
        claim: claim::Claim,
    ) -> anyhow::Result<Self> {
        let (device_spec, device) = start_device(config, name, dist)?;
        let geometry = geometry(config, dist.data_share())?;
        let fresh = resumed.is_none();
        let start_step = resumed.as_ref().map_or(0, |c| c.progress.step);
        let mut records = Records::open(config, name, dist, geometry, (!fresh).then_some(start_step))?;
        records.emit(RunEvent::Init);
        let spec = config.lora.clone();
        let train_device = device.clone().autodiff();
        train_device.seed(config.run.seed);
        let (model, mut state, reference) = match ready_model(config, &spec, dist, resumed, &device, &train_device) {
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
        let mut data = records.stop_on_error(samples, load_data(config, model.config.vocab_size))?;
        if let (Data::Pairs { train, eval }, true) = (&mut data, config.dpo.precompute_reference) {
            let pairs = (Arc::make_mut(train).as_mut_slice(), Arc::make_mut(eval).as_mut_slice());
            let done = super::reference::precompute(config, &model, &reference, pairs, &device, dist);
            records.stop_on_error(samples, done)?;
        }
        let event = data_event(config, &data);
        if let RunEvent::Data { train, eval, .. } = event {
            info!(train, eval, "data ready");
        }
        records.emit(event);
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
            eval_set: match data {
                Data::Samples(d) => EvalSet::Samples(d.eval),
                Data::Pairs { eval, .. } => EvalSet::Pairs(eval),
            },
            batches,
            records,
            result_log: config.run.dir.join(outputs::RESULT_LOG),
            stop: StopSignal::install()?,
            tokens_here: 0,
            t_train: Instant::now(),
            peak_tflops: peak_tflops(config, &device_spec, dist.is_main()),
            claim,
            objective: llora_model::PreferenceObjective { reference, ..config.dpo.objective() },
        })
    }
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
        let references: Vec<Option<Vec<f64>>> = batch.micro_batches.iter().map(|m| m.reference.clone()).collect();
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
            bucket_bytes: config.dist.bucket_bytes(),
        };
        let optim = &mut self.state.optim;
        let stats = match config.train.objective {
            Objective::Sft => {
                train_step(&mut self.model, optim, comm, micro, batch.target_tokens, opts).map(|s| (s, None))
            }
            Objective::Dpo => {
                let objective = (&self.objective, config.train.global_batch_size);
                let micro = micro.into_iter().zip(references).collect();
                preference_step(&mut self.model, optim, comm, micro, objective, opts).map(|(s, p)| (s, Some(p)))
            }
        };
        let stats = stats.and_then(|(s, pairs)| {
            // Ranks stop together, after the same step, or their collectives would not match.
            let mut stop = [f64::from(u8::from(self.stop.raised()))];
            comm.all_reduce_f64(&mut stop, ReduceOp::Max)?;
            Ok(((s, pairs), stop[0] > 0.0))
        });
        let ((s, pairs), stop) = stats.map_err(|e| match e.downcast_ref::<super::step::NonFinite>() {
            Some(bad) => anyhow::anyhow!(
                "step {}: {bad} (a non-finite base weight, an lr too high for this run, or fp8 scales out of \
                 range); the adapters were not updated, and the last checkpoint is still in {}",
                step + 1,
                config.run.dir.display()
            ),
            None => e.context(format!("step {}", step + 1)),
        })?;
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
            pairs,
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
        let (eval_loss, pairs) = {
            let _span = debug_span!("eval", samples).entered();
            let how = EvalBatching {
                batch_size: config.eval.batch_size,
                workers: config.data.eval_workers,
                padding: config.data.padding.padding(config.data.max_seq_len),
                packing: config.data.packing(),
            };
            let (model, comm, share) = (self.model.valid(), self.dist.comm.as_ref(), self.dist.data_share());
            match &self.eval_set {
                EvalSet::Samples(set) => {
                    let loss = evaluate(&model, set, how, &self.device, comm, share)?;
                    let eval_loss = match config.eval.averaging {
                        Averaging::PerToken => loss.per_token,
                        Averaging::PerSample => loss.per_sample,
                    };
                    (eval_loss, None)
                }
                EvalSet::Pairs(set) => {
                    let e = evaluate_pairs(&model, set, how, &self.objective, (&self.device, comm), share)?;
                    (e.loss, Some(e.stats))
                }
            }
        };
        let (step, target) = (self.state.progress.step, config.eval.target_loss);
        self.records.emit(RunEvent::Eval { step, samples, eval_loss, target, pairs });
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
            dir = resume::save_checkpoint(
                &self.config.run.dir,
                keep,
                &self.config_toml,
                &self.state,
                &mut self.model,
                adapter,
            )?;
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
                let dir = run_dir.join(outputs::FULL_CHECKPOINT);
                let model = &mut self.model;
                crate::paths::write_dir_atomic(&dir, |tmp| save_hf_checkpoint(model, tmp))?;
                dir
            }
            Trainable::Lora => {
                let dir = run_dir.join(outputs::ADAPTER);
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
        let plot = run_dir.join(outputs::PLOT);
        let curve = crate::plot::Curve { label: self.name.clone(), ..self.records.metrics.curve.clone() };
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
