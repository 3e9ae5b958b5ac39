//! Build script of llora-model: the rpath to LibTorch (shared with the other crates), and the
//! fused-attention shim (`src/attention/sdpa_shim.cpp`) compiled against the same LibTorch, as
//! tch builds its own C++ wrapper. The shim needs only LibTorch's own headers.

use std::path::PathBuf;

#[path = "../build/rpath.rs"]
mod rpath;

fn main() {
    rpath::main();
    println!("cargo:rerun-if-changed=src/attention/sdpa_shim.cpp");
    let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") else {
        panic!("torch-sys did not report its libtorch directory: run ./scripts/setup.sh first");
    };
    // .venv/libtorch is a link to the wheel's torch directory.
    let lib = std::fs::canonicalize(&lib).unwrap_or_else(|_| PathBuf::from(&lib));
    let torch = lib.parent().expect("libtorch/lib has a parent");
    cc::Build::new()
        .cpp(true)
        .file("src/attention/sdpa_shim.cpp")
        .include(torch.join("include"))
        .include(torch.join("include/torch/csrc/api/include"))
        .flag("-std=c++17")
        .flag("-D_GLIBCXX_USE_CXX11_ABI=1")
        .flag_if_supported("-Wno-unused-parameter")
        .warnings(false)
        .compile("llora_sdpa");
    println!("cargo:rustc-link-search=native={}", lib.display());
    for l in ["torch_cpu", "c10"] {
        println!("cargo:rustc-link-lib=dylib={l}");
    }
}
