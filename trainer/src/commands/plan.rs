//! `llora plan`: one rank's memory for a config, and the cheapest recipe that fits a device.

use crate::plan::{GB, budget, report, shape_of, to_json};

/// `llora plan`: prints the budget, the kept-vs-minimum activations and the cheapest recipe.
pub fn run(args: &crate::cli::PlanArgs) -> anyhow::Result<()> {
    let config = crate::config::Config::load(args.config.config.as_deref(), &args.config.overrides)?;
    let env_world = match std::env::var("WORLD_SIZE") {
        Ok(w) => Some(w.trim().parse::<usize>().map_err(|_| {
            anyhow::anyhow!("WORLD_SIZE={w:?} is not a number of ranks (llora plan reads it when --world is not given)")
        })?),
        Err(_) => None,
    };
    let world = args.world.or(env_world).unwrap_or(1);
    // Where the world size came from, as the user set it.
    let from = match (args.world, env_world) {
        (Some(_), _) => "--world",
        (None, Some(_)) => "WORLD_SIZE (from the environment)",
        (None, None) => "the world (one process without --world)",
    };
    anyhow::ensure!(world >= 1, "{from} = {world} must be at least 1");
    let (gbs, micro, cp) =
        (config.train.global_batch_size, config.train.micro_batch_size, config.train.context_parallel);
    anyhow::ensure!(
        world.is_multiple_of(cp),
        "train.context_parallel = {cp} must divide {from} = {world}: training would refuse this world size"
    );
    let groups = world / cp;
    let groups_named = format!("data-parallel groups ({from} = {world} / train.context_parallel = {cp})");
    let per_step = crate::plan::checked_product(&[("train.micro_batch_size", micro), (&groups_named, groups)])?;
    anyhow::ensure!(
        gbs.is_multiple_of(per_step),
        "train.global_batch_size = {gbs} must be a multiple of train.micro_batch_size × data-parallel groups = \
         {micro} × {groups} = {per_step} ({from} = {world}, train.context_parallel = {cp}): training would refuse \
         this world size"
    );
    let shape = shape_of(&config, world)?;
    if args.json {
        crate::outln!("{}", to_json(&shape, args.device_memory));
    } else {
        crate::out!("{}", report(&shape, args.device_memory));
    }
    match args.device_memory {
        Some(device) if budget(&shape).peak > device => {
            Err(DoesNotFit { needs: budget(&shape).peak / GB, device: device / GB }.into())
        }
        _ => Ok(()),
    }
}

/// `llora plan --device-memory`: the config needs more than the device has (exit status 3).
#[derive(Debug, thiserror::Error)]
#[error("the config needs {needs:.1} GiB of the {device:.1} GiB of --device-memory: it does not fit")]
pub struct DoesNotFit {
    /// GiB the plan predicts.
    pub needs: f64,
    /// GiB of the device.
    pub device: f64,
}
