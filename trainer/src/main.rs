//! The `llora` binary: parses the command line, sets up logging, runs one job.

use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches};
use llora_trainer::cli::{Cli, Command, ConfigCommand, LogFormat, MlperfCommand};
use llora_trainer::config::{Config, TINY_CPU_NAME};
use llora_trainer::{dist, train};
use tracing_subscriber::EnvFilter;

fn main() -> ExitCode {
    // `--version` names the LibTorch build llora runs with, known only at run time.
    let version: &'static str =
        Box::leak(format!("{} ({})", env!("CARGO_PKG_VERSION"), llora_model::device::libtorch_summary()).into());
    let cli = match Cli::from_arg_matches(&Cli::command().version(version).get_matches()) {
        Ok(cli) => cli,
        Err(e) => e.exit(),
    };
    init_tracing(cli.log_format);
    match run(cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // `{:#}` prints the whole context chain on one line: what failed, then why.
            eprintln!("error: {}", user_message(&format!("{e:#}")));
            if e.downcast_ref::<llora_trainer::train::Interrupted>().is_some() {
                ExitCode::from(130)
            } else if e.downcast_ref::<llora_trainer::plan::DoesNotFit>().is_some() {
                ExitCode::from(3)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

/// An error as the user sees it: LibTorch's messages carry its C++ stack (`Exception raised
/// from ...` and `frame #N: ...` lines), which says nothing to a user; it is cut unless
/// `RUST_BACKTRACE` is set (then everything is printed, for a bug report).
fn user_message(msg: &str) -> String {
    if std::env::var_os("RUST_BACKTRACE").is_some_and(|v| v != "0") {
        return msg.to_string();
    }
    let kept: Vec<&str> = msg
        .lines()
        .filter(|l| {
            let t = l.trim_start();
            !(t.starts_with("frame #") || t.starts_with("Exception raised from"))
        })
        .collect();
    let mut out = kept.join("\n");
    if kept.len() < msg.lines().count() {
        out.push_str("\n(LibTorch's C++ stack omitted: set RUST_BACKTRACE=1 to print it)");
    }
    out
}

fn init_tracing(format: LogFormat) {
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    // Span close events carry busy/idle times; spans are debug-level, so only
    // `RUST_LOG=...=debug` prints them.
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        // Colours only on a terminal: logs collected from ranks or CI stay plain text.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_span_events(tracing_subscriber::fmt::format::FmtSpan::CLOSE);
    match format {
        LogFormat::Pretty => builder.with_target(false).init(),
        LogFormat::Json => builder.json().flatten_event(true).init(),
    }
}

fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Train(args) => {
            let outcome = match &args.resume {
                Some(dir) => {
                    let resumed = train::load_resume(dir, &args.config.overrides)?;
                    let dist = dist::init(&resumed.config.dist, resumed.config.run.device.is_cuda())?;
                    let target = (resumed.config.eval.target_loss, resumed.config.schedule.max_steps);
                    let outcome = train::resume(resumed, &dist)?;
                    dist.shutdown()?;
                    (outcome, target)
                }
                None => {
                    let config = Config::load(args.config.config.as_deref(), &args.config.overrides)?;
                    let name =
                        args.config.config.as_ref().map_or(TINY_CPU_NAME.to_string(), |p| p.display().to_string());
                    let dist = dist::init(&config.dist, config.run.device.is_cuda())?;
                    let outcome = train::run(&config, &name, &dist, args.overwrite)?;
                    dist.shutdown()?;
                    (outcome, (config.eval.target_loss, config.schedule.max_steps))
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
        Command::Config { command: ConfigCommand::Show(args) } => {
            let config = Config::load(args.config.as_deref(), &args.overrides)?;
            print!("{}", config.to_toml());
            Ok(())
        }
        Command::Eval(args) => llora_trainer::train::eval_command(&args),
        Command::Data { command } => llora_trainer::data_cmd::run(&command),
        Command::Mlperf { command: MlperfCommand::Score { dir } } => {
            let score = llora_trainer::mlperf::score_dir(&dir)?;
            print!("{}", score.table());
            println!("{}", score.json());
            Ok(())
        }
        Command::Mlperf { command: MlperfCommand::Check { log, ruleset } } => {
            let verdict = llora_trainer::compliance::check(&log, &ruleset)?;
            print!("{}", verdict.output);
            anyhow::ensure!(
                verdict.passed,
                "{}: the MLPerf compliance checker (training ruleset {ruleset}) rejected this log",
                log.display()
            );
            println!("PASS: {} (training ruleset {ruleset})", log.display());
            Ok(())
        }
        Command::Mlperf { command: MlperfCommand::Run(args) } => {
            let config = Config::load(args.config.config.as_deref(), &args.config.overrides)?;
            let name = args.config.config.as_ref().map_or(TINY_CPU_NAME.to_string(), |p| p.display().to_string());
            let dist = dist::init(&config.dist, config.run.device.is_cuda())?;
            let score = llora_trainer::mlperf::run_many(&config, &name, args.runs as usize, &args.out, &dist)?;
            dist.shutdown()?;
            if let Some(score) = score {
                print!("{}", score.table());
                println!("{}", score.json());
            }
            Ok(())
        }
        Command::Export(args) => llora_trainer::train::export_merged(&args),
        Command::Generate(args) => llora_trainer::generate::run(&args),
        Command::Plan(args) => llora_trainer::plan::plan_command(&args),
        Command::Plot(args) => llora_trainer::plot::plot_command(&args),
        Command::Selftest(args) => {
            let spec = args.device;
            let args = llora_trainer::cli::SelftestArgs { device: spec.for_local_rank(dist::local_rank()), ..args };
            let record = llora_trainer::selftest::run(&args)?;
            // Under a launcher only rank 0 prints.
            if std::env::var("RANK").map_or(true, |r| r == "0") {
                println!("{record}");
            }
            anyhow::ensure!(record["ok"] == true, "self-test failed: {}", record["failed"]);
            Ok(())
        }
        Command::Bench(args) => {
            // Under a launcher only rank 0 prints and appends the record.
            let Some(mut record) = llora_trainer::bench::run(&args)? else { return Ok(()) };
            if let Some(tag) = &args.tag {
                record["tag"] = tag.clone().into();
            }
            let line = record.to_string();
            println!("{line}");
            if let Some(out) = &args.out {
                use std::io::Write;
                let mut f = std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(out)
                    .map_err(|e| anyhow::anyhow!("cannot open {}: {e}", out.display()))?;
                writeln!(f, "{line}").map_err(|e| anyhow::anyhow!("cannot write {}: {e}", out.display()))?;
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The shape of a c10d failure as LibTorch words it: the message stays, the stack goes.
    #[test]
    fn cpp_frames_are_cut_from_errors() {
        let msg = "dist: rank 1 could not reach the store: The client socket has timed out after 30000ms \
                   while trying to connect to (127.0.0.1, 29500).\nException raised from throwTimeoutError at \
                   /pytorch/torch/csrc/distributed/c10d/socket.cpp:1021 (most recent call first):\nframe #0: \
                   c10::Error::Error(c10::SourceLocation, std::string) + 0x98 (0x7f libc10.so)\nframe #1: <unknown \
                   function> + 0x5c1d (0x7f libtorch_cpu.so)";
        if std::env::var_os("RUST_BACKTRACE").is_some_and(|v| v != "0") {
            assert_eq!(user_message(msg), msg);
            return;
        }
        let shown = user_message(msg);
        assert!(shown.starts_with("dist: rank 1 could not reach the store"), "{shown}");
        assert!(!shown.contains("frame #") && !shown.contains("Exception raised from"), "{shown}");
        assert!(shown.ends_with("set RUST_BACKTRACE=1 to print it)"), "{shown}");
        assert_eq!(user_message("plain error"), "plain error");
    }
}
