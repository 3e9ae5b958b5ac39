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
        let mut ckpt = Self { dir: dir.to_path_buf(), config, shards, index };
        if ckpt.config.tie_word_embeddings && ckpt.holds_its_own_head()? {
            tracing::warn!(
                dir = %dir.display(),
                "config.json ties the LM head to the embedding (tie_word_embeddings = true), but the checkpoint \
                 holds an lm_head.weight with other values: using the file's head, untied, as transformers does \
                 (set tie_word_embeddings = false in config.json to silence this)"
            );
            ckpt.config.tie_word_embeddings = false;
        }
        Ok(ckpt)
    }

    /// Whether the checkpoint holds an `lm_head.weight` that differs from the embedding (dtype,
    /// shape or any byte). transformers then keeps the file's head and unties the two, whatever
    /// `tie_word_embeddings` says; a head equal to the embedding stays tied.
    fn holds_its_own_head(&self) -> anyhow::Result<bool> {
        let (head, embed) = ("lm_head.weight", "model.embed_tokens.weight");
        let (Some(&h), Some(&e)) = (self.index.get(head), self.index.get(embed)) else { return Ok(false) };
        let (hs, es) = (&self.shards[h], &self.shards[e]);
        let same_layout = match (hs.meta.info(head), es.meta.info(embed)) {
            (Some(a), Some(b)) => a.dtype == b.dtype && a.shape == b.shape,
            _ => false,
        };
        let differ = !same_layout || hs.raw(head)? != es.raw(embed)?;
        hs.forget(head);
        es.forget(embed);
        Ok(differ)
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
    safetensors_bytes_with(tensors, None)
}

/// [`safetensors_bytes`] with the header's `__metadata__` (string pairs every reader ignores
/// but can read: PEFT and transformers leave them alone).
pub fn safetensors_bytes_with(
    tensors: &[(String, Vec<usize>, Vec<f32>)],
    metadata: Option<HashMap<String, String>>,
) -> anyhow::Result<Vec<u8>> {
    let bytes: Vec<(String, Vec<usize>, Vec<u8>)> = tensors
        .iter()
        .map(|(n, s, v)| (n.clone(), s.clone(), v.iter().flat_map(|x| x.to_le_bytes()).collect()))
        .collect();
    let views: Vec<(String, TensorView<'_>)> = bytes
        .iter()
        .map(|(n, s, b)| Ok((n.clone(), TensorView::new(Dtype::F32, s.clone(), b)?)))
        .collect::<Result<_, safetensors::SafeTensorError>>()?;
    Ok(safetensors::serialize(views, metadata)?)
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
