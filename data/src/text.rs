//! The raw-text path: SCROLLS GovReport report/summary pairs, tokenised with an HF
//! `tokenizer.json` into MLPerf samples.
//!
//! The MLPerf reference (mlcommons/training, `llama2_70b_lora/scripts/utils.py`,
//! `create_datasets`) tokenises `### Summarize the following text:\n {input}\n ### Summary:\n
//! {output}{eos}` with Llama 2's tokenizer (`<s>` first) and masks the labels of as many tokens
//! as `<s>` + `### Summarize the following text:\n {input}\n ### Summary:\n` has. Here the
//! prompt (that text) and the summary (`{output}</s>`) are tokenised separately, so the
//! prompt/label boundary is exact by construction: `<s>`, the prompt's tokens (labels -100),
//! the summary's tokens and `</s>` (labelled). With Llama 2's tokenizer this is token for token
//! the reference's single encoding: its normaliser prepends the `▁` that the template's space
//! after `Summary:\n` becomes, and no merge crosses the newline (`tests/it/tokenizer.rs` checks
//! both against the tokenizer's own JS encoder). Samples longer than `max_seq_len` are dropped
//! and counted, as the reference's `filter_function` drops them.

use std::path::Path;

use anyhow::{Context, ensure};
use tokenizers::Tokenizer;

use crate::{IGNORE_INDEX, Sample};

/// One SCROLLS row: the report (`input`) and its summary (`output`).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct TextPair {
    /// The report.
    pub input: String,
    /// The summary.
    pub output: String,
}

/// The prompt part of the template around a report (the space before the summary is the
/// summary's own leading `▁`, see the module documentation).
pub fn prompt_text(input: &str) -> String {
    format!("### Summarize the following text:\n {input}\n ### Summary:\n")
}

/// The labelled part of the template: the summary and the end-of-sequence token (`</s>` for
/// Llama 2, `<|end_of_text|>` for Llama 3), which the tokenizer reads as that token.
pub fn target_text(output: &str, eos: &str) -> String {
    format!("{output}{eos}")
}

/// Report/summary pairs of a `.jsonl` file (one `{"input": .., "output": ..}` per line) or a
/// parquet / Arrow IPC file with string columns `input` and `output` (other columns ignored),
/// and how many rows were over `max_bytes` (not read: too long for any sample).
pub fn read_pairs(path: &Path, max_bytes: Option<usize>) -> anyhow::Result<(Vec<TextPair>, usize)> {
    let (mut pairs, mut too_long) = (Vec::new(), 0);
    for row in crate::rows::read_rows(path, max_bytes)? {
        let Some(value) = row.value else {
            too_long += 1;
            continue;
        };
        pairs.push(serde_json::from_value::<TextPair>(value).with_context(|| {
            format!("{}: {}: expected string fields \"input\" and \"output\"", path.display(), row.place)
        })?);
    }
    Ok((pairs, too_long))
}

/// What [`tokenize_pairs`] produced.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tokenized {
    /// Samples in input order, over-long ones removed.
    pub samples: Vec<Sample>,
    /// Indices (in the input) of the samples dropped for length.
    pub dropped: Vec<usize>,
}

/// Pairs tokenised per batch: bounds memory (an `Encoding` keeps strings and offsets of every
/// token, ~50 bytes each; all of GovReport at once would be ~10 GB) while each batch still
/// spreads over every core.
const ENCODE_CHUNK: usize = 256;

/// Tokenises pairs with the MLPerf template (in parallel, through the tokenizers crate's
/// batch encoding), the tokenizer's beginning-of-sequence token first (`<s>`, or Llama 3's
/// `<|begin_of_text|>`), prompt labels -100; drops samples over `max_seq_len`.
pub fn tokenize_pairs(tokenizer: &Tokenizer, pairs: &[TextPair], max_seq_len: usize) -> anyhow::Result<Tokenized> {
    let (bos, eos) = crate::tokenizer::special_ids(tokenizer)?;
    let eos = tokenizer.id_to_token(eos).context("the end-of-sequence id has no token")?;
    let enc = |texts: Vec<String>| tokenizer.encode_batch(texts, false).map_err(|e| anyhow::anyhow!("tokenising: {e}"));
    let mut out = Tokenized { samples: Vec::with_capacity(pairs.len()), dropped: Vec::new() };
    for (c, chunk) in pairs.chunks(ENCODE_CHUNK).enumerate() {
        let prompts = enc(chunk.iter().map(|p| prompt_text(&p.input)).collect())?;
        let targets = enc(chunk.iter().map(|p| target_text(&p.output, &eos)).collect())?;
        for (k, (p, t)) in prompts.iter().zip(&targets).enumerate() {
            let i = c * ENCODE_CHUNK + k;
            let n = 1 + p.get_ids().len() + t.get_ids().len();
            if n > max_seq_len {
                out.dropped.push(i);
                continue;
            }
            ensure!(!t.get_ids().is_empty(), "pair {i}: the summary tokenises to nothing");
            let mut ids = Vec::with_capacity(n);
            ids.push(bos);
            ids.extend_from_slice(p.get_ids());
            let prompt_len = ids.len();
            ids.extend_from_slice(t.get_ids());
            let labels =
                ids.iter().enumerate().map(|(j, &id)| if j < prompt_len { IGNORE_INDEX } else { id as i64 }).collect();
            out.samples.push(Sample { input_ids: ids, labels });
        }
    }
    Ok(out)
}

/// A word-level `tokenizer.json` for the synthetic corpus (whitespace split, `<s>`, `</s>`,
/// `<unk>` as special tokens), built and serialised by the tokenizers crate.
pub fn synthetic_tokenizer(vocab: usize) -> anyhow::Result<Tokenizer> {
    use tokenizers::models::wordlevel::WordLevel;
    use tokenizers::pre_tokenizers::whitespace::WhitespaceSplit;
    let words = crate::synth::tokenizer_vocab(vocab);
    let model = WordLevel::builder()
        .vocab(words.into_iter().collect())
        .unk_token("<unk>".into())
        .build()
        .map_err(|e| anyhow::anyhow!("building the word-level tokenizer: {e}"))?;
    let mut tok = Tokenizer::new(model);
    tok.with_pre_tokenizer(Some(WhitespaceSplit));
    tok.add_special_tokens(&["<unk>", "<s>", "</s>"].map(|t| tokenizers::AddedToken::from(t, true)));
    Ok(tok)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::synth::{Synth, SynthConfig};

    /// The raw path reproduces the token-level corpus exactly: text → tokenizer → samples.
    #[test]
    fn synthetic_text_tokenises_to_the_synthetic_samples() {
        let synth = Synth::new(SynthConfig { vocab: 2048, max_seq_len: 600, ..Default::default() }).unwrap();
        let docs = synth.documents(0, 40);
        let pairs: Vec<TextPair> =
            docs.iter().map(|d| d.text()).map(|(input, output)| TextPair { input, output }).collect();
        let tok = synthetic_tokenizer(2048).unwrap();
        let got = tokenize_pairs(&tok, &pairs, 600).unwrap();
        assert!(got.dropped.is_empty());
        assert_eq!(got.samples, synth.samples(0, 40));
        // A tighter limit drops the long ones and says which.
        let short = tokenize_pairs(&tok, &pairs, 300).unwrap();
        let expected: Vec<usize> =
            synth.samples(0, 40).iter().enumerate().filter(|(_, s)| s.input_ids.len() > 300).map(|(i, _)| i).collect();
        assert_eq!(short.dropped, expected);
        assert!(!expected.is_empty());
    }

    #[test]
    fn template_boundaries_are_hand_checkable() {
        let tok = synthetic_tokenizer(64).unwrap();
        let pairs = [TextPair { input: "kaka loka".into(), output: "mika".into() }];
        let s = &tokenize_pairs(&tok, &pairs, 64).unwrap().samples[0];
        // <s> ### Summarize the following text: kaka loka ### Summary: mika </s>
        assert_eq!(s.input_ids, vec![1, 3, 4, 5, 6, 7, 16, 17, 3, 8, 18, 2]);
        assert_eq!(s.labels, vec![-100, -100, -100, -100, -100, -100, -100, -100, -100, -100, 18, 2]);
    }

    #[test]
    fn bad_jsonl_names_the_line() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("raw.jsonl");
        std::fs::write(&p, "{\"input\": \"a\", \"output\": \"b\"}\n\n{\"input\": \"a\"}\n").unwrap();
        let err = format!("{:#}", read_pairs(&p, None).unwrap_err());
        assert!(err.contains("raw.jsonl: line 3") && err.contains("output"), "{err}");
    }
}
