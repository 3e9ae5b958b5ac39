//! `llora export --merged`, streamed: the base checkpoint is rewritten one tensor at a time,
//! each adapted linear weight with its adapter folded in (`W + (α/r)·B·A`, with DoRA each row
//! then rescaled to its magnitude; PEFT's `merge_and_unload`), every tensor in the checkpoint's
//! own dtype unless another is asked for.
//!
//! Why streamed: building the model and saving it held the whole model in f32 several times
//! over (docs/performance.md, M6; over 1 TB at 70B) and wrote f32. Here the
//! peak is the largest tensor in f32 twice (the weight and its update) plus the mapped pages
//! being copied; the output keeps the base's shard layout, `config.json` (its `torch_dtype`
//! changed only when another dtype is asked for) and tokenizer files.

use std::collections::{HashMap, HashSet};
use std::io::Write;
use std::path::Path;

use anyhow::{Context, ensure};
pub use safetensors::tensor::Dtype;

use crate::checkpoint::{HfCheckpoint, Shard};
use crate::layout::BlockLinear;
use crate::peft::{adapter_tensor_names, read_peft_config, stray_tensor_error};

/// What an export wrote.
#[derive(Debug, Clone, PartialEq)]
pub struct MergedExport {
    /// Linear weights that received an update.
    pub merged_modules: usize,
    /// Tensors written.
    pub tensors: usize,
    /// Bytes of the safetensors files written.
    pub bytes: u64,
}

/// Files beside the weights that a merged checkpoint keeps from its base, when present.
const CARRIED: &[&str] = &[
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "chat_template.jinja",
];

/// The name transformers gives a dtype in `config.json`.
fn torch_name(dtype: Dtype) -> &'static str {
    match dtype {
        Dtype::BF16 => "bfloat16",
        Dtype::F16 => "float16",
        _ => "float32",
    }
}

/// `values` in the little-endian bytes of `dtype` (F32, BF16 or F16; rounded to nearest even,
/// as torch's casts).
fn encode(values: &[f32], dtype: Dtype) -> Vec<u8> {
    match dtype {
        Dtype::BF16 => values.iter().flat_map(|x| half::bf16::from_f32(*x).to_le_bytes()).collect(),
        Dtype::F16 => values.iter().flat_map(|x| half::f16::from_f32(*x).to_le_bytes()).collect(),
        _ => values.iter().flat_map(|x| x.to_le_bytes()).collect(),
    }
}

/// A PEFT adapter's tensors, read on demand, with the ones not yet used.
struct Adapter {
    shard: Shard,
    /// The adapter's settings (each module's scale from its rank and alpha patterns).
    spec: crate::lora_spec::LoraSpec,
    /// PEFT name without the adapter name (`...lora_A.weight`) → stored name; removed when used.
    unused: HashMap<String, String>,
    /// The modules its config selects (`model.layers.0.self_attn.q_proj`); removed when merged.
    selected: HashSet<String>,
}

impl Adapter {
    fn open(dir: &Path, config: &crate::config::LlamaConfig) -> anyhow::Result<Self> {
        let peft = read_peft_config(dir)?;
        let mut selected = peft.select.modules(config);
        if config.fused_qkv {
            // A q/k/v adapter folds into a fused qkv_proj by rows (see `update_of`).
            let parts = peft.select.modules(&crate::config::LlamaConfig { fused_qkv: false, ..config.clone() });
            selected = match (selected, parts) {
                (Ok(mut a), Ok(b)) => {
                    a.extend(b);
                    Ok(a)
                }
                (Err(_), Ok(b)) => Ok(b),
                (a, _) => a,
            };
        }
        let selected = selected.with_context(|| dir.join("adapter_config.json").display().to_string())?;
        let shard = Shard::open(&dir.join("adapter_model.safetensors"))?;
        let unused = adapter_tensor_names(&shard);
        Ok(Self { shard, spec: peft.spec, unused, selected: selected.into_iter().collect() })
    }

    /// The update of `module` (`model.layers.0.self_attn.q_proj`), `None` when the adapter does
    /// not adapt it.
    ///
    /// # Shapes
    /// - lora_A: `[r, in]`; lora_B: `[out, r]`; lora_magnitude_vector: `[out]`
    fn update(&mut self, module: &str, out: usize, inp: usize) -> anyhow::Result<Option<Update>> {
        if !self.selected.remove(module) {
            return Ok(None);
        }
        let mut take = |which: &str| {
            let key = format!("base_model.model.{module}.{which}");
            self.unused.remove(&key).with_context(|| format!("{key} is missing from the adapter"))
        };
        let (a_name, b_name) = (take("lora_A.weight")?, take("lora_B.weight")?);
        let magnitude = if self.spec.dora { Some(take(crate::params::MAGNITUDE)?) } else { None };
        let module_spec = self.spec.module_spec(module)?;
        let r = module_spec.rank;
        let a = self.shard.read_f32(&a_name, &[r, inp])?;
        let b = self.shard.read_f32(&b_name, &[out, r])?;
        let t = |d: burn::tensor::TensorData, rows: usize, cols: usize| {
            tch::Tensor::from_slice(&d.to_vec::<f32>().expect("f32")).reshape([rows as i64, cols as i64])
        };
        // PEFT's order: (B·A) then the scale, in f32.
        let delta = t(b, out, r).mm(&t(a, r, inp)) * f64::from(module_spec.scale() as f32);
        let magnitude = match magnitude {
            Some(name) => Some(self.shard.read_f32(&name, &[out])?.to_vec::<f32>().expect("f32")),
            None => None,
        };
        Ok(Some(Update { delta: Vec::<f32>::try_from(delta.flatten(0, -1)).expect("f32"), magnitude }))
    }
}

/// What an adapter does to some rows of a base weight: `W + ΔW`, with DoRA each row then
/// rescaled to its magnitude, `m/‖W + ΔW‖ ⊙ (W + ΔW)` (PEFT's `merge_and_unload`).
struct Update {
    /// `ΔW = (α/r)·B·A`, row-major `[rows, in]`.
    delta: Vec<f32>,
    /// DoRA's magnitude, one per row.
    magnitude: Option<Vec<f32>>,
}

impl Update {
    /// Applies the update to `w`, the same rows of the base weight, row-major.
    fn apply(&self, w: &mut [f32]) {
        for (x, d) in w.iter_mut().zip(&self.delta) {
            *x += d;
        }
        if let Some(m) = &self.magnitude {
            let inp = w.len() / m.len();
            for (row, m) in w.chunks_exact_mut(inp).zip(m) {
                let norm = row.iter().map(|x| f64::from(*x) * f64::from(*x)).sum::<f64>().sqrt() as f32;
                let factor = m / norm;
                row.iter_mut().for_each(|x| *x *= factor);
            }
        }
    }
}

/// The updates of the base tensor `name` of shape `shape`, each with the first row it applies
/// to, if the adapter has any: its own module's, or for a fused `qkv_proj` those of the q/k/v
/// adapters, stacked by rows.
fn updates_of(
    adapter: &mut Adapter,
    name: &str,
    shape: &[usize],
    ckpt: &HfCheckpoint,
) -> anyhow::Result<Vec<(usize, Update)>> {
    let (Some(module), [out, inp]) = (name.strip_suffix(".weight"), shape) else { return Ok(Vec::new()) };
    if let Some(u) = adapter.update(module, *out, *inp)? {
        return Ok(vec![(0, u)]);
    }
    let fused = BlockLinear::Qkv;
    let Some(prefix) = module.strip_suffix(fused.name()).filter(|p| p.ends_with('.')) else { return Ok(Vec::new()) };
    let mut parts = Vec::new();
    let mut row = 0;
    for part in fused.parts() {
        let [rows, _] = part.shape(&ckpt.config);
        if let Some(u) = adapter.update(&format!("{prefix}{}", part.name()), rows, *inp)? {
            parts.push((row, u));
        }
        row += rows;
    }
    ensure!(parts.is_empty() || row == *out, "{name}: {out} rows, but q, k and v take {row}");
    Ok(parts)
}

/// Writes one output shard: the header, then each tensor of `shard` in file order (copied,
/// converted, or with its update added), `dtype` for floating tensors when asked.
fn write_shard(
    shard: &Shard,
    path: &Path,
    dtype: Option<Dtype>,
    adapter: &mut Adapter,
    ckpt: &HfCheckpoint,
) -> anyhow::Result<(usize, usize, u64)> {
    let mut names: Vec<(String, safetensors::tensor::TensorInfo)> =
        shard.meta.tensors().into_iter().map(|(n, i)| (n, i.clone())).collect();
    names.sort_by_key(|(_, i)| i.data_offsets.0);
    let floating = |d: Dtype| matches!(d, Dtype::F32 | Dtype::BF16 | Dtype::F16);
    let out_dtype = |d: Dtype| if floating(d) { dtype.unwrap_or(d) } else { d };
    let mut header = serde_json::Map::new();
    if let Some(meta) = shard.meta.metadata() {
        header.insert("__metadata__".into(), serde_json::to_value(meta)?);
    }
    let mut offset = 0usize;
    for (name, info) in &names {
        let size = info.shape.iter().product::<usize>() * out_dtype(info.dtype).size();
        header.insert(
            name.clone(),
            serde_json::json!({"dtype": out_dtype(info.dtype), "shape": info.shape, "data_offsets": [offset, offset + size]}),
        );
        offset += size;
    }
    let mut json = serde_json::to_string(&header)?;
    // The safetensors format pads its header with spaces to a multiple of 8 bytes.
    while json.len() % 8 != 0 {
        json.push(' ');
    }
    let file = std::fs::File::create(path).with_context(|| format!("cannot create {}", path.display()))?;
    let mut w = std::io::BufWriter::new(file);
    let mut write = |bytes: &[u8]| w.write_all(bytes).with_context(|| format!("cannot write {}", path.display()));
    write(&(json.len() as u64).to_le_bytes())?;
    write(json.as_bytes())?;
    let mut merged = 0;
    for (name, info) in &names {
        let to = out_dtype(info.dtype);
        let updates = updates_of(adapter, name, &info.shape, ckpt)?;
        if updates.is_empty() && to == info.dtype {
            write(shard.raw(name)?)?;
        } else {
            let mut w = shard.read_f32(name, &info.shape)?.to_vec::<f32>().expect("f32");
            let cols = info.shape.last().copied().unwrap_or(1);
            for (row, u) in &updates {
                u.apply(&mut w[row * cols..(row * cols + u.delta.len())]);
            }
            if !updates.is_empty() {
                check_merged(name, &w, cols, to)?;
            }
            merged += usize::from(!updates.is_empty());
            write(&encode(&w, to))?;
        }
        shard.forget(name);
    }
    w.flush().with_context(|| format!("cannot write {}", path.display()))?;
    Ok((merged, names.len(), (8 + json.len() + offset) as u64))
}

/// Refuses a merged weight that is not finite in the dtype it is written in (an adapter holding
/// NaN or infinity, or an update past f16's range), naming the tensor and the first place.
fn check_merged(name: &str, w: &[f32], cols: usize, to: Dtype) -> anyhow::Result<()> {
    let limit = if to == Dtype::F16 { 65504.0 } else { f32::MAX };
    let bad = |v: &f32| !v.is_finite() || v.abs() > limit;
    let Some(first) = w.iter().position(bad) else { return Ok(()) };
    let count = w.iter().filter(|v| bad(v)).count();
    anyhow::bail!(
        "tensor {name}: the merged weight holds {count} value(s) that are not finite in {} (the first at row {}, \
         column {}, {}): the adapter's update for this module holds NaN or infinity{}; nothing was written",
        torch_name(to),
        first / cols.max(1),
        first % cols.max(1),
        w[first],
        if to == Dtype::F16 { " or overflows f16 (try --dtype bf16)" } else { "" }
    )
}

/// Writes `ckpt` with the PEFT adapter in `adapter_dir` folded in, into the existing empty
/// directory `out`: the same shards and index, `config.json`, and the tokenizer files; floating
/// tensors in `dtype` when given, else in their own. Every adapter tensor must fold into a
/// weight of the base (else the base and the adapter do not belong together).
pub fn export_merged(
    ckpt: &HfCheckpoint,
    adapter_dir: &Path,
    out: &Path,
    dtype: Option<Dtype>,
) -> anyhow::Result<MergedExport> {
    let mut adapter = Adapter::open(adapter_dir, &ckpt.config)?;
    let mut done = MergedExport { merged_modules: 0, tensors: 0, bytes: 0 };
    for shard in &ckpt.shards {
        let name = shard.path.file_name().context("a shard has a file name")?;
        let (merged, tensors, bytes) = write_shard(shard, &out.join(name), dtype, &mut adapter, ckpt)?;
        done.merged_modules += merged;
        done.tensors += tensors;
        done.bytes += bytes;
    }
    if let Some(extra) = adapter.unused.keys().min() {
        return Err(stray_tensor_error(&adapter_dir.join("adapter_model.safetensors"), extra, &ckpt.config));
    }
    ensure!(done.merged_modules > 0, "{}: the adapter changed no weight of the base", adapter_dir.display());
    let mut config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(ckpt.dir.join("config.json"))
            .with_context(|| format!("cannot read {}", ckpt.dir.join("config.json").display()))?,
    )?;
    // A head the base holds apart from a "tied" embedding was read untied: say so in the
    // export's config.json, so that every reader of the export takes it as llora did.
    if !ckpt.config.tie_word_embeddings && config.get("tie_word_embeddings") == Some(&true.into()) {
        config["tie_word_embeddings"] = false.into();
    }
    if let Some(d) = dtype {
        config["torch_dtype"] = torch_name(d).into();
        if config.get("dtype").is_some() {
            config["dtype"] = torch_name(d).into();
        }
    }
    crate::checkpoint::write_atomic(&out.join("config.json"), serde_json::to_string_pretty(&config)?.as_bytes())?;
    let index = ckpt.dir.join("model.safetensors.index.json");
    if index.is_file() {
        let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&index)?)
            .with_context(|| format!("{}: invalid JSON", index.display()))?;
        let weights = done.bytes - ckpt.shards.len() as u64 * 8;
        v["metadata"]["total_size"] = serde_json::json!(weights);
        crate::checkpoint::write_atomic(
            &out.join("model.safetensors.index.json"),
            serde_json::to_string_pretty(&v)?.as_bytes(),
        )?;
    }
    for name in CARRIED {
        let from = ckpt.dir.join(name);
        if from.is_file() {
            std::fs::copy(&from, out.join(name)).with_context(|| format!("cannot copy {}", from.display()))?;
        }
    }
    Ok(done)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::save_hf_checkpoint;
    use crate::peft::save_peft_adapter;
    use crate::{BuildOptions, LlamaConfig, LlamaForCausalLM, LoraSpec};
    use burn::tensor::Device;

    /// Every tensor of a safetensors file: (dtype, shape, bytes).
    fn tensors(path: &Path) -> std::collections::BTreeMap<String, (Dtype, Vec<usize>, Vec<u8>)> {
        let bytes = std::fs::read(path).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        st.tensors().into_iter().map(|(n, v)| (n, (v.dtype(), v.shape().to_vec(), v.data().to_vec()))).collect()
    }

    fn f32s(dtype: Dtype, bytes: &[u8]) -> Vec<f32> {
        match dtype {
            Dtype::BF16 => bytes.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            _ => bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
        }
    }

    /// A new adapter folder `dir` with `from`'s adapter_config.json and these f32 tensors.
    fn adapter_like(from: &Path, dir: &Path, tensors: &[(String, Vec<usize>, Vec<u8>)]) {
        std::fs::create_dir(dir).unwrap();
        std::fs::copy(from.join("adapter_config.json"), dir.join("adapter_config.json")).unwrap();
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
            .iter()
            .map(|(n, s, b)| (n.clone(), safetensors::tensor::TensorView::new(Dtype::F32, s.clone(), b).unwrap()))
            .collect();
        std::fs::write(dir.join("adapter_model.safetensors"), safetensors::serialize(views, None).unwrap()).unwrap();
    }

    /// A bf16 base stays bf16 (same size, same header order); an adapted weight is
    /// bf16(W + (α/r)·B·A) with the product summed here by hand; every other tensor is copied
    /// byte for byte; `--dtype f32` writes f32 and says so in config.json; a foreign adapter
    /// tensor is refused.
    #[test]
    fn merges_in_the_checkpoints_dtype_one_tensor_at_a_time() {
        let _rng = crate::device::torch_rng_lock();
        let device = Device::libtorch();
        device.seed(4);
        let config = LlamaConfig::preset("tiny").unwrap();
        let spec =
            LoraSpec { rank: 4, alpha: 8.0, targets: vec!["q_proj".into(), "down_proj".into()], ..LoraSpec::default() };
        let mut model =
            LlamaForCausalLM::random(&config, &BuildOptions { lora: Some(&spec), ..Default::default() }, &device)
                .unwrap();
        for (name, mut p) in model.trainable_params_mut() {
            if name.contains("lora_B") {
                let n = p.flat().shape().num_elements();
                p.set_flat(burn::tensor::Tensor::random([n], burn::tensor::Distribution::Normal(0.0, 0.05), &device));
            }
        }
        let dir = tempfile::tempdir().unwrap();
        let (f32_base, base, adapter) = (dir.path().join("f32"), dir.path().join("bf16"), dir.path().join("adapter"));
        save_hf_checkpoint(&mut model, &f32_base).unwrap();
        save_peft_adapter(&model, &spec, &adapter, "base").unwrap();
        // The same checkpoint in bf16, with transformers' dtype in its config.
        std::fs::create_dir(&base).unwrap();
        let f32_tensors = tensors(&f32_base.join("model.safetensors"));
        let bf16: Vec<(String, Vec<usize>, Vec<u8>)> = f32_tensors
            .iter()
            .map(|(n, (d, s, b))| (n.clone(), s.clone(), encode(&f32s(*d, b), Dtype::BF16)))
            .collect();
        let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = bf16
            .iter()
            .map(|(n, s, b)| (n.clone(), safetensors::tensor::TensorView::new(Dtype::BF16, s.clone(), b).unwrap()))
            .collect();
        std::fs::write(base.join("model.safetensors"), safetensors::serialize(views, None).unwrap()).unwrap();
        let cfg = std::fs::read_to_string(f32_base.join("config.json")).unwrap().replace("float32", "bfloat16");
        std::fs::write(base.join("config.json"), cfg).unwrap();

        let ckpt = HfCheckpoint::open(&base).unwrap();
        let out = dir.path().join("merged");
        std::fs::create_dir(&out).unwrap();
        let done = export_merged(&ckpt, &adapter, &out, None).unwrap();
        assert_eq!(done.merged_modules, 2 * config.num_hidden_layers);
        let (inp, merged) = (tensors(&base.join("model.safetensors")), tensors(&out.join("model.safetensors")));
        assert_eq!(
            std::fs::metadata(out.join("model.safetensors")).unwrap().len(),
            std::fs::metadata(base.join("model.safetensors")).unwrap().len()
        );
        let peft = tensors(&adapter.join("adapter_model.safetensors"));
        let mut adapted = 0;
        for (name, (dtype, shape, bytes)) in &merged {
            assert_eq!(*dtype, Dtype::BF16, "{name}");
            let module = name.strip_suffix(".weight").unwrap_or(name);
            let a = peft.get(&format!("base_model.model.{module}.lora_A.weight"));
            let Some((_, a_shape, a_bytes)) = a else {
                assert_eq!(bytes, &inp[name].2, "{name} is not adapted and must be copied as it is");
                continue;
            };
            adapted += 1;
            let (_, _, b_bytes) = &peft[&format!("base_model.model.{module}.lora_B.weight")];
            let (a, b) = (f32s(Dtype::F32, a_bytes), f32s(Dtype::F32, b_bytes));
            let (r, (o, i)) = (a_shape[0], (shape[0], shape[1]));
            let w = f32s(Dtype::BF16, &inp[name].2);
            let got = f32s(Dtype::BF16, bytes);
            for row in 0..o {
                for col in 0..i {
                    let d: f32 = (0..r).map(|k| b[row * r + k] * a[k * i + col]).sum::<f32>() * 2.0;
                    let want = half::bf16::from_f32(w[row * i + col] + d).to_f32();
                    let g = got[row * i + col];
                    // The product's summation order may differ in f32's last bits before the
                    // bf16 rounding: one bf16 step of the terms' size.
                    let size = w[row * i + col].abs() + d.abs();
                    assert!((g - want).abs() <= size / 128.0, "{name}[{row},{col}]: {g} vs {want}");
                }
            }
        }
        assert_eq!(adapted, 2 * config.num_hidden_layers);
        assert!(std::fs::read_to_string(out.join("config.json")).unwrap().contains("bfloat16"));

        let out32 = dir.path().join("merged32");
        std::fs::create_dir(&out32).unwrap();
        export_merged(&ckpt, &adapter, &out32, Some(Dtype::F32)).unwrap();
        assert!(tensors(&out32.join("model.safetensors")).values().all(|(d, _, _)| *d == Dtype::F32));
        assert!(std::fs::read_to_string(out32.join("config.json")).unwrap().contains("\"float32\""));
        assert!(HfCheckpoint::open(&out32).is_ok());

        // An adapter of another model: a tensor that folds into nothing is refused.
        let other = dir.path().join("other");
        let mut extra: Vec<(String, Vec<usize>, Vec<u8>)> =
            peft.iter().map(|(n, (_, s, b))| (n.clone(), s.clone(), b.clone())).collect();
        extra.push(("base_model.model.model.layers.99.self_attn.q_proj.lora_A.weight".into(), vec![1], vec![0; 4]));
        adapter_like(&adapter, &other, &extra);
        let out3 = dir.path().join("merged3");
        std::fs::create_dir(&out3).unwrap();
        let err = format!("{:#}", export_merged(&ckpt, &other, &out3, None).unwrap_err());
        assert!(err.contains("layers.99") && err.contains("matches no module of the base model"), "{err}");

        // An adapter holding a NaN (a diverged run): the merged weight is refused, named.
        let nan = dir.path().join("nan");
        let poisoned: Vec<(String, Vec<usize>, Vec<u8>)> = peft
            .iter()
            .map(|(n, (_, s, b))| {
                let mut b = b.clone();
                if n.contains("layers.1.mlp.down_proj.lora_B") {
                    b[4 * 5..4 * 6].copy_from_slice(&f32::NAN.to_le_bytes());
                }
                (n.clone(), s.clone(), b)
            })
            .collect();
        adapter_like(&adapter, &nan, &poisoned);
        let out4 = dir.path().join("merged4");
        std::fs::create_dir(&out4).unwrap();
        let err = format!("{:#}", export_merged(&ckpt, &nan, &out4, None).unwrap_err());
        assert!(err.contains("tensor model.layers.1.mlp.down_proj.weight") && err.contains("not finite"), "{err}");
    }
}
