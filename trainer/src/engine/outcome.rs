//! How a run ended: its [`Outcome`], or [`Interrupted`] by a signal after saving a checkpoint.

use std::path::PathBuf;

use crate::engine::events::RunStatus;

/// How a run ended.
#[derive(Debug, Clone, PartialEq)]
pub struct Outcome {
    /// Target reached, or not.
    pub status: RunStatus,
    /// Training samples consumed.
    pub samples: usize,
    /// Last evaluation loss, if any evaluation ran.
    pub eval_loss: Option<f64>,
    /// run_stop − run_start, seconds.
    pub time_to_train_s: f64,
    /// The MLPerf result log (written by rank 0).
    pub result_log: PathBuf,
}

/// A run stopped by SIGINT/SIGTERM after saving its checkpoint; `llora` exits with 130 for it,
/// as shells do for Ctrl-C, so schedulers can tell it from a failure.
#[derive(Debug, thiserror::Error)]
#[error("interrupted after step {step}; checkpoint saved in {}; continue with `llora train --resume {}`", checkpoint.display(), run_dir.display())]
pub struct Interrupted {
    /// Steps completed (and saved).
    pub step: usize,
    /// The checkpoint directory written.
    pub checkpoint: std::path::PathBuf,
    /// The run directory to pass to `--resume`.
    pub run_dir: std::path::PathBuf,
}
