//! Instruction data: chat conversations rendered with the model's own chat template, and
//! prompt/completion pairs, tokenised into samples whose loss is on what the model must say.
//!
//! A conversation (`messages`: `[{role, content}]`, roles `system`, `user`, `assistant`) is
//! rendered by the tokenizer's Jinja chat template (`tokenizer_config.json`) through minijinja
//! with Python's string methods (the engine HF's Rust serving stack uses for these templates),
//! then tokenised whole, as transformers' `apply_chat_template(messages, tokenize=True)` does,
//! so the ids are the model's own. The labels are each assistant turn's tokens, its
//! end-of-turn token included, and -100 elsewhere: an assistant turn is the text that
//! rendering the conversation up to it adds after rendering the conversation before it with
//! the generation prompt, and a token is labelled when its bytes lie in such a span.
//!
//! Text that spells a special token (`<|eot_id|>` typed by a user) would become that token
//! in a rendered conversation; such rows are refused rather than trained on with forged turns.

use std::path::Path;

use anyhow::{Context, bail};
use serde::Deserialize;
use tokenizers::Tokenizer;

use crate::{IGNORE_INDEX, Sample};

/// One turn of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Message {
    /// `system`, `user` or `assistant`.
    pub role: String,
    /// What was said.
    pub content: String,
}

/// Roles a conversation may hold.
const ROLES: &[&str] = &["system", "user", "assistant"];

/// A tokenizer's chat template with the special tokens it refers to.
#[derive(Debug, Clone)]
pub struct ChatTemplate {
    source: String,
    bos_token: String,
    eos_token: String,
}

/// `tokenizer_config.json`'s token fields: a string or `{"content": ...}`.
#[derive(Deserialize)]
#[serde(untagged)]
enum TokenField {
    Text(String),
    Added { content: String },
}

impl TokenField {
    fn text(self) -> String {
        match self {
            Self::Text(s) | Self::Added { content: s } => s,
        }
    }
}

#[derive(Deserialize)]
struct TokenizerConfig {
    chat_template: Option<serde_json::Value>,
    bos_token: Option<TokenField>,
    eos_token: Option<TokenField>,
}

impl ChatTemplate {
    /// Reads the chat template of `tokenizer_config.json` in `dir` (a string, or HF's list of
    /// named templates, of which `default` is used).
    pub fn from_tokenizer_dir(dir: &Path) -> anyhow::Result<Self> {
        let path = dir.join("tokenizer_config.json");
        let text = std::fs::read_to_string(&path).with_context(|| {
            format!("cannot read {} (a chat template comes with the tokenizer's directory)", path.display())
        })?;
        let config: TokenizerConfig =
            serde_json::from_str(&text).with_context(|| format!("{}: not a tokenizer_config.json", path.display()))?;
        let source = match config.chat_template {
            Some(serde_json::Value::String(s)) => s,
            Some(serde_json::Value::Array(named)) => named
                .iter()
                .find(|t| t["name"] == "default")
                .and_then(|t| t["template"].as_str())
                .map(str::to_string)
                .with_context(|| format!("{}: no chat template named \"default\"", path.display()))?,
            None | Some(serde_json::Value::Null) => {
                bail!("{}: no chat_template (is this a base model's tokenizer?)", path.display())
            }
            Some(other) => bail!(
                "{}: chat_template = {other} is neither a template string nor a list of named templates",
                path.display()
            ),
        };
        let template = Self {
            source,
            bos_token: config.bos_token.map(TokenField::text).unwrap_or_default(),
            eos_token: config.eos_token.map(TokenField::text).unwrap_or_default(),
        };
        template.render(&[Message { role: "user".into(), content: "hi".into() }], true).with_context(|| {
            format!("{}: the chat template does not render a one-message conversation", path.display())
        })?;
        Ok(template)
    }

    /// The chat template of the tokenizer `path` names: an HF tokenizer directory, or the
    /// directory of a `tokenizer.json` given as a file.
    pub fn for_tokenizer(path: &Path) -> anyhow::Result<Self> {
        let dir = if path.is_dir() { path } else { path.parent().unwrap_or(Path::new(".")) };
        Self::from_tokenizer_dir(dir)
    }

    /// The tokenizer's end-of-sequence token as `tokenizer_config.json` names it (Llama 3
    /// Instruct's end of turn, `<|eot_id|>`), if any.
    pub fn eos_token(&self) -> Option<&str> {
        Some(self.eos_token.as_str()).filter(|t| !t.is_empty())
    }

    /// The conversation as the template renders it.
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> anyhow::Result<String> {
        let mut env = minijinja::Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        env.add_template("chat", &self.source).context("the chat template does not parse")?;
        let ctx = minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        };
        Ok(env.get_template("chat").expect("added").render(ctx)?)
    }
}

/// The conversation in a row's `messages`, or why it cannot be trained on.
pub fn parse_messages(row: &serde_json::Value) -> Result<Vec<Message>, String> {
    let list = row.get("messages").ok_or("no \"messages\" field")?.as_array().ok_or("\"messages\" is not a list")?;
    let mut out = Vec::with_capacity(list.len());
    for (k, m) in list.iter().enumerate() {
        let role = m.get("role").and_then(|r| r.as_str()).ok_or(format!("message {k}: no string \"role\""))?;
        if !ROLES.contains(&role) {
            return Err(format!("message {k}: unknown role {role:?} (expected one of {})", ROLES.join(", ")));
        }
        let content = match m.get("content") {
            Some(serde_json::Value::String(s)) => s.clone(),
            Some(other) => return Err(format!("message {k}: content is not a string but {other}")),
            None => return Err(format!("message {k}: no \"content\"")),
        };
        out.push(Message { role: role.to_string(), content });
    }
    if !out.iter().any(|m| m.role == "assistant") {
        return Err("no assistant turn: nothing to learn from".into());
    }
    Ok(out)
}

/// Refuses text that spells one of the tokenizer's special tokens.
fn check_no_special(tokenizer: &Tokenizer, what: &str, text: &str) -> Result<(), String> {
    for (_, t) in tokenizer.get_added_tokens_decoder() {
        if t.special && !t.content.is_empty() && text.contains(&t.content) {
            return Err(format!("{what} spells the special token {:?} (it would be read as one)", t.content));
        }
    }
    Ok(())
}

/// A conversation as token ids (the template's rendering, tokenised whole) with labels on the
/// assistant turns only.
pub fn chat_sample(tokenizer: &Tokenizer, template: &ChatTemplate, messages: &[Message]) -> Result<Sample, String> {
    for (k, m) in messages.iter().enumerate() {
        check_no_special(tokenizer, &format!("message {k}"), &m.content)?;
    }
    let err = |e: anyhow::Error| format!("{e:#}");
    let full = template.render(messages, false).map_err(err)?;
    // Byte spans of the assistant turns in `full`.
    let mut spans = Vec::new();
    for (i, _) in messages.iter().enumerate().filter(|(_, m)| m.role == "assistant") {
        let before = template.render(&messages[..i], true).map_err(err)?;
        let through = template.render(&messages[..=i], false).map_err(err)?;
        if !full.starts_with(&through) || !through.starts_with(&before) {
            return Err(format!(
                "the chat template does not render this conversation turn by turn (message {i}): its assistant \
                 turns cannot be found"
            ));
        }
        // A template that drops assistant content (or all of the turn) would leave nothing,
        // or only a header, to learn from.
        let content = messages[i].content.trim();
        if through.len() == before.len() || !through[before.len()..].contains(content) {
            return Err(format!(
                "the chat template does not render assistant message {i}'s content: nothing to learn from it"
            ));
        }
        spans.push(before.len()..through.len());
    }
    let enc = tokenizer.encode(full.as_str(), false).map_err(|e| format!("tokenising: {e}"))?;
    let ids = enc.get_ids().to_vec();
    let mut labels = vec![IGNORE_INDEX; ids.len()];
    for (j, &(start, end)) in enc.get_offsets().iter().enumerate() {
        match spans.iter().find(|s| s.contains(&start) || (start < s.start && end > s.start)) {
            Some(s) if s.start <= start && end <= s.end => labels[j] = ids[j] as i64,
            Some(_) => return Err(format!("token {j} crosses the edge of an assistant turn")),
            None => {}
        }
    }
    if labels.iter().all(|&l| l == IGNORE_INDEX) {
        return Err("the chat template renders no assistant token: nothing to learn from".into());
    }
    Ok(Sample { input_ids: ids, labels })
}

/// A prompt/completion pair: `<bos>` + prompt (labels -100) + completion + `<eos>` (labelled),
/// each part tokenised as plain text (give [`plain`]'s tokenizer: text spelling a special
/// token stays text).
pub fn completion_sample(tokenizer: &Tokenizer, prompt: &str, completion: &str) -> Result<Sample, String> {
    let (bos, eos) = crate::tokenizer::special_ids(tokenizer).map_err(|e| format!("{e:#}"))?;
    let enc =
        |t: &str| tokenizer.encode(t, false).map(|e| e.get_ids().to_vec()).map_err(|e| format!("tokenising: {e}"));
    let (p, c) = (enc(prompt)?, enc(completion)?);
    if c.is_empty() {
        return Err("the completion is empty".into());
    }
    let mut ids = vec![bos];
    ids.extend(&p);
    let prompt_len = ids.len();
    ids.extend(&c);
    ids.push(eos);
    let labels = ids.iter().enumerate().map(|(j, &id)| if j < prompt_len { IGNORE_INDEX } else { id as i64 }).collect();
    Ok(Sample { input_ids: ids, labels })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn template(source: &str) -> ChatTemplate {
        ChatTemplate { source: source.into(), bos_token: "<s>".into(), eos_token: "</s>".into() }
    }

    fn msg(role: &str, content: &str) -> Message {
        Message { role: role.into(), content: content.into() }
    }

    /// Python's string methods work in templates (pycompat), and raise_exception fails the
    /// render with the template's message.
    #[test]
    fn templates_get_python_methods_and_raise_exception() {
        let t = template("{% for m in messages %}{{ m['content'].strip().upper() }}{% endfor %}");
        assert_eq!(t.render(&[msg("user", "  hi ")], false).unwrap(), "HI");
        let t = template("{{ raise_exception('only user/assistant roles') }}");
        let e = format!("{:#}", t.render(&[msg("user", "x")], false).unwrap_err());
        assert!(e.contains("only user/assistant roles"), "{e}");
    }

    #[test]
    fn bad_rows_say_what_is_wrong() {
        let cases = [
            (serde_json::json!({"text": "x"}), "no \"messages\""),
            (serde_json::json!({"messages": [{"role": "bot", "content": "x"}]}), "unknown role \"bot\""),
            (serde_json::json!({"messages": [{"role": "user", "content": 3}]}), "content is not a string"),
            (serde_json::json!({"messages": [{"role": "user", "content": "q"}]}), "no assistant turn"),
        ];
        for (row, want) in cases {
            let e = parse_messages(&row).unwrap_err();
            assert!(e.contains(want), "{e}");
        }
    }

    /// `chat_template` of the wrong type is said to be that, not missing.
    #[test]
    fn a_chat_template_of_the_wrong_type_is_named() {
        let dir = tempfile::tempdir().unwrap();
        for (value, want) in [("5", "chat_template = 5 is neither"), ("null", "no chat_template")] {
            std::fs::write(dir.path().join("tokenizer_config.json"), format!("{{\"chat_template\": {value}}}"))
                .unwrap();
            let e = format!("{:#}", ChatTemplate::from_tokenizer_dir(dir.path()).unwrap_err());
            assert!(e.contains(want), "{e}");
        }
    }

    /// A template that leaves out assistant content (the turn, or its text under a header)
    /// gives no sample rather than one with nothing to learn from.
    #[test]
    fn templates_that_drop_assistant_content_are_refused() {
        let tok = crate::synth_chat::tokenizer(64).unwrap();
        let chat = [msg("user", "w1 w2"), msg("assistant", "w3 w4")];
        let keeps = template("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }} {% endfor %}");
        let sample = chat_sample(&tok, &keeps, &chat).unwrap();
        assert!(sample.labels.iter().any(|&l| l != IGNORE_INDEX));
        for source in [
            "{% for m in messages %}{% if m['role'] != 'assistant' %}{{ m['content'] }} {% endif %}{% endfor %}",
            "{% for m in messages %}{{ m['role'] }}: {% if m['role'] == 'user' %}{{ m['content'] }}{% endif %} {% endfor %}",
        ] {
            let e = chat_sample(&tok, &template(source), &chat).unwrap_err();
            assert!(e.contains("assistant message 1") && e.contains("nothing to learn"), "{source}: {e}");
        }
    }
}
