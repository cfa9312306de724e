//! The terminal table: the device and its memory on top, then one row per run.

use comfy_table::{
    presets::{ASCII_FULL_CONDENSED, UTF8_FULL_CONDENSED},
    Cell, CellAlignment, Color, ContentArrangement, Table,
};

use super::model::{ProbeReport, RunResult, IN_PROGRESS_NOTE};
use super::throughput::best_throughput;
use super::{device_line, fmt_pct, fmt_seconds, fmt_signed_pct, prediction_error, ValueFormat};
use crate::units::fmt_bytes;

/// Column titles of [`summary_row`] (shared by the table, Markdown and HTML).
pub const SUMMARY_COLUMNS: [&str; 13] = [
    "scenario",
    "variant",
    "dimension",
    "max fit",
    "first fail",
    "reason",
    "bytes at max",
    "predicted max",
    "error",
    "fill",
    "best throughput",
    "probes",
    "seconds",
];

/// A run's summary cells in [`SUMMARY_COLUMNS`] order (`-` where a value is unknown).
pub fn summary_row(run: &RunResult) -> Vec<String> {
    let dash = || "-".to_string();
    let shown = [run.max_fit, run.first_fail, run.predicted_max];
    let f = ValueFormat::distinct(&run.dimension, shown.into_iter().flatten());
    let v = |x: Option<u64>| x.map(|x| f.fmt(x)).unwrap_or_else(dash);
    let mut max_fit = v(run.max_fit);
    if run.flaky {
        max_fit.push_str(" (flaky)");
    }
    if run.is_partial() {
        max_fit.push_str(" (in progress)");
    }
    vec![
        run.scenario.name().to_string(),
        run.variant.clone().unwrap_or_else(dash),
        run.dimension.clone(),
        max_fit,
        v(run.first_fail),
        run.fail_reason
            .map(|o| o.name().to_string())
            .unwrap_or_else(dash),
        run.bytes_at_max_fit.map(fmt_bytes).unwrap_or_else(dash),
        v(run.predicted_max),
        prediction_error(run)
            .map(fmt_signed_pct)
            .unwrap_or_else(dash),
        run.fill_ratio.map(fmt_pct).unwrap_or_else(dash),
        best_throughput(run).map(|t| t.label()).unwrap_or_else(dash),
        run.probes.len().to_string(),
        fmt_seconds(run.seconds),
    ]
}

/// The columns a terminal shows by default (indices into [`SUMMARY_COLUMNS`]): scenario,
/// variant, max fit, predicted max, error, probes, seconds, which fit 100 columns; `--wide`
/// shows every column.
pub const NARROW_COLUMNS: [usize; 7] = [0, 1, 3, 7, 8, 11, 12];

/// The first note of a report written before its probe finished.
pub const PARTIAL_NOTE: &str = "IN PROGRESS: partial results (the probe was still running or was \
stopped); a run marked \"in progress\" has no confirmed boundary, only the largest fit so far";

/// Columns that hold numbers (right-aligned).
pub fn is_numeric_column(i: usize) -> bool {
    matches!(i, 3 | 4 | 6 | 7 | 8 | 9 | 11 | 12)
}

/// Notes printed under a table: flaky runs, run notes, and where the best throughput is
/// below the largest fitting value.
pub fn notes(report: &ProbeReport) -> Vec<String> {
    let mut out = Vec::new();
    if report.in_progress || report.runs.iter().any(|r| r.is_partial()) {
        out.push(PARTIAL_NOTE.to_string());
    }
    for run in &report.runs {
        let label = super::run_label(run);
        if let (Some(best), Some(max)) = (best_throughput(run), run.max_fit) {
            if best.value < max {
                out.push(format!(
                    "{label}: most throughput at {} = {} ({}), below the max fit {}",
                    run.dimension,
                    best.value,
                    best.rate(),
                    max
                ));
            }
        }
        if run.flaky {
            out.push(format!(
                "{label}: a fit was seen above a failure (non-monotone device behaviour)"
            ));
        }
        if let Some(m) = run.measured_capacity_bytes {
            // The bounds as measured: a range where the filler resolved no finer.
            let below = run
                .measured_capacity_below
                .filter(|b| b.saturating_sub(m) > 1);
            let lo = fmt_bytes(m);
            let range = match below.map(|b| (b, fmt_bytes(b))) {
                // Ends that print alike ("256.00 MiB-256.00 MiB") print once, with the width.
                Some((b, hi)) if hi == lo => format!("{lo} (to within {})", fmt_bytes(b - m)),
                Some((_, hi)) => format!("{lo}-{hi}"),
                None => lo,
            };
            let within = run
                .capacity_bytes
                .zip(below)
                .is_some_and(|(c, b)| m <= c && c < b);
            let kept = match run.device_overhead_bytes {
                _ if within => ", the memory predicted against lies within it".to_string(),
                Some(k) if k >= 0 => {
                    format!(", {} less than predicted against", fmt_bytes(k as u64))
                }
                Some(k) => format!(
                    ", {} more than predicted against",
                    fmt_bytes(k.unsigned_abs())
                ),
                None => String::new(),
            };
            out.push(format!("{label}: measured capacity {range}{kept}"));
        }
        for n in run.notes.iter().filter(|n| *n != IN_PROGRESS_NOTE) {
            out.push(format!("{label}: {n}"));
        }
    }
    out
}

/// The terminal table as a string (ends with a newline), without color, every column.
pub fn render(report: &ProbeReport) -> String {
    render_styled(report, false, true)
}

/// The terminal table; with `color`, the max fit is green, the first fail red and a flaky
/// boundary yellow (the caller decides, e.g. from `NO_COLOR` and whether stdout is a terminal);
/// `wide`, every column, else [`NARROW_COLUMNS`].
pub fn render_styled(report: &ProbeReport, color: bool, wide: bool) -> String {
    let mut out = format!("device: {}\n", device_line(report));
    let shown = |i: usize| wide || NARROW_COLUMNS.contains(&i);
    let mut table = Table::new();
    let preset = if crate::term::unicode_enabled() {
        UTF8_FULL_CONDENSED
    } else {
        ASCII_FULL_CONDENSED
    };
    table
        .load_preset(preset)
        .set_content_arrangement(ContentArrangement::Disabled)
        .set_header(
            SUMMARY_COLUMNS
                .iter()
                .enumerate()
                .filter(|(i, _)| shown(*i))
                .map(|(_, c)| Cell::new(c)),
        );
    if color {
        table.enforce_styling();
    } else {
        table.force_no_tty();
    }
    for run in &report.runs {
        let cells = summary_row(run).into_iter().enumerate();
        table.add_row(cells.filter(|(i, _)| shown(*i)).map(|(i, s)| {
            let mut c = Cell::new(s);
            if is_numeric_column(i) {
                c = c.set_alignment(CellAlignment::Right);
            }
            match i {
                3 if run.flaky => c.fg(Color::Yellow),
                3 => c.fg(Color::Green),
                4 | 5 => c.fg(Color::Red),
                _ => c,
            }
        }));
    }
    if report.runs.is_empty() {
        out.push_str("no runs\n");
    } else {
        out.push_str(&table.to_string());
        out.push('\n');
    }
    for n in notes(report) {
        out.push_str(&format!("note: {n}\n"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn color_only_when_asked() {
        let report = crate::report::sample::sample_report(512 << 20);
        let plain = render_styled(&report, false, true);
        let colored = render_styled(&report, true, true);
        assert!(!plain.contains('\u{1b}'), "{plain}");
        assert!(colored.contains('\u{1b}'), "{colored}");
        assert_eq!(plain, render(&report));
    }

    #[test]
    fn the_default_table_fits_100_columns_and_wide_shows_the_rest() {
        let report = crate::report::sample::sample_report(512 << 20);
        let narrow = render_styled(&report, false, false);
        let table_lines = narrow
            .lines()
            .filter(|l| !l.starts_with("device:") && !l.starts_with("note:"));
        for l in table_lines {
            assert!(
                l.chars().count() <= 100,
                "{} columns: {l}",
                l.chars().count()
            );
        }
        assert!(narrow.contains("predicted max") && !narrow.contains("best throughput"));
        let wide = render_styled(&report, false, true);
        assert!(wide.contains("best throughput") && wide.contains("bytes at max"));
    }

    #[test]
    fn the_measured_capacity_note_shows_its_range_and_the_prediction_inside_it() {
        let mut report = crate::report::sample::sample_report(512 << 20);
        let run = &mut report.runs[0];
        run.capacity_bytes = Some(512 << 20);
        run.measured_capacity_bytes = Some(506 << 20);
        run.measured_capacity_below = Some(514 << 20);
        run.device_overhead_bytes = Some(6 << 20);
        let n = notes(&report).join("\n");
        assert!(
            n.contains(
                "measured capacity 506.00 MiB-514.00 MiB, the memory predicted against lies within it"
            ),
            "{n}"
        );
        let run = &mut report.runs[0];
        run.measured_capacity_below = Some(510 << 20);
        let n = notes(&report).join("\n");
        assert!(
            n.contains("506.00 MiB-510.00 MiB, 6.00 MiB less than predicted"),
            "{n}"
        );
        // A budget's capacity, measured to 4 KiB: both ends print as 256.00 MiB.
        let run = &mut report.runs[0];
        run.capacity_bytes = Some(256 << 20);
        run.measured_capacity_bytes = Some((256 << 20) - (4 << 10));
        run.measured_capacity_below = Some(256 << 20);
        let n = notes(&report).join("\n");
        assert!(
            n.contains("measured capacity 256.00 MiB (to within 4.00 KiB)"),
            "{n}"
        );
    }
}
