//! The Llama causal LM, block by block in the order data flows through it.
//!
//! embedding → L × [x += Attn(RMSNorm(x)); x += MLP(RMSNorm(x))] → RMSNorm → LM head.
//! Every linear layer is a [`LoraLinear`]: frozen base weight plus an optional adapter.

use burn::module::{Module, Param};
use burn::tensor::activation::silu;
use burn::tensor::{DType, Device, Int, Tensor};

use std::sync::Arc;

use crate::attention::{VarlenSpans, packed_causal_attention, windowed_causal_attention};
use crate::config::LlamaConfig;
use crate::layout::BlockLinear;
use crate::lora::{LoraLinear, LoraSpec};
pub use crate::norm::RmsNorm;
use crate::packing::PackedRows;
pub use crate::rope::{apply_rope, rope_tables, rope_tables_at};
use crate::saved::Saved;

use crate::dropout::BlockSeeds;
use crate::fp8::{SharedCodes, WriteCodes};
use crate::precision::{Compute, FrozenWeight, LinearScales, PrecisionSpec, Storage, swiglu, tch_device};
use crate::shard::{Sharding, WeightShard};

/// Where a forward's tokens are: RoPE's tables at their positions and, for packed rows, where
/// each row's documents lie (see [`crate::packing`]).
#[derive(Debug, Clone)]
pub struct Positions {
    /// cos of each position, `[1, 1, seq, head_dim]` (every row at 0..seq), or
    /// `[batch, 1, seq, head_dim]` for packed rows (each document from 0).
    pub cos: Tensor<4>,
    /// sin, shaped as `cos`.
    pub sin: Tensor<4>,
    /// The documents of packed rows; `None`: one sequence per row.
    pub packed: Option<Arc<PackedRows>>,
    /// Their spans on the device for the variable-length attention kernel (packed rows of a
    /// bf16/f16 model on CUDA: uploaded once per batch, not per layer).
    pub varlen: Option<Arc<VarlenSpans>>,
    /// Under context parallelism: this rank's share of the sequence (cos and sin are then at
    /// its tokens' global positions) and the attention over the group.
    pub context: Option<Arc<crate::attention::gathered_kv::ContextAttention>>,
}

impl Positions {
    /// The same positions on the inner (non-autodiff) backend.
    pub fn inner(&self) -> Self {
        let (packed, varlen, context) = (self.packed.clone(), self.varlen.clone(), self.context.clone());
        Self { cos: self.cos.clone().inner(), sin: self.sin.clone().inner(), packed, varlen, context }
    }

    /// This rank's tokens of `ids` under context parallelism (padded to the split's length
    /// first); all of them otherwise.
    ///
    /// # Shapes
    /// - ids: `[batch, seq]`; output: `[batch, local]`
    pub fn local_ids(&self, ids: Tensor<2, Int>) -> Tensor<2, Int> {
        let Some(cp) = &self.context else { return ids };
        let [b, s] = ids.dims();
        let device = ids.device();
        let padded = if cp.split.padded > s {
            Tensor::cat(vec![ids, Tensor::<2, Int>::zeros([b, cp.split.padded - s], &device)], 1)
        } else {
            ids
        };
        let local: Vec<i64> = cp.split.local_positions().into_iter().map(|p| p as i64).collect();
        let n = local.len();
        padded.select(1, Tensor::<1, Int>::from_data(burn::tensor::TensorData::new(local, [n]), &device))
    }
}

/// The token embeddings of `ids` in the activations' dtype `dtype` (a bf16 embedding table is
/// read as stored; an f32 one is cast after the lookup).
///
/// # Shapes
/// - weights: `[V, d]`
/// - ids: `[batch, seq]`
/// - output: `[batch, seq, d]`
pub fn embed(weights: Tensor<2>, ids: Tensor<2, Int>, dtype: DType) -> Tensor<3> {
    burn::tensor::module::embedding(weights, ids).cast(dtype)
}

/// One block's cached keys and values while decoding, `[batch, KV, cached, head_dim]` each
/// (None before the prefill).
pub type LayerKv = Option<(Tensor<4>, Tensor<4>)>;

/// An attention block's projections and head norms, borrowed mutably ([`Attention::parts_mut`]).
pub type HeadParts<'a> = (Vec<(BlockLinear, &'a mut LoraLinear)>, Vec<(&'static str, &'a mut RmsNorm)>);

/// Grouped-query self-attention with RoPE and a causal mask.
#[derive(Module, Debug)]
pub struct Attention {
    /// Query projection `[H·hd, d]` (separate-projection checkpoints).
    pub q_proj: Option<LoraLinear>,
    /// Key projection `[KV·hd, d]`.
    pub k_proj: Option<LoraLinear>,
    /// Value projection `[KV·hd, d]`.
    pub v_proj: Option<LoraLinear>,
    /// Fused projection `[(H + 2·KV)·hd, d]`, rows q then k then v (MLPerf's checkpoint).
    pub qkv_proj: Option<LoraLinear>,
    /// Output projection `[d, H·hd]`.
    pub o_proj: LoraLinear,
    /// RMSNorm of each query head over hd, before RoPE (Qwen 3).
    pub q_norm: Option<RmsNorm>,
    /// RMSNorm of each key head over hd, before RoPE (Qwen 3).
    pub k_norm: Option<RmsNorm>,
    /// Sliding window W: a token attends to itself and the W - 1 positions before it.
    #[module(skip)]
    pub window: Option<usize>,
    /// Query heads H.
    #[module(skip)]
    pub n_heads: usize,
    /// Key/value heads KV.
    #[module(skip)]
    pub n_kv_heads: usize,
    /// Head width hd.
    #[module(skip)]
    pub head_dim: usize,
}

impl Attention {
    /// What the norm before attention is asked to write for the projection(s) reading its
    /// output (the fused qkv, or q: k and v share its scale), handed over in `to`
    /// ([`LoraLinear::codes_to_write`]).
    pub fn codes_to_write(&self, train: bool, to: &SharedCodes) -> Option<WriteCodes> {
        self.qkv_proj.as_ref().or(self.q_proj.as_ref())?.codes_to_write(train, to)
    }

    /// What attention keeps for backward per token: q and k after RoPE, v (K/V at their own
    /// head count), its output, and the f32 log-sum-exp per query head (the fused kernels).
    pub fn saved_per_token(c: &LlamaConfig, spec: &PrecisionSpec) -> Vec<Saved> {
        let (e, qd, kvd) = (
            spec.activation_bytes(),
            (c.num_attention_heads * c.head_dim) as f64,
            (c.num_key_value_heads * c.head_dim) as f64,
        );
        let why = "fused attention backward (K/V at their own head count)";
        let mut saved = vec![
            Saved::new("q after RoPE", e * qd, why),
            Saved::new("k after RoPE", e * kvd, why),
            Saved::new("v", e * kvd, why),
            Saved::new("attention output", e * qd, why),
            Saved::new("attention log-sum-exp", 4.0 * c.num_attention_heads as f64, "fused attention backward"),
        ];
        if c.family.qk_norm {
            let why = "q/k head norms' backward (their input and 1/rms per head)";
            let heads = (c.num_attention_heads + c.num_key_value_heads) as f64;
            saved.push(Saved::new("q and k before their head norms", e * (qd + kvd), why));
            saved.push(Saved::new("q and k head norms: 1/rms", 4.0 * heads, why));
        }
        saved
    }

    /// Loads the attention of decoder layer `layer`: q, k and v (or the fused qkv, as the
    /// checkpoint's layout has it), then o.
    fn load(c: &LlamaConfig, layer: usize, weights: &mut dyn BlockWeights) -> anyhow::Result<Self> {
        let mut proj = |kind: BlockLinear| -> anyhow::Result<Option<LoraLinear>> {
            BlockLinear::of(c.fused_qkv).contains(&kind).then(|| weights.linear(layer, kind)).transpose()
        };
        let (q_proj, k_proj, v_proj, qkv_proj) =
            (proj(BlockLinear::Q)?, proj(BlockLinear::K)?, proj(BlockLinear::V)?, proj(BlockLinear::Qkv)?);
        let o_proj = weights.linear(layer, BlockLinear::O)?;
        let mut head_norm = |name: &str| -> anyhow::Result<Option<RmsNorm>> {
            let path = format!("model.layers.{layer}.self_attn.{name}.weight");
            c.family.qk_norm.then(|| weights.norm(&path, c.head_dim)).transpose()
        };
        Ok(Self {
            q_proj,
            k_proj,
            v_proj,
            qkv_proj,
            o_proj,
            q_norm: head_norm("q_norm")?,
            k_norm: head_norm("k_norm")?,
            window: c.family.window_of(layer),
            n_heads: c.num_attention_heads,
            n_kv_heads: c.num_key_value_heads,
            head_dim: c.head_dim,
        })
    }

    /// The projections with their kinds, in forward order ([`DecoderLayer::linears_mut`]).
    pub fn linears_mut(&mut self) -> Vec<(BlockLinear, &mut LoraLinear)> {
        self.parts_mut().0
    }

    /// The projections (as [`Self::linears_mut`]) and the q/k head norms with their names
    /// (`q_norm`, `k_norm`), mutably at once.
    pub fn parts_mut(&mut self) -> HeadParts<'_> {
        let Self { q_proj, k_proj, v_proj, qkv_proj, o_proj, q_norm, k_norm, .. } = self;
        let all = [
            (BlockLinear::Q, q_proj.as_mut()),
            (BlockLinear::K, k_proj.as_mut()),
            (BlockLinear::V, v_proj.as_mut()),
            (BlockLinear::Qkv, qkv_proj.as_mut()),
            (BlockLinear::O, Some(o_proj)),
        ];
        let linears = all.into_iter().filter_map(|(k, l)| Some((k, l?))).collect();
        let norms = [("q_norm", q_norm.as_mut()), ("k_norm", k_norm.as_mut())];
        (linears, norms.into_iter().filter_map(|(n, m)| Some((n, m?))).collect())
    }

    /// Causal self-attention; on packed rows, within each document. The projections take
    /// x's FP8 codes from `x_codes` (quantised once for q, k and v, or written by the norm).
    ///
    /// # Shapes
    /// - x: `[batch, seq, d]`
    /// - output: `[batch, seq, d]`
    pub fn forward(&self, x: Tensor<3>, x_codes: Option<&SharedCodes>, at: &Positions, train: bool) -> Tensor<3> {
        let [b, s, _] = x.dims();
        let (q, k, v) = self.qkv(x, x_codes, at.cos.clone(), at.sin.clone(), train);
        let out = match (&at.context, &at.packed) {
            // A window shorter than the sequence is refused under context parallelism before
            // the run (`llora plan`, `llora train`).
            (Some(cp), _) => crate::attention::context_attention(q, k, v, cp.clone()),
            (None, None) => windowed_causal_attention(q, k, v, self.window),
            (None, Some(packed)) => packed_causal_attention(q, k, v, packed, at.varlen.as_ref(), self.window),
        };
        self.o_proj.forward(out.swap_dims(1, 2).reshape([b, s, self.n_heads * self.head_dim]), train)
    }

    /// Decoding: the new positions `x` attend to the cached keys and values and to themselves;
    /// their keys and values join `cache`. The first call (empty cache) is the causal prefill
    /// of the prompt; later calls take one position each.
    ///
    /// # Shapes
    /// - x: `[batch, new, d]`; cos, sin: `[1, 1, new, head_dim]` at the new positions
    /// - cache: `[batch, KV, cached, head_dim]` keys and values, grown by `new`
    /// - output: `[batch, new, d]`
    pub fn forward_cached(&self, x: Tensor<3>, cos: Tensor<4>, sin: Tensor<4>, cache: &mut LayerKv) -> Tensor<3> {
        let [b, s, _] = x.dims();
        let (q, k, v) = self.qkv(x, None, cos, sin, false);
        let prefill = cache.is_none();
        let (k, v) = match cache.take() {
            Some((ck, cv)) => (Tensor::cat(vec![ck, k], 2), Tensor::cat(vec![cv, v], 2)),
            None => (k, v),
        };
        *cache = Some((k.clone(), v.clone()));
        // One new position sees every cached one: no mask. The fused kernel reads K/V at KV
        // heads (grouped), as in training.
        debug_assert!(prefill || s == 1, "decode one position at a time");
        let out = match self.window {
            Some(w) if prefill => windowed_causal_attention(q, k, v, Some(w)),
            // The new position sees the last W keys, itself included.
            Some(w) if k.dims()[2] > w => {
                let n = k.dims()[2];
                crate::attention::attention(q, k.narrow(2, n - w, w), v.narrow(2, n - w, w), false)
            }
            _ => crate::attention::attention(q, k, v, prefill),
        };
        self.o_proj.forward(out.swap_dims(1, 2).reshape([b, s, self.n_heads * self.head_dim]), false)
    }

    /// Queries, keys and values in heads, RoPE applied to q and k; x's FP8 codes taken from
    /// `x_codes`.
    ///
    /// # Shapes
    /// - x: `[batch, seq, d]`; cos, sin: `[1 or batch, 1, seq, head_dim]`
    /// - output: q `[batch, H, seq, hd]`, k and v `[batch, KV, seq, hd]`
    fn qkv(
        &self,
        x: Tensor<3>,
        x_codes: Option<&SharedCodes>,
        cos: Tensor<4>,
        sin: Tensor<4>,
        train: bool,
    ) -> (Tensor<4>, Tensor<4>, Tensor<4>) {
        let [b, s, _] = x.dims();
        let (h, kv, hd) = (self.n_heads, self.n_kv_heads, self.head_dim);
        let (q, k, v) = match (&self.qkv_proj, &self.q_proj, &self.k_proj, &self.v_proj) {
            (Some(qkv), ..) => {
                let fused = qkv.forward_reading(x, x_codes, train);
                (
                    fused.clone().narrow(2, 0, h * hd),
                    fused.clone().narrow(2, h * hd, kv * hd),
                    fused.narrow(2, (h + kv) * hd, kv * hd),
                )
            }
            // One input, quantised once for the three FP8 GEMMs (by the first, or the norm).
            (None, Some(q), Some(k), Some(v)) => (
                q.forward_reading(x.clone(), x_codes, train),
                k.forward_reading(x.clone(), x_codes, train),
                v.forward_reading(x, x_codes, train),
            ),
            _ => unreachable!("the loader builds either qkv_proj or all of q/k/v_proj"),
        };
        let heads = |t: Tensor<3>, n: usize, norm: &Option<RmsNorm>| {
            let t = match norm {
                // Each head normalised over its hd channels (Qwen 3's q_norm / k_norm).
                Some(norm) => norm.forward(t.reshape([b, s * n, hd])),
                None => t,
            };
            t.reshape([b, s, n, hd]).swap_dims(1, 2)
        };
        let q = apply_rope(heads(q, h, &self.q_norm), cos.clone(), sin.clone());
        let k = apply_rope(heads(k, kv, &self.k_norm), cos, sin);
        let v = heads(v, kv, &None);
        (q, k, v)
    }
}

/// SwiGLU feed-forward: `down(silu(gate(x)) · up(x))`.
#[derive(Module, Debug)]
pub struct Mlp {
    /// `[I, d]`.
    pub gate_proj: LoraLinear,
    /// `[I, d]`.
    pub up_proj: LoraLinear,
    /// `[d, I]`.
    pub down_proj: LoraLinear,
    /// How gate and up are kept for backward.
    #[module(skip)]
    pub storage: Storage,
}

impl Mlp {
    /// What the MLP keeps for backward per token: the fused SwiGLU's gate and up, in the
    /// saved activations' storage (its linears' adapters are listed by
    /// [`DecoderLayer::saved_per_token`]).
    pub fn saved_per_token(c: &LlamaConfig, spec: &PrecisionSpec) -> Vec<Saved> {
        let bytes = c.intermediate_size as f64 * spec.saved_activation_bytes();
        vec![Saved::new("SwiGLU gate", bytes, "SwiGLU backward"), Saved::new("SwiGLU up", bytes, "SwiGLU backward")]
    }

    /// Loads the MLP of decoder layer `layer`: gate, up, down.
    fn load(layer: usize, weights: &mut dyn BlockWeights) -> anyhow::Result<Self> {
        Ok(Self {
            gate_proj: weights.linear(layer, BlockLinear::Gate)?,
            up_proj: weights.linear(layer, BlockLinear::Up)?,
            down_proj: weights.linear(layer, BlockLinear::Down)?,
            storage: Storage::F32,
        })
    }

    /// The projections with their kinds, in forward order ([`DecoderLayer::linears_mut`]).
    pub fn linears_mut(&mut self) -> Vec<(BlockLinear, &mut LoraLinear)> {
        let Self { gate_proj, up_proj, down_proj, .. } = self;
        vec![(BlockLinear::Gate, gate_proj), (BlockLinear::Up, up_proj), (BlockLinear::Down, down_proj)]
    }

    /// Gate and up take x's FP8 codes from `x_codes` (quantised once for both, or written by
    /// the norm).
    ///
    /// # Shapes
    /// - x: `[batch, seq, d]`
    /// - output: `[batch, seq, d]`
    pub fn forward(&self, x: Tensor<3>, x_codes: Option<&SharedCodes>, train: bool) -> Tensor<3> {
        let gate = self.gate_proj.forward_reading(x.clone(), x_codes, train);
        let up = self.up_proj.forward_reading(x, x_codes, train);
        // The fused op keeps only gate and up for backward (Burn's composite keeps four
        // tensors of this size); it is a LibTorch extension. Where our FP8 kernel runs it also
        // writes h's codes at down_proj's input scale, which down_proj's GEMM then takes.
        let h_codes = SharedCodes::new();
        let hidden = if tch_device(&gate.device()).is_some() {
            swiglu(gate, up, self.storage, self.down_proj.codes_to_write(train, &h_codes))
        } else {
            silu(gate) * up
        };
        self.down_proj.forward_reading(hidden, Some(&h_codes), train)
    }
}

/// One pre-norm decoder block.
#[derive(Module, Debug)]
pub struct DecoderLayer {
    /// Norm before attention.
    pub input_layernorm: RmsNorm,
    /// Self-attention.
    pub self_attn: Attention,
    /// Norm before the MLP.
    pub post_attention_layernorm: RmsNorm,
    /// Feed-forward.
    pub mlp: Mlp,
}

impl DecoderLayer {
    /// What a middle decoder block keeps for backward per token (block 0's input needs no
    /// gradient), one entry per tensor, each declared by the module that keeps it: the two
    /// norms, attention, the MLP, then each adapter in forward order.
    pub fn saved_per_token(c: &LlamaConfig, lora: &LoraSpec, spec: &PrecisionSpec) -> Vec<Saved> {
        let d = c.hidden_size;
        let mut out = Vec::from(RmsNorm::saved_per_token("block input", d, spec));
        out.extend(RmsNorm::saved_per_token("residual after attention", d, spec));
        out.extend(Attention::saved_per_token(c, spec));
        out.extend(Mlp::saved_per_token(c, spec));
        let mut shared = Vec::new();
        for kind in lora.adapted_kinds(c.fused_qkv) {
            out.extend(crate::lora::LoraAdapter::saved_per_token(kind, c, lora, spec, &mut shared));
        }
        out
    }

    /// # Shapes
    /// - x: `[batch, seq, d]`
    /// - output: `[batch, seq, d]`
    pub fn forward(&self, x: Tensor<3>, at: &Positions, train: bool) -> Tensor<3> {
        // Under context parallelism the adapters' dropout masks are this rank's rows of the
        // whole sequence's (those one process draws), not masks of the local rows.
        let split = at.context.as_ref().map(|cp| cp.split);
        crate::dropout::over_split(split, || {
            // Each norm writes, beside its output, the FP8 codes its projections would make
            // (where our kernel runs and the projections' input scale exists) and hands them
            // over; where it does not, the first projection makes them for the others.
            let attn = {
                let codes = SharedCodes::new();
                let normed = self.input_layernorm.forward_fp8(x.clone(), self.self_attn.codes_to_write(train, &codes));
                self.self_attn.forward(normed, Some(&codes), at, train)
            };
            let h = x + attn;
            let mlp = {
                let codes = SharedCodes::new();
                let write = self.mlp.gate_proj.codes_to_write(train, &codes);
                self.mlp.forward(self.post_attention_layernorm.forward_fp8(h.clone(), write), Some(&codes), train)
            };
            h + mlp
        })
    }

    /// [`Self::forward`] while decoding, with this block's key/value cache
    /// ([`Attention::forward_cached`]).
    ///
    /// # Shapes
    /// As [`Attention::forward_cached`].
    pub fn forward_cached(&self, x: Tensor<3>, cos: Tensor<4>, sin: Tensor<4>, cache: &mut LayerKv) -> Tensor<3> {
        let h = x.clone() + self.self_attn.forward_cached(self.input_layernorm.forward(x), cos, sin, cache);
        h.clone() + self.mlp.forward(self.post_attention_layernorm.forward(h), None, false)
    }

    /// Builds decoder layer `layer` of a model of `c` from `weights`, each part loading itself
    /// in forward order (a hang's last debug line names the tensor being read).
    pub(crate) fn load(c: &LlamaConfig, layer: usize, weights: &mut dyn BlockWeights) -> anyhow::Result<Self> {
        let p = format!("model.layers.{layer}");
        Ok(Self {
            input_layernorm: weights.norm(&format!("{p}.input_layernorm.weight"), c.hidden_size)?,
            self_attn: Attention::load(c, layer, weights)?,
            post_attention_layernorm: weights.norm(&format!("{p}.post_attention_layernorm.weight"), c.hidden_size)?,
            mlp: Mlp::load(layer, weights)?,
        })
    }

    /// The block's linear `kind`, if this layout has it ([`BlockLinear::of`]).
    pub fn linear(&self, kind: BlockLinear) -> Option<&LoraLinear> {
        let (a, m) = (&self.self_attn, &self.mlp);
        match kind {
            BlockLinear::Q => a.q_proj.as_ref(),
            BlockLinear::K => a.k_proj.as_ref(),
            BlockLinear::V => a.v_proj.as_ref(),
            BlockLinear::Qkv => a.qkv_proj.as_ref(),
            BlockLinear::O => Some(&a.o_proj),
            BlockLinear::Gate => Some(&m.gate_proj),
            BlockLinear::Up => Some(&m.up_proj),
            BlockLinear::Down => Some(&m.down_proj),
        }
    }

    /// The block's linear layers with their kinds, in forward order.
    pub fn linears(&self) -> Vec<(BlockLinear, &LoraLinear)> {
        BlockLinear::ALL.into_iter().filter_map(|k| Some((k, self.linear(k)?))).collect()
    }

    /// Mutable variant of [`Self::linears`], same order.
    pub fn linears_mut(&mut self) -> Vec<(BlockLinear, &mut LoraLinear)> {
        let mut out = self.self_attn.linears_mut();
        out.extend(self.mlp.linears_mut());
        out
    }

    /// The block's sharded frozen weights.
    fn shards(&self) -> Vec<&WeightShard> {
        self.linears()
            .into_iter()
            .filter_map(|(_, l)| match l.weight.stored()? {
                FrozenWeight::Sharded(s) => Some(&**s),
                FrozenWeight::Whole(_) => None,
            })
            .collect()
    }

    /// All-gathers the block's sharded weights (nothing to do when unsharded).
    pub(crate) fn gather(&self, k: usize) -> anyhow::Result<()> {
        for shard in self.shards() {
            shard.gather().map_err(|e| e.context(format!("gathering the weights of decoder block {k}")))?;
        }
        Ok(())
    }

    /// Starts gathering the block's sharded weights without waiting (the next block's, while
    /// this one computes); [`Self::gather`] then waits for them.
    fn prefetch(&self, k: usize) -> anyhow::Result<()> {
        for shard in self.shards() {
            shard.prefetch().map_err(|e| e.context(format!("gathering the weights of decoder block {k}")))?;
        }
        Ok(())
    }

    /// Frees the block's gathered weights. On the CPU the freed buffers stay with the
    /// allocator, which hands them to the next block's gather of the same size (jemalloc,
    /// purging off: device.rs); returning them to the kernel after every block, as glibc's
    /// malloc needed, cost far more step time than the RSS it saved (docs/performance.md, M8).
    pub(crate) fn release(&self) {
        self.shards().into_iter().for_each(WeightShard::release);
    }
}

/// Where a decoder block's parts come from while the model is built
/// ([`crate::load`] implements it over a checkpoint or an initialiser).
pub(crate) trait BlockWeights {
    /// The linear `kind` of decoder layer `layer`, its base weight read and stored, with an
    /// adapter when the run targets it.
    fn linear(&mut self, layer: usize, kind: BlockLinear) -> anyhow::Result<LoraLinear>;
    /// The RMSNorm over `width` channels whose gain is the tensor `name`.
    fn norm(&mut self, name: &str, width: usize) -> anyhow::Result<RmsNorm>;
}

/// How [`LlamaForCausalLM::build`] makes a model.
#[derive(Debug, Clone, Default)]
pub struct BuildOptions<'a> {
    /// Fresh adapters on the modules this targets.
    pub lora: Option<&'a LoraSpec>,
    /// Unfreezes the base (full fine-tuning).
    pub trainable: bool,
    /// Switches the model to this precision while loading (None: Burn's f32 layers).
    pub precision: Option<PrecisionSpec>,
    /// Shards the frozen linear weights over these ranks (needs `precision`).
    pub sharding: Option<Sharding>,
}

/// How the step's FP8 amaxes are max-reduced over the data-parallel ranks, in place
/// ([`LlamaForCausalLM::reduce_and_update_fp8`]).
pub type AmaxReduce<'a> = dyn Fn(&mut [f32]) -> anyhow::Result<()> + 'a;

/// Llama causal language model with (optional) LoRA adapters.
#[derive(Module, Debug)]
pub struct LlamaForCausalLM {
    /// Token embedding `[V, d]`.
    pub embed_tokens: Param<Tensor<2>>,
    /// Decoder blocks.
    pub layers: Vec<DecoderLayer>,
    /// Final norm.
    pub norm: RmsNorm,
    /// LM head `[V, d]`; `None` when it is tied to the embedding (read it with [`Self::head`]).
    pub lm_head: Option<Param<Tensor<2>>>,
    /// Architecture.
    #[module(skip)]
    pub config: LlamaConfig,
    /// The dtype of the hidden states between the blocks (f32, or bf16 for bf16/FP8 compute;
    /// [`PrecisionSpec::activation_dtype`]).
    #[module(skip)]
    pub activations: DType,
    /// The RoPE tables of the longest sequence seen (see [`crate::rope::RopeCache`]).
    #[module(skip)]
    pub rope_cache: crate::rope::RopeCache,
    /// The context-parallel group this rank shares each sequence with; `None`: every rank
    /// runs whole sequences.
    #[module(skip)]
    pub context: Option<crate::context_parallel::ContextParallel>,
}

impl LlamaForCausalLM {
    /// Final hidden states (after the last norm).
    ///
    /// # Shapes
    /// - input_ids: `[batch, seq]`
    /// - output: `[batch, seq, d]`
    ///
    /// A sharded model gathers each block's weights for its forward and frees them after, so
    /// its output cannot be backpropagated: train it with [`Self::recomputed_backward`].
    pub fn hidden(&self, input_ids: Tensor<2, Int>, train: bool) -> anyhow::Result<Tensor<3>> {
        self.hidden_packed(input_ids, None, train)
    }

    /// [`Self::hidden`] of packed rows when `packed` is given (each document on its own).
    ///
    /// # Shapes
    /// As [`Self::hidden`].
    pub fn hidden_packed(
        &self,
        input_ids: Tensor<2, Int>,
        packed: Option<&Arc<PackedRows>>,
        train: bool,
    ) -> anyhow::Result<Tensor<3>> {
        let device = input_ids.device();
        let at = self.positions(input_ids.dims(), packed, &device)?;
        let blocks = BlockSeeds::draw(&device, train);
        let mut x = embed(self.embed_tokens.val(), at.local_ids(input_ids), self.activations);
        for (k, layer) in self.layers.iter().enumerate() {
            blocks.seed(&device, k);
            layer.gather(k)?;
            self.prefetch(k + 1)?;
            x = layer.forward(x, &at, train);
            layer.release();
        }
        Ok(self.norm.forward(x))
    }

    /// The positions of a `[batch, seq]` batch: 0..seq in every row, or for packed rows each
    /// document's own from 0 (the RoPE table of `0..seq` gathered by position); under context
    /// parallelism, this rank's share of them.
    pub fn positions(
        &self,
        [b, s]: [usize; 2],
        packed: Option<&Arc<PackedRows>>,
        device: &Device,
    ) -> anyhow::Result<Positions> {
        if let Some(cp) = &self.context {
            return self.context_positions([b, s], packed, cp, device);
        }
        let (cos, sin) = self.rope(s, device);
        let none = None;
        let Some(packed) = packed else { return Ok(Positions { cos, sin, packed: None, varlen: None, context: none }) };
        anyhow::ensure!(
            [packed.rows(), packed.seq()] == [b, s],
            "packed layout of {} rows of {} tokens for a batch of {b} x {s}",
            packed.rows(),
            packed.seq()
        );
        let hd = self.config.head_dim;
        let index = Tensor::<1, Int>::from_data(burn::tensor::TensorData::new(packed.positions(), [b * s]), device);
        let gather = |t: Tensor<4>| t.reshape([s, hd]).select(0, index.clone()).reshape([b, 1, s, hd]);
        let varlen = match tch_device(device) {
            Some(dev)
                if crate::routes::takes_cuda_routes(dev) && matches!(self.activations, DType::BF16 | DType::F16) =>
            {
                Some(Arc::new(VarlenSpans::new(packed, dev)?))
            }
            _ => None,
        };
        Ok(Positions { cos: gather(cos), sin: gather(sin), packed: Some(packed.clone()), varlen, context: None })
    }

    /// [`Self::positions`] of this rank's share under context parallelism: RoPE at the global
    /// positions of its tokens (each document's own from 0 in packed rows), the documents laid
    /// out over the padded sequence for attention.
    fn context_positions(
        &self,
        [b, s]: [usize; 2],
        packed: Option<&Arc<PackedRows>>,
        cp: &crate::context_parallel::ContextParallel,
        device: &Device,
    ) -> anyhow::Result<Positions> {
        let split = cp.split(s);
        let padded = match packed {
            Some(p) => {
                anyhow::ensure!(
                    [p.rows(), p.seq()] == [b, s],
                    "packed layout of {} rows of {} tokens for a batch of {b} x {s}",
                    p.rows(),
                    p.seq()
                );
                Some(Arc::new(PackedRows::new(p.docs().to_vec(), split.padded)?))
            }
            None => None,
        };
        let local = split.local_positions();
        // The RoPE position of each local token, row-major `[rows, local]` (one row unpacked).
        let index: Vec<i64> = match &padded {
            None => local.iter().map(|&t| t as i64).collect(),
            Some(p) => {
                let all = p.positions();
                (0..b).flat_map(|r| local.iter().map(|&t| all[r * split.padded + t]).collect::<Vec<_>>()).collect()
            }
        };
        let (rows, n, hd) = (index.len() / local.len(), local.len(), self.config.head_dim);
        let (cos, sin) = self.rope(split.padded, device);
        let index = Tensor::<1, Int>::from_data(burn::tensor::TensorData::new(index, [rows * n]), device);
        let gather = |t: Tensor<4>| t.reshape([split.padded, hd]).select(0, index.clone()).reshape([rows, 1, n, hd]);
        let context =
            crate::attention::gathered_kv::ContextAttention { split, group: cp.group.clone(), packed: padded };
        Ok(Positions {
            cos: gather(cos),
            sin: gather(sin),
            packed: None,
            varlen: None,
            context: Some(Arc::new(context)),
        })
    }

    /// RoPE tables for `seq` positions, computed in f32 and cast to the activations' dtype
    /// (as HF's rotary embedding returns them).
    ///
    /// # Shapes
    /// - output: (cos, sin), each `[1, 1, seq, head_dim]`
    pub fn rope(&self, seq: usize, device: &Device) -> (Tensor<4>, Tensor<4>) {
        self.rope_cache.get(seq, device, self.activations, |n| self.rope_at(0..n, device))
    }

    /// [`Self::rope`] for the positions `positions` only.
    ///
    /// # Shapes
    /// - output: (cos, sin), each `[1, 1, positions.len(), head_dim]`
    pub fn rope_at(&self, positions: std::ops::Range<usize>, device: &Device) -> (Tensor<4>, Tensor<4>) {
        let c = &self.config;
        let (cos, sin) = rope_tables_at(positions, c.head_dim, c.rope_theta, c.rope_scaling.as_ref(), device);
        (cos.cast(self.activations), sin.cast(self.activations))
    }

    /// The LM head's weight `[V, d]`: the embedding table when they are tied.
    pub fn head(&self) -> Tensor<2> {
        self.lm_head.as_ref().unwrap_or(&self.embed_tokens).val()
    }

    /// Starts gathering block k's sharded weights, if there is a block k.
    pub(crate) fn prefetch(&self, k: usize) -> anyhow::Result<()> {
        self.layers.get(k).map_or(Ok(()), |l| l.prefetch(k))
    }

    /// Whether the frozen weights are sharded across ranks.
    pub fn is_sharded(&self) -> bool {
        self.layers.iter().any(|l| !l.shards().is_empty())
    }

    /// Logits over the vocabulary.
    ///
    /// # Shapes
    /// - input_ids: `[batch, seq]`
    /// - output: `[batch, seq, V]`
    pub fn forward(&self, input_ids: Tensor<2, Int>, train: bool) -> anyhow::Result<Tensor<3>> {
        self.forward_packed(input_ids, None, train)
    }

    /// [`Self::forward`] of packed rows when `packed` is given.
    ///
    /// # Shapes
    /// As [`Self::forward`].
    pub fn forward_packed(
        &self,
        input_ids: Tensor<2, Int>,
        packed: Option<&Arc<PackedRows>>,
        train: bool,
    ) -> anyhow::Result<Tensor<3>> {
        let hidden = self.hidden_packed(input_ids, packed, train)?;
        // In the activations' dtype, then f32 (as HF's loss upcasts them).
        let head = self.head().cast(hidden.dtype());
        Ok(crate::lora::linear_t(hidden, head).cast(DType::F32))
    }

    /// Loss sums of a batch (see [`crate::loss::target_rows_loss`]): the LM head runs only on
    /// the positions that have a target; per row, or per document of `packed` rows.
    ///
    /// # Shapes
    /// - input_ids, labels: `[batch, seq]`
    pub fn loss(
        &self,
        input_ids: Tensor<2, Int>,
        labels: impl Into<crate::loss::Labels>,
        packed: Option<&Arc<PackedRows>>,
        train: bool,
    ) -> anyhow::Result<crate::loss::LossSums> {
        let split = self.context.as_ref().map(|cp| cp.split(input_ids.dims()[1]));
        let hidden = self.hidden_packed(input_ids, packed, train)?;
        Ok(crate::loss::target_rows_loss(hidden, self.head(), labels, packed.map(|p| &**p), split.as_ref()))
    }

    /// Switches every decoder linear layer (and adapter) and every MLP to `spec`; frozen base
    /// weights are then stored as `spec` asks. The embedding and the LM head stay f32. On
    /// LibTorch devices the layers then run through the precision module's ops, f32 included.
    pub fn set_precision(&mut self, spec: &PrecisionSpec) -> anyhow::Result<()> {
        spec.validate().map_err(anyhow::Error::msg)?;
        if !spec.is_fp32() && tch_device(&self.embed_tokens.device()).is_none() {
            anyhow::bail!(
                "precision.compute = {:?} / fp8_activations need a LibTorch device (cpu or cuda:N)",
                spec.compute.name()
            );
        }
        let device = self.embed_tokens.device();
        for (_, linear) in self.named_linears_mut() {
            linear.set_precision(spec, &device);
        }
        for layer in &mut self.layers {
            layer.mlp.storage = spec.activation_storage();
        }
        self.activations = spec.activation_dtype();
        // A frozen embedding and LM head are read in the activations' dtype: keep them so
        // (HF's bf16 model holds them in bf16 too), rather than casting 2·V·d values per step.
        for table in std::iter::once(&mut self.embed_tokens).chain(self.lm_head.as_mut()) {
            if !table.is_require_grad() && table.val().dtype() != self.activations {
                let cast = table.val().cast(self.activations).set_require_grad(false);
                *table = Param::initialized(table.id, cast);
            }
        }
        Ok(())
    }

    /// Every linear layer's reduced-precision state by name, base before adapter, in module
    /// order: `<module>` for the base GEMM, `<module>.lora_A` and `<module>.lora_B` for the
    /// adapter's. The one walk over them (scales saved and restored, amaxes read, updated).
    fn named_quant_states(&self) -> Vec<(String, &crate::precision::LinearPrecision)> {
        let mut out = Vec::new();
        for (name, linear) in self.named_linears() {
            if let Some(q) = &linear.quant {
                out.push((name.clone(), &**q));
            }
            if let Some([qa, qb]) = linear.lora.as_ref().and_then(|a| a.quant.as_ref()) {
                out.extend([(format!("{name}.lora_A"), &**qa), (format!("{name}.lora_B"), &**qb)]);
            }
        }
        out
    }

    /// Every delayed-scaling state, by name ([`Self::named_quant_states`]'s); empty unless the
    /// compute is FP8.
    pub fn fp8_scales(&self) -> std::collections::BTreeMap<String, LinearScales> {
        let fp8 = self.named_quant_states().into_iter().filter(|(_, q)| q.spec.compute == Compute::Fp8);
        fp8.map(|(name, q)| (name, q.scales.lock().unwrap().clone())).collect()
    }

    /// Restores states saved by [`Self::fp8_scales`]; every state of this model must be there.
    pub fn set_fp8_scales(&self, saved: &std::collections::BTreeMap<String, LinearScales>) -> anyhow::Result<()> {
        for (name, q) in self.named_quant_states().into_iter().filter(|(_, q)| q.spec.compute == Compute::Fp8) {
            let state = saved.get(&name).ok_or_else(|| anyhow::anyhow!("no FP8 scaling state for {name:?}"))?;
            *q.scales.lock().unwrap() = state.clone();
        }
        Ok(())
    }

    /// Every linear layer's reduced-precision state ([`Self::named_quant_states`]'s order).
    fn quant_states(&self) -> Vec<&crate::precision::LinearPrecision> {
        self.named_quant_states().into_iter().map(|(_, q)| q).collect()
    }

    /// Reads back, in one host-device transfer, the amaxes the step's FP8 GEMMs left on the
    /// device, and records them in their scaling states (`LinearPrecision::record_amax`).
    pub fn settle_fp8_amaxes(&self) {
        let quants = self.quant_states();
        let (mut owners, mut groups) = (Vec::new(), Vec::new());
        for (i, q) in quants.iter().enumerate() {
            for (role, amaxes) in q.take_lazy_amaxes() {
                owners.push((i, role));
                groups.push(amaxes);
            }
        }
        for ((i, role), v) in owners.into_iter().zip(crate::precision::read_amaxes(groups)) {
            quants[i].record_amax(role, v);
        }
    }

    /// The amaxes recorded since the last scale update (input, weight, gradient of every layer,
    /// in a fixed order; −1 where none was recorded): data-parallel ranks max-reduce these so
    /// that every rank's scales follow the global batch's amaxes.
    pub fn fp8_pending_amaxes(&self) -> Vec<f32> {
        self.settle_fp8_amaxes();
        let mut out = Vec::new();
        for q in self.quant_states() {
            let s = q.scales.lock().unwrap();
            out.extend([&s.input, &s.weight, &s.grad].map(|d| d.pending.unwrap_or(-1.0)));
        }
        out
    }

    /// Sets the pending amaxes from [`Self::fp8_pending_amaxes`]'s layout (negative = none).
    pub fn set_fp8_pending_amaxes(&self, amaxes: &[f32]) {
        for (q, a) in self.quant_states().into_iter().zip(amaxes.chunks_exact(3)) {
            let mut guard = q.scales.lock().unwrap();
            let s = &mut *guard;
            for (d, &v) in [&mut s.input, &mut s.weight, &mut s.grad].into_iter().zip(a) {
                d.pending = (v >= 0.0).then_some(v);
            }
        }
    }

    /// Ends a training step for delayed scaling (Transformer Engine's `reduce_and_update`): the
    /// amaxes recorded this step max-reduced by `reduce` (over the data-parallel ranks: every
    /// rank then takes the largest any saw; `None` on one rank), then every one joins its
    /// history and the next step's scales follow.
    pub fn reduce_and_update_fp8(&self, reduce: Option<&AmaxReduce<'_>>) -> anyhow::Result<()> {
        if let Some(reduce) = reduce {
            let mut amaxes = self.fp8_pending_amaxes();
            if !amaxes.is_empty() {
                reduce(&mut amaxes)?;
                self.set_fp8_pending_amaxes(&amaxes);
            }
        }
        self.update_fp8_scales();
        Ok(())
    }

    /// Ends a training step for delayed scaling: every recorded amax joins its history.
    pub fn update_fp8_scales(&self) {
        self.settle_fp8_amaxes();
        for q in self.quant_states() {
            q.update();
        }
    }

    /// Bytes of the base weights as held (linear weights, embedding and head in their storage
    /// dtype, norms f32).
    pub fn base_weight_bytes(&self) -> usize {
        let linears: usize = self.named_linears().iter().map(|(_, l)| l.base_weight_bytes()).sum();
        let norms: usize =
            self.layers.iter().map(|l| 2 * l.input_layernorm.weight.shape().num_elements()).sum::<usize>()
                + self.norm.weight.shape().num_elements();
        let table = |p: &Param<Tensor<2>>| p.shape().num_elements() * p.val().dtype().size();
        let head = self.lm_head.as_ref().map_or(0, table);
        linears + 4 * norms + table(&self.embed_tokens) + head
    }

    /// Trainable adapter parameters (A, B and DoRA's magnitude of every adapter).
    pub fn num_lora_parameters(&self) -> usize {
        self.adapters().iter().map(|(_, a)| a.num_params()).sum()
    }

    /// Whether the base weights train (full fine-tuning) rather than adapters.
    pub fn trains_base(&self) -> bool {
        self.embed_tokens.val().is_require_grad()
    }

    /// Values the optimizer updates: every base parameter under full fine-tuning, else the
    /// adapters'.
    pub fn num_trainable_parameters(&self) -> usize {
        if self.trains_base() { self.config.num_parameters() } else { self.num_lora_parameters() }
    }
}
