//! A synthetic GovReport-shaped corpus: long "reports" and short "summaries" that are a
//! learnable function of their report, in the MLPerf token layout, with no download.
//!
//! Token space, Llama-like: 0 `<unk>` (also padding), 1 `<s>`, 2 `</s>`, 3..=8 the template
//! words `###`, `Summarize`, `the`, `following`, `text:`, `Summary:`, 9..=11 the chat roles;
//! content tokens from 16, each a made-up word ([`word`]). [`tokenizer_vocab`] lists them all, so the same corpus
//! exists as text (SCROLLS' `input`/`output`) and as MLPerf token ids, and a word-level
//! tokenizer maps one onto the other exactly.
//! Each report is written about one of `topics` topics: its tokens follow that topic's Zipf
//! distribution over its own slice of the vocabulary. Its summary is the topic's fixed
//! `summary_len`-token abstract followed by the report's first `copy_len` tokens, then EOS. A
//! model must therefore recognise the topic from the report (attention over many tokens) and
//! copy from its start, so the eval loss on summaries falls far below their unigram entropy
//! only when it learns both.

use rand::distr::{Distribution, weighted::WeightedIndex};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::{IGNORE_INDEX, Sample};

/// Beginning of sequence.
pub const BOS: u32 = 1;
/// End of sequence (the `</s>` after each summary).
pub const EOS: u32 = 2;
/// `### Summarize the following text:` as tokens.
pub const PROMPT: [u32; 5] = [3, 4, 5, 6, 7];
/// `### Summary:` as tokens.
pub const SUMMARY_MARK: [u32; 2] = [3, 8];
/// First content token id.
pub const FIRST_CONTENT: u32 = 16;
/// The words of ids 0..=11: the MLPerf template's, then the chat roles (the corpus in chat
/// form, [`crate::synth_chat`]); ids 12..16 are unused (`<unused_N>`).
pub const SPECIAL_WORDS: [&str; 12] = [
    "<unk>",
    "<s>",
    "</s>",
    "###",
    "Summarize",
    "the",
    "following",
    "text:",
    "Summary:",
    "system",
    "user",
    "assistant",
];

/// The made-up word of content token `id` (≥ [`FIRST_CONTENT`]): the id's base-16 digits as
/// syllables, at least two, so every id has its own word and none is a template word.
pub fn word(id: u32) -> String {
    const SYL: [&str; 16] =
        ["ka", "lo", "mi", "ru", "se", "ta", "ne", "po", "fi", "da", "gu", "be", "zo", "wa", "hi", "ye"];
    let mut k = id - FIRST_CONTENT;
    let mut w = String::new();
    for digit in 0.. {
        if k == 0 && digit >= 2 {
            break;
        }
        w += SYL[(k % 16) as usize];
        k /= 16;
    }
    w
}

/// Every token of a `vocab`-sized synthetic vocabulary as (word, id), for a tokenizer.
pub fn tokenizer_vocab(vocab: usize) -> Vec<(String, u32)> {
    (0..vocab as u32)
        .map(|id| match id {
            i if (i as usize) < SPECIAL_WORDS.len() => (SPECIAL_WORDS[i as usize].to_string(), i),
            i if i < FIRST_CONTENT => (format!("<unused_{i}>"), i),
            i => (word(i), i),
        })
        .collect()
}

/// Shape of the synthetic corpus.
#[derive(Debug, Clone, PartialEq)]
pub struct SynthConfig {
    /// Vocabulary size (content tokens are 16..vocab).
    pub vocab: usize,
    /// Longest sequence, template and summary included.
    pub max_seq_len: usize,
    /// Number of topics.
    pub topics: usize,
    /// Tokens of each topic's fixed abstract.
    pub summary_len: usize,
    /// Report tokens copied into the summary after the abstract.
    pub copy_len: usize,
    /// Seed for the topics and the samples.
    pub seed: u64,
}

impl Default for SynthConfig {
    fn default() -> Self {
        Self { vocab: 512, max_seq_len: 512, topics: 8, summary_len: 24, copy_len: 4, seed: 0 }
    }
}

struct Topic {
    words: Vec<u32>,
    weights: WeightedIndex<f64>,
    abstract_: Vec<u32>,
}

/// Generator of samples for one [`SynthConfig`].
pub struct Synth {
    config: SynthConfig,
    topics: Vec<Topic>,
}

impl Synth {
    /// Draws the topics from the seed.
    pub fn new(config: SynthConfig) -> anyhow::Result<Self> {
        let content = config.vocab.saturating_sub(FIRST_CONTENT as usize);
        let overhead =
            (2 + PROMPT.len() + SUMMARY_MARK.len()).saturating_add(config.summary_len).saturating_add(config.copy_len);
        anyhow::ensure!(content >= 64, "vocab {} leaves {content} content tokens; need at least 64", config.vocab);
        anyhow::ensure!(config.topics >= 1, "topics must be at least 1");
        // Each topic holds a quarter of the vocabulary with its weights (~16 bytes a word).
        let topic_bytes = (config.topics as f64) * ((content / 4).max(16) as f64) * 16.0;
        anyhow::ensure!(
            topic_bytes <= (1u64 << 31) as f64,
            "{} topics over a {}-token vocabulary would take {:.1} GiB; at most 2 GiB (fewer topics or a smaller vocab)",
            config.topics,
            config.vocab,
            topic_bytes / (1u64 << 30) as f64
        );
        anyhow::ensure!(
            config.max_seq_len >= overhead.saturating_add(config.copy_len.max(8).saturating_mul(4)),
            "max_seq_len {} is too short for the template and a {}-token summary",
            config.max_seq_len,
            config.summary_len + config.copy_len
        );
        let mut rng = ChaCha8Rng::seed_from_u64(config.seed);
        // Each topic writes with its own quarter of the vocabulary (slices overlap), Zipf(1.1).
        let slice = (content / 4).max(16);
        let topics = (0..config.topics)
            .map(|_| {
                let start = rng.random_range(0..content - slice + 1) as u32;
                let mut words: Vec<u32> = (0..slice as u32).map(|i| FIRST_CONTENT + start + i).collect();
                // Shuffle which words are frequent, so topics sharing words rank them differently.
                for i in (1..words.len()).rev() {
                    words.swap(i, rng.random_range(0..=i));
                }
                let weights =
                    WeightedIndex::new((1..=slice).map(|r| 1.0 / (r as f64).powf(1.1))).expect("positive weights");
                let abstract_ = (0..config.summary_len).map(|_| words[rng.random_range(0..slice)]).collect();
                Topic { words, weights, abstract_ }
            })
            .collect();
        Ok(Self { config, topics })
    }

    /// The configuration.
    pub fn config(&self) -> &SynthConfig {
        &self.config
    }

    /// `n` samples of the stream `split` (e.g. 0 = train, 1 = eval): same topics, other reports.
    pub fn samples(&self, split: u64, n: usize) -> Vec<Sample> {
        self.documents(split, n).into_iter().map(|d| d.sample()).collect()
    }

    /// The same `n` samples as report/summary texts.
    pub fn documents(&self, split: u64, n: usize) -> Vec<Document> {
        let mut rng = ChaCha8Rng::seed_from_u64(self.config.seed ^ (0x9E37_79B9_7F4A_7C15u64.wrapping_mul(split + 1)));
        (0..n).map(|_| self.document(&mut rng)).collect()
    }

    fn document(&self, rng: &mut ChaCha8Rng) -> Document {
        let c = &self.config;
        let topic = &self.topics[rng.random_range(0..self.topics.len())];
        let overhead = 1 + PROMPT.len() + SUMMARY_MARK.len() + c.summary_len + c.copy_len + 1;
        let max_report = c.max_seq_len - overhead;
        // GovReport reports are long with a wide spread: lengths uniform in log space between
        // an eighth of the room and all of it.
        let (lo, hi) = (((max_report / 8).max(c.copy_len)) as f64, max_report as f64);
        let len = (lo * (hi / lo).powf(rng.random::<f64>())).round().clamp(lo, hi) as usize;
        let report: Vec<u32> = (0..len).map(|_| topic.words[topic.weights.sample(rng)]).collect();
        let mut summary = topic.abstract_.clone();
        summary.extend(&report[..c.copy_len]);
        Document { report, summary }
    }
}

/// One synthetic report and its summary, as content token ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Document {
    /// The report's tokens.
    pub report: Vec<u32>,
    /// The summary's tokens (without `</s>`).
    pub summary: Vec<u32>,
}

impl Document {
    /// The MLPerf sample: `<s>` prompt report `### Summary:` summary `</s>`, loss on the
    /// summary and `</s>` only.
    pub fn sample(&self) -> Sample {
        let mut ids = vec![BOS];
        ids.extend(PROMPT);
        ids.extend(&self.report);
        ids.extend(SUMMARY_MARK);
        let prompt_len = ids.len();
        ids.extend(&self.summary);
        ids.push(EOS);
        let labels =
            ids.iter().enumerate().map(|(i, &t)| if i < prompt_len { IGNORE_INDEX } else { t as i64 }).collect();
        Sample { input_ids: ids, labels }
    }

    /// The texts SCROLLS stores: (`input`, `output`), words separated by spaces.
    pub fn text(&self) -> (String, String) {
        let join = |ids: &[u32]| ids.iter().map(|&t| word(t)).collect::<Vec<_>>().join(" ");
        (join(&self.report), join(&self.summary))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_matches_the_mlperf_template() {
        let s = Synth::new(SynthConfig::default()).unwrap();
        for sample in s.samples(0, 20) {
            let ids = &sample.input_ids;
            assert_eq!(ids[0], BOS);
            assert_eq!(&ids[1..6], &PROMPT);
            assert_eq!(*ids.last().unwrap(), EOS);
            // Summary = abstract + copy + EOS = 24 + 4 + 1 labelled tokens; the rest is -100.
            let labelled: Vec<usize> = (0..ids.len()).filter(|&i| sample.labels[i] != IGNORE_INDEX).collect();
            assert_eq!(labelled.len(), 29);
            assert_eq!(labelled[0], ids.len() - 29);
            assert_eq!(&ids[labelled[0] - 2..labelled[0]], &SUMMARY_MARK);
            // The copied tokens are the report's first four.
            assert_eq!(&ids[ids.len() - 5..ids.len() - 1], &ids[6..10]);
            sample.validate(512, 512).unwrap();
        }
    }

    #[test]
    fn words_are_unique_and_not_template_words() {
        let vocab = tokenizer_vocab(32000);
        let mut seen = std::collections::HashSet::new();
        for (w, id) in &vocab {
            assert!(seen.insert(w.clone()), "word {w} of id {id} repeats");
            assert!(!w.contains(char::is_whitespace));
        }
        assert_eq!(word(16), "kaka");
        assert_eq!(word(17), "loka");
        assert_eq!(word(16 + 256), "kakalo");
    }

    #[test]
    fn deterministic_and_splits_differ() {
        let a = Synth::new(SynthConfig { seed: 5, ..Default::default() }).unwrap();
        let b = Synth::new(SynthConfig { seed: 5, ..Default::default() }).unwrap();
        assert_eq!(a.samples(0, 10), b.samples(0, 10));
        assert_ne!(a.samples(0, 10), a.samples(1, 10));
    }

    #[test]
    fn lengths_spread_up_to_the_limit() {
        let s = Synth::new(SynthConfig { max_seq_len: 1024, ..Default::default() }).unwrap();
        let lens: Vec<usize> = s.samples(0, 400).iter().map(|x| x.input_ids.len()).collect();
        assert!(lens.iter().all(|&l| l <= 1024));
        assert!(*lens.iter().max().unwrap() > 900 && *lens.iter().min().unwrap() < 250, "{lens:?}");
    }
}
