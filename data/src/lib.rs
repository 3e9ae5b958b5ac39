//! GovReport data pipeline for llora: the MLPerf parquet schema, a synthetic GovReport-shaped
//! corpus for CPU runs and tests, and a deterministic, shardable, resumable loader.
//!
//! A [`Sample`] is one sequence as MLPerf preprocessed it: `input_ids` and `labels` of equal
//! length, labels `-100` where no loss is taken (the prompt).

pub mod batch;
pub mod chat;
pub mod loader;
pub mod packing;
pub mod parquet_io;
pub mod preference;
pub mod prefetch;
pub mod rows;
pub mod synth;
pub mod synth_chat;
pub mod text;
pub mod tokenizer;

/// The tokenizers crate's tokenizer, which the text paths take.
pub use tokenizers::Tokenizer;

/// Where a row is in its file: a JSONL file's line, or a parquet / Arrow file's row, both
/// counted from 1 (blank JSONL lines count: the number is the line an editor shows).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowPlace {
    /// Line of a `.jsonl` file.
    Line(usize),
    /// Row of a columnar file.
    Row(usize),
}

impl std::fmt::Display for RowPlace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Line(n) => write!(f, "line {n}"),
            Self::Row(n) => write!(f, "row {n}"),
        }
    }
}

/// Label value that takes no loss.
pub const IGNORE_INDEX: i64 = -100;

/// One training or evaluation sequence.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sample {
    /// Token ids, BOS first.
    pub input_ids: Vec<u32>,
    /// Same length; `-100` where no loss is taken, else equal to `input_ids` at that position.
    pub labels: Vec<i64>,
}

/// What a row's error says when the row holds more tokens than the run's sequence length.
pub const TOO_LONG: &str = "is longer than max_seq_len";

impl Sample {
    /// Number of positions that take a loss after HF's shift (label at t+1 for t < len-1).
    pub fn target_tokens(&self) -> usize {
        self.labels.iter().skip(1).filter(|&&l| l != IGNORE_INDEX).count()
    }

    /// Checks one row against the benchmark's rules; the error says what is wrong.
    pub fn validate(&self, vocab: usize, max_seq_len: usize) -> Result<(), String> {
        let n = self.input_ids.len();
        if n != self.labels.len() {
            return Err(format!("input_ids has {n} tokens but labels has {}", self.labels.len()));
        }
        if n < 2 {
            return Err(format!("{n} tokens: a sample needs at least 2"));
        }
        if n > max_seq_len {
            return Err(format!(
                "{n} tokens {TOO_LONG} {max_seq_len}: raise it (data.max_seq_len, or the \
                 command's --max-seq-len, up to the model's max_position_embeddings), or drop such rows \
                 (data.on_bad_row = \"skip\")"
            ));
        }
        if let Some((i, id)) = self.input_ids.iter().enumerate().find(|(_, id)| **id as usize >= vocab) {
            return Err(format!("input_ids[{i}] = {id} is outside the vocabulary [0, {vocab})"));
        }
        if let Some((i, l)) =
            self.labels.iter().enumerate().find(|(_, l)| **l != IGNORE_INDEX && (**l < 0 || **l as usize >= vocab))
        {
            return Err(format!("labels[{i}] = {l} is neither -100 nor a token id in [0, {vocab})"));
        }
        if self.target_tokens() == 0 {
            return Err("no target token (every label after the first is -100)".into());
        }
        Ok(())
    }
}
