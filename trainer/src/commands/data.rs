//! `llora data synth | prepare | inspect`: make, tokenise and check GovReport-schema datasets.

use std::path::Path;

use anyhow::Context;
use llora_data::Sample;
use llora_data::parquet_io::{OnBadRow, ReadOptions, for_each_row, parquet_bytes};
use llora_data::synth::{Synth, SynthConfig};
use llora_data::text::{TextPair, read_pairs, synthetic_tokenizer, tokenize_pairs};
use llora_model::checkpoint::write_atomic;
use serde_json::json;

use crate::cli::{DataBenchArgs, DataCommand, DataFormat, InspectArgs, PrepareArgs, SynthArgs};

/// Runs one `llora data` subcommand.
pub fn run(command: &DataCommand) -> anyhow::Result<()> {
    match command {
        DataCommand::Synth(a) => synth(a),
        DataCommand::Prepare(a) => prepare(a),
        DataCommand::Inspect(a) => inspect(a),
        DataCommand::Bench(a) => bench(a),
        DataCommand::BenchTokenizer(a) => bench_tokenizer(a),
    }
}

fn write_jsonl(path: &Path, pairs: &[TextPair]) -> anyhow::Result<()> {
    let mut text = String::new();
    for p in pairs {
        text += &serde_json::to_string(p)?;
        text.push('\n');
    }
    write_atomic(path, text.as_bytes())
}

/// Both splits as raw text (SCROLLS `input`/`output` jsonl) and MLPerf parquet, plus the
/// word-level `tokenizer.json` that maps one onto the other.
fn synth(a: &SynthArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        a.train >= 1 && a.eval >= 1,
        "--train ({}) and --eval ({}) must each be at least 1",
        a.train,
        a.eval
    );
    // Sizes are checked before anything is allocated (4e9 words or 1e11-token documents were
    // OOM kills).
    const MAX_VOCAB: usize = 1 << 21;
    anyhow::ensure!(
        a.vocab <= MAX_VOCAB,
        "--vocab {}: the synthetic tokenizer holds one word per id, at most {MAX_VOCAB} (Llama 2 has 32000, Llama 3 128256)",
        a.vocab
    );
    // Token ids and labels (i64) and the text, ~24 bytes a token, for documents of at most max_seq_len.
    let need = (a.train as f64 + a.eval as f64) * a.max_seq_len as f64 * 24.0;
    if let Some(total) = crate::plan::total_memory_bytes() {
        anyhow::ensure!(
            need <= total,
            "--train {} + --eval {} documents of up to --max-seq-len {} tokens need up to {:.1} GiB in memory; this \
             machine has {:.1} GiB: lower --max-seq-len or the counts",
            a.train,
            a.eval,
            a.max_seq_len,
            need / crate::plan::GB,
            total / crate::plan::GB
        );
    }
    let synth = Synth::new(SynthConfig {
        vocab: a.vocab,
        max_seq_len: a.max_seq_len,
        topics: a.topics,
        seed: a.seed,
        ..SynthConfig::default()
    })?;
    crate::paths::ensure_new_output("--out", &a.out, Some(a.overwrite))?;
    // The whole directory is swapped for the new one: with --overwrite it may hold only what
    // this command writes.
    let written: &[&str] = if a.chat {
        &["train.jsonl", "validation.jsonl", "tokenizer.json", "tokenizer_config.json"]
    } else {
        &["train.jsonl", "validation.jsonl", "train.parquet", "validation.parquet", "tokenizer.json"]
    };
    crate::paths::ensure_only_own_files("--out", &a.out, written)?;
    if a.chat {
        return synth_chat(a, &synth);
    }
    crate::paths::write_dir_atomic(&a.out, |out| {
        for (split, name, n) in [(0, "train", a.train), (1, "validation", a.eval)] {
            let docs = synth.documents(split, n);
            let pairs: Vec<TextPair> =
                docs.iter().map(|d| d.text()).map(|(input, output)| TextPair { input, output }).collect();
            write_jsonl(&out.join(format!("{name}.jsonl")), &pairs)?;
            let samples: Vec<Sample> = docs.iter().map(|d| d.sample()).collect();
            write_atomic(&out.join(format!("{name}.parquet")), &parquet_bytes(&samples)?)?;
        }
        let tok = synthetic_tokenizer(a.vocab)?;
        let json = tok.to_string(true).map_err(|e| anyhow::anyhow!("serialising the tokenizer: {e}"))?;
        write_atomic(&out.join("tokenizer.json"), json.as_bytes())
    })?;
    crate::outln!(
        "{}",
        json!({"out": a.out.display().to_string(), "train": a.train, "eval": a.eval, "vocab": a.vocab})
    );
    Ok(())
}

/// `llora data synth --chat`: both splits as conversation rows (`train.jsonl`,
/// `validation.jsonl`) and the Llama-3-style tokenizer directory (`tokenizer.json`,
/// `tokenizer_config.json` with the chat template) that `llora data prepare --format chat`
/// and `llora generate --chat` take.
fn synth_chat(a: &SynthArgs, synth: &Synth) -> anyhow::Result<()> {
    use llora_data::synth_chat::{SPECIAL_TOKENS, conversation, tokenizer, tokenizer_config};
    crate::paths::write_dir_atomic(&a.out, |out| {
        for (split, name, n) in [(0, "train", a.train), (1, "validation", a.eval)] {
            let mut text = String::new();
            for doc in synth.documents(split, n) {
                text += &conversation(&doc).to_string();
                text.push('\n');
            }
            write_atomic(&out.join(format!("{name}.jsonl")), text.as_bytes())?;
        }
        let json =
            tokenizer(a.vocab)?.to_string(true).map_err(|e| anyhow::anyhow!("serialising the tokenizer: {e}"))?;
        write_atomic(&out.join("tokenizer.json"), json.as_bytes())?;
        write_atomic(&out.join("tokenizer_config.json"), serde_json::to_string_pretty(&tokenizer_config())?.as_bytes())
    })?;
    crate::outln!(
        "{}",
        json!({"out": a.out.display().to_string(), "train": a.train, "eval": a.eval, "vocab": a.vocab,
               "model_vocab": a.vocab + SPECIAL_TOKENS, "format": "chat"})
    );
    Ok(())
}

/// Raw rows → MLPerf-schema parquet through a tokenizer: SCROLLS pairs with the benchmark's
/// template, conversations through the chat template, or prompt/completion pairs.
fn prepare(a: &PrepareArgs) -> anyhow::Result<()> {
    crate::paths::ensure_not_an_input("--out", &a.out, &[("--input", &a.input), ("--tokenizer", &a.tokenizer)])?;
    crate::paths::ensure_new_output("--out", &a.out, Some(a.overwrite))?;
    crate::paths::ensure_folder_exists("--out", &a.out)?;
    let tok = llora_data::tokenizer::load_tokenizer(&a.tokenizer)?;
    if a.format == DataFormat::Preference {
        return prepare_pairs(a, &tok);
    }
    if a.format != DataFormat::Chat {
        // The tokenizer's fault, said once (not as every row's).
        llora_data::tokenizer::special_ids(&tok).with_context(|| format!("--tokenizer {}", a.tokenizer.display()))?;
    }
    // Rows this long cannot fit --max-seq-len: skipped unread rather than tokenised whole.
    let max_bytes = Some(llora_data::tokenizer::max_row_bytes(&tok, a.max_seq_len));
    let (rows, samples, dropped, bad) = match a.format {
        DataFormat::Mlperf => {
            let (pairs, too_long) = read_pairs(&a.input, max_bytes)?;
            let out = tokenize_pairs(&tok, &pairs, a.max_seq_len)
                .with_context(|| format!("tokenising {}", a.input.display()))?;
            (pairs.len() + too_long, out.samples, out.dropped.len() + too_long, 0)
        }
        DataFormat::Chat | DataFormat::Completion => instruction_samples(a, &tok, max_bytes)?,
        DataFormat::Preference => unreachable!("prepared above"),
    };
    if dropped > 0 {
        tracing::warn!(dropped, max_seq_len = a.max_seq_len, "samples longer than max_seq_len dropped");
    }
    anyhow::ensure!(
        !samples.is_empty(),
        "{}: no usable sample ({rows} rows: {dropped} longer than --max-seq-len {}, {bad} bad): nothing written to {}",
        a.input.display(),
        a.max_seq_len,
        a.out.display()
    );
    write_atomic(&a.out, &parquet_bytes(&samples)?)?;
    crate::outln!(
        "{}",
        json!({"rows": rows, "written": samples.len(), "dropped_too_long": dropped, "bad_rows": bad,
               "out": a.out.display().to_string(), "peak_rss_mb": crate::engine::observe::peak_rss_mb()})
    );
    Ok(())
}

/// `--format preference`: every row tokenised as TRL's DPOTrainer does
/// ([`llora_data::preference::tokenize_pair`]), pairs longer than `--max-seq-len` dropped and
/// counted (TRL truncates them instead), a bad row an error naming it unless `--skip-bad-rows`.
fn prepare_pairs(a: &PrepareArgs, tok: &llora_data::Tokenizer) -> anyhow::Result<()> {
    use llora_data::chat::ChatTemplate;
    use llora_data::preference::{pairs_parquet_bytes, tokenize_pair};
    let template = ChatTemplate::for_tokenizer(&a.tokenizer).ok();
    // TRL appends the tokenizer's eos_token text (tokenizer_config.json's) to text completions.
    let eos = match template.as_ref().and_then(ChatTemplate::eos_token) {
        Some(t) => t.to_string(),
        None => {
            let id = llora_data::tokenizer::end_of_text_id(tok)?;
            tok.id_to_token(id)
                .with_context(|| format!("--tokenizer {}: no text for token {id}", a.tokenizer.display()))?
        }
    };
    let rows = llora_data::rows::read_rows(&a.input, Some(llora_data::tokenizer::max_row_bytes(tok, a.max_seq_len)))?;
    let (mut pairs, mut dropped, mut bad) = (Vec::new(), 0, 0);
    for raw in &rows {
        let Some(row) = &raw.value else {
            dropped += 1;
            continue;
        };
        match tokenize_pair(tok, template.as_ref(), &eos, row) {
            Ok(p) if p.chosen.input_ids.len().max(p.rejected.input_ids.len()) > a.max_seq_len => dropped += 1,
            Ok(p) => pairs.push(p),
            Err(why) if a.skip_bad_rows => {
                tracing::warn!("{}: {} skipped: {why}", a.input.display(), raw.place);
                bad += 1;
            }
            Err(why) => anyhow::bail!("{}: {}: {why} (--skip-bad-rows skips such rows)", a.input.display(), raw.place),
        }
    }
    anyhow::ensure!(
        !pairs.is_empty(),
        "{}: no usable pair ({} rows): nothing written to {}",
        a.input.display(),
        rows.len(),
        a.out.display()
    );
    write_atomic(&a.out, &pairs_parquet_bytes(&pairs)?)?;
    crate::outln!(
        "{}",
        json!({"rows": rows.len(), "written": pairs.len(), "dropped_too_long": dropped, "bad_rows": bad,
               "out": a.out.display().to_string()})
    );
    Ok(())
}

/// `--format chat|completion`: (rows, samples, dropped as too long, bad rows skipped); a bad
/// row stops the command naming it unless `--skip-bad-rows`.
fn instruction_samples(
    a: &PrepareArgs,
    tok: &llora_data::Tokenizer,
    max_bytes: Option<usize>,
) -> anyhow::Result<(usize, Vec<Sample>, usize, usize)> {
    use llora_data::chat::{ChatTemplate, chat_sample, completion_sample, parse_messages};
    use llora_data::rows::read_rows;
    let template = match a.format {
        DataFormat::Chat => Some(ChatTemplate::for_tokenizer(&a.tokenizer)?),
        _ => None,
    };
    let rows = read_rows(&a.input, max_bytes)?;
    let plain = llora_data::tokenizer::plain(tok);
    let (mut samples, mut dropped, mut bad) = (Vec::with_capacity(rows.len()), 0, 0);
    for raw in &rows {
        let Some(row) = &raw.value else {
            dropped += 1;
            continue;
        };
        let sample = match &template {
            Some(t) => parse_messages(row).and_then(|m| chat_sample(tok, t, &m)),
            None => {
                match (row.get("prompt").and_then(|p| p.as_str()), row.get("completion").and_then(|c| c.as_str())) {
                    (Some(p), Some(c)) => completion_sample(&plain, p, c),
                    _ => Err("expected string fields \"prompt\" and \"completion\"".to_string()),
                }
            }
        };
        let place = raw.place;
        match sample {
            Ok(s) if s.input_ids.len() > a.max_seq_len => dropped += 1,
            Ok(s) => samples.push(s),
            Err(why) if a.skip_bad_rows => {
                tracing::warn!("{}: {place} skipped: {why}", a.input.display());
                bad += 1;
            }
            Err(why) => {
                anyhow::bail!("{}: {place}: {why} (--skip-bad-rows skips such rows)", a.input.display())
            }
        }
    }
    Ok((rows.len(), samples, dropped, bad))
}

/// Rows, lengths, target tokens and every bad row of a file; fails if any row is bad.
fn inspect(a: &InspectArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        a.pack_window >= 1,
        "--pack-window {}: must be at least 1 (samples packed together)",
        a.pack_window
    );
    let opts = ReadOptions { vocab: a.vocab, max_seq_len: a.max_seq_len, on_bad_row: OnBadRow::Skip };
    let (mut lens, mut targets) = (Vec::new(), Vec::new());
    let report = for_each_row(&a.file, &opts, |s| {
        lens.push(s.input_ids.len());
        targets.push(s.target_tokens());
    })?;
    crate::outln!("{}: {} rows, {} valid, {} bad", a.file.display(), report.rows, lens.len(), report.skipped);
    anyhow::ensure!(report.rows > 0, "{}: the file has no rows", a.file.display());
    let buckets = 8;
    let width = a.max_seq_len.div_ceil(buckets).max(1);
    let mut hist = vec![0usize; buckets];
    for &l in &lens {
        hist[((l.saturating_sub(1)) / width).min(buckets - 1)] += 1;
    }
    crate::outln!("length histogram (tokens):");
    for (i, n) in hist.iter().enumerate() {
        crate::outln!("  {:>6}..{:<6} {n:>8}", i * width + 1, ((i + 1) * width).min(a.max_seq_len));
    }
    let total: usize = targets.iter().sum();
    crate::outln!(
        "target tokens: total {total}, per row min {} mean {:.1} max {}",
        targets.iter().min().unwrap_or(&0),
        total as f64 / targets.len().max(1) as f64,
        targets.iter().max().unwrap_or(&0)
    );
    // Rows of max_seq_len tokens: one sample each (padded) or packed (`data.packing`).
    let packing = llora_data::packing::Packing { seq_len: a.max_seq_len, window: a.pack_window };
    let packed = llora_data::packing::stats(&lens, packing);
    let tokens: usize = lens.iter().sum();
    let padded_efficiency = tokens as f64 / (lens.len().max(1) * a.max_seq_len) as f64;
    crate::outln!(
        "rows of {} tokens: padded {} ({:.1}% tokens, the rest padding), packed {} ({:.1}% tokens; window {})",
        a.max_seq_len,
        lens.len(),
        100.0 * padded_efficiency,
        packed.rows,
        100.0 * packed.efficiency,
        packing.window
    );
    for p in &report.problems {
        crate::outln!("bad {p}");
    }
    crate::outln!(
        "{}",
        json!({"rows": report.rows, "valid": lens.len(), "bad": report.skipped, "target_tokens": total, "histogram": hist,
            "tokens": tokens, "padded_rows": lens.len(), "padded_efficiency": padded_efficiency,
            "packed_rows": packed.rows, "packing_efficiency": packed.efficiency})
    );
    anyhow::ensure!(
        report.skipped == 0,
        "{}: {} bad rows (first: {})",
        a.file.display(),
        report.skipped,
        report.problems[0]
    );
    Ok(())
}

/// Times what the loader does per step (order, gather, pad, collate, hand-over through the
/// prefetch queues) with the data already read, as the trainer uses it; each batch becomes a
/// LibTorch CPU tensor, as the step's input does.
fn bench(a: &DataBenchArgs) -> anyhow::Result<()> {
    use burn::tensor::{Device, Int, Tensor, TensorData};
    use llora_data::batch::{Geometry, Padding, eval_batches, train_batches};
    use llora_data::loader::{Position, SampleOrder};
    use std::sync::Arc;
    use std::time::Instant;
    let flag = |key: &str| format!("`{key}`");
    let mut p = crate::config::Problems::new(&flag);
    for &w in &a.workers {
        crate::config::check_workers(&mut p, "--workers", w);
    }
    for &w in &a.eval_workers {
        crate::config::check_workers(&mut p, "--eval-workers", w);
    }
    p.finish()
        .map_err(|problems| anyhow::anyhow!("invalid llora data bench flags:\n  - {}", problems.join("\n  - ")))?;
    let opts = ReadOptions { vocab: a.vocab, max_seq_len: a.max_seq_len, on_bad_row: OnBadRow::Error };
    let t = Instant::now();
    let (train, _) = llora_data::parquet_io::read_parquet(&a.train, &opts)?;
    let (eval, _) = llora_data::parquet_io::read_parquet(&a.eval, &opts)?;
    let read_s = t.elapsed().as_secs_f64();
    for (flag, path, rows) in [("--train", &a.train, train.len()), ("--eval", &a.eval, eval.len())] {
        anyhow::ensure!(rows > 0, "{flag} {}: no rows to time", path.display());
    }
    let (train, eval) = (Arc::new(train), Arc::new(eval));
    #[allow(deprecated)]
    let device = Device::libtorch();
    let to_tensor = |c: llora_data::batch::Collated| {
        Tensor::<2, Int>::from_data(TensorData::new(c.input_ids, [c.batch, c.seq]), &device)
    };
    crate::outln!("read {} train + {} eval rows in {read_s:.2} s", train.len(), eval.len());
    crate::outln!("{:<22} {:>8} {:>12} {:>14}", "stream", "workers", "seq/s", "tokens/s");
    for &w in &a.workers {
        let order = SampleOrder::new(train.len(), 1, true, Position::default())?;
        let t = Instant::now();
        let (mut seqs, mut tokens) = (0usize, 0usize);
        for batch in train_batches(
            train.clone(),
            llora_data::batch::RowOrder::Samples(order),
            Geometry { global: a.global_batch, micro: 1, rank: 0, world: 1 },
            Padding::Longest,
            w,
        )
        .take(a.steps)
        {
            seqs += batch.lengths.len();
            tokens += batch.lengths.iter().sum::<usize>();
            batch.micro_batches.into_iter().for_each(|m| drop(to_tensor(m)));
        }
        let s = t.elapsed().as_secs_f64();
        crate::outln!("{:<22} {w:>8} {:>12.0} {:>14.0}", "train batches", seqs as f64 / s, tokens as f64 / s);
    }
    for &w in &a.eval_workers {
        let t = Instant::now();
        let tokens: usize = eval.iter().map(|x| x.input_ids.len()).sum();
        let rows = Arc::new(llora_data::batch::eval_rows(&eval, None));
        eval_batches(eval.clone(), rows, 1, (0, 1), (Padding::Longest, false), w).for_each(|m| drop(to_tensor(m)));
        let s = t.elapsed().as_secs_f64();
        crate::outln!(
            "{:<22} {w:>8} {:>12.0} {:>14.0}   one pass {s:.3} s",
            "eval pass",
            eval.len() as f64 / s,
            tokens as f64 / s
        );
    }
    Ok(())
}

/// English-like text: common words, numbers, punctuation and line breaks in proportions like a
/// government report's, from a fixed seed; `n` words.
fn report_text(rng: &mut impl rand::Rng, n: usize) -> String {
    const WORDS: &[&str] = &[
        "the",
        "of",
        "and",
        "to",
        "in",
        "a",
        "for",
        "that",
        "is",
        "on",
        "agency",
        "agencies",
        "report",
        "federal",
        "program",
        "programs",
        "department",
        "GAO",
        "costs",
        "funding",
        "management",
        "information",
        "Congress",
        "recommended",
        "officials",
        "data",
        "oversight",
        "contracts",
        "implementation",
        "requirements",
        "fiscal",
        "year",
        "billion",
        "million",
        "percent",
        "analysis",
        "performance",
        "Defense",
        "Health",
        "Services",
        "accountability",
        "infrastructure",
        "cybersecurity",
        "acquisition",
        "veterans",
        "Medicare",
        "regulations",
        "stakeholders",
        "estimated",
        "approximately",
        "additionally",
        "however",
        "therefore",
        "significant",
    ];
    let mut out = String::with_capacity(n * 8);
    for i in 0..n {
        if i > 0 {
            out.push_str(match rng.random_range(0..40) {
                0 => ".\n",
                1..=3 => ", ",
                4 => ". ",
                _ => " ",
            });
        }
        if rng.random_range(0..25) == 0 {
            out.push_str(&format!("{}", rng.random_range(1..100_000u32)));
        } else {
            out.push_str(WORDS[rng.random_range(0..WORDS.len())]);
        }
    }
    out
}

/// Times `data prepare`'s tokenisation (prompt and summary of every pair, batch encoding on all
/// cores) on a generated corpus of `docs` reports.
fn bench_tokenizer(a: &crate::cli::TokenizerBenchArgs) -> anyhow::Result<()> {
    use rand::SeedableRng;
    use std::time::Instant;
    let tokenizer = llora_data::tokenizer::load_tokenizer(&a.tokenizer)?;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    let t = Instant::now();
    let pairs: Vec<TextPair> = (0..a.docs)
        .map(|_| TextPair { input: report_text(&mut rng, a.words), output: report_text(&mut rng, a.summary_words) })
        .collect();
    let gen_s = t.elapsed().as_secs_f64();
    let bytes: usize = pairs.iter().map(|p| p.input.len() + p.output.len()).sum();
    let t = Instant::now();
    let out = llora_data::text::tokenize_pairs(&tokenizer, &pairs, usize::MAX)?;
    let s = t.elapsed().as_secs_f64();
    let tokens: usize = out.samples.iter().map(|x| x.input_ids.len()).sum();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    crate::outln!("generated {} reports ({:.0} MB of text) in {gen_s:.1} s", a.docs, bytes as f64 / 1e6);
    crate::outln!(
        "| tokenizer | reports | words/report | tokens | threads | seconds | documents/s | tokens/s | MB/s |"
    );
    crate::outln!("|---|---|---|---|---|---|---|---|---|");
    crate::outln!(
        "| {} | {} | {} + {} | {tokens} | {threads} | {s:.1} | {:.0} | {:.0} | {:.1} |",
        a.tokenizer.display(),
        a.docs,
        a.words,
        a.summary_words,
        a.docs as f64 / s,
        tokens as f64 / s,
        bytes as f64 / s / 1e6
    );
    Ok(())
}
