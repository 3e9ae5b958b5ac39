//! Preference tuning's objective (DPO and its variants, as TRL 1.16's `DPOTrainer` computes
//! them): from the summed log-probabilities of each pair's chosen and rejected completions
//! under the policy (the model with its adapters) and under the reference ([`Reference`]: the
//! same model with the adapters off, or with the adapters training started from, frozen), the
//! loss and the rewards TRL logs.
//!
//! A batch holds P pairs as 2P rows, the P chosen completions first, then the P rejected ones
//! in the same order (TRL concatenates them so: one forward for both).

use std::sync::Arc;

use burn::tensor::activation::{log_sigmoid, relu};
use burn::tensor::{Int, Tensor};

use crate::llama::LlamaForCausalLM;
use crate::lora::without_adapters;
use crate::loss::LossSums;
use crate::micro_step::{MicroBatch, MicroGrads, flat_grads};

/// One of TRL's DPO losses (`DPOConfig.loss_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PreferenceLoss {
    /// DPO: `−log σ(β·Δ)`, Δ the chosen log-ratio minus the rejected one.
    Sigmoid,
    /// SLiC's hinge: `max(0, 1 − β·Δ)`.
    Hinge,
    /// IPO: `(Δ̄ − 1/(2β))²`, Δ̄ with each log-ratio averaged over its completion's tokens (as TRL).
    Ipo,
    /// The chosen completions' negative log-likelihood per token (TRL's `"sft"`: an SFT term).
    Sft,
}

/// The reference policy the rewards are measured against.
#[derive(Debug, Clone, Default)]
pub enum Reference {
    /// The base: the same network with the adapters off (TRL with a fresh PEFT adapter).
    #[default]
    Base,
    /// The adapters training started from, frozen (TRL's "ref" copy of an existing adapter):
    /// each trainable parameter's value, flattened, in `trainable_params_mut` order, on the
    /// plain backend ([`LlamaForCausalLM::frozen_trainable_values`]).
    Adapters(Arc<Vec<Tensor<1>>>),
    /// One batch's reference loss sums, computed before training (TRL's
    /// `precompute_ref_log_probs`): `[2P]` f32, the batch's rows in order.
    Sums(Tensor<1>),
}

impl PreferenceObjective {
    /// This objective for one batch whose reference loss sums were computed before training
    /// (`sums`, a row each, [`Reference::Sums`]); itself when there are none.
    pub fn for_batch(&self, sums: Option<&[f64]>, device: &burn::tensor::Device) -> std::borrow::Cow<'_, Self> {
        match sums {
            None => std::borrow::Cow::Borrowed(self),
            Some(s) => {
                let values: Vec<f32> = s.iter().map(|&x| x as f32).collect();
                let t = Tensor::from_data(burn::tensor::TensorData::new(values, [s.len()]), device);
                std::borrow::Cow::Owned(Self { reference: Reference::Sums(t), ..self.clone() })
            }
        }
    }
}

impl PartialEq for Reference {
    /// The same reference: both the base, or the same frozen copy.
    fn eq(&self, other: &Self) -> bool {
        match (self, other) {
            (Self::Base, Self::Base) => true,
            (Self::Adapters(a), Self::Adapters(b)) => Arc::ptr_eq(a, b),
            (Self::Sums(a), Self::Sums(b)) => a.clone().equal(b.clone()).all().into_scalar::<bool>(),
            _ => false,
        }
    }
}

/// The objective: β, the losses summed with their weights (TRL's `loss_type` and
/// `loss_weights`) and the reference.
#[derive(Debug, Clone, PartialEq)]
pub struct PreferenceObjective {
    /// How far the policy may move from the reference (TRL's `beta`; IPO's τ).
    pub beta: f64,
    /// Each loss and its weight.
    pub losses: Vec<(PreferenceLoss, f64)>,
    /// What the policy is compared with.
    pub reference: Reference,
}

/// The means over the batch's pairs TRL logs (`rewards/chosen`, ..., `logps/rejected`).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PairStats {
    /// β · (policy − reference) log-probability of the chosen completions.
    pub rewards_chosen: f64,
    /// The same for the rejected completions.
    pub rewards_rejected: f64,
    /// The share of pairs whose chosen reward exceeds the rejected one.
    pub rewards_accuracy: f64,
    /// Chosen minus rejected reward.
    pub rewards_margin: f64,
    /// The policy's summed log-probability of the chosen completions.
    pub logps_chosen: f64,
    /// The same of the rejected completions.
    pub logps_rejected: f64,
}

/// The records' names of [`PairStats::values`] (TRL's `rewards/chosen` is `rewards_chosen`, ...).
const NAMES: [&str; 6] =
    ["rewards_chosen", "rewards_rejected", "rewards_accuracy", "rewards_margin", "logps_chosen", "logps_rejected"];

impl PairStats {
    /// The statistics in [`NAMES`]' order (what is summed over micro-batches and ranks).
    pub fn values(&self) -> [f64; 6] {
        [
            self.rewards_chosen,
            self.rewards_rejected,
            self.rewards_accuracy,
            self.rewards_margin,
            self.logps_chosen,
            self.logps_rejected,
        ]
    }

    /// The statistics from [`Self::values`]' order.
    pub fn from_values(
        [rewards_chosen, rewards_rejected, rewards_accuracy, rewards_margin, logps_chosen, logps_rejected]: [f64; 6],
    ) -> Self {
        Self { rewards_chosen, rewards_rejected, rewards_accuracy, rewards_margin, logps_chosen, logps_rejected }
    }

    /// Each statistic with the name the records use.
    pub fn named(&self) -> [(&'static str, f64); 6] {
        let v = self.values();
        std::array::from_fn(|i| (NAMES[i], v[i]))
    }
}

/// The objective's loss over a batch of pairs, and its statistics.
///
/// `policy` is the rows' loss sums (−Σ log p over each completion's target tokens, and their
/// counts: [`crate::LlamaForCausalLM::loss`]), `reference` the reference's loss sums; the
/// reference carries no gradient (computed without autodiff, or detached). The loss is a mean
/// over pairs, as TRL's.
///
/// # Shapes
/// - policy, reference: `[2P]` (chosen rows, then rejected rows), f32; output: `[1]`, f32
pub fn preference_loss(
    policy: &LossSums,
    reference: &Tensor<1>,
    objective: &PreferenceObjective,
) -> (Tensor<1>, PairStats) {
    let rows = policy.loss_sum.dims()[0];
    let pairs = rows / 2;
    let half = |t: &Tensor<1>, at: usize| t.clone().narrow(0, at, pairs);
    let logps = policy.loss_sum.clone().neg();
    let ref_logps = reference.clone().neg().detach();
    let (chosen, rejected) = (half(&logps, 0), half(&logps, pairs));
    let chosen_ratio = chosen.clone() - half(&ref_logps, 0);
    let rejected_ratio = rejected.clone() - half(&ref_logps, pairs);
    let delta = chosen_ratio.clone() - rejected_ratio.clone();
    let beta = objective.beta;
    let tokens = policy.tokens.clone().detach().clamp_min(1.0);
    let mut loss = Tensor::<1>::zeros([1], &logps.device());
    for &(kind, weight) in &objective.losses {
        let per_pair = match kind {
            PreferenceLoss::Sigmoid => log_sigmoid(delta.clone().mul_scalar(beta)).neg(),
            PreferenceLoss::Hinge => relu(delta.clone().mul_scalar(-beta).add_scalar(1.0)),
            PreferenceLoss::Ipo => {
                let averaged = chosen_ratio.clone() / half(&tokens, 0) - rejected_ratio.clone() / half(&tokens, pairs);
                averaged.sub_scalar(1.0 / (2.0 * beta)).powi_scalar(2)
            }
            // One value for the batch: every chosen target token's −log p, averaged.
            PreferenceLoss::Sft => {
                let nll = half(&policy.loss_sum, 0).sum() / half(&policy.tokens, 0).detach().sum().clamp_min(1.0);
                nll.expand([pairs])
            }
        };
        loss = loss + per_pair.mean().mul_scalar(weight);
    }
    (loss, stats(&chosen_ratio, &rejected_ratio, &chosen, &rejected, beta))
}

impl LlamaForCausalLM {
    /// The reference's loss sums of a batch of pairs, in evaluation (no dropout, no amax
    /// recorded, no gradient): the base alone, the model with its trainable parameters holding
    /// the frozen values (a copy sharing every other tensor), or the sums given.
    ///
    /// # Shapes
    /// - ids, labels: `[2P, seq]`; output: `[2P]`, f32
    pub fn reference_loss(
        &self,
        ids: Tensor<2, Int>,
        labels: crate::loss::Labels,
        reference: &Reference,
    ) -> anyhow::Result<Tensor<1>> {
        let sums = match reference {
            Reference::Base => without_adapters(|| self.loss(ids, labels, None, false))?,
            Reference::Adapters(values) => self.with_frozen_values(values)?.loss(ids, labels, None, false)?,
            Reference::Sums(sums) => {
                let rows = ids.dims()[0];
                anyhow::ensure!(sums.dims()[0] == rows, "{} reference sums for a batch of {rows} rows", sums.dims()[0]);
                return Ok(sums.clone());
            }
        };
        Ok(sums.loss_sum.detach())
    }

    /// One micro-batch of P pairs (2P rows: the chosen completions, then the rejected ones,
    /// each with its prompt; labels −100 outside the completion): the reference's sums
    /// ([`Self::reference_loss`]), the policy's, the objective's loss times `weight` (the
    /// micro-batch's share of the step's pairs), and the flattened gradient of every trainable
    /// parameter, in `trainable_params_mut` order. Whole rows only: packed rows, recomputed or
    /// sharded blocks and context parallelism are refused by the config before a run.
    ///
    /// # Shapes
    /// - mb.ids, mb.labels: `[2P, seq]`
    pub fn preference_loss_and_grads(
        &mut self,
        mb: MicroBatch,
        objective: &PreferenceObjective,
        weight: f64,
    ) -> anyhow::Result<(MicroGrads, PairStats)> {
        let t = std::time::Instant::now();
        anyhow::ensure!(mb.packed.is_none(), "preference pairs are whole rows: packed rows are not supported");
        let rows = mb.ids.dims()[0];
        anyhow::ensure!(
            rows.is_multiple_of(2) && rows > 0,
            "a batch of pairs has an even number of rows (chosen, then rejected), not {rows}"
        );
        if let Some(seed) = mb.seed {
            mb.ids.device().seed(seed);
        }
        let reference = self.reference_loss(mb.ids.clone(), mb.labels.clone(), &objective.reference)?;
        let policy = self.loss(mb.ids, mb.labels, None, true)?;
        let (loss, stats) = preference_loss(&policy, &reference, objective);
        let loss = loss.mul_scalar(weight);
        let forward_s = t.elapsed().as_secs_f64();
        let grads = vec![loss.clone().backward()];
        let grads = flat_grads(self, &grads);
        let loss = loss.inner();
        Ok((MicroGrads { loss, grads, forward_s, backward_s: t.elapsed().as_secs_f64() - forward_s }, stats))
    }
}

/// [`PairStats`] from the log-ratios and the policy's log-probabilities (read from the device).
fn stats(
    chosen_ratio: &Tensor<1>,
    rejected_ratio: &Tensor<1>,
    chosen: &Tensor<1>,
    rejected: &Tensor<1>,
    beta: f64,
) -> PairStats {
    let host = |t: &Tensor<1>| -> Vec<f64> {
        t.clone().detach().cast(burn::tensor::DType::F64).into_data().into_vec::<f64>().unwrap_or_default()
    };
    let (rc, rr) = (host(chosen_ratio), host(rejected_ratio));
    let n = rc.len().max(1) as f64;
    let mean = |v: &[f64]| v.iter().sum::<f64>() / n;
    let (rc, rr): (Vec<f64>, Vec<f64>) = (rc.iter().map(|x| beta * x).collect(), rr.iter().map(|x| beta * x).collect());
    PairStats {
        rewards_chosen: mean(&rc),
        rewards_rejected: mean(&rr),
        rewards_accuracy: rc.iter().zip(&rr).filter(|(c, r)| c > r).count() as f64 / n,
        rewards_margin: rc.iter().zip(&rr).map(|(c, r)| c - r).sum::<f64>() / n,
        logps_chosen: mean(&host(chosen)),
        logps_rejected: mean(&host(rejected)),
    }
}

#[cfg(test)]
mod tests;
