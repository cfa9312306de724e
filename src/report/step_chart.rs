//! The picture of one predicted step (`estimate --out FILE.svg|FILE.html`), drawn with plotters.
//!
//! Over the step's events (x: the index into `Plan::events`) it draws:
//! - the live bytes stacked by role (params at the bottom, then gradients, optimizer state,
//!   activations, attention and workspace), from the plan's timeline;
//! - PyTorch's reserved curve: the caching allocator's replay of the same events in its last
//!   step (`alloc::timeline::replay`; when the card refused a request, the replay without a
//!   limit, so the whole step is drawn, and the refusal marked);
//! - the card's usable line (what PyTorch may use), when the card is known;
//! - the peak of live bytes, marked with its phase and the tensor whose allocation reached it.
//!
//! The HTML page is the same SVG inside a small self-contained page (no scripts, nothing
//! external). Text is written as SVG `<text>` with a generic font family: plotters' `ttf`
//! feature (system fonts through font-kit and freetype) is left out, so its text extents are
//! estimates and the browser picks the font.

use std::path::Path;

use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};

use crate::alloc::timeline::{replay, Failure, Replay, ReservedPoint, STEPS};
use crate::alloc::AllocConf;
use crate::plan::{EventKind, Plan, Role};
use crate::units::fmt_bytes;

/// Picture size in pixels.
pub const WIDTH: u32 = 1100;
pub const HEIGHT: u32 = 620;

/// Room on the right for the legend, outside the plot.
const LEGEND_WIDTH: u32 = 300;

/// The most points of the stacked live-bytes areas (each the highest of its run of events, so
/// the peak is always drawn).
pub const AREA_POINTS: usize = 1200;

/// Legend text of the series (the test and the docs read them).
pub const RESERVED_LABEL: &str = "PyTorch reserved (steady step)";
pub const RESERVED_UNLIMITED_LABEL: &str = "PyTorch reserved (no card limit)";
pub const USABLE_LABEL: &str = "usable on the card";

/// Role colours (Okabe-Ito, colour-blind friendly), in `Role::ALL` order.
pub const ROLE_COLORS: [RGBColor; 6] = [
    RGBColor(0x00, 0x72, 0xB2), // params
    RGBColor(0x56, 0xB4, 0xE9), // gradients
    RGBColor(0x00, 0x9E, 0x73), // optimizer
    RGBColor(0xE6, 0x9F, 0x00), // activations
    RGBColor(0xCC, 0x79, 0xA7), // attention
    RGBColor(0x99, 0x99, 0x99), // workspace
];
/// Indigo (Paul Tol's palette): apart from the black axes and text.
pub const RESERVED_COLOR: RGBColor = RGBColor(0x33, 0x22, 0x88);
pub const USABLE_COLOR: RGBColor = RGBColor(0xC0, 0x39, 0x2B);
const PEAK_COLOR: RGBColor = RGBColor(0xD5, 0x5E, 0x00);

/// What `--out` writes, from the file's extension.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Format {
    Svg,
    Html,
}

/// Why a picture could not be made.
#[derive(Debug, thiserror::Error)]
pub enum ChartError {
    #[error("{0}: the picture is written as .svg or .html (by the file's extension)")]
    Extension(String),
    #[error("drawing the step: {0}")]
    Draw(String),
}

impl Format {
    /// The format a path's extension names (case-insensitive).
    pub fn of_path(path: &Path) -> Result<Format, ChartError> {
        let ext = path
            .extension()
            .and_then(|e| e.to_str())
            .map(str::to_ascii_lowercase);
        match ext.as_deref() {
            Some("svg") => Ok(Format::Svg),
            Some("html") | Some("htm") => Ok(Format::Html),
            _ => Err(ChartError::Extension(path.display().to_string())),
        }
    }
}

/// Everything the picture shows, gathered from a plan and its replay.
#[derive(Debug, Clone, PartialEq)]
pub struct StepChart {
    /// The picture's title: model, batch, sequence, precision and the card.
    pub title: String,
    /// The workload in full, written above the picture on the HTML page.
    pub description: String,
    pub events: usize,
    /// Live bytes by role after an alloc or free: (event, bytes in `Role::ALL` order).
    pub stacks: Vec<(usize, [u64; 6])>,
    /// The allocator's reserved bytes over the same events.
    pub reserved: Vec<ReservedPoint>,
    /// The reserved curve is the replay without a card limit (the card refused a request).
    pub reserved_unlimited: bool,
    pub usable: Option<u64>,
    pub peak_event: usize,
    pub peak_bytes: u64,
    /// "peak 15.60 GiB in backward, allocating grad.logits".
    pub peak_label: String,
    /// The request the card refused: (event, "refused: …").
    pub refused: Option<(usize, String)>,
}

impl StepChart {
    /// The picture of `plan` as `estimate` predicts it: `replay_on_card` is its replay on the
    /// card (with the curve kept), `usable` what PyTorch may use there, `card` its name.
    pub fn new(
        description: String,
        card: Option<&str>,
        plan: &Plan,
        conf: &AllocConf,
        replay_on_card: &Replay,
        usable: Option<u64>,
    ) -> StepChart {
        let (reserved, reserved_unlimited) = reserved_curve(plan, conf, replay_on_card);
        let peak = plan.peak();
        let phase = peak.phase.map_or("the step", |p| p.name());
        let peak_label = match plan.peak_tensor(&peak) {
            Some(t) => format!("peak {} in {phase}, allocating {t}", fmt_bytes(peak.bytes)),
            None => format!("peak {} in {phase}", fmt_bytes(peak.bytes)),
        };
        let w = &plan.workload;
        let on = card.map_or(String::new(), |c| format!(" on {c}"));
        StepChart {
            title: format!(
                "{}, batch {}, seq {}, {}{on}",
                w.name,
                w.batch,
                w.seq,
                w.precision.name()
            ),
            description,
            events: plan.events.len(),
            stacks: stacks(plan, AREA_POINTS),
            reserved,
            reserved_unlimited,
            usable,
            peak_event: peak.event,
            peak_bytes: peak.bytes,
            peak_label,
            refused: replay_on_card.failure.as_ref().map(refused_label),
        }
    }

    /// The picture as an SVG document.
    pub fn svg(&self) -> Result<String, ChartError> {
        let mut buf = String::new();
        self.draw(&mut buf)
            .map_err(|e| ChartError::Draw(e.to_string()))?;
        Ok(buf)
    }

    /// The picture in a small self-contained HTML page.
    pub fn html(&self) -> Result<String, ChartError> {
        let svg = self.svg()?;
        let svg = svg.trim_start_matches(|c| c != '<');
        let title = super::svg::esc(&self.title);
        Ok(format!(
            "<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">\
             <title>oomprobe estimate: {title}</title><style>{}</style></head>\n<body>\
             <h1>The predicted step: {title}</h1><p class=\"meta\">{}</p>\
             <p class=\"meta\">{}</p>\n<div class=\"chart\">{svg}</div>\n\
             <footer>oomprobe estimate --out</footer></body></html>\n",
            super::html::STYLE,
            super::svg::esc(&self.description),
            super::svg::esc(&self.peak_label),
        ))
    }

    /// The picture in `format`.
    pub fn render(&self, format: Format) -> Result<String, ChartError> {
        match format {
            Format::Svg => self.svg(),
            Format::Html => self.html(),
        }
    }

    fn draw(&self, buf: &mut String) -> Result<(), Box<dyn std::error::Error + '_>> {
        let top = self
            .stacks
            .iter()
            .map(|(_, r)| r.iter().sum::<u64>())
            .chain(self.reserved.iter().map(|p| p.reserved_bytes))
            .chain(self.usable)
            .max()
            .unwrap_or(0)
            .max(1);
        let (unit, unit_name) = if top >= 1 << 30 {
            ((1u64 << 30) as f64, "GiB")
        } else {
            ((1u64 << 20) as f64, "MiB")
        };
        let ymax = top as f64 / unit * 1.12;
        let xmax = self.events.max(1) as f64;
        let y = |b: u64| b as f64 / unit;

        let root = SVGBackend::with_string(buf, (WIDTH, HEIGHT)).into_drawing_area();
        root.fill(&WHITE)?;
        let (left, right) = root.split_horizontally(WIDTH - LEGEND_WIDTH);
        let mut chart = ChartBuilder::on(&left)
            .caption(&self.title, ("sans-serif", 22))
            .margin(16)
            .x_label_area_size(52)
            .y_label_area_size(72)
            .build_cartesian_2d(0f64..xmax, 0f64..ymax)?;
        chart
            .configure_mesh()
            .x_desc("event of the step (allocations, frees and kernels, in order)")
            .y_desc(format!("live bytes ({unit_name})"))
            .light_line_style(WHITE.mix(0.0))
            .label_style(("sans-serif", 15))
            .axis_desc_style(("sans-serif", 17))
            .x_label_formatter(&|v| format!("{v:.0}"))
            .y_label_formatter(&|v| format!("{v}"))
            .draw()?;

        // Legend entries, top to bottom: (text, colour, a band rather than a line).
        let mut legend: Vec<(String, RGBColor, bool)> = Vec::new();
        // Stacked: each role's area is drawn from zero to the sum of itself and the roles
        // below it, opaque, the top one first, so each shows as its own band.
        for k in (0..Role::ALL.len()).rev() {
            let color = ROLE_COLORS[k];
            let pts = self.stacks.iter().map(|(e, r)| {
                let cum: u64 = r[..=k].iter().sum();
                (*e as f64, y(cum))
            });
            chart.draw_series(AreaSeries::new(pts, 0.0, color).border_style(color))?;
            legend.push((Role::ALL[k].name().to_string(), color, true));
        }

        let reserved = self
            .reserved
            .iter()
            .map(|p| (p.event as f64, y(p.reserved_bytes)));
        chart.draw_series(LineSeries::new(reserved, RESERVED_COLOR.stroke_width(2)))?;
        let label = if self.reserved_unlimited {
            RESERVED_UNLIMITED_LABEL
        } else {
            RESERVED_LABEL
        };
        legend.push((label.to_string(), RESERVED_COLOR, false));

        if let Some(u) = self.usable {
            let line = vec![(0.0, y(u)), (xmax, y(u))];
            chart.draw_series(std::iter::once(PathElement::new(
                line,
                USABLE_COLOR.stroke_width(2),
            )))?;
            legend.push((
                format!("{USABLE_LABEL}: {}", fmt_bytes(u)),
                USABLE_COLOR,
                false,
            ));
        }

        let peak = (self.peak_event as f64, y(self.peak_bytes));
        chart.draw_series(std::iter::once(Circle::new(peak, 5, PEAK_COLOR.filled())))?;
        // The label leans left of the mark in the right half, so it stays on the picture.
        let anchor = if peak.0 > xmax / 2.0 {
            Pos::new(HPos::Right, VPos::Bottom)
        } else {
            Pos::new(HPos::Left, VPos::Bottom)
        };
        let style = TextStyle::from(("sans-serif", 17).into_font())
            .color(&PEAK_COLOR)
            .pos(anchor);
        chart.draw_series(std::iter::once(Text::new(
            self.peak_label.clone(),
            (peak.0, peak.1 + ymax * 0.02),
            style,
        )))?;

        if let Some((event, text)) = &self.refused {
            let x = *event as f64;
            chart.draw_series(std::iter::once(PathElement::new(
                vec![(x, 0.0), (x, ymax)],
                USABLE_COLOR.stroke_width(1),
            )))?;
            let style = TextStyle::from(("sans-serif", 16).into_font())
                .color(&USABLE_COLOR)
                .pos(Pos::new(HPos::Left, VPos::Top));
            chart.draw_series(std::iter::once(Text::new(
                text.clone(),
                (x + xmax * 0.005, ymax * 0.97),
                style,
            )))?;
        }

        // The legend, in its own panel right of the plot.
        let font = ("sans-serif", 16).into_font().color(&BLACK);
        for (i, (text, color, band)) in legend.iter().enumerate() {
            let ly = 60 + 26 * i as i32;
            if *band {
                right.draw(&Rectangle::new([(8, ly - 7), (28, ly + 7)], color.filled()))?;
            } else {
                right.draw(&PathElement::new(
                    vec![(8, ly), (28, ly)],
                    color.stroke_width(3),
                ))?;
            }
            right.draw(&Text::new(
                text.clone(),
                (36, ly),
                font.pos(Pos::new(HPos::Left, VPos::Center)),
            ))?;
        }
        root.present()?;
        Ok(())
    }
}

/// The reserved curve to draw: the card's replay when it served every request, else the replay
/// without a limit (true), so the whole step is drawn.
fn reserved_curve(plan: &Plan, conf: &AllocConf, on_card: &Replay) -> (Vec<ReservedPoint>, bool) {
    if on_card.fits() && !on_card.curve.is_empty() {
        return (on_card.curve.clone(), false);
    }
    let free = replay(plan, conf, None, STEPS, true);
    (free.curve, !on_card.fits())
}

/// "refused: 1.00 GiB for grad.x in backward (step 1)".
fn refused_label(f: &Failure) -> (usize, String) {
    (
        f.event,
        format!(
            "refused: {} for {} in {} (step {})",
            fmt_bytes(f.oom.requested),
            f.tensor,
            f.phase.name(),
            f.step
        ),
    )
}

/// Live bytes by role after each alloc and free, at most `n` points: the highest total of each
/// of `n` equal runs (the peak is always one of them).
fn stacks(plan: &Plan, n: usize) -> Vec<(usize, [u64; 6])> {
    let mut all = Vec::new();
    plan.walk(|i, e, live| {
        if !matches!(e.kind, EventKind::Kernel(_)) {
            all.push((i, Role::ALL.map(|r| live.get(r))));
        }
    });
    if all.len() <= n {
        return all;
    }
    let per = all.len().div_ceil(n);
    all.chunks(per)
        .filter_map(|c| c.iter().copied().max_by_key(|(_, r)| r.iter().sum::<u64>()))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scenario::Scenario;

    fn plan() -> Plan {
        let w = crate::workload::presets::get("tiny-gpt").unwrap();
        Plan::for_value(&w, Scenario::Batch, w.batch).unwrap()
    }

    #[test]
    fn the_extension_names_the_format() {
        assert_eq!(Format::of_path(Path::new("a/x.SVG")).unwrap(), Format::Svg);
        assert_eq!(Format::of_path(Path::new("x.html")).unwrap(), Format::Html);
        assert!(Format::of_path(Path::new("x.png")).is_err());
        assert!(Format::of_path(Path::new("x")).is_err());
    }

    #[test]
    fn the_thinned_stacks_keep_the_peak() {
        let p = plan();
        let peak = p.peak();
        let s = stacks(&p, 16);
        assert!(s.len() <= 16 && !s.is_empty());
        let top = s.iter().map(|(_, r)| r.iter().sum::<u64>()).max();
        assert_eq!(top, Some(peak.bytes));
        assert!(s.windows(2).all(|w| w[0].0 < w[1].0));
    }

    #[test]
    fn a_refused_card_draws_the_unlimited_curve_and_marks_the_refusal() {
        let p = plan();
        let conf = AllocConf::default();
        let cap = p.peak_bytes() / 3;
        let r = replay(&p, &conf, Some(cap), STEPS, true);
        let c = StepChart::new("t".into(), None, &p, &conf, &r, Some(cap));
        assert!(c.reserved_unlimited);
        assert!(!c.reserved.is_empty());
        let (event, text) = c.refused.clone().expect("refused");
        assert!(
            event < p.events.len() && text.starts_with("refused: "),
            "{text}"
        );
        let svg = c.svg().unwrap();
        assert!(svg.contains(RESERVED_UNLIMITED_LABEL) && svg.contains("refused: "));
    }
}
