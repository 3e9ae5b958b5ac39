//! `llora generate`: a prompt continued, or a conversation answered, by a model with its
//! adapter, streaming the text as it comes.

use std::io::Write;
use std::time::Instant;

use anyhow::Context;
use llora_data::chat::{ChatTemplate, Message, load_tokenizer};
use llora_model::BuildOptions;
use llora_model::checkpoint::HfCheckpoint;
use llora_model::generate::{Sampling, generate};
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
    let device = a.device.init(a.threads)?;
    let ckpt = HfCheckpoint::open(&a.model).with_context(|| format!("--model {}", a.model.display()))?;
    let mut model = ckpt.load_model(&BuildOptions::default(), &device)?;
    if let Some(adapter) = &a.adapter {
        llora_model::peft::load_peft_adapter(&mut model, adapter, &device)
            .with_context(|| format!("loading the adapter {}", adapter.display()))?;
    }
    // After the adapter (it loads into f32 parameters), as `llora eval` does.
    let spec = llora_model::precision::PrecisionSpec { compute: a.precision, ..Default::default() };
    if !spec.is_fp32() {
        model.set_precision(&spec)?;
    }
    let tokenizer = load_tokenizer(&a.tokenizer)?;
    anyhow::ensure!(
        tokenizer.get_vocab_size(true) <= model.config.vocab_size,
        "--tokenizer has {} tokens but the model's vocabulary {}: another model's tokenizer?",
        tokenizer.get_vocab_size(true),
        model.config.vocab_size
    );
    // The model's end-of-text ids, and the template's end of turn for conversations.
    let mut stop = model.config.eos_token_ids.clone();
    let prompt = match (&a.prompt, &a.chat) {
        (Some(text), _) => tokenizer.encode(text.as_str(), true),
        (None, Some(file)) => {
            let template = ChatTemplate::for_tokenizer(&a.tokenizer)?;
            let messages = read_chat(file)?;
            if let Some(eot) = template.eos_token().and_then(|t| tokenizer.token_to_id(t)) {
                stop.push(eot);
            }
            tokenizer.encode(template.render(&messages, true)?, false)
        }
        (None, None) => anyhow::bail!("give --prompt TEXT or --chat FILE"),
    }
    .map_err(|e| anyhow::anyhow!("tokenising the prompt: {e}"))?;
    if stop.is_empty() {
        stop.push(llora_data::chat::special_ids(&tokenizer)?.1);
    }
    let ids = prompt.get_ids().to_vec();
    // Checked before any token is produced: running out of positions halfway would lose what
    // was streamed (and all of it with --json).
    let positions = model.config.max_position_embeddings;
    anyhow::ensure!(
        ids.len().saturating_add(a.max_new_tokens) <= positions,
        "the prompt ({} tokens) plus --max-new-tokens {} exceeds the model's max_position_embeddings ({positions}): \
         lower --max-new-tokens to at most {} or shorten the prompt",
        ids.len(),
        a.max_new_tokens,
        positions.saturating_sub(ids.len())
    );
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
                print!("{tail}");
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
        println!(
            "{}",
            json!({"prompt_ids": ids, "new_tokens": new.len(), "ids": new, "text": text,
                "prefill_s": prefill, "decode_tokens_per_s": decode_tps})
        );
    } else {
        println!();
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

/// A conversation file: a JSON list of `{"role", "content"}` (or `{"messages": [...]}`).
fn read_chat(path: &std::path::Path) -> anyhow::Result<Vec<Message>> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let value: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("{}: not JSON", path.display()))?;
    let row = if value.is_array() { json!({"messages": value}) } else { value };
    // A conversation to answer ends with a user turn: no assistant turn is required here.
    let mut with_answer = row.clone();
    if let Some(list) = with_answer["messages"].as_array_mut() {
        list.push(json!({"role": "assistant", "content": ""}));
    }
    let mut messages =
        llora_data::chat::parse_messages(&with_answer).map_err(|why| anyhow::anyhow!("{}: {why}", path.display()))?;
    messages.pop();
    Ok(messages)
}
