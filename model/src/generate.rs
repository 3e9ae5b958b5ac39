//! Text generation from a model (with its adapters): a key/value cache per decoder block, the
//! prompt run once (causal prefill), then one position per step; greedy by default, or
//! temperature + nucleus (top-p) sampling from a seeded stream.

use anyhow::ensure;
use burn::tensor::{Int, Tensor, TensorData};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::llama::{LayerKv, LlamaForCausalLM, embed};

/// The keys and values every decoder block has seen so far.
pub struct KvCache {
    /// Per block: keys and values `[batch, KV, len, head_dim]` (None before the prefill).
    layers: Vec<LayerKv>,
    /// Positions cached.
    len: usize,
}

impl KvCache {
    /// An empty cache for `model`.
    pub fn new(model: &LlamaForCausalLM) -> Self {
        Self { layers: (0..model.layers.len()).map(|_| None).collect(), len: 0 }
    }

    /// Positions cached.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing is cached yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl LlamaForCausalLM {
    /// Runs `ids` after what `cache` holds and returns the logits of the last position; the
    /// new positions join the cache. The first call takes the whole prompt, later ones one
    /// token each.
    ///
    /// # Shapes
    /// - ids: `[batch, new]`
    /// - output: `[batch, vocab]`, f32
    pub fn decode(&self, ids: Tensor<2, Int>, cache: &mut KvCache) -> anyhow::Result<Tensor<2>> {
        let [b, s] = ids.dims();
        let device = ids.device();
        let end = cache.len + s;
        ensure!(
            end <= self.config.max_position_embeddings,
            "{end} positions exceed the model's max_position_embeddings ({})",
            self.config.max_position_embeddings
        );
        // This step's positions only: the tables of all earlier ones would be recomputed per token.
        let (cos, sin) = self.rope_at(cache.len..end, &device);
        let mut x = embed(self.embed_tokens.val(), ids, self.activations);
        for (k, layer) in self.layers.iter().enumerate() {
            layer.gather(k)?;
            x = layer.forward_cached(x, cos.clone(), sin.clone(), &mut cache.layers[k]);
            layer.release();
        }
        cache.len = end;
        let last = self.norm.forward(x.narrow(1, s - 1, 1));
        let head = self.head().cast(last.dtype());
        Ok(crate::lora::linear_t(last, head).reshape([b, self.config.vocab_size]).cast(burn::tensor::DType::F32))
    }
}

/// How the next token is chosen.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Sampling {
    /// The most likely token (HF `do_sample=False`).
    Greedy,
    /// Drawn from the softmax of logits / `temperature`, restricted to the smallest set of
    /// most likely tokens whose probability reaches `top_p`, from a stream seeded by `seed`.
    Sample {
        /// > 0.
        temperature: f64,
        /// In (0, 1].
        top_p: f64,
        /// The stream's seed.
        seed: u64,
    },
}

/// Continues `prompt` by up to `max_new` tokens, stopping after one of `stop` (which is
/// kept); `on_token` sees each new token as it comes. Returns the new tokens.
pub fn generate(
    model: &LlamaForCausalLM,
    prompt: &[u32],
    max_new: usize,
    stop: &[u32],
    sampling: Sampling,
    mut on_token: impl FnMut(u32),
) -> anyhow::Result<Vec<u32>> {
    ensure!(!prompt.is_empty(), "the prompt has no tokens");
    if let Sampling::Sample { temperature, top_p, .. } = sampling {
        ensure!(temperature.is_finite() && temperature > 0.0, "temperature {temperature} must be > 0");
        ensure!(top_p > 0.0 && top_p <= 1.0, "top_p {top_p} must be in (0, 1]");
    }
    let device = model.embed_tokens.device();
    let mut rng = match sampling {
        Sampling::Sample { seed, .. } => Some(ChaCha8Rng::seed_from_u64(seed)),
        Sampling::Greedy => None,
    };
    let mut cache = KvCache::new(model);
    let ids = |t: &[u32]| {
        let v: Vec<i64> = t.iter().map(|&x| x as i64).collect();
        Tensor::<2, Int>::from_data(TensorData::new(v, [1, t.len()]), &device)
    };
    let mut logits = model.decode(ids(prompt), &mut cache)?;
    let mut out = Vec::with_capacity(max_new);
    for _ in 0..max_new {
        let row: Vec<f32> = logits.into_data().convert::<f32>().into_vec().expect("f32 logits");
        let next = match (&mut rng, sampling) {
            (Some(rng), Sampling::Sample { temperature, top_p, .. }) => sample(&row, temperature, top_p, rng),
            _ => argmax(&row),
        };
        out.push(next);
        on_token(next);
        if stop.contains(&next) {
            break;
        }
        logits = model.decode(ids(&[next]), &mut cache)?;
    }
    Ok(out)
}

/// The first index of the largest value (torch.argmax's choice among equal values).
fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in row.iter().enumerate() {
        if x > row[best] {
            best = i;
        }
    }
    best as u32
}

/// One draw from softmax(row / temperature) restricted to its top-p nucleus.
fn sample(row: &[f32], temperature: f64, top_p: f64, rng: &mut ChaCha8Rng) -> u32 {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let mut probs: Vec<(usize, f64)> =
        row.iter().enumerate().map(|(i, &x)| (i, ((x as f64 - max) / temperature).exp())).collect();
    let total: f64 = probs.iter().map(|p| p.1).sum();
    probs.sort_by(|a, b| b.1.total_cmp(&a.1));
    let (mut kept, mut mass) = (0, 0.0);
    for p in &probs {
        kept += 1;
        mass += p.1 / total;
        if mass >= top_p {
            break;
        }
    }
    let nucleus = &probs[..kept];
    let norm: f64 = nucleus.iter().map(|p| p.1).sum();
    let mut u = rng.random::<f64>() * norm;
    for &(i, p) in nucleus {
        if u < p {
            return i as u32;
        }
        u -= p;
    }
    nucleus[kept - 1].0 as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_takes_the_first_of_equal_values() {
        assert_eq!(argmax(&[0.1, 0.7, 0.7, -1.0]), 1);
    }

    /// top_p 0.5 over probabilities (0.6, 0.3, 0.1): only the first; top_p 1 draws all three
    /// in about their proportions.
    #[test]
    fn nucleus_sampling_keeps_the_top_mass() {
        let logits: Vec<f32> = [0.6f64, 0.3, 0.1].iter().map(|p| p.ln() as f32).collect();
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        assert!((0..200).all(|_| sample(&logits, 1.0, 0.5, &mut rng) == 0));
        let mut counts = [0usize; 3];
        for _ in 0..20_000 {
            counts[sample(&logits, 1.0, 1.0, &mut rng) as usize] += 1;
        }
        let share: Vec<f64> = counts.iter().map(|&c| c as f64 / 20_000.0).collect();
        assert!((share[0] - 0.6).abs() < 0.02 && (share[2] - 0.1).abs() < 0.02, "{share:?}");
    }
}
