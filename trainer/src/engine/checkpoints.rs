//! The checkpoints of a run on disk: step-numbered, written atomically, verified on resume.
//!
//! `<run.dir>/resume/` holds up to `run.keep_checkpoints` directories `step-NNNNNNNN/`. Each is
//! written whole into `.step-NNNNNNNN.tmp/` (every file fsynced by `write_atomic`), closed by a
//! `manifest.json` listing every file with its size and SHA-256, renamed into place, and the
//! parent directory fsynced; only then are checkpoints beyond the newest N deleted. A crash or
//! a full disk at any point leaves the earlier checkpoints as they were.
//!
//! Resuming takes the newest checkpoint whose files all match its manifest; a damaged one (a
//! truncated file, a flipped byte, a missing manifest) is skipped with a warning naming the
//! file, and the previous one is used. What a checkpoint holds is `resume.rs`'s business.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};

use anyhow::{Context, ensure};
use llora_model::checkpoint::write_atomic;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// The folder of a run directory holding the checkpoints of a run in progress.
pub const RESUME: &str = "resume";

/// Where `--overwrite` keeps the outputs it replaces until the new run has saved something
/// (`engine/run_dir.rs`).
pub const REPLACED: &str = ".replaced";

/// The file that closes a checkpoint directory: without it the checkpoint is incomplete.
pub const MANIFEST: &str = "manifest.json";
/// Manifest format version.
const MANIFEST_FORMAT: u32 = 1;
/// Prefix of a checkpoint directory's name; the step follows, zero-padded to 8 digits.
const STEP_PREFIX: &str = "step-";

/// One file of a checkpoint as it was written.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct FileSum {
    bytes: u64,
    sha256: String,
}

/// `manifest.json`: every file of a checkpoint (paths relative to its directory).
#[derive(Debug, Serialize, Deserialize)]
struct Manifest {
    format: u32,
    step: usize,
    files: BTreeMap<String, FileSum>,
}

/// The directory that holds a run's checkpoints.
pub fn root(run_dir: &Path) -> PathBuf {
    run_dir.join(RESUME)
}

/// The name of the checkpoint directory of `step`.
fn step_name(step: usize) -> String {
    format!("{STEP_PREFIX}{step:08}")
}

/// The checkpoint directories of a run directory, newest (highest step) first, whatever their
/// state: [`verify`] says which are intact.
pub fn list(run_dir: &Path) -> Vec<(usize, PathBuf)> {
    let Ok(entries) = std::fs::read_dir(root(run_dir)) else { return Vec::new() };
    let mut found: Vec<(usize, PathBuf)> = entries
        .filter_map(Result::ok)
        .filter_map(|e| {
            let name = e.file_name().into_string().ok()?;
            let step = name.strip_prefix(STEP_PREFIX)?.parse().ok()?;
            e.path().is_dir().then_some((step, e.path()))
        })
        .collect();
    found.sort_by_key(|b| std::cmp::Reverse(b.0));
    found
}

/// Writes the checkpoint of `step` into `run_dir` with `fill` (which writes its files into the
/// directory it is given), then keeps only the newest `keep` checkpoints. Returns its directory.
///
/// On any failure (a full disk, an I/O error) the unfinished directory is removed, the earlier
/// checkpoints are untouched, and the error names what failed.
pub fn save(
    run_dir: &Path,
    step: usize,
    keep: usize,
    fill: impl FnOnce(&Path) -> anyhow::Result<()>,
) -> anyhow::Result<PathBuf> {
    let root = root(run_dir);
    std::fs::create_dir_all(&root).with_context(|| format!("cannot create {}", root.display()))?;
    let name = step_name(step);
    let (dir, tmp, old) = (root.join(&name), root.join(format!(".{name}.tmp")), root.join(format!(".{name}.old")));
    remove_unfinished(&root)?;
    let written = std::fs::create_dir(&tmp)
        .with_context(|| format!("cannot create {}", tmp.display()))
        .and_then(|()| fill(&tmp))
        .and_then(|()| write_manifest(&tmp, step));
    if let Err(e) = written {
        let _ = std::fs::remove_dir_all(&tmp);
        let kept = list(run_dir).into_iter().map(|(s, _)| s.to_string()).collect::<Vec<_>>();
        return Err(e.context(format!(
            "the checkpoint of step {step} could not be written in {}; the earlier checkpoints (steps [{}]) are \
             untouched",
            root.display(),
            kept.join(", ")
        )));
    }
    // The same step saved again (interrupted right after resuming): the new one replaces it.
    if dir.exists() {
        std::fs::rename(&dir, &old).with_context(|| format!("cannot move {} aside", dir.display()))?;
    }
    std::fs::rename(&tmp, &dir).with_context(|| format!("cannot rename {} to {}", tmp.display(), dir.display()))?;
    sync_dir(&root);
    if old.exists() {
        std::fs::remove_dir_all(&old).with_context(|| format!("cannot remove {}", old.display()))?;
    }
    for (_, stale) in list(run_dir).into_iter().skip(keep.max(1)) {
        std::fs::remove_dir_all(&stale)
            .with_context(|| format!("cannot remove the old checkpoint {}", stale.display()))?;
    }
    Ok(dir)
}

/// Removes what an earlier process left half-written (`.step-*.tmp`, `.step-*.old`).
fn remove_unfinished(root: &Path) -> anyhow::Result<()> {
    for e in std::fs::read_dir(root).with_context(|| format!("cannot list {}", root.display()))? {
        let path = e?.path();
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        if name.starts_with(&format!(".{STEP_PREFIX}")) && (name.ends_with(".tmp") || name.ends_with(".old")) {
            std::fs::remove_dir_all(&path).with_context(|| format!("cannot remove {}", path.display()))?;
        }
    }
    Ok(())
}

/// The directory's entry table durable (after a rename); best effort, as in `write_atomic`.
fn sync_dir(dir: &Path) {
    if let Ok(d) = std::fs::File::open(dir) {
        let _ = d.sync_all();
    }
}

/// Every file under `dir` (relative paths, sorted), the manifest excepted.
fn files(dir: &Path) -> anyhow::Result<Vec<String>> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).with_context(|| format!("cannot list {}", d.display()))? {
            let path = e?.path();
            if path.is_dir() {
                todo.push(path);
            } else {
                let rel = path.strip_prefix(dir).expect("under dir").to_string_lossy().into_owned();
                if rel != MANIFEST {
                    out.push(rel);
                }
            }
        }
    }
    out.sort();
    Ok(out)
}

/// Size and SHA-256 of a file, read back from disk.
fn sum(path: &Path) -> anyhow::Result<FileSum> {
    let mut f = std::fs::File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let (mut hasher, mut buf, mut bytes) = (Sha256::new(), vec![0u8; 1 << 20], 0u64);
    loop {
        let n = f.read(&mut buf).with_context(|| format!("cannot read {}", path.display()))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        bytes += n as u64;
    }
    let sha256 = hasher.finalize().iter().map(|b| format!("{b:02x}")).collect();
    Ok(FileSum { bytes, sha256 })
}

/// Closes the checkpoint in `dir`: the manifest of what is on disk (read back, so it vouches
/// for the bytes that were stored, not for the ones meant).
fn write_manifest(dir: &Path, step: usize) -> anyhow::Result<()> {
    let mut sums = BTreeMap::new();
    for rel in files(dir)? {
        sums.insert(rel.clone(), sum(&dir.join(&rel))?);
    }
    let manifest = Manifest { format: MANIFEST_FORMAT, step, files: sums };
    write_atomic(&dir.join(MANIFEST), serde_json::to_string_pretty(&manifest)?.as_bytes())
}

/// Checks every file of the checkpoint `dir` against its manifest; the error names the first
/// file that is missing, of another size or of other content.
pub fn verify(dir: &Path) -> anyhow::Result<()> {
    let path = dir.join(MANIFEST);
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("{}: no manifest (the checkpoint was never completed)", path.display()))?;
    let manifest: Manifest =
        serde_json::from_str(&text).with_context(|| format!("{}: not a checkpoint manifest", path.display()))?;
    ensure!(
        manifest.format == MANIFEST_FORMAT,
        "{}: manifest format {} (this llora reads {MANIFEST_FORMAT})",
        path.display(),
        manifest.format
    );
    // What the manifest vouches for must be the checkpoint: its own step, every file in it
    // (and none outside it), so that no file is read unchecked and nothing else is read.
    if let Some(step) = dir.file_name().and_then(|n| n.to_str()).and_then(|n| n.strip_prefix(STEP_PREFIX)) {
        ensure!(
            step.parse::<usize>().ok() == Some(manifest.step),
            "{}: says step {}, but the checkpoint is {}",
            path.display(),
            manifest.step,
            dir.display()
        );
    }
    for rel in manifest.files.keys() {
        let inside = Path::new(rel).components().all(|c| matches!(c, std::path::Component::Normal(_)));
        ensure!(
            inside && !rel.is_empty(),
            "{}: lists {rel:?}, which is not a file inside the checkpoint",
            path.display()
        );
    }
    let on_disk = files(dir)?;
    let listed: Vec<&String> = manifest.files.keys().collect();
    if let Some(extra) = on_disk.iter().find(|f| !manifest.files.contains_key(*f)) {
        anyhow::bail!("{}: {extra} is in the checkpoint but not in its manifest", path.display());
    }
    ensure!(!listed.is_empty(), "{}: lists no file", path.display());
    for (rel, want) in &manifest.files {
        let file = dir.join(rel);
        ensure!(file.is_file(), "{}: missing (listed in {MANIFEST})", file.display());
        let got = sum(&file)?;
        ensure!(
            got.bytes == want.bytes,
            "{}: {} bytes, {MANIFEST} says {} (truncated or overwritten)",
            file.display(),
            got.bytes,
            want.bytes
        );
        ensure!(got.sha256 == want.sha256, "{}: its SHA-256 differs from {MANIFEST}'s (corrupted)", file.display());
    }
    Ok(())
}

/// The newest intact checkpoint of `path` (a run directory, or one checkpoint directory), with
/// a warning for each newer one that is damaged; an error listing every damage when none is
/// intact.
pub fn newest_intact(path: &Path) -> anyhow::Result<PathBuf> {
    newest_usable(path, |dir| Ok(dir.to_path_buf()))
}

/// [`newest_intact`] whose contents `open` also accepts (it reads and checks them): a
/// checkpoint whose manifest holds but whose contents are inconsistent (an optimizer moment of
/// the wrong shape) is skipped like a damaged one, with a warning, for the previous one.
pub fn newest_usable<T>(path: &Path, open: impl Fn(&Path) -> anyhow::Result<T>) -> anyhow::Result<T> {
    let candidates = match path.join(MANIFEST).is_file() {
        true => vec![path.to_path_buf()],
        false => list(path).into_iter().map(|(_, d)| d).collect(),
    };
    if candidates.is_empty() {
        let replaced = path.join(REPLACED);
        if !list(&replaced).is_empty() {
            anyhow::bail!(
                "{}: no checkpoint of its own, but the earlier run it replaced is in {} (an --overwrite moved it \
                 there, and the new run stopped before saving anything): `llora train --resume {}` continues \
                 that run, or start the new one again",
                path.display(),
                replaced.display(),
                replaced.display()
            );
        }
        anyhow::bail!(
            "{}: no checkpoint ({}/{STEP_PREFIX}*); was run.checkpoint_every set, or the run interrupted?",
            path.display(),
            root(path).display()
        );
    }
    let mut damaged = Vec::new();
    for dir in candidates {
        match verify(&dir).and_then(|()| open(&dir)) {
            Ok(opened) => {
                if !damaged.is_empty() {
                    tracing::warn!(using = %dir.display(), "a newer checkpoint is damaged; resuming from the previous one");
                }
                return Ok(opened);
            }
            Err(e) => {
                tracing::warn!("checkpoint {} is damaged: {e:#}", dir.display());
                damaged.push(format!("{e:#}"));
            }
        }
    }
    anyhow::bail!("{}: no intact checkpoint to resume from:\n  - {}", path.display(), damaged.join("\n  - "))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A run directory whose checkpoints an `--overwrite` moved into `.replaced` says where
    /// they are and how to continue them; one with none says there are none.
    #[test]
    fn no_checkpoint_points_at_the_replaced_run() {
        let dir = tempfile::tempdir().unwrap();
        let run = dir.path().join("run");
        std::fs::create_dir_all(run.join(REPLACED).join(RESUME).join(format!("{STEP_PREFIX}00000002"))).unwrap();
        let err = newest_intact(&run).unwrap_err().to_string();
        let replaced = run.join(REPLACED).display().to_string();
        assert!(err.contains(&format!("llora train --resume {replaced}")), "{err}");
        let empty = dir.path().join("empty");
        std::fs::create_dir_all(&empty).unwrap();
        let err = newest_intact(&empty).unwrap_err().to_string();
        assert!(err.contains("no checkpoint") && !err.contains(REPLACED), "{err}");
    }

    fn save_files(run: &Path, step: usize, keep: usize, content: &str) -> PathBuf {
        save(run, step, keep, |d| {
            std::fs::create_dir(d.join("adapter"))?;
            write_atomic(&d.join("adapter/w.bin"), content.as_bytes())?;
            write_atomic(&d.join("state.json"), b"{}")
        })
        .unwrap()
    }

    /// The newest `keep` survive; a truncated or flipped file is named and skipped for the
    /// previous checkpoint; with none intact, every damage is listed.
    #[test]
    fn newest_intact_checkpoint_wins() {
        let run = tempfile::tempdir().unwrap();
        for step in [2, 4, 6] {
            save_files(run.path(), step, 2, &format!("weights of step {step}"));
        }
        let steps: Vec<usize> = list(run.path()).into_iter().map(|(s, _)| s).collect();
        assert_eq!(steps, [6, 4]);
        assert_eq!(newest_intact(run.path()).unwrap(), root(run.path()).join("step-00000006"));

        let newest = root(run.path()).join("step-00000006/adapter/w.bin");
        let mut bytes = std::fs::read(&newest).unwrap();
        bytes[3] ^= 0x10;
        std::fs::write(&newest, &bytes).unwrap();
        assert_eq!(newest_intact(run.path()).unwrap(), root(run.path()).join("step-00000004"));
        let err = verify(&root(run.path()).join("step-00000006")).unwrap_err().to_string();
        assert!(err.contains("w.bin") && err.contains("SHA-256"), "{err}");

        let older = root(run.path()).join("step-00000004/state.json");
        std::fs::write(&older, b"{").unwrap();
        let err = format!("{:#}", newest_intact(run.path()).unwrap_err());
        assert!(err.contains("no intact checkpoint") && err.contains("w.bin") && err.contains("state.json"), "{err}");
        assert!(err.contains("1 bytes") && err.contains("truncated"), "{err}");
    }

    /// A manifest vouches for exactly its checkpoint: one listing no file, skipping a
    /// file, claiming another step or naming a path outside is refused, with the reason named;
    /// and a checkpoint whose contents `open` rejects falls back to the previous one.
    #[test]
    fn a_manifest_must_be_its_checkpoints() {
        let run = tempfile::tempdir().unwrap();
        save_files(run.path(), 2, 2, "two");
        let dir = save_files(run.path(), 4, 2, "four");
        let manifest = dir.join(MANIFEST);
        let good = std::fs::read_to_string(&manifest).unwrap();
        let m: serde_json::Value = serde_json::from_str(&good).unwrap();
        let tamper = |f: &dyn Fn(&mut serde_json::Value)| {
            let mut v = m.clone();
            f(&mut v);
            std::fs::write(&manifest, v.to_string()).unwrap();
            format!("{:#}", verify(&dir).unwrap_err())
        };
        let err = tamper(&|v| v["files"] = serde_json::json!({}));
        assert!(err.contains("not in its manifest") || err.contains("lists no file"), "{err}");
        let err = tamper(&|v| {
            v["files"].as_object_mut().unwrap().remove("state.json");
        });
        assert!(err.contains("state.json") && err.contains("not in its manifest"), "{err}");
        let err = tamper(&|v| v["step"] = 7.into());
        assert!(err.contains("says step 7"), "{err}");
        let err = tamper(&|v| {
            let sum = v["files"]["state.json"].clone();
            v["files"]["../../outside"] = sum;
        });
        assert!(err.contains("\"../../outside\"") && err.contains("not a file inside"), "{err}");
        std::fs::write(&manifest, &good).unwrap();
        verify(&dir).unwrap();
        // Contents rejected by the reader: the previous checkpoint is used.
        let opened = newest_usable(run.path(), |d| {
            anyhow::ensure!(!d.ends_with("step-00000004"), "optimizer moment x has 3 values, its parameter 4");
            Ok(d.to_path_buf())
        })
        .unwrap();
        assert_eq!(opened, root(run.path()).join("step-00000002"));
    }

    /// A failing fill (a full disk) leaves the earlier checkpoints and no temporary directory.
    #[test]
    fn a_failed_save_keeps_the_earlier_checkpoints() {
        let run = tempfile::tempdir().unwrap();
        let first = save_files(run.path(), 1, 1, "first");
        let err = save(run.path(), 2, 1, |d| {
            write_atomic(&d.join("state.json"), b"{}")?;
            anyhow::bail!("No space left on device")
        })
        .unwrap_err();
        assert!(format!("{err:#}").contains("step 2") && format!("{err:#}").contains("[1]"), "{err:#}");
        assert_eq!(list(run.path()), [(1, first.clone())]);
        verify(&first).unwrap();
        let names: Vec<_> = std::fs::read_dir(root(run.path())).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(names, ["step-00000001"]);
    }
}
