//! Data parallelism: one process per device, launched by torchrun or SLURM, talking through
//! PyTorch's c10d (the engine under DDP, FSDP and DeepSpeed) rather than a home-made one.
//!
//! [`World::from_env`] reads who this process is from the launcher's variables; [`init`] joins
//! the process group (Gloo on CPU, NCCL on CUDA; `c10d.rs` and the C++ shim beside it) and
//! refuses to start when ranks were given different configs. The trainer only sees
//! [`Collective`]: a single process uses the identity [`SingleProcess`].

mod c10d;
mod collective;
mod cp_group;
mod startup;
mod world;

pub use collective::{
    Backend, Collective, DistError, InFlight, PendingBytes, PendingSum, ReduceOp, plain_c10d_message,
};
pub use cp_group::ContextComm;
pub use startup::announce_startup_failure;
pub use world::{BackendChoice, DistConfig, Launcher, World};

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use tracing::info;

/// One process, one rank: every collective is the identity.
#[derive(Debug, Clone, Copy, Default)]
pub struct SingleProcess;

impl Collective for SingleProcess {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn backend(&self) -> &'static str {
        "none (single process)"
    }
    fn all_reduce_f32(&self, _: &mut [f32], _: ReduceOp) -> Result<(), DistError> {
        Ok(())
    }
    fn all_reduce_sum_tensor(&self, x: &tch::Tensor) -> Result<tch::Tensor, DistError> {
        // The sum over one rank: x itself (in f32, as every group returns it).
        Ok(x.to_kind(tch::Kind::Float))
    }
    fn all_reduce_f64(&self, _: &mut [f64], _: ReduceOp) -> Result<(), DistError> {
        Ok(())
    }
    fn broadcast_f32(&self, _: &mut [f32], _: usize) -> Result<(), DistError> {
        Ok(())
    }
    fn all_gather_f64(&self, x: &[f64]) -> Result<Vec<f64>, DistError> {
        Ok(x.to_vec())
    }
    fn all_gather_f32(&self, x: &[f32]) -> Result<Vec<f32>, DistError> {
        Ok(x.to_vec())
    }
    fn start_all_gather_bytes(&self, shard: &tch::Tensor) -> Result<PendingBytes, DistError> {
        Ok(PendingBytes { out: shard.shallow_clone(), work: None })
    }
    fn wait_all_gather_bytes(&self, pending: PendingBytes) -> Result<tch::Tensor, DistError> {
        Ok(pending.out)
    }
    fn barrier(&self) -> Result<(), DistError> {
        Ok(())
    }
    fn publish(&self, _: &str, _: &[u8]) -> Result<(), DistError> {
        Ok(())
    }
    fn fetch(&self, key: &str) -> Result<Vec<u8>, DistError> {
        Err(DistError::Setup { rank: 0, world: 1, message: format!("no store in a single process (key {key})") })
    }
}

/// This process's rank on its node as the launcher gives it (`LOCAL_RANK`, `SLURM_LOCALID`; 0
/// without a launcher): the GPU a command that joins no group (`eval`, `selftest`) takes for
/// the device `cuda`.
pub fn local_rank() -> usize {
    ["LOCAL_RANK", "SLURM_LOCALID"]
        .iter()
        .find_map(|k| std::env::var(k).ok().and_then(|v| v.trim().parse().ok()))
        .unwrap_or(0)
}

/// Whether this build has the NCCL half of the c10d shim (CUDA headers found at build time).
pub fn nccl_compiled() -> bool {
    cfg!(llora_nccl)
}

/// The data-parallel group as the model's weight gatherer (`train.shard_frozen_weights`).
pub struct WeightGatherer(pub Arc<dyn Collective>);

impl llora_model::shard::WeightGather for WeightGatherer {
    fn rank(&self) -> usize {
        self.0.rank()
    }
    fn world(&self) -> usize {
        self.0.world_size()
    }
    fn start_all_gather_bytes(
        &self,
        shard: &tch::Tensor,
    ) -> anyhow::Result<Box<dyn llora_model::shard::PendingGather>> {
        Ok(Box::new(Gathering { comm: self.0.clone(), pending: self.0.start_all_gather_bytes(shard)? }))
    }
}

/// A weight gather in flight on the data-parallel group.
struct Gathering {
    comm: Arc<dyn Collective>,
    pending: PendingBytes,
}

impl llora_model::shard::PendingGather for Gathering {
    fn wait(self: Box<Self>) -> anyhow::Result<tch::Tensor> {
        Ok(self.comm.wait_all_gather_bytes(self.pending)?)
    }
}

/// This process's world and its collectives.
pub struct Dist {
    /// Who we are.
    pub world: World,
    /// How we talk (the whole world: gradients, losses, checks).
    pub comm: Arc<dyn Collective>,
    /// The ranks this one shares each sequence with (`train.context_parallel` > 1).
    pub context: Option<Arc<ContextComm>>,
}

impl Dist {
    /// A single process.
    pub fn single() -> Self {
        Self { world: World::single(), comm: Arc::new(SingleProcess), context: None }
    }

    /// Ranks sharing one sequence (1 without context parallelism).
    pub fn context_size(&self) -> usize {
        self.context.as_ref().map_or(1, |c| c.comm.world_size())
    }

    /// The model's view of [`Self::context`].
    pub fn context_parallel(&self) -> Option<llora_model::context_parallel::ContextParallel> {
        let group = self.context.clone()?;
        Some(llora_model::context_parallel::ContextParallel { group })
    }

    /// (this rank's data-parallel group, the number of groups): what the data is shared out by.
    pub fn data_share(&self) -> (usize, usize) {
        let n = self.context_size();
        (self.world.rank / n, self.world.size / n)
    }

    /// The frozen-weight sharding over this group, when `shard` asks for it.
    pub fn sharding(&self, shard: bool) -> Option<llora_model::shard::Sharding> {
        shard.then(|| llora_model::shard::Sharding { gather: Arc::new(WeightGatherer(self.comm.clone())) })
    }

    /// Rank 0 writes the run's files; the others compute the same steps silently.
    pub fn is_main(&self) -> bool {
        self.world.rank == 0
    }

    /// The device this rank computes on for the configured `spec`: `cuda` is `cuda:LOCAL_RANK`,
    /// or `cuda:0` for every rank with `dist.share_device` (train and bench pick it here;
    /// `DeviceSpec::init` then makes it the current device). Several ranks of a node on one
    /// explicit `cuda:N` are refused unless shared on purpose.
    pub fn device(&self, spec: llora_model::device::DeviceSpec) -> anyhow::Result<llora_model::device::DeviceSpec> {
        rank_device(spec, &self.world).map_err(anyhow::Error::msg)
    }

    /// Ends the process group after the command's work succeeded (see [`Collective::shutdown`]);
    /// on an error path the group is dropped instead, which aborts it.
    pub fn shutdown(self) -> anyhow::Result<()> {
        if let Some(c) = &self.context {
            c.comm.shutdown()?;
        }
        Ok(self.comm.shutdown()?)
    }
}

/// [`Dist::device`] for a rank of `world`.
fn rank_device(
    spec: llora_model::device::DeviceSpec,
    world: &World,
) -> Result<llora_model::device::DeviceSpec, String> {
    use llora_model::device::DeviceSpec;
    match spec {
        DeviceSpec::CudaLocal if world.share_device => Ok(DeviceSpec::Cuda(0)),
        DeviceSpec::Cuda(n) if world.local_size > 1 && !world.share_device => Err(format!(
            "run.device = \"cuda:{n}\" puts all {} ranks of this node on one GPU (rank {}): set run.device = \"cuda\" \
             (each rank its own GPU, cuda:LOCAL_RANK), or set dist.share_device = true with dist.backend = \"gloo\" \
             to run them on one GPU on purpose",
            world.local_size, world.rank
        )),
        other => Ok(other.for_local_rank(world.local_rank)),
    }
}

/// Joins the world the environment describes; `cuda` says whether the run's device is a GPU
/// (NCCL under `dist.backend = "auto"`).
pub fn init(config: &DistConfig, cuda: bool) -> anyhow::Result<Dist> {
    init_with_context(config, cuda, 1, "train.context_parallel")
}

/// [`init`], each sequence shared by `context` consecutive ranks (`train.context_parallel`, or
/// the setting `named`): their c10d subgroup is joined after the world's, once every rank is
/// known to ask for the same size (different sizes joined different subgroups and waited for
/// `dist.timeout_s`).
pub fn init_with_context(config: &DistConfig, cuda: bool, context: usize, named: &str) -> anyhow::Result<Dist> {
    let world = World::from_env(|k| std::env::var(k).ok(), config).map_err(anyhow::Error::msg)?;
    if world.size == 1 {
        let fix = match named {
            "--cp" => "run the bench under torchrun (--nproc-per-node N), or drop --cp".to_string(),
            _ => format!(
                "start it under torchrun (--nproc-per-node {context} or a multiple), or set --set {named}=1 \
                 (a --resume may change it)"
            ),
        };
        anyhow::ensure!(
            context == 1,
            "{named} = {context} splits each sequence over {context} ranks, and this is one process (no launcher \
             started ranks): {fix}"
        );
        return Ok(Dist { world, comm: Arc::new(SingleProcess), context: None });
    }
    let backend = backend_for(config, cuda)?;
    let timeout = Duration::from_secs(config.timeout_s);
    let pg = world_group(&world, backend, timeout)?;
    same_context_everywhere(&pg, context, named)?;
    anyhow::ensure!(
        context >= 1 && world.size.is_multiple_of(context),
        "{named} = {context} must divide the {} ranks the launcher started: the world is data-parallel groups x \
         context-parallel ranks",
        world.size
    );
    let context = if context > 1 {
        let (group, _, members) = cp_group::layout(world.rank, context);
        let sub = c10d::ProcessGroup::subgroup(&world, &format!("context_{group}"), members, backend, timeout)?;
        Some(Arc::new(ContextComm::new(Arc::new(sub))))
    } else {
        None
    };
    if world.rank == 0 {
        info!(
            world = world.size,
            nodes = world.nodes(),
            per_node = world.local_size,
            backend = %backend,
            launcher = ?world.launcher,
            store = %format!("{}:{}", world.master_addr, world.master_port),
            context_parallel = context.as_ref().map_or(1, |c| c.comm.world_size()),
            "data-parallel group ready"
        );
    }
    Ok(Dist { world, comm: Arc::new(pg), context })
}

/// The world's process group, once every rank has reached the store and said it started
/// ([`startup`]).
fn world_group(world: &World, backend: Backend, timeout: Duration) -> Result<c10d::ProcessGroup, DistError> {
    let store = startup::rendezvous(world, world.serves_store(), timeout)?;
    // A second connection to the store, for the ranks' words on forming the group.
    let watch = c10d::without_c10_logs(|| c10d::Store::connect(world, false, timeout, timeout)).ok();
    startup::form_group(world, watch, || c10d::ProcessGroup::new(world, store, backend, timeout))
}

/// Refuses, on every rank, ranks started with different context-parallel sizes, naming each.
fn same_context_everywhere(comm: &dyn Collective, context: usize, named: &str) -> anyhow::Result<()> {
    let sizes = comm.all_gather_f64(&[context as f64])?;
    if sizes.iter().all(|&s| s == sizes[0]) {
        return Ok(());
    }
    let each: Vec<String> = sizes.iter().enumerate().map(|(r, s)| format!("rank {r}: {s}")).collect();
    anyhow::bail!("ranks differ: {named} ({}): every rank must be started with the same value", each.join(", "))
}

/// The c10d backend `config` asks for on a CUDA (`cuda`) or CPU device.
fn backend_for(config: &DistConfig, cuda: bool) -> anyhow::Result<Backend> {
    let backend = match config.backend {
        // NCCL refuses two ranks on one device: shared, the ranks talk over Gloo.
        BackendChoice::Auto if cuda && !config.share_device => Backend::Nccl,
        BackendChoice::Auto | BackendChoice::Gloo => Backend::Gloo,
        BackendChoice::Nccl => Backend::Nccl,
    };
    anyhow::ensure!(
        backend == Backend::Gloo || nccl_compiled(),
        "dist.backend = nccl, but this llora was built without NCCL (run ./scripts/setup.sh, then rebuild)"
    );
    Ok(backend)
}

/// A real c10d group of this one process (NCCL for `cuda`, else Gloo), on a TCPStore it serves
/// on a free local port: `llora selftest` runs the collectives' code path without a launcher.
pub fn single_process_group(cuda: bool) -> anyhow::Result<(Backend, Arc<dyn Collective>)> {
    let port = std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
    let world = World { master_addr: "127.0.0.1".into(), master_port: port, ..World::single() };
    let backend = backend_for(&DistConfig::default(), cuda)?;
    let pg = world_group(&world, backend, Duration::from_secs(60))?;
    Ok((backend, Arc::new(pg)))
}

/// Every rank fingerprints the data files it will read (`(key, path)`, e.g. `data.train`);
/// ranks that would read other data than rank 0 under the same paths (a file that differs per
/// node) are an error on every rank, naming the ranks and the keys.
pub fn check_same_data(comm: &dyn Collective, files: &[(&str, &Path)]) -> Result<(), DistError> {
    if comm.world_size() == 1 {
        return Ok(());
    }
    // (key, fingerprint) is compared; the path is only shown (ranks may mount data elsewhere).
    let mut mine = Vec::new();
    for (key, path) in files {
        let print = data_fingerprint(path).unwrap_or_else(|e| format!("unreadable: {e}"));
        mine.push((format!("{key}\t{print}"), format!("{key} {} ({print})", path.display())));
    }
    let text: Vec<&str> = mine.iter().map(|(line, _)| line.as_str()).collect();
    let text = text.join("\n");
    let diff = |reference: &str| {
        let theirs: Vec<&str> = reference.lines().collect();
        mine.iter().filter(|(line, _)| !theirs.contains(&line.as_str())).map(|(_, shown)| shown.clone()).collect()
    };
    match agree_with_rank_0(comm, "data", &text, diff)? {
        None => Ok(()),
        Some(detail) => Err(DistError::ConfigMismatch(format!(
            "{detail}: these ranks would read other data than rank 0 under the same paths (a file that differs \
             between nodes?); copy the same files to every node"
        ))),
    }
}

/// Size and SHA-256 of the first and last MiB of a data file (a parquet file's footer, with
/// its row groups' statistics, is in its last bytes): cheap at any size, and two copies of one
/// dataset agree while two different files almost never do.
pub fn data_fingerprint(path: &Path) -> std::io::Result<String> {
    use sha2::{Digest, Sha256};
    use std::io::{Read, Seek, SeekFrom};
    const PART: u64 = 1 << 20;
    let mut file = std::fs::File::open(path)?;
    let bytes = file.metadata()?.len();
    let mut hasher = Sha256::new();
    let mut buf = Vec::new();
    (&mut file).take(PART).read_to_end(&mut buf)?;
    hasher.update(&buf);
    if bytes > PART {
        file.seek(SeekFrom::Start(bytes.saturating_sub(PART).max(PART)))?;
        buf.clear();
        file.read_to_end(&mut buf)?;
        hasher.update(&buf);
    }
    let digest: String = hasher.finalize().iter().take(8).map(|b| format!("{b:02x}")).collect();
    Ok(format!("{bytes} bytes, sha256 {digest}"))
}

/// Every rank's `text` is compared with rank 0's: each lists how its own differs (`diff` of rank
/// 0's text, empty when equal), and all learn every rank's answer: `Some("ranks [..] differ
/// from rank 0 (rank r: differences)")` on every rank when any differs.
///
/// The texts' hashes are gathered first (a collective: every rank's answer is of this round),
/// and the store's keys name the content they hold: a rank never reads what an earlier
/// agreement left under the same name (`llora mlperf run` agrees on one config per run; with
/// one key per `what`, a rank ahead read the previous run's config and refused run.dir and
/// run.seed).
pub fn agree_with_rank_0(
    comm: &dyn Collective,
    what: &str,
    text: &str,
    diff: impl Fn(&str) -> Vec<String>,
) -> Result<Option<String>, DistError> {
    if comm.world_size() == 1 {
        return Ok(None);
    }
    let rank = comm.rank();
    let hashes = comm.all_gather_f64(&content_hash(text))?;
    let hash_of = |r: usize| format!("{:08x}{:08x}", hashes[2 * r] as u32, hashes[2 * r + 1] as u32);
    if (0..comm.world_size()).all(|r| hash_of(r) == hash_of(0)) {
        return Ok(None);
    }
    let fetch = |key: &str| comm.fetch(key).map(|b| String::from_utf8_lossy(&b).into_owned());
    let reference = format!("{what}/0/{}", hash_of(0));
    let diff_key = |r: usize| format!("{what}-diff/{r}/{}/{}", hash_of(r), hash_of(0));
    let keys = if rank == 0 {
        comm.publish(&reference, text.as_bytes())?;
        Vec::new()
    } else {
        diff(&fetch(&reference)?)
    };
    if !keys.is_empty() {
        comm.publish(&diff_key(rank), keys.join(", ").as_bytes())?;
    }
    let flags = comm.all_gather_f64(&[f64::from(u8::from(!keys.is_empty()))])?;
    let bad: Vec<usize> = flags.iter().enumerate().filter(|(_, f)| **f > 0.0).map(|(r, _)| r).collect();
    if bad.is_empty() {
        return Ok(None);
    }
    let detail: Vec<String> =
        bad.iter().map(|&r| format!("rank {r}: {}", fetch(&diff_key(r)).unwrap_or_else(|_| "?".into()))).collect();
    Ok(Some(format!("ranks {bad:?} differ from rank 0 ({})", detail.join("; "))))
}

/// The first 8 bytes of `text`'s SHA-256 as two f64s (each a u32, exact in f64).
fn content_hash(text: &str) -> [f64; 2] {
    use sha2::{Digest, Sha256};
    let d = Sha256::digest(text.as_bytes());
    let word = |i: usize| f64::from(u32::from_le_bytes([d[i], d[i + 1], d[i + 2], d[i + 3]]));
    [word(0), word(4)]
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env<'a>(vars: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |k| vars.iter().find(|(n, _)| *n == k).map(|(_, v)| v.to_string())
    }

    /// Runs `f(rank, group)` on two Gloo ranks (threads of this test over a real TCPStore) and
    /// returns each rank's result, in rank order; each group is shut down after `f`.
    fn on_two_gloo_ranks<T: Send + 'static>(
        f: impl Fn(usize, &c10d::ProcessGroup) -> T + Send + Sync + 'static,
    ) -> Vec<T> {
        let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
        let f = Arc::new(f);
        let handles: Vec<_> = (0..2)
            .map(|rank| {
                let f = f.clone();
                std::thread::spawn(move || {
                    let world = World {
                        rank,
                        size: 2,
                        local_rank: rank,
                        local_size: 2,
                        master_addr: "127.0.0.1".into(),
                        master_port: port,
                        ..World::single()
                    };
                    let pg = world_group(&world, Backend::Gloo, Duration::from_secs(20)).unwrap();
                    let out = f(rank, &pg);
                    pg.shutdown().unwrap();
                    out
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    }

    /// Two Gloo ranks (threads of this test, a real TCPStore) with the same
    /// data paths: equal files pass; a file whose content differs on rank 1 (a node with another
    /// copy) fails on both ranks naming rank 1 and the key; one that is missing on rank 1 too.
    #[test]
    fn ranks_that_would_read_other_data_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let [a, b] = ["a", "b"].map(|n| dir.path().join(n));
        for d in [&a, &b] {
            std::fs::create_dir(d).unwrap();
            std::fs::write(d.join("eval.parquet"), vec![7u8; 3 << 20]).unwrap();
        }
        std::fs::write(a.join("train.parquet"), vec![1u8; 5 << 20]).unwrap();
        let mut other = vec![1u8; 5 << 20];
        other[(5 << 20) - 10] = 2; // differs in the footer only
        std::fs::write(b.join("train.parquet"), &other).unwrap();
        let two_ranks = |files: [std::path::PathBuf; 2]| -> Vec<Result<(), String>> {
            on_two_gloo_ranks(move |rank, pg| {
                check_same_data(pg, &[("data.train", &files[rank])]).map_err(|e| e.to_string())
            })
        };
        for r in two_ranks([a.join("eval.parquet"), b.join("eval.parquet")]) {
            r.unwrap();
        }
        for (case, files) in [
            ("content", [a.join("train.parquet"), b.join("train.parquet")]),
            ("missing", [a.join("train.parquet"), b.join("absent.parquet")]),
        ] {
            for (rank, r) in two_ranks(files).into_iter().enumerate() {
                let e = r.unwrap_err();
                assert!(
                    e.contains("ranks [1]") && e.contains("data.train") && e.contains("other data"),
                    "{case}, rank {rank}: {e}"
                );
            }
        }
    }

    /// Two Gloo ranks (threads, a real TCPStore) agree on one text per round, as `llora mlperf
    /// run` agrees on each run's config: rank 0 enters each round 300 ms late, so rank 1 asks
    /// the store first. Equal texts agree in every round (with one key per `what`, rank 1 read
    /// the round before's text and refused: the lost runs); a text that differs is still
    /// named, on both ranks, in a later round.
    #[test]
    fn agreements_in_rounds_never_read_an_earlier_round() {
        let results = on_two_gloo_ranks(|rank, pg| {
            let diff = |mine: String| move |theirs: &str| if theirs == mine { vec![] } else { vec!["run.dir".into()] };
            let mut out = Vec::new();
            for round in 0..4 {
                if rank == 0 {
                    std::thread::sleep(Duration::from_millis(300));
                }
                // Round 3: rank 1 runs another config.
                let text = if round == 3 && rank == 1 { "other".to_string() } else { format!("run_{round}") };
                out.push(agree_with_rank_0(pg, "config", &text, diff(text.clone())).unwrap());
            }
            out
        });
        for (rank, out) in results.into_iter().enumerate() {
            assert_eq!(out[..3], [None, None, None], "rank {rank}: {out:?}");
            let last = out[3].as_deref().unwrap_or_default();
            assert!(last.starts_with("ranks [1] differ from rank 0 (rank 1: run.dir)"), "rank {rank}: {last}");
        }
    }

    /// Gloo's and NCCL's messages as they come (copied from real failures)
    /// lose their C++ locations and stack lines and keep what happened, addresses included.
    #[test]
    fn c10d_messages_lose_their_cpp_locations() {
        let cases = [
            (
                "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:29500: Connection reset by peer",
                "Read error [127.0.0.1]:29500: Connection reset by peer",
            ),
            (
                "[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:81] Timed out waiting 30000ms for recv operation to complete",
                "Timed out waiting 30000ms for recv operation to complete",
            ),
            (
                "NCCL error in: /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:3356, remote process exited\nException raised from checkForNCCLErrorsInternal at /pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp:617 (most recent call first):\nframe #0: c10::Error::Error() + 0x98",
                "NCCL error in: remote process exited",
            ),
            ("plain [text] stays [a.cc] [x.cc:y]", "plain [text] stays [a.cc] [x.cc:y]"),
        ];
        for (raw, want) in cases {
            assert_eq!(plain_c10d_message(raw), want);
        }
    }

    #[test]
    fn torchrun_variables() {
        let vars = [
            ("RANK", "3"),
            ("WORLD_SIZE", "16"),
            ("LOCAL_RANK", "3"),
            ("LOCAL_WORLD_SIZE", "8"),
            ("MASTER_ADDR", "node0"),
            ("MASTER_PORT", "29400"),
            ("TORCHELASTIC_USE_AGENT_STORE", "True"),
        ];
        let w = World::from_env(env(&vars), &DistConfig::default()).unwrap();
        assert_eq!((w.rank, w.size, w.local_rank, w.nodes()), (3, 16, 3, 2));
        assert_eq!((w.master_addr.as_str(), w.master_port, w.agent_store), ("node0", 29400, true));
        assert!(!w.serves_store());
        // Without the agent store, rank 0 serves it.
        let vars = [("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h"), ("MASTER_PORT", "1")];
        assert!(World::from_env(env(&vars), &DistConfig::default()).unwrap().serves_store());
        let restarted = [("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h"), ("TORCHELASTIC_RESTART_COUNT", "3")];
        assert_eq!(World::from_env(env(&restarted), &DistConfig::default()).unwrap().attempt, 3);
        let job = [("RANK", "0"), ("WORLD_SIZE", "1"), ("TORCHELASTIC_RUN_ID", "abc123")];
        assert_eq!(World::from_env(env(&job), &DistConfig::default()).unwrap().job.as_deref(), Some("abc123"));
        let slurm = [("SLURM_PROCID", "1"), ("SLURM_NTASKS", "2"), ("MASTER_ADDR", "h"), ("SLURM_RESTART_COUNT", "2")];
        assert_eq!(World::from_env(env(&slurm), &DistConfig::default()).unwrap().attempt, 2);
        let bad = [("RANK", "0"), ("WORLD_SIZE", "2"), ("MASTER_ADDR", "h"), ("TORCHELASTIC_RESTART_COUNT", "x")];
        assert!(World::from_env(env(&bad), &DistConfig::default()).unwrap_err().contains("TORCHELASTIC_RESTART_COUNT"));
    }

    /// Each rank of an 8-GPU node computes on its own GPU: `cuda` is `cuda:LOCAL_RANK` (no two
    /// local ranks share one), an explicit `cuda:N` and the CPU are kept.
    #[test]
    fn each_rank_picks_its_own_gpu() {
        use llora_model::device::DeviceSpec;
        let picked: Vec<DeviceSpec> = (0..8)
            .map(|r| {
                let (rank, local) = ((8 + r).to_string(), r.to_string());
                let vars = [
                    ("RANK", rank.as_str()),
                    ("WORLD_SIZE", "16"),
                    ("LOCAL_RANK", local.as_str()),
                    ("LOCAL_WORLD_SIZE", "8"),
                    ("MASTER_ADDR", "node0"),
                ];
                let world = World::from_env(env(&vars), &DistConfig::default()).unwrap();
                Dist { world, comm: Arc::new(SingleProcess), context: None }.device(DeviceSpec::CudaLocal).unwrap()
            })
            .collect();
        assert_eq!(picked, (0..8).map(DeviceSpec::Cuda).collect::<Vec<_>>());
        let dist =
            Dist { world: World { local_rank: 5, ..World::single() }, comm: Arc::new(SingleProcess), context: None };
        assert_eq!(dist.device(DeviceSpec::Cuda(2)).unwrap(), DeviceSpec::Cuda(2));
        assert_eq!(dist.device(DeviceSpec::Cpu).unwrap(), DeviceSpec::Cpu);
    }

    /// Two ranks on a one-GPU machine: with `dist.share_device` both compute on `cuda:0`
    /// (`cuda` and `cuda:0` alike) and `auto` picks Gloo; without it an explicit `cuda:0` for
    /// both is refused by key, naming the ways on; the CPU is shared as always.
    #[test]
    fn ranks_share_a_gpu_only_when_asked() {
        use llora_model::device::DeviceSpec;
        let world = |local_rank, share_device| World {
            local_rank,
            local_size: 2,
            size: 2,
            rank: local_rank,
            share_device,
            ..World::single()
        };
        for r in 0..2 {
            assert_eq!(rank_device(DeviceSpec::CudaLocal, &world(r, true)), Ok(DeviceSpec::Cuda(0)));
            assert_eq!(rank_device(DeviceSpec::Cuda(0), &world(r, true)), Ok(DeviceSpec::Cuda(0)));
            assert_eq!(rank_device(DeviceSpec::CudaLocal, &world(r, false)), Ok(DeviceSpec::Cuda(r)));
            assert_eq!(rank_device(DeviceSpec::Cpu, &world(r, false)), Ok(DeviceSpec::Cpu));
            let refused = rank_device(DeviceSpec::Cuda(0), &world(r, false)).unwrap_err();
            assert!(
                refused.contains("all 2 ranks of this node on one GPU") && refused.contains("dist.share_device = true"),
                "{refused}"
            );
        }
        let shared = DistConfig { share_device: true, ..DistConfig::default() };
        assert_eq!(backend_for(&shared, true).unwrap(), Backend::Gloo);
        assert_eq!(backend_for(&DistConfig::default(), false).unwrap(), Backend::Gloo);
    }

    #[test]
    fn slurm_variables_take_the_master_from_the_config() {
        let vars =
            [("SLURM_PROCID", "5"), ("SLURM_NTASKS", "8"), ("SLURM_LOCALID", "1"), ("SLURM_NTASKS_PER_NODE", "4(x2)")];
        let err = World::from_env(env(&vars), &DistConfig::default()).unwrap_err();
        assert!(err.contains("MASTER_ADDR"), "{err}");
        let config = DistConfig { master_addr: Some("n0".into()), ..Default::default() };
        let w = World::from_env(env(&vars), &config).unwrap();
        assert_eq!((w.rank, w.size, w.local_rank, w.local_size, w.master_port), (5, 8, 1, 4, 29500));
        assert_eq!(w.launcher, Launcher::Slurm);
    }

    #[test]
    fn no_launcher_is_one_process_and_bad_values_are_named() {
        assert_eq!(World::from_env(env(&[]), &DistConfig::default()).unwrap(), World::single());
        let err = World::from_env(env(&[("RANK", "x"), ("WORLD_SIZE", "2")]), &DistConfig::default()).unwrap_err();
        assert!(err.contains("RANK=\"x\""), "{err}");
        let err = World::from_env(env(&[("RANK", "2"), ("WORLD_SIZE", "2")]), &DistConfig::default()).unwrap_err();
        assert!(err.contains("rank 2 is not in 0..2"), "{err}");
    }
}
