//! FP8 delayed scaling of one linear layer: a state per tensor role (input, weight, output
//! gradient), and the scale a tensor of a given amax gets in training and in evaluation.

use serde::{Deserialize, Serialize};

use crate::fp8::{AmaxSpec, DelayedScaling, Fp8Format};

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
    pub(super) const ALL: [Role; 3] = [Role::Input, Role::Weight, Role::Grad];
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

    pub(super) fn new() -> Self {
        Self {
            input: DelayedScaling::new(Fp8Format::E4M3),
            weight: DelayedScaling::new(Fp8Format::E4M3),
            grad: DelayedScaling::new(Fp8Format::E5M2),
        }
    }
}

/// A scale for a tensor of the given amax: recorded during training, looked up otherwise.
pub(super) fn scale_of(state: &mut DelayedScaling, amax: f32, spec: &AmaxSpec, train: bool) -> f32 {
    if train {
        state.observe(amax, spec)
    } else if state.initialized {
        state.scale
    } else {
        // Never trained: use the tensor's own amax without recording it.
        crate::fp8::scale_for_amax(amax, state.format.max(), spec.margin).unwrap_or(1.0)
    }
}
