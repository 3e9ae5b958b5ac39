//! The forwards of the fused CUDA attention kernels that tch 0.22 does not bind (flash
//! attention, dense and variable-length, and cuDNN SDPA), called through `sdpa_shim.cpp`.
//! Which kernel runs is `choice.rs`'s; the variable-length one is `varlen.rs`'s.

use std::ffi::{c_char, c_int};

/// What the shim's forward returns, in the order the matching backward takes it.
#[repr(C)]
struct SdpaOut {
    out: *mut torch_sys::C_tensor,
    logsumexp: *mut torch_sys::C_tensor,
    cum_seq_q: *mut torch_sys::C_tensor,
    cum_seq_k: *mut torch_sys::C_tensor,
    max_q: i64,
    max_k: i64,
    philox_seed: *mut torch_sys::C_tensor,
    philox_offset: *mut torch_sys::C_tensor,
}

unsafe extern "C" {
    fn llora_sdpa_forward(
        kernel: c_int,
        q: *const torch_sys::C_tensor,
        k: *const torch_sys::C_tensor,
        v: *const torch_sys::C_tensor,
        causal: c_int,
        res: *mut SdpaOut,
        err: *mut *mut c_char,
    ) -> c_int;
    fn llora_flash_varlen_forward(
        q: *const torch_sys::C_tensor,
        k: *const torch_sys::C_tensor,
        v: *const torch_sys::C_tensor,
        cu_seq: *const torch_sys::C_tensor,
        max_len: i64,
        causal: c_int,
        window_left: i64,
        res: *mut VarlenOut,
        err: *mut *mut c_char,
    ) -> c_int;
    fn llora_sdpa_free(s: *mut c_char);
}

/// What the shim's variable-length forward returns.
#[repr(C)]
struct VarlenOut {
    out: *mut torch_sys::C_tensor,
    logsumexp: *mut torch_sys::C_tensor,
    philox_seed: *mut torch_sys::C_tensor,
    philox_offset: *mut torch_sys::C_tensor,
}

/// A flash or cuDNN forward's outputs: what its backward needs besides q, k, v and the gradient.
#[derive(Debug)]
pub struct SdpaForward {
    /// Attention output, `[batch, heads, seq, head_dim]`.
    pub out: tch::Tensor,
    /// Row log-sum-exp of the scores (f32).
    pub logsumexp: tch::Tensor,
    /// Cumulative sequence lengths (empty for dense inputs).
    pub cum_seq_q: tch::Tensor,
    /// As `cum_seq_q`, for the keys.
    pub cum_seq_k: tch::Tensor,
    /// Longest query sequence.
    pub max_q: i64,
    /// Longest key sequence.
    pub max_k: i64,
    /// The kernel's dropout RNG state (unused with dropout 0, but its backward takes it).
    pub philox_seed: tch::Tensor,
    /// As `philox_seed`.
    pub philox_offset: tch::Tensor,
}

/// Flash attention (`flash = true`) or cuDNN SDPA forward, scale 1/√hd, no dropout.
///
/// # Shapes
/// - q: `[batch, heads, seq, head_dim]`, bf16 or f16, on a CUDA device
/// - k, v: `[batch, kv_heads, seq, head_dim]`, kv_heads dividing heads
pub fn sdpa_forward(
    flash: bool,
    q: &tch::Tensor,
    k: &tch::Tensor,
    v: &tch::Tensor,
    causal: bool,
) -> Result<SdpaForward, tch::TchError> {
    let null = std::ptr::null_mut();
    let mut res = SdpaOut {
        out: null,
        logsumexp: null,
        cum_seq_q: null,
        cum_seq_k: null,
        max_q: 0,
        max_k: 0,
        philox_seed: null,
        philox_offset: null,
    };
    let mut err = std::ptr::null_mut();
    // SAFETY: the tensors outlive the call; on success every pointer in `res` is a new
    // at::Tensor that tch takes over below, on failure `err` is a malloc'd message.
    let rc = unsafe {
        llora_sdpa_forward(
            c_int::from(!flash),
            q.as_ptr(),
            k.as_ptr(),
            v.as_ptr(),
            c_int::from(causal),
            &mut res,
            &mut err,
        )
    };
    check(rc, err)?;
    Ok(SdpaForward {
        out: own(res.out),
        logsumexp: own(res.logsumexp),
        cum_seq_q: own(res.cum_seq_q),
        cum_seq_k: own(res.cum_seq_k),
        max_q: res.max_q,
        max_k: res.max_k,
        philox_seed: own(res.philox_seed),
        philox_offset: own(res.philox_offset),
    })
}

/// A variable-length flash forward's outputs: what its backward needs besides q, k, v, the
/// gradient and the sequences' offsets.
#[derive(Debug)]
pub struct VarlenForward {
    /// Attention output, `[tokens, heads, head_dim]`.
    pub out: tch::Tensor,
    /// Log-sum-exp of the scores (f32), laid out as the kernel chooses.
    pub logsumexp: tch::Tensor,
    /// The kernel's dropout RNG state (unused with dropout 0, but its backward takes it).
    pub philox_seed: tch::Tensor,
    /// As `philox_seed`.
    pub philox_offset: tch::Tensor,
}

/// Flash attention over sequences laid end to end, each attending only within itself; scale
/// 1/√hd, no dropout. With `window_left` (causal only), a query sees itself and at most that
/// many keys before it (flash attention's window arguments).
///
/// # Shapes
/// - q: `[tokens, heads, head_dim]`, bf16 or f16, on a CUDA device, last dimension contiguous
/// - k, v: `[tokens, kv_heads, head_dim]`, kv_heads dividing heads
/// - cu_seq: `[sequences + 1]` int32 on q's device: 0, the end of each sequence, ..., tokens
/// - max_len: the longest sequence
pub fn flash_varlen_forward(
    q: &tch::Tensor,
    k: &tch::Tensor,
    v: &tch::Tensor,
    cu_seq: &tch::Tensor,
    max_len: i64,
    causal: bool,
    window_left: Option<i64>,
) -> Result<VarlenForward, tch::TchError> {
    let null = std::ptr::null_mut();
    let mut res = VarlenOut { out: null, logsumexp: null, philox_seed: null, philox_offset: null };
    let mut err = std::ptr::null_mut();
    // SAFETY: as in `sdpa_forward`.
    let rc = unsafe {
        llora_flash_varlen_forward(
            q.as_ptr(),
            k.as_ptr(),
            v.as_ptr(),
            cu_seq.as_ptr(),
            max_len,
            c_int::from(causal),
            window_left.unwrap_or(-1),
            &mut res,
            &mut err,
        )
    };
    check(rc, err)?;
    Ok(VarlenForward {
        out: own(res.out),
        logsumexp: own(res.logsumexp),
        philox_seed: own(res.philox_seed),
        philox_offset: own(res.philox_offset),
    })
}

/// The shim's return code (0: success) as a result: its message (freed here) on failure.
fn check(rc: c_int, err: *mut c_char) -> Result<(), tch::TchError> {
    // SAFETY: on failure `err` is null or the shim's malloc'd message, used only here.
    unsafe { crate::profile::shim_status(c_int::from(rc == 0), err, "fused attention forward", llora_sdpa_free) }
        .map_err(tch::TchError::Torch)
}

/// Takes over a tensor the shim returned.
fn own(p: *mut torch_sys::C_tensor) -> tch::Tensor {
    // SAFETY: every pointer the shim fills on success is a fresh at::Tensor owned by nobody else.
    unsafe { tch::Tensor::from_ptr(p) }
}
