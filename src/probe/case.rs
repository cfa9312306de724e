//! Replay an OOM case file on this device: each expectation's workload probed once with the
//! case's card memory as the budget, beside the plan's verdict and the expected one.

use crate::backend::DeviceType;
use crate::error::{CliError, CliResult};
use crate::plan::Plan;
use crate::report::SCHEMA_VERSION;
use crate::scenario::Scenario;
use crate::units::fmt_bytes;
use crate::workload::case::{CaseFile, Verdict};
use crate::workload::Arch;

use super::capacity::{self, Capacity};
use super::child::ProbeTimeout;
use super::runner::{RunContext, SearchMode};
use super::session::{isolation, select_device};
use super::suite::RunSpec;
use super::Compute;

pub use crate::report::case_replay::{ReplayReport, ReplayRun};

/// Where and how to replay a case.
#[derive(Debug, Clone)]
pub struct CaseOptions {
    pub backend: String,
    pub device: Option<String>,
    pub allocator: crate::backend::pooled::AllocatorPick,
    pub isolate: bool,
    pub timeout: ProbeTimeout,
}

/// Replay every expectation of `case` (whose card has `memory` bytes) on the chosen device.
/// A device smaller than the case's card is reported as not replayable, not probed.
pub fn replay(case: &CaseFile, memory: u64, opts: &CaseOptions) -> CliResult<ReplayReport> {
    let (choice, info) = select_device(&opts.backend, opts.device.as_deref(), &opts.allocator)?;
    let available = capacity::decide(&info, None);
    let room = available
        .budget
        .or(available.predict_against)
        .or(info.memory_total_bytes);
    let not_replayable = match room {
        Some(r) if r < memory => Some(format!(
            "this device offers {} but the case's card has {}: replay it on a card at least that large",
            fmt_bytes(r),
            fmt_bytes(memory)
        )),
        None => Some("this device does not tell its memory".to_string()),
        _ => None,
    };
    let compute = if info.device_type == DeviceType::Cpu {
        Compute::Touch
    } else {
        Compute::Full
    };
    let ctx = RunContext {
        device: choice,
        info: info.clone(),
        capacity: Capacity {
            budget: Some(memory),
            predict_against: Some(memory),
            free_at_start: info.memory_free_bytes,
            notes: Vec::new(),
        },
        compute,
        isolation: isolation(opts.isolate, opts.timeout.clone())?,
        // One probe per expectation: no search.
        search: SearchMode::default(),
        repeat: 0,
    };
    let mut report = ReplayReport {
        schema_version: SCHEMA_VERSION,
        case: case.name.clone(),
        memory_bytes: memory,
        device: info,
        not_replayable: not_replayable.clone(),
        runs: Vec::new(),
    };
    for i in 0..case.expects.len() {
        report
            .runs
            .push(replay_one(&ctx, case, i, not_replayable.is_none())?);
    }
    Ok(report)
}

fn replay_one(ctx: &RunContext, case: &CaseFile, i: usize, run_it: bool) -> CliResult<ReplayRun> {
    let workload = case.workload_for(i)?;
    let (scenario, value) = if workload.arch == Arch::Dense {
        (
            Scenario::Params,
            crate::plan::build::param_count(&workload)
                .map_err(|e| CliError::usage(e.to_string()))?,
        )
    } else {
        (Scenario::Batch, workload.batch)
    };
    let plan =
        Plan::for_value(&workload, scenario, value).map_err(|e| CliError::usage(e.to_string()))?;
    let plan_bytes = plan.peak_bytes();
    let predicted = if plan_bytes <= case.memory.unwrap_or(0) {
        Verdict::Fits
    } else {
        Verdict::Oom
    };
    let expected = case.expects[i].verdict;
    let (measured, probe) = if run_it {
        let spec = RunSpec {
            scenario,
            variant: None,
            workload: workload.clone(),
            notes: Vec::new(),
        };
        let rec = ctx.probe(&spec, value);
        let v = if rec.outcome.is_fit() {
            Verdict::Fits
        } else {
            Verdict::Oom
        };
        (Some(v), Some(rec))
    } else {
        (None, None)
    };
    Ok(ReplayRun {
        expect_index: i,
        workload,
        expected,
        predicted,
        plan_bytes,
        measured,
        reproduced: measured.map(|m| m == expected),
        probe,
    })
}
