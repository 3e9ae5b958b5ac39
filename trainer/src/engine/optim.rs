//! AdamW with PyTorch's semantics, the cosine schedule of HF's Trainer, global-norm clipping.
//!
//! Burn's AdamW defaults differ from torch's (and the MLPerf rules fix betas, eps and weight
//! decay), so the update is written out here exactly as `torch.optim.AdamW` does it:
//! `p ← p·(1 − lr·wd)`, `m ← β₁m + (1−β₁)g`, `v ← β₂v + (1−β₂)g²`,
//! `p ← p − lr/(1−β₁ᵗ) · m / (√v/√(1−β₂ᵗ) + ε)`.

use std::collections::HashMap;

use burn::tensor::Tensor;
use llora_model::{AdamWHyper, AdamWItem, ParamMut, fused_adamw_update, fused_adamw_usable};

use crate::config::{FusedOptim, OptimConfig, ScheduleConfig};

/// Learning rate for optimizer step `k` (0-based), as HF's `get_cosine_schedule_with_warmup`:
/// linear from 0 over `warmup_steps`, then half a cosine from `lr` to 0 at `max_steps`.
pub fn lr_at(k: usize, lr: f64, schedule: &ScheduleConfig) -> f64 {
    let (w, n) = (schedule.warmup_steps, schedule.max_steps);
    if k < w {
        return lr * k as f64 / w as f64;
    }
    let progress = (k - w) as f64 / (n - w).max(1) as f64;
    lr * 0.5 * (1.0 + (std::f64::consts::PI * progress.min(1.0)).cos())
}

/// `min(1, max_norm / (‖g‖ + 1e-6))`, torch's `clip_grad_norm_` coefficient (1 when disabled).
pub fn clip_coefficient(total_norm: f64, max_norm: f64) -> f64 {
    if max_norm <= 0.0 { 1.0 } else { (max_norm / (total_norm + 1e-6)).min(1.0) }
}

/// First and second moments of one parameter, flattened.
#[derive(Debug, Clone)]
pub struct Moments {
    /// β₁-averaged gradient.
    pub m: Tensor<1>,
    /// β₂-averaged squared gradient.
    pub v: Tensor<1>,
}

/// AdamW state over named parameters.
#[derive(Debug, Clone)]
pub struct AdamW {
    /// Hyperparameters.
    pub config: OptimConfig,
    /// Steps taken (t in the bias corrections).
    pub step: u64,
    /// Moments per parameter name.
    pub state: HashMap<String, Moments>,
}

impl AdamW {
    /// A fresh optimizer.
    pub fn new(config: OptimConfig) -> Self {
        Self { config, step: 0, state: HashMap::new() }
    }

    /// One optimizer step over every trainable parameter with its gradient (flattened, in the
    /// order of `params`), each gradient multiplied by `clip` first, at learning rate `lr`.
    ///
    /// Where `optim.fused` asks for LibTorch's multi-tensor AdamW (by default: CUDA, or the CPU
    /// under `LLORA_CUDA_ROUTES_ON_CPU=1`) and it passed its first-use check there, the f32
    /// parameters take one launch; the others take [`AdamW::update`] one at a time. An error (the
    /// kernel refused its inputs) comes back with every parameter in its place: the run stops.
    pub fn step(
        &mut self,
        params: Vec<(String, ParamMut<'_>)>,
        grads: Vec<Tensor<1>>,
        clip: f64,
        lr: f64,
    ) -> Result<(), String> {
        self.step += 1;
        let mut fused = Vec::new();
        for ((name, mut param), grad) in params.into_iter().zip(grads) {
            if self.takes_fused(&param, &grad) {
                fused.push((name, param, grad));
            } else {
                self.update(&name, &mut param, grad.mul_scalar(clip), lr);
            }
        }
        self.update_fused(fused, clip, lr)
    }

    /// Updates one parameter with its (already clipped, flattened) gradient at learning rate `lr`.
    ///
    /// The parameter keeps its id and stays trainable; the gradient and moments live on the
    /// plain (non-autodiff) backend.
    fn update(&mut self, name: &str, param: &mut ParamMut<'_>, grad: Tensor<1>, lr: f64) {
        let c = &self.config;
        let [b1, b2] = c.betas;
        let t = self.step as i32;
        let p = param.flat().inner();
        let moments = self
            .state
            .entry(name.to_string())
            .or_insert_with(|| Moments { m: grad.zeros_like(), v: grad.zeros_like() });
        moments.m = moments.m.clone().mul_scalar(b1) + grad.clone().mul_scalar(1.0 - b1);
        moments.v = moments.v.clone().mul_scalar(b2) + grad.square().mul_scalar(1.0 - b2);
        let step_size = lr / (1.0 - b1.powi(t));
        let denom = moments.v.clone().sqrt().div_scalar((1.0 - b2.powi(t)).sqrt()).add_scalar(c.eps);
        let p = p.mul_scalar(1.0 - lr * c.weight_decay) - moments.m.clone().div(denom).mul_scalar(step_size);
        param.set_flat(p);
    }

    /// Whether `param` takes the multi-tensor update: an f32 parameter and gradient on a LibTorch
    /// device where `optim.fused` asks for it and the kernel passed its check.
    fn takes_fused(&self, param: &ParamMut<'_>, grad: &Tensor<1>) -> bool {
        let anywhere = match self.config.fused {
            FusedOptim::Off => return false,
            FusedOptim::Auto => false,
            FusedOptim::On => true,
        };
        let f32 = burn::tensor::DType::F32;
        let (dtype, device) = param.dtype_and_device();
        dtype == f32
            && grad.dtype() == f32
            && llora_model::precision::tch_device(&device).is_some_and(|d| fused_adamw_usable(d, anywhere))
    }

    /// [`fused_adamw_update`] over `fused`, the moments kept here.
    fn update_fused(
        &mut self,
        fused: Vec<(String, ParamMut<'_>, Tensor<1>)>,
        clip: f64,
        lr: f64,
    ) -> Result<(), String> {
        if fused.is_empty() {
            return Ok(());
        }
        let mut names = Vec::with_capacity(fused.len());
        let mut items = Vec::with_capacity(fused.len());
        for (name, param, grad) in fused {
            let moments = self.state.remove(&name);
            let Moments { m, v } = moments.unwrap_or_else(|| Moments { m: grad.zeros_like(), v: grad.zeros_like() });
            items.push(AdamWItem { param, grad, exp_avg: m, exp_avg_sq: v });
            names.push(name);
        }
        let c = &self.config;
        let hyper = AdamWHyper { lr, betas: c.betas, weight_decay: c.weight_decay, eps: c.eps };
        let (moments, result) = fused_adamw_update(items, self.step, &hyper, clip);
        for (name, [m, v]) in names.into_iter().zip(moments) {
            self.state.insert(name, Moments { m, v });
        }
        result
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cosine_matches_hand_values() {
        let s = ScheduleConfig { max_steps: 100, warmup_steps: 0 };
        assert_eq!(lr_at(0, 4e-4, &s), 4e-4);
        assert!((lr_at(50, 4e-4, &s) - 2e-4).abs() < 1e-12);
        assert!(lr_at(100, 4e-4, &s).abs() < 1e-12);
        let w = ScheduleConfig { max_steps: 110, warmup_steps: 10 };
        assert_eq!(lr_at(0, 1.0, &w), 0.0);
        assert_eq!(lr_at(5, 1.0, &w), 0.5);
        assert_eq!(lr_at(10, 1.0, &w), 1.0);
        assert!((lr_at(60, 1.0, &w) - 0.5).abs() < 1e-12);
    }

    #[test]
    fn clip_is_torchs() {
        assert_eq!(clip_coefficient(0.1, 0.3), 1.0);
        assert!((clip_coefficient(1.7205733, 0.3) - 0.17436038591256847).abs() < 1e-7);
        assert_eq!(clip_coefficient(5.0, 0.0), 1.0);
    }
}
