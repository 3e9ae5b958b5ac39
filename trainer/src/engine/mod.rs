//! The training engine, read top-down: `train.rs` is the run in one page (the ranks agree, the
//! start decided once), `trainer.rs` the [`trainer::Trainer`] with all its methods (set-up,
//! the loop, evaluation, checkpoints, the finish), `setup.rs` the set-up's named steps, `records.rs` the run's records, `outcome.rs` how a run
//! ended; `step.rs` one optimizer step (micro-batches, gradients, the all-reduce, clipping),
//! `eval.rs` an evaluation pass; `optim.rs` AdamW and the schedule; `checkpoints.rs`,
//! `resume.rs` and `run_dir.rs` what a run leaves on disk and how it continues (`claim.rs`: the directory a run holds; `run_lock.rs`: a live run's lock on it; `outputs.rs`: the names of what it writes); `events.rs`
//! what a run emits (start, step, eval, checkpoint, stop) and the `Observer`s that record it:
//! `mllog.rs` the MLPerf result log, `observe.rs` metrics and progress, `tensorboard.rs` TensorBoard's event file; `stop_signal.rs`
//! SIGINT/SIGTERM. The commands (`crate::commands`) call it; it parses no arguments.

pub mod checkpoints;
pub mod claim;
pub mod eval;
pub mod events;
mod grad_reduce;
pub mod mllog;
pub mod observe;
pub mod optim;
pub mod outcome;
pub mod outputs;
pub mod pretrain;
pub mod records;
pub mod reference;
pub mod resume;
pub mod run_dir;
pub mod run_lock;
pub mod setup;
pub mod step;
pub mod stop_signal;
pub mod tensorboard;
pub mod train;
pub mod trainer;
