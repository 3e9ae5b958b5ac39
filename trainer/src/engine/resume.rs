//! Resumable checkpoints: everything a stopped run needs to continue exactly where it was.
//!
//! A checkpoint is a directory `<run.dir>/resume/step-N/` (how it is written, kept and
//! verified: `checkpoints.rs`):
//! - `state.json`: the [`Progress`] counters (step, samples, evaluations, data position, ...);
//! - `config.toml`: the resolved config of the run;
//! - `params.safetensors`: the trainable parameters, flattened, by name;
//! - `optimizer.safetensors`: AdamW's moments (`<name>.exp_avg`, `<name>.exp_avg_sq`);
//! - `fp8_scales.json`: the delayed-scaling states (amax histories and scales) of bf16/FP8
//!   runs, by layer (absent in fp32);
//! - `adapter/`: the adapters in PEFT format (LoRA runs), for use without resuming;
//! - `manifest.json`: sizes and SHA-256 of all of the above, written last.
//!
//! The dropout RNG needs no file: every step reseeds it from `(run.seed, step)`, so the step
//! number is its whole state.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use anyhow::{Context, ensure};
use burn::tensor::{Device, Tensor, TensorData};
use llora_data::loader::Position;
use llora_model::checkpoint::{read_safetensors_f32, safetensors_bytes, write_atomic};
use llora_model::save_peft_adapter;
use llora_model::{LlamaForCausalLM, LoraSpec};
use serde::{Deserialize, Serialize};

use crate::config::{Config, Override, differing_keys};
use crate::engine::checkpoints;
use crate::engine::optim::{AdamW, Moments};

/// Checkpoint format version written in `state.json`.
const FORMAT: u32 = 1;

/// Everything of a run in progress that is not a model weight: counters and optimizer state
/// (the FP8 scaling state lives in the model's layers and is saved with it).
#[derive(Debug, Clone)]
pub struct TrainState {
    /// Counters and data position.
    pub progress: Progress,
    /// AdamW moments and step.
    pub optim: AdamW,
}

/// The counters of a run in progress.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, Default)]
pub struct Progress {
    /// Optimizer steps done.
    pub step: usize,
    /// Training samples consumed.
    pub samples: usize,
    /// Evaluation points passed (skipped ones included).
    pub evals_done: usize,
    /// Input tokens consumed.
    pub tokens_seen: usize,
    /// Last evaluation loss.
    pub last_eval: Option<f64>,
    /// Where the training-data order continues.
    pub position: Position,
    /// Epoch milliseconds of `run_start` (time-to-train of a resumed run includes the gap).
    pub run_start_ms: u64,
    /// The fingerprint of the adapter preference tuning's frozen reference comes from
    /// (`lora.init_from`), so that a resumed run refuses one changed since the run started.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub reference_adapter: Option<String>,
}

#[derive(Serialize, Deserialize)]
struct StateFile {
    format: u32,
    progress: Progress,
    optimizer_step: u64,
}

/// A checkpoint read back from disk.
pub struct Checkpoint {
    /// The directory it was read from (`<run.dir>/resume/step-N`).
    pub dir: PathBuf,
    /// The run's counters.
    pub progress: Progress,
    /// The resolved config text of the run.
    pub config_toml: String,
    optimizer_step: u64,
    params: BTreeMap<String, (Vec<usize>, Vec<f32>)>,
    moments: BTreeMap<String, (Vec<usize>, Vec<f32>)>,
}

/// The file holding the delayed-scaling states.
const SCALES: &str = "fp8_scales.json";

/// Writes a checkpoint of the run into `<run_dir>/resume/step-N/` (N the step), keeping the
/// newest `keep` (see `checkpoints.rs`); returns its directory.
///
/// `adapter` is the LoRA spec and base-model name for the PEFT copy (None for full fine-tuning).
pub fn save_checkpoint(
    run_dir: &Path,
    keep: usize,
    config_toml: &str,
    state: &TrainState,
    model: &mut LlamaForCausalLM,
    adapter: Option<(&LoraSpec, &str)>,
) -> anyhow::Result<PathBuf> {
    checkpoints::save(run_dir, state.progress.step, keep, |dir| {
        write_checkpoint(dir, config_toml, state, model, adapter)
    })
}

/// Every file of a checkpoint into the directory `tmp` (`checkpoints::save` closes it with
/// the manifest).
fn write_checkpoint(
    tmp: &Path,
    config_toml: &str,
    state: &TrainState,
    model: &mut LlamaForCausalLM,
    adapter: Option<(&LoraSpec, &str)>,
) -> anyhow::Result<()> {
    let mut params = Vec::new();
    let mut moments = Vec::new();
    for (name, p) in model.trainable_params_mut() {
        let (shape, values) = llora_model::checkpoint::tensor_f32(&p.flat());
        if let Some(m) = state.optim.state.get(&name) {
            moments.push((format!("{name}.exp_avg"), shape.clone(), llora_model::checkpoint::tensor_f32(&m.m).1));
            moments.push((format!("{name}.exp_avg_sq"), shape.clone(), llora_model::checkpoint::tensor_f32(&m.v).1));
        }
        params.push((name, shape, values));
    }
    write_atomic(&tmp.join("params.safetensors"), &safetensors_bytes(&params)?)?;
    write_atomic(&tmp.join("optimizer.safetensors"), &safetensors_bytes(&moments)?)?;
    write_atomic(&tmp.join("config.toml"), config_toml.as_bytes())?;
    let scales = model.fp8_scales();
    if !scales.is_empty() {
        write_atomic(&tmp.join(SCALES), serde_json::to_string(&scales)?.as_bytes())?;
    }
    if let Some((spec, base)) = adapter {
        save_peft_adapter(model, spec, &tmp.join("adapter"), base)?;
    }
    let file = StateFile { format: FORMAT, progress: state.progress.clone(), optimizer_step: state.optim.step };
    write_atomic(&tmp.join("state.json"), serde_json::to_string_pretty(&file)?.as_bytes())
}

/// Config keys a resumed run may change: how it runs, logs and stops, not what it trains or
/// in which order (`schedule.max_steps` moves the end of the cosine, so it changes the
/// remaining learning rates; it must stay past the checkpoint's step).
const CHANGEABLE_ON_RESUME: &[&str] = &[
    "schedule.max_steps",
    "eval.target_loss",
    "eval.batch_size",
    "run.device",
    "run.threads",
    "run.checkpoint_every",
    "run.keep_checkpoints",
    "run.resume",
    "data.train_workers",
    "data.eval_workers",
    "train.recompute_layers",
    "train.shard_frozen_weights",
    // How many ranks share a sequence: the same data and adapters (a run's world may change too).
    "train.context_parallel",
    "train.warmup_batches",
    // One AdamW kernel or one launch per parameter: the same update (within f32 rounding).
    "optim.fused",
    "mlperf.check",
    "logging.",
    "dist.",
];

/// Refuses `--set` overrides of `llora train --resume` that cannot apply to a checkpoint of
/// step `step` saved with the config `saved`: moving the run (`run.dir`), and what
/// [`check_compatible`] refuses.
pub fn check_overrides(saved: &Config, resumed: &Config, overrides: &[Override], step: usize) -> anyhow::Result<()> {
    ensure!(
        !overrides.iter().any(|o| o.key == "run.dir"),
        "--set run.dir cannot move a resumed run: it continues in its own directory (copy the directory and \
         resume the copy to continue elsewhere)"
    );
    check_compatible(saved, resumed, step).map_err(|e| anyhow::anyhow!("--set {e}"))
}

/// Whether `config` can continue a run saved at step `step` with the config `saved`: a
/// `max_steps` past the step, and no change to what is trained (model, adapters, data,
/// optimizer, precision, seed, batch geometry); `run.dir` may differ (a moved directory).
pub fn check_compatible(saved: &Config, config: &Config, step: usize) -> anyhow::Result<()> {
    ensure!(
        config.schedule.max_steps > step,
        "schedule.max_steps = {} but the checkpoint is at step {step}: nothing is left to train (raise it past {step})",
        config.schedule.max_steps
    );
    let mut fixed: Vec<String> = differing_keys(&saved.to_toml(), &config.to_toml())
        .into_iter()
        .filter(|k| {
            k != "run.dir" && !CHANGEABLE_ON_RESUME.iter().any(|c| k == c || (c.ends_with('.') && k.starts_with(c)))
        })
        .collect();
    fixed.dedup();
    ensure!(
        fixed.is_empty(),
        "{} would change what the checkpoint was trained with; a resumed run may change only {}",
        fixed.join(", "),
        CHANGEABLE_ON_RESUME
            .iter()
            .map(|k| if k.ends_with('.') { format!("{k}*") } else { (*k).to_string() })
            .collect::<Vec<_>>()
            .join(", ")
    );
    Ok(())
}

/// The config and step of the newest checkpoint in `run_dir` whose config can be read
/// (unverified: a cheap look before [`load`] verifies).
pub fn peek(run_dir: &Path) -> anyhow::Result<(Config, usize)> {
    let mut why = Vec::new();
    for (step, dir) in checkpoints::list(run_dir) {
        let path = dir.join("config.toml");
        let parsed = std::fs::read_to_string(&path)
            .map_err(anyhow::Error::from)
            .and_then(|t| Ok(Config::parse(&path.display().to_string(), &t, &[])?));
        match parsed {
            Ok(c) => return Ok((c, step)),
            Err(e) => why.push(format!("{}: {e:#}", path.display())),
        }
    }
    anyhow::bail!("{}: no readable checkpoint config ({})", run_dir.display(), why.join("; "))
}

/// Reads the newest intact checkpoint of the run directory `run_dir` (or the checkpoint
/// directory `run_dir` itself), falling back past damaged ones with a warning.
pub fn load(run_dir: &Path) -> anyhow::Result<Checkpoint> {
    checkpoints::newest_usable(run_dir, read)
}

/// One checkpoint's contents, checked for consistency on their own (every parameter with both
/// moments of its size once an optimizer step was taken, no stray moment): what
/// [`Checkpoint::restore`] then checks against the model.
fn read(dir: &Path) -> anyhow::Result<Checkpoint> {
    let dir = dir.to_path_buf();
    let state_path = dir.join("state.json");
    let text = std::fs::read_to_string(&state_path).with_context(|| format!("cannot read {}", state_path.display()))?;
    let state: StateFile = serde_json::from_str(&text)
        .with_context(|| format!("{}: not a llora checkpoint state", state_path.display()))?;
    ensure!(
        state.format == FORMAT,
        "{}: checkpoint format {} (this llora reads {FORMAT})",
        state_path.display(),
        state.format
    );
    let config_path = dir.join("config.toml");
    let params = read_safetensors_f32(&dir.join("params.safetensors"))?;
    let moments = read_safetensors_f32(&dir.join("optimizer.safetensors"))?;
    check_moments(&params, &moments, state.optimizer_step, &dir.join("optimizer.safetensors"))?;
    Ok(Checkpoint {
        progress: state.progress,
        optimizer_step: state.optimizer_step,
        config_toml: std::fs::read_to_string(&config_path)
            .with_context(|| format!("cannot read {}", config_path.display()))?,
        params,
        moments,
        dir,
    })
}

/// Every parameter's AdamW moments are there with its number of values (after the first
/// optimizer step; before it, none need be), and every moment belongs to a parameter.
fn check_moments(
    params: &llora_model::checkpoint::F32Tensors,
    moments: &llora_model::checkpoint::F32Tensors,
    optimizer_step: u64,
    file: &Path,
) -> anyhow::Result<()> {
    let numel = |shape: &[usize]| shape.iter().product::<usize>();
    for (name, (shape, _)) in params {
        for which in ["exp_avg", "exp_avg_sq"] {
            let key = format!("{name}.{which}");
            match moments.get(&key) {
                Some((m, _)) => ensure!(
                    numel(m) == numel(shape),
                    "{}: optimizer moment {key} has {} values, its parameter {}",
                    file.display(),
                    numel(m),
                    numel(shape)
                ),
                None => ensure!(
                    optimizer_step == 0,
                    "{}: optimizer moment {key} is missing (the checkpoint is after optimizer step {optimizer_step})",
                    file.display()
                ),
            }
        }
    }
    for key in moments.keys() {
        let param = key.strip_suffix(".exp_avg_sq").or_else(|| key.strip_suffix(".exp_avg"));
        ensure!(
            param.is_some_and(|p| params.contains_key(p)),
            "{}: moment {key} belongs to no saved parameter",
            file.display()
        );
    }
    Ok(())
}

impl Checkpoint {
    /// The run directory the checkpoint belongs to.
    pub fn run_dir(&self) -> PathBuf {
        self.dir.parent().and_then(Path::parent).map_or_else(|| self.dir.clone(), Path::to_path_buf)
    }

    /// Puts the saved parameters and FP8 scales into `model`, the counters and moments into `state`.
    ///
    /// Every trainable parameter must be in the checkpoint with its size, and every saved
    /// tensor must belong to a parameter: anything else means another model or adapter layout.
    pub fn restore(
        &mut self,
        model: &mut LlamaForCausalLM,
        state: &mut TrainState,
        device: &Device,
    ) -> anyhow::Result<()> {
        state.progress = self.progress.clone();
        let optim = &mut state.optim;
        let file = self.dir.join("params.safetensors");
        let flat = |(shape, values): (Vec<usize>, Vec<f32>)| -> Tensor<1> {
            let n = shape.iter().product::<usize>();
            Tensor::from_data(TensorData::new(values, [n]), device)
        };
        for (name, mut p) in model.trainable_params_mut() {
            let want = p.flat().shape().num_elements();
            let saved = self
                .params
                .remove(&name)
                .with_context(|| format!("{}: parameter {name} is missing", file.display()))?;
            let got = saved.0.iter().product::<usize>();
            ensure!(got == want, "{}: parameter {name} has {got} values, the model's has {want}", file.display());
            p.set_flat(flat(saved));
            let (m, v) =
                (self.moments.remove(&format!("{name}.exp_avg")), self.moments.remove(&format!("{name}.exp_avg_sq")));
            if let (Some(m), Some(v)) = (m, v) {
                optim.state.insert(name, Moments { m: flat(m), v: flat(v) });
            }
        }
        if let Some(extra) = self.params.keys().next() {
            anyhow::bail!("{}: parameter {extra} is not trainable in this model", file.display());
        }
        if let Some(extra) = self.moments.keys().next() {
            anyhow::bail!(
                "{}: moment {extra} belongs to no trainable parameter",
                self.dir.join("optimizer.safetensors").display()
            );
        }
        optim.step = self.optimizer_step;
        let scales = self.dir.join(SCALES);
        if !model.fp8_scales().is_empty() {
            if scales.is_file() {
                let text =
                    std::fs::read_to_string(&scales).with_context(|| format!("cannot read {}", scales.display()))?;
                let saved = serde_json::from_str(&text)
                    .with_context(|| format!("{}: not a scaling-state file", scales.display()))?;
                model.set_fp8_scales(&saved).with_context(|| format!("{}", scales.display()))?;
            } else {
                tracing::warn!(
                    "{}: none saved (the checkpoint is from an fp32 run); FP8 scales start afresh",
                    scales.display()
                );
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// How the optimizer runs may change on resume (one kernel or a launch per parameter); what
    /// it computes may not.
    #[test]
    fn the_optimizer_kernel_may_change_on_resume_its_hyperparameters_may_not() {
        let ov = |s: &str| s.parse::<crate::config::Override>().unwrap();
        let saved = Config::load(None, &[]).unwrap();
        let fused_off = Config::load(None, &[ov("optim.fused=\"off\"")]).unwrap();
        check_compatible(&saved, &fused_off, 3).unwrap();
        let lr = Config::load(None, &[ov("optim.lr=1e-3")]).unwrap();
        let err = check_compatible(&saved, &lr, 3).unwrap_err().to_string();
        assert!(err.contains("optim.lr") && err.contains("would change what the checkpoint was trained with"), "{err}");
    }

    /// Moments of the wrong size, missing after a step, or of no parameter are refused naming
    /// the moment (a wrong shape would panic in burn's Add); before the first step none are
    /// needed.
    #[test]
    fn moments_must_match_their_parameters() {
        let file = Path::new("optimizer.safetensors");
        let t = |n: usize| (vec![n], vec![0.0f32; n]);
        let params: llora_model::checkpoint::F32Tensors = [("a".to_string(), t(4))].into();
        let moments = |m: usize, v: usize| -> llora_model::checkpoint::F32Tensors {
            [("a.exp_avg".to_string(), t(m)), ("a.exp_avg_sq".to_string(), t(v))].into()
        };
        check_moments(&params, &moments(4, 4), 3, file).unwrap();
        let err = check_moments(&params, &moments(4, 3), 3, file).unwrap_err().to_string();
        assert!(err.contains("a.exp_avg_sq has 3 values, its parameter 4"), "{err}");
        let mut missing = moments(4, 4);
        missing.remove("a.exp_avg");
        let err = check_moments(&params, &missing, 3, file).unwrap_err().to_string();
        assert!(err.contains("a.exp_avg is missing") && err.contains("step 3"), "{err}");
        check_moments(&params, &Default::default(), 0, file).unwrap();
        let mut stray = moments(4, 4);
        stray.insert("b.exp_avg".into(), t(2));
        let err = check_moments(&params, &stray, 3, file).unwrap_err().to_string();
        assert!(err.contains("b.exp_avg belongs to no saved parameter"), "{err}");
    }
}
