//! The components of one training step, written for any number of data-parallel ranks (one
//! rank is the identity [`SingleProcess`](crate::dist::SingleProcess)); evaluation is `eval.rs`.

use std::sync::Arc;
use std::time::Instant;

use burn::tensor::{Device, Tensor, TensorData};
use llora_data::batch::Collated;
use llora_model::Labels;
use llora_model::{LlamaForCausalLM, MicroGrads, PackedRows};

pub use llora_model::{MicroBatch, device_sync};
use tracing::debug_span;

use crate::dist::{Collective, ReduceOp};
use crate::engine::grad_reduce::{Buckets, TreeSum, all_reduce_after_backward};
use crate::engine::optim::{AdamW, clip_coefficient};

/// The dropout seed of micro-batch `micro` (its index in the global batch) of optimizer step
/// `step`: the same sample sees the same masks on any rank and world size, and a resumed run
/// needs no RNG state beyond the step number.
pub fn dropout_seed(run_seed: u64, step: usize, micro: usize) -> u64 {
    run_seed
        .wrapping_mul(1_000_003)
        .wrapping_add(step as u64)
        .wrapping_mul(0x9E37_79B9_7F4A_7C15)
        .wrapping_add(micro as u64)
}

/// A collated micro-batch as device tensors (ids and labels `[batch, seq]`), with its packed
/// layout; no dropout seed.
pub fn upload(c: Collated, device: &Device) -> MicroBatch {
    let packed = c.docs.map(|docs| Arc::new(PackedRows::new(docs, c.seq).expect("collate_rows keeps rows within seq")));
    MicroBatch {
        ids: Tensor::from_data(TensorData::new(c.input_ids, [c.batch, c.seq]), device),
        labels: Labels::from_host(c.labels, [c.batch, c.seq], device),
        packed,
        seed: None,
    }
}

/// The knobs of one optimizer step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepOptions {
    /// Learning rate of this step.
    pub lr: f64,
    /// Global gradient-norm clip (0 = none).
    pub clip_grad_norm: f64,
    /// Decoder blocks, from the first, whose activations are recomputed in backward (0 = none).
    pub recompute_layers: usize,
    /// Waits for the device at the phase boundaries (after the forward, after the backward,
    /// after the optimizer) so that the phase times are real on an asynchronous device (CUDA);
    /// `llora bench` sets it, training does not (each wait stalls the launch queue).
    pub sync_phases: bool,
    /// With several ranks, the gradients are summed over them in buckets of this many bytes,
    /// each started during the last micro-batch's backward as soon as it is full
    /// (`dist.bucket_mb`); 0: one reduction after the backward.
    pub bucket_bytes: usize,
}

/// One micro-batch's loss (`loss_sum / norm`) and the flattened gradients of every trainable
/// parameter, in `trainable_params_mut` order, with the first `recompute` blocks recomputed
/// ([`LlamaForCausalLM::loss_and_grads`]); also the forward and backward seconds (real on
/// CUDA: the device is waited for after the forward and at the end).
pub fn micro_batch_grads(
    model: &mut LlamaForCausalLM,
    mb: MicroBatch,
    norm: f64,
    recompute: usize,
) -> anyhow::Result<(f64, Vec<Tensor<1>>, f64, f64)> {
    let g = model.loss_and_grads(mb, norm, recompute, true)?;
    let loss = llora_model::device::to_host(g.loss).convert::<f32>().try_into_vec::<f32>().expect("f32")[0] as f64;
    Ok((loss, g.grads, g.forward_s, g.backward_s))
}

/// A step whose loss or gradient norm is not finite: nothing was updated (the trainer says
/// where the last checkpoint is).
#[derive(Debug, Clone, Copy, PartialEq, thiserror::Error)]
#[error("the loss is {loss} and the gradient norm {grad_norm}: training cannot go on from non-finite values")]
pub struct NonFinite {
    /// The step's loss.
    pub loss: f64,
    /// Its gradient norm before clipping.
    pub grad_norm: f64,
}

/// One optimizer step over this rank's micro-batches of a global batch.
///
/// Each micro-batch's loss is its sum of token losses divided by `global_tokens`, the target
/// tokens of the whole global batch (all ranks), so the summed gradient is that of the per-token
/// mean over the global batch however it is split across micro-batches and ranks (not a mean of
/// per-micro-batch means). The ranks' gradients are then summed in one flat f32 all-reduce, the
/// FP8 amaxes max-reduced, and every rank clips by the same global L2 norm and takes the same
/// AdamW step, so the adapters stay identical everywhere. Returns the loss, the pre-clip norm and
/// where the time went; a non-finite loss or norm is an error and leaves the adapters untouched.
///
/// On one rank the host reads the device once per step: the micro-batches' losses and each
/// gradient's squared norm, together, for the clip coefficient and the non-finite check (sums
/// in f64 on the host, in a fixed order). With several ranks the gradients are summed on the
/// device, in buckets started during the last micro-batch's backward (`opts.bucket_bytes`;
/// `grad_reduce.rs`) where they fill more than one, bitwise as one reduction after it.
pub fn train_step(
    model: &mut LlamaForCausalLM,
    optim: &mut AdamW,
    comm: &dyn Collective,
    micro_batches: Vec<MicroBatch>,
    global_tokens: usize,
    opts: StepOptions,
) -> anyhow::Result<StepStats> {
    // A batch with no target token has zero loss and zero gradient, not 0/0.
    let norm = global_tokens.max(1) as f64;
    let during_backward = comm.world_size() > 1 && reduced_after_backward(model, opts.bucket_bytes).is_none();
    let last = micro_batches.len().saturating_sub(1);
    let mut acc = Accumulated::default();
    for (k, mb) in micro_batches.into_iter().enumerate() {
        let at = (norm, opts.recompute_layers, opts.sync_phases);
        if during_backward && k == last {
            let n = model.trainable_params_mut().len();
            let mut buckets = Buckets::new(comm, opts.bucket_bytes, std::mem::take(&mut acc.grads));
            let g = model.loss_and_grads_streamed(mb, at, &mut |i, g| buckets.ready(i, g))?;
            say_once_how_gradients_are_reduced(buckets.started(), opts.bucket_bytes);
            acc.push_reduced(g, buckets.finish(n)?);
        } else {
            acc.push(model.loss_and_grads(mb, at.0, at.1, at.2)?);
        }
    }
    if comm.world_size() > 1 && !during_backward {
        let why = reduced_after_backward(model, opts.bucket_bytes).unwrap_or_default();
        say_once(|| tracing::info!("gradients summed over the ranks in one reduction after the backward: {why}"));
    }
    apply(model, optim, comm, acc, opts)
}

/// Why the gradients are summed in one reduction after the backward rather than in buckets
/// during it; `None` where buckets can start during it.
fn reduced_after_backward(model: &LlamaForCausalLM, bucket_bytes: usize) -> Option<String> {
    let mib = |bytes: usize| bytes as f64 / f64::from(1 << 20);
    // f32 gradients.
    let bytes = 4 * model.num_trainable_parameters();
    if bucket_bytes == 0 {
        Some("dist.bucket_mb = 0".into())
    } else if bytes <= bucket_bytes {
        // Nothing could start before the backward ends: the block-by-block backward would cost
        // time for nothing (docs/performance.md).
        Some(format!("their {:.1} MiB fit one bucket of {} MiB (dist.bucket_mb)", mib(bytes), mib(bucket_bytes)))
    } else if !model.streams_gradients() {
        Some("the embedding trains (full fine-tuning)".into())
    } else {
        None
    }
}

/// One optimizer step of preference tuning over this rank's micro-batches of pairs, each with
/// its precomputed reference sums when there are some
/// ([`LlamaForCausalLM::preference_loss_and_grads`]): each micro-batch's loss weighted by its
/// share of the step's `global_pairs` (so the step's loss is the objective's mean over every
/// pair of the global batch, however they are split), then as [`train_step`]: one all-reduce,
/// the same clip and AdamW step on every rank. Also the pairs' statistics, means over the
/// global batch.
pub fn preference_step(
    model: &mut LlamaForCausalLM,
    optim: &mut AdamW,
    comm: &dyn Collective,
    micro_batches: Vec<(MicroBatch, Option<Vec<f64>>)>,
    (objective, global_pairs): (&llora_model::PreferenceObjective, usize),
    opts: StepOptions,
) -> anyhow::Result<(StepStats, llora_model::PairStats)> {
    let mut acc = Accumulated::default();
    // Each statistic times its micro-batch's pairs, summed.
    let mut sums = [0f64; 6];
    for (mb, reference) in micro_batches {
        let pairs = mb.ids.dims()[0] / 2;
        let objective = objective.for_batch(reference.as_deref(), &mb.ids.device());
        let (g, s) = model.preference_loss_and_grads(mb, &objective, pairs as f64 / global_pairs.max(1) as f64)?;
        acc.push(g);
        for (sum, v) in sums.iter_mut().zip(s.values()) {
            *sum += v * pairs as f64;
        }
    }
    comm.all_reduce_f64(&mut sums, ReduceOp::Sum)?;
    let stats = llora_model::PairStats::from_values(sums.map(|x| x / global_pairs.max(1) as f64));
    Ok((apply(model, optim, comm, acc, opts)?, stats))
}

/// Logs once per process how many gradient buckets the first step started during its backward.
fn say_once_how_gradients_are_reduced(during: usize, bucket_bytes: usize) {
    let mib = bucket_bytes as f64 / f64::from(1 << 20);
    say_once(|| {
        tracing::info!(
            "gradients summed over the ranks in buckets of {mib} MiB: {during} started during the backward, the last after it"
        )
    });
}

/// Runs `say` the first time a step says how its gradients are reduced, in this process.
fn say_once(say: impl FnOnce()) {
    static SAID: std::sync::Once = std::sync::Once::new();
    SAID.call_once(say);
}

/// A rank's micro-batches' losses and gradients, summed in a fixed tree ([`TreeSum`]), or
/// already summed over the ranks too (`reduced`, during the last backward).
#[derive(Default)]
struct Accumulated {
    grads: TreeSum<Vec<Tensor<1>>>,
    reduced: Option<Vec<Tensor<1>>>,
    losses: Vec<Tensor<1>>,
    forward_s: f64,
    backward_s: f64,
}

impl Accumulated {
    fn push(&mut self, g: MicroGrads) {
        self.grads.push(g.grads, |a, b| a.into_iter().zip(b).map(|(a, b)| a + b).collect());
        self.push_times(g.loss, g.forward_s, g.backward_s);
    }

    /// The last micro-batch, whose gradients went into the buckets: `reduced` is every
    /// parameter's gradient summed over the micro-batches and the ranks.
    fn push_reduced(&mut self, g: MicroGrads, reduced: Vec<Tensor<1>>) {
        self.reduced = Some(reduced);
        self.push_times(g.loss, g.forward_s, g.backward_s);
    }

    fn push_times(&mut self, loss: Tensor<1>, forward_s: f64, backward_s: f64) {
        self.losses.push(loss);
        self.forward_s += forward_s;
        self.backward_s += backward_s;
    }
}

/// The step's end, whatever its objective: the ranks' gradients summed, the loss and the norm
/// read back once (non-finite: nothing is updated), clipped, AdamW, the FP8 scales updated.
fn apply(
    model: &mut LlamaForCausalLM,
    optim: &mut AdamW,
    comm: &dyn Collective,
    acc: Accumulated,
    opts: StepOptions,
) -> anyhow::Result<StepStats> {
    let Accumulated { grads, reduced, losses, forward_s, backward_s } = acc;
    let (lr, clip_grad_norm) = (opts.lr, opts.clip_grad_norm);
    let t = Instant::now();
    let _span = debug_span!("optimizer").entered();
    tracing::debug!("step phase: all-reduce and optimizer");
    let grads = match reduced {
        Some(reduced) => reduced,
        None => {
            let summed = grads.finish(|a, b| a.into_iter().zip(b).map(|(a, b)| a + b).collect());
            all_reduce_after_backward(comm, summed.unwrap_or_default())?
        }
    };
    let (micro_losses, square_norms) = read_losses_and_norms(losses, &grads)?;
    let mut loss_acc: TreeSum<f64> = TreeSum::default();
    for l in micro_losses {
        loss_acc.push(l, |a, b| a + b);
    }
    let mut loss = [loss_acc.finish(|a, b| a + b).unwrap_or(0.0)];
    comm.all_reduce_f64(&mut loss, ReduceOp::Sum)?;
    let loss_sum = loss[0];
    let total_norm = square_norms.iter().sum::<f64>().sqrt();
    if !loss_sum.is_finite() || !total_norm.is_finite() {
        return Err(NonFinite { loss: loss_sum, grad_norm: total_norm }.into());
    }
    let coef = clip_coefficient(total_norm, clip_grad_norm);
    optim.step(model.trainable_params_mut(), grads, coef, lr).map_err(|e| anyhow::anyhow!("optimizer step: {e}"))?;
    // Delayed scaling follows the global batch: every rank takes the largest amax any saw.
    let max_over_ranks = |amaxes: &mut [f32]| Ok(comm.all_reduce_f32(amaxes, ReduceOp::Max)?);
    model.reduce_and_update_fp8((comm.world_size() > 1).then_some(&max_over_ranks as _))?;
    if opts.sync_phases
        && let Some(g) = model.trainable_params_mut().first().map(|(_, p)| p.flat().inner())
    {
        device_sync(&g.device());
    }
    Ok(StepStats {
        loss: loss_sum,
        grad_norm: total_norm,
        forward_s,
        backward_s,
        optimizer_s: t.elapsed().as_secs_f64(),
    })
}

/// The micro-batches' losses and each gradient's squared L2 norm (the norms accumulated in f32
/// on the device in one multi-tensor op, [`llora_model::l2_norms`]; squared in f64 here), read
/// back in one host-device transfer.
///
/// # Shapes
/// - losses: `[1]` each (f32); grads: `[n_i]` each
fn read_losses_and_norms(losses: Vec<Tensor<1>>, grads: &[Tensor<1>]) -> anyhow::Result<(Vec<f64>, Vec<f64>)> {
    let m = losses.len();
    let norms = llora_model::l2_norms(grads).map_err(|e| anyhow::anyhow!("the gradients' norms: {e}"))?;
    // Off LibTorch, a norm per gradient.
    let norms = norms.or_else(|| {
        let each = grads.iter().map(|g| g.clone().cast(burn::tensor::DType::F32).square().sum().sqrt());
        (!grads.is_empty()).then(|| Tensor::cat(each.collect(), 0))
    });
    let parts: Vec<Tensor<1>> = losses.into_iter().chain(norms).collect();
    if parts.is_empty() {
        return Ok((vec![], vec![]));
    }
    let host = llora_model::device::to_host(Tensor::cat(parts, 0)).convert::<f32>().try_into_vec::<f32>().expect("f32");
    let values: Vec<f64> = host.into_iter().map(f64::from).collect();
    Ok((values[..m].to_vec(), values[m..].iter().map(|n| n * n).collect()))
}

/// What one optimizer step gave and where its time went.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepStats {
    /// Mean target-token loss over the global batch.
    pub loss: f64,
    /// Global L2 norm of the gradients before clipping.
    pub grad_norm: f64,
    /// Seconds in forward passes (all micro-batches).
    pub forward_s: f64,
    /// Seconds in backward passes and gradient accumulation.
    pub backward_s: f64,
    /// Seconds in reduction, clipping and AdamW.
    pub optimizer_s: f64,
}

#[cfg(test)]
mod tests {
    #![allow(deprecated)] // Device::libtorch: burn-tch is deprecated upstream, and it is our backend.
    use super::*;
    use crate::config::OptimConfig;
    use crate::dist::SingleProcess;
    use burn::tensor::Int;
    use llora_model::{BuildOptions, LlamaConfig, LoraSpec};

    /// The recompute check: loss and every LoRA gradient with all 4 blocks (and with 2)
    /// recomputed equal the plain backward's, with dropout on, in fp32 and in FP8 with FP8
    /// activations; the FP8 case on packed rows (documents of 20 + 28 and 10 + 5 + 30
    /// tokens, the second row with padding), whose layout the recomputed blocks must see too;
    /// and in bf16 over an NF4 base (QLoRA, its weights decoded again in the recompute).
    #[test]
    fn recomputed_blocks_give_the_plain_gradients() {
        let _rng = llora_model::device::torch_rng_lock();
        use llora_model::precision::{Compute, PrecisionSpec};
        let device = Device::libtorch().autodiff();
        let nf4 = Some(llora_model::precision::Nf4Spec::default());
        for (compute, fp8_activations, nf4) in
            [(Compute::Fp32, false, None), (Compute::Fp8, true, None), (Compute::Bf16, false, nf4)]
        {
            device.seed(3);
            let config = LlamaConfig::preset("demo").unwrap();
            let spec = LoraSpec { dropout: 0.1, ..LoraSpec::default() };
            let precision = PrecisionSpec { compute, fp8_activations, nf4, ..PrecisionSpec::default() };
            let mut model = LlamaForCausalLM::random(
                &config,
                &BuildOptions { lora: Some(&spec), precision: Some(precision), ..Default::default() },
                &device,
            )
            .unwrap();
            // B starts at zero (PEFT's init): give it values so that every gradient is non-trivial.
            for (name, mut p) in model.trainable_params_mut() {
                if name.contains("lora_B") {
                    let n = p.flat().shape().num_elements();
                    p.set_flat(Tensor::random(
                        [n],
                        burn::tensor::Distribution::Normal(0.0, 0.02),
                        &device.clone().inner(),
                    ));
                }
            }
            let ids: Vec<i64> = (0..2 * 48).map(|i| (i * 37 % 500) as i64 + 3).collect();
            let labels: Vec<i64> = ids.iter().enumerate().map(|(i, &t)| if i % 48 < 20 { -100 } else { t }).collect();
            let packed = (compute == Compute::Fp8)
                .then(|| Arc::new(PackedRows::new(vec![vec![20, 28], vec![10, 5, 30]], 48).unwrap()));
            let mb = || MicroBatch {
                ids: Tensor::from_data(TensorData::new(ids.clone(), [2, 48]), &device),
                labels: Labels::from_host(labels.clone(), [2, 48], &device),
                packed: packed.clone(),
                seed: Some(11),
            };
            let (loss0, plain, _, _) = micro_batch_grads(&mut model, mb(), 40.0, 0).unwrap();
            for recompute in [4, 2] {
                let (loss, grads, _, _) = micro_batch_grads(&mut model, mb(), 40.0, recompute).unwrap();
                assert!((loss - loss0).abs() <= 1e-6 * loss0.abs(), "{compute:?} r{recompute}: loss {loss} vs {loss0}");
                for (k, (a, b)) in plain.iter().zip(&grads).enumerate() {
                    let (a, b) = (a.to_data().to_vec::<f32>().unwrap(), b.to_data().to_vec::<f32>().unwrap());
                    let scale = a.iter().fold(0f32, |m, x| m.max(x.abs()));
                    assert!(scale > 0.0, "{compute:?}: gradient {k} is zero");
                    let diff = a.iter().zip(&b).fold(0f32, |m, (x, y)| m.max((x - y).abs()));
                    assert!(
                        diff <= 1e-6 * scale,
                        "{compute:?} r{recompute}: gradient {k} differs by {diff:e} (scale {scale:e})"
                    );
                }
            }
            // And dropout is really on: another seed gives other gradients.
            let (_, other, _, _) =
                micro_batch_grads(&mut model, MicroBatch { seed: Some(12), ..mb() }, 40.0, 0).unwrap();
            assert!(plain.iter().zip(&other).any(|(a, b)| a.to_data() != b.to_data()), "dropout had no effect");
        }
    }

    /// N threads as the N ranks of a context-parallel group, over shared memory (what c10d
    /// does between processes): each exchange writes this rank's tensor, waits for all, reads
    /// all. So one test can run the ranks' steps side by side and read their gradients.
    struct ThreadGroup {
        rank: usize,
        shared: Arc<(std::sync::Barrier, std::sync::Mutex<Vec<Option<tch::Tensor>>>)>,
    }

    impl ThreadGroup {
        /// The group's ranks, each to be moved to its thread.
        fn of(size: usize) -> Vec<Self> {
            let shared =
                Arc::new((std::sync::Barrier::new(size), std::sync::Mutex::new((0..size).map(|_| None).collect())));
            (0..size).map(|rank| Self { rank, shared: shared.clone() }).collect()
        }

        /// Every rank's `x`, in rank order. The barrier before writing keeps a fast rank from
        /// overwriting a slot another rank has still to read from the exchange before.
        fn exchange(&self, x: &tch::Tensor) -> Vec<tch::Tensor> {
            let (barrier, slots) = &*self.shared;
            barrier.wait();
            slots.lock().unwrap()[self.rank] = Some(x.copy());
            barrier.wait();
            slots.lock().unwrap().iter().map(|t| t.as_ref().unwrap().shallow_clone()).collect()
        }
    }

    impl llora_model::context_parallel::ContextGroup for ThreadGroup {
        fn rank(&self) -> usize {
            self.rank
        }
        fn size(&self) -> usize {
            self.shared.1.lock().unwrap().len()
        }
        fn all_gather(&self, x: &tch::Tensor) -> anyhow::Result<tch::Tensor> {
            Ok(tch::Tensor::stack(&self.exchange(x), 0))
        }
        fn all_reduce_sum(&self, x: &tch::Tensor) -> anyhow::Result<tch::Tensor> {
            let all = self.exchange(&x.to_kind(tch::Kind::Float));
            Ok(all.iter().skip(1).fold(all[0].copy(), |sum, t| sum + t))
        }
    }

    /// Gradients, read directly: the ranks of a context-parallel group
    /// (threads, [`ThreadGroup`]), each with the same model (B random, so that A's gradients
    /// are not zero) and the same batch of 2 rows of 50 tokens (padded to the split), their
    /// loss shares and LoRA gradients added over the group, against one process: 2 and 4
    /// ranks, Llama 2 and Llama 3 style, one sequence per row and packed rows (documents
    /// crossing the chunks), every block kept and 2 recomputed. Each target token's loss (from
    /// the rank's logits at its global positions) within 1e-6 of one process's (measured 3.5e-8
    /// to 4.5e-8 at worst over the 76 target tokens), the loss within 1e-6, the LoRA
    /// gradients as one vector within 1e-6 relative L2 (measured 3.8e-7 to 4.0e-7). Each
    /// tensor within twice what fp32 alone moves it by, measured in the same test: one process
    /// with the generic ("eager") attention instead of the flash kernel differs from itself by
    /// up to 1.1e-6 to 1.5e-6 per tensor (3.2e-7 to 3.9e-7 as one vector); the ranks' sum
    /// differs by 1.3e-6 to 2.1e-6 at worst (1.09x to 1.42x that), in both cases the q/k
    /// adapters of the last block, whose gradients come through the softmax's derivative, a
    /// difference of nearly equal terms.
    #[test]
    fn context_parallel_gradients_add_up_to_one_process() {
        // Held for the whole test, the ranks' threads included: a running rank reseeds torch's
        // generator per block, which would change the draws of a seeding test running beside
        // this one (CI saw `recomputed_blocks_give_the_plain_gradients` fail so).
        let _rng = llora_model::device::torch_rng_lock();
        let device = Device::libtorch().autodiff();
        let model = |preset: &str| {
            device.seed(5);
            model_with_random_b(preset, None, &device)
        };
        let ids: Vec<i64> = (0..2 * 50).map(|i| (i * 37 % 500) as i64 + 3).collect();
        let labels: Vec<i64> = ids.iter().enumerate().map(|(i, &t)| if i % 50 < 12 { -100 } else { t }).collect();
        let docs = || Arc::new(PackedRows::new(vec![vec![20, 30], vec![10, 5, 33]], 50).unwrap());
        let mb = |packed: Option<Arc<PackedRows>>| MicroBatch {
            ids: Tensor::from_data(TensorData::new(ids.clone(), [2, 50]), &device),
            labels: Labels::from_host(labels.clone(), [2, 50], &device),
            packed,
            seed: None,
        };
        let host = |grads: Vec<Tensor<1>>| grads.iter().map(|g| g.to_data().to_vec::<f32>().unwrap()).collect();
        for (preset, packed, recompute) in [("demo", false, 0), ("demo-llama3", true, 2), ("demo", true, 0)] {
            let packed = packed.then(docs);
            let (whole, grads, _, _) =
                micro_batch_grads(&mut model(preset), mb(packed.clone()), 76.0, recompute).unwrap();
            let grads: Vec<Vec<f32>> = host(grads);
            // What fp32 alone moves each tensor by: one process with Burn's generic attention
            // (as HF's "eager") instead of the flash kernel, summing the softmax in another order.
            let eager = llora_model::diagnostics::with_generic_attention(|| {
                micro_batch_grads(&mut model(preset), mb(packed.clone()), 76.0, recompute).unwrap()
            });
            let noise = relative_differences(&grads, &host(eager.1)).into_iter().fold(0.0, f64::max);
            assert!(noise > 0.0 && noise <= 5e-6, "{preset}: flash vs eager attention moves a tensor by {noise:e}");
            for n in [2, 4] {
                // Every model is built before any rank runs: a running rank reseeds torch's
                // generator per block, which would change the weights of a model being built.
                let models: Vec<LlamaForCausalLM> = ThreadGroup::of(n)
                    .into_iter()
                    .map(|group| {
                        let mut model = model(preset);
                        model.context = Some(llora_model::context_parallel::ContextParallel { group: Arc::new(group) });
                        model
                    })
                    .collect();
                let ranks: Vec<(f64, Vec<Vec<f32>>, Vec<f32>)> = std::thread::scope(|scope| {
                    let runs: Vec<_> = models
                        .into_iter()
                        .map(|mut model| {
                            let packed = packed.clone();
                            scope.spawn(move || {
                                let (loss, g, _, _) =
                                    micro_batch_grads(&mut model, mb(packed.clone()), 76.0, recompute).unwrap();
                                let logits = model.forward_packed(mb(None).ids, packed.as_ref(), false).unwrap();
                                (loss, host(g), logits.to_data().to_vec::<f32>().unwrap())
                            })
                        })
                        .collect();
                    runs.into_iter().map(|r| r.join().unwrap()).collect()
                });
                let what = format!("{preset}, packed {}, {recompute} recomputed, {n} ranks", packed.is_some());
                let loss: f64 = ranks.iter().map(|r| r.0).sum();
                assert!((loss - whole).abs() <= 1e-6 * whole, "{what}: loss {loss} vs {whole}");
                // Each target token's loss on the rank that holds its position, against one
                // process's at the same global position.
                let one = model(preset).forward_packed(mb(None).ids, packed.as_ref(), false).unwrap();
                let one =
                    token_losses(&one.to_data().to_vec::<f32>().unwrap(), &(0..50).collect::<Vec<_>>(), &ids, &labels);
                let mut split = std::collections::BTreeMap::new();
                for (rank, r) in ranks.iter().enumerate() {
                    let at = llora_model::context_parallel::ContextSplit::new(50, rank, n).local_positions();
                    split.extend(token_losses(&r.2, &at, &ids, &labels));
                }
                assert_eq!(split.len(), one.len(), "{what}: target tokens");
                for (key, ce) in &one {
                    let cp = split[key];
                    assert!((cp - ce).abs() <= 1e-6 * ce, "{what}: token {key:?}: loss {cp} vs {ce}");
                }
                // The group's sum of each tensor.
                let summed: Vec<Vec<f32>> = (0..grads.len())
                    .map(|k| (0..grads[k].len()).map(|i| ranks.iter().map(|r| r.1[k][i]).sum()).collect())
                    .collect();
                for (k, rel) in relative_differences(&grads, &summed).into_iter().enumerate() {
                    let bound = (2.0 * noise).max(1e-6);
                    assert!(rel <= bound, "{what}: gradient {k} differs by {rel:e} (eager vs flash: {noise:e})");
                }
                let vector = |g: &[Vec<f32>]| vec![g.concat()];
                let rel = relative_differences(&vector(&grads), &vector(&summed))[0];
                assert!(rel <= 1e-6, "{what}: the LoRA gradients differ by {rel:e}");
            }
        }
    }

    /// FP8 (weights, activations stored in FP8) under context parallelism takes one process's
    /// scales: the amaxes each role's first use chooses its scale from (read as the step leaves
    /// them pending) are the same on every rank of the group, the whole sequence's, and differ
    /// from one process's by no more than twice what FP8 moves them by in one process when
    /// only attention's summation order changes (the generic attention instead of the flash
    /// kernel, measured here: up to ~10%, FP8 rounds bf16 differences of an ulp to steps of
    /// 6-25%). Each rank's own chunk's amaxes, as before, were up to 80% apart between ranks
    /// and from one process's. The loss and the LoRA gradients (one vector) stay within twice
    /// that measured difference as well; CP 2 and 4.
    #[test]
    fn fp8_under_context_parallelism_takes_one_process_scales() {
        let _rng = llora_model::device::torch_rng_lock();
        use llora_model::precision::{Compute, PrecisionSpec};
        let device = Device::libtorch().autodiff();
        let precision =
            PrecisionSpec { compute: Compute::Fp8, fp8_weights: true, fp8_activations: true, ..Default::default() };
        let model = || {
            device.seed(7);
            model_with_random_b("demo", Some(precision), &device)
        };
        let ids: Vec<i64> = (0..2 * 48).map(|i| (i * 41 % 500) as i64 + 3).collect();
        let labels: Vec<i64> = ids.iter().enumerate().map(|(i, &t)| if i % 48 < 10 { -100 } else { t }).collect();
        let mb = || MicroBatch {
            ids: Tensor::from_data(TensorData::new(ids.clone(), [2, 48]), &device),
            labels: Labels::from_host(labels.clone(), [2, 48], &device),
            packed: None,
            seed: None,
        };
        // One process's step: its loss, LoRA gradients (one vector) and pending amaxes.
        let step = |model: &mut LlamaForCausalLM| {
            let (loss, g, _, _) = micro_batch_grads(model, mb(), 76.0, 0).unwrap();
            let g: Vec<Vec<f32>> = g.iter().map(|g| g.to_data().to_vec::<f32>().unwrap()).collect();
            (loss, g.concat(), model.fp8_pending_amaxes())
        };
        let worst = |a: &[f32], b: &[f32]| {
            a.iter().zip(b).map(|(a, b)| f64::from((a - b).abs() / a.abs().max(f32::MIN_POSITIVE))).fold(0.0, f64::max)
        };
        let (loss, grads, amaxes) = step(&mut model());
        assert!(amaxes.iter().filter(|a| **a > 0.0).count() > 20, "{amaxes:?}");
        let (eager_loss, eager_grads, eager_amaxes) =
            llora_model::diagnostics::with_generic_attention(|| step(&mut model()));
        let noise_amax = worst(&amaxes, &eager_amaxes);
        let noise_grads = relative_differences(std::slice::from_ref(&grads), &[eager_grads])[0];
        let noise_loss = (eager_loss - loss).abs() / loss;
        assert!(noise_amax > 0.0 && noise_amax < 0.2 && noise_grads < 0.1, "FP8 noise {noise_amax} {noise_grads}");
        for n in [2, 4] {
            let models: Vec<LlamaForCausalLM> = ThreadGroup::of(n)
                .into_iter()
                .map(|group| {
                    let mut model = model();
                    model.context = Some(llora_model::context_parallel::ContextParallel { group: Arc::new(group) });
                    model
                })
                .collect();
            let ranks: Vec<(f64, Vec<f32>, Vec<f32>)> = std::thread::scope(|scope| {
                let runs: Vec<_> = models.into_iter().map(|mut model| scope.spawn(move || step(&mut model))).collect();
                runs.into_iter().map(|r| r.join().unwrap()).collect()
            });
            for (rank, r) in ranks.iter().enumerate() {
                assert_eq!(r.2, ranks[0].2, "{n} ranks: rank {rank}'s amaxes differ from rank 0's");
            }
            let off = worst(&amaxes, &ranks[0].2);
            assert!(
                off <= 2.0 * noise_amax,
                "{n} ranks: amaxes off one process's by {off:e} (FP8 noise {noise_amax:e})"
            );
            let cp_loss: f64 = ranks.iter().map(|r| r.0).sum();
            let rel_loss = (cp_loss - loss).abs() / loss;
            assert!(rel_loss <= 2.0 * noise_loss + 1e-6, "{n} ranks: loss {cp_loss} vs {loss} (noise {noise_loss:e})");
            let summed: Vec<f32> = (0..grads.len()).map(|i| ranks.iter().map(|r| r.1[i]).sum()).collect();
            let rel = relative_differences(std::slice::from_ref(&grads), &[summed])[0];
            assert!(
                rel <= 2.0 * noise_grads,
                "{n} ranks: the LoRA gradients differ by {rel:e} (noise {noise_grads:e})"
            );
        }
    }

    /// A random `preset` model with LoRA adapters without dropout, stored as `precision` says,
    /// whose B matrices are random too, so that A's gradients are not zero; drawn from the
    /// generator as the caller seeded it (under its lock).
    fn model_with_random_b(
        preset: &str,
        precision: Option<llora_model::precision::PrecisionSpec>,
        device: &Device,
    ) -> LlamaForCausalLM {
        let spec = LoraSpec { dropout: 0.0, ..LoraSpec::default() };
        let options = BuildOptions { lora: Some(&spec), precision, ..Default::default() };
        let mut model = LlamaForCausalLM::random(&LlamaConfig::preset(preset).unwrap(), &options, device).unwrap();
        for (name, mut p) in model.trainable_params_mut() {
            if name.contains("lora_B") {
                let n = p.flat().shape().num_elements();
                let normal = burn::tensor::Distribution::Normal(0.0, 0.02);
                p.set_flat(Tensor::random([n], normal, &device.clone().inner()));
            }
        }
        model
    }

    /// `|a − b| / |a|` (L2, in f64) of each tensor; every `a` must be non-zero.
    fn relative_differences(a: &[Vec<f32>], b: &[Vec<f32>]) -> Vec<f64> {
        let sq = |x: f32| f64::from(x).powi(2);
        a.iter()
            .zip(b)
            .enumerate()
            .map(|(k, (a, b))| {
                let size: f64 = a.iter().map(|&x| sq(x)).sum();
                assert!(size > 0.0, "gradient {k} is zero");
                (a.iter().zip(b).map(|(&x, &y)| (f64::from(x) - f64::from(y)).powi(2)).sum::<f64>() / size).sqrt()
            })
            .collect()
    }

    /// The cross-entropy of each target token of logits `[2, positions.len(), V]` (f32, row
    /// major) whose sequence positions are `positions` (padding beyond 50 tokens skipped), keyed
    /// by (row, position); the labels of a 2 x 50 batch, shifted as HF shifts them. In f64.
    fn token_losses(
        logits: &[f32],
        positions: &[usize],
        ids: &[i64],
        labels: &[i64],
    ) -> std::collections::BTreeMap<(usize, usize), f64> {
        let vocab = logits.len() / (2 * positions.len());
        let mut out = std::collections::BTreeMap::new();
        for row in 0..2 {
            for (local, &t) in positions.iter().enumerate() {
                if t + 1 >= 50 || labels[row * 50 + t + 1] == llora_data::IGNORE_INDEX {
                    continue;
                }
                let z = &logits[(row * positions.len() + local) * vocab..][..vocab];
                let max = z.iter().fold(f64::MIN, |m, &x| m.max(f64::from(x)));
                let lse = max + z.iter().map(|&x| (f64::from(x) - max).exp()).sum::<f64>().ln();
                out.insert((row, t), lse - f64::from(z[ids[row * 50 + t + 1] as usize]));
            }
        }
        out
    }

    /// A global batch whose labels are all -100 gives loss 0 and gradient norm 0, not 0/0.
    #[test]
    fn batch_without_targets_is_finite() {
        let _rng = llora_model::device::torch_rng_lock();
        let device = Device::libtorch().autodiff();
        device.seed(1);
        let config = LlamaConfig::preset("demo").unwrap();
        let mut model = LlamaForCausalLM::random(
            &config,
            &BuildOptions { lora: Some(&LoraSpec::default()), ..Default::default() },
            &device,
        )
        .unwrap();
        let mut optim = AdamW::new(OptimConfig::default());
        let ids = Tensor::<2, Int>::from_data(TensorData::new(vec![1i64, 5, 9, 13], [1, 4]), &device);
        let labels = Tensor::<2, Int>::from_data(TensorData::new(vec![llora_data::IGNORE_INDEX; 4], [1, 4]), &device);
        let s = train_step(
            &mut model,
            &mut optim,
            &SingleProcess,
            vec![MicroBatch { ids, labels: labels.into(), packed: None, seed: None }],
            0,
            StepOptions { lr: 1e-3, clip_grad_norm: 0.3, recompute_layers: 0, sync_phases: false, bucket_bytes: 0 },
        )
        .unwrap();
        assert_eq!((s.loss, s.grad_norm), (0.0, 0.0));
        for (name, p) in model.trainable_params_mut() {
            let v = p.flat().into_data().convert::<f32>().to_vec::<f32>().unwrap();
            assert!(v.iter().all(|x| x.is_finite()), "{name} is not finite");
        }
    }
}
