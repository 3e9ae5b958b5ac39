//! A config turned into the [`Shape`] the plan works on.

use super::*;

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
    // A sliding window across context-parallel chunks would need the band in the K/V exchange.
    if let Some(w) = model.family.sliding_window.filter(|&w| w < config.data.max_seq_len)
        && config.train.context_parallel > 1
    {
        anyhow::bail!(
            "the model's sliding_window = {w} is shorter than data.max_seq_len = {}: under context parallelism \
             (train.context_parallel = {}) llora runs full causal attention only; set train.context_parallel = 1 \
             or data.max_seq_len <= {w}",
            config.data.max_seq_len,
            config.train.context_parallel
        );
    }
    // What training would refuse of the adapters, the plan refuses too (and before it, a run).
    if config.model.trainable == crate::config::Trainable::Lora {
        config.lora.check_for_model(&model)?;
    }
    Ok(Shape {
        model,
        lora: config.lora.clone(),
        precision: config.precision_spec(),
        // A preference micro-batch of P pairs is 2P rows (chosen, rejected) through the policy;
        // the reference's forward (adapters off, no autodiff) frees each block's activations as
        // it goes, below the policy's saved ones.
        micro_batch: config.train.micro_batch_size
            * if config.train.objective == crate::config::Objective::Dpo { 2 } else { 1 },
        seq_len: config.data.max_seq_len,
        // Every position may have a target (the plan must hold for the worst batch).
        target_fraction: 1.0,
        recompute_layers: config.train.recompute_layers,
        shard_frozen_weights: config.train.shard_frozen_weights,
        full_fine_tuning: config.model.trainable == crate::config::Trainable::All,
        frozen_reference: config.train.objective == crate::config::Objective::Dpo && config.lora.init_from.is_some(),
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
