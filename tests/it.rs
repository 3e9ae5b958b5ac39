//! The end-to-end tests: one binary (one LibTorch link), a module per guarantee. Run one module
//! with `cargo test --release --test it -- parity::` (a name filter).
//!
//! A test that needs something beyond `scripts/setup.sh` (the peer venv of `scripts/setup.sh
//! --parity`, or node) is ignored, with the reason, on a machine without it: `build/tests.rs`
//! looks for them and sets `has_peer` / `has_node`.

#![allow(deprecated)] // Device::libtorch: burn-tch is deprecated upstream, and it is our backend.

// The modules live in tests/it/; the root stays `tests/it.rs` so that it is the one file
// Cargo finds in tests/ (each other `tests/*.rs` would be a binary of its own).
#[path = "common/mod.rs"]
mod common;

#[path = "it/bench.rs"]
mod bench;
#[path = "it/checkpoint.rs"]
mod checkpoint;
#[path = "it/cli.rs"]
mod cli;
#[path = "it/cuda_routes.rs"]
mod cuda_routes;
#[path = "it/dist.rs"]
mod dist;
#[path = "it/faults.rs"]
mod faults;
#[path = "it/fuzz.rs"]
mod fuzz;
#[path = "it/gpu_check.rs"]
mod gpu_check;
#[path = "it/house.rs"]
mod house;
#[path = "it/parity/mod.rs"]
mod parity;
#[path = "it/plan.rs"]
mod plan;
#[path = "it/resume.rs"]
mod resume;
#[path = "it/run_dirs.rs"]
mod run_dirs;
#[path = "it/tokenizer.rs"]
mod tokenizer;
#[path = "it/train.rs"]
mod train;
