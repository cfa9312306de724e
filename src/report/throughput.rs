//! Throughput from the fitting probes' step times: the value that trains fastest under the limit.
//!
//! For a batch dimension a probe at batch `b` whose step took `t` seconds processes `b / t`
//! samples per second; for a sequence dimension `seq · batch / t` tokens per second. The params
//! dimension has no throughput (one optimizer step over `n` parameters is not a sample rate).
//! The largest batch that fits is not always the fastest one (cache, tiling, or a driver that
//! starts paging near the limit), so reports mark the best one separately.

use serde::Serialize;

use super::model::RunResult;

/// The fastest fitting value of a run.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Throughput {
    /// The value of the run's dimension (batch or seq) that gave the most throughput.
    pub value: u64,
    /// Samples (batch) or tokens (seq) per second at that value.
    pub per_second: f64,
    /// `samples` or `tokens`.
    pub unit: &'static str,
}

impl Throughput {
    /// Compact text, e.g. `48 (1.2k samples/s)`.
    pub fn label(&self) -> String {
        format!("{} ({})", self.value, self.rate())
    }
    /// The rate alone, e.g. `1.2k samples/s`.
    pub fn rate(&self) -> String {
        format!("{} {}/s", fmt_rate(self.per_second), self.unit)
    }
}

/// A rate with three significant digits and a k/M suffix.
pub fn fmt_rate(r: f64) -> String {
    if !r.is_finite() {
        return "-".to_string();
    }
    let (v, s) = if r >= 1e6 {
        (r / 1e6, "M")
    } else if r >= 1e3 {
        (r / 1e3, "k")
    } else {
        (r, "")
    };
    if v >= 100.0 {
        format!("{v:.0}{s}")
    } else if v >= 10.0 {
        format!("{v:.1}{s}")
    } else {
        format!("{v:.2}{s}")
    }
}

/// The throughput of one probe at `value` with step time `step_seconds`, in the run's unit;
/// None for the params dimension or a missing/zero step time.
pub fn rate_at(run: &RunResult, value: u64, step_seconds: Option<f64>) -> Option<f64> {
    let t = step_seconds.filter(|t| t.is_finite() && *t > 0.0)?;
    match run.dimension.as_str() {
        "batch" => Some(value as f64 / t),
        "seq" => Some(value as f64 * run.workload.batch.max(1) as f64 / t),
        _ => None,
    }
}

/// The unit `rate_at` counts in for this run, if any.
pub fn unit_of(run: &RunResult) -> Option<&'static str> {
    match run.dimension.as_str() {
        "batch" => Some("samples"),
        "seq" => Some("tokens"),
        _ => None,
    }
}

/// The fitting probe with the most throughput (ties: the smaller value, which needs less
/// memory). None when no fitting probe has a step time or the dimension has no rate.
pub fn best_throughput(run: &RunResult) -> Option<Throughput> {
    let unit = unit_of(run)?;
    let mut best: Option<Throughput> = None;
    for p in run.probes.iter().filter(|p| p.outcome.is_fit()) {
        let Some(r) = rate_at(run, p.value, p.step_seconds) else {
            continue;
        };
        let better = match best {
            None => true,
            Some(b) => r > b.per_second || (r == b.per_second && p.value < b.value),
        };
        if better {
            best = Some(Throughput {
                value: p.value,
                per_second: r,
                unit,
            });
        }
    }
    best
}
