//! `oomprobe probe`: search each scenario's empirical OOM boundary on a device and report it
//! beside the prediction; results are written to `--out` as they arrive.

use crate::cli::{ComputeMode, OutputFormat, ProbeArgs, SearchArg};
use crate::error::{CliError, CliResult};
use crate::probe::child::ProbeTimeout;
use crate::probe::runner::SearchMode;
use crate::probe::session::{self, Session, SessionOptions, Sink};
use crate::probe::sinks::OutFile;
use crate::probe::Compute;
use crate::report;
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
        Some(t) => ProbeTimeout::Fixed(session::parse_timeout(t)?),
        None => ProbeTimeout::auto(),
    };
    if crate::commands::snapshot::wanted(&args.snapshot) {
        return crate::commands::snapshot::probe(args, budget, timeout);
    }
    let out = match &args.out {
        Some(path) => {
            let format = report::out_format(path, args.format)
                .map_err(|e| CliError::usage(e.to_string()))?;
            OutFile::new(path.clone(), format)
        }
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
    if let Some(path) = &args.workload.config {
        if crate::commands::case::is_case_file(path) {
            return crate::commands::case::run(args, budget, timeout);
        }
    }
    let workload = user_workload(args)?;
    if let Some(w) = workload
        .as_ref()
        .filter(|w| w.mode == crate::workload::Mode::Serve)
    {
        return crate::probe::serve::run(args, w.clone(), budget, timeout);
    }
    let session = Session::prepare(&SessionOptions {
        backend: args.device.backend.clone(),
        device: args.device.device.clone(),
        allocator: args.device.allocator(),
        budget,
        at,
        timeout,
        isolate: !args.no_isolate,
        compute: args.compute.map(|c| match c {
            ComputeMode::Full => Compute::Full,
            ComputeMode::Touch => Compute::Touch,
        }),
        scenarios: args.scenario.clone(),
        workload,
        search: match args.search {
            SearchArg::Measure => SearchMode::Measure,
            SearchArg::Gallop => SearchMode::Gallop,
        },
        force: args.force,
        repeat: match &args.repeat {
            Some(v) => Some(
                v.trim()
                    .parse::<u32>()
                    .ok()
                    .filter(|&n| n <= 100)
                    .ok_or_else(|| {
                        CliError::usage(format!("--repeat: expected 0 to 100, not '{v}'"))
                    })?,
            ),
            None => None,
        },
    })?;
    for w in session.warnings() {
        crate::error::warn(w);
    }
    let device = session.device();
    let label = format!("{} ({})", device.name, device.backend.as_str());
    let mut progress = Progress::new(args.quiet, &label, session.runs().len());
    if !args.quiet {
        for n in session.notes() {
            progress.println(&format!("oomprobe: {n}"));
        }
    }
    let mut sinks: Vec<&mut dyn Sink> = vec![&mut progress];
    let mut out = out;
    if let Some(file) = out.as_mut() {
        sinks.push(file);
    }
    let report = session.run(&mut sinks)?;

    let text = match stdout_format {
        OutputFormat::Table => {
            report::table::render_styled(&report, color_enabled(Stream::Stdout), args.wide)
        }
        f => report::render(&report, f).map_err(|e| CliError::run(e.to_string()))?,
    };
    print!("{text}");
    if !text.ends_with('\n') {
        println!();
    }
    match session::probe_error(&report) {
        Some((scenario, detail)) => Err(CliError::run(format!(
            "{} run ended on a probe error, not an OOM: {detail}",
            scenario.name()
        ))),
        None => Ok(()),
    }
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
    let resolved = crate::resolve::resolve(&args.workload, "gpt2")?;
    for w in &resolved.warnings {
        crate::error::warn(w);
    }
    Ok(Some(resolved.workload))
}

fn has_overrides(w: &crate::workload::args::WorkloadArgs) -> bool {
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
