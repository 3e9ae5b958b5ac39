//! Every CUDA route in one list: each is declared here once (its name, the `llora selftest`
//! part that checks it, its first-use check, what passing means, whether a run took it), and
//! `llora selftest` and `llora bench` both read this list, so a route added here appears in
//! both. The routes themselves (when to take one, its check, its fallback) live with the op
//! they replace; this file only names them. docs/gpu.md says which ran on a GPU.

use tch::Kind;

/// One route of the list.
pub struct Route {
    /// As logs, `llora selftest` and `llora bench` name it.
    pub name: &'static str,
    /// The `llora selftest --only` part that checks it.
    pub part: &'static str,
    /// Its check on a device, against the reference it replaces (run once where the route
    /// keeps its verdict): `Ok` means a run takes it there.
    pub check: fn(tch::Device) -> Result<(), String>,
    /// What passing the check says, for the self-test's detail.
    pub passed: &'static str,
    /// Whether a run in this process took it (routes that record their uses: their
    /// [`crate::routes::Verdicts`]).
    pub used: Option<fn() -> bool>,
}

/// Every route, in the order `llora selftest` runs them.
pub fn all() -> &'static [Route] {
    &ROUTES
}

static ROUTES: [Route; 9] = [
    Route {
        name: crate::fp8::CUDA_ROUTES_CHECK,
        part: "gemm",
        check: crate::fp8::cuda_routes_checked_on,
        passed: "codes and amaxes equal the f32 route's, bit for bit",
        used: None,
    },
    Route {
        name: crate::fp8::KERNEL_CHECK,
        part: "gemm",
        check: crate::fp8::kernel_checked_on,
        passed: "codes, transpose and amax equal the f32 route's, bit for bit",
        used: None,
    },
    Route {
        name: crate::precision::swiglu_route::CHECK,
        part: "gemm",
        check: crate::precision::swiglu_route::checked_on,
        passed: "codes and scales equal the LibTorch route's bit for bit, h and gradients within a bf16 ulp",
        used: Some(|| crate::precision::swiglu_route::ROUTE.used()),
    },
    Route {
        name: "attention cuda-flash-varlen BFloat16 (packed rows)",
        part: "attention",
        check: |device| crate::attention::verify_varlen(device, Kind::BFloat16, 64, 8, 128),
        passed: "packed rows' forward and backward match plain LibTorch",
        used: Some(|| crate::attention::VARLEN_ROUTE.used()),
    },
    Route {
        name: "attention cuda-flash-window BFloat16 (sliding windows)",
        part: "attention",
        check: |device| crate::attention::verify_varlen_window(device, Kind::BFloat16, 32, 8, 128),
        passed: "banded forward and backward match plain LibTorch",
        used: Some(|| crate::attention::WINDOW_ROUTE.used()),
    },
    Route {
        name: "RMSNorm fused kernels BFloat16",
        part: "norm",
        check: |device| crate::norm::verify_fused_kernels(device, Kind::BFloat16),
        passed: "forward and backward match the definition in f64",
        used: Some(|| crate::norm::FUSED_KERNELS_ROUTE.used()),
    },
    Route {
        name: "RMSNorm fused kernels Float",
        part: "norm",
        check: |device| crate::norm::verify_fused_kernels(device, Kind::Float),
        passed: "forward and backward match the definition in f64",
        used: Some(|| crate::norm::FUSED_KERNELS_ROUTE.used()),
    },
    Route {
        name: crate::norm::fp8_route::CHECK,
        part: "norm",
        check: crate::norm::fp8_route::checked_on,
        passed: "1/rms, output and codes equal the LibTorch route's (a bf16 ulp, codes bit for bit)",
        used: Some(|| crate::norm::fp8_route::ROUTE.used()),
    },
    Route {
        name: "optimizer: fused AdamW Float (one multi-tensor launch)",
        part: "optimizer",
        check: crate::fused_adamw::verify,
        passed: "three steps of 41 parameters match AdamW's definition in f64",
        used: Some(|| crate::fused_adamw::ROUTE.used()),
    },
];
