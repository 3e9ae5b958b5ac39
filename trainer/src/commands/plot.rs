//! `llora plot`: several runs' loss curves on one SVG, and the samples each took to the target.

use std::path::Path;

use crate::plot::{loss_svg, read_metrics};

/// `llora plot`: the runs' curves on one SVG; prints, per run, the samples at which its eval
/// loss first reached the target (one JSON line each).
pub fn run(args: &crate::cli::PlotArgs) -> anyhow::Result<()> {
    let runs: Vec<(String, &Path)> = args
        .runs
        .iter()
        .map(|spec| match spec.split_once('=') {
            Some((l, d)) => (l.to_string(), Path::new(d)),
            None => (
                Path::new(spec).file_name().map_or(spec.clone(), |n| n.to_string_lossy().into_owned()),
                Path::new(spec.as_str()),
            ),
        })
        .collect();
    for (spec, (_, dir)) in args.runs.iter().zip(&runs) {
        crate::paths::ensure_not_an_input("--out", &args.out, &[(spec.as_str(), &dir.join("metrics.jsonl"))])?;
    }
    crate::paths::ensure_new_output("--out", &args.out, Some(args.overwrite))?;
    crate::paths::ensure_folder_exists("--out", &args.out)?;
    anyhow::ensure!(!args.out.is_dir(), "--out {} is a directory: name the SVG file to write", args.out.display());
    let mut curves = Vec::new();
    for (label, dir) in runs {
        let curve = read_metrics(&dir.join("metrics.jsonl"), &label)?;
        let reached = curve.eval.iter().find(|(_, l)| *l <= args.target).map(|(s, _)| *s);
        crate::outln!(
            "{}",
            serde_json::json!({"run": label, "dir": dir.display().to_string(), "samples_to_target": reached, "evals": curve.eval.len()})
        );
        curves.push(curve);
    }
    loss_svg(&args.out, &curves, args.target)?;
    eprintln!("wrote {}", args.out.display());
    Ok(())
}
