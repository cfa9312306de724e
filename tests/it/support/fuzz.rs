//! What the CLI fuzzers share: how many cases a pass runs (`OOMPROBE_FUZZ_CASES`), and one
//! bounded run of the binary judged as every input must be (exit 0 or 2, one escaped line on
//! stderr for a 2, within a time bound), with the slowest run seen kept for the report.
//!
//! CI runs a short pass ([`DEFAULT_CASES`] per fuzzer); `OOMPROBE_FUZZ_CASES=500 cargo test
//! --release --test it fuzz` runs a long one (docs/src/testing.md).

use std::io::Write;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use proptest::test_runner::Config;

/// Cases per fuzzer in CI's short pass.
pub const DEFAULT_CASES: u32 = 24;

/// A run that takes longer fails; the goal is well under a second (issue 48), the slack is for a
/// loaded two-core CI machine.
pub const RUN_BOUND: Duration = Duration::from_secs(5);

/// A run slower than this, and slower than any before it, is printed.
const SLOW_NOTE: Duration = Duration::from_secs(1);

/// Where a run that hangs is killed (it fails either way; this keeps the suite moving).
const KILL_AFTER: Duration = Duration::from_secs(20);

/// `OOMPROBE_FUZZ_CASES` when set to a number, else [`DEFAULT_CASES`].
pub fn cases() -> u32 {
    std::env::var("OOMPROBE_FUZZ_CASES")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(DEFAULT_CASES)
}

/// Whether this is a long pass (`OOMPROBE_FUZZ_CASES` above the default): fuzzers may then
/// take inputs too slow for CI's short pass.
pub fn long_pass() -> bool {
    cases() > DEFAULT_CASES
}

/// proptest's config for a fuzzer: [`cases`] cases, few shrink steps (each is a process).
pub fn config() -> Config {
    Config {
        cases: cases(),
        max_shrink_iters: 64,
        ..Config::default()
    }
}

/// The slowest run so far, in microseconds, over every fuzzer in this process.
static SLOWEST_US: AtomicU64 = AtomicU64::new(0);

/// What one run printed.
pub struct Ran {
    pub code: i32,
    pub stdout: Vec<u8>,
    pub stderr: String,
}

/// Runs `oomprobe ARGS` with `env` set (a `None` value removes the variable) and `stdin`
/// written to it, killed after [`KILL_AFTER`]. Err says why the run is not one every input
/// may give: a signal or an exit other than 0 and 2, more or less than one stderr line or a
/// raw control character on exit 2, or longer than [`RUN_BOUND`].
pub fn run(args: &[&str], env: &[(&str, Option<&str>)], stdin: &[u8]) -> Result<Ran, String> {
    run_within(RUN_BOUND, args, env, stdin)
}

/// [`run`] with another time bound (below [`KILL_AFTER`]).
pub fn run_within(
    bound: Duration,
    args: &[&str],
    env: &[(&str, Option<&str>)],
    stdin: &[u8],
) -> Result<Ran, String> {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_oomprobe"));
    cmd.args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        // No allocator settings from the machine running the tests.
        .env_remove("PYTORCH_CUDA_ALLOC_CONF")
        .env_remove("PYTORCH_ALLOC_CONF");
    for (k, v) in env {
        match v {
            Some(v) => cmd.env(k, v),
            None => cmd.env_remove(k),
        };
    }
    let _load = super::load::timed();
    let started = Instant::now();
    let mut child = cmd.spawn().map_err(|e| format!("spawn: {e}"))?;
    let mut pipe = child.stdin.take().expect("piped stdin");
    let input = stdin.to_vec();
    // A writer thread: a child that reads nothing must not block the test on a full pipe.
    let writer = std::thread::spawn(move || {
        let _ = pipe.write_all(&input);
    });
    let (tx, rx) = std::sync::mpsc::channel();
    let pid = child.id();
    let waiter = std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    let out = match rx.recv_timeout(KILL_AFTER) {
        Ok(out) => out.map_err(|e| format!("wait: {e}"))?,
        Err(_) => {
            // SAFETY: kill(2) on the child this function spawned and has not yet reaped.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            let _ = waiter.join();
            return Err(format!("still running after {KILL_AFTER:?}: killed"));
        }
    };
    let took = started.elapsed();
    let _ = writer.join();
    let _ = waiter.join();
    let before = SLOWEST_US.fetch_max(took.as_micros() as u64, Ordering::Relaxed);
    if took > SLOW_NOTE && took.as_micros() as u64 > before {
        // A long pass reports what came near the bound (seen with --nocapture).
        eprintln!("fuzz: slowest run so far {took:?}: oomprobe {args:?}");
    }
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    let Some(code) = out.status.code() else {
        return Err(format!("killed by a signal ({:?}): {stderr}", out.status));
    };
    if code != 0 && code != 2 {
        return Err(format!("exit {code}: {stderr}"));
    }
    if code == 2 {
        let lines = stderr.trim_end_matches('\n').split('\n').count();
        if lines != 1 || stderr.trim().is_empty() {
            return Err(format!("exit 2 with {lines} stderr lines: {stderr:?}"));
        }
        if stderr
            .trim_end_matches('\n')
            .contains(|c: char| c.is_control())
        {
            return Err(format!("a raw control character on stderr: {stderr:?}"));
        }
    }
    if took > bound {
        return Err(format!("took {took:?} (bound {bound:?})"));
    }
    Ok(Ran {
        code,
        stdout: out.stdout,
        stderr,
    })
}

/// The first control character of `out` other than a newline or a tab, escaped, and the line it
/// is on: what would reach a terminal as a command (issue 48: input echoed raw).
pub fn raw_control(out: &[u8]) -> Option<String> {
    let text = String::from_utf8_lossy(out);
    text.lines()
        .find(|l| l.contains(|c: char| c.is_control() && c != '\t'))
        .map(|l| l.escape_debug().to_string())
}

/// The slowest run any fuzzer made in this process (printed by each fuzzer at its end, seen
/// with `--nocapture`).
pub fn slowest() -> Duration {
    Duration::from_micros(SLOWEST_US.load(Ordering::Relaxed))
}
