//! SVG charts, written by hand (no dependency): memory against the varied dimension.
//!
//! One chart per run. A chart draws, for each series (one run of one file):
//! - every probe as a point at (value, plan bytes): a filled circle (`class="probe fit"`) when
//!   it fitted, a cross (`class="probe fail"`) when it failed; points above the chart's top are
//!   drawn on the top edge and their tooltip says so;
//! - the plan's predicted line (`class="predicted"`): the plan of the run's workload rebuilt
//!   at about 64 values across the axis (`data-source="plan"`) when it reproduces the bytes
//!   recorded for every probe, else a line through the probes' bytes (`data-source="probes"`);
//! - the capacity the run measured against, a horizontal line (`class="capacity"`);
//! - the boundary: a band from max fit to first fail and a line at max fit (`class="boundary"`),
//!   and the predicted max as a dotted line (`class="predicted-max"`);
//! - the fitting value with the most throughput, ringed (`class="best"`).
//!
//! [`render_report`] stacks one chart per run vertically in one SVG document; the HTML report
//! embeds one `<svg>` per run instead ([`run_svg`]). `compare` draws one chart per scenario and
//! variant with one series per file ([`chart_svg`]).

use super::model::{ProbeRecord, ProbeReport, RunResult};
use super::throughput::best_throughput;
use super::{fmt_value, run_capacity, run_label, sorted_probes};
use crate::plan::Plan;
use crate::units::fmt_bytes;

/// Chart size in pixels.
pub const WIDTH: f64 = 820.0;
pub const HEIGHT: f64 = 360.0;
const LEFT: f64 = 78.0;
const RIGHT: f64 = 190.0;
const TOP: f64 = 40.0;
const BOTTOM: f64 = 48.0;

/// Series colours (colour-blind friendly, Okabe-Ito).
pub const PALETTE: [&str; 8] = [
    "#0072B2", "#D55E00", "#009E73", "#CC79A7", "#E69F00", "#56B4E9", "#000000", "#F0E442",
];
const FAIL_RED: &str = "#C0392B";
const CAPACITY_RED: &str = "#C0392B";
const BEST: &str = "#E69F00";

/// One run drawn in a chart.
pub struct Series<'a> {
    /// Legend text (a file or device name); empty for a single-series chart.
    pub label: String,
    pub color: &'a str,
    pub run: &'a RunResult,
    /// The memory the run measured against.
    pub capacity: Option<u64>,
}

/// Escape text for XML content and attribute values.
pub fn esc(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&apos;"),
            c if (c as u32) < 0x20 && c != '\n' && c != '\t' => o.push(' '),
            c => o.push(c),
        }
    }
    o
}

/// A linear or log2 axis mapping values to pixels.
#[derive(Debug, Clone, Copy)]
struct Axis {
    lo: f64,
    hi: f64,
    log: bool,
    p0: f64,
    p1: f64,
}

impl Axis {
    fn map(&self, v: f64) -> f64 {
        let (a, b, x) = if self.log {
            (self.lo.log2(), self.hi.log2(), v.max(self.lo).log2())
        } else {
            (self.lo, self.hi, v)
        };
        if b <= a {
            return (self.p0 + self.p1) / 2.0;
        }
        self.p0 + (x - a) / (b - a) * (self.p1 - self.p0)
    }
}

/// A "nice" step (1, 2 or 5 times a power of ten) giving about `n` intervals over `range`.
fn nice_step(range: f64, n: f64) -> f64 {
    if range <= 0.0 || !range.is_finite() {
        return 1.0;
    }
    let raw = range / n;
    let p = 10f64.powf(raw.log10().floor());
    let m = raw / p;
    let k = if m <= 1.0 {
        1.0
    } else if m <= 2.0 {
        2.0
    } else if m <= 5.0 {
        5.0
    } else {
        10.0
    };
    k * p
}

/// Where a label beside a vertical line at `x` goes: on the preferred side unless it would
/// leave the plot area `[p0, p1]` (11 px text, about 6.2 px per character).
fn label_place(x: f64, text: &str, prefer_right: bool, p0: f64, p1: f64) -> (f64, &'static str) {
    let w = 6.2 * text.chars().count() as f64;
    let right_fits = x + 4.0 + w <= p1;
    let left_fits = x - 4.0 - w >= p0;
    if (prefer_right && right_fits) || (!prefer_right && !left_fits) {
        (x + 4.0, "start")
    } else {
        (x - 4.0, "end")
    }
}

fn f(v: f64) -> String {
    format!("{v:.1}")
}

/// The x range over all series: probes, max fit, first fail, predicted max.
fn x_values(series: &[Series<'_>]) -> Vec<f64> {
    let mut xs = Vec::new();
    for s in series {
        xs.extend(s.run.probes.iter().map(|p| p.value as f64));
        xs.extend(
            [s.run.max_fit, s.run.first_fail, s.run.predicted_max]
                .into_iter()
                .flatten()
                .map(|v| v as f64),
        );
    }
    xs.retain(|v| v.is_finite() && *v > 0.0);
    xs
}

/// The plan's total bytes at about 64 values spread over the axis, or None when the plan of the
/// run's workload does not reproduce the bytes recorded for its probes (a report from another
/// version, or a synthetic one): then the line goes through the probes alone.
fn plan_curve(run: &RunResult, xa: &Axis) -> Option<Vec<(u64, u64)>> {
    let total = |x: u64| {
        Plan::for_value(&run.workload, run.scenario, x)
            .ok()
            .map(|p| p.peak_bytes())
    };
    if run.probes.is_empty() {
        return None;
    }
    for p in &run.probes {
        if total(p.value)? != p.bytes {
            return None;
        }
    }
    const N: usize = 64;
    let lo = xa.lo.max(1.0);
    let hi = xa.hi.max(lo);
    let mut xs: Vec<u64> = (0..=N)
        .map(|i| {
            let t = i as f64 / N as f64;
            let v = if xa.log {
                (lo.ln() + t * (hi.ln() - lo.ln())).exp()
            } else {
                lo + t * (hi - lo)
            };
            v.round().max(1.0) as u64
        })
        .chain(run.probes.iter().map(|p| p.value))
        .collect();
    xs.sort_unstable();
    xs.dedup();
    let pts: Vec<(u64, u64)> = xs
        .into_iter()
        .filter_map(|x| Some((x, total(x)?)))
        .collect();
    (pts.len() >= 2).then_some(pts)
}

/// One chart as a complete `<svg>` element of `WIDTH` x `HEIGHT`.
pub fn chart_svg(title: &str, dimension: &str, series: &[Series<'_>]) -> String {
    format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" \
         viewBox=\"0 0 {w} {h}\" font-family=\"sans-serif\" font-size=\"12\">\n{}</svg>\n",
        chart_body(title, dimension, series),
        w = WIDTH,
        h = HEIGHT
    )
}

/// One chart's elements (no `<svg>` wrapper), drawn in a `WIDTH` x `HEIGHT` box at the origin.
pub fn chart_body(title: &str, dimension: &str, series: &[Series<'_>]) -> String {
    let mut o = String::new();
    o.push_str(&format!(
        "<rect class=\"background\" x=\"0\" y=\"0\" width=\"{}\" height=\"{}\" fill=\"#ffffff\"/>\n",
        WIDTH, HEIGHT
    ));
    o.push_str(&format!(
        "<text class=\"title\" x=\"{}\" y=\"22\" font-size=\"15\" font-weight=\"bold\" fill=\"#222\">{}</text>\n",
        f(LEFT),
        esc(title)
    ));
    let xs = x_values(series);
    if xs.is_empty() {
        o.push_str(&format!(
            "<text x=\"{}\" y=\"{}\" fill=\"#666\">no probes</text>\n",
            f(LEFT),
            f(HEIGHT / 2.0)
        ));
        return o;
    }
    let fr = frame(&xs, series);
    grid_and_ticks(&mut o, &fr, dimension);
    for s in series {
        series_marks(&mut o, s, &fr, dimension);
    }
    o.push_str(&legend(series));
    o
}

/// A chart's frame: its axes (log2 x for a wide range), the y axis's top and where marks clip.
#[derive(Debug, Clone, Copy)]
struct Frame {
    xa: Axis,
    ya: Axis,
    log: bool,
    ytop: f64,
    clip_top: f64,
    single: bool,
}

/// The frame for these x values and series: the axes' ranges from the probes and capacities.
fn frame(xs: &[f64], series: &[Series<'_>]) -> Frame {
    let (px0, px1) = (LEFT, WIDTH - RIGHT);
    let (py0, py1) = (HEIGHT - BOTTOM, TOP);
    // X axis: log2 when the values span a wide range (doubling search), linear otherwise.
    let xmin = xs.iter().cloned().fold(f64::INFINITY, f64::min);
    let xmax = xs.iter().cloned().fold(0.0, f64::max);
    let log = xmax / xmin >= 32.0;
    let xa = if log {
        Axis {
            lo: xmin / 1.25,
            hi: xmax * 1.25,
            log,
            p0: px0,
            p1: px1,
        }
    } else {
        Axis {
            lo: 0.0,
            hi: xmax * 1.08,
            log,
            p0: px0,
            p1: px1,
        }
    };
    // Y axis: bytes from 0; clip far overshoots at 2.5x the largest capacity.
    let cap_max = series.iter().filter_map(|s| s.capacity).max().unwrap_or(0) as f64;
    let bytes_max = series
        .iter()
        .flat_map(|s| s.run.probes.iter().map(|p| p.bytes as f64))
        .fold(0.0, f64::max);
    let mut ytop = bytes_max.max(cap_max);
    if cap_max > 0.0 {
        ytop = ytop.min(cap_max * 2.5);
    }
    if ytop <= 0.0 {
        ytop = 1.0;
    }
    let ytop = ytop * 1.08;
    let ya = Axis {
        lo: 0.0,
        hi: ytop,
        log: false,
        p0: py0,
        p1: py1,
    };
    let single = series.len() == 1;
    let clip_top = ytop / 1.08;
    Frame {
        xa,
        ya,
        log,
        ytop,
        clip_top,
        single,
    }
}

/// The grid, the axes, their tick labels and their titles.
fn grid_and_ticks(o: &mut String, fr: &Frame, dimension: &str) {
    let Frame {
        xa, ya, log, ytop, ..
    } = *fr;
    let (px0, px1) = (LEFT, WIDTH - RIGHT);
    let (py0, py1) = (HEIGHT - BOTTOM, TOP);
    // Grid and axes.
    let mut unit = 1f64;
    let mut uname = "B";
    for (u, n) in [
        (1024f64, "KiB"),
        (1048576.0, "MiB"),
        (1073741824.0, "GiB"),
        (1099511627776.0, "TiB"),
    ] {
        if ytop / u >= 1.0 {
            unit = u;
            uname = n;
        }
    }
    let ystep = nice_step(ytop / unit, 5.0) * unit;
    o.push_str("<g class=\"grid\" stroke=\"#e5e5e5\" stroke-width=\"1\">\n");
    let mut yt = 0.0;
    let mut yticks = Vec::new();
    while yt <= ytop + 1e-9 && yticks.len() < 20 {
        yticks.push(yt);
        yt += ystep;
    }
    for &t in &yticks {
        o.push_str(&format!(
            "<line x1=\"{}\" y1=\"{y}\" x2=\"{}\" y2=\"{y}\"/>\n",
            f(px0),
            f(px1),
            y = f(ya.map(t))
        ));
    }
    let xticks = x_ticks(&xa, log, dimension);
    for &t in &xticks {
        o.push_str(&format!(
            "<line x1=\"{x}\" y1=\"{}\" x2=\"{x}\" y2=\"{}\"/>\n",
            f(py0),
            f(py1),
            x = f(xa.map(t))
        ));
    }
    o.push_str("</g>\n");
    o.push_str(&format!(
        "<g class=\"axes\" stroke=\"#444\" stroke-width=\"1\"><line x1=\"{x0}\" y1=\"{y0}\" x2=\"{x1}\" y2=\"{y0}\"/><line x1=\"{x0}\" y1=\"{y0}\" x2=\"{x0}\" y2=\"{y1}\"/></g>\n",
        x0 = f(px0),
        x1 = f(px1),
        y0 = f(py0),
        y1 = f(py1)
    ));
    o.push_str("<g class=\"ticks\" fill=\"#444\" font-size=\"11\">\n");
    for &t in &yticks {
        let v = t / unit;
        let label = if (v - v.round()).abs() < 1e-9 {
            format!("{v:.0} {uname}")
        } else {
            format!("{v:.1} {uname}")
        };
        o.push_str(&format!(
            "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{}</text>\n",
            f(px0 - 6.0),
            f(ya.map(t) + 4.0),
            label
        ));
    }
    for &t in &xticks {
        o.push_str(&format!(
            "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n",
            f(xa.map(t)),
            f(py0 + 16.0),
            esc(&fmt_value(dimension, t.round() as u64))
        ));
    }
    o.push_str("</g>\n");
    o.push_str(&format!(
        "<text class=\"axis-title\" x=\"{}\" y=\"{}\" text-anchor=\"middle\" fill=\"#222\">{}{}</text>\n",
        f((px0 + px1) / 2.0),
        f(HEIGHT - 10.0),
        esc(dimension),
        if log { " (log scale)" } else { "" }
    ));
    o.push_str(&format!(
        "<text class=\"axis-title\" transform=\"translate(16 {}) rotate(-90)\" text-anchor=\"middle\" fill=\"#222\">memory (plan bytes)</text>\n",
        f((py0 + py1) / 2.0)
    ));
}

/// The x axis's ticks: 1-2-5 decimal for log parameter counts, else powers of two or round steps.
fn x_ticks(xa: &Axis, log: bool, dimension: &str) -> Vec<f64> {
    if log && dimension == "params" {
        // Parameter counts: 1-2-5 decimal ticks (1M, 2M, 5M, 10M, ...).
        let mut v = Vec::new();
        let mut e = xa.lo.log10().floor() as i32;
        while 10f64.powi(e) <= xa.hi && v.len() < 40 {
            for m in [1.0, 2.0, 5.0] {
                let t = m * 10f64.powi(e);
                if t >= xa.lo && t <= xa.hi {
                    v.push(t);
                }
            }
            e += 1;
        }
        if v.len() > 9 {
            v.retain(|t| (t.log10() - t.log10().round()).abs() < 1e-9);
        }
        v
    } else if log {
        // Batch and sequence: powers of two (the doubling search probes them).
        let a = xa.lo.log2().ceil() as i32;
        let b = xa.hi.log2().floor() as i32;
        let stride = ((b - a) / 8 + 1).max(1);
        (a..=b)
            .filter(|e| (e - a) % stride == 0)
            .map(|e| 2f64.powi(e))
            .collect()
    } else {
        let step = nice_step(xa.hi, 6.0).max(1.0);
        let mut v = Vec::new();
        let mut t = 0.0;
        while t <= xa.hi + 1e-9 && v.len() < 20 {
            v.push(t);
            t += step;
        }
        v
    }
}

/// One series' group: boundary lines, capacity, predicted line, best-throughput ring and probes.
fn series_marks(o: &mut String, s: &Series<'_>, fr: &Frame, dimension: &str) {
    let Frame { single, .. } = *fr;
    let color = s.color;
    let fail_color = if single { FAIL_RED } else { color };
    let cap_color = if single { CAPACITY_RED } else { color };
    let run = s.run;
    let probes = sorted_probes(run);
    o.push_str(&format!(
        "<g class=\"series\" data-label=\"{}\">\n",
        esc(&s.label)
    ));
    boundary_marks(o, run, color, fr, dimension);
    capacity_marks(o, s.capacity, cap_color, fr);
    predicted_line(o, run, &probes, color, fr);
    best_ring(o, run, &probes, fr);
    probe_marks(o, run, &probes, color, fail_color, fr, dimension);
    o.push_str("</g>\n");
}

/// The max-fit band and line and the predicted max (labelled apart on a single-series chart).
fn boundary_marks(o: &mut String, run: &RunResult, color: &str, fr: &Frame, dimension: &str) {
    let Frame { xa, single, .. } = *fr;
    let (px0, px1) = (LEFT, WIDTH - RIGHT);
    let (py0, py1) = (HEIGHT - BOTTOM, TOP);
    // Boundary band and line; labels on the sides facing away from each other.
    let pred_right = match (run.max_fit, run.predicted_max) {
        (Some(m), Some(p)) => p >= m,
        _ => true,
    };
    if let Some(m) = run.max_fit {
        let xm = xa.map(m as f64);
        if let Some(ff) = run.first_fail {
            let xf = xa.map(ff as f64);
            o.push_str(&format!(
                "<rect class=\"boundary-band\" x=\"{}\" y=\"{}\" width=\"{}\" height=\"{}\" fill=\"{color}\" fill-opacity=\"0.12\"/>\n",
                f(xm.min(xf)),
                f(py1),
                f((xf - xm).abs().max(1.0)),
                f(py0 - py1)
            ));
        }
        o.push_str(&format!(
            "<line class=\"boundary\" x1=\"{x}\" y1=\"{}\" x2=\"{x}\" y2=\"{}\" stroke=\"{color}\" stroke-width=\"1.5\"><title>max fit {}</title></line>\n",
            f(py0),
            f(py1),
            esc(&fmt_value(dimension, m)),
            x = f(xm)
        ));
        if single {
            let text = format!("max fit {}", fmt_value(dimension, m));
            let (lx, anchor) = label_place(xm, &text, !pred_right, px0, px1);
            o.push_str(&format!(
                "<text class=\"boundary-label\" x=\"{}\" y=\"{}\" text-anchor=\"{anchor}\" fill=\"{color}\" font-size=\"11\">{}</text>\n",
                f(lx),
                f(py0 - 22.0),
                esc(&text)
            ));
        }
    }
    if let Some(p) = run.predicted_max {
        let xp = xa.map(p as f64);
        o.push_str(&format!(
            "<line class=\"predicted-max\" x1=\"{x}\" y1=\"{}\" x2=\"{x}\" y2=\"{}\" stroke=\"{}\" stroke-width=\"1\" stroke-dasharray=\"1 3\"><title>predicted max {}</title></line>\n",
            f(py0),
            f(py1),
            if single { "#555" } else { color },
            esc(&fmt_value(dimension, p)),
            x = f(xp)
        ));
        if single {
            let text = format!("predicted {}", fmt_value(dimension, p));
            let (lx, anchor) = label_place(xp, &text, pred_right, px0, px1);
            o.push_str(&format!(
                "<text class=\"predicted-max-label\" x=\"{}\" y=\"{}\" text-anchor=\"{anchor}\" fill=\"#555\" font-size=\"11\">{}</text>\n",
                f(lx),
                f(py0 - 8.0),
                esc(&text)
            ));
        }
    }
}

/// The capacity line and its label.
fn capacity_marks(o: &mut String, capacity: Option<u64>, cap_color: &str, fr: &Frame) {
    let Frame { ya, .. } = *fr;
    let (px0, px1) = (LEFT, WIDTH - RIGHT);
    // Capacity.
    if let Some(c) = capacity {
        let y = ya.map(c as f64);
        o.push_str(&format!(
            "<line class=\"capacity\" x1=\"{}\" y1=\"{y}\" x2=\"{}\" y2=\"{y}\" stroke=\"{cap_color}\" stroke-width=\"1.5\" stroke-dasharray=\"8 3 2 3\"><title>capacity {}</title></line>\n",
            f(px0),
            f(px1),
            esc(&fmt_bytes(c)),
            y = f(y)
        ));
        o.push_str(&format!(
            "<text class=\"capacity-label\" x=\"{}\" y=\"{}\" fill=\"{cap_color}\" font-size=\"11\">capacity {}</text>\n",
            f(px0 + 6.0),
            f(y - 4.0),
            esc(&fmt_bytes(c))
        ));
    }
}

/// The plan's predicted line, clipped where it leaves the top of the chart.
fn predicted_line(
    o: &mut String,
    run: &RunResult,
    probes: &[&ProbeRecord],
    color: &str,
    fr: &Frame,
) {
    let Frame {
        xa, ya, clip_top, ..
    } = *fr;
    // The plan's predicted line: rebuilt from the run's workload across the whole axis when
    // the plan reproduces every probe's recorded bytes, else through the probes' bytes.
    let (line, source) = match plan_curve(run, &xa) {
        Some(c) => (c, "plan"),
        None => (
            probes.iter().map(|p| (p.value, p.bytes)).collect(),
            "probes",
        ),
    };
    // Stop the line where it leaves the top of the chart (the plan grows with x).
    let line: Vec<(u64, u64)> = match line.iter().position(|&(_, b)| b as f64 > clip_top) {
        Some(i) if source == "plan" => line[..=i].to_vec(),
        _ => line,
    };
    if line.len() >= 2 {
        let pts: Vec<String> = line
            .iter()
            .map(|&(x, b)| {
                format!(
                    "{},{}",
                    f(xa.map(x as f64)),
                    f(ya.map((b as f64).min(clip_top)))
                )
            })
            .collect();
        o.push_str(&format!(
            "<polyline class=\"predicted\" data-source=\"{source}\" points=\"{}\" fill=\"none\" stroke=\"{color}\" stroke-width=\"1.5\" stroke-dasharray=\"6 4\" stroke-opacity=\"0.8\"/>\n",
            pts.join(" ")
        ));
    }
}

/// The ring on the probe with the most throughput.
fn best_ring(o: &mut String, run: &RunResult, probes: &[&ProbeRecord], fr: &Frame) {
    let Frame {
        xa, ya, clip_top, ..
    } = *fr;
    // Best throughput ring.
    if let Some(b) = best_throughput(run) {
        if let Some(p) = probes
            .iter()
            .find(|p| p.value == b.value && p.outcome.is_fit())
        {
            o.push_str(&format!(
                "<circle class=\"best\" cx=\"{}\" cy=\"{}\" r=\"9\" fill=\"none\" stroke=\"{BEST}\" stroke-width=\"2.5\"><title>most throughput: {} = {} ({})</title></circle>\n",
                f(xa.map(p.value as f64)),
                f(ya.map((p.bytes as f64).min(clip_top))),
                esc(&run.dimension),
                p.value,
                esc(&b.rate())
            ));
        }
    }
}

/// Each probe: a dot for a fit, a cross for a failure, with its value, outcome and plan bytes.
fn probe_marks(
    o: &mut String,
    run: &RunResult,
    probes: &[&ProbeRecord],
    color: &str,
    fail_color: &str,
    fr: &Frame,
    dimension: &str,
) {
    let Frame {
        xa, ya, clip_top, ..
    } = *fr;
    // Probes.
    for p in probes {
        let clipped = p.bytes as f64 > clip_top;
        let x = xa.map(p.value as f64);
        let y = ya.map((p.bytes as f64).min(clip_top));
        let tip = format!(
            "{} {}: {}, plan {}{}",
            run.dimension,
            fmt_value(dimension, p.value),
            p.outcome.name(),
            fmt_bytes(p.bytes),
            if clipped { " (above the chart)" } else { "" }
        );
        if p.outcome.is_fit() {
            o.push_str(&format!(
                "<circle class=\"probe fit\" cx=\"{}\" cy=\"{}\" r=\"4.5\" fill=\"{color}\" stroke=\"#fff\" stroke-width=\"1\"><title>{}</title></circle>\n",
                f(x),
                f(y),
                esc(&tip)
            ));
        } else {
            let d = 5.0;
            o.push_str(&format!(
                "<path class=\"probe fail\" d=\"M{} {}L{} {}M{} {}L{} {}\" stroke=\"{fail_color}\" stroke-width=\"2.2\" fill=\"none\"><title>{}</title></path>\n",
                f(x - d),
                f(y - d),
                f(x + d),
                f(y + d),
                f(x - d),
                f(y + d),
                f(x + d),
                f(y - d),
                esc(&tip)
            ));
        }
    }
}

fn legend(series: &[Series<'_>]) -> String {
    let x = WIDTH - RIGHT + 16.0;
    let mut y = TOP + 6.0;
    let single = series.len() == 1;
    let main = series.first().map(|s| s.color).unwrap_or(PALETTE[0]);
    let mut o = String::from("<g class=\"legend\" font-size=\"11\" fill=\"#222\">\n");
    let push = |o: &mut String, y: &mut f64, mark: String, text: &str| {
        o.push_str(&mark);
        o.push_str(&format!(
            "<text x=\"{}\" y=\"{}\">{}</text>\n",
            f(x + 24.0),
            f(*y + 4.0),
            esc(text)
        ));
        *y += 18.0;
    };
    if !single {
        for s in series {
            let mark = format!(
                "<rect x=\"{}\" y=\"{}\" width=\"14\" height=\"10\" fill=\"{}\"/>\n",
                f(x),
                f(y - 5.0),
                s.color
            );
            push(&mut o, &mut y, mark, &s.label);
        }
        y += 6.0;
    }
    let dot = if single { main } else { "#555" };
    let fail = if single { FAIL_RED } else { "#555" };
    let cap = if single { CAPACITY_RED } else { "#555" };
    type Mark<'a> = Box<dyn Fn(f64) -> String + 'a>;
    let items: Vec<(Mark<'_>, &str)> = vec![
        (
            Box::new(|y| {
                format!(
                    "<circle cx=\"{}\" cy=\"{}\" r=\"4.5\" fill=\"{dot}\"/>\n",
                    f(x + 7.0),
                    f(y)
                )
            }),
            "probe fitted",
        ),
        (
            Box::new(|y| {
                format!(
                    "<path d=\"M{} {}L{} {}M{} {}L{} {}\" stroke=\"{fail}\" stroke-width=\"2.2\"/>\n",
                    f(x + 2.0),
                    f(y - 5.0),
                    f(x + 12.0),
                    f(y + 5.0),
                    f(x + 2.0),
                    f(y + 5.0),
                    f(x + 12.0),
                    f(y - 5.0)
                )
            }),
            "probe failed",
        ),
        (
            Box::new(|y| {
                format!(
                    "<line x1=\"{}\" y1=\"{y}\" x2=\"{}\" y2=\"{y}\" stroke=\"{dot}\" stroke-width=\"1.5\" stroke-dasharray=\"6 4\"/>\n",
                    f(x),
                    f(x + 18.0),
                    y = f(y)
                )
            }),
            "plan (predicted bytes)",
        ),
        (
            Box::new(|y| {
                format!(
                    "<line x1=\"{}\" y1=\"{y}\" x2=\"{}\" y2=\"{y}\" stroke=\"{cap}\" stroke-width=\"1.5\" stroke-dasharray=\"8 3 2 3\"/>\n",
                    f(x),
                    f(x + 18.0),
                    y = f(y)
                )
            }),
            "capacity",
        ),
        (
            Box::new(|y| {
                format!(
                    "<rect x=\"{x0}\" y=\"{}\" width=\"18\" height=\"12\" fill=\"{dot}\" fill-opacity=\"0.12\"/><line x1=\"{x0}\" y1=\"{}\" x2=\"{x0}\" y2=\"{}\" stroke=\"{dot}\" stroke-width=\"1.5\"/>\n",
                    f(y - 6.0),
                    f(y - 6.0),
                    f(y + 6.0),
                    x0 = f(x)
                )
            }),
            "max fit .. first fail",
        ),
        (
            Box::new(|y| {
                format!(
                    "<line x1=\"{x1}\" y1=\"{}\" x2=\"{x1}\" y2=\"{}\" stroke=\"#555\" stroke-dasharray=\"1 3\"/>\n",
                    f(y - 6.0),
                    f(y + 6.0),
                    x1 = f(x + 9.0)
                )
            }),
            "predicted max",
        ),
        (
            Box::new(|y| {
                format!(
                    "<circle cx=\"{}\" cy=\"{}\" r=\"7\" fill=\"none\" stroke=\"{BEST}\" stroke-width=\"2.5\"/>\n",
                    f(x + 7.0),
                    f(y)
                )
            }),
            "most throughput",
        ),
    ];
    for (mark, text) in items {
        let m = mark(y);
        push(&mut o, &mut y, m, text);
    }
    o.push_str("</g>\n");
    o
}

/// The chart title of a run in a report: `batch — resnet50 · llvmpipe (budget 512 MiB)`.
pub fn run_title(report: &ProbeReport, run: &RunResult) -> String {
    format!(
        "{}{} \u{2014} {} \u{00b7} {}",
        run_label(run),
        if run.is_partial() {
            " (in progress)"
        } else {
            ""
        },
        run.workload.name,
        report.device.name
    )
}

/// One run of a report as a standalone `<svg>` element.
pub fn run_svg(report: &ProbeReport, run: &RunResult) -> String {
    let series = [Series {
        label: String::new(),
        color: PALETTE[0],
        run,
        capacity: run_capacity(report, run),
    }];
    chart_svg(&run_title(report, run), &run.dimension, &series)
}

/// Several charts stacked vertically in one SVG document (each body at the origin).
pub fn stack(charts: &[String]) -> String {
    let n = charts.len().max(1) as f64;
    let mut o = format!(
        "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" viewBox=\"0 0 {w} {h}\" font-family=\"sans-serif\" font-size=\"12\">\n",
        w = WIDTH,
        h = HEIGHT * n
    );
    if charts.is_empty() {
        o.push_str(&format!(
            "<rect width=\"{}\" height=\"{}\" fill=\"#fff\"/><text x=\"{}\" y=\"{}\" fill=\"#666\">no runs</text>\n",
            WIDTH,
            HEIGHT,
            f(LEFT),
            f(HEIGHT / 2.0)
        ));
    }
    for (i, c) in charts.iter().enumerate() {
        o.push_str(&format!(
            "<g class=\"chart\" transform=\"translate(0 {})\">\n{c}</g>\n",
            f(HEIGHT * i as f64)
        ));
    }
    o.push_str("</svg>\n");
    o
}

/// The whole report: one chart per run, stacked vertically in one SVG document.
pub fn render_report(report: &ProbeReport) -> String {
    let charts: Vec<String> = report
        .runs
        .iter()
        .map(|run| {
            let series = [Series {
                label: String::new(),
                color: PALETTE[0],
                run,
                capacity: run_capacity(report, run),
            }];
            chart_body(&run_title(report, run), &run.dimension, &series)
        })
        .collect();
    stack(&charts)
}
