//! Build script of llora-model: the rpath to LibTorch (shared with the other crates), and six
//! C++ shims compiled against the same LibTorch, as tch builds its own C++ wrapper (their
//! shared error handling in `src/shim.h`): the fused attention forwards tch does not bind
//! (`src/attention/sdpa_shim.cpp`), the fused RMSNorm's backward (`src/norm/norm_shim.cpp`),
//! the multi-tensor AdamW and gradient norms (`src/fused_adamw_shim.cpp`), what LibTorch build llora runs with
//! (`src/torch_info.cpp`, beside `device.rs`), LibTorch's profiler, op counter and device
//! statistics (`src/profile_shim.cpp`, beside `profile.rs`), and the CPU generator's state
//! taken and put back around a first-use check (`src/rng_shim.cpp`, beside `rng.rs`). They need
//! only LibTorch's own headers.

use std::path::PathBuf;

#[path = "../build/rpath.rs"]
mod rpath;

#[path = "../build/cuda_headers.rs"]
mod cuda_headers;

fn main() {
    rpath::main();
    let shims = [
        "src/attention/sdpa_shim.cpp",
        "src/norm/norm_shim.cpp",
        "src/fused_adamw_shim.cpp",
        "src/torch_info.cpp",
        "src/profile_shim.cpp",
        "src/rng_shim.cpp",
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
    build_stream_shim(torch, &lib);
    build_kernel_emulation();
}

/// `src/kernels/stream_shim.cpp`, LibTorch's current CUDA stream for our launches, against the
/// venv's CUDA headers (without them it reports that, and launches take the default stream).
fn build_stream_shim(torch: &std::path::Path, lib: &std::path::Path) {
    println!("cargo:rerun-if-changed=src/kernels/stream_shim.cpp");
    let mut build = cc::Build::new();
    build
        .cpp(true)
        .file("src/kernels/stream_shim.cpp")
        .include(torch.join("include"))
        .include(torch.join("include/torch/csrc/api/include"))
        .flag("-std=c++17")
        .flag("-D_GLIBCXX_USE_CXX11_ABI=1")
        .warnings(false);
    // Both the headers and LibTorch's CUDA library (a CPU-only torch has neither).
    let headers = cuda_headers::includes(torch).filter(|_| lib.join("libc10_cuda.so").exists());
    if let Some(dirs) = &headers {
        for d in dirs {
            build.include(d);
        }
        build.define("LLORA_WITH_CUDA_HEADERS", None).define("USE_CUDA", None);
    } else {
        println!("cargo:warning=CUDA headers not found in the venv: kernels launch on the default stream");
    }
    build.compile("llora_stream_shim");
    if headers.is_some() {
        println!("cargo:rustc-link-lib=dylib=c10_cuda");
    }
}

/// Our CUDA kernels (`src/kernels/*.cu`, each after `fp8_device.cuh`, as `Source::text` puts
/// them) compiled for the CPU against `src/kernels/emulation/cuda_cpu.h`, for the tests
/// (`src/kernels/emulate.rs`): every `.cu` found is built, each `extern "C" __global__` kernel
/// gets a trampoline that reads its arguments from a cuLaunchKernel parameter array, and each
/// `__shared__` declaration becomes a checked array (`cuda_cpu_shared.h`).
fn build_kernel_emulation() {
    let kernels = PathBuf::from("src/kernels");
    let emulation = kernels.join("emulation");
    println!("cargo:rerun-if-changed={}", kernels.display());
    println!("cargo:rerun-if-changed={}", emulation.display());
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("cargo sets OUT_DIR"));
    let device = std::fs::read_to_string(kernels.join("fp8_device.cuh")).expect("src/kernels/fp8_device.cuh");
    let cu_files = |dir: &PathBuf| {
        let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| p.extension().is_some_and(|x| x == "cu"))
            .collect();
        found.sort();
        found
    };
    // Our kernels after the device helpers, and the emulator's own check kernels alone.
    let sources: Vec<(PathBuf, &str)> = cu_files(&kernels)
        .into_iter()
        .map(|p| (p, device.as_str()))
        .chain(cu_files(&emulation).into_iter().map(|p| (p, "")))
        .collect();
    let (mut files, mut names) = (vec![emulation.join("emulate.cpp")], Vec::new());
    for (cu, prefix) in &sources {
        let text = std::fs::read_to_string(cu).unwrap_or_else(|e| panic!("{}: {e}", cu.display()));
        let kernels = kernel_names(&text);
        let mut unit = format!("// {} for the CPU (model/build.rs).\n#include \"cuda_cpu.h\"\n", cu.display());
        unit += &checked_shared(&format!("{prefix}\n{text}"));
        for k in &kernels {
            unit += &format!("\nextern \"C\" void llora_emu_tramp_{k}(void** p) {{ ::llora_emu::call(&{k}, p); }}");
        }
        let path = out.join(format!("emu_{}.cpp", cu.file_stem().and_then(|s| s.to_str()).expect("a file name")));
        std::fs::write(&path, unit).expect("OUT_DIR is writable");
        files.push(path);
        names.extend(kernels);
    }
    let mut registry = String::from("#include <cstring>\n");
    for k in &names {
        registry += &format!("extern \"C\" void llora_emu_tramp_{k}(void**);\n");
    }
    registry += "extern \"C\" void (*llora_emu_find(const char* name))(void**) {\n";
    for k in &names {
        registry += &format!("    if (std::strcmp(name, \"{k}\") == 0) return llora_emu_tramp_{k};\n");
    }
    registry += "    return nullptr;\n}\n";
    let path = out.join("emu_registry.cpp");
    std::fs::write(&path, registry).expect("OUT_DIR is writable");
    files.push(path);
    cc::Build::new()
        .cpp(true)
        .files(files)
        .include(&emulation)
        .include(emulation.join("include"))
        .define("LLORA_EMU_CHECKED_SHARED", None)
        .flag("-std=c++20")
        .flag("-pthread")
        // No multiply-add contracted: NVRTC compiles the kernels with --fmad=false too.
        .flag("-ffp-contract=off")
        .warnings(false)
        .compile("llora_kernel_emulation");
}

/// The `extern "C" __global__ void NAME(` kernels of a source.
fn kernel_names(text: &str) -> Vec<String> {
    let marker = "extern \"C\" __global__ void ";
    text.match_indices(marker)
        .map(|(at, _)| {
            let rest = &text[at + marker.len()..];
            rest[..rest.find('(').expect("a kernel's parameter list")].trim().to_string()
        })
        .collect()
}

/// `text` with each `__shared__ T name[A][B];` as `static ::llora_emu::SharedArray<T, (A), (B)>
/// name;` and each `__shared__ T name;` as `static ::llora_emu::Shared<T> name;`.
fn checked_shared(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("__shared__") {
        out += &rest[..at];
        let after = &rest[at + "__shared__".len()..];
        let end = after.find(';').expect("a __shared__ declaration ends with ;");
        let decl = after[..end].trim();
        let (head, dims) = decl.split_at(decl.find('[').unwrap_or(decl.len()));
        let (ty, name) = head.trim().rsplit_once(char::is_whitespace).expect("__shared__ TYPE NAME");
        if dims.is_empty() {
            out += &format!("static ::llora_emu::Shared<{ty}> {name}");
        } else {
            let sizes: Vec<String> = dims
                .split('[')
                .filter(|d| !d.trim().is_empty())
                .map(|d| format!("({})", d.trim_end_matches([']', ' '])))
                .collect();
            out += &format!("static ::llora_emu::SharedArray<{ty}, {}> {name}", sizes.join(", "));
        }
        rest = &after[end..];
    }
    out + rest
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
