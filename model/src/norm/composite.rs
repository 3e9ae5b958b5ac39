//! RMSNorm as LibTorch ops: the forward's statistic and output, and the two gradients. The
//! norm node runs them where the fused kernels do not (`mod.rs`), and the CPU standing in for
//! CUDA runs the backward in place of the fused backward kernel it lacks (`cuda.rs`).

/// `1 / √(mean(x²) + ε)` per row, in f32.
///
/// # Shapes
/// - x: `[.., d]` (any float dtype); output: `[.., 1]`, f32
pub(crate) fn inv_rms(x: &tch::Tensor, eps: f64) -> tch::Tensor {
    let x = x.to_kind(tch::Kind::Float);
    (x.square().mean_dim(-1, true, tch::Kind::Float) + eps).rsqrt()
}

/// The norm's output from x and its `inv_rms`: normalised in f32, cast to x's dtype, then
/// times the gain cast to x's dtype (HF's order).
///
/// # Shapes
/// - x: `[.., d]`; r: `[.., 1]` f32; w: `[d]`; output: as x, in x's dtype
pub(crate) fn normalised(x: &tch::Tensor, r: &tch::Tensor) -> tch::Tensor {
    (x.to_kind(tch::Kind::Float) * r).to_kind(x.kind())
}

/// The gain's gradient as LibTorch ops: Σ over rows of dy · n (in f32), with n the normalised
/// input as the forward rounded it, in `kind`.
///
/// # Shapes
/// - dy, x: `[.., d]`; r: `[.., 1]` f32; output: `[d]`
pub(super) fn dw(dy: &tch::Tensor, x: &tch::Tensor, r: &tch::Tensor, kind: tch::Kind) -> tch::Tensor {
    let d = *x.size().last().expect("a norm input has a last dimension");
    (dy.to_kind(tch::Kind::Float) * normalised(x, r).to_kind(tch::Kind::Float))
        .reshape([-1, d])
        .sum_dim_intlist([0i64].as_slice(), false, tch::Kind::Float)
        .to_kind(kind)
}

/// The input's gradient as LibTorch ops: dn = dy · w in the activations' dtype (the forward's
/// product), then in f32 `dx = r · (dn − n · mean(dn · n))`, n = x · r; in x's dtype.
///
/// # Shapes
/// - dy, x: `[.., d]`; r: `[.., 1]` f32; w: `[d]`; output: as x
pub(super) fn dx(dy: &tch::Tensor, x: &tch::Tensor, r: &tch::Tensor, w: &tch::Tensor) -> tch::Tensor {
    let dn = (dy * w.to_kind(dy.kind())).to_kind(tch::Kind::Float);
    let n = x.to_kind(tch::Kind::Float) * r;
    let proj = (&dn * &n).mean_dim(-1, true, tch::Kind::Float);
    ((dn - n * proj) * r).to_kind(x.kind())
}
