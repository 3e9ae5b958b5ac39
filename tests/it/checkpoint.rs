//! Loading HF checkpoints: sharded indexes, and a clear error (never a panic) for each
//! kind of broken checkpoint.

use std::path::Path;

use burn::tensor::Device;
use llora_model::checkpoint::{HfCheckpoint, safetensors_bytes};
use llora_model::{BuildOptions, LlamaConfig};

fn micro() -> LlamaConfig {
    LlamaConfig {
        vocab_size: 16,
        hidden_size: 8,
        intermediate_size: 12,
        num_hidden_layers: 1,
        num_attention_heads: 2,
        num_key_value_heads: 1,
        head_dim: 4,
        ..LlamaConfig::tiny()
    }
}

/// Every tensor of `micro()` with its HF name and shape, filled with a distinct constant each.
fn tensors(c: &LlamaConfig) -> Vec<(String, Vec<usize>, Vec<f32>)> {
    let (d, i, v, hd) = (c.hidden_size, c.intermediate_size, c.vocab_size, c.head_dim);
    let (q, kv) = (c.num_attention_heads * hd, c.num_key_value_heads * hd);
    let p = "model.layers.0";
    let shapes: Vec<(String, Vec<usize>)> = vec![
        ("model.embed_tokens.weight".into(), vec![v, d]),
        (format!("{p}.input_layernorm.weight"), vec![d]),
        (format!("{p}.self_attn.q_proj.weight"), vec![q, d]),
        (format!("{p}.self_attn.k_proj.weight"), vec![kv, d]),
        (format!("{p}.self_attn.v_proj.weight"), vec![kv, d]),
        (format!("{p}.self_attn.o_proj.weight"), vec![d, q]),
        (format!("{p}.post_attention_layernorm.weight"), vec![d]),
        (format!("{p}.mlp.gate_proj.weight"), vec![i, d]),
        (format!("{p}.mlp.up_proj.weight"), vec![i, d]),
        (format!("{p}.mlp.down_proj.weight"), vec![d, i]),
        ("model.norm.weight".into(), vec![d]),
        ("lm_head.weight".into(), vec![v, d]),
    ];
    shapes
        .into_iter()
        .enumerate()
        .map(|(k, (n, s))| {
            let len = s.iter().product();
            (n, s, vec![0.01 * (k as f32 + 1.0); len])
        })
        .collect()
}

fn write_single(dir: &Path, t: &[(String, Vec<usize>, Vec<f32>)]) {
    std::fs::write(dir.join("config.json"), micro().to_hf_json()).unwrap();
    std::fs::write(dir.join("model.safetensors"), safetensors_bytes(t).unwrap()).unwrap();
}

fn write_sharded(dir: &Path, t: &[(String, Vec<usize>, Vec<f32>)]) {
    std::fs::write(dir.join("config.json"), micro().to_hf_json()).unwrap();
    let (a, b) = t.split_at(t.len() / 2);
    let mut map = serde_json::Map::new();
    for (file, part) in [("model-00001-of-00002.safetensors", a), ("model-00002-of-00002.safetensors", b)] {
        std::fs::write(dir.join(file), safetensors_bytes(part).unwrap()).unwrap();
        for (n, _, _) in part {
            map.insert(n.clone(), file.into());
        }
    }
    let index = serde_json::json!({"metadata": {}, "weight_map": map});
    std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
}

fn load_err(dir: &Path) -> String {
    let device = Device::libtorch();
    match HfCheckpoint::open(dir).and_then(|c| c.load_model(&BuildOptions::default(), &device)) {
        Ok(_) => panic!("loading {} should fail", dir.display()),
        Err(e) => format!("{e:#}"),
    }
}

#[test]
fn sharded_and_single_file_load_the_same_weights() {
    let device = Device::libtorch();
    let (one, two) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    write_single(one.path(), &tensors(&micro()));
    write_sharded(two.path(), &tensors(&micro()));
    let a = HfCheckpoint::open(one.path()).unwrap().load_model(&BuildOptions::default(), &device).unwrap();
    let b = HfCheckpoint::open(two.path()).unwrap().load_model(&BuildOptions::default(), &device).unwrap();
    // The o_proj weight was written as the constant 0.06 (the 6th tensor).
    let o = a.layers[0].self_attn.o_proj.base_weight(&device).into_data().convert::<f32>().try_to_vec::<f32>().unwrap();
    assert!(o.iter().all(|&x| x == 0.06f32), "{o:?}");
    assert_eq!(a.head().into_data(), b.head().into_data());
}

#[test]
fn missing_tensor_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let t: Vec<_> = tensors(&micro()).into_iter().filter(|(n, _, _)| !n.ends_with("v_proj.weight")).collect();
    write_single(dir.path(), &t);
    let e = load_err(dir.path());
    assert!(e.contains("model.layers.0.self_attn.v_proj.weight") && e.contains("missing"), "{e}");
}

#[test]
fn wrong_shape_names_tensor_and_both_shapes() {
    let dir = tempfile::tempdir().unwrap();
    let mut t = tensors(&micro());
    let up = t.iter_mut().find(|(n, _, _)| n.ends_with("up_proj.weight")).unwrap();
    up.1 = vec![8, 12];
    write_single(dir.path(), &t);
    let e = load_err(dir.path());
    assert!(e.contains("mlp.up_proj.weight") && e.contains("[12, 8]") && e.contains("[8, 12]"), "{e}");
}

#[test]
fn shard_missing_from_disk_is_named() {
    let dir = tempfile::tempdir().unwrap();
    write_sharded(dir.path(), &tensors(&micro()));
    std::fs::remove_file(dir.path().join("model-00002-of-00002.safetensors")).unwrap();
    let e = load_err(dir.path());
    assert!(e.contains("model-00002-of-00002.safetensors") && e.contains("missing"), "{e}");
}

#[test]
fn truncated_shard_and_bad_config_are_errors() {
    let dir = tempfile::tempdir().unwrap();
    write_single(dir.path(), &tensors(&micro()));
    let path = dir.path().join("model.safetensors");
    let bytes = std::fs::read(&path).unwrap();
    std::fs::write(&path, &bytes[..bytes.len() / 2]).unwrap();
    let e = load_err(dir.path());
    assert!(e.contains("model.safetensors"), "{e}");
    std::fs::write(dir.path().join("config.json"), "{\"vocab_size\": 3}").unwrap();
    let e = load_err(dir.path());
    assert!(e.contains("config.json"), "{e}");
}

/// A negative `rms_norm_eps` (the norm's 1/√ turns NaN) is refused with the field named, not
/// evaluated to a null loss.
#[test]
fn negative_rms_norm_eps_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    write_single(dir.path(), &tensors(&micro()));
    let mut config: serde_json::Value = serde_json::from_str(&micro().to_hf_json()).unwrap();
    config["rms_norm_eps"] = serde_json::json!(-1e-5);
    std::fs::write(dir.path().join("config.json"), config.to_string()).unwrap();
    let e = load_err(dir.path());
    assert!(e.contains("rms_norm_eps") && e.contains("config.json"), "{e}");
}

/// A checkpoint with tensors its config.json does not describe (here a second layer's) is
/// refused with the count and the first name, not loaded as a smaller model; the RoPE
/// buffer transformers itself ignores is accepted.
#[test]
fn unused_tensors_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let mut t = tensors(&micro());
    t.push(("model.layers.0.self_attn.rotary_emb.inv_freq".into(), vec![2], vec![1.0, 0.5]));
    write_single(dir.path(), &t);
    let device = Device::libtorch();
    assert!(HfCheckpoint::open(dir.path()).unwrap().load_model(&BuildOptions::default(), &device).is_ok());
    let extra: Vec<_> = tensors(&micro())
        .into_iter()
        .filter(|(n, ..)| n.starts_with("model.layers.0."))
        .map(|(n, s, v)| (n.replace("layers.0.", "layers.1."), s, v))
        .collect();
    t.extend(extra);
    write_single(dir.path(), &t);
    let e = load_err(dir.path());
    assert!(e.contains("9 tensor(s) match nothing in a 1-layer Llama") && e.contains("model.layers.1."), "{e}");
}

/// The scan that explains a non-finite eval loss names the tensor holding NaN or inf and how
/// many values; a finite checkpoint has none.
#[test]
fn first_non_finite_tensor_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let mut t = tensors(&micro());
    write_single(dir.path(), &t);
    assert_eq!(HfCheckpoint::open(dir.path()).unwrap().first_non_finite().unwrap(), None);
    let up = t.iter_mut().find(|(n, ..)| n.ends_with("mlp.up_proj.weight")).unwrap();
    up.2[3] = f32::NAN;
    up.2[5] = f32::INFINITY;
    write_single(dir.path(), &t);
    let found = HfCheckpoint::open(dir.path()).unwrap().first_non_finite().unwrap();
    assert_eq!(found, Some(("model.layers.0.mlp.up_proj.weight".to_string(), 2)));
}
