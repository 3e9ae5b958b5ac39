//! `llora plan`: the memory one rank needs for a run, worked out from the config before
//! anything is allocated, and the cheapest recipe that fits a device.
//!
//! Every term is derived from what llora's code allocates (the tensors each op keeps for
//! backward, the temporaries of the largest backward op), not fitted to measurements; `llora
//! bench` prints the plan of each run next to its measured peak (`planned_peak_mb`), and
//! `scripts/bench-memory.sh` tabulates the two (docs/memory.md).

use llora_model::LlamaConfig;
pub use llora_model::Saved;
use llora_model::precision::{Compute, PrecisionSpec};
use llora_model::{BlockLinear, LinearInput};
use serde_json::{Value, json};

/// CPU: the process's resident memory before the model exists (LibTorch's libraries, the
/// allocator, the thread pools), measured with `llora bench` (docs/performance.md, M15).
const CPU_RUNTIME_BYTES: f64 = 366.0 * MB;
/// CUDA: the context, cuBLAS/cuDNN workspaces and NCCL buffers a rank holds on its device
/// (NVIDIA's usual 1-2 GB; not measured here: no GPU on this project's machines).
const CUDA_RUNTIME_BYTES: f64 = 2.0 * GB;
/// CUDA: what the caching allocator holds beyond live tensors at the peak (a margin, untested).
const CUDA_FRAGMENTATION: f64 = 0.05;
/// CPU: the packing buffers one thread's f32 GEMMs hold, which MKL's memory manager keeps
/// after the first GEMM: the most measured per thread (docs/performance.md, M15). bf16 GEMMs
/// (oneDNN) keep none.
const CPU_F32_GEMM_WORKSPACE: f64 = 36.0 * MB;
/// CPU: the same when only the rank-r adapter GEMMs run in f32 (the `[r, d]` weight gradient
/// at d 8192 is the largest: docs/performance.md, M15).
const CPU_ADAPTER_GEMM_WORKSPACE: f64 = 21.0 * MB;
/// Elements of a weight one CPU GEMM converts to f32 at a time: `_scaled_mm` on FP8 codes
/// (`fp8/gemm.rs`) and bf16 GEMMs routed through f32 (`precision/bf16.rs`).
const CPU_GEMM_BLOCK_ELEMENTS: f64 = llora_model::precision::blocked::BLOCK_ELEMENTS as f64;
/// Bytes of logits one chunk of the fused LM-head cross-entropy holds (`loss.rs`).
const LCE_CHUNK_BYTES: f64 = 32.0 * MB;

const MB: f64 = (1u64 << 20) as f64;
/// Bytes in a GiB (the plan reports binary units).
pub const GB: f64 = (1u64 << 30) as f64;

/// Where the run's tensors live.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// Host memory: the plan is the process's peak RSS.
    Cpu,
    /// One GPU per rank: the plan is the device memory at the peak.
    Cuda,
}

/// Everything about a run that decides its memory.
#[derive(Debug, Clone)]
pub struct Shape {
    /// Architecture.
    pub model: LlamaConfig,
    /// The adapters: rank, dropout, targets (`q_proj`, …, `qkv_proj`), per-module ranks and
    /// layer selection.
    pub lora: llora_model::LoraSpec,
    /// Numerics.
    pub precision: PrecisionSpec,
    /// Sequences per micro-batch.
    pub micro_batch: usize,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Fraction of positions that have a target (1 for the MLPerf data's worst case).
    pub target_fraction: f64,
    /// `train.recompute_layers`.
    pub recompute_layers: usize,
    /// `train.shard_frozen_weights`.
    pub shard_frozen_weights: bool,
    /// Ranks in all (data-parallel groups × `context_parallel`).
    pub world: usize,
    /// `train.context_parallel`: ranks sharing each sequence (1: none).
    pub context_parallel: usize,
    /// Host or GPU.
    pub target: Target,
    /// CPU threads of the rank's GEMMs (each holds its own GEMM workspace).
    pub threads: usize,
    /// Whether bf16 GEMMs run natively on the target; where not (an AVX2-only CPU), they run
    /// in f32 on f32 copies of their bf16 operands (`precision/bf16.rs`).
    pub native_bf16_gemm: bool,
}

/// One line of a rank's memory budget.
#[derive(Debug, Clone)]
pub struct Line {
    /// What it is.
    pub name: &'static str,
    /// Bytes.
    pub bytes: f64,
    /// How it was counted.
    pub note: String,
}

/// A rank's memory at the run's peak.
#[derive(Debug, Clone)]
pub struct Budget {
    /// The terms, which add up to `peak`.
    pub lines: Vec<Line>,
    /// Their sum: the predicted peak (CPU: RSS; CUDA: device memory).
    pub peak: f64,
}

/// Bytes per element of a frozen linear weight as stored.
fn weight_elem(p: &PrecisionSpec) -> f64 {
    if let Some(nf4) = p.nf4 {
        return nf4.bytes_per_value();
    }
    match p.compute {
        Compute::Bf16 => 2.0,
        Compute::Fp8 if p.fp8_weights => 1.0,
        _ => 4.0,
    }
}

/// A block's widths as f64, for per-token byte counts: hidden d, query heads h, q and kv
/// widths, MLP width i, activation bytes per element e, saved-activation bytes per element a,
/// adapter bottleneck bytes per element b, adapter rank r.
struct Widths {
    d: f64,
    h: f64,
    qd: f64,
    kvd: f64,
    i: f64,
    e: f64,
    a: f64,
    b: f64,
    r: f64,
}

fn widths(s: &Shape) -> Widths {
    let c = &s.model;
    let f = |x: usize| x as f64;
    Widths {
        d: f(c.hidden_size),
        h: f(c.num_attention_heads),
        qd: f(c.num_attention_heads * c.head_dim),
        kvd: f(c.num_key_value_heads * c.head_dim),
        i: f(c.intermediate_size),
        e: s.precision.activation_bytes(),
        a: s.precision.saved_activation_bytes(),
        b: s.precision.adapter_bottleneck_bytes(),
        r: s.lora.rank as f64,
    }
}

/// What llora keeps for backward per token of one decoder block (a middle block: block 0's
/// input needs no gradient), op by op as the code does it, one entry per tensor (the
/// allocator rounds each one up on its own: [`allocated`]).
pub fn kept_per_token(s: &Shape) -> Vec<Saved> {
    llora_model::llama::DecoderLayer::saved_per_token(&s.model, &s.lora, &s.precision)
}

/// The least a LoRA backward of one block must keep per token with the same numerics (the
/// residual stream and attention in the activations' dtype, with f32 1/rms, GEMM inputs in the
/// run's activation storage), each tensor
/// once: dropout masks are redrawn from a per-block seed, K/V stay at their head count, the
/// attention output doubles as o_proj's adapter input, and nothing cheap to recompute from
/// the kept tensors (norm outputs) is stored.
pub fn minimum_per_token(s: &Shape) -> Vec<Saved> {
    let Widths { d, h, qd, kvd, i, e, a, b, r } = widths(s);
    let mut out = vec![
        Saved { name: "block input + 1/rms".into(), bytes: e * d + 4.0, why: "RMSNorm before attention" },
        Saved { name: "residual after attention + 1/rms".into(), bytes: e * d + 4.0, why: "RMSNorm before the MLP" },
        Saved {
            name: "q, k, v after RoPE, attention output, log-sum-exp".into(),
            bytes: e * (2.0 * qd + 2.0 * kvd) + 4.0 * h,
            why: "attention backward; the output is also o_proj's adapter input",
        },
        Saved { name: "SwiGLU gate and up".into(), bytes: 2.0 * i * a, why: "SwiGLU backward" },
    ];
    let mut inputs = Vec::new();
    for kind in s.lora.adapted_kinds(s.model.fused_qkv) {
        let (input, [_, n_in]) = (kind.input(), kind.shape(&s.model));
        if input != LinearInput::AttnOut && !inputs.contains(&input) {
            inputs.push(input);
            out.push(Saved {
                name: format!("{} (adapter input, once)", input.name()),
                bytes: n_in as f64 * a,
                why: "LoRA A gradients (masks redrawn from the seed)",
            });
        }
        out.push(Saved { name: format!("{} adapter bottleneck", kind.name()), bytes: r * b, why: "LoRA B gradient" });
        out.extend(llora_model::LoraAdapter::dora_saved_per_token(kind, &s.model, &s.lora, &s.precision));
    }
    out
}

/// Total bytes per token of a list.
pub fn per_token(list: &[Saved]) -> f64 {
    list.iter().map(|k| k.bytes).sum()
}

/// The bytes an allocation of `bytes` occupies. CPU: jemalloc's size classes, four per
/// doubling, so a tensor takes up to 25% more than its bytes (docs/performance.md, M16). CUDA: the caching allocator's 512-byte rounding (its larger block rounding is in
/// the fragmentation margin).
fn allocated(bytes: f64, target: Target) -> f64 {
    if bytes <= 0.0 {
        return 0.0;
    }
    let step = match target {
        // Small classes (≤ 16 KiB) are 16-byte-spaced at worst; what matters are the large ones.
        Target::Cpu if bytes > 16384.0 => (bytes - 1.0).log2().floor().exp2() / 4.0,
        Target::Cpu => 16.0,
        Target::Cuda => 512.0,
    };
    (bytes / step).ceil() * step
}

/// Elements of each linear weight of one decoder block, and of the largest one.
fn block_linears(c: &LlamaConfig) -> (Vec<f64>, f64) {
    let sizes: Vec<f64> =
        BlockLinear::of(c.fused_qkv).iter().map(|k| k.shape(c).iter().product::<usize>() as f64).collect();
    let largest = sizes.iter().cloned().fold(0.0, f64::max);
    (sizes, largest)
}

/// LoRA parameters of the model (with DoRA's magnitudes), each adapter at its own rank
/// (`rank_pattern`) and only in the layers that have adapters (`layers_to_transform`).
fn lora_params(s: &Shape) -> f64 {
    let c = &s.model;
    let mut total = 0usize;
    for l in 0..c.num_hidden_layers {
        for kind in s.lora.adapted_kinds(s.model.fused_qkv) {
            let ([n_out, n_in], module) = (kind.shape(c), kind.path(l));
            if s.lora.layers.as_ref().is_some_and(|ls| !ls.contains(&l)) {
                continue;
            }
            let rank = s.lora.module_spec(&module).map_or(s.lora.rank, |m| m.rank);
            // DoRA: one magnitude per output row.
            total += rank * (n_in + n_out) + if s.lora.dora { n_out } else { 0 };
        }
    }
    total as f64
}

/// The memory one rank of the run `s` needs at its peak, term by term, each tensor as the
/// allocator rounds it ([`allocated`]).
pub fn budget(s: &Shape) -> Budget {
    let runtime = match s.target {
        Target::Cpu => CPU_RUNTIME_BYTES,
        Target::Cuda => CUDA_RUNTIME_BYTES,
    };
    let mut lines =
        vec![Line { name: "runtime", bytes: runtime, note: format!("{:?} runtime before the model", s.target) }];
    lines.push(frozen_weights(s));
    lines.extend(nf4_dequantised(s));
    lines.push(tables_and_norms(s));
    let n_lora = lora_params(s);
    // Parameter, its gradient, the flat gradient the step reduces, AdamW's two moments.
    let note = format!("{n_lora} parameters x 5 f32");
    lines.push(Line { name: "LoRA weights, gradients, AdamW", bytes: n_lora * 4.0 * 5.0, note });
    lines.push(saved_activations(s));
    lines.push(final_norm_and_loss(s));
    lines.extend(context_exchange(s));
    lines.push(workspace(s));
    lines.extend(cpu_gemm_workspace(s));
    let mut peak: f64 = lines.iter().map(|x| x.bytes).sum();
    if s.target == Target::Cuda {
        let margin = (peak - runtime) * CUDA_FRAGMENTATION;
        lines.push(Line { name: "allocator margin", bytes: margin, note: "5% of tensors (caching allocator)".into() });
        peak += margin;
    }
    Budget { lines, peak }
}

/// Tokens of one micro-batch on this rank: under context parallelism its share of each
/// (padded) sequence.
fn tokens(s: &Shape) -> f64 {
    let split = llora_model::context::ContextSplit::new(s.seq_len, 0, s.context_parallel.max(1));
    (s.micro_batch * split.local_len()) as f64
}

/// Context parallelism's transients in one block's attention backward (its peak): the group's
/// keys and values gathered in the activations' dtype and their f32 gradients over the whole
/// sequence (summed over the group in place: `dist/context.rs`), and this rank's f32 query
/// gradient and merged output.
fn context_exchange(s: &Shape) -> Option<Line> {
    let n = s.context_parallel;
    if n <= 1 {
        return None;
    }
    let c = &s.model;
    let split = llora_model::context::ContextSplit::new(s.seq_len, 0, n);
    let whole = (s.micro_batch * split.padded) as f64 * (c.num_key_value_heads * c.head_dim) as f64;
    let e = s.precision.activation_bytes();
    let alloc = |bytes: f64| allocated(bytes, s.target);
    let q_local = tokens(s) * (c.num_attention_heads * c.head_dim) as f64;
    let bytes = 2.0 * alloc(whole * e) + 2.0 * alloc(whole * 4.0) + 2.0 * alloc(q_local * 4.0);
    Some(Line {
        name: "context-parallel K/V exchange",
        bytes,
        note: format!("{n} ranks per sequence: the whole sequence's K/V and their f32 gradients, in one block"),
    })
}

/// Whether the frozen weights are sharded over more than one rank.
fn sharded(s: &Shape) -> bool {
    s.shard_frozen_weights && s.world > 1
}

/// The frozen linear weights: every block's, replicated or a 1/world share of each plus the
/// blocks gathered at a time.
fn frozen_weights(s: &Shape) -> Line {
    let (c, p) = (&s.model, &s.precision);
    let l = c.num_hidden_layers;
    let (weights, _) = block_linears(c);
    // FP8 weights kept whole on CUDA keep their transpose too (`_scaled_mm` wants the
    // input-gradient GEMM's weight column-major: precision/weights.rs, `StoredWeight::Fp8`).
    let transposed = s.target == Target::Cuda
        && p.compute == Compute::Fp8
        && p.fp8_weights
        && !p.fp8_weights_one_layout
        && !sharded(s);
    let w = weight_elem(p) * if transposed { 2.0 } else { 1.0 };
    let block = |share: f64| weights.iter().map(|&n| allocated(n * w / share, s.target)).sum::<f64>();
    let (bytes, note) = if sharded(s) {
        // The block that runs and the next one, whose gather is in flight meanwhile.
        let gathered = l.min(2);
        (
            l as f64 * block(s.world as f64) + gathered as f64 * block(1.0),
            format!("{w} B/elem, 1/{} of every block + {gathered} block(s) gathered", s.world),
        )
    } else {
        let one = s.target == Target::Cuda && p.fp8_weights && p.fp8_weights_one_layout;
        let layouts = match (transposed, one) {
            (true, _) => " (both layouts)",
            (false, true) => " (one layout, transposed for each backward GEMM)",
            (false, false) => "",
        };
        (l as f64 * block(1.0), format!("{w} B/elem{layouts}, replicated"))
    };
    Line { name: "frozen linear weights", bytes, note }
}

/// NF4: each GEMM dequantises its weight whole: NF4 codes to f32 (precision/weights.rs), then
/// the compute dtype's copy for bf16.
fn nf4_dequantised(s: &Shape) -> Option<Line> {
    let p = &s.precision;
    p.nf4?;
    let (_, largest) = block_linears(&s.model);
    let copy = if p.compute == Compute::Bf16 { allocated(largest * 2.0, s.target) } else { 0.0 };
    Some(Line {
        name: "NF4 weight dequantised for its GEMM",
        bytes: allocated(largest * 4.0, s.target) + copy,
        note: "the largest linear weight in f32 (and bf16), while its GEMM runs".into(),
    })
}

/// Frozen tables, stored in the activations' dtype (load.rs), and the f32 norms.
fn tables_and_norms(s: &Shape) -> Line {
    let c = &s.model;
    let (d, v, l) = (c.hidden_size as f64, c.vocab_size as f64, c.num_hidden_layers);
    let e = s.precision.activation_bytes();
    // A tied LM head is the embedding table itself (Llama 3.2 1B/3B).
    let tables = if c.tie_word_embeddings { 1.0 } else { 2.0 };
    Line {
        name: "embedding, LM head, norms",
        bytes: tables * allocated(v * d * e, s.target) + (2 * l + 1) as f64 * allocated(d * 4.0, s.target),
        note: format!(
            "{e} B/elem tables{}, f32 norms, replicated",
            if c.tie_word_embeddings { " (tied: one)" } else { "" }
        ),
    }
}

/// What backward needs kept at its start: the blocks with a graph (block 0's input needs no
/// gradient), each recomputed block's input, and the recomputed block being backpropagated.
fn saved_activations(s: &Shape) -> Line {
    let l = s.model.num_hidden_layers;
    let (t, e, d) = (tokens(s), s.precision.activation_bytes(), s.model.hidden_size as f64);
    let alloc = |bytes: f64| allocated(bytes, s.target);
    let kept: f64 = kept_per_token(s).iter().map(|k| alloc(k.bytes * t)).sum();
    let n = s.recompute_layers.min(l);
    let untracked_input = n == 0 && !sharded(s);
    let graphs = (l - n) as f64 * kept - if untracked_input { alloc(e * d * t) } else { 0.0 };
    let recompute = if n > 0 { n as f64 * alloc(e * d * t) + kept } else { 0.0 };
    Line {
        name: "saved activations",
        bytes: graphs + recompute,
        note: format!("{} blocks kept, {n} recomputed", l - n),
    }
}

/// Target rows of a micro-batch.
fn target_rows(s: &Shape) -> f64 {
    (tokens(s) * s.target_fraction).ceil()
}

/// The final norm's input and its output, and the loss's dh rows.
fn final_norm_and_loss(s: &Shape) -> Line {
    let (t, e, d) = (tokens(s), s.precision.activation_bytes(), s.model.hidden_size as f64);
    let rows = target_rows(s);
    let bytes = 2.0 * allocated(e * d * t, s.target) + allocated(e * d * rows, s.target);
    Line { name: "final norm and loss", bytes, note: format!("{rows} target rows kept for backward") }
}

/// Whether bf16 GEMMs are routed through f32 (a CPU without native bf16).
fn upcast_gemms(s: &Shape) -> bool {
    s.precision.activation_bytes() < 4.0 && !s.native_bf16_gemm
}

/// The loss's transients: one chunk of f32 logits (and the chunk's bf16 GEMM output it is
/// upcast from), and the LM head's f32 column block when bf16 GEMMs go through f32.
fn loss_transients(s: &Shape) -> (f64, f64) {
    let (e, d, v) = (s.precision.activation_bytes(), s.model.hidden_size as f64, s.model.vocab_size as f64);
    let alloc = |bytes: f64| allocated(bytes, s.target);
    let chunk = LCE_CHUNK_BYTES.min(target_rows(s) * v * 4.0);
    let chunk = alloc(chunk) + if e < 4.0 { alloc(chunk * e / 4.0) } else { 0.0 };
    let head_block = (v * d).min(llora_model::loss::LCE_HEAD_BLOCK_ELEMENTS as f64);
    let table = if upcast_gemms(s) { alloc(head_block * 4.0) } else { 0.0 };
    (chunk, table)
}

/// The largest transient: the loss's, or backward's largest op. That is SwiGLU's, with four
/// `[tokens, I]` activation-dtype tensors live (plus, when gate and up are stored in FP8, their
/// dequantised copies and one f32 transient), or the MLP GEMM with its operands' copies; plus
/// the residual-stream gradient. The loss's transients are gone when backward starts.
fn workspace(s: &Shape) -> Line {
    let p = &s.precision;
    let (t, e) = (tokens(s), p.activation_bytes());
    let (d, i) = (s.model.hidden_size as f64, s.model.intermediate_size as f64);
    let alloc = |bytes: f64| allocated(bytes, s.target);
    let (chunk, table) = loss_transients(s);
    let loss = chunk + table;
    let fp8_kept = if p.saved_activation_bytes() < e { 2.0 * alloc(e * t * i) + alloc(4.0 * t * i) } else { 0.0 };
    let swiglu = 4.0 * alloc(e * t * i) + fp8_kept;
    let gemm = gemm_workspace(s);
    let backward = swiglu.max(gemm) + 2.0 * alloc(t * d * e);
    let note = if loss > backward {
        "the loss: a chunk of logits".to_string() + if table > 0.0 { " and a block of the LM head in f32" } else { "" }
    } else if swiglu >= gemm {
        "backward: SwiGLU's temporaries".into()
    } else {
        "backward: the MLP GEMM with its operands' copies".into()
    };
    Line { name: "loss or backward workspace", bytes: loss.max(backward), note }
}

/// The MLP GEMM's operands and their copies in backward, by compute precision.
fn gemm_workspace(s: &Shape) -> f64 {
    let p = &s.precision;
    let (t, e) = (tokens(s), p.activation_bytes());
    let (d, i) = (s.model.hidden_size as f64, s.model.intermediate_size as f64);
    let alloc = |bytes: f64| allocated(bytes, s.target);
    let (_, largest) = block_linears(&s.model);
    // torch's CPU `_scaled_mm` converts its operands to f32: the whole first operand and a
    // column block of the second (fp8/gemm.rs), with its transpose and f32 output.
    let block = largest.min(CPU_GEMM_BLOCK_ELEMENTS);
    let cpu_fp8 = if s.target == Target::Cpu { alloc(t * i * 4.0) + 3.0 * alloc(block * 4.0) } else { 0.0 };
    // The f32 upcast of the widest adapter input (f32 adapters on bf16 activations).
    let widest_adapter =
        s.lora.adapted_kinds(s.model.fused_qkv).iter().map(|k| k.shape(&s.model)[1]).max().unwrap_or(0) as f64;
    let upcast = if p.compute == Compute::Bf16 { alloc(widest_adapter * t * 4.0) } else { 0.0 };
    match p.compute {
        // `_scaled_mm`'s operands: the input's and gradient's FP8 codes, the weight's codes
        // and (uncached) transposed codes.
        Compute::Fp8 => alloc(t * i * e) + alloc(t * d * e) + alloc(t * i) + 2.0 * alloc(largest) + cpu_fp8,
        // bf16 routed through f32 (precision/bf16.rs): the first operand in f32, a column
        // block of the weight in f32 and its f32 output block.
        Compute::Bf16 if upcast_gemms(s) => {
            alloc(t * i * e) + alloc(t * d * e) + alloc(t * i * 4.0) + 2.0 * alloc(block * 4.0)
        }
        _ => alloc(t * i * e) + alloc(t * d * e) + upcast,
    }
}

/// CPU: MKL's per-thread buffers; the big GEMMs run in f32 for fp32 compute and for the
/// emulated FP8 recipe.
fn cpu_gemm_workspace(s: &Shape) -> Option<Line> {
    if s.target != Target::Cpu {
        return None;
    }
    let (per_thread, which) = match s.precision.compute {
        Compute::Bf16 if s.native_bf16_gemm => (CPU_ADAPTER_GEMM_WORKSPACE, "the adapters' f32 GEMMs"),
        _ => (CPU_F32_GEMM_WORKSPACE, "f32 GEMMs"),
    };
    let threads = s.threads.max(1);
    let note = format!("MKL's buffers for {which}, {threads} thread(s)");
    Some(Line { name: "GEMM workspace", bytes: per_thread * threads as f64, note })
}

/// Dense FLOPs per byte of memory bandwidth of the GPUs llora plans for (H100/H200 bf16: 989
/// TFLOP/s over 3.4-4.8 TB/s): what turns a transpose's bytes into recomputed blocks' time.
const GPU_FLOP_PER_BYTE: f64 = 250.0;

/// The time of keeping FP8 weights in one layout, in blocks recomputed: every layer's weights
/// transposed once per backward (2 B moved per value) against one block's forward (2 FLOPs per
/// value per token), so `layers · FLOP-per-byte / tokens` (≈ 2.4 blocks for 70B at 8192 tokens).
fn one_layout_cost(s: &Shape) -> f64 {
    s.model.num_hidden_layers as f64 * GPU_FLOP_PER_BYTE / tokens(s).max(1.0)
}

/// Dense FLOPs per byte of one rank's all-gather bandwidth within one node: H100 bf16 (989
/// TFLOP/s) over NVLink 4's ~360 GB/s all-gather bus bandwidth (nccl-tests on 8 x H100 SXM).
const GPU_FLOP_PER_LINK_BYTE: f64 = 2750.0;

/// The same for one CPU thread: its f32 GEMMs (~50 GFLOP/s) over Gloo's 1.1 GB/s on loopback
/// (docs/performance.md).
const CPU_FLOP_PER_LINK_BYTE_PER_THREAD: f64 = 45.0;

/// The time of sharding the frozen weights, in blocks recomputed. Each block's weights are
/// gathered twice per micro-batch (its forward, its backward), each gather in flight while the
/// block before computes (`LlamaForCausalLM::prefetch`), so it costs only what it takes beyond
/// one block's forward: `2 · layers · max(0, gathered bytes · FLOP-per-link-byte / forward
/// FLOPs − 1)` (0 for the 70B at 8192 tokens on NVLink: a gather is 0.17 of a forward).
/// Gathered FP8 weights come in one layout, so on CUDA they add [`one_layout_cost`].
fn shard_cost(s: &Shape) -> f64 {
    let w = s.world as f64;
    let flop_per_byte = match s.target {
        Target::Cuda => GPU_FLOP_PER_LINK_BYTE,
        Target::Cpu => CPU_FLOP_PER_LINK_BYTE_PER_THREAD * s.threads.max(1) as f64,
    };
    // Per value: bytes gathered (all but this rank's share) against 2 FLOPs per token.
    let ratio = weight_elem(&s.precision) * (w - 1.0) / w * flop_per_byte / (2.0 * tokens(s).max(1.0));
    let exposed = 2.0 * s.model.num_hidden_layers as f64 * (ratio - 1.0).max(0.0);
    let p = &s.precision;
    let transposes =
        if s.target == Target::Cuda && p.compute == Compute::Fp8 && p.fp8_weights { one_layout_cost(s) } else { 0.0 };
    exposed + transposes
}

/// The cheapest recipe for `s` that fits in `device_bytes`: its own context parallelism
/// first, then (when nothing fits and the world allows) more ranks per sequence
/// (`train.context_parallel`, dividing the world: each doubling halves the activations for a
/// K/V exchange per block). At each, every way to hold the weights (replicated, in one or
/// both layouts; sharded over the world) with its fewest recomputed blocks, costed in
/// recomputed blocks: one layout on CUDA with FP8 weights adds [`one_layout_cost`], sharding
/// [`shard_cost`]; the cheapest wins, ties to the replicated weights. None if nothing fits.
pub fn cheapest_recipe(s: &Shape, device_bytes: f64) -> Option<(Shape, Budget)> {
    let own = s.context_parallel.max(1);
    let more = (1..).map(|k| own << k).take_while(|&n| n <= s.world && s.world.is_multiple_of(n));
    std::iter::once(own)
        .chain(more)
        .find_map(|n| cheapest_at(&Shape { context_parallel: n, ..s.clone() }, device_bytes))
}

/// [`cheapest_recipe`] at `s`'s context parallelism.
fn cheapest_at(s: &Shape, device_bytes: f64) -> Option<(Shape, Budget)> {
    let l = s.model.num_hidden_layers;
    let p = s.precision;
    // (sharded, one layout): replicated in the config's layout, in one layout, sharded.
    let mut ways = vec![(false, p.fp8_weights_one_layout)];
    if s.target == Target::Cuda && p.fp8_weights && !p.fp8_weights_one_layout {
        ways.push((false, true));
    }
    if s.world > 1 {
        ways.push((true, p.fp8_weights_one_layout));
    }
    let mut best: Option<(f64, Shape, Budget)> = None;
    for (shard, one_layout) in ways {
        let precision = PrecisionSpec { fp8_weights_one_layout: one_layout, ..p };
        // The peak falls with every block recomputed: the first that fits is this way's best.
        let fit = (0..=l).find_map(|n| {
            let cand = Shape { recompute_layers: n, shard_frozen_weights: shard, precision, ..s.clone() };
            let b = budget(&cand);
            (b.peak <= device_bytes).then_some((cand, b))
        });
        let Some((cand, b)) = fit else { continue };
        let extra = match (shard, one_layout && !p.fp8_weights_one_layout) {
            (true, _) => shard_cost(s),
            (false, true) => one_layout_cost(s),
            (false, false) => 0.0,
        };
        let cost = cand.recompute_layers as f64 + extra;
        if best.as_ref().is_none_or(|(c, _, _)| cost < *c) {
            best = Some((cost, cand, b));
        }
    }
    best.map(|(_, cand, b)| (cand, b))
}

/// The plan as JSON: the budget, the per-token lists and, with a device size, the recipe.
pub fn to_json(s: &Shape, device_bytes: Option<f64>) -> Value {
    let b = budget(s);
    let mb = |x: f64| (x / MB * 10.0).round() / 10.0;
    let kept = kept_per_token(s);
    let min = minimum_per_token(s);
    let list =
        |l: &[Saved]| l.iter().map(|k| json!({"tensor": k.name, "bytes": k.bytes, "why": k.why})).collect::<Vec<_>>();
    let mut out = json!({
        "world": s.world, "context_parallel": s.context_parallel, "micro_batch": s.micro_batch, "seq_len": s.seq_len,
        "recompute_layers": s.recompute_layers, "shard_frozen_weights": s.shard_frozen_weights,
        "peak_mb": mb(b.peak),
        "budget": b.lines.iter().map(|x| json!({"term": x.name, "mb": mb(x.bytes), "note": x.note})).collect::<Vec<_>>(),
        "kept_bytes_per_token_per_block": per_token(&kept), "kept": list(&kept),
        "minimum_bytes_per_token_per_block": per_token(&min), "minimum": list(&min),
        "kept_over_minimum": (per_token(&kept) / per_token(&min) * 1000.0).round() / 1000.0,
    });
    if let Some(dev) = device_bytes {
        out["device_mb"] = mb(dev).into();
        out["fits"] = (b.peak <= dev).into();
        out["cheapest"] = match cheapest_recipe(s, dev) {
            Some((c, cb)) => {
                json!({"recompute_layers": c.recompute_layers, "shard_frozen_weights": c.shard_frozen_weights,
                       "fp8_weights_one_layout": c.precision.fp8_weights_one_layout,
                       "context_parallel": c.context_parallel, "peak_mb": mb(cb.peak)})
            }
            None => Value::Null,
        };
    }
    out
}

/// The product of sizes, or an error naming each factor when it does not fit a `usize` (a huge
/// world or batch must be refused, not wrapped around into a small one).
pub fn checked_product(factors: &[(&str, usize)]) -> anyhow::Result<usize> {
    factors.iter().try_fold(1usize, |acc, &(_, n)| acc.checked_mul(n)).ok_or_else(|| {
        let named: Vec<String> = factors.iter().map(|(what, n)| format!("{what} = {n}")).collect();
        anyhow::anyhow!("{} multiply past 2^64: lower one of them", named.join(" × "))
    })
}

/// The run a config describes, on `world` ranks.
pub fn shape_of(config: &crate::config::Config, world: usize) -> anyhow::Result<Shape> {
    // Every size the budget multiplies together, checked once here.
    checked_product(&[
        ("train.micro_batch_size", config.train.micro_batch_size),
        ("data.max_seq_len", config.data.max_seq_len),
        ("ranks", world),
    ])?;
    let model = match (&config.model.path, &config.model.preset) {
        (Some(path), _) if path.join("config.json").exists() => {
            llora_model::checkpoint::HfCheckpoint::open(path)
                .map_err(|e| e.context(format!("model.path = {}", path.display())))?
                .config
        }
        // Without the checkpoint, the preset in the layout the adapters name: `qkv_proj`
        // exists only in a fused-QKV checkpoint (the MLPerf reference's conversion), and on
        // separate q/k/v projections training refuses that target.
        (_, Some(preset)) => {
            let fused_qkv = config.lora.targets.iter().any(|t| t == "qkv_proj");
            LlamaConfig { fused_qkv, ..LlamaConfig::preset(preset)? }
        }
        (Some(path), None) => {
            anyhow::bail!("model.path {} has no config.json and model.preset is not set", path.display())
        }
        (None, None) => anyhow::bail!("set model.path or model.preset"),
    };
    // What training would refuse of the adapters, the plan refuses too (and before it, a run).
    if config.model.trainable == crate::config::Trainable::Lora {
        config.lora.check_for_model(&model)?;
    }
    Ok(Shape {
        model,
        lora: config.lora.clone(),
        precision: config.precision_spec(),
        micro_batch: config.train.micro_batch_size,
        seq_len: config.data.max_seq_len,
        // Every position may have a target (the plan must hold for the worst batch).
        target_fraction: 1.0,
        recompute_layers: config.train.recompute_layers,
        shard_frozen_weights: config.train.shard_frozen_weights,
        world,
        context_parallel: config.train.context_parallel,
        target: if config.run.device.is_cuda() { Target::Cuda } else { Target::Cpu },
        threads: match config.run.threads {
            0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
            n => n,
        },
        native_bf16_gemm: config.run.device.is_cuda() || llora_model::precision::bf16::native_on_this_cpu(),
    })
}

/// Refuses a training config before anything is allocated when its sequences are longer than
/// the model's positions, or when (on a CPU) its planned peak is more than the machine's
/// memory: a run that cannot fit is an error that says how much it needs, not an OOM kill.
/// (On CUDA the device's memory is not known before the run starts; `llora plan
/// --device-memory` answers there.)
pub fn check_fits(config: &crate::config::Config, world: usize) -> anyhow::Result<()> {
    let shape = shape_of(config, world)?;
    let source = match &config.model.path {
        Some(p) if p.join("config.json").exists() => format!("{}/config.json", p.display()),
        _ => format!("model.preset = {:?}", config.model.preset.as_deref().unwrap_or_default()),
    };
    anyhow::ensure!(
        shape.seq_len <= shape.model.max_position_embeddings,
        "data.max_seq_len = {} is past the model's max_position_embeddings = {} ({source}): positions beyond it \
         were never trained. Lower data.max_seq_len, or raise max_position_embeddings in config.json on purpose \
         (MLPerf's Llama 2 70B checkpoint raises it to 8192)",
        shape.seq_len,
        shape.model.max_position_embeddings
    );
    if shape.target == Target::Cpu
        && let Some(total) = total_memory_bytes()
    {
        let peak = budget(&shape).peak;
        anyhow::ensure!(
            peak <= total,
            "this run needs about {:.1} GiB at its peak per rank (llora plan: {source}, data.max_seq_len = {}, \
             train.micro_batch_size = {}), and this machine has {:.1} GiB: lower data.max_seq_len or \
             train.micro_batch_size, recompute blocks (train.recompute_layers), or see `llora plan` for a recipe",
            peak / GB,
            shape.seq_len,
            shape.micro_batch,
            total / GB
        );
    }
    Ok(())
}

/// `MemTotal` of /proc/meminfo in bytes (Linux), if readable.
pub fn total_memory_bytes() -> Option<f64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb: f64 =
        info.lines().find_map(|l| l.strip_prefix("MemTotal:"))?.trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kb * 1024.0)
}

/// The human-readable plan.
pub(crate) fn report(s: &Shape, device: Option<f64>) -> String {
    use std::fmt::Write;
    let b = budget(s);
    let c = &s.model;
    let mut o = String::new();
    let _ = writeln!(
        o,
        "# {} layers, d {}, {} tokens per micro-batch, {} {}, {} rank(s), context_parallel {}, recompute_layers {}, \
         shard_frozen_weights {}",
        c.num_hidden_layers,
        c.hidden_size,
        s.micro_batch * s.seq_len,
        s.precision.compute.name(),
        match (s.precision.fp8_weights, s.precision.fp8_activations) {
            (true, true) => "+ FP8 weights and activations",
            (true, false) => "+ FP8 weights",
            (false, true) => "+ FP8 activations",
            _ => "",
        },
        s.world,
        s.context_parallel,
        s.recompute_layers,
        s.shard_frozen_weights
    );
    let _ = writeln!(o, "| term | MB per rank | how |\n|---|---|---|");
    for l in &b.lines {
        let _ = writeln!(o, "| {} | {:.0} | {} |", l.name, l.bytes / MB, l.note);
    }
    let _ = writeln!(
        o,
        "| **peak** | **{:.0}** | {} |",
        b.peak / MB,
        match s.target {
            Target::Cpu => "process RSS",
            Target::Cuda => "device memory",
        }
    );
    let (kept, min) = (kept_per_token(s), minimum_per_token(s));
    let _ = writeln!(
        o,
        "\nsaved activations per token per block: llora keeps {:.0} B, the minimum is {:.0} B ({:.2}x)",
        per_token(&kept),
        per_token(&min),
        per_token(&kept) / per_token(&min)
    );
    let _ = writeln!(o, "| minimum keeps | B per token | for |\n|---|---|---|");
    for k in &min {
        let _ = writeln!(o, "| {} | {:.0} | {} |", k.name, k.bytes, k.why);
    }
    if let Some(dev) = device {
        let verdict = if b.peak <= dev { "fits" } else { "does NOT fit" };
        let _ = writeln!(o, "\nthis recipe needs {:.1} GiB of {:.1} GiB: {verdict}", b.peak / GB, dev / GB);
        match cheapest_recipe(s, dev) {
            Some((r, rb)) => {
                let mut layout = if r.precision.fp8_weights_one_layout != s.precision.fp8_weights_one_layout {
                    ", precision.fp8_weights_one_layout = true".to_string()
                } else {
                    String::new()
                };
                if r.context_parallel != s.context_parallel {
                    layout += &format!(", train.context_parallel = {}", r.context_parallel);
                }
                let _ = writeln!(
                    o,
                    "cheapest recipe that fits: train.recompute_layers = {}, train.shard_frozen_weights = {}{layout} ({:.1} GiB)",
                    r.recompute_layers,
                    r.shard_frozen_weights,
                    rb.peak / GB
                );
            }
            None => {
                let sharded = if s.world > 1 { " with sharded frozen weights" } else { "" };
                let _ = writeln!(
                    o,
                    "no recipe fits: every block recomputed{sharded} still needs more; {}",
                    no_fit_advice(s)
                );
            }
        }
    }
    o
}

/// What else could make `s` fit when no recipe does: only the changes it has not made.
fn no_fit_advice(s: &Shape) -> String {
    let p = &s.precision;
    let mut ways = vec!["use more ranks (and split each sequence over them: train.context_parallel)".to_string()];
    if !(p.compute == Compute::Fp8 && p.fp8_weights) {
        ways.push(
            "FP8 weights (precision.compute = \"fp8\", precision.fp8_weights = true, in one layout: \
             precision.fp8_weights_one_layout = true)"
                .into(),
        );
    } else if !p.fp8_weights_one_layout {
        ways.push("FP8 weights in one layout (precision.fp8_weights_one_layout = true)".into());
    }
    ways.push("shorter sequences".into());
    let last = ways.pop().unwrap_or_default();
    format!("{} or {last}", ways.join(", "))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// When nothing fits, the advice names only changes the run has not made:
    /// FP8 weights when it has none, one layout when it keeps two, neither when it has both.
    #[test]
    fn advice_when_nothing_fits_names_only_what_is_left() {
        let mut s = mlperf(1, 0, false);
        s.precision = PrecisionSpec { compute: Compute::Bf16, ..Default::default() };
        assert!(no_fit_advice(&s).contains("precision.fp8_weights = true"), "{}", no_fit_advice(&s));
        s = mlperf(1, 0, false);
        let two = no_fit_advice(&s);
        assert!(two.contains("one layout") && !two.contains("precision.compute"), "{two}");
        s.precision.fp8_weights_one_layout = true;
        let done = no_fit_advice(&s);
        assert!(
            !done.contains("fp8")
                && done
                    == "use more ranks (and split each sequence over them: train.context_parallel) or shorter sequences",
            "{done}"
        );
    }

    /// Per-module ranks and layer selection change the adapter count as worked out by hand: on
    /// the 70B shape (d 8192, k/v width 1024, 80 layers), q/k/v/o at r 16, v_proj at r 4 and
    /// only layers 0 and 1 adapted.
    #[test]
    fn adapter_bytes_follow_rank_patterns_and_layers() {
        let mut s = mlperf(1, 0, false);
        s.model.fused_qkv = false;
        s.lora.targets = ["q_proj", "k_proj", "v_proj", "o_proj"].map(String::from).to_vec();
        let (d, kv) = (8192.0, 1024.0);
        let per_layer = |rv: f64| 16.0 * (d + d) + 16.0 * (d + kv) + rv * (d + kv) + 16.0 * (d + d);
        assert_eq!(lora_params(&s), 80.0 * per_layer(16.0));
        s.lora.rank_pattern = vec![("v_proj".into(), 4)];
        assert_eq!(lora_params(&s), 80.0 * per_layer(4.0));
        s.lora.layers = Some(vec![0, 1]);
        assert_eq!(lora_params(&s), 2.0 * per_layer(4.0));
        // DoRA: a magnitude per output row of each adapted module (q d, k kv, v kv, o d).
        s.lora.dora = true;
        assert_eq!(lora_params(&s), 2.0 * (per_layer(4.0) + d + kv + kv + d));
    }

    /// The planner counts the adapters the loader attaches: a `tiny-gqa` model built with each
    /// target set (on both layouts, `qkv_proj` on separate projections meaning q, k and v)
    /// has as many LoRA parameters as [`lora_params`] says.
    #[test]
    fn adapter_count_is_the_built_models() {
        // Building draws A from LibTorch's generator.
        let _rng = llora_model::device::torch_rng_lock();
        let device = burn::tensor::Device::default();
        for (fused, targets) in [
            (false, &["qkv_proj", "o_proj"][..]),
            (false, &["q_proj", "v_proj", "down_proj"]),
            (true, &["qkv_proj", "gate_proj"]),
        ] {
            let mut s = mlperf(1, 0, false);
            s.model = LlamaConfig { fused_qkv: fused, ..LlamaConfig::preset("tiny-gqa").unwrap() };
            s.lora = llora_model::LoraSpec {
                rank: 4,
                targets: targets.iter().map(|t| t.to_string()).collect(),
                ..Default::default()
            };
            let opts = llora_model::BuildOptions { lora: Some(&s.lora), ..Default::default() };
            let model = llora_model::LlamaForCausalLM::random(&s.model, &opts, &device).unwrap();
            assert_eq!(lora_params(&s), model.num_lora_parameters() as f64, "{targets:?}, fused {fused}");
        }
    }

    /// NF4 (QLoRA) frozen weights, worked by hand on Llama 2 70B: 80 layers of
    /// 8192·(8192 + 1024 + 1024 + 8192) + 3·8192·28672 = 855,638,016 values, at half a byte a
    /// value plus the scales: 64 values share 1 byte of scale code and 1/256 of a 4-byte f32 (double
    /// quantisation) = 0.515869 bytes a value, 35.31 GB; 0.5625 without double quantisation.
    #[test]
    fn nf4_frozen_weights_take_half_a_byte_and_the_scales() {
        let mut s = mlperf(1, 0, false);
        let values = 80.0 * 855_638_016.0;
        s.precision = PrecisionSpec { compute: Compute::Bf16, ..Default::default() };
        s.precision.nf4 = Some(llora_model::precision::Nf4Spec { block: 64, double: true });
        let frozen = |s: &Shape| budget(s).lines.iter().find(|l| l.name == "frozen linear weights").unwrap().bytes;
        let got = frozen(&s);
        assert!((got / values - (0.5 + (1.0 + 4.0 / 256.0) / 64.0)).abs() < 1e-4, "{} bytes a value", got / values);
        assert!((got / 1e9 - 35.31).abs() < 0.05, "{} GB", got / 1e9);
        s.precision.nf4 = Some(llora_model::precision::Nf4Spec { block: 64, double: false });
        assert!((frozen(&s) / values - 0.5625).abs() < 1e-4);
    }

    /// DoRA keeps, per token and adapted module, the factor its magnitude multiplies (one
    /// output row; two with dropout), in the adapter output's dtype: bf16 under FP8 (the
    /// MLPerf job: qkv 10240 wide, o 8192, dropout 0.1), f32 otherwise.
    #[test]
    fn dora_keeps_its_rescale_input_per_token() {
        let mut s = mlperf(1, 0, false);
        let base: f64 = kept_per_token(&s).iter().map(|k| k.bytes).sum();
        s.lora.dora = true;
        let dora: f64 = kept_per_token(&s).iter().map(|k| k.bytes).sum();
        assert_eq!(dora - base, 2.0 * 2.0 * (10240.0 + 8192.0));
        s.lora.dropout = 0.0;
        s.precision = PrecisionSpec { compute: Compute::Bf16, ..Default::default() };
        let base: f64 =
            kept_per_token(&Shape { lora: llora_model::LoraSpec { dora: false, ..s.lora.clone() }, ..s.clone() })
                .iter()
                .map(|k| k.bytes)
                .sum();
        let dora: f64 = kept_per_token(&s).iter().map(|k| k.bytes).sum();
        assert_eq!(dora - base, 4.0 * (10240.0 + 8192.0));
    }

    /// The MLPerf job's block (70B, fused qkv + o adapters, r 16, dropout 0.1, FP8 weights and
    /// activations), one 8192-token sequence.
    fn mlperf(world: usize, recompute: usize, shard: bool) -> Shape {
        Shape {
            model: LlamaConfig { fused_qkv: true, ..LlamaConfig::llama2_70b() },
            lora: llora_model::LoraSpec {
                rank: 16,
                dropout: 0.1,
                targets: vec!["qkv_proj".into(), "o_proj".into()],
                ..Default::default()
            },
            precision: PrecisionSpec {
                compute: Compute::Fp8,
                fp8_weights: true,
                fp8_activations: true,
                ..Default::default()
            },
            micro_batch: 1,
            seq_len: 8192,
            target_fraction: 1.0,
            recompute_layers: recompute,
            shard_frozen_weights: shard,
            world,
            context_parallel: 1,
            target: Target::Cuda,
            threads: 1,
            native_bf16_gemm: true,
        }
    }

    /// Llama 3 8B (vocab 128256, d 4096, I 14336, 32 layers, 32 heads over 8 K/V heads) in
    /// bf16 with LoRA on q/k/v/o, one `seq`-token sequence on `world` GPUs.
    fn llama3_8b(seq: usize, world: usize) -> Shape {
        let model = LlamaConfig {
            vocab_size: 128256,
            hidden_size: 4096,
            intermediate_size: 14336,
            num_hidden_layers: 32,
            num_attention_heads: 32,
            num_key_value_heads: 8,
            head_dim: 128,
            max_position_embeddings: 131072,
            ..LlamaConfig::llama2_7b()
        };
        Shape {
            model,
            precision: PrecisionSpec { compute: Compute::Bf16, ..Default::default() },
            seq_len: seq,
            world,
            ..mlperf(world, 0, false)
        }
    }

    /// The MLPerf config, without its checkpoint, is planned in the fused-QKV layout its
    /// `qkv_proj` target names (the reference's conversion; on separate q/k/v training refuses
    /// that target), and on 8 x H100 80 GB the recipe it ships (31 blocks recomputed, sharded
    /// weights) is the cheapest that fits.
    #[test]
    fn the_mlperf_config_plans_its_fused_checkpoint() {
        let path = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../configs/llama2-70b-mlperf.toml"));
        let config = crate::config::Config::load(Some(path), &[]).unwrap();
        let s = shape_of(&config, 8).unwrap();
        assert!(s.model.fused_qkv);
        let (r, b) = cheapest_recipe(&s, 80.0 * GB).unwrap();
        assert_eq!((r.recompute_layers, r.shard_frozen_weights), (config.train.recompute_layers, true));
        assert!(b.peak <= 80.0 * GB);
    }

    /// Context parallelism N holds 1/N of each sequence's tokens (the saved
    /// activations, the final norm and loss, the workspace fall by N), plus the exchange,
    /// counted by hand: the whole sequence's K/V (8 heads × 128 = 1024 wide at 70B) in bf16,
    /// their f32 gradients, and this rank's f32 dq and merged output (8192 wide).
    #[test]
    fn context_parallelism_divides_the_tokens_and_counts_the_exchange() {
        let one = mlperf(8, 0, false);
        let two = Shape { context_parallel: 2, ..one.clone() };
        assert_eq!((tokens(&one), tokens(&two)), (8192.0, 4096.0));
        let line = |b: &Budget, name: &str| b.lines.iter().find(|l| l.name == name).map(|l| l.bytes);
        let (b1, b2) = (budget(&one), budget(&two));
        let kept = |b: &Budget| line(b, "saved activations").unwrap();
        assert!((kept(&b2) / kept(&b1) - 0.5).abs() < 1e-3, "{} {}", kept(&b1), kept(&b2));
        assert_eq!(line(&b1, "context-parallel K/V exchange"), None);
        let (whole, local) = (8192.0 * 1024.0, 4096.0 * 8192.0);
        let want = allocated(whole * 2.0, Target::Cuda) * 2.0
            + allocated(whole * 4.0, Target::Cuda) * 2.0
            + allocated(local * 4.0, Target::Cuda) * 2.0;
        assert_eq!(line(&b2, "context-parallel K/V exchange"), Some(want));
    }

    /// The recipe splits a sequence over ranks only when nothing else fits: Llama 3
    /// 8B at 131072 tokens (Llama 3.1's context) in bf16 fits no single 80 GiB GPU even with
    /// every block recomputed (at 65536 it does, recomputing), and on 2 GPUs it takes context
    /// parallelism 2 (where it fits, with the fewest blocks recomputed); at 8192 tokens one
    /// GPU suffices and no split is proposed.
    #[test]
    fn the_recipe_splits_a_sequence_only_when_nothing_else_fits() {
        let gpu = 80.0 * GB;
        assert!(cheapest_recipe(&llama3_8b(131072, 1), gpu).is_none());
        let (r, b) = cheapest_recipe(&llama3_8b(131072, 2), gpu).expect("context parallelism 2 fits");
        assert_eq!(r.context_parallel, 2);
        assert!(b.peak <= gpu);
        if r.recompute_layers > 0 {
            let fewer = Shape { recompute_layers: r.recompute_layers - 1, ..r.clone() };
            assert!(budget(&fewer).peak > gpu, "{} blocks recomputed would do", r.recompute_layers - 1);
        }
        let (short, _) = cheapest_recipe(&llama3_8b(8192, 2), gpu).unwrap();
        assert_eq!(short.context_parallel, 1);
    }

    /// Sharding costs what its gathers do not hide behind the block before (hand-counted: the
    /// 70B's FP8 block on 8 ranks at 8192 tokens gathers 7/8 B per value against 2·8192
    /// FLOPs, 0.147 of a forward at 2750 FLOP per link byte: hidden, leaving one layout's
    /// transposes; at 256 tokens in bf16 each gather is 9.4 forwards, 8.4 exposed, twice per
    /// block). So at context parallelism 2 on 8 x H100 80 GiB the recipe shards the weights
    /// and recomputes nothing (about 62.5 GiB) instead of recomputing ~79 blocks of
    /// replicated one-layout weights, and sharding is still taken where nothing else fits
    /// however much it costs.
    #[test]
    fn sharding_is_chosen_where_it_saves_recomputation() {
        let s = mlperf(8, 0, false);
        assert_eq!(shard_cost(&s), one_layout_cost(&s));
        assert!((one_layout_cost(&s) - 80.0 * 250.0 / 8192.0).abs() < 1e-12);
        let short = Shape {
            seq_len: 256,
            precision: PrecisionSpec { compute: Compute::Bf16, ..Default::default() },
            ..s.clone()
        };
        let ratio = 2.0 * 7.0 / 8.0 * 2750.0 / (2.0 * 256.0);
        assert!((shard_cost(&short) - 2.0 * 80.0 * (ratio - 1.0)).abs() < 1e-9, "{}", shard_cost(&short));
        let dev = 80.0 * GB;
        let cp2 = Shape { context_parallel: 2, ..s.clone() };
        // Replicated, only one layout fits, and only with nearly every block recomputed.
        let one = PrecisionSpec { fp8_weights_one_layout: true, ..cp2.precision };
        let replicated = |n, precision| budget(&Shape { recompute_layers: n, precision, ..cp2.clone() }).peak;
        assert!(replicated(80, cp2.precision) > dev);
        let n = (0..=80).find(|&n| replicated(n, one) <= dev).expect("one layout fits, recomputing");
        assert!(n >= 70, "{n}");
        let (r, b) = cheapest_recipe(&cp2, dev).unwrap();
        assert_eq!((r.context_parallel, r.recompute_layers, r.shard_frozen_weights), (2, 0, true));
        assert!(b.peak <= dev && b.peak > 55.0 * GB, "{} GiB", b.peak / GB);
        // Only sharding fits the 70B on 8 x 80 GiB at context parallelism 1, short or not.
        let (r, _) = cheapest_recipe(&short, dev).unwrap();
        assert!(r.shard_frozen_weights);
    }

    /// Per-token bytes worked out by hand from the ops (d 8192, q 8192, kv 1024, I 28672, H 64).
    #[test]
    fn kept_and_minimum_bytes_match_the_hand_count() {
        let s = mlperf(8, 0, false);
        // x 2·8192 + h 2·8192 (the fused norms keep their bf16 input) + two f32 1/rms + q,k,v,out in bf16
        // 2·(2·8192 + 2·1024) + lse 4·64 + gate/up 2·28672·1 + (dropped-out input 8192 + FP8
        // bottleneck 16) for qkv and for o (the dropout masks are redrawn, not kept).
        let kept = 16384.0 + 16384.0 + 8.0 + 36864.0 + 256.0 + 57344.0 + 2.0 * (8192.0 + 16.0);
        assert_eq!(per_token(&kept_per_token(&s)), kept);
        // x and h in bf16 with f32 1/rms, attention tensors + lse, gate/up, the adapters' input
        // once, two bottlenecks.
        let min = 2.0 * (16384.0 + 4.0) + (36864.0 + 256.0) + 57344.0 + 8192.0 + 32.0;
        assert_eq!(per_token(&minimum_per_token(&s)), min);
    }

    /// More recomputed blocks and sharding each lower the peak; the recipe search returns the
    /// first that fits, which is no cheaper than needed.
    #[test]
    fn recipes_are_monotone_and_the_cheapest_is_the_first_that_fits() {
        let peak = |n, shard| budget(&mlperf(8, n, shard)).peak;
        assert!(peak(0, false) > peak(40, false) && peak(40, false) > peak(80, false));
        assert!(peak(80, false) > peak(80, true));
        let dev = 80.0 * GB;
        let (r, b) = cheapest_recipe(&mlperf(8, 0, false), dev).expect("sharded + recompute fits 80 GiB");
        assert!(r.shard_frozen_weights && b.peak <= dev);
        assert!(peak(r.recompute_layers - 1, true) > dev, "one block fewer would fit too");
        // 288 GiB holds the replicated FP8 replica with every activation.
        let (r, _) = cheapest_recipe(&mlperf(8, 0, false), 288.0 * GB).unwrap();
        assert_eq!((r.recompute_layers, r.shard_frozen_weights), (0, false));
    }

    /// One 141 GB GPU: the 70B's FP8 weights in both layouts (130560 MB:
    /// 2 B per value) leave no room, every block recomputed or not; in one layout they take
    /// exactly half, and the search finds that recipe with the fewest recomputed blocks.
    #[test]
    fn one_gpu_fits_the_70b_with_fp8_weights_in_one_layout() {
        let line = |s: &Shape| budget(s).lines.iter().find(|x| x.name == "frozen linear weights").unwrap().bytes;
        let both = mlperf(1, 0, false);
        let one = Shape { precision: PrecisionSpec { fp8_weights_one_layout: true, ..both.precision }, ..both.clone() };
        // 80 blocks of (8192·(8192 + 2·1024) + 8192² + 3·8192·28672) values, 1 B each per layout.
        let values = 80.0 * (8192.0 * 10240.0 + 8192.0 * 8192.0 + 3.0 * 8192.0 * 28672.0);
        assert!((line(&both) - 2.0 * values).abs() / values < 1e-3, "{} vs {}", line(&both), 2.0 * values);
        assert_eq!(line(&one), line(&both) / 2.0);
        let dev = 141.0 * GB;
        assert!(budget(&Shape { recompute_layers: 80, ..both.clone() }).peak > dev, "both layouts cannot fit");
        let (r, b) = cheapest_recipe(&both, dev).expect("one layout fits 141 GiB");
        assert!(r.precision.fp8_weights_one_layout && b.peak <= dev);
        let fewer = Shape { recompute_layers: r.recompute_layers - 1, ..r.clone() };
        assert!(budget(&fewer).peak > dev, "one block fewer would fit too");
        assert!(report(&both, Some(dev)).contains("precision.fp8_weights_one_layout = true"));
        // Its time, in recomputed blocks: 80 layers · 250 FLOP/B / 8192 tokens.
        assert_eq!(one_layout_cost(&both), 80.0 * 250.0 / 8192.0);
        // 8 x 180 GiB: both layouts fit only with many blocks recomputed, one layout with none,
        // which costs less; at 288 GiB both layouts fit with none, and stay.
        let dev = 180.0 * GB;
        let both_n = (0..=80).find(|&n| budget(&mlperf(8, n, false)).peak <= dev).unwrap();
        assert!(both_n as f64 > one_layout_cost(&both), "{both_n}");
        let (r, _) = cheapest_recipe(&mlperf(8, 0, false), dev).unwrap();
        assert_eq!((r.recompute_layers, r.shard_frozen_weights, r.precision.fp8_weights_one_layout), (0, false, true));
        let (r, _) = cheapest_recipe(&mlperf(8, 0, false), 288.0 * GB).unwrap();
        assert!(!r.precision.fp8_weights_one_layout);
    }

    #[test]
    fn device_sizes_parse_with_units() {
        use crate::cli::parse_bytes;
        assert_eq!(parse_bytes("80GiB").unwrap(), 80.0 * GB);
        assert_eq!(parse_bytes("141GB").unwrap(), 141e9);
        assert_eq!(parse_bytes("512 MiB").unwrap(), 512.0 * MB);
        assert!(parse_bytes("80 gigs").unwrap_err().contains("unknown unit"));
        assert!(parse_bytes("-1GiB").is_err());
    }
}
