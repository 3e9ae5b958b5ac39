//! The CUDA routes' shared control: which devices take them, their first-use verdicts, and the
//! CPU stand-in that runs all of it in CI.
//!
//! Every CUDA-only route (the FP8 two-pass quantiser and one-pass amax, LibTorch's fused
//! RMSNorm kernels, the fused attention kernels and their choice, the variable-length kernel of
//! packed rows) is checked against a reference the first time a device meets it and falls back
//! to that reference when the check fails. That control flow is the dangerous part of code
//! written where it cannot run: a lock held across the FP8 check, which re-enters its own
//! route, hangs every FP8 run. Two rules live here:
//! - [`Verdicts`] never holds its lock while a check runs. A caller that arrives while a check
//!   of the same key runs (the check itself re-entering the route it checks, or another
//!   thread) gets the reference route, which is what the check compares with, so the result is
//!   the same; a check that panics counts as failed.
//! - [`ON_CPU_ENV`]`=1` makes the CPU take the CUDA routes ([`takes_cuda_routes`]), with each
//!   kernel the CPU lacks replaced by its LibTorch composite ([`stands_in`]): the route
//!   choice, first-use checks, fallbacks and counters then run in CI and in `llora selftest` /
//!   `llora bench --device cpu`. It measures nothing about the kernels themselves.

use std::cell::Cell;
use std::collections::HashMap;
use std::fmt::Debug;
use std::hash::Hash;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};

/// The environment variable that makes the CPU take the CUDA routes when set to `1`.
pub const ON_CPU_ENV: &str = "LLORA_CUDA_ROUTES_ON_CPU";

/// The environment variable that turns off the CUDA routes added after the first GPU
/// measurements (fused RMSNorm kernels, the two-pass FP8 quantiser and one-pass amax, the
/// variable-length attention of packed rows) when set to `off`: a diagnostic switch, so that
/// one GPU run can time each step with and without them (`scripts/gpu-check.sh`'s `-unfused`
/// rows). The routes give the same results either way (bit for bit, or within an ulp for the
/// norm).
pub const FUSED_ROUTES_ENV: &str = "LLORA_CUDA_FUSED_ROUTES";

/// Whether the newer CUDA routes may run ([`FUSED_ROUTES_ENV`] not `off`); read once.
pub fn fused_routes() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| match switch(FUSED_ROUTES_ENV).as_deref() {
        Some("off") => {
            tracing::info!("{FUSED_ROUTES_ENV}=off: the fused CUDA routes are off");
            false
        }
        None | Some("" | "on") => true,
        Some(other) => {
            tracing::warn!("{FUSED_ROUTES_ENV}={other} is neither off nor on: taken as on (the fused routes run)");
            true
        }
    })
}

/// A switch's value in the environment: `None` when unset; a word it may take as it is; any
/// other value quoted (one that is not UTF-8 as its lossy text, said so), to be reported as it
/// reads and to match no word.
fn switch(name: &str) -> Option<String> {
    let value = std::env::var_os(name)?;
    Some(match value.to_str() {
        Some(v @ ("" | "0" | "1" | "on" | "off")) => v.to_string(),
        Some(v) => format!("{v:?}"),
        None => format!("{:?} (not UTF-8)", value.to_string_lossy()),
    })
}

thread_local! {
    /// This thread's override of [`ON_CPU_ENV`] ([`on_cpu_for_this_thread`]).
    static FORCED: Cell<Option<bool>> = const { Cell::new(None) };
    /// Whether this thread is running a first-use check ([`run_check`]).
    static IN_CHECK: Cell<bool> = const { Cell::new(false) };
}

/// Whether the CPU takes the CUDA routes: this thread's override, else [`ON_CPU_ENV`] (read
/// once; a value other than `1`, `0` or empty is reported and taken as off).
pub fn on_cpu() -> bool {
    if let Some(forced) = FORCED.with(Cell::get) {
        return forced;
    }
    static ENV: OnceLock<bool> = OnceLock::new();
    *ENV.get_or_init(|| match switch(ON_CPU_ENV).as_deref() {
        Some("1") => {
            tracing::info!("{ON_CPU_ENV}=1: the CPU takes the CUDA routes, the kernels it lacks as composites");
            true
        }
        None | Some("0" | "") => false,
        Some(other) => {
            tracing::warn!("{ON_CPU_ENV}={other} is neither 1 nor 0: taken as 0 (the CPU keeps its own routes)");
            false
        }
    })
}

/// Restores a thread's earlier override when dropped (see [`on_cpu_for_this_thread`]).
#[cfg(test)]
pub type OnCpuOverride = crate::scoped::Restore<Option<bool>>;

/// Sets [`on_cpu`] for this thread until the returned guard is dropped, whatever the
/// environment says: tests run on threads of one process, so they cannot set the variable.
#[cfg(test)]
pub fn on_cpu_for_this_thread(on: bool) -> OnCpuOverride {
    crate::scoped::set(&FORCED, Some(on))
}

/// Whether tensors on `device` take the CUDA routes: a CUDA device, or the CPU under
/// [`ON_CPU_ENV`].
pub fn takes_cuda_routes(device: tch::Device) -> bool {
    match device {
        tch::Device::Cuda(_) => true,
        tch::Device::Cpu => on_cpu(),
        _ => false,
    }
}

/// Whether the CPU stands in for CUDA on `device`: a CUDA route's kernel that the CPU lacks
/// runs as its LibTorch composite there.
pub fn stands_in(device: tch::Device) -> bool {
    device == tch::Device::Cpu && on_cpu()
}

/// What a route is, declared once beside the op it replaces ([`declare_route!`], which also
/// registers it in [`ROUTES`], the list `llora selftest` and `llora bench` read).
#[derive(Debug)]
pub struct RouteSpec {
    /// What the route is, as logs name its first-use check.
    pub name: &'static str,
    /// What runs instead when the check fails, for the warning.
    pub fallback: &'static str,
    /// Its place in the list (the order `llora selftest` runs the routes in).
    pub order: u16,
    /// The `llora selftest --only` part that checks it.
    pub part: &'static str,
    /// Its self-tests, each on a device against the route's reference.
    pub self_tests: &'static [SelfTest],
    /// Whether the route records that a run took it (bench JSON `used`; `null` otherwise).
    pub counts_uses: bool,
}

/// One self-test of a route.
#[derive(Debug)]
pub struct SelfTest {
    /// As `llora selftest` and `llora bench`'s `route_list` name it.
    pub name: &'static str,
    /// The check on a device (run once where the route keeps its verdict): `Ok` means a run
    /// takes the route there.
    pub check: fn(tch::Device) -> Result<(), String>,
    /// What passing it says, for the self-test's detail.
    pub passed: &'static str,
}

/// A declared route, as the list sees it.
pub trait Declared: Sync {
    /// Its description.
    fn spec(&self) -> &'static RouteSpec;
    /// Whether a run in this process took it.
    fn used(&self) -> bool;
}

/// Every route [`declare_route!`] declared, gathered at link time.
#[linkme::distributed_slice]
pub static ROUTES: [&'static dyn Declared];

/// Declares a route's [`Verdicts`] static from its [`RouteSpec`] and registers it in
/// [`ROUTES`]: the one place a route is named.
macro_rules! declare_route {
    ($(#[$doc:meta])* $vis:vis static $name:ident: Verdicts<$key:ty> = $spec:expr;) => {
        $(#[$doc])*
        $vis static $name: $crate::routes::Verdicts<$key> = $crate::routes::Verdicts::new($spec);
        const _: () = {
            #[linkme::distributed_slice($crate::routes::ROUTES)]
            static DECLARED: &'static dyn $crate::routes::Declared = &$name;
        };
    };
}
pub(crate) use declare_route;

/// One route's state: its first-use verdicts, per key (a device, a device and dtype, an
/// attention problem), each key's check run once, logged either way, with no lock held while
/// it runs; and whether a run in this process took the route (`llora bench` reports it
/// through [`crate::route_list`]).
pub struct Verdicts<K> {
    /// What the route is.
    spec: &'static RouteSpec,
    /// Per key: `None` while its check runs, then the check's result.
    map: Mutex<Option<HashMap<K, Verdict>>>,
    /// Whether the route ran in this process.
    used: AtomicBool,
}

/// A key's check: `None` while it runs, then its result.
type Verdict = Option<Result<(), String>>;

impl<K: Copy + Eq + Hash + Debug + Send> Declared for Verdicts<K> {
    fn spec(&self) -> &'static RouteSpec {
        self.spec
    }

    fn used(&self) -> bool {
        Verdicts::used(self)
    }
}

impl<K: Copy + Eq + Hash + Debug> Verdicts<K> {
    /// An empty table for the route `spec` describes ([`declare_route!`] makes each one).
    pub const fn new(spec: &'static RouteSpec) -> Self {
        Self { spec, map: Mutex::new(None), used: AtomicBool::new(false) }
    }

    /// Records that the route ran, unless it ran for a first-use check (its own or another's):
    /// a route whose check failed has not been taken.
    pub fn mark_used(&self) {
        if !IN_CHECK.with(Cell::get) {
            self.used.store(true, Ordering::Relaxed);
        }
    }

    /// Whether the route has run in this process.
    pub fn used(&self) -> bool {
        self.used.load(Ordering::Relaxed)
    }

    fn lock(&self) -> MutexGuard<'_, Option<HashMap<K, Verdict>>> {
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Whether the route passed its check for `key` (see [`Self::check`]). Once decided, a
    /// lookup: routes ask this on every use, so a refusal's message is not cloned each time.
    pub fn passed(&self, key: K, check: impl FnOnce() -> Result<(), String>) -> bool {
        self.verdict(key).unwrap_or_else(|| self.check(key, check).is_ok())
    }

    /// The route's check for `key`: run the first time (the lock released meanwhile), its
    /// result kept. While that check runs, every caller for `key`, the check itself included,
    /// gets an error: the reference route.
    pub fn check(&self, key: K, check: impl FnOnce() -> Result<(), String>) -> Result<(), String> {
        {
            let mut guard = self.lock();
            let map = guard.get_or_insert_with(HashMap::new);
            match map.get(&key) {
                Some(Some(done)) => return done.clone(),
                Some(None) => {
                    tracing::trace!(route = self.spec.name, ?key, "asked during its own check: the reference route");
                    return Err(format!("{}: asked while its check runs", self.spec.name));
                }
                None => map.insert(key, None),
            };
        }
        tracing::debug!(route = self.spec.name, ?key, "first-use check: starting");
        let result = run_check(check);
        self.lock().get_or_insert_with(HashMap::new).insert(key, Some(result.clone()));
        match &result {
            Ok(()) => tracing::info!(?key, "{}: checked against its reference, taken", self.spec.name),
            Err(e) => tracing::warn!(?key, "{} refused ({e}); {}", self.spec.name, self.spec.fallback),
        }
        result
    }

    /// The verdict for `key` once its check has ended: `Some(true)` passed, `Some(false)`
    /// refused, `None` not checked yet or being checked.
    pub fn verdict(&self, key: K) -> Option<bool> {
        self.lock().as_ref()?.get(&key)?.as_ref().map(Result::is_ok)
    }
}

/// Runs a first-use check, a panic counted as a failure with its message: a check must never
/// leave its route "being checked" for the rest of the process, nor take the process down.
pub fn run_check(check: impl FnOnce() -> Result<(), String>) -> Result<(), String> {
    // A check runs on one rank alone: its amaxes are its own (a reduction would wait for
    // ranks that never reach it).
    // Our kernels' launches inside it wait and check their errors: a fault fails this check.
    // Its random inputs leave the CPU generator as they found it: the dropout seeds drawn
    // after it must not depend on whether a check ran first (`rng.rs`).
    let check = || {
        crate::scoped::with(&IN_CHECK, true, || {
            crate::rng::keeping_cpu_generator(|| {
                crate::kernels::launch::with_checked_launches(|| crate::fp8::amax_group::with_amax_group(None, check))
            })
        })
    };
    std::panic::catch_unwind(AssertUnwindSafe(check)).unwrap_or_else(|payload| {
        Err(format!("the check panicked: {}", crate::kernels::nvrtc::panic_message(&payload)))
    })
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A route for the tests of [`Verdicts`] (not declared: not in the list).
    static TEST_ROUTE: RouteSpec = RouteSpec {
        name: "test route",
        fallback: "the reference runs",
        order: 0,
        part: "test",
        self_tests: &[],
        counts_uses: true,
    };

    /// Runs `f` on a thread of its own with the CUDA routes on the CPU, failing the test if it
    /// takes longer than `secs` (a deadlock fails, it does not hang the suite).
    pub(crate) fn on_cpu_within<T: Send + 'static>(secs: u64, what: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _on = on_cpu_for_this_thread(true);
            let _ = tx.send(f());
        });
        match rx.recv_timeout(std::time::Duration::from_secs(secs)) {
            Ok(v) => v,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => panic!("{what}: hung (no answer within {secs} s)"),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => panic!("{what}: panicked (see above)"),
        }
    }

    /// Waits until `done` holds, failing the test after `secs`.
    pub(crate) fn until(secs: u64, done: impl Fn() -> bool) {
        let start = std::time::Instant::now();
        while !done() {
            assert!(start.elapsed().as_secs() < secs, "not done within {secs} s");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }

    /// A check that re-enters its own route gets the reference route (no deadlock); its
    /// verdict is then kept, and a check that panics is a refusal, not a stuck "checking".
    #[test]
    fn a_check_that_reenters_its_route_sees_the_reference() {
        static V: Verdicts<u8> = Verdicts::new(&TEST_ROUTE);
        let inner = on_cpu_within(20, "re-entrant check", || {
            let mut seen = None;
            let outer = V.passed(1, || {
                seen = Some(V.passed(1, || panic!("a nested check must not run")));
                Ok(())
            });
            (outer, seen)
        });
        assert_eq!(inner, (true, Some(false)));
        assert_eq!(V.verdict(1), Some(true));
        assert!(!V.passed(2, || panic!("broken kernel")));
        assert_eq!(V.verdict(2), Some(false));
        assert!(!V.passed(3, || Err("codes differ".into())));
        assert_eq!(V.verdict(4), None);
    }

    /// A route run by a first-use check is not "used" (a refused route never ran for the
    /// model); run outside a check, it is.
    #[test]
    fn a_route_run_by_its_check_is_not_counted_as_used() {
        static V: Verdicts<u8> = Verdicts::new(&TEST_ROUTE);
        assert!(!V.passed(1, || {
            V.mark_used();
            Err("wrong codes".into())
        }));
        assert!(!V.used(), "only the check ran it");
        assert!(V.passed(2, || Ok(())));
        V.mark_used();
        assert!(V.used());
    }

    /// The switch: the CPU takes the CUDA routes only under it; other devices never.
    #[test]
    fn the_cpu_takes_cuda_routes_only_under_the_switch() {
        let _off = on_cpu_for_this_thread(false);
        assert!(!takes_cuda_routes(tch::Device::Cpu) && !stands_in(tch::Device::Cpu));
        assert!(takes_cuda_routes(tch::Device::Cuda(3)) && !stands_in(tch::Device::Cuda(3)));
        {
            let _on = on_cpu_for_this_thread(true);
            assert!(takes_cuda_routes(tch::Device::Cpu) && stands_in(tch::Device::Cpu));
            assert!(!takes_cuda_routes(tch::Device::Mps));
        }
        assert!(!on_cpu(), "the override ends with its guard");
    }
}
