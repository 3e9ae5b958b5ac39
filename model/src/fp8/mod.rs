//! FP8: how llora computes in 8-bit floats, as Transformer Engine's hybrid recipe does (E4M3
//! forward, E5M2 gradients, per-tensor scales). The map, one idea a file:
//!
//! | idea | where |
//! |---|---|
//! | the formats E4M3 / E5M2, and an exact scalar emulation of torch's cast | [`format`](mod@format) |
//! | the recipe, configuration only: delayed-scaling settings, the scale an amax gives | [`recipe`] |
//! | the scaling state a run keeps: one tensor's amax history and scale, a linear's three | [`scaling_state`] |
//! | the one FP8 tensor: codes + inverse scale (host or device) + kept transpose; codes a kernel writes | [`tensor`] |
//! | quantise / dequantise / amax, each on the fastest route its device checked | [`quantize`] |
//! | a tensor made an [`Fp8Tensor`] at a delayed scale or its own amax (current scaling) | [`quantizer`] |
//! | amaxes taken over a context-parallel group (one process's scales) | [`amax_group`] |
//! | one input's codes made once and handed to each GEMM reading it (q/k/v, gate/up, down) | [`shared_codes`] |
//! | the FP8 linear: its GEMMs' operands and what it saves for backward, each an [`Fp8Tensor`] | `precision/linear.rs`, `precision/nodes.rs` |
//! | the GEMMs on `_scaled_mm` (and the CPU's emulation), counted by route | [`gemm`] |
//! | frozen weights stored as an [`Fp8Tensor`] | `precision/weights.rs` |
//! | FP8-kept SwiGLU input, RMSNorm writing codes | `precision/swiglu_route.rs`, `norm/fp8_route.rs` |
//! | our NVRTC kernels (argument checks, launches) | `kernels/` |
//! | what each kernel computes in LibTorch ops: its reference and CPU stand-in | [`stand_ins`] |
//! | a route's first-use check and fallback; every route in one list (`llora selftest`, `llora bench`) | `routes.rs`, `route_list.rs` |
//! | the step's end: amaxes max-reduced over ranks, then every scale updated | `LlamaForCausalLM::reduce_and_update_fp8` (llama.rs), called once by the trainer's `engine/step.rs` |
//!
//! A tensor is quantised as `q = cast(clamp(x·s, ±max))` and stands for `float(q) · (1/s)`.
//! Delayed scaling takes `s` from the amaxes of earlier steps (a role's first use from its own
//! amax); tensors that are only stored (activations kept for backward) take current scaling,
//! `s` from their own amax, computed on the device. docs/precision.md says what runs in which
//! format and why.

pub mod amax_group;
pub mod format;
pub mod gemm;
pub mod quantize;
pub mod quantizer;
pub mod recipe;
pub mod scaling_state;
pub mod shared_codes;
pub mod stand_ins;
pub mod tensor;

pub use format::Fp8Format;
pub use quantize::*;
pub use quantizer::Quantizer;
pub use recipe::{AmaxAlgo, AmaxSpec, scale_for_amax};
pub use scaling_state::DelayedScaling;
pub use shared_codes::{SharedCodes, WriteCodes};
pub use tensor::{CodesToWrite, Fp8Tensor, InvScale};
