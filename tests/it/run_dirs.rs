//! A rerun never destroys an earlier run, through the binary: a run into a taken
//! `run.dir` writes beside it, an interrupted run is refused and resumes, `--overwrite` puts
//! the earlier run back when the new one fails before saving anything, and `--resume` refuses
//! what cannot apply to its checkpoint.

use crate::common;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use common::{checkpoint_step, llora, mllog, random_base_config, short_run_args, strs, text};

/// Every file under `dir` with its bytes (but the run lock, which names the last process that
/// held the directory: process state, not a run's output).
fn snapshot(dir: &Path) -> BTreeMap<PathBuf, Vec<u8>> {
    fn walk(dir: &Path, out: &mut BTreeMap<PathBuf, Vec<u8>>) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            if path.file_name().is_some_and(|n| n == ".llora-run.lock") {
                continue;
            }
            if path.is_dir() {
                walk(&path, out);
            } else {
                out.insert(path.clone(), std::fs::read(&path).unwrap());
            }
        }
    }
    let mut out = BTreeMap::new();
    walk(dir, &mut out);
    out
}

/// `short_run_args` with more `--set`s.
fn run_args(config: &str, run: &Path, sets: &[&str]) -> Vec<String> {
    let mut args = short_run_args(config, run);
    for s in sets {
        args.extend(["--set".into(), s.to_string()]);
    }
    args
}

/// Converges at its first evaluation (16 samples, 2 steps): the random base's loss is far below 100.
const CONVERGES: &[&str] = &["eval.every_samples=16", "eval.target_loss=100.0"];

/// A converged run, then a failing rerun of the same config: the rerun writes to `run-2` and
/// says so; the first run is byte for byte as it was. `--overwrite` whose run fails before
/// saving anything puts the first run back; one that succeeds replaces it.
#[test]
fn reruns_write_beside_a_finished_run_or_replace_it_on_request() {
    let dir = tempfile::tempdir().unwrap();
    let config = random_base_config(dir.path());
    let run = dir.path().join("run");
    let out = llora(&strs(&run_args(&config, &run, CONVERGES)));
    assert!(out.status.success(), "{}", text(&out).1);
    let first = snapshot(&run);
    assert!(
        first.contains_key(&run.join("adapter/adapter_model.safetensors"))
            && first.contains_key(&run.join("result_0.txt"))
    );

    // The same config, failing (target out of reach in 2 steps).
    let out = llora(&strs(&run_args(&config, &run, &["schedule.max_steps=2"])));
    let (stdout, stderr) = text(&out);
    assert!(!out.status.success(), "{stderr}");
    let second = dir.path().join("run-2");
    assert!(stdout.contains(&format!("run.dir: {}", second.display())), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("did not reach") && stderr.contains(&second.join("result_0.txt").display().to_string()),
        "{stderr}"
    );
    let stop = mllog(&second.join("result_0.txt")).into_iter().find(|l| l["key"] == "run_stop").unwrap();
    assert_eq!(stop["metadata"]["status"], "aborted");
    assert!(snapshot(&run) == first, "the first run's files changed");

    // --overwrite with a run that fails before its first save (its base does not exist).
    let missing = format!("model.path=\"{}\"", dir.path().join("no-such-base").display());
    let mut args = run_args(&config, &run, &[&missing]);
    args.push("--overwrite".into());
    let out = llora(&strs(&args));
    assert!(!out.status.success() && text(&out).1.contains("no-such-base"), "{}", text(&out).1);
    assert!(snapshot(&run) == first, "a failed --overwrite must put the earlier run back");
    assert!(!run.join(".replaced").exists());

    // --overwrite that succeeds: another seed's adapters replace the first run's.
    let mut args = run_args(&config, &run, &[CONVERGES[0], CONVERGES[1], "run.seed=2"]);
    args.push("--overwrite".into());
    let out = llora(&strs(&args));
    let (stdout, stderr) = text(&out);
    assert!(out.status.success() && stdout.contains(&format!("run.dir: {}", run.display())), "{stdout}\n{stderr}");
    let adapter = run.join("adapter/adapter_model.safetensors");
    assert!(std::fs::read(&adapter).unwrap() != first[&adapter], "the adapters were not replaced");
    assert!(!run.join(".replaced").exists() && second.join("result_0.txt").is_file());
}

/// An interrupted run (SIGTERM): a fresh `train` into its directory is refused naming both
/// ways on and changes nothing; `--resume` refuses overrides that cannot apply, then converges;
/// resuming the finished run is refused and adds no second `run_stop`.
#[test]
fn an_interrupted_run_is_refused_then_resumed() {
    let dir = tempfile::tempdir().unwrap();
    let config = random_base_config(dir.path());
    let run = dir.path().join("run");
    // 40 steps, one evaluation at the end that reaches the target.
    let args = run_args(&config, &run, &["schedule.max_steps=40", "eval.every_samples=320", "eval.target_loss=100.0"]);
    let out = common::signal_after_two_steps(&args, &run, "TERM");
    assert!(!out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let step = checkpoint_step(&run).expect("a checkpoint on SIGTERM");
    assert!(step < 40, "the run finished before SIGTERM");
    let interrupted = snapshot(&run);

    let out = llora(&strs(&args));
    let (_, stderr) = text(&out);
    assert!(!out.status.success(), "{stderr}");
    let run_s = run.display().to_string();
    for want in ["interrupted", &format!("llora train --resume {run_s}"), "run.dir", "--overwrite"] {
        assert!(stderr.contains(want), "missing {want:?}: {stderr}");
    }
    assert!(snapshot(&run) == interrupted, "a refused run changed the interrupted one");
    assert!(!dir.path().join("run-2").exists(), "a refused run wrote elsewhere");

    let refusals: &[(&str, &str)] = &[
        ("run.dir=\"elsewhere\"", "cannot move a resumed run"),
        ("schedule.max_steps=1", "nothing is left to train"),
        ("lora.rank=8", "lora.rank"),
        ("optim.lr=0.1", "optim.lr"),
    ];
    for (set, want) in refusals {
        let out = llora(&["train", "--resume", &run_s, "--set", set]);
        let (_, stderr) = text(&out);
        assert!(!out.status.success() && stderr.contains(want), "--set {set}: {stderr}");
        assert!(snapshot(&run) == interrupted, "--set {set} changed the run");
    }

    let out = llora(&["train", "--resume", &run_s, "--set", "logging.every_steps=5"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success() && stdout.contains("status: success"), "{stdout}\n{stderr}");
    let out = llora(&["train", "--resume", &run_s]);
    let (_, stderr) = text(&out);
    assert!(!out.status.success() && stderr.contains("finished") && stderr.contains("nothing to resume"), "{stderr}");
    let stops = mllog(&run.join("result_0.txt")).into_iter().filter(|l| l["key"] == "run_stop").count();
    assert_eq!(stops, 1);
}

/// `--resume` of a run that is still going and has no checkpoint yet names the live run that
/// holds it (it said "no checkpoint ... was run.checkpoint_every set?").
#[test]
fn resuming_a_live_run_names_it() {
    let dir = tempfile::tempdir().unwrap();
    let config = random_base_config(dir.path());
    let run = dir.path().join("run");
    let args = run_args(&config, &run, &["schedule.max_steps=100000", "run.checkpoint_every=0"]);
    let mut child = common::llora_command(&common::root(), &strs(&args))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let started = std::time::Instant::now();
    while std::fs::read_to_string(run.join("metrics.jsonl")).map_or(true, |m| m.is_empty()) {
        assert!(child.try_wait().unwrap().is_none(), "the run ended early");
        assert!(started.elapsed().as_secs() < 120, "no step within 2 minutes");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let out = llora(&["train", "--resume", run.to_str().unwrap()]);
    child.kill().unwrap();
    child.wait().unwrap();
    let (_, stderr) = text(&out);
    assert!(!out.status.success(), "{stderr}");
    let pid = format!("PID {}", child.id());
    assert!(stderr.contains("in use by a live llora run") && stderr.contains(&pid), "{stderr}");
    assert!(!stderr.contains("checkpoint_every"), "{stderr}");
}

/// A checkpoint that cannot be written (the file-size limit stands in for a full disk: writes
/// fail with EFBIG) stops the run with an error naming the file, and leaves no temporary file
/// or half-written checkpoint behind (`.tmp-PID` files and `.resume.tmp/` stayed).
/// A run refused while its model is built (a pattern key that sets nothing) leaves no outputs:
/// the corrected rerun takes the same run.dir, not `DIR-2`.
#[test]
fn a_run_refused_at_model_load_leaves_its_run_dir_free() {
    let dir = tempfile::tempdir().unwrap();
    let config = random_base_config(dir.path());
    let run = dir.path().join("run");
    let out = llora(&strs(&run_args(&config, &run, &[r#"lora.rank_pattern={"no_such_module"=4}"#])));
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("no_such_module"), "{stderr}");
    let left = if run.exists() { snapshot(&run) } else { BTreeMap::new() };
    assert!(left.is_empty(), "outputs left: {:?}", left.keys().collect::<Vec<_>>());
    // The short run ends below its target (exit 1), its adapters saved where it was asked.
    let out = llora(&strs(&run_args(&config, &run, &[])));
    assert!(run.join("adapter").is_dir() && !dir.path().join("run-2").exists(), "{}", text(&out).1);
}

#[test]
fn a_failed_checkpoint_write_leaves_no_temporary_files() {
    let dir = tempfile::tempdir().unwrap();
    let config = random_base_config(dir.path());
    let run = dir.path().join("run");
    let args = run_args(&config, &run, &["run.checkpoint_every=1", "schedule.max_steps=3"]);
    let inner: Vec<String> = common::llora_command(&common::root(), &strs(&args))
        .get_args()
        .map(|a| format!("'{}'", a.to_string_lossy().replace('\'', "'\\''")))
        .collect();
    // 256 KiB: the result log and metrics fit, the adapter's parameters (~600 KB) do not.
    // SIGXFSZ ignored, so the write fails with an error instead of killing the process.
    let script = format!("trap '' XFSZ; ulimit -f 256; exec '{}' {}", common::llora_bin().display(), inner.join(" "));
    let out = std::process::Command::new("bash")
        .args(["-c", &script])
        .current_dir(common::root())
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("OMP_WAIT_POLICY", "PASSIVE")
        .output()
        .unwrap();
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("params.safetensors") || stderr.contains("optimizer.safetensors"), "{stderr}");
    let left: Vec<String> =
        snapshot(&run).into_keys().map(|p| p.strip_prefix(&run).unwrap().display().to_string()).collect();
    assert!(left.iter().all(|p| !p.contains(".tmp") && !p.starts_with("resume")), "left behind: {left:?}");
    assert!(left.contains(&"result_0.txt".to_string()), "{left:?}");
}
