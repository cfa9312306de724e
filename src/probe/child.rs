//! Probe isolation: re-exec this binary for one probe (`oomprobe probe-child --request JSON`)
//! and read its result as one JSON line, so a driver crash, a device loss or the kernel's OOM
//! killer ends the child, not the search. The parent classifies a child's death.

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};
use wait_timeout::ChildExt;

use crate::cli::ProbeChildArgs;
use crate::error::{CliError, CliResult};
use crate::plan::Plan;
use crate::report::{Outcome, ProbeRecord};
use crate::scenario::Scenario;
use crate::workload::Workload;

use super::{Compute, DeviceChoice};

/// Test hook: a child whose probe value equals this kills itself with SIGKILL (exercises the
/// parent's `killed` classification the way the kernel's OOM killer would).
pub const KILL_AT_ENV: &str = "OOMPROBE_TEST_KILL_AT";
/// Test hook: a child whose probe value equals this hangs (exercises `timeout`).
pub const HANG_AT_ENV: &str = "OOMPROBE_TEST_HANG_AT";

/// Everything a child needs to run one probe.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ChildRequest {
    pub workload: Workload,
    pub scenario: Scenario,
    pub value: u64,
    pub compute: Compute,
    pub device: DeviceChoice,
    pub budget: Option<u64>,
}

/// Run one probe in this process: open the device, apply the budget, build the plan, execute.
pub fn probe_in_process(req: &ChildRequest) -> ProbeRecord {
    let started = Instant::now();
    let plan = match Plan::for_value(&req.workload, req.scenario, req.value) {
        Ok(p) => p,
        Err(e) => return failed_record(req.value, 0, Outcome::Error, e.to_string(), started),
    };
    let bytes = plan.peak_bytes();
    let backend = match crate::backend::open::open_device(&req.device.backend, req.device.index) {
        Ok(b) => b,
        Err(e) => return failed_record(req.value, bytes, Outcome::Error, e.to_string(), started),
    };
    let mut backend: Box<dyn crate::backend::Backend> = match req.budget {
        Some(cap) => Box::new(crate::backend::budget::BudgetBackend::new(backend, cap)),
        None => backend,
    };
    let mut record = super::exec::execute_plan(backend.as_mut(), &plan, req.compute);
    record.seconds = started.elapsed().as_secs_f64();
    record
}

fn failed_record(
    value: u64,
    bytes: u64,
    outcome: Outcome,
    detail: String,
    started: Instant,
) -> ProbeRecord {
    ProbeRecord {
        value,
        outcome,
        bytes,
        bytes_allocated: 0,
        failed_tensor: None,
        seconds: started.elapsed().as_secs_f64(),
        step_seconds: None,
        checksum: None,
        detail: Some(detail),
        failed_at: None,
    }
}

/// `oomprobe probe-child`: the child side.
pub fn run_child(args: &ProbeChildArgs) -> CliResult<()> {
    let req: ChildRequest = serde_json::from_str(&args.request)
        .map_err(|e| CliError::usage(format!("probe-child: bad request: {e}")))?;
    apply_test_hooks(req.value);
    let record = probe_in_process(&req);
    let line = serde_json::to_string(&record)
        .map_err(|e| CliError::run(format!("probe-child: cannot encode result: {e}")))?;
    println!("{line}");
    Ok(())
}

fn apply_test_hooks(value: u64) {
    let hit =
        |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<u64>().ok()) == Some(value);
    if hit(KILL_AT_ENV) {
        #[cfg(unix)]
        // SAFETY: raising a signal on ourselves; SIGKILL ends the process here.
        unsafe {
            libc::raise(libc::SIGKILL);
        }
    }
    if hit(HANG_AT_ENV) {
        loop {
            std::thread::sleep(Duration::from_secs(60));
        }
    }
}

/// Runs probes in child processes of `exe` (normally this very binary).
#[derive(Debug, Clone)]
pub struct ChildRunner {
    pub exe: PathBuf,
    pub timeout: Duration,
}

impl ChildRunner {
    pub fn current(timeout: Duration) -> std::io::Result<Self> {
        Ok(ChildRunner {
            exe: std::env::current_exe()?,
            timeout,
        })
    }

    /// Run one probe in a child and classify how it ended.
    pub fn run(&self, req: &ChildRequest) -> ProbeRecord {
        let started = Instant::now();
        let bytes = Plan::for_value(&req.workload, req.scenario, req.value)
            .map(|p| p.peak_bytes())
            .unwrap_or(0);
        let fail =
            |outcome, detail: String| failed_record(req.value, bytes, outcome, detail, started);
        let json = match serde_json::to_string(req) {
            Ok(j) => j,
            Err(e) => return fail(Outcome::Error, format!("cannot encode request: {e}")),
        };
        let mut child = match Command::new(&self.exe)
            .arg("probe-child")
            .arg("--request")
            .arg(&json)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
        {
            Ok(c) => c,
            Err(e) => return fail(Outcome::Error, format!("cannot start probe child: {e}")),
        };
        // Drain both pipes on threads so a chatty child never blocks on a full pipe.
        let stdout = child.stdout.take().map(drain);
        let stderr = child.stderr.take().map(drain);
        let status = match child.wait_timeout(self.timeout) {
            Ok(Some(s)) => Some(s),
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                None
            }
            Err(e) => return fail(Outcome::Error, format!("waiting for probe child: {e}")),
        };
        let out = stdout.and_then(|h| h.join().ok()).unwrap_or_default();
        let err = stderr.and_then(|h| h.join().ok()).unwrap_or_default();
        let last_err = err
            .lines()
            .rev()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("")
            .trim();
        let Some(status) = status else {
            return fail(
                Outcome::Timeout,
                format!(
                    "probe child ran past {:.0} s and was killed",
                    self.timeout.as_secs_f64()
                ),
            );
        };
        #[cfg(unix)]
        {
            use std::os::unix::process::ExitStatusExt;
            if let Some(sig) = status.signal() {
                let what = if sig == libc::SIGKILL {
                    "killed by SIGKILL (the kernel's OOM killer, or a user)".to_string()
                } else {
                    format!("killed by signal {sig}")
                };
                let outcome = if sig == libc::SIGKILL {
                    Outcome::Killed
                } else {
                    Outcome::Error
                };
                let detail = if last_err.is_empty() {
                    what
                } else {
                    format!("{what}: {last_err}")
                };
                return fail(outcome, detail);
            }
        }
        match out
            .lines()
            .rev()
            .find_map(|l| serde_json::from_str::<ProbeRecord>(l).ok())
        {
            Some(mut rec) => {
                rec.seconds = started.elapsed().as_secs_f64();
                rec
            }
            None => fail(
                Outcome::Error,
                format!(
                    "probe child exited with {status} and no result{}",
                    if last_err.is_empty() {
                        String::new()
                    } else {
                        format!(": {last_err}")
                    }
                ),
            ),
        }
    }
}

fn drain<R: Read + Send + 'static>(mut r: R) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut buf = Vec::new();
        let _ = r.read_to_end(&mut buf);
        String::from_utf8_lossy(&buf).into_owned()
    })
}
