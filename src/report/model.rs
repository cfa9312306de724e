//! The result model of a probe run: what `probe --json` and `--out` write (JSON contract).

use serde::{Deserialize, Serialize};

use crate::backend::DeviceInfo;

/// Bumped only for incompatible changes; additions keep it.
pub const SCHEMA_VERSION: u32 = 1;

/// One probe's (or one run's) result. Contract names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Outcome {
    Fit,
    OutOfMemory,
    Budget,
    ExceedsLimit,
    DeviceLost,
    Killed,
    Timeout,
    /// The probe's child died by a signal (SIGSEGV, SIGABRT) or panicked while the probe was in
    /// flight, typically at the edge of memory inside the driver stack: not a fit.
    Crashed,
    /// Every tensor was allocated, written and verified, but the last-allocated buffers ran at
    /// host-link speed (or the driver counted the memory outside the device-local heap): the
    /// driver placed part of the step in system memory. Not a fit (see `probe::spill`).
    Spilled,
    /// A read-back lost what the probe wrote (zeros where a pattern was written, or a verify
    /// pass that never ran): on Metal a command buffer aborted for memory or by the watchdog
    /// reports nothing else. Possible OOM or watchdog; not a fit.
    VerifyFailed,
    Error,
}

impl Outcome {
    pub fn name(self) -> &'static str {
        match self {
            Outcome::Fit => "fit",
            Outcome::OutOfMemory => "out_of_memory",
            Outcome::Budget => "budget",
            Outcome::ExceedsLimit => "exceeds_limit",
            Outcome::DeviceLost => "device_lost",
            Outcome::Killed => "killed",
            Outcome::Timeout => "timeout",
            Outcome::Crashed => "crashed",
            Outcome::Spilled => "spilled",
            Outcome::VerifyFailed => "verify_failed",
            Outcome::Error => "error",
        }
    }
    pub fn is_fit(self) -> bool {
        self == Outcome::Fit
    }
    /// The child was killed or ran out of time: the device gave no answer, so the probe says
    /// nothing about fitting (the search never lets it move a boundary it confirmed).
    pub fn is_inconclusive(self) -> bool {
        matches!(self, Outcome::Killed | Outcome::Timeout)
    }
    /// The child died before answering (crashed, killed, timed out): worth one retry.
    pub fn is_transient(self) -> bool {
        self.is_inconclusive() || self == Outcome::Crashed
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ToolInfo {
    pub name: String,
    pub version: String,
}

impl Default for ToolInfo {
    fn default() -> Self {
        ToolInfo {
            name: env!("CARGO_PKG_NAME").to_string(),
            version: env!("CARGO_PKG_VERSION").to_string(),
        }
    }
}

/// One probe at one value.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProbeRecord {
    pub value: u64,
    pub outcome: Outcome,
    /// Bytes the plan holds at this value (all of it when it fit; requested when it failed).
    pub bytes: u64,
    /// Bytes actually allocated when the probe stopped.
    #[serde(default)]
    pub bytes_allocated: u64,
    /// The tensor whose allocation failed, if any.
    #[serde(default)]
    pub failed_tensor: Option<String>,
    /// Wall time of the whole probe.
    pub seconds: f64,
    /// Time of the compute (or touch) step alone, when it ran.
    pub step_seconds: Option<f64>,
    /// Checksum read back after the step (hex), when it fit.
    #[serde(default)]
    pub checksum: Option<String>,
    /// One-line detail for failures.
    #[serde(default)]
    pub detail: Option<String>,
    /// Additive: where in the step's timeline the probe failed.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed_at: Option<FailurePoint>,
    /// Additive: what the spill check at the step's peak measured, where it ran (see
    /// `probe::spill`); a spill makes the outcome `spilled`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spill: Option<SpillReport>,
    /// Additive: the room a fitting probe measured with filler at its peak.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub room: Option<RoomMeasurement>,
    /// Additive: where the step's own allocations, replayed unwritten after it, stopped fitting
    /// (see `probe::dry`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub dry: Option<DryBoundary>,
    /// Additive: the caching allocator's counters at the probe's end, where tensors went
    /// through it (`--allocator pytorch`): `reserved_peak` is what the card had to give.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocator: Option<crate::alloc::Stats>,
    /// Additive: the time limit the probe's child ran under (`--timeout`, or the automatic
    /// one sized from the bytes it allocates), so a `timeout` says what it ran past.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_limit_seconds: Option<f64>,
}

impl ProbeRecord {
    /// A probe at `value` holding `bytes` with `outcome`, nothing else known yet: no bytes
    /// allocated, no time, no detail, no measurement.
    pub fn new(value: u64, outcome: Outcome, bytes: u64) -> Self {
        ProbeRecord {
            value,
            outcome,
            bytes,
            bytes_allocated: 0,
            failed_tensor: None,
            seconds: 0.0,
            step_seconds: None,
            checksum: None,
            detail: None,
            failed_at: None,
            spill: None,
            room: None,
            dry: None,
            allocator: None,
            time_limit_seconds: None,
        }
    }

    /// A probe that failed before its timeline ran (no plan, no device, kernels not prepared),
    /// `started` when it began.
    pub fn failed(
        value: u64,
        bytes: u64,
        outcome: Outcome,
        detail: String,
        started: std::time::Instant,
    ) -> Self {
        ProbeRecord {
            seconds: started.elapsed().as_secs_f64(),
            detail: Some(detail),
            ..ProbeRecord::new(value, outcome, bytes)
        }
    }
}

/// The room left at a probe's peak, measured with filler (see `probe::room`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoomMeasurement {
    /// Index into the plan's events: the allocation that reaches the peak (measured just
    /// before it).
    pub event: usize,
    /// Bytes the plan held live then.
    pub live_bytes: u64,
    /// Filler bytes the device accepted on top.
    pub room_bytes: u64,
    /// The least further filler the device refused on top of `room_bytes` (null: the limit
    /// came first).
    pub refused_bytes: Option<u64>,
    /// The filler's chunk size (the plan's chunk at its peak).
    pub chunk_bytes: u64,
    /// The most filler the search asked for.
    pub limit_bytes: u64,
}

/// The point of the timeline where a probe failed.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct FailurePoint {
    /// Index into the plan's events.
    pub event: usize,
    pub phase: crate::plan::Phase,
    /// Bytes the plan held live just before the failing event.
    pub live_bytes: u64,
    /// Bytes the failing allocation asked for (0 when a kernel or a read-back failed).
    pub requested_bytes: u64,
    /// Additive: the most bytes the plan held at once before the failing event (the device
    /// held all of them).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_live_bytes: Option<u64>,
}

/// One scenario's search.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunResult {
    pub scenario: crate::scenario::Scenario,
    pub dimension: String,
    /// A label telling runs of one scenario apart, e.g. "naive", "flash", "checkpoint full".
    #[serde(default)]
    pub variant: Option<String>,
    pub workload: crate::workload::Workload,
    pub max_fit: Option<u64>,
    pub first_fail: Option<u64>,
    pub fail_reason: Option<Outcome>,
    pub bytes_at_max_fit: Option<u64>,
    pub predicted_max: Option<u64>,
    /// The memory the run measured against at its start (budget, or free memory).
    #[serde(default)]
    pub capacity_bytes: Option<u64>,
    /// bytes_at_max_fit / free memory at start (fill ratio), where free memory is known.
    #[serde(default)]
    pub fill_ratio: Option<f64>,
    /// Share of activations (incl. attention) in the plan at max fit.
    #[serde(default)]
    pub activation_share: Option<f64>,
    /// Set when the run is one probe at a chosen value (`--at X`), not a boundary search.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub at: Option<u64>,
    /// True when a fit was seen above a failure (non-monotone device behaviour).
    #[serde(default)]
    pub flaky: bool,
    /// Additive: the capacity the probes measured (bytes as the device charges them, every
    /// chunk in whole pages: at least this much fit at once), where their measurements agree.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub measured_capacity_bytes: Option<u64>,
    /// Additive: the measured capacity's upper bound (less than this fits).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub measured_capacity_below: Option<u64>,
    /// Additive: what the device kept for itself beyond what the prediction assumed:
    /// `capacity_bytes` minus `measured_capacity_bytes` (negative when more fit than assumed).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_overhead_bytes: Option<i64>,
    #[serde(default)]
    pub notes: Vec<String>,
    pub probes: Vec<ProbeRecord>,
    /// Additive (`--repeat N`): the boundary's values probed again in fresh children after
    /// the search, with how often each fit.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub repeats: Vec<Repeat>,
    pub seconds: f64,
    /// True in a snapshot written while the run was still searching (`--out` of a run that was
    /// stopped half way): its max fit is only the largest fit seen so far, not a boundary.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub in_progress: bool,
}

/// One value probed again after a search (`--repeat`): of `tries` fresh probes, `fits` fit.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Repeat {
    pub value: u64,
    pub tries: u32,
    pub fits: u32,
    /// Each probe's outcome, in order.
    pub outcomes: Vec<Outcome>,
}

impl RunResult {
    /// The run was not finished when it was written (also understood from files written
    /// before the `in_progress` field existed, whose partial runs carry the note).
    pub fn is_partial(&self) -> bool {
        self.in_progress || self.notes.iter().any(|n| n == IN_PROGRESS_NOTE)
    }
}

/// The note of a run that was not finished when written.
pub const IN_PROGRESS_NOTE: &str = "in progress";

/// A whole `probe` invocation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ProbeReport {
    pub schema_version: u32,
    pub tool: ToolInfo,
    pub device: DeviceInfo,
    pub budget_bytes: Option<u64>,
    /// "full" or "touch".
    #[serde(default)]
    pub compute: Option<String>,
    pub runs: Vec<RunResult>,
    /// True in a snapshot written while the probe was still running: runs may be missing and
    /// the last one may be partial.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub in_progress: bool,
}

/// What the spill check measured (additive JSON: `probes[].spill`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SpillReport {
    /// Bytes written and read on each side.
    pub sample_bytes: u64,
    /// Fastest write + read of the first-allocated buffers, seconds.
    pub first_seconds: f64,
    /// Fastest write + read of the last-allocated buffers, seconds.
    pub last_seconds: f64,
    /// "device" (the backend's device clock) or "wall".
    pub clock: String,
    /// Heap usage when the probe started and at the peak, where the API reports it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heap_start: Option<crate::backend::HeapUsage>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub heap_peak: Option<crate::backend::HeapUsage>,
    pub spilled: bool,
    /// One line: the verdict and why.
    pub reason: String,
}

impl SpillReport {
    /// last / first (1.0 when the first side took no measurable time).
    pub fn ratio(&self) -> f64 {
        if self.first_seconds > 0.0 {
            self.last_seconds / self.first_seconds
        } else {
            1.0
        }
    }
}

/// What the replays found: the largest value whose allocations the device took, and the
/// smallest above it that it refused (None where the replays did not reach one), with the
/// reserve they were made under.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DryBoundary {
    pub fits: Option<u64>,
    pub fails: Option<u64>,
    /// Bytes held on the device before each replay.
    pub reserve_bytes: u64,
    /// Replays made (the reserve's calibration included).
    pub replays: u32,
}
