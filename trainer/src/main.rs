//! The `llora` binary: parses the command line, sets up logging, runs one job.

use std::process::ExitCode;

use clap::{CommandFactory, FromArgMatches};
use llora_trainer::cli::{Cli, Command, ConfigCommand, LogFormat};
use llora_trainer::commands;
use tracing_subscriber::EnvFilter;

/// The process's allocator, chosen here in the binary (a library does not choose one), for Rust and (linked unprefixed, so LibTorch's `posix_memalign`
/// and `free` resolve to it) for every CPU tensor: jemalloc.
///
/// LibTorch's CPU allocator is plain `malloc`. With glibc's, training either unmapped its large
/// activations and faulted them back in every step or, told to keep freed memory, left it
/// fragmented between the long-lived saved activations, the RSS of a step growing well past
/// what its tensors occupied (docs/performance.md, M14). jemalloc (the usual fix for CPU training, through
/// `LD_PRELOAD` in PyTorch's guides) with purging off is as fast or faster and keeps the RSS
/// within a few percent of the tensors' peak, which is what makes `llora plan` checkable.
#[cfg(target_os = "linux")]
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

fn main() -> ExitCode {
    // `--version` names the LibTorch build llora runs with, known only at run time.
    let version: &'static str =
        Box::leak(format!("{} ({})", env!("CARGO_PKG_VERSION"), llora_model::device::libtorch_summary()).into());
    // The commands whose ranks join one world under a launcher.
    let args: Vec<String> = std::env::args().skip(1).take(2).collect();
    let joins_a_world = matches!(args.first().map(String::as_str), Some("train" | "bench"))
        || args.iter().map(String::as_str).eq(["mlperf", "run"]);
    let cli = match Cli::command().version(version).try_get_matches().and_then(|m| Cli::from_arg_matches(&m)) {
        Ok(cli) => cli,
        Err(e) => {
            if joins_a_world && e.use_stderr() {
                // A rank refused on its command line: the others would wait for it.
                llora_trainer::dist::announce_startup_failure(&e.to_string());
            }
            e.exit()
        }
    };
    init_tracing(cli.log_format);
    match run(cli.command) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // `{:#}` prints the whole context chain on one line: what failed, then why.
            let message = user_message(&format!("{e:#}"));
            eprintln!("error: {message}");
            if joins_a_world {
                // The other ranks would wait for this one until dist.timeout_s: tell them.
                llora_trainer::dist::announce_startup_failure(&message);
            }
            if e.downcast_ref::<llora_trainer::engine::train::Interrupted>().is_some() {
                ExitCode::from(130)
            } else if e.downcast_ref::<llora_trainer::commands::plan::DoesNotFit>().is_some() {
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

/// The command table: each subcommand's code is its file in `trainer/src/commands/`.
fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Train(args) => commands::train::run(&args),
        Command::Config { command: ConfigCommand::Show(args) } => commands::config::show(&args),
        Command::Eval(args) => commands::eval::run(&args),
        Command::Data { command } => commands::data::run(&command),
        Command::Mlperf { command } => commands::mlperf::run(&command),
        Command::Export(args) => commands::export::run(&args),
        Command::Generate(args) => commands::generate::run(&args),
        Command::Plan(args) => commands::plan::run(&args),
        Command::Plot(args) => commands::plot::run(&args),
        Command::Selftest(args) => commands::selftest::command(args),
        Command::Bench(args) => commands::bench::command(&args),
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
