//! `scripts/gpu-check.sh` and its tools on the CPU: the whole report in `--cpu` mode, refusals of
//! what it cannot honour, a hung process reported while the check goes on, and the Kineto
//! trace table.

use crate::common;
use common::text;

/// `scripts/gpu-check.sh --cpu` runs the whole report path on the CPU (what a GPU node runs, on
/// small shapes): the self-tests pass, the all-reduce spans two Gloo ranks, llora's eval loss
/// agrees with HF + PEFT's (fp32 and bf16), and llora and the PyTorch + PEFT peer both ran each
/// precision's bench, with the plan beside the measured peak.
#[test]
#[cfg_attr(not(has_peer), ignore = "needs the peer venv: ./scripts/setup.sh --parity")]
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
    assert_eq!(parts, ["gemm", "attention", "norm", "rope", "optimizer", "dropout", "all-reduce"], "{report}");
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
    let optimizer = selftest.iter().find(|r| r["part"] == "optimizer").unwrap();
    let skipped = optimizer["skipped"].as_array().unwrap();
    assert!(
        skipped.iter().any(|c| c["name"] == "optimizer: fused AdamW Float (one multi-tensor launch)"),
        "{optimizer}"
    );
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
    // And where each traced step's copies come from.
    for precision in ["bf16", "fp8"] {
        let copies = dir.path().join(format!("copies-tiny-128-{precision}.md"));
        let copies = std::fs::read_to_string(&copies).unwrap_or_else(|e| panic!("{}: {e}", copies.display()));
        assert!(copies.contains("| **all** |"), "{copies}");
    }
    let md = std::fs::read_to_string(dir.path().join("report.md")).unwrap();
    assert!(md.contains("## Self-tests") && md.contains("## llora against PyTorch + PEFT"), "{md}");
    assert!(md.contains("## Where one traced step's device time goes"), "{md}");
    assert!(md.contains("## Exit statuses") && md.contains("## Where the step goes"), "{md}");
}

/// `scripts/copies.py` classes each `aten::copy_` by the ops around it, by hand: a cast under
/// `aten::to` (f32 → bf16, 4 x 8 = 64 B), a transpose made contiguous (a layout fix, 2 x 3 f32 =
/// 24 B, its source's strides a transpose's), two copies llora asked for itself (no aten op
/// around them, bf16, 10 B each) and a copy on another thread, not inside the `aten::to` that
/// spans its time there.
#[test]
fn copies_py_classes_each_copy_by_what_asked_for_it() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("trace.json");
    let op = |name: &str, tid: u32, ts: u32, dur: u32, args: serde_json::Value| serde_json::json!({"ph": "X", "cat": "cpu_op", "name": name, "tid": tid, "ts": ts, "dur": dur, "args": args});
    let copy = |tid: u32, ts: u32, types: [&str; 2], dims: serde_json::Value, strides: serde_json::Value| {
        let args = serde_json::json!({"Input type": [types[0], types[1], "Scalar"], "Input Dims": dims, "Input Strides": strides});
        op("aten::copy_", tid, ts, 2, args)
    };
    let none = serde_json::json!({});
    let events = vec![
        op("aten::to", 1, 0, 10, none.clone()),
        op("aten::_to_copy", 1, 1, 8, none.clone()),
        copy(
            1,
            2,
            ["c10::BFloat16", "float"],
            serde_json::json!([[4, 8], [4, 8], []]),
            serde_json::json!([[8, 1], [8, 1], []]),
        ),
        op("aten::contiguous", 1, 20, 10, none.clone()),
        op("aten::clone", 1, 21, 8, none.clone()),
        copy(
            1,
            22,
            ["float", "float"],
            serde_json::json!([[2, 3], [2, 3], []]),
            serde_json::json!([[3, 1], [1, 2], []]),
        ),
        copy(
            1,
            40,
            ["c10::BFloat16", "c10::BFloat16"],
            serde_json::json!([[5], [5], []]),
            serde_json::json!([[1], [1], []]),
        ),
        copy(
            2,
            4,
            ["c10::BFloat16", "c10::BFloat16"],
            serde_json::json!([[5], [5], []]),
            serde_json::json!([[1], [1], []]),
        ),
    ];
    std::fs::write(&trace, serde_json::json!({ "traceEvents": events }).to_string()).unwrap();
    let out = std::process::Command::new(common::root().join(".venv/bin/python"))
        .arg(common::root().join("scripts/copies.py"))
        .arg(&trace)
        .output()
        .unwrap();
    let (stdout, stderr) = text(&out);
    assert!(out.status.success(), "{stderr}");
    for row in ["| cast | 1 | 64 |", "| layout | 1 | 24 |", "| own copy | 2 | 20 |", "| **all** | **4** | **108** |"] {
        assert!(stdout.contains(row), "no {row:?} in\n{stdout}");
    }
    assert!(stdout.contains("| cast | `aten::to` | [4, 8] | 1 |"), "{stdout}");
    assert!(stdout.contains("| layout | `aten::contiguous` | [2, 3] | 1 |"), "{stdout}");
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
#[cfg_attr(not(has_peer), ignore = "needs the peer venv: ./scripts/setup.sh --parity")]
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
    assert_eq!(parts, ["attention", "norm", "rope", "optimizer", "dropout", "all-reduce"], "the other parts ran");
    assert!(rows.iter().any(|r| r["section"] == "allreduce"), "{rows:?}");
    let md = std::fs::read_to_string(report_dir.join("report.md")).unwrap();
    assert!(md.contains("**hung**") && md.contains("gemm: about to hang"), "{md}");
}
