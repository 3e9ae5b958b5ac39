//! Every CUDA route in one list, gathered from where each is declared (`routes::declare_route!`
//! beside the op it replaces: its name, the `llora selftest` part and checks, what passing
//! means, whether a run took it): `llora selftest` and `llora bench` both read this list, so a
//! route declared anywhere appears in both. docs/gpu.md says which ran on a GPU.

use crate::routes::ROUTES;

/// One self-test of a route, as the list gives it.
#[derive(Debug)]
pub struct Route {
    /// As `llora selftest` and `llora bench` name it.
    pub name: &'static str,
    /// The `llora selftest --only` part that checks it.
    pub part: &'static str,
    /// Its check on a device, against the reference it replaces (run once where the route
    /// keeps its verdict): `Ok` means a run takes it there.
    pub check: fn(tch::Device) -> Result<(), String>,
    /// What passing the check says, for the self-test's detail.
    pub passed: &'static str,
    /// Whether a run in this process took its route (`None`: the route does not count its uses).
    pub used: Option<bool>,
}

/// Every route's self-tests, in the routes' declared order.
pub fn all() -> Vec<Route> {
    let mut routes: Vec<_> = ROUTES.iter().collect();
    routes.sort_by_key(|r| r.spec().order);
    routes
        .into_iter()
        .flat_map(|r| {
            let (spec, used) = (r.spec(), r.spec().counts_uses.then(|| r.used()));
            spec.self_tests.iter().map(move |t| Route {
                name: t.name,
                part: spec.part,
                check: t.check,
                passed: t.passed,
                used,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    /// The list holds every route declared, each once, in order: the eleven self-tests of the
    /// ten routes (RMSNorm's fused kernels in two dtypes).
    #[test]
    fn every_declared_route_is_listed_once_in_order() {
        let names: Vec<&str> = super::all().iter().map(|r| r.name).collect();
        assert_eq!(
            names,
            [
                crate::fp8::CUDA_ROUTES_CHECK,
                crate::fp8::KERNEL_CHECK,
                crate::precision::swiglu_route::CHECK,
                "attention cuda-flash-varlen BFloat16 (packed rows)",
                "attention cuda-flash-window BFloat16 (sliding windows)",
                "RMSNorm fused kernels BFloat16",
                "RMSNorm fused kernels Float",
                crate::norm::fp8_route::CHECK,
                crate::rope::fused::CHECK,
                crate::dropout::fused::CHECK,
                "optimizer: fused AdamW Float (one multi-tensor launch)",
            ]
        );
    }
}
