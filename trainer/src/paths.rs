//! Where commands write: never over a file they read (`data prepare --out` equal to `--input`
//! replaced the raw text), never over an earlier output unless told to (`--overwrite`), and a
//! replaced output is swapped in whole, never half-written. (`llora train`'s run directories
//! have their own rules: `engine/run_dir.rs`.)

use std::path::{Path, PathBuf};

/// `path` made absolute with symlinks resolved, also when it does not exist yet (its parent
/// is resolved, its name kept).
fn resolved(path: &Path) -> PathBuf {
    if let Ok(p) = path.canonicalize() {
        return p;
    }
    let parent = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    match (parent.canonicalize(), path.file_name()) {
        (Ok(dir), Some(name)) => dir.join(name),
        _ => path.to_path_buf(),
    }
}

/// Refuses `out` (`flag`) when it is one of `inputs` (each with the flag that named it).
pub fn ensure_not_an_input(flag: &str, out: &Path, inputs: &[(&str, &Path)]) -> anyhow::Result<()> {
    let target = resolved(out);
    for (input_flag, input) in inputs {
        anyhow::ensure!(
            resolved(input) != target,
            "{flag} {} is also {input_flag}: llora would overwrite its own input; write somewhere else",
            out.display()
        );
    }
    Ok(())
}

/// Nothing is at `path`, or an empty directory: writing there replaces nothing.
pub fn is_free(path: &Path) -> bool {
    path.symlink_metadata().is_err() || std::fs::read_dir(path).is_ok_and(|mut d| d.next().is_none())
}

/// Refuses an existing `out` (`flag`) unless `overwrite` is `Some(true)`; an empty directory
/// counts as free. `None`: the command has no `--overwrite`, and its message offers none.
pub fn ensure_new_output(flag: &str, out: &Path, overwrite: Option<bool>) -> anyhow::Result<()> {
    let offer =
        if overwrite.is_some() { ", or pass --overwrite to replace it once the new one is complete" } else { "" };
    anyhow::ensure!(
        overwrite == Some(true) || is_free(out),
        "{flag} {} already exists: llora does not replace earlier outputs (choose another path{offer})",
        out.display()
    );
    Ok(())
}

/// Refuses a file output `out` (`flag`) whose folder does not exist: a typo in the folder
/// would otherwise create a tree somewhere unexpected, silently.
pub fn ensure_folder_exists(flag: &str, out: &Path) -> anyhow::Result<()> {
    let folder = out.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    anyhow::ensure!(
        folder.is_dir(),
        "{flag} {}: the folder {} does not exist; create it first (llora makes no folders for one file)",
        out.display(),
        folder.display()
    );
    Ok(())
}

/// Refuses an `--overwrite` of the directory `out` (`flag`) when it holds entries other than
/// `names`, the ones the command writes: replacing the directory would delete them.
pub fn ensure_only_own_files(flag: &str, out: &Path, names: &[&str]) -> anyhow::Result<()> {
    let Ok(entries) = std::fs::read_dir(out) else { return Ok(()) };
    let foreign: Vec<String> = entries
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| !names.contains(&n.as_str()))
        .collect();
    if foreign.is_empty() {
        return Ok(());
    }
    let mut shown = foreign.clone();
    shown.sort();
    shown.truncate(5);
    anyhow::bail!(
        "{flag} {} holds {} entr{} this command does not write ({}{}): --overwrite replaces only what the \
         command writes; move them away or choose another {flag}",
        out.display(),
        foreign.len(),
        if foreign.len() == 1 { "y" } else { "ies" },
        shown.join(", "),
        if foreign.len() > shown.len() { ", ..." } else { "" }
    )
}

/// Makes the directory `out` with `fill` in a temporary directory beside it, then swaps it in
/// by renames: an existing `out` is replaced only by a complete new one, and a failure leaves
/// it as it was (and no temporary directory behind).
pub fn write_dir_atomic(out: &Path, fill: impl FnOnce(&Path) -> anyhow::Result<()>) -> anyhow::Result<()> {
    use anyhow::Context;
    let name =
        out.file_name().and_then(|n| n.to_str()).with_context(|| format!("{} names no directory", out.display()))?;
    let beside = |what: &str| out.with_file_name(format!(".{name}.{what}-{}", std::process::id()));
    let (tmp, old) = (beside("tmp"), beside("old"));
    let _ = std::fs::remove_dir_all(&tmp);
    let made = std::fs::create_dir_all(&tmp)
        .with_context(|| format!("cannot create {}", tmp.display()))
        .and_then(|()| fill(&tmp));
    if let Err(e) = made {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    let had_old = out.symlink_metadata().is_ok();
    if had_old {
        std::fs::rename(out, &old).with_context(|| format!("cannot move {} aside", out.display()))?;
    }
    if let Err(e) = std::fs::rename(&tmp, out) {
        if had_old {
            let _ = std::fs::rename(&old, out);
        }
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e).with_context(|| format!("cannot rename {} to {}", tmp.display(), out.display()));
    }
    if had_old {
        std::fs::remove_dir_all(&old).with_context(|| format!("cannot remove the replaced {}", old.display()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A file output into a missing folder is refused naming the folder; into
    /// an existing one, or the working directory, it is not.
    #[test]
    fn a_file_output_needs_its_folder() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("no/such/loss.svg");
        let err = ensure_folder_exists("--out", &missing).unwrap_err().to_string();
        assert!(err.contains("--out") && err.contains("no/such") && err.contains("does not exist"), "{err}");
        assert!(!dir.path().join("no").exists(), "nothing created");
        ensure_folder_exists("--out", &dir.path().join("loss.svg")).unwrap();
        ensure_folder_exists("--out", Path::new("loss.svg")).unwrap();
    }

    /// The same file by another spelling (relative, `./`, through a symlink) is caught; a
    /// file beside it is not.
    #[test]
    fn the_same_file_by_any_path_is_an_input() {
        let dir = tempfile::tempdir().unwrap();
        let input = dir.path().join("raw.jsonl");
        std::fs::write(&input, "{}").unwrap();
        let link = dir.path().join("link.jsonl");
        std::os::unix::fs::symlink(&input, &link).unwrap();
        let dotted = dir.path().join(".").join("raw.jsonl");
        for out in [&input, &link, &dotted] {
            let err = ensure_not_an_input("--out", out, &[("--input", &input)]).unwrap_err().to_string();
            assert!(err.contains("--out") && err.contains("--input"), "{err}");
        }
        assert!(ensure_not_an_input("--out", &dir.path().join("new.parquet"), &[("--input", &input)]).is_ok());
    }

    /// An existing output is refused without `--overwrite`; a directory written atomically
    /// replaces the old one only when complete, and a failing fill leaves the old one intact
    /// and no temporary directory.
    #[test]
    fn outputs_are_replaced_only_whole_and_on_request() {
        let dir = tempfile::tempdir().unwrap();
        let out = dir.path().join("out");
        assert!(ensure_new_output("--out", &out, Some(false)).is_ok());
        std::fs::create_dir(&out).unwrap();
        assert!(ensure_new_output("--out", &out, Some(false)).is_ok(), "an empty directory is free");
        std::fs::write(out.join("a"), "old").unwrap();
        let err = ensure_new_output("--out", &out, Some(false)).unwrap_err().to_string();
        assert!(err.contains("already exists") && err.contains("--overwrite"), "{err}");
        assert!(ensure_new_output("--out", &out, Some(true)).is_ok());
        // A command without --overwrite (export) offers none.
        let err = ensure_new_output("--out", &out, None).unwrap_err().to_string();
        assert!(err.contains("already exists") && !err.contains("--overwrite"), "{err}");

        let failed = write_dir_atomic(&out, |tmp| {
            std::fs::write(tmp.join("a"), "half")?;
            anyhow::bail!("disk full")
        });
        assert!(failed.is_err());
        assert_eq!(std::fs::read_to_string(out.join("a")).unwrap(), "old");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1, "no temporary directory left");
        write_dir_atomic(&out, |tmp| Ok(std::fs::write(tmp.join("b"), "new")?)).unwrap();
        assert!(!out.join("a").exists() && std::fs::read_to_string(out.join("b")).unwrap() == "new");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
    }
}
