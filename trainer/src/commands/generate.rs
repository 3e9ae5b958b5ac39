//! `llora generate`: a prompt continued, or a conversation answered, by a model with its
//! adapter, streaming the text as it comes.

use std::io::Write;
use std::time::Instant;

use anyhow::Context;
use llora_data::chat::{ChatTemplate, Message};
use llora_data::tokenizer::load_tokenizer;
use llora_model::checkpoint::HfCheckpoint;
use llora_model::{Sampling, generate};
use serde_json::json;

use crate::cli::GenerateArgs;

/// Runs `llora generate`.
pub fn run(a: &GenerateArgs) -> anyhow::Result<()> {
    // Flags first: a bad one should not wait for a 140 GB model to load.
    let flag = |key: &str| format!("`{key}`");
    let mut p = crate::config::Problems::new(&flag);
    crate::config::check_threads(&mut p, "--threads", a.threads);
    p.check(a.max_new_tokens >= 1, "--max-new-tokens", &a.max_new_tokens, "must be at least 1");
    p.check(
        a.temperature.is_finite() && a.temperature >= 0.0,
        "--temperature",
        &a.temperature,
        "must be >= 0 (0: greedy)",
    );
    p.check(a.top_p > 0.0 && a.top_p <= 1.0, "--top-p", &a.top_p, "must be in (0, 1]");
    p.finish().map_err(|problems| anyhow::anyhow!("invalid llora generate flags:\n  - {}", problems.join("\n  - ")))?;
    // The prompt before the model: a prompt that cannot fit should not wait for 140 GB to load.
    let ckpt = HfCheckpoint::open(&a.model).with_context(|| format!("--model {}", a.model.display()))?;
    let tokenizer = load_tokenizer(&a.tokenizer)?;
    anyhow::ensure!(
        tokenizer.get_vocab_size(true) <= ckpt.config.vocab_size,
        "--tokenizer has {} tokens but the model's vocabulary {}: another model's tokenizer?",
        tokenizer.get_vocab_size(true),
        ckpt.config.vocab_size
    );
    // The model's end-of-text ids, and the template's end of turn for conversations.
    let mut stop = ckpt.config.eos_token_ids.clone();
    let ids = prompt_ids(a, &tokenizer, ckpt.config.max_position_embeddings, &mut stop)?;
    if stop.is_empty() {
        stop.push(llora_data::tokenizer::end_of_text_id(&tokenizer)?);
    }
    // Checked before any token is produced: running out of positions halfway would lose what
    // was streamed (and all of it with --json).
    let positions = ckpt.config.max_position_embeddings;
    anyhow::ensure!(
        ids.len().saturating_add(a.max_new_tokens) <= positions,
        "the prompt ({} tokens) plus --max-new-tokens {} exceeds the model's max_position_embeddings ({positions}): {}",
        ids.len(),
        a.max_new_tokens,
        room_advice(ids.len(), positions)
    );
    let device = a.device.init(a.threads)?;
    let spec =
        llora_model::precision::PrecisionSpec { compute: a.precision, nf4: a.quantize.nf4()?, ..Default::default() };
    let flag = |key: &str| format!("`{key}`");
    let mut p = crate::config::Problems::new(&flag);
    crate::config::check_precision_flags(&spec, &mut p);
    p.finish().map_err(|problems| anyhow::anyhow!("invalid llora generate flags:\n  - {}", problems.join("\n  - ")))?;
    let model = ckpt.load_for_inference(a.adapter.as_deref(), &spec, &device)?;
    let sampling = if a.temperature == 0.0 {
        Sampling::Greedy
    } else {
        Sampling::Sample { temperature: a.temperature, top_p: a.top_p, seed: a.seed }
    };
    let (t0, mut first) = (Instant::now(), None);
    let mut shown = String::new();
    let mut out_ids = Vec::new();
    let new = generate(&model, &ids, a.max_new_tokens, &stop, sampling, |id| {
        first.get_or_insert_with(Instant::now);
        out_ids.push(id);
        if !a.json {
            // Decoded whole each time: a character may span several tokens.
            let text = tokenizer.decode(&out_ids, true).unwrap_or_default();
            if let Some(tail) = text.strip_prefix(shown.as_str()) {
                crate::out!("{tail}");
                let _ = std::io::stdout().flush();
                shown = text;
            }
        }
    })?;
    let total = t0.elapsed().as_secs_f64();
    let prefill = first.map_or(total, |f| (f - t0).as_secs_f64());
    let decode_tps = (new.len().saturating_sub(1)) as f64 / (total - prefill).max(1e-9);
    let text = tokenizer.decode(&new, true).map_err(|e| anyhow::anyhow!("decoding: {e}"))?;
    if a.json {
        crate::outln!(
            "{}",
            json!({"prompt_ids": ids, "new_tokens": new.len(), "ids": new, "text": text,
                "prefill_s": prefill, "decode_tokens_per_s": decode_tps})
        );
    } else {
        crate::outln!();
        tracing::info!(
            prompt_tokens = ids.len(),
            new_tokens = new.len(),
            prefill_s = format!("{prefill:.3}"),
            decode_tokens_per_s = format!("{decode_tps:.1}"),
            "generated"
        );
    }
    Ok(())
}

/// The prompt's token ids (`--prompt` as text, `--chat` through the chat template, whose end of
/// turn joins `stop`). Text longer in bytes than `positions` tokens could hold is refused before
/// it is read whole or tokenised.
fn prompt_ids(
    a: &GenerateArgs,
    tokenizer: &llora_data::Tokenizer,
    positions: usize,
    stop: &mut Vec<u32>,
) -> anyhow::Result<Vec<u32>> {
    let bound = llora_data::tokenizer::max_row_bytes(tokenizer, positions);
    let too_long = |what: String, bytes: u64| {
        anyhow::anyhow!(
            "{what} is {bytes} bytes: more than the model's {positions} positions can hold with this tokenizer \
             (at most {bound} bytes); nothing was tokenised"
        )
    };
    let encoding = match (&a.prompt, &a.chat) {
        (Some(text), _) => {
            if text.len() > bound {
                return Err(too_long("--prompt".into(), text.len() as u64));
            }
            tokenizer.encode(text.as_str(), true)
        }
        (None, Some(file)) => {
            let bytes = std::fs::metadata(file).with_context(|| format!("cannot read {}", file.display()))?.len();
            if bytes > bound as u64 {
                return Err(too_long(format!("--chat {}", file.display()), bytes));
            }
            let template = ChatTemplate::for_tokenizer(&a.tokenizer)?;
            let messages = read_chat(file)?;
            if let Some(eot) = template.eos_token().and_then(|t| tokenizer.token_to_id(t)) {
                stop.push(eot);
            }
            tokenizer.encode(template.render(&messages, true)?, false)
        }
        (None, None) => anyhow::bail!("give --prompt TEXT or --chat FILE"),
    };
    Ok(encoding.map_err(|e| anyhow::anyhow!("tokenising the prompt: {e}"))?.get_ids().to_vec())
}

/// A conversation file: a JSON list of `{"role", "content"}` (or `{"messages": [...]}`) that
/// ends with a turn to answer (not the assistant's).
fn read_chat(path: &std::path::Path) -> anyhow::Result<Vec<Message>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let value: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{}: not JSON", path.display()))?;
    let row = if value.is_array() { json!({"messages": value}) } else { value };
    // A conversation to answer ends with a user turn: no assistant turn is required here.
    let mut with_answer = row.clone();
    if let Some(list) = with_answer["messages"].as_array_mut() {
        anyhow::ensure!(!list.is_empty(), "{}: the conversation holds no message: nothing to answer", path.display());
        list.push(json!({"role": "assistant", "content": ""}));
    }
    let mut messages =
        llora_data::chat::parse_messages(&with_answer).map_err(|why| anyhow::anyhow!("{}: {why}", path.display()))?;
    messages.pop();
    let last = messages.last().map(|m| m.role.as_str());
    anyhow::ensure!(
        last != Some("assistant"),
        "{}: the conversation ends with an assistant turn: end it with the user turn to answer",
        path.display()
    );
    Ok(messages)
}

/// What to do when a prompt and the tokens asked for do not fit the model's positions: fewer
/// new tokens while at least one fits, else a shorter prompt (`--max-new-tokens 0` is refused).
fn room_advice(prompt: usize, positions: usize) -> String {
    match positions.saturating_sub(prompt) {
        0 => format!("the prompt alone fills them; shorten it to fewer than {positions} tokens"),
        room => format!("lower --max-new-tokens to at most {room} or shorten the prompt"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The advice never asks for `--max-new-tokens 0` (refused): with no room left, a shorter
    /// prompt.
    #[test]
    fn a_prompt_that_fills_the_positions_is_told_to_shrink() {
        assert_eq!(room_advice(10, 16), "lower --max-new-tokens to at most 6 or shorten the prompt");
        assert_eq!(room_advice(16, 16), "the prompt alone fills them; shorten it to fewer than 16 tokens");
        assert_eq!(room_advice(20, 16), "the prompt alone fills them; shorten it to fewer than 16 tokens");
    }
    use clap::Parser;

    fn args(extra: &[&str]) -> GenerateArgs {
        let mut all = vec!["llora", "generate", "--model", "m", "--tokenizer"];
        all.extend(extra);
        match crate::cli::Cli::try_parse_from(all).unwrap().command {
            crate::cli::Command::Generate(a) => a,
            _ => unreachable!(),
        }
    }

    /// A conversation or prompt too long in bytes for the model's
    /// positions is refused before it is read whole or tokenised (a BPE tokenizer bounds bytes
    /// per token); an empty conversation, or one ending with the assistant, has nothing to answer.
    #[test]
    fn prompts_that_cannot_fit_or_answer_nothing_are_refused_up_front() {
        let dir = tempfile::tempdir().unwrap();
        let vocab: serde_json::Map<String, serde_json::Value> =
            ('a'..='z').chain([' ']).enumerate().map(|(i, c)| (c.to_string(), i.into())).collect();
        let tokenizer = serde_json::json!({
            "version": "1.0", "truncation": null, "padding": null, "added_tokens": [], "normalizer": null,
            "pre_tokenizer": null, "post_processor": null, "decoder": null,
            "model": {"type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
                "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "vocab": vocab, "merges": []},
        });
        let tok_path = dir.path().join("tokenizer.json");
        std::fs::write(&tok_path, tokenizer.to_string()).unwrap();
        let template = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}";
        std::fs::write(
            dir.path().join("tokenizer_config.json"),
            serde_json::json!({"chat_template": template}).to_string(),
        )
        .unwrap();
        let tok = load_tokenizer(&tok_path).unwrap();
        let t = tok_path.to_str().unwrap();
        let chat = |name: &str, value: serde_json::Value| {
            let p = dir.path().join(name);
            std::fs::write(&p, value.to_string()).unwrap();
            p.to_str().unwrap().to_string()
        };
        let ok = chat("ok.json", serde_json::json!([{"role": "user", "content": "hi there"}]));
        let ids = prompt_ids(&args(&[t, "--chat", &ok]), &tok, 64, &mut Vec::new()).unwrap();
        assert_eq!(ids.len(), "user hi there ".len(), "one token per character");
        // 10 MB of content against 64 positions: refused by size, nothing tokenised.
        let big = chat("big.json", serde_json::json!([{"role": "user", "content": "a".repeat(10 << 20)}]));
        let err = prompt_ids(&args(&[t, "--chat", &big]), &tok, 64, &mut Vec::new()).unwrap_err().to_string();
        assert!(err.contains("big.json") && err.contains("nothing was tokenised"), "{err}");
        // The same with the chat demo's word-level tokenizer (a whole unknown word is one token:
        // 256 bytes a token are allowed), the case the sweep found.
        let word = llora_data::synth_chat::tokenizer(64).unwrap();
        let err = prompt_ids(&args(&[t, "--chat", &big]), &word, 64, &mut Vec::new()).unwrap_err().to_string();
        assert!(err.contains("big.json") && err.contains("nothing was tokenised"), "{err}");
        let long = "b".repeat(1 << 21);
        let err = prompt_ids(&args(&[t, "--prompt", &long]), &tok, 64, &mut Vec::new()).unwrap_err().to_string();
        assert!(err.contains("--prompt") && err.contains("nothing was tokenised"), "{err}");
        for (name, value, want) in [
            ("empty.json", serde_json::json!([]), "holds no message"),
            ("empty2.json", serde_json::json!({"messages": []}), "holds no message"),
            (
                "answered.json",
                serde_json::json!([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]),
                "ends with an assistant turn",
            ),
        ] {
            let p = chat(name, value);
            let err = format!("{:#}", prompt_ids(&args(&[t, "--chat", &p]), &tok, 64, &mut Vec::new()).unwrap_err());
            assert!(err.contains(name) && err.contains(want), "{err}");
        }
    }
}
