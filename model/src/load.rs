//! Building a [`LlamaForCausalLM`] from a weight source: a checkpoint reader or HF's random
//! initialiser, each frozen weight converted to its storage dtype (and cut to this rank's
//! shard) as soon as it is read.

use std::sync::Arc;

use burn::backend::libtorch::TchTensor;
use burn::module::Param;
use burn::tensor::{DType, Device, Distribution, Tensor, TensorData};

use crate::config::LlamaConfig;
use crate::llama::{Attention, BuildOptions, DecoderLayer, LlamaForCausalLM, Mlp, RmsNorm};
use crate::lora::LoraLinear;
use crate::precision::{FrozenWeight, LinearQuant, PrecisionSpec, Storage, StoredWeight, tch_device};
use crate::shard::WeightShard;

impl LlamaForCausalLM {
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
        // The modules that got adapters, for the pattern keys' check after the layers.
        let adapted = std::cell::RefCell::new(Vec::<String>::new());
        let linear = |weights: &mut WeightSource<'_>,
                      name: &str,
                      short: &str,
                      out: usize,
                      inp: usize|
         -> anyhow::Result<LoraLinear> {
            let module = name;
            let name = format!("{name}.weight");
            // Events before each piece of building, so that a hang's last line names its place.
            tracing::debug!(weight = %name, "model: loading a linear weight");
            let (mut layer, whole) = match stores {
                Some(spec) => {
                    let whole = weights.stored(&name, [out, inp], spec)?;
                    (LoraLinear::from_stored(FrozenWeight::Whole(whole.clone()), spec, device), Some((whole, spec)))
                }
                None => (LoraLinear::new(weights.get(&name, [out, inp])?, trainable), None),
            };
            if let Some(spec) = lora.filter(|s| s.targets(short) && s.adapts(module)) {
                let own = spec.module_spec(module)?;
                own.check_rank_fits(module, [out, inp])?;
                adapted.borrow_mut().push(module.to_string());
                // Before sharding: DoRA's initial magnitude is the whole weight's row norms.
                layer = layer.with_new_adapter(&own, device);
            }
            if let (Some((whole, spec)), Some(s)) = (whole, sharding) {
                let adapter = layer.lora.take();
                layer =
                    LoraLinear::from_stored(FrozenWeight::Sharded(Arc::new(WeightShard::new(whole, s))), spec, device);
                layer.lora = adapter;
            }
            Ok(layer)
        };
        if let Some(wanted) = lora.and_then(|s| s.layers.as_ref()) {
            let bad = wanted.iter().find(|&&l| l >= c.num_hidden_layers);
            anyhow::ensure!(
                bad.is_none(),
                "lora layers_to_transform names layer {} but the model has {} (0..{})",
                bad.copied().unwrap_or_default(),
                c.num_hidden_layers,
                c.num_hidden_layers
            );
        }
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for l in 0..c.num_hidden_layers {
            tracing::debug!(layer = l, of = c.num_hidden_layers, "model: building decoder layer");
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
        if let Some(spec) = lora {
            spec.check_patterns_used(&adapted.borrow())?;
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
        // A tied head is the embedding parameter itself: one table, trained (full fine-tuning)
        // by the sum of both uses' gradients, as torch's shared nn.Parameter is.
        let embed = table(weights, "model.embed_tokens.weight")?;
        let lm_head = if c.tie_word_embeddings { None } else { Some(table(weights, "lm_head.weight")?) };
        let mut model = Self {
            embed_tokens: Param::from_tensor(embed).set_require_grad(trainable),
            layers,
            norm: norm(weights, "model.norm.weight", d, c.rms_norm_eps, trainable)?,
            lm_head: lm_head.map(|t| Param::from_tensor(t).set_require_grad(trainable)),
            config: c.clone(),
            activations: DType::F32,
            rope_cache: Default::default(),
        };
        if let Some(spec) = precision {
            model.set_precision(spec)?;
        }
        Ok(model)
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
        tracing::debug!(tensor = name, ?dims, "model: converting a weight to its storage dtype");
        let stored = LinearQuant::store_weight(spec, &values, dims, device).unwrap_or_else(|| {
            let t = tch::Tensor::from_slice(&values).reshape([dims[0] as i64, dims[1] as i64]).to_device(device);
            StoredWeight::F32(TchTensor::new(t))
        });
        drop(values);
        crate::device::release_free_memory();
        Ok(stored)
    }
}
