//! HF checkpoints in (single or sharded safetensors, memory-mapped) and PEFT adapters in/out.
//!
//! Burn's safetensors store reads one file and ignores `model.safetensors.index.json`, so the
//! shards and the index are read here with the `safetensors` crate. Every error names the file
//! and the tensor, and the expected and found shape or dtype.

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use anyhow::{Context, bail, ensure};
use burn::tensor::{Device, Tensor, TensorData};
use memmap2::Mmap;
use safetensors::tensor::{Dtype, Metadata, TensorView};

use crate::config::LlamaConfig;
use crate::llama::{BuildOptions, LlamaForCausalLM};
use crate::load::WeightSource;
use crate::lora::{LoraAdapter, LoraSpec};
use crate::params::ParamMut;

/// One memory-mapped safetensors file with its parsed header.
pub(crate) struct Shard {
    pub(crate) path: PathBuf,
    mmap: Mmap,
    header_len: usize,
    pub(crate) meta: Metadata,
}

impl Shard {
    pub(crate) fn open(path: &Path) -> anyhow::Result<Self> {
        let file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
        // SAFETY: the file is opened read-only and llora never writes a checkpoint it is
        // reading; a concurrent external writer would be a user error the header check catches
        // only partly, as with any mmap-based reader (PyTorch's included).
        let mmap = unsafe { Mmap::map(&file) }.with_context(|| format!("cannot map {}", path.display()))?;
        let (header_len, meta) = safetensors::SafeTensors::read_metadata(&mmap)
            .map_err(|e| anyhow::anyhow!("{}: not a valid safetensors file: {e}", path.display()))?;
        Ok(Self { path: path.to_path_buf(), mmap, header_len, meta })
    }

    /// The stored bytes of the named tensor (its dtype and shape are in `meta`).
    pub(crate) fn raw(&self, name: &str) -> anyhow::Result<&[u8]> {
        let info =
            self.meta.info(name).with_context(|| format!("tensor {name} is missing from {}", self.path.display()))?;
        let (start, end) = info.data_offsets;
        Ok(&self.mmap[8 + self.header_len + start..8 + self.header_len + end])
    }

    /// The named tensor converted to f32, checked against `expected` shape.
    pub(crate) fn read_f32(&self, name: &str, expected: &[usize]) -> anyhow::Result<TensorData> {
        let info =
            self.meta.info(name).with_context(|| format!("tensor {name} is missing from {}", self.path.display()))?;
        ensure!(
            info.shape == expected,
            "tensor {name} in {}: expected shape {expected:?}, found {:?}",
            self.path.display(),
            info.shape
        );
        let (start, end) = info.data_offsets;
        let bytes = &self.mmap[8 + self.header_len + start..8 + self.header_len + end];
        let values: Vec<f32> = match info.dtype {
            Dtype::F32 => bytes.chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect(),
            Dtype::BF16 => bytes.chunks_exact(2).map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            Dtype::F16 => bytes.chunks_exact(2).map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32()).collect(),
            other => bail!(
                "tensor {name} in {}: dtype {other:?} is not supported (expected F32, BF16 or F16)",
                self.path.display()
            ),
        };
        self.forget(name);
        Ok(TensorData::new(values, expected.to_vec()))
    }

    /// Drops the named tensor's mapped pages from this process's RSS: a 70B load (or export)
    /// would otherwise hold the whole checkpoint resident (in the page cache they stay).
    pub(crate) fn forget(&self, name: &str) {
        let Some(info) = self.meta.info(name) else { return };
        let (start, end) = info.data_offsets;
        // SAFETY: the mapping is read-only and private; dropped pages are read again from the
        // file if touched, and no borrow of these bytes outlives the call that read them.
        let _ = unsafe {
            self.mmap.unchecked_advise_range(
                memmap2::UncheckedAdvice::DontNeed,
                8 + self.header_len + start,
                end - start,
            )
        };
    }
}

/// An HF checkpoint directory: `config.json` plus `model.safetensors` or sharded
/// `model-XXXXX-of-YYYYY.safetensors` with `model.safetensors.index.json`.
pub struct HfCheckpoint {
    /// The directory.
    pub dir: PathBuf,
    /// The architecture from `config.json` (with `fused_qkv` detected from the tensors).
    pub config: LlamaConfig,
    pub(crate) shards: Vec<Shard>,
    /// Tensor name → index into `shards`.
    index: HashMap<String, usize>,
}

/// The path of a shard an index names, refused unless it is a file name or relative path that
/// stays inside the checkpoint directory (no absolute path, no `..`, no symlink out of it): an
/// index is input, and must not make llora open `/etc/passwd`.
fn shard_path(dir: &Path, file: &str) -> anyhow::Result<PathBuf> {
    use std::path::Component;
    let rel = Path::new(file);
    ensure!(
        !file.is_empty() && rel.components().all(|c| matches!(c, Component::Normal(_) | Component::CurDir)),
        "shard {file:?} is not a path inside the model directory"
    );
    let path = dir.join(rel);
    if let (Ok(real), Ok(root)) = (path.canonicalize(), dir.canonicalize()) {
        ensure!(real.starts_with(&root), "shard {file:?} leads outside the model directory (to {})", real.display());
    }
    Ok(path)
}

impl HfCheckpoint {
    /// Opens and indexes a checkpoint directory without reading any tensor data.
    pub fn open(dir: &Path) -> anyhow::Result<Self> {
        ensure!(dir.exists(), "model directory {} does not exist", dir.display());
        ensure!(dir.is_dir(), "model path {} is a file, not a checkpoint directory", dir.display());
        let mut config = LlamaConfig::from_hf_dir(dir)?;
        let index_path = dir.join("model.safetensors.index.json");
        let single = dir.join("model.safetensors");
        let mut shards = Vec::new();
        let mut index = HashMap::new();
        if index_path.is_file() {
            let text = std::fs::read_to_string(&index_path)
                .with_context(|| format!("cannot read {}", index_path.display()))?;
            let json: serde_json::Value =
                serde_json::from_str(&text).with_context(|| format!("{}: invalid JSON", index_path.display()))?;
            let map = json
                .get("weight_map")
                .and_then(|m| m.as_object())
                .with_context(|| format!("{}: no \"weight_map\" object", index_path.display()))?;
            let mut by_file: BTreeMap<String, usize> = BTreeMap::new();
            for (tensor, file) in map {
                let file = file
                    .as_str()
                    .with_context(|| format!("{}: weight_map[{tensor:?}] is not a file name", index_path.display()))?;
                let next = by_file.len();
                let shard_idx = *by_file.entry(file.to_string()).or_insert(next);
                if shard_idx == shards.len() {
                    let path = shard_path(dir, file)
                        .with_context(|| format!("{}: weight_map[{tensor:?}]", index_path.display()))?;
                    ensure!(
                        path.is_file(),
                        "shard {file} (holding tensor {tensor}) is listed in {} but missing from {}",
                        index_path.display(),
                        dir.display()
                    );
                    shards.push(Shard::open(&path)?);
                }
                ensure!(
                    shards[shard_idx].meta.info(tensor).is_some(),
                    "{} maps tensor {tensor} to {file}, which does not contain it",
                    index_path.display()
                );
                index.insert(tensor.clone(), shard_idx);
            }
        } else if single.is_file() {
            let shard = Shard::open(&single)?;
            for name in shard.meta.tensors().into_keys() {
                index.insert(name, 0);
            }
            shards.push(shard);
        } else {
            bail!("{} has neither model.safetensors nor model.safetensors.index.json", dir.display());
        }
        if index.contains_key("model.layers.0.self_attn.qkv_proj.weight") {
            config.fused_qkv = true;
        }
        Ok(Self { dir: dir.to_path_buf(), config, shards, index })
    }

    /// Reads one tensor as f32 in the expected shape.
    pub fn read(&self, name: &str, expected: &[usize]) -> anyhow::Result<TensorData> {
        let shard = self
            .index
            .get(name)
            .with_context(|| format!("tensor {name} is missing from the checkpoint in {}", self.dir.display()))?;
        self.shards[*shard].read_f32(name, expected)
    }

    /// Elements of the checkpoint's largest tensor (its f32 copy is what loading holds at most
    /// besides the stored weights).
    pub fn largest_tensor_elements(&self) -> usize {
        self.shards
            .iter()
            .flat_map(|s| s.meta.tensors().into_values())
            .map(|i| i.shape.iter().product())
            .max()
            .unwrap_or(0)
    }

    /// Bytes of the checkpoint's safetensors files.
    pub fn file_bytes(&self) -> usize {
        self.shards.iter().map(|s| s.mmap.len()).sum()
    }

    /// Builds the model from this checkpoint as `opts` asks (see [`LlamaForCausalLM::build`]:
    /// tensors are read one at a time from the mapped files and converted to their storage).
    ///
    /// Every tensor of the checkpoint must be used (a checkpoint with more layers than its
    /// config.json, or another architecture's extra tensors, would otherwise load as a
    /// different model without a word), except the ones transformers itself ignores.
    pub fn load_model(&self, opts: &BuildOptions<'_>, device: &Device) -> anyhow::Result<LlamaForCausalLM> {
        let used = std::cell::RefCell::new(std::collections::HashSet::new());
        let mut source = WeightSource::new(device, |name: &str, shape: &[usize]| {
            used.borrow_mut().insert(name.to_string());
            self.read(name, shape)
        });
        let model = LlamaForCausalLM::build(&self.config, opts, device, &mut source)
            .with_context(|| format!("loading the model from {}", self.dir.display()))?;
        drop(source);
        let used = used.into_inner();
        // transformers drops the RoPE buffer old checkpoints saved, and an LM head tied to the
        // embedding that llora reads from the embedding.
        let ignored =
            |n: &str| n.ends_with("rotary_emb.inv_freq") || (n == "lm_head.weight" && self.config.tie_word_embeddings);
        let mut unused: Vec<&String> = self.index.keys().filter(|n| !used.contains(*n) && !ignored(n)).collect();
        unused.sort();
        ensure!(
            unused.is_empty(),
            "{}: {} tensor(s) match nothing in a {}-layer Llama as config.json describes it (first: {}): \
             the checkpoint and its config.json disagree",
            self.dir.display(),
            unused.len(),
            self.config.num_hidden_layers,
            unused.iter().take(3).map(|s| s.as_str()).collect::<Vec<_>>().join(", ")
        );
        Ok(model)
    }

    /// The first tensor (in name order) holding a NaN or an infinity, with the count; `None`
    /// when every value is finite. Reads the whole checkpoint: for explaining a non-finite loss.
    pub fn first_non_finite(&self) -> anyhow::Result<Option<(String, usize)>> {
        let mut names: Vec<&String> = self.index.keys().collect();
        names.sort();
        for name in names {
            let shard = &self.shards[self.index[name]];
            let shape = shard.meta.info(name).map(|i| i.shape.clone()).unwrap_or_default();
            let data = shard.read_f32(name, &shape)?;
            let bad = data.as_slice::<f32>().map_or(0, |v| v.iter().filter(|x| !x.is_finite()).count());
            if bad > 0 {
                return Ok(Some((name.clone(), bad)));
            }
        }
        Ok(None)
    }
}

/// Writes `bytes` to `path` through a temporary file beside it (fsynced), a rename and an
/// fsync of the directory, so a crash never leaves a half-written file where a good one was
/// and a written file survives a power cut; on any error the temporary file is removed.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> anyhow::Result<()> {
    let dir = path.parent().filter(|p| !p.as_os_str().is_empty()).unwrap_or(Path::new("."));
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    let tmp = dir.join(format!(
        ".{}.tmp-{}",
        path.file_name().and_then(|n| n.to_str()).unwrap_or("file"),
        std::process::id()
    ));
    let written = (|| {
        let mut f = File::create(&tmp).with_context(|| format!("cannot create {}", tmp.display()))?;
        injected_disk_full(bytes.len())
            .map_or_else(|| f.write_all(bytes).and_then(|_| f.sync_all()), Err)
            .with_context(|| format!("cannot write {}", tmp.display()))?;
        drop(f);
        std::fs::rename(&tmp, path).with_context(|| format!("cannot rename {} to {}", tmp.display(), path.display()))
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written?;
    // The rename is durable once the directory is; a directory that cannot be opened for
    // syncing (some network file systems) keeps the file, so this is best effort.
    if let Ok(d) = File::open(dir) {
        let _ = d.sync_all();
    }
    Ok(())
}

/// Fault injection for the tests of a full disk where no small file system can be mounted
/// (containers without `CAP_SYS_ADMIN`): with `LLORA_FAULT_ENOSPC_AFTER_BYTES=N`, a
/// [`write_atomic`] that would take this process past N bytes fails as a full disk does.
fn injected_disk_full(len: usize) -> Option<std::io::Error> {
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicU64, Ordering};
    static LIMIT: OnceLock<Option<u64>> = OnceLock::new();
    static WRITTEN: AtomicU64 = AtomicU64::new(0);
    let limit = (*LIMIT.get_or_init(|| std::env::var("LLORA_FAULT_ENOSPC_AFTER_BYTES").ok()?.parse().ok()))?;
    let total = WRITTEN.fetch_add(len as u64, Ordering::Relaxed) + len as u64;
    (total > limit).then(|| {
        std::io::Error::new(
            std::io::ErrorKind::StorageFull,
            "No space left on device (injected: LLORA_FAULT_ENOSPC_AFTER_BYTES)",
        )
    })
}

/// f32 tensors as a safetensors file in memory (names sorted, as safetensors requires).
pub fn safetensors_bytes(tensors: &[(String, Vec<usize>, Vec<f32>)]) -> anyhow::Result<Vec<u8>> {
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(n, s, v)| (n.clone(), s.clone(), v.iter().flat_map(|x| x.to_le_bytes()).collect()))
        .collect();
    let views: Vec<(String, TensorView<'_>)> = bytes
        .iter()
        .map(|(n, s, b)| Ok((n.clone(), TensorView::new(Dtype::F32, s.clone(), b)?)))
        .collect::<Result<_, safetensors::SafeTensorError>>()?;
    Ok(safetensors::serialize(views, None)?)
}

/// Tensors by name as (shape, f32 values).
pub type F32Tensors = BTreeMap<String, (Vec<usize>, Vec<f32>)>;

/// Every tensor of a safetensors file as f32 (F32, BF16 or F16 on disk), by name.
pub fn read_safetensors_f32(path: &Path) -> anyhow::Result<F32Tensors> {
    let shard = Shard::open(path)?;
    let mut out = BTreeMap::new();
    for (name, info) in shard.meta.tensors() {
        let data = shard.read_f32(&name, &info.shape)?;
        let values = data.to_vec::<f32>().map_err(|e| anyhow::anyhow!("{}: tensor {name}: {e:?}", path.display()))?;
        out.insert(name, (info.shape.clone(), values));
    }
    Ok(out)
}

/// f32 values of a tensor, for writing.
pub fn tensor_f32<const D: usize>(t: &Tensor<D>) -> (Vec<usize>, Vec<f32>) {
    let data = t.to_data().convert::<f32>();
    (data.shape().to_vec(), data.to_vec::<f32>().expect("converted to f32"))
}

/// Saves the base weights as an HF checkpoint (`config.json` + `model.safetensors`, f32), each
/// file written atomically; transformers' `LlamaForCausalLM.from_pretrained` reads it.
pub fn save_hf_checkpoint(model: &mut LlamaForCausalLM, dir: &Path) -> anyhow::Result<()> {
    let mut tensors = Vec::new();
    // A tied head is the embedding (no lm_head parameter): stored once, as transformers'
    // save_pretrained does.
    for (name, p) in model.params_mut(crate::params::ParamKind::Base) {
        let (shape, values) = match &p {
            ParamMut::Vector(p) => tensor_f32(&p.val()),
            ParamMut::Matrix(p) => tensor_f32(&p.val()),
        };
        tensors.push((name, shape, values));
    }
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    write_atomic(&dir.join("model.safetensors"), &safetensors_bytes(&tensors)?)?;
    write_atomic(&dir.join("config.json"), model.config.to_hf_json().as_bytes())
}

/// Saves the model's adapters in PEFT format: `adapter_config.json` and
/// `adapter_model.safetensors` with PEFT's names
/// (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` `[r, in]`, `lora_B` `[out, r]`).
pub fn save_peft_adapter(
    model: &LlamaForCausalLM,
    spec: &LoraSpec,
    dir: &Path,
    base_model: &str,
) -> anyhow::Result<()> {
    let mut tensors = Vec::new();
    for (name, adapter) in model.adapters() {
        let (sa, va) = tensor_f32(&adapter.a.val());
        let (sb, vb) = tensor_f32(&adapter.b.val());
        tensors.push((format!("{name}.lora_A.weight"), sa, va));
        tensors.push((format!("{name}.lora_B.weight"), sb, vb));
    }
    ensure!(!tensors.is_empty(), "the model has no adapters to save");
    // The modules that carry adapters, not the names asked for: `qkv_proj` on a checkpoint with
    // separate projections was adapted as q/k/v_proj, and PEFT must look for those.
    let mut modules: Vec<String> = Vec::new();
    for (name, _) in model.adapters() {
        let short = name.rsplit('.').next().unwrap_or_default().to_string();
        if !modules.contains(&short) {
            modules.push(short);
        }
    }
    let config = serde_json::json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": false,
        "inference_mode": true,
        "init_lora_weights": true,
        "use_rslora": false,
        "use_dora": false,
        "modules_to_save": null,
        "layers_to_transform": null,
        "rank_pattern": {},
        "alpha_pattern": {},
    });
    std::fs::create_dir_all(dir).with_context(|| format!("cannot create {}", dir.display()))?;
    write_atomic(&dir.join("adapter_model.safetensors"), &safetensors_bytes(&tensors)?)?;
    write_atomic(&dir.join("adapter_config.json"), serde_json::to_string_pretty(&config)?.as_bytes())
}

/// Reads a PEFT `adapter_config.json` as a [`LoraSpec`].
pub fn read_peft_config(dir: &Path) -> anyhow::Result<LoraSpec> {
    let path = dir.join("adapter_config.json");
    let text = std::fs::read_to_string(&path).with_context(|| format!("cannot read {}", path.display()))?;
    let v: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{}: invalid JSON", path.display()))?;
    let field = |k: &str| v.get(k).with_context(|| format!("{}: missing key {k:?}", path.display()));
    let peft_type = field("peft_type")?.as_str().unwrap_or_default();
    ensure!(peft_type == "LORA", "{}: peft_type {peft_type:?} is not supported (LORA only)", path.display());
    for unsupported in ["use_dora", "use_rslora"] {
        ensure!(
            !v.get(unsupported).and_then(|x| x.as_bool()).unwrap_or(false),
            "{}: {unsupported} = true is not supported",
            path.display()
        );
    }
    // Keys that change the math: llora does not implement them, so an adapter using them is
    // refused rather than evaluated differently from PEFT. Empty or null values are PEFT's
    // defaults (what llora itself writes).
    for key in ["alpha_pattern", "rank_pattern", "layers_to_transform", "layers_pattern", "modules_to_save"] {
        let set = match v.get(key) {
            None | Some(serde_json::Value::Null) => false,
            Some(serde_json::Value::Object(m)) => !m.is_empty(),
            Some(serde_json::Value::Array(a)) => !a.is_empty(),
            Some(serde_json::Value::String(s)) => !s.is_empty(),
            Some(_) => true,
        };
        ensure!(
            !set,
            "{}: {key} = {} is not supported (llora applies one rank and alpha to every targeted module of every layer)",
            path.display(),
            v[key]
        );
    }
    if let Some(bias) = v.get("bias").and_then(|b| b.as_str()) {
        ensure!(bias == "none", "{}: bias = {bias:?} is not supported (only \"none\")", path.display());
    }
    let targets: Vec<String> = match field("target_modules")? {
        serde_json::Value::Array(a) => {
            a.iter().map(|x| x.as_str().map(String::from)).collect::<Option<_>>().with_context(|| {
                format!("{}: target_modules {} holds a non-string", path.display(), v["target_modules"])
            })?
        }
        serde_json::Value::String(s) => vec![s.clone()],
        other => bail!("{}: target_modules {other} is not a list", path.display()),
    };
    ensure!(
        !targets.is_empty() && targets.iter().all(|t| !t.is_empty()),
        "{}: target_modules {} names no module",
        path.display(),
        v["target_modules"]
    );
    let rank = field("r")?.as_u64().filter(|r| (1..=1 << 16).contains(r));
    let rank = rank.with_context(|| format!("{}: r = {} is not a rank in 1..=65536", path.display(), v["r"]))? as usize;
    let alpha = field("lora_alpha")?.as_f64().filter(|a| a.is_finite());
    let alpha = alpha
        .with_context(|| format!("{}: lora_alpha = {} is not a finite number", path.display(), v["lora_alpha"]))?;
    let dropout = match v.get("lora_dropout") {
        None | Some(serde_json::Value::Null) => 0.0,
        Some(d) => d
            .as_f64()
            .filter(|d| (0.0..1.0).contains(d))
            .with_context(|| format!("{}: lora_dropout = {d} is not a probability in [0, 1)", path.display()))?,
    };
    Ok(LoraSpec { rank, alpha, dropout, targets })
}

/// Loads a PEFT adapter directory onto `model`, replacing its adapters (or adding them).
///
/// Accepts PEFT's on-disk names with or without the adapter name (`lora_A.weight` or
/// `lora_A.default.weight`). Every targeted module must have both tensors in the right shape;
/// a tensor that matches no module is an error too, since it means the base and adapter differ.
pub fn load_peft_adapter(model: &mut LlamaForCausalLM, dir: &Path, device: &Device) -> anyhow::Result<LoraSpec> {
    let spec = read_peft_config(dir)?;
    let path = dir.join("adapter_model.safetensors");
    let shard = Shard::open(&path)?;
    let mut names: HashMap<String, String> = shard
        .meta
        .tensors()
        .into_keys()
        .map(|n| (n.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B."), n))
        .collect();
    let mut loaded = 0;
    for (module, layer) in model.named_linears_mut() {
        let short = module.rsplit('.').next().unwrap_or_default();
        if !spec.targets(short) {
            continue;
        }
        let peft = format!("base_model.model.{module}");
        let [out, inp] = layer.dims();
        let mut take = |which: &str, shape: [usize; 2]| -> anyhow::Result<Tensor<2>> {
            let key = format!("{peft}.{which}.weight");
            let stored =
                names.remove(&key).with_context(|| format!("tensor {key} is missing from {}", path.display()))?;
            let data = shard.read_f32(&stored, &shape)?;
            Ok(Tensor::from_data(data, device))
        };
        let a = take("lora_A", [spec.rank, inp])?;
        let b = take("lora_B", [out, spec.rank])?;
        layer.lora = Some(LoraAdapter::from_tensors(a, b, &spec));
        loaded += 1;
    }
    if let Some(extra) = names.keys().next() {
        bail!(
            "{}: tensor {extra} matches no module of the base model (wrong base, or a target llora does not know)",
            path.display()
        );
    }
    ensure!(loaded > 0, "{}: no module of the model matches target_modules {:?}", path.display(), spec.targets);
    Ok(spec)
}

#[cfg(test)]
mod shard_path_tests {
    use super::shard_path;

    /// An index may name files in the directory and below it, nothing else.
    #[test]
    fn shard_paths_stay_inside_the_model_directory() {
        let dir = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        std::fs::write(outside.path().join("x.safetensors"), b"").unwrap();
        std::fs::create_dir(dir.path().join("sub")).unwrap();
        assert!(shard_path(dir.path(), "model-00001-of-00002.safetensors").is_ok());
        assert!(shard_path(dir.path(), "sub/a.safetensors").is_ok());
        for bad in ["../x.safetensors", "sub/../../x.safetensors", "/etc/passwd", ""] {
            let err = shard_path(dir.path(), bad).unwrap_err().to_string();
            assert!(err.contains("inside the model directory"), "{bad}: {err}");
        }
        #[cfg(unix)]
        {
            std::os::unix::fs::symlink(outside.path().join("x.safetensors"), dir.path().join("link.safetensors"))
                .unwrap();
            let err = shard_path(dir.path(), "link.safetensors").unwrap_err().to_string();
            assert!(err.contains("leads outside"), "{err}");
        }
    }
}

#[cfg(test)]
mod peft_config_tests {
    use super::read_peft_config;

    /// PEFT keys that would change the math are refused with the key named; PEFT's defaults
    /// (empty, null) and an adapter written with them load.
    #[test]
    fn math_changing_peft_keys_are_refused() {
        let dir = tempfile::tempdir().unwrap();
        let write = |extra: &str| {
            let text = format!(
                r#"{{"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], "rank_pattern": {{}},
                   "alpha_pattern": {{}}, "layers_to_transform": null, "modules_to_save": null{extra}}}"#
            );
            std::fs::write(dir.path().join("adapter_config.json"), text).unwrap();
            read_peft_config(dir.path())
        };
        assert_eq!(write("").unwrap().rank, 8);
        for (extra, key) in [
            (r#", "alpha_pattern": {"q_proj": 64}"#, "alpha_pattern"),
            (r#", "rank_pattern": {"layers.0.self_attn.q_proj": 4}"#, "rank_pattern"),
            (r#", "layers_to_transform": [0, 1]"#, "layers_to_transform"),
            (r#", "layers_pattern": "layers""#, "layers_pattern"),
            (r#", "modules_to_save": ["lm_head"]"#, "modules_to_save"),
            (r#", "bias": "all""#, "bias"),
        ] {
            let err = format!("{:#}", write(extra).unwrap_err());
            assert!(err.contains(key) && err.contains("adapter_config.json"), "{key}: {err}");
        }
    }
}
