//! Which fused attention kernel runs a problem, and the forward that dispatches to it.
//!
//! The CPU has one (torch's CPU flash attention). On CUDA the kernels differ in what they take:
//! cuDNN SDPA and flash attention want bf16 or f16 and take K/V with fewer heads than Q (no
//! repeated copy, forward or backward); the memory-efficient kernel also takes f32 but needs K/V
//! repeated to Q's head count. torch's own `scaled_dot_product_attention` prefers cuDNN on
//! sm_90. Each candidate is checked against plain LibTorch on the first problem of its kind
//! (device, dtype, head counts, head size) before it is used, and a candidate that fails that
//! check or a later forward is dropped, with a warning, for the next. The kernel chosen is
//! logged once per kind of problem.

use std::collections::HashMap;
use std::sync::Mutex;

use super::fused::{FusedKernel, Saved, forward_with, verify_at};

/// The fused forward for the tensors' device: torch's CPU flash attention on the CPU, the
/// first CUDA kernel that passes its check on CUDA.
///
/// # Shapes
/// - q: `[batch, heads, seq, head_dim]`; k, v: `[batch, kv_heads, seq, head_dim]`
pub fn forward(q: &tch::Tensor, k: &tch::Tensor, v: &tch::Tensor, causal: bool) -> Result<Saved, tch::TchError> {
    let Some(p) = Problem::of(q, k) else { return forward_with(FusedKernel::CpuFlash, q, k, v, causal) };
    while let Some(kernel) = choose_for(p, Some(q.size()[2])) {
        match forward_with(kernel, q, k, v, causal) {
            Ok(saved) => return Ok(saved),
            Err(e) => refuse(p, kernel, &e),
        }
    }
    Err(tch::TchError::Torch(format!("no fused CUDA attention kernel runs {p:?}")))
}

/// A kind of attention problem: what decides which kernels can run it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Problem {
    /// The device: a CUDA one, or the CPU standing in for CUDA
    /// ([`crate::routes::takes_cuda_routes`]).
    pub device: tch::Device,
    /// Element type of q, k and v.
    pub kind: tch::Kind,
    /// Query heads.
    pub heads: i64,
    /// Key/value heads (dividing `heads`).
    pub kv_heads: i64,
    /// Size of one head.
    pub head_dim: i64,
    /// One query and one key (a one-token document of a packed row, a context-parallel piece
    /// of one token): cuDNN SDPA runs its forward but builds no backward for it ("s_q = s_kv =
    /// 1 is not supported", seen on an H200 with torch 2.11), so it is a problem of its own,
    /// without cuDNN, its kernels checked at that length.
    pub single_token: bool,
}

impl Problem {
    /// The problem `q` and `k` pose.
    ///
    /// # Shapes
    /// - q: `[batch, heads, seq, head_dim]`; k: `[batch, kv_heads, seq, head_dim]`
    pub fn of(q: &tch::Tensor, k: &tch::Tensor) -> Option<Self> {
        let device = q.device();
        if !crate::routes::takes_cuda_routes(device) {
            return None;
        }
        let (qs, ks) = (q.size(), k.size());
        let single_token = qs[2] == 1 && ks[2] == 1;
        Some(Self { device, kind: q.kind(), heads: qs[1], kv_heads: ks[1], head_dim: qs[3], single_token })
    }

    /// The kernels to try, fastest first.
    fn candidates(&self) -> &'static [FusedKernel] {
        match self.kind {
            tch::Kind::BFloat16 | tch::Kind::Half if self.single_token => {
                &[FusedKernel::CudaFlash, FusedKernel::CudaEfficient]
            }
            tch::Kind::BFloat16 | tch::Kind::Half => {
                &[FusedKernel::CudaCudnn, FusedKernel::CudaFlash, FusedKernel::CudaEfficient]
            }
            _ => &[FusedKernel::CudaEfficient],
        }
    }

    /// Tokens of the first-use check's sequences: one for a single-token problem, else a
    /// length of more than one 128-row block that no kernel's tiling divides.
    fn check_len(&self) -> i64 {
        if self.single_token { 1 } else { 133 }
    }
}

/// For one kind of problem: the candidates not yet refused, whether the first is verified (or
/// being verified), and the sequence lengths seen.
#[derive(Debug)]
struct Candidates {
    left: Vec<FusedKernel>,
    first: Check,
    lengths: std::collections::BTreeSet<i64>,
}

/// Where the first candidate's check stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Check {
    NotYet,
    Running,
    Passed,
}

/// Distinct sequence lengths cuDNN SDPA is kept for. It builds and caches an execution graph per
/// shape, which costs far more than a flash attention call (docs/performance.md, M1), so a run
/// whose batches take many lengths (`data.padding = "longest"`) spends its time building graphs:
/// past this many lengths the problem moves to the next candidate (flash attention), which
/// takes any length as it comes. Fixed-length jobs (MLPerf's 8192 tokens) keep cuDNN.
pub const CUDNN_MAX_LENGTHS: usize = 4;

/// The candidates of every kind of problem seen.
static CHOICES: Mutex<Option<HashMap<Problem, Candidates>>> = Mutex::new(None);

/// The fused kernel for `p`, verifying candidates on first use; `None` when none passes (then
/// the generic attention runs).
pub fn choose(p: Problem) -> Option<FusedKernel> {
    choose_for(p, None)
}

/// What [`choose_for`] does next, decided under the lock.
enum Next {
    Take(Option<FusedKernel>),
    Verify(FusedKernel),
}

/// [`choose`] for a problem of `seq` tokens: also moves a problem off cuDNN SDPA once it has
/// seen more than [`CUDNN_MAX_LENGTHS`] sequence lengths. A length's first forward decides,
/// so the forward and the recomputed forward of one micro-batch run the same kernel.
///
/// A candidate's check runs with no lock held (a check that reaches this function again, or
/// another thread meanwhile, gets `None`: the generic attention, the check's own reference).
pub fn choose_for(p: Problem, mut seq: Option<i64>) -> Option<FusedKernel> {
    loop {
        let kernel = match next(p, seq.take()) {
            Next::Take(kernel) => return kernel,
            Next::Verify(kernel) => kernel,
        };
        tracing::debug!(device = ?p.device, dtype = ?p.kind, "attention kernel {}: first-use check starting", kernel.name());
        let result = crate::routes::run_check(|| {
            verify_at(kernel, p.device, p.kind, [p.heads, p.kv_heads, p.head_dim], p.check_len())
        });
        let mut guard = CHOICES.lock().unwrap_or_else(|e| e.into_inner());
        let Some(c) = guard.as_mut().and_then(|m| m.get_mut(&p)) else { continue };
        if c.left.first() != Some(&kernel) {
            continue; // moved on meanwhile (refused by a failing forward)
        }
        match result {
            Ok(()) => {
                c.first = Check::Passed;
                tracing::info!(
                    device = ?p.device,
                    dtype = ?p.kind,
                    heads = p.heads,
                    kv_heads = p.kv_heads,
                    head_dim = p.head_dim,
                    "attention kernel: {} (verified against plain LibTorch)",
                    kernel.name()
                );
            }
            Err(e) => {
                tracing::warn!(device = ?p.device, dtype = ?p.kind, "attention kernel {} refused: {e}", kernel.name());
                c.left.remove(0);
                c.first = Check::NotYet;
                none_left(p, &c.left);
            }
        }
    }
}

/// Warns once a problem's last candidate is gone.
fn none_left(p: Problem, left: &[FusedKernel]) {
    if left.is_empty() {
        tracing::warn!(device = ?p.device, dtype = ?p.kind, "no fused CUDA attention kernel passed its check: using the generic O(S²) attention");
    }
}

/// Under the lock: records `seq`, moves off cuDNN past [`CUDNN_MAX_LENGTHS`] lengths, and
/// says whether the first candidate is ready, needs its check (then marked running), or none
/// is left.
fn next(p: Problem, seq: Option<i64>) -> Next {
    let mut guard = CHOICES.lock().unwrap_or_else(|e| e.into_inner());
    let map = guard.get_or_insert_with(HashMap::new);
    let c = map.entry(p).or_insert_with(|| Candidates {
        left: p.candidates().to_vec(),
        first: Check::NotYet,
        lengths: Default::default(),
    });
    if let Some(seq) = seq {
        c.lengths.insert(seq);
        if c.lengths.len() > CUDNN_MAX_LENGTHS && c.left.first() == Some(&FusedKernel::CudaCudnn) && c.left.len() > 1 {
            tracing::info!(
                device = ?p.device,
                dtype = ?p.kind,
                lengths = c.lengths.len(),
                "attention: sequence lengths vary (cuDNN builds a graph per length); moving to the next kernel"
            );
            c.left.remove(0);
            c.first = Check::NotYet;
        }
    }
    match (c.left.first(), c.first) {
        (None, _) => Next::Take(None),
        (Some(&k), Check::Passed) => Next::Take(Some(k)),
        (Some(_), Check::Running) => Next::Take(None),
        (Some(&k), Check::NotYet) => {
            c.first = Check::Running;
            Next::Verify(k)
        }
    }
}

/// Drops `kernel` for `p` after it failed on a real problem; the next call of [`choose`]
/// verifies the next candidate.
pub fn refuse(p: Problem, kernel: FusedKernel, err: &tch::TchError) {
    let mut guard = CHOICES.lock().unwrap_or_else(|e| e.into_inner());
    if let Some(c) = guard.get_or_insert_with(HashMap::new).get_mut(&p)
        && c.left.first() == Some(&kernel)
    {
        tracing::warn!(device = ?p.device, dtype = ?p.kind, "attention kernel {} failed, trying the next: {err}", kernel.name());
        c.left.remove(0);
        c.first = Check::NotYet;
        none_left(p, &c.left);
    }
}
