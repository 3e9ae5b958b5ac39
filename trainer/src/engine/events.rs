//! What a run tells the world: the engine emits [`RunEvent`]s as it goes (start, step,
//! evaluation, checkpoint, stop), and each record of it is an [`Observer`] of them: the MLPerf
//! result log (`mllog.rs`), `metrics.jsonl` and the progress bar (`observe.rs`). The engine
//! writes no record itself; a new record (a dashboard, a W&B-style sink) is a new observer.

use std::path::Path;

/// `run_stop`'s status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunStatus {
    /// The eval loss reached the target.
    Success,
    /// `max_steps` ran out (or the run failed).
    Aborted,
}

impl RunStatus {
    /// The name the result log uses.
    pub fn name(self) -> &'static str {
        match self {
            Self::Success => "success",
            Self::Aborted => "aborted",
        }
    }
}

/// One optimizer step, as the records show it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepReport {
    /// Steps done, this one included.
    pub step: usize,
    /// Training samples consumed (rows of the schedule: packed rows when packing).
    pub samples: usize,
    /// The step's loss (token-normalised over the global batch).
    pub loss: f64,
    /// The learning rate it used.
    pub lr: f64,
    /// The gradient norm before clipping.
    pub grad_norm: f64,
    /// Tokens per second on this rank since training began.
    pub tokens_per_s: f64,
    /// The step's wall time.
    pub step_s: f64,
    /// Model TFLOP/s per rank.
    pub tflops: f64,
    /// `tflops` over the GPU's dense bf16 peak, when known.
    pub mfu: Option<f64>,
    /// Target tokens of the global batch.
    pub target_tokens: usize,
    /// Documents the step took, when rows are packed.
    pub documents: Option<usize>,
    /// Preference tuning: the pairs' rewards, accuracy, margin and log-probabilities.
    pub pairs: Option<llora_model::PairStats>,
}

/// What happened in a run, in the order runs emit them.
#[derive(Debug, Clone, PartialEq)]
pub enum RunEvent<'a> {
    /// Set-up begins (the device is up; the model is about to be built).
    Init,
    /// Every rank is ready: the clock starts at `time_ms` (epoch ms; a resumed run's clock
    /// started in its first attempt).
    Start {
        /// Epoch milliseconds.
        time_ms: u64,
    },
    /// The datasets are read.
    Data {
        /// Training samples, in the schedule's unit: documents, or packed rows when rows are
        /// packed (the training set packed in its file order).
        train: usize,
        /// Evaluation samples, in the same unit (evaluation packs in order: exact).
        eval: usize,
        /// The documents (train, eval) when rows are packed.
        packed_documents: Option<(usize, usize)>,
    },
    /// A training block begins (after set-up, and after each evaluation short of the target).
    Block {
        /// Samples consumed so far.
        samples: usize,
    },
    /// A step finished.
    Step(&'a StepReport),
    /// An evaluation begins.
    EvalStart {
        /// Samples consumed so far.
        samples: usize,
    },
    /// An evaluation finished.
    Eval {
        /// Steps done.
        step: usize,
        /// Samples consumed.
        samples: usize,
        /// The evaluation loss (`eval.averaging`).
        eval_loss: f64,
        /// `eval.target_loss`.
        target: f64,
        /// Preference tuning: the held-out pairs' rewards, accuracy, margin and log-probabilities.
        pairs: Option<llora_model::PairStats>,
    },
    /// A checkpoint was saved (rank 0).
    Checkpoint {
        /// Steps it holds.
        step: usize,
        /// Where.
        dir: &'a Path,
    },
    /// SIGINT/SIGTERM stopped the run after a checkpoint; a resumed run continues it.
    Interrupted,
    /// The run ended: its final outputs are saved when it ended normally, and nothing more
    /// happens in it.
    Stop {
        /// Samples consumed.
        samples: usize,
        /// How it ended.
        status: RunStatus,
        /// When training ended (epoch ms), taken before the final outputs were saved.
        time_ms: u64,
    },
}

/// A record of a run.
pub trait Observer {
    /// Records `event`. Records are for people and harnesses: a failing one says so in the log
    /// and never stops the run.
    fn observe(&mut self, event: &RunEvent<'_>);
}
