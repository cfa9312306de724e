//! Probes needed to find the boundary on modelled devices: oomprobe's measuring search (the
//! default), its fit/fail search (`--search gallop`) and a Lightning-style search (double from
//! the smallest value until failure, then bisect), on the same devices. `cargo bench --bench
//! search` prints one row per case, the totals and whether the goals are met (at most a third
//! of the Lightning-style search's probes in total, at most 6 in a deterministic run), and fails
//! if a search misses a boundary on a deterministic device.
//!
//! A device here is a model, not a measurement: a card of some bytes, a driver overhead the
//! prediction does not know, 2 MiB pages, buffers under 64 MiB suballocated from 64 MiB blocks
//! (first fit, a block returned when empty), bigger ones dedicated (as wgpu's own allocator
//! does: gpu-allocator under `MemoryHints::MemoryUsage` suballocates from 8-64 MiB device
//! blocks). A probe replays the real plan of a preset (every allocation and free of the step,
//! chunked as on a GPU) on it, so the byte function, the failure points and the filler are the
//! real ones; then the replays a probe's child makes (`probe::dry`), each on a fresh device
//! (`SEARCH_FILLER=1` leaves them out: the search as it was with filler alone). A modelled
//! lavapipe under 1.5-4 GiB of address space (`search/lavapipe.rs`, from the traces of issue
//! 25) runs seq naive and flash (where filler alone took up to 17 probes, as on the real one),
//! params and batch.
//! Another edge of a device that is not monotone (a value that fits, the next refused) counts
//! as exact. Flaky devices add, by a fixed pseudo-random draw per probe, a child that crashes
//! before answering (retried) or 48 MiB that another process holds during the probe.
//! Prediction errors: the search starts at the true boundary times 1.03, 0.97, 1.2, 0.8, 2 or
//! 0.5. The same cards are then swept at 90-110 % of their bytes (other boundaries, other
//! fragmentation), totals only; `SEARCH_SCALE=0.95` prints the rows of one such sweep.
//! `SEARCH_TRACE=TEXT` prints the measuring search's probes, and the bounds each measured, for
//! the rows whose name and prediction contain TEXT.

use std::collections::HashMap;

use oomprobe::backend::{
    AllocError, Backend, BackendError, BackendKind, BufferId, DeviceInfo, DeviceType, MemoryInfo,
};
use oomprobe::kernels::KernelId;
use oomprobe::plan::Plan;
use oomprobe::probe::charge::Charge;
use oomprobe::probe::dry;
use oomprobe::probe::exec;
use oomprobe::probe::runner::search_space;
use oomprobe::probe::suite::default_runs;
use oomprobe::report::Outcome;
use oomprobe::scenario::Scenario;
use oomprobe::search::{
    find_boundary, find_boundary_charged, lightning_style, Answer, Ask, SearchOutcome, SearchSpace,
};
use oomprobe::workload::{presets, Checkpoint, Precision, Workload};

/// The `Backend` methods a modelled device answers without doing anything: its info, no
/// memory report, writes and kernels that succeed, reads of zeros (allocation bookkeeping is
/// all a model does).
macro_rules! memory_only {
    () => {
        fn info(&self) -> &DeviceInfo {
            &self.info
        }
        fn memory(&self) -> MemoryInfo {
            MemoryInfo::default()
        }
        fn write_buffer(&mut self, _: BufferId, _: u64, _: &[u8]) -> Result<(), BackendError> {
            Ok(())
        }
        fn read_buffer(&mut self, _: BufferId, _: u64, len: u64) -> Result<Vec<u8>, BackendError> {
            Ok(vec![0; len as usize])
        }
        fn dispatch(
            &mut self,
            _: KernelId,
            _: &[u8],
            _: &[BufferId],
            _: [u32; 3],
        ) -> Result<(), BackendError> {
            Ok(())
        }
        fn synchronize(&mut self) -> Result<(), BackendError> {
            Ok(())
        }
        fn allocated_bytes(&self) -> u64 {
            0
        }
    };
}

#[path = "search/lavapipe.rs"]
mod lavapipe;

const MIB: u64 = 1 << 20;
const GIB: u64 = 1 << 30;
const PAGE: u64 = 2 * MIB;
const BLOCK: u64 = 64 * MIB;
const PAGES_PER_BLOCK: u64 = BLOCK / PAGE;
/// What a real step on lavapipe holds besides its tensors (1.5-2.1 MiB measured).
const STEP_EXTRA: u64 = 2 * MIB;

/// A modelled card: allocation bookkeeping only (nothing is stored or computed).
struct Device {
    info: DeviceInfo,
    /// The card's bytes, of which the driver keeps `overhead` (and another process `transient`).
    capacity: u64,
    overhead: u64,
    transient: u64,
    dedicated: u64,
    /// Used pages of each 64 MiB block (None: returned).
    blocks: Vec<Option<u32>>,
    bufs: HashMap<u64, (Option<usize>, u64)>,
    next: u64,
}

impl Device {
    fn new(capacity: u64, overhead: u64, transient: u64) -> Self {
        Device {
            info: DeviceInfo {
                index: 0,
                name: "modelled card".into(),
                backend: BackendKind::Mock,
                device_type: DeviceType::Discrete,
                driver: "model".into(),
                memory_total_bytes: Some(capacity),
                memory_free_bytes: None,
                max_buffer_size: 4 * GIB - 2 * MIB,
                max_storage_binding_size: 2 * GIB - 1,
                overhead_bytes: None,
                kernel_overhead_bytes: None,
            },
            capacity,
            overhead,
            transient,
            dedicated: 0,
            blocks: Vec::new(),
            bufs: HashMap::new(),
            next: 1,
        }
    }

    fn used(&self) -> u64 {
        let blocks = self.blocks.iter().flatten().count() as u64;
        self.overhead + self.transient + self.dedicated + blocks * BLOCK
    }

    fn oom(bytes: u64) -> AllocError {
        AllocError::OutOfMemory {
            requested: bytes,
            detail: "modelled".into(),
        }
    }
}

impl Backend for Device {
    fn alloc_buffer(&mut self, bytes: u64) -> Result<BufferId, AllocError> {
        let pages = bytes.div_ceil(PAGE).max(1);
        let id = self.next;
        if bytes >= BLOCK {
            let need = pages * PAGE;
            if self.used() + need > self.capacity {
                return Err(Self::oom(bytes));
            }
            self.dedicated += need;
            self.bufs.insert(id, (None, need));
        } else {
            let run = ((1u64 << pages) - 1) as u32;
            let slot = self.blocks.iter().enumerate().find_map(|(b, used)| {
                let used = (*used)?;
                (0..=PAGES_PER_BLOCK - pages)
                    .map(|p| run << p)
                    .find(|m| used & m == 0)
                    .map(|m| (b, m))
            });
            let (b, mask) = match slot {
                Some(s) => s,
                None => {
                    if self.used() + BLOCK > self.capacity {
                        return Err(Self::oom(bytes));
                    }
                    let b = match self.blocks.iter().position(Option::is_none) {
                        Some(b) => b,
                        None => {
                            self.blocks.push(None);
                            self.blocks.len() - 1
                        }
                    };
                    self.blocks[b] = Some(0);
                    (b, run)
                }
            };
            self.blocks[b] = Some(self.blocks[b].unwrap_or(0) | mask);
            self.bufs.insert(id, (Some(b), u64::from(mask)));
        }
        self.next += 1;
        Ok(BufferId(id))
    }
    fn free_buffer(&mut self, id: BufferId) {
        match self.bufs.remove(&id.0) {
            Some((None, bytes)) => self.dedicated -= bytes,
            Some((Some(b), mask)) => {
                let left = self.blocks[b].unwrap_or(0) & !(mask as u32);
                self.blocks[b] = (left != 0).then_some(left);
            }
            None => {}
        }
    }
    memory_only!();
}

/// One case: a workload's scenario on a card.
struct Case {
    label: &'static str,
    workload: Workload,
    scenario: Scenario,
    /// The card's bytes, or on a modelled lavapipe its address-space limit.
    capacity: u64,
    overhead: u64,
    lavapipe: bool,
}

impl Case {
    fn plan(&self, x: u64) -> Option<Plan> {
        Plan::for_value(&self.workload, self.scenario, x).ok()
    }

    /// A fresh device, `transient` bytes of it held by another process; a real step's when
    /// `real` (a modelled lavapipe maps what the step holds besides its tensors).
    fn device(&self, transient: u64, real: bool) -> Box<dyn Backend> {
        if self.lavapipe {
            let extra = if real { STEP_EXTRA } else { 0 };
            Box::new(lavapipe::Lavapipe::new(self.capacity - transient, extra))
        } else {
            Box::new(Device::new(self.capacity, self.overhead, transient))
        }
    }

    /// Replay the plan at `ask.value` on a fresh device (with `transient` bytes of another
    /// process), measuring the room at the peak when asked, then the replays a probe's child
    /// adds (each on a fresh device; none with `SEARCH_FILLER` set, where the filler's room
    /// alone is the measurement); the answer as the runner gives it.
    fn probe(&self, ask: Ask, transient: u64) -> Answer {
        let Some(plan) = self.plan(ask.value) else {
            return Answer::bare(Outcome::Error);
        };
        let mut dev = self.device(transient, true);
        let charge = Charge::of(dev.info(), None);
        let mut rec = exec::replay_allocations(dev.as_mut(), &plan, ask.room.map(|a| (a, charge)));
        drop(dev);
        let plan_at = |x: u64| self.plan(x);
        if let Some(a) = ask
            .room
            .filter(|_| std::env::var_os("SEARCH_FILLER").is_none())
        {
            let space = search_space(self.scenario);
            let mut fresh = || Some(self.device(transient, false));
            rec.dry = dry::after_probe(&rec, &plan, a, charge, space, &plan_at, &mut fresh);
        }
        dry::answer_of(&rec, &plan, &charge, &plan_at)
    }

    /// Whether `x` fits on the undisturbed device (a plain probe, measuring nothing).
    fn fits(&self, x: u64) -> bool {
        let ask = Ask {
            value: x,
            room: None,
        };
        self.probe(ask, 0).outcome.is_fit()
    }

    /// Whether `x` fits and the next value does not, on the undisturbed device.
    fn is_edge(&self, space: SearchSpace, x: u64) -> bool {
        self.fits(x) && !self.fits(x + space.granularity)
    }

    /// The true boundary: the largest value that fits on the undisturbed device, checked by
    /// probing every value from a bracket (so a non-monotone device would show).
    fn truth(&self, space: SearchSpace) -> u64 {
        let g = space.granularity;
        let (mut lo, mut hi) = (space.min, space.min);
        while self.fits(hi) {
            lo = hi;
            hi = space.snap(hi * 2);
        }
        while hi - lo > g {
            let mid = space.snap(lo + (hi - lo) / 2);
            if self.fits(mid) {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        assert!(
            self.fits(lo) && !self.fits(lo + g),
            "{}: not a boundary at {lo}",
            self.label
        );
        lo
    }
}

/// A fixed pseudo-random draw (splitmix64) for probe `n` of a flaky run.
fn draw(seed: u64, n: u64) -> u64 {
    let mut z = seed
        .wrapping_add(n.wrapping_mul(0x9e37_79b9_7f4a_7c15))
        .wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The oracle of one run: deterministic, or flaky (1 probe in 6 crashes before answering,
/// 1 in 6 shares the card with 48 MiB of another process).
fn oracle(case: &Case, flaky: Option<u64>) -> impl FnMut(Ask) -> Answer + '_ {
    let mut n = 0;
    move |ask| {
        n += 1;
        let Some(seed) = flaky else {
            return case.probe(ask, 0);
        };
        match draw(seed, n) % 6 {
            0 => Answer::bare(Outcome::Crashed),
            1 => case.probe(ask, 48 * MIB),
            _ => case.probe(ask, 0),
        }
    }
}

/// The Lightning-style search, with a child that died retried once as oomprobe does.
fn lightning(case: &Case, space: SearchSpace, flaky: Option<u64>) -> SearchOutcome {
    let mut o = oracle(case, flaky);
    let mut extra = 0;
    let mut r = lightning_style(space, space.snap(2 * space.granularity), |x| {
        let a = o(Ask {
            value: x,
            room: None,
        })
        .outcome;
        if a.is_transient() {
            extra += 1;
            return o(Ask {
                value: x,
                room: None,
            })
            .outcome;
        }
        a
    });
    r.probes.extend((0..extra).map(|_| (0, Outcome::Crashed)));
    r
}

fn cases() -> Vec<Case> {
    let preset = |n: &str| presets::get(n).expect("preset");
    let suite = |s: Scenario, i: usize| default_runs(s).swap_remove(i).workload;
    let mut mixed = preset("dense");
    mixed.precision = Precision::Mixed;
    let mut gpt2_full = preset("gpt2");
    gpt2_full.checkpoint = Checkpoint::Full;
    vec![
        Case {
            label: "params fp32 adam, 24 GiB",
            workload: suite(Scenario::Params, 0),
            scenario: Scenario::Params,
            capacity: 24 * GIB,
            overhead: 500 * MIB,
            lavapipe: false,
        },
        Case {
            label: "params mixed adam, 80 GiB",
            workload: mixed,
            scenario: Scenario::Params,
            capacity: 80 * GIB,
            overhead: 700 * MIB,
            lavapipe: false,
        },
        Case {
            label: "batch resnet50, 16 GiB",
            workload: preset("resnet50"),
            scenario: Scenario::Batch,
            capacity: 16 * GIB,
            overhead: 400 * MIB,
            lavapipe: false,
        },
        Case {
            label: "batch gpt2 s1024, 80 GiB",
            workload: preset("gpt2"),
            scenario: Scenario::Batch,
            capacity: 80 * GIB,
            overhead: 600 * MIB,
            lavapipe: false,
        },
        Case {
            label: "batch vit-b16, 24 GiB",
            workload: preset("vit-b16"),
            scenario: Scenario::Batch,
            capacity: 24 * GIB,
            overhead: 450 * MIB,
            lavapipe: false,
        },
        Case {
            label: "batch bert-base, 12 GiB",
            workload: preset("bert-base"),
            scenario: Scenario::Batch,
            capacity: 12 * GIB,
            overhead: 300 * MIB,
            lavapipe: false,
        },
        Case {
            label: "seq naive, 24 GiB",
            workload: suite(Scenario::Seq, 0),
            scenario: Scenario::Seq,
            capacity: 24 * GIB,
            overhead: 500 * MIB,
            lavapipe: false,
        },
        Case {
            label: "seq flash, 8 GiB",
            workload: suite(Scenario::Seq, 1),
            scenario: Scenario::Seq,
            capacity: 8 * GIB,
            overhead: 350 * MIB,
            lavapipe: false,
        },
        Case {
            label: "activations gpt2 full, 40 GiB",
            workload: gpt2_full,
            scenario: Scenario::Activations,
            capacity: 40 * GIB,
            overhead: 550 * MIB,
            lavapipe: false,
        },
    ]
    .into_iter()
    .chain(lavapipe_rows(suite))
    .collect()
}

/// The modelled lavapipe (issue 25) under 1.5, 2, 3 and 4 GiB of address space: the default
/// suite's seq naive and flash (where filler alone missed on the real one), params and batch.
fn lavapipe_rows(suite: impl Fn(Scenario, usize) -> Workload) -> Vec<Case> {
    use Scenario::{Batch, Params, Seq};
    let rows: [(&'static str, Scenario, usize, u64); 16] = [
        ("seq naive, lavapipe 1.5 GiB", Seq, 0, 3 * GIB / 2),
        ("seq flash, lavapipe 1.5 GiB", Seq, 1, 3 * GIB / 2),
        ("params fp32 adam, lavapipe 1.5 GiB", Params, 0, 3 * GIB / 2),
        ("batch resnet50, lavapipe 1.5 GiB", Batch, 0, 3 * GIB / 2),
        ("seq naive, lavapipe 2 GiB", Seq, 0, 2 * GIB),
        ("seq flash, lavapipe 2 GiB", Seq, 1, 2 * GIB),
        ("params fp32 adam, lavapipe 2 GiB", Params, 0, 2 * GIB),
        ("batch resnet50, lavapipe 2 GiB", Batch, 0, 2 * GIB),
        ("seq naive, lavapipe 3 GiB", Seq, 0, 3 * GIB),
        ("seq flash, lavapipe 3 GiB", Seq, 1, 3 * GIB),
        ("params fp32 adam, lavapipe 3 GiB", Params, 0, 3 * GIB),
        ("batch resnet50, lavapipe 3 GiB", Batch, 0, 3 * GIB),
        ("seq naive, lavapipe 4 GiB", Seq, 0, 4 * GIB),
        ("seq flash, lavapipe 4 GiB", Seq, 1, 4 * GIB),
        ("params fp32 adam, lavapipe 4 GiB", Params, 0, 4 * GIB),
        ("batch resnet50, lavapipe 4 GiB", Batch, 0, 4 * GIB),
    ];
    rows.into_iter()
        .map(|(label, scenario, i, limit)| Case {
            label,
            workload: suite(scenario, i),
            scenario,
            capacity: limit,
            overhead: 0,
            lavapipe: true,
        })
        .collect()
}

/// Prediction quality: the prediction as a fraction of the true boundary.
const ERRORS: [(&str, f64); 6] = [
    ("+3%", 1.03),
    ("-3%", 0.97),
    ("+20%", 1.2),
    ("-20%", 0.8),
    ("2x", 2.0),
    ("0.5x", 0.5),
];

/// Probe counts of one sweep over the cases: [measure, gallop, lightning].
#[derive(Default)]
struct Totals {
    deterministic: [usize; 3],
    flaky: [usize; 3],
    /// Most probes the measuring search made in one deterministic run.
    worst: usize,
    /// Deterministic runs whose boundary a search missed.
    missed: Vec<String>,
}

/// Run every case on its card with `scale` times the card's bytes; print each run's row when
/// `rows`.
fn sweep(scale: f64, rows: bool) -> Totals {
    let mut t = Totals::default();
    let trace = std::env::var("SEARCH_TRACE").ok();
    for mut case in cases() {
        case.capacity = (case.capacity as f64 * scale) as u64;
        let space = search_space(case.scenario);
        let truth = case.truth(space);
        let charge = Charge::of(case.device(0, true).info(), None);
        let cost = |x: u64| case.plan(x).map(|p| charge.cost(&p));
        for (flaky, list) in [(None, &ERRORS[..]), (Some(7u64), &ERRORS[2..4])] {
            for (label, k) in list {
                let start = space.snap(((truth as f64) * k).round() as u64);
                let seed = flaky.map(|s| s ^ truth ^ start);
                let name = if flaky.is_some() {
                    format!("{} (flaky)", case.label)
                } else {
                    case.label.to_string()
                };
                let tracing = rows
                    && trace
                        .as_ref()
                        .is_some_and(|t| format!("{name} {label}").contains(t.as_str()));
                let mut inner = oracle(&case, seed);
                let traced = |a: Ask| {
                    let r = inner(a);
                    if tracing {
                        let (b, sig) = cost(a.value).unwrap_or((0, 0));
                        let b = b as i64;
                        let d = |v: Option<u64>| v.map(|v| (v as i64 - b) >> 20);
                        println!(
                            "    {} [{} MiB, sig {:x}] {:?}: at least {:?}, below {:?} MiB from its bytes",
                            a.value,
                            b >> 20,
                            sig & 0xffff,
                            r.outcome,
                            d(r.bounds.at_least),
                            d(r.bounds.below)
                        );
                    }
                    r
                };
                let ours = find_boundary_charged(space, start, cost, traced);
                let mut plain = oracle(&case, seed);
                let gallop = find_boundary(space, start, |x| {
                    plain(Ask {
                        value: x,
                        room: None,
                    })
                    .outcome
                });
                let theirs = lightning(&case, space, seed);
                let counts = [ours.probes.len(), gallop.probes.len(), theirs.probes.len()];
                // Another edge of a device that is not monotone (a modelled lavapipe's blocks)
                // is an exact answer too: its value fits and the next fails, undisturbed.
                let exact = |r: &SearchOutcome| {
                    r.max_fit == Some(truth) || r.max_fit.is_some_and(|m| case.is_edge(space, m))
                };
                let mark = |r: &SearchOutcome| match r.max_fit == Some(truth) {
                    true => "",
                    false if exact(r) => "~",
                    false => "*",
                };
                if rows {
                    println!(
                        "{name:<30} {label:>6} {truth:>12} {:>7}{} {:>7}{} {:>8}{}  {}",
                        counts[0],
                        mark(&ours),
                        counts[1],
                        mark(&gallop),
                        counts[2],
                        mark(&theirs),
                        if ours.fell_back { "yes" } else { "" }
                    );
                }
                let sums = if flaky.is_some() {
                    &mut t.flaky
                } else {
                    &mut t.deterministic
                };
                for (s, c) in sums.iter_mut().zip(counts) {
                    *s += c;
                }
                if flaky.is_none() {
                    t.worst = t.worst.max(counts[0]);
                    if !exact(&ours) || !exact(&theirs) {
                        t.missed.push(format!("{name} {label} at {scale}"));
                    }
                }
            }
        }
    }
    t
}

fn main() {
    println!(
        "{:<30} {:>6} {:>12} {:>8} {:>8} {:>9}  fell back",
        "case", "pred", "boundary", "measure", "gallop", "lightning"
    );
    let t = sweep(
        std::env::var("SEARCH_SCALE")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(1.0),
        true,
    );
    let ratio = |t: [usize; 3]| t[0] as f64 / t[2] as f64;
    let totals = t.deterministic;
    let worst = t.worst;
    println!(
        "{:<30} {:>6} {:>12} {:>8} {:>8} {:>9}  measure/lightning {:.2}, most probes in a run {worst}",
        "total (deterministic)", "", "", totals[0], totals[1], totals[2], ratio(totals)
    );
    println!(
        "{:<30} {:>6} {:>12} {:>8} {:>8} {:>9}  measure/lightning {:.2}",
        "total (flaky)",
        "",
        "",
        t.flaky[0],
        t.flaky[1],
        t.flaky[2],
        ratio(t.flaky)
    );
    println!(
        "counts include every retry and confirmation; * marks a boundary other than the true one, ~ another edge of a device that is not monotone (a fit, then a failure one value up)"
    );
    // The same cards with a little more or less memory: other boundaries, other fragmentation.
    let mut missed = t.missed;
    for scale in [0.9, 0.95, 1.05, 1.1] {
        let s = sweep(scale, false);
        println!(
            "same cards at {:>3.0}% of their bytes: deterministic {} / {} / {} probes, measure/lightning {:.2}, most {}",
            scale * 100.0,
            s.deterministic[0],
            s.deterministic[1],
            s.deterministic[2],
            ratio(s.deterministic),
            s.worst
        );
        missed.extend(s.missed);
    }
    assert!(
        missed.is_empty(),
        "boundaries missed on deterministic devices: {missed:?}"
    );
    // The goals, stated rather than asserted: the bench shows where they are not met.
    let goal = |ok: bool| if ok { "met" } else { "NOT met" };
    println!(
        "goal: total <= 1/3 of the Lightning-style search: {} ({} vs {})",
        goal(3 * totals[0] <= totals[2]),
        totals[0],
        totals[2]
    );
    println!(
        "goal: no deterministic run above 6 probes: {} (most {worst})",
        goal(worst <= 6)
    );
}
