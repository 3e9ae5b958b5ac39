//! The check a training run makes before it allocates: does it fit the device (or the host's
//! memory, from /proc/meminfo)?

use super::*;

/// Refuses a training config before anything is allocated when its sequences are longer than
/// the model's positions, or when (on a CPU) its planned peak is more than the machine's
/// memory: a run that cannot fit is an error that says how much it needs, not an OOM kill.
/// (On CUDA the device's memory is not known before the run starts; `llora plan
/// --device-memory` answers there.)
pub fn check_fits(config: &crate::config::Config, world: usize) -> anyhow::Result<()> {
    let shape = shape_of(config, world)?;
    let source = match &config.model.path {
        Some(p) if p.join("config.json").exists() => format!("{}/config.json", p.display()),
        _ => format!("model.preset = {:?}", config.model.preset.as_deref().unwrap_or_default()),
    };
    anyhow::ensure!(
        shape.seq_len <= shape.model.max_position_embeddings,
        "data.max_seq_len = {} is past the model's max_position_embeddings = {} ({source}): positions beyond it \
         were never trained. Lower data.max_seq_len, or raise max_position_embeddings in config.json on purpose \
         (MLPerf's Llama 2 70B checkpoint raises it to 8192)",
        shape.seq_len,
        shape.model.max_position_embeddings
    );
    if shape.target == Target::Cpu
        && let Some(total) = total_memory_bytes()
    {
        let peak = budget(&shape).peak;
        anyhow::ensure!(
            peak <= total,
            "this run needs about {:.1} GiB at its peak per rank (llora plan: {source}, data.max_seq_len = {}, \
             train.micro_batch_size = {}), and this machine has {:.1} GiB: lower data.max_seq_len or \
             train.micro_batch_size, recompute blocks (train.recompute_layers), or see `llora plan` for a recipe",
            peak / GB,
            shape.seq_len,
            shape.micro_batch,
            total / GB
        );
    }
    Ok(())
}

/// `MemTotal` of /proc/meminfo in bytes (Linux), if readable.
pub fn total_memory_bytes() -> Option<f64> {
    let info = std::fs::read_to_string("/proc/meminfo").ok()?;
    let kb: f64 =
        info.lines().find_map(|l| l.strip_prefix("MemTotal:"))?.trim().trim_end_matches("kB").trim().parse().ok()?;
    Some(kb * 1024.0)
}
