//! A live run holds a lock on its directory (`flock` on `.llora-run.lock`, which names its PID
//! and host): a second `llora train` on the same directory, fresh, `--overwrite`, `--resume` or
//! auto-resumed, is refused naming the live run, before it moves or writes anything. The lock
//! goes with the process, so a crashed or killed run never leaves one behind.

use std::path::Path;

use anyhow::Context;

/// The file a live run locks in its directory .
pub const LOCK: &str = ".llora-run.lock";

/// A run directory's lock, held while the run lives (released on drop or at the process's end).
#[derive(Debug)]
pub struct RunLock {
    _file: std::fs::File,
}

/// Takes the lock of `dir` (created if absent), or fails naming the live run that holds it.
pub fn lock(dir: &Path) -> anyhow::Result<RunLock> {
    use std::io::Write;
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let path = dir.join(LOCK);
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(&path)
        .with_context(|| format!("cannot open {}", path.display()))?;
    match file.try_lock() {
        Ok(()) => {}
        Err(std::fs::TryLockError::WouldBlock) => return Err(live_run(dir)),
        Err(std::fs::TryLockError::Error(e)) => {
            return Err(e).with_context(|| format!("cannot lock {}", path.display()));
        }
    }
    let host = std::fs::read_to_string("/proc/sys/kernel/hostname").unwrap_or_else(|_| "unknown host".into());
    let since = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let owner = format!("llora PID {} on {}, since unix time {since}\n", std::process::id(), host.trim());
    file.set_len(0)
        .and_then(|()| file.write_all(owner.as_bytes()))
        .with_context(|| format!("cannot write {}", path.display()))?;
    Ok(RunLock { _file: file })
}

/// The error for a directory a live run holds, naming it from its lock file.
fn live_run(dir: &Path) -> anyhow::Error {
    let owner = std::fs::read_to_string(dir.join(LOCK)).unwrap_or_default();
    anyhow::anyhow!(
        "run.dir {} is in use by a live llora run ({}): a second run there would mix with it. Wait for it to \
         end, stop it (SIGINT checkpoints it), or choose another run.dir",
        dir.display(),
        owner.trim().trim_start_matches("llora ")
    )
}

/// Refuses `dir` while a live run holds its lock; changes nothing in it (an earlier run's
/// directory stays byte for byte as it was).
pub fn refuse_if_live(dir: &Path) -> anyhow::Result<()> {
    let Ok(file) = std::fs::File::open(dir.join(LOCK)) else { return Ok(()) };
    match file.try_lock() {
        Ok(()) => {
            let _ = file.unlock();
            Ok(())
        }
        Err(std::fs::TryLockError::WouldBlock) => Err(live_run(dir)),
        Err(std::fs::TryLockError::Error(_)) => Ok(()),
    }
}
