//! `llora train`'s first step when the config asks for a base it does not have yet: pre-training
//! one (`[model.pretrain]`: full fine-tuning of `model.preset`, a run of its own) before the run
//! that needs it.

use anyhow::Context;
use tracing::info;

use crate::config::{Config, PretrainConfig, Trainable};
use crate::dist::Dist;
use crate::engine::outputs;
use crate::engine::train::{self, Request, RunStatus};

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
    crate::engine::setup::check_data_files(config)?;
    // Before pre-training too: a base still to be made is planned from model.preset.
    crate::plan::check_fits(config, world)?;
    pretrain(config, pt, path)
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
    let request = Request::Config { config: c.clone(), name: "model.pretrain".into(), overwrite: false };
    let outcome = train::run(request, &Dist::single())?;
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
    std::fs::rename(c.run.dir.join(outputs::FULL_CHECKPOINT), path)
        .with_context(|| format!("cannot move the pre-trained base to {}", path.display()))?;
    info!(path = %path.display(), "pre-trained base saved");
    Ok(())
}
