//! Build-script helper shared by the crates whose C++ includes LibTorch's CUDA headers (the c10d
//! shim's NCCL half in the trainer, the kernels' stream shim in the model): where the venv's
//! `nvidia-*` wheels keep the headers those need. Compiles on machines without a GPU.

use std::path::{Path, PathBuf};

/// The include directories C++ against LibTorch's CUDA half needs (the CUDA runtime's, NCCL's,
/// and the two header-only wheels'), when every one is in the venv: the `nvidia`
/// package directory beside `torch`. CUDA 12 wheels put each package's headers in
/// `nvidia/<package>/include`, CUDA 13 ones (torch 2.11) in `nvidia/cu13/include`; the layout of
/// torch's own CUDA (its `version.py`) is searched first, so that wheels a previous torch left
/// behind are not mixed in.
pub fn includes(torch: &Path) -> Option<Vec<PathBuf>> {
    let nvidia = torch.parent()?.join("nvidia");
    let cuda_major = std::fs::read_to_string(torch.join("version.py"))
        .ok()
        .and_then(|v| v.lines().find_map(|l| l.strip_prefix("cuda")?.split('\'').nth(1).map(str::to_string)))
        .and_then(|v| v.split('.').next().map(str::to_string))?;
    let merged = nvidia.join(format!("cu{cuda_major}")).join("include");
    let need = [
        ("cuda_runtime", "cuda_runtime_api.h"),
        ("nccl", "nccl.h"),
        ("cuda_nvcc", "crt/host_config.h"),
        ("cuda_cccl", "nv/target"),
    ];
    let mut dirs = Vec::new();
    for (pkg, header) in need {
        let inc = [merged.clone(), nvidia.join(pkg).join("include")].into_iter().find(|d| d.join(header).exists())?;
        if !dirs.contains(&inc) {
            dirs.push(inc);
        }
    }
    // Other nvidia packages' headers (cuBLAS, cuDNN, ...) that c10/cuda headers may include.
    if let Ok(entries) = std::fs::read_dir(&nvidia) {
        for e in entries.flatten() {
            let inc = e.path().join("include");
            let foreign = e.file_name().to_str().is_some_and(|n| n.starts_with("cu") && n[2..].parse::<u32>().is_ok())
                && inc != merged;
            if inc.is_dir() && !dirs.contains(&inc) && !foreign {
                dirs.push(inc);
            }
        }
    }
    Some(dirs)
}
