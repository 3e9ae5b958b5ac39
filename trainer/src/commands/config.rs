//! `llora config show`: the resolved config (file, embedded default and `--set` overrides) as TOML.

use crate::config::Config;

/// Prints the resolved config.
pub fn show(args: &crate::cli::ConfigArgs) -> anyhow::Result<()> {
    let config = Config::load(args.config.as_deref(), &args.overrides)?;
    crate::out!("{}", config.to_toml());
    Ok(())
}
