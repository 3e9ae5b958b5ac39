//! What `llora selftest` and `llora bench` read of the model beyond training it: every CUDA
//! route in one list and whether a device takes them, the routes that report their use, op and
//! sync counters and Kineto traces of a step, and the device's memory peaks.

pub use crate::attention::{
    FusedKernel, kernels_used as attention_kernels_used, verify as verify_attention_kernel, with_generic_attention,
};
pub use crate::dropout::dropout;
pub use crate::fused_adamw::ROUTE as FUSED_ADAMW_ROUTE;
pub use crate::norm::FUSED_KERNELS_ROUTE as RMS_NORM_FUSED_ROUTE;
pub use crate::norm::fp8_route::ROUTE as RMS_NORM_FP8_ROUTE;
pub use crate::precision::swiglu_route::ROUTE as SWIGLU_FP8_ROUTE;
pub use crate::profile::{Counter, Counts, Trace, device_peaks, reset_device_peaks};
pub use crate::route_list::{Route, all as all_routes};
pub use crate::routes::{Verdicts, on_cpu, takes_cuda_routes};
