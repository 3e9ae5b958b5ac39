//! The MLPerf GovReport schema: `input_ids` and `labels` as lists of int32 or int64, an
//! optional `attention_mask`; read from parquet or Arrow IPC (file or stream format, as the HF
//! `datasets` cache holds it) as a stream of record batches, validated row by row.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, bail};
use arrow_array::cast::AsArray;
use arrow_array::types::{Int32Type, Int64Type};
use arrow_array::{Array, ArrayRef, ListArray, RecordBatch};
use arrow_schema::{ArrowError, DataType, Field, Schema};
use parquet::arrow::ArrowWriter;
use parquet::arrow::arrow_reader::ParquetRecordBatchReaderBuilder;

use crate::{RowPlace, Sample};

/// What to do with a row that fails validation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum OnBadRow {
    /// Stop with an error naming the file, the row and the reason.
    Error,
    /// Count it, warn, and go on.
    Skip,
}

/// How rows are checked while reading.
#[derive(Debug, Clone, Copy)]
pub struct ReadOptions {
    /// Token ids must be below this.
    pub vocab: usize,
    /// Rows must be at most this long.
    pub max_seq_len: usize,
    /// Bad-row policy.
    pub on_bad_row: OnBadRow,
}

/// Rows read and rows skipped by [`read_parquet`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReadReport {
    /// Rows in the file.
    pub rows: usize,
    /// Rows dropped under `OnBadRow::Skip`.
    pub skipped: usize,
    /// `row N: reason` for every skipped row.
    pub problems: Vec<String>,
}

/// Samples in the MLPerf schema (`input_ids`, `labels`: list<int64>, as HF datasets writes
/// them) as the bytes of one parquet file, for the caller to write atomically
/// (`llora_model::checkpoint::write_atomic`: the one atomic-write helper).
pub fn parquet_bytes(samples: &[Sample]) -> anyhow::Result<Vec<u8>> {
    let refs: Vec<&Sample> = samples.iter().collect();
    columns_bytes(&[("", &refs)])
}

/// Columns `{prefix}input_ids` and `{prefix}labels` of each set of samples (one row each), as
/// the bytes of one parquet file.
pub(crate) fn columns_bytes(sets: &[(&str, &[&Sample])]) -> anyhow::Result<Vec<u8>> {
    let item = Arc::new(Field::new("item", DataType::Int64, true));
    let (mut fields, mut arrays) = (Vec::new(), Vec::<ArrayRef>::new());
    for (prefix, samples) in sets {
        fields.push(Field::new(format!("{prefix}input_ids"), DataType::List(item.clone()), false));
        fields.push(Field::new(format!("{prefix}labels"), DataType::List(item.clone()), false));
        arrays.push(Arc::new(ListArray::from_iter_primitive::<Int64Type, _, _>(
            samples.iter().map(|s| Some(s.input_ids.iter().map(|&t| Some(t as i64)).collect::<Vec<_>>())),
        )));
        arrays.push(Arc::new(ListArray::from_iter_primitive::<Int64Type, _, _>(
            samples.iter().map(|s| Some(s.labels.iter().map(|&t| Some(t)).collect::<Vec<_>>())),
        )));
    }
    let schema = Arc::new(Schema::new(fields));
    let batch = RecordBatch::try_new(schema.clone(), arrays)?;
    let mut bytes = Vec::new();
    let mut writer = ArrowWriter::try_new(&mut bytes, schema, None)?;
    writer.write(&batch)?;
    writer.close()?;
    Ok(bytes)
}

/// Values of row `row` of a list column as i64, whatever the integer width.
fn row_values(col: &ListArray, row: usize) -> Result<Vec<i64>, String> {
    if col.is_null(row) {
        return Err("null list".into());
    }
    let values = col.value(row);
    if values.null_count() > 0 {
        return Err("null element".into());
    }
    match values.data_type() {
        DataType::Int64 => Ok(values.as_primitive::<Int64Type>().values().to_vec()),
        DataType::Int32 => Ok(values.as_primitive::<Int32Type>().values().iter().map(|&v| v as i64).collect()),
        other => Err(format!("element type {other}, expected int32 or int64")),
    }
}

/// The list column `name` of `batch`, or an error naming the file and the columns it has.
pub(crate) fn list_column<'a>(batch: &'a RecordBatch, name: &str, path: &Path) -> anyhow::Result<&'a ListArray> {
    let col = batch.column_by_name(name).with_context(|| {
        format!(
            "{}: no column {name:?} (columns: {:?})",
            path.display(),
            batch.schema().fields().iter().map(|f| f.name()).collect::<Vec<_>>()
        )
    })?;
    col.as_list_opt::<i32>().with_context(|| {
        format!("{}: column {name:?} is {}, expected a list of int32 or int64", path.display(), col.data_type())
    })
}

/// Calls `each(batch, index of its first row)` for every record batch of a parquet or Arrow
/// IPC file (told apart by their magic bytes), so memory grows with one batch, not the file.
pub fn for_each_batch(
    path: &Path,
    mut each: impl FnMut(&RecordBatch, usize) -> anyhow::Result<()>,
) -> anyhow::Result<usize> {
    let mut file = File::open(path).with_context(|| format!("cannot open {}", path.display()))?;
    let mut magic = [0u8; 6];
    let n = file.read(&mut magic).with_context(|| format!("cannot read {}", path.display()))?;
    file.seek(SeekFrom::Start(0)).with_context(|| format!("cannot read {}", path.display()))?;
    type Batches = Box<dyn Iterator<Item = Result<RecordBatch, ArrowError>>>;
    let batches: Batches = if magic[..n].starts_with(b"PAR1") {
        Box::new(
            ParquetRecordBatchReaderBuilder::try_new(file)
                .with_context(|| format!("{}: not a readable parquet file", path.display()))?
                .with_batch_size(64)
                .build()
                .with_context(|| format!("{}: cannot read", path.display()))?,
        )
    } else if &magic[..n] == b"ARROW1" {
        Box::new(
            arrow_ipc::reader::FileReader::try_new(file, None)
                .with_context(|| format!("{}: not a readable Arrow IPC file", path.display()))?,
        )
    } else {
        Box::new(
            arrow_ipc::reader::StreamReader::try_new(file, None)
                .with_context(|| format!("{}: neither parquet nor an Arrow IPC file or stream", path.display()))?,
        )
    };
    let mut rows = 0;
    for batch in batches {
        let batch = batch.with_context(|| format!("{}: corrupt record batch after row {rows}", path.display()))?;
        each(&batch, rows)?;
        rows += batch.num_rows();
    }
    Ok(rows)
}

impl ReadReport {
    /// Row `row`'s outcome: handed to `each`, an error naming the file and the row, or skipped
    /// and recorded under `OnBadRow::Skip`.
    pub(crate) fn take<T>(
        &mut self,
        result: Result<T, String>,
        row: usize,
        path: &Path,
        on_bad_row: OnBadRow,
        each: &mut impl FnMut(T),
    ) -> anyhow::Result<()> {
        match (result, on_bad_row) {
            (Ok(value), _) => each(value),
            (Err(reason), OnBadRow::Error) => bail!("{}: {}: {reason}", path.display(), RowPlace::Row(row + 1)),
            (Err(reason), OnBadRow::Skip) => {
                self.skipped += 1;
                self.problems.push(format!("{}: {reason}", RowPlace::Row(row + 1)));
            }
        }
        Ok(())
    }
}

/// Row `r` of the columns (input_ids, labels, attention_mask if any) as a validated sample.
pub(crate) fn sample_at(
    (ids, labels, mask): (&ListArray, &ListArray, Option<&ListArray>),
    r: usize,
    opts: &ReadOptions,
) -> Result<Sample, String> {
    let input_ids = row_values(ids, r).map_err(|e| format!("input_ids: {e}"))?;
    let labels = row_values(labels, r).map_err(|e| format!("labels: {e}"))?;
    if let Some(mask) = mask {
        let m = row_values(mask, r).map_err(|e| format!("attention_mask: {e}"))?;
        if m.len() != input_ids.len() {
            return Err(format!("attention_mask has {} entries for {} tokens", m.len(), input_ids.len()));
        }
        // One sample per sequence: padding inside a row would be attended to.
        if let Some(i) = m.iter().position(|&x| x != 1) {
            return Err(format!("attention_mask[{i}] = {} (padded rows are not supported; one sample per row)", m[i]));
        }
    }
    if let Some((i, id)) = input_ids.iter().enumerate().find(|(_, id)| **id < 0 || **id > u32::MAX as i64) {
        return Err(format!("input_ids[{i}] = {id} is not a token id"));
    }
    let sample = Sample { input_ids: input_ids.iter().map(|&t| t as u32).collect(), labels };
    sample.validate(opts.vocab, opts.max_seq_len)?;
    Ok(sample)
}

/// Streams `path` (parquet or Arrow IPC) record batch by record batch, calling `each` for
/// every valid row.
///
/// Memory grows with one record batch, not with the file. Every row is validated
/// ([`Sample::validate`], plus `attention_mask` all ones when present); a bad row is an error
/// naming the file, the row and the reason, unless `on_bad_row` is `Skip`.
pub fn for_each_row(path: &Path, opts: &ReadOptions, mut each: impl FnMut(Sample)) -> anyhow::Result<ReadReport> {
    let mut report = ReadReport::default();
    for_each_batch(path, |batch, _| {
        let ids = list_column(batch, "input_ids", path)?;
        let labels = list_column(batch, "labels", path)?;
        let mask = match batch.column_by_name("attention_mask") {
            Some(_) => Some(list_column(batch, "attention_mask", path)?),
            None => None,
        };
        for r in 0..batch.num_rows() {
            let row = report.rows;
            report.rows += 1;
            let result = sample_at((ids, labels, mask), r, opts);
            report.take(result, row, path, opts.on_bad_row, &mut each)?;
        }
        Ok(())
    })?;
    if report.skipped > 0 {
        tracing::warn!(file = %path.display(), skipped = report.skipped, rows = report.rows, first = ?report.problems.first(), "skipped bad rows (data.on_bad_row = \"skip\")");
    }
    Ok(report)
}

/// Reads every valid row of `path` into memory (see [`for_each_row`]).
pub fn read_parquet(path: &Path, opts: &ReadOptions) -> anyhow::Result<(Vec<Sample>, ReadReport)> {
    let mut out = Vec::new();
    let report = for_each_row(path, opts, |s| out.push(s))?;
    Ok((out, report))
}

#[cfg(test)]
mod tests {
    use super::*;
    use arrow_array::builder::{Int32Builder, ListBuilder};

    fn opts() -> ReadOptions {
        ReadOptions { vocab: 100, max_seq_len: 16, on_bad_row: OnBadRow::Error }
    }

    fn sample(ids: &[u32], labels: &[i64]) -> Sample {
        Sample { input_ids: ids.to_vec(), labels: labels.to_vec() }
    }

    /// A hand-built file with int32 lists and an attention_mask column, as other tools write.
    fn write_int32_with_mask(path: &Path, rows: &[(Vec<i32>, Vec<i32>, Vec<i32>)]) {
        let mut cols: Vec<ListBuilder<Int32Builder>> = (0..3).map(|_| ListBuilder::new(Int32Builder::new())).collect();
        for (a, b, c) in rows {
            for (col, vals) in cols.iter_mut().zip([a, b, c]) {
                col.values().append_slice(vals);
                col.append(true);
            }
        }
        let arrays: Vec<ArrayRef> = cols.iter_mut().map(|c| Arc::new(c.finish()) as ArrayRef).collect();
        let batch =
            RecordBatch::try_from_iter(["input_ids", "labels", "attention_mask"].into_iter().zip(arrays)).unwrap();
        let mut w = ArrowWriter::try_new(File::create(path).unwrap(), batch.schema(), None).unwrap();
        w.write(&batch).unwrap();
        w.close().unwrap();
    }

    #[test]
    fn round_trip_int64() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("a.parquet");
        let rows = vec![sample(&[1, 5, 6, 7], &[-100, -100, 6, 7]), sample(&[1, 9, 2], &[-100, 9, 2])];
        std::fs::write(&p, parquet_bytes(&rows).unwrap()).unwrap();
        let (back, report) = read_parquet(&p, &opts()).unwrap();
        assert_eq!(back, rows);
        assert_eq!(report, ReadReport { rows: 2, ..Default::default() });
    }

    #[test]
    fn int32_with_attention_mask_reads() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("b.parquet");
        write_int32_with_mask(&p, &[(vec![1, 4, 5], vec![-100, 4, 5], vec![1, 1, 1])]);
        let (back, _) = read_parquet(&p, &opts()).unwrap();
        assert_eq!(back, vec![sample(&[1, 4, 5], &[-100, 4, 5])]);
    }

    #[test]
    fn each_bad_row_kind_is_named_or_skipped() {
        let dir = tempfile::tempdir().unwrap();
        let cases: Vec<(Sample, &str)> = vec![
            (sample(&[1, 2, 3], &[-100, 2]), "input_ids has 3 tokens but labels has 2"),
            (sample(&[1; 17], &[1; 17]), "longer than max_seq_len 16: raise it (data.max_seq_len"),
            (sample(&[1, 100], &[-100, 100]), "input_ids[1] = 100 is outside the vocabulary"),
            (sample(&[1, 2, 3], &[-100, -100, -100]), "no target token"),
            (sample(&[1, 2], &[-100, -7]), "labels[1] = -7"),
        ];
        for (i, (bad, reason)) in cases.iter().enumerate() {
            let p = dir.path().join(format!("bad{i}.parquet"));
            let good = sample(&[1, 5, 6], &[-100, 5, 6]);
            std::fs::write(&p, parquet_bytes(&[good.clone(), bad.clone(), good.clone()]).unwrap()).unwrap();
            let err = read_parquet(&p, &opts()).unwrap_err().to_string();
            assert!(err.contains(&format!("bad{i}.parquet: row 2: ")) && err.contains(reason), "{err}");
            let (rows, report) = read_parquet(&p, &ReadOptions { on_bad_row: OnBadRow::Skip, ..opts() }).unwrap();
            assert_eq!(rows, vec![good.clone(), good]);
            assert_eq!((report.rows, report.skipped), (3, 1));
        }
        let p = dir.path().join("mask.parquet");
        write_int32_with_mask(&p, &[(vec![1, 4, 5], vec![-100, 4, 5], vec![1, 1, 0])]);
        let err = read_parquet(&p, &opts()).unwrap_err().to_string();
        assert!(err.contains("row 1: attention_mask[2] = 0"), "{err}");
    }

    /// The HF `datasets` cache holds Arrow IPC streams; the file format is read too. Both with
    /// int32 lists and an attention_mask, and a truncated stream is an error naming the file.
    #[test]
    fn arrow_ipc_file_and_stream_read() {
        let dir = tempfile::tempdir().unwrap();
        let parquet = dir.path().join("src.parquet");
        write_int32_with_mask(
            &parquet,
            &[(vec![1, 4, 5], vec![-100, 4, 5], vec![1, 1, 1]), (vec![1, 7], vec![-100, 7], vec![1, 1])],
        );
        let mut batches = Vec::new();
        for_each_batch(&parquet, |b, _| {
            batches.push(b.clone());
            Ok(())
        })
        .unwrap();
        let schema = batches[0].schema();
        let want = vec![sample(&[1, 4, 5], &[-100, 4, 5]), sample(&[1, 7], &[-100, 7])];
        let file = dir.path().join("data.arrow");
        let mut w = arrow_ipc::writer::FileWriter::try_new(File::create(&file).unwrap(), &schema).unwrap();
        batches.iter().for_each(|b| w.write(b).unwrap());
        w.finish().unwrap();
        assert_eq!(read_parquet(&file, &opts()).unwrap().0, want);
        let stream = dir.path().join("data-00000-of-00001.arrow");
        let mut w = arrow_ipc::writer::StreamWriter::try_new(File::create(&stream).unwrap(), &schema).unwrap();
        batches.iter().for_each(|b| w.write(b).unwrap());
        w.finish().unwrap();
        assert_eq!(read_parquet(&stream, &opts()).unwrap().0, want);
        let bytes = std::fs::read(&stream).unwrap();
        std::fs::write(&stream, &bytes[..bytes.len() / 2]).unwrap();
        let err = format!("{:#}", read_parquet(&stream, &opts()).unwrap_err());
        assert!(err.contains("data-00000-of-00001.arrow"), "{err}");
    }

    #[test]
    fn truncated_or_missing_files_are_errors() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("t.parquet");
        std::fs::write(&p, parquet_bytes(&vec![sample(&[1, 5, 6], &[-100, 5, 6]); 50]).unwrap()).unwrap();
        let bytes = std::fs::read(&p).unwrap();
        for cut in [bytes.len() - 5, bytes.len() / 2, 3] {
            std::fs::write(&p, &bytes[..cut]).unwrap();
            let err = format!("{:#}", read_parquet(&p, &opts()).unwrap_err());
            assert!(err.contains("t.parquet"), "{err}");
        }
        let err = format!("{:#}", read_parquet(&dir.path().join("none.parquet"), &opts()).unwrap_err());
        assert!(err.contains("none.parquet"), "{err}");
    }
}
