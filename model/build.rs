//! Build script of llora-model: the rpath to LibTorch (shared with the other crates), and five
//! C++ shims compiled against the same LibTorch, as tch builds its own C++ wrapper (their
//! shared error handling in `src/shim.h`): the fused attention forwards tch does not bind
//! (`src/attention/sdpa_shim.cpp`), the fused RMSNorm's backward (`src/norm/norm_shim.cpp`),
//! the multi-tensor AdamW (`src/fused_adamw_shim.cpp`), what LibTorch build llora runs with
//! (`src/torch_info.cpp`, beside `device.rs`), and LibTorch's profiler, op counter and device
//! statistics (`src/profile_shim.cpp`, beside `profile.rs`). They need only LibTorch's own
//! headers.

use std::path::PathBuf;

#[path = "../build/rpath.rs"]
mod rpath;

fn main() {
    rpath::main();
    let shims = [
        "src/attention/sdpa_shim.cpp",
        "src/norm/norm_shim.cpp",
        "src/fused_adamw_shim.cpp",
        "src/torch_info.cpp",
        "src/profile_shim.cpp",
    ];
    for f in shims.iter().chain(&["src/shim.h"]) {
        println!("cargo:rerun-if-changed={f}");
    }
    let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") else {
        panic!("torch-sys did not report its libtorch directory: run ./scripts/setup.sh first");
    };
    // .venv/libtorch is a link to the wheel's torch directory.
    let lib = std::fs::canonicalize(&lib).unwrap_or_else(|_| PathBuf::from(&lib));
    let torch = lib.parent().expect("libtorch/lib has a parent");
    check_version(torch);
    cc::Build::new()
        .cpp(true)
        .files(shims)
        .include(torch.join("include"))
        .include(torch.join("include/torch/csrc/api/include"))
        .flag("-std=c++17")
        .flag("-D_GLIBCXX_USE_CXX11_ABI=1")
        .flag_if_supported("-Wno-unused-parameter")
        .warnings(false)
        .compile("llora_model_shims");
    println!("cargo:rustc-link-search=native={}", lib.display());
    for l in ["torch_cpu", "c10"] {
        println!("cargo:rustc-link-lib=dylib={l}");
    }
}

/// The LibTorch minor versions llora builds against (tch 0.22's wrapper compiles against each;
/// 2.15's headers need C++20 and drop functions tch binds).
const SUPPORTED_MINORS: std::ops::RangeInclusive<u32> = 9..=11;

/// Refuses a LibTorch outside [`SUPPORTED_MINORS`], reading its version from its headers
/// (torch-sys's own exact-version check is off: `.cargo/config.toml`).
fn check_version(torch: &std::path::Path) {
    // torch 2.11 moved the definitions to torch/headeronly/version.h (the old header includes it).
    let headers = ["include/torch/headeronly/version.h", "include/torch/csrc/api/include/torch/version.h"];
    let header = headers
        .iter()
        .map(|h| torch.join(h))
        .find(|h| h.is_file())
        .unwrap_or_else(|| panic!("no LibTorch version header under {} (looked for {headers:?})", torch.display()));
    let text = std::fs::read_to_string(&header)
        .unwrap_or_else(|e| panic!("cannot read LibTorch's version from {}: {e}", header.display()));
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(&format!("#define TORCH_VERSION_{name} ")))
            .and_then(|v| v.trim().parse::<u32>().ok())
            .unwrap_or_else(|| panic!("{} has no TORCH_VERSION_{name}", header.display()))
    };
    let (major, minor) = (field("MAJOR"), field("MINOR"));
    if major != 2 || !SUPPORTED_MINORS.contains(&minor) {
        panic!(
            "LibTorch {major}.{minor} at {} is outside the range llora builds against (2.{} to 2.{}): \
             run ./scripts/setup.sh --torch 2.11.0 (or another version in range)",
            torch.display(),
            SUPPORTED_MINORS.start(),
            SUPPORTED_MINORS.end()
        );
    }
}
