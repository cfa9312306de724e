//! Results and their exporters: one module per format, all reading the same model.
//!
//! - [`table`]: a terminal table (comfy-table), the default on a terminal.
//! - [`json`]: the JSON contract (serde of [`ProbeReport`], pretty-printed).
//! - [`csv`]: one row per run ([`csv::runs_csv`], what `--format csv` writes) and, for
//!   spreadsheets that want every probe, one row per probe ([`csv::probes_csv`]).
//! - [`markdown`]: a runs table plus one probe table per run.
//! - [`svg`]: one chart per run, stacked vertically in one SVG document: memory against the
//!   varied dimension, probes as points (filled = fit, cross = failed), the plan's predicted
//!   line, the capacity line and the boundary.
//! - [`html`]: one self-contained file (inline CSS and SVG, no external resources).
//! - [`compare`]: several probe files side by side (`oomprobe compare`).
//! - [`throughput`]: samples (or tokens) per second from the fitting probes' step times.

#[doc(hidden)]
pub mod case_replay;
pub mod compare;
pub mod csv;
pub mod html;
pub mod json;
pub mod markdown;
pub mod model;
pub mod sample;
pub mod step_chart;
pub mod svg;
pub mod table;
pub mod throughput;

pub use model::*;
pub use throughput::{best_throughput, Throughput};

use std::io::Write;
use std::path::{Path, PathBuf};

use thiserror::Error;

use crate::error::CliError;
use crate::units::fmt_bytes;

/// A results format (`--format`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum OutputFormat {
    Table,
    Json,
    Csv,
    Markdown,
    Svg,
    Html,
}

/// Why a report could not be rendered, read or its format chosen.
#[derive(Debug, Error)]
pub enum ReportError {
    /// `--out` names a file whose extension says no format, and `--format` was not given.
    #[error(
        "{}: cannot tell the output format from the extension; use .json .csv .md .svg .html \
         .txt or --format table|json|csv|markdown|svg|html",
        .0.display()
    )]
    UnknownExtension(PathBuf),
    /// `--out` cannot be written: its folder does not exist, or it names a folder.
    #[error("{}: {why}", path.display())]
    BadOutPath { path: PathBuf, why: &'static str },
    /// A result file could not be read.
    #[error("{}: cannot read: {source}", path.display())]
    Read {
        path: PathBuf,
        source: crate::input::InputError,
    },
    /// A result file is not a probe result (malformed JSON or wrong fields).
    #[error("{}: not an oomprobe probe result: {detail}", path.display())]
    Malformed { path: PathBuf, detail: String },
    /// A result file has a schema version this build does not understand.
    #[error(
        "{}: schema_version {found} is newer than this oomprobe understands ({supported})",
        path.display()
    )]
    Schema {
        path: PathBuf,
        found: u64,
        supported: u32,
    },
    /// Serialising to JSON failed (should not happen for the model's types).
    #[error("cannot write JSON: {0}")]
    Json(#[from] serde_json::Error),
    /// Writing the output failed.
    #[error("cannot write {}: {source}", path.display())]
    Write {
        path: PathBuf,
        source: std::io::Error,
    },
}

impl From<ReportError> for CliError {
    fn from(e: ReportError) -> Self {
        match e {
            ReportError::UnknownExtension(_)
            | ReportError::BadOutPath { .. }
            | ReportError::Read { .. }
            | ReportError::Malformed { .. }
            | ReportError::Schema { .. }
            | ReportError::Write { .. } => CliError::usage(e.to_string()),
            ReportError::Json(_) => CliError::run(e.to_string()),
        }
    }
}

/// Render a probe report in one format. SVG is one chart per run stacked in one document; HTML
/// is one self-contained page (tables and inline SVG charts).
pub fn render(report: &ProbeReport, format: OutputFormat) -> Result<String, ReportError> {
    Ok(match format {
        OutputFormat::Table => table::render(report),
        OutputFormat::Json => json::render(report)?,
        OutputFormat::Csv => csv::runs_csv(report),
        OutputFormat::Markdown => markdown::render(report),
        OutputFormat::Svg => svg::render_report(report),
        OutputFormat::Html => html::render(report),
    })
}

/// The format to write `path` in: `explicit` (`--format`) wins; otherwise the extension
/// (case-insensitive): .json, .csv, .md/.markdown, .svg, .html/.htm, .txt (table).
/// `-` (stdout) without `--format` is JSON: `--out -` exists to pipe the contract to a tool.
/// Any other extension without `--format` is a usage error.
pub fn format_for_path(
    path: &Path,
    explicit: Option<OutputFormat>,
) -> Result<OutputFormat, ReportError> {
    if let Some(f) = explicit {
        return Ok(f);
    }
    if is_stdout(path) {
        return Ok(OutputFormat::Json);
    }
    let ext = path
        .extension()
        .and_then(|e| e.to_str())
        .map(|e| e.to_ascii_lowercase());
    match ext.as_deref() {
        Some("json") => Ok(OutputFormat::Json),
        Some("csv") => Ok(OutputFormat::Csv),
        Some("md") | Some("markdown") => Ok(OutputFormat::Markdown),
        Some("svg") => Ok(OutputFormat::Svg),
        Some("html") | Some("htm") => Ok(OutputFormat::Html),
        Some("txt") => Ok(OutputFormat::Table),
        _ => Err(ReportError::UnknownExtension(path.to_path_buf())),
    }
}

/// The format to write `--out` `path` in ([`format_for_path`]), once it is known the file can
/// be created: a folder that does not exist or a path that is a folder is a usage error.
pub fn out_format(
    path: &Path,
    explicit: Option<OutputFormat>,
) -> Result<OutputFormat, ReportError> {
    if !is_stdout(path) {
        check_out_path(path)?;
    }
    format_for_path(path, explicit)
}

/// `path` can be written as `write_atomically` writes it, checked before any device work: it
/// is a regular file or a new name (never a folder, a symbolic link, a device, a FIFO or a
/// socket, which a rename would clobber or a reader would see torn), and its folder exists and
/// takes a new file.
fn check_out_path(path: &Path) -> Result<(), ReportError> {
    let bad = |why| {
        Err(ReportError::BadOutPath {
            path: path.to_path_buf(),
            why,
        })
    };
    match std::fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => {
            return bad("is a symbolic link (give the file it names, or a new name)")
        }
        Ok(m) if m.is_dir() => return bad("is a folder, not a file"),
        Ok(m) if !m.is_file() => {
            return bad("is not a regular file (a device, FIFO or socket): give a file name")
        }
        _ => {}
    }
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    if !dir.is_dir() {
        return bad("its folder does not exist (create it first)");
    }
    // The folder takes a new file (the temporary one a write renames into place).
    let probe = dir.join(format!(".oomprobe-write-check.{}.tmp", std::process::id()));
    match std::fs::File::create(&probe) {
        Ok(_) => {
            let _ = std::fs::remove_file(&probe);
            Ok(())
        }
        Err(_) => bad("its folder is not writable"),
    }
}

/// True when `path` is `-`, meaning standard output.
pub fn is_stdout(path: &Path) -> bool {
    path.as_os_str() == "-"
}

/// Replace `path` with `contents` atomically: write a temporary file in the same directory,
/// flush it to disk, then rename it over `path`. A reader (or a run killed half way) sees the
/// old file or the new one, never a torn one. `-` writes to standard output instead.
pub fn write_atomically(path: &Path, contents: &str) -> std::io::Result<()> {
    if is_stdout(path) {
        let mut out = std::io::stdout().lock();
        out.write_all(contents.as_bytes())?;
        return out.flush();
    }
    let dir = match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "out".to_string());
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let result = (|| {
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(contents.as_bytes())?;
        f.sync_all()?;
        drop(f);
        std::fs::rename(&tmp, path)
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// Write `contents` to `path` (atomically) or to stdout for `-`, mapping errors to a
/// [`ReportError`] that names the file.
pub fn write_output(path: &Path, contents: &str) -> Result<(), ReportError> {
    write_atomically(path, contents).map_err(|source| ReportError::Write {
        path: path.to_path_buf(),
        source,
    })
}

// ---- small formatting helpers shared by the exporters ----

/// A value of the params dimension, compact with three significant digits (48, 12.3k, 7.00M,
/// 13.0B) and `extra` more decimals (never more than make the value exact): how `ValueFormat`
/// prints a column of parameter counts. Counts in sentences use `units::fmt_count`.
fn fmt_compact_with(v: u64, extra: usize) -> String {
    if v < 10_000 {
        return v.to_string();
    }
    let (d, s, exact_decimals) = if v >= 1_000_000_000 {
        (1e9, "B", 9)
    } else if v >= 1_000_000 {
        (1e6, "M", 6)
    } else {
        (1e3, "k", 3)
    };
    let x = v as f64 / d;
    let decimals = if x >= 100.0 {
        0
    } else if x >= 10.0 {
        1
    } else {
        2
    };
    let decimals = (decimals + extra).min(exact_decimals);
    format!("{x:.decimals$}{s}")
}

/// A value of a run's dimension: parameter counts compact, batch and seq plain.
pub fn fmt_value(dimension: &str, v: u64) -> String {
    ValueFormat::plain(dimension).fmt(v)
}

/// How the values of one dimension are printed side by side: parameter counts compact
/// (`774M`), batch and seq as plain integers, with as many more decimals as it takes for two
/// different values never to print the same (`774.07M`, `774.13M`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ValueFormat {
    compact: bool,
    extra: usize,
}

impl ValueFormat {
    /// The shortest form, for a value printed alone.
    pub fn plain(dimension: &str) -> Self {
        ValueFormat {
            compact: dimension == "params",
            extra: 0,
        }
    }

    /// The shortest form that prints different `values` differently.
    pub fn distinct(dimension: &str, values: impl IntoIterator<Item = u64>) -> Self {
        let mut values: Vec<u64> = values.into_iter().collect();
        values.sort_unstable();
        values.dedup();
        let mut f = Self::plain(dimension);
        // Nine more decimals make any count exact (units of at most 1e9).
        while f.compact && f.extra < 9 {
            let mut shown: Vec<String> = values.iter().map(|&v| f.fmt(v)).collect();
            shown.sort_unstable();
            shown.dedup();
            if shown.len() == values.len() {
                break;
            }
            f.extra += 1;
        }
        f
    }

    pub fn fmt(self, v: u64) -> String {
        if self.compact {
            fmt_compact_with(v, self.extra)
        } else {
            v.to_string()
        }
    }
}

/// Seconds with sensible precision.
pub fn fmt_seconds(s: f64) -> String {
    if !s.is_finite() {
        return "-".to_string();
    }
    if s >= 100.0 {
        format!("{s:.0}")
    } else if s >= 1.0 {
        format!("{s:.1}")
    } else {
        format!("{s:.3}")
    }
}

/// A ratio as a percentage with one decimal.
pub fn fmt_pct(r: f64) -> String {
    if r.is_finite() {
        format!("{:.1}%", r * 100.0)
    } else {
        "-".to_string()
    }
}

/// Signed percentage: `+8.3%`, `-2.0%`.
pub fn fmt_signed_pct(r: f64) -> String {
    if r.is_finite() {
        format!("{:+.1}%", r * 100.0)
    } else {
        "-".to_string()
    }
}

/// `(predicted - max_fit) / max_fit`: how far the plan's prediction is from the measurement
/// (positive: the plan promised more than the device gave). None without both numbers or
/// when nothing fitted.
pub fn prediction_error(run: &RunResult) -> Option<f64> {
    if run.at.is_some() {
        return None; // one probe at a chosen value is no boundary
    }
    let m = run.max_fit?;
    let p = run.predicted_max?;
    if m == 0 {
        return None;
    }
    Some((p as f64 - m as f64) / m as f64)
}

/// The scenario name with its variant, e.g. `seq (flash)`.
pub fn run_label(run: &RunResult) -> String {
    match &run.variant {
        Some(v) if !v.is_empty() => format!("{} ({v})", run.scenario.name()),
        _ => run.scenario.name().to_string(),
    }
}

/// The memory a run was measured against: its own capacity, else the report's budget, else
/// the device's free then total memory.
pub fn run_capacity(report: &ProbeReport, run: &RunResult) -> Option<u64> {
    run.capacity_bytes
        .or(report.budget_bytes)
        .or(report.device.memory_free_bytes)
        .or(report.device.memory_total_bytes)
}

/// A one-line description of the device and its memory.
pub fn device_line(report: &ProbeReport) -> String {
    let d = &report.device;
    let mut s = format!(
        "{} ({}, {}, driver {})",
        d.name,
        d.backend.as_str(),
        device_type_name(d.device_type),
        if d.driver.is_empty() { "?" } else { &d.driver }
    );
    let mem = |v: Option<u64>| v.map(fmt_bytes).unwrap_or_else(|| "unknown".to_string());
    s.push_str(&format!(
        "; memory total {}, free {}",
        mem(d.memory_total_bytes),
        mem(d.memory_free_bytes)
    ));
    if let Some(o) = d.overhead_bytes {
        s.push_str(&format!(
            " after an overhead of {} (kernels {})",
            fmt_bytes(o),
            mem(d.kernel_overhead_bytes)
        ));
    }
    if let Some(b) = report.budget_bytes {
        s.push_str(&format!("; budget {}", fmt_bytes(b)));
    }
    s.push_str(&format!(
        "; max buffer {}, max binding {}",
        fmt_bytes(d.max_buffer_size),
        fmt_bytes(d.max_storage_binding_size)
    ));
    if let Some(c) = &report.compute {
        s.push_str(&format!("; compute {c}"));
    }
    s
}

/// The contract name of a device type.
pub fn device_type_name(t: crate::backend::DeviceType) -> &'static str {
    use crate::backend::DeviceType;
    match t {
        DeviceType::Discrete => "discrete",
        DeviceType::Integrated => "integrated",
        DeviceType::Cpu => "cpu",
        DeviceType::Virtual => "virtual",
        DeviceType::Other => "other",
    }
}

/// Probes sorted by value (the order they are drawn and listed in).
pub fn sorted_probes(run: &RunResult) -> Vec<&ProbeRecord> {
    let mut v: Vec<&ProbeRecord> = run.probes.iter().collect();
    v.sort_by_key(|p| p.value);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_from_extension() {
        let f = |p: &str| format_for_path(Path::new(p), None).ok();
        assert_eq!(f("a.json"), Some(OutputFormat::Json));
        assert_eq!(f("a.CSV"), Some(OutputFormat::Csv));
        assert_eq!(f("dir/a.md"), Some(OutputFormat::Markdown));
        assert_eq!(f("a.svg"), Some(OutputFormat::Svg));
        assert_eq!(f("a.htm"), Some(OutputFormat::Html));
        assert_eq!(f("a.txt"), Some(OutputFormat::Table));
        assert_eq!(f("-"), Some(OutputFormat::Json));
        assert_eq!(f("a.xlsx"), None);
        assert_eq!(f("noext"), None);
        assert_eq!(
            format_for_path(Path::new("a.xlsx"), Some(OutputFormat::Csv)).ok(),
            Some(OutputFormat::Csv)
        );
        let e = format_for_path(Path::new("a.xlsx"), None).unwrap_err();
        assert!(matches!(CliError::from(e), CliError::Usage(_)));
    }

    #[test]
    fn params_values_are_compact() {
        assert_eq!(fmt_value("params", 7_000_000_000), "7.00B");
        assert_eq!(fmt_value("params", 13_000_000_000), "13.0B");
        assert_eq!(fmt_value("params", 48), "48");
    }

    #[test]
    fn different_values_in_a_row_never_print_the_same() {
        // The row: two boundaries 65,536 params apart printed as `774M` twice.
        let (fit, fail) = (774_045_696u64, 774_111_232u64);
        assert_eq!(fmt_value("params", fit), fmt_value("params", fail));
        let f = ValueFormat::distinct("params", [fit, fail, fit]);
        assert_ne!(f.fmt(fit), f.fmt(fail));
        assert_eq!(
            (f.fmt(fit).as_str(), f.fmt(fail).as_str()),
            ("774.0M", "774.1M")
        );
        // No more digits than needed: far-apart values keep the short form.
        assert_eq!(
            ValueFormat::distinct("params", [33_554_432, 67_108_864]),
            ValueFormat::plain("params")
        );
        // Values one apart end exact, whatever their size.
        for base in [12_345u64, 7_000_000_001, 123_456_789_012] {
            let f = ValueFormat::distinct("params", [base, base + 1]);
            assert_ne!(f.fmt(base), f.fmt(base + 1), "{base}");
        }
        // Batch and seq are exact integers already.
        assert_eq!(ValueFormat::distinct("seq", [1393, 1394]).fmt(1394), "1394");
    }

    #[test]
    fn atomic_write_replaces_and_leaves_no_temp() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join("r.json");
        write_atomically(&p, "one").expect("write");
        write_atomically(&p, "two").expect("rewrite");
        assert_eq!(std::fs::read_to_string(&p).expect("read"), "two");
        let names: Vec<_> = std::fs::read_dir(dir.path())
            .expect("ls")
            .filter_map(|e| e.ok())
            .map(|e| e.file_name())
            .collect();
        assert_eq!(names.len(), 1, "{names:?}");
    }
}
