//! The run's records: the MLPerf result log, `metrics.jsonl`, TensorBoard's event file and the
//! progress bar, each an observer of the run's events.

use anyhow::Context;
use llora_data::batch::Geometry;

use crate::config::Config;
use crate::dist::Dist;
use crate::engine::events::{Observer, RunEvent, RunStatus};
use crate::engine::mllog::{MlperfKeys, RunLog, now_ms};
use crate::engine::observe::{Metrics, Progress};
use crate::engine::outputs;
use crate::engine::tensorboard::EventFile;

/// The run's records: the MLPerf result log, `metrics.jsonl` and the progress bar, each an
/// [`Observer`] of the run's events (silent on ranks other than 0).
pub(crate) struct Records {
    log: RunLog,
    pub(crate) metrics: Metrics,
    events: EventFile,
    bar: Progress,
}

impl Records {
    /// Opens the records of a run in `config.run.dir`: fresh, or continuing a run resumed at
    /// step `resumed_at` (the result log appended to, `metrics.jsonl` cut to that step).
    pub(crate) fn open(
        config: &Config,
        name: &str,
        dist: &Dist,
        geometry: Geometry,
        resumed_at: Option<usize>,
    ) -> anyhow::Result<Self> {
        let (run_dir, main) = (&config.run.dir, dist.is_main());
        if main {
            std::fs::create_dir_all(run_dir).with_context(|| format!("cannot create run.dir {}", run_dir.display()))?;
        }
        let keys = MlperfKeys::of(config, dist.world.nodes(), geometry.accumulation(), name);
        // A resumed run appends to its log; that log then tells the story of an interrupted
        // run, which the MLPerf rules do not accept as a result (they time uninterrupted runs).
        let log = RunLog::open(&run_dir.join(outputs::RESULT_LOG), main, resumed_at.is_some(), keys)?;
        let metrics = Metrics::open(&run_dir.join(outputs::METRICS), resumed_at, main)?;
        let events = EventFile::open(run_dir, config.logging.tensorboard, main)?;
        let bar = Progress::new(config, resumed_at.unwrap_or(0), main);
        Ok(Self { log, metrics, events, bar })
    }

    /// Removes what a fresh run's records wrote (rank 0), when it failed before `run_start`.
    pub(crate) fn discard(self, config: &Config, main: bool) {
        drop(self);
        if main {
            for name in [outputs::RESULT_LOG, outputs::METRICS] {
                let _ = std::fs::remove_file(config.run.dir.join(name));
            }
            let _ = std::fs::remove_dir_all(config.run.dir.join(outputs::TENSORBOARD));
        }
    }

    /// Tells every record what happened.
    pub(crate) fn emit(&mut self, event: RunEvent<'_>) {
        self.log.observe(&event);
        self.metrics.observe(&event);
        self.events.observe(&event);
        self.bar.observe(&event);
    }

    /// `r`, with the run stopped (aborted) first when it is an error: whatever fails after
    /// `run_start` ends the result log.
    pub(crate) fn stop_on_error<T>(&mut self, samples: usize, r: anyhow::Result<T>) -> anyhow::Result<T> {
        if r.is_err() {
            self.emit(RunEvent::Stop { samples, status: RunStatus::Aborted, time_ms: now_ms() });
        }
        r
    }
}
