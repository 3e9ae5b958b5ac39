//! `llora train`: the recipe. LoRA fine-tuning to a target eval loss, logged the MLPerf way,
//! on one process or on many data-parallel ranks.
//!
//! [`run`] is the run in one page: the ranks agree, the start is decided once, then the
//! [`Trainer`] (`trainer.rs`, the type with all its methods): `setup` (its named steps in
//! `setup.rs`: device, records, model, data) and `train` (step, maybe evaluate, maybe
//! checkpoint, until the target or `max_steps`; then finish). The step itself and evaluation are `step.rs`; what happened is emitted as
//! `RunEvent`s to the run's records (`records.rs`: the result log, metrics and progress); what
//! is saved and restored is `resume.rs`'s `TrainState`.

use std::path::{Path, PathBuf};

use anyhow::Context;
use tracing::info;

use crate::config::{Config, Override};
use crate::dist::Dist;
use crate::engine::claim;
use crate::engine::outputs;
use crate::engine::pretrain;
use crate::engine::resume::{self, Checkpoint};
use crate::engine::run_dir;
use crate::engine::trainer::Trainer;

pub use crate::engine::events::RunStatus;
pub use crate::engine::outcome::{Interrupted, Outcome};

/// Where a run starts, as the command asks.
pub enum Request {
    /// A config: a fresh run into `run.dir`, or where [`run_dir::claim`] says when that holds an
    /// earlier run (`overwrite`: replacing it); with `run.resume = "auto"` (or under a launcher's
    /// restart) the interrupted run of this config found there is continued.
    Config {
        /// The validated config.
        config: Config,
        /// Where it came from, for logs.
        name: String,
        /// Replace what `run.dir` holds.
        overwrite: bool,
    },
    /// `llora train --resume DIR`: the checkpoint [`load_resume`] read.
    Resume(Resumed),
    /// Pre-training the base another config asks for (`pretrain.rs`): full fine-tuning into
    /// its own run directory, the result moved into that config's `model.path`.
    Pretrain {
        /// The pre-training run's config.
        config: Config,
        /// Where its result goes.
        base: pretrain::Base,
    },
}

impl Request {
    fn config(&self) -> &Config {
        match self {
            Self::Config { config, .. } | Self::Pretrain { config, .. } => config,
            Self::Resume(r) => &r.config,
        }
    }
}

/// How the run starts, decided once: the run directory claimed, and the checkpoint (if any)
/// loaded and checked against the config.
enum Start {
    /// This job's run already finished in an earlier attempt: nothing to train.
    Finished(PathBuf),
    /// Train from step 0, or from a checkpoint.
    Run(Box<Started>),
}

/// A run about to be set up: its config (`run.dir` the claimed directory), the checkpoint it
/// continues, if any, and its claim on the directory.
struct Started {
    config: Config,
    name: String,
    checkpoint: Option<Checkpoint>,
    claim: claim::Claim,
}

/// `llora train` on `dist`'s ranks, top to bottom: the ranks agree on the config and the data;
/// the checks that need no model pass ([`preflight`]); the base is pre-trained if the config
/// asks for one not made yet; the start is decided (fresh, resumed, or already finished); then
/// the device, the records, the model and the data are set up ([`Trainer::setup`]); then the
/// loop runs to the target or `max_steps`, and the run finishes (outputs, `run_stop`, plot) or
/// ends as aborted or interrupted ([`Trainer::train`]).
pub fn run(request: Request, dist: &Dist) -> anyhow::Result<Outcome> {
    // Ranks agree on the config, run.dir included, before rank 0 decides for all of them.
    crate::config::check_same_config(dist.comm.as_ref(), &request.config().to_toml())?;
    check_same_data(request.config(), dist)?;
    preflight(request.config(), dist.world.size)?;
    make_base(request.config(), dist.world.size)?;
    let base = match &request {
        Request::Pretrain { base, .. } => Some(base.clone()),
        _ => None,
    };
    let Started { config, name, checkpoint, claim } = match decide_start(request, dist)? {
        Start::Finished(dir) => return finished_outcome(&dir),
        Start::Run(started) => *started,
    };
    if let Some(c) = &checkpoint {
        info!(checkpoint = %c.dir.display(), step = c.progress.step, samples = c.progress.samples, "resuming");
    }
    let outcome = Trainer::setup(&config, &name, dist, checkpoint, claim)?.train()?;
    if let Some(base) = base {
        pretrain::publish(&outcome, &config.run.dir, &base)?;
    }
    Ok(outcome)
}

/// Makes the base `config` asks for, if `model.path` holds none yet: the pre-training request
/// run on this process alone, its checkpoint moved into place. Nothing otherwise.
pub fn make_base(config: &Config, world: usize) -> anyhow::Result<()> {
    let Some((config, base)) = pretrain::base_to_make(config, world)? else { return Ok(()) };
    run(Request::Pretrain { config, base }, &Dist::single()).map(|_| ())
}

/// The checks that need no model, made once before anything is claimed or loaded (a 70B run
/// should not load 140 GB first): the base is there (or `[model.pretrain]` makes it), the data
/// files are, and the run fits (`llora plan`; a base still to be made is planned from
/// `model.preset`).
fn preflight(config: &Config, world: usize) -> anyhow::Result<()> {
    if let Some(p) = &config.model.path {
        anyhow::ensure!(
            p.is_dir() || config.model.pretrain.is_some(),
            "model.path = {}: no such directory (download the HF checkpoint there, or set model.path)",
            p.display()
        );
    }
    for (key, p) in [("data.train", &config.data.train), ("data.eval", &config.data.eval)] {
        if let Some(p) = p {
            anyhow::ensure!(p.is_file(), "{key} = {}: no such file", p.display());
        }
    }
    crate::plan::check_fits(config, world)
}

/// Claims the run directory and, where the run continues, loads its checkpoint (checked
/// against the config once: by the claim, or by [`load_resume`]): the one place a run's
/// start is decided.
fn decide_start(request: Request, dist: &Dist) -> anyhow::Result<Start> {
    let (config, name, overwrite) = match request {
        Request::Resume(Resumed { checkpoint, config, name }) => {
            let claim = claim::Claim::resumed(config.run.dir.clone(), dist.is_main())?;
            return Ok(Start::Run(Box::new(Started { config, name, checkpoint: Some(checkpoint), claim })));
        }
        Request::Config { config, name, overwrite } => (config, name, overwrite),
        Request::Pretrain { config, .. } => (config, "model.pretrain".to_string(), false),
    };
    let policy = run_dir::Policy {
        overwrite,
        auto_resume: config.run.resume.is_auto(),
        restarted: dist.world.attempt > 0,
        job: dist.world.job.as_deref().map(run_dir::job_hash),
    };
    // The one compatibility check of an auto-resumed run: the claim resumes only a run whose
    // newest checkpoint's config passes it.
    let compatible = |dir: &Path| -> anyhow::Result<()> {
        let (saved, step) = resume::peek(dir)?;
        resume::check_compatible(&saved, &config, step)
    };
    let claim = run_dir::claim(&config.run.dir, policy, &compatible, dist.comm.as_ref())?;
    if claim.finished() {
        return Ok(Start::Finished(claim.dir().to_path_buf()));
    }
    if let (Some(job), true) = (&dist.world.job, dist.is_main()) {
        run_dir::mark_job(claim.dir(), job)?;
    }
    let mut config = config;
    config.run.dir = claim.dir().to_path_buf();
    if !claim.resumes() {
        return Ok(Start::Run(Box::new(Started { config, name, checkpoint: None, claim })));
    }
    let checkpoint = resume::load(claim.dir())?;
    if dist.is_main() {
        info!(
            dir = %config.run.dir.display(),
            checkpoint = %checkpoint.dir.display(),
            "run.resume = \"{}\": run.dir holds an interrupted run of this config; continuing it",
            if config.run.resume == crate::config::ResumeMode::Auto { "auto" } else { "launcher" }
        );
    }
    Ok(Start::Run(Box::new(Started { config, name, checkpoint: Some(checkpoint), claim })))
}

/// The outcome of the finished run in `dir`, read from its result log (a restarted attempt
/// reports it instead of training again).
fn finished_outcome(dir: &Path) -> anyhow::Result<Outcome> {
    let result_log = dir.join(outputs::RESULT_LOG);
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
    let checkpoint = resume::load(dir).map_err(|e| crate::engine::run_lock::refuse_if_live(dir).err().unwrap_or(e))?;
    let name = checkpoint.dir.join("config.toml").display().to_string();
    let saved = Config::parse(&name, &checkpoint.config_toml, &[])?;
    let mut config = saved.with_overrides(&name, overrides)?;
    // The run continues where its files are, even if the directory was moved.
    let home = checkpoint.run_dir();
    run_dir::check_resumable(&home)?;
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
