//! Who this process is among the data-parallel ranks, read from the launcher's variables
//! (torchrun, SLURM) or a single process, and the `[dist]` config that says how it joins.

use serde::{Deserialize, Serialize};

/// Which launcher set the world up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// No launcher variables: one process.
    Single,
    /// torchrun (or any launcher that sets `RANK`/`WORLD_SIZE`/`MASTER_ADDR`/`MASTER_PORT`).
    Torchrun,
    /// `srun`: `SLURM_PROCID`, `SLURM_NTASKS`, `SLURM_LOCALID`.
    Slurm,
}

/// This process's place among the data-parallel ranks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct World {
    /// Global rank, `0..size`.
    pub rank: usize,
    /// Number of ranks.
    pub size: usize,
    /// Rank on this node: the CUDA device index for `run.device = "cuda"`.
    pub local_rank: usize,
    /// Ranks on this node.
    pub local_size: usize,
    /// Host of the TCPStore.
    pub master_addr: String,
    /// Port of the TCPStore.
    pub master_port: u16,
    /// torchrun's agent already serves the store (`TORCHELASTIC_USE_AGENT_STORE=True`): every
    /// rank, rank 0 included, is a client.
    pub agent_store: bool,
    /// The launcher's restart count (`TORCHELASTIC_RESTART_COUNT`, `SLURM_RESTART_COUNT`; 0 on
    /// the first attempt): every store key is scoped to it, so a restarted group never reads
    /// the rendezvous keys of the attempt that died.
    pub attempt: u64,
    /// Who launched us.
    pub launcher: Launcher,
    /// The launcher's id of the whole job, the same in every restarted attempt
    /// (`TORCHELASTIC_RUN_ID`, `SLURM_JOB_ID`): how a restart recognises its job's run directory.
    pub job: Option<String>,
    /// `dist.share_device`: the node's ranks compute on one GPU.
    pub share_device: bool,
}

impl World {
    /// One process, no store.
    pub fn single() -> Self {
        Self {
            rank: 0,
            size: 1,
            local_rank: 0,
            local_size: 1,
            master_addr: String::new(),
            master_port: 0,
            agent_store: false,
            attempt: 0,
            launcher: Launcher::Single,
            job: None,
            share_device: false,
        }
    }

    /// The world the launcher describes in `env` (torchrun's variables first, then SLURM's),
    /// or a single process; `config` supplies the master address and port SLURM does not.
    pub fn from_env(env: impl Fn(&str) -> Option<String>, config: &DistConfig) -> Result<Self, String> {
        let num = |key: &str| -> Result<Option<usize>, String> {
            env(key).map(|v| v.trim().parse::<usize>().map_err(|_| format!("{key}={v:?} is not a number"))).transpose()
        };
        let (launcher, rank, size, local_rank, local_size) = if let Some(rank) = num("RANK")? {
            let size = num("WORLD_SIZE")?.ok_or("RANK is set but WORLD_SIZE is not")?;
            let local_rank = num("LOCAL_RANK")?.unwrap_or(rank);
            let local_size = num("LOCAL_WORLD_SIZE")?.unwrap_or(size);
            (Launcher::Torchrun, rank, size, local_rank, local_size)
        } else if let Some(rank) = num("SLURM_PROCID")? {
            let size = num("SLURM_NTASKS")?.ok_or("SLURM_PROCID is set but SLURM_NTASKS is not")?;
            let local_rank = num("SLURM_LOCALID")?.unwrap_or(0);
            let local_size = env("SLURM_NTASKS_PER_NODE")
                .and_then(|v| v.split(['(', ',']).next().and_then(|n| n.parse().ok()))
                .unwrap_or(size);
            (Launcher::Slurm, rank, size, local_rank, local_size)
        } else {
            (Launcher::Single, 0, 1, 0, 1)
        };
        // A requeued single-process sbatch job has SLURM_RESTART_COUNT too.
        let restarts = match launcher {
            Launcher::Torchrun => "TORCHELASTIC_RESTART_COUNT",
            _ => "SLURM_RESTART_COUNT",
        };
        let attempt = env(restarts)
            .map(|v| v.trim().parse::<u64>().map_err(|_| format!("{restarts}={v:?} is not a number")))
            .transpose()?
            .unwrap_or(0);
        let job = match launcher {
            Launcher::Torchrun => env("TORCHELASTIC_RUN_ID"),
            _ => env("SLURM_JOB_ID"),
        }
        .map(|v| v.trim().to_string())
        .filter(|v| !v.is_empty());
        if size == 0 || rank >= size {
            return Err(format!("rank {rank} is not in 0..{size} (world size from the {launcher:?} variables)"));
        }
        if size == 1 {
            return Ok(Self { launcher, attempt, job, ..Self::single() });
        }
        let master_addr = env("MASTER_ADDR").or_else(|| config.master_addr.clone()).ok_or_else(|| {
            "MASTER_ADDR is not set: export it (e.g. the first host of `scontrol show hostnames \
             $SLURM_JOB_NODELIST`) or set dist.master_addr"
                .to_string()
        })?;
        let master_port = match env("MASTER_PORT") {
            Some(p) => p.trim().parse().map_err(|_| format!("MASTER_PORT={p:?} is not a port number"))?,
            None => config.master_port,
        };
        let agent_store = env("TORCHELASTIC_USE_AGENT_STORE").as_deref() == Some("True");
        let share_device = config.share_device;
        Ok(Self {
            rank,
            size,
            local_rank,
            local_size,
            master_addr,
            master_port,
            agent_store,
            attempt,
            launcher,
            job,
            share_device,
        })
    }

    /// Whether a launcher that restarts or requeues jobs by itself started this process:
    /// torchrun (`TORCHELASTIC_RESTART_COUNT`, `RANK`) or SLURM (`SLURM_JOB_ID`).
    pub fn launched() -> bool {
        ["TORCHELASTIC_RESTART_COUNT", "RANK", "SLURM_JOB_ID"].iter().any(|k| std::env::var_os(k).is_some())
    }

    /// Whether this process serves the TCPStore (torch's `_create_c10d_store` rule).
    pub fn serves_store(&self) -> bool {
        self.rank == 0 && !self.agent_store
    }

    /// Nodes in the job.
    pub fn nodes(&self) -> usize {
        self.size.div_ceil(self.local_size.max(1))
    }
}

/// `dist.backend`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BackendChoice {
    /// NCCL on CUDA devices, Gloo on the CPU.
    Auto,
    /// Always Gloo.
    Gloo,
    /// Always NCCL.
    Nccl,
}

/// `[dist]`: how ranks find and talk to each other (only used with more than one rank).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DistConfig {
    /// `"auto"` (NCCL on CUDA, Gloo on CPU), `"gloo"` or `"nccl"`.
    pub backend: BackendChoice,
    /// A collective that has not completed after this many seconds fails the run (a hung
    /// peer); a dead peer fails the next collective at once.
    pub timeout_s: u64,
    /// TCPStore host when the launcher does not export `MASTER_ADDR` (SLURM).
    pub master_addr: Option<String>,
    /// TCPStore port when the launcher does not export `MASTER_PORT`.
    pub master_port: u16,
    /// Every rank of a node computes on its first GPU (`run.device = "cuda"` is `cuda:0` for
    /// all): a rehearsal of several ranks on a machine with one GPU. Needs Gloo (NCCL refuses
    /// two ranks on one device); its collectives stage through the host.
    pub share_device: bool,
    /// With several ranks, the gradients are summed in buckets of this many MiB, each started
    /// during the last micro-batch's backward once full, so the reduction overlaps the backward
    /// of the blocks below (PyTorch DDP's `bucket_cap_mb`, 25 there too); 0: one reduction after
    /// the backward. The results are bitwise the same either way.
    pub bucket_mb: f64,
}

impl DistConfig {
    /// `bucket_mb` in bytes (0: after the backward).
    pub fn bucket_bytes(&self) -> usize {
        (self.bucket_mb * (1 << 20) as f64) as usize
    }
}

impl Default for DistConfig {
    fn default() -> Self {
        Self {
            backend: BackendChoice::Auto,
            timeout_s: 600,
            master_addr: None,
            master_port: 29500,
            share_device: false,
            bucket_mb: 25.0,
        }
    }
}
