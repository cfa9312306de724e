//! `--snapshot FILE` on `probe`, `estimate` and `diagnose`, and `estimate --export-snapshot`:
//! thin adapters over `crate::snapshot` (argument checks, printing).

use std::path::Path;

use serde::Serialize;

use crate::cli::{ProbeArgs, SnapshotArgs};
use crate::error::{CliError, CliResult};
use crate::plan::Plan;
use crate::probe::capacity;
use crate::probe::child::{ChildRunner, ProbeTimeout};
use crate::snapshot::read::{load_file, Loaded};
use crate::snapshot::replay::{self, Replayer};
use crate::snapshot::report::DeviceSelect;
use crate::snapshot::trace::trace_of_device;
use crate::snapshot::verdict::{self, third};
use crate::snapshot::{describe, Granularity, SnapshotError, Source, Trace};
use crate::units::fmt_bytes;

use crate::term::out;

/// True when the command was given `--snapshot`.
pub fn wanted(args: &SnapshotArgs) -> bool {
    !args.snapshot.is_empty()
}

fn bad(path: &Path, e: SnapshotError) -> CliError {
    match e {
        SnapshotError::Scale(m) | SnapshotError::Device(m) => CliError::usage(m),
        e => CliError::usage(format!("{}: {e}", path.display())),
    }
}

/// The checked source: files readable as snapshots, one batch per file when scaling.
pub fn source(args: &SnapshotArgs) -> CliResult<Source> {
    source_read(args).map(|(src, _)| src)
}

/// [`source`] and its first file as read (the file a verdict reads: read once).
fn source_read(args: &SnapshotArgs) -> CliResult<(Source, Loaded)> {
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
    let mut synthetic = false;
    let mut first = None;
    for f in &args.snapshot {
        let loaded = load_file(f).map_err(|e| bad(f, e))?;
        if let Some(wrong) = loaded.snapshot.inconsistent.first() {
            if !args.lenient {
                return Err(CliError::usage(format!(
                    "{}: a trace that cannot have happened: {wrong} (--lenient replays it anyway)",
                    f.display()
                )));
            }
            crate::error::warn(format!(
                "{}: a trace that cannot have happened, replayed as --lenient asks: {wrong}",
                f.display()
            ));
        }
        synthetic |= crate::snapshot::read::synthetic_segments(&loaded.snapshot).is_some();
        first.get_or_insert(loaded);
    }
    let first = first.ok_or_else(|| CliError::usage("--snapshot: no file given"))?;
    // Made-up segments say nothing of what a device held: read the tensors, unless asked.
    let granularity = match args.granularity {
        None if synthetic => Granularity::Blocks,
        _ => granularity,
    };
    let device = match select(args)? {
        DeviceSelect::One(d) => Some(d),
        DeviceSelect::All => None,
    };
    let src = Source {
        files: args.snapshot.clone(),
        batches,
        granularity: if n >= 2 {
            Granularity::Blocks
        } else {
            granularity
        },
        device,
    };
    Ok((src, first))
}

/// `--snapshot-device N|all` (default all).
fn select(args: &SnapshotArgs) -> CliResult<DeviceSelect> {
    match args.snapshot_device.as_deref() {
        None => Ok(DeviceSelect::All),
        Some(s) => {
            DeviceSelect::parse(s).map_err(|e| CliError::usage(format!("--snapshot-device: {e}")))
        }
    }
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
    let (choice, info) = crate::probe::session::select_device(
        &args.device.backend,
        args.device.device.as_deref(),
        &args.device.allocator(),
    )?;
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
        return out(&describe::scaled(&run));
    }
    // One file: each selected device replayed in turn, the default (the OOM's) first.
    let devices: Vec<usize> = match src.device {
        Some(d) => vec![d],
        None => verdict::report_of(&src, DeviceSelect::All)
            .map_err(|e| bad(&src.files[0], e))?
            .devices
            .iter()
            .map(|d| d.device)
            .collect(),
    };
    let mut reps = Vec::new();
    for d in devices {
        let one = Source {
            device: Some(d),
            ..src.clone()
        };
        let rep = replay::replay_one(&r, &one).map_err(|e| bad(&src.files[0], e))?;
        if rep.probe.outcome == crate::report::Outcome::Error {
            return Err(CliError::run(format!(
                "the replay of cuda:{d} failed with an error, not an OOM: {}",
                rep.probe.detail.clone().unwrap_or_default()
            )));
        }
        if !args.json {
            out(&describe::replay(&rep, cap.budget))?;
        }
        reps.push(rep);
    }
    if args.json {
        // One device: its report as before; several: the list.
        return match reps.as_slice() {
            [one] => json(&wrapped(&info, cap.budget, one)),
            many => json(&wrapped(&info, cap.budget, &many)),
        };
    }
    Ok(())
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

/// `estimate --snapshot`.
pub fn estimate(
    args: &SnapshotArgs,
    memory: Option<u64>,
    as_json: bool,
    export_to: Option<&Path>,
) -> CliResult<()> {
    let (src, loaded) = source_read(args)?;
    let e = verdict::estimate_of(&src, &loaded, select(args)?, memory)
        .map_err(|e| bad(&src.files[0], e))?;
    if let Some(path) = export_to {
        let trace = trace_of_device(&loaded.snapshot, src.granularity, e.device)
            .map_err(|err| bad(&src.files[0], err))?;
        let label = format!("cuda:{}", e.device);
        export(
            &trace.to_plan(&label, src.batches.first().copied().unwrap_or(0)),
            path,
        )?;
    }
    if as_json {
        return json(&e);
    }
    out(&describe::estimate(&e))
}

/// `diagnose --snapshot`: judged against the card recorded at the OOM, or `--memory`.
pub fn diagnose(args: &SnapshotArgs, memory: Option<u64>, as_json: bool) -> CliResult<()> {
    let (src, loaded) = source_read(args)?;
    let d = verdict::diagnose_of(&src, &loaded, select(args)?, memory)
        .map_err(|e| bad(&src.files[0], e))?;
    if as_json {
        return json(&d);
    }
    out(&describe::diagnose(&d))
}

/// The OOMs a snapshot recorded, one per device that has one.
pub fn recorded_ooms(args: &SnapshotArgs) -> CliResult<Vec<crate::snapshot::report::OomReport>> {
    let (src, loaded) = source_read(args)?;
    let e = verdict::estimate_of(&src, &loaded, select(args)?, None)
        .map_err(|e| bad(&src.files[0], e))?;
    let mut v: Vec<_> = e.devices.iter().filter_map(|d| d.oom.clone()).collect();
    if let Some(o) = e.oom {
        if !v.iter().any(|x| x.device == o.device && x.entry == o.entry) {
            v.push(o);
        }
    }
    Ok(v)
}

/// `estimate --export-snapshot FILE`: the plan's timeline as a snapshot pickle.
pub fn export(plan: &Plan, path: &Path) -> CliResult<()> {
    crate::snapshot::write::write_file(&Trace::from_plan(plan), path)
        .map_err(|e| CliError::run(format!("--export-snapshot: {e}")))
}
