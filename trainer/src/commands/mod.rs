//! One file per `llora` subcommand: each parses nothing (clap did, into `cli.rs`'s types),
//! checks its flags, calls the engine or the library crates, and prints its result.

pub mod bench;
pub mod config;
pub mod data;
pub mod eval;
pub mod export;
pub mod generate;
pub mod mlperf;
pub mod plan;
pub mod plot;
pub mod selftest;
pub mod train;
