//! The synthetic corpus as Llama-3-style conversations, for the chat end-to-end on a CPU.
//!
//! Each document becomes one conversation: the user asks `Summarize the following text:
//! <report>`, the assistant answers `<summary>`. The tokenizer is the corpus's word-level one
//! (ids below `vocab`, [`crate::synth::tokenizer_vocab`]) with Llama 3's special tokens after
//! it, in Llama 3.1's order and offsets (`<|begin_of_text|>` at `vocab` as at 128000,
//! `<|eot_id|>` at `vocab + 9` as at 128009, ...), and its `tokenizer_config.json` carries
//! Llama 3 Instruct's chat template. So `llora data prepare --format chat` renders and labels
//! these conversations exactly as it does a real Llama 3's, with a 528-token model instead of
//! a 128,256-token one.

use serde_json::json;
use tokenizers::{AddedToken, Tokenizer};

use crate::synth::Document;

/// Special tokens after the word vocabulary (Llama 3 reserves 256; 16 hold the named ones).
pub const SPECIAL_TOKENS: usize = 16;

/// Llama 3.1's named special tokens by offset from the first (128000); the rest are
/// `<|reserved_special_token_N|>` as there.
const NAMED: [(usize, &str); 8] = [
    (0, "<|begin_of_text|>"),
    (1, "<|end_of_text|>"),
    (4, "<|finetune_right_pad_id|>"),
    (6, "<|start_header_id|>"),
    (7, "<|end_header_id|>"),
    (8, "<|eom_id|>"),
    (9, "<|eot_id|>"),
    (10, "<|python_tag|>"),
];

/// Offset of `<|begin_of_text|>`.
pub const BEGIN_OF_TEXT: usize = 0;
/// Offsets of the end-of-text ids Llama 3.1's `config.json` lists (`eos_token_id`).
pub const EOS_OFFSETS: [usize; 3] = [1, 8, 9];

/// Llama 3 Instruct's chat template: each turn is `<|start_header_id|>ROLE<|end_header_id|>`,
/// a blank line, the trimmed content and `<|eot_id|>`; `<|begin_of_text|>` opens the first.
pub const LLAMA3_CHAT_TEMPLATE: &str = "{% set loop_messages = messages %}{% for message in loop_messages %}\
{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' %}\
{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}\
{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}";

/// The special tokens' names, in id order from `vocab`.
pub fn special_token_names() -> Vec<String> {
    let mut reserved = 0;
    (0..SPECIAL_TOKENS)
        .map(|k| match NAMED.iter().find(|(o, _)| *o == k) {
            Some((_, name)) => name.to_string(),
            None => {
                reserved += 1;
                format!("<|reserved_special_token_{}|>", reserved - 1)
            }
        })
        .collect()
}

/// The word-level tokenizer of a `vocab`-word corpus with Llama 3's special tokens at
/// `vocab..vocab + SPECIAL_TOKENS` (a model for it needs that many embeddings).
pub fn tokenizer(vocab: usize) -> anyhow::Result<Tokenizer> {
    use tokenizers::models::wordlevel::WordLevel;
    use tokenizers::pre_tokenizers::whitespace::WhitespaceSplit;
    let specials = special_token_names();
    let words = crate::synth::tokenizer_vocab(vocab)
        .into_iter()
        .chain(specials.iter().enumerate().map(|(k, name)| (name.clone(), (vocab + k) as u32)));
    let model = WordLevel::builder()
        .vocab(words.collect())
        .unk_token("<unk>".into())
        .build()
        .map_err(|e| anyhow::anyhow!("building the word-level tokenizer: {e}"))?;
    let mut tok = Tokenizer::new(model);
    tok.with_pre_tokenizer(Some(WhitespaceSplit));
    let added: Vec<AddedToken> = specials.iter().map(|t| AddedToken::from(t.as_str(), true)).collect();
    tok.add_special_tokens(&added);
    Ok(tok)
}

/// `tokenizer_config.json` for [`tokenizer`]: Llama 3 Instruct's tokens and chat template.
pub fn tokenizer_config() -> serde_json::Value {
    let names = special_token_names();
    json!({
        "bos_token": names[BEGIN_OF_TEXT],
        "eos_token": "<|eot_id|>",
        "chat_template": LLAMA3_CHAT_TEMPLATE,
        "model_max_length": 131072,
        "tokenizer_class": "PreTrainedTokenizerFast",
    })
}

/// One document as a conversation row (`{"messages": [...]}`).
pub fn conversation(doc: &Document) -> serde_json::Value {
    let (report, summary) = doc.text();
    json!({"messages": [
        {"role": "user", "content": format!("Summarize the following text: {report}")},
        {"role": "assistant", "content": summary},
    ]})
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::chat::{ChatTemplate, chat_sample, parse_messages};
    use crate::synth::{EOS, Synth, SynthConfig};

    /// The conversation renders and labels as a Llama 3 conversation: the hand-written token
    /// sequence of the template, labels on the answer and `<|eot_id|>` only, and the answer's
    /// tokens are the MLPerf sample's summary tokens.
    #[test]
    fn a_document_as_a_conversation_is_llama3_shaped() {
        let vocab = 512;
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("tokenizer_config.json"), tokenizer_config().to_string()).unwrap();
        let template = ChatTemplate::from_tokenizer_dir(dir.path()).unwrap();
        let tok = tokenizer(vocab).unwrap();
        let synth = Synth::new(SynthConfig { vocab, max_seq_len: 256, ..Default::default() }).unwrap();
        let doc = &synth.documents(1, 1)[0];
        let messages = parse_messages(&conversation(doc)).unwrap();
        let sample = chat_sample(&tok, &template, &messages).unwrap();
        let id = |t: &str| tok.token_to_id(t).unwrap();
        let (bot, sh, eh, eot) =
            (id("<|begin_of_text|>"), id("<|start_header_id|>"), id("<|end_header_id|>"), id("<|eot_id|>"));
        assert_eq!((bot, eot), (512, 521), "Llama 3.1's offsets (128000, 128009)");
        let mut expected = vec![bot, sh, id("user"), eh, id("Summarize"), id("the"), id("following"), id("text:")];
        expected.extend(&doc.report);
        expected.extend([eot, sh, id("assistant"), eh]);
        let answer_at = expected.len();
        expected.extend(&doc.summary);
        expected.push(eot);
        assert_eq!(sample.input_ids, expected);
        let labelled: Vec<u32> = sample.labels.iter().filter(|&&l| l >= 0).map(|&l| l as u32).collect();
        assert_eq!(labelled, expected[answer_at..]);
        // The same answer as the MLPerf sample's labels, with <|eot_id|> for </s>.
        let mlperf: Vec<u32> = doc.sample().labels.iter().filter(|&&l| l >= 0).map(|&l| l as u32).collect();
        assert_eq!(&mlperf[..mlperf.len() - 1], &labelled[..labelled.len() - 1]);
        assert_eq!(*mlperf.last().unwrap(), EOS);
        // Decoding the answer gives its text.
        assert_eq!(tok.decode(&labelled, true).unwrap(), doc.text().1);
    }

    #[test]
    fn special_tokens_follow_llama_3_1() {
        let names = special_token_names();
        assert_eq!(names.len(), SPECIAL_TOKENS);
        assert_eq!(names[2], "<|reserved_special_token_0|>");
        assert_eq!(names[5], "<|reserved_special_token_2|>");
        assert_eq!(names[11], "<|reserved_special_token_3|>");
        assert_eq!(EOS_OFFSETS.map(|o| names[o].as_str()), ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]);
    }
}
