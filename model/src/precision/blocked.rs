//! GEMMs whose second operand is handed to the CPU kernel one column block at a time.
//!
//! Two of torch's CPU paths convert their operands to f32 before multiplying: `_scaled_mm` on a
//! CPU without FP8 units (temporaries many times the FP8 weight: docs/performance.md, M4) and
//! llora's own bf16 route on CPUs without bf16 GEMMs (`bf16.rs`; whole f32 copies of a 70B MLP
//! weight, 0.94 GB each, also left the allocator fragmented). Cut into column blocks, each output column is still one whole dot
//! product; only the temporaries shrink to one block.

use tch::{Kind, Tensor};

/// Elements of the second operand one call takes (64 MB in f32). `llora plan` counts one
/// block's f32 copies (`CPU_GEMM_BLOCK_ELEMENTS` there).
pub const BLOCK_ELEMENTS: i64 = 1 << 24;

/// `call(b)` for a `b` of at most [`BLOCK_ELEMENTS`]; otherwise `call` on each column block
/// of `b`, written into one output of dtype `out` (a block's result is cast to `out` as it is
/// copied in).
///
/// # Shapes
/// - b: `[k, n]` (any layout); `call(block)`: `[m, cols]`; output: `[m, n]`
pub fn by_column_blocks(
    m: i64,
    b: &Tensor,
    out: Kind,
    call: impl Fn(&Tensor) -> Result<Tensor, tch::TchError>,
) -> Result<Tensor, tch::TchError> {
    by_column_blocks_of(BLOCK_ELEMENTS, m, b, out, call)
}

/// [`by_column_blocks`] with blocks of at most `block_elements` elements of `b`.
///
/// # Shapes
/// - b: `[k, n]` (any layout); `call(block)`: `[m, cols]`; output: `[m, n]`
pub fn by_column_blocks_of(
    block_elements: i64,
    m: i64,
    b: &Tensor,
    out: Kind,
    call: impl Fn(&Tensor) -> Result<Tensor, tch::TchError>,
) -> Result<Tensor, tch::TchError> {
    let (k, n) = (b.size()[0], b.size()[1]);
    if k * n <= block_elements {
        return call(b);
    }
    let cols = (block_elements / k.max(1)).max(1);
    let y = Tensor::f_empty([m, n], (out, b.device()))?;
    for j in (0..n).step_by(cols as usize) {
        let c = cols.min(n - j);
        y.narrow(1, j, c).f_copy_(&call(&b.narrow(1, j, c))?)?;
    }
    Ok(y)
}
