//! The one way a model is loaded to be run rather than trained (`llora eval`, `llora generate`):
//! a checkpoint, a PEFT adapter on it if given, in a precision.

use std::path::Path;

use anyhow::Context;
use burn::tensor::Device;

use crate::checkpoint::HfCheckpoint;
use crate::llama::{BuildOptions, LlamaForCausalLM};
use crate::precision::PrecisionSpec;

impl HfCheckpoint {
    /// The checkpoint's model with the PEFT adapter in `adapter` (if any), in `spec`: an NF4
    /// base quantised one tensor at a time as it loads (never whole in f32); the adapter loaded
    /// into f32 parameters; then the whole model switched to the precision.
    pub fn load_for_inference(
        &self,
        adapter: Option<&Path>,
        spec: &PrecisionSpec,
        device: &Device,
    ) -> anyhow::Result<LlamaForCausalLM> {
        let build = BuildOptions { precision: spec.nf4.map(|_| *spec), ..Default::default() };
        let mut model = self.load_model(&build, device)?;
        if let Some(adapter) = adapter {
            crate::peft::load_peft_adapter(&mut model, adapter, device)
                .with_context(|| format!("loading the adapter {}", adapter.display()))?;
        }
        if !spec.is_fp32() {
            model.set_precision(spec)?;
        }
        Ok(model)
    }
}
