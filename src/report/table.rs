//! The terminal table: the device and its memory on top, then one row per run.

use comfy_table::{presets::UTF8_FULL_CONDENSED, Cell, CellAlignment, ContentArrangement, Table};

use super::model::{ProbeReport, RunResult, IN_PROGRESS_NOTE};
use super::throughput::best_throughput;
use super::{
    device_line, fmt_bytes, fmt_pct, fmt_seconds, fmt_signed_pct, fmt_value, prediction_error,
};

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
    let v = |x: Option<u64>| x.map(|x| fmt_value(&run.dimension, x)).unwrap_or_else(dash);
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
        for n in run.notes.iter().filter(|n| *n != IN_PROGRESS_NOTE) {
            out.push(format!("{label}: {n}"));
        }
    }
    out
}

/// The terminal table as a string (ends with a newline).
pub fn render(report: &ProbeReport) -> String {
    let mut out = format!("device: {}\n", device_line(report));
    let mut table = Table::new();
    table
        .load_preset(UTF8_FULL_CONDENSED)
        .set_content_arrangement(ContentArrangement::Disabled)
        .set_header(SUMMARY_COLUMNS.iter().map(Cell::new));
    for run in &report.runs {
        table.add_row(summary_row(run).into_iter().enumerate().map(|(i, s)| {
            let c = Cell::new(s);
            if is_numeric_column(i) {
                c.set_alignment(CellAlignment::Right)
            } else {
                c
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
