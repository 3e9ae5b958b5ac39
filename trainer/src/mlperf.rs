//! MLPerf result logs: what one says of its run, and the score of a set of them.
//!
//! The score follows the MLPerf Training rules for `llama2_70b_lora`: a result is a set of
//! runs (`result_<n>.txt`, 10 for a submission); each run's time is `run_stop − run_start` in
//! minutes; the fastest and slowest are dropped and the rest averaged (olympic mean); at most
//! one run may end without `status: success`, and it then counts as the slowest; the mean is
//! multiplied by `scaling_factor` from `scaling.json` beside the logs when it exists (the RCP
//! scaling MLCommons applies to submissions that converge faster than the reference).

use std::path::{Path, PathBuf};

use anyhow::{Context, bail, ensure};
use serde::Deserialize;
use serde_json::{Value, json};

/// What one result log says about its run.
#[derive(Debug, Clone, PartialEq)]
pub struct RunResult {
    /// The log file.
    pub file: PathBuf,
    /// The `seed` event's value, when logged.
    pub seed: Option<u64>,
    /// `run_stop`'s status (`success`, `aborted`), or `None` when the log has no `run_stop`
    /// (a crashed run).
    pub status: Option<String>,
    /// `samples_count` at `run_stop`.
    pub samples: Option<u64>,
    /// run_stop − run_start in minutes (`None` without `run_stop`).
    pub minutes: Option<f64>,
    /// `submission_benchmark`, when logged.
    pub benchmark: Option<String>,
    /// `submission_platform` (the system), when logged.
    pub platform: Option<String>,
}

/// The benchmark `llora mlperf score` scores.
pub const BENCHMARK: &str = "llama2_70b_lora";

impl RunResult {
    /// Converged: `run_stop` with status `success`.
    pub fn converged(&self) -> bool {
        self.status.as_deref() == Some("success")
    }
}

/// The score of a results directory.
#[derive(Debug, Clone, PartialEq)]
pub struct Score {
    /// Every run, in file order (`result_0`, `result_1`, ...).
    pub runs: Vec<RunResult>,
    /// Index into `runs` of the run dropped as fastest.
    pub fastest: usize,
    /// Index into `runs` of the run dropped as slowest (the non-converged one when there is one).
    pub slowest: usize,
    /// `scaling_factor` from `scaling.json`, 1 without it.
    pub scaling: f64,
    /// Olympic mean × scaling, in minutes.
    pub minutes: f64,
}

/// Reads one `:::MLLOG` result log.
pub fn read_result(path: &Path) -> anyhow::Result<RunResult> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let (mut start, mut stop, mut status, mut samples, mut seed) = (None, None, None, None, None);
    let (mut benchmark, mut platform) = (None, None);
    for (i, line) in text.lines().enumerate() {
        let Some(record) = line.find(":::MLLOG").map(|at| &line[at + ":::MLLOG".len()..]) else { continue };
        let v: Value = serde_json::from_str(record.trim())
            .with_context(|| format!("{}:{}: the :::MLLOG record is not JSON", path.display(), i + 1))?;
        let time =
            || v["time_ms"].as_f64().with_context(|| format!("{}:{}: no numeric time_ms", path.display(), i + 1));
        match v["key"].as_str() {
            Some("run_start") => {
                ensure!(start.is_none(), "{}:{}: a second run_start", path.display(), i + 1);
                start = Some(time()?);
            }
            Some("run_stop") => {
                ensure!(stop.is_none(), "{}:{}: a second run_stop", path.display(), i + 1);
                stop = Some(time()?);
                status = v["metadata"]["status"].as_str().map(str::to_string);
                samples = v["metadata"]["samples_count"].as_u64();
            }
            Some("seed") => seed = v["value"].as_u64(),
            Some("submission_benchmark") => benchmark = Some(v["value"].as_str().unwrap_or_default().to_string()),
            Some("submission_platform") => platform = Some(v["value"].as_str().unwrap_or_default().to_string()),
            _ => {}
        }
    }
    let start =
        start.with_context(|| format!("{}: no run_start: not a result log of a started run", path.display()))?;
    if let Some(stop) = stop {
        ensure!(stop >= start, "{}: run_stop is earlier than run_start", path.display());
    }
    Ok(RunResult {
        file: path.to_path_buf(),
        seed,
        status: stop.and(status.or(Some("unknown".into()))),
        samples,
        minutes: stop.map(|stop| (stop - start) / 60_000.0),
        benchmark,
        platform,
    })
}

/// `result_<n>.txt` files of a directory, ordered by `n`.
pub fn result_files(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let mut files = Vec::new();
    for entry in
        std::fs::read_dir(dir).with_context(|| format!("cannot read the results directory {}", dir.display()))?
    {
        let path = entry?.path();
        let n = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_prefix("result_"))
            .and_then(|n| n.strip_suffix(".txt"))
            .and_then(|n| n.parse::<u64>().ok());
        if let Some(n) = n {
            files.push((n, path));
        }
    }
    files.sort();
    Ok(files.into_iter().map(|(_, p)| p).collect())
}

#[derive(Deserialize)]
struct Scaling {
    scaling_factor: f64,
}

/// Scores the runs in `dir` (see the module docs for the rules).
pub fn score_dir(dir: &Path) -> anyhow::Result<Score> {
    let files = result_files(dir)?;
    ensure!(!files.is_empty(), "{}: no result_<n>.txt files", dir.display());
    let runs = files.iter().map(|f| read_result(f)).collect::<anyhow::Result<Vec<_>>>()?;
    let scaling_path = dir.join("scaling.json");
    let scaling = if scaling_path.is_file() {
        let text = std::fs::read_to_string(&scaling_path)
            .with_context(|| format!("cannot read {}", scaling_path.display()))?;
        let s: Scaling = serde_json::from_str(&text)
            .with_context(|| format!("{}: expected {{\"scaling_factor\": <number>}}", scaling_path.display()))?;
        ensure!(
            s.scaling_factor.is_finite() && s.scaling_factor > 0.0,
            "{}: scaling_factor {} is not a positive number",
            scaling_path.display(),
            s.scaling_factor
        );
        s.scaling_factor
    } else {
        1.0
    };
    score(runs, scaling)
}

/// The olympic mean of `runs` × `scaling`, in minutes.
pub fn score(runs: Vec<RunResult>, scaling: f64) -> anyhow::Result<Score> {
    ensure!(runs.len() >= 3, "{} runs: an olympic mean needs at least 3 (MLPerf asks for 10)", runs.len());
    // One benchmark on one system: a score over another benchmark's logs, or a mix, means nothing.
    for r in &runs {
        if let Some(b) = r.benchmark.as_deref().filter(|b| *b != BENCHMARK) {
            bail!(
                "{} is a result log of the benchmark {b:?}, not {BENCHMARK}: it cannot be scored here",
                r.file.display()
            );
        }
    }
    let mut platforms = runs.iter().filter_map(|r| r.platform.as_deref().map(|p| (p, &r.file)));
    if let Some((first, first_file)) = platforms.next()
        && let Some((other, file)) = platforms.find(|(p, _)| p != &first)
    {
        bail!(
            "the logs come from different systems: {} ran on {first:?}, {} on {other:?}; score each system's runs apart",
            first_file.display(),
            file.display()
        );
    }
    let failed: Vec<&RunResult> = runs.iter().filter(|r| !r.converged()).collect();
    if failed.len() > 1 {
        let names: Vec<String> = failed
            .iter()
            .map(|r| format!("{} ({})", r.file.display(), r.status.as_deref().unwrap_or("no run_stop")))
            .collect();
        bail!("{} runs did not converge, at most one may: {}", failed.len(), names.join(", "));
    }
    // A non-converged run is the slowest whatever its clock says.
    let key =
        |r: &RunResult| if r.converged() { r.minutes.expect("converged runs have run_stop") } else { f64::INFINITY };
    let mut order: Vec<usize> = (0..runs.len()).collect();
    order.sort_by(|&a, &b| key(&runs[a]).total_cmp(&key(&runs[b])));
    let (fastest, slowest) = (order[0], order[order.len() - 1]);
    let kept = &order[1..order.len() - 1];
    let mean = kept.iter().map(|&i| key(&runs[i])).sum::<f64>() / kept.len() as f64;
    Ok(Score { runs, fastest, slowest, scaling, minutes: mean * scaling })
}

impl Score {
    /// The per-run table and the score, for a terminal.
    pub fn table(&self) -> String {
        let mut out = String::from("run  file            seed        status    samples  minutes\n");
        for (i, r) in self.runs.iter().enumerate() {
            let name = r.file.file_name().map_or_else(String::new, |n| n.to_string_lossy().into_owned());
            let note = if i == self.fastest {
                "  dropped (fastest)"
            } else if i == self.slowest {
                "  dropped (slowest)"
            } else {
                ""
            };
            out += &format!(
                "{i:<4} {name:<15} {:<11} {:<9} {:>7}  {:>7}{note}\n",
                r.seed.map_or("-".into(), |s| s.to_string()),
                r.status.as_deref().unwrap_or("no stop"),
                r.samples.map_or("-".into(), |s| s.to_string()),
                r.minutes.map_or("-".into(), |m| format!("{m:.3}")),
            );
        }
        let n = self.runs.len();
        out += &format!("score: {:.2} min (olympic mean of {} of {n} runs", self.minutes, n - 2);
        if self.scaling != 1.0 {
            out += &format!(" x scaling_factor {:.6}", self.scaling);
        }
        out += ")";
        if n != 10 {
            out += &format!("; MLPerf asks for 10 runs, this is {n}");
        }
        out + "\n"
    }

    /// The score as one JSON object (the last line `llora mlperf score` prints).
    pub fn json(&self) -> Value {
        json!({
            "score_min": self.minutes,
            "runs": self.runs.len(),
            "converged": self.runs.iter().filter(|r| r.converged()).count(),
            "scaling_factor": self.scaling,
            "minutes": self.runs.iter().map(|r| r.minutes).collect::<Vec<_>>(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(minutes: f64, status: &str) -> RunResult {
        RunResult {
            file: format!("result_{minutes}.txt").into(),
            seed: None,
            status: Some(status.into()),
            samples: Some(1),
            minutes: Some(minutes),
            benchmark: Some(BENCHMARK.into()),
            platform: Some("1xcpu".into()),
        }
    }

    /// Logs of another benchmark, or of several systems, are refused naming the log.
    #[test]
    fn scores_one_benchmark_on_one_system() {
        let runs = || vec![run(3.0, "success"), run(1.0, "success"), run(10.0, "success")];
        let mut other = runs();
        other[1].benchmark = Some("bert".into());
        let err = score(other, 1.0).unwrap_err().to_string();
        assert!(err.contains("result_1.txt") && err.contains("\"bert\""), "{err}");
        let mut mixed = runs();
        mixed[2].platform = Some("8xH100".into());
        let err = score(mixed, 1.0).unwrap_err().to_string();
        assert!(err.contains("result_10.txt") && err.contains("8xH100") && err.contains("different systems"), "{err}");
        let mut unlabelled = runs();
        unlabelled[0].platform = None;
        assert!(score(unlabelled, 1.0).is_ok(), "a log without the key is not a mix");
    }

    #[test]
    fn olympic_mean_drops_fastest_and_slowest() {
        let s = score(vec![run(3.0, "success"), run(1.0, "success"), run(10.0, "success"), run(5.0, "success")], 1.0)
            .unwrap();
        assert_eq!((s.fastest, s.slowest), (1, 2));
        assert_eq!(s.minutes, 4.0);
        let s = score(vec![run(3.0, "success"), run(1.0, "success"), run(10.0, "success"), run(5.0, "success")], 0.5)
            .unwrap();
        assert_eq!(s.minutes, 2.0);
    }

    #[test]
    fn one_failed_run_counts_as_slowest_two_invalidate() {
        // The aborted run is the quickest by the clock but is dropped as the slowest, so the
        // 10-minute run now counts.
        let s = score(vec![run(3.0, "success"), run(0.5, "aborted"), run(10.0, "success"), run(1.0, "success")], 1.0)
            .unwrap();
        assert_eq!((s.fastest, s.slowest), (3, 1));
        assert_eq!(s.minutes, 6.5);
        let crashed = RunResult { status: None, minutes: None, ..run(0.0, "") };
        let s =
            score(vec![run(3.0, "success"), crashed.clone(), run(10.0, "success"), run(1.0, "success")], 1.0).unwrap();
        assert_eq!(s.slowest, 1);
        let err = score(vec![run(3.0, "success"), run(0.5, "aborted"), crashed, run(1.0, "success")], 1.0).unwrap_err();
        assert!(err.to_string().contains("2 runs did not converge"), "{err}");
        assert!(score(vec![run(1.0, "success"), run(2.0, "success")], 1.0).is_err());
    }

    #[test]
    fn reads_a_log_and_names_bad_lines() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("result_0.txt");
        std::fs::write(
            &p,
            "noise\n:::MLLOG {\"key\": \"seed\", \"value\": 7, \"time_ms\": 1}\n\
             :::MLLOG {\"key\": \"run_start\", \"value\": null, \"time_ms\": 1000}\n\
             :::MLLOG {\"key\": \"run_stop\", \"value\": null, \"time_ms\": 91000, \"metadata\": {\"status\": \"success\", \"samples_count\": 48}}\n",
        )
        .unwrap();
        let r = read_result(&p).unwrap();
        assert_eq!(
            (r.seed, r.status.as_deref(), r.samples, r.minutes),
            (Some(7), Some("success"), Some(48), Some(1.5))
        );
        std::fs::write(&p, ":::MLLOG {\"key\": \"run_start\", \"time_ms\": 1}\n:::MLLOG {\"key\": \n").unwrap();
        let err = format!("{:#}", read_result(&p).unwrap_err());
        assert!(err.contains("result_0.txt:2"), "{err}");
    }
}
