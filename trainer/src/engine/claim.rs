//! The directory a run writes to, as [`crate::engine::run_dir::claim`] decided it: it holds the
//! directory's lock, and what `--overwrite` moved aside until the run saved something.

use std::path::{Path, PathBuf};

use tracing::{info, warn};

use crate::engine::outputs::OUTPUTS;
use crate::engine::run_lock::{LOCK, RunLock, lock};

/// The directory a run writes to; while it holds replaced outputs, dropping it unsettled
/// (the run failed before saving anything) moves them back.
#[derive(Debug)]
pub struct Claim {
    dir: PathBuf,
    replaced: Option<PathBuf>,
    resume: bool,
    finished: bool,
    /// The directory's lock, on the rank that writes there.
    lock: Option<RunLock>,
    /// The directory did not exist before the lock made it.
    created: bool,
}

impl Claim {
    /// A directory taken as it is (a free one, a resumed run's, or rank 0's decision).
    pub fn existing(dir: PathBuf) -> Self {
        Self { dir, replaced: None, resume: false, finished: false, lock: None, created: false }
    }

    /// A run directory to continue (`llora train --resume DIR`), locked on the writing rank
    /// (`main`): refused while a live run holds it.
    pub fn resumed(dir: PathBuf, main: bool) -> anyhow::Result<Self> {
        let lock = if main { Some(lock(&dir)?) } else { None };
        Ok(Self { dir, replaced: None, resume: false, finished: false, lock, created: false })
    }

    /// The interrupted run in `dir`, to be continued (`run.resume = "auto"`).
    pub(crate) fn resuming(dir: &Path) -> Self {
        Self { dir: dir.to_path_buf(), replaced: None, resume: true, finished: false, lock: None, created: false }
    }

    /// The finished run of this job in `dir`, found by a restarted attempt: nothing to train.
    pub(crate) fn finished_run(dir: &Path) -> Self {
        Self { dir: dir.to_path_buf(), replaced: None, resume: false, finished: true, lock: None, created: false }
    }

    /// `dir`, whose earlier outputs `--overwrite` is moving into `replaced`: put back if the
    /// claim is dropped before [`Self::settle`].
    pub(crate) fn replacing(dir: &Path, replaced: &Path) -> Self {
        let mut claim = Self::existing(dir.to_path_buf());
        claim.replaced = Some(replaced.to_path_buf());
        claim
    }

    /// This claim with its directory's lock taken (the directory created if absent, and removed
    /// again on drop if the run wrote nothing there).
    pub(crate) fn locked(mut self) -> anyhow::Result<Self> {
        self.created = !self.dir.exists();
        self.lock = Some(lock(&self.dir)?);
        Ok(self)
    }

    /// Whether the job's run in [`Self::dir`] has already finished (a restarted attempt).
    pub fn finished(&self) -> bool {
        self.finished
    }

    /// Whether the run continues the interrupted run in [`Self::dir`].
    pub fn resumes(&self) -> bool {
        self.resume
    }

    /// Where the run writes.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The run has saved a checkpoint or its results: what `--overwrite` replaced goes.
    pub fn settle(&mut self) {
        if let Some(replaced) = self.replaced.take() {
            match std::fs::remove_dir_all(&replaced) {
                Ok(()) => info!(removed = %replaced.display(), "the replaced run's outputs are deleted"),
                Err(e) => warn!("cannot delete {} (the replaced run's outputs): {e}", replaced.display()),
            }
        }
    }

    /// Puts the replaced outputs back, removing what the new run wrote under the same names.
    fn restore(&mut self, replaced: &Path) -> std::io::Result<()> {
        for name in OUTPUTS {
            let kept = replaced.join(name);
            if kept.symlink_metadata().is_err() {
                continue;
            }
            let target = self.dir.join(name);
            if target.is_dir() {
                std::fs::remove_dir_all(&target)?;
            } else if target.symlink_metadata().is_ok() {
                std::fs::remove_file(&target)?;
            }
            std::fs::rename(&kept, &target)?;
        }
        std::fs::remove_dir(replaced)
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        if let Some(replaced) = self.replaced.take() {
            match self.restore(&replaced) {
                Ok(()) => {
                    warn!(dir = %self.dir.display(), "the run stopped before saving anything: the earlier run's outputs are back")
                }
                Err(e) => warn!(
                    "the run stopped before saving anything, and the earlier run's outputs could not all be moved \
                     back ({e}); they are in {}",
                    replaced.display()
                ),
            }
        }
        // A directory made only to hold the lock, by a run refused before writing anything,
        // goes again: a refused command leaves nothing behind.
        if self.created {
            let only_lock =
                std::fs::read_dir(&self.dir).is_ok_and(|d| d.flatten().all(|e| e.file_name().to_str() == Some(LOCK)));
            if only_lock {
                self.lock.take();
                let _ = std::fs::remove_file(self.dir.join(LOCK));
                let _ = std::fs::remove_dir(&self.dir);
            }
        }
    }
}
