//! CSV: one row per run (what `--format csv` writes) or one row per probe.
//!
//! Both start with a header line; numbers are plain (bytes in bytes, ratios as fractions,
//! seconds as decimals); a missing value is an empty field. Fields are quoted (RFC 4180) when
//! they hold a comma, a quote or a line break.

use super::model::{ProbeReport, RunResult};
use super::throughput::{best_throughput, rate_at};
use super::{prediction_error, run_capacity};

/// Column names of [`runs_csv`].
pub const RUN_COLUMNS: [&str; 23] = [
    "device",
    "backend",
    "budget_bytes",
    "capacity_bytes",
    "scenario",
    "variant",
    "dimension",
    "max_fit",
    "first_fail",
    "fail_reason",
    "bytes_at_max_fit",
    "predicted_max",
    "prediction_error",
    "fill_ratio",
    "activation_share",
    "best_throughput_value",
    "best_throughput_per_second",
    "throughput_unit",
    "probes",
    "seconds",
    "flaky",
    "workload",
    "status",
];

/// Column names of [`probes_csv`].
pub const PROBE_COLUMNS: [&str; 12] = [
    "device",
    "scenario",
    "variant",
    "dimension",
    "value",
    "outcome",
    "bytes",
    "bytes_allocated",
    "seconds",
    "step_seconds",
    "per_second",
    "detail",
];

/// Quote a field when it needs it.
pub fn field(s: &str) -> String {
    if s.contains([',', '"', '\n', '\r']) {
        format!("\"{}\"", s.replace('"', "\"\""))
    } else {
        s.to_string()
    }
}

fn opt<T: ToString>(v: Option<T>) -> String {
    v.map(|v| v.to_string()).unwrap_or_default()
}

fn line(fields: &[String]) -> String {
    let mut s = fields
        .iter()
        .map(|f| field(f))
        .collect::<Vec<_>>()
        .join(",");
    s.push('\n');
    s
}

/// The run's values in [`RUN_COLUMNS`] order, without the device and budget columns (shared
/// with `compare`'s CSV).
pub fn run_fields(run: &RunResult) -> Vec<String> {
    let best = best_throughput(run);
    vec![
        run.scenario.name().to_string(),
        run.variant.clone().unwrap_or_default(),
        run.dimension.clone(),
        opt(run.max_fit),
        opt(run.first_fail),
        opt(run.fail_reason.map(|o| o.name())),
        opt(run.bytes_at_max_fit),
        opt(run.predicted_max),
        opt(prediction_error(run)),
        opt(run.fill_ratio),
        opt(run.activation_share),
        opt(best.map(|b| b.value)),
        opt(best.map(|b| b.per_second)),
        opt(best.map(|b| b.unit)),
        run.probes.len().to_string(),
        run.seconds.to_string(),
        run.flaky.to_string(),
        workload_summary(run),
        if run.is_partial() {
            "in_progress"
        } else {
            "complete"
        }
        .to_string(),
    ]
}

/// A compact `key=value` summary of the workload (one field).
pub fn workload_summary(run: &RunResult) -> String {
    match serde_json::to_value(&run.workload) {
        Ok(serde_json::Value::Object(m)) => m
            .iter()
            .filter(|(_, v)| !v.is_null())
            .map(|(k, v)| match v {
                serde_json::Value::String(s) => format!("{k}={s}"),
                other => format!("{k}={other}"),
            })
            .collect::<Vec<_>>()
            .join(" "),
        _ => String::new(),
    }
}

/// One row per run, with a header.
pub fn runs_csv(report: &ProbeReport) -> String {
    let mut out = line(&RUN_COLUMNS.map(str::to_string));
    for run in &report.runs {
        let mut f = vec![
            report.device.name.clone(),
            report.device.backend.as_str().to_string(),
            opt(report.budget_bytes),
            opt(run_capacity(report, run)),
        ];
        f.extend(run_fields(run));
        out.push_str(&line(&f));
    }
    out
}

/// One row per probe (every run's probes in value order), with a header.
pub fn probes_csv(report: &ProbeReport) -> String {
    let mut out = line(&PROBE_COLUMNS.map(str::to_string));
    for run in &report.runs {
        for p in super::sorted_probes(run) {
            let rate = if p.outcome.is_fit() {
                rate_at(run, p.value, p.step_seconds)
            } else {
                None
            };
            out.push_str(&line(&[
                report.device.name.clone(),
                run.scenario.name().to_string(),
                run.variant.clone().unwrap_or_default(),
                run.dimension.clone(),
                p.value.to_string(),
                p.outcome.name().to_string(),
                p.bytes.to_string(),
                p.bytes_allocated.to_string(),
                p.seconds.to_string(),
                opt(p.step_seconds),
                opt(rate),
                p.detail.clone().unwrap_or_default(),
            ]));
        }
    }
    out
}
