//! Small SVG charts for the reports (grouped bars, lines), saved as PNG when ImageMagick's
//! `convert` or `rsvg-convert` is installed (`scripts/test` installs `rsvg-convert`), as SVG
//! only when neither is. One format per chart: the SVG is not kept beside its PNG. No plotting
//! library: the charts are a few dozen shapes.

use std::fmt::Write as _;
use std::path::Path;
use std::process::Command;

const W: f64 = 760.0;
const H: f64 = 400.0;
const LEFT: f64 = 70.0;
const RIGHT: f64 = 20.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 90.0;
const COLORS: [&str; 5] = ["#4477aa", "#ee6677", "#228833", "#ccbb44", "#66ccee"];

fn header(title: &str) -> String {
    format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{H}\" font-family=\"DejaVu Sans, sans-serif\" font-size=\"12\">\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\
         <text x=\"{}\" y=\"22\" text-anchor=\"middle\" font-size=\"15\">{title}</text>",
        W / 2.0
    )
}

fn axes(o: &mut String, max: f64, unit: &str) {
    let (x0, y0, y1) = (LEFT, H - BOTTOM, TOP);
    let _ = write!(
        o,
        "<line x1=\"{x0}\" y1=\"{y0}\" x2=\"{}\" y2=\"{y0}\" stroke=\"black\"/>",
        W - RIGHT
    );
    let _ = write!(
        o,
        "<line x1=\"{x0}\" y1=\"{y0}\" x2=\"{x0}\" y2=\"{y1}\" stroke=\"black\"/>"
    );
    for i in 0..=4 {
        let v = max * i as f64 / 4.0;
        let y = y0 - (y0 - y1) * i as f64 / 4.0;
        let _ = write!(
            o,
            "<line x1=\"{x0}\" y1=\"{y}\" x2=\"{}\" y2=\"{y}\" stroke=\"#ddd\"/><text x=\"{}\" y=\"{}\" text-anchor=\"end\">{}</text>",
            W - RIGHT,
            x0 - 5.0,
            y + 4.0,
            short(v)
        );
    }
    let _ = write!(
        o,
        "<text x=\"14\" y=\"{}\" transform=\"rotate(-90 14 {})\" text-anchor=\"middle\">{unit}</text>",
        (y0 + y1) / 2.0,
        (y0 + y1) / 2.0
    );
}

/// The value axis' top: four round steps (1, 2, 2.5 or 5 times a power of ten) that reach
/// at least 5% above the largest value.
fn top(series: &[(&str, Vec<f64>)]) -> f64 {
    let max = series
        .iter()
        .flat_map(|s| s.1.iter().copied())
        .fold(1.0, f64::max)
        * 1.05;
    let raw = max / 4.0;
    let p = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .into_iter()
        .map(|m| m * p)
        .find(|&s| s >= raw)
        .unwrap_or(10.0 * p);
    step * 4.0
}

fn short(v: f64) -> String {
    let k = v / 1e3;
    if (1e3..1e6).contains(&v) && k.fract() != 0.0 {
        format!("{k:.1}k")
    } else if (1e3..1e6).contains(&v) {
        format!("{k:.0}k")
    } else if v < 1e3 && v.fract() != 0.0 {
        format!("{v:.1}")
    } else {
        crate::stats::rate(v)
    }
}

/// One entry per series under the chart, laid out by name length, wrapping to a second row.
fn legend(o: &mut String, names: &[&str]) {
    let (mut x, mut y) = (LEFT, H - 28.0);
    for (i, n) in names.iter().enumerate() {
        let w = 26.0 + 7.0 * n.chars().count() as f64;
        if x + w > W - RIGHT && x > LEFT {
            (x, y) = (LEFT, y + 18.0);
        }
        let _ = write!(
            o,
            "<rect x=\"{x}\" y=\"{}\" width=\"12\" height=\"12\" fill=\"{}\"/><text x=\"{}\" y=\"{y}\">{n}</text>",
            y - 10.0,
            COLORS[i % COLORS.len()],
            x + 16.0
        );
        x += w;
    }
}

/// Grouped bars: one group per label, one bar per series.
pub fn bars(title: &str, unit: &str, labels: &[String], series: &[(&str, Vec<f64>)]) -> String {
    let max = top(series);
    let mut o = header(title);
    axes(&mut o, max, unit);
    let plot_w = W - LEFT - RIGHT;
    let group = plot_w / labels.len() as f64;
    let bar = group * 0.8 / series.len() as f64;
    let scale = (H - BOTTOM - TOP) / max;
    for (g, label) in labels.iter().enumerate() {
        let gx = LEFT + g as f64 * group + group * 0.1;
        for (i, (_, vals)) in series.iter().enumerate() {
            let v = vals.get(g).copied().unwrap_or(0.0);
            let h = v * scale;
            let _ = write!(
                o,
                "<rect x=\"{:.1}\" y=\"{:.1}\" width=\"{:.1}\" height=\"{:.1}\" fill=\"{}\"/>",
                gx + i as f64 * bar,
                H - BOTTOM - h,
                bar * 0.95,
                h,
                COLORS[i % COLORS.len()]
            );
        }
        let _ = write!(
            o,
            "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">{label}</text>",
            gx + group * 0.4,
            H - BOTTOM + 16.0
        );
    }
    legend(&mut o, &series.iter().map(|s| s.0).collect::<Vec<_>>());
    o + "</svg>"
}

/// Lines over x = 1..=n.
pub fn lines(title: &str, unit: &str, xlabel: &str, series: &[(&str, Vec<f64>)]) -> String {
    let n = series.iter().map(|s| s.1.len()).max().unwrap_or(1).max(2);
    let max = top(series);
    let mut o = header(title);
    axes(&mut o, max, unit);
    let plot_w = W - LEFT - RIGHT;
    let scale = (H - BOTTOM - TOP) / max;
    let x = |i: usize| LEFT + plot_w * i as f64 / (n - 1) as f64;
    for (k, (_, vals)) in series.iter().enumerate() {
        let pts: Vec<String> = vals
            .iter()
            .enumerate()
            .map(|(i, v)| format!("{:.1},{:.1}", x(i), H - BOTTOM - v * scale))
            .collect();
        let _ = write!(
            o,
            "<polyline points=\"{}\" fill=\"none\" stroke=\"{}\" stroke-width=\"2\"/>",
            pts.join(" "),
            COLORS[k % COLORS.len()]
        );
    }
    for i in (0..n).step_by((n / 10).max(1)) {
        let _ = write!(
            o,
            "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">{}</text>",
            x(i),
            H - BOTTOM + 16.0,
            i + 1
        );
    }
    let _ = write!(
        o,
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{xlabel}</text>",
        LEFT + plot_w / 2.0,
        H - BOTTOM + 32.0
    );
    legend(&mut o, &series.iter().map(|s| s.0).collect::<Vec<_>>());
    o + "</svg>"
}

/// Writes `name.png` in `dir` if a converter is installed, else `name.svg`. Returns the file
/// the report should link.
pub fn save(dir: &Path, name: &str, svg: &str) -> String {
    let svg_path = dir.join(format!("{name}.svg"));
    std::fs::write(&svg_path, svg).unwrap_or_else(|e| panic!("write {}: {e}", svg_path.display()));
    let png = dir.join(format!("{name}.png"));
    let converted = Command::new("rsvg-convert")
        .arg("-o")
        .arg(&png)
        .arg(&svg_path)
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
        || Command::new("convert")
            .arg(&svg_path)
            .arg(&png)
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
    if converted {
        let _ = std::fs::remove_file(&svg_path);
        format!("{name}.png")
    } else {
        format!("{name}.svg")
    }
}
