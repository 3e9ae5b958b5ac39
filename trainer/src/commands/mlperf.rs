//! `llora mlperf`: seeded repeated runs into a results directory (`run`), the MLPerf score of
//! one (`score`), and the official compliance checker on a log (`check`).

use std::path::Path;

use anyhow::{Context, ensure};
use llora_model::checkpoint::write_atomic;
use tracing::{error, info};

use crate::cli::MlperfCommand;
use crate::config::{Config, TINY_CPU_NAME};
use crate::engine::train::Request;
use crate::mlperf::{Score, result_files, score_dir};

/// Runs one `llora mlperf` subcommand.
pub fn run(command: &MlperfCommand) -> anyhow::Result<()> {
    match command {
        MlperfCommand::Score { dir } => {
            let score = score_dir(dir)?;
            crate::out!("{}", score.table());
            crate::outln!("{}", score.json());
            Ok(())
        }
        MlperfCommand::Check { log, ruleset } => {
            let verdict = crate::compliance::check(log, ruleset)?;
            crate::out!("{}", verdict.output);
            ensure!(
                verdict.passed,
                "{}: the MLPerf compliance checker (training ruleset {ruleset}) rejected this log",
                log.display()
            );
            crate::outln!("PASS: {} (training ruleset {ruleset})", log.display());
            Ok(())
        }
        MlperfCommand::Run(args) => {
            let config = Config::load(args.config.config.as_deref(), &args.config.overrides)?;
            let name = args.config.config.as_ref().map_or(TINY_CPU_NAME.to_string(), |p| p.display().to_string());
            let dist = config.join_world()?;
            let score = run_many(&config, &name, args.runs as usize, &args.out, &dist)?;
            dist.shutdown()?;
            if let Some(score) = score {
                crate::out!("{}", score.table());
                crate::outln!("{}", score.json());
            }
            Ok(())
        }
    }
}

/// `llora mlperf run`: `runs` runs of `config` with seeds `run.seed + i`, each in
/// `out/run_<i>` with its log copied to `out/result_<i>.txt`; then scores the set.
///
/// A run that fails (NaN, I/O) is reported and the next one starts: the rules allow one
/// non-converged run in a set, and the score says whether this set is valid.
pub fn run_many(
    config: &Config,
    config_name: &str,
    runs: usize,
    out: &Path,
    dist: &crate::dist::Dist,
) -> anyhow::Result<Option<Score>> {
    ensure!(runs >= 3, "--runs {runs}: the score's olympic mean needs at least 3 runs (MLPerf asks for 10)");
    // Every rank trains; rank 0 alone writes and scores.
    let main = dist.is_main();
    if main {
        std::fs::create_dir_all(out).with_context(|| format!("cannot create {}", out.display()))?;
        ensure!(
            result_files(out)?.is_empty() && (0..runs).all(|i| !out.join(format!("run_{i}")).exists()),
            "{} already holds result_<n>.txt files or run_<n> directories of earlier runs; use a new --out \
             directory so that runs are neither mixed nor replaced",
            out.display()
        );
    }
    // Made once before the runs: a base that cannot be made stops here, not in each run.
    crate::engine::train::make_base(config, dist.world.size)?;
    for i in 0..runs {
        let mut c = config.clone();
        c.run.seed = config.run.seed.wrapping_add(i as u64);
        c.run.dir = out.join(format!("run_{i}"));
        info!(run = i, seed = c.run.seed, dir = %c.run.dir.display(), "mlperf run {}/{runs}", i + 1);
        let request = Request::Config { config: c.clone(), name: config_name.to_string(), overwrite: false };
        let log = match crate::engine::train::run(request, dist) {
            Ok(outcome) => outcome.result_log,
            Err(e) => {
                error!(run = i, "run failed: {e:#}");
                c.run.dir.join(crate::engine::outputs::RESULT_LOG)
            }
        };
        if main && log.is_file() {
            let bytes = std::fs::read(&log).with_context(|| format!("cannot read {}", log.display()))?;
            write_atomic(&out.join(format!("result_{i}.txt")), &bytes)?;
        }
    }
    if !main {
        return Ok(None);
    }
    score_dir(out).map(Some)
}
