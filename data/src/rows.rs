//! Raw rows of a `.jsonl` file or a parquet / Arrow IPC file, each with its place in the file
//! (the one numbering every message uses) and read within a byte bound.
//!
//! A JSONL file is read a line at a time, and a line longer than the bound is skipped without
//! being held: one 1 GB line costs no more memory than the bound, instead of the line and then
//! its tokenisation (~50 bytes per token in an `Encoding`). The bound comes from the tokenizer
//! and the longest sample wanted (`tokenizer::max_row_bytes`), so a skipped row is one that
//! could not have fitted anyway.

use std::io::BufRead;
use std::path::Path;

use anyhow::Context;

pub use crate::RowPlace;

/// One row as read.
#[derive(Debug, Clone, PartialEq)]
pub struct RawRow {
    /// Where it is.
    pub place: RowPlace,
    /// Its JSON value; `None` when it is longer than the byte bound (too long to be a sample).
    pub value: Option<serde_json::Value>,
}

/// Every non-blank row of a `.jsonl` file, or every row of a parquet / Arrow IPC file as a JSON
/// object; rows over `max_bytes` (when given) come back without their value. A line that is not
/// JSON is an error naming the file and line.
pub fn read_rows(path: &Path, max_bytes: Option<usize>) -> anyhow::Result<Vec<RawRow>> {
    let cap = max_bytes.unwrap_or(usize::MAX);
    if path.extension().is_some_and(|e| e == "jsonl" || e == "json") {
        let file = std::fs::File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
        let mut reader = std::io::BufReader::with_capacity(1 << 20, file);
        let (mut rows, mut line, mut buf) = (Vec::new(), 0, Vec::new());
        while let Some(fits) =
            read_line_capped(&mut reader, &mut buf, cap).with_context(|| format!("cannot read {}", path.display()))?
        {
            line += 1;
            let place = RowPlace::Line(line);
            if !fits {
                rows.push(RawRow { place, value: None });
            } else if !buf.trim_ascii().is_empty() {
                let value = serde_json::from_slice(&buf)
                    .with_context(|| format!("{}: {place}: not a JSON object", path.display()))?;
                rows.push(RawRow { place, value: Some(value) });
            }
        }
        return Ok(rows);
    }
    let mut rows = Vec::new();
    crate::parquet_io::for_each_batch(path, |batch, _| {
        let mut writer = arrow_json::ArrayWriter::new(Vec::new());
        writer.write(batch).with_context(|| format!("{}: cannot read its rows", path.display()))?;
        writer.finish()?;
        let values: Vec<serde_json::Value> = serde_json::from_slice(&writer.into_inner())?;
        for value in values {
            let place = RowPlace::Row(rows.len() + 1);
            let fits = serde_json::to_vec(&value).is_ok_and(|b| b.len() <= cap);
            rows.push(RawRow { place, value: fits.then_some(value) });
        }
        Ok(())
    })?;
    Ok(rows)
}

/// Reads one line (without its `\n` or `\r\n`) into `buf`, keeping at most `cap` bytes:
/// `None` at the end of the input, `Some(false)` when the line was longer (its bytes are
/// consumed, not kept).
fn read_line_capped(r: &mut impl BufRead, buf: &mut Vec<u8>, cap: usize) -> std::io::Result<Option<bool>> {
    buf.clear();
    let (mut fits, mut any) = (true, false);
    loop {
        let avail = r.fill_buf()?;
        if avail.is_empty() {
            break;
        }
        any = true;
        let newline = avail.iter().position(|&b| b == b'\n');
        let chunk = &avail[..newline.unwrap_or(avail.len())];
        if fits && buf.len() + chunk.len() <= cap.saturating_add(1) {
            buf.extend_from_slice(chunk);
        } else {
            fits = false;
            buf.clear();
        }
        let used = newline.map_or(avail.len(), |i| i + 1);
        r.consume(used);
        if newline.is_some() {
            break;
        }
    }
    if buf.last() == Some(&b'\r') {
        buf.pop();
    }
    fits &= buf.len() <= cap;
    Ok(any.then_some(fits))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Lines are numbered as the file's lines (blank ones counted), CRLF is a line end, and a
    /// line over the bound comes back without its value while the next is read normally.
    #[test]
    fn rows_keep_their_file_line_and_long_ones_are_not_held() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("raw.jsonl");
        let long = format!("{{\"x\": \"{}\"}}", "a".repeat(5000));
        std::fs::write(&p, format!("{{\"x\": 1}}\r\n\n  \n{long}\n{{\"x\": 2}}")).unwrap();
        let rows = read_rows(&p, Some(100)).unwrap();
        let got: Vec<(String, Option<serde_json::Value>)> =
            rows.into_iter().map(|r| (r.place.to_string(), r.value)).collect();
        assert_eq!(
            got,
            [
                ("line 1".to_string(), Some(serde_json::json!({"x": 1}))),
                ("line 4".to_string(), None),
                ("line 5".to_string(), Some(serde_json::json!({"x": 2}))),
            ]
        );
        assert_eq!(read_rows(&p, None).unwrap()[1].value.as_ref().unwrap()["x"].as_str().unwrap().len(), 5000);
        // Exactly at the bound fits; one byte over does not.
        std::fs::write(&p, "{\"x\": 12}\n").unwrap();
        assert!(read_rows(&p, Some(9)).unwrap()[0].value.is_some());
        assert!(read_rows(&p, Some(8)).unwrap()[0].value.is_none());
        std::fs::write(&p, "{\"x\": 1}\n{\"x\": \n").unwrap();
        let err = format!("{:#}", read_rows(&p, None).unwrap_err());
        assert!(err.contains("raw.jsonl: line 2: not a JSON object"), "{err}");
    }
}
