//! How much memory a run measures against: the user's budget, the device's free memory, or on
//! CPU adapters a default cap that keeps the run inside free RAM (the kernel's OOM killer is not
//! a result anyone wants) and small enough for the suite to finish in about a minute at the
//! fill rate measured at startup, unless an address-space limit already binds first.

use std::time::Instant;

use crate::backend::{Backend, DeviceInfo, DeviceType};
use crate::plan::Plan;
use crate::scenario::Scenario;

/// Share of available RAM a CPU adapter may use by default.
pub const CPU_DEFAULT_SHARE: f64 = 0.5;

/// The capacity a run is sized against, and why.
#[derive(Debug, Clone, PartialEq)]
pub struct Capacity {
    /// The budget enforced by oomprobe itself (None: only the driver says no).
    pub budget: Option<u64>,
    /// The memory the prediction is made against.
    pub predict_against: Option<u64>,
    /// Free memory at start, where the device tells (for the fill ratio).
    pub free_at_start: Option<u64>,
    /// Lines a person should see ("CPU adapter: capped at ...").
    pub notes: Vec<String>,
}

/// Bytes of RAM available now (Linux /proc/meminfo `MemAvailable`).
pub fn ram_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// The process's address-space limit (RLIMIT_AS), if one is set.
pub fn address_space_limit() -> Option<u64> {
    #[cfg(unix)]
    {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes into the struct we pass and has no other effect.
        let rc = unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut lim) };
        if rc == 0 && lim.rlim_cur != libc::RLIM_INFINITY {
            return Some(lim.rlim_cur);
        }
        None
    }
    #[cfg(not(unix))]
    {
        None
    }
}

/// Address space this process maps now (Linux `VmSize`): what a limit leaves for tensors is
/// the limit minus this.
pub fn address_space_in_use() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = text.lines().find(|l| l.starts_with("VmSize:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// Headroom kept for pipelines, staging buffers and the driver's own allocations when a
/// prediction is made against an address-space limit.
pub const ADDRESS_SPACE_SLACK: u64 = 96 << 20;

/// Under an address-space limit, what a freshly opened device leaves for tensors: the limit
/// minus the address space this process maps once `open` has opened the device (measured, then
/// the device is dropped), minus a slack. None when there is no limit or `open` fails.
pub fn usable_under_address_space_limit<T, E>(open: impl FnOnce() -> Result<T, E>) -> Option<u64> {
    let limit = address_space_limit()?;
    let device = open().ok()?;
    let mapped = address_space_in_use()?;
    drop(device);
    Some(
        limit
            .saturating_sub(mapped)
            .saturating_sub(ADDRESS_SPACE_SLACK),
    )
}

/// Decide the capacity for a run on `device` with an optional user budget.
pub fn decide(device: &DeviceInfo, user_budget: Option<u64>) -> Capacity {
    let free = device.memory_free_bytes;
    let mut notes = Vec::new();
    if let Some(b) = user_budget {
        return Capacity {
            budget: Some(b),
            predict_against: Some(b),
            free_at_start: free,
            notes,
        };
    }
    if device.device_type == DeviceType::Cpu {
        let ram = ram_available();
        let cap = ram.map(|r| (r as f64 * CPU_DEFAULT_SHARE) as u64);
        let as_limit = address_space_limit();
        if let Some(limit) = as_limit.filter(|l| cap.is_none_or(|c| *l <= c)) {
            notes.push(format!(
                "CPU adapter under an address-space limit of {}: no cap of oomprobe's own, \
                 the driver's real OOM is the boundary",
                crate::units::fmt_bytes(limit)
            ));
            let usable = limit.saturating_sub(address_space_in_use().unwrap_or(0));
            return Capacity {
                budget: None,
                predict_against: Some(usable),
                free_at_start: free,
                notes,
            };
        }
        match cap {
            Some(c) => {
                notes.push(format!(
                    "CPU adapter: capped at {} ({}% of available RAM) so the kernel's OOM killer \
                     stays away; pass --budget to choose",
                    crate::units::fmt_bytes(c),
                    (CPU_DEFAULT_SHARE * 100.0) as u32
                ));
                Capacity {
                    budget: Some(c),
                    predict_against: Some(c),
                    free_at_start: ram,
                    notes,
                }
            }
            None => Capacity {
                budget: None,
                predict_against: device.memory_total_bytes,
                free_at_start: free,
                notes,
            },
        }
    } else {
        Capacity {
            budget: None,
            predict_against: free.or(device.memory_total_bytes),
            free_at_start: free,
            notes,
        }
    }
}

/// How long a CPU adapter's default run (no `--budget`) should take, in seconds.
pub const CPU_TARGET_SECONDS: f64 = 60.0;

/// Probes a boundary search makes when the prediction is right (start, next, and the pair
/// confirmed once more), and how many of them fit, i.e. write and verify about the capacity.
pub const PROBES_PER_RUN: usize = 4;
pub const FITS_PER_RUN: usize = 2;

/// The smallest cap a time-sized run gets: every default scenario keeps a boundary above one
/// at this size (design.md), however slow the adapter.
pub const MIN_TIME_SIZED: u64 = 256 << 20;

/// Time-sized caps are whole multiples of this, so the note and the table read cleanly.
pub const TIME_SIZED_STEP: u64 = 32 << 20;

/// Bytes of the plan the fill rate is measured on, and of the plan that warms the pipelines
/// (whose time is what every probe pays before its first byte).
pub const CALIBRATION_BYTES: u64 = 64 << 20;
const WARMUP_BYTES: u64 = 1 << 20;

/// What a probe costs on this device, measured at startup.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FillRate {
    /// Bytes allocated, written and verified per second.
    pub bytes_per_second: f64,
    /// Seconds every probe pays whatever its size: opening the device, compiling the fill and
    /// verify pipelines, starting the child.
    pub probe_overhead_seconds: f64,
}

/// A fixed allowance for starting a probe child (exec, dynamic linking), not measured.
const CHILD_START_SECONDS: f64 = 0.05;

/// Measure the fill rate with `open` (the device the probes will use): open it, run a tiny
/// touch probe (pipelines, first use), then one of `CALIBRATION_BYTES` (the rate), and drop it.
/// None when the device cannot be opened or a probe does not fit.
pub fn measure_fill_rate<E>(
    open: impl FnOnce() -> Result<Box<dyn Backend>, E>,
) -> Option<FillRate> {
    let plan = |bytes: u64| {
        let w = crate::plan::build::default_workload(Scenario::Params);
        // Model states of fp32 Adam: 16 bytes per parameter.
        Plan::for_value(&w, Scenario::Params, (bytes / 16).max(1)).ok()
    };
    let (small, big) = (plan(WARMUP_BYTES)?, plan(CALIBRATION_BYTES)?);
    let started = Instant::now();
    let mut backend = open().ok()?;
    let warm = super::exec::execute_plan(backend.as_mut(), &small, super::Compute::Touch);
    let overhead = started.elapsed().as_secs_f64();
    let timed = super::exec::execute_plan(backend.as_mut(), &big, super::Compute::Touch);
    drop(backend);
    if !(warm.outcome.is_fit() && timed.outcome.is_fit()) || timed.seconds <= 0.0 {
        return None;
    }
    Some(FillRate {
        bytes_per_second: timed.bytes as f64 / timed.seconds,
        probe_overhead_seconds: overhead + CHILD_START_SECONDS,
    })
}

/// The capacity whose `runs` searches take about `target_seconds` at `rate`: each run makes
/// `PROBES_PER_RUN` probes, `FITS_PER_RUN` of which write and verify about the capacity.
/// Rounded down to `TIME_SIZED_STEP`, never below `MIN_TIME_SIZED`.
pub fn time_sized(rate: &FillRate, runs: usize, target_seconds: f64) -> u64 {
    let probes = (runs * PROBES_PER_RUN) as f64;
    let fits = (runs * FITS_PER_RUN).max(1) as f64;
    let for_bytes = target_seconds - probes * rate.probe_overhead_seconds;
    let bytes = (rate.bytes_per_second * for_bytes / fits).max(0.0);
    let bytes = if bytes.is_finite() {
        bytes as u64
    } else {
        u64::MAX
    };
    (bytes / TIME_SIZED_STEP * TIME_SIZED_STEP).max(MIN_TIME_SIZED)
}

/// Lower a CPU adapter's default cap (`decide` without a budget) to what `runs` searches fill
/// in about `target_seconds` at `rate`, and say so and how to ask for more. A cap that already
/// fits in time, or a run under a user budget, is left as it is.
pub fn size_for_time(cap: &mut Capacity, rate: &FillRate, runs: usize, target_seconds: f64) {
    let Some(ram_cap) = cap.budget else { return };
    let sized = time_sized(rate, runs, target_seconds);
    if sized >= ram_cap {
        return;
    }
    cap.budget = Some(sized);
    cap.predict_against = Some(sized);
    cap.notes.clear();
    cap.notes.push(format!(
        "CPU adapter: capped at {} so this run takes about {:.0} s (write+verify measured at \
         {}/s); pass --budget SIZE for more, up to {} ({}% of available RAM)",
        crate::units::fmt_bytes(sized),
        target_seconds,
        crate::units::fmt_bytes(rate.bytes_per_second as u64),
        crate::units::fmt_bytes(ram_cap),
        (CPU_DEFAULT_SHARE * 100.0) as u32
    ));
}

#[cfg(test)]
mod tests {
    use super::*;

    const MIB: u64 = 1 << 20;

    fn rate(mib_per_s: f64, overhead: f64) -> FillRate {
        FillRate {
            bytes_per_second: mib_per_s * MIB as f64,
            probe_overhead_seconds: overhead,
        }
    }

    #[test]
    fn the_cap_fills_the_target_time_at_the_measured_rate() {
        // 6 runs: 24 probes at 0.5 s = 12 s fixed; 48 s of filling at 100 MiB/s over 12 fits.
        let cap = time_sized(&rate(100.0, 0.5), 6, 60.0);
        assert_eq!(cap, 384 * MIB);
        // Twice the rate, about twice the cap (rounded down to the step).
        let fast = time_sized(&rate(200.0, 0.5), 6, 60.0);
        assert_eq!(fast, 800 * MIB);
        // Predicted time of the sized run stays within the target.
        let r = rate(173.0, 0.37);
        let c = time_sized(&r, 6, 60.0);
        let t = 24.0 * r.probe_overhead_seconds + 12.0 * c as f64 / r.bytes_per_second;
        assert!(t <= 60.0 && t > 55.0, "{t}");
    }

    #[test]
    fn a_slow_device_still_gets_a_meaningful_cap() {
        assert_eq!(time_sized(&rate(1.0, 5.0), 6, 60.0), MIN_TIME_SIZED);
    }

    fn cpu_cap(ram_cap: u64) -> Capacity {
        Capacity {
            budget: Some(ram_cap),
            predict_against: Some(ram_cap),
            free_at_start: Some(2 * ram_cap),
            notes: vec!["CPU adapter: capped at half the RAM".into()],
        }
    }

    #[test]
    fn sizing_lowers_the_ram_cap_and_says_how_to_ask_for_more() {
        let mut cap = cpu_cap(11 << 30);
        size_for_time(&mut cap, &rate(100.0, 0.5), 6, 60.0);
        assert_eq!(cap.budget, Some(384 * MIB));
        assert_eq!(cap.predict_against, Some(384 * MIB));
        assert_eq!(cap.notes.len(), 1, "{:?}", cap.notes);
        assert!(cap.notes[0].contains("--budget"), "{}", cap.notes[0]);
        assert!(cap.notes[0].contains("384.00 MiB"), "{}", cap.notes[0]);
    }

    #[test]
    fn sizing_never_raises_a_cap() {
        let mut cap = cpu_cap(300 * MIB);
        let before = cap.clone();
        size_for_time(&mut cap, &rate(10_000.0, 0.1), 6, 60.0);
        assert_eq!(cap, before);
        let mut none = Capacity {
            budget: None,
            ..cpu_cap(1)
        };
        let before = none.clone();
        size_for_time(&mut none, &rate(100.0, 0.5), 6, 60.0);
        assert_eq!(none, before);
    }
}
