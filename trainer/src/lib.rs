//! llora's recipe: configuration, command line and (as the issues land) the training loop.
pub mod bench;
pub mod cli;
pub mod collective;
pub mod config;
pub mod data_cmd;
pub mod mllog;
pub mod mlperf;
pub mod optim;
pub mod plot;
pub mod resume;
pub mod train;
