//! Loss curves as SVG, drawn with plotters: train and eval loss against samples, with the
//! target line, and for preference tuning the held-out reward margin. SVG needs no font or image library on the machine (the PNG backend would).

use std::path::Path;

use anyhow::Context;
use plotters::prelude::*;

/// One run's curves: (samples, loss) points.
#[derive(Debug, Clone, Default)]
pub struct Curve {
    /// Legend label (config name, or what differs between runs).
    pub label: String,
    /// Training loss per step.
    pub train: Vec<(f64, f64)>,
    /// Evaluation loss per evaluation.
    pub eval: Vec<(f64, f64)>,
    /// Preference tuning's held-out reward margin (chosen minus rejected) per evaluation.
    pub margin: Vec<(f64, f64)>,
}

impl Curve {
    /// Adds what one `metrics.jsonl` record holds for the plot (a step's loss, an evaluation's
    /// loss and reward margin), at its sample count.
    pub fn push_record(&mut self, v: &serde_json::Value) {
        let Some(s) = v["samples"].as_f64() else { return };
        for (key, points) in
            [("loss", &mut self.train), ("eval_loss", &mut self.eval), ("eval_rewards_margin", &mut self.margin)]
        {
            if let Some(y) = v[key].as_f64() {
                points.push((s, y));
            }
        }
    }
}

/// Reads a run's `metrics.jsonl` into a curve.
pub fn read_metrics(path: &Path, label: &str) -> anyhow::Result<Curve> {
    let text = std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let mut curve = Curve { label: label.to_string(), ..Curve::default() };
    for (i, line) in text.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let v: serde_json::Value =
            serde_json::from_str(line).with_context(|| format!("{}:{}: not JSON", path.display(), i + 1))?;
        curve.push_record(&v);
    }
    Ok(curve)
}

/// Writes an SVG of every curve's train loss (thin), eval loss (thick, with points) and reward
/// margin (dashed, where there is one) and a dashed horizontal line at `target`, written
/// atomically.
pub fn loss_svg(path: &Path, curves: &[Curve], target: f64) -> anyhow::Result<()> {
    let points = || curves.iter().flat_map(|c| c.train.iter().chain(&c.eval).chain(&c.margin));
    let x_max = points().map(|p| p.0).fold(1.0, f64::max);
    let y_max = points().map(|p| p.1).filter(|y| y.is_finite()).fold(target, f64::max) * 1.05;
    let y_min = points().map(|p| p.1).filter(|y| y.is_finite()).fold(target, f64::min).min(0.0);
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, (900, 560)).into_drawing_area();
        root.fill(&WHITE)?;
        let mut chart = ChartBuilder::on(&root)
            .caption("loss against training samples", ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(56)
            .build_cartesian_2d(0.0..x_max, y_min..y_max)?;
        chart.configure_mesh().x_desc("training samples").y_desc("loss").draw()?;
        for (i, c) in curves.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            chart
                .draw_series(LineSeries::new(c.train.iter().copied(), color.mix(0.45).stroke_width(1)))?
                .label(format!("{} train", c.label))
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], color.mix(0.45)));
            chart
                .draw_series(LineSeries::new(c.eval.iter().copied(), color.stroke_width(3)).point_size(3))?
                .label(format!("{} eval", c.label))
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], color.stroke_width(3)));
            if !c.margin.is_empty() {
                chart
                    .draw_series(DashedLineSeries::new(c.margin.iter().copied(), 3, 3, color.stroke_width(2)))?
                    .label(format!("{} eval reward margin", c.label))
                    .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], color.stroke_width(2)));
            }
        }
        chart
            .draw_series(DashedLineSeries::new([(0.0, target), (x_max, target)], 6, 4, BLACK.stroke_width(1)))?
            .label(format!("target {target}"))
            .legend(|(x, y)| PathElement::new([(x, y), (x + 18, y)], BLACK));
        chart.configure_series_labels().background_style(WHITE.mix(0.85)).border_style(BLACK).draw()?;
        root.present()?;
    }
    llora_model::checkpoint::write_atomic(path, svg.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_curves_and_the_target() {
        let dir = tempfile::tempdir().unwrap();
        let metrics = dir.path().join("metrics.jsonl");
        std::fs::write(
            &metrics,
            "{\"step\":1,\"samples\":8,\"loss\":2.5}\n{\"step\":2,\"samples\":16,\"loss\":1.5}\n{\"step\":2,\"samples\":16,\"eval_loss\":1.25}\n",
        )
        .unwrap();
        let c = read_metrics(&metrics, "run").unwrap();
        assert_eq!(c.train, vec![(8.0, 2.5), (16.0, 1.5)]);
        assert_eq!(c.eval, vec![(16.0, 1.25)]);
        let svg = dir.path().join("loss.svg");
        loss_svg(&svg, &[c], 0.925).unwrap();
        let text = std::fs::read_to_string(&svg).unwrap();
        assert!(text.starts_with("<svg") && text.contains("target 0.925") && text.contains("run eval"), "{text}");
        assert!(text.contains("<polyline"), "the curves are drawn");
        assert!(!text.contains("reward margin"), "no margin without preference tuning");

        // A DPO run's held-out margin is drawn beside its losses.
        let with_margin = "{\"step\":1,\"samples\":8,\"loss\":0.69}\n\
                           {\"step\":1,\"samples\":8,\"eval_loss\":0.6,\"eval_rewards_margin\":0.25}\n";
        std::fs::write(&metrics, with_margin).unwrap();
        let c = read_metrics(&metrics, "dpo").unwrap();
        assert_eq!(c.margin, vec![(8.0, 0.25)]);
        loss_svg(&svg, &[c], 0.5).unwrap();
        assert!(std::fs::read_to_string(&svg).unwrap().contains("dpo eval reward margin"));
    }
}
