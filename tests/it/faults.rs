//! Runs that survive faults, through the binary: a damaged newest checkpoint falls back
//! to the previous one, a full disk during a checkpoint keeps the previous one resumable, and a
//! job preempted with SIGTERM and requeued (as SLURM does) resumes by itself. Each run ends
//! with the adapters of an uninterrupted run.

use crate::common;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

use crate::resume::same_adapters;
use common::{checkpoint_step, llora, llora_command, mllog, newest_checkpoint, random_base_config, root, strs, text};

/// 12 steps of 8 samples, a checkpoint every 2 steps, one evaluation at the end that reaches
/// its target: an uninterrupted run ends "success" at 96 samples.
fn run_args(config: &str, run: &Path, extra: &[&str]) -> Vec<String> {
    let mut args = common::short_run_args(config, run);
    for s in ["eval.every_samples=96", "eval.target_loss=100.0", "run.checkpoint_every=2"].iter().chain(extra) {
        args.extend(["--set".into(), s.to_string()]);
    }
    args
}

/// The uninterrupted run every faulty one must end like.
fn reference(dir: &Path, config: &str) -> PathBuf {
    let whole = dir.join("whole");
    let out = llora(&strs(&run_args(config, &whole, &[])));
    assert!(out.status.success(), "{}", text(&out).1);
    whole
}

/// Starts `cmd` and SIGKILLs it once a checkpoint of step `at` or later is complete.
fn kill_after_checkpoint(mut cmd: Command, run: &Path, at: u64) {
    let mut child = cmd.stdout(Stdio::null()).stderr(Stdio::null()).spawn().unwrap();
    let started = Instant::now();
    while checkpoint_step(run).is_none_or(|s| s < at) {
        assert!(child.try_wait().unwrap().is_none(), "the run ended before its checkpoint of step {at}");
        assert!(started.elapsed() < Duration::from_secs(300), "no checkpoint of step {at} after 5 minutes");
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap();
    child.wait().unwrap();
}

fn cp_r(from: &Path, to: &Path) {
    assert!(Command::new("cp").arg("-r").arg(from).arg(to).status().unwrap().success());
}

fn resume(run: &Path) -> Output {
    llora(&["train", "--resume", run.to_str().unwrap()])
}

/// The newest checkpoint truncated, or one byte flipped: the resumed run warns
/// naming the file, continues from the previous checkpoint and ends with the uninterrupted
/// run's adapters. Both checkpoints damaged: a clear error naming each file.
#[test]
fn a_damaged_newest_checkpoint_falls_back_to_the_previous_one() {
    let dir = tempfile::tempdir().unwrap();
    let config = random_base_config(dir.path());
    let whole = reference(dir.path(), &config);
    let killed = dir.path().join("killed");
    kill_after_checkpoint(llora_command(&root(), &strs(&run_args(&config, &killed, &[]))), &killed, 6);
    let newest = newest_checkpoint(&killed).unwrap();
    let rel = newest.strip_prefix(&killed).unwrap().to_path_buf();
    let (flipped, both) = (dir.path().join("flipped"), dir.path().join("both"));
    cp_r(&killed, &flipped);
    cp_r(&killed, &both);

    let params = killed.join(&rel).join("params.safetensors");
    let len = std::fs::metadata(&params).unwrap().len();
    std::fs::OpenOptions::new().write(true).open(&params).unwrap().set_len(len / 2).unwrap();
    let optimizer = flipped.join(&rel).join("optimizer.safetensors");
    let mut bytes = std::fs::read(&optimizer).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0x01;
    std::fs::write(&optimizer, &bytes).unwrap();

    for (run, file, damage) in
        [(&killed, "params.safetensors", "truncated"), (&flipped, "optimizer.safetensors", "corrupted")]
    {
        let out = resume(run);
        let (stdout, stderr) = text(&out);
        assert!(out.status.success() && stdout.contains("samples: 96"), "{stdout}\n{stderr}");
        assert!(stderr.contains(file) && stderr.contains(damage) && stderr.contains("previous one"), "{stderr}");
        same_adapters(&whole, run, &format!("resuming past a {damage} {file}"));
    }

    for ckpt in std::fs::read_dir(both.join("resume")).unwrap().map(|e| e.unwrap().path()) {
        std::fs::write(ckpt.join("state.json"), b"{").unwrap();
    }
    let out = resume(&both);
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("no intact checkpoint"), "{stderr}");
    assert!(stderr.matches("state.json").count() >= 2, "each damaged file named:\n{stderr}");
    assert!(!both.join("adapter").exists());
}

/// A small tmpfs mounted on `dir` for as long as it lives (root with CAP_SYS_ADMIN only).
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(dir: &Path, bytes: u64) -> Option<Self> {
        std::fs::create_dir_all(dir).unwrap();
        let size = format!("size={}k", bytes.div_ceil(1024));
        let ok = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &size, "tmpfs"])
            .arg(dir)
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        ok.then(|| Self(dir.to_path_buf()))
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

/// Bytes of every file under `dir`.
fn du(dir: &Path) -> u64 {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .map(|p| if p.is_dir() { du(&p) } else { std::fs::metadata(&p).unwrap().len() })
        .sum()
}

/// The disk fills while the second checkpoint is written, through llora's
/// injected ENOSPC (`LLORA_FAULT_ENOSPC_AFTER_BYTES`) everywhere, and also through a real tmpfs
/// with room for one checkpoint and a half where one can be mounted (root with
/// CAP_SYS_ADMIN; the test says whether it could). The run stops with exit 1 and an error
/// naming the file system's message, the step and the checkpoints kept, the result log ends
/// with an aborted run_stop, no temporary directory is left, and the first checkpoint is
/// intact: resumed, it ends with the uninterrupted run's adapters.
#[test]
fn a_full_disk_during_a_checkpoint_keeps_the_previous_one() {
    let dir = tempfile::tempdir().unwrap();
    let config = random_base_config(dir.path());
    let whole = reference(dir.path(), &config);
    let checkpoint = du(&newest_checkpoint(&whole).unwrap());
    let room = checkpoint * 3 / 2;

    let injected = dir.path().join("injected");
    let mut cmd = llora_command(&root(), &strs(&run_args(&config, &injected.join("run"), &[])));
    cmd.env("LLORA_FAULT_ENOSPC_AFTER_BYTES", room.to_string());
    fills_then_resumes(cmd, &injected, &whole);

    let disk = dir.path().join("disk");
    // Logs and metrics take a few KiB beside the checkpoint.
    match Tmpfs::mount(&disk, room + 64 * 1024) {
        Some(tmpfs) => {
            eprintln!("disk full: also on a tmpfs of {} KiB on {}", (room + 64 * 1024) / 1024, disk.display());
            let cmd = llora_command(&root(), &strs(&run_args(&config, &disk.join("run"), &[])));
            fills_then_resumes(cmd, &disk, &whole);
            drop(tmpfs);
        }
        None => eprintln!("disk full: SKIPPED the tmpfs case (cannot mount here); the injected ENOSPC ran"),
    }
}

/// Runs `cmd` (training into `base/run`) into a full disk, checks what it left, and resumes a
/// copy of it (off that disk) to `whole`'s adapters.
fn fills_then_resumes(mut cmd: Command, base: &Path, whole: &Path) {
    let run = base.join("run");
    let out = cmd.output().unwrap();
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("No space left on device"), "{stderr}");
    assert!(
        stderr.contains("checkpoint of step 4") && stderr.contains(&run.join("resume").display().to_string()),
        "{stderr}"
    );
    assert!(stderr.contains("earlier checkpoints (steps [2]) are untouched"), "{stderr}");
    let log = mllog(&run.join("result_0.txt"));
    let last = log.last().unwrap();
    assert!(last["key"] == "run_stop" && last["metadata"]["status"] == "aborted", "{last}");
    let left: Vec<String> =
        std::fs::read_dir(run.join("resume")).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
    assert_eq!(left, ["step-00000002"]);

    let copy = base.with_extension("copy");
    cp_r(&run, &copy);
    let out = resume(&copy);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success() && stdout.contains("samples: 96"), "{stdout}\n{stderr}");
    same_adapters(whole, &copy, "a full disk and a resume");
}

/// SIGTERM (what SLURM sends before it preempts a job) checkpoints at the next
/// step boundary and exits 130. Started again by hand, the same command refuses (run.resume
/// is `launcher`); with another config under SLURM it refuses naming the key; requeued under
/// SLURM (`SLURM_JOB_ID`, `SLURM_RESTART_COUNT=1`) it resumes by itself, in the same
/// directory, to the uninterrupted run's adapters.
#[test]
fn a_preempted_job_requeued_by_slurm_resumes_by_itself() {
    let dir = tempfile::tempdir().unwrap();
    let config = random_base_config(dir.path());
    let whole = reference(dir.path(), &config);
    let run = dir.path().join("run");
    let args = run_args(&config, &run, &[]);
    let slurm = |args: &[String], restart: &str| {
        let mut cmd = llora_command(&root(), &strs(args));
        cmd.env("SLURM_JOB_ID", "4242").env("SLURM_RESTART_COUNT", restart);
        cmd
    };
    let child = slurm(&args, "0").stdout(Stdio::null()).stderr(Stdio::piped()).spawn().unwrap();
    let started = Instant::now();
    while !std::fs::read_to_string(run.join("metrics.jsonl")).is_ok_and(|m| m.lines().count() >= 3) {
        assert!(started.elapsed() < Duration::from_secs(300), "no step after 5 minutes");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(Command::new("kill").args(["-TERM", &child.id().to_string()]).status().unwrap().success());
    let out = child.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(130), "{stderr}");
    let at = checkpoint_step(&run).expect("a checkpoint on SIGTERM");
    assert!(at < 12, "the run had finished before SIGTERM");

    let out = llora(&strs(&args));
    let (_, stderr) = text(&out);
    assert!(!out.status.success() && stderr.contains("run.resume=\"auto\""), "{stderr}");
    let out = slurm(&run_args(&config, &run, &["lora.rank=4"]), "1").output().unwrap();
    let (_, stderr) = text(&out);
    assert!(!out.status.success() && stderr.contains("cannot continue it") && stderr.contains("lora.rank"), "{stderr}");

    let out = slurm(&args, "1").output().unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success() && stdout.contains("samples: 96"), "{stdout}\n{stderr}");
    assert!(stderr.contains("continuing it"), "{stderr}");
    assert!(!dir.path().join("run-2").exists());
    same_adapters(&whole, &run, &format!("SIGTERM at step {at} and a requeue"));
}

/// The failure paths before the first step: the training data is read after
/// run_start (the MLPerf rules forbid touching it before), so data this model cannot take (ids
/// of a 32,000-token vocabulary for the 512-token demo model) fails there, naming the row, and
/// the result log still ends with run_stop `aborted`.
#[test]
fn a_failure_after_run_start_ends_the_result_log() {
    let dir = tempfile::tempdir().unwrap();
    let synth = dir.path().join("synth");
    let out = llora(&[
        "data",
        "synth",
        "--out",
        synth.to_str().unwrap(),
        "--train",
        "8",
        "--eval",
        "2",
        "--max-seq-len",
        "128",
        "--vocab",
        "32000",
    ]);
    assert!(out.status.success(), "{}", text(&out).1);
    let mut config: toml::Table =
        toml::from_str(&std::fs::read_to_string(random_base_config(dir.path())).unwrap()).unwrap();
    let data = config.get_mut("data").unwrap().as_table_mut().unwrap();
    data.remove("synthetic");
    data.insert("train".into(), synth.join("train.parquet").display().to_string().into());
    data.insert("eval".into(), synth.join("validation.parquet").display().to_string().into());
    data.insert("max_seq_len".into(), 128.into());
    let path = dir.path().join("wrong-vocab.toml");
    std::fs::write(&path, toml::to_string(&config).unwrap()).unwrap();
    let run = dir.path().join("run");
    let out = llora(&["train", path.to_str().unwrap(), "--set", &format!("run.dir=\"{}\"", run.display())]);
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("train.parquet") && stderr.contains("row 1"), "{stderr}");
    let log = mllog(&run.join("result_0.txt"));
    assert!(log.iter().any(|l| l["key"] == "run_start"), "the data is read after run_start");
    let last = log.last().unwrap();
    assert!(last["key"] == "run_stop" && last["metadata"]["status"] == "aborted", "{last}");
}
