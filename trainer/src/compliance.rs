//! `llora mlperf check`: the official MLPerf Training compliance checker on one result log.
//!
//! The checker is MLCommons' own Python package (`mlperf_logging.compliance_checker`), not a
//! re-implementation: its rules are what submissions are judged by. It runs from the first
//! Python that has it: `LLORA_MLPERF_PYTHON`, the project venv (`scripts/setup.sh` installs it
//! there), or a venv of its own under `~/.cache/llora/` that is created on first use.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, bail, ensure};

/// The checker release result logs are validated with.
pub const CHECKER_SPEC: &str = "mlperf-logging==4.1.68";
/// The newest training ruleset that release ships.
pub const DEFAULT_RULESET: &str = "6.1.0";

/// What the checker said of one log.
#[derive(Debug, Clone)]
pub struct Verdict {
    /// The checker exited 0 and printed SUCCESS.
    pub passed: bool,
    /// Its standard output and error, as printed.
    pub output: String,
}

/// Runs the checker on `log` against the training `ruleset`.
pub fn check(log: &Path, ruleset: &str) -> anyhow::Result<Verdict> {
    ensure!(log.is_file(), "{}: no such result log", log.display());
    ensure!(
        !ruleset.is_empty() && ruleset.chars().all(|c| c.is_ascii_digit() || c == '.'),
        "--ruleset {ruleset:?}: expected a version such as {DEFAULT_RULESET}"
    );
    // The checker's rules for another benchmark are not llora's to judge (and it answers an
    // unknown one with a Python traceback).
    if let Ok(r) = crate::mlperf::read_result(log)
        && let Some(b) = r.benchmark.filter(|b| b != crate::mlperf::BENCHMARK)
    {
        bail!(
            "{} is a result log of the benchmark {b:?}: llora checks {} logs; run mlperf_logging's checker on it directly",
            log.display(),
            crate::mlperf::BENCHMARK
        );
    }
    let python = checker_python()?;
    let scratch = tempfile::tempdir().context("cannot create a temporary directory for the checker's log")?;
    let out = Command::new(&python)
        .args(["-m", "mlperf_logging.compliance_checker", "--usage", "training", "--ruleset", ruleset])
        .arg("--log_output")
        .arg(scratch.path().join("checker.log"))
        .arg(log)
        .output()
        .with_context(|| format!("cannot run {}", python.display()))?;
    let output = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    if out.status.code() == Some(2) && output.contains("usage:") {
        // argparse's last line names the choices: say that, not its whole usage text.
        let choices =
            output.lines().rev().find_map(|l| l.split("(choose from ").nth(1)).map(|c| c.trim_end_matches(')'));
        match choices {
            Some(c) => bail!("--ruleset {ruleset} is not a training ruleset of {CHECKER_SPEC}: choose one of {c}"),
            None => bail!("the checker refused its arguments (does {CHECKER_SPEC} ship training ruleset {ruleset}?)"),
        }
    }
    if let Some(at) = output.find("Traceback (most recent call last)") {
        // The checker crashed rather than judged: its exception, without Python's stack.
        let exception = output[at..].lines().rev().find(|l| !l.trim().is_empty() && !l.starts_with(' ')).unwrap_or("");
        bail!("the MLPerf checker failed on {} (a crash, not a verdict): {exception}", log.display());
    }
    Ok(Verdict { passed: out.status.success() && output.contains("SUCCESS"), output })
}

/// A Python that imports the checker, installing it into a cache venv when none does.
fn checker_python() -> anyhow::Result<PathBuf> {
    if let Some(p) = std::env::var_os("LLORA_MLPERF_PYTHON") {
        let p = PathBuf::from(p);
        ensure!(
            has_checker(&p),
            "LLORA_MLPERF_PYTHON={} cannot import mlperf_logging: pip install {CHECKER_SPEC} there",
            p.display()
        );
        return Ok(p);
    }
    let project = Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv/bin/python");
    if has_checker(&project) {
        return Ok(project);
    }
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .context("neither XDG_CACHE_HOME nor HOME is set: set LLORA_MLPERF_PYTHON to a Python with mlperf-logging")?
        .join("llora")
        .join(CHECKER_SPEC.replace("==", "-"));
    let python = cache.join("bin/python");
    if !has_checker(&python) {
        install(&cache)?;
    }
    Ok(python)
}

fn has_checker(python: &Path) -> bool {
    python.is_file()
        && Command::new(python)
            .args(["-c", "import mlperf_logging.compliance_checker"])
            .output()
            .is_ok_and(|o| o.status.success())
}

/// Creates a venv at `dir` with the checker: built beside it and renamed into place, so that a
/// failed or concurrent install never leaves a half-made venv where the next run looks.
fn install(dir: &Path) -> anyhow::Result<()> {
    let parent = dir.parent().expect("the cache venv has a parent");
    std::fs::create_dir_all(parent).with_context(|| format!("cannot create {}", parent.display()))?;
    let staging = parent.join(format!(".install-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&staging);
    eprintln!("llora: installing the MLPerf compliance checker ({CHECKER_SPEC}) into {}", dir.display());
    let system = std::env::var_os("PYTHON").unwrap_or_else(|| "python3".into());
    let steps: [(&str, Vec<std::ffi::OsString>); 2] = [
        ("create a venv", vec!["-m".into(), "venv".into(), staging.clone().into()]),
        ("pip install", vec!["-m".into(), "pip".into(), "install".into(), "--quiet".into(), CHECKER_SPEC.into()]),
    ];
    for (i, (what, args)) in steps.iter().enumerate() {
        let program: PathBuf = if i == 0 { PathBuf::from(&system) } else { staging.join("bin/python") };
        let out = Command::new(&program).args(args).output();
        let failed = match &out {
            Ok(o) if o.status.success() => None,
            Ok(o) => Some(String::from_utf8_lossy(&o.stderr).trim().to_string()),
            Err(e) => Some(e.to_string()),
        };
        if let Some(why) = failed {
            let _ = std::fs::remove_dir_all(&staging);
            bail!(
                "cannot install the MLPerf compliance checker ({what} with {} failed: {why}); install {CHECKER_SPEC} \
                 into a Python (e.g. ./scripts/setup.sh does it in .venv) and set LLORA_MLPERF_PYTHON to it",
                program.display()
            );
        }
    }
    if let Err(e) = std::fs::rename(&staging, dir) {
        let _ = std::fs::remove_dir_all(&staging);
        // Another process installed it first: theirs is as good.
        ensure!(has_checker(&dir.join("bin/python")), "cannot move the checker's venv to {}: {e}", dir.display());
    }
    Ok(())
}
