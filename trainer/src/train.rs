//! `llora train`: the recipe that joins model and data (see issue #5 for what is still missing).

use anyhow::Context;
use tracing::info;

use crate::config::Config;

/// Runs `llora train` with a validated config; `config_name` is reported in logs.
pub fn run(config: &Config, config_name: &str) -> anyhow::Result<()> {
    let device = config
        .run
        .device
        .init(config.run.threads)
        .with_context(|| format!("cannot start on run.device = \"{}\"", config.run.device))?;
    info!(
        config = config_name,
        backend = config.run.device.backend_name(),
        device = %config.run.device,
        threads = config.run.device.effective_threads(config.run.threads),
        "llora {} starting",
        env!("CARGO_PKG_VERSION")
    );
    let _ = device;
    anyhow::bail!("the training loop is not implemented yet (issue #5); `llora config show` validates a config")
}
