//! The named steps of [`Trainer::setup`](crate::engine::trainer::Trainer::setup), everything
//! before the first step in the result log's order: the device, the preflight checks, the
//! batch geometry, the model and its adapters (or the checkpoint's state) with warm-up, the
//! data and its batches.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Context;
use burn::tensor::{Device, Int, Tensor};
use llora_data::Sample;
use llora_data::batch::{Geometry, RowOrder, StepBatch, train_batches};
use llora_data::loader::SampleOrder;
use llora_data::packing::PackedOrder;
use llora_data::parquet_io::{ReadOptions, read_parquet};
use llora_data::preference::{Pair, pair_batches, read_pairs, synthetic_pairs};
use llora_data::prefetch::Prefetched;
use llora_data::synth::{Synth, SynthConfig};
use llora_model::checkpoint::HfCheckpoint;
use llora_model::shard::Sharding;
use llora_model::{BuildOptions, LlamaConfig, LlamaForCausalLM, LoraSpec};
use tracing::info;

use crate::config::{Config, Objective, Trainable};
use crate::dist::Dist;
use crate::engine::events::RunEvent;
use crate::engine::optim::AdamW;
use crate::engine::resume::{self, Checkpoint, TrainState};

/// The peak MFU is measured against: `logging.peak_tflops` when set, else on a CUDA device the
/// dense bf16 peak of a GPU llora knows by name (logged once on the main rank).
pub(super) fn peak_tflops(config: &Config, device: &llora_model::device::DeviceSpec, main: bool) -> Option<f64> {
    if config.logging.peak_tflops > 0.0 {
        return Some(config.logging.peak_tflops);
    }
    let llora_model::device::DeviceSpec::Cuda(index) = device else { return None };
    let name = crate::flops::gpu_name(*index)?;
    let found = crate::flops::gpu_peak_tflops(&name);
    if main {
        match found {
            Some((bf16, fp8)) => {
                info!(gpu = %name, bf16_tflops = bf16, fp8_tflops = fp8, "MFU against the GPU's dense bf16 peak")
            }
            None => info!(gpu = %name, "no known peak for this GPU: set logging.peak_tflops for an MFU column"),
        }
    }
    found.map(|(bf16, _)| bf16)
}

/// Starts this rank's device and says what runs where (main rank).
pub(super) fn start_device(
    config: &Config,
    name: &str,
    dist: &Dist,
) -> anyhow::Result<(llora_model::device::DeviceSpec, Device)> {
    let (world, comm) = (&dist.world, dist.comm.as_ref());
    let device_spec = dist.device(config.run.device)?;
    let device = device_spec
        .init(config.run.threads)
        .with_context(|| format!("cannot start on run.device = \"{}\" (rank {})", config.run.device, world.rank))?;
    if dist.is_main() {
        info!(
            config = name,
            backend = %device_spec.backend_name(),
            device = %device_spec,
            threads = device_spec.effective_threads(config.run.threads),
            ranks = world.size,
            collectives = comm.backend(),
            "llora {} starting",
            env!("CARGO_PKG_VERSION")
        );
    }
    Ok((device_spec, device))
}

/// How a global batch splits over the ranks and their micro-batches.
///
/// `(rank, world)` is this rank's data-parallel share: under context parallelism the ranks of
/// one group read the same sequences.
pub(super) fn geometry(config: &Config, (rank, world): (usize, usize)) -> anyhow::Result<Geometry> {
    let t = &config.train;
    let g = Geometry { global: t.global_batch_size, micro: t.micro_batch_size, rank, world };
    let ranks = if t.context_parallel > 1 { "data-parallel groups (ranks / train.context_parallel)" } else { "ranks" };
    let per_step = crate::plan::checked_product(&[("train.micro_batch_size", g.micro), (ranks, g.world)])?;
    anyhow::ensure!(
        g.global.is_multiple_of(per_step),
        "train.global_batch_size = {} must be a multiple of train.micro_batch_size × ranks = {} × {} = {per_step}",
        g.global,
        g.micro,
        g.world,
    );
    Ok(g)
}

/// The model with its adapters and the state training starts from: the checkpoint's, or fresh
/// after the warm-up passes (from `lora.init_from` when set). Also the preference objective's
/// reference: the adapters `lora.init_from` holds, frozen, else the base.
pub(super) fn ready_model(
    config: &Config,
    spec: &LoraSpec,
    dist: &Dist,
    resumed: Option<Checkpoint>,
    device: &Device,
    train_device: &Device,
) -> anyhow::Result<(LlamaForCausalLM, TrainState, llora_model::Reference)> {
    let sharding = dist.sharding(config.train.shard_frozen_weights);
    let mut model = load_model(config, spec, sharding, train_device)?;
    model.context = dist.context_parallel();
    let mut reference = llora_model::Reference::Base;
    let mut print = None;
    if let Some(dir) = &spec.init_from {
        // Read before a checkpoint's state: a resumed run's reference is the same frozen copy.
        llora_model::peft::load_adapter_values(&mut model, dir, train_device)
            .with_context(|| format!("lora.init_from = {}", dir.display()))?;
        if config.train.objective == Objective::Dpo {
            reference = llora_model::Reference::Adapters(Arc::new(model.frozen_trainable_values()));
            print = Some(reference_print(dir, resumed.as_ref())?);
        }
    }
    info!(
        base_parameters = model.config.num_parameters(),
        lora_parameters = model.num_lora_parameters(),
        base_weight_mb = model.base_weight_bytes() >> 20,
        frozen_weights = if model.is_sharded() { "sharded" } else { "replicated" },
        "model ready"
    );
    let progress = resume::Progress { reference_adapter: print, ..Default::default() };
    let mut state = TrainState { progress, optim: AdamW::new(config.optim.clone()) };
    match resumed {
        Some(mut ckpt) => ckpt.restore(&mut model, &mut state, device)?,
        None => {
            // Warm-up passes must not leave amaxes of random tokens in the scaling state.
            let scales = model.fp8_scales();
            warm_up(&model, config, train_device)?;
            model.set_fp8_scales(&scales)?;
        }
    }
    Ok((model, state, reference))
}

/// The fingerprint of the adapter in `dir`, the frozen reference of preference tuning; a
/// resumed run's must be the one its checkpoint recorded.
fn reference_print(dir: &std::path::Path, resumed: Option<&Checkpoint>) -> anyhow::Result<String> {
    let file = dir.join("adapter_model.safetensors");
    let print = crate::dist::data_fingerprint(&file).with_context(|| format!("lora.init_from: {}", file.display()))?;
    if let Some(recorded) = resumed.and_then(|c| c.progress.reference_adapter.as_ref()) {
        anyhow::ensure!(
            *recorded == print,
            "lora.init_from = {}: the adapter changed since the run started (it is the frozen reference of \
             preference tuning, and the checkpoint's steps were taken against the one it was): put that \
             adapter back, or start a new run",
            dir.display()
        );
    }
    Ok(print)
}

/// The datasets' sizes in the schedule's unit: documents (or pairs), or packed rows (the
/// training set packed in file order; the shuffled epochs' rows differ by a few).
pub(super) fn data_event(config: &Config, data: &Data) -> RunEvent<'static> {
    let data = match data {
        Data::Samples(d) => d,
        Data::Pairs { train, eval } => {
            return RunEvent::Data { train: train.len(), eval: eval.len(), packed_documents: None };
        }
    };
    let (train, eval) = (data.train.len(), data.eval.len());
    let Some(packing) = config.data.packing() else { return RunEvent::Data { train, eval, packed_documents: None } };
    let rows = |set: &[Sample]| {
        let lengths: Vec<usize> = set.iter().map(|s| s.input_ids.len()).collect();
        llora_data::packing::stats(&lengths, packing).rows
    };
    RunEvent::Data { train: rows(&data.train), eval: rows(&data.eval), packed_documents: Some((train, eval)) }
}

/// The training stream from where `progress` stands: one global order for every rank, each
/// taking its micro-batches of every global batch; packed into rows when the config packs.
pub(super) fn batches(
    config: &Config,
    data: &Data,
    progress: &resume::Progress,
    geometry: Geometry,
    fresh: bool,
) -> anyhow::Result<Prefetched<StepBatch>> {
    let position = progress.position;
    let len = match data {
        Data::Samples(d) => d.train.len(),
        Data::Pairs { train, .. } => train.len(),
    };
    let order = SampleOrder::new(len, config.run.seed, true, position).with_context(|| {
        let source = config.data.train.as_ref().map_or("data.synthetic".into(), |p| p.display().to_string());
        let n = len;
        match fresh {
            true => format!("the training data ({source}: {n} samples)"),
            false => format!(
                "the training data ({source}: {n} samples) does not fit the checkpoint's data position (epoch {}, \
                 sample {}): was the file changed since the run started?",
                position.epoch, position.index
            ),
        }
    })?;
    let padding = config.data.padding.padding(config.data.max_seq_len);
    let data = match data {
        Data::Samples(d) => d,
        Data::Pairs { train, .. } => {
            let order = RowOrder::Samples(order);
            return Ok(pair_batches(train.clone(), order, geometry, padding, config.data.train_workers));
        }
    };
    let order = match config.data.packing() {
        None => RowOrder::Samples(order),
        Some(packing) => {
            let lengths = Arc::new(data.train.iter().map(|s| s.input_ids.len()).collect());
            RowOrder::Packed(PackedOrder::new(order, lengths, packing, position.packed_rows)?)
        }
    };
    Ok(train_batches(data.train.clone(), order, geometry, padding, config.data.train_workers))
}

/// The training and evaluation sets.
pub(super) struct Datasets {
    pub(super) train: Arc<Vec<Sample>>,
    pub(super) eval: Arc<Vec<Sample>>,
}

/// What a run trains on: samples, or preference pairs (`train.objective = "dpo"`).
pub(super) enum Data {
    /// Supervised samples.
    Samples(Datasets),
    /// Preference pairs.
    Pairs {
        /// Training pairs.
        train: Arc<Vec<Pair>>,
        /// Held-out pairs.
        eval: Arc<Vec<Pair>>,
    },
}

/// The run's data: [`load_datasets`], or the preference pairs of `data.train` / `data.eval`
/// (prepared parquet, `llora_data::preference`'s schema) or of `data.synthetic`.
pub(super) fn load_data(config: &Config, vocab: usize) -> anyhow::Result<Data> {
    if config.train.objective != Objective::Dpo {
        return Ok(Data::Samples(load_datasets(config, vocab)?));
    }
    let d = &config.data;
    if let Some(syn) = &d.synthetic {
        let synth = Synth::new(synth_config(d, syn, vocab)).context("data.synthetic")?;
        let (train, eval) =
            (synthetic_pairs(&synth, 0, syn.train_samples), synthetic_pairs(&synth, 1, syn.eval_samples));
        return Ok(Data::Pairs { train: Arc::new(train), eval: Arc::new(eval) });
    }
    let opts = ReadOptions { vocab, max_seq_len: d.max_seq_len, on_bad_row: d.on_bad_row };
    let read = |p: &Option<PathBuf>, key: &str| -> anyhow::Result<Vec<Pair>> {
        let path = p.as_ref().with_context(|| format!("{key} is not set"))?;
        let (pairs, _) = read_pairs(path, &opts)?;
        anyhow::ensure!(!pairs.is_empty(), "{key} = {}: no usable pairs", path.display());
        Ok(pairs)
    };
    Ok(Data::Pairs { train: Arc::new(read(&d.train, "data.train")?), eval: Arc::new(read(&d.eval, "data.eval")?) })
}

/// The data crate's corpus settings of `data.synthetic`.
fn synth_config(d: &crate::config::DataConfig, syn: &crate::config::SyntheticConfig, vocab: usize) -> SynthConfig {
    SynthConfig {
        vocab,
        max_seq_len: d.max_seq_len,
        topics: syn.topics,
        summary_len: syn.summary_len,
        copy_len: syn.copy_len,
        seed: syn.seed,
    }
}

pub(super) fn load_datasets(config: &Config, vocab: usize) -> anyhow::Result<Datasets> {
    let d = &config.data;
    if let Some(syn) = &d.synthetic {
        let synth = Synth::new(synth_config(d, syn, vocab)).context("data.synthetic")?;
        return Ok(Datasets {
            train: Arc::new(synth.samples(0, syn.train_samples)),
            eval: Arc::new(synth.samples(1, syn.eval_samples)),
        });
    }
    let opts = ReadOptions { vocab, max_seq_len: d.max_seq_len, on_bad_row: d.on_bad_row };
    let read = |p: &Option<PathBuf>, key: &str| -> anyhow::Result<Vec<Sample>> {
        let path = p.as_ref().with_context(|| format!("{key} is not set"))?;
        let (rows, _) = read_parquet(path, &opts)?;
        anyhow::ensure!(!rows.is_empty(), "{key} = {}: no usable rows", path.display());
        Ok(rows)
    };
    Ok(Datasets { train: Arc::new(read(&d.train, "data.train")?), eval: Arc::new(read(&d.eval, "data.eval")?) })
}

/// The base model with adapters, from a checkpoint or a preset.
pub(crate) fn load_model(
    config: &Config,
    spec: &LoraSpec,
    sharding: Option<Sharding>,
    device: &Device,
) -> anyhow::Result<LlamaForCausalLM> {
    let full = config.model.trainable == Trainable::All;
    let opts = BuildOptions {
        lora: (!full).then_some(spec),
        trainable: full,
        precision: Some(config.precision_spec()),
        sharding,
    };
    match &config.model.path {
        Some(path) => {
            let ckpt = HfCheckpoint::open(path).with_context(|| format!("model.path = {}", path.display()))?;
            if let Some(preset) = &config.model.preset {
                let differ = preset_differences(&ckpt.config, &LlamaConfig::preset(preset)?);
                anyhow::ensure!(
                    differ.is_empty(),
                    "model.path {} is not a {preset} checkpoint: its config.json has {}; drop model.preset to \
                     train the checkpoint as it is, or point model.path at a {preset} checkpoint",
                    path.display(),
                    differ.join(", ")
                );
            }
            ckpt.load_model(&opts, device)
        }
        None => {
            let preset = config.model.preset.as_deref().expect("validated: path or preset");
            LlamaForCausalLM::random(&LlamaConfig::preset(preset)?, &opts, device)
        }
    }
}

/// The dimensions in which a checkpoint's architecture differs from a preset's, each as
/// "key got (preset: want)".
fn preset_differences(got: &LlamaConfig, want: &LlamaConfig) -> Vec<String> {
    [
        ("hidden_size", got.hidden_size, want.hidden_size),
        ("num_hidden_layers", got.num_hidden_layers, want.num_hidden_layers),
        ("num_attention_heads", got.num_attention_heads, want.num_attention_heads),
        ("num_key_value_heads", got.num_key_value_heads, want.num_key_value_heads),
    ]
    .into_iter()
    .filter(|(_, g, w)| g != w)
    .map(|(key, g, w)| format!("{key} {g} (the preset: {w})"))
    .collect()
}

/// Forward + backward passes on random tokens of the run's shape, then the gradients are
/// dropped: the adapters, the optimizer and the data order are untouched.
fn warm_up(model: &LlamaForCausalLM, config: &Config, device: &Device) -> anyhow::Result<()> {
    let (b, s) = (config.train.micro_batch_size, config.data.max_seq_len);
    for _ in 0..config.train.warmup_batches {
        let ids = Tensor::<2, Int>::random(
            [b, s],
            burn::tensor::Distribution::Uniform(0.0, model.config.vocab_size as f64),
            device,
        );
        let labels = ids.clone();
        // The step's own path (block-wise when recomputing or sharded), so the warm-up
        // allocates what the steps will.
        let at = (1.0, config.train.recompute_layers);
        drop(model.recomputed_backward(ids, labels, None, at, || (), llora_model::Segments::plain())?);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A checkpoint that is not the preset is named by the dimension that differs, with both
    /// values; the ones that match are not listed.
    #[test]
    fn a_preset_mismatch_names_the_dimension_that_differs() {
        let want = LlamaConfig::preset("tiny").unwrap();
        assert!(preset_differences(&want, &want).is_empty());
        let got = LlamaConfig { num_hidden_layers: want.num_hidden_layers + 2, ..want.clone() };
        let differ = preset_differences(&got, &want);
        let expected = format!("num_hidden_layers {} (the preset: {})", got.num_hidden_layers, want.num_hidden_layers);
        assert_eq!(differ, vec![expected]);
    }
}
