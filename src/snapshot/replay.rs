//! Replay snapshots on a device through the same probe path as plans (a child per probe,
//! `exec` writing and verifying every byte): one snapshot as recorded, or a scaled pair searched
//! for its max batch beside the model's prediction.

use serde::Serialize;

use crate::probe::child::{probe_in_process, ChildRequest, ChildRunner};
use crate::probe::{Compute, DeviceChoice};
use crate::report::{Outcome, ProbeRecord};
use crate::search::{self, SearchSpace};

use super::scale::{check_against, Class, ScaleModel};
use super::{load, Granularity, SnapshotError, Source};

/// The largest batch a scaled search probes.
pub const MAX_BATCH: u64 = 1 << 20;

/// How probes run: on which device, under which budget, isolated or not.
#[derive(Debug, Clone)]
pub struct Replayer {
    pub device: DeviceChoice,
    pub budget: Option<u64>,
    /// None: in this process.
    pub runner: Option<ChildRunner>,
}

impl Replayer {
    /// Replay `source` at batch `value` once.
    pub fn probe(&self, source: &Source, value: u64) -> ProbeRecord {
        let mut workload =
            crate::workload::presets::get("tiny-gpt").expect("the tiny-gpt preset exists");
        workload.batch = value;
        let req = ChildRequest {
            workload,
            scenario: crate::scenario::Scenario::Batch,
            value,
            compute: Compute::Touch,
            device: self.device.clone(),
            budget: self.budget,
            snapshot: Some(source.clone()),
            room: None,
        };
        match &self.runner {
            Some(r) => r.run(&req),
            None => probe_in_process(&req),
        }
    }
}

/// One snapshot replayed as recorded.
#[derive(Debug, Clone, Serialize)]
pub struct ReplayReport {
    pub file: String,
    /// The device of the file replayed (cuda:N).
    pub device: usize,
    pub granularity: Granularity,
    pub allocations: usize,
    pub events: usize,
    /// The trace's own peak (live bytes, from the snapshot alone).
    pub trace_peak_bytes: u64,
    /// Whether the trace recorded an OOM, and what it asked for.
    pub recorded_oom: Option<RecordedOom>,
    pub fits: bool,
    /// The probe (its `bytes_allocated` is the peak the device really held).
    pub probe: ProbeRecord,
    /// The stack frame of the allocation that failed, when one did.
    pub failed_frame: Option<String>,
    pub notes: Vec<String>,
}

#[derive(Debug, Clone, Serialize)]
pub struct RecordedOom {
    pub requested_bytes: u64,
    pub device_free_bytes: Option<u64>,
    pub frame: String,
}

/// Replay one snapshot.
pub fn replay_one(r: &Replayer, source: &Source) -> Result<ReplayReport, SnapshotError> {
    let file = &source.files[0];
    let snap = super::read::read_file(file)?;
    let device = source
        .device
        .unwrap_or_else(|| super::trace::default_device(&snap, source.granularity));
    let trace = super::trace::trace_of_device(&snap, source.granularity, device)?;
    let source = &Source {
        device: Some(device),
        ..source.clone()
    };
    let probe = r.probe(source, source.batches.first().copied().unwrap_or(0));
    Ok(ReplayReport {
        file: file.display().to_string(),
        device,
        granularity: source.granularity,
        allocations: trace.allocs.len(),
        events: trace.events.len(),
        trace_peak_bytes: trace.peak(),
        recorded_oom: trace.oom.as_ref().map(|o| RecordedOom {
            requested_bytes: o.requested,
            device_free_bytes: o.device_free,
            frame: o.frame.clone(),
        }),
        fits: probe.outcome.is_fit(),
        failed_frame: probe.failed_tensor.clone(),
        probe,
        notes: trace.notes,
    })
}

/// The scaling model in numbers.
#[derive(Debug, Clone, Serialize)]
pub struct ScaleSummary {
    pub batches: (u64, u64),
    pub assumption: String,
    pub allocations: usize,
    pub matched: usize,
    pub unmatched_fixed: usize,
    pub fixed: usize,
    pub scaling: usize,
    /// At the larger batch's peak: bytes of fixed and of scaling allocations.
    pub peak_fixed_bytes: u64,
    pub peak_scaling_bytes: u64,
    /// A third snapshot, when given: its batch, the predicted peak and its own.
    pub check: Option<ScaleCheck>,
}

#[derive(Debug, Clone, Serialize)]
pub struct ScaleCheck {
    pub file: String,
    pub batch: u64,
    pub predicted_peak_bytes: u64,
    pub trace_peak_bytes: u64,
    /// (predicted - trace) / trace.
    pub error: f64,
}

/// Summarize a model; `third` = (file, batch) checks the linear assumption.
pub fn summarize(
    model: &ScaleModel,
    third: Option<(&std::path::Path, u64)>,
) -> Result<ScaleSummary, SnapshotError> {
    let n = model.template.allocs.len();
    let scaling = (0..n).filter(|&i| model.class(i) == Class::Scaling).count();
    let (pf, ps) = model.split_at_peak();
    let check = match third {
        Some((path, x)) => {
            let t = load(path, Granularity::Blocks)?;
            let (pred, own) = check_against(model, &t, x);
            Some(ScaleCheck {
                file: path.display().to_string(),
                batch: x,
                predicted_peak_bytes: pred,
                trace_peak_bytes: own,
                error: (pred as f64 - own as f64) / own.max(1) as f64,
            })
        }
        None => None,
    };
    Ok(ScaleSummary {
        batches: model.batches,
        assumption: "each allocation's bytes are linear in the batch; the allocation sequence is the larger batch's".into(),
        allocations: n,
        matched: model.matched,
        unmatched_fixed: model.unmatched,
        fixed: n - scaling,
        scaling,
        peak_fixed_bytes: pf,
        peak_scaling_bytes: ps,
        check,
    })
}

/// A scaled search: the predicted max batch and the probed one.
#[derive(Debug, Clone, Serialize)]
pub struct ScaledRun {
    pub summary: ScaleSummary,
    pub capacity_bytes: Option<u64>,
    pub predicted_max: Option<u64>,
    pub max_fit: Option<u64>,
    pub first_fail: Option<u64>,
    pub fail_reason: Option<Outcome>,
    pub probes: Vec<ProbeRecord>,
    pub seconds: f64,
    pub notes: Vec<String>,
}

/// Predict the max batch against `capacity`, then search it with real probes.
pub fn search_max(
    r: &Replayer,
    source: &Source,
    capacity: Option<u64>,
    third: Option<(&std::path::Path, u64)>,
    on_probe: &mut dyn FnMut(&ProbeRecord),
) -> Result<ScaledRun, SnapshotError> {
    let started = std::time::Instant::now();
    let model = source.model()?;
    let summary = summarize(&model, third)?;
    let predicted = capacity.and_then(|c| model.predict_max(c, MAX_BATCH));
    let mut probes = Vec::new();
    let found = search::find_boundary(
        SearchSpace::unit(MAX_BATCH),
        predicted.unwrap_or(model.batches.1),
        |x| {
            let rec = r.probe(source, x);
            on_probe(&rec);
            let o = rec.outcome;
            probes.push(rec);
            o
        },
    );
    let mut notes = model.template.notes.clone();
    if found.flaky {
        notes.push("flaky: a batch fit above one that failed".into());
    }
    Ok(ScaledRun {
        summary,
        capacity_bytes: capacity,
        predicted_max: predicted,
        max_fit: found.max_fit,
        first_fail: found.first_fail,
        fail_reason: found.fail_reason,
        probes,
        seconds: started.elapsed().as_secs_f64(),
        notes,
    })
}
