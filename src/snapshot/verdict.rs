//! `estimate --snapshot` and `diagnose --snapshot` as data: the report of every device, whether
//! each device's peak fits the card (the memory recorded at the OOM, or the one given), the
//! cause, what is live at the peak by stack frame, and the scaled max batch of two snapshots.

use serde::Serialize;

use crate::units::fmt_bytes;

use super::read::{load_file, Loaded};
use super::replay::{self, ScaleSummary};
use super::report::{report, report_file, DeviceReport, DeviceSelect, OomReport, SnapshotReport};
use super::trace::{self, trace_of_device};
use super::{SnapshotError, Source};

/// What `estimate --snapshot` reports. The top-level `breakdown`, `timeline` and `fits` are the
/// default device's (the OOM's, else the highest peak); `devices` has every device reported.
#[derive(Debug, Serialize)]
pub struct SnapshotEstimate {
    pub schema_version: u32,
    pub file: String,
    pub format: String,
    pub granularity: super::Granularity,
    /// The default device.
    pub device: usize,
    pub breakdown: crate::estimate::Breakdown,
    pub timeline: crate::estimate::TimelineSummary,
    pub memory_bytes: Option<u64>,
    /// Whether the default device's peak fits in `memory_bytes`.
    pub fits: Option<bool>,
    /// The recorded OOM, if the file has one (on a reported device).
    pub oom: Option<OomReport>,
    pub devices: Vec<DeviceReport>,
    pub devices_in_file: Vec<usize>,
    /// With two snapshots: the scaling model and the predicted max batch.
    pub scale: Option<ScaleSummary>,
    pub predicted_max_batch: Option<u64>,
    pub notes: Vec<String>,
}

/// The third file and its batch, if given.
pub fn third(src: &Source) -> Option<(&std::path::Path, u64)> {
    Some((src.files.get(2)?.as_path(), *src.batches.get(2)?))
}

/// Estimate a source against `memory` (None: the card recorded at an OOM, if any).
pub fn estimate(
    src: &Source,
    select: DeviceSelect,
    memory: Option<u64>,
) -> Result<SnapshotEstimate, SnapshotError> {
    estimate_of(src, &load_file(&src.files[0])?, select, memory)
}

/// [`estimate`] of the first file, already read.
pub fn estimate_of(
    src: &Source,
    loaded: &Loaded,
    select: DeviceSelect,
    memory: Option<u64>,
) -> Result<SnapshotEstimate, SnapshotError> {
    let select = match (select, src.device) {
        (DeviceSelect::All, Some(d)) => DeviceSelect::One(d),
        (s, _) => s,
    };
    let rep = report(
        &loaded.snapshot,
        &src.files[0].display().to_string(),
        &loaded.format,
        src.granularity,
        select,
    )?;
    let (scale, predicted) = if src.scales() {
        let model = src.model()?;
        let sm = replay::summarize(&model, third(src))?;
        let p = memory.and_then(|m| model.predict_max(m, replay::MAX_BATCH));
        (Some(sm), p)
    } else {
        (None, None)
    };
    let main = &rep.devices[0];
    let mut notes = rep.notes.clone();
    notes.extend(main.notes.iter().cloned());
    for d in &rep.devices[1..] {
        notes.extend(d.notes.iter().cloned());
    }
    Ok(SnapshotEstimate {
        schema_version: crate::report::SCHEMA_VERSION,
        file: rep.file.clone(),
        format: rep.format.clone(),
        granularity: rep.granularity,
        device: main.device,
        breakdown: main.breakdown,
        timeline: main.timeline.clone(),
        memory_bytes: memory,
        fits: memory.map(|m| main.peak_bytes <= m),
        oom: rep.devices.iter().find_map(|d| d.oom.clone()),
        devices_in_file: rep.devices_in_file.clone(),
        devices: rep.devices,
        scale,
        predicted_max_batch: predicted,
        notes,
    })
}

/// What `diagnose --snapshot` reports.
#[derive(Debug, Serialize)]
pub struct SnapshotDiagnosis {
    pub schema_version: u32,
    /// The default device's cause: fits | model_too_large | batch_too_large.
    pub cause: &'static str,
    pub memory_bytes: u64,
    /// Where `memory_bytes` comes from: "--memory" or the recorded OOM.
    pub memory_from: String,
    /// Each reported device against `memory_bytes`.
    pub judged: Vec<DeviceJudgement>,
    /// The default device's live allocations at its peak, by top stack frame (10 largest).
    pub live_at_peak_by_frame: Vec<(String, u64)>,
    pub estimate: SnapshotEstimate,
}

/// One device against the card.
#[derive(Debug, Serialize)]
pub struct DeviceJudgement {
    pub device: usize,
    pub peak_bytes: u64,
    pub fits: bool,
    pub cause: &'static str,
    /// Memory that existed before the trace (model states, typically) plus the model states the
    /// trace's frames name.
    pub states_bytes: u64,
}

/// The card's memory: `--memory`, else what the recorded OOM shows (reserved + free).
pub fn card_memory(
    e: &SnapshotEstimate,
    given: Option<u64>,
) -> Result<(u64, String), SnapshotError> {
    if let Some(m) = given {
        return Ok((m, "--memory".into()));
    }
    match &e.oom {
        Some(o) => match o.usable_bytes {
            Some(u) => Ok((
                u,
                format!(
                    "the OOM recorded on cuda:{}: {} reserved + {} free",
                    o.device,
                    fmt_bytes(o.reserved_bytes),
                    fmt_bytes(o.device_free_bytes.unwrap_or(0))
                ),
            )),
            None => Err(SnapshotError::Device(
                "the recorded OOM has no free bytes: pass --memory SIZE (the card's memory)".into(),
            )),
        },
        None => Err(no_oom()),
    }
}

/// The card's memory is unknown: no `--memory` and no recorded OOM.
fn no_oom() -> SnapshotError {
    SnapshotError::Device(
        "the snapshot records no OOM, so not the card's memory: pass --memory SIZE".into(),
    )
}

/// Diagnose a source against `memory` (None: the card recorded at the OOM).
pub fn diagnose(
    src: &Source,
    select: DeviceSelect,
    memory: Option<u64>,
) -> Result<SnapshotDiagnosis, SnapshotError> {
    diagnose_of(src, &load_file(&src.files[0])?, select, memory)
}

/// [`diagnose`] of the first file, already read.
pub fn diagnose_of(
    src: &Source,
    loaded: &Loaded,
    select: DeviceSelect,
    memory: Option<u64>,
) -> Result<SnapshotDiagnosis, SnapshotError> {
    if memory.is_none() && trace::oom_device(&loaded.snapshot).is_none() {
        // Known before any replay: no OOM anywhere in the file, so no card to judge against.
        return Err(no_oom());
    }
    let e = estimate_of(src, loaded, select, memory)?;
    let (memory, memory_from) = card_memory(&e, memory)?;
    let e = SnapshotEstimate {
        memory_bytes: Some(memory),
        fits: Some(e.devices[0].peak_bytes <= memory),
        predicted_max_batch: match (&e.scale, e.predicted_max_batch) {
            (Some(_), None) => src.model()?.predict_max(memory, replay::MAX_BATCH),
            (_, p) => p,
        },
        ..e
    };
    let judged: Vec<DeviceJudgement> = e
        .devices
        .iter()
        .map(|d| {
            let b = &d.breakdown;
            // Unknown memory from before the trace counts as params in the breakdown.
            let states = b.model_states();
            DeviceJudgement {
                device: d.device,
                peak_bytes: d.peak_bytes,
                fits: d.peak_bytes <= memory,
                cause: if d.peak_bytes <= memory {
                    "fits"
                } else if states > memory {
                    "model_too_large"
                } else {
                    "batch_too_large"
                },
                states_bytes: states,
            }
        })
        .collect();
    let main = &e.devices[0];
    let trace = trace_of_device(&loaded.snapshot, src.granularity, main.device)?;
    let plan = trace.to_plan("snapshot", 0);
    let mut by_frame: std::collections::BTreeMap<String, u64> = Default::default();
    for t in plan.live_after(main.peak_event + 1) {
        *by_frame.entry(plan.tensors[t].name.clone()).or_default() += plan.tensors[t].bytes;
    }
    let mut top: Vec<(String, u64)> = by_frame.into_iter().collect();
    top.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    top.truncate(10);
    Ok(SnapshotDiagnosis {
        schema_version: crate::report::SCHEMA_VERSION,
        cause: judged[0].cause,
        memory_bytes: memory,
        memory_from,
        judged,
        live_at_peak_by_frame: top,
        estimate: e,
    })
}

/// The report of one file (for callers that need no verdict).
pub fn report_of(src: &Source, select: DeviceSelect) -> Result<SnapshotReport, SnapshotError> {
    report_file(&src.files[0], src.granularity, select)
}
