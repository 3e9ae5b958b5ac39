//! Output paths checked against the inputs of the same command: a command never writes over a
//! file it reads (`data prepare --out` equal to `--input` replaced the raw text).

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

#[cfg(test)]
mod tests {
    use super::*;

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
}
