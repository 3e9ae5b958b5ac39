//! Build script of the root package (the end-to-end tests): the rpath to LibTorch, and the
//! tiers. A test that needs more than `scripts/setup.sh` installs is ignored, with its reason,
//! where that is missing, so `cargo test` on a fresh clone ends with 0 failed:
//! - `has_peer`: the peer venv of `scripts/setup.sh --parity` (transformers, PEFT, bitsandbytes,
//!   TRL, TensorBoard, pyarrow), as `setup.sh` records it in `.venv/llora-peer`;
//! - `has_node`: `node` on the PATH (the Llama 2 tokenizer's npm package is the reference).
//!
//! The rest of what the tests run comes with `setup.sh` (torch with torchrun, the MLPerf
//! checker) or with a GPU (`#[ignore = "needs CUDA"]`, run by the GPU bundle).

#[path = "rpath.rs"]
mod rpath;

use std::path::Path;

fn main() {
    rpath::main();
    println!("cargo::rustc-check-cfg=cfg(has_peer)");
    println!("cargo::rustc-check-cfg=cfg(has_node)");
    // setup.sh rewrites the stamp only when what it records changes, so a test build is
    // redone exactly when the peer venv comes or goes. Without a venv (LIBTORCH pointed
    // elsewhere) there is no stamp: watching a missing file would rerun this on every build.
    let stamp = Path::new(".venv/llora-peer");
    if stamp.exists() {
        println!("cargo:rerun-if-changed={}", stamp.display());
    } else {
        println!("cargo:rerun-if-changed=build/tests.rs");
    }
    let peer = std::fs::read_to_string(stamp).is_ok_and(|s| s.trim() == "yes");
    if peer {
        println!("cargo:rustc-cfg=has_peer");
    }
    println!("cargo:rerun-if-env-changed=PATH");
    let node = std::env::var_os("PATH")
        .is_some_and(|paths| std::env::split_paths(&paths).any(|dir| dir.join("node").is_file()));
    if node {
        println!("cargo:rustc-cfg=has_node");
    }
}
