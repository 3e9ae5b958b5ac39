//! The tokenizer and what llora asks of it: loading an HF `tokenizer.json`, its begin/end of
//! sequence ids, a copy that reads special-token spellings as text, and how many bytes a row of
//! at most N tokens can take.

use std::path::Path;

use anyhow::Context;
use tokenizers::Tokenizer;
use tokenizers::models::ModelWrapper;

/// Loads a `tokenizer.json`, or the one in an HF tokenizer directory, naming the file on failure.
pub fn load_tokenizer(path: &Path) -> anyhow::Result<Tokenizer> {
    let file = if path.is_dir() { path.join("tokenizer.json") } else { path.to_path_buf() };
    Tokenizer::from_file(&file).map_err(|e| anyhow::anyhow!("{}: not a usable tokenizer.json: {e}", file.display()))
}

/// `tokenizer` reading all text as plain text: a string that spells a special token
/// (`<|eot_id|>`) is encoded as its characters, not as that token.
pub fn plain(tokenizer: &Tokenizer) -> Tokenizer {
    let mut t = tokenizer.clone();
    t.set_encode_special_tokens(true);
    t
}

/// The tokenizer's beginning- and end-of-sequence ids (Llama 3's `<|begin_of_text|>` and
/// `<|end_of_text|>`, Llama 2's `<s>` and `</s>`).
pub fn special_ids(tokenizer: &Tokenizer) -> anyhow::Result<(u32, u32)> {
    let bos = bos_id(tokenizer).context("the tokenizer has no <|begin_of_text|> or <s> token")?;
    Ok((bos, end_of_text_id(tokenizer)?))
}

/// The tokenizer's beginning-of-sequence id, if it has one (Qwen's has none).
pub fn bos_id(tokenizer: &Tokenizer) -> Option<u32> {
    ["<|begin_of_text|>", "<s>"].iter().find_map(|n| tokenizer.token_to_id(n))
}

/// The tokenizer's end-of-text id: Llama 3's `<|end_of_text|>`, Llama 2's and Mistral's `</s>`,
/// Qwen's `<|endoftext|>` (Qwen has no beginning-of-sequence token).
pub fn end_of_text_id(tokenizer: &Tokenizer) -> anyhow::Result<u32> {
    let names = ["<|end_of_text|>", "</s>", "<|endoftext|>"];
    names
        .iter()
        .find_map(|n| tokenizer.token_to_id(n))
        .context("the tokenizer has no <|end_of_text|>, </s> or <|endoftext|> token")
}

/// Bytes a token is taken to stand for at most where the model itself sets no bound: a whole
/// unknown word of a word-level model, or a fused run of unknown characters, is one token
/// however long; text with "words" longer than this is not language a model of that kind reads.
pub const UNBOUNDED_TOKEN_BYTES: usize = 256;

/// The byte length past which a row surely tokenises to more than `max_tokens` tokens.
///
/// A BPE token stands for at most as many bytes as its vocabulary entry is long (a byte-level
/// entry spells each byte with one or two; a SentencePiece `▁` stands for a 1-byte space), and
/// an unknown character is one token unless unknowns are fused. Word-level, WordPiece and
/// Unigram models, and BPE with fused unknowns, can map any length to one token: for them a
/// token counts as [`UNBOUNDED_TOKEN_BYTES`]. A row's JSON can be up to 6 times its text
/// (`\uXXXX` escapes) and templates only add tokens; the bound takes 8 times the text's and a
/// megabyte more.
pub fn max_row_bytes(tokenizer: &Tokenizer, max_tokens: usize) -> usize {
    let per_token = match tokenizer.get_model() {
        ModelWrapper::BPE(bpe) if !(bpe.fuse_unk && !bpe.byte_fallback && bpe.unk_token.is_some()) => {
            tokenizer.get_vocab(true).keys().map(String::len).max().unwrap_or(1).max(4)
        }
        _ => UNBOUNDED_TOKEN_BYTES,
    };
    max_tokens.saturating_mul(per_token).saturating_mul(8).saturating_add(1 << 20)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The bound is the longest vocabulary entry (at least 4 bytes) per token, times 8, plus a
    /// megabyte, for BPE; UNBOUNDED_TOKEN_BYTES per token for a word-level model or fused unknowns.
    #[test]
    fn byte_bounds_follow_the_tokenizer_model() {
        let word = crate::text::synthetic_tokenizer(64).unwrap();
        assert_eq!(max_row_bytes(&word, 100), 100 * UNBOUNDED_TOKEN_BYTES * 8 + (1 << 20));
        let bpe = |fuse_unk: bool, byte_fallback: bool| {
            let json = serde_json::json!({
                "version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
                "pre_tokenizer": null, "post_processor": null, "decoder": null,
                "model": {"type": "BPE", "dropout": null, "unk_token": "<unk>", "continuing_subword_prefix": null,
                    "end_of_word_suffix": null, "fuse_unk": fuse_unk, "byte_fallback": byte_fallback,
                    "vocab": {"a": 0, "b": 1, "ab": 2, "<unk>": 3, "abab": 4, "abababab": 5},
                    "merges": ["a b", "ab ab", "abab abab"]},
            });
            json.to_string().parse::<Tokenizer>().unwrap()
        };
        assert_eq!(max_row_bytes(&bpe(false, false), 100), 100 * 8 * 8 + (1 << 20));
        assert_eq!(max_row_bytes(&bpe(true, true), 100), 100 * 8 * 8 + (1 << 20));
        // Fused unknowns: a run of unknown characters of any length is one token.
        assert_eq!(max_row_bytes(&bpe(true, false), 100), 100 * UNBOUNDED_TOKEN_BYTES * 8 + (1 << 20));
    }
}
