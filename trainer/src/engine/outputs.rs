//! The names of what a run writes in its directory.

use crate::engine::checkpoints::RESUME;

/// The MLPerf result log of a run.
pub const RESULT_LOG: &str = "result_0.txt";
/// One JSON record per step and per evaluation.
pub const METRICS: &str = "metrics.jsonl";
/// TensorBoard's event files (`logging.tensorboard`).
pub const TENSORBOARD: &str = "tensorboard";
/// The loss plot.
pub const PLOT: &str = "loss.svg";
/// The adapters of a finished LoRA run (PEFT format).
pub const ADAPTER: &str = "adapter";
/// The weights of a finished full fine-tuning run (HF format).
pub const FULL_CHECKPOINT: &str = "checkpoint";

/// Everything a run writes in its directory; other files there are not llora's and stay.
pub const OUTPUTS: &[&str] = &[RESULT_LOG, METRICS, TENSORBOARD, PLOT, ADAPTER, FULL_CHECKPOINT, RESUME];
