//! `probe --config CASE.toml`: replay an OOM case file on this device, with the case's card
//! memory as the budget, and say whether each expected verdict reproduced.

use std::path::Path;

use serde::Serialize;

use crate::backend::DeviceInfo;
use crate::cli::ProbeArgs;
use crate::error::{CliError, CliResult};
use crate::plan::Plan;
use crate::probe::capacity::{self, Capacity};
use crate::probe::child::{ChildRunner, ProbeTimeout};
use crate::probe::runner::{Isolation, RunContext, SearchMode};
use crate::probe::suite::RunSpec;
use crate::probe::Compute;
use crate::report::{ProbeRecord, SCHEMA_VERSION};
use crate::scenario::Scenario;
use crate::units::fmt_bytes;
use crate::workload::config::{load_config, CaseFile, LoadedConfig, Verdict};
use crate::workload::Arch;

/// True when `--config` names an oomprobe case file (TOML) rather than a config.json.
pub fn is_case_file(path: &Path) -> bool {
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("toml"))
}

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

pub fn run(args: &ProbeArgs, budget: Option<u64>, timeout: ProbeTimeout) -> CliResult<()> {
    let Some(path) = &args.workload.config else {
        return Err(CliError::usage("case replay needs --config CASE.toml"));
    };
    let case = match load_config(path).map_err(|e| CliError::usage(e.to_string()))? {
        LoadedConfig::Case(c) => c,
        LoadedConfig::Hf(_) => {
            return Err(CliError::usage(format!(
                "{} is not an oomprobe case file",
                path.display()
            )))
        }
    };
    let memory = case.memory.ok_or_else(|| {
        CliError::usage(format!(
            "case {}: `memory` (the card's memory) is required to replay it",
            path.display()
        ))
    })?;
    if budget.is_some_and(|b| b != memory) {
        return Err(CliError::usage(format!(
            "case {} sets the card's memory ({}); --budget cannot change it",
            path.display(),
            fmt_bytes(memory)
        )));
    }
    let (choice, info) =
        super::probe::select_device(&args.device.backend, args.device.device.as_deref())?;
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
    let compute = if info.device_type == crate::backend::DeviceType::Cpu {
        Compute::Touch
    } else {
        Compute::Full
    };
    let isolation = if args.no_isolate {
        eprintln!(
            "oomprobe: warning: {}",
            crate::commands::probe::NO_ISOLATE_WARNING
        );
        Isolation::InProcess
    } else {
        Isolation::Child(ChildRunner::current(timeout).map_err(|e| CliError::run(e.to_string()))?)
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
        isolation,
        search: match args.search {
            crate::cli::SearchArg::Measure => SearchMode::Measure,
            crate::cli::SearchArg::Gallop => SearchMode::Gallop,
        },
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
            .push(replay_one(&ctx, &case, i, not_replayable.is_none())?);
    }
    if args.json {
        let text =
            serde_json::to_string_pretty(&report).map_err(|e| CliError::run(e.to_string()))?;
        println!("{text}");
    } else {
        print!("{}", render(&report));
    }
    Ok(())
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
