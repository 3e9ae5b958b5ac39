//! What a run shows and records: `metrics.jsonl` and the progress bar or log lines. On
//! data-parallel ranks other than 0 both are silent.

use std::io::Write;

use serde_json::json;
use tracing::info;

use crate::config::{Config, ProgressBar};
use crate::engine::events::{Observer, RunEvent};

/// `metrics.jsonl`: one JSON record per step and per evaluation, appended and flushed.
pub struct Metrics {
    /// None on ranks other than 0.
    file: Option<std::fs::File>,
    /// What the records so far hold for the loss plot (no label).
    pub curve: crate::plot::Curve,
}

impl Metrics {
    /// Opens `path` on rank 0 (records nothing elsewhere): a fresh run starts it empty; a run
    /// resumed at step `resumed_at` keeps the records up to that step and drops the later ones
    /// (steps a killed run made after its checkpoint, which the resumed run makes again).
    pub fn open(path: &std::path::Path, resumed_at: Option<usize>, main_rank: bool) -> anyhow::Result<Self> {
        use anyhow::Context;
        let mut metrics = Self { file: None, curve: crate::plot::Curve::default() };
        if !main_rank {
            return Ok(metrics);
        }
        let mut kept = String::new();
        if let Some(step) = resumed_at {
            let text = match std::fs::read_to_string(path) {
                Ok(t) => t,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
                Err(e) => return Err(e).with_context(|| format!("cannot read {}", path.display())),
            };
            for line in text.lines() {
                let Ok(record) = serde_json::from_str::<serde_json::Value>(line) else { continue };
                if record["step"].as_u64().is_some_and(|s| s as usize > step) {
                    continue;
                }
                metrics.curve.push_record(&record);
                kept.push_str(line);
                kept.push('\n');
            }
        }
        llora_model::checkpoint::write_atomic(path, kept.as_bytes())?;
        let file = std::fs::OpenOptions::new()
            .append(true)
            .open(path)
            .with_context(|| format!("cannot open {}", path.display()))?;
        metrics.file = Some(file);
        Ok(metrics)
    }

    /// Appends one record.
    fn write(&mut self, record: serde_json::Value) {
        self.curve.push_record(&record);
        // Metrics are for people; a full disk must not end the run (the result log reports it).
        if let Some(f) = self.file.as_mut() {
            let _ = writeln!(f, "{record}");
        }
    }
}

impl Observer for Metrics {
    fn observe(&mut self, event: &RunEvent<'_>) {
        match *event {
            RunEvent::Step(r) => {
                let mut record = json!({"step": r.step, "samples": r.samples, "loss": r.loss, "lr": r.lr,
                    "grad_norm": r.grad_norm, "tokens_per_s": r.tokens_per_s, "step_s": r.step_s,
                    "model_tflops_per_s": r.tflops, "mfu": r.mfu, "target_tokens": r.target_tokens});
                if let Some(documents) = r.documents {
                    // A sample of the schedule is a packed row: say how many documents the step took.
                    record["documents"] = documents.into();
                }
                for (name, v) in r.pairs.iter().flat_map(|p| p.named()) {
                    record[name] = v.into();
                }
                self.write(record);
            }
            RunEvent::Eval { step, samples, eval_loss, pairs, .. } => {
                let mut record = json!({"step": step, "samples": samples, "eval_loss": eval_loss});
                for (name, v) in pairs.iter().flat_map(|p| p.named()) {
                    record[format!("eval_{name}")] = v.into();
                }
                self.write(record);
            }
            _ => {}
        }
    }
}

/// Progress output: an indicatif bar on a terminal, periodic tracing lines otherwise.
pub struct Progress {
    bar: Option<indicatif::ProgressBar>,
    every: usize,
}

impl Progress {
    /// A bar (or log lines) from step `start`; silent when not `main_rank`.
    pub fn new(config: &Config, start: usize, main_rank: bool) -> Self {
        use std::io::IsTerminal;
        if !main_rank {
            return Self { bar: None, every: usize::MAX };
        }
        let show = match config.logging.progress {
            ProgressBar::Always => true,
            ProgressBar::Never => false,
            ProgressBar::Auto => std::io::stderr().is_terminal(),
        };
        let bar = show.then(|| {
            let bar = indicatif::ProgressBar::new(config.schedule.max_steps as u64);
            bar.set_style(
                indicatif::ProgressStyle::with_template(
                    "{elapsed_precise} [{bar:30}] step {pos}/{len} {msg} ETA {eta}",
                )
                .expect("valid template")
                .progress_chars("=> "),
            );
            bar.set_position(start as u64);
            bar
        });
        Self { bar, every: config.logging.every_steps }
    }

    /// Shows a finished step.
    pub fn step(&self, step: usize, samples: usize, loss: f64, lr: f64, grad_norm: f64, tok_s: f64) {
        match &self.bar {
            Some(bar) => {
                bar.set_position(step as u64);
                bar.set_message(format!("samples {samples} loss {loss:.4} lr {lr:.2e} {tok_s:.0} tok/s"));
            }
            None if self.every != usize::MAX && (step.is_multiple_of(self.every) || step == 1) => {
                info!(
                    step,
                    samples,
                    loss = format!("{loss:.4}"),
                    lr = format!("{lr:.2e}"),
                    grad_norm = format!("{grad_norm:.3}"),
                    tok_per_s = format!("{tok_s:.0}"),
                    "train"
                );
            }
            None => {}
        }
    }

    /// Runs `f` (which logs) with the bar hidden, so lines do not tear it.
    pub fn print<R>(&self, f: impl FnOnce() -> R) -> R {
        match &self.bar {
            Some(bar) => bar.suspend(f),
            None => f(),
        }
    }

    /// Clears the bar.
    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

impl Observer for Progress {
    fn observe(&mut self, event: &RunEvent<'_>) {
        match *event {
            RunEvent::Step(r) => self.step(r.step, r.samples, r.loss, r.lr, r.grad_norm, r.tokens_per_s),
            RunEvent::Eval { samples, eval_loss, target, pairs: None, .. } => {
                self.print(|| info!(samples, eval_loss = format!("{eval_loss:.4}"), target, "eval"))
            }
            RunEvent::Eval { samples, eval_loss, target, pairs: Some(p), .. } => self.print(|| {
                let (accuracy, margin) = (format!("{:.3}", p.rewards_accuracy), format!("{:.4}", p.rewards_margin));
                info!(
                    samples,
                    eval_loss = format!("{eval_loss:.4}"),
                    target,
                    reward_accuracy = accuracy,
                    reward_margin = margin,
                    "eval"
                )
            }),
            RunEvent::Checkpoint { step, dir } => self.print(|| info!(step, dir = %dir.display(), "checkpoint saved")),
            RunEvent::Interrupted | RunEvent::Stop { .. } => self.finish(),
            _ => {}
        }
    }
}

/// Peak resident set size of this process so far, in MB (`VmHWM`).
pub fn peak_rss_mb() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    Some(line.split_whitespace().nth(1)?.parse::<f64>().ok()? / 1024.0)
}
