//! PyTorch's c10d process groups (Gloo for CPU tensors, NCCL for CUDA tensors) through the C++
//! shim beside this file (`c10d_shim.cpp`, built by `trainer/build.rs`).
//!
//! Buffers cross as host slices: a Gloo collective runs in place on the slice (a LibTorch
//! tensor over its memory, no copy); an NCCL one copies it to this rank's GPU and back.

use std::ffi::{CString, c_char, c_int, c_void};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use super::collective::{
    Backend, Collective, DistError, InFlight, PendingBytes, PendingSum, ReduceOp, plain_c10d_message,
};
use super::world::World;

unsafe extern "C" {
    fn llora_c10d_store_new(
        host: *const c_char,
        port: u16,
        is_server: c_int,
        connect_ms: i64,
        timeout_ms: i64,
        err: *mut *mut c_char,
    ) -> *mut c_void;
    fn llora_c10d_store_free(s: *mut c_void);
    fn llora_c10d_store_check(s: *mut c_void, key: *const c_char, exists: *mut c_int, err: *mut *mut c_char) -> c_int;
    fn llora_c10d_store_put(
        s: *mut c_void,
        key: *const c_char,
        data: *const u8,
        len: usize,
        err: *mut *mut c_char,
    ) -> c_int;
    fn llora_c10d_store_fetch(
        s: *mut c_void,
        key: *const c_char,
        data: *mut *mut u8,
        len: *mut usize,
        err: *mut *mut c_char,
    ) -> c_int;
    fn llora_c10d_new(
        store: *mut c_void,
        prefix: *const c_char,
        rank: c_int,
        world: c_int,
        backend: c_int,
        cuda_device: c_int,
        timeout_ms: i64,
        err: *mut *mut c_char,
    ) -> *mut c_void;
    fn llora_c10d_shutdown(g: *mut c_void, err: *mut *mut c_char) -> c_int;
    fn llora_c10d_abort(g: *mut c_void);
    fn llora_c10d_bound_device(g: *mut c_void) -> c_int;
    fn llora_c10d_free_group(g: *mut c_void);
    fn llora_c10d_free(s: *mut c_char);
    fn llora_c10d_log_level(level: c_int) -> c_int;
    fn llora_c10d_all_reduce(g: *mut c_void, t: *mut torch_sys::C_tensor, op: c_int, err: *mut *mut c_char) -> c_int;
    fn llora_c10d_broadcast(g: *mut c_void, t: *mut torch_sys::C_tensor, root: c_int, err: *mut *mut c_char) -> c_int;
    fn llora_c10d_all_gather_start(
        g: *mut c_void,
        out: *mut torch_sys::C_tensor,
        input: *mut torch_sys::C_tensor,
        world: c_int,
        err: *mut *mut c_char,
    ) -> *mut c_void;
    fn llora_c10d_all_reduce_start(g: *mut c_void, t: *mut torch_sys::C_tensor, err: *mut *mut c_char) -> *mut c_void;
    fn llora_c10d_work_wait(w: *mut c_void, err: *mut *mut c_char) -> c_int;
    fn llora_c10d_work_free(w: *mut c_void);
    fn llora_c10d_barrier(g: *mut c_void, err: *mut *mut c_char) -> c_int;
    fn llora_c10d_store_set(
        g: *mut c_void,
        key: *const c_char,
        data: *const u8,
        len: usize,
        err: *mut *mut c_char,
    ) -> c_int;
    fn llora_c10d_store_get(
        g: *mut c_void,
        key: *const c_char,
        data: *mut *mut u8,
        len: *mut usize,
        err: *mut *mut c_char,
    ) -> c_int;
    fn llora_c10d_store_add(
        g: *mut c_void,
        key: *const c_char,
        delta: i64,
        value: *mut i64,
        err: *mut *mut c_char,
    ) -> c_int;
}

/// The shim's group handle; c10d's store and process groups are thread-safe.
struct Handle(*mut c_void);
// SAFETY: the handle is only used through the shim, whose c10d objects lock internally
// (TCPStore serialises its client operations; a process group takes one caller at a time, and
// llora's collectives are all issued by the training thread).
unsafe impl Send for Handle {}
unsafe impl Sync for Handle {}

impl Drop for Handle {
    fn drop(&mut self) {
        // SAFETY: created by llora_c10d_new, freed once.
        unsafe { llora_c10d_free_group(self.0) }
    }
}

/// c10's log threshold that keeps errors only (c10d's warnings each carry a C++ stack).
const C10_ERRORS: c_int = 2;

/// c10's warnings off from here on (a higher threshold already set stays): c10d logs each
/// failed read of a dead peer's store as a warning with ~25 lines of C++ frames, a failure
/// llora reports itself in one line. Errors (NCCL's watchdog, say) still print.
pub fn quiet_c10_warnings() {
    // SAFETY: sets an integer of c10's.
    unsafe {
        let old = llora_c10d_log_level(C10_ERRORS);
        llora_c10d_log_level(old.max(C10_ERRORS));
    }
}

/// `f` with c10's logs off (restored after): connection attempts to a store whose server is
/// not up yet, each of which c10d logs as a warning, then an error, with ~25 lines of C++
/// frames; the caller reports the failure itself.
pub fn without_c10_logs<T>(f: impl FnOnce() -> T) -> T {
    // SAFETY: sets an integer of c10's (3: fatal only).
    let old = unsafe { llora_c10d_log_level(3) };
    let out = f();
    // SAFETY: as above.
    unsafe { llora_c10d_log_level(old.max(0)) };
    out
}

/// A connection to the job's TCPStore, before any group (the start-up rendezvous runs on it;
/// the groups made on it keep it alive in the shim). Keys are full keys, no prefix.
pub struct Store(*mut c_void);
// SAFETY: c10d's TCPStore serialises its client operations; the handle is only used through
// the shim.
unsafe impl Send for Store {}
unsafe impl Sync for Store {}

impl Store {
    /// Connects to the store at `world`'s master address (serving it when `serve`), waiting up
    /// to `connect` for its server; operations then wait up to `timeout`.
    pub fn connect(world: &World, serve: bool, connect: Duration, timeout: Duration) -> Result<Self, String> {
        let host =
            CString::new(world.master_addr.clone()).map_err(|_| "MASTER_ADDR contains a NUL byte".to_string())?;
        let (connect_ms, timeout_ms) = (connect.as_millis() as i64, timeout.as_millis() as i64);
        let mut err = std::ptr::null_mut();
        // SAFETY: a valid C string; err receives a malloc'd message on failure.
        let s = unsafe {
            llora_c10d_store_new(host.as_ptr(), world.master_port, c_int::from(serve), connect_ms, timeout_ms, &mut err)
        };
        if s.is_null() {
            return Err(check(0, err).unwrap_err());
        }
        Ok(Self(s))
    }

    /// Whether `key` is set (no wait).
    pub fn check(&self, key: &str) -> Result<bool, String> {
        let k = CString::new(key).expect("keys have no NUL");
        let (mut exists, mut err) = (0, std::ptr::null_mut());
        // SAFETY: live store, valid key.
        check(unsafe { llora_c10d_store_check(self.0, k.as_ptr(), &mut exists, &mut err) }, err)?;
        Ok(exists != 0)
    }

    /// Sets `key` to `value`.
    pub fn put(&self, key: &str, value: &[u8]) -> Result<(), String> {
        let k = CString::new(key).expect("keys have no NUL");
        let mut err = std::ptr::null_mut();
        // SAFETY: live store, valid key and slice.
        check(unsafe { llora_c10d_store_put(self.0, k.as_ptr(), value.as_ptr(), value.len(), &mut err) }, err)
    }

    /// The value of `key` (waits up to the store's timeout for it).
    pub fn fetch(&self, key: &str) -> Result<Vec<u8>, String> {
        let k = CString::new(key).expect("keys have no NUL");
        let (mut data, mut len, mut err) = (std::ptr::null_mut(), 0usize, std::ptr::null_mut());
        // SAFETY: live store, valid key; the shim mallocs `data` on success.
        check(unsafe { llora_c10d_store_fetch(self.0, k.as_ptr(), &mut data, &mut len, &mut err) }, err)?;
        // SAFETY: `len` bytes at `data`, malloc'd by the shim and freed here.
        let v = unsafe { std::slice::from_raw_parts(data, len) }.to_vec();
        unsafe { llora_c10d_free(data as *mut c_char) };
        Ok(v)
    }
}

impl Drop for Store {
    fn drop(&mut self) {
        // SAFETY: created by llora_c10d_store_new, freed once.
        unsafe { llora_c10d_store_free(self.0) }
    }
}

/// A collective the shim started and nobody has waited on yet.
pub struct Work {
    ptr: *mut c_void,
    /// Keeps the group alive while its collective runs.
    _group: Arc<Handle>,
}
// SAFETY: the work object is c10d's, waited on and freed through the shim from one thread at
// a time (it moves with the pending gather, which is not shared).
unsafe impl Send for Work {}

impl Work {
    /// Waits for the collective; the shim's message on failure.
    fn wait(self) -> Result<(), String> {
        let mut err = std::ptr::null_mut();
        // SAFETY: a live work handle; `self` is consumed, so waited once, then freed by Drop.
        let ok = unsafe { llora_c10d_work_wait(self.ptr, &mut err) };
        check(ok, err)
    }
}

impl InFlight for Work {
    fn wait(self: Box<Self>) -> Result<(), String> {
        Work::wait(*self)
    }
}

impl Drop for Work {
    fn drop(&mut self) {
        // SAFETY: created by llora_c10d_all_gather_start and freed once. A work dropped without
        // a wait (an error unwound past it) is waited on first: its tensors must outlive it.
        unsafe {
            let mut err = std::ptr::null_mut();
            if llora_c10d_work_wait(self.ptr, &mut err) == 0 && !err.is_null() {
                llora_c10d_free(err);
            }
            llora_c10d_work_free(self.ptr);
        }
    }
}

/// Turns the shim's (status, message) into a Result.
fn check(ok: c_int, err: *mut c_char) -> Result<(), String> {
    // SAFETY: `err` comes from the c10d shim, which mallocs it for llora_c10d_free.
    unsafe { llora_model::device::shim_status(ok, err, "c10d", llora_c10d_free) }
}

/// A c10d process group with its store, and a heartbeat that tells which rank was lost.
///
/// It ends as PyTorch's `destroy_process_group` ends one: [`ProcessGroup::shutdown`] on success
/// (the heartbeat thread stopped and joined, then NCCL's communicators finalised while CUDA is
/// up), an abort when dropped without it (an error path: a peer may be gone). Either way the
/// shim's group is freed by this thread before `main` returns, never by the heartbeat thread
/// after it (that aborts the process at exit with SIGABRT).
pub struct ProcessGroup {
    handle: Arc<Handle>,
    /// This group as a world of its own (a subgroup's rank and size are within it).
    world: World,
    /// The whole world's rank of each member, and the whole world's size (errors name ranks
    /// as the launcher numbers them).
    members: Vec<usize>,
    whole: usize,
    backend: Backend,
    device: tch::Device,
    heartbeat: Duration,
    stop: Arc<AtomicBool>,
    beating: Mutex<Option<JoinHandle<()>>>,
    ended: AtomicBool,
}

impl ProcessGroup {
    /// Joins the group of `world` on `store` (the job's TCPStore, reached and agreed on at
    /// start-up: `dist/startup.rs`) on `backend`; collectives fail after `timeout`.
    pub fn new(world: &World, store: Store, backend: Backend, timeout: Duration) -> Result<Self, DistError> {
        Self::join(world, (0..world.size).collect(), "", store, backend, timeout)
    }

    /// Joins the subgroup `name` of `world` whose members are the world's ranks `members` (in
    /// the subgroup's rank order; this rank among them): the ranks sharing a sequence under
    /// context parallelism. It uses the store the whole world's group serves (join that
    /// first), its keys apart under `name`.
    pub fn subgroup(
        world: &World,
        name: &str,
        members: Vec<usize>,
        backend: Backend,
        timeout: Duration,
    ) -> Result<Self, DistError> {
        if !members.contains(&world.rank) {
            return Err(DistError::setup(world, format!("rank {} is not a member of group {name}", world.rank)));
        }
        let store = Store::connect(world, false, timeout, timeout).map_err(|m| {
            DistError::setup(
                world,
                format!("cannot reach the store at {}:{}: {m}", world.master_addr, world.master_port),
            )
        })?;
        Self::join(world, members, name, store, backend, timeout)
    }

    /// Joins `members` of `world` (all of it, or a subgroup named `name`) on `world`'s store.
    fn join(
        world: &World,
        members: Vec<usize>,
        name: &str,
        store: Store,
        backend: Backend,
        timeout: Duration,
    ) -> Result<Self, DistError> {
        let rank = members.iter().position(|&r| r == world.rank).expect("a member");
        let me = &World { rank, size: members.len(), ..world.clone() };
        // torch's own rule under torchrun's agent store is `/worker/attempt_N`; llora's keys
        // live apart from it and, like torch's, per attempt (a subgroup's under its name).
        let prefix = match name {
            "" => format!("llora/attempt_{}", world.attempt),
            _ => format!("llora/attempt_{}/{name}", world.attempt),
        };
        let prefix = CString::new(prefix).map_err(|_| DistError::setup(world, "a NUL byte in a group name".into()))?;
        let cuda_device = match backend {
            Backend::Gloo => -1,
            Backend::Nccl => world.local_rank as c_int,
        };
        let mut err = std::ptr::null_mut();
        // SAFETY: a live store and valid C strings; err receives a malloc'd message on failure.
        let g = unsafe {
            llora_c10d_new(
                store.0,
                prefix.as_ptr(),
                me.rank as c_int,
                me.size as c_int,
                c_int::from(backend == Backend::Nccl),
                cuda_device,
                timeout.as_millis() as i64,
                &mut err,
            )
        };
        if g.is_null() {
            let msg = check(0, err).unwrap_err();
            return Err(DistError::setup(
                world,
                format!("cannot join the {backend} group at {}:{}: {msg}", world.master_addr, world.master_port),
            ));
        }
        let device = match backend {
            Backend::Gloo => tch::Device::Cpu,
            Backend::Nccl => tch::Device::Cuda(world.local_rank),
        };
        let pg = Self {
            handle: Arc::new(Handle(g)),
            world: me.clone(),
            members,
            whole: world.size,
            backend,
            device,
            heartbeat: Duration::from_millis(500),
            stop: Arc::new(AtomicBool::new(false)),
            beating: Mutex::new(None),
            ended: AtomicBool::new(false),
        };
        pg.start_heartbeat();
        Ok(pg)
    }

    /// Bumps this rank's counter in the store every `heartbeat`, so that after a failed
    /// collective the survivors can tell which ranks stopped beating.
    fn start_heartbeat(&self) {
        let (handle, stop, every) = (self.handle.clone(), self.stop.clone(), self.heartbeat);
        let key = CString::new(format!("heartbeat/{}", self.world.rank)).expect("no NUL");
        let thread = std::thread::Builder::new()
            .name("llora-heartbeat".into())
            .spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    let (mut v, mut err) = (0i64, std::ptr::null_mut());
                    // SAFETY: live handle (the Arc keeps it), valid key.
                    let ok = unsafe { llora_c10d_store_add(handle.0, key.as_ptr(), 1, &mut v, &mut err) };
                    if check(ok, err).is_err() {
                        return; // The store is gone; a collective will say so.
                    }
                    // Woken early by `stop_heartbeat`.
                    std::thread::park_timeout(every);
                }
            })
            .expect("spawn the heartbeat thread");
        *self.beating.lock().unwrap_or_else(|e| e.into_inner()) = Some(thread);
    }

    /// Stops the heartbeat and waits for its thread, which then holds no reference to the group.
    fn stop_heartbeat(&self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.beating.lock().unwrap_or_else(|e| e.into_inner()).take() {
            thread.thread().unpark();
            let _ = thread.join();
        }
    }

    /// Ends the group after successful work, as `destroy_process_group` does; idempotent. Every
    /// rank must call it (NCCL's finalisation is collective).
    pub fn shutdown(&self) -> Result<(), String> {
        if self.ended.swap(true, Ordering::SeqCst) {
            return Ok(());
        }
        self.stop_heartbeat();
        let mut err = std::ptr::null_mut();
        // SAFETY: live handle; err receives a malloc'd message on failure.
        check(unsafe { llora_c10d_shutdown(self.handle.0, &mut err) }, err)
    }

    /// Whether the heartbeat thread is still running (tests of the shutdown order).
    #[cfg(test)]
    fn heartbeat_running(&self) -> bool {
        self.beating.lock().unwrap_or_else(|e| e.into_inner()).as_ref().is_some_and(|t| !t.is_finished())
    }

    /// The CUDA device the group is bound to (`None` for Gloo).
    pub fn bound_device(&self) -> Option<usize> {
        // SAFETY: live handle.
        usize::try_from(unsafe { llora_c10d_bound_device(self.handle.0) }).ok()
    }

    fn counter(&self, rank: usize) -> Result<i64, String> {
        let key = CString::new(format!("heartbeat/{rank}")).expect("no NUL");
        let (mut v, mut err) = (0i64, std::ptr::null_mut());
        // SAFETY: live handle, valid key.
        let ok = unsafe { llora_c10d_store_add(self.handle.0, key.as_ptr(), 0, &mut v, &mut err) };
        check(ok, err).map(|()| v)
    }

    /// The ranks whose heartbeat stopped: counters read twice, four beats apart. When the
    /// store itself is unreachable, its server is what was lost (rank 0 outside torchrun).
    fn lost_ranks(&self) -> Vec<usize> {
        let others: Vec<usize> = (0..self.world.size).filter(|&r| r != self.world.rank).collect();
        let Ok(before) = others.iter().map(|&r| self.counter(r)).collect::<Result<Vec<_>, _>>() else {
            return if self.world.agent_store { vec![] } else { vec![0] };
        };
        std::thread::sleep(self.heartbeat * 4);
        let Ok(after) = others.iter().map(|&r| self.counter(r)).collect::<Result<Vec<_>, _>>() else {
            return if self.world.agent_store { vec![] } else { vec![0] };
        };
        let stopped = others.iter().zip(before.iter().zip(&after)).filter(|(_, (b, a))| a == b);
        stopped.map(|(&r, _)| self.members[r]).collect()
    }

    fn fail(&self, op: &'static str, message: String) -> DistError {
        tracing::debug!(op, "c10d's message, as it came: {message}");
        // The probes of the peers' heartbeats that follow may each meet a dead store.
        quiet_c10_warnings();
        let message = plain_c10d_message(&message);
        let (rank, world, lost) = (self.members[self.world.rank], self.whole, self.lost_ranks());
        DistError::Collective { op, rank, world, lost, message }
    }

    /// Every rank's `x`, concatenated in rank order.
    fn all_gather<T: tch::kind::Element + Copy + Default>(&self, x: &[T]) -> Result<Vec<T>, DistError> {
        let mut out = vec![T::default(); x.len() * self.world.size];
        let input = tch::Tensor::from_slice(x).to_device(self.device);
        let (h, world) = (self.handle.0, self.world.size as c_int);
        // SAFETY: live handle and tensors; `out` holds world × x.len() values and outlives the
        // wait, after which the handle is freed.
        self.with_tensor(&mut out, "all_gather", |o, err| unsafe {
            let w = llora_c10d_all_gather_start(h, o, input.as_ptr() as *mut _, world, err);
            if w.is_null() {
                return 0;
            }
            let ok = llora_c10d_work_wait(w, err);
            llora_c10d_work_free(w);
            ok
        })?;
        Ok(out)
    }

    /// Runs `f` on a LibTorch tensor over `buf` (in place on the CPU; through the GPU for NCCL).
    fn with_tensor<T: tch::kind::Element + Copy>(
        &self,
        buf: &mut [T],
        op: &'static str,
        f: impl FnOnce(*mut torch_sys::C_tensor, &mut *mut c_char) -> c_int,
    ) -> Result<(), DistError> {
        let mut err = std::ptr::null_mut();
        let ok = match self.device {
            tch::Device::Cpu => {
                let n = buf.len() as i64;
                // SAFETY: the tensor views `buf`, which outlives it (dropped at the end of this arm).
                let t =
                    unsafe { tch::Tensor::from_blob(buf.as_mut_ptr() as *const u8, &[n], &[1], T::KIND, self.device) };
                f(t.as_ptr() as *mut _, &mut err)
            }
            device => {
                let t = tch::Tensor::from_slice(buf).to_device(device);
                let ok = f(t.as_ptr() as *mut _, &mut err);
                if ok != 0 {
                    t.to_device(tch::Device::Cpu).copy_data(buf, buf.len());
                }
                ok
            }
        };
        check(ok, err).map_err(|m| self.fail(op, m))
    }

    fn all_reduce<T: tch::kind::Element + Copy>(&self, buf: &mut [T], op: ReduceOp) -> Result<(), DistError> {
        let h = self.handle.0;
        let code = match op {
            ReduceOp::Sum => 0,
            ReduceOp::Max => 1,
        };
        // SAFETY: live handle and tensor.
        self.with_tensor(buf, "all_reduce", |t, err| unsafe { llora_c10d_all_reduce(h, t, code, err) })
    }
}

impl Drop for ProcessGroup {
    fn drop(&mut self) {
        if self.ended.swap(true, Ordering::SeqCst) {
            return;
        }
        // Dropped without `shutdown`: an error unwound past the group, and a peer may be gone,
        // so nothing collective is waited for.
        self.stop_heartbeat();
        // SAFETY: live handle (freed after this, when the last Arc goes).
        unsafe { llora_c10d_abort(self.handle.0) }
    }
}

impl Collective for ProcessGroup {
    fn rank(&self) -> usize {
        self.world.rank
    }

    fn world_size(&self) -> usize {
        self.world.size
    }

    fn backend(&self) -> &'static str {
        match self.backend {
            Backend::Gloo => "c10d Gloo",
            Backend::Nccl => "c10d NCCL",
        }
    }

    fn shutdown(&self) -> Result<(), DistError> {
        ProcessGroup::shutdown(self).map_err(|m| DistError::Setup {
            rank: self.world.rank,
            world: self.world.size,
            message: format!("cannot shut the {} group down: {m}", self.backend),
        })
    }

    fn bound_device(&self) -> Option<usize> {
        ProcessGroup::bound_device(self)
    }

    fn all_reduce_f32(&self, buf: &mut [f32], op: ReduceOp) -> Result<(), DistError> {
        self.all_reduce(buf, op)
    }

    fn all_reduce_f64(&self, buf: &mut [f64], op: ReduceOp) -> Result<(), DistError> {
        self.all_reduce(buf, op)
    }

    fn all_reduce_sum_tensor(&self, x: &tch::Tensor) -> Result<tch::Tensor, DistError> {
        // On the group's device, in place (x's own buffer when it is a contiguous f32 tensor
        // there; a copy moved there and back otherwise).
        let t = x.to_kind(tch::Kind::Float).to_device(self.device).contiguous();
        let mut err = std::ptr::null_mut();
        // SAFETY: live handle and tensor; the shim waits for c10d's all-reduce.
        let ok = unsafe { llora_c10d_all_reduce(self.handle.0, t.as_ptr() as *mut _, 0, &mut err) };
        check(ok, err).map_err(|m| self.fail("all_reduce", m))?;
        Ok(t.to_device(x.device()))
    }

    fn broadcast_f32(&self, buf: &mut [f32], root: usize) -> Result<(), DistError> {
        let h = self.handle.0;
        // SAFETY: live handle and tensor.
        self.with_tensor(buf, "broadcast", |t, err| unsafe { llora_c10d_broadcast(h, t, root as c_int, err) })
    }

    fn all_gather_f64(&self, x: &[f64]) -> Result<Vec<f64>, DistError> {
        self.all_gather(x)
    }

    fn all_gather_f32(&self, x: &[f32]) -> Result<Vec<f32>, DistError> {
        self.all_gather(x)
    }

    fn start_all_gather_bytes(&self, shard: &tch::Tensor) -> Result<PendingBytes, DistError> {
        let out =
            tch::Tensor::empty([shard.numel() as i64 * self.world.size as i64], (tch::Kind::Uint8, shard.device()));
        let mut err = std::ptr::null_mut();
        // SAFETY: live handle and tensors; `out` holds world × shard's bytes. The shim keeps
        // references to both tensors until the work is freed.
        let ptr = unsafe {
            llora_c10d_all_gather_start(
                self.handle.0,
                out.as_ptr() as *mut _,
                shard.as_ptr() as *mut _,
                self.world.size as c_int,
                &mut err,
            )
        };
        if ptr.is_null() {
            return Err(self.fail("all_gather", check(0, err).unwrap_err()));
        }
        Ok(PendingBytes { out, work: Some(Box::new(Work { ptr, _group: self.handle.clone() })) })
    }

    fn start_all_reduce_sum(&self, x: &tch::Tensor) -> Result<PendingSum, DistError> {
        // On the group's device, as `all_reduce_sum_tensor`: Gloo sums CUDA tensors through a
        // host copy (made here, before the start), NCCL sums in place on this rank's GPU.
        let sum = x.to_kind(tch::Kind::Float).to_device(self.device).contiguous();
        let mut err = std::ptr::null_mut();
        // SAFETY: live handle and tensor; the shim keeps a reference to the tensor until the
        // work is freed.
        let ptr = unsafe { llora_c10d_all_reduce_start(self.handle.0, sum.as_ptr() as *mut _, &mut err) };
        if ptr.is_null() {
            return Err(self.fail("all_reduce", check(0, err).unwrap_err()));
        }
        let work: Box<dyn InFlight> = Box::new(Work { ptr, _group: self.handle.clone() });
        Ok(PendingSum { sum, device: x.device(), work: Some(work) })
    }

    fn wait_all_reduce_sum(&self, pending: PendingSum) -> Result<tch::Tensor, DistError> {
        let PendingSum { sum, device, work } = pending;
        if let Some(work) = work {
            work.wait().map_err(|m| self.fail("all_reduce", m))?;
        }
        Ok(sum.to_device(device))
    }

    fn wait_all_gather_bytes(&self, pending: PendingBytes) -> Result<tch::Tensor, DistError> {
        let PendingBytes { out, work } = pending;
        if let Some(work) = work {
            work.wait().map_err(|m| self.fail("all_gather", m))?;
        }
        Ok(out)
    }

    fn barrier(&self) -> Result<(), DistError> {
        let mut err = std::ptr::null_mut();
        // SAFETY: live handle.
        let ok = unsafe { llora_c10d_barrier(self.handle.0, &mut err) };
        check(ok, err).map_err(|m| self.fail("barrier", m))
    }

    fn publish(&self, key: &str, value: &[u8]) -> Result<(), DistError> {
        let k = CString::new(key).expect("keys have no NUL");
        let mut err = std::ptr::null_mut();
        // SAFETY: live handle, valid key and slice.
        let ok = unsafe { llora_c10d_store_set(self.handle.0, k.as_ptr(), value.as_ptr(), value.len(), &mut err) };
        check(ok, err).map_err(|m| self.fail("store set", m))
    }

    fn fetch(&self, key: &str) -> Result<Vec<u8>, DistError> {
        let k = CString::new(key).expect("keys have no NUL");
        let (mut data, mut len, mut err) = (std::ptr::null_mut(), 0usize, std::ptr::null_mut());
        // SAFETY: live handle, valid key; the shim mallocs `data` on success.
        let ok = unsafe { llora_c10d_store_get(self.handle.0, k.as_ptr(), &mut data, &mut len, &mut err) };
        check(ok, err).map_err(|m| self.fail("store get", m))?;
        // SAFETY: `len` bytes at `data`, malloc'd by the shim and freed here.
        let v = unsafe { std::slice::from_raw_parts(data, len) }.to_vec();
        unsafe { llora_c10d_free(data as *mut c_char) };
        Ok(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A one-rank Gloo group on a local store: `shutdown` stops and joins the heartbeat thread
    /// first (so the group is freed by this thread, not by the heartbeat after `main`), is
    /// idempotent, and the group still drops cleanly afterwards; a group dropped without it
    /// (an error path) stops its heartbeat too.
    #[test]
    fn shutdown_joins_the_heartbeat_before_the_group_goes() {
        for graceful in [true, false] {
            let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
            let world = World { master_addr: "127.0.0.1".into(), master_port: port, ..World::single() };
            let store = Store::connect(&world, true, Duration::from_secs(20), Duration::from_secs(20)).unwrap();
            let pg = ProcessGroup::new(&world, store, Backend::Gloo, Duration::from_secs(20)).unwrap();
            assert!(pg.heartbeat_running());
            assert_eq!(pg.bound_device(), None, "Gloo binds no CUDA device");
            let mut buf = [2.0f32, 3.0];
            pg.all_reduce(&mut buf, ReduceOp::Sum).unwrap();
            assert_eq!(buf, [2.0, 3.0]);
            let beat = pg.handle.clone();
            if graceful {
                pg.shutdown().unwrap();
                assert!(!pg.heartbeat_running(), "the heartbeat thread outlived shutdown");
                pg.shutdown().unwrap();
                // Only this test's clone and the group hold the handle: the heartbeat let go.
                assert_eq!(Arc::strong_count(&beat), 2);
            }
            drop(pg);
            assert_eq!(Arc::strong_count(&beat), 1, "graceful {graceful}: someone still holds the group");
        }
    }
}
