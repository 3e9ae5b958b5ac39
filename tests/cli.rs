//! The command line as a user meets it: config errors, overrides, unfinished subcommands.

mod common;
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

/// `llora plan`'s prediction against the peak RSS `llora bench` measures (from /proc) on three
/// small shapes: fp32 and bf16 with every block's activations, and FP8 weights + activations
/// with half the blocks recomputed. The bounds of docs/memory.md: measured / planned <= 1.05
/// (a plan that says "fits" and then runs out of memory is its worst failure), planned /
/// measured <= 1.15.
#[test]
fn plan_predicts_the_measured_peak_of_three_small_shapes() {
    for extra in [
        &["--preset", "small", "--seq-len", "512"][..],
        &["--preset", "small", "--seq-len", "512", "--precision", "bf16"][..],
        &[
            "--preset",
            "small",
            "--seq-len",
            "768",
            "--precision",
            "fp8",
            "--fp8-weights",
            "--fp8-activations",
            "--recompute-layers",
            "4",
        ],
    ] {
        let mut args = vec!["bench", "--threads", "1", "--warmup", "1", "--steps", "1"];
        args.extend(extra);
        let out = llora(&args);
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{stderr}");
        let record: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
        let (planned, measured) =
            (record["planned_peak_mb"].as_f64().unwrap(), record["peak_rss_mb"].as_f64().unwrap());
        // Never optimistic by more than 5%, never pessimistic by more than 15%.
        let what = format!("{extra:?}: planned {planned} MB, measured {measured} MB");
        assert!(measured / planned <= 1.05, "{what}: the plan is optimistic");
        assert!(planned / measured <= 1.15, "{what}: the plan is pessimistic");
    }
}

/// The MLPerf job on 8 x 80 GiB: the replicated FP8 replica with all activations does not
/// fit, and the plan names a recipe that does; a bad size names the flag's units.
#[test]
fn plan_of_the_mlperf_job_names_a_recipe_that_fits() {
    let fp8 = [
        "--set",
        "precision.compute=fp8",
        "--set",
        "precision.fp8_weights=true",
        "--set",
        "precision.fp8_activations=true",
    ];
    let mut args = vec![
        "plan",
        "configs/llama2-70b-mlperf.toml",
        "--world",
        "8",
        "--device-memory",
        "80GiB",
        "--json",
        "--set",
        "run.device=cuda",
        "--set",
        "train.recompute_layers=0",
        "--set",
        "train.shard_frozen_weights=false",
    ];
    args.extend(fp8);
    let out = llora(&args);
    let (stdout, stderr) = text(&out);
    // Exit 3: the plan is printed whole, and a script can tell "does not fit" from an error.
    assert_eq!(out.status.code(), Some(3), "{stderr}");
    assert!(stderr.contains("does not fit"), "{stderr}");
    let plan: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    assert_eq!(plan["fits"], false);
    let cheapest = &plan["cheapest"];
    assert!(cheapest["peak_mb"].as_f64().unwrap() <= 80.0 * 1024.0, "{plan}");
    // 65 GiB of FP8 weights per replica plus 20 GiB of block inputs at 8192 tokens: only
    // sharding gets under 80 GiB.
    assert_eq!(cheapest["shard_frozen_weights"], true, "{plan}");
    let kept = plan["kept_bytes_per_token_per_block"].as_f64().unwrap();
    let min = plan["minimum_bytes_per_token_per_block"].as_f64().unwrap();
    assert!(kept >= min, "llora cannot keep less than the minimum: {kept} < {min}");
    let out = llora(&["plan", "configs/llama2-70b-mlperf.toml", "--device-memory", "80 gigs"]);
    let (_, stderr) = text(&out);
    assert!(!out.status.success() && stderr.contains("--device-memory") && stderr.contains("GiB"), "{stderr}");
}

/// A regular file given as `--model` is called a file, not a missing directory.
#[test]
fn a_file_given_as_model_is_named_as_a_file() {
    let file = tempfile::NamedTempFile::new().unwrap();
    let out = llora(&["eval", "--model", file.path().to_str().unwrap(), "--data", "absent.parquet"]);
    let (_, stderr) = text(&out);
    assert!(!out.status.success() && stderr.contains("is a file, not a checkpoint directory"), "{stderr}");
}

/// `scripts/gpu-check.sh --cpu` runs the whole report path on the CPU (what a GPU node runs, on
/// small shapes): the self-tests pass, the all-reduce spans two Gloo ranks, llora's eval loss
/// agrees with HF + PEFT's (fp32 and bf16), and llora and the PyTorch + PEFT peer both ran each
/// precision's bench, with the plan beside the measured peak.
#[test]
fn gpu_check_cpu_mode_writes_the_whole_report() {
    let dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(common::root().join("scripts/gpu-check.sh"))
        .arg("--cpu")
        .env("REPORT_DIR", dir.path())
        .env("LLORA", common::llora_bin())
        .env("PYTHON", common::root().join(".venv/bin/python"))
        .env("TRACE", "1")
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.path().join("report.json")).unwrap()).unwrap();
    let rows = report["rows"].as_array().unwrap();
    let section = |s: &str| rows.iter().filter(|r| r["section"] == s).collect::<Vec<_>>();
    // One row per part, each its own process.
    let selftest = section("selftest");
    let parts: Vec<&str> = selftest.iter().map(|r| r["part"].as_str().unwrap()).collect();
    assert_eq!(parts, ["gemm", "attention", "norm", "dropout", "all-reduce"], "{report}");
    let names: Vec<&str> =
        selftest.iter().flat_map(|r| r["checks"].as_array().unwrap()).map(|c| c["name"].as_str().unwrap()).collect();
    for want in [
        "bf16 GEMM",
        "FP8 GEMMs on _scaled_mm",
        "attention cpu-flash BFloat16",
        "dropout mask redrawn in backward",
        "all-reduce",
    ] {
        assert!(names.contains(&want), "{want} missing from {names:?}");
    }
    assert!(selftest.iter().all(|r| r["ok"] == true), "{selftest:?}");
    // The CUDA-only part checks nothing here and says so, in the row and in the report.
    let norm = selftest.iter().find(|r| r["part"] == "norm").unwrap();
    assert!(norm["checks"].as_array().unwrap().is_empty(), "{norm}");
    let skipped: Vec<&str> = norm["skipped"].as_array().unwrap().iter().map(|c| c["name"].as_str().unwrap()).collect();
    assert!(skipped.contains(&"RMSNorm fused kernels BFloat16"), "{norm}");
    let md = std::fs::read_to_string(dir.path().join("report.md")).unwrap();
    assert!(md.contains("| RMSNorm fused kernels BFloat16 | skipped | CUDA only"), "{md}");
    assert_eq!(report["final"], true);
    let allreduce = &section("allreduce")[0]["checks"][0];
    assert!(allreduce["ok"] == true && allreduce["detail"].as_str().unwrap().starts_with("2 ranks"), "{allreduce}");
    let parity = section("parity");
    assert_eq!(parity.len(), 2, "{report}");
    assert!(parity.iter().all(|r| r["ok"] == true), "{parity:?}");
    let bench = section("bench");
    assert_eq!(bench.iter().map(|r| r["precision"].as_str().unwrap()).collect::<Vec<_>>(), ["bf16", "fp8"]);
    for r in bench {
        assert!(r["ratio"].as_f64().unwrap() > 0.0 && r["measured_over_planned"].as_f64().unwrap() > 0.0, "{r}");
        assert!(r["error"].is_null(), "{r}");
    }
    // Every process it ran is listed with its exit status, and all exited 0.
    let exits = section("exit");
    assert!(exits.len() >= 10, "{exits:?}");
    assert!(exits.iter().all(|r| r["rc"] == 0 && r["status"] == "ok" && r["limit_s"].as_u64() > Some(0)), "{exits:?}");
    // TRACE=1: each bench's traced step ranked (on the CPU: its top-level ops; no phases).
    let traces = section("trace");
    assert_eq!(traces.iter().map(|r| r["precision"].as_str().unwrap()).collect::<Vec<_>>(), ["bf16", "fp8"]);
    for t in &traces {
        let top = t["top"].as_array().unwrap();
        assert!(t["timeline"] == "cpu (top-level ops)" && !top.is_empty() && top.len() <= 15, "{t}");
        assert!(top.iter().any(|k| k["name"].as_str().unwrap().starts_with("aten::")), "{t}");
    }
    let md = std::fs::read_to_string(dir.path().join("report.md")).unwrap();
    assert!(md.contains("## Self-tests") && md.contains("## llora against PyTorch + PEFT"), "{md}");
    assert!(md.contains("## Where one traced step's device time goes"), "{md}");
    assert!(md.contains("## Exit statuses") && md.contains("## Where the step goes"), "{md}");
}

/// `scripts/trace-table.py` ranks a trace's device activities and splits them into the bench's
/// phases at the ends of its device waits; the values below are derived by hand from the
/// timeline: forward 100-150 and 160-200 (busy 90, span 100 from the first activity), backward
/// after the first wait ends at 210: 300-310 and a copy 305-325 (union 25, span 115), optimizer
/// after 330: 400-405 (busy 5, span 75); a kernel after the last wait is its own phase.
#[test]
fn trace_table_ranks_kernels_and_splits_the_phases() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("trace.json");
    let x = |cat: &str, name: &str, ts: u32, dur: u32| serde_json::json!({"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur});
    let events = vec![
        x("kernel", "gemm", 100, 50),
        x("cuda_runtime", "cudaDeviceSynchronize", 150, 60),
        x("kernel", "gemm", 160, 40),
        x("cpu_op", "aten::mm", 90, 200),
        x("kernel", "cast", 300, 10),
        x("gpu_memcpy", "Memcpy DtoH", 305, 20),
        x("cuda_runtime", "cudaDeviceSynchronize", 290, 40),
        x("kernel", "adam", 400, 5),
        x("cuda_runtime", "cudaDeviceSynchronize", 380, 30),
        x("kernel", "late", 500, 1),
    ];
    std::fs::write(&trace, serde_json::json!({ "traceEvents": events }).to_string()).unwrap();
    let out = std::process::Command::new(common::root().join(".venv/bin/python"))
        .arg(common::root().join("scripts/trace-table.py"))
        .args(["--json", "--top", "3"])
        .arg(&trace)
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    let t: serde_json::Value = serde_json::from_str(stdout.trim()).unwrap();
    let close = |v: &serde_json::Value, want: f64| (v.as_f64().unwrap() - want).abs() < 1e-9;
    assert_eq!(t["timeline"], "device");
    assert!(close(&t["busy_ms"], 0.121) && close(&t["sum_ms"], 0.126) && close(&t["wall_ms"], 0.401), "{t}");
    let top = t["top"].as_array().unwrap();
    let names: Vec<&str> = top.iter().map(|k| k["name"].as_str().unwrap()).collect();
    assert_eq!(names, ["gemm", "[gpu_memcpy] Memcpy DtoH", "cast"], "{t}");
    assert!(top[0]["calls"] == 2 && close(&top[0]["ms"], 0.090) && close(&top[0]["share"], 90.0 / 126.0), "{t}");
    let phases = t["phases"].as_array().unwrap();
    let got: Vec<(&str, u64, f64, f64, f64)> = phases
        .iter()
        .map(|p| {
            let ms = |k: &str| (p[k].as_f64().unwrap() * 1e3).round();
            (
                p["phase"].as_str().unwrap(),
                p["kernels"].as_u64().unwrap(),
                ms("busy_ms"),
                ms("span_ms"),
                ms("host_gap_ms"),
            )
        })
        .collect();
    assert_eq!(
        got,
        [
            ("forward", 2, 90.0, 100.0, 10.0),
            ("backward", 2, 25.0, 115.0, 90.0),
            ("optimizer", 1, 5.0, 75.0, 70.0),
            ("after the last wait", 1, 1.0, 91.0, 90.0),
        ],
        "{t}"
    );
    // An unreadable trace is an error naming the file, not a traceback.
    let out = std::process::Command::new(common::root().join(".venv/bin/python"))
        .arg(common::root().join("scripts/trace-table.py"))
        .arg(dir.path().join("absent.json"))
        .output()
        .unwrap();
    let (_, stderr) = text(&out);
    assert!(!out.status.success() && stderr.contains("cannot read") && stderr.contains("absent.json"), "{stderr}");
}

/// gpu-check refuses up front, in one line naming the variable and with exit 2, what it cannot
/// honour: a switch that is not 0 or 1, a limit that is not a whole number of seconds above 0,
/// a shape without its length, a precision it does not run, `TESTS=1` with no test executables
/// (a relative `TEST_BINS` resolved against the caller's folder, as `REPORT_DIR` is), and a
/// `REPORT_DIR` that holds an earlier report (left as it was) or cannot be created.
#[test]
fn gpu_check_refuses_what_it_cannot_honour() {
    let dir = tempfile::tempdir().unwrap();
    let earlier = dir.path().join("earlier");
    std::fs::create_dir_all(earlier.join("work")).unwrap();
    std::fs::write(earlier.join("report.md"), "# the earlier report\n").unwrap();
    std::fs::write(earlier.join("work/p-tiny-128.json"), "{}").unwrap();
    let a_file = dir.path().join("a-file");
    std::fs::write(&a_file, "").unwrap();
    std::fs::create_dir_all(dir.path().join("no-tests")).unwrap();
    let (earlier_s, file_s) = (earlier.to_str().unwrap(), a_file.to_str().unwrap());
    let cases: Vec<(Vec<(&str, &str)>, &str)> = vec![
        (vec![("LIMIT_S", "0")], "LIMIT_S=0: a whole number from 1 to"),
        (vec![("LIMIT_S", "-5")], "LIMIT_S=-5: a whole number"),
        (vec![("LIMIT_S", "5.5")], "LIMIT_S=5.5: a whole number"),
        (vec![("LIMIT_S", "abc")], "LIMIT_S=abc: a whole number"),
        (vec![("L_BENCH", "08x")], "L_BENCH=08x"),
        (vec![("TESTS", "yes")], "TESTS=yes: say 0 or 1"),
        (vec![("PACKING", "yes")], "PACKING=yes: say 0 or 1"),
        (vec![("SHAPES", "tiny")], "SHAPES: 'tiny' is not PRESET:SEQ_LEN"),
        (vec![("PRECISIONS", "fp16")], "'fp16' is not fp32, bf16 or fp8"),
        (vec![("TESTS", "1"), ("TEST_BINS", "no-tests")], "no-tests holds no test executables"),
        (vec![("REPORT_DIR", earlier_s)], "holds an earlier report"),
        (vec![("REPORT_DIR", file_s)], "exists and is not a folder"),
    ];
    for (env, want) in cases {
        let started = std::time::Instant::now();
        let out = std::process::Command::new(common::root().join("scripts/gpu-check.sh"))
            .arg("--cpu")
            .current_dir(dir.path())
            .env("REPORT_DIR", dir.path().join("new-report"))
            .env("LLORA", common::llora_bin())
            .env("PYTHON", common::root().join(".venv/bin/python"))
            .envs(env.iter().copied())
            .output()
            .unwrap();
        let (_, stderr) = text(&out);
        assert_eq!(out.status.code(), Some(2), "{env:?}: {stderr}");
        assert!(stderr.contains(want) && stderr.lines().count() == 1, "{env:?}: {stderr}");
        assert!(started.elapsed().as_secs() < 20, "{env:?} took {:?}", started.elapsed());
        assert!(!dir.path().join("new-report").exists(), "{env:?} wrote a report");
    }
    let earlier_md = std::fs::read_to_string(earlier.join("report.md")).unwrap();
    assert_eq!(earlier_md, "# the earlier report\n", "the earlier report is left as it was");
}

/// gpu-check survives a hang: a self-test part that never exits (a stand-in binary sleeps in
/// `--only gemm`) is killed at its limit (60 s, loose enough for the real parts on a busy
/// 2-core CI machine) and reported as hung with its last log lines, the other parts still
/// run, and the report is written and fails.
#[test]
fn gpu_check_reports_a_hung_process_and_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let hanging = dir.path().join("llora-hangs-in-gemm");
    std::fs::write(
        &hanging,
        format!(
            "#!/bin/sh\ncase \" $* \" in *\" --only gemm \"*) echo 'gemm: about to hang' >&2; exec sleep 600 ;; esac\nexec '{}' \"$@\"\n",
            common::llora_bin().display()
        ),
    )
    .unwrap();
    std::process::Command::new("chmod").arg("+x").arg(&hanging).status().unwrap();
    let report_dir = dir.path().join("report");
    let started = std::time::Instant::now();
    let out = std::process::Command::new(common::root().join("scripts/gpu-check.sh"))
        .arg("--cpu")
        .env("REPORT_DIR", &report_dir)
        .env("LLORA", &hanging)
        .env("PYTHON", common::root().join(".venv/bin/python"))
        .envs([("LIMIT_S", "60"), ("SHAPES", ""), ("PARITY", "0"), ("PACKING", "0")])
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(!out.status.success(), "a hung process fails the report: {stdout}\n{stderr}");
    assert!(started.elapsed().as_secs() < 400, "gpu-check took {:?}", started.elapsed());
    let report: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(report_dir.join("report.json")).unwrap()).unwrap();
    assert_eq!(report["final"], true);
    let rows = report["rows"].as_array().unwrap();
    let hung: Vec<_> = rows.iter().filter(|r| r["status"] == "hung").collect();
    assert_eq!(hung.len(), 1, "{rows:?}");
    assert!(hung[0]["what"].as_str().unwrap().contains("--only gemm") && hung[0]["limit_s"] == 60, "{}", hung[0]);
    assert!(hung[0]["tail"].as_array().unwrap().iter().any(|l| l == "gemm: about to hang"), "{}", hung[0]);
    let parts: Vec<&str> =
        rows.iter().filter(|r| r["section"] == "selftest").map(|r| r["part"].as_str().unwrap()).collect();
    assert_eq!(parts, ["attention", "norm", "dropout", "all-reduce"], "the other parts ran");
    assert!(rows.iter().any(|r| r["section"] == "allreduce"), "{rows:?}");
    let md = std::fs::read_to_string(report_dir.join("report.md")).unwrap();
    assert!(md.contains("**hung**") && md.contains("gemm: about to hang"), "{md}");
}

/// The launch and synchronisation budgets of a training step, held on the CPU so that a new
/// per-layer readback or a cast storm is caught without a GPU: one host-device
/// synchronisation per optimizer step in fp32 and bf16 (loss and gradient norms read together),
/// two in FP8 (plus delayed scaling's amaxes, once), none more with accumulation or recomputed
/// blocks; a bf16 step dispatches at most 1.15x the ops of an fp32 one, an FP8 step 2.6x. The
/// `--trace` of the extra step is a Chrome trace, and an existing trace file is refused.
#[test]
fn step_budgets_of_syncs_and_ops_hold_on_the_cpu() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("trace.json");
    let bench = |extra: &[&str]| -> serde_json::Value {
        let mut args =
            vec!["bench", "--preset", "tiny", "--seq-len", "64", "--threads", "1", "--warmup", "1", "--steps", "1"];
        args.extend(extra);
        let out = llora(&args);
        let (stdout, stderr) = text(&out);
        assert!(out.status.success(), "{extra:?}: {stderr}");
        serde_json::from_str(stdout.lines().last().unwrap()).unwrap()
    };
    let fp32 = bench(&[]);
    let bf16 = bench(&["--precision", "bf16", "--accum", "3", "--trace", trace.to_str().unwrap()]);
    let fp8 = bench(&["--precision", "fp8", "--fp8-weights", "--fp8-activations", "--recompute-layers", "1"]);
    let syncs = |r: &serde_json::Value| r["host_syncs_per_step"].as_u64().unwrap();
    let ops_of = |r: &serde_json::Value| r["ops_per_step"].as_u64().unwrap() as f64;
    assert_eq!(syncs(&fp32), 1, "{fp32}");
    assert_eq!(syncs(&bf16), 1, "three micro-batches, still one read: {bf16}");
    assert!(syncs(&fp8) <= 2, "{fp8}");
    // bf16 ran 3 micro-batches: compare per micro-batch.
    let per_micro = ops_of(&bf16) / 3.0;
    assert!(per_micro <= 1.15 * ops_of(&fp32), "bf16 {per_micro} ops per micro-batch vs fp32 {}", ops_of(&fp32));
    assert!(ops_of(&fp8) <= 2.6 * ops_of(&fp32), "FP8 {} ops vs fp32 {}", ops_of(&fp8), ops_of(&fp32));
    // The phases are timed with recomputed blocks too (the forward to the loss; it read 0.0).
    for r in [&fp32, &bf16, &fp8] {
        let phase = |k: &str| r[k].as_f64().unwrap();
        let (fwd, bwd, opt) = (phase("fwd_s_median"), phase("bwd_s_median"), phase("opt_s_median"));
        assert!(fwd > 0.0 && bwd > 0.0, "{r}");
        assert!(fwd + bwd + opt <= phase("step_s_median") + 3e-4, "phases exceed the step: {r}");
    }
    let events: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&trace).unwrap()).unwrap();
    let names: std::collections::BTreeSet<&str> =
        events["traceEvents"].as_array().unwrap().iter().filter_map(|e| e["name"].as_str()).collect();
    assert!(names.contains("aten::mm") || names.contains("aten::matmul"), "{names:?}");
    let out = llora(&["bench", "--preset", "tiny", "--seq-len", "16", "--trace", trace.to_str().unwrap()]);
    assert!(!out.status.success() && text(&out).1.contains("--trace"), "{}", text(&out).1);
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
