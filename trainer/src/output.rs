//! Command output on stdout that a closed reader cannot turn into a panic.
//!
//! `println!` panics when stdout is a pipe whose reader has gone (`llora plan ... | head -1`,
//! `llora train ... | true`): the command then dies in the middle of its work. Here a closed
//! stdout ends the output, quietly, and the command finishes what it was doing (a run still
//! writes its checkpoints, result log and adapter); any other write error is reported once on
//! stderr.

use std::io::Write;
use std::sync::atomic::{AtomicBool, Ordering};

/// Whether stdout was found closed (or broken) by an earlier write.
static CLOSED: AtomicBool = AtomicBool::new(false);

/// Writes `args` (and a newline with `newline`) to stdout and flushes; see the module doc.
pub fn write(args: std::fmt::Arguments<'_>, newline: bool) {
    if CLOSED.load(Ordering::Relaxed) {
        return;
    }
    let mut out = std::io::stdout().lock();
    let result = out.write_fmt(args).and_then(|()| if newline { out.write_all(b"\n") } else { Ok(()) });
    if let Err(e) = result.and_then(|()| out.flush()) {
        CLOSED.store(true, Ordering::Relaxed);
        if e.kind() != std::io::ErrorKind::BrokenPipe {
            eprintln!("llora: cannot write to stdout ({e}); its output stops here, the command goes on");
        }
    }
}

/// `println!` for command output (see [`write`]).
#[macro_export]
macro_rules! outln {
    () => { $crate::output::write(format_args!(""), true) };
    ($($arg:tt)*) => { $crate::output::write(format_args!($($arg)*), true) };
}

/// `print!` for command output (see [`write`]).
#[macro_export]
macro_rules! out {
    ($($arg:tt)*) => { $crate::output::write(format_args!($($arg)*), false) };
}
