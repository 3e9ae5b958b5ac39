//! The Llama causal LM, block by block in the order data flows through it.
//!
//! embedding → L × [x += Attn(RMSNorm(x)); x += MLP(RMSNorm(x))] → RMSNorm → LM head.
//! Every linear layer is a [`LoraLinear`]: frozen base weight plus an optional adapter.

use burn::module::{Module, Param};
use burn::tensor::activation::silu;
use burn::tensor::{DType, Device, Distribution, Int, Tensor, TensorData};

use crate::attention::causal_attention;
use crate::config::LlamaConfig;
use crate::lora::{LoraAdapter, LoraLinear, LoraSpec};
pub use crate::norm::RmsNorm;
pub use crate::rope::{apply_rope, rope_tables, rope_tables_at};
use std::sync::Arc;

use burn::backend::libtorch::TchTensor;

use crate::precision::{
    Compute, FrozenWeight, LinearQuant, LinearScales, PrecisionSpec, Storage, StoredWeight, swiglu, tch_device,
};
use crate::shard::{Sharding, WeightShard};

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
    /// # Shapes
    /// - x: `[batch, seq, d]`
    /// - cos, sin: `[1, 1, seq, head_dim]`
    /// - output: `[batch, seq, d]`
    pub fn forward(&self, x: Tensor<3>, cos: Tensor<4>, sin: Tensor<4>, train: bool) -> Tensor<3> {
        let [b, s, _] = x.dims();
        let (q, k, v) = self.qkv(x, cos, sin, train);
        let out = causal_attention(q, k, v);
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
        let (q, k, v) = self.qkv(x, cos, sin, false);
        let prefill = cache.is_none();
        let (k, v) = match cache.take() {
            Some((ck, cv)) => (Tensor::cat(vec![ck, k], 2), Tensor::cat(vec![cv, v], 2)),
            None => (k, v),
        };
        *cache = Some((k.clone(), v.clone()));
        // One new position sees every cached one: no mask. The fused kernel reads K/V at KV
        // heads (grouped), as in training.
        debug_assert!(prefill || s == 1, "decode one position at a time");
        let out = crate::attention::attention(q, k, v, prefill);
        self.o_proj.forward(out.swap_dims(1, 2).reshape([b, s, self.n_heads * self.head_dim]), false)
    }

    /// Queries, keys and values in heads, RoPE applied to q and k.
    ///
    /// # Shapes
    /// - x: `[batch, seq, d]`; cos, sin: `[1, 1, seq, head_dim]`
    /// - output: q `[batch, H, seq, hd]`, k and v `[batch, KV, seq, hd]`
    fn qkv(&self, x: Tensor<3>, cos: Tensor<4>, sin: Tensor<4>, train: bool) -> (Tensor<4>, Tensor<4>, Tensor<4>) {
        let [b, s, _] = x.dims();
        let (h, kv, hd) = (self.n_heads, self.n_kv_heads, self.head_dim);
        let (q, k, v) = match (&self.qkv_proj, &self.q_proj, &self.k_proj, &self.v_proj) {
            (Some(qkv), ..) => {
                let fused = qkv.forward(x, train);
                (
                    fused.clone().narrow(2, 0, h * hd),
                    fused.clone().narrow(2, h * hd, kv * hd),
                    fused.narrow(2, (h + kv) * hd, kv * hd),
                )
            }
            (None, Some(q), Some(k), Some(v)) => {
                (q.forward(x.clone(), train), k.forward(x.clone(), train), v.forward(x, train))
            }
            _ => unreachable!("the loader builds either qkv_proj or all of q/k/v_proj"),
        };
        let heads = |t: Tensor<3>, n: usize| t.reshape([b, s, n, hd]).swap_dims(1, 2);
        let q = apply_rope(heads(q, h), cos.clone(), sin.clone());
        let k = apply_rope(heads(k, kv), cos, sin);
        (q, k, heads(v, kv))
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
    /// # Shapes
    /// - x: `[batch, seq, d]`
    /// - output: `[batch, seq, d]`
    pub fn forward(&self, x: Tensor<3>, train: bool) -> Tensor<3> {
        let gate = self.gate_proj.forward(x.clone(), train);
        let up = self.up_proj.forward(x, train);
        // The fused op keeps only gate and up for backward (Burn's composite keeps four
        // tensors of this size); it is a LibTorch extension.
        let hidden =
            if tch_device(&gate.device()).is_some() { swiglu(gate, up, self.storage) } else { silu(gate) * up };
        self.down_proj.forward(hidden, train)
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
    /// # Shapes
    /// - x: `[batch, seq, d]`
    /// - output: `[batch, seq, d]`
    pub fn forward(&self, x: Tensor<3>, cos: Tensor<4>, sin: Tensor<4>, train: bool) -> Tensor<3> {
        let h = x.clone() + self.self_attn.forward(self.input_layernorm.forward(x), cos, sin, train);
        h.clone() + self.mlp.forward(self.post_attention_layernorm.forward(h), train)
    }

    /// [`Self::forward`] while decoding, with this block's key/value cache
    /// ([`Attention::forward_cached`]).
    ///
    /// # Shapes
    /// As [`Attention::forward_cached`].
    pub fn forward_cached(&self, x: Tensor<3>, cos: Tensor<4>, sin: Tensor<4>, cache: &mut LayerKv) -> Tensor<3> {
        let h = x.clone() + self.self_attn.forward_cached(self.input_layernorm.forward(x), cos, sin, cache);
        h.clone() + self.mlp.forward(self.post_attention_layernorm.forward(h), false)
    }

    /// The block's linear layers, in forward order.
    fn linears(&self) -> Vec<&LoraLinear> {
        let a = &self.self_attn;
        let m = &self.mlp;
        [&a.q_proj, &a.k_proj, &a.v_proj, &a.qkv_proj]
            .into_iter()
            .flatten()
            .chain([&a.o_proj, &m.gate_proj, &m.up_proj, &m.down_proj])
            .collect()
    }

    /// The block's sharded frozen weights.
    fn shards(&self) -> Vec<&WeightShard> {
        self.linears()
            .into_iter()
            .filter_map(|l| match l.quant.as_ref()?.stored.as_ref()? {
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
    /// malloc needed, cost 18% of a sharded `small` step on 2 ranks (3.65 → 2.97 s) for 47 MB
    /// less peak RSS.
    pub(crate) fn release(&self) {
        self.shards().into_iter().for_each(WeightShard::release);
    }
}

/// Dropout seeds per decoder block of one forward pass: one draw from the device's generator
/// (which the trainer seeds per micro-batch), then block k reseeds the generator from it and k.
/// A block's masks then do not depend on what ran before it, so a recomputed block draws the
/// same masks again.
#[derive(Debug, Clone, Copy)]
struct BlockSeeds(Option<u64>);

impl BlockSeeds {
    /// A base seed for a training pass on a LibTorch device (None otherwise: no reseeding).
    fn draw(device: &Device, train: bool) -> Self {
        if !train || tch_device(device).is_none() {
            return Self(None);
        }
        let base = tch::Tensor::randint(i64::MAX, [1], (tch::Kind::Int64, tch::Device::Cpu)).int64_value(&[0]) as u64;
        Self(Some(base))
    }

    /// Reseeds the generator for block `k`.
    fn seed(self, device: &Device, k: usize) {
        if let Some(base) = self.0 {
            device.seed(base.wrapping_add((k as u64 + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15)));
        }
    }
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

/// Llama causal language model with (optional) LoRA adapters.
#[derive(Module, Debug)]
pub struct LlamaForCausalLM {
    /// Token embedding `[V, d]`.
    pub embed_tokens: Param<Tensor<2>>,
    /// Decoder blocks.
    pub layers: Vec<DecoderLayer>,
    /// Final norm.
    pub norm: RmsNorm,
    /// LM head `[V, d]` (untied).
    pub lm_head: Param<Tensor<2>>,
    /// Architecture.
    #[module(skip)]
    pub config: LlamaConfig,
    /// The dtype of the hidden states between the blocks (f32, or bf16 for bf16/FP8 compute;
    /// [`PrecisionSpec::activation_dtype`]).
    #[module(skip)]
    pub activations: DType,
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
        let [_, s] = input_ids.dims();
        let device = input_ids.device();
        let (cos, sin) = self.rope(s, &device);
        let blocks = BlockSeeds::draw(&device, train);
        let mut x = embed(self.embed_tokens.val(), input_ids, self.activations);
        for (k, layer) in self.layers.iter().enumerate() {
            blocks.seed(&device, k);
            layer.gather(k)?;
            self.prefetch(k + 1)?;
            x = layer.forward(x, cos.clone(), sin.clone(), train);
            layer.release();
        }
        Ok(self.norm.forward(x))
    }

    /// RoPE tables for `seq` positions, computed in f32 and cast to the activations' dtype
    /// (as HF's rotary embedding returns them).
    ///
    /// # Shapes
    /// - output: (cos, sin), each `[1, 1, seq, head_dim]`
    pub fn rope(&self, seq: usize, device: &Device) -> (Tensor<4>, Tensor<4>) {
        self.rope_at(0..seq, device)
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

    /// Starts gathering block k's sharded weights, if there is a block k.
    fn prefetch(&self, k: usize) -> anyhow::Result<()> {
        self.layers.get(k).map_or(Ok(()), |l| l.prefetch(k))
    }

    /// Whether the frozen weights are sharded across ranks.
    pub fn is_sharded(&self) -> bool {
        self.layers.iter().any(|l| !l.shards().is_empty())
    }

    /// Gradients of `loss_sum / norm` of a training micro-batch, computed block by block, with
    /// the first `recompute` decoder blocks recomputed: a forward without autodiff keeps only
    /// each of those blocks' input; the rest of the model runs with autodiff and backpropagates
    /// to the input of block `recompute`; then each recomputed block, last first, runs its
    /// forward again from its saved input and backpropagates the gradient it receives (as the
    /// gradient of `sum(y · g)`). Dropout masks are drawn from a seed per block and FP8 scales
    /// change only between steps, so the second forward is the first one: results equal the
    /// plain backward's.
    ///
    /// A sharded model runs every block as its own segment (the others keep their autodiff
    /// graph from the forward): each block's weights are gathered for its forward and again
    /// for its backward, and freed after each. Returns the loss value and one `Gradients` per
    /// segment; every trainable parameter's gradient is in exactly one of them.
    ///
    /// # Shapes
    /// - input_ids, labels: `[batch, seq]`
    pub fn recomputed_backward(
        &self,
        input_ids: Tensor<2, Int>,
        labels: Tensor<2, Int>,
        norm: f64,
        recompute: usize,
    ) -> anyhow::Result<(f64, Vec<burn::tensor::Gradients>)> {
        /// What the backward of one block starts from.
        enum Segment {
            /// The block's input, to run its forward again.
            Recompute(Tensor<3>),
            /// The block's input (a graph leaf) and output, with the graph between them.
            Graph(Tensor<3>, Tensor<3>),
        }
        let n = recompute.min(self.layers.len());
        // Blocks [0, n) are recomputed, [n, split) keep their own graphs, [split, L) share the
        // head's graph.
        let split = if self.is_sharded() { self.layers.len() } else { n };
        let [_, s] = input_ids.dims();
        let device = input_ids.device();
        let (cos, sin) = self.rope(s, &device);
        let blocks = BlockSeeds::draw(&device, true);
        let inner = self.valid();
        let (cos_i, sin_i) = (cos.clone().inner(), sin.clone().inner());
        let mut x = embed(inner.embed_tokens.val(), input_ids.clone().inner(), self.activations);
        let mut segments = Vec::with_capacity(split);
        for k in 0..split {
            blocks.seed(&device, k);
            self.layers[k].gather(k)?;
            if k + 1 < split {
                self.prefetch(k + 1)?;
            }
            if k < n {
                segments.push(Segment::Recompute(x.clone()));
                x = inner.layers[k].forward(x, cos_i.clone(), sin_i.clone(), true);
            } else {
                let input = Tensor::from_inner(x).require_grad();
                let y = self.layers[k].forward(input.clone(), cos.clone(), sin.clone(), true);
                x = y.clone().inner();
                segments.push(Segment::Graph(input, y));
            }
            self.layers[k].release();
        }
        drop(inner);
        let top_in = Tensor::from_inner(x).require_grad();
        let mut h = top_in.clone();
        for (k, layer) in self.layers.iter().enumerate().skip(split) {
            blocks.seed(&device, k);
            h = layer.forward(h, cos.clone(), sin.clone(), true);
        }
        let loss = crate::loss::target_rows_loss(self.norm.forward(h), self.lm_head.val(), labels)
            .loss_sum
            .sum()
            .div_scalar(norm);
        let value = loss.clone().into_scalar::<f32>() as f64;
        let grads = loss.backward();
        let mut g = top_in.grad(&grads);
        let mut out = vec![grads];
        // Each block below the head's graph, last first.
        for (k, segment) in segments.into_iter().enumerate().rev() {
            let Some(upstream) = g.take() else {
                self.layers[k].release(); // prefetched, not needed
                break;
            };
            let layer = &self.layers[k];
            layer.gather(k)?;
            if k > 0 {
                self.prefetch(k - 1)?;
            }
            let (input, y) = match segment {
                Segment::Recompute(x) => {
                    let input = Tensor::from_inner(x).require_grad();
                    blocks.seed(&device, k);
                    (input.clone(), layer.forward(input, cos.clone(), sin.clone(), true))
                }
                Segment::Graph(input, y) => (input, y),
            };
            let grads = (y * Tensor::from_inner(upstream)).sum().backward();
            layer.release();
            g = input.grad(&grads);
            out.push(grads);
        }
        // A trainable embedding (full fine-tuning) takes the gradient of block 0's input.
        if let Some(upstream) = g.filter(|_| self.embed_tokens.val().is_require_grad()) {
            let emb = embed(self.embed_tokens.val(), input_ids, self.activations);
            out.push((emb * Tensor::from_inner(upstream)).sum().backward());
        }
        Ok((value, out))
    }

    /// Logits over the vocabulary.
    ///
    /// # Shapes
    /// - input_ids: `[batch, seq]`
    /// - output: `[batch, seq, V]`
    pub fn forward(&self, input_ids: Tensor<2, Int>, train: bool) -> anyhow::Result<Tensor<3>> {
        let hidden = self.hidden(input_ids, train)?;
        // In the activations' dtype, then f32 (as HF's loss upcasts them).
        let head = self.lm_head.val().cast(hidden.dtype());
        Ok(crate::lora::linear_t(hidden, head).cast(DType::F32))
    }

    /// Loss sums of a batch (see [`crate::loss::target_rows_loss`]): the LM head runs only on
    /// the positions that have a target.
    ///
    /// # Shapes
    /// - input_ids, labels: `[batch, seq]`
    pub fn loss(
        &self,
        input_ids: Tensor<2, Int>,
        labels: Tensor<2, Int>,
        train: bool,
    ) -> anyhow::Result<crate::loss::LossSums> {
        Ok(crate::loss::target_rows_loss(self.hidden(input_ids, train)?, self.lm_head.val(), labels))
    }

    /// A randomly initialised model (HF's init: N(0, 0.02²) weights, unit norms), built as
    /// `opts` asks. Used for presets without a checkpoint and for benchmarks.
    pub fn random(config: &LlamaConfig, opts: &BuildOptions<'_>, device: &Device) -> anyhow::Result<Self> {
        let mut weights = WeightSource { fetch: None, device: device.clone() };
        Self::build(config, opts, device, &mut weights)
    }

    /// Builds the model from a weight source (a checkpoint or an initialiser), attaching fresh
    /// adapters to the modules `opts.lora` targets. With `opts.precision`, the model is
    /// switched to it ([`Self::set_precision`]) and each frozen weight it stores in bf16 or FP8
    /// is converted as soon as it is read (and, with `opts.sharding`, cut to this rank's
    /// slice): the model never exists in f32 (at 70B that would be 276 GB), nor whole on a
    /// sharded rank.
    pub fn build(
        config: &LlamaConfig,
        opts: &BuildOptions<'_>,
        device: &Device,
        weights: &mut WeightSource<'_>,
    ) -> anyhow::Result<Self> {
        let c = config;
        let (d, i, v, hd) = (c.hidden_size, c.intermediate_size, c.vocab_size, c.head_dim);
        let (qd, kvd) = (c.num_attention_heads * hd, c.num_key_value_heads * hd);
        let BuildOptions { lora, trainable, precision, sharding } = opts;
        let trainable = *trainable;
        // The targets as this checkpoint's modules: a name that matches nothing is an error here,
        // not a model without adapters that fails in backward.
        let resolved = lora.map(|s| s.for_layout(c.fused_qkv)).transpose()?;
        if let (Some(asked), Some(got)) = (lora, &resolved)
            && asked.targets != got.targets
        {
            tracing::info!(asked = ?asked.targets, adapted = ?got.targets, "LoRA targets resolved for this checkpoint's layout");
        }
        let lora = resolved.as_ref();
        if let Some(spec) = precision {
            spec.validate().map_err(anyhow::Error::msg)?;
        }
        if sharding.is_some() {
            anyhow::ensure!(!trainable, "train.shard_frozen_weights = true needs frozen base weights (LoRA)");
            anyhow::ensure!(
                precision.is_some() && tch_device(device).is_some(),
                "train.shard_frozen_weights = true needs a LibTorch device (cpu or cuda)"
            );
        }
        let stores = precision.as_ref().filter(|p| {
            !trainable && (p.stores_frozen_weights() || sharding.is_some()) && tch_device(device).is_some()
        });
        let linear = |weights: &mut WeightSource<'_>,
                      name: &str,
                      short: &str,
                      out: usize,
                      inp: usize|
         -> anyhow::Result<LoraLinear> {
            let name = format!("{name}.weight");
            let mut layer = match stores {
                Some(spec) => {
                    let whole = weights.stored(&name, [out, inp], spec)?;
                    let frozen = match sharding {
                        Some(s) => FrozenWeight::Sharded(Arc::new(WeightShard::new(whole, s))),
                        None => FrozenWeight::Whole(whole),
                    };
                    LoraLinear::from_stored(frozen, spec, device)
                }
                None => LoraLinear::new(weights.get(&name, [out, inp])?, trainable),
            };
            if let Some(spec) = lora.filter(|s| s.targets(short)) {
                layer = layer.with_adapter(LoraAdapter::new(inp, out, spec, device));
            }
            Ok(layer)
        };
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for l in 0..c.num_hidden_layers {
            let p = format!("model.layers.{l}");
            let (q_proj, k_proj, v_proj, qkv_proj) = if c.fused_qkv {
                (
                    None,
                    None,
                    None,
                    Some(linear(weights, &format!("{p}.self_attn.qkv_proj"), "qkv_proj", qd + 2 * kvd, d)?),
                )
            } else {
                (
                    Some(linear(weights, &format!("{p}.self_attn.q_proj"), "q_proj", qd, d)?),
                    Some(linear(weights, &format!("{p}.self_attn.k_proj"), "k_proj", kvd, d)?),
                    Some(linear(weights, &format!("{p}.self_attn.v_proj"), "v_proj", kvd, d)?),
                    None,
                )
            };
            let self_attn = Attention {
                q_proj,
                k_proj,
                v_proj,
                qkv_proj,
                o_proj: linear(weights, &format!("{p}.self_attn.o_proj"), "o_proj", d, qd)?,
                n_heads: c.num_attention_heads,
                n_kv_heads: c.num_key_value_heads,
                head_dim: hd,
            };
            let mlp = Mlp {
                gate_proj: linear(weights, &format!("{p}.mlp.gate_proj"), "gate_proj", i, d)?,
                up_proj: linear(weights, &format!("{p}.mlp.up_proj"), "up_proj", i, d)?,
                down_proj: linear(weights, &format!("{p}.mlp.down_proj"), "down_proj", d, i)?,
                storage: Storage::F32,
            };
            layers.push(DecoderLayer {
                input_layernorm: norm(weights, &format!("{p}.input_layernorm.weight"), d, c.rms_norm_eps, trainable)?,
                self_attn,
                post_attention_layernorm: norm(
                    weights,
                    &format!("{p}.post_attention_layernorm.weight"),
                    d,
                    c.rms_norm_eps,
                    trainable,
                )?,
                mlp,
            });
        }
        // A frozen table is cast to the activations' dtype as soon as it is read, and its f32
        // buffer returned to the kernel: otherwise the allocator keeps the two f32 tables'
        // pages resident through training (small preset, bf16: 187 MB above the live peak).
        let table_dtype = precision.filter(|_| !trainable).map(|p| p.activation_dtype()).filter(|&t| t != DType::F32);
        let table = |weights: &mut WeightSource<'_>, name: &str| -> anyhow::Result<Tensor<2>> {
            let t = weights.get(name, [v, d])?;
            Ok(match table_dtype {
                Some(dtype) => {
                    let cast = t.cast(dtype);
                    crate::device::release_free_memory();
                    cast
                }
                None => t,
            })
        };
        // A tied head is the embedding tensor itself; training both as one parameter is not
        // implemented, so full fine-tuning of such a model is refused rather than untied.
        anyhow::ensure!(
            !(trainable && c.tie_word_embeddings),
            "full fine-tuning of a model with tied embeddings (tie_word_embeddings = true, e.g. Llama 3.2 1B/3B) is \
             not supported: train LoRA adapters (model.trainable = \"lora\")"
        );
        let embed = table(weights, "model.embed_tokens.weight")?;
        let lm_head = if c.tie_word_embeddings { embed.clone() } else { table(weights, "lm_head.weight")? };
        let mut model = Self {
            embed_tokens: Param::from_tensor(embed).set_require_grad(trainable),
            layers,
            norm: norm(weights, "model.norm.weight", d, c.rms_norm_eps, trainable)?,
            lm_head: Param::from_tensor(lm_head).set_require_grad(trainable),
            config: c.clone(),
            activations: DType::F32,
        };
        if let Some(spec) = precision {
            model.set_precision(spec)?;
        }
        Ok(model)
    }

    /// Every adapter with its PEFT module path, in forward order
    /// (`base_model.model.model.layers.0.self_attn.q_proj`, ...).
    pub fn adapters(&self) -> Vec<(String, &LoraAdapter)> {
        let mut out = Vec::new();
        for (name, layer) in self.named_linears() {
            if let Some(a) = &layer.lora {
                out.push((format!("base_model.model.{name}"), a));
            }
        }
        out
    }

    /// Mutable access to every adapter, in the order of [`LlamaForCausalLM::adapters`].
    pub fn adapters_mut(&mut self) -> Vec<(String, &mut LoraAdapter)> {
        let mut out = Vec::new();
        for (name, layer) in self.named_linears_mut() {
            if let Some(a) = layer.lora.as_mut() {
                out.push((format!("base_model.model.{name}"), a));
            }
        }
        out
    }

    /// Every linear layer with its HF module path (`model.layers.0.self_attn.q_proj`).
    pub fn named_linears(&self) -> Vec<(String, &LoraLinear)> {
        let mut out = Vec::new();
        for (l, layer) in self.layers.iter().enumerate() {
            let a = &layer.self_attn;
            let p = format!("model.layers.{l}");
            for (n, m) in
                [("q_proj", &a.q_proj), ("k_proj", &a.k_proj), ("v_proj", &a.v_proj), ("qkv_proj", &a.qkv_proj)]
            {
                if let Some(m) = m {
                    out.push((format!("{p}.self_attn.{n}"), m));
                }
            }
            out.push((format!("{p}.self_attn.o_proj"), &a.o_proj));
            let m = &layer.mlp;
            out.push((format!("{p}.mlp.gate_proj"), &m.gate_proj));
            out.push((format!("{p}.mlp.up_proj"), &m.up_proj));
            out.push((format!("{p}.mlp.down_proj"), &m.down_proj));
        }
        out
    }

    /// Mutable variant of [`LlamaForCausalLM::named_linears`], same order.
    pub fn named_linears_mut(&mut self) -> Vec<(String, &mut LoraLinear)> {
        self.layers
            .iter_mut()
            .enumerate()
            .flat_map(|(l, layer)| layer_linears_mut(l, &mut layer.self_attn, &mut layer.mlp))
            .collect()
    }

    /// Folds every adapter into its base weight (`W ← W + (α/r)·B·A`) and removes the
    /// adapters: the plain model that `llora export --merged` writes.
    pub fn merge_adapters(&mut self) {
        for (_, layer) in self.named_linears_mut() {
            if let Some(adapter) = layer.lora.take() {
                let trainable = layer.weight.val().is_require_grad();
                let w = (layer.base_weight() + adapter.delta()).detach();
                layer.weight = Param::initialized(layer.weight.id, w.set_require_grad(trainable));
                layer.quant = None;
            }
        }
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
        for (_, linear) in self.named_linears_mut() {
            linear.set_precision(spec);
        }
        for layer in &mut self.layers {
            layer.mlp.storage = spec.activation_storage();
        }
        self.activations = spec.activation_dtype();
        // A frozen embedding and LM head are read in the activations' dtype: keep them so
        // (HF's bf16 model holds them in bf16 too), rather than casting 2·V·d values per step.
        for table in [&mut self.embed_tokens, &mut self.lm_head] {
            if !table.is_require_grad() && table.val().dtype() != self.activations {
                let cast = table.val().cast(self.activations).set_require_grad(false);
                *table = Param::initialized(table.id, cast);
            }
        }
        if self.config.tie_word_embeddings {
            // One table for both, as loaded: the casts above made two.
            self.lm_head = Param::initialized(self.lm_head.id, self.embed_tokens.val());
        }
        Ok(())
    }

    /// Every delayed-scaling state, by name (`<module>` for the base GEMM, `<module>.lora_A`
    /// and `<module>.lora_B` for the adapter's); empty unless the compute is FP8.
    pub fn fp8_scales(&self) -> std::collections::BTreeMap<String, LinearScales> {
        let mut out = std::collections::BTreeMap::new();
        for (name, linear) in self.named_linears() {
            if let Some(q) = linear.quant.as_ref().filter(|q| q.spec.compute == Compute::Fp8) {
                out.insert(name.clone(), q.scales.lock().unwrap().clone());
            }
            if let Some([qa, qb]) =
                linear.lora.as_ref().and_then(|a| a.quant.as_ref()).filter(|[q, _]| q.spec.compute == Compute::Fp8)
            {
                out.insert(format!("{name}.lora_A"), qa.scales.lock().unwrap().clone());
                out.insert(format!("{name}.lora_B"), qb.scales.lock().unwrap().clone());
            }
        }
        out
    }

    /// Restores states saved by [`Self::fp8_scales`]; every state of this model must be there.
    pub fn set_fp8_scales(&self, saved: &std::collections::BTreeMap<String, LinearScales>) -> anyhow::Result<()> {
        let mut targets = Vec::new();
        for (name, linear) in self.named_linears() {
            if let Some(q) = linear.quant.as_ref().filter(|q| q.spec.compute == Compute::Fp8) {
                targets.push((name.clone(), q.clone()));
            }
            if let Some([qa, qb]) =
                linear.lora.as_ref().and_then(|a| a.quant.as_ref()).filter(|[q, _]| q.spec.compute == Compute::Fp8)
            {
                targets.push((format!("{name}.lora_A"), qa.clone()));
                targets.push((format!("{name}.lora_B"), qb.clone()));
            }
        }
        for (name, q) in targets {
            let state = saved.get(&name).ok_or_else(|| anyhow::anyhow!("no FP8 scaling state for {name:?}"))?;
            *q.scales.lock().unwrap() = state.clone();
        }
        Ok(())
    }

    /// Every linear layer's reduced-precision state, base before adapter, in module order.
    fn quant_states(&self) -> Vec<&crate::precision::LinearQuant> {
        let mut out = Vec::new();
        for (_, linear) in self.named_linears() {
            if let Some(q) = &linear.quant {
                out.push(&**q);
            }
            if let Some([qa, qb]) = linear.lora.as_ref().and_then(|a| a.quant.as_ref()) {
                out.extend([&**qa, &**qb]);
            }
        }
        out
    }

    /// The amaxes recorded since the last scale update (input, weight, gradient of every layer,
    /// in a fixed order; −1 where none was recorded): data-parallel ranks max-reduce these so
    /// that every rank's scales follow the global batch's amaxes.
    pub fn fp8_pending_amaxes(&self) -> Vec<f32> {
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

    /// Ends a training step for delayed scaling: every recorded amax joins its history.
    pub fn update_fp8_scales(&self) {
        for (_, linear) in self.named_linears() {
            if let Some(q) = &linear.quant {
                q.update();
            }
            if let Some([qa, qb]) = linear.lora.as_ref().and_then(|a| a.quant.as_ref()) {
                qa.update();
                qb.update();
            }
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
        let head = if self.config.tie_word_embeddings { 0 } else { table(&self.lm_head) };
        linears + 4 * norms + table(&self.embed_tokens) + head
    }

    /// Trainable adapter parameters (A and B of every adapter).
    pub fn num_lora_parameters(&self) -> usize {
        self.adapters().iter().map(|(_, a)| a.a.shape().num_elements() + a.b.shape().num_elements()).sum()
    }

    /// Every parameter of one kind, named as it is saved: base weights with HF names
    /// (`model.layers.0.mlp.up_proj.weight`), adapters with PEFT names
    /// (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`). In forward order.
    pub fn params_mut(&mut self, kind: ParamKind) -> Vec<(String, ParamMut<'_>)> {
        let mut out = Vec::new();
        match kind {
            ParamKind::Adapters => {
                for (name, a) in self.adapters_mut() {
                    out.push((format!("{name}.lora_A.weight"), ParamMut::Matrix(&mut a.a)));
                    out.push((format!("{name}.lora_B.weight"), ParamMut::Matrix(&mut a.b)));
                }
            }
            ParamKind::Base => {
                out.push(("model.embed_tokens.weight".to_string(), ParamMut::Matrix(&mut self.embed_tokens)));
                for (l, layer) in self.layers.iter_mut().enumerate() {
                    let p = format!("model.layers.{l}");
                    let DecoderLayer { input_layernorm, self_attn, post_attention_layernorm, mlp } = layer;
                    out.push((format!("{p}.input_layernorm.weight"), ParamMut::Vector(&mut input_layernorm.weight)));
                    out.push((
                        format!("{p}.post_attention_layernorm.weight"),
                        ParamMut::Vector(&mut post_attention_layernorm.weight),
                    ));
                    for (name, linear) in layer_linears_mut(l, self_attn, mlp) {
                        out.push((format!("{name}.weight"), ParamMut::Matrix(&mut linear.weight)));
                    }
                }
                out.push(("model.norm.weight".to_string(), ParamMut::Vector(&mut self.norm.weight)));
                out.push(("lm_head.weight".to_string(), ParamMut::Matrix(&mut self.lm_head)));
            }
        }
        out
    }

    /// The parameters training updates: every base weight under full fine-tuning, else the
    /// adapters.
    pub fn trainable_params_mut(&mut self) -> Vec<(String, ParamMut<'_>)> {
        let full = self.embed_tokens.val().is_require_grad();
        self.params_mut(if full { ParamKind::Base } else { ParamKind::Adapters })
    }
}

/// The linear layers of decoder layer `l` with their HF module paths, in forward order.
fn layer_linears_mut<'a>(l: usize, a: &'a mut Attention, m: &'a mut Mlp) -> Vec<(String, &'a mut LoraLinear)> {
    let mut out = Vec::new();
    let p = format!("model.layers.{l}");
    for (n, m) in
        [("q_proj", &mut a.q_proj), ("k_proj", &mut a.k_proj), ("v_proj", &mut a.v_proj), ("qkv_proj", &mut a.qkv_proj)]
    {
        if let Some(m) = m.as_mut() {
            out.push((format!("{p}.self_attn.{n}"), m));
        }
    }
    out.push((format!("{p}.self_attn.o_proj"), &mut a.o_proj));
    out.push((format!("{p}.mlp.gate_proj"), &mut m.gate_proj));
    out.push((format!("{p}.mlp.up_proj"), &mut m.up_proj));
    out.push((format!("{p}.mlp.down_proj"), &mut m.down_proj));
    out
}

/// Which parameters [`LlamaForCausalLM::params_mut`] lists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParamKind {
    /// Embeddings, norms, linear weights, LM head (HF names).
    Base,
    /// LoRA A and B (PEFT names).
    Adapters,
}

/// A mutable parameter of either rank the model has.
pub enum ParamMut<'a> {
    /// A norm gain `[d]`.
    Vector(&'a mut Param<Tensor<1>>),
    /// A weight matrix.
    Matrix(&'a mut Param<Tensor<2>>),
}

impl ParamMut<'_> {
    /// The value flattened to one dimension (same autodiff node: gradients can be looked up).
    pub fn flat(&self) -> Tensor<1> {
        match self {
            Self::Vector(p) => p.val(),
            Self::Matrix(p) => p.val().flatten(0, 1),
        }
    }

    /// The gradient of this parameter in `grads`, flattened.
    pub fn grad_flat(&self, grads: &burn::tensor::Gradients) -> Option<Tensor<1>> {
        match self {
            Self::Vector(p) => p.val().grad(grads),
            Self::Matrix(p) => p.val().grad(grads).map(|g| g.flatten(0, 1)),
        }
    }

    /// Replaces the value with `new` (flattened, plain backend), keeping the id and trainability.
    pub fn set_flat(&mut self, new: Tensor<1>) {
        match self {
            Self::Vector(p) => {
                let trainable = p.val().is_require_grad();
                **p = Param::initialized(p.id, Tensor::from_inner(new).set_require_grad(trainable));
            }
            Self::Matrix(p) => {
                let dims: [usize; 2] = p.shape().dims();
                let t = Tensor::from_inner(new.reshape(dims)).set_require_grad(p.val().is_require_grad());
                **p = Param::initialized(p.id, t);
            }
        }
    }
}

fn norm(weights: &mut WeightSource<'_>, name: &str, d: usize, eps: f64, trainable: bool) -> anyhow::Result<RmsNorm> {
    let w = weights.get::<1>(name, [d])?;
    Ok(RmsNorm { weight: Param::from_tensor(w).set_require_grad(trainable), eps })
}

/// Returns one base tensor's data given its HF name and the shape the architecture expects.
type FetchFn<'a> = Box<dyn FnMut(&str, &[usize]) -> anyhow::Result<TensorData> + 'a>;

/// Where [`LlamaForCausalLM::build`] gets each base tensor: a checkpoint or an initialiser.
///
/// The closure receives the HF tensor name and the shape the architecture expects and returns
/// the data in that shape (a checkpoint reader checks it and names the tensor when it differs).
pub struct WeightSource<'a> {
    /// `None`: HF's random init, drawn on the device (a host round trip would hold a second
    /// copy of the largest matrix: at 70B that was the process's peak RSS).
    fetch: Option<FetchFn<'a>>,
    device: Device,
}

impl<'a> WeightSource<'a> {
    /// Wraps `fetch(name, expected_shape)`; tensors are created on `device`.
    pub fn new(device: &Device, fetch: impl FnMut(&str, &[usize]) -> anyhow::Result<TensorData> + 'a) -> Self {
        Self { fetch: Some(Box::new(fetch)), device: device.clone() }
    }

    /// The f32 data of a checkpoint tensor, checked against the architecture's shape.
    fn fetch(fetch: &mut FetchFn<'a>, name: &str, shape: &[usize]) -> anyhow::Result<TensorData> {
        let data = fetch(name, shape)?;
        anyhow::ensure!(
            data.shape().as_slice() == shape,
            "tensor {name}: expected shape {shape:?}, found {:?}",
            data.shape().as_slice()
        );
        Ok(data)
    }

    fn get<const D: usize>(&mut self, name: &str, shape: [usize; D]) -> anyhow::Result<Tensor<D>> {
        let Some(fetch) = self.fetch.as_mut() else {
            return Ok(if name.ends_with("norm.weight") {
                Tensor::ones(shape, &self.device)
            } else {
                Tensor::random(shape, Distribution::Normal(0.0, 0.02), &self.device)
            });
        };
        Ok(Tensor::from_data(Self::fetch(fetch, name, &shape)?, &self.device))
    }

    /// A frozen linear weight stored as `spec` asks (f32 when it keeps f32: sharding), converted
    /// from its f32 values before the next tensor is read (a random one is drawn on the device
    /// as [`Self::get`] draws it).
    fn stored(&mut self, name: &str, dims: [usize; 2], spec: &PrecisionSpec) -> anyhow::Result<StoredWeight> {
        let device = tch_device(&self.device).expect("stored weights need a LibTorch device");
        let data = match self.fetch.as_mut() {
            Some(fetch) => Self::fetch(fetch, name, &dims)?,
            None => self.get(name, dims)?.into_data(),
        };
        let values = data.into_vec::<f32>().map_err(|e| anyhow::anyhow!("tensor {name}: {e:?}"))?;
        let stored = LinearQuant::store_weight(spec, &values, dims, device).unwrap_or_else(|| {
            let t = tch::Tensor::from_slice(&values).reshape([dims[0] as i64, dims[1] as i64]).to_device(device);
            StoredWeight::F32(TchTensor::new(t))
        });
        drop(values);
        crate::device::release_free_memory();
        Ok(stored)
    }
}
