//! llora's recipe: configuration, command line and (as the issues land) the training loop.
pub mod cli;
pub mod config;
pub mod mllog;
pub mod optim;
pub mod train;
