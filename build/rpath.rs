//! Build script shared by every crate that links LibTorch (see `build = ...` in each manifest).
//!
//! torch-sys links `libtorch*.so` from the project venv but leaves finding it at run time to
//! `LD_LIBRARY_PATH`. Embedding its directory as an rpath lets `llora` and every test binary
//! run in a new shell with nothing exported. torch-sys declares `links = "tch"` and publishes
//! the directory as `DEP_TCH_LIBTORCH_LIB`, visible only to crates that depend on it
//! directly, hence the direct `torch-sys` dependency next to this script.

pub fn main() {
    println!("cargo:rerun-if-env-changed=DEP_TCH_LIBTORCH_LIB");
    match std::env::var("DEP_TCH_LIBTORCH_LIB") {
        Ok(lib) if !lib.is_empty() => {
            println!("cargo:rustc-link-arg=-Wl,-rpath,{lib}");
        }
        _ => println!(
            "cargo:warning=torch-sys did not report its libtorch directory; \
             binaries will need LD_LIBRARY_PATH (run ./scripts/setup.sh)"
        ),
    }
}
