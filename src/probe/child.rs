//! Probe isolation: re-exec this binary for one probe (`oomprobe probe-child --request JSON`)
//! and read its result as one JSON line, so a driver crash, a device loss or the kernel's OOM
//! killer ends the child, not the search. The parent classifies a child's death.

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
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
/// Test hook: a child whose probe value equals this sends itself SIGTERM (also `killed`).
pub const TERM_AT_ENV: &str = "OOMPROBE_TEST_TERM_AT";
/// Test hook: a child whose probe value equals this hangs (exercises `timeout`).
pub const HANG_AT_ENV: &str = "OOMPROBE_TEST_HANG_AT";
/// Test hook: a child whose probe value equals this aborts (SIGABRT, as a failed host
/// allocation does): exercises `crashed`.
pub const CRASH_AT_ENV: &str = "OOMPROBE_TEST_CRASH_AT";
/// Test hook: a child whose probe value equals this panics (as wgpu does on some OOM paths).
pub const PANIC_AT_ENV: &str = "OOMPROBE_TEST_PANIC_AT";

/// Test hook: a child whose probe value equals this reports a read-back that lost its data
/// (`verify_failed`), as an adapter that corrupts memory at the edge does.
pub const VERIFY_FAIL_AT_ENV: &str = "OOMPROBE_TEST_VERIFY_FAIL_AT";

/// The exit status of a child whose probe panicked (set by the child's panic hook).
pub const PANIC_EXIT: i32 = 101;

/// Everything a child needs to run one probe.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ChildRequest {
    pub workload: Workload,
    pub scenario: Scenario,
    pub value: u64,
    pub compute: Compute,
    pub device: DeviceChoice,
    pub budget: Option<u64>,
    /// Replay a PyTorch memory snapshot instead of the workload's plan (`probe --snapshot`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub snapshot: Option<crate::snapshot::Source>,
    /// Additive: measure the room left at the plan's peak with filler (see `probe::room`).
    #[serde(default)]
    pub room: Option<crate::search::RoomAsk>,
}

/// Run one probe in this process: open the device, apply the budget, build the plan, execute.
pub fn probe_in_process(req: &ChildRequest) -> ProbeRecord {
    let started = Instant::now();
    super::hostmem::fix_mmap_threshold();
    let plan = match &req.snapshot {
        Some(s) => s.plan_at(req.value).map_err(|e| e.to_string()),
        // A serving probe: `value` is the card's bytes (`probe::serve`).
        None if req.workload.mode == crate::workload::Mode::Serve => {
            crate::serve::pool::probe_plan(&req.workload, req.value)
                .map(|(p, ..)| p)
                .map_err(|e| e.to_string())
        }
        None => Plan::for_value(&req.workload, req.scenario, req.value).map_err(|e| e.to_string()),
    };
    let plan = match plan {
        Ok(p) => p,
        Err(e) => return ProbeRecord::failed(req.value, 0, Outcome::Error, e, started),
    };
    let bytes = plan.peak_bytes();
    let mut backend = match open(req) {
        Ok(b) => b,
        Err(e) => return ProbeRecord::failed(req.value, bytes, Outcome::Error, e, started),
    };
    let charge = super::charge::Charge::of(backend.info(), req.budget);
    let info = backend.info().clone();
    let room = req.room.map(|ask| (ask, charge));
    let mut record =
        super::exec::execute_plan_measuring(backend.as_mut(), &plan, req.compute, room);
    record.allocator = backend.allocator_stats();
    // Where the search measures: the step's own allocations at other values, replayed
    // unwritten on a device opened afresh for each (a workload's plan only: a snapshot or a
    // serving probe has no plan at another value).
    let replayable = req.snapshot.is_none() && req.workload.mode != crate::workload::Mode::Serve;
    if let (Some(ask), true) = (req.room, replayable) {
        drop(backend);
        let kernels = super::warmup::kernels_of(&plan, req.compute, &info);
        let mut fresh = || -> Option<Box<dyn crate::backend::Backend>> {
            let mut b = open(req).ok()?;
            b.prepare(&kernels).ok()?;
            Some(b)
        };
        let plan_at = |x: u64| Plan::for_value(&req.workload, req.scenario, x).ok();
        let space = crate::search::search_space(req.scenario);
        record.dry =
            super::dry::after_probe(&record, &plan, ask, charge, space, &plan_at, &mut fresh);
    }
    record.seconds = started.elapsed().as_secs_f64();
    record
}

/// Open the request's device under its budget.
fn open(req: &ChildRequest) -> Result<Box<dyn crate::backend::Backend>, String> {
    let b = crate::backend::open::open_device(&req.device.backend, req.device.index)
        .map_err(|e| e.to_string())?;
    // The budget is the card: it counts what the allocator takes from the driver (segments).
    let b: Box<dyn crate::backend::Backend> = match req.budget {
        Some(cap) => Box::new(crate::backend::budget::BudgetBackend::new(b, cap)),
        None => b,
    };
    Ok(match &req.device.allocator {
        Some(text) => {
            let conf = crate::alloc::conf::parse(text).map_err(|e| e.to_string())?;
            Box::new(crate::backend::pooled::PooledBackend::new(b, conf)?)
        }
        None => b,
    })
}

/// `oomprobe probe-child`: the child side.
pub fn run_child(args: &ProbeChildArgs) -> CliResult<()> {
    install_panic_hook();
    let req: ChildRequest = serde_json::from_str(&args.request)
        .map_err(|e| CliError::usage(format!("probe-child: bad request: {e}")))?;
    apply_test_hooks(req.value);
    // Off glibc's main arena, where a refused buffer would change what later ones cost.
    let mut record = super::hostmem::off_main_arena(|| probe_in_process(&req));
    if std::env::var(VERIFY_FAIL_AT_ENV)
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        == Some(req.value)
    {
        record.outcome = Outcome::VerifyFailed;
        record.detail = Some(format!(
            "{}: tensor test.hook lost what was written (test hook)",
            super::readback::VERIFY_FAILED
        ));
        record.checksum = None;
    }
    let line = serde_json::to_string(&record)
        .map_err(|e| CliError::run(format!("probe-child: cannot encode result: {e}")))?;
    println!("{line}");
    Ok(())
}

fn apply_test_hooks(value: u64) {
    let hit =
        |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<u64>().ok()) == Some(value);
    #[cfg(unix)]
    for (env, sig) in [(KILL_AT_ENV, libc::SIGKILL), (TERM_AT_ENV, libc::SIGTERM)] {
        if hit(env) {
            // SAFETY: raising a signal on ourselves; both end the process here.
            unsafe {
                libc::raise(sig);
            }
        }
    }
    if hit(CRASH_AT_ENV) {
        eprintln!("memory allocation of {value} bytes failed (test hook)");
        std::process::abort();
    }
    if hit(PANIC_AT_ENV) {
        panic!("test hook: panic at {value}");
    }
    if hit(HANG_AT_ENV) {
        loop {
            std::thread::sleep(Duration::from_secs(60));
        }
    }
}

/// Write to stderr without allocating or locking (safe in a panic with memory exhausted).
fn raw_stderr(bytes: &[u8]) {
    #[cfg(unix)]
    {
        let mut rest = bytes;
        while !rest.is_empty() {
            // SAFETY: writing a valid byte slice to fd 2.
            let n = unsafe { libc::write(2, rest.as_ptr().cast(), rest.len()) };
            if n <= 0 {
                return;
            }
            rest = &rest[n as usize..];
        }
    }
    #[cfg(not(unix))]
    {
        use std::io::Write;
        let _ = std::io::stderr().write_all(bytes);
    }
}

/// The child's panic hook: one fixed-format line (message and location, no backtrace, no
/// allocation, no lock) and an immediate `_exit(PANIC_EXIT)`, so a panic at the edge of memory
/// can neither deadlock nor hang the probe.
fn install_panic_hook() {
    std::panic::set_hook(Box::new(|info| {
        raw_stderr(b"oomprobe-child: panicked: ");
        let payload = info.payload();
        let msg = payload
            .downcast_ref::<&str>()
            .copied()
            .or_else(|| payload.downcast_ref::<String>().map(String::as_str))
            .unwrap_or("(no message)");
        raw_stderr(msg.as_bytes());
        if let Some(loc) = info.location() {
            raw_stderr(b" at ");
            raw_stderr(loc.file().as_bytes());
            let mut digits = [0u8; 12];
            let mut n = loc.line();
            let mut i = digits.len();
            loop {
                i -= 1;
                digits[i] = b'0' + (n % 10) as u8;
                n /= 10;
                if n == 0 {
                    break;
                }
            }
            i -= 1;
            digits[i] = b':';
            raw_stderr(&digits[i..]);
        }
        raw_stderr(b"\n");
        #[cfg(unix)]
        // SAFETY: ending the process at once, without unwinding or running destructors.
        unsafe {
            libc::_exit(PANIC_EXIT)
        };
        #[cfg(not(unix))]
        std::process::exit(PANIC_EXIT);
    }));
}

/// Make a child die with this process: SIGKILL when the parent dies (Linux
/// `PR_SET_PDEATHSIG`, checked against a parent that died before the call), and no core dump
/// for a child that crashes at the edge of memory.
pub fn die_with_parent(cmd: &mut Command) {
    #[cfg(unix)]
    {
        use std::os::unix::process::CommandExt;
        let parent = std::process::id() as libc::pid_t;
        // SAFETY: the closure runs between fork and exec and only makes async-signal-safe calls.
        unsafe {
            cmd.pre_exec(move || {
                #[cfg(target_os = "linux")]
                {
                    if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    if libc::getppid() != parent {
                        libc::_exit(1);
                    }
                }
                let _ = parent;
                let no_core = libc::rlimit {
                    rlim_cur: 0,
                    rlim_max: 0,
                };
                libc::setrlimit(libc::RLIMIT_CORE, &no_core);
                Ok(())
            });
        }
    }
    cmd.env("RUST_BACKTRACE", "0")
        .env("RUST_LIB_BACKTRACE", "0");
}

/// How long a probe child may run.
#[derive(Debug, Clone)]
pub enum ProbeTimeout {
    /// `--timeout SECONDS`.
    Fixed(Duration),
    /// Sized from the bytes the probe's step allocates (what it writes and reads back) and the
    /// slowest rate (seconds per such byte) seen on a fitting probe so far; see
    /// [`auto_timeout`].
    Auto(Arc<Mutex<Option<f64>>>),
}

impl ProbeTimeout {
    pub fn auto() -> Self {
        ProbeTimeout::Auto(Arc::new(Mutex::new(None)))
    }
    /// The limit for a probe whose step allocates `bytes` in all.
    pub fn for_bytes(&self, bytes: u64) -> Duration {
        match self {
            ProbeTimeout::Fixed(d) => *d,
            ProbeTimeout::Auto(rate) => auto_timeout(bytes, rate.lock().ok().and_then(|r| *r)),
        }
    }
    /// Learn from a finished probe whose step allocated `bytes` in all (only fits of at least
    /// `RATE_MIN_BYTES` say how fast the device fills memory; small ones are all start-up). A
    /// step that allocates far more than its peak (checkpointing recomputes, many short-lived
    /// activations) takes time for all of it, not for its peak.
    fn observe(&self, rec: &ProbeRecord, bytes: u64) {
        if let ProbeTimeout::Auto(rate) = self {
            if rec.outcome.is_fit() && bytes >= RATE_MIN_BYTES {
                let r = rec.seconds / bytes as f64;
                if let Ok(mut g) = rate.lock() {
                    *g = Some(g.map_or(r, |old| old.max(r)));
                }
            }
        }
    }
}

/// Auto timeout: never below this (start-up, shader compilation).
pub const AUTO_TIMEOUT_FLOOR: Duration = Duration::from_secs(60);
/// Auto timeout: never above this.
pub const AUTO_TIMEOUT_CAP: Duration = Duration::from_secs(3600);
/// Before any probe fit: assume 1 s per 64 MiB (slower than lavapipe's touch mode).
const DEFAULT_SECONDS_PER_BYTE: f64 = 1.0 / (64u64 << 20) as f64;
/// Fits smaller than this do not set the rate.
const RATE_MIN_BYTES: u64 = 64 << 20;
/// Slack over the expected time.
const AUTO_TIMEOUT_SLACK: f64 = 4.0;

/// The time limit of a probe of `bytes` given the slowest rate seen (seconds per byte):
/// `SLACK × bytes × rate`, clamped to [floor, cap].
pub fn auto_timeout(bytes: u64, seconds_per_byte: Option<f64>) -> Duration {
    let rate = seconds_per_byte
        .filter(|r| r.is_finite() && *r > 0.0)
        .unwrap_or(DEFAULT_SECONDS_PER_BYTE);
    let secs = AUTO_TIMEOUT_SLACK * bytes as f64 * rate;
    Duration::from_secs_f64(secs.clamp(
        AUTO_TIMEOUT_FLOOR.as_secs_f64(),
        AUTO_TIMEOUT_CAP.as_secs_f64(),
    ))
}

/// How probes are run.
#[derive(Debug, Clone)]
pub enum Isolation {
    /// A child process per probe (the default).
    Child(ChildRunner),
    /// In this process (`--no-isolate`).
    InProcess,
}

impl Isolation {
    /// Run one probe as this isolation says.
    pub fn run(&self, req: &ChildRequest) -> ProbeRecord {
        match self {
            Isolation::Child(runner) => runner.run(req),
            Isolation::InProcess => probe_in_process(req),
        }
    }
}

/// Runs probes in child processes of `exe` (normally this very binary).
#[derive(Debug, Clone)]
pub struct ChildRunner {
    pub exe: PathBuf,
    pub timeout: ProbeTimeout,
}

impl ChildRunner {
    pub fn current(timeout: ProbeTimeout) -> std::io::Result<Self> {
        Ok(ChildRunner {
            exe: std::env::current_exe()?,
            timeout,
        })
    }

    /// Run one probe in a child and classify how it ended.
    pub fn run(&self, req: &ChildRequest) -> ProbeRecord {
        let plan = Plan::for_value(&req.workload, req.scenario, req.value).ok();
        let bytes = plan.as_ref().map_or(0, Plan::peak_bytes);
        let work = plan.as_ref().map_or(0, Plan::allocated_bytes);
        let limit = self.timeout.for_bytes(work);
        let mut rec = self.run_once(req, bytes, limit);
        rec.time_limit_seconds = Some(limit.as_secs_f64());
        self.timeout.observe(&rec, work);
        rec
    }

    /// One probe of a plan that peaks at `bytes`, in a child killed after `limit`.
    fn run_once(&self, req: &ChildRequest, bytes: u64, limit: Duration) -> ProbeRecord {
        let started = Instant::now();
        let fail = |outcome, detail: String| {
            ProbeRecord::failed(req.value, bytes, outcome, detail, started)
        };
        let json = match serde_json::to_string(req) {
            Ok(j) => j,
            Err(e) => return fail(Outcome::Error, format!("cannot encode request: {e}")),
        };
        let mut cmd = Command::new(&self.exe);
        cmd.arg("probe-child")
            .arg("--request")
            .arg(&json)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        die_with_parent(&mut cmd);
        let mut child = match cmd.spawn() {
            Ok(c) => c,
            Err(e) => return fail(Outcome::Error, format!("cannot start probe child: {e}")),
        };
        // Drain both pipes on threads so a chatty child never blocks on a full pipe.
        let stdout = child.stdout.take().map(|r| drain(r, STDOUT_KEEP));
        let stderr = child.stderr.take().map(|r| drain(r, STDERR_KEEP));
        let status = match child.wait_timeout(limit) {
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
        let cause = meaningful_line(&err);
        let with_cause = |what: String| match &cause {
            Some(c) => format!("{what}: {c}"),
            None => what,
        };
        let Some(status) = status else {
            return fail(
                Outcome::Timeout,
                format!(
                    "probe child ran past {:.0} s and was killed",
                    limit.as_secs_f64()
                ),
            );
        };
        #[cfg(unix)]
        {
            use std::os::unix::process::ExitStatusExt;
            if let Some(sig) = status.signal() {
                let (outcome, what) = classify_signal(sig);
                return fail(outcome, with_cause(what));
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
            None if status.code() == Some(PANIC_EXIT) => {
                fail(Outcome::Crashed, with_cause("probe child panicked".into()))
            }
            None => fail(
                Outcome::Error,
                with_cause(format!("probe child exited with {status} and no result")),
            ),
        }
    }
}

/// How a child that died by signal `sig` is classified, and the words for it.
#[cfg(unix)]
pub fn classify_signal(sig: i32) -> (Outcome, String) {
    match sig {
        libc::SIGKILL => (
            Outcome::Killed,
            "killed by SIGKILL (the kernel's OOM killer, or a user)".to_string(),
        ),
        libc::SIGTERM | libc::SIGINT | libc::SIGHUP => {
            (Outcome::Killed, format!("killed by {}", signal_name(sig)))
        }
        _ => (
            Outcome::Crashed,
            format!("crashed: {} (signal {sig})", signal_name(sig)),
        ),
    }
}

#[cfg(unix)]
fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGKILL => "SIGKILL",
        libc::SIGTERM => "SIGTERM",
        libc::SIGINT => "SIGINT",
        libc::SIGHUP => "SIGHUP",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGILL => "SIGILL",
        libc::SIGFPE => "SIGFPE",
        libc::SIGTRAP => "SIGTRAP",
        _ => "a signal",
    }
}

/// Bytes of a child's output kept by the parent (the tail).
const STDOUT_KEEP: usize = 1 << 20;
const STDERR_KEEP: usize = 64 << 10;

/// Lines that say what went wrong, most telling first.
const CAUSE_MARKERS: [&str; 6] = [
    "panicked",
    "memory allocation of",
    "llvm error",
    "out of memory",
    "outofmemory",
    "error",
];
/// Lines that never say why a child died (driver chatter, backtrace hints and frames).
const NOISE_MARKERS: [&str; 4] = [
    "xdg_runtime_dir",
    "rust_backtrace",
    "stack backtrace",
    "lavapipe is not a conformant",
];

/// The line of a child's stderr that says why it died: among the last lines, the latest that
/// names a panic, a failed allocation or an LLVM / out-of-memory error (with the line after a
/// `panicked at FILE:` header), else the latest line that is not driver noise or a backtrace.
pub fn meaningful_line(stderr: &str) -> Option<String> {
    let lines: Vec<&str> = stderr
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    let tail = &lines[lines.len().saturating_sub(32)..];
    let is_noise = |l: &str| {
        let low = l.to_ascii_lowercase();
        NOISE_MARKERS.iter().any(|m| low.contains(m))
            || low.starts_with("note:")
            || low.starts_with("at ")
            || l.split(':')
                .next()
                .is_some_and(|n| !n.is_empty() && n.bytes().all(|c| c.is_ascii_digit()))
    };
    for marker in CAUSE_MARKERS {
        if let Some(i) = tail
            .iter()
            .rposition(|l| !is_noise(l) && l.to_ascii_lowercase().contains(marker))
        {
            let line = tail[i];
            if line.contains("panicked at") && line.ends_with(':') {
                if let Some(next) = tail.get(i + 1) {
                    return Some(format!("{line} {next}"));
                }
            }
            return Some(line.to_string());
        }
    }
    tail.iter()
        .rev()
        .find(|l| !is_noise(l))
        .map(|l| l.to_string())
}

/// Read `r` to its end on a thread, keeping the last `keep` bytes.
fn drain<R: Read + Send + 'static>(mut r: R, keep: usize) -> std::thread::JoinHandle<String> {
    std::thread::spawn(move || {
        let mut buf: Vec<u8> = Vec::new();
        let mut chunk = [0u8; 8192];
        loop {
            match r.read(&mut chunk) {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    buf.extend_from_slice(&chunk[..n]);
                    if buf.len() > 2 * keep {
                        buf.drain(..buf.len() - keep);
                    }
                }
            }
        }
        if buf.len() > keep {
            buf.drain(..buf.len() - keep);
        }
        String::from_utf8_lossy(&buf).into_owned()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cause_is_the_panic_or_allocation_line_not_driver_noise() {
        let mesa = "MESA: error: XDG_RUNTIME_DIR is invalid or not set in the environment.";
        let hint = "note: run with `RUST_BACKTRACE=1` environment variable to display a backtrace";
        let panic = format!(
            "{mesa}\nthread 'main' panicked at wgpu-core-30.0.2/src/device/queue.rs:503:18:\ncalled `Result::unwrap()` on an `Err` value: OutOfMemory\n{hint}\n"
        );
        let got = meaningful_line(&panic).unwrap();
        assert!(
            got.contains("queue.rs:503") && got.contains("OutOfMemory"),
            "{got}"
        );
        let alloc = format!("{mesa}\nmemory allocation of 134217728 bytes failed\n");
        assert_eq!(
            meaningful_line(&alloc).as_deref(),
            Some("memory allocation of 134217728 bytes failed")
        );
        assert_eq!(
            meaningful_line(&format!(
                "LLVM ERROR: Unable to allocate section memory!\n{mesa}\n"
            ))
            .as_deref(),
            Some("LLVM ERROR: Unable to allocate section memory!")
        );
        assert_eq!(meaningful_line(&format!("{mesa}\n{hint}\n")), None);
        assert_eq!(
            meaningful_line("warming up\nsomething odd happened\n").as_deref(),
            Some("something odd happened")
        );
    }

    #[cfg(unix)]
    #[test]
    fn signals_are_classified() {
        assert_eq!(classify_signal(libc::SIGKILL).0, Outcome::Killed);
        assert_eq!(classify_signal(libc::SIGTERM).0, Outcome::Killed);
        let (o, w) = classify_signal(libc::SIGSEGV);
        assert_eq!(o, Outcome::Crashed);
        assert!(w.contains("SIGSEGV"), "{w}");
        assert_eq!(classify_signal(libc::SIGABRT).0, Outcome::Crashed);
    }

    #[test]
    fn the_auto_timeout_grows_with_bytes_between_floor_and_cap() {
        assert_eq!(auto_timeout(1 << 20, None), AUTO_TIMEOUT_FLOOR);
        // 16 GiB at the default 1 s / 64 MiB, ×4: 1024 s.
        assert_eq!(auto_timeout(16 << 30, None), Duration::from_secs(1024));
        assert_eq!(auto_timeout(u64::MAX, None), AUTO_TIMEOUT_CAP);
        // A measured rate of 1 s per GiB: 8 GiB → 32 s → the floor.
        let r = 1.0 / (1u64 << 30) as f64;
        assert_eq!(auto_timeout(8 << 30, Some(r)), AUTO_TIMEOUT_FLOOR);
        assert_eq!(auto_timeout(100 << 30, Some(r)), Duration::from_secs(400));
        let t = ProbeTimeout::auto();
        let fit = |bytes, seconds| ProbeRecord {
            bytes_allocated: bytes,
            seconds,
            ..ProbeRecord::new(1, Outcome::Fit, bytes)
        };
        t.observe(&fit(1 << 20, 50.0), 1 << 20); // too small to say anything
        assert_eq!(t.for_bytes(16 << 30), Duration::from_secs(1024));
        t.observe(&fit(1 << 30, 2.0), 1 << 30);
        assert_eq!(t.for_bytes(100 << 30), Duration::from_secs(800));
    }
}
