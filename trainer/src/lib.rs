//! llora's recipe: configuration, command line and the training loop.
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
