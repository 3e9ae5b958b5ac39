//! llora's recipe: configuration, command line and (as the issues land) the training loop.
#![recursion_limit = "256"] // serde_json::json! of the bench record
pub mod checkpoints;
pub mod cli;
pub mod commands;
pub mod compliance;
pub mod config;
pub mod dist;
pub mod flops;
pub mod mllog;
pub mod mlperf;
pub mod observe;
pub mod optim;
pub mod paths;
pub mod plan;
pub mod plot;
pub mod resume;
pub mod run_dir;
pub mod step;
pub mod train;
