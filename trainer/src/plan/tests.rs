//! The plan's unit tests: hand-counted bytes, recipes, advice.

use super::recipe::{one_layout_cost, shard_cost};
use super::*;

/// When nothing fits, the advice names only changes the run has not made:
/// FP8 weights when it has none, one layout when it keeps two, neither when it has both.
#[test]
fn advice_when_nothing_fits_names_only_what_is_left() {
    let mut s = mlperf(1, 0, false);
    s.precision = PrecisionSpec { compute: Compute::Bf16, ..Default::default() };
    assert!(no_fit_advice(&s).contains("precision.fp8_weights = true"), "{}", no_fit_advice(&s));
    s = mlperf(1, 0, false);
    let two = no_fit_advice(&s);
    assert!(two.contains("one layout") && !two.contains("precision.compute"), "{two}");
    s.precision.fp8_weights_one_layout = true;
    let done = no_fit_advice(&s);
    assert!(
        !done.contains("fp8")
            && done
                == "use more ranks (and split each sequence over them: train.context_parallel) or shorter sequences",
        "{done}"
    );
}

/// Per-module ranks and layer selection change the adapter count as worked out by hand: on
/// the 70B shape (d 8192, k/v width 1024, 80 layers), q/k/v/o at r 16, v_proj at r 4 and
/// only layers 0 and 1 adapted.
#[test]
fn adapter_bytes_follow_rank_patterns_and_layers() {
    let mut s = mlperf(1, 0, false);
    s.model.fused_qkv = false;
    s.lora.targets = ["q_proj", "k_proj", "v_proj", "o_proj"].map(String::from).to_vec();
    let (d, kv) = (8192.0, 1024.0);
    let per_layer = |rv: f64| 16.0 * (d + d) + 16.0 * (d + kv) + rv * (d + kv) + 16.0 * (d + d);
    assert_eq!(lora_params(&s), 80.0 * per_layer(16.0));
    s.lora.rank_pattern = vec![("v_proj".into(), 4)];
    assert_eq!(lora_params(&s), 80.0 * per_layer(4.0));
    s.lora.layers = Some(vec![0, 1]);
    assert_eq!(lora_params(&s), 2.0 * per_layer(4.0));
    // DoRA: a magnitude per output row of each adapted module (q d, k kv, v kv, o d).
    s.lora.dora = true;
    assert_eq!(lora_params(&s), 2.0 * (per_layer(4.0) + d + kv + kv + d));
}

/// The planner counts the adapters the loader attaches: a `tiny-gqa` model built with each
/// target set (on both layouts, `qkv_proj` on separate projections meaning q, k and v)
/// has as many LoRA parameters as [`lora_params`] says.
#[test]
fn adapter_count_is_the_built_models() {
    // Building draws A from LibTorch's generator.
    let _rng = llora_model::device::torch_rng_lock();
    let device = burn::tensor::Device::default();
    for (fused, targets) in [
        (false, &["qkv_proj", "o_proj"][..]),
        (false, &["q_proj", "v_proj", "down_proj"]),
        (true, &["qkv_proj", "gate_proj"]),
    ] {
        let mut s = mlperf(1, 0, false);
        s.model = LlamaConfig { fused_qkv: fused, ..LlamaConfig::preset("tiny-gqa").unwrap() };
        s.lora = llora_model::LoraSpec {
            rank: 4,
            targets: targets.iter().map(|t| t.to_string()).collect(),
            ..Default::default()
        };
        let opts = llora_model::BuildOptions { lora: Some(&s.lora), ..Default::default() };
        let model = llora_model::LlamaForCausalLM::random(&s.model, &opts, &device).unwrap();
        assert_eq!(lora_params(&s), model.num_lora_parameters() as f64, "{targets:?}, fused {fused}");
    }
}

/// NF4 (QLoRA) frozen weights, worked by hand on Llama 2 70B: 80 layers of
/// 8192·(8192 + 1024 + 1024 + 8192) + 3·8192·28672 = 855,638,016 values, at half a byte a
/// value plus the scales: 64 values share 1 byte of scale code and 1/256 of a 4-byte f32 (double
/// quantisation) = 0.515869 bytes a value, 35.31 GB; 0.5625 without double quantisation.
#[test]
fn nf4_frozen_weights_take_half_a_byte_and_the_scales() {
    let mut s = mlperf(1, 0, false);
    let values = 80.0 * 855_638_016.0;
    s.precision = PrecisionSpec { compute: Compute::Bf16, ..Default::default() };
    s.precision.nf4 = Some(llora_model::precision::Nf4Spec { block: 64, double: true });
    let frozen = |s: &Shape| budget(s).lines.iter().find(|l| l.name == "frozen linear weights").unwrap().bytes;
    let got = frozen(&s);
    assert!((got / values - (0.5 + (1.0 + 4.0 / 256.0) / 64.0)).abs() < 1e-4, "{} bytes a value", got / values);
    assert!((got / 1e9 - 35.31).abs() < 0.05, "{} GB", got / 1e9);
    s.precision.nf4 = Some(llora_model::precision::Nf4Spec { block: 64, double: false });
    assert!((frozen(&s) / values - 0.5625).abs() < 1e-4);
}

/// With FP8 activations each adapter's A keeps an FP8 copy of its input (1 byte a value): one
/// per adapter with dropout (each its own dropped input), one per input without (q, k and v
/// share theirs, gate and up theirs): on Llama 2 70B with all seven linears adapted,
/// q/k/v/o/gate/up 6·8192 + down 28672 bytes a token with dropout, 3·8192 + 28672 without.
#[test]
fn adapters_without_dropout_keep_one_fp8_copy_of_each_input() {
    let mut s = mlperf(1, 0, false);
    s.model.fused_qkv = false;
    let seven = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"];
    s.lora.targets = seven.iter().map(|t| t.to_string()).collect();
    let copies = |s: &Shape| -> f64 {
        kept_per_token(s).iter().filter(|k| k.name.ends_with("adapter input")).map(|k| k.bytes).sum()
    };
    assert_eq!(copies(&s), 6.0 * 8192.0 + 28672.0);
    s.lora.dropout = 0.0;
    assert_eq!(copies(&s), 3.0 * 8192.0 + 28672.0);
}

/// DoRA keeps, per token and adapted module, the factor its magnitude multiplies (one
/// output row; two with dropout), in the adapter output's dtype: bf16 under FP8 (the
/// MLPerf job: qkv 10240 wide, o 8192, dropout 0.1), f32 otherwise.
#[test]
fn dora_keeps_its_rescale_input_per_token() {
    let mut s = mlperf(1, 0, false);
    let base: f64 = kept_per_token(&s).iter().map(|k| k.bytes).sum();
    s.lora.dora = true;
    let dora: f64 = kept_per_token(&s).iter().map(|k| k.bytes).sum();
    assert_eq!(dora - base, 2.0 * 2.0 * (10240.0 + 8192.0));
    s.lora.dropout = 0.0;
    s.precision = PrecisionSpec { compute: Compute::Bf16, ..Default::default() };
    let base: f64 =
        kept_per_token(&Shape { lora: llora_model::LoraSpec { dora: false, ..s.lora.clone() }, ..s.clone() })
            .iter()
            .map(|k| k.bytes)
            .sum();
    let dora: f64 = kept_per_token(&s).iter().map(|k| k.bytes).sum();
    assert_eq!(dora - base, 4.0 * (10240.0 + 8192.0));
}

/// The MLPerf job's block (70B, fused qkv + o adapters, r 16, dropout 0.1, FP8 weights and
/// activations), one 8192-token sequence.
fn mlperf(world: usize, recompute: usize, shard: bool) -> Shape {
    Shape {
        model: LlamaConfig { fused_qkv: true, ..LlamaConfig::llama2_70b() },
        lora: llora_model::LoraSpec {
            rank: 16,
            dropout: 0.1,
            targets: vec!["qkv_proj".into(), "o_proj".into()],
            ..Default::default()
        },
        precision: PrecisionSpec {
            compute: Compute::Fp8,
            fp8_weights: true,
            fp8_activations: true,
            ..Default::default()
        },
        micro_batch: 1,
        seq_len: 8192,
        target_fraction: 1.0,
        recompute_layers: recompute,
        shard_frozen_weights: shard,
        full_fine_tuning: false,
        frozen_reference: false,
        world,
        context_parallel: 1,
        target: Target::Cuda,
        threads: 1,
        native_bf16_gemm: true,
    }
}

/// Llama 3 8B (vocab 128256, d 4096, I 14336, 32 layers, 32 heads over 8 K/V heads) in
/// bf16 with LoRA on q/k/v/o, one `seq`-token sequence on `world` GPUs.
fn llama3_8b(seq: usize, world: usize) -> Shape {
    let model = LlamaConfig {
        vocab_size: 128256,
        hidden_size: 4096,
        intermediate_size: 14336,
        num_hidden_layers: 32,
        num_attention_heads: 32,
        num_key_value_heads: 8,
        head_dim: 128,
        max_position_embeddings: 131072,
        ..LlamaConfig::llama2_7b()
    };
    Shape {
        model,
        precision: PrecisionSpec { compute: Compute::Bf16, ..Default::default() },
        seq_len: seq,
        world,
        ..mlperf(world, 0, false)
    }
}

/// The MLPerf config, without its checkpoint, is planned in the fused-QKV layout its
/// `qkv_proj` target names (the reference's conversion; on separate q/k/v training refuses
/// that target), and on 8 x H100 80 GB the recipe it ships (31 blocks recomputed, sharded
/// weights) is the cheapest that fits.
#[test]
fn the_mlperf_config_plans_its_fused_checkpoint() {
    let path = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../configs/llama2-70b-mlperf.toml"));
    let config = crate::config::Config::load(Some(path), &[]).unwrap();
    let s = shape_of(&config, 8).unwrap();
    assert!(s.model.fused_qkv);
    let (r, b) = cheapest_recipe(&s, 80.0 * GB).unwrap();
    assert_eq!((r.recompute_layers, r.shard_frozen_weights), (config.train.recompute_layers, true));
    assert!(b.peak <= 80.0 * GB);
}

/// Context parallelism N holds 1/N of each sequence's tokens (the saved
/// activations, the final norm and loss, the workspace fall by N), plus the exchange,
/// counted by hand: the whole sequence's K/V (8 heads × 128 = 1024 wide at 70B) in bf16,
/// their f32 gradients, and this rank's f32 dq and merged output (8192 wide).
#[test]
fn context_parallelism_divides_the_tokens_and_counts_the_exchange() {
    let one = mlperf(8, 0, false);
    let two = Shape { context_parallel: 2, ..one.clone() };
    assert_eq!((tokens(&one), tokens(&two)), (8192.0, 4096.0));
    let line = |b: &Budget, name: &str| b.lines.iter().find(|l| l.name == name).map(|l| l.bytes);
    let (b1, b2) = (budget(&one), budget(&two));
    let kept = |b: &Budget| line(b, "saved activations").unwrap();
    assert!((kept(&b2) / kept(&b1) - 0.5).abs() < 1e-3, "{} {}", kept(&b1), kept(&b2));
    assert_eq!(line(&b1, "context-parallel K/V exchange"), None);
    let (whole, local) = (8192.0 * 1024.0, 4096.0 * 8192.0);
    let want = allocated(whole * 2.0, Target::Cuda) * 2.0
        + allocated(whole * 4.0, Target::Cuda) * 2.0
        + allocated(local * 4.0, Target::Cuda) * 2.0;
    assert_eq!(line(&b2, "context-parallel K/V exchange"), Some(want));
}

/// The recipe splits a sequence over ranks only when nothing else fits: Llama 3
/// 8B at 131072 tokens (Llama 3.1's context) in bf16 fits no single 80 GiB GPU even with
/// every block recomputed (at 65536 it does, recomputing), and on 2 GPUs it takes context
/// parallelism 2 (where it fits, with the fewest blocks recomputed); at 8192 tokens one
/// GPU suffices and no split is proposed.
#[test]
fn the_recipe_splits_a_sequence_only_when_nothing_else_fits() {
    let gpu = 80.0 * GB;
    assert!(cheapest_recipe(&llama3_8b(131072, 1), gpu).is_none());
    let (r, b) = cheapest_recipe(&llama3_8b(131072, 2), gpu).expect("context parallelism 2 fits");
    assert_eq!(r.context_parallel, 2);
    assert!(b.peak <= gpu);
    if r.recompute_layers > 0 {
        let fewer = Shape { recompute_layers: r.recompute_layers - 1, ..r.clone() };
        assert!(budget(&fewer).peak > gpu, "{} blocks recomputed would do", r.recompute_layers - 1);
    }
    let (short, _) = cheapest_recipe(&llama3_8b(8192, 2), gpu).unwrap();
    assert_eq!(short.context_parallel, 1);
}

/// Sharding costs what its gathers do not hide behind the block before (hand-counted: the
/// 70B's FP8 block on 8 ranks at 8192 tokens gathers 7/8 B per value against 2·8192
/// FLOPs, 0.147 of a forward at 2750 FLOP per link byte: hidden, leaving one layout's
/// transposes; at 256 tokens in bf16 each gather is 9.4 forwards, 8.4 exposed, twice per
/// block). So at context parallelism 2 on 8 x H100 80 GiB the recipe shards the weights
/// and recomputes nothing (about 62.5 GiB) instead of recomputing ~79 blocks of
/// replicated one-layout weights, and sharding is still taken where nothing else fits
/// however much it costs.
#[test]
fn sharding_is_chosen_where_it_saves_recomputation() {
    let s = mlperf(8, 0, false);
    assert_eq!(shard_cost(&s), one_layout_cost(&s));
    assert!((one_layout_cost(&s) - 80.0 * 250.0 / 8192.0).abs() < 1e-12);
    let short =
        Shape { seq_len: 256, precision: PrecisionSpec { compute: Compute::Bf16, ..Default::default() }, ..s.clone() };
    let ratio = 2.0 * 7.0 / 8.0 * 2750.0 / (2.0 * 256.0);
    assert!((shard_cost(&short) - 2.0 * 80.0 * (ratio - 1.0)).abs() < 1e-9, "{}", shard_cost(&short));
    let dev = 80.0 * GB;
    let cp2 = Shape { context_parallel: 2, ..s.clone() };
    // Replicated, only one layout fits, and only with nearly every block recomputed.
    let one = PrecisionSpec { fp8_weights_one_layout: true, ..cp2.precision };
    let replicated = |n, precision| budget(&Shape { recompute_layers: n, precision, ..cp2.clone() }).peak;
    assert!(replicated(80, cp2.precision) > dev);
    let n = (0..=80).find(|&n| replicated(n, one) <= dev).expect("one layout fits, recomputing");
    assert!(n >= 70, "{n}");
    let (r, b) = cheapest_recipe(&cp2, dev).unwrap();
    assert_eq!((r.context_parallel, r.recompute_layers, r.shard_frozen_weights), (2, 0, true));
    assert!(b.peak <= dev && b.peak > 55.0 * GB, "{} GiB", b.peak / GB);
    // Only sharding fits the 70B on 8 x 80 GiB at context parallelism 1, short or not.
    let (r, _) = cheapest_recipe(&short, dev).unwrap();
    assert!(r.shard_frozen_weights);
}

/// Per-token bytes worked out by hand from the ops (d 8192, q 8192, kv 1024, I 28672, H 64).
#[test]
fn kept_and_minimum_bytes_match_the_hand_count() {
    let s = mlperf(8, 0, false);
    // x 2·8192 + h 2·8192 (the fused norms keep their bf16 input) + two f32 1/rms + q,k,v,out in bf16
    // 2·(2·8192 + 2·1024) + lse 4·64 + gate/up 2·28672·1 + (dropped-out input 8192 + FP8
    // bottleneck 16) for qkv and for o (the dropout masks are redrawn, not kept).
    let kept = 16384.0 + 16384.0 + 8.0 + 36864.0 + 256.0 + 57344.0 + 2.0 * (8192.0 + 16.0);
    assert_eq!(per_token(&kept_per_token(&s)), kept);
    // x and h in bf16 with f32 1/rms, attention tensors + lse, gate/up, the adapters' input
    // once, two bottlenecks.
    let min = 2.0 * (16384.0 + 4.0) + (36864.0 + 256.0) + 57344.0 + 8192.0 + 32.0;
    assert_eq!(per_token(&minimum_per_token(&s)), min);
}

/// More recomputed blocks and sharding each lower the peak; the recipe search returns the
/// first that fits, which is no cheaper than needed.
#[test]
fn recipes_are_monotone_and_the_cheapest_is_the_first_that_fits() {
    let peak = |n, shard| budget(&mlperf(8, n, shard)).peak;
    assert!(peak(0, false) > peak(40, false) && peak(40, false) > peak(80, false));
    assert!(peak(80, false) > peak(80, true));
    let dev = 80.0 * GB;
    let (r, b) = cheapest_recipe(&mlperf(8, 0, false), dev).expect("sharded + recompute fits 80 GiB");
    assert!(r.shard_frozen_weights && b.peak <= dev);
    assert!(peak(r.recompute_layers - 1, true) > dev, "one block fewer would fit too");
    // 288 GiB holds the replicated FP8 replica with every activation.
    let (r, _) = cheapest_recipe(&mlperf(8, 0, false), 288.0 * GB).unwrap();
    assert_eq!((r.recompute_layers, r.shard_frozen_weights), (0, false));
}

/// One 141 GB GPU: the 70B's FP8 weights in both layouts (130560 MB:
/// 2 B per value) leave no room, every block recomputed or not; in one layout they take
/// exactly half, and the search finds that recipe with the fewest recomputed blocks.
#[test]
fn one_gpu_fits_the_70b_with_fp8_weights_in_one_layout() {
    let line = |s: &Shape| budget(s).lines.iter().find(|x| x.name == "frozen linear weights").unwrap().bytes;
    let both = mlperf(1, 0, false);
    let one = Shape { precision: PrecisionSpec { fp8_weights_one_layout: true, ..both.precision }, ..both.clone() };
    // 80 blocks of (8192·(8192 + 2·1024) + 8192² + 3·8192·28672) values, 1 B each per layout.
    let values = 80.0 * (8192.0 * 10240.0 + 8192.0 * 8192.0 + 3.0 * 8192.0 * 28672.0);
    assert!((line(&both) - 2.0 * values).abs() / values < 1e-3, "{} vs {}", line(&both), 2.0 * values);
    assert_eq!(line(&one), line(&both) / 2.0);
    let dev = 141.0 * GB;
    assert!(budget(&Shape { recompute_layers: 80, ..both.clone() }).peak > dev, "both layouts cannot fit");
    let (r, b) = cheapest_recipe(&both, dev).expect("one layout fits 141 GiB");
    assert!(r.precision.fp8_weights_one_layout && b.peak <= dev);
    let fewer = Shape { recompute_layers: r.recompute_layers - 1, ..r.clone() };
    assert!(budget(&fewer).peak > dev, "one block fewer would fit too");
    assert!(report(&both, Some(dev)).contains("precision.fp8_weights_one_layout = true"));
    // Its time, in recomputed blocks: 80 layers · 250 FLOP/B / 8192 tokens.
    assert_eq!(one_layout_cost(&both), 80.0 * 250.0 / 8192.0);
    // 8 x 180 GiB: both layouts fit only with many blocks recomputed, one layout with none,
    // which costs less; at 288 GiB both layouts fit with none, and stay.
    let dev = 180.0 * GB;
    let both_n = (0..=80).find(|&n| budget(&mlperf(8, n, false)).peak <= dev).unwrap();
    assert!(both_n as f64 > one_layout_cost(&both), "{both_n}");
    let (r, _) = cheapest_recipe(&mlperf(8, 0, false), dev).unwrap();
    assert_eq!((r.recompute_layers, r.shard_frozen_weights, r.precision.fp8_weights_one_layout), (0, false, true));
    let (r, _) = cheapest_recipe(&mlperf(8, 0, false), 288.0 * GB).unwrap();
    assert!(!r.precision.fp8_weights_one_layout);
}

#[test]
fn device_sizes_parse_with_units() {
    use crate::cli::parse_bytes;
    assert_eq!(parse_bytes("80GiB").unwrap(), 80.0 * GB);
    assert_eq!(parse_bytes("141GB").unwrap(), 141e9);
    assert_eq!(parse_bytes("512 MiB").unwrap(), 512.0 * MB);
    assert!(parse_bytes("80 gigs").unwrap_err().contains("unknown unit"));
    assert!(parse_bytes("-1GiB").is_err());
}

/// A window shorter than the rows (Mistral v0.1's 4096 at 8192 tokens, all 32 layers): on CUDA in
/// bf16 flash attention's window runs and on the CPU its flash kernel by blocks, and the plan
/// adds nothing; in f32 on CUDA the masked path keeps three f32 `[32, 8192, 8192]` tensors a
/// layer (8 GiB each, hand-counted), two more in one layer's backward.
#[test]
fn a_sliding_window_costs_scores_only_where_the_masked_path_runs() {
    let mut s = mlperf(1, 0, false);
    s.model = LlamaConfig::mistral_7b();
    s.model.family.sliding_window = Some(4096);
    s.precision = PrecisionSpec { compute: Compute::Bf16, ..Default::default() };
    assert!(budget::sliding_window_scores(&s).is_none(), "bf16 on CUDA: flash's window");
    s.model.family.sliding_window = Some(8192);
    s.precision = PrecisionSpec::default();
    assert!(budget::sliding_window_scores(&s).is_none(), "a window as long as the rows is causal attention");
    s.model.family.sliding_window = Some(4096);
    // Per layer three f32 [H, seq, seq] tensors kept (32 heads), two more in one layer's backward.
    let scores = 32.0 * 8192.0 * 8192.0 * 4.0;
    let line = budget::sliding_window_scores(&s).expect("f32 on CUDA: the masked path");
    let least = (32.0 * 3.0 + 2.0) * scores;
    assert!(line.bytes >= least && line.bytes < 1.05 * least, "{} vs {least}", line.bytes);
    s.target = Target::Cpu;
    assert!(budget::sliding_window_scores(&s).is_none(), "the CPU: its flash kernel by blocks");
}

/// Full fine-tuning is planned as it runs, hand-counted on `tiny` (V 32000, d 256, I 688, 4
/// layers) at 512 tokens on the CPU: every weight f32 (the linears and both tables), each
/// parameter's gradient and two AdamW moments plus one temporary of the largest tensor (the
/// embedding), every linear's input kept for its weight's gradient (o_proj's is attention's
/// output), and the unfused loss's three f32 `[rows, V]` buffers; no adapter, no sharding, no
/// context parallelism; the advice says to train adapters. (It planned LoRA's memory before.)
#[test]
fn full_fine_tuning_plans_f32_weights_gradients_moments_and_whole_logits() {
    let c = LlamaConfig::preset("tiny").unwrap();
    let lora = Shape {
        model: c.clone(),
        precision: PrecisionSpec::default(),
        seq_len: 512,
        target: Target::Cpu,
        ..mlperf(1, 0, false)
    };
    let full = Shape { full_fine_tuning: true, ..lora.clone() };
    let line = |s: &Shape, name: &str| budget(s).lines.iter().find(|l| l.name == name).map(|l| l.bytes);
    let alloc = |bytes: f64| allocated(bytes, Target::Cpu);
    let n = c.num_parameters() as f64;
    assert_eq!(n, 2.0 * 32000.0 * 256.0 + 4.0 * (4.0 * 256.0 * 256.0 + 3.0 * 256.0 * 688.0 + 2.0 * 256.0) + 256.0);
    let state = line(&full, "gradients and AdamW (full fine-tuning)").unwrap();
    assert_eq!(state, 3.0 * alloc(n * 4.0) + alloc(32000.0 * 256.0 * 4.0));
    assert_eq!(line(&full, "LoRA weights, gradients, AdamW"), None);
    // fp32 stores frozen weights in f32 too: the linears' bytes are the same, named as trained.
    assert_eq!(line(&full, "linear weights (trained)"), line(&lora, "frozen linear weights"));
    let kept = |s: &Shape| per_token(&kept_per_token(s));
    let no_adapters =
        Shape { lora: llora_model::LoraSpec { targets: Vec::new(), ..lora.lora.clone() }, ..lora.clone() };
    assert_eq!(kept(&full) - kept(&no_adapters), 4.0 * (256.0 + 256.0 + 688.0));
    let rows = (512.0 * full.target_fraction).ceil();
    assert_eq!(loss_transients(&full), (3.0 * alloc(rows * 32000.0 * 4.0), 0.0));
    assert!(budget(&full).peak > budget(&lora).peak + 3.0 * n * 4.0);
    // bf16 compute: the tables stay f32 where they train.
    let bf16 = PrecisionSpec { compute: Compute::Bf16, ..Default::default() };
    let tables = |s: &Shape| line(&Shape { precision: bf16, ..s.clone() }, "embedding, LM head, norms").unwrap();
    assert_eq!(tables(&full), 2.0 * tables(&lora) - 9.0 * alloc(256.0 * 4.0));
    // Eight ranks: no sharded or context-parallel recipe; the advice is LoRA.
    let eight = Shape { world: 8, target: Target::Cuda, seq_len: 8192, ..full.clone() };
    let (r, _) = cheapest_recipe(&eight, 1e12).unwrap();
    assert_eq!((r.shard_frozen_weights, r.context_parallel), (false, 1));
    assert!(cheapest_recipe(&eight, 1e9).is_none());
    assert!(no_fit_advice(&eight).contains("model.trainable = \"lora\""), "{}", no_fit_advice(&eight));
}

/// Preference tuning from an existing adapter keeps a frozen copy of it as the reference: one
/// more f32 per adapter parameter, counted from the config.
#[test]
fn a_frozen_reference_adds_one_copy_of_the_adapters() {
    let s = mlperf(8, 0, false);
    let plain = super::budget::trained_state(&s).bytes;
    let frozen = super::budget::trained_state(&Shape { frozen_reference: true, ..s.clone() }).bytes;
    assert_eq!(frozen - plain, super::budget::lora_params(&s) * 4.0);
    let path = std::path::Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/../configs/tiny-cpu.toml"));
    let ov = |s: &str| s.parse::<crate::config::Override>().unwrap();
    let sets = [ov("train.objective=\"dpo\""), ov("lora.init_from=\"runs/a/adapter\""), ov("mlperf.check=false")];
    let config = crate::config::Config::load(Some(path), &sets).unwrap();
    assert!(shape_of(&config, 1).unwrap().frozen_reference);
}
