//! The SIGINT/SIGTERM flag the loop checks between steps (see [`StopSignal`]).

/// SIGINT/SIGTERM as a flag checked between steps; the handlers are removed on drop.
///
/// Signals come in pairs and more: coreutils `timeout` signals the child and then its group,
/// launchers forward what they get, users press Ctrl-C twice. The first signal asks for a
/// stop after the current step and its checkpoint (exit 130); a second, which may arrive while
/// that checkpoint is being written, only says so, and the checkpoint is finished; a third
/// exits at once without it, saying so, with [`HARD_EXIT_CODE`] (not 130, so that a scheduler
/// can tell it from a checkpointed stop). Each arrival is counted in the handler itself: a
/// thread reading them later would see several merged into one.
pub struct StopSignal {
    flag: std::sync::Arc<std::sync::atomic::AtomicBool>,
    ids: Vec<signal_hook::SigId>,
}

/// The exit status of a third signal's exit without the checkpoint being written.
pub const HARD_EXIT_CODE: i32 = 131;

impl StopSignal {
    /// Installs the handlers.
    pub fn install() -> anyhow::Result<Self> {
        use signal_hook::consts::{SIGINT, SIGTERM};
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
        let flag = std::sync::Arc::new(AtomicBool::new(false));
        let count = std::sync::Arc::new(AtomicUsize::new(0));
        let mut ids = Vec::new();
        for (sig, first) in [
            (SIGINT, &b"llora: SIGINT: stopping after this step, once its checkpoint is saved\n"[..]),
            (SIGTERM, &b"llora: SIGTERM: stopping after this step, once its checkpoint is saved\n"[..]),
        ] {
            let (flag, count) = (flag.clone(), count.clone());
            let action = move || {
                let n = count.fetch_add(1, Ordering::SeqCst) + 1;
                flag.store(true, Ordering::SeqCst);
                let msg: &[u8] = match n {
                    1 => first,
                    2 => {
                        b"llora: signal again: still finishing the step and its checkpoint (a third signal \
                           exits at once without it, exit 131)\n"
                    }
                    _ => {
                        b"llora: signal a third time: exiting at once, without the checkpoint of this step \
                           (earlier checkpoints are complete; exit 131)\n"
                    }
                };
                // SAFETY: write(2) on stderr with a static buffer is async-signal-safe.
                unsafe { libc::write(2, msg.as_ptr().cast(), msg.len()) };
                if n >= 3 {
                    // `_exit`: no destructors run under the training thread.
                    signal_hook::low_level::exit(HARD_EXIT_CODE);
                }
            };
            // SAFETY: the action uses atomics, write(2) and _exit only: all async-signal-safe.
            ids.push(unsafe { signal_hook::low_level::register(sig, action) }?);
        }
        Ok(Self { flag, ids })
    }

    /// Whether SIGINT or SIGTERM arrived.
    pub fn raised(&self) -> bool {
        self.flag.load(std::sync::atomic::Ordering::SeqCst)
    }
}

impl Drop for StopSignal {
    fn drop(&mut self) {
        for id in self.ids.drain(..) {
            signal_hook::low_level::unregister(id);
        }
    }
}
