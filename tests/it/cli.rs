//! The command line as a user meets it: config errors, overrides, unfinished subcommands.

use crate::common;
use common::{llora, text};

#[test]
fn help_runs_without_any_environment() {
    // llora_in clears the environment: this passes only if the rpath finds LibTorch.
    let out = llora(&["--help"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    for cmd in ["train", "eval", "data", "mlperf", "config"] {
        assert!(stdout.contains(cmd), "help lacks {cmd}: {stdout}");
    }
}

#[test]
fn config_show_prints_overrides() {
    let out = llora(&[
        "config",
        "show",
        "configs/llama2-70b-mlperf.toml",
        "--set",
        "optim.lr=5e-4",
        "--set",
        "run.device=cuda:3",
    ]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    let shown: toml::Table = toml::from_str(&stdout).expect("config show prints TOML");
    assert_eq!(shown["optim"]["lr"].as_float(), Some(5e-4));
    assert_eq!(shown["run"]["device"].as_str(), Some("cuda:3"));
}

#[test]
fn mlperf_config_has_the_benchmark_values() {
    // Values typed in from the benchmark's rules (MLCommons training_policies and the reference
    // implementation's hyper-parameters), not from our own defaults.
    let out = llora(&["config", "show", "configs/llama2-70b-mlperf.toml"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    let c: toml::Table = toml::from_str(&stdout).unwrap();
    let f = |s: &str, k: &str| c[s][k].as_float().unwrap();
    let i = |s: &str, k: &str| c[s][k].as_integer().unwrap();
    assert_eq!((i("lora", "rank"), f("lora", "alpha"), f("lora", "dropout")), (16, 32.0, 0.1));
    assert_eq!(
        (f("optim", "lr"), f("optim", "weight_decay"), f("optim", "clip_grad_norm"), f("optim", "eps")),
        (4e-4, 1e-4, 0.3, 1e-8)
    );
    assert_eq!((i("schedule", "max_steps"), i("schedule", "warmup_steps")), (1024, 0));
    assert_eq!((i("train", "global_batch_size"), i("train", "micro_batch_size")), (8, 1));
    assert_eq!((i("eval", "every_samples"), f("eval", "target_loss")), (384, 0.925));
    assert_eq!(i("data", "max_seq_len"), 8192);
    assert_eq!(c["model"]["preset"].as_str(), Some("llama2-70b"));
}

fn fails_naming(args: &[&str], needles: &[&str]) {
    let out = llora(args);
    let (_, stderr) = text(&out);
    assert!(!out.status.success(), "{args:?} should fail");
    // 1 is llora's error exit; a panic exits 101 (or aborts), which is never a clear error.
    assert_eq!(out.status.code(), Some(1), "{args:?} did not fail cleanly:\n{stderr}");
    for n in needles {
        assert!(stderr.contains(n), "{args:?}: stderr lacks {n:?}:\n{stderr}");
    }
}

/// A LoRA target that matches no module is refused before anything runs (it used
/// to give a model without adapters that panicked in backward).
#[test]
fn lora_targets_matching_nothing_are_refused() {
    let bench = ["bench", "--preset", "tiny", "--seq-len", "16", "--warmup", "0", "--steps", "1", "--targets"];
    fails_naming(&[&bench[..], &["foo"]].concat(), &["\"foo\"", "q_proj"]);
    fails_naming(&[&bench[..], &["o_proj,lm_head"]].concat(), &["\"lm_head\""]);
}

#[test]
fn bad_configs_fail_naming_the_key() {
    fails_naming(&["config", "show", "--set", "optim.learnig_rate=1"], &["`optim.learnig_rate`", "lr"]);
    fails_naming(&["config", "show", "--set", "lora.rank=sixteen"], &["`lora.rank`", "sixteen"]);
    fails_naming(&["config", "show", "--set", "lora.dropout=1.5"], &["`lora.dropout` = 1.5", "[0, 1)"]);
    fails_naming(&["config", "show", "--set", "run.device=tpu:0"], &["`run.device`", "cuda:N"]);
    fails_naming(&["config", "show", "no/such.toml"], &["no/such.toml", "cannot read"]);
    fails_naming(&["train", "--set", "lora.targets=q_proj,qkv_proj"], &["`lora.targets`", "exclude"]);
}

#[test]
fn bad_config_file_names_the_file_and_key() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("bad.toml");
    std::fs::write(&path, "[model]\npreset = \"tiny\"\n[train]\nglobal_batch_size = 0\n").unwrap();
    fails_naming(&["config", "show", path.to_str().unwrap()], &["bad.toml", "`train.global_batch_size` = 0"]);
}

/// `llora data synth` writes text and tokens; `prepare` on the text with the written
/// tokenizer gives the same samples; `inspect` passes it and names the bad row of a bad file.
#[test]
fn data_synth_prepare_inspect_round_trip() {
    use llora_data::parquet_io::{OnBadRow, ReadOptions, parquet_bytes, read_parquet};
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let out = llora(&[
        "data",
        "synth",
        "--out",
        d,
        "--train",
        "64",
        "--eval",
        "8",
        "--max-seq-len",
        "1024",
        "--vocab",
        "4096",
        "--seed",
        "3",
    ]);
    assert!(out.status.success(), "{}", text(&out).1);
    for f in ["train.jsonl", "train.parquet", "validation.jsonl", "validation.parquet", "tokenizer.json"] {
        assert!(dir.path().join(f).is_file(), "{f} missing");
    }
    let prepared = dir.path().join("prepared.parquet");
    let out = llora(&[
        "data",
        "prepare",
        "--input",
        &format!("{d}/train.jsonl"),
        "--tokenizer",
        &format!("{d}/tokenizer.json"),
        "--out",
        prepared.to_str().unwrap(),
        "--max-seq-len",
        "1024",
    ]);
    assert!(out.status.success(), "{}", text(&out).1);
    let opts = ReadOptions { vocab: 4096, max_seq_len: 1024, on_bad_row: OnBadRow::Error };
    let (a, _) = read_parquet(&prepared, &opts).unwrap();
    let (b, _) = read_parquet(&dir.path().join("train.parquet"), &opts).unwrap();
    assert_eq!(a.len(), 64);
    assert!(a == b, "the raw-text path does not reproduce the synthetic parquet");

    let out = llora(&["data", "inspect", prepared.to_str().unwrap(), "--vocab", "4096", "--max-seq-len", "1024"]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    assert!(stdout.contains("64 rows, 64 valid, 0 bad"), "{stdout}");
    // Its packing report: the file's own token count in rows of 1024; packed rows at
    // least the tokens' worth of full rows, and at most one of them half empty or less.
    let got: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    let tokens: usize = a.iter().map(|s| s.input_ids.len()).sum();
    let packed = got["packed_rows"].as_u64().unwrap() as usize;
    assert_eq!((got["tokens"].as_u64(), got["padded_rows"].as_u64()), (Some(tokens as u64), Some(64)));
    assert!((got["padded_efficiency"].as_f64().unwrap() - tokens as f64 / (64.0 * 1024.0)).abs() < 1e-12);
    assert!(packed >= tokens.div_ceil(1024) && packed <= 2 * tokens / 1024 + 1, "{packed} rows for {tokens} tokens");
    assert!((got["packing_efficiency"].as_f64().unwrap() - tokens as f64 / (packed as f64 * 1024.0)).abs() < 1e-12);
    let mut bad = b.clone();
    bad[5].labels.pop();
    let bad_path = dir.path().join("bad.parquet");
    std::fs::write(&bad_path, parquet_bytes(&bad).unwrap()).unwrap();
    fails_naming(
        &["data", "inspect", bad_path.to_str().unwrap(), "--vocab", "4096"],
        &["bad.parquet", "row 6", "labels has"],
    );
}

/// Published MLPerf Training scores (minutes) of the result folders kept in tests/data (their
/// README names the MLCommons repositories they come from).
#[test]
fn mlperf_score_reproduces_the_published_scores() {
    let root = common::root().join("tests/data/mlperf-results");
    for (dir, published) in [
        ("v5.1-AMD-MI355X_EPYC_9575F_pytorch", 10.18),
        ("v5.1-NVIDIA-theia_ngpu8_ngc25.09_nemo", 5.97),
        ("v5.0-NVIDIA-tyche_ngpu8_ngc25.04_nemo", 11.14),
        ("v4.0-NVIDIA-h200_ngc24.04_nemo", 24.69),
    ] {
        let path = root.join(dir);
        assert!(path.is_dir(), "{} missing", path.display());
        let out = llora(&["mlperf", "score", path.to_str().unwrap()]);
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{dir}: {stderr}");
        let last: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
        let score = last["score_min"].as_f64().unwrap();
        assert!((score - published).abs() < 0.005 + 1e-9, "{dir}: score {score:.4}, published {published}");
        assert!(stdout.contains(&format!("score: {published:.2} min")), "{dir}: {stdout}");
        assert_eq!(last["runs"], 10);
        assert!(stdout.contains("dropped (fastest)") && stdout.contains("dropped (slowest)"), "{stdout}");
    }
}

#[test]
fn mlperf_score_rejects_two_failed_runs() {
    let dir = tempfile::tempdir().unwrap();
    let line = |key: &str, t: u64, status: &str| {
        format!(
            ":::MLLOG {{\"namespace\": \"\", \"time_ms\": {t}, \"event_type\": \"INTERVAL_END\", \"key\": \"{key}\", \"value\": null, \"metadata\": {{\"status\": \"{status}\", \"samples_count\": 8}}}}\n"
        )
    };
    for (i, status) in ["success", "aborted", "success", "aborted"].iter().enumerate() {
        let log = line("run_start", 0, "") + &line("run_stop", 60_000 * (i as u64 + 1), status);
        std::fs::write(dir.path().join(format!("result_{i}.txt")), log).unwrap();
    }
    fails_naming(
        &["mlperf", "score", dir.path().to_str().unwrap()],
        &["2 runs did not converge", "result_1.txt (aborted)", "result_3.txt"],
    );
    fails_naming(&["mlperf", "score", "/nonexistent-results"], &["/nonexistent-results"]);
}

/// A regular file given as `--model` is called a file, not a missing directory.
#[test]
fn a_file_given_as_model_is_named_as_a_file() {
    let file = tempfile::NamedTempFile::new().unwrap();
    let out = llora(&["eval", "--model", file.path().to_str().unwrap(), "--data", "absent.parquet"]);
    let (_, stderr) = text(&out);
    assert!(!out.status.success() && stderr.contains("is a file, not a checkpoint directory"), "{stderr}");
}

/// Command flags get the validation of the config keys they stand for: each bad value is
/// refused before anything runs, with the flag named, a non-zero exit and no panic.
#[test]
fn bad_flags_are_refused_naming_the_flag() {
    let cases: &[(&[&str], &str)] = &[
        (&["bench", "--batch", "0"], "`--batch` = 0"),
        (&["bench", "--lora-r", "0"], "`--lora-r` = 0"),
        (&["bench", "--targets", "foo"], "`--targets` = \"foo\""),
        (&["bench", "--threads", "100000"], "`--threads` = 100000"),
        (&["bench", "--lora-dropout", "1.5"], "`--lora-dropout` = 1.5"),
        (&["bench", "--lr", "NaN"], "`--lr` = NaN"),
        (&["bench", "--seq-len", "100000"], "the preset's 4096 positions"),
        (&["eval", "--model", "m", "--data", "d", "--batch-size", "0"], "`--batch-size` = 0"),
        (&["eval", "--model", "m", "--data", "d", "--workers", "100000"], "`--workers` = 100000"),
        (&["eval", "--model", "m", "--data", "d", "--threads", "100000"], "`--threads` = 100000"),
        (&["data", "bench", "--train", "t", "--eval", "e", "--workers", "1,100000"], "`--workers` = 100000"),
        (&["train", "--set", "run.threads=100000"], "config key `run.threads` = 100000"),
        (&["train", "--set", "optim.eps=1e-46"], "config key `optim.eps` = 1e-46"),
        (
            &["plan", "configs/llama2-70b-mlperf.toml", "--world", "3"],
            "must be a multiple of train.micro_batch_size × data-parallel groups",
        ),
        (&["bench", "--cp", "0"], "`--cp` = 0"),
        // Context parallelism without a launcher says what to do (for a resume too).
        (&["bench", "--cp", "2"], "--cp = 2 splits each sequence over 2 ranks, and this is one process"),
        (&["train", "--set", "train.context_parallel=2"], "or set --set train.context_parallel=1 (a --resume may"),
        // Flags the chosen bench would not read (they were accepted and ignored).
        (&["bench", "--cp", "2", "--load", "m"], "`--cp` = 2: times training steps; --load replaces them"),
        (&["bench", "--cp", "2", "--allreduce-values", "8"], "`--cp` = 2: times training steps; --allreduce-values"),
        (&["bench", "--load", "m", "--allreduce-values", "8"], "`--allreduce-values` = 8: --load times loading"),
        (&["train", "--set", "precision.amax_margin=1"], "config key `precision.amax_margin` = 1: only applies with"),
        (&["train", "--set", "train.context_parallel=0"], "config key `train.context_parallel` = 0"),
        (
            &["plan", "configs/tiny-cpu.toml", "--world", "3", "--set", "train.context_parallel=2"],
            "train.context_parallel = 2 must divide --world = 3",
        ),
    ];
    for (args, want) in cases {
        // Without the thread flags `common::llora` adds for the small test machines.
        let out =
            std::process::Command::new(common::llora_bin()).args(*args).current_dir(common::root()).output().unwrap();
        let (_, stderr) = text(&out);
        assert!(!out.status.success(), "{args:?} succeeded");
        assert!(stderr.contains(want), "{args:?}: {stderr}");
        assert!(!stderr.contains("panicked") && !stderr.contains("frame #"), "{args:?}: {stderr}");
    }
}

/// No command writes over its own input: `data prepare --out` onto `--input` and `plot
/// --out` onto a run's metrics.jsonl are refused and the input is left as it was; commands
/// that would write or find nothing say so with a non-zero exit.
#[test]
fn outputs_never_overwrite_inputs() {
    let dir = tempfile::tempdir().unwrap();
    let raw = dir.path().join("raw.jsonl");
    std::fs::write(&raw, "{\"input\": \"a\", \"output\": \"b\"}\n").unwrap();
    let metrics = dir.path().join("metrics.jsonl");
    std::fs::write(&metrics, "{\"step\": 1}\n").unwrap();
    let empty = dir.path().join("empty.parquet");
    std::fs::write(&empty, llora_data::parquet_io::parquet_bytes(&[]).unwrap()).unwrap();
    let (raw_s, dir_s, metrics_s) = (raw.to_str().unwrap(), dir.path().to_str().unwrap(), metrics.to_str().unwrap());
    let empty_s = empty.to_str().unwrap();
    let cases: &[(&[&str], &str)] = &[
        (&["data", "prepare", "--input", raw_s, "--tokenizer", "t.json", "--out", raw_s], "is also --input"),
        (&["plot", dir_s, "--out", metrics_s], "would overwrite its own input"),
        (&["data", "synth", "--out", dir_s, "--train", "0"], "must each be at least 1"),
        (&["data", "bench", "--train", empty_s, "--eval", empty_s], "empty.parquet: no rows to time"),
    ];
    for (args, want) in cases {
        let out = llora(args);
        let (_, stderr) = text(&out);
        assert!(!out.status.success() && stderr.contains(want), "{args:?}: {stderr}");
    }
    assert_eq!(std::fs::read_to_string(&raw).unwrap(), "{\"input\": \"a\", \"output\": \"b\"}\n");
    assert_eq!(std::fs::read_to_string(&metrics).unwrap(), "{\"step\": 1}\n");
}

/// `data synth` and `data prepare` never replace an earlier output unless told to: a
/// second run onto the same `--out` is refused and leaves it byte for byte; `--overwrite`
/// replaces it whole.
#[test]
fn data_outputs_are_replaced_only_on_request() {
    let dir = tempfile::tempdir().unwrap();
    let synth_dir = dir.path().join("synth");
    let d = synth_dir.to_str().unwrap();
    let synth = ["data", "synth", "--out", d, "--train", "8", "--eval", "2", "--max-seq-len", "256", "--vocab", "512"];
    assert!(llora(&synth).status.success());
    let train = synth_dir.join("train.parquet");
    let before = std::fs::read(&train).unwrap();
    let out = llora(&[&synth[..], &["--seed", "5"]].concat());
    let (_, stderr) = text(&out);
    assert!(!out.status.success() && stderr.contains("already exists") && stderr.contains("--overwrite"), "{stderr}");
    assert!(std::fs::read(&train).unwrap() == before);

    let prepared = dir.path().join("prepared.parquet");
    let (input, tok) = (format!("{d}/train.jsonl"), format!("{d}/tokenizer.json"));
    let prepare = ["data", "prepare", "--input", &input, "--tokenizer", &tok, "--out", prepared.to_str().unwrap()];
    std::fs::write(&prepared, b"an earlier output").unwrap();
    let out = llora(&prepare);
    let (_, stderr) = text(&out);
    assert!(
        !out.status.success() && stderr.contains("already exists") && stderr.contains("prepared.parquet"),
        "{stderr}"
    );
    assert_eq!(std::fs::read(&prepared).unwrap(), b"an earlier output");
    let out = llora(&[&prepare[..], &["--overwrite"]].concat());
    assert!(out.status.success(), "{}", text(&out).1);
    assert!(std::fs::read(&prepared).unwrap() == before, "prepare reproduces synth's tokens");

    let out = llora(&[&synth[..], &["--seed", "5", "--overwrite"]].concat());
    assert!(out.status.success(), "{}", text(&out).1);
    assert!(std::fs::read(&train).unwrap() != before, "another seed, other samples");
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(left.len(), 2, "no temporary files or directories left: {left:?}");

    // --overwrite replaces only what the command writes: a file or folder of the user's in
    // the directory makes it refuse, plain and --chat, and everything stays as it was.
    std::fs::write(synth_dir.join("notes.txt"), b"mine").unwrap();
    std::fs::create_dir(synth_dir.join("keep")).unwrap();
    let now = std::fs::read(&train).unwrap();
    for chat in [false, true] {
        let mut args = [&synth[..], &["--overwrite"]].concat();
        if chat {
            args.push("--chat");
        }
        let out = llora(&args);
        let (_, stderr) = text(&out);
        assert!(
            !out.status.success() && stderr.contains("keep, notes.txt") && stderr.contains("does not write"),
            "{stderr}"
        );
        assert_eq!(std::fs::read(synth_dir.join("notes.txt")).unwrap(), b"mine");
        assert!(synth_dir.join("keep").is_dir() && std::fs::read(&train).unwrap() == now);
    }

    // `plot --out` never replaces an existing file unless told to.
    let run = dir.path().join("run");
    std::fs::create_dir(&run).unwrap();
    std::fs::write(run.join("metrics.jsonl"), "{\"samples\": 8, \"loss\": 2.0}\n").unwrap();
    let svg = dir.path().join("result_0.txt");
    std::fs::write(&svg, b"an MLPerf log").unwrap();
    let plot = ["plot", run.to_str().unwrap(), "--out", svg.to_str().unwrap()];
    let out = llora(&plot);
    let (_, stderr) = text(&out);
    assert!(!out.status.success() && stderr.contains("already exists") && stderr.contains("--overwrite"), "{stderr}");
    assert_eq!(std::fs::read(&svg).unwrap(), b"an MLPerf log");
    let out = llora(&[&plot[..], &["--overwrite"]].concat());
    assert!(out.status.success(), "{}", text(&out).1);
    assert!(std::fs::read_to_string(&svg).unwrap().contains("<svg"));
}

/// Sizes that used to end in an OOM kill or a long hang are refused before anything is
/// allocated or written, saying what is needed: sequences past the model's positions,
/// a run whose planned peak (`llora plan`) is more than the machine's memory, synthetic
/// corpora too large to hold; and a `model.path` that [model.pretrain] could not fill is found
/// before pre-training, not after.
#[test]
fn oversized_runs_are_refused_before_allocating() {
    let dir = tempfile::tempdir().unwrap();
    let config = common::random_base_config(dir.path());
    let run = dir.path().join("run");
    let run_set = format!("run.dir=\"{}\"", run.display());
    let clash = dir.path().join("not-a-checkpoint");
    std::fs::create_dir(&clash).unwrap();
    std::fs::write(clash.join("notes.txt"), "mine").unwrap();
    let clash_set = format!("model.path=\"{}\"", clash.display());
    let synth_out = dir.path().join("synth");
    let synth_out = synth_out.to_str().unwrap();
    let cases: &[(&[&str], &[&str])] = &[
        (
            &[
                "train",
                &config,
                "--set",
                &run_set,
                "--set",
                "data.max_seq_len=1000000000000",
                "--set",
                "data.padding=max_length",
            ],
            &["data.max_seq_len = 1000000000000", "max_position_embeddings = 1024", "model.preset = \"demo\""],
        ),
        (
            &[
                "train",
                &config,
                "--set",
                &run_set,
                "--set",
                "model.preset=llama2-70b",
                "--set",
                "data.max_seq_len=8192",
                "--set",
                "train.micro_batch_size=8",
            ],
            &["GiB at its peak", "this machine has", "llora plan"],
        ),
        // The embedded config pre-trains its base into model.path when that has no config.json.
        (&["train", "--set", &run_set, "--set", &clash_set], &["not-a-checkpoint", "holds no config.json"]),
        (&["data", "synth", "--out", synth_out, "--vocab", "4000000000"], &["--vocab 4000000000", "at most"]),
        (
            &["data", "synth", "--out", synth_out, "--max-seq-len", "100000000000"],
            &["GiB in memory", "this machine has"],
        ),
    ];
    for (args, want) in cases {
        let started = std::time::Instant::now();
        fails_naming(args, want);
        assert!(started.elapsed().as_secs() < 60, "{args:?} took {:?} to fail", started.elapsed());
    }
    assert!(!run.exists() && !std::path::Path::new(synth_out).exists(), "a refused command wrote its output");
    assert_eq!(std::fs::read_dir(&clash).unwrap().count(), 1, "the clashing directory changed");
}

/// A small BPE `tokenizer.json` (the bound on a row's bytes needs a BPE model): the letters a-z,
/// a space, `<s>` and `</s>` when asked.
fn bpe_tokenizer(dir: &std::path::Path, specials: bool) -> std::path::PathBuf {
    let mut vocab = serde_json::Map::new();
    for (i, c) in ('a'..='z').chain([' ']).enumerate() {
        vocab.insert(c.to_string(), i.into());
    }
    let mut added = Vec::new();
    if specials {
        for (k, t) in ["<s>", "</s>"].iter().enumerate() {
            vocab.insert(t.to_string(), (27 + k).into());
            added.push(serde_json::json!({"id": 27 + k, "content": t, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": true}));
        }
    }
    let json = serde_json::json!({
        "version": "1.0", "truncation": null, "padding": null, "added_tokens": added, "normalizer": null,
        "pre_tokenizer": null, "post_processor": null, "decoder": null,
        "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "vocab": vocab, "merges": []},
    });
    let path = dir.join(if specials { "tok.json" } else { "tok-nospecial.json" });
    std::fs::write(&path, json.to_string()).unwrap();
    path
}

/// A 64 MB JSONL line is skipped unread (counted as too long, the
/// peak RSS within 32 MB of the same file without it), errors name the file's line (blank lines
/// counted, JSON and content errors alike), and a tokenizer without `<s>`/`<|begin_of_text|>`
/// is blamed on --tokenizer, not on a row.
#[test]
fn raw_rows_are_bounded_and_named_by_their_line() {
    let dir = tempfile::tempdir().unwrap();
    let tok = bpe_tokenizer(dir.path(), true);
    let row = |p: &str, c: &str| serde_json::json!({"prompt": p, "completion": c}).to_string();
    let normal: Vec<String> = (0..200).map(|i| row(&format!("ask {i}"), " answer")).collect();
    // `data prepare --format completion` of `rows` (written to NAME.jsonl) with tokenizer `tok`.
    let prepare_with = |tok: &std::path::Path, rows: &str, name: &str| {
        let input = dir.path().join(format!("{name}.jsonl"));
        std::fs::write(&input, rows).unwrap();
        let out = dir.path().join(format!("{name}.parquet"));
        let p = |x: &std::path::Path| x.to_str().unwrap().to_string();
        let args = ["data", "prepare", "--format", "completion", "--input", &p(&input), "--tokenizer", &p(tok)];
        llora(&[&args[..], &["--out", &p(&out), "--max-seq-len", "64"]].concat())
    };
    let prepare = |rows: &str, name: &str| prepare_with(&tok, rows, name);
    let report = |out: &std::process::Output| -> serde_json::Value {
        assert!(out.status.success(), "{}", text(out).1);
        serde_json::from_str(text(out).0.trim()).unwrap()
    };
    let plain = report(&prepare(&normal.join("\n"), "plain"));
    let huge = row("x", &"a".repeat(64 << 20));
    let with_huge =
        report(&prepare(&format!("{}\n{huge}\n{}", normal[..100].join("\n"), normal[100..].join("\n")), "huge"));
    assert_eq!((with_huge["rows"].as_u64(), with_huge["written"].as_u64()), (Some(201), Some(200)), "{with_huge}");
    assert_eq!(with_huge["dropped_too_long"], 1, "{with_huge}");
    let grew = with_huge["peak_rss_mb"].as_f64().unwrap() - plain["peak_rss_mb"].as_f64().unwrap();
    assert!(grew < 32.0, "a 64 MB line raised the peak RSS by {grew:.1} MB");

    // One numbering: the file's line, for a JSON error and for a content error.
    let out = prepare(&format!("{}\n\n{{\"prompt\": ", normal[0]), "badjson");
    assert!(!out.status.success() && text(&out).1.contains("badjson.jsonl: line 3"), "{}", text(&out).1);
    let out = prepare(&format!("{}\n\n{}", normal[0], serde_json::json!({"prompt": "p"})), "badrow");
    assert!(!out.status.success() && text(&out).1.contains("badrow.jsonl: line 3"), "{}", text(&out).1);

    let nospecial = bpe_tokenizer(dir.path(), false);
    let out = prepare_with(&nospecial, &normal.join("\n"), "nospecial");
    let stderr = text(&out).1;
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    for needle in ["--tokenizer", "tok-nospecial.json", "<s>"] {
        assert!(stderr.contains(needle), "stderr lacks {needle:?}:\n{stderr}");
    }
}

/// Inputs that used to be accepted silently are refused before any work,
/// each naming what is wrong: a device size without a unit, a WORLD_SIZE that is no number, a
/// NaN plot target, fewer MLPerf runs than a score needs.
#[test]
fn silently_accepted_inputs_are_refused_up_front() {
    fails_naming_with(2, &["plan", "--device-memory", "80"], &["--device-memory", "no unit", "80GiB"]);
    let out = common::llora_command(&common::root(), &["plan"]).env("WORLD_SIZE", "abc").output().unwrap();
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("WORLD_SIZE=\"abc\""), "{stderr}");
    // The world size is named as it was given: WORLD_SIZE from the environment, not --world,
    // and the data-parallel groups as such (they were called --world).
    let mlperf = ["plan", "configs/llama2-70b-mlperf.toml"];
    let out = common::llora_command(&common::root(), &mlperf).env("WORLD_SIZE", "3").output().unwrap();
    let (_, stderr) = text(&out);
    assert!(
        stderr.contains("(WORLD_SIZE (from the environment) = 3, train") && !stderr.contains("--world"),
        "{stderr}"
    );
    let big = "4611686018427387904";
    let (micro, gbs) = (format!("train.micro_batch_size={big}"), format!("train.global_batch_size={big}"));
    let huge = ["plan", "--world", "8", "--set", &micro, "--set", &gbs];
    let (_, stderr) = text(&llora(&huge));
    assert!(stderr.contains("data-parallel groups (--world = 8 / train.context_parallel = 1) = 8"), "{stderr}");
    fails_naming_with(2, &["plot", "--target", "nan", "--out", "x.svg", "runs/a"], &["--target", "finite"]);
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("results");
    fails_naming_with(2, &["mlperf", "run", "--runs", "2", "--out", out_dir.to_str().unwrap()], &["--runs", "2"]);
    assert!(!out_dir.exists(), "nothing is trained or written for a refused --runs");
    // A plan that fits exits 0.
    let out = llora(&["plan", "--device-memory", "1TiB"]);
    assert!(out.status.success(), "{}", text(&out).1);
}

/// `args` fails with exit status `code` (2: clap's usage errors), stderr naming every needle.
fn fails_naming_with(code: i32, args: &[&str], needles: &[&str]) {
    let out = llora(args);
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(code), "{args:?}:\n{stderr}");
    for n in needles {
        assert!(stderr.contains(n), "{args:?}: stderr lacks {n:?}:\n{stderr}");
    }
}

/// A reader that goes away (`llora plan ... | head -1`, `llora train ... | true`) ends the
/// output, not the command: no panic, the command's own exit status, and a run still writes
/// its result log to the end and its adapter.
#[test]
fn a_closed_stdout_ends_the_output_not_the_command() {
    let closed = |dir: &std::path::Path, args: &[&str]| {
        let mut child = common::llora_command(dir, args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        drop(child.stdout.take()); // the reader is gone before the first line
        child.wait_with_output().unwrap()
    };
    for args in
        [&["config", "show", "configs/llama2-70b-mlperf.toml"][..], &["plan", "configs/tiny-cpu.toml", "--json"]]
    {
        let out = closed(&common::root(), args);
        let (_, stderr) = text(&out);
        assert!(out.status.success() && !stderr.contains("panicked"), "{args:?}: {:?} {stderr}", out.status);
    }
    let dir = tempfile::tempdir().unwrap();
    let config = common::random_base_config(dir.path());
    let run = dir.path().join("run");
    let mut args = common::short_run_args(&config, &run);
    args.extend(["--set".into(), "schedule.max_steps=4".into()]);
    let out = closed(&common::root(), &common::strs(&args));
    let (_, stderr) = text(&out);
    // Its own verdict: the short run cannot reach its target, exit 1 saying so.
    assert!(out.status.code() == Some(1) && stderr.contains("did not reach"), "{:?} {stderr}", out.status);
    assert!(!stderr.contains("panicked"), "{stderr}");
    let log = common::mllog(&run.join("result_0.txt"));
    assert!(log.iter().any(|e| e["key"] == "run_stop"), "the result log ends: {log:?}");
    assert!(run.join("adapter/adapter_model.safetensors").is_file());
}

/// Sizes that multiply past 2^64 are refused naming each factor, never wrapped around into a
/// small world: 2 × (2^63 + 2) is 4 modulo 2^64, which divides the global batch of 8.
#[test]
fn a_huge_world_is_refused_not_wrapped() {
    let huge = (1u64 << 63) + 2;
    let out =
        llora(&["plan", "configs/tiny-cpu.toml", "--world", &huge.to_string(), "--set", "train.micro_batch_size=2"]);
    let (stdout, stderr) = text(&out);
    assert!(!out.status.success() && stdout.is_empty(), "{stdout}");
    assert!(
        stderr.contains(
            "train.micro_batch_size = 2 × data-parallel groups (--world = 9223372036854775810 / \
             train.context_parallel = 1) = 9223372036854775810 multiply past 2^64"
        ),
        "{stderr}"
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
}

/// Values that would be accepted and ignored are refused, each naming its flag or key: NF4
/// settings without NF4 (flags and config keys), `eval --pack-window` without `--pack`,
/// `data inspect --pack-window 0`; and an NF4 base of other blocks can be benched (evaluated,
/// generated) on its own blocks with `--quant-block-size`.
#[test]
fn settings_that_would_be_ignored_are_refused() {
    let eval = ["eval", "--model", "runs/absent", "--data", "absent.parquet"];
    fails_naming(&[&eval[..], &["--pack-window", "4"]].concat(), &["--pack-window", "only applies with --pack"]);
    fails_naming(&[&eval[..], &["--quant-block-size", "128"]].concat(), &["--quant-block-size", "--quantize nf4"]);
    fails_naming(&["bench", "--preset", "tiny", "--double-quant", "false"], &["--double-quant", "--quantize nf4"]);
    fails_naming(
        &["config", "show", "--set", "model.quant_block_size=128"],
        &["model.quant_block_size", "model.quantize"],
    );
    fails_naming(&["config", "show", "--set", "model.double_quant=false"], &["model.double_quant", "model.quantize"]);
    fails_naming(&["data", "inspect", "absent.parquet", "--pack-window", "0"], &["--pack-window 0", "at least 1"]);
    let out = llora(&[
        "bench",
        "--preset",
        "tiny",
        "--seq-len",
        "16",
        "--threads",
        "1",
        "--warmup",
        "0",
        "--steps",
        "1",
        "--quantize",
        "nf4",
        "--quant-block-size",
        "128",
    ]);
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    let r: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!(r["nf4"]["block"], 128, "{r}");
}

/// A `rank_pattern` / `alpha_pattern` key that matches no adapted module (a typo, another case,
/// a module not targeted) is refused naming the key, not ignored and written to
/// adapter_config.json; so is a rank above a module's smaller dimension (the random base is
/// d 128); `llora plan` refuses the same.
#[test]
fn pattern_keys_that_set_nothing_and_oversized_ranks_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let config = common::random_base_config(dir.path());
    for (set, needles) in [
        ("lora.rank_pattern={\"v_prj\"=4}", &["rank_pattern key \"v_prj\" matches no adapted module"][..]),
        ("lora.alpha_pattern={\"Q_PROJ\"=8.0}", &["alpha_pattern key \"Q_PROJ\" matches no adapted module"]),
        ("lora.rank_pattern={\"gate_proj\"=4}", &["\"gate_proj\" matches no adapted module"]),
        ("lora.rank=100000", &["lora rank 100000", "above its smaller dimension"]),
    ] {
        let run = dir.path().join(format!("run-{}", set.len()));
        let mut args = common::short_run_args(&config, &run);
        args.extend(["--set".into(), set.into(), "--set".into(), "lora.targets=[\"q_proj\",\"v_proj\"]".into()]);
        let out = common::llora_in(&common::root(), &common::strs(&args));
        let (_, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(1), "{set}: {stderr}");
        for n in needles {
            assert!(stderr.contains(n), "{set}: {stderr}");
        }
        assert!(!run.join("adapter").exists(), "{set}: an adapter was written");
        // The plan makes the same checks (it promised memory for what training refused).
        let targets = "lora.targets=[\"q_proj\",\"v_proj\"]";
        let out = llora(&["plan", &config, "--set", set, "--set", targets]);
        let (_, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(1), "plan {set}: {stderr}");
        for n in needles {
            assert!(stderr.contains(n), "plan {set}: {stderr}");
        }
    }
}

/// `llora eval` names a bad row's own problem; the sequence-length limit and `--skip-bad-rows`
/// are said only where a row is too long (every data error used to start with them).
#[test]
fn eval_says_the_length_limit_only_for_rows_too_long() {
    let tmp = tempfile::tempdir().unwrap();
    let model = common::family_base_away_from_0_and_1(tmp.path(), "demo");
    let row =
        |ids: Vec<u32>| llora_data::Sample { labels: ids.iter().map(|&i| i64::from(i)).collect(), input_ids: ids };
    for (name, sample, says, not) in [
        ("bad-id", row(vec![1, 2, 100_000]), "input_ids[2] = 100000 is outside the vocabulary", Some("rows may hold")),
        ("long", row(vec![1; 40]), "rows may hold at most 32 tokens (--max-seq-len", None),
    ] {
        let data = tmp.path().join(format!("{name}.parquet"));
        std::fs::write(&data, llora_data::parquet_io::parquet_bytes(&[sample]).unwrap()).unwrap();
        let (m, d) = (model.to_str().unwrap(), data.to_str().unwrap());
        let out = llora(&["eval", "--model", m, "--data", d, "--max-seq-len", "32"]);
        let (_, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(1), "{name}: {stderr}");
        assert!(stderr.contains(says) && stderr.contains("row 1"), "{name}: {stderr}");
        assert!(not.is_none_or(|n| !stderr.contains(n)), "{name}: {stderr}");
    }
}

/// `llora data prepare --format preference` tokenises pairs as TRL 1.16's DPOTrainer does (its
/// own `_prepare_dataset`, `scripts/peer/dpo_tokenize.py`, with the same tokenizer directory):
/// conversational pairs through the chat template (the prompt with the generation prompt),
/// text pairs with the EOS text appended (not twice when a completion already ends with it);
/// each written pair is TRL's prompt + completion ids, labels on the completion only.
#[test]
#[cfg_attr(not(has_peer), ignore = "needs the peer venv: ./scripts/setup.sh --parity")]
fn preference_pairs_prepare_as_trl_tokenises_them() {
    let dir = tempfile::tempdir().unwrap();
    let syn = dir.path().join("syn");
    let out = llora(&["data", "synth", "--out", syn.to_str().unwrap(), "--train", "2", "--eval", "1", "--chat"]);
    assert!(out.status.success(), "{}", text(&out).1);
    let first: serde_json::Value =
        serde_json::from_str(std::fs::read_to_string(syn.join("train.jsonl")).unwrap().lines().next().unwrap())
            .unwrap();
    let words: Vec<&str> = first["messages"][0]["content"].as_str().unwrap().split_whitespace().take(40).collect();
    let say = |a: usize, b: usize| words[a..b].join(" ");
    let message = |role: &str, content: String| serde_json::json!([{"role": role, "content": content}]);
    let eos = "<|eot_id|>";
    let rows = [
        serde_json::json!({"prompt": message("user", say(0, 12)), "chosen": message("assistant", say(12, 16)),
                           "rejected": message("assistant", say(16, 25))}),
        serde_json::json!({"prompt": say(0, 10), "chosen": format!(" {}", say(10, 13)), "rejected": format!(" {}", say(13, 20))}),
        serde_json::json!({"prompt": say(5, 9), "chosen": format!(" {}{eos}", say(20, 22)), "rejected": format!(" {}", say(22, 30))}),
    ];
    let input = dir.path().join("pairs.jsonl");
    std::fs::write(&input, rows.iter().map(|r| format!("{r}\n")).collect::<String>()).unwrap();
    let prepared = dir.path().join("pairs.parquet");
    let out = llora(&[
        "data",
        "prepare",
        "--format",
        "preference",
        "--input",
        input.to_str().unwrap(),
        "--tokenizer",
        syn.to_str().unwrap(),
        "--out",
        prepared.to_str().unwrap(),
        "--max-seq-len",
        "512",
    ]);
    assert!(out.status.success(), "{}", text(&out).1);
    let peer = std::process::Command::new(common::root().join(".venv/bin/python"))
        .arg(common::root().join("scripts/peer/dpo_tokenize.py"))
        .args(["--tokenizer", syn.to_str().unwrap(), "--input", input.to_str().unwrap()])
        .output()
        .unwrap();
    let (stdout, stderr) = text(&peer);
    assert!(peer.status.success(), "{stderr}");
    let trl: Vec<serde_json::Value> = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    let opts = llora_data::parquet_io::ReadOptions {
        vocab: 1 << 20,
        max_seq_len: 512,
        on_bad_row: llora_data::parquet_io::OnBadRow::Error,
    };
    let (pairs, _) = llora_data::preference::read_pairs(&prepared, &opts).unwrap();
    assert_eq!(pairs.len(), 3);
    for (k, (pair, t)) in pairs.iter().zip(&trl).enumerate() {
        let ids = |key: &str| t[key].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect::<Vec<_>>();
        let prompt = ids("prompt_ids");
        for (sample, key) in [(&pair.chosen, "chosen_ids"), (&pair.rejected, "rejected_ids")] {
            assert_eq!(sample.input_ids, [prompt.clone(), ids(key)].concat(), "row {}: {key}", k + 1);
            let labelled = sample.labels.iter().position(|&l| l != -100).unwrap();
            assert_eq!(labelled, prompt.len(), "row {}: the labels start with the completion", k + 1);
        }
    }
}

/// `llora eval --dpo-*`: bad values and `--pack` are refused by flag before anything loads,
/// and a file of plain samples (not pairs) names the column it lacks.
#[test]
fn eval_of_preference_pairs_refuses_what_cannot_apply() {
    let out = llora(&["eval", "--model", "absent", "--data", "absent.parquet", "--dpo-beta", "0", "--pack"]);
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("`--dpo-beta`") && stderr.contains("`--pack`"), "{stderr}");
    let out = llora(&["eval", "--model", "absent", "--data", "absent.parquet", "--dpo-sft-weight=-1"]);
    assert!(text(&out).1.contains("`--dpo-sft-weight`"), "{}", text(&out).1);

    let tmp = tempfile::tempdir().unwrap();
    let model = common::family_base_away_from_0_and_1(tmp.path(), "demo");
    let data = tmp.path().join("samples.parquet");
    let sample = llora_data::Sample { input_ids: vec![1, 2, 3], labels: vec![-100, 2, 3] };
    std::fs::write(&data, llora_data::parquet_io::parquet_bytes(&[sample]).unwrap()).unwrap();
    let (m, d) = (model.to_str().unwrap(), data.to_str().unwrap());
    let out = llora(&["eval", "--model", m, "--data", d, "--dpo-loss", "ipo"]);
    let (_, stderr) = text(&out);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(stderr.contains("chosen_input_ids") && stderr.contains("samples.parquet"), "{stderr}");
}
