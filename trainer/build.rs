//! Build script of llora-trainer: the rpath to LibTorch (shared with the other crates), and the
//! c10d shim (`src/dist/c10d_shim.cpp`) compiled against the same LibTorch, as tch builds its
//! own C++ wrapper.
//!
//! The shim needs gloo's headers, which the torch wheel lacks (Debian's `libgloo-dev` has them;
//! `scripts/setup.sh` installs it). Its NCCL half needs the CUDA runtime and NCCL headers of the
//! venv's `nvidia-*` wheels plus two header-only wheels (`nvidia-cuda-nvcc-cu12`,
//! `nvidia-cuda-cccl-cu12`, also installed by `scripts/setup.sh`); it compiles on machines without
//! a GPU. Without those headers the shim is built Gloo-only, with a warning, and `cfg(llora_nccl)`
//! is unset.

use std::path::{Path, PathBuf};

#[path = "../build/rpath.rs"]
mod rpath;

#[path = "../build/cuda_headers.rs"]
mod cuda_headers;

fn main() {
    rpath::main();
    println!("cargo:rustc-check-cfg=cfg(llora_nccl)");
    println!("cargo:rerun-if-changed=src/dist/c10d_shim.cpp");
    println!("cargo:rerun-if-changed=../model/src/shim.h");
    let Ok(lib) = std::env::var("DEP_TCH_LIBTORCH_LIB") else {
        panic!("torch-sys did not report its libtorch directory: run ./scripts/setup.sh first");
    };
    // .venv/libtorch is a link to the wheel's torch directory; the nvidia packages are beside
    // the real one.
    let lib = std::fs::canonicalize(&lib).unwrap_or_else(|_| PathBuf::from(&lib));
    let torch = lib.parent().expect("libtorch/lib has a parent");
    let gloo = Path::new("/usr/include/gloo/config.h");
    if !gloo.is_file() {
        panic!(
            "{} not found: the c10d shim needs gloo's headers, which the torch wheel lacks. \
             Install Debian's libgloo-dev (`apt-get install libgloo-dev`, or run ./scripts/setup.sh as root)",
            gloo.display()
        );
    }
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .file("src/dist/c10d_shim.cpp")
        .include("../model/src")
        .include(torch.join("include"))
        .include(torch.join("include/torch/csrc/api/include"))
        .flag("-std=c++17")
        .flag("-D_GLIBCXX_USE_CXX11_ABI=1")
        .flag("-DGLOG_USE_GLOG_EXPORT")
        .flag("-DUSE_C10D_GLOO")
        .flag_if_supported("-Wno-unused-parameter")
        .warnings(false);
    let nccl = cuda_headers::includes(torch);
    match &nccl {
        Some(dirs) => {
            for d in dirs {
                build.include(d);
            }
            build.flag("-DUSE_C10D_NCCL").flag("-DUSE_CUDA").flag("-DLLORA_WITH_NCCL");
            println!("cargo:rustc-cfg=llora_nccl");
        }
        None => println!(
            "cargo:warning=CUDA/NCCL headers not found in the venv: the c10d shim is built without NCCL \
             (run ./scripts/setup.sh to install nvidia-cuda-nvcc-cu12 and nvidia-cuda-cccl-cu12)"
        ),
    }
    build.compile("llora_c10d");
    println!("cargo:rustc-link-search=native={}", lib.display());
    for l in ["torch_cpu", "c10"] {
        println!("cargo:rustc-link-lib=dylib={l}");
    }
    if nccl.is_some() {
        for l in ["torch_cuda", "c10_cuda"] {
            println!("cargo:rustc-link-lib=dylib={l}");
        }
    }
}
