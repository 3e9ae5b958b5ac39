//! Start-up: before the world's process group waits for its peers (Gloo and NCCL wait for
//! every rank's address for `dist.timeout_s`, silently), each rank reaches the job's store and
//! writes that it started, and a rank that failed before getting there writes why
//! ([`announce_startup_failure`]). The ranks then go on together, or all stop within seconds
//! naming the rank that failed and its error; ranks that never come are named while waited
//! for, every 30 s.

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tracing::info;

use super::c10d::{Store, quiet_c10_warnings, without_c10_logs};
use super::collective::DistError;
use super::world::{DistConfig, World};

/// What a rank that failed before joining writes under its key, before its error.
const FAILED: &str = "failed: ";
/// How often the waiting ranks say whom they wait for.
const NOTE_EVERY: Duration = Duration::from_secs(30);
/// How long a failing rank tries to reach the store, and rank 0 (its server) keeps it up for
/// the others to read the failure.
const ANNOUNCE_FOR: Duration = Duration::from_secs(30);

/// This process began joining a world (its own failures are then the rendezvous's to report).
static JOINING: AtomicBool = AtomicBool::new(false);

/// Rank `rank`'s start-up key in the store, per launcher attempt (a restart never reads the
/// words of the attempt before it).
fn key(world: &World, rank: usize) -> String {
    format!("llora/attempt_{}/started/{rank}", world.attempt)
}

/// Reaches the store (serving it when `serve`), says this rank started, and waits until every
/// rank did, up to `timeout`; fails naming a rank that wrote it failed, or the ranks that never
/// came. Returns the store for the world's group.
pub(super) fn rendezvous(world: &World, serve: bool, timeout: Duration) -> Result<Store, DistError> {
    JOINING.store(true, Ordering::SeqCst);
    // A peer that dies takes the store's reads with it, each logged by c10d with its C++ stack
    // (by the heartbeat thread too, before any collective fails): llora names the lost rank in
    // one line instead. TORCH_CPP_LOG_LEVEL, when set, keeps c10's warnings.
    if std::env::var_os("TORCH_CPP_LOG_LEVEL").is_none() {
        quiet_c10_warnings();
    }
    without_c10_logs(|| meet(world, serve, timeout))
}

/// [`rendezvous`] with c10's logs off (each failed attempt to reach a store that is not up yet,
/// or has died, is a warning or an error with its C++ stack; the failure is reported here).
fn meet(world: &World, serve: bool, timeout: Duration) -> Result<Store, DistError> {
    let started = Instant::now();
    let store = connect(world, serve, timeout)?;
    let fail = |m: String| DistError::setup(world, m);
    store.put(&key(world, world.rank), b"started").map_err(|m| fail(format!("cannot write to the store: {m}")))?;
    let mut note_at = NOTE_EVERY;
    loop {
        let mut missing = Vec::new();
        for r in 0..world.size {
            if !store.check(&key(world, r)).map_err(|m| fail(format!("cannot read the store: {m}")))? {
                missing.push(r);
            }
        }
        if missing.is_empty() {
            break;
        }
        let waited = started.elapsed();
        if waited >= timeout {
            return Err(fail(format!(
                "ranks {missing:?} did not start within dist.timeout_s = {} s (a rank that died before reaching the \
                 store at {}:{}, or a launcher that started fewer than WORLD_SIZE = {} ranks)",
                timeout.as_secs(),
                world.master_addr,
                world.master_port,
                world.size
            )));
        }
        if waited >= note_at {
            info!(
                "waiting for ranks {missing:?} to start ({} s of dist.timeout_s = {} s)",
                waited.as_secs(),
                timeout.as_secs()
            );
            note_at += NOTE_EVERY;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let mut failed = Vec::new();
    for r in (0..world.size).filter(|&r| r != world.rank) {
        let word = store.fetch(&key(world, r)).map_err(|m| fail(format!("cannot read the store: {m}")))?;
        if let Some(why) = String::from_utf8_lossy(&word).strip_prefix(FAILED) {
            failed.push(format!("rank {r} failed at start-up: {why}"));
        }
    }
    match failed.is_empty() {
        true => Ok(store),
        false => Err(fail(failed.join("; "))),
    }
}

/// The store, tried every 30 s (saying so) until `timeout`: rank 0, or torchrun's agent, may
/// start after this rank.
fn connect(world: &World, serve: bool, timeout: Duration) -> Result<Store, DistError> {
    let started = Instant::now();
    loop {
        let left = timeout.saturating_sub(started.elapsed());
        match Store::connect(world, serve, left.min(NOTE_EVERY), timeout) {
            Ok(store) => return Ok(store),
            Err(m) if serve || started.elapsed() >= timeout => {
                return Err(DistError::setup(
                    world,
                    format!("cannot reach the store at {}:{}: {m}", world.master_addr, world.master_port),
                ));
            }
            Err(_) => info!(
                "waiting for the store at {}:{} (rank 0 or the launcher serves it): {} s of dist.timeout_s = {} s",
                world.master_addr,
                world.master_port,
                started.elapsed().as_secs(),
                timeout.as_secs()
            ),
        }
    }
}

/// How long a rank whose group failed to form waits for every other rank's word about it.
const GROUP_WORD_WAIT: Duration = Duration::from_secs(5);

/// Rank `rank`'s word on forming the world's group, per launcher attempt.
fn group_key(world: &World, rank: usize) -> String {
    format!("llora/attempt_{}/group/{rank}", world.attempt)
}

/// Forms the world's group with `form` (its store reached and every rank started), each rank
/// then saying in the store, through a second connection `watch`, whether it formed: a rank
/// that dies while the group forms (Gloo's and NCCL's errors then name an address, or nothing)
/// is named as lost by the ranks that outlive it, from the words that never come.
pub(super) fn form_group<G>(
    world: &World,
    watch: Option<Store>,
    form: impl FnOnce() -> Result<G, DistError>,
) -> Result<G, DistError> {
    let formed = form();
    let Some(watch) = watch else { return formed };
    let word: &[u8] = if formed.is_ok() { b"formed" } else { b"failed" };
    let _ = without_c10_logs(|| watch.put(&group_key(world, world.rank), word));
    let Err(DistError::Setup { message, .. }) = formed else { return formed };
    let started = Instant::now();
    let silent = |r: &usize| !without_c10_logs(|| watch.check(&group_key(world, *r))).unwrap_or(false);
    let mut lost: Vec<usize> = (0..world.size).filter(|r| *r != world.rank).collect();
    while !lost.is_empty() && started.elapsed() < GROUP_WORD_WAIT {
        lost.retain(silent);
        std::thread::sleep(Duration::from_millis(100));
    }
    let why = match lost.as_slice() {
        [] => message,
        [r] => format!(
            "{message}; lost rank {r} while the group formed (no word from it within {} s: it died or hangs)",
            GROUP_WORD_WAIT.as_secs()
        ),
        rs => format!(
            "{message}; lost ranks {rs:?} while the group formed (no word from them within {} s: they died or hang)",
            GROUP_WORD_WAIT.as_secs()
        ),
    };
    Err(DistError::setup(world, why))
}

/// Says in the store that this rank failed before joining its world (`message`: its error), so
/// that the others stop at once naming it instead of waiting for `dist.timeout_s`. A no-op
/// unless a launcher started this process as one of several ranks and it never began joining.
/// Rank 0 outside torchrun serves the store, and keeps it up until every rank has read its
/// word or [`ANNOUNCE_FOR`] passed.
pub fn announce_startup_failure(message: &str) {
    if JOINING.load(Ordering::SeqCst) {
        return;
    }
    let Ok(world) = World::from_env(|k| std::env::var(k).ok(), &DistConfig::default()) else { return };
    if world.size < 2 {
        return;
    }
    let serve = world.serves_store();
    let Ok(store) = without_c10_logs(|| Store::connect(&world, serve, ANNOUNCE_FOR, ANNOUNCE_FOR)) else {
        return;
    };
    let one_line: String = message.lines().map(str::trim).collect::<Vec<_>>().join(" ").chars().take(2000).collect();
    if store.put(&key(&world, world.rank), format!("{FAILED}{one_line}").as_bytes()).is_err() || !serve {
        return;
    }
    let started = Instant::now();
    while started.elapsed() < ANNOUNCE_FOR {
        if (0..world.size).all(|r| store.check(&key(&world, r)).unwrap_or(true)) {
            // Every rank has written its word, so each is reading (or has read) this one.
            std::thread::sleep(Duration::from_secs(2));
            return;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A rank whose group failed to form names the peer that said nothing about it as lost
    /// (a peer SIGKILLed while Gloo connected its mesh: Gloo's error names an address only),
    /// and not a peer that said it failed too.
    #[test]
    fn a_failed_group_names_the_silent_rank_as_lost() {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let world = World { master_addr: "127.0.0.1".into(), master_port: port, size: 3, ..World::single() };
        let server = Store::connect(&world, true, Duration::from_secs(5), Duration::from_secs(5)).unwrap();
        let watch = || Store::connect(&world, false, Duration::from_secs(5), Duration::from_secs(5)).unwrap();
        // Rank 2 failed too and said so; rank 1 says nothing.
        server.put(&group_key(&world, 2), b"failed").unwrap();
        let failed = || Err::<(), _>(DistError::setup(&world, "cannot join the gloo group: Connection refused".into()));
        let err = form_group(&world, Some(watch()), failed).unwrap_err().to_string();
        assert!(err.contains("Connection refused") && err.contains("lost rank 1 while the group formed"), "{err}");
        assert!(!err.contains("rank 2"), "{err}");
        // Where every peer spoke, the error is the group's own.
        server.put(&group_key(&world, 1), b"failed").unwrap();
        let err = form_group(&world, Some(watch()), failed).unwrap_err().to_string();
        assert!(!err.contains("lost"), "{err}");
        // A group that formed is returned as it is, and says so.
        assert_eq!(form_group(&world, Some(watch()), || Ok::<_, DistError>(7)).unwrap(), 7);
        assert_eq!(server.fetch(&group_key(&world, 0)).unwrap(), b"formed");
    }
}
