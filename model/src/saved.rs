//! `Saved`: one tensor a module keeps for its backward, in bytes per token. Each module
//! declares what its forward keeps beside that forward (`RmsNorm::saved_per_token`,
//! `Attention::saved_per_token`, `Mlp::saved_per_token`, `LoraAdapter::saved_per_token`);
//! `DecoderLayer::saved_per_token` lists a block's, and `llora plan` sums them per token, so a
//! module that starts keeping another tensor changes the plan in the same place.

/// One tensor kept for backward, per token of one decoder block.
#[derive(Debug, Clone, PartialEq)]
pub struct Saved {
    /// What it is (`q after RoPE`, `o_proj adapter bottleneck`, ...).
    pub name: String,
    /// Bytes per token.
    pub bytes: f64,
    /// Which backward reads it.
    pub why: &'static str,
}

impl Saved {
    /// `name`, `bytes` per token, read by `why`.
    pub fn new(name: impl Into<String>, bytes: f64, why: &'static str) -> Self {
        Self { name: name.into(), bytes, why }
    }
}
