//! `--snapshot FILE` on `probe`, `estimate` and `diagnose`, and `estimate --export-snapshot`:
//! thin adapters over `crate::snapshot` (argument checks, printing).

use std::path::Path;

use serde::Serialize;

use crate::cli::{ProbeArgs, SnapshotArgs};
use crate::error::{CliError, CliResult};
use crate::plan::{Plan, Role};
use crate::probe::capacity;
use crate::probe::child::{ChildRunner, ProbeTimeout};
use crate::snapshot::replay::{self, Replayer};
use crate::snapshot::{load, Granularity, SnapshotError, Source, Trace};
use crate::units::fmt_bytes;

use super::estimate::out;

/// True when the command was given `--snapshot`.
pub fn wanted(args: &SnapshotArgs) -> bool {
    !args.snapshot.is_empty()
}

fn bad(path: &Path, e: SnapshotError) -> CliError {
    match e {
        SnapshotError::Scale(m) => CliError::usage(m),
        e => CliError::usage(format!("{}: {e}", path.display())),
    }
}

/// The checked source: files readable as snapshots, one batch per file when scaling.
pub fn source(args: &SnapshotArgs) -> CliResult<Source> {
    let batches: Vec<u64> = match args.batch_of.as_deref() {
        Some(s) => s
            .split(',')
            .map(|v| {
                crate::units::parse_count(v.trim())
                    .map_err(|e| CliError::usage(format!("--batch-of: {e}")))
            })
            .collect::<CliResult<_>>()?,
        None => Vec::new(),
    };
    let n = args.snapshot.len();
    if n > 3 {
        return Err(CliError::usage(
            "--snapshot: at most three files (two to scale, a third to check)",
        ));
    }
    if n >= 2 && batches.len() != n {
        return Err(CliError::usage(format!(
            "--batch-of: {n} snapshots need {n} batch sizes (e.g. --batch-of 1,2)"
        )));
    }
    if n == 1 && batches.len() > 1 {
        return Err(CliError::usage(
            "--batch-of: one snapshot takes one batch size",
        ));
    }
    let granularity = args.granularity.unwrap_or_default();
    if n >= 2 && granularity == Granularity::Segments && args.granularity.is_some() {
        return Err(CliError::usage(
            "--granularity segments: scaling works on tensor blocks (segments are the allocator's response and change in number with the batch)",
        ));
    }
    for f in &args.snapshot {
        crate::snapshot::read::read_file(f).map_err(|e| bad(f, e))?;
    }
    Ok(Source {
        files: args.snapshot.clone(),
        batches,
        granularity: if n >= 2 {
            Granularity::Blocks
        } else {
            granularity
        },
    })
}

/// The third file and its batch, if given.
fn third(src: &Source) -> Option<(&Path, u64)> {
    Some((src.files.get(2)?.as_path(), *src.batches.get(2)?))
}

/// `probe --snapshot`.
pub fn probe(args: &ProbeArgs, budget: Option<u64>, timeout: ProbeTimeout) -> CliResult<()> {
    let w = &args.workload;
    if w.model.is_some() || w.config.is_some() || w.params.is_some() || !args.scenario.is_empty() {
        return Err(CliError::usage(
            "--snapshot replaces the workload and the scenarios: drop --model, --config, --params and --scenario",
        ));
    }
    if args.at.is_some() || args.out.is_some() {
        return Err(CliError::usage(
            "--at and --out do not apply to --snapshot (the trace's own batch is replayed; use --json)",
        ));
    }
    let src = source(&args.snapshot)?;
    let (choice, info) =
        crate::probe::session::select_device(&args.device.backend, args.device.device.as_deref())?;
    let cap = capacity::decide(&info, budget);
    if !args.quiet {
        for n in &cap.notes {
            eprintln!("oomprobe: {n}");
        }
    }
    let runner = if args.no_isolate {
        eprintln!(
            "oomprobe: warning: {}",
            crate::probe::session::NO_ISOLATE_WARNING
        );
        None
    } else {
        Some(ChildRunner::current(timeout).map_err(|e| {
            CliError::run(format!(
                "cannot find this executable to isolate probes: {e}"
            ))
        })?)
    };
    let r = Replayer {
        device: choice,
        budget: cap.budget,
        runner,
    };
    let capacity = cap
        .budget
        .or(cap.predict_against)
        .or(info.memory_free_bytes);
    if src.scales() {
        let quiet = args.quiet;
        let mut on_probe = |p: &crate::report::ProbeRecord| {
            if !quiet {
                eprintln!(
                    "oomprobe: batch {}: {} ({}, {:.1} s)",
                    p.value,
                    p.outcome.name(),
                    fmt_bytes(p.bytes),
                    p.seconds
                );
            }
        };
        let run = replay::search_max(&r, &src, capacity, third(&src), &mut on_probe)
            .map_err(|e| bad(&src.files[0], e))?;
        if args.json {
            return json(&wrapped(&info, cap.budget, &run));
        }
        out(&render_scaled(&run))
    } else {
        let rep = replay::replay_one(&r, &src).map_err(|e| bad(&src.files[0], e))?;
        if rep.probe.outcome == crate::report::Outcome::Error {
            return Err(CliError::run(format!(
                "the replay failed with an error, not an OOM: {}",
                rep.probe.detail.clone().unwrap_or_default()
            )));
        }
        if args.json {
            return json(&wrapped(&info, cap.budget, &rep));
        }
        out(&render_replay(&rep, cap.budget))
    }
}

/// `probe --snapshot --json`: the device and budget beside the snapshot's result.
#[derive(Serialize)]
struct Wrapped<'a, T: Serialize> {
    schema_version: u32,
    tool: crate::report::ToolInfo,
    device: &'a crate::backend::DeviceInfo,
    budget_bytes: Option<u64>,
    snapshot: &'a T,
}

fn wrapped<'a, T: Serialize>(
    device: &'a crate::backend::DeviceInfo,
    budget_bytes: Option<u64>,
    snapshot: &'a T,
) -> Wrapped<'a, T> {
    Wrapped {
        schema_version: crate::report::SCHEMA_VERSION,
        tool: crate::report::ToolInfo::default(),
        device,
        budget_bytes,
        snapshot,
    }
}

fn json<T: Serialize>(v: &T) -> CliResult<()> {
    let s = serde_json::to_string_pretty(v).map_err(|e| CliError::run(e.to_string()))?;
    out(&format!("{s}\n"))
}

fn render_replay(r: &replay::ReplayReport, budget: Option<u64>) -> String {
    let p = &r.probe;
    let mut s = format!(
        "snapshot {} ({} granularity): {} allocations, {} events\ntrace peak     {} ({} B)\n",
        r.file,
        r.granularity.name(),
        r.allocations,
        r.events,
        fmt_bytes(r.trace_peak_bytes),
        r.trace_peak_bytes
    );
    if let Some(o) = &r.recorded_oom {
        s.push_str(&format!(
            "recorded OOM   {} requested at {}{}\n",
            fmt_bytes(o.requested_bytes),
            o.frame,
            o.device_free_bytes
                .map(|f| format!(" ({} free on the device)", fmt_bytes(f)))
                .unwrap_or_default()
        ));
    }
    if let Some(b) = budget {
        s.push_str(&format!("budget         {}\n", fmt_bytes(b)));
    }
    if r.fits {
        s.push_str(&format!(
            "replay         fits: peak held {} ({} B), every byte written and verified, {:.2} s\n",
            fmt_bytes(p.bytes_allocated),
            p.bytes_allocated,
            p.seconds
        ));
    } else {
        let at = p
            .failed_at
            .map(|f| {
                format!(
                    " at event {} ({}, {} live, {} requested)",
                    f.event,
                    f.phase.name(),
                    fmt_bytes(f.live_bytes),
                    fmt_bytes(f.requested_bytes)
                )
            })
            .unwrap_or_default();
        s.push_str(&format!(
            "replay         does not fit: {}{at}\n               frame: {}\n",
            p.outcome.name(),
            r.failed_frame.as_deref().unwrap_or("-")
        ));
    }
    for n in &r.notes {
        s.push_str(&format!("note: {n}\n"));
    }
    s
}

fn render_summary(sm: &replay::ScaleSummary) -> String {
    let mut s = format!(
        "scaling from batch {} and {} (assumption: {})\n  {} allocations: {} scaling, {} fixed ({} matched, {} only at batch {})\n  at batch {}'s peak: fixed {}, scaling {}\n",
        sm.batches.0,
        sm.batches.1,
        sm.assumption,
        sm.allocations,
        sm.scaling,
        sm.fixed,
        sm.matched,
        sm.unmatched_fixed,
        sm.batches.1,
        sm.batches.1,
        fmt_bytes(sm.peak_fixed_bytes),
        fmt_bytes(sm.peak_scaling_bytes)
    );
    if let Some(c) = &sm.check {
        s.push_str(&format!(
            "  check at batch {} ({}): predicted peak {} B, the trace's own {} B ({:+.2} %)\n",
            c.batch,
            c.file,
            c.predicted_peak_bytes,
            c.trace_peak_bytes,
            c.error * 100.0
        ));
    }
    s
}

fn render_scaled(r: &replay::ScaledRun) -> String {
    let mut s = render_summary(&r.summary);
    let opt = |v: Option<u64>| v.map_or("-".to_string(), |x| x.to_string());
    s.push_str(&format!(
        "capacity {}: predicted max batch {}, probed max batch {} (first fail {}{}), {} probes, {:.1} s\n",
        r.capacity_bytes.map_or("unknown".into(), fmt_bytes),
        opt(r.predicted_max),
        opt(r.max_fit),
        opt(r.first_fail),
        r.fail_reason
            .map(|o| format!(": {}", o.name()))
            .unwrap_or_default(),
        r.probes.len(),
        r.seconds
    ));
    for n in &r.notes {
        s.push_str(&format!("note: {n}\n"));
    }
    s
}

/// What `estimate --snapshot` reports.
#[derive(Debug, Serialize)]
pub struct SnapshotEstimate {
    pub schema_version: u32,
    pub file: String,
    pub granularity: Granularity,
    pub breakdown: crate::estimate::Breakdown,
    pub timeline: crate::estimate::TimelineSummary,
    pub memory_bytes: Option<u64>,
    /// Whether the trace's peak fits in `memory_bytes`.
    pub fits: Option<bool>,
    /// With two snapshots: the scaling model and the predicted max batch.
    pub scale: Option<replay::ScaleSummary>,
    pub predicted_max_batch: Option<u64>,
    pub notes: Vec<String>,
}

/// The plan and trace of the first snapshot (scaled sources: at the larger batch).
fn first_plan(src: &Source) -> CliResult<(Trace, Plan)> {
    let f = &src.files[0];
    let label = f
        .file_name()
        .map_or("snapshot".into(), |n| n.to_string_lossy().into_owned());
    let trace = load(f, src.granularity).map_err(|e| bad(f, e))?;
    let plan = trace.to_plan(&label, src.batches.first().copied().unwrap_or(0));
    Ok((trace, plan))
}

fn estimate_of(src: &Source, memory: Option<u64>) -> CliResult<SnapshotEstimate> {
    let (trace, plan) = first_plan(src)?;
    let (scale, predicted) = if src.scales() {
        let model = src.model().map_err(|e| bad(&src.files[0], e))?;
        let sm = replay::summarize(&model, third(src)).map_err(|e| bad(&src.files[0], e))?;
        let p = memory.and_then(|m| model.predict_max(m, replay::MAX_BATCH));
        (Some(sm), p)
    } else {
        (None, None)
    };
    let peak = trace.peak();
    Ok(SnapshotEstimate {
        schema_version: crate::report::SCHEMA_VERSION,
        file: src.files[0].display().to_string(),
        granularity: src.granularity,
        breakdown: crate::estimate::breakdown(&plan),
        timeline: crate::estimate::timeline_summary(&plan),
        memory_bytes: memory,
        fits: memory.map(|m| peak <= m),
        scale,
        predicted_max_batch: predicted,
        notes: plan.notes.clone(),
    })
}

/// `estimate --snapshot`.
pub fn estimate(
    args: &SnapshotArgs,
    memory: Option<u64>,
    as_json: bool,
    export_to: Option<&Path>,
) -> CliResult<()> {
    let src = source(args)?;
    let e = estimate_of(&src, memory)?;
    if let Some(path) = export_to {
        export(&first_plan(&src)?.1, path)?;
    }
    if as_json {
        return json(&e);
    }
    let tl = &e.timeline;
    let mut s = format!(
        "snapshot {} ({} granularity): peak {} ({} B) in {} (event {} of {}, allocating {})\nby role at the peak (setup = allocated before the trace):\n{}\n",
        e.file,
        e.granularity.name(),
        fmt_bytes(e.breakdown.total),
        e.breakdown.total,
        tl.peak_phase.map_or("-", |p| p.name()),
        tl.peak_event,
        tl.events,
        tl.peak_tensor.as_deref().unwrap_or("-"),
        crate::estimate::breakdown_table(&e.breakdown, tl.model_states_bytes)
    );
    if let (Some(m), Some(f)) = (e.memory_bytes, e.fits) {
        s.push_str(&format!(
            "on {}: {}\n",
            fmt_bytes(m),
            if f { "fits" } else { "does not fit" }
        ));
    }
    if let Some(sm) = &e.scale {
        s.push_str(&render_summary(sm));
        if let Some(m) = e.memory_bytes {
            s.push_str(&format!(
                "predicted max batch on {}: {}\n",
                fmt_bytes(m),
                e.predicted_max_batch
                    .map_or("none".into(), |x| x.to_string())
            ));
        }
    }
    for n in &e.notes {
        s.push_str(&format!("note: {n}\n"));
    }
    out(&s)
}

/// `diagnose --snapshot`: does the trace fit, and what is live at its peak, by stack frame.
pub fn diagnose(args: &SnapshotArgs, memory: u64, as_json: bool) -> CliResult<()> {
    let src = source(args)?;
    let e = estimate_of(&src, Some(memory))?;
    let (_, plan) = first_plan(&src)?;
    let peak = plan.peak();
    let mut by_frame: std::collections::BTreeMap<String, u64> = Default::default();
    for t in plan.live_after(peak.event + 1) {
        *by_frame.entry(plan.tensors[t].name.clone()).or_default() += plan.tensors[t].bytes;
    }
    let mut top: Vec<(String, u64)> = by_frame.into_iter().collect();
    top.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    top.truncate(10);
    let states = peak.by_role.get(Role::Params) + peak.by_role.get(Role::Optimizer);
    let cause = if peak.bytes <= memory {
        "fits"
    } else if states > memory {
        "model_too_large"
    } else {
        "batch_too_large"
    };
    #[derive(Serialize)]
    struct Diag<'a> {
        schema_version: u32,
        cause: &'a str,
        estimate: &'a SnapshotEstimate,
        live_at_peak_by_frame: Vec<(String, u64)>,
    }
    let d = Diag {
        schema_version: crate::report::SCHEMA_VERSION,
        cause,
        estimate: &e,
        live_at_peak_by_frame: top.clone(),
    };
    if as_json {
        return json(&d);
    }
    let mut s = format!(
        "cause: {cause} — the trace's peak is {} on {} (states allocated before the trace: {})\nlive at the peak, by stack frame:\n",
        fmt_bytes(peak.bytes),
        fmt_bytes(memory),
        fmt_bytes(states)
    );
    for (f, b) in &top {
        s.push_str(&format!("  {:>12}  {f}\n", fmt_bytes(*b)));
    }
    if let Some(x) = e.predicted_max_batch {
        s.push_str(&format!(
            "max batch on {} (scaled): {x}\n",
            fmt_bytes(memory)
        ));
    }
    out(&s)
}

/// `estimate --export-snapshot FILE`: the plan's timeline as a snapshot pickle.
pub fn export(plan: &Plan, path: &Path) -> CliResult<()> {
    crate::snapshot::write::write_file(&Trace::from_plan(plan), path)
        .map_err(|e| CliError::run(format!("--export-snapshot: {e}")))
}
