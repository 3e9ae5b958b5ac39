//! llora's recipe: configuration, command line and (as the issues land) the training loop.
#![recursion_limit = "256"] // serde_json::json! of the bench record
pub mod cli;
pub mod commands;
pub mod compliance;
pub mod config;
pub mod dist;
pub mod engine;
pub mod flops;
pub mod mlperf;
pub mod output;
pub mod paths;
pub mod plan;
pub mod plot;

/// LibTorch's CPU generator is one per process, and tests run on parallel threads: every test
/// that draws from it (building a model draws A) holds this lock, so that a test that seeds it
/// and expects the same masks twice is not disturbed.
#[cfg(test)]
pub(crate) static TORCH_RNG: std::sync::Mutex<()> = std::sync::Mutex::new(());
