//! Preference tuning's reference computed before training (`dpo.precompute_reference`, TRL's
//! `precompute_ref_log_probs`): one forward pass over every pair, the loss sums kept in each
//! pair and cached beside `data.train`, so that a step runs the policy alone.

use std::path::{Path, PathBuf};

use burn::tensor::Device;
use llora_data::preference::{Pair, eval_pair_batches};
use llora_model::LlamaForCausalLM;
use tracing::info;

use crate::config::Config;
use crate::dist::{Collective, Dist, ReduceOp};
use crate::engine::step::upload;

/// The reference's loss sums of every pair of `train` and `eval`: read from the cache when one
/// was made by the same inputs, else computed here and cached by the main rank. The ranks
/// share the pass out as evaluation does (batches of `eval.batch_size` pairs, batch j to rank
/// j mod world, so each batch is the one a single process forms) and sum what each computed.
pub(super) fn precompute(
    config: &Config,
    model: &LlamaForCausalLM,
    reference: &llora_model::Reference,
    (train, eval): (&mut [Pair], &mut [Pair]),
    device: &Device,
    dist: &Dist,
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
    let share = (dist.comm.rank(), dist.comm.world_size());
    let mut mine = 0;
    for pairs in [&mut *train, &mut *eval] {
        mine += sums_of(model, reference, pairs, config.eval.batch_size, device, share)?;
    }
    share_out(dist.comm.as_ref(), [&mut *train, &mut *eval])?;
    // A pair left without sums would silently fall back to the reference forward in its steps.
    if let Some(i) = train.iter().chain(eval.iter()).position(|p| p.reference.is_none()) {
        anyhow::bail!(
            "the reference's sums of pair {i} (train, then eval) came from no rank: a bug in sharing the pass out"
        );
    }
    info!(
        pairs = train.len() + eval.len(),
        this_rank = mine,
        seconds = format!("{:.1}", t.elapsed().as_secs_f64()),
        "reference log-probabilities computed"
    );
    if let (Some(path), true) = (&cache, dist.is_main()) {
        let list = |pairs: &[Pair]| pairs.iter().map(|p| p.reference.expect("computed")).collect::<Vec<_>>();
        let json = serde_json::json!({"train": list(train), "eval": list(eval)});
        if let Err(e) = llora_model::checkpoint::write_atomic(path, json.to_string().as_bytes()) {
            tracing::warn!("cannot cache the reference log-probabilities in {}: {e:#}", path.display());
        }
    }
    Ok(())
}

/// Gives every rank every pair's sums: each rank holds those it computed (the others `None`),
/// and a sum over ranks of zeros and the one rank's values is those values exactly.
fn share_out(comm: &dyn Collective, sets: [&mut [Pair]; 2]) -> anyhow::Result<()> {
    if comm.world_size() == 1 {
        return Ok(());
    }
    let mut buf: Vec<f64> = sets.iter().flat_map(|s| s.iter()).flat_map(|p| p.reference.unwrap_or([0.0; 2])).collect();
    comm.all_reduce_f64(&mut buf, ReduceOp::Sum)?;
    for (pair, s) in sets.into_iter().flat_map(|s| s.iter_mut()).zip(buf.chunks_exact(2)) {
        pair.reference = Some([s[0], s[1]]);
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

/// The reference's loss sums of this rank's share of `pairs` (batches of `batch` pairs, batch
/// j to rank j mod world), stored in those pairs; the others are left `None`. Returns how many
/// pairs it computed.
fn sums_of(
    model: &LlamaForCausalLM,
    reference: &llora_model::Reference,
    pairs: &mut [Pair],
    batch: usize,
    device: &Device,
    (rank, world): (usize, usize),
) -> anyhow::Result<usize> {
    for pair in pairs.iter_mut() {
        pair.reference = None;
    }
    let all = std::sync::Arc::new(pairs.to_vec());
    let padding = llora_data::batch::Padding::Longest;
    let batch = batch.max(1);
    let starts = (0..pairs.len()).step_by(batch).skip(rank).step_by(world);
    let mut mine = 0;
    for (collated, at) in eval_pair_batches(all, batch, (rank, world), padding, 0).zip(starts) {
        let n = collated.batch / 2;
        let mb = upload(collated, device);
        let sums = model.reference_loss(mb.ids, mb.labels, reference)?;
        let host = llora_model::device::to_host(sums).convert::<f64>().try_into_vec::<f64>().expect("f64");
        for (i, pair) in pairs[at..at + n].iter_mut().enumerate() {
            pair.reference = Some([host[i], host[n + i]]);
        }
        mine += n;
    }
    Ok(mine)
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
