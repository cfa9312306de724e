//! How much memory a run measures against: the user's budget, the device's free memory, or on
//! CPU adapters a default cap that keeps the run inside free RAM (the kernel's OOM killer is not
//! a result anyone wants) and small enough for the suite to finish in about a minute at the
//! fill rate measured at startup, unless an address-space limit already binds first.

use std::time::Instant;

use crate::backend::{DeviceInfo, DeviceType};
use crate::plan::Plan;
use crate::scenario::Scenario;
use crate::workload::Workload;

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

pub use crate::backend::astrace::address_space_in_use;

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

/// A user's `--budget` on a CPU adapter, held to the host memory available (`ram`): a CPU
/// adapter's buffers are host RAM, so a budget above it invites the kernel's OOM killer, not a
/// result. Above it the budget is capped there with a warning, unless `force`. Returns the
/// budget to use and the warning.
pub fn host_guard(
    device: &DeviceInfo,
    budget: Option<u64>,
    force: bool,
    ram: Option<u64>,
) -> (Option<u64>, Option<String>) {
    match (budget, ram) {
        (Some(b), Some(r)) if device.device_type == DeviceType::Cpu && b > r && !force => (
            Some(r),
            Some(format!(
                "--budget {} is more host memory than is available ({}) and a CPU adapter's \
                 buffers are host memory: capped at {}; pass --force to use the budget anyway",
                crate::units::fmt_bytes(b),
                crate::units::fmt_bytes(r),
                crate::units::fmt_bytes(r)
            )),
        ),
        _ => (budget, None),
    }
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

/// Probes a run makes under the CPU cap: the cap is a budget oomprobe enforces, so the
/// prediction is exact and the measuring search probes the boundary and its neighbour (the
/// default suite on lavapipe: 2 probes in 5 of its 6 runs, 3 for params). Each is costed as
/// writing and verifying every byte its plan allocates at the predicted boundary.
pub const PROBES_PER_RUN: usize = 2;

/// The smallest cap a time-sized run gets: every default scenario keeps a boundary above one
/// at this size (design.md), however slow the adapter.
pub const MIN_TIME_SIZED: u64 = 256 << 20;

/// Time-sized caps are whole multiples of this, so the note and the table read cleanly.
pub const TIME_SIZED_STEP: u64 = 32 << 20;

/// Bytes of the plan the cost is measured on, and of the plan that measures the fixed cost.
pub const CALIBRATION_BYTES: u64 = 64 << 20;
const WARMUP_BYTES: u64 = 1 << 20;

/// What a probe costs on this device, measured at startup with real probes.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FillRate {
    /// Bytes allocated, written and verified per second.
    pub bytes_per_second: f64,
    /// Seconds every probe pays whatever its size: starting the child, opening the device,
    /// compiling the pipelines.
    pub probe_overhead_seconds: f64,
}

impl FillRate {
    /// Seconds one probe takes to allocate, write and verify `bytes`.
    pub fn probe_seconds(&self, bytes: u64) -> f64 {
        self.probe_overhead_seconds + bytes as f64 / self.bytes_per_second
    }

    /// The rate and fixed cost through two probes: (bytes, seconds) of a small and a large one.
    pub fn from_two(small: (u64, f64), large: (u64, f64)) -> Option<FillRate> {
        let (db, dt) = (large.0.checked_sub(small.0)? as f64, large.1 - small.1);
        if db <= 0.0 || dt <= 0.0 {
            return None;
        }
        let bytes_per_second = db / dt;
        Some(FillRate {
            bytes_per_second,
            probe_overhead_seconds: (small.1 - small.0 as f64 / bytes_per_second).max(0.0),
        })
    }
}

/// Measure what a probe costs exactly as the runs will pay it: two real probes (a child each
/// when isolated) of a params plan, one tiny (the fixed cost: child start, device open,
/// pipelines) and one of `CALIBRATION_BYTES` (the rate). None when either does not fit.
pub fn measure_probe_cost(
    isolation: &super::child::Isolation,
    device: &super::DeviceChoice,
) -> Option<FillRate> {
    let w = crate::plan::build::default_workload(Scenario::Params);
    let g = crate::search::PARAMS_GRANULARITY;
    let probe = |bytes: u64| {
        let req = super::child::ChildRequest {
            workload: w.clone(),
            scenario: Scenario::Params,
            // Model states of fp32 Adam with the foreach temporary: 20 bytes per parameter.
            value: (bytes / 20 / g).max(1) * g,
            compute: super::Compute::Touch,
            device: device.clone(),
            budget: None,
            snapshot: None,
            room: None,
        };
        let started = Instant::now();
        let rec = isolation.run(&req);
        let plan = Plan::for_value(&w, Scenario::Params, req.value).ok()?;
        rec.outcome
            .is_fit()
            .then(|| (plan.allocated_bytes(), started.elapsed().as_secs_f64()))
    };
    // The first probe also warms caches (shader cache, page cache of the binary).
    probe(WARMUP_BYTES)?;
    FillRate::from_two(probe(WARMUP_BYTES)?, probe(CALIBRATION_BYTES)?)
}

/// Seconds the runs planned for capacity `cap` take at `rate`: each run makes
/// `PROBES_PER_RUN` probes, each writing and verifying every byte its plan allocates at the
/// predicted boundary. `runs_at(cap)` gives each run's workload and scenario.
pub fn suite_seconds(
    runs: &[(Workload, Scenario)],
    cap: u64,
    rate: &FillRate,
    probes_per_run: usize,
) -> f64 {
    runs.iter()
        .map(|(w, s)| {
            let at = crate::estimate::predicted_max(w, *s, cap)
                .ok()
                .flatten()
                .unwrap_or(1);
            let bytes = Plan::for_value(w, *s, at)
                .map(|p| p.allocated_bytes())
                .unwrap_or(cap);
            probes_per_run as f64 * rate.probe_seconds(bytes)
        })
        .sum()
}

/// The largest cap whose run takes at most `target_seconds` by `seconds_at` (which grows with
/// the cap): `limit` itself when it does, else a multiple of `TIME_SIZED_STEP`, never below
/// `MIN_TIME_SIZED`.
pub fn time_sized(limit: u64, target_seconds: f64, seconds_at: impl Fn(u64) -> f64) -> u64 {
    if seconds_at(limit) <= target_seconds {
        return limit;
    }
    let (mut lo, mut hi) = (MIN_TIME_SIZED / TIME_SIZED_STEP, limit / TIME_SIZED_STEP);
    if hi <= lo {
        return MIN_TIME_SIZED;
    }
    // Invariant: lo is the floor (or fits the target); hi does not fit.
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if seconds_at(mid * TIME_SIZED_STEP) <= target_seconds {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    lo * TIME_SIZED_STEP
}

/// Lower a CPU adapter's default cap (`decide` without a budget) to what the run fills in
/// about `target_seconds` by `seconds_at`, and say so and how to ask for more. A cap that
/// already fits in time, or a run under a user budget, is left as it is.
pub fn size_for_time(
    cap: &mut Capacity,
    rate: &FillRate,
    target_seconds: f64,
    seconds_at: impl Fn(u64) -> f64,
) {
    let Some(ram_cap) = cap.budget else { return };
    let sized = time_sized(ram_cap, target_seconds, seconds_at);
    if sized >= ram_cap {
        return;
    }
    cap.budget = Some(sized);
    cap.predict_against = Some(sized);
    cap.notes.clear();
    cap.notes.push(format!(
        "CPU adapter: capped at {} so this run takes about {:.0} s (a probe measured at {}/s \
         plus {:.1} s); pass --budget SIZE for more, up to {} ({}% of available RAM)",
        crate::units::fmt_bytes(sized),
        target_seconds,
        crate::units::fmt_bytes(rate.bytes_per_second as u64),
        rate.probe_overhead_seconds,
        crate::units::fmt_bytes(ram_cap),
        (CPU_DEFAULT_SHARE * 100.0) as u32
    ));
}

#[cfg(test)]
mod tests {
    #[test]
    fn predictions_use_what_is_left_after_the_context_and_kernels() {
        use crate::backend::mock::MockBackend;
        const MIB: u64 = 1 << 20;
        let mut m = MockBackend::new(1024 * MIB).with_overhead(300 * MIB, 120 * MIB);
        let info = crate::backend::overhead::measured_info(&mut m).expect("measured");
        // Against free-after-overhead, not the total or what was free at open.
        let cap = decide(&info, None);
        assert_eq!(cap.predict_against, Some(604 * MIB));
    }

    #[test]
    fn a_budget_above_host_memory_is_capped_on_cpu_adapters_unless_forced() {
        use crate::backend::Backend;
        let mut cpu = crate::backend::mock::MockBackend::new(1 << 30)
            .info()
            .clone();
        cpu.device_type = DeviceType::Cpu;
        let ram = Some(8u64 << 30);
        let (b, w) = host_guard(&cpu, Some(1 << 40), false, ram);
        assert_eq!(b, Some(8 << 30));
        assert!(w.is_some_and(|w| w.contains("--force")));
        assert_eq!(
            host_guard(&cpu, Some(1 << 40), true, ram),
            (Some(1 << 40), None)
        );
        assert_eq!(
            host_guard(&cpu, Some(1 << 30), false, ram),
            (Some(1 << 30), None)
        );
        let mut gpu = cpu.clone();
        gpu.device_type = DeviceType::Discrete;
        assert_eq!(
            host_guard(&gpu, Some(1 << 40), false, ram),
            (Some(1 << 40), None)
        );
    }
    use super::*;

    const MIB: u64 = 1 << 20;

    fn rate(mib_per_s: f64, overhead: f64) -> FillRate {
        FillRate {
            bytes_per_second: mib_per_s * MIB as f64,
            probe_overhead_seconds: overhead,
        }
    }

    /// 24 probes, each the overhead plus twice the cap's bytes.
    fn linear(r: FillRate) -> impl Fn(u64) -> f64 {
        move |cap| 24.0 * r.probe_seconds(2 * cap)
    }

    #[test]
    fn two_probes_give_the_rate_and_the_fixed_cost() {
        let r = FillRate::from_two((MIB, 1.01), (65 * MIB, 1.65)).expect("a rate");
        assert!(
            (r.bytes_per_second - 100.0 * MIB as f64).abs() < 1.0,
            "{r:?}"
        );
        assert!((r.probe_overhead_seconds - 1.0).abs() < 1e-9, "{r:?}");
        assert_eq!(
            FillRate::from_two((MIB, 2.0), (65 * MIB, 1.0)),
            None,
            "faster when larger"
        );
        assert_eq!(FillRate::from_two((MIB, 1.0), (MIB, 2.0)), None);
    }

    #[test]
    fn the_cap_fills_the_target_time_at_the_measured_rate() {
        // 24 probes at 0.5 s = 12 s fixed; 48 s of filling 48 caps at 100 MiB/s: 100 MiB.
        let r = rate(100.0, 0.5);
        let cap = time_sized(64 << 30, 60.0, linear(r));
        assert_eq!(cap, 256 * MIB, "the floor: 100 MiB is below it");
        let r = rate(400.0, 0.5);
        let cap = time_sized(64 << 30, 60.0, linear(r));
        assert_eq!(cap, 384 * MIB, "400 MiB/s: 48 s fill 400 MiB, rounded down");
        assert!(linear(r)(cap) <= 60.0 && linear(r)(cap + TIME_SIZED_STEP) > 60.0);
        // A limit that already fits in time is kept.
        assert_eq!(time_sized(320 * MIB, 60.0, linear(r)), 320 * MIB);
    }

    #[test]
    fn a_slow_device_still_gets_a_meaningful_cap() {
        assert_eq!(
            time_sized(64 << 30, 60.0, linear(rate(1.0, 5.0))),
            MIN_TIME_SIZED
        );
    }

    #[test]
    fn the_suite_is_costed_by_the_bytes_its_plans_allocate() {
        let w = crate::workload::presets::get("tiny-gpt").expect("preset");
        let runs = vec![(w.clone(), Scenario::Batch)];
        let r = rate(100.0, 0.5);
        let small = suite_seconds(&runs, 256 * MIB, &r, 4);
        let large = suite_seconds(&runs, 1024 * MIB, &r, 4);
        assert!(small > 2.0 && large > small, "{small} {large}");
        // A step allocates more than its peak: transients come and go.
        let at = crate::estimate::predicted_max(&w, Scenario::Batch, 256 * MIB)
            .unwrap()
            .unwrap();
        let plan = Plan::for_value(&w, Scenario::Batch, at).unwrap();
        assert!(plan.allocated_bytes() > plan.peak_bytes());
        let expect = 4.0 * r.probe_seconds(plan.allocated_bytes());
        assert!((small - expect).abs() < 1e-9, "{small} {expect}");
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
        let r = rate(400.0, 0.5);
        size_for_time(&mut cap, &r, 60.0, linear(r));
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
        let r = rate(10_000.0, 0.1);
        size_for_time(&mut cap, &r, 60.0, linear(r));
        assert_eq!(cap, before);
        let mut none = Capacity {
            budget: None,
            ..cpu_cap(1)
        };
        let before = none.clone();
        let r = rate(100.0, 0.5);
        size_for_time(&mut none, &r, 60.0, linear(r));
        assert_eq!(none, before);
    }
}
