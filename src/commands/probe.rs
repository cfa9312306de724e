//! `oomprobe probe`: search each scenario's empirical OOM boundary on a device and report it
//! beside the prediction; results are written to `--out` as they arrive.

use std::path::PathBuf;
use std::time::Duration;

use crate::backend::{nvidia, DeviceInfo, DeviceType};
use crate::cli::{ComputeMode, OutputFormat, ProbeArgs};
use crate::error::{CliError, CliResult};
use crate::probe::capacity;
use crate::probe::child::{ChildRunner, ProbeTimeout};
use crate::probe::runner::{Isolation, ProbeEvent, RunContext, SearchMode};
use crate::probe::suite::{self, RunSpec};
use crate::probe::{Compute, DeviceChoice};
use crate::report::{self, Outcome, ProbeRecord, ProbeReport, RunResult, ToolInfo, SCHEMA_VERSION};
use crate::term::{color_enabled, Progress, Stream};
use crate::units;

pub fn run(args: &ProbeArgs) -> CliResult<()> {
    let budget = args
        .budget
        .as_deref()
        .map(|s| units::parse_size(s).map_err(|e| CliError::usage(format!("--budget: {e}"))))
        .transpose()?;
    let at = args
        .at
        .as_deref()
        .map(|s| units::parse_count(s).map_err(|e| CliError::usage(format!("--at: {e}"))))
        .transpose()?;
    let timeout = match args.timeout.as_deref() {
        Some(t) => ProbeTimeout::Fixed(parse_timeout(t)?),
        None => ProbeTimeout::auto(),
    };
    let out_format = match &args.out {
        Some(path) => Some(
            report::out_format(path, args.format).map_err(|e| CliError::usage(e.to_string()))?,
        ),
        None => None,
    };
    let stdout_format = if args.json {
        OutputFormat::Json
    } else {
        args.format.unwrap_or(OutputFormat::Table)
    };

    if crate::commands::fleet::wants_all(args.device.device.as_deref()) {
        return crate::commands::fleet::run(args);
    }
    // The workload: the user's (a preset, a config or a case file) or the default suite.
    if let Some(path) = &args.workload.config {
        if crate::commands::replay::is_case_file(path) {
            return crate::commands::replay::run(args, budget, timeout);
        }
    }
    let user = user_workload(args)?;

    let (choice, info) = select_device(&args.device.backend, args.device.device.as_deref())?;
    let open = || crate::backend::open::open_device(&choice.backend, choice.index);
    let mut cap = capacity::decide(&info, budget);
    if cap.budget.is_none() {
        // Under an address-space limit the device's own mappings count: measure them once.
        if let Some(usable) = capacity::usable_under_address_space_limit(open) {
            cap.predict_against = Some(usable);
        }
    }
    let compute = match args.compute {
        Some(ComputeMode::Full) => Compute::Full,
        Some(ComputeMode::Touch) => Compute::Touch,
        None if info.device_type == DeviceType::Cpu => Compute::Touch,
        None => Compute::Full,
    };
    let mut notes: Vec<String> =
        crate::backend::open::faster_driver_hint(&info, &args.device.backend)
            .into_iter()
            .map(String::from)
            .collect();
    if budget.is_none() && info.device_type == DeviceType::Cpu && compute == Compute::Touch {
        // A first run that finishes: size the default cap by the measured fill rate.
        let probes_per_run = if at.is_some() {
            1
        } else {
            capacity::PROBES_PER_RUN
        };
        let runs = suite::plan_runs(&args.scenario, user.as_ref(), cap.predict_against).len();
        if let Some(rate) = capacity::measure_fill_rate(open) {
            let runs = (runs * probes_per_run).div_ceil(capacity::PROBES_PER_RUN);
            capacity::size_for_time(&mut cap, &rate, runs, capacity::CPU_TARGET_SECONDS);
        }
    }
    notes.extend(cap.notes.iter().cloned());
    let isolation = if args.no_isolate {
        eprintln!("oomprobe: warning: {NO_ISOLATE_WARNING}");
        Isolation::InProcess
    } else {
        Isolation::Child(ChildRunner::current(timeout).map_err(|e| {
            CliError::run(format!(
                "cannot find this executable to isolate probes: {e}"
            ))
        })?)
    };
    let ctx = RunContext {
        device: choice,
        info: info.clone(),
        capacity: cap.clone(),
        compute,
        isolation,
        search: match args.search {
            crate::cli::SearchArg::Measure => SearchMode::Measure,
            crate::cli::SearchArg::Gallop => SearchMode::Gallop,
        },
    };
    let mut runs = suite::plan_runs(&args.scenario, user.as_ref(), cap.predict_against);
    // A CPU adapter standing in for a GPU whose Vulkan driver is missing says so.
    if let Some(note) =
        nvidia::probe_note(&info, crate::backend::open::list_devices, nvidia::detect)
    {
        cap.notes.push(note.clone());
        notes.push(note.clone());
        for r in &mut runs {
            r.notes.push(note.clone());
        }
    }
    if runs.is_empty() {
        return Err(CliError::usage("no scenario applies to this workload"));
    }
    if let Some(x) = at {
        for spec in &runs {
            check_at(spec, x)?;
        }
    }

    let mut progress = Progress::new(args.quiet, &device_label(&info), runs.len());
    if !args.quiet {
        for n in &notes {
            progress.println(&format!("oomprobe: {n}"));
        }
    }
    let mut report = ProbeReport {
        schema_version: SCHEMA_VERSION,
        tool: ToolInfo::default(),
        device: info,
        budget_bytes: cap.budget,
        compute: Some(compute.name().to_string()),
        runs: Vec::new(),
        in_progress: true,
    };
    let out = OutSink {
        path: args.out.clone(),
        format: out_format,
    };

    for spec in &runs {
        // Until the run ends, `--out` holds it as a run in progress (even before its first
        // probe), so a file of a stopped probe always says it is partial.
        let mut snapshot = report.clone();
        snapshot.runs.push(partial_run(spec, &[]));
        out.write(&snapshot)?;
        progress.start_run(&spec_label(spec), spec.scenario.dimension());
        let result = match at {
            Some(x) => {
                progress.probe_started(x);
                let result = ctx.single(spec, x);
                for p in &result.probes {
                    progress.probe_finished(p);
                }
                result
            }
            None => {
                let mut partial: Vec<ProbeRecord> = Vec::new();
                let mut on_event = |event: ProbeEvent<'_>| match event {
                    ProbeEvent::Started(x) => progress.probe_started(x),
                    ProbeEvent::Finished(rec) => {
                        progress.probe_finished(rec);
                        partial.push(rec.clone());
                        // Keep what was measured even if the run is killed half way.
                        let mut snapshot = report.clone();
                        snapshot.runs.push(partial_run(spec, &partial));
                        let _ = out.write(&snapshot);
                    }
                };
                ctx.search(spec, &mut on_event)
            }
        };
        report.runs.push(result);
    }
    report.in_progress = false;
    out.write(&report)?;
    progress.finish();

    let text = match stdout_format {
        OutputFormat::Table => report::table::render_styled(&report, color_enabled(Stream::Stdout)),
        f => report::render(&report, f).map_err(|e| CliError::run(e.to_string()))?,
    };
    print!("{text}");
    if !text.ends_with('\n') {
        println!();
    }
    if let Some(err) = report
        .runs
        .iter()
        .find(|r| r.fail_reason == Some(Outcome::Error))
    {
        let detail = err
            .probes
            .iter()
            .rev()
            .find(|p| p.outcome == Outcome::Error)
            .and_then(|p| p.detail.clone())
            .unwrap_or_default();
        return Err(CliError::run(format!(
            "{} run ended on a probe error, not an OOM: {detail}",
            err.scenario.name()
        )));
    }
    Ok(())
}

/// Where `--out` results go, rewritten after every probe.
struct OutSink {
    path: Option<PathBuf>,
    format: Option<OutputFormat>,
}

impl OutSink {
    fn write(&self, report: &ProbeReport) -> CliResult<()> {
        let (Some(path), Some(format)) = (&self.path, self.format) else {
            return Ok(());
        };
        if report::is_stdout(path) {
            return Ok(()); // `-`: printed once at the end
        }
        let text = report::render(report, format).map_err(|e| CliError::run(e.to_string()))?;
        report::write_atomically(path, &text)
            .map_err(|e| CliError::run(format!("cannot write {}: {e}", path.display())))
    }
}

/// A run in progress, for the `--out` snapshot.
fn partial_run(spec: &RunSpec, probes: &[ProbeRecord]) -> RunResult {
    let max_fit = probes
        .iter()
        .filter(|p| p.outcome.is_fit())
        .map(|p| p.value)
        .max();
    RunResult {
        scenario: spec.scenario,
        dimension: spec.scenario.dimension().to_string(),
        variant: spec.variant.clone(),
        workload: spec.workload.clone(),
        max_fit,
        first_fail: None,
        fail_reason: None,
        bytes_at_max_fit: None,
        predicted_max: None,
        capacity_bytes: None,
        fill_ratio: None,
        activation_share: None,
        at: None,
        flaky: false,
        measured_capacity_bytes: None,
        measured_capacity_below: None,
        device_overhead_bytes: None,
        notes: vec![report::IN_PROGRESS_NOTE.into()],
        probes: probes.to_vec(),
        seconds: probes.iter().map(|p| p.seconds).sum(),
        in_progress: true,
    }
}

/// The device as the progress bar names it: `llvmpipe (LLVM 15.0.6, 256 bits) (vulkan)`.
fn device_label(info: &DeviceInfo) -> String {
    format!("{} ({})", info.name, info.backend.as_str())
}

/// A run as the progress bar names it: `seq (naive)`.
fn spec_label(spec: &RunSpec) -> String {
    match spec.variant.as_deref() {
        Some(v) if !v.is_empty() => format!("{} ({v})", spec.scenario.name()),
        _ => spec.scenario.name().to_string(),
    }
}

/// What `--no-isolate` gives up, said plainly.
pub const NO_ISOLATE_WARNING: &str = "--no-isolate runs every probe inside this process: a \
driver crash, a panic or the OOM killer at the edge of memory ends the whole run (and its \
output) instead of one probe";

/// `--at X` must be a value the scenario can take and its plan must be computable.
fn check_at(spec: &RunSpec, x: u64) -> CliResult<()> {
    let space = crate::probe::runner::search_space(spec.scenario);
    let dim = spec.scenario.dimension();
    if x > space.max {
        return Err(CliError::usage(format!(
            "--at: {x} is beyond the largest {dim} the {} scenario probes ({})",
            spec.scenario.name(),
            space.max
        )));
    }
    crate::plan::Plan::for_value(&spec.workload, spec.scenario, x)
        .map(|_| ())
        .map_err(|e| CliError::usage(format!("--at: {dim}={x}: {e}")))
}

fn parse_timeout(s: &str) -> CliResult<Duration> {
    let secs: f64 = s
        .trim()
        .parse()
        .map_err(|_| CliError::usage(format!("--timeout: '{s}' is not a number of seconds")))?;
    if !(secs.is_finite() && secs > 0.0 && secs <= 86_400.0) {
        return Err(CliError::usage(format!(
            "--timeout: {s} s is out of range (0, 86400]"
        )));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// The user's workload when --model or --config was given; None for the default suite.
/// Overrides without a model apply to the default suite's workloads.
fn user_workload(args: &ProbeArgs) -> CliResult<Option<crate::workload::Workload>> {
    if args.workload.model.is_none()
        && args.workload.config.is_none()
        && args.workload.params.is_none()
    {
        if has_overrides(&args.workload) {
            return Err(CliError::usage(
                "workload overrides need a workload: pass --model NAME or --config FILE \
                 (the default suite uses its own workloads)",
            ));
        }
        return Ok(None);
    }
    let resolved = crate::workload::overrides::resolve(&args.workload, "gpt2")?;
    for w in &resolved.warnings {
        eprintln!("oomprobe: warning: {w}");
    }
    Ok(Some(resolved.workload))
}

fn has_overrides(w: &crate::cli::WorkloadArgs) -> bool {
    [
        &w.batch,
        &w.seq,
        &w.layers,
        &w.hidden,
        &w.heads,
        &w.ffn,
        &w.vocab,
        &w.image,
        &w.precision,
        &w.optimizer,
        &w.attention,
        &w.checkpoint,
        &w.dropout,
        &w.zero,
        &w.gpus,
    ]
    .iter()
    .any(|o| o.is_some())
}

/// Resolve --backend/--device to a device without opening it (probes open it themselves).
pub fn select_device(backend: &str, device: Option<&str>) -> CliResult<(DeviceChoice, DeviceInfo)> {
    let index = device
        .map(|d| {
            d.trim()
                .parse::<usize>()
                .map_err(|_| CliError::usage(format!("--device: '{d}' is not a device index")))
        })
        .transpose()?;
    let info = crate::backend::open::device_info(backend, index)?;
    // The backend resolved (`auto` becomes e.g. `vulkan`): probe children open only it.
    Ok((
        DeviceChoice {
            backend: info.backend.as_str().to_string(),
            index: Some(info.index),
        },
        info,
    ))
}
