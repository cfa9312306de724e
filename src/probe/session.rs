//! A probe session: choose the device and the capacity, plan the runs, run them one after
//! another, and tell every sink (progress bar, `--out` file, ...) what happens as it happens.

use std::time::Duration;

use crate::backend::{nvidia, DeviceInfo, DeviceType};
use crate::error::{CliError, CliResult};
use crate::report::{self, Outcome, ProbeRecord, ProbeReport, RunResult, ToolInfo, SCHEMA_VERSION};
use crate::scenario::Scenario;
use crate::workload::Workload;

use super::capacity::{self, Capacity};
use super::child::{ChildRunner, Isolation, ProbeTimeout};
use super::runner::{ProbeEvent, RunContext, SearchMode};
use super::suite::{self, RunSpec};
use super::{Compute, DeviceChoice};
use crate::backend::pooled::AllocatorPick;
use crate::search::search_space;

/// What a session is asked to do, already parsed and checked by the command.
#[derive(Debug, Clone)]
pub struct SessionOptions {
    /// `--backend`: auto, vulkan, cuda, ...
    pub backend: String,
    /// `--device`: an index, or None for the default device.
    pub device: Option<String>,
    /// `--allocator`, `--alloc-conf`.
    pub allocator: AllocatorPick,
    /// `--budget` in bytes.
    pub budget: Option<u64>,
    /// `--at X`: one probe per run at X instead of a search.
    pub at: Option<u64>,
    pub timeout: ProbeTimeout,
    /// False with `--no-isolate`.
    pub isolate: bool,
    /// `--compute`; None picks touch on CPU adapters and full elsewhere.
    pub compute: Option<Compute>,
    /// `--scenario` (empty: the workload's scenarios, or the whole suite).
    pub scenarios: Vec<Scenario>,
    /// The user's workload; None runs the default suite.
    pub workload: Option<Workload>,
    /// `--search`: measure the capacity (default) or only gallop and bisect.
    pub search: SearchMode,
    /// `--force`: a budget above the host memory a CPU adapter has is used as given.
    pub force: bool,
    /// `--repeat N`; None: 2 on real OOM, 0 under `--budget` (where the budget is exact).
    pub repeat: Option<u32>,
}

/// `--repeat`'s default on real OOM: each boundary value probed twice more.
pub const DEFAULT_REPEAT: u32 = 2;

/// What a session tells its sinks.
#[derive(Debug, Clone, Copy)]
pub enum SessionEvent<'a> {
    /// A run begins; `report` holds it as a run in progress without probes.
    RunStarted {
        index: usize,
        spec: &'a RunSpec,
        report: &'a ProbeReport,
    },
    /// A probe at `value` begins.
    ProbeStarted { value: u64 },
    /// A probe ended; `report` holds every finished run and this run's probes so far.
    ProbeFinished {
        record: &'a ProbeRecord,
        report: &'a ProbeReport,
    },
    /// Every run ended.
    Finished { report: &'a ProbeReport },
}

/// Something that follows a session: a progress bar, a file rewritten as results arrive.
pub trait Sink {
    fn event(&mut self, event: &SessionEvent<'_>) -> CliResult<()>;
}

/// A session ready to run: device chosen, capacity decided, runs planned.
pub struct Session {
    ctx: RunContext,
    runs: Vec<RunSpec>,
    at: Option<u64>,
    notes: Vec<String>,
    warnings: Vec<String>,
}

impl Session {
    /// Choose the device, decide the capacity (sized by the measured fill rate on a CPU
    /// adapter without a budget), and plan the runs. Bad options are usage errors.
    pub fn prepare(opts: &SessionOptions) -> CliResult<Session> {
        let (choice, info) = select_device(&opts.backend, opts.device.as_deref(), &opts.allocator)?;
        let isolation = isolation(opts.isolate, opts.timeout.clone())?;
        let open = || crate::backend::open::open_device(&choice.backend, choice.index);
        let (budget, host_warning) =
            capacity::host_guard(&info, opts.budget, opts.force, capacity::ram_available());
        let mut cap = capacity::decide(&info, budget);
        if cap.budget.is_none() {
            // Under an address-space limit the device's own mappings count: measure them once.
            if let Some(usable) = capacity::usable_under_address_space_limit(open) {
                cap.predict_against = Some(usable);
            }
        }
        let compute = opts
            .compute
            .unwrap_or(if info.device_type == DeviceType::Cpu {
                Compute::Touch
            } else {
                Compute::Full
            });
        let mut notes: Vec<String> = crate::backend::open::faster_driver_hint(&info, &opts.backend)
            .into_iter()
            .map(String::from)
            .collect();
        let planned = |cap: &Capacity| {
            suite::plan_runs(&opts.scenarios, opts.workload.as_ref(), cap.predict_against)
        };
        if opts.budget.is_none() && info.device_type == DeviceType::Cpu && compute == Compute::Touch
        {
            // A first run that finishes: size the default cap by what probes cost here.
            if let Some(rate) = capacity::measure_probe_cost(&isolation, &choice) {
                let per_run = if opts.at.is_some() {
                    1
                } else {
                    capacity::PROBES_PER_RUN
                };
                let seconds_at = |c: u64| {
                    let runs: Vec<(Workload, Scenario)> =
                        suite::plan_runs(&opts.scenarios, opts.workload.as_ref(), Some(c))
                            .into_iter()
                            .map(|r| (r.workload, r.scenario))
                            .collect();
                    capacity::suite_seconds(&runs, c, &rate, per_run)
                };
                capacity::size_for_time(&mut cap, &rate, capacity::CPU_TARGET_SECONDS, seconds_at);
            }
        }
        notes.extend(cap.notes.iter().cloned());
        let mut runs = planned(&cap);
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
        // What a probe measures of the room counts tensor bytes; through the caching allocator
        // the device gives segments, so the search goes by fit and fail from the model's
        // prediction.
        let search = match &choice.allocator {
            Some(conf) => {
                notes.push(format!(
                    "tensors placed in segments as PyTorch's caching allocator does ({}; \
                     --allocator direct for one buffer each), {} steps a probe: the boundary \
                     is found by fit/fail probes from the allocator model's prediction",
                    if conf.is_empty() {
                        "PyTorch's defaults"
                    } else {
                        conf
                    },
                    crate::alloc::timeline::STEPS
                ));
                SearchMode::Gallop
            }
            None => opts.search,
        };
        if let Some(x) = opts.at {
            for spec in &runs {
                check_at(spec, x)?;
            }
        }
        let mut warnings: Vec<String> = host_warning.into_iter().collect();
        if !opts.isolate {
            warnings.push(NO_ISOLATE_WARNING.to_string());
        }
        // Any enforced budget (--budget, or the first run's cap on a CPU adapter) is exact:
        // repeats there would only repeat the arithmetic.
        let repeat = opts.repeat.unwrap_or(if cap.budget.is_some() {
            0
        } else {
            DEFAULT_REPEAT
        });
        Ok(Session {
            ctx: RunContext {
                device: choice,
                info,
                capacity: cap,
                compute,
                isolation,
                search,
                repeat,
            },
            runs,
            at: opts.at,
            notes,
            warnings,
        })
    }

    /// The device the probes run on.
    pub fn device(&self) -> &DeviceInfo {
        &self.ctx.info
    }

    /// The runs the session makes, in order.
    pub fn runs(&self) -> &[RunSpec] {
        &self.runs
    }

    /// Lines a person should see before the runs (capacity chosen, faster drivers).
    pub fn notes(&self) -> &[String] {
        &self.notes
    }

    /// Warnings that are printed even with `--quiet`.
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    /// Run every run, telling `sinks` as results arrive; the finished report.
    pub fn run(&self, sinks: &mut [&mut dyn Sink]) -> CliResult<ProbeReport> {
        let mut report = ProbeReport {
            schema_version: SCHEMA_VERSION,
            tool: ToolInfo::default(),
            device: self.ctx.info.clone(),
            budget_bytes: self.ctx.capacity.budget,
            compute: Some(self.ctx.compute.name().to_string()),
            runs: Vec::new(),
            in_progress: true,
        };
        for (index, spec) in self.runs.iter().enumerate() {
            // Until the run ends, the report holds it as a run in progress (even before its
            // first probe), so a file of a stopped probe always says it is partial.
            let partial = with_partial(&report, spec, &[]);
            broadcast(
                sinks,
                &SessionEvent::RunStarted {
                    index,
                    spec,
                    report: &partial,
                },
            )?;
            let mut probes: Vec<ProbeRecord> = Vec::new();
            let mut failed: Option<CliError> = None;
            let mut on_event = |event: ProbeEvent<'_>| {
                let result = match event {
                    ProbeEvent::Started(value) => {
                        broadcast(sinks, &SessionEvent::ProbeStarted { value })
                    }
                    ProbeEvent::Finished(record) => {
                        probes.push(record.clone());
                        let partial = with_partial(&report, spec, &probes);
                        broadcast(
                            sinks,
                            &SessionEvent::ProbeFinished {
                                record,
                                report: &partial,
                            },
                        )
                    }
                };
                if let Err(e) = result {
                    failed.get_or_insert(e);
                }
            };
            let result = match self.at {
                Some(x) => {
                    on_event(ProbeEvent::Started(x));
                    let result = self.ctx.single(spec, x);
                    for p in &result.probes {
                        on_event(ProbeEvent::Finished(p));
                    }
                    result
                }
                None => self.ctx.search(spec, &mut on_event),
            };
            if let Some(e) = failed {
                return Err(e);
            }
            report.runs.push(result);
        }
        report.in_progress = false;
        broadcast(sinks, &SessionEvent::Finished { report: &report })?;
        Ok(report)
    }
}

/// Tell every sink; the first error wins, but every sink hears the event.
fn broadcast(sinks: &mut [&mut dyn Sink], event: &SessionEvent<'_>) -> CliResult<()> {
    let mut first = Ok(());
    for sink in sinks.iter_mut() {
        if let Err(e) = sink.event(event) {
            if first.is_ok() {
                first = Err(e);
            }
        }
    }
    first
}

/// The report with `spec` appended as a run in progress holding `probes`.
fn with_partial(report: &ProbeReport, spec: &RunSpec, probes: &[ProbeRecord]) -> ProbeReport {
    let mut snapshot = report.clone();
    snapshot.runs.push(partial_run(spec, probes));
    snapshot
}

/// A run in progress.
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
        repeats: Vec::new(),
        seconds: probes.iter().map(|p| p.seconds).sum(),
        in_progress: true,
    }
}

/// The first run that ended on a probe error (not an OOM result), with that probe's detail.
pub fn probe_error(report: &ProbeReport) -> Option<(Scenario, String)> {
    let run = report
        .runs
        .iter()
        .find(|r| r.fail_reason == Some(Outcome::Error))?;
    let detail = run
        .probes
        .iter()
        .rev()
        .find(|p| p.outcome == Outcome::Error)
        .and_then(|p| p.detail.clone())
        .unwrap_or_default();
    Some((run.scenario, detail))
}

/// What `--no-isolate` gives up, said plainly.
pub const NO_ISOLATE_WARNING: &str = "--no-isolate runs every probe inside this process: a \
driver crash, a panic or the OOM killer at the edge of memory ends the whole run (and its \
output) instead of one probe";

/// A child per probe, or this process with `isolate` false.
pub fn isolation(isolate: bool, timeout: ProbeTimeout) -> CliResult<Isolation> {
    if !isolate {
        return Ok(Isolation::InProcess);
    }
    ChildRunner::current(timeout)
        .map(Isolation::Child)
        .map_err(|e| {
            CliError::run(format!(
                "cannot find this executable to isolate probes: {e}"
            ))
        })
}

/// Resolve --backend/--device/--allocator to a device without opening it (probes open it
/// themselves).
pub fn select_device(
    backend: &str,
    device: Option<&str>,
    allocator: &AllocatorPick,
) -> CliResult<(DeviceChoice, DeviceInfo)> {
    let index = device
        .map(|d| {
            d.trim()
                .parse::<usize>()
                .map_err(|_| CliError::usage(format!("--device: '{d}' is not a device index")))
        })
        .transpose()?;
    let info = crate::backend::open::device_info(backend, index)?;
    let allocator = allocator.resolve(info.backend).map_err(CliError::usage)?;
    // The backend resolved (`auto` becomes e.g. `vulkan`): probe children open only it.
    Ok((
        DeviceChoice {
            backend: info.backend.as_str().to_string(),
            index: Some(info.index),
            allocator,
        },
        info,
    ))
}

/// `--at X` must be a value the scenario can take and its plan must be computable.
fn check_at(spec: &RunSpec, x: u64) -> CliResult<()> {
    let space = search_space(spec.scenario);
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

/// Parse `--timeout` seconds.
pub fn parse_timeout(s: &str) -> CliResult<Duration> {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A sink that records the kinds of events it saw.
    #[derive(Default)]
    struct Log(Vec<String>);

    impl Sink for Log {
        fn event(&mut self, event: &SessionEvent<'_>) -> CliResult<()> {
            self.0.push(match event {
                SessionEvent::RunStarted { index, report, .. } => {
                    assert!(report.runs[*index].in_progress);
                    format!("run {index}")
                }
                SessionEvent::ProbeStarted { value } => format!("start {value}"),
                SessionEvent::ProbeFinished { record, report } => {
                    let run = report.runs.last().expect("the run in progress");
                    assert!(run.in_progress && run.probes.last() == Some(*record));
                    format!("done {} {}", record.value, record.outcome.name())
                }
                SessionEvent::Finished { report } => {
                    assert!(!report.in_progress);
                    "finished".to_string()
                }
            });
            Ok(())
        }
    }

    struct Failing;

    impl Sink for Failing {
        fn event(&mut self, _: &SessionEvent<'_>) -> CliResult<()> {
            Err(CliError::run("disk full"))
        }
    }

    fn mock_session(budget: u64, at: Option<u64>) -> Session {
        let opts = SessionOptions {
            backend: "auto".into(),
            device: None,
            allocator: AllocatorPick::default(),
            budget: Some(budget),
            at,
            timeout: ProbeTimeout::auto(),
            isolate: false,
            compute: Some(Compute::Touch),
            scenarios: vec![Scenario::Batch],
            workload: Some(crate::workload::presets::get("tiny-gpt").expect("preset")),
            search: SearchMode::default(),
            force: false,
            repeat: None,
        };
        Session::prepare(&opts).expect("a mock session")
    }

    #[test]
    fn every_sink_hears_every_probe_in_order() {
        let session = mock_session(48 << 20, None);
        assert!(!session.warnings().is_empty(), "in process is warned about");
        let (mut a, mut b) = (Log::default(), Log::default());
        let report = session.run(&mut [&mut a, &mut b]).expect("runs");
        assert_eq!(a.0, b.0);
        assert_eq!(a.0.first().map(String::as_str), Some("run 0"));
        assert_eq!(a.0.last().map(String::as_str), Some("finished"));
        let probes = report.runs[0].probes.len();
        assert_eq!(a.0.iter().filter(|e| e.starts_with("done")).count(), probes);
        assert_eq!(
            a.0.iter().filter(|e| e.starts_with("start")).count(),
            probes
        );
        assert!(report.runs[0].max_fit.is_some() && report.runs[0].first_fail.is_some());
    }

    #[test]
    fn at_makes_one_probe_per_run() {
        let session = mock_session(48 << 20, Some(3));
        let mut log = Log::default();
        let report = session.run(&mut [&mut log]).expect("runs");
        assert_eq!(report.runs[0].at, Some(3));
        assert_eq!(log.0, vec!["run 0", "start 3", "done 3 fit", "finished"]);
    }

    #[test]
    fn a_failing_sink_stops_the_session_with_its_error() {
        let session = mock_session(48 << 20, None);
        let mut log = Log::default();
        let err = session
            .run(&mut [&mut log, &mut Failing])
            .expect_err("the sink's error");
        assert!(err.to_string().contains("disk full"));
        assert_eq!(log.0, vec!["run 0"], "nothing probed after the failure");
    }

    #[test]
    fn an_at_beyond_the_space_is_a_usage_error() {
        let opts = SessionOptions {
            at: Some(u64::MAX),
            ..SessionOptions {
                backend: "auto".into(),
                device: None,
                allocator: AllocatorPick::default(),
                budget: Some(1 << 30),
                at: None,
                timeout: ProbeTimeout::auto(),
                isolate: false,
                compute: None,
                scenarios: vec![Scenario::Batch],
                workload: Some(crate::workload::presets::get("tiny-gpt").expect("preset")),
                search: SearchMode::default(),
                force: false,
                repeat: None,
            }
        };
        let err = Session::prepare(&opts).err().expect("usage error");
        assert_eq!(err.exit_code(), 2, "{err}");
    }
}
