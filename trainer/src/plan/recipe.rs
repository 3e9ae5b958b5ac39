//! The cheapest recipe that fits a device: recomputation, sharding, one weight layout, context
//! parallelism, in the order of what they cost.

use super::*;

/// Dense FLOPs per byte of memory bandwidth of the GPUs llora plans for (H100/H200 bf16: 989
/// TFLOP/s over 3.4-4.8 TB/s): what turns a transpose's bytes into recomputed blocks' time.
pub(super) const GPU_FLOP_PER_BYTE: f64 = 250.0;

/// The time of keeping FP8 weights in one layout, in blocks recomputed: every layer's weights
/// transposed once per backward (2 B moved per value) against one block's forward (2 FLOPs per
/// value per token), so `layers · FLOP-per-byte / tokens` (≈ 2.4 blocks for 70B at 8192 tokens).
pub(super) fn one_layout_cost(s: &Shape) -> f64 {
    s.model.num_hidden_layers as f64 * GPU_FLOP_PER_BYTE / tokens(s).max(1.0)
}

/// Dense FLOPs per byte of one rank's all-gather bandwidth within one node: H100 bf16 (989
/// TFLOP/s) over NVLink 4's ~360 GB/s all-gather bus bandwidth (nccl-tests on 8 x H100 SXM).
pub(super) const GPU_FLOP_PER_LINK_BYTE: f64 = 2750.0;

/// The same for one CPU thread: its f32 GEMMs (~50 GFLOP/s) over Gloo's 1.1 GB/s on loopback
/// (docs/performance.md).
pub(super) const CPU_FLOP_PER_LINK_BYTE_PER_THREAD: f64 = 45.0;

/// The time of sharding the frozen weights, in blocks recomputed. Each block's weights are
/// gathered twice per micro-batch (its forward, its backward), each gather in flight while the
/// block before computes (`LlamaForCausalLM::prefetch`), so it costs only what it takes beyond
/// one block's forward: `2 · layers · max(0, gathered bytes · FLOP-per-link-byte / forward
/// FLOPs − 1)` (0 for the 70B at 8192 tokens on NVLink: a gather is 0.17 of a forward).
/// Gathered FP8 weights come in one layout, so on CUDA they add [`one_layout_cost`].
pub(super) fn shard_cost(s: &Shape) -> f64 {
    let w = s.world as f64;
    let flop_per_byte = match s.target {
        Target::Cuda => GPU_FLOP_PER_LINK_BYTE,
        Target::Cpu => CPU_FLOP_PER_LINK_BYTE_PER_THREAD * s.threads.max(1) as f64,
    };
    // Per value: bytes gathered (all but this rank's share) against 2 FLOPs per token.
    let ratio = weight_elem(s) * (w - 1.0) / w * flop_per_byte / (2.0 * tokens(s).max(1.0));
    let exposed = 2.0 * s.model.num_hidden_layers as f64 * (ratio - 1.0).max(0.0);
    let p = &s.precision;
    let transposes =
        if s.target == Target::Cuda && p.compute == Compute::Fp8 && p.fp8_weights { one_layout_cost(s) } else { 0.0 };
    exposed + transposes
}

/// The cheapest recipe for `s` that fits in `device_bytes`: its own context parallelism
/// first, then (when nothing fits and the world allows) more ranks per sequence
/// (`train.context_parallel`, dividing the world: each doubling halves the activations for a
/// K/V exchange per block). At each, every way to hold the weights (replicated, in one or
/// both layouts; sharded over the world) with its fewest recomputed blocks, costed in
/// recomputed blocks: one layout on CUDA with FP8 weights adds [`one_layout_cost`], sharding
/// [`shard_cost`]; the cheapest wins, ties to the replicated weights. None if nothing fits.
pub fn cheapest_recipe(s: &Shape, device_bytes: f64) -> Option<(Shape, Budget)> {
    let own = s.context_parallel.max(1);
    // Full fine-tuning runs neither context-parallel nor sharded (config.rs refuses both).
    let more =
        (1..).map(|k| own << k).take_while(|&n| !s.full_fine_tuning && n <= s.world && s.world.is_multiple_of(n));
    std::iter::once(own)
        .chain(more)
        .find_map(|n| cheapest_at(&Shape { context_parallel: n, ..s.clone() }, device_bytes))
}

/// [`cheapest_recipe`] at `s`'s context parallelism.
pub(super) fn cheapest_at(s: &Shape, device_bytes: f64) -> Option<(Shape, Budget)> {
    let l = s.model.num_hidden_layers;
    let p = s.precision;
    // (sharded, one layout): replicated in the config's layout, in one layout, sharded.
    let mut ways = vec![(false, p.fp8_weights_one_layout)];
    if s.target == Target::Cuda && p.fp8_weights && !p.fp8_weights_one_layout {
        ways.push((false, true));
    }
    if s.world > 1 && !s.full_fine_tuning {
        ways.push((true, p.fp8_weights_one_layout));
    }
    let mut best: Option<(f64, Shape, Budget)> = None;
    for (shard, one_layout) in ways {
        let precision = PrecisionSpec { fp8_weights_one_layout: one_layout, ..p };
        // The peak falls with every block recomputed: the first that fits is this way's best.
        let fit = (0..=l).find_map(|n| {
            let cand = Shape { recompute_layers: n, shard_frozen_weights: shard, precision, ..s.clone() };
            let b = budget(&cand);
            (b.peak <= device_bytes).then_some((cand, b))
        });
        let Some((cand, b)) = fit else { continue };
        let extra = match (shard, one_layout && !p.fp8_weights_one_layout) {
            (true, _) => shard_cost(s),
            (false, true) => one_layout_cost(s),
            (false, false) => 0.0,
        };
        let cost = cand.recompute_layers as f64 + extra;
        if best.as_ref().is_none_or(|(c, _, _)| cost < *c) {
            best = Some((cost, cand, b));
        }
    }
    best.map(|(_, cand, b)| (cand, b))
}
