//! TensorBoard event files beside `metrics.jsonl` (`logging.tensorboard`): the same scalars,
//! per optimizer step, in `RUN_DIR/tensorboard/events.out.tfevents.*`, so that
//! `tensorboard --logdir runs` shows every run.
//!
//! The file is TFRecord frames of `Event` protocol buffers (TensorFlow's `event.proto`, one
//! `Summary` of simple scalar values each). Written here rather than through a crate: the
//! maintained TensorBoard writers for Rust pull a protobuf toolchain (or TensorFlow) for three
//! messages of a few fields, which this file encodes by hand; the frames' checksum is the
//! `crc32c` crate's.

use std::io::Write;
use std::path::Path;

use crate::engine::events::{Observer, RunEvent};
use crate::engine::outputs::TENSORBOARD;

/// One run's event file (rank 0), or nothing.
pub struct EventFile {
    file: Option<std::fs::File>,
    /// Whether a failed write was already reported (once per run: records never stop a run).
    warned: bool,
}

impl EventFile {
    /// A new event file in `run_dir/tensorboard/` on the main rank (a resumed run starts one of
    /// its own beside the earlier attempts'); nothing elsewhere or when `on` is false.
    pub fn open(run_dir: &Path, on: bool, main_rank: bool) -> anyhow::Result<Self> {
        use anyhow::Context;
        if !(on && main_rank) {
            return Ok(Self { file: None, warned: false });
        }
        let dir = run_dir.join(TENSORBOARD);
        std::fs::create_dir_all(&dir).with_context(|| format!("cannot create {}", dir.display()))?;
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        let name = format!("events.out.tfevents.{}.llora.{}", now.as_secs(), std::process::id());
        let path = dir.join(name);
        let file = std::fs::File::create(&path).with_context(|| format!("cannot create {}", path.display()))?;
        let mut events = Self { file: Some(file), warned: false };
        events.write(&event(wall_time(), 0, Body::FileVersion("brain.Event:2")));
        Ok(events)
    }

    /// Appends scalars `(tag, value)` at `step`.
    fn scalars(&mut self, step: usize, values: &[(&str, f64)]) {
        self.write(&event(wall_time(), step as i64, Body::Scalars(values)));
    }

    /// Appends one framed record, flushed (a run killed later keeps what was written).
    fn write(&mut self, data: &[u8]) {
        let Some(f) = self.file.as_mut() else { return };
        let written = f.write_all(&frame(data)).and_then(|()| f.flush());
        if let (Err(e), false) = (written, self.warned) {
            self.warned = true;
            tracing::warn!(
                "cannot write the TensorBoard event file: {e} (the run goes on; metrics.jsonl has the same)"
            );
        }
    }
}

impl Observer for EventFile {
    fn observe(&mut self, event: &RunEvent<'_>) {
        match *event {
            RunEvent::Step(r) => {
                let mut values = vec![
                    ("loss", r.loss),
                    ("lr", r.lr),
                    ("grad_norm", r.grad_norm),
                    ("tokens_per_s", r.tokens_per_s),
                    ("step_s", r.step_s),
                    ("model_tflops_per_s", r.tflops),
                    ("samples", r.samples as f64),
                    ("target_tokens", r.target_tokens as f64),
                ];
                values.extend(r.mfu.map(|m| ("mfu", m)));
                values.extend(r.documents.map(|d| ("documents", d as f64)));
                values.extend(r.pairs.iter().flat_map(|p| p.named()));
                self.scalars(r.step, &values);
            }
            RunEvent::Eval { step, eval_loss, pairs, .. } => {
                let named: Vec<(String, f64)> =
                    pairs.iter().flat_map(|p| p.named()).map(|(n, v)| (format!("eval_{n}"), v)).collect();
                let mut values = vec![("eval_loss", eval_loss)];
                values.extend(named.iter().map(|(n, v)| (n.as_str(), *v)));
                self.scalars(step, &values);
            }
            _ => {}
        }
    }
}

fn wall_time() -> f64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0.0, |d| d.as_secs_f64())
}

/// What an event carries.
enum Body<'a> {
    /// `file_version` (the first event of a file).
    FileVersion(&'a str),
    /// A `Summary` of simple scalar values.
    Scalars(&'a [(&'a str, f64)]),
}

/// An `Event` message: `wall_time` (field 1, double), `step` (2, int64), then `file_version`
/// (3, string) or `summary` (5, a `Summary`: repeated `value` (1), each a `tag` (1, string) and
/// a `simple_value` (2, float)).
fn event(wall_time: f64, step: i64, body: Body<'_>) -> Vec<u8> {
    let mut out = vec![0x09];
    out.extend_from_slice(&wall_time.to_le_bytes());
    out.push(0x10);
    varint(&mut out, step as u64);
    match body {
        Body::FileVersion(v) => field_bytes(&mut out, 3, v.as_bytes()),
        Body::Scalars(values) => {
            let mut summary = Vec::new();
            for (tag, v) in values {
                let mut value = Vec::new();
                field_bytes(&mut value, 1, tag.as_bytes());
                value.push(0x15);
                value.extend_from_slice(&(*v as f32).to_le_bytes());
                field_bytes(&mut summary, 1, &value);
            }
            field_bytes(&mut out, 5, &summary);
        }
    }
    out
}

/// A length-delimited field (wire type 2).
fn field_bytes(out: &mut Vec<u8>, field: u8, bytes: &[u8]) {
    out.push(field << 3 | 2);
    varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

/// A protobuf varint.
fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8 & 0x7F) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// A TFRecord frame: the length (u64 LE) and its masked CRC32C, the data and its masked CRC32C.
fn frame(data: &[u8]) -> Vec<u8> {
    let len = (data.len() as u64).to_le_bytes();
    let mut out = Vec::with_capacity(data.len() + 16);
    out.extend_from_slice(&len);
    out.extend_from_slice(&masked_crc(&len).to_le_bytes());
    out.extend_from_slice(data);
    out.extend_from_slice(&masked_crc(data).to_le_bytes());
    out
}

/// TFRecord's masked CRC32C (Castagnoli).
fn masked_crc(bytes: &[u8]) -> u32 {
    let crc = crc32c::crc32c(bytes);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The checksum is CRC-32C (its check value over "123456789" is 0xE3069283, RFC 3720) masked
    /// as TFRecord masks it, by hand: rotate right 15, add 0xa282ead8.
    #[test]
    fn frames_carry_masked_crc32c() {
        assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(masked_crc(b"123456789"), 0xE306_9283u32.rotate_right(15).wrapping_add(0xa282_ead8));
        let f = frame(b"abc");
        assert_eq!(&f[..8], &3u64.to_le_bytes());
        assert_eq!(&f[12..15], b"abc");
        assert_eq!(f.len(), 8 + 4 + 3 + 4);
    }

    /// An event's bytes, field by field, for a scalar: hand-encoded protobuf.
    #[test]
    fn a_scalar_event_is_encoded_as_protobuf_says() {
        let e = event(0.5, 300, Body::Scalars(&[("loss", 2.0)]));
        let mut want = vec![0x09];
        want.extend_from_slice(&0.5f64.to_le_bytes());
        want.extend_from_slice(&[0x10, 0xAC, 0x02]); // 300 as a varint
        let value = [&[0x0A, 4][..], b"loss", &[0x15], &2.0f32.to_le_bytes()].concat();
        let summary = [&[0x0A, value.len() as u8][..], &value].concat();
        want.extend_from_slice(&[0x2A, summary.len() as u8]);
        want.extend_from_slice(&summary);
        assert_eq!(e, want);
    }
}
