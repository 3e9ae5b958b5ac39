//! `llora train`: a new run of a config, or `--resume DIR` of an interrupted one, on this
//! process's ranks; fails unless the run reached its target.

use crate::config::{Config, TINY_CPU_NAME};
use crate::engine::train;

/// Runs `llora train`.
pub fn run(args: &crate::cli::TrainArgs) -> anyhow::Result<()> {
    let outcome = match &args.resume {
        Some(dir) => {
            let resumed = train::load_resume(dir, &args.config.overrides)?;
            let dist = resumed.config.join_world()?;
            let target = (resumed.config.eval.target_loss, resumed.config.schedule.max_steps);
            let outcome = train::run(train::Request::Resume(resumed), &dist)?;
            dist.shutdown()?;
            (outcome, target)
        }
        None => {
            let config = Config::load(args.config.config.as_deref(), &args.config.overrides)?;
            let name = args.config.config.as_ref().map_or(TINY_CPU_NAME.to_string(), |p| p.display().to_string());
            let dist = config.join_world()?;
            let target = (config.eval.target_loss, config.schedule.max_steps);
            let outcome = train::run(train::Request::Config { config, name, overwrite: args.overwrite }, &dist)?;
            dist.shutdown()?;
            (outcome, target)
        }
    };
    let (outcome, (target, max_steps)) = outcome;
    if outcome.status != train::RunStatus::Success {
        anyhow::bail!(
            "the run did not reach eval.target_loss = {target} within schedule.max_steps = {max_steps} \
             (run_stop status \"{}\"; result log {})",
            outcome.status.name(),
            outcome.result_log.display()
        );
    }
    Ok(())
}
