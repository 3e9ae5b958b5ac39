//! Building a [`LlamaForCausalLM`] from a weight source: a checkpoint reader or HF's random
//! initialiser, each frozen weight converted to its storage dtype (and cut to this rank's
//! shard) as soon as it is read.

use std::sync::Arc;

use burn::backend::libtorch::TchTensor;
use burn::module::Param;
use burn::tensor::{DType, Device, Distribution, Tensor, TensorData};

use crate::config::LlamaConfig;
use crate::layout::BlockLinear;
use crate::llama::{BlockWeights, BuildOptions, DecoderLayer, LlamaForCausalLM, RmsNorm};
use crate::lora::{LoraLinear, LoraSpec};
use crate::precision::{FrozenWeight, PrecisionSpec, StoredWeight, tch_device};
use crate::shard::{Sharding, WeightShard};

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
        let trainable = opts.trainable;
        // The targets as this checkpoint's modules: a name that matches nothing is an error here,
        // not a model without adapters that fails in backward.
        let resolved = opts.lora.map(|s| s.for_layout(c.fused_qkv)).transpose()?;
        if let (Some(asked), Some(got)) = (opts.lora, &resolved)
            && asked.targets != got.targets
        {
            tracing::info!(asked = ?asked.targets, adapted = ?got.targets, "LoRA targets resolved for this checkpoint's layout");
        }
        let lora = resolved.as_ref();
        check_options(c, opts, lora, device)?;
        let mut blocks = Loader::new(c, opts, lora, device, weights);
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for l in 0..c.num_hidden_layers {
            tracing::debug!(layer = l, of = c.num_hidden_layers, "model: building decoder layer");
            layers.push(DecoderLayer::load(c, l, &mut blocks)?);
        }
        if let Some(spec) = lora {
            spec.check_patterns_used(&blocks.adapted)?;
        }
        // A frozen table is cast to the activations' dtype as soon as it is read, and its f32
        // buffer returned to the kernel: otherwise the allocator keeps the two f32 tables'
        // pages resident through training (docs/performance.md, M10).
        let table_dtype =
            opts.precision.as_ref().filter(|_| !trainable).map(|p| p.activation_dtype()).filter(|&t| t != DType::F32);
        let mut table = |name: &str| -> anyhow::Result<Param<Tensor<2>>> {
            let t = blocks.weights.get(name, [c.vocab_size, c.hidden_size])?;
            let t = match table_dtype {
                Some(dtype) => {
                    let cast = t.cast(dtype);
                    crate::device::release_free_memory();
                    cast
                }
                None => t,
            };
            Ok(Param::from_tensor(t).set_require_grad(trainable))
        };
        // A tied head is the embedding parameter itself: one table, trained (full fine-tuning)
        // by the sum of both uses' gradients, as torch's shared nn.Parameter is.
        let embed_tokens = table("model.embed_tokens.weight")?;
        let lm_head = if c.tie_word_embeddings { None } else { Some(table("lm_head.weight")?) };
        let mut model = Self {
            embed_tokens,
            layers,
            norm: blocks.norm("model.norm.weight", config.hidden_size)?,
            lm_head,
            config: c.clone(),
            activations: DType::F32,
            rope_cache: Default::default(),
            context: None,
        };
        if let Some(spec) = &opts.precision {
            model.set_precision(spec)?;
        }
        Ok(model)
    }
}

/// Refuses build options that contradict each other or the model, before any tensor is read.
fn check_options(
    c: &LlamaConfig,
    opts: &BuildOptions<'_>,
    lora: Option<&LoraSpec>,
    device: &Device,
) -> anyhow::Result<()> {
    if let Some(spec) = &opts.precision {
        spec.validate().map_err(anyhow::Error::msg)?;
    }
    if opts.sharding.is_some() {
        anyhow::ensure!(!opts.trainable, "train.shard_frozen_weights = true needs frozen base weights (LoRA)");
        anyhow::ensure!(
            opts.precision.is_some() && tch_device(device).is_some(),
            "train.shard_frozen_weights = true needs a LibTorch device (cpu or cuda)"
        );
    }
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
    Ok(())
}

/// Builds each block's parts from a weight source as the build options ask: frozen weights
/// stored (and sharded) as read, adapters on the targeted modules.
struct Loader<'w, 'a, 'o> {
    config: &'o LlamaConfig,
    lora: Option<&'o LoraSpec>,
    trainable: bool,
    /// The precision frozen weights are stored in as they are read, if they are.
    stores: Option<&'o PrecisionSpec>,
    sharding: Option<&'o Sharding>,
    device: &'o Device,
    weights: &'w mut WeightSource<'a>,
    /// The modules that got adapters, for the pattern keys' check after the layers.
    adapted: Vec<String>,
}

impl<'w, 'a, 'o> Loader<'w, 'a, 'o> {
    fn new(
        config: &'o LlamaConfig,
        opts: &'o BuildOptions<'_>,
        lora: Option<&'o LoraSpec>,
        device: &'o Device,
        weights: &'w mut WeightSource<'a>,
    ) -> Self {
        let (trainable, sharding) = (opts.trainable, opts.sharding.as_ref());
        let stores = opts.precision.as_ref().filter(|p| {
            !trainable && (p.stores_frozen_weights() || sharding.is_some()) && tch_device(device).is_some()
        });
        Self { config, lora, trainable, stores, sharding, device, weights, adapted: Vec::new() }
    }
}

impl BlockWeights for Loader<'_, '_, '_> {
    fn linear(&mut self, layer: usize, kind: BlockLinear) -> anyhow::Result<LoraLinear> {
        let (module, shape) = (kind.path(layer), kind.shape(self.config));
        let name = format!("{module}.weight");
        // Events before each piece of building, so that a hang's last line names its place.
        tracing::debug!(weight = %name, "model: loading a linear weight");
        let (mut linear, whole) = match self.stores {
            Some(spec) => {
                let whole = self.weights.stored(&name, shape, spec)?;
                (LoraLinear::from_stored(FrozenWeight::Whole(whole.clone()), spec), Some(whole))
            }
            None => (LoraLinear::new(self.weights.get(&name, shape)?, self.trainable), None),
        };
        if kind.has_bias(&self.config.family) {
            let bias = self.weights.get::<1>(&format!("{module}.bias"), [shape[0]])?;
            linear = linear.with_bias(bias, self.trainable);
        }
        if let Some(spec) = self.lora.filter(|s| s.targets(kind.name()) && s.adapts(&module)) {
            let own = spec.module_spec(&module)?;
            own.check_rank_fits(&module, shape)?;
            self.adapted.push(module);
            // Before sharding: DoRA's initial magnitude is the whole weight's row norms.
            linear = linear.with_new_adapter(&own, self.device);
        }
        if let (Some(whole), Some(s)) = (whole, self.sharding) {
            // Only the weight is cut to this rank's slice: the bias, the adapter and the
            // layer's precision state stay as they are.
            let shard = FrozenWeight::Sharded(Arc::new(WeightShard::new(whole, s)));
            linear.weight = crate::lora::BaseWeight::Stored(burn::module::Ignored(shard));
        }
        Ok(linear)
    }

    fn norm(&mut self, name: &str, width: usize) -> anyhow::Result<RmsNorm> {
        let w = self.weights.get::<1>(name, [width])?;
        Ok(RmsNorm { weight: Param::from_tensor(w).set_require_grad(self.trainable), eps: self.config.rms_norm_eps })
    }
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
            // HF's initialisation: norm gains 1, biases 0, weights N(0, 0.02).
            return Ok(if name.ends_with("norm.weight") {
                Tensor::ones(shape, &self.device)
            } else if name.ends_with(".bias") {
                Tensor::zeros(shape, &self.device)
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
        if self.fetch.is_none() && spec.nf4.is_none() && crate::routes::takes_cuda_routes(device) {
            // Drawn and converted on the device: through the host (each f32 weight read back,
            // converted in chunks, sent again) the random 70B took ~9 s a layer on an H200.
            // NF4's quantiser runs on the host: it takes the path below.
            let w = tch::Tensor::empty([dims[0] as i64, dims[1] as i64], (tch::Kind::Float, device)).normal_(0.0, 0.02);
            tracing::debug!(tensor = name, ?dims, "model: converting a weight to its storage dtype");
            return Ok(match StoredWeight::store_on_device(spec, &w) {
                Some(stored) => stored,
                None => StoredWeight::F32(TchTensor::new(w)),
            });
        }
        let data = match self.fetch.as_mut() {
            Some(fetch) => Self::fetch(fetch, name, &dims)?,
            None => self.get(name, dims)?.into_data(),
        };
        let values = data.into_vec::<f32>().map_err(|e| anyhow::anyhow!("tensor {name}: {e:?}"))?;
        tracing::debug!(tensor = name, ?dims, "model: converting a weight to its storage dtype");
        let stored = StoredWeight::store(spec, &values, dims, device).unwrap_or_else(|| {
            let t = tch::Tensor::from_slice(&values).reshape([dims[0] as i64, dims[1] as i64]).to_device(device);
            StoredWeight::F32(TchTensor::new(t))
        });
        drop(values);
        crate::device::release_free_memory();
        Ok(stored)
    }
}
