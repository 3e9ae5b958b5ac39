//! Pre-training a base a config asks for (`[model.pretrain]`: full fine-tuning of
//! `model.preset` into `model.path` when that holds no checkpoint yet): its run's config and
//! where the result goes, which `engine/train.rs` runs as a `Request::Pretrain` before the run
//! that needs the base, and the base moved into place after it.

use anyhow::Context;
use tracing::info;

use crate::config::{Config, Trainable};
use crate::engine::events::RunStatus;
use crate::engine::outcome::Outcome;
use crate::engine::outputs;

/// The base a pre-training run makes: where it goes, and the eval loss it must reach.
#[derive(Debug, Clone)]
pub struct Base {
    /// `model.path` of the config that asked for it.
    pub path: std::path::PathBuf,
    /// `model.pretrain.target_loss`.
    target_loss: f64,
    /// `model.pretrain.steps`.
    steps: usize,
}

/// The pre-training run's config and the base it makes, when `config`'s `[model.pretrain]`
/// asks for one and `model.path` holds no checkpoint; `None` otherwise.
pub fn base_to_make(config: &Config, world: usize) -> anyhow::Result<Option<(Config, Base)>> {
    let (Some(pt), Some(path)) = (&config.model.pretrain, &config.model.path) else { return Ok(None) };
    if path.join("config.json").is_file() {
        return Ok(None);
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
    let base = Base { path: path.clone(), target_loss: pt.target_loss, steps: pt.steps };
    Ok(Some((c, base)))
}

/// After the pre-training run: the base it reached is moved into `model.path`; a run that did
/// not reach `model.pretrain.target_loss` is an error saying what to raise.
pub(super) fn publish(outcome: &Outcome, run_dir: &std::path::Path, base: &Base) -> anyhow::Result<()> {
    anyhow::ensure!(
        outcome.status == RunStatus::Success,
        "pre-training stopped at eval loss {} above model.pretrain.target_loss = {} after {} steps; raise model.pretrain.steps",
        outcome.eval_loss.map_or("(none: no evaluation ran)".to_string(), |l| format!("{l:.4}")),
        base.target_loss,
        base.steps
    );
    let path = &base.path;
    if let Some(parent) = path.parent() {
        std::fs::create_dir_all(parent).with_context(|| format!("cannot create {}", parent.display()))?;
    }
    // The checkpoint was written completely in the run directory; one rename publishes it.
    std::fs::rename(run_dir.join(outputs::FULL_CHECKPOINT), path)
        .with_context(|| format!("cannot move the pre-trained base to {}", path.display()))?;
    info!(path = %path.display(), "pre-trained base saved");
    Ok(())
}
