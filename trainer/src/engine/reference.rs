//! Preference tuning's reference computed before training (`dpo.precompute_reference`, TRL's
//! `precompute_ref_log_probs`): one forward pass over every pair, the loss sums kept in each
//! pair and cached beside `data.train`, so that a step runs the policy alone.

use std::path::{Path, PathBuf};

use burn::tensor::Device;
use llora_data::preference::{Pair, eval_pair_batches};
use llora_model::LlamaForCausalLM;
use tracing::info;

use crate::config::Config;
use crate::engine::step::upload;

/// The reference's loss sums of every pair of `train` and `eval`: read from the cache when one
/// was made by the same inputs, else computed here (every rank computes them all, in batches of
/// `eval.batch_size` pairs) and cached by the main rank.
pub(super) fn precompute(
    config: &Config,
    model: &LlamaForCausalLM,
    reference: &llora_model::Reference,
    (train, eval): (&mut [Pair], &mut [Pair]),
    device: &Device,
    main: bool,
) -> anyhow::Result<()> {
    let cache = cache_path(config)?;
    if let Some(path) = &cache
        && let Ok(text) = std::fs::read_to_string(path)
    {
        let cached: serde_json::Value = serde_json::from_str(&text)?;
        if fill(train, &cached["train"]) && fill(eval, &cached["eval"]) {
            info!(cache = %path.display(), "reference log-probabilities read from the cache");
            return Ok(());
        }
    }
    let t = std::time::Instant::now();
    for pairs in [&mut *train, &mut *eval] {
        sums_of(model, reference, pairs, config.eval.batch_size, device)?;
    }
    info!(
        pairs = train.len() + eval.len(),
        seconds = format!("{:.1}", t.elapsed().as_secs_f64()),
        "reference log-probabilities computed"
    );
    if let (Some(path), true) = (&cache, main) {
        let list = |pairs: &[Pair]| pairs.iter().map(|p| p.reference.expect("computed")).collect::<Vec<_>>();
        let json = serde_json::json!({"train": list(train), "eval": list(eval)});
        if let Err(e) = llora_model::checkpoint::write_atomic(path, json.to_string().as_bytes()) {
            tracing::warn!("cannot cache the reference log-probabilities in {}: {e:#}", path.display());
        }
    }
    Ok(())
}

/// Sets each pair's reference from `cached` (a list of `[chosen, rejected]`), when it holds
/// one for every pair.
fn fill(pairs: &mut [Pair], cached: &serde_json::Value) -> bool {
    let Ok(sums) = serde_json::from_value::<Vec<[f64; 2]>>(cached.clone()) else { return false };
    if sums.len() != pairs.len() {
        return false;
    }
    for (pair, s) in pairs.iter_mut().zip(sums) {
        pair.reference = Some(s);
    }
    true
}

/// The reference's loss sums of `pairs`, in batches of `batch` pairs, stored in each pair.
fn sums_of(
    model: &LlamaForCausalLM,
    reference: &llora_model::Reference,
    pairs: &mut [Pair],
    batch: usize,
    device: &Device,
) -> anyhow::Result<()> {
    let all = std::sync::Arc::new(pairs.to_vec());
    let padding = llora_data::batch::Padding::Longest;
    let mut at = 0;
    for collated in eval_pair_batches(all, batch, (0, 1), padding, 0) {
        let n = collated.batch / 2;
        let mb = upload(collated, device);
        let sums = model.reference_loss(mb.ids, mb.labels, reference)?;
        let host = llora_model::device::to_host(sums).convert::<f64>().try_into_vec::<f64>().expect("f64");
        for (i, pair) in pairs[at..at + n].iter_mut().enumerate() {
            pair.reference = Some([host[i], host[n + i]]);
        }
        at += n;
    }
    Ok(())
}

/// Where the cache of a run's inputs lives: beside `data.train`, named by a hash of what the
/// sums depend on (the data files, the checkpoint's files, the adapter training starts from,
/// the precision and the sequence length); `None` for synthetic pairs.
fn cache_path(config: &Config) -> anyhow::Result<Option<PathBuf>> {
    use sha2::{Digest, Sha256};
    let (Some(train), Some(eval)) = (&config.data.train, &config.data.eval) else { return Ok(None) };
    if config.data.synthetic.is_some() {
        return Ok(None);
    }
    let mut h = Sha256::new();
    let mut files = vec![train.clone(), eval.clone()];
    for dir in [config.model.path.as_ref(), config.lora.init_from.as_ref()].into_iter().flatten() {
        files.extend(inputs_in(dir)?);
    }
    for f in &files {
        let print = crate::dist::data_fingerprint(f).map_err(|e| anyhow::anyhow!("{}: {e}", f.display()))?;
        h.update(print.as_bytes());
    }
    h.update(format!("{:?} {}", config.precision_spec(), config.data.max_seq_len).as_bytes());
    let key: String = h.finalize().iter().take(8).map(|b| format!("{b:02x}")).collect();
    let name = format!("{}.llora-reference-{key}.json", train.file_name().unwrap_or_default().to_string_lossy());
    Ok(Some(train.with_file_name(name)))
}

/// The files of a checkpoint or adapter directory the reference depends on (JSON and
/// safetensors), sorted.
fn inputs_in(dir: &Path) -> anyhow::Result<Vec<PathBuf>> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| anyhow::anyhow!("{}: {e}", dir.display()))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "json" || x == "safetensors"))
        .collect();
    files.sort();
    Ok(files)
}
