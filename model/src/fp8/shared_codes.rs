//! One activation's FP8 codes, made once and handed to every GEMM that reads it.
//!
//! q, k and v (gate and up) read one input, and their input scales, made from one amax history,
//! are equal: quantising that input once serves all three. The decoder block makes a
//! [`SharedCodes`] per such input and hands it, in the open, to the op that writes the input
//! (RMSNorm writes its output's codes in the same pass where our kernel runs; SwiGLU writes
//! h's for down_proj) and to each projection reading it. The first projection to need codes
//! that nobody wrote makes them; the others take them. Bitwise the same as quantising each
//! time: the same input, scale and format give the same codes.

use std::sync::{Arc, Mutex};

use super::format::Fp8Format;
use super::tensor::Fp8Tensor;

/// Codes of one input at one scale, and the input's amax (0-dim f32, on its device).
#[derive(Debug)]
struct Made {
    codes: Fp8Tensor,
    amax: tch::Tensor,
    /// The scale's bits: codes are taken only at the reader's own scale.
    scale: u32,
    numel: i64,
}

/// The FP8 codes of one activation that several GEMMs read (see the module doc): empty until
/// the writer or the first reader fills it; when its writer took it, the activation's amax for
/// a reader that keeps an FP8 copy at current scaling (the adapters' dropout hands it to their
/// A GEMM); and that copy, made once for every reader that keeps one (the adapters of q, k and
/// v without dropout). A handle: clones share all three.
#[derive(Debug, Clone, Default)]
pub struct SharedCodes {
    /// Codes at a reader's delayed input scale, with the input's amax.
    made: Arc<Mutex<Option<Made>>>,
    /// The amax (`[1]` f32) the input's writer took, and the input's size.
    handed_amax: Arc<Mutex<Option<(tch::Tensor, i64)>>>,
    /// The input's FP8 copy at current scaling, kept for a weight's gradient.
    current: Arc<Mutex<Option<Fp8Tensor>>>,
}

impl SharedCodes {
    /// An empty handle for one input.
    pub fn new() -> Self {
        Self::default()
    }

    /// Hands over the codes of the input at `scale` and its amax (0-dim f32), made by the op
    /// that wrote the input.
    ///
    /// # Shapes
    /// - codes: the input's shape (or a view of it)
    pub fn offer(&self, codes: Fp8Tensor, amax: tch::Tensor, scale: f32) {
        let made = Made { numel: codes.codes().numel() as i64, codes, amax, scale: scale.to_bits() };
        *self.made.lock().unwrap() = Some(made);
    }

    /// Hands over the amax (`[1]` f32 on the device, read by nobody) of the input, `numel`
    /// elements, taken by the op that wrote it.
    pub fn offer_input_amax(&self, amax: tch::Tensor, numel: i64) {
        *self.handed_amax.lock().unwrap() = Some((amax, numel));
    }

    /// The amax of `x` (`[1]` f32) its writer handed over, else the one taken with the codes of
    /// `x` made for a GEMM (by the writer or the first reader: the amax of the same values);
    /// `None` when neither was, or `x` is not of their size.
    pub fn input_amax(&self, x: &tch::Tensor) -> Option<tch::Tensor> {
        let n = x.numel() as i64;
        let handed = self.handed_amax.lock().unwrap().as_ref().filter(|(_, m)| *m == n).map(|(a, _)| a.shallow_clone());
        handed.or_else(|| {
            let made = self.made.lock().unwrap();
            made.as_ref().filter(|m| m.numel == n).map(|m| m.amax.reshape([1]))
        })
    }

    /// The codes of `x` at `scale` and `format` and its amax: those handed over, or made by
    /// `make` (then kept for the next reader). Codes at another scale, format or size are not
    /// taken (the reader quantises itself). No lock is held while `make` runs.
    ///
    /// # Shapes
    /// - x: any; output: codes shaped as x, amax 0-dim f32
    pub fn get_or_make(
        &self,
        x: &tch::Tensor,
        scale: f32,
        format: Fp8Format,
        make: impl FnOnce() -> (Fp8Tensor, tch::Tensor),
    ) -> (Fp8Tensor, tch::Tensor) {
        let found = self.made.lock().unwrap().as_ref().and_then(|m| {
            let fits = m.scale == scale.to_bits() && m.codes.format() == format && m.numel == x.numel() as i64;
            fits.then(|| (m.codes.reshape(&x.size()), m.amax.shallow_clone()))
        });
        if let Some(found) = found {
            return found;
        }
        let (codes, amax) = make();
        self.offer(codes.clone(), amax.shallow_clone(), scale);
        (codes, amax)
    }

    /// The FP8 copy of `x` at current scaling that a reader keeps for its weight's gradient:
    /// the one an earlier reader of `x` made, or made by `make` (then kept for the next).
    /// Bitwise what each reader would make: the same input and amax give the same codes. No
    /// lock is held while `make` runs.
    ///
    /// # Shapes
    /// - x: any; output: codes shaped as `make`'s
    pub fn current_copy(&self, x: &tch::Tensor, make: impl FnOnce() -> Fp8Tensor) -> Fp8Tensor {
        let fits = |c: &&Fp8Tensor| c.codes().numel() == x.numel();
        let found = self.current.lock().unwrap().as_ref().filter(fits).cloned();
        if let Some(found) = found {
            return found;
        }
        let made = make();
        *self.current.lock().unwrap() = Some(made.clone());
        made
    }
}

/// What an op writing a GEMM's input is asked to write beside it: the input's codes at the
/// GEMM's delayed input scale, handed over in `to`.
#[derive(Debug, Clone)]
pub struct WriteCodes {
    /// The reading GEMMs' delayed input scale.
    pub scale: f32,
    /// Where the readers take the codes.
    pub to: SharedCodes,
}
