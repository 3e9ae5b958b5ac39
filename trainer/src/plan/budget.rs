//! The memory terms of a run: what each part of a rank holds at the peak.

use super::*;

/// Bytes per element of a linear weight as stored: f32 when it trains (full fine-tuning),
/// else as the precision stores frozen weights.
pub(super) fn weight_elem(s: &Shape) -> f64 {
    let p = &s.precision;
    if s.full_fine_tuning {
        return 4.0;
    }
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
pub(super) struct Widths {
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

pub(super) fn widths(s: &Shape) -> Widths {
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
    if !s.full_fine_tuning {
        return llora_model::DecoderLayer::saved_per_token(&s.model, &s.lora, &s.precision);
    }
    // No adapters; every linear keeps its input for its weight's gradient instead (o_proj's is
    // the attention output, kept by attention already).
    let none = llora_model::LoraSpec { targets: Vec::new(), ..s.lora.clone() };
    let mut kept = llora_model::DecoderLayer::saved_per_token(&s.model, &none, &s.precision);
    let (e, d, i) = (s.precision.activation_bytes(), s.model.hidden_size as f64, s.model.intermediate_size as f64);
    let why = "the weight's gradient (full fine-tuning)";
    kept.push(Saved::new("q/k/v input (the attention norm's output)", e * d, why));
    kept.push(Saved::new("gate/up input (the MLP norm's output)", e * d, why));
    kept.push(Saved::new("down_proj input (SwiGLU's output)", e * i, why));
    kept
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
pub(super) fn allocated(bytes: f64, target: Target) -> f64 {
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
pub(super) fn block_linears(c: &LlamaConfig) -> (Vec<f64>, f64) {
    let sizes: Vec<f64> =
        BlockLinear::of(c.fused_qkv).iter().map(|k| k.shape(c).iter().product::<usize>() as f64).collect();
    let largest = sizes.iter().cloned().fold(0.0, f64::max);
    (sizes, largest)
}

/// LoRA parameters of the model (with DoRA's magnitudes), each adapter at its own rank
/// (`rank_pattern`) and only in the layers that have adapters (`layers_to_transform`).
pub(super) fn lora_params(s: &Shape) -> f64 {
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
    lines.push(trained_state(s));
    lines.push(saved_activations(s));
    lines.push(final_norm_and_loss(s));
    lines.extend(context_exchange(s));
    lines.extend(sliding_window_scores(s));
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

/// What training adds per trained parameter. LoRA: the parameter, its gradient, the flat
/// gradient the step reduces, AdamW's two moments (and preference tuning's frozen reference
/// copy, from `lora.init_from`). Full fine-tuning (the weights are counted
/// as stored): the gradient and the two moments, the all-reduce's bucket on the host and the
/// device with more than one rank, and one temporary of the largest tensor for the
/// per-parameter update (`engine/optim.rs`; burn-tch updates a tensor it holds alone in place,
/// and the update runs after backward has freed the activations).
pub(super) fn trained_state(s: &Shape) -> Line {
    if !s.full_fine_tuning {
        let n_lora = lora_params(s);
        let copies = if s.frozen_reference { 6.0 } else { 5.0 };
        let note = format!("{n_lora} parameters x {copies} f32");
        return Line { name: "LoRA weights, gradients, AdamW", bytes: n_lora * 4.0 * copies, note };
    }
    let c = &s.model;
    let n = c.num_parameters() as f64;
    let copies = 3.0 + if s.world > 1 { 2.0 } else { 0.0 };
    let largest = block_linears(c).1.max((c.vocab_size * c.hidden_size) as f64);
    let bytes = allocated(n * 4.0, s.target) * copies + allocated(largest * 4.0, s.target);
    let note = format!("{n} parameters x {copies} f32 (gradient, AdamW moments) + the update of the largest");
    Line { name: "gradients and AdamW (full fine-tuning)", bytes, note }
}

/// Tokens of one micro-batch on this rank: under context parallelism its share of each
/// (padded) sequence.
pub(super) fn tokens(s: &Shape) -> f64 {
    let split = llora_model::context_parallel::ContextSplit::new(s.seq_len, 0, s.context_parallel.max(1));
    (s.micro_batch * split.local_len()) as f64
}

/// Context parallelism's transients in one block's attention backward (its peak): the group's
/// keys and values gathered in the activations' dtype and their f32 gradients over the whole
/// sequence (summed over the group in place: `dist/cp_group.rs`), and this rank's f32 query
/// gradient and merged output.
pub(super) fn context_exchange(s: &Shape) -> Option<Line> {
    let n = s.context_parallel;
    if n <= 1 {
        return None;
    }
    let c = &s.model;
    let split = llora_model::context_parallel::ContextSplit::new(s.seq_len, 0, n);
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

/// The masked path of sliding-window attention (`attention::masked_window_attention`, on the
/// layers whose window is shorter than the sequence, where no flash kernel's window runs: f32
/// on CUDA): autodiff keeps, per layer, three f32 `[batch, H, seq, seq]`
/// tensors (the shifted scores Burn's exp recomputes from in backward, the exp the quotient
/// keeps, the probabilities), the `seq x seq` mask and f32 copies of q and of K/V repeated to H
/// heads; one layer's backward has two more at once. Measured on the tiny Mistral, Qwen 2 and
/// Qwen 3 at 1024-4096 tokens when the CPU ran this path (docs/memory.md).
pub(super) fn sliding_window_scores(s: &Shape) -> Option<Line> {
    let c = &s.model;
    let w = c.family.sliding_window.filter(|&w| w < s.seq_len)?;
    // The CPU runs windows on its flash kernel by blocks (`attention/banded.rs`), CUDA in bf16
    // on flash attention's window: what causal attention keeps.
    if s.target == Target::Cpu || s.precision.activation_bytes() < 4.0 {
        return None;
    }
    let layers = (0..c.num_hidden_layers).filter(|&l| c.family.window_of(l).is_some()).count() as f64;
    let (b, h, seq) = (s.micro_batch as f64, c.num_attention_heads as f64, s.seq_len as f64);
    let alloc = |bytes: f64| allocated(bytes, s.target);
    let scores = alloc(b * h * seq * seq * 4.0);
    let copies = 3.0 * alloc(b * h * seq * c.head_dim as f64 * 4.0);
    Some(Line {
        name: "sliding-window attention (masked path)",
        bytes: layers * (3.0 * scores + copies + alloc(seq * seq)) + 2.0 * scores,
        note: format!("window {w} < {} tokens in {layers} layers: f32 seq x seq probabilities per layer", s.seq_len),
    })
}

/// Whether the frozen weights are sharded over more than one rank.
pub(super) fn sharded(s: &Shape) -> bool {
    s.shard_frozen_weights && s.world > 1
}

/// The frozen linear weights: every block's, replicated or a 1/world share of each plus the
/// blocks gathered at a time.
pub(super) fn frozen_weights(s: &Shape) -> Line {
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
    let w = weight_elem(s) * if transposed { 2.0 } else { 1.0 };
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
    let name = if s.full_fine_tuning { "linear weights (trained)" } else { "frozen linear weights" };
    Line { name, bytes, note }
}

/// NF4: each GEMM dequantises its weight whole: NF4 codes to f32 (precision/weights.rs), then
/// the compute dtype's copy for bf16.
pub(super) fn nf4_dequantised(s: &Shape) -> Option<Line> {
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
pub(super) fn tables_and_norms(s: &Shape) -> Line {
    let c = &s.model;
    let (d, v, l) = (c.hidden_size as f64, c.vocab_size as f64, c.num_hidden_layers);
    // Trained tables stay f32 (load.rs casts only frozen ones).
    let e = if s.full_fine_tuning { 4.0 } else { s.precision.activation_bytes() };
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
pub(super) fn saved_activations(s: &Shape) -> Line {
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
pub(super) fn target_rows(s: &Shape) -> f64 {
    (tokens(s) * s.target_fraction).ceil()
}

/// The final norm's input and its output, and the loss's dh rows.
pub(super) fn final_norm_and_loss(s: &Shape) -> Line {
    let (t, e, d) = (tokens(s), s.precision.activation_bytes(), s.model.hidden_size as f64);
    let rows = target_rows(s);
    let bytes = 2.0 * allocated(e * d * t, s.target) + allocated(e * d * rows, s.target);
    Line { name: "final norm and loss", bytes, note: format!("{rows} target rows kept for backward") }
}

/// Whether bf16 GEMMs are routed through f32 (a CPU without native bf16).
pub(super) fn upcast_gemms(s: &Shape) -> bool {
    s.precision.activation_bytes() < 4.0 && !s.native_bf16_gemm
}

/// The loss's transients: one chunk of f32 logits (and the chunk's bf16 GEMM output it is
/// upcast from), and the LM head's f32 column block when bf16 GEMMs go through f32; under full
/// fine-tuning, every target row's logits.
pub(super) fn loss_transients(s: &Shape) -> (f64, f64) {
    let (e, d, v) = (s.precision.activation_bytes(), s.model.hidden_size as f64, s.model.vocab_size as f64);
    let alloc = |bytes: f64| allocated(bytes, s.target);
    if s.full_fine_tuning {
        // A trained head takes the unfused loss (loss.rs): the target rows' logits whole, in
        // f32, kept for the cross-entropy's backward, which makes `logits − lse` and its exp
        // beside them (three at once; forward has two and the GEMM's output when not f32).
        let logits = alloc(target_rows(s) * v * 4.0);
        return (3.0 * logits, 0.0);
    }
    let chunk = LCE_CHUNK_BYTES.min(target_rows(s) * v * 4.0);
    let chunk = alloc(chunk) + if e < 4.0 { alloc(chunk * e / 4.0) } else { 0.0 };
    let head_block = (v * d).min(llora_model::LCE_HEAD_BLOCK_ELEMENTS as f64);
    let table = if upcast_gemms(s) { alloc(head_block * 4.0) } else { 0.0 };
    (chunk, table)
}

/// The largest transient: the loss's, or backward's largest op. That is SwiGLU's, with four
/// `[tokens, I]` activation-dtype tensors live (plus, when gate and up are stored in FP8, their
/// dequantised copies and one f32 transient), or the MLP GEMM with its operands' copies; plus
/// the residual-stream gradient. The loss's transients are gone when backward starts.
pub(super) fn workspace(s: &Shape) -> Line {
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
pub(super) fn gemm_workspace(s: &Shape) -> f64 {
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
pub(super) fn cpu_gemm_workspace(s: &Shape) -> Option<Line> {
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
