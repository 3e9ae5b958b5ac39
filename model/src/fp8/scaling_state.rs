//! What delayed scaling keeps while a run trains (and a checkpoint saves): one tensor's state
//! ([`DelayedScaling`]: its amax history and the scale it gives) and a linear layer's three
//! ([`LinearScales`]: input, weight, output gradient), with the scale a tensor of a given amax
//! gets in training and in evaluation. The settings they follow are the recipe's
//! (`recipe.rs`).

use serde::{Deserialize, Serialize};

use super::format::Fp8Format;
use super::recipe::{AmaxAlgo, AmaxSpec, scale_for_amax};

/// Delayed scaling of one tensor, Transformer Engine style.
///
/// Each step quantises with the scale computed from the amaxes of *earlier* steps; the amax of
/// this step (the maximum over its micro-batches) is recorded and joins the history at
/// [`Self::update`], which the trainer calls after every optimizer step. The history keeps
/// the newest `history_len` amaxes; non-finite amaxes are not recorded (a NaN or ∞ step is
/// aborted by the trainer anyway) and a zero amax does not change the scale.
///
/// One difference from Transformer Engine, on purpose: TE starts every scale at 1, so the first
/// step quantises with an arbitrary scale (small gradients flush to zero in E5M2). Here a
/// tensor's very first quantisation uses its own amax (current scaling) instead.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DelayedScaling {
    /// Which format the scale is for.
    pub format: Fp8Format,
    /// Amaxes of past steps, newest first.
    pub history: Vec<f32>,
    /// The scale quantisation uses now.
    pub scale: f32,
    /// Whether a scale has been chosen (by the first use or an update).
    pub initialized: bool,
    /// Largest amax seen since the last update.
    pub pending: Option<f32>,
}

impl DelayedScaling {
    /// A fresh state: empty history, scale chosen at the first use.
    pub fn new(format: Fp8Format) -> Self {
        Self { format, history: Vec::new(), scale: 1.0, initialized: false, pending: None }
    }

    /// Records this use's amax and returns the scale to quantise it with.
    pub fn observe(&mut self, amax: f32, spec: &AmaxSpec) -> f32 {
        if !self.initialized
            && let Some(s) = scale_for_amax(amax, self.format.max(), spec.margin)
        {
            self.scale = s;
            self.initialized = true;
        }
        if amax.is_finite() {
            self.pending = Some(self.pending.map_or(amax, |p| p.max(amax)));
        }
        self.scale
    }

    /// End of a step: the step's amax joins the history and the scale is recomputed from it.
    pub fn update(&mut self, spec: &AmaxSpec) {
        let Some(amax) = self.pending.take() else { return };
        self.history.insert(0, amax);
        self.history.truncate(spec.history_len.max(1));
        let reduced = match spec.algo {
            AmaxAlgo::Max => self.history.iter().copied().fold(0.0f32, f32::max),
            AmaxAlgo::MostRecent => self.history[0],
        };
        if let Some(s) = scale_for_amax(reduced, self.format.max(), spec.margin) {
            self.scale = s;
            self.initialized = true;
        }
    }
}

/// The delayed-scaling states of one linear layer, by tensor role.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LinearScales {
    /// Forward input (E4M3).
    pub input: DelayedScaling,
    /// Weight (E4M3; unused when the weight is stored in FP8).
    pub weight: DelayedScaling,
    /// Gradient of the output (E5M2).
    pub grad: DelayedScaling,
}

/// Which delayed-scaling state of a layer a tensor feeds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The forward input.
    Input,
    /// The weight.
    Weight,
    /// The output gradient.
    Grad,
}

impl Role {
    pub(crate) const ALL: [Role; 3] = [Role::Input, Role::Weight, Role::Grad];
}

impl LinearScales {
    /// The state of `role`.
    pub fn get(&self, role: Role) -> &DelayedScaling {
        match role {
            Role::Input => &self.input,
            Role::Weight => &self.weight,
            Role::Grad => &self.grad,
        }
    }

    /// The state of `role`, mutably.
    pub fn get_mut(&mut self, role: Role) -> &mut DelayedScaling {
        match role {
            Role::Input => &mut self.input,
            Role::Weight => &mut self.weight,
            Role::Grad => &mut self.grad,
        }
    }

    pub(crate) fn new() -> Self {
        Self {
            input: DelayedScaling::new(Fp8Format::E4M3),
            weight: DelayedScaling::new(Fp8Format::E4M3),
            grad: DelayedScaling::new(Fp8Format::E5M2),
        }
    }
}

/// A scale for a tensor of the given amax: recorded during training, looked up otherwise.
pub(crate) fn scale_of(state: &mut DelayedScaling, amax: f32, spec: &AmaxSpec, train: bool) -> f32 {
    if train {
        state.observe(amax, spec)
    } else if state.initialized {
        state.scale
    } else {
        // Never trained: use the tensor's own amax without recording it.
        scale_for_amax(amax, state.format.max(), spec.margin).unwrap_or(1.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn amax_history_semantics() {
        let spec = AmaxSpec { history_len: 3, algo: AmaxAlgo::Max, margin: 0 };
        let mut s = DelayedScaling::new(Fp8Format::E4M3);
        // First use: current scaling from its own amax.
        assert_eq!(s.observe(2.0, &spec), 224.0);
        // Micro-batches of one step: the step's amax is their max; the scale does not move.
        assert_eq!(s.observe(1.0, &spec), 224.0);
        s.update(&spec);
        assert_eq!((s.history.clone(), s.scale), (vec![2.0], 224.0));
        let mut scales = Vec::new();
        for amax in [4.0, 0.5, 0.25, 0.125] {
            s.observe(amax, &spec);
            s.update(&spec);
            scales.push(s.scale);
        }
        // Histories: [4,2] → 4; [.5,4,2] → 4; [.25,.5,4] → 4; [.125,.25,.5] → .5 (4 dropped).
        assert_eq!(scales, vec![112.0, 112.0, 112.0, 896.0]);
        assert_eq!(s.history, vec![0.125, 0.25, 0.5]);

        let recent = AmaxSpec { algo: AmaxAlgo::MostRecent, margin: 1, ..spec };
        let mut r = DelayedScaling::new(Fp8Format::E5M2);
        assert_eq!(r.observe(57344.0, &recent), 0.5); // 57344 / 57344 / 2^1
        r.update(&recent);
        r.observe(7.0, &recent);
        r.update(&recent);
        assert_eq!(r.scale, 57344.0 / 7.0 / 2.0);
        // Zero and non-finite amaxes keep the scale; non-finite ones are not recorded.
        for bad in [0.0, f32::INFINITY, f32::NAN] {
            r.observe(bad, &recent);
            r.update(&recent);
        }
        assert_eq!(r.scale, 57344.0 / 7.0 / 2.0);
        assert_eq!(r.history, vec![0.0, 7.0, 57344.0]);
        // An update without a use since the last one changes nothing.
        let before = r.clone();
        r.update(&recent);
        assert_eq!(r, before);
        // A state serialises and comes back equal (checkpoints keep it).
        let json = serde_json::to_string(&s).unwrap();
        assert_eq!(serde_json::from_str::<DelayedScaling>(&json).unwrap(), s);
    }
}
