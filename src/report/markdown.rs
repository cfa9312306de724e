//! Markdown: the device, a runs table, then one probe table per run.

use super::model::{ProbeReport, RunResult};
use super::table::{is_numeric_column, notes, summary_row, SUMMARY_COLUMNS};
use super::throughput::{best_throughput, fmt_rate, rate_at};
use super::{device_line, fmt_seconds, fmt_value, run_label, sorted_probes};
use crate::units::fmt_bytes;

/// Escape a table cell: pipes and line breaks would break the row.
pub fn cell(s: &str) -> String {
    s.replace('\\', "\\\\")
        .replace('|', "\\|")
        .replace(['\n', '\r'], " ")
}

/// A GitHub-flavoured Markdown table; `numeric(i)` right-aligns column i.
pub fn table(headers: &[&str], rows: &[Vec<String>], numeric: impl Fn(usize) -> bool) -> String {
    let mut s = format!(
        "| {} |\n|{}|\n",
        headers
            .iter()
            .map(|h| cell(h))
            .collect::<Vec<_>>()
            .join(" | "),
        (0..headers.len())
            .map(|i| if numeric(i) { "---:" } else { "---" })
            .collect::<Vec<_>>()
            .join("|")
    );
    for r in rows {
        s.push_str(&format!(
            "| {} |\n",
            r.iter().map(|c| cell(c)).collect::<Vec<_>>().join(" | ")
        ));
    }
    s
}

/// Column titles of [`probe_rows`].
pub const PROBE_COLUMNS: [&str; 7] = [
    "value",
    "outcome",
    "plan bytes",
    "allocated",
    "step s",
    "throughput",
    "mark",
];

/// One row per probe in value order, marking max fit, first fail and best throughput.
pub fn probe_rows(run: &RunResult) -> Vec<Vec<String>> {
    let best = best_throughput(run);
    let mut best_marked = false;
    sorted_probes(run)
        .into_iter()
        .map(|p| {
            let mut marks = Vec::new();
            if Some(p.value) == run.max_fit && p.outcome.is_fit() {
                marks.push("max fit");
            }
            if Some(p.value) == run.first_fail && !p.outcome.is_fit() {
                marks.push("first fail");
            }
            let rate = if p.outcome.is_fit() {
                rate_at(run, p.value, p.step_seconds)
            } else {
                None
            };
            // Mark the one probe that gave the best rate (a value may be probed twice).
            if !best_marked
                && best.is_some_and(|b| b.value == p.value && rate == Some(b.per_second))
            {
                marks.push("best throughput");
                best_marked = true;
            }
            vec![
                fmt_value(&run.dimension, p.value),
                p.outcome.name().to_string(),
                fmt_bytes(p.bytes),
                fmt_bytes(p.bytes_allocated),
                p.step_seconds
                    .map(fmt_seconds)
                    .unwrap_or_else(|| "-".into()),
                match (rate, super::throughput::unit_of(run)) {
                    (Some(r), Some(u)) => format!("{} {u}/s", fmt_rate(r)),
                    _ => "-".to_string(),
                },
                marks.join(", "),
            ]
        })
        .collect()
}

/// The whole report as Markdown.
pub fn render(report: &ProbeReport) -> String {
    let mut s = String::from("# oomprobe probe report\n\n");
    s.push_str(&format!("- **device**: {}\n", device_line(report)));
    s.push_str(&format!(
        "- **tool**: {} {}\n\n",
        report.tool.name, report.tool.version
    ));
    if report.runs.is_empty() {
        s.push_str("No runs.\n");
        return s;
    }
    s.push_str("## Runs\n\n");
    let rows: Vec<Vec<String>> = report.runs.iter().map(summary_row).collect();
    s.push_str(&table(&SUMMARY_COLUMNS, &rows, is_numeric_column));
    s.push_str("\nerror = (predicted max - max fit) / max fit; fill = bytes at max / capacity.\n");
    let notes = notes(report);
    if !notes.is_empty() {
        s.push('\n');
        for n in notes {
            s.push_str(&format!("- {}\n", cell(&n)));
        }
    }
    for run in &report.runs {
        s.push_str(&format!("\n## {}: probes\n\n", cell(&run_label(run))));
        s.push_str(&table(&PROBE_COLUMNS, &probe_rows(run), |i| {
            matches!(i, 0 | 2 | 3 | 4)
        }));
    }
    s
}
