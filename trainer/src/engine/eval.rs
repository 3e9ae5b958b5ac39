//! One evaluation pass over a set, sharded across the data-parallel ranks, its result the single
//! process's for any world size.

use std::sync::Arc;

use burn::tensor::{Device, Int, Tensor};
use llora_data::Sample;
use llora_data::batch::{Padding, eval_batches, eval_rows};
use llora_data::packing::Packing;
use llora_model::LlamaForCausalLM;

use crate::dist::{Collective, ReduceOp};
use crate::engine::step::upload;

/// An evaluation's losses over the whole set (all ranks).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EvalLoss {
    /// Mean over all target tokens.
    pub per_token: f64,
    /// Mean over samples of each sample's mean token loss.
    pub per_sample: f64,
    /// Target tokens evaluated.
    pub tokens: usize,
}

/// How an evaluation batches its set.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct EvalBatching {
    /// Rows per batch.
    pub batch_size: usize,
    /// Prefetch threads.
    pub workers: usize,
    /// What batches are padded to.
    pub padding: Padding,
    /// Samples packed into rows (in order), when set; each still counts as its own sample.
    pub packing: Option<Packing>,
}

/// Evaluation loss over `samples`, sharded across ranks: this rank's data-parallel group
/// `share.0` of `share.1` evaluates every `share.1`-th batch (prepared by `workers` threads) and
/// the sums are all-reduced, so the result is the single process's for any world size, also
/// when the set does not divide; packed or not, each sample's loss is its own (the per-sample
/// mean is MLPerf's metric either way). Under context parallelism the ranks of a group
/// evaluate the same batches, each summing its share of every sample's tokens; the group adds
/// the samples' sums up once, after the last batch, and its first rank counts them.
pub fn evaluate(
    model: &LlamaForCausalLM,
    samples: &Arc<Vec<Sample>>,
    how: EvalBatching,
    device: &Device,
    comm: &dyn Collective,
    share: (usize, usize),
) -> anyhow::Result<EvalLoss> {
    let rows = Arc::new(eval_rows(samples, how.packing));
    let batches = rows.len().div_ceil(how.batch_size.max(1));
    let layout = (how.padding, how.packing.is_some());
    // Each evaluated sample's (sum of token losses, target tokens), in batch order.
    let (mut loss_sums, mut tokens) = (Vec::<f32>::new(), Vec::<f32>::new());
    let mut mine = 0;
    for batch in eval_batches(samples.clone(), rows, how.batch_size, share, layout, how.workers) {
        mine += 1;
        let mb = upload(batch, device);
        let out = model.loss(mb.ids, mb.labels, mb.packed.as_ref(), false)?;
        llora_model::context_parallel::take_failure()?;
        loss_sums.extend(out.loss_sum.into_data().convert::<f32>().try_into_vec::<f32>().expect("f32"));
        tokens.extend(out.tokens.into_data().convert::<f32>().try_into_vec::<f32>().expect("f32"));
    }
    // Sharded weights are gathered by every rank for every forward: a rank with fewer batches
    // runs one-token forwards (discarded) until it has joined as many gathers as rank 0.
    let most = batches.div_ceil(share.1);
    if model.is_sharded() {
        for _ in mine..most {
            let token = Tensor::<2, Int>::zeros([1, 1], device);
            model.loss(token.clone(), token, None, false)?;
        }
    }
    if let Some(group) = model.context.as_ref().map(|cp| &cp.group).filter(|_| !loss_sums.is_empty()) {
        // The ranks of a group evaluated the same samples: one sum of the lists, same length.
        let n = loss_sums.len();
        let both = group.all_reduce_sum(&tch::Tensor::from_slice(&[loss_sums, tokens].concat()))?;
        let both = Vec::<f32>::try_from(&both)?;
        let counted = if group.rank() == 0 { 1.0 } else { 0.0 };
        loss_sums = both[..n].iter().map(|x| x * counted).collect();
        tokens = both[n..].iter().map(|x| x * counted).collect();
    }
    // [sum of token losses, target tokens, sum of per-sample mean losses]
    let mut sums = [0f64; 3];
    for (s, t) in loss_sums.iter().zip(&tokens) {
        sums[0] += *s as f64;
        sums[1] += *t as f64;
        sums[2] += *s as f64 / (*t as f64).max(1.0);
    }
    comm.all_reduce_f64(&mut sums, ReduceOp::Sum)?;
    Ok(EvalLoss {
        per_token: sums[0] / sums[1].max(1.0),
        per_sample: sums[2] / samples.len().max(1) as f64,
        tokens: sums[1] as usize,
    })
}

/// An evaluation over preference pairs (all ranks): the objective's loss and TRL's statistics,
/// each a mean over pairs.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PairEval {
    /// The objective's loss, mean over pairs.
    pub loss: f64,
    /// Rewards, accuracy, margin and log-probabilities, means over pairs.
    pub stats: llora_model::PairStats,
}

/// The preference objective over the evaluation `pairs`, sharded across ranks as [`evaluate`]
/// does (batch j on data-parallel group j mod groups; sums all-reduced): the single process's
/// result for any world size, against the objective's reference.
pub fn evaluate_pairs(
    model: &LlamaForCausalLM,
    pairs: &Arc<Vec<llora_data::preference::Pair>>,
    how: EvalBatching,
    objective: &llora_model::PreferenceObjective,
    (device, comm): (&Device, &dyn Collective),
    share: (usize, usize),
) -> anyhow::Result<PairEval> {
    let batches =
        llora_data::preference::eval_pair_batches(pairs.clone(), how.batch_size, share, how.padding, how.workers);
    // [the loss, then the statistics] times each batch's pairs, summed.
    let mut sums = [0f64; 7];
    for mut batch in batches {
        let n = (batch.batch / 2) as f64;
        let given = batch.reference.take();
        let objective = objective.for_batch(given.as_deref(), device);
        let mb = upload(batch, device);
        let reference = model.reference_loss(mb.ids.clone(), mb.labels.clone(), &objective.reference)?;
        let policy = model.loss(mb.ids, mb.labels, None, false)?;
        let (loss, s) = llora_model::preference_loss(&policy, &reference, &objective);
        let loss = f64::from(loss.into_scalar::<f32>());
        for (sum, v) in sums.iter_mut().zip(std::iter::once(loss).chain(s.values())) {
            *sum += v * n;
        }
    }
    comm.all_reduce_f64(&mut sums, ReduceOp::Sum)?;
    let means = sums.map(|s| s / pairs.len().max(1) as f64);
    let stats = llora_model::PairStats::from_values(std::array::from_fn(|i| means[i + 1]));
    Ok(PairEval { loss: means[0], stats })
}
