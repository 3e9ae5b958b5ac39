//! Preference pairs (DPO): a prompt with a chosen and a rejected completion, each stored as a
//! whole sample (prompt + completion, labels only on the completion), as TRL's collator lays
//! them out. A micro-batch of P pairs is 2P rows: the chosen ones, then the rejected ones in
//! the same order (one forward for both, as TRL's concatenation).

use std::path::Path;
use std::sync::Arc;

use crate::batch::{Collated, Geometry, Padding, RowOrder, StepBatch, collate};
use crate::loader::Position;
use crate::parquet_io::{ReadOptions, ReadReport, columns_bytes, for_each_batch, list_column, sample_at};
use crate::prefetch::{Prefetched, prefetch};
use crate::synth::{Document, Synth};
use crate::{IGNORE_INDEX, Sample};

/// One preference pair.
#[derive(Debug, Clone, PartialEq)]
pub struct Pair {
    /// Prompt + the chosen completion.
    pub chosen: Sample,
    /// Prompt + the rejected completion.
    pub rejected: Sample,
    /// The reference's loss sums (−Σ log p over each completion's target tokens) of the
    /// chosen and the rejected completion, when computed before training
    /// (`dpo.precompute_reference`); `None`: the step computes them.
    pub reference: Option<[f64; 2]>,
}

impl Pair {
    /// Both completions have a target token and share their prompt (the tokens before the
    /// first label).
    pub fn validate(&self) -> Result<(), String> {
        let prompt = |s: &Sample| s.labels.iter().position(|&l| l != IGNORE_INDEX);
        let (Some(c), Some(r)) = (prompt(&self.chosen), prompt(&self.rejected)) else {
            return Err("a completion has no target token (every label is -100)".into());
        };
        if self.chosen.input_ids[..c] != self.rejected.input_ids[..r] {
            return Err(format!(
                "chosen and rejected do not share their prompt ({c} and {r} tokens before the labels)"
            ));
        }
        Ok(())
    }
}

/// The pairs of a parquet (or Arrow IPC) file with the columns `chosen_input_ids`,
/// `chosen_labels`, `rejected_input_ids`, `rejected_labels` (lists of int32 or int64), each
/// sample validated as a supervised row is ([`Sample::validate`]) and the pair by
/// [`Pair::validate`]; a bad row is an error naming the file, the row and the reason, or is
/// skipped under `OnBadRow::Skip`.
pub fn read_pairs(path: &Path, opts: &ReadOptions) -> anyhow::Result<(Vec<Pair>, ReadReport)> {
    let (mut pairs, mut report) = (Vec::new(), ReadReport::default());
    for_each_batch(path, |batch, _| {
        let col = |name: &str| list_column(batch, name, path);
        let (ci, cl, ri, rl) =
            (col("chosen_input_ids")?, col("chosen_labels")?, col("rejected_input_ids")?, col("rejected_labels")?);
        for r in 0..batch.num_rows() {
            let row = report.rows;
            report.rows += 1;
            let pair = (|| {
                let chosen = sample_at((ci, cl, None), r, opts).map_err(|e| format!("chosen: {e}"))?;
                let rejected = sample_at((ri, rl, None), r, opts).map_err(|e| format!("rejected: {e}"))?;
                let pair = Pair { chosen, rejected, reference: None };
                pair.validate()?;
                Ok(pair)
            })();
            report.take(pair, row, path, opts.on_bad_row, &mut |p| pairs.push(p))?;
        }
        Ok(())
    })?;
    Ok((pairs, report))
}

/// Pairs as the bytes of one parquet file in [`read_pairs`]'s schema.
pub fn pairs_parquet_bytes(pairs: &[Pair]) -> anyhow::Result<Vec<u8>> {
    let chosen: Vec<&Sample> = pairs.iter().map(|p| &p.chosen).collect();
    let rejected: Vec<&Sample> = pairs.iter().map(|p| &p.rejected).collect();
    columns_bytes(&[("chosen_", &chosen), ("rejected_", &rejected)])
}

/// `n` synthetic pairs of the stream `split`: each report's own summary (its topic's abstract,
/// then the report's first words) chosen, and rejected the same summary under another topic's
/// abstract (the rule the chosen follows and the rejected breaks: the abstract is the report's
/// topic's).
pub fn synthetic_pairs(synth: &Synth, split: u64, n: usize) -> Vec<Pair> {
    let abstract_len = synth.config().summary_len;
    let docs = synth.documents(split, n);
    let abstract_of = |d: &Document| d.summary[..abstract_len].to_vec();
    (0..docs.len())
        .map(|i| {
            let d = &docs[i];
            // The next report of another topic (every report's own when all share one topic).
            let other = (1..docs.len()).map(|k| &docs[(i + k) % docs.len()]).find(|o| abstract_of(o) != abstract_of(d));
            let wrong_abstract = other.map_or_else(|| abstract_of(d).into_iter().rev().collect(), abstract_of);
            let summary = [&wrong_abstract[..], &d.summary[abstract_len..]].concat();
            let wrong = Document { report: d.report.clone(), summary };
            Pair { chosen: d.sample(), rejected: wrong.sample(), reference: None }
        })
        .collect()
}

/// One raw preference row as TRL 1.16's `DPOTrainer` tokenises it: `prompt`, `chosen` and
/// `rejected` strings (the tokenizer's end-of-sequence text `eos` appended to each completion
/// that lacks it, every text encoded with the tokenizer's special tokens, as
/// `tokenizer(text)`), or lists of `{role, content}` messages (rendered with `template`, the
/// prompt with the generation prompt, encoded as `apply_chat_template(tokenize=True)`); prompt
/// and prompt + completion are encoded whole and the completion starts where the two token
/// lists diverge (TRL's `common_prefix_length`: a prompt whose last tokens merge with the
/// completion's loses them, as in TRL).
pub fn tokenize_pair(
    tokenizer: &tokenizers::Tokenizer,
    template: Option<&crate::chat::ChatTemplate>,
    eos: &str,
    row: &serde_json::Value,
) -> Result<Pair, String> {
    let field = |k: &str| row.get(k).ok_or(format!("no \"{k}\" field"));
    let (prompt, chosen, rejected) = (field("prompt")?, field("chosen")?, field("rejected")?);
    let encode = |text: &str, special: bool| -> Result<Vec<u32>, String> {
        tokenizer.encode(text, special).map(|e| e.get_ids().to_vec()).map_err(|e| format!("tokenising: {e}"))
    };
    let (p, pc, pr) = match (prompt, chosen, rejected) {
        (serde_json::Value::String(p), serde_json::Value::String(c), serde_json::Value::String(r)) => {
            let with_eos = |t: &str| if t.ends_with(eos) { t.to_string() } else { format!("{t}{eos}") };
            (
                encode(p, true)?,
                encode(&format!("{p}{}", with_eos(c)), true)?,
                encode(&format!("{p}{}", with_eos(r)), true)?,
            )
        }
        (serde_json::Value::Array(p), serde_json::Value::Array(c), serde_json::Value::Array(r)) => {
            let template = template.ok_or("conversational pairs need the tokenizer's chat template")?;
            let messages = |list: Vec<serde_json::Value>| -> Result<Vec<crate::chat::Message>, String> {
                crate::chat::parse_messages(&serde_json::json!({ "messages": list }))
            };
            let render = |m: &[crate::chat::Message], generation: bool| {
                template.render(m, generation).map_err(|e| format!("{e:#}"))
            };
            let both = |completion: &Vec<serde_json::Value>| messages([p.clone(), completion.clone()].concat());
            let (mc, mr) = (both(c)?, both(r)?);
            let mp = &mc[..p.len()];
            (
                encode(&render(mp, true)?, false)?,
                encode(&render(&mc, false)?, false)?,
                encode(&render(&mr, false)?, false)?,
            )
        }
        _ => return Err("prompt, chosen and rejected must all be strings or all be lists of messages".into()),
    };
    let common = |a: &[u32], b: &[u32]| a.iter().zip(b).take_while(|(x, y)| x == y).count();
    let prompt_len = common(&p, &pc).min(common(&p, &pr));
    let sample = |ids: Vec<u32>| -> Result<Sample, String> {
        if ids.len() <= prompt_len {
            return Err("a completion encodes to no token".into());
        }
        let labels =
            ids.iter().enumerate().map(|(j, &t)| if j < prompt_len { IGNORE_INDEX } else { i64::from(t) }).collect();
        Ok(Sample { input_ids: ids, labels })
    };
    let pair = Pair { chosen: sample(pc)?, rejected: sample(pr)?, reference: None };
    pair.validate()?;
    Ok(pair)
}

/// Collates `pairs` as one micro-batch: the chosen samples, then the rejected ones, with their
/// precomputed reference sums in the same order when every pair has them.
pub fn collate_pairs(pairs: &[&Pair], padding: Padding) -> Collated {
    let rows: Vec<&Sample> = pairs.iter().map(|p| &p.chosen).chain(pairs.iter().map(|p| &p.rejected)).collect();
    let reference: Option<Vec<[f64; 2]>> = pairs.iter().map(|p| p.reference).collect();
    Collated {
        reference: reference.map(|r| r.iter().map(|[c, _]| *c).chain(r.iter().map(|[_, rj]| *rj)).collect()),
        ..collate(&rows, padding)
    }
}

/// The endless stream of global batches of pairs drawn by `order` (over pair indices; one order
/// for every rank), `geometry` counting pairs; the batch's token counts cover both completions.
pub fn pair_batches(
    data: Arc<Vec<Pair>>,
    mut order: RowOrder,
    geometry: Geometry,
    padding: Padding,
    workers: usize,
) -> Prefetched<StepBatch> {
    let jobs = std::iter::from_fn(move || {
        let picked: Vec<usize> = (0..geometry.global).flat_map(|_| order.next_row()).collect();
        Some((picked, order.position()))
    });
    let accum = geometry.accumulation();
    let first_micro = geometry.rank * accum;
    prefetch(jobs, workers, 2, move |(indices, position_after): (Vec<usize>, Position)| {
        let pairs: Vec<&Pair> = indices.iter().map(|&i| &data[i]).collect();
        let samples = || pairs.iter().flat_map(|p| [&p.chosen, &p.rejected]);
        StepBatch {
            micro_batches: pairs
                .chunks(geometry.micro.max(1))
                .skip(first_micro)
                .take(accum)
                .map(|m| collate_pairs(m, padding))
                .collect(),
            first_micro,
            target_tokens: samples().map(Sample::target_tokens).sum(),
            lengths: samples().map(|s| s.input_ids.len()).collect(),
            position_after,
        }
    })
}

/// Rank `rank` of `world`'s share of the evaluation pairs: batches of `batch` pairs in order,
/// batch j to rank j mod world (every pair evaluated once, whatever the world size).
pub fn eval_pair_batches(
    data: Arc<Vec<Pair>>,
    batch: usize,
    (rank, world): (usize, usize),
    padding: Padding,
    workers: usize,
) -> Prefetched<Collated> {
    let batch = batch.max(1);
    let starts = (0..data.len()).step_by(batch).skip(rank).step_by(world.max(1));
    prefetch(starts, workers, 2, move |start: usize| {
        let take: Vec<&Pair> = data[start..(start + batch).min(data.len())].iter().collect();
        collate_pairs(&take, padding)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::parquet_io::OnBadRow;
    use crate::synth::SynthConfig;

    fn opts() -> ReadOptions {
        ReadOptions { vocab: 32000, max_seq_len: 4096, on_bad_row: OnBadRow::Error }
    }

    /// Synthetic pairs share their prompt, differ only in the summary's quoted words, and round
    /// trip through parquet; a micro-batch holds the chosen rows, then the rejected ones.
    #[test]
    fn synthetic_pairs_round_trip_and_collate_chosen_first() {
        let synth = Synth::new(SynthConfig::default()).unwrap();
        let pairs = synthetic_pairs(&synth, 0, 5);
        for p in &pairs {
            p.validate().unwrap();
            assert_ne!(p.chosen, p.rejected);
            assert_eq!(p.chosen.input_ids.len(), p.rejected.input_ids.len());
        }
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("pairs.parquet");
        std::fs::write(&path, pairs_parquet_bytes(&pairs).unwrap()).unwrap();
        let (back, report) = read_pairs(&path, &opts()).unwrap();
        assert_eq!((back, report.rows), (pairs.clone(), 5));
        let c = collate_pairs(&[&pairs[0], &pairs[1]], Padding::Longest);
        let row = |i: usize| c.input_ids[i * c.seq..(i + 1) * c.seq].to_vec();
        let ids = |s: &Sample| s.input_ids.iter().map(|&t| t as i64).collect::<Vec<_>>();
        assert_eq!(c.batch, 4);
        assert_eq!(row(0)[..pairs[0].chosen.input_ids.len()], ids(&pairs[0].chosen)[..]);
        assert_eq!(row(2)[..pairs[0].rejected.input_ids.len()], ids(&pairs[0].rejected)[..]);
        assert_eq!(row(3)[..pairs[1].rejected.input_ids.len()], ids(&pairs[1].rejected)[..]);
    }

    /// A pair whose prompts differ, or whose completion has no label, is named by its row.
    #[test]
    fn bad_pairs_are_named_by_row() {
        let s = |ids: &[u32], labels: &[i64]| Sample { input_ids: ids.to_vec(), labels: labels.to_vec() };
        let (chosen, rejected) = (s(&[1, 5, 6], &[-100, -100, 6]), s(&[1, 5, 7, 8], &[-100, -100, 7, 8]));
        let good = Pair { chosen, rejected, reference: None };
        let other_prompt = Pair { rejected: s(&[1, 9, 7], &[-100, -100, 7]), ..good.clone() };
        let no_label = Pair { rejected: s(&[1, 5, 7], &[-100, -100, -100]), ..good.clone() };
        let dir = tempfile::tempdir().unwrap();
        for (bad, words) in [(other_prompt, "do not share their prompt"), (no_label, "no target token")] {
            let path = dir.path().join("bad.parquet");
            std::fs::write(&path, pairs_parquet_bytes(&[good.clone(), bad]).unwrap()).unwrap();
            let err = read_pairs(&path, &opts()).unwrap_err().to_string();
            assert!(err.contains("row 2") && err.contains(words), "{err}");
        }
    }
}
