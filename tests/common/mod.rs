//! Helpers shared by the end-to-end tests: the `llora` binary, run as a user would.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

pub mod peer;

/// The repository root.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Path of the `llora` binary of this build profile, built (once per test binary) if stale.
///
/// The binary lives in the `llora-trainer` package, so Cargo does not build it for this
/// package's tests on its own; building through `$CARGO` keeps it in step with the sources.
pub fn llora_bin() -> &'static Path {
    static BIN: OnceLock<PathBuf> = OnceLock::new();
    BIN.get_or_init(|| {
        let exe = std::env::current_exe().expect("test executable path");
        let profile_dir = exe.parent().and_then(Path::parent).expect("target/<profile>/deps/<test>");
        let release = profile_dir.file_name().is_some_and(|n| n == "release");
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut cmd = Command::new(cargo);
        cmd.current_dir(root()).args(["build", "--quiet", "--bin", "llora"]);
        // Cargo sets CARGO_MANIFEST_DIR & co. for tests; some build scripts (ring, under
        // torch-sys) rerun when they change, which would rebuild LibTorch's whole dependent
        // tree. Give the nested build the environment a user's shell has.
        for (key, _) in std::env::vars_os() {
            let key = key.to_string_lossy().into_owned();
            let keep = ["CARGO_HOME", "CARGO_TARGET_DIR"].contains(&key.as_str());
            if (key.starts_with("CARGO_") && !keep) || key == "OUT_DIR" || key == "LD_LIBRARY_PATH" {
                cmd.env_remove(&key);
            }
        }
        if release {
            cmd.arg("--release");
        }
        let status = cmd.status().expect("run cargo build");
        assert!(status.success(), "cargo build --bin llora failed");
        let bin = profile_dir.join("llora");
        assert!(bin.is_file(), "{} was not built", bin.display());
        bin
    })
}

/// Runs `llora ARGS` in `dir` with a clean environment (no LD_LIBRARY_PATH, no LIBTORCH).
///
/// Tests run several llora processes at once on a 2-core machine. LibTorch's OpenMP threads
/// spin at every barrier, and with more threads than cores a run of tiny ops slows down by
/// orders of magnitude (seen: 2 steps not done after 6 minutes), so training commands get one
/// intra-op thread and OpenMP is told to sleep rather than spin.
pub fn llora_in(dir: &Path, args: &[&str]) -> Output {
    llora_command(dir, args).output().expect("run llora")
}

/// The `llora ARGS` command of [`llora_in`], not yet started (for tests that signal it).
pub fn llora_command(dir: &Path, args: &[&str]) -> Command {
    let mut args: Vec<&str> = args.to_vec();
    if args.first() == Some(&"train") || args.starts_with(&["mlperf", "run"]) {
        args.extend(["--set", "run.threads=1"]);
    }
    if args.first() == Some(&"eval") {
        args.extend(["--threads", "1"]);
    }
    let mut cmd = Command::new(llora_bin());
    cmd.args(&args)
        .current_dir(dir)
        .env_clear()
        .env("PATH", "/usr/bin:/bin")
        .env("HOME", std::env::var("HOME").unwrap_or_default())
        .env("OMP_WAIT_POLICY", "PASSIVE");
    cmd
}

/// Runs `llora ARGS` from the repository root.
pub fn llora(args: &[&str]) -> Output {
    llora_in(&root(), args)
}

/// stdout and stderr as text, for assertion messages.
pub fn text(out: &Output) -> (String, String) {
    (String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned())
}

/// The embedded tiny config without its pre-trained base (no `model.path`, no
/// `[model.pretrain]`): a random `demo` model, so short tests neither pre-train nor depend on a
/// base left in the working tree by an earlier run. Written into `dir`; returns its path.
pub fn random_base_config(dir: &Path) -> String {
    let text = std::fs::read_to_string(root().join("configs/tiny-cpu.toml")).unwrap();
    let mut config: toml::Table = toml::from_str(&text).unwrap();
    let model = config.get_mut("model").unwrap().as_table_mut().unwrap();
    model.remove("path");
    model.remove("pretrain");
    let path = dir.join("random-base.toml");
    std::fs::write(&path, toml::to_string(&config).unwrap()).unwrap();
    path.display().to_string()
}

/// Every `:::MLLOG` record of a result log.
pub fn mllog(path: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
        .lines()
        .filter_map(|l| l.strip_prefix(":::MLLOG "))
        .map(|j| serde_json::from_str(j).expect("every MLLOG line is JSON"))
        .collect()
}

/// The newest complete checkpoint directory of a run (`resume/step-N` with its manifest).
pub fn newest_checkpoint(run_dir: &Path) -> Option<std::path::PathBuf> {
    let mut dirs: Vec<_> = std::fs::read_dir(run_dir.join("resume"))
        .ok()?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.file_name().unwrap().to_string_lossy().starts_with("step-") && p.join("manifest.json").is_file())
        .collect();
    dirs.sort();
    dirs.pop()
}

/// The step of the newest complete checkpoint of a run, read from its `state.json`.
pub fn checkpoint_step(run_dir: &Path) -> Option<u64> {
    let text = std::fs::read_to_string(newest_checkpoint(run_dir)?.join("state.json")).ok()?;
    serde_json::from_str::<serde_json::Value>(&text).ok()?["progress"]["step"].as_u64()
}

/// `llora mlperf check LOG`: the official MLPerf compliance checker's verdict and what it printed.
pub fn mlperf_check(log: &Path) -> (bool, String) {
    let out = llora(&["mlperf", "check", log.to_str().expect("utf-8 path")]);
    let (stdout, stderr) = text(&out);
    (out.status.success(), format!("{stdout}\n{stderr}"))
}

/// A short LoRA run on the random base: 12 steps of 8, an evaluation every 32 samples, a
/// target it cannot reach (so it runs to max_steps).
pub fn short_run_args(config: &str, run_dir: &std::path::Path) -> Vec<String> {
    train_args(
        config,
        [
            format!("run.dir=\"{}\"", run_dir.display()),
            "schedule.max_steps=12".into(),
            "eval.every_samples=32".into(),
            "eval.target_loss=0.001".into(),
            "data.synthetic.train_samples=64".into(),
            "data.synthetic.eval_samples=4".into(),
            "data.max_seq_len=128".into(),
        ],
    )
}

/// `llora train CONFIG` with each of `sets` as a `--set KEY=VALUE` override, in order.
pub fn train_args(config: &str, sets: impl IntoIterator<Item = String>) -> Vec<String> {
    let mut args: Vec<String> = vec!["train".into(), config.into()];
    for set in sets {
        args.extend(["--set".into(), set]);
    }
    args
}

/// Owned arguments as the `&str`s the helpers take.
pub fn strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// Starts `llora ARGS` (a training run into `run_dir`), sends it `signal` (`"TERM"`, `"INT"`)
/// once its metrics show two steps, and returns how it ended.
pub fn signal_after_two_steps(args: &[String], run_dir: &Path, signal: &str) -> Output {
    signals_after_two_steps(args, run_dir, signal, 1)
}

/// [`signal_after_two_steps`] with the signal sent `times` times in a row (as `timeout` and
/// launchers do: the child, then its group), each after llora acknowledged the one before:
/// two signals sent back to back may reach the process as one (a pending signal is not
/// queued twice), which would test the kernel's timing, not llora.
pub fn signals_after_two_steps(args: &[String], run_dir: &Path, signal: &str, times: usize) -> Output {
    signals(args, run_dir, signal, &vec![std::time::Duration::ZERO; times.saturating_sub(1)], true)
}

/// Starts `llora ARGS`, sends `signal` once its metrics show two steps and again after each
/// of `gaps` (so that a later one lands in the step, the checkpoint write or the exit), and
/// returns how it ended.
pub fn signals_after_steps(args: &[String], run_dir: &Path, signal: &str, gaps: &[std::time::Duration]) -> Output {
    signals(args, run_dir, signal, gaps, false)
}

/// The lines llora writes to stderr when a signal reaches it (`llora: SIGTERM: stopping ...`,
/// `llora: signal again ...`, `llora: signal a third time ...`).
fn acknowledged(stderr: &[u8]) -> usize {
    String::from_utf8_lossy(stderr)
        .lines()
        .filter(|l| l.starts_with("llora: SIG") || l.starts_with("llora: signal"))
        .count()
}

fn signals(args: &[String], run_dir: &Path, signal: &str, gaps: &[std::time::Duration], acks: bool) -> Output {
    use std::io::Read;
    let mut child = llora_command(&root(), &strs(args)).stderr(std::process::Stdio::piped()).spawn().unwrap();
    // stderr read as it comes, so that each signal can wait for the one before to be seen.
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut pipe = child.stderr.take().unwrap();
    let reader = {
        let seen = seen.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n) = pipe.read(&mut buf) {
                if n == 0 {
                    break;
                }
                seen.lock().unwrap().extend_from_slice(&buf[..n]);
            }
        })
    };
    let started = std::time::Instant::now();
    while !std::fs::read_to_string(run_dir.join("metrics.jsonl")).is_ok_and(|m| m.lines().count() >= 2) {
        assert!(started.elapsed().as_secs() < 300, "no step after 5 minutes");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    let pid = child.id().to_string();
    for (sent, gap) in std::iter::once(&std::time::Duration::ZERO).chain(gaps).enumerate() {
        std::thread::sleep(*gap);
        let waited = std::time::Instant::now();
        while acks && acknowledged(&seen.lock().unwrap()) < sent && child.try_wait().unwrap().is_none() {
            assert!(waited.elapsed().as_secs() < 60, "llora did not acknowledge signal {sent} within 60 s");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        // The process may be gone by a later signal: that is one way for it to end.
        let _ = Command::new("kill").args([&format!("-{signal}"), &pid]).stderr(std::process::Stdio::null()).status();
    }
    let status = child.wait().unwrap();
    reader.join().unwrap();
    let stderr = std::mem::take(&mut *seen.lock().unwrap());
    let mut stdout = Vec::new();
    if let Some(mut out) = child.stdout.take() {
        let _ = out.read_to_end(&mut stdout);
    }
    Output { status, stdout, stderr }
}

/// An HF checkpoint of a tiny family preset (`tiny-qwen2`, `tiny-qwen3`, `tiny-mistral`, `demo`)
/// in `dir`, whose frozen tensors a preset's random init leaves at 0 or 1 are not: every bias
/// U(-0.3, 0.3) (Qwen 3 gets `attention_bias`), every norm gain U(0.5, 1.5). Sharded, recomputed
/// and distributed runs must carry each of them: a path that dropped one would still match a
/// zero bias or a unit gain.
pub fn family_base_away_from_0_and_1(dir: &Path, preset: &str) -> PathBuf {
    #![allow(deprecated)] // Device::libtorch: burn-tch is deprecated upstream, and it is our backend.
    use rand::{Rng, SeedableRng};
    let mut config = llora_model::LlamaConfig::preset(preset).unwrap();
    if config.family.model_type == llora_model::ModelType::Qwen3 {
        (config.family.qkv_bias, config.family.o_bias) = (true, true);
    }
    let device = burn::tensor::Device::libtorch();
    let opts = llora_model::BuildOptions::default();
    let mut model = llora_model::LlamaForCausalLM::random(&config, &opts, &device).unwrap();
    let base = dir.join(format!("{preset}-base"));
    llora_model::checkpoint::save_hf_checkpoint(&mut model, &base).unwrap();
    let file = base.join("model.safetensors");
    let mut tensors = llora_model::checkpoint::read_safetensors_f32(&file).unwrap();
    let mut rng = rand::rngs::StdRng::seed_from_u64(7);
    let (mut biases, mut gains) = (0, 0);
    for (name, (_, values)) in tensors.iter_mut() {
        if name.ends_with(".bias") {
            biases += 1;
            values.iter_mut().for_each(|v| *v = 0.6 * rng.random::<f32>() - 0.3);
        } else if name.ends_with("norm.weight") {
            gains += 1;
            values.iter_mut().for_each(|v| *v = 0.5 + rng.random::<f32>());
        }
    }
    let has_bias = config.family.qkv_bias;
    assert!(gains > 0 && (biases > 0) == has_bias, "{preset}: {biases} biases, {gains} gains");
    let list: Vec<_> = tensors.into_iter().map(|(n, (s, v))| (n, s, v)).collect();
    std::fs::write(&file, llora_model::checkpoint::safetensors_bytes(&list).unwrap()).unwrap();
    base
}

/// Mistral's v3 chat templates' rule (7B Instruct v0.3, Nemo 2407), written here: after an
/// optional system message roles alternate, and the system message goes into the *last* user
/// turn only (a training conversation, which ends with the assistant, loses it).
pub const MISTRAL_V3_STYLE: &str = "{%- if messages[0]['role'] == 'system' %}{%- set system_message = messages[0]['content'] %}\
{%- set loop_messages = messages[1:] %}{%- else %}{%- set loop_messages = messages %}{%- endif %}{{- bos_token }}\
{%- for message in loop_messages %}{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}\
{{- raise_exception('After the optional system message, conversation roles must alternate user/assistant/user/assistant/...') }}\
{%- endif %}{%- if message['role'] == 'user' %}{%- if loop.last and system_message is defined %}\
{{- '[INST] ' + system_message + '\\n\\n' + message['content'] + '[/INST]' }}{%- else %}\
{{- '[INST] ' + message['content'] + '[/INST]' }}{%- endif %}{%- elif message['role'] == 'assistant' %}\
{{- ' ' + message['content'] | trim + eos_token }}{%- endif %}{%- endfor %}";

/// TRL's copies of models' own chat templates in the project venv (`trl/chat_templates`,
/// installed by `scripts/setup.sh --parity`).
pub fn trl_chat_templates() -> PathBuf {
    let lib = root().join(".venv/lib");
    let python = std::fs::read_dir(&lib)
        .unwrap_or_else(|e| panic!("{}: {e}: run ./scripts/setup.sh --parity", lib.display()))
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("python3")))
        .expect("the venv's python3.X directory");
    let dir = python.join("site-packages/trl/chat_templates");
    assert!(dir.is_dir(), "{} missing: run ./scripts/setup.sh --parity", dir.display());
    dir
}
