//! A plan's timeline through the caching allocator, step after step (the cache carries over):
//! the reserved curve, the reserved peak, reserved − allocated there (fragmentation), and on a
//! card of limited room the first request the allocator cannot serve.
//!
//! Step 1 replays every event; later steps replay all but the setup (model states exist). A
//! tensor still live from the step before is not allocated again (Adam state after a first
//! step, gradients kept for accumulation): it is the same tensor.

use serde::Serialize;

use super::caching::{Allocator, BlockId, Device, Oom};
use super::conf::AllocConf;
use super::device::ModelDevice;
use crate::plan::{EventKind, Phase, Plan, TensorSpec};

/// How many steps a plan is replayed for by default: the second already reuses the first's
/// cache, and by then the reserved peak has settled (later steps repeat the second's pattern).
pub const STEPS: usize = 2;

/// The most points a reserved curve keeps (each the highest of its share of the step's events,
/// so the peak is always one of them).
pub const CURVE_POINTS: usize = 256;

/// One point of the reserved curve (after an alloc or free).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ReservedPoint {
    pub step: usize,
    pub event: usize,
    pub reserved_bytes: u64,
    pub allocated_bytes: u64,
}

/// The request a card could not serve.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Failure {
    /// 1-based step.
    pub step: usize,
    pub event: usize,
    pub phase: Phase,
    pub tensor: String,
    #[serde(flatten)]
    pub oom: Oom,
    /// The step's tensors' peak less the card's capacity (0 when they fit): what the step lacks
    /// whatever the allocator does.
    pub shortage_bytes: u64,
    /// The free memory in total would have served it, and the shortage is less than the free
    /// pieces: fragmentation. A step short by more than that is a shortage (issue 47).
    pub fragmentation: bool,
}

impl Failure {
    /// `plan`'s event `event` (allocating tensor `t`) at `step` refused with `oom` on a card
    /// whose allocator may take `capacity` bytes.
    pub fn at(
        plan: &Plan,
        step: usize,
        event: usize,
        t: usize,
        capacity: Option<u64>,
        oom: Oom,
    ) -> Failure {
        let shortage = capacity.map_or(0, |c| plan.peak_bytes().saturating_sub(c));
        Failure {
            step,
            event,
            phase: plan.events[event].phase,
            tensor: plan.tensors[t].name.clone(),
            shortage_bytes: shortage,
            fragmentation: oom.fragmentation() && shortage < oom.cached_free,
            oom,
        }
    }
}

/// The allocator's view of a plan.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Replay {
    pub steps: usize,
    /// The most bytes the allocator held from the driver (`max_memory_reserved`).
    pub reserved_peak_bytes: u64,
    /// The most bytes of blocks in use (`max_memory_allocated`: rounded tensor sizes).
    pub allocated_peak_bytes: u64,
    /// Blocks in use at the moment of the reserved peak.
    pub allocated_at_reserved_peak_bytes: u64,
    /// Reserved − allocated at the reserved peak: cached, unusable for what came next.
    pub fragmentation_bytes: u64,
    /// Where the reserved peak was reached (1-based step, event index, phase).
    pub reserved_peak_step: usize,
    pub reserved_peak_event: usize,
    pub reserved_peak_phase: Option<Phase>,
    /// Segments held at the end.
    pub segments: u64,
    /// Times the allocator had to free its cache and retry.
    pub retries: u64,
    /// The first request the card could not serve (None: every step fit).
    pub failure: Option<Failure>,
    /// The reserved curve of the last step (after each alloc and free, at most
    /// [`CURVE_POINTS`] of them), empty unless asked for.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub curve: Vec<ReservedPoint>,
}

impl Replay {
    pub fn fits(&self) -> bool {
        self.failure.is_none()
    }
}

/// Ask `a` for tensor `t`'s blocks, one per PyTorch tensor it stands for
/// (`TensorSpec::blocks`); on a refusal the blocks already taken are given back.
pub(super) fn malloc_tensor(
    a: &mut Allocator,
    dev: &mut dyn Device,
    t: &TensorSpec,
) -> Result<Vec<BlockId>, Oom> {
    let mut got = Vec::new();
    for bytes in t.blocks() {
        match a.malloc(dev, bytes, t.stream.id(), None) {
            Ok(id) => got.push(id),
            Err(oom) => {
                for id in got {
                    a.free(id);
                }
                return Err(oom);
            }
        }
    }
    Ok(got)
}

/// Replay `plan` for `steps` steps through an allocator with `conf` on a card whose allocator
/// may take `capacity` bytes from the driver (None: no limit). `curve` keeps the last step's
/// reserved curve.
pub fn replay(
    plan: &Plan,
    conf: &AllocConf,
    capacity: Option<u64>,
    steps: usize,
    curve: bool,
) -> Replay {
    let mut dev = match capacity {
        Some(c) => ModelDevice::new(c, c),
        None => ModelDevice::unlimited(),
    };
    let mut a = Allocator::new(conf.clone());
    let mut live: Vec<Option<Vec<BlockId>>> = vec![None; plan.tensors.len()];
    let mut out = Replay {
        steps: steps.max(1),
        reserved_peak_bytes: 0,
        allocated_peak_bytes: 0,
        allocated_at_reserved_peak_bytes: 0,
        fragmentation_bytes: 0,
        reserved_peak_step: 1,
        reserved_peak_event: 0,
        reserved_peak_phase: None,
        segments: 0,
        retries: 0,
        failure: None,
        curve: Vec::new(),
    };
    'steps: for step in 1..=out.steps {
        for (i, e) in plan.events.iter().enumerate() {
            if step > 1 && e.phase == Phase::Setup {
                continue;
            }
            match e.kind {
                EventKind::Alloc(t) => {
                    if live[t].is_some() {
                        continue;
                    }
                    match malloc_tensor(&mut a, &mut dev, &plan.tensors[t]) {
                        Ok(ids) => live[t] = Some(ids),
                        Err(oom) => {
                            out.failure = Some(Failure::at(plan, step, i, t, capacity, oom));
                            break 'steps;
                        }
                    }
                }
                EventKind::Free(t) => match live[t].take() {
                    Some(ids) => ids.into_iter().for_each(|id| a.free(id)),
                    None => continue,
                },
                EventKind::Kernel(_) => continue,
            }
            let s = a.stats();
            if s.reserved > out.reserved_peak_bytes {
                out.reserved_peak_bytes = s.reserved;
                out.allocated_at_reserved_peak_bytes = s.allocated;
                out.reserved_peak_step = step;
                out.reserved_peak_event = i;
                out.reserved_peak_phase = Some(e.phase);
            }
            if curve && step == out.steps {
                out.curve.push(ReservedPoint {
                    step,
                    event: i,
                    reserved_bytes: s.reserved,
                    allocated_bytes: s.allocated,
                });
            }
        }
    }
    out.curve = thin(std::mem::take(&mut out.curve), CURVE_POINTS);
    let s = a.stats();
    out.allocated_peak_bytes = s.allocated_peak;
    out.fragmentation_bytes = out
        .reserved_peak_bytes
        .saturating_sub(out.allocated_at_reserved_peak_bytes);
    out.segments = s.segments;
    out.retries = s.num_alloc_retries;
    out
}

/// The least capacity `plan` fits in for `steps` steps: under a limit the allocator frees its
/// cache and retries, so it can be below the reserved peak it reaches with no limit.
pub fn least_capacity(plan: &Plan, conf: &AllocConf, steps: usize) -> u64 {
    let free = replay(plan, conf, None, steps, false);
    least_capacity_between(plan, conf, steps, 0, free.reserved_peak_bytes)
}

/// [`least_capacity`] where `lo` is known to refuse and `hi` to fit (`lo` < `hi`).
pub fn least_capacity_between(
    plan: &Plan,
    conf: &AllocConf,
    steps: usize,
    lo: u64,
    hi: u64,
) -> u64 {
    let (mut lo, mut hi) = (lo, hi);
    while hi.saturating_sub(lo) > 1 {
        let mid = lo + (hi - lo) / 2;
        if replay(plan, conf, Some(mid), steps, false).fits() {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    hi
}

/// At most `n` points: the highest (reserved, then allocated) of each of `n` equal runs.
fn thin(points: Vec<ReservedPoint>, n: usize) -> Vec<ReservedPoint> {
    if points.len() <= n {
        return points;
    }
    let per = points.len().div_ceil(n);
    points
        .chunks(per)
        .filter_map(|c| {
            c.iter()
                .copied()
                .max_by_key(|p| (p.reserved_bytes, p.allocated_bytes))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scenario::Scenario;

    #[test]
    fn the_curve_keeps_its_peak_in_at_most_256_points() {
        let p = plan(96);
        let r = replay(&p, &AllocConf::default(), None, 2, true);
        assert!(!r.curve.is_empty() && r.curve.len() <= CURVE_POINTS);
        assert!(r
            .curve
            .iter()
            .all(|c| c.step == 2 && c.reserved_bytes >= c.allocated_bytes));
        let top = r.curve.iter().map(|c| c.reserved_bytes).max().unwrap();
        // The last step's own peak (the run's may be in step 1, never above it).
        assert!(top <= r.reserved_peak_bytes && top > 0);
        assert!(r.curve.windows(2).all(|w| w[0].event < w[1].event));
    }

    fn plan(batch: u64) -> Plan {
        let mut w = crate::workload::presets::get("tiny-gpt").unwrap();
        w.batch = batch;
        Plan::for_value(&w, Scenario::Batch, batch).unwrap()
    }

    #[test]
    fn reserved_is_at_least_the_tensors_and_steps_settle() {
        let p = plan(4);
        let conf = AllocConf::default();
        let one = replay(&p, &conf, None, 1, false);
        let two = replay(&p, &conf, None, 2, false);
        let three = replay(&p, &conf, None, 3, false);
        assert!(one.reserved_peak_bytes >= p.peak_bytes(), "{one:?}");
        assert!(one.allocated_peak_bytes >= p.peak_bytes());
        assert!(two.reserved_peak_bytes >= one.reserved_peak_bytes);
        assert_eq!(three.reserved_peak_bytes, two.reserved_peak_bytes);
        assert!(one.fits() && two.fits());
    }

    #[test]
    fn a_card_below_the_reserved_peak_fails_and_says_where() {
        let p = plan(4);
        let conf = AllocConf::default();
        let free = replay(&p, &conf, None, 2, false);
        let r = replay(&p, &conf, Some(free.reserved_peak_bytes - 1), 2, false);
        let f = r.failure.expect("refused below the reserved peak");
        assert!(f.oom.reserved <= free.reserved_peak_bytes);
        assert!(!f.tensor.is_empty());
        // At the reserved peak itself it fits.
        assert!(replay(&p, &conf, Some(free.reserved_peak_bytes), 2, false).fits());
    }

    #[test]
    fn a_card_far_below_the_tensors_is_a_shortage_not_fragmentation() {
        let p = plan(4);
        let conf = AllocConf::default();
        let cap = p.peak_bytes() / 3;
        let f = replay(&p, &conf, Some(cap), 2, false)
            .failure
            .expect("refused");
        assert_eq!(f.shortage_bytes, p.peak_bytes() - cap);
        assert!(!f.fragmentation, "{f:?}");
        // Between the tensors' peak and the reserved peak nothing is short.
        let free = replay(&p, &conf, None, 2, false);
        if free.reserved_peak_bytes > p.peak_bytes() + 1 {
            let r = replay(&p, &conf, Some(free.reserved_peak_bytes - 1), 2, false);
            assert_eq!(r.failure.map(|f| f.shortage_bytes), Some(0));
        }
    }
}
