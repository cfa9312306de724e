//! Several probe result files side by side (`oomprobe compare`).
//!
//! Files are matched by run: a row per (scenario, variant) seen in any file, a column per file.
//! Each cell holds that file's run: max fit, bytes at max, fill ratio, predicted versus measured,
//! and the max fit's ratio to the first file's. When two files ran the same scenario on
//! different workloads (other than the varied dimension), a warning says so: their numbers are
//! not comparable.
//!
//! JSON output (`--format json`) is a [`Comparison`]:
//! `{ "schema_version": 1, "files": [ { "path", "label", "device", "budget_bytes", "tool" } ],
//!   "rows": [ { "scenario", "variant", "dimension", "cells": [ null | { "max_fit",
//!   "first_fail", "fail_reason", "bytes_at_max_fit", "capacity_bytes", "fill_ratio",
//!   "predicted_max", "prediction_error", "ratio_to_first", "best_throughput": null | { "value",
//!   "per_second", "unit" } } ] } ], "warnings": [ "..." ] }`; `cells[i]` belongs to `files[i]`
//! and is null when that file has no such run.
//!
//! CSV output: one line per (row, file) with the file's path, device and budget, then the run
//! columns of [`super::csv::RUN_COLUMNS`] from `scenario` on, then `ratio_to_first`.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use comfy_table::{presets::UTF8_FULL_CONDENSED, Cell, CellAlignment, ContentArrangement, Table};
use serde::Serialize;

use super::OutputFormat;
use crate::backend::DeviceInfo;
use crate::scenario::Scenario;

use super::model::{Outcome, ProbeReport, RunResult, ToolInfo, SCHEMA_VERSION};
use super::throughput::{best_throughput, Throughput};
use super::{fmt_pct, fmt_signed_pct, prediction_error, run_capacity, ReportError, ValueFormat};
use crate::units::fmt_bytes;

/// Version of the `compare --format json` object.
pub const COMPARE_SCHEMA_VERSION: u32 = 1;

/// A probe result file read from disk.
#[derive(Debug, Clone)]
pub struct LoadedFile {
    pub path: PathBuf,
    pub report: ProbeReport,
}

/// The largest result file read (a run of thousands of probes writes a few MB).
pub const MAX_RESULT_BYTES: u64 = 64 << 20;

/// Read and check one probe result file. Errors name the file: unreadable, not JSON, not a
/// probe result (missing or wrong fields), or a newer `schema_version`.
pub fn load_report(path: &Path) -> Result<ProbeReport, ReportError> {
    let text = crate::input::read_text_capped(path, MAX_RESULT_BYTES).map_err(|source| {
        ReportError::Read {
            path: path.to_path_buf(),
            source,
        }
    })?;
    parse_report(path, &text)
}

/// Parse the text of a probe result file (see [`load_report`]).
pub fn parse_report(path: &Path, text: &str) -> Result<ProbeReport, ReportError> {
    let malformed = |detail: String| ReportError::Malformed {
        path: path.to_path_buf(),
        detail,
    };
    let value: serde_json::Value =
        serde_json::from_str(text).map_err(|e| malformed(format!("invalid JSON: {e}")))?;
    let obj = value
        .as_object()
        .ok_or_else(|| malformed("expected a JSON object".to_string()))?;
    let version = obj
        .get("schema_version")
        .ok_or_else(|| malformed("no schema_version field".to_string()))?
        .as_u64()
        .ok_or_else(|| malformed("schema_version is not a whole number".to_string()))?;
    if version > u64::from(SCHEMA_VERSION) {
        return Err(ReportError::Schema {
            path: path.to_path_buf(),
            found: version,
            supported: SCHEMA_VERSION,
        });
    }
    if version == 0 {
        return Err(malformed(
            "schema_version 0 is not a valid version".to_string(),
        ));
    }
    serde_json::from_value(value).map_err(|e| malformed(e.to_string()))
}

/// One file's column header.
#[derive(Debug, Clone, Serialize)]
pub struct ComparedFile {
    pub path: String,
    /// Device name and budget, e.g. `llvmpipe · budget 512 MiB`.
    pub label: String,
    pub device: DeviceInfo,
    pub budget_bytes: Option<u64>,
    pub tool: ToolInfo,
}

/// One file's numbers for one row.
#[derive(Debug, Clone, Serialize)]
pub struct CompareCell {
    pub max_fit: Option<u64>,
    pub first_fail: Option<u64>,
    pub fail_reason: Option<Outcome>,
    pub bytes_at_max_fit: Option<u64>,
    pub capacity_bytes: Option<u64>,
    pub fill_ratio: Option<f64>,
    pub predicted_max: Option<u64>,
    /// (predicted - max fit) / max fit.
    pub prediction_error: Option<f64>,
    /// This file's max fit over the first file's (in the row), where both exist.
    pub ratio_to_first: Option<f64>,
    pub best_throughput: Option<Throughput>,
    /// The file's run was not finished (a snapshot of a stopped probe): its max fit is only
    /// the largest fit seen so far.
    pub in_progress: bool,
    /// Index of the run in the file's `runs`.
    #[serde(skip)]
    pub run_index: usize,
}

/// One (scenario, variant) across the files.
#[derive(Debug, Clone, Serialize)]
pub struct CompareRow {
    pub scenario: Scenario,
    pub variant: Option<String>,
    pub dimension: String,
    pub cells: Vec<Option<CompareCell>>,
}

impl CompareRow {
    /// `scenario` or `scenario (variant)`.
    pub fn label(&self) -> String {
        match &self.variant {
            Some(v) if !v.is_empty() => format!("{} ({v})", self.scenario.name()),
            _ => self.scenario.name().to_string(),
        }
    }
}

/// What `compare` reports (and its JSON output).
#[derive(Debug, Clone, Serialize)]
pub struct Comparison {
    pub schema_version: u32,
    pub files: Vec<ComparedFile>,
    pub rows: Vec<CompareRow>,
    pub warnings: Vec<String>,
}

fn scenario_order(s: Scenario) -> usize {
    Scenario::ALL
        .iter()
        .position(|x| *x == s)
        .unwrap_or(usize::MAX)
}

/// The workload as JSON with the varied dimension (and the name) removed.
fn comparable_workload(run: &RunResult) -> BTreeMap<String, serde_json::Value> {
    let mut m: BTreeMap<String, serde_json::Value> = match serde_json::to_value(&run.workload) {
        Ok(serde_json::Value::Object(o)) => o.into_iter().collect(),
        _ => BTreeMap::new(),
    };
    m.remove(run.dimension.as_str());
    m.remove("name");
    m
}

/// The keys whose values differ, as `key a vs b`.
fn workload_diff(a: &RunResult, b: &RunResult) -> Vec<String> {
    let (wa, wb) = (comparable_workload(a), comparable_workload(b));
    let mut keys: Vec<&String> = wa.keys().chain(wb.keys()).collect();
    keys.sort();
    keys.dedup();
    let show = |v: Option<&serde_json::Value>| match v {
        None | Some(serde_json::Value::Null) => "none".to_string(),
        Some(serde_json::Value::String(s)) => s.clone(),
        Some(other) => other.to_string(),
    };
    keys.into_iter()
        .filter(|k| wa.get(*k) != wb.get(*k))
        .map(|k| format!("{k} {} vs {}", show(wa.get(k)), show(wb.get(k))))
        .collect()
}

/// A file's label: device name and budget (or memory).
fn file_label(report: &ProbeReport) -> String {
    let mem = match (report.budget_bytes, report.device.memory_total_bytes) {
        (Some(b), _) => format!("budget {}", fmt_bytes(b)),
        (None, Some(t)) => format!("memory {}", fmt_bytes(t)),
        (None, None) => "memory unknown".to_string(),
    };
    format!("{} \u{00b7} {mem}", report.device.name)
}

/// Build the comparison of `files` (the first file is the reference for ratios).
pub fn build(files: &[LoadedFile]) -> Comparison {
    let mut warnings = Vec::new();
    for f in files {
        if f.report.in_progress || f.report.runs.iter().any(|r| r.is_partial()) {
            warnings.push(format!(
                "{}: the probe was not finished (in progress): its numbers are partial",
                f.path.display()
            ));
        }
    }
    let mut labels: Vec<String> = files.iter().map(|f| file_label(&f.report)).collect();
    // Tell identical labels apart by file name.
    for i in 0..labels.len() {
        if labels.iter().filter(|l| **l == labels[i]).count() > 1 {
            let l = labels[i].clone();
            for (j, f) in files.iter().enumerate() {
                if labels[j] == l {
                    labels[j] = format!(
                        "{l} \u{00b7} {}",
                        f.path
                            .file_name()
                            .map(|n| n.to_string_lossy())
                            .unwrap_or_default()
                    );
                }
            }
        }
    }
    let compared: Vec<ComparedFile> = files
        .iter()
        .zip(&labels)
        .map(|(f, label)| ComparedFile {
            path: f.path.display().to_string(),
            label: label.clone(),
            device: f.report.device.clone(),
            budget_bytes: f.report.budget_bytes,
            tool: f.report.tool.clone(),
        })
        .collect();

    // Row keys in scenario order, variants in first-seen order.
    let mut keys: Vec<(Scenario, Option<String>, String)> = Vec::new();
    for f in files {
        for run in &f.report.runs {
            if !keys
                .iter()
                .any(|(s, v, _)| *s == run.scenario && *v == run.variant)
            {
                keys.push((run.scenario, run.variant.clone(), run.dimension.clone()));
            }
        }
    }
    keys.sort_by_key(|(s, _, _)| scenario_order(*s));

    let mut rows = Vec::new();
    for (scenario, variant, dimension) in keys {
        let label = CompareRow {
            scenario,
            variant: variant.clone(),
            dimension: dimension.clone(),
            cells: Vec::new(),
        }
        .label();
        let mut first: Option<(usize, &RunResult)> = None;
        let mut cells = Vec::new();
        for (fi, f) in files.iter().enumerate() {
            let mut matching = f
                .report
                .runs
                .iter()
                .enumerate()
                .filter(|(_, r)| r.scenario == scenario && r.variant == variant);
            let Some((ri, run)) = matching.next() else {
                cells.push(None);
                continue;
            };
            if matching.next().is_some() {
                warnings.push(format!(
                    "{}: more than one {label} run; comparing the first",
                    f.path.display()
                ));
            }
            let ratio = match first {
                Some((_, r0)) => match (run.max_fit, r0.max_fit) {
                    (Some(a), Some(b)) if b > 0 => Some(a as f64 / b as f64),
                    _ => None,
                },
                None => run.max_fit.map(|_| 1.0),
            };
            if let Some((f0, r0)) = first {
                let diff = workload_diff(r0, run);
                if !diff.is_empty() {
                    warnings.push(format!(
                        "{label}: workloads differ between {} and {} ({}); the numbers are not comparable",
                        files[f0].path.display(),
                        f.path.display(),
                        diff.join(", ")
                    ));
                }
            } else {
                first = Some((fi, run));
            }
            cells.push(Some(CompareCell {
                max_fit: run.max_fit,
                first_fail: run.first_fail,
                fail_reason: run.fail_reason,
                bytes_at_max_fit: run.bytes_at_max_fit,
                capacity_bytes: run_capacity(&f.report, run),
                fill_ratio: run.fill_ratio,
                predicted_max: run.predicted_max,
                prediction_error: prediction_error(run),
                ratio_to_first: ratio,
                best_throughput: best_throughput(run),
                in_progress: run.is_partial(),
                run_index: ri,
            }));
        }
        rows.push(CompareRow {
            scenario,
            variant,
            dimension,
            cells,
        });
    }
    Comparison {
        schema_version: COMPARE_SCHEMA_VERSION,
        files: compared,
        rows,
        warnings,
    }
}

/// The measures shown per row, one line each.
pub const MEASURES: [&str; 7] = [
    "max fit",
    "first fail",
    "bytes at max",
    "fill",
    "predicted (error)",
    "ratio to first",
    "best throughput",
];

/// The cell text of one measure.
fn measure(row: &CompareRow, cell: &Option<CompareCell>, m: usize) -> String {
    let dash = || "-".to_string();
    let Some(c) = cell else {
        return "no run".to_string();
    };
    // Every value of the row's dimension, across files, printed so that different ones differ.
    let shown = row
        .cells
        .iter()
        .flatten()
        .flat_map(|c| [c.max_fit, c.first_fail, c.predicted_max])
        .flatten();
    let vf = ValueFormat::distinct(&row.dimension, shown);
    let v = |x: Option<u64>| x.map(|x| vf.fmt(x)).unwrap_or_else(dash);
    match m {
        0 if c.in_progress => format!("{} (in progress)", v(c.max_fit)),
        0 => v(c.max_fit),
        1 => match (c.first_fail, c.fail_reason) {
            (Some(f), Some(r)) => format!("{} ({})", vf.fmt(f), r.name()),
            (Some(f), None) => vf.fmt(f),
            _ => dash(),
        },
        2 => c.bytes_at_max_fit.map(fmt_bytes).unwrap_or_else(dash),
        3 => c.fill_ratio.map(fmt_pct).unwrap_or_else(dash),
        4 => match (c.predicted_max, c.prediction_error) {
            (Some(p), Some(e)) => format!("{} ({})", vf.fmt(p), fmt_signed_pct(e)),
            (Some(p), None) => vf.fmt(p),
            _ => dash(),
        },
        5 => c
            .ratio_to_first
            .map(|r| format!("{r:.2}\u{00d7}"))
            .unwrap_or_else(dash),
        6 => c.best_throughput.map(|t| t.label()).unwrap_or_else(dash),
        _ => dash(),
    }
}

/// The comparison as a grid: header, then (scenario, measure, cell per file) rows.
fn grid(cmp: &Comparison) -> (Vec<String>, Vec<Vec<String>>) {
    let mut header = vec!["scenario".to_string(), "measure".to_string()];
    header.extend(cmp.files.iter().map(|f| f.label.clone()));
    let mut rows = Vec::new();
    for row in &cmp.rows {
        for (mi, name) in MEASURES.iter().enumerate() {
            let mut r = vec![
                if mi == 0 { row.label() } else { String::new() },
                name.to_string(),
            ];
            r.extend(row.cells.iter().map(|c| measure(row, c, mi)));
            rows.push(r);
        }
    }
    (header, rows)
}

/// The terminal table: a column per file, headed `[i]` (the legend above names each file) so a
/// few files fit 100 columns; `wide`, headed by the files' full labels.
fn table_text(cmp: &Comparison, wide: bool) -> String {
    let (mut header, rows) = grid(cmp);
    if !wide {
        for (i, h) in header.iter_mut().skip(2).enumerate() {
            *h = format!("[{}]", i + 1);
        }
    }
    let mut t = Table::new();
    let preset = if crate::term::unicode_enabled() {
        UTF8_FULL_CONDENSED
    } else {
        comfy_table::presets::ASCII_FULL_CONDENSED
    };
    t.load_preset(preset)
        .set_header(header.iter().map(Cell::new));
    if wide {
        t.set_content_arrangement(ContentArrangement::Disabled);
    } else {
        // Long scenario labels wrap: the table stays within 100 columns.
        t.set_content_arrangement(ContentArrangement::Dynamic)
            .set_width(100);
    }
    for r in rows {
        t.add_row(r.into_iter().enumerate().map(|(i, s)| {
            let c = Cell::new(s);
            if i >= 2 {
                c.set_alignment(CellAlignment::Right)
            } else {
                c
            }
        }));
    }
    let mut s = String::new();
    for (i, f) in cmp.files.iter().enumerate() {
        s.push_str(&format!("[{}] {} ({})\n", i + 1, f.label, f.path));
    }
    s.push_str(&t.to_string());
    s.push('\n');
    s
}

fn markdown_text(cmp: &Comparison) -> String {
    let (header, rows) = grid(cmp);
    let mut s = String::from("# oomprobe comparison\n\n");
    for (i, f) in cmp.files.iter().enumerate() {
        s.push_str(&format!(
            "{}. {} (`{}`)\n",
            i + 1,
            super::markdown::cell(&f.label),
            f.path.replace('`', "'")
        ));
    }
    s.push('\n');
    let h: Vec<&str> = header.iter().map(String::as_str).collect();
    s.push_str(&super::markdown::table(&h, &rows, |i| i >= 2));
    if !cmp.warnings.is_empty() {
        s.push('\n');
        for w in &cmp.warnings {
            s.push_str(&format!("- warning: {}\n", super::markdown::cell(w)));
        }
    }
    s
}

fn csv_text(files: &[LoadedFile], cmp: &Comparison) -> String {
    use super::csv::{field, run_fields, RUN_COLUMNS};
    let mut header = vec![
        "file",
        "device",
        "backend",
        "budget_bytes",
        "capacity_bytes",
    ];
    header.extend(RUN_COLUMNS.iter().skip(4));
    header.push("ratio_to_first");
    let mut s = header.join(",");
    s.push('\n');
    for row in &cmp.rows {
        for (fi, cell) in row.cells.iter().enumerate() {
            let Some(c) = cell else { continue };
            let Some(run) = files.get(fi).and_then(|f| f.report.runs.get(c.run_index)) else {
                continue;
            };
            let f = &cmp.files[fi];
            let mut fields = vec![
                f.path.clone(),
                f.device.name.clone(),
                f.device.backend.as_str().to_string(),
                f.budget_bytes.map(|b| b.to_string()).unwrap_or_default(),
                c.capacity_bytes.map(|b| b.to_string()).unwrap_or_default(),
            ];
            fields.extend(run_fields(run));
            fields.push(c.ratio_to_first.map(|r| r.to_string()).unwrap_or_default());
            s.push_str(
                &fields
                    .iter()
                    .map(|x| field(x))
                    .collect::<Vec<_>>()
                    .join(","),
            );
            s.push('\n');
        }
    }
    s
}

/// The series of one row: each file's run, coloured by file.
fn row_series<'a>(
    files: &'a [LoadedFile],
    cmp: &'a Comparison,
    row: &'a CompareRow,
) -> Vec<super::svg::Series<'a>> {
    use super::svg::{Series, PALETTE};
    row.cells
        .iter()
        .enumerate()
        .filter_map(|(fi, c)| {
            let c = c.as_ref()?;
            let run = files.get(fi)?.report.runs.get(c.run_index)?;
            Some(Series {
                label: format!(
                    "[{}] {}{}",
                    fi + 1,
                    short_label(cmp, fi),
                    if c.in_progress { " (in progress)" } else { "" }
                ),
                color: PALETTE[fi % PALETTE.len()],
                run,
                capacity: c.capacity_bytes,
            })
        })
        .collect()
}

/// A legend label that fits the chart: the budget/memory part when every file has the same
/// device, else the device name, cut to 26 characters.
fn short_label(cmp: &Comparison, fi: usize) -> String {
    let f = &cmp.files[fi];
    let same_device = cmp.files.iter().all(|g| g.device.name == f.device.name);
    let text = if same_device {
        match f.label.rsplit_once(" \u{00b7} ") {
            Some((_, tail)) if f.label.matches(" \u{00b7} ").count() == 1 => tail.to_string(),
            _ => f
                .label
                .replacen(&format!("{} \u{00b7} ", f.device.name), "", 1),
        }
    } else {
        f.label.clone()
    };
    if text.chars().count() > 26 {
        let mut t: String = text.chars().take(25).collect();
        t.push('\u{2026}');
        t
    } else {
        text
    }
}

fn row_title(files: &[LoadedFile], row: &CompareRow) -> String {
    let workload = row
        .cells
        .iter()
        .enumerate()
        .find_map(|(fi, c)| {
            let c = c.as_ref()?;
            Some(
                files
                    .get(fi)?
                    .report
                    .runs
                    .get(c.run_index)?
                    .workload
                    .name
                    .clone(),
            )
        })
        .unwrap_or_default();
    format!("{} \u{2014} {workload}", row.label())
}

fn svg_text(files: &[LoadedFile], cmp: &Comparison) -> String {
    let charts: Vec<String> = cmp
        .rows
        .iter()
        .map(|row| {
            super::svg::chart_body(
                &row_title(files, row),
                &row.dimension,
                &row_series(files, cmp, row),
            )
        })
        .collect();
    super::svg::stack(&charts)
}

fn html_text(files: &[LoadedFile], cmp: &Comparison) -> String {
    use super::html::{page_end, page_start, table};
    use super::svg::esc;
    let mut s = page_start("oomprobe comparison");
    s.push_str("<ol>\n");
    for f in &cmp.files {
        s.push_str(&format!(
            "<li>{} &mdash; <code>{}</code> (driver {})</li>\n",
            esc(&f.label),
            esc(&f.path),
            esc(&f.device.driver)
        ));
    }
    s.push_str("</ol>\n");
    for w in &cmp.warnings {
        s.push_str(&format!("<p class=\"warn\">warning: {}</p>\n", esc(w)));
    }
    let (header, rows) = grid(cmp);
    let h: Vec<&str> = header.iter().map(String::as_str).collect();
    s.push_str(&table(&h, &rows, |i| i >= 2, |_| None));
    for row in &cmp.rows {
        s.push_str(&format!("<h2>{}</h2>\n", esc(&row.label())));
        s.push_str(&format!(
            "<div class=\"chart\">\n{}</div>\n",
            super::svg::chart_svg(
                &row_title(files, row),
                &row.dimension,
                &row_series(files, cmp, row)
            )
        ));
    }
    s.push_str(&page_end(&format!(
        "{} {}",
        env!("CARGO_PKG_NAME"),
        env!("CARGO_PKG_VERSION")
    )));
    s
}

/// Render a comparison of `files` (as built by [`build`]) in one format.
pub fn render(
    files: &[LoadedFile],
    cmp: &Comparison,
    format: OutputFormat,
    wide: bool,
) -> Result<String, ReportError> {
    Ok(match format {
        OutputFormat::Table => table_text(cmp, wide),
        OutputFormat::Json => {
            let mut s = serde_json::to_string_pretty(cmp)?;
            s.push('\n');
            s
        }
        OutputFormat::Csv => csv_text(files, cmp),
        OutputFormat::Markdown => markdown_text(cmp),
        OutputFormat::Svg => svg_text(files, cmp),
        OutputFormat::Html => html_text(files, cmp),
    })
}
