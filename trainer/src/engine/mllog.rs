//! MLPerf logging: `:::MLLOG {json}` lines as the official compliance checker reads them.
//!
//! Every line carries `namespace`, `time_ms`, `event_type`, `key`, `value` and `metadata` with
//! the call site's `file` and `lineno` (the checker fails on a line without metadata), plus
//! `samples_count` and `status` where the rules ask for them.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::panic::Location;
use std::path::Path;
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::Context;
use serde_json::{Map, Value, json};

/// Milliseconds since the Unix epoch.
pub fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// A result log (`result_<n>.txt`), flushed line by line so a crash loses nothing written.
pub struct MlLogger {
    out: BufWriter<File>,
    /// Echo lines to stdout as well (MLPerf harnesses collect them from there).
    pub echo: bool,
}

impl MlLogger {
    /// Creates (truncates) the log file.
    pub fn create(path: &Path, echo: bool) -> anyhow::Result<Self> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
        }
        let file = File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
        Ok(Self { out: BufWriter::new(file), echo })
    }

    /// Opens an existing log for appending (a resumed run).
    pub fn append(path: &Path, echo: bool) -> anyhow::Result<Self> {
        let file = std::fs::OpenOptions::new()
            .append(true)
            .create(true)
            .open(path)
            .with_context(|| format!("cannot open {} for appending", path.display()))?;
        Ok(Self { out: BufWriter::new(file), echo })
    }

    fn line(&mut self, event_type: &str, key: &str, value: Value, extra: Map<String, Value>, at: &Location<'_>) {
        self.line_at(now_ms(), event_type, key, value, extra, at);
    }

    fn line_at(
        &mut self,
        time_ms: u64,
        event_type: &str,
        key: &str,
        value: Value,
        extra: Map<String, Value>,
        at: &Location<'_>,
    ) {
        let mut metadata = Map::new();
        metadata.insert("file".into(), json!(at.file()));
        metadata.insert("lineno".into(), json!(at.line()));
        metadata.extend(extra);
        let record = json!({
            "namespace": "",
            "time_ms": time_ms,
            "event_type": event_type,
            "key": key,
            "value": value,
            "metadata": metadata,
        });
        let text = format!(":::MLLOG {record}");
        // A full disk must not kill a training run; the checker will then report the gap.
        if writeln!(self.out, "{text}").and_then(|_| self.out.flush()).is_err() {
            tracing::error!("cannot write the MLPerf result log");
        }
        if self.echo {
            crate::outln!("{text}");
        }
    }

    /// A `POINT_IN_TIME` event.
    #[track_caller]
    pub fn event(&mut self, key: &str, value: impl Into<Value>) {
        self.line("POINT_IN_TIME", key, value.into(), Map::new(), Location::caller());
    }

    /// A `POINT_IN_TIME` event with extra metadata (e.g. `samples_count`).
    #[track_caller]
    pub fn event_with(&mut self, key: &str, value: impl Into<Value>, metadata: Value) {
        self.line("POINT_IN_TIME", key, value.into(), as_map(metadata), Location::caller());
    }

    /// An `INTERVAL_START` event.
    #[track_caller]
    pub fn start(&mut self, key: &str, metadata: Value) {
        self.line("INTERVAL_START", key, Value::Null, as_map(metadata), Location::caller());
    }

    /// An `INTERVAL_END` event.
    #[track_caller]
    pub fn end(&mut self, key: &str, metadata: Value) {
        self.line("INTERVAL_END", key, Value::Null, as_map(metadata), Location::caller());
    }

    /// An `INTERVAL_END` event stamped `time_ms` (an end taken before work that must not count).
    #[track_caller]
    pub fn end_at(&mut self, key: &str, metadata: Value, time_ms: u64) {
        self.line_at(time_ms, "INTERVAL_END", key, Value::Null, as_map(metadata), Location::caller());
    }
}

fn as_map(v: Value) -> Map<String, Value> {
    match v {
        Value::Object(m) => m,
        Value::Null => Map::new(),
        other => panic!("mllog metadata must be a JSON object, got {other}"),
    }
}

/// The result log of one training run, which owns the order of the MLPerf events.
///
/// The rules' order is: `cache_clear`, `init_start`, submission and hyperparameter keys,
/// `init_stop`, `run_start`, dataset sizes, then blocks (`block_start`, `train_loss`,
/// `block_stop`, `eval_start`, `eval_accuracy`, `eval_stop`) and `run_stop`. A resumed run appends
/// to the log of the interrupted one and so skips everything up to and including the dataset
/// sizes. Ranks other than 0 hold no file: every call is a no-op there.
pub struct RunLog {
    out: Option<MlLogger>,
    resumed: bool,
    /// A `block_start` without its `block_stop`.
    in_block: bool,
    /// `run_stop` was written: later calls write nothing.
    stopped: bool,
}

impl RunLog {
    /// Opens `path` on rank 0 (created, or appended to when `resumed`); nothing elsewhere.
    pub fn open(path: &Path, main_rank: bool, resumed: bool) -> anyhow::Result<Self> {
        let out = match (main_rank, resumed) {
            (false, _) => None,
            (true, false) => Some(MlLogger::create(path, false)?),
            (true, true) => Some(MlLogger::append(path, false)?),
        };
        Ok(Self { out, resumed, in_block: false, stopped: false })
    }

    fn fresh(&mut self) -> Option<&mut MlLogger> {
        if self.resumed { None } else { self.out.as_mut() }
    }

    /// `cache_clear`, `init_start` and the submission keys.
    pub fn init_start(&mut self, submission: &[(&str, Value)]) {
        if let Some(ml) = self.fresh() {
            ml.event("cache_clear", true);
            ml.start("init_start", json!(null));
            for (k, v) in submission {
                ml.event(k, v.clone());
            }
        }
    }

    /// The hyperparameter keys, `init_stop` and `run_start`: the clock starts. Returns the
    /// run_start time (epoch ms) of a fresh run.
    pub fn run_start(&mut self, hyperparameters: &[(&str, Value)]) -> Option<u64> {
        let ml = self.fresh()?;
        for (k, v) in hyperparameters {
            ml.event(k, v.clone());
        }
        ml.end("init_stop", json!(null));
        ml.start("run_start", json!(null));
        Some(now_ms())
    }

    /// The dataset sizes (logged after run_start: the rules forbid touching the data before).
    pub fn datasets(&mut self, train: usize, eval: usize) {
        if let Some(ml) = self.fresh() {
            ml.event("train_samples", train);
            ml.event("eval_samples", eval);
        }
    }

    /// A training block begins at `samples`.
    pub fn block_start(&mut self, samples: usize) {
        self.in_block = true;
        if let Some(ml) = self.out.as_mut() {
            ml.start("block_start", json!({"samples_count": samples}));
        }
    }

    /// The block ends with its last training loss, and an evaluation starts.
    pub fn eval_start(&mut self, samples: usize, train_loss: f64) {
        self.in_block = false;
        if let Some(ml) = self.out.as_mut() {
            ml.event_with("train_loss", train_loss, json!({"samples_count": samples}));
            ml.end("block_stop", json!({"samples_count": samples}));
            ml.start("eval_start", json!({"samples_count": samples}));
        }
    }

    /// The evaluation's result.
    pub fn eval_stop(&mut self, samples: usize, eval_loss: f64) {
        if let Some(ml) = self.out.as_mut() {
            ml.event_with("eval_accuracy", eval_loss, json!({"samples_count": samples}));
            ml.end("eval_stop", json!({"samples_count": samples}));
        }
    }

    /// The run ends (an open training block is closed first); only the first call writes, so
    /// a failure after a `run_stop` does not add a second one.
    pub fn run_stop(&mut self, samples: usize, status: &str) {
        self.run_stop_at(samples, status, now_ms());
    }

    /// [`Self::run_stop`] stamped `time_ms`: the run's end, taken before its final outputs are
    /// saved (they are written before `run_stop`, so that a log with a `run_stop` always has
    /// them, and saving them does not count in the time to train).
    pub fn run_stop_at(&mut self, samples: usize, status: &str, time_ms: u64) {
        if std::mem::replace(&mut self.stopped, true) {
            return;
        }
        let in_block = std::mem::replace(&mut self.in_block, false);
        if let Some(ml) = self.out.as_mut() {
            if in_block {
                ml.end_at("block_stop", json!({"samples_count": samples}), time_ms);
            }
            ml.end_at("run_stop", json!({"samples_count": samples, "status": status}), time_ms);
        }
    }

    /// `r`, with an aborted `run_stop` written first when it is an error: whatever fails after
    /// `run_start` ends the result log.
    pub fn stop_on_error<T>(&mut self, samples: usize, r: anyhow::Result<T>) -> anyhow::Result<T> {
        if r.is_err() {
            self.run_stop(samples, "aborted");
        }
        r
    }
}
