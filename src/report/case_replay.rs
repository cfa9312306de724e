//! The text view of a case replay: one row per expectation, expected beside predicted and
//! measured.

use serde::Serialize;

use super::ProbeRecord;
use crate::backend::DeviceInfo;
use crate::units::fmt_bytes;
use crate::workload::case::Verdict;

/// One expectation's replay.
#[derive(Debug, Clone, Serialize)]
pub struct ReplayRun {
    pub expect_index: usize,
    pub workload: crate::workload::Workload,
    pub expected: Verdict,
    /// The plan's verdict against the case memory.
    pub predicted: Verdict,
    pub plan_bytes: u64,
    /// The device's verdict (None when the case could not run here).
    pub measured: Option<Verdict>,
    pub reproduced: Option<bool>,
    pub probe: Option<ProbeRecord>,
}

/// The whole replay (`--json`).
#[derive(Debug, Clone, Serialize)]
pub struct ReplayReport {
    pub schema_version: u32,
    pub case: String,
    pub memory_bytes: u64,
    pub device: DeviceInfo,
    /// Why the case was not run on this device, if it was not.
    pub not_replayable: Option<String>,
    pub runs: Vec<ReplayRun>,
}

fn verdict_name(v: Verdict) -> &'static str {
    match v {
        Verdict::Oom => "oom",
        Verdict::Fits => "fits",
    }
}

/// The replay as a short text report.
pub fn render(r: &ReplayReport) -> String {
    let mut table = comfy_table::Table::new();
    table.load_preset(comfy_table::presets::UTF8_FULL_CONDENSED);
    table.set_header([
        "#",
        "workload",
        "plan bytes",
        "expected",
        "predicted",
        "measured",
        "reproduced",
    ]);
    for run in &r.runs {
        let w = &run.workload;
        table.add_row([
            run.expect_index.to_string(),
            format!(
                "{} batch {} seq {} {:?} ckpt {:?}",
                w.name, w.batch, w.seq, w.attention, w.checkpoint
            ),
            fmt_bytes(run.plan_bytes),
            verdict_name(run.expected).to_string(),
            verdict_name(run.predicted).to_string(),
            run.measured.map(verdict_name).unwrap_or("-").to_string(),
            match run.reproduced {
                Some(true) => "yes".to_string(),
                Some(false) => "NO".to_string(),
                None => "not run".to_string(),
            },
        ]);
    }
    let mut out = format!(
        "case: {}\ncard memory: {} (the budget)\ndevice: {}\n{table}\n",
        r.case,
        fmt_bytes(r.memory_bytes),
        r.device.name
    );
    if let Some(why) = &r.not_replayable {
        out.push_str(&format!("not replayed here: {why}\n"));
    }
    out
}
