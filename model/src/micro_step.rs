//! One micro-batch through the model: its loss and the gradient of every trainable parameter
//! ([`LlamaForCausalLM::loss_and_grads`]), what a training step asks of the model, with what the
//! model owns about it (dropout seeding, recomputed blocks, the FP8 amax scope of a
//! context-parallel group, a lost rank's failure). The step around it (accumulation, the
//! all-reduce, clipping, the optimizer) is the trainer's.

use std::sync::Arc;
use std::time::Instant;

use burn::tensor::{Device, Int, Tensor};
use tracing::debug_span;

use crate::llama::LlamaForCausalLM;
use crate::loss::Labels;
use crate::packing::PackedRows;

/// One micro-batch on the device, with the seed of its dropout masks.
pub struct MicroBatch {
    /// `[batch, seq]` token ids.
    pub ids: Tensor<2, Int>,
    /// `[batch, seq]` labels (−100 = no loss), with their host values when known.
    pub labels: Labels,
    /// Where the documents of packed rows lie; `None`: a sample per row.
    pub packed: Option<Arc<PackedRows>>,
    /// Reseeds the device's generator before the forward, when set.
    pub seed: Option<u64>,
}

/// Waits until `device` has finished the work queued on it (a no-op on the CPU).
pub fn device_sync(device: &Device) {
    if let Some(tch::Device::Cuda(n)) = crate::precision::tch_device(device) {
        tch::Cuda::synchronize(n as i64);
    }
}

/// A micro-batch's loss and gradients, left on the device.
pub struct MicroGrads {
    /// `loss_sum / norm`, `[1]` (f32), not read back.
    pub loss: Tensor<1>,
    /// The flattened gradient of each trainable parameter, in `trainable_params_mut` order.
    pub grads: Vec<Tensor<1>>,
    /// Seconds of the forward, to the loss (a recomputed block's second forward is backward's).
    pub forward_s: f64,
    /// Seconds of the backward and the gradients' gathering.
    pub backward_s: f64,
}

impl LlamaForCausalLM {
    /// One micro-batch's loss (`loss_sum / norm`, left on the device) and the flattened
    /// gradient of every trainable parameter, in `trainable_params_mut` order: the dropout
    /// masks seeded from the batch's seed, the first `recompute` blocks recomputed (and a
    /// sharded model block by block: [`Self::recomputed_backward`]), a context-parallel
    /// collective's failure turned into this error. The host queues the forward and the
    /// backward without waiting for the device, unless `sync` asks for real phase times. Under
    /// context parallelism the FP8 scales chosen inside (first uses, current scaling) come from
    /// the whole sequence's amaxes, as one process's would (`fp8::amax_group`).
    pub fn loss_and_grads(
        &mut self,
        mb: MicroBatch,
        norm: f64,
        recompute: usize,
        sync: bool,
    ) -> anyhow::Result<MicroGrads> {
        let group = self.context.as_ref().map(|c| c.group.clone());
        crate::fp8::amax_group::with_amax_group(group, || grads_of(self, mb, (norm, recompute, sync), None))
    }

    /// Whether [`Self::loss_and_grads_streamed`] can run: every trainable parameter sits in
    /// one segment of the backward (the embedding is frozen).
    pub fn streams_gradients(&self) -> bool {
        !self.embed_tokens.val().is_require_grad()
    }

    /// [`Self::loss_and_grads`] with every decoder block's backward a segment of its own
    /// ([`Self::recomputed_backward`]), `ready` told each trainable parameter's gradient (its
    /// index in `trainable_params_mut` order, flattened) as soon as the segment holding it is
    /// queued: the last block's adapters first. Every parameter must sit in one segment (LoRA
    /// adapters and norms do; a trainable tied embedding has a part in two, refused).
    pub fn loss_and_grads_streamed(
        &mut self,
        mb: MicroBatch,
        (norm, recompute, sync): (f64, usize, bool),
        ready: &mut dyn FnMut(usize, Tensor<1>),
    ) -> anyhow::Result<MicroGrads> {
        anyhow::ensure!(
            self.streams_gradients(),
            "gradients streamed during backward need every parameter in one block: the embedding trains"
        );
        let group = self.context.as_ref().map(|c| c.group.clone());
        crate::fp8::amax_group::with_amax_group(group, || grads_of(self, mb, (norm, recompute, sync), Some(ready)))
    }
}

/// The flattened gradient of every trainable parameter in `grads` (the backward's, or each
/// recomputed segment's), in `trainable_params_mut` order.
pub(crate) fn flat_grads(model: &mut LlamaForCausalLM, grads: &[burn::tensor::Gradients]) -> Vec<Tensor<1>> {
    model
        .trainable_params_mut()
        .iter()
        .map(|(name, p)| {
            // A tied embedding has a part in the head's segment and one in the embedding's.
            grads
                .iter()
                .filter_map(|gr| p.grad_flat(gr))
                .reduce(|a, b| a + b)
                .unwrap_or_else(|| panic!("{name} got no gradient"))
        })
        .collect()
}

/// [`LlamaForCausalLM::loss_and_grads`] inside its amax scope; with `ready`, streamed
/// ([`LlamaForCausalLM::loss_and_grads_streamed`]).
fn grads_of(
    model: &mut LlamaForCausalLM,
    mb: MicroBatch,
    (norm, recompute, sync): (f64, usize, bool),
    mut ready: Option<&mut dyn FnMut(usize, Tensor<1>)>,
) -> anyhow::Result<MicroGrads> {
    let t = Instant::now();
    let device = mb.ids.device();
    if let Some(seed) = mb.seed {
        device.seed(seed);
    }
    let keys: Vec<crate::params::GradKey> = match ready {
        Some(_) => model.trainable_params_mut().iter().map(|(_, p)| p.grad_key()).collect(),
        None => Vec::new(),
    };
    let mut tell = |grads: &burn::tensor::Gradients| {
        if let Some(ready) = ready.as_mut() {
            for (i, key) in keys.iter().enumerate() {
                if let Some(g) = key.grad_flat(grads) {
                    ready(i, g);
                }
            }
        }
    };
    let cuts = crate::recompute::Segments { every_block: !keys.is_empty(), done: Some(&mut tell) };
    let (loss, grads, forward_s) = if recompute > 0 || model.is_sharded() || cuts.every_block {
        // The forward ends at the loss; the recomputed blocks' second forward counts as backward.
        tracing::debug!(recompute, sharded = model.is_sharded(), "step phase: forward, then backward block by block");
        let mut forward_s = 0.0;
        let forward_done = || {
            if sync {
                device_sync(&device);
            }
            forward_s = t.elapsed().as_secs_f64();
        };
        let at = (norm, recompute);
        let (loss, grads) = model.recomputed_backward(mb.ids, mb.labels, mb.packed.as_ref(), at, forward_done, cuts)?;
        (loss, grads, forward_s)
    } else {
        let loss = {
            let _span = debug_span!("forward").entered();
            // An event at the start (spans print when they close): a hang names its phase.
            tracing::debug!("step phase: forward");
            model.loss(mb.ids, mb.labels, mb.packed.as_ref(), true)?.loss_sum.sum().div_scalar(norm)
        };
        if sync {
            device_sync(&device);
        }
        let forward_s = t.elapsed().as_secs_f64();
        let _span = debug_span!("backward").entered();
        tracing::debug!("step phase: backward");
        (loss.clone().inner(), vec![loss.backward()], forward_s)
    };
    // A context-parallel collective that failed inside attention (a lost rank) ends the step here.
    crate::context_parallel::take_failure()?;
    let g = flat_grads(model, &grads);
    if sync {
        device_sync(&device);
    }
    let loss = loss.cast(burn::tensor::DType::F32);
    Ok(MicroGrads { loss, grads: g, forward_s, backward_s: t.elapsed().as_secs_f64() - forward_s })
}
