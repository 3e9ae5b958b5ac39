//! The delayed-scaling recipe, configuration only (Transformer Engine's `DelayedScaling` recipe):
//! its settings ([`AmaxSpec`]: history length, how the history becomes one amax, margin) and the
//! scale an amax gives. The state a run keeps (each tensor's amax history and scale) is
//! `scaling_state.rs`.

use serde::{Deserialize, Serialize};

/// `fp8_max / amax / 2^margin` in f32, as Transformer Engine computes it; `None` when amax is
/// zero or not finite (the previous scale must then be kept).
pub fn scale_for_amax(amax: f32, fp8_max: f32, margin: i32) -> Option<f32> {
    if amax.is_finite() && amax > 0.0 {
        let s = (fp8_max / amax) / 2f32.powi(margin);
        s.is_finite().then_some(s)
    } else {
        None
    }
}

/// How the amax history is reduced to the amax that sets the scale.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum AmaxAlgo {
    /// The largest amax in the history (Transformer Engine's default).
    #[default]
    Max,
    /// The newest amax only.
    MostRecent,
}

/// Delayed-scaling settings shared by every scaled tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct AmaxSpec {
    /// History length, 1..=1024.
    pub history_len: usize,
    /// How the history becomes one amax.
    pub algo: AmaxAlgo,
    /// Scale down by 2^margin for headroom.
    pub margin: i32,
}

impl Default for AmaxSpec {
    /// MLPerf submissions' Transformer Engine recipe: history 4, max, margin 0.
    fn default() -> Self {
        Self { history_len: 4, algo: AmaxAlgo::Max, margin: 0 }
    }
}
