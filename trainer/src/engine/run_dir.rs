//! Where `llora train` writes: a rerun never destroys an earlier run.
//!
//! A fresh run looks at `run.dir` before it writes anything:
//! - absent, or holding none of a run's outputs: the run writes there;
//! - holding an earlier run's results (a finished run, or one that stopped before its first
//!   checkpoint): the run writes into the first free sibling, `DIR-2`, `DIR-3`, ..., and says so
//!   at start, so that the same command can be run again and again;
//! - holding an interrupted run (a checkpoint and no final results): with `run.resume = "auto"`
//!   (the default under torchrun and SLURM) the run continues it from its newest intact
//!   checkpoint, if its config is this one's; otherwise refused before any write, naming the
//!   ways on (`--resume DIR`, `run.resume = "auto"`, another `run.dir`), since a second run
//!   there would make its checkpoint and log disagree;
//! - a restarted attempt (torchrun `--max-restarts`, SLURM requeue) whose predecessor wrote
//!   into `DIR-N` (because `DIR` held an earlier run) finds that directory again: the last one
//!   of the `DIR`, `DIR-2`, ... chain; if its predecessor died before its first checkpoint,
//!   the attempt starts over there, replacing those partial outputs; if its predecessor
//!   finished there (a run that ended without reaching its target exits 1, and the launcher
//!   restarts it), the attempt reports that run's outcome and trains nothing: a restart only
//!   ever continues an interrupted run, never repeats a finished one;
//! - `--overwrite`: the earlier outputs are moved into `DIR/.replaced/` and deleted only once the
//!   new run has saved its first checkpoint or its results; if it fails before that, they are
//!   moved back.
//!
//! With several ranks, rank 0 decides (and moves files), publishes its decision in the c10d
//! store, and every rank follows it, or fails with rank 0's reason.
//!
//! A live run's directory is refused to every other run (its lock: `run_lock.rs`).

use std::path::{Path, PathBuf};

use anyhow::Context;
use tracing::info;

use crate::dist::Collective;
use crate::engine::checkpoints::{REPLACED, RESUME};
use crate::engine::claim::Claim;
use crate::engine::outputs::{ADAPTER, FULL_CHECKPOINT, OUTPUTS, RESULT_LOG};
use crate::engine::run_lock::refuse_if_live;

/// What a directory holds, as far as runs go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Holds {
    /// Absent, or none of a run's outputs.
    Nothing,
    /// A run that ended: its adapters (or full weights) were saved.
    Finished,
    /// A run with a checkpoint and no final results: `llora train --resume` continues it.
    Interrupted,
    /// Outputs of a run that ended before its first checkpoint (nothing to resume).
    Partial,
}

/// Looks at `dir` without changing it.
pub fn inspect(dir: &Path) -> Holds {
    if !OUTPUTS.iter().any(|name| dir.join(name).symlink_metadata().is_ok()) {
        return Holds::Nothing;
    }
    let checkpoints = !crate::engine::checkpoints::list(dir).is_empty();
    // Final weights are saved before `run_stop` is logged: with checkpoints and no `run_stop`,
    // the run was stopped while saving them, and resuming completes it.
    let saved = dir.join(ADAPTER).exists() || dir.join(FULL_CHECKPOINT).exists();
    if saved && (!checkpoints || has_run_stop(dir)) {
        Holds::Finished
    } else if checkpoints {
        Holds::Interrupted
    } else {
        Holds::Partial
    }
}

/// Whether the result log in `dir` has its `run_stop`.
fn has_run_stop(dir: &Path) -> bool {
    let Ok(log) = std::fs::read_to_string(dir.join(RESULT_LOG)) else { return false };
    log.lines()
        .filter_map(|l| l.strip_prefix(":::MLLOG "))
        .any(|json| serde_json::from_str::<serde_json::Value>(json).is_ok_and(|v| v["key"] == "run_stop"))
}

/// How a fresh run treats what it finds in `run.dir`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Policy {
    /// `--overwrite`: replace an earlier run.
    pub overwrite: bool,
    /// `run.resume` is auto: continue an interrupted run of the same config.
    pub auto_resume: bool,
    /// A launcher restarted this job (attempt > 0).
    pub restarted: bool,
    /// [`job_hash`] of the launcher's job id, when it has one.
    pub job: Option<u64>,
}

/// The file in a run directory naming the launcher job that wrote it (torchrun's run id,
/// SLURM's job id): a restarted attempt recognises its own finished run by it.
pub const JOB: &str = "launcher-job";

/// A stable hash of a launcher job id (the same binary computes it in every attempt).
pub fn job_hash(id: &str) -> u64 {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    id.hash(&mut h);
    h.finish()
}

/// Records in `dir` that `job` writes there (rank 0, as a run starts or resumes).
pub fn mark_job(dir: &Path, job: &str) -> anyhow::Result<()> {
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let path = dir.join(JOB);
    std::fs::write(&path, format!("{job}\n")).with_context(|| format!("cannot write {}", path.display()))
}

/// Whether `dir` was written by the job `policy.job` names.
fn same_job(dir: &Path, policy: Policy) -> bool {
    let Some(job) = policy.job else { return false };
    std::fs::read_to_string(dir.join(JOB)).is_ok_and(|id| job_hash(id.trim()) == job)
}

/// Whether the interrupted run in a directory can be continued with this run's config: `Err`
/// says why not.
pub type Compatible<'a> = &'a dyn Fn(&Path) -> anyhow::Result<()>;

/// The directory a fresh run writes to, decided on every rank (see the module doc); with
/// `overwrite`, the earlier outputs stay restorable until [`Claim::settle`].
pub fn claim(
    requested: &Path,
    policy: Policy,
    compatible: Compatible<'_>,
    comm: &dyn Collective,
) -> anyhow::Result<Claim> {
    // One key per requested directory: `llora mlperf run` claims one directory per run.
    let key = format!("run-dir/claim/{}", requested.display());
    if comm.world_size() == 1 {
        return decide_locked(requested, policy, compatible);
    }
    if comm.rank() == 0 {
        let decided = decide_locked(requested, policy, compatible);
        let message = match &decided {
            Ok(c) if c.resumes() => format!("resume\n{}", c.dir().display()),
            Ok(c) if c.finished() => format!("finished\n{}", c.dir().display()),
            Ok(c) => format!("ok\n{}", c.dir().display()),
            Err(e) => format!("error\n{e:#}"),
        };
        comm.publish(&key, message.as_bytes())?;
        return decided;
    }
    let message = String::from_utf8_lossy(&comm.fetch(&key)?).into_owned();
    match message.split_once('\n') {
        Some(("ok", dir)) => Ok(Claim::existing(PathBuf::from(dir))),
        Some(("resume", dir)) => Ok(Claim::resuming(Path::new(dir))),
        Some(("finished", dir)) => Ok(Claim::finished_run(Path::new(dir))),
        Some((_, reason)) => anyhow::bail!("rank 0 refused run.dir {}: {reason}", requested.display()),
        None => anyhow::bail!("rank 0 published no decision on run.dir {}", requested.display()),
    }
}

/// [`decide`] with the directories' locks: a live run in the requested directory, or in the
/// job's own directory of its chain, is refused before anything is moved (also with
/// `--overwrite`); the chosen directory's lock is taken and kept by the claim (if that fails,
/// the claim is dropped, which puts back what an `--overwrite` moved).
fn decide_locked(requested: &Path, policy: Policy, compatible: Compatible<'_>) -> anyhow::Result<Claim> {
    refuse_if_live(requested)?;
    refuse_if_live(&last_taken(requested))?;
    let claim = decide(requested, policy, compatible)?;
    if claim.finished() { Ok(claim) } else { claim.locked() }
}

/// Rank 0's decision, with the moves `overwrite` makes.
fn decide(requested: &Path, policy: Policy, compatible: Compatible<'_>) -> anyhow::Result<Claim> {
    let replaced = requested.join(REPLACED);
    anyhow::ensure!(
        !replaced.exists(),
        "{} holds the outputs of a run that an --overwrite replaced, kept because the replacing run \
         stopped before saving anything: move them back into {} or delete the folder, then run again",
        replaced.display(),
        requested.display()
    );
    let holds = inspect(requested);
    if policy.overwrite && holds != Holds::Nothing {
        return displace(requested);
    }
    match holds {
        Holds::Nothing => return Ok(Claim::existing(requested.to_path_buf())),
        Holds::Interrupted if policy.auto_resume => {
            compatible(requested).with_context(|| {
                format!(
                    "run.resume = \"auto\" found an interrupted run in {} but cannot continue it",
                    requested.display()
                )
            })?;
            return Ok(Claim::resuming(requested));
        }
        Holds::Interrupted => anyhow::bail!(
            "run.dir {dir} holds an interrupted run (checkpoints in {dir}/{RESUME}); a new run there would mix \
             with it. Continue it with `llora train --resume {dir}` (or --set run.resume=\"auto\", which \
             continues it whenever the config is the same), or start a new run elsewhere (--set run.dir=...), \
             or replace it with --overwrite",
            dir = requested.display()
        ),
        Holds::Finished | Holds::Partial => {}
    }
    // The job's own directory, when an earlier attempt of it was sent beside `requested`.
    let last = last_taken(requested);
    match inspect(&last) {
        Holds::Interrupted if policy.auto_resume && compatible(&last).is_ok() => {
            info!(requested = %requested.display(), dir = %last.display(), "run.dir holds an earlier run; continuing the interrupted run of this config beside it");
            return Ok(Claim::resuming(&last));
        }
        Holds::Finished if policy.restarted && (same_job(&last, policy) || compatible(&last).is_ok()) => {
            info!(dir = %last.display(), "restarted: the previous attempt of this job finished; reporting its outcome (a restart never repeats a finished run)");
            return Ok(Claim::finished_run(&last));
        }
        Holds::Partial if policy.restarted => {
            info!(dir = %last.display(), "restarted: the previous attempt stopped before its first checkpoint; starting over in its directory");
            clear(&last)?;
            return Ok(Claim::existing(last));
        }
        _ => {}
    }
    let sibling = free_sibling(requested)?;
    info!(
        requested = %requested.display(),
        dir = %sibling.display(),
        "run.dir holds an earlier run, kept as it is; this run writes to the next free directory \
         (--overwrite replaces instead)"
    );
    Ok(Claim::existing(sibling))
}

/// The last directory of the `DIR`, `DIR-2`, ... chain that holds a run (`DIR` itself when
/// `DIR-2` is free).
fn last_taken(dir: &Path) -> PathBuf {
    let Some(name) = dir.file_name().and_then(|n| n.to_str()) else { return dir.to_path_buf() };
    let mut last = dir.to_path_buf();
    for n in 2..10_000 {
        let next = dir.with_file_name(format!("{name}-{n}"));
        if inspect(&next) == Holds::Nothing {
            break;
        }
        last = next;
    }
    last
}

/// Removes a run's outputs from `dir` (a restarted attempt's predecessor that saved nothing).
fn clear(dir: &Path) -> anyhow::Result<()> {
    for name in OUTPUTS {
        let path = dir.join(name);
        let removed = match path.symlink_metadata() {
            Ok(m) if m.is_dir() => std::fs::remove_dir_all(&path),
            Ok(_) => std::fs::remove_file(&path),
            Err(_) => Ok(()),
        };
        removed.with_context(|| format!("cannot remove {}", path.display()))?;
    }
    Ok(())
}

/// The first `DIR-N` (N ≥ 2) that holds nothing of a run.
fn free_sibling(dir: &Path) -> anyhow::Result<PathBuf> {
    let name = dir
        .file_name()
        .and_then(|n| n.to_str())
        .with_context(|| format!("run.dir {} holds an earlier run; name a new directory", dir.display()))?;
    (2..10_000)
        .map(|n| dir.with_file_name(format!("{name}-{n}")))
        .find(|d| inspect(d) == Holds::Nothing && !d.join(REPLACED).exists())
        .with_context(|| format!("no free directory {name}-N beside {}", dir.display()))
}

/// `--overwrite`: moves the earlier outputs of `dir` into `dir/.replaced/` (renames only).
fn displace(dir: &Path) -> anyhow::Result<Claim> {
    let replaced = dir.join(REPLACED);
    std::fs::create_dir(&replaced).with_context(|| format!("cannot create {}", replaced.display()))?;
    let claim = Claim::replacing(dir, &replaced);
    for name in OUTPUTS {
        let from = dir.join(name);
        if from.symlink_metadata().is_ok() {
            // On failure `claim` is dropped and moves back what it already moved.
            std::fs::rename(&from, replaced.join(name))
                .with_context(|| format!("cannot move {} aside into {}", from.display(), replaced.display()))?;
        }
    }
    info!(dir = %dir.display(), kept_in = %replaced.display(),
        "--overwrite: the earlier run's outputs are kept aside until this run saves its first checkpoint");
    Ok(claim)
}

/// `llora train --resume`: the run directory must hold an interrupted run.
pub fn check_resumable(dir: &Path) -> anyhow::Result<()> {
    anyhow::ensure!(
        inspect(dir) != Holds::Finished,
        "{} holds a finished run (its {ADAPTER}/ or {FULL_CHECKPOINT}/ and the run_stop of {RESULT_LOG} were \
         written): there is nothing to resume. Start a new run with `llora train` (it writes beside this one)",
        dir.display()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn any(_: &Path) -> anyhow::Result<()> {
        Ok(())
    }

    fn touch(path: &Path) {
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, b"x").unwrap();
    }

    /// A result log that ends with `run_stop`, as the logger writes it.
    fn stopped(run: &Path) {
        std::fs::create_dir_all(run).unwrap();
        std::fs::write(run.join(RESULT_LOG), ":::MLLOG {\"key\":\"run_stop\",\"value\":null}\n").unwrap();
    }

    #[test]
    fn what_a_directory_holds() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run");
        assert_eq!(inspect(&run), Holds::Nothing);
        touch(&run.join("notes.txt"));
        assert_eq!(inspect(&run), Holds::Nothing, "files that are not llora's do not make a run");
        touch(&run.join(RESULT_LOG));
        assert_eq!(inspect(&run), Holds::Partial);
        touch(&run.join("resume/step-00000004/state.json"));
        assert_eq!(inspect(&run), Holds::Interrupted);
        touch(&run.join("adapter/adapter_config.json"));
        assert_eq!(inspect(&run), Holds::Interrupted, "adapters saved, stopped before run_stop: resumable");
        stopped(&run);
        assert_eq!(inspect(&run), Holds::Finished);
    }

    /// A taken directory sends the run to the first free sibling; an interrupted one is refused
    /// naming both ways on; nothing is written by deciding.
    #[test]
    fn fresh_runs_never_land_on_earlier_ones() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run");
        touch(&run.join(ADAPTER).join("adapter_model.safetensors"));
        touch(&dir.path().join("run-2").join(RESULT_LOG));
        let claim = decide(&run, Policy::default(), &any).unwrap();
        assert_eq!(claim.dir(), dir.path().join("run-3"));
        assert!(!claim.dir().exists(), "deciding creates nothing");

        let stopped = dir.path().join("stopped");
        touch(&stopped.join("resume/step-00000002/state.json"));
        let err = format!("{:#}", decide(&stopped, Policy::default(), &any).unwrap_err());
        assert!(err.contains("interrupted") && err.contains("--resume") && err.contains("run.dir"), "{err}");
        assert!(err.contains("run.resume=\"auto\""), "{err}");
    }

    /// `--overwrite` keeps the earlier outputs until `settle`; dropped unsettled, it puts them
    /// back byte for byte and removes the new run's files of the same names.
    #[test]
    fn overwrite_restores_until_settled() {
        let overwrite = Policy { overwrite: true, ..Policy::default() };
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run");
        std::fs::create_dir_all(run.join(ADAPTER)).unwrap();
        std::fs::write(run.join(ADAPTER).join("w"), b"old adapter").unwrap();
        std::fs::write(run.join(RESULT_LOG), b"old log").unwrap();
        std::fs::write(run.join("mine.txt"), b"user file").unwrap();
        {
            let claim = decide(&run, overwrite, &any).unwrap();
            assert_eq!(claim.dir(), run);
            assert_eq!(inspect(&run), Holds::Nothing);
            std::fs::write(run.join(RESULT_LOG), b"new log").unwrap();
        }
        assert_eq!(std::fs::read(run.join(RESULT_LOG)).unwrap(), b"old log");
        assert_eq!(std::fs::read(run.join(ADAPTER).join("w")).unwrap(), b"old adapter");
        assert_eq!(std::fs::read(run.join("mine.txt")).unwrap(), b"user file");
        assert!(!run.join(REPLACED).exists());

        let mut claim = decide(&run, overwrite, &any).unwrap();
        std::fs::write(run.join(RESULT_LOG), b"new log").unwrap();
        claim.settle();
        drop(claim);
        assert_eq!(std::fs::read(run.join(RESULT_LOG)).unwrap(), b"new log");
        assert!(!run.join(ADAPTER).exists() && !run.join(REPLACED).exists());
        assert_eq!(std::fs::read(run.join("mine.txt")).unwrap(), b"user file");
    }

    #[test]
    fn a_finished_run_is_not_resumable() {
        let dir = tempfile::tempdir().unwrap();
        touch(&dir.path().join("resume/step-00000001/state.json"));
        assert!(check_resumable(dir.path()).is_ok());
        touch(&dir.path().join("adapter/adapter_model.safetensors"));
        assert!(check_resumable(dir.path()).is_ok(), "stopped while saving its adapters: resumable");
        stopped(dir.path());
        let err = check_resumable(dir.path()).unwrap_err().to_string();
        assert!(err.contains("finished") && err.contains("nothing to resume"), "{err}");
    }

    /// `run.resume = "auto"` continues an interrupted run of the same config, in `DIR` or at
    /// the end of its chain; one of another config beside `DIR` is left alone; a restarted
    /// attempt reuses its predecessor's checkpoint-less directory.
    #[test]
    fn auto_resume_finds_the_jobs_own_directory() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run");
        let auto = Policy { auto_resume: true, ..Policy::default() };
        touch(&run.join("resume/step-00000002/state.json"));
        let claim = decide(&run, auto, &any).unwrap();
        assert!(claim.resumes() && claim.dir() == run);
        let other = |_: &Path| -> anyhow::Result<()> { anyhow::bail!("lora.rank differs") };
        let err = format!("{:#}", decide(&run, auto, &other).unwrap_err());
        assert!(err.contains("cannot continue") && err.contains("lora.rank"), "{err}");

        touch(&run.join("adapter/adapter_config.json"));
        stopped(&run);
        touch(&dir.path().join("run-2/resume/step-00000006/state.json"));
        let claim = decide(&run, auto, &any).unwrap();
        assert!(claim.resumes() && claim.dir() == dir.path().join("run-2"));
        let claim = decide(&run, auto, &other).unwrap();
        assert!(!claim.resumes() && claim.dir() == dir.path().join("run-3"));

        touch(&dir.path().join("run-3/result_0.txt"));
        touch(&dir.path().join("run-3/mine.txt"));
        let restarted = Policy { restarted: true, ..auto };
        let claim = decide(&run, restarted, &other).unwrap();
        assert!(!claim.resumes() && claim.dir() == dir.path().join("run-3"));
        assert!(!dir.path().join("run-3/result_0.txt").exists() && dir.path().join("run-3/mine.txt").exists());
        assert_eq!(decide(&run, auto, &other).unwrap().dir(), dir.path().join("run-3"), "run-3 is free again");
    }

    /// A live run's directory is refused to a fresh run, to `--overwrite` (nothing moved), to
    /// auto-resume and to `--resume`, naming the live process; once its lock is released (its
    /// process ended), the same calls go through.
    #[test]
    fn a_live_run_is_never_joined() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run");
        touch(&run.join("resume/step-00000002/state.json"));
        touch(&run.join(RESULT_LOG));
        let live = crate::engine::run_lock::lock(&run).unwrap();
        let me = format!("PID {}", std::process::id());
        for policy in [
            Policy::default(),
            Policy { overwrite: true, ..Policy::default() },
            Policy { auto_resume: true, ..Policy::default() },
        ] {
            let err = format!("{:#}", decide_locked(&run, policy, &any).unwrap_err());
            assert!(err.contains("in use by a live llora run") && err.contains(&me), "{err}");
            assert!(run.join(RESULT_LOG).exists() && !run.join(REPLACED).exists(), "nothing moved");
        }
        let err = format!("{:#}", Claim::resumed(run.clone(), true).unwrap_err());
        assert!(err.contains(&me), "{err}");
        drop(live);
        let claim = decide_locked(&run, Policy { auto_resume: true, ..Policy::default() }, &any).unwrap();
        assert!(claim.resumes() && claim.dir() == run);
        let err = format!("{:#}", Claim::resumed(run.clone(), true).unwrap_err());
        assert!(err.contains(&me), "the claim holds the lock now: {err}");
        drop(claim);
        assert!(Claim::resumed(run.clone(), true).is_ok());
    }

    /// A restarted attempt whose predecessor finished (the launcher restarts a run that ended
    /// without reaching its target) finds that run and trains nothing; a fresh job, or a run of
    /// another config, still goes to the next free directory.
    #[test]
    fn a_restart_never_repeats_a_finished_run() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run");
        touch(&run.join("adapter/adapter_config.json"));
        touch(&run.join("resume/step-00000006/state.json"));
        stopped(&run);
        let restarted = Policy { restarted: true, auto_resume: true, ..Policy::default() };
        let claim = decide(&run, restarted, &any).unwrap();
        assert!(claim.finished() && !claim.resumes() && claim.dir() == run);
        let other = |_: &Path| -> anyhow::Result<()> { anyhow::bail!("lora.rank differs") };
        let claim = decide(&run, restarted, &other).unwrap();
        assert!(!claim.finished() && claim.dir() == dir.path().join("run-2"));
        let fresh = Policy { auto_resume: true, ..Policy::default() };
        let claim = decide(&run, fresh, &any).unwrap();
        assert!(!claim.finished() && claim.dir() == dir.path().join("run-2"));
        // Beside an unrelated finished run in `run`, the job's own finished run is run-2.
        touch(&dir.path().join("run-2/adapter/adapter_config.json"));
        let claim = decide(&run, restarted, &any).unwrap();
        assert!(claim.finished() && claim.dir() == dir.path().join("run-2"));
        // A finished run without checkpoints is recognised by the launcher's job id alone.
        let bare = dir.path().join("bare");
        touch(&bare.join("adapter/adapter_config.json"));
        mark_job(&bare, "job-7").unwrap();
        let mine = Policy { job: Some(job_hash("job-7")), ..restarted };
        assert!(decide(&bare, mine, &other).unwrap().finished());
        let theirs = Policy { job: Some(job_hash("job-8")), ..restarted };
        assert!(!decide(&bare, theirs, &other).unwrap().finished());
    }
}
