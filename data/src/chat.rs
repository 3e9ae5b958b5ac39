//! Instruction data: chat conversations rendered with the model's own chat template, and
//! prompt/completion pairs, tokenised into samples whose loss is on what the model must say.
//!
//! A conversation (`messages`: `[{role, content}]`, roles `system`, `user`, `assistant`) is
//! rendered by the tokenizer's Jinja chat template (`chat_template.jinja`, where transformers 5
//! saves it, else `tokenizer_config.json`'s `chat_template`) through minijinja with Python's
//! string methods (the engine HF's Rust serving stack uses for these templates), then tokenised
//! whole, as transformers' `apply_chat_template(messages, tokenize=True)` does, so the ids are
//! the model's own. The labels are each assistant turn's tokens, its end-of-turn token
//! included, and -100 elsewhere; a token is labelled when its bytes lie in an assistant span of
//! the rendering. The spans are found, in this order of preference:
//! - where the template marks them (`{% generation %}` ... `{% endgeneration %}`, what
//!   transformers' `return_assistant_tokens_mask` reads);
//! - turn by turn: the text rendering the conversation up to an assistant turn adds after
//!   rendering the conversation before it with the generation prompt;
//! - where turn-by-turn renderings are not prefixes of the whole (Qwen 3 drops earlier turns'
//!   `<think>` blocks, Mistral's v3 templates put the system message in the last user turn, a
//!   template may refuse a conversation's first part): each assistant message's text found in
//!   the one rendering, in order, with the end of turn the template writes after it.
//!
//! Text that spells a special token (`<|eot_id|>` typed by a user) would become that token
//! in a rendered conversation; such rows are refused rather than trained on with forged turns.

use std::ops::Range;
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

/// Where transformers 5 saves a tokenizer's chat template (beside `tokenizer_config.json`,
/// which then holds none); when both exist, transformers takes this one.
const TEMPLATE_FILE: &str = "chat_template.jinja";

impl ChatTemplate {
    /// Reads the chat template of the tokenizer in `dir`: `chat_template.jinja` when present,
    /// else `tokenizer_config.json`'s `chat_template` (a string, or HF's list of named
    /// templates, of which `default` is used); the special tokens from `tokenizer_config.json`.
    pub fn from_tokenizer_dir(dir: &Path) -> anyhow::Result<Self> {
        let path = dir.join("tokenizer_config.json");
        let file = dir.join(TEMPLATE_FILE);
        let config = match std::fs::read_to_string(&path) {
            Ok(text) => serde_json::from_str(&text)
                .with_context(|| format!("{}: not a tokenizer_config.json", path.display()))?,
            Err(_) if file.is_file() => TokenizerConfig { chat_template: None, bos_token: None, eos_token: None },
            Err(e) => bail!(
                "cannot read {} ({e}): a chat template comes with the tokenizer's directory ({} or {TEMPLATE_FILE})",
                path.display(),
                path.file_name().and_then(|n| n.to_str()).unwrap_or_default()
            ),
        };
        let source = if file.is_file() {
            std::fs::read_to_string(&file).with_context(|| format!("cannot read {}", file.display()))?
        } else {
            config_template(config.chat_template, &path, dir)?
        };
        let where_ = if file.is_file() { file } else { path };
        let template = Self {
            source,
            bos_token: config.bos_token.map(TokenField::text).unwrap_or_default(),
            eos_token: config.eos_token.map(TokenField::text).unwrap_or_default(),
        };
        template.render(&[Message { role: "user".into(), content: "hi".into() }], true).with_context(|| {
            format!("{}: the chat template does not render a one-message conversation", where_.display())
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

    /// The conversation as the template renders it (`apply_chat_template(tokenize=False)`).
    pub fn render(&self, messages: &[Message], add_generation_prompt: bool) -> anyhow::Result<String> {
        Ok(self.render_marked(messages, add_generation_prompt)?.replace([GEN_START, GEN_END], ""))
    }

    /// [`Self::render`] with the template's `{% generation %}` spans marked by [`GEN_START`]
    /// and [`GEN_END`] (minijinja has no such tag: each becomes an expression writing its
    /// marker, with the tag's own whitespace control).
    fn render_marked(&self, messages: &[Message], add_generation_prompt: bool) -> anyhow::Result<String> {
        let mut env = minijinja::Environment::new();
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", |msg: String| -> Result<String, minijinja::Error> {
            Err(minijinja::Error::new(minijinja::ErrorKind::InvalidOperation, msg))
        });
        let source = generation_tags().replace_all(&self.source, |c: &regex::Captures<'_>| {
            let marker = if c.get(2).is_some() { GEN_END } else { GEN_START };
            format!("{{{{{} '{marker}' {}}}}}", &c[1], &c[3])
        });
        env.add_template("chat", &source).context("the chat template does not parse")?;
        let ctx = minijinja::context! {
            messages => messages,
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        };
        Ok(env.get_template("chat").expect("added").render(ctx)?)
    }

    /// Whether the template marks assistant output with `{% generation %}`.
    fn marks_generation(&self) -> bool {
        generation_tags().is_match(&self.source)
    }

    /// The conversation as [`Self::render`] writes it (no generation prompt), and the byte span
    /// of each assistant turn in it, in order (see the module docs for how they are found).
    pub fn render_with_assistant_spans(&self, messages: &[Message]) -> Result<(String, Vec<Range<usize>>), String> {
        let marked = self
            .render_marked(messages, false)
            .map_err(|e| format!("the chat template refuses this conversation: {e:#}"))?;
        let (full, spans) = if self.marks_generation() {
            marked_spans(&marked)?
        } else {
            let spans = match self.turn_by_turn_spans(messages, &marked) {
                Some(spans) => spans,
                None => self.searched_spans(messages, &marked)?,
            };
            (marked, spans)
        };
        check_spans_hold_content(messages, &full, &spans)?;
        Ok((full, spans))
    }

    /// Each assistant turn as what rendering the conversation through it adds to rendering the
    /// conversation before it with the generation prompt; `None` when a part does not render
    /// or is not a prefix of the whole.
    fn turn_by_turn_spans(&self, messages: &[Message], full: &str) -> Option<Vec<Range<usize>>> {
        let mut spans = Vec::new();
        for (i, _) in messages.iter().enumerate().filter(|(_, m)| m.role == "assistant") {
            let before = self.render(&messages[..i], true).ok()?;
            let through = self.render(&messages[..=i], false).ok()?;
            if !full.starts_with(&through) || !through.starts_with(&before) {
                return None;
            }
            spans.push(before.len()..through.len());
        }
        Some(spans)
    }

    /// Each assistant message's text found in `full` after the turns before it (users' texts
    /// passed over in order; system texts a template may move), widened back to the end of
    /// the generation prompt before it (or over the whitespace before it) and on over the end
    /// of turn the template writes after an assistant message.
    fn searched_spans(&self, messages: &[Message], full: &str) -> Result<Vec<Range<usize>>, String> {
        let (prompt, turn_end) = self.probe_turn_edges();
        let (mut cursor, mut spans) = (0, Vec::new());
        for (i, m) in messages.iter().enumerate().filter(|(_, m)| m.role != "system") {
            let found = rendered_forms(&m.content)
                .into_iter()
                .find_map(|c| full[cursor..].find(c).map(|p| (cursor + p, c.len())));
            let Some((at, len)) = found else {
                if m.role == "assistant" {
                    return Err(not_rendered(i));
                }
                continue;
            };
            if m.role != "assistant" {
                cursor = at + len;
                continue;
            }
            let start = match prompt.as_deref().and_then(|p| full[cursor..at].rfind(p).map(|k| cursor + k + p.len())) {
                Some(after_prompt) => after_prompt,
                None => cursor + full[cursor..at].trim_end().len(),
            };
            let mut end = at + len;
            if let Some(t) = turn_end.as_deref().filter(|t| full[end..].starts_with(t)) {
                end += t.len();
            }
            spans.push(start..end);
            cursor = end;
        }
        Ok(spans)
    }

    /// What the template writes to open an assistant turn (the generation prompt) and after an
    /// assistant message's text (its end of turn), read from two probe conversations; `None`
    /// where a probe does not render or writes nothing.
    fn probe_turn_edges(&self) -> (Option<String>, Option<String>) {
        let user = Message { role: "user".into(), content: "Probe?".into() };
        let answer = Message { role: "assistant".into(), content: PROBE.into() };
        let prompt =
            match (self.render(std::slice::from_ref(&user), true), self.render(std::slice::from_ref(&user), false)) {
                (Ok(with), Ok(without)) => with.strip_prefix(&without).map(str::to_string),
                _ => None,
            };
        let end = self
            .render(&[user, answer], false)
            .ok()
            .and_then(|t| t.split_once(PROBE).map(|(_, after)| after.to_string()));
        (prompt.filter(|p| !p.is_empty()), end.filter(|e| !e.is_empty()))
    }
}

/// Marks the start and end of a `{% generation %}` span in a rendering (private-use code
/// points; conversations holding them are refused).
const GEN_START: char = '\u{E000}';
/// See [`GEN_START`].
const GEN_END: char = '\u{E001}';
/// An assistant text no conversation holds, for [`ChatTemplate::probe_turn_edges`].
const PROBE: &str = "\u{E002}probe\u{E002}";

/// `{% generation %}` and `{% endgeneration %}` with their whitespace control.
fn generation_tags() -> &'static regex::Regex {
    static TAGS: std::sync::OnceLock<regex::Regex> = std::sync::OnceLock::new();
    TAGS.get_or_init(|| regex::Regex::new(r"\{%(-?)\s*(end)?generation\s*(-?)%\}").expect("a valid pattern"))
}

/// The rendering without its markers, and the spans between them.
fn marked_spans(marked: &str) -> Result<(String, Vec<Range<usize>>), String> {
    let (mut text, mut spans, mut open) = (String::with_capacity(marked.len()), Vec::new(), None);
    for c in marked.chars() {
        match (c, open) {
            (GEN_START, None) => open = Some(text.len()),
            (GEN_END, Some(start)) => {
                spans.push(start..text.len());
                open = None;
            }
            (GEN_START | GEN_END, _) => return Err("the chat template's generation spans are not paired".into()),
            _ => text.push(c),
        }
    }
    if open.is_some() {
        return Err("the chat template's generation spans are not paired".into());
    }
    Ok((text, spans.into_iter().filter(|s| !s.is_empty()).collect()))
}

/// How a template may write an assistant message's text: as given, trimmed, or (Qwen 3) only
/// what follows its reasoning block, without the newlines after `</think>`.
fn rendered_forms(content: &str) -> Vec<&str> {
    let mut forms = vec![content, content.trim()];
    if let Some((_, answer)) = content.rsplit_once("</think>") {
        forms.push(answer.trim_start_matches('\n'));
        forms.push(answer.trim());
    }
    forms.into_iter().filter(|f| !f.is_empty()).collect()
}

fn not_rendered(i: usize) -> String {
    format!("the chat template does not render assistant message {i}'s content: nothing to learn from it")
}

/// Refuses spans that are not one per assistant message, in order, each holding its text (a
/// template that drops the content, or all of the turn, leaves nothing to learn from).
fn check_spans_hold_content(messages: &[Message], full: &str, spans: &[Range<usize>]) -> Result<(), String> {
    let assistants: Vec<usize> =
        messages.iter().enumerate().filter(|(_, m)| m.role == "assistant").map(|(i, _)| i).collect();
    if spans.len() != assistants.len() {
        return Err(format!(
            "the chat template marks {} assistant span(s) for {} assistant message(s)",
            spans.len(),
            assistants.len()
        ));
    }
    for (span, &i) in spans.iter().zip(&assistants) {
        if !rendered_forms(&messages[i].content).iter().any(|f| full[span.clone()].contains(f)) {
            return Err(not_rendered(i));
        }
    }
    if spans.windows(2).any(|w| w[0].end > w[1].start) {
        return Err("the chat template's assistant spans overlap".into());
    }
    Ok(())
}

/// `tokenizer_config.json`'s `chat_template` (read from `path`; `dir` the tokenizer's).
fn config_template(value: Option<serde_json::Value>, path: &Path, dir: &Path) -> anyhow::Result<String> {
    Ok(match value {
        Some(serde_json::Value::String(s)) => s,
        Some(serde_json::Value::Array(named)) => named
            .iter()
            .find(|t| t["name"] == "default")
            .and_then(|t| t["template"].as_str())
            .map(str::to_string)
            .with_context(|| format!("{}: no chat template named \"default\"", path.display()))?,
        None | Some(serde_json::Value::Null) => bail!(
            "{}: no chat_template, and no {TEMPLATE_FILE} in {} (is this a base model's tokenizer?)",
            path.display(),
            dir.display()
        ),
        Some(other) => bail!(
            "{}: chat_template = {other} is neither a template string nor a list of named templates",
            path.display()
        ),
    })
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
        if m.content.contains([GEN_START, GEN_END, '\u{E002}']) {
            return Err(format!("message {k} holds a private-use character (U+E000-U+E002) llora marks turns with"));
        }
    }
    let (full, spans) = template.render_with_assistant_spans(messages)?;
    let enc = tokenizer.encode(full.as_str(), false).map_err(|e| format!("tokenising: {e}"))?;
    let ids = enc.get_ids().to_vec();
    let mut labels = vec![IGNORE_INDEX; ids.len()];
    for (j, &(start, end)) in enc.get_offsets().iter().enumerate() {
        match spans.iter().find(|s| s.contains(&start) || (start < s.start && end > s.start)) {
            Some(s) if s.start <= start && end <= s.end => labels[j] = i64::from(ids[j]),
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
/// token stays text). A tokenizer without a beginning-of-sequence token (Qwen's) starts with
/// the prompt, as its own encoder does.
pub fn completion_sample(tokenizer: &Tokenizer, prompt: &str, completion: &str) -> Result<Sample, String> {
    let eos = crate::tokenizer::end_of_text_id(tokenizer).map_err(|e| format!("{e:#}"))?;
    let bos = crate::tokenizer::bos_id(tokenizer);
    let enc =
        |t: &str| tokenizer.encode(t, false).map(|e| e.get_ids().to_vec()).map_err(|e| format!("tokenising: {e}"));
    let (p, c) = (enc(prompt)?, enc(completion)?);
    if c.is_empty() {
        return Err("the completion is empty".into());
    }
    let mut ids: Vec<u32> = bos.into_iter().collect();
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

    /// The labelled ids of each run of a sample.
    fn labelled(sample: &Sample) -> Vec<Vec<i64>> {
        let mut runs: Vec<Vec<i64>> = Vec::new();
        for (j, &l) in sample.labels.iter().enumerate() {
            if l != IGNORE_INDEX && (j == 0 || sample.labels[j - 1] == IGNORE_INDEX) {
                runs.push(Vec::new());
            }
            if l != IGNORE_INDEX {
                runs.last_mut().unwrap().push(l);
            }
        }
        runs
    }

    /// The synthetic tokenizer's ids of `text` (whitespace-separated words).
    fn ids(tok: &Tokenizer, text: &str) -> Vec<i64> {
        tok.encode(text, false).unwrap().get_ids().iter().map(|&i| i64::from(i)).collect()
    }

    /// Words of the synthetic tokenizer's vocabulary, `w(k)` the k-th.
    fn w(k: u32) -> String {
        crate::synth::word(crate::synth::FIRST_CONTENT + k)
    }

    /// `{% generation %}` markup (with its whitespace control) is what gets labelled, and the
    /// markers never reach the rendering.
    #[test]
    fn generation_markup_marks_the_labelled_spans() {
        let tok = crate::synth_chat::tokenizer(64).unwrap();
        let t = template(&format!(
            "{{% for m in messages %}}{{{{ m['role'] }}}}: {{% if m['role'] == 'assistant' %}} {{%- generation -%}} \
             {{{{ m['content'] }}}} {} {{% endgeneration -%}} {{% else %}}{{{{ m['content'] }}}} {{% endif %}}{{% endfor %}}",
            w(9)
        ));
        let chat = [
            msg("user", &w(1)),
            msg("assistant", &format!("{} {}", w(3), w(4))),
            msg("user", &w(5)),
            msg("assistant", &w(6)),
        ];
        let want = format!(
            "user: {} assistant: {} {} {} user: {} assistant: {} {} ",
            w(1),
            w(3),
            w(4),
            w(9),
            w(5),
            w(6),
            w(9)
        );
        assert_eq!(t.render(&chat, false).unwrap(), want);
        let sample = chat_sample(&tok, &t, &chat).unwrap();
        let runs = [format!("{} {} {}", w(3), w(4), w(9)), format!("{} {}", w(6), w(9))];
        assert_eq!(labelled(&sample), runs.map(|r| ids(&tok, &r)));
    }

    /// Where turn-by-turn renderings are not prefixes of the whole (a Qwen 3-like template that
    /// drops earlier turns' reasoning) or a conversation's first part does not render (it
    /// starts with the assistant, and the template reads `messages[0]`), each assistant message
    /// is found in the one rendering, with its end of turn.
    #[test]
    fn assistant_turns_are_found_where_turn_by_turn_renderings_differ() {
        let tok = crate::synth_chat::tokenizer(64).unwrap();
        let end = w(9);
        let think = template(&format!(
            "{{% for m in messages %}}{{% if m['role'] == 'assistant' %}}{{% set c = m['content'] %}}\
             {{% if not loop.last and '</think>' in c %}}{{% set c = c.split('</think>')[-1].lstrip(' ') %}}{{% endif %}}\
             A: {{{{ c }}}} {end} {{% else %}}U: {{{{ m['content'] }}}} {{% endif %}}{{% endfor %}}\
             {{% if add_generation_prompt %}}A: {{% endif %}}"
        ));
        let chat = [
            msg("user", &w(1)),
            msg("assistant", &format!("<think> {} </think> {}", w(2), w(3))),
            msg("user", &w(4)),
            msg("assistant", &format!("<think> {} </think> {}", w(5), w(6))),
        ];
        let sample = chat_sample(&tok, &think, &chat).unwrap();
        let runs = [format!("{} {end}", w(3)), format!("<think> {} </think> {} {end}", w(5), w(6))];
        assert_eq!(labelled(&sample), runs.map(|r| ids(&tok, &r)));
        let first = template(&format!(
            "{{{{ messages[0]['role'] }}}} {{% for m in messages %}}{{{{ m['role'] }}}} {{{{ m['content'] }}}} {end} {{% endfor %}}"
        ));
        let chat = [msg("assistant", &w(1)), msg("user", &format!("{} {}", w(1), w(2))), msg("assistant", &w(3))];
        let sample = chat_sample(&tok, &first, &chat).unwrap();
        assert_eq!(labelled(&sample), [format!("{} {end}", w(1)), format!("{} {end}", w(3))].map(|r| ids(&tok, &r)));
    }

    /// transformers 5 saves the template to `chat_template.jinja`, which wins over
    /// `tokenizer_config.json`'s (as transformers reads it), with or without that file.
    #[test]
    fn a_chat_template_jinja_file_is_the_template() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("chat_template.jinja"), "J{{ messages[0]['content'] }}").unwrap();
        let read = |d: &Path| ChatTemplate::from_tokenizer_dir(d).unwrap().render(&[msg("user", "x")], false).unwrap();
        assert_eq!(read(dir.path()), "Jx");
        std::fs::write(dir.path().join("tokenizer_config.json"), r#"{"chat_template": "C", "eos_token": "</s>"}"#)
            .unwrap();
        assert_eq!(read(dir.path()), "Jx");
        std::fs::remove_file(dir.path().join("chat_template.jinja")).unwrap();
        assert_eq!(read(dir.path()), "C");
    }

    /// A tokenizer without a beginning-of-sequence token (Qwen's) still takes completions:
    /// prompt, completion and end of text, no BOS (it used to be refused); one with a BOS
    /// starts with it.
    #[test]
    fn completions_need_no_bos_token() {
        use tokenizers::models::wordlevel::WordLevel;
        let words = |list: &[&str]| list.iter().enumerate().map(|(i, w)| (w.to_string(), i as u32)).collect();
        let qwen_like =
            WordLevel::builder().vocab(words(&["<|endoftext|>", "a", "b", "<unk>"])).unk_token("<unk>".into());
        let mut tok = Tokenizer::new(qwen_like.build().unwrap());
        tok.with_pre_tokenizer(Some(tokenizers::pre_tokenizers::whitespace::WhitespaceSplit));
        let sample = completion_sample(&tok, "a", "b").unwrap();
        assert_eq!((sample.input_ids, sample.labels), (vec![1, 2, 0], vec![IGNORE_INDEX, 2, 0]));
        let with_bos = crate::synth_chat::tokenizer(64).unwrap();
        let sample = completion_sample(&with_bos, &w(1), &w(2)).unwrap();
        assert_eq!(sample.input_ids.first().copied(), crate::tokenizer::bos_id(&with_bos));
    }
}
