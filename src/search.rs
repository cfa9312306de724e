//! Boundary search over an oracle. Pure logic, tested with mock oracles.
//!
//! Two searches share the probing rules below. [`find_boundary_charged`] (the default, and
//! [`find_boundary_measured`] without the page signature) reads what each probe measured about
//! the device's capacity (the room filler found at a fit's peak or right after a refusal),
//! inverts the plan's bytes per value to the boundary, probes that value and its neighbour, and
//! when the measurements and the probes disagree bisects over the values where the device's
//! charge changes. [`find_boundary`] only sees fit or fail: it starts at the prediction,
//! gallops to bracket the boundary, bisects, then confirms the pair once more.
//!
//! A child that died before answering (`crashed`, `killed`, `timeout`) is probed once more at
//! the same value. Any outcome other than `Fit` steers the search like a failure, and the first
//! failure's reason is what the run reports. A `crashed` probe counts as not fitting. A `killed`
//! or `timeout` probe is inconclusive: the device said nothing, so it never lowers the boundary
//! below a fit seen above it, and when the bracket's upper end is inconclusive the search steps
//! over it to look for a real answer above.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::report::Outcome;

/// What probes measured about the device's capacity, in the plan's bytes (the bytes a plan's
/// tensors may hold at once): at least `at_least`, less than `below`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Bounds {
    pub at_least: Option<u64>,
    pub below: Option<u64>,
}

impl Bounds {
    /// Both sets of bounds at once (the larger lower bound, the smaller upper bound).
    pub fn meet(self, o: Bounds) -> Bounds {
        let pick = |a: Option<u64>, b: Option<u64>, f: fn(u64, u64) -> u64| match (a, b) {
            (Some(a), Some(b)) => Some(f(a, b)),
            (a, b) => a.or(b),
        };
        Bounds {
            at_least: pick(self.at_least, o.at_least, u64::max),
            below: pick(self.below, o.below, u64::min),
        }
    }
    /// Some capacity satisfies both bounds.
    pub fn is_consistent(&self) -> bool {
        match (self.at_least, self.below) {
            (Some(a), Some(b)) => a < b,
            _ => true,
        }
    }

    /// Both sets of bounds, where they agree within a thousandth of the capacity (the device
    /// rounds what it charges: bounds that cross by that little touch instead); None where they
    /// disagree.
    fn meet_close(self, o: Bounds) -> Option<Bounds> {
        let n = self.meet(o);
        match (n.at_least, n.below) {
            _ if n.is_consistent() => Some(n),
            (Some(a), Some(b)) if a - b <= a >> 10 => Some(Bounds {
                at_least: Some(b.saturating_sub(1)),
                below: Some(b),
            }),
            _ => None,
        }
    }
}

/// How much room a fitting probe should measure with filler at its peak: at most `limit` bytes
/// (what the search needs to know), resolved to `step` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct RoomAsk {
    pub limit: u64,
    pub step: u64,
    /// Bytes a replay of the plan holds besides its tensors (what a real step holds that a
    /// replay does not; the runner passes on the latest a probe measured).
    #[serde(default)]
    pub reserve: u64,
}

/// One probe the search asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ask {
    pub value: u64,
    /// None: only fit or fail (retries and the fallback's probes measure nothing).
    pub room: Option<RoomAsk>,
}

/// A probe's answer: its outcome and what it measured about the capacity.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Answer {
    pub outcome: Outcome,
    pub bounds: Bounds,
    /// The bounds are where the step's own allocations, replayed, stopped fitting (the
    /// boundary itself, measured), not a capacity measured at this value: no drift is drawn
    /// through them (a replay measured from far below can be off by more than one from near,
    /// and a line through both aims past the boundary).
    pub replayed: bool,
}

impl Answer {
    /// An answer that measured nothing.
    pub fn bare(outcome: Outcome) -> Self {
        Answer::measured(outcome, Bounds::default())
    }

    /// An answer with the capacity it measured at its value.
    pub fn measured(outcome: Outcome, bounds: Bounds) -> Self {
        Answer {
            outcome,
            bounds,
            replayed: false,
        }
    }
}

/// Where and how finely to search.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SearchSpace {
    /// Smallest value worth probing (usually 1, or one granule).
    pub min: u64,
    /// Largest value the search will probe ("beyond any sane maximum" stops here).
    pub max: u64,
    /// Values are multiples of this (1 for batch and seq).
    pub granularity: u64,
}

impl SearchSpace {
    pub fn unit(max: u64) -> Self {
        SearchSpace {
            min: 1,
            max,
            granularity: 1,
        }
    }

    /// Round down to the grid and clamp into [min, max].
    pub fn snap(&self, x: u64) -> u64 {
        let g = self.granularity.max(1);
        let x = x.clamp(self.min, self.max);
        let snapped = x / g * g;
        snapped.max(self.min)
    }
}

/// What the search found.
#[derive(Debug, Clone, PartialEq)]
pub struct SearchOutcome {
    /// Largest value seen to fit such that the next grid value failed (None: nothing fits).
    pub max_fit: Option<u64>,
    /// Smallest value seen to fail above `max_fit` (None: everything up to `max` fits).
    pub first_fail: Option<u64>,
    /// The failure reason at `first_fail`.
    pub fail_reason: Option<Outcome>,
    /// Every probe in the order it ran (value, outcome); confirmations appear twice.
    pub probes: Vec<(u64, Outcome)>,
    /// A fit was seen above a failure (the device is not monotone, or a probe was flaky).
    pub flaky: bool,
    /// Values whose only answers were inconclusive (killed, timeout), in ascending order.
    pub inconclusive: Vec<u64>,
    /// The capacity the probes measured, where their measurements agree (plan bytes).
    pub capacity: Bounds,
    /// The measuring search fell back to galloping and bisecting (measurements and probes
    /// disagreed, or nothing was measured).
    pub fell_back: bool,
}

/// The probes run so far, the first answer seen at each value, and every answer's bounds.
struct Prober<F> {
    oracle: F,
    space: SearchSpace,
    probes: Vec<(u64, Outcome)>,
    seen: BTreeMap<u64, Outcome>,
    answers: Vec<(u64, Answer)>,
}

impl<F: FnMut(Ask) -> Answer> Prober<F> {
    fn new(space: SearchSpace, oracle: F) -> Self {
        Prober {
            oracle,
            space,
            probes: Vec::new(),
            seen: BTreeMap::new(),
            answers: Vec::new(),
        }
    }

    /// Probe `x` measuring nothing; true if it fit.
    fn run(&mut self, x: u64) -> bool {
        self.ask(Ask {
            value: x,
            room: None,
        })
    }

    /// Probe as asked (once more, without filler, if the child died before answering); true
    /// if it fit.
    fn ask(&mut self, ask: Ask) -> bool {
        let x = ask.value;
        let mut a = (self.oracle)(ask);
        self.probes.push((x, a.outcome));
        self.answers.push((x, a));
        if a.outcome.is_transient() {
            a = (self.oracle)(Ask {
                value: x,
                room: None,
            });
            self.probes.push((x, a.outcome));
            self.answers.push((x, a));
        }
        let o = a.outcome;
        // A later fit does not erase a failure seen at the same value; an inconclusive answer
        // never replaces a real one, and a real one replaces it.
        self.seen
            .entry(x)
            .and_modify(|prev| {
                if (prev.is_fit() && !o.is_inconclusive()) || prev.is_inconclusive() {
                    *prev = o
                }
            })
            .or_insert(o);
        o.is_fit()
    }

    fn inconclusive_at(&self, x: Option<u64>) -> bool {
        x.and_then(|x| self.seen.get(&x))
            .is_some_and(|o| o.is_inconclusive())
    }

    /// Strides: one granule first (a good prediction is right there), then `wide`, doubling.
    fn next_stride(&self, stride: u64, wide: u64) -> u64 {
        let g = self.space.granularity.max(1);
        if stride == g {
            wide.max(2 * g)
        } else {
            stride.saturating_mul(2)
        }
    }

    /// From a fitting value, step up until a failure: (last fit, first failure or None).
    fn gallop_up(&mut self, from: u64, wide: u64) -> (Option<u64>, Option<u64>) {
        let mut lo = from;
        let mut stride = self.space.granularity.max(1);
        while lo < self.space.max {
            let x = self.space.snap(lo.saturating_add(stride));
            if x <= lo {
                break;
            }
            if !self.run(x) {
                return (Some(lo), Some(x));
            }
            lo = x;
            stride = self.next_stride(stride, wide);
        }
        (Some(lo), None)
    }

    /// From a failing value, step down until a fit: (fit or None, lowest failure).
    fn gallop_down(&mut self, from: u64, wide: u64) -> (Option<u64>, Option<u64>) {
        let mut hi = from;
        let mut stride = self.space.granularity.max(1);
        while hi > self.space.min {
            let x = self.space.snap(hi.saturating_sub(stride));
            if x >= hi {
                break;
            }
            if self.run(x) {
                return (Some(x), Some(hi));
            }
            hi = x;
            stride = self.next_stride(stride, wide);
        }
        (None, Some(hi))
    }

    /// Narrow a (fit, failure) pair to adjacent grid values.
    fn bisect(&mut self, mut lo: u64, mut hi: u64) -> (u64, u64) {
        let g = self.space.granularity.max(1);
        while hi - lo > g {
            let mid = self.space.snap(lo + (hi - lo) / 2);
            let mid = if mid <= lo { lo + g } else { mid };
            if mid >= hi {
                break;
            }
            if self.run(mid) {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        (lo, hi)
    }
}

/// The wide stride: a few percent of the prediction, at least one granule.
fn wide_stride(space: SearchSpace, start: u64) -> u64 {
    let g = space.granularity.max(1);
    (start / 32).max(g) / g * g
}

impl<F: FnMut(Ask) -> Answer> Prober<F> {
    /// The bracket the answers so far give: the largest value that fit below the lowest real
    /// failure, and that failure (inconclusive answers are neither).
    fn bracket(&self) -> (Option<u64>, Option<u64>) {
        let failed = |o: &Outcome| !o.is_fit() && !o.is_inconclusive();
        let fail = self.seen.iter().find(|(_, o)| failed(o)).map(|(x, _)| *x);
        let fit = self
            .seen
            .range(..fail.unwrap_or(u64::MAX))
            .filter(|(_, o)| o.is_fit())
            .map(|(x, _)| *x)
            .next_back();
        (fit, fail)
    }

    /// The bracket is the boundary: adjacent fit and failure, everything up to the maximum fit,
    /// or nothing down to the minimum.
    fn settled(&self) -> bool {
        let g = self.space.granularity.max(1);
        match self.bracket() {
            (Some(f), Some(u)) => u - f <= g,
            (Some(f), None) => f >= self.space.snap(self.space.max),
            (None, Some(u)) => u <= self.space.min,
            (None, None) => false,
        }
    }

    /// Bisect a bracket, confirm its pair once more (searching below a fit that does not hold,
    /// stepping over an inconclusive upper end) and assemble the result.
    fn finish(mut self, mut lo: Option<u64>, mut hi: Option<u64>, wide: u64) -> SearchOutcome {
        // Bisect, then confirm the pair once more. If the fit does not hold on confirmation,
        // search again below it (a few rounds at most); every answer stays in `seen`.
        for _round in 0..3 {
            let (Some(l0), Some(h0)) = (lo, hi) else {
                break;
            };
            let (l, h) = self.bisect(l0, h0);
            let lo_holds = self.run(l) || self.seen.get(&l).is_some_and(|o| o.is_fit());
            self.run(h);
            if lo_holds {
                (lo, hi) = (Some(l), Some(h));
                break;
            }
            (lo, hi) = self.gallop_down(l, wide);
        }

        // A killed or timed-out upper end says nothing: step over it (a few times at most) and
        // look for a real answer above, then narrow that bracket as before.
        for _round in 0..3 {
            let (Some(_), Some(h0)) = (lo, hi) else {
                break;
            };
            if !self.inconclusive_at(Some(h0)) {
                break;
            }
            let (l, h) = self.gallop_up(h0, wide);
            match (l, h) {
                (Some(l), Some(h)) if l > h0 => {
                    let (l, h) = self.bisect(l, h);
                    self.run(l);
                    self.run(h);
                    (lo, hi) = (Some(l), Some(h));
                }
                (_, h) => hi = h.or(hi),
            }
        }
        assemble(&self.seen, self.probes, hi)
    }
}

/// Find the boundary. `oracle(x)` runs one probe at `x` and returns its outcome.
/// `start` is the predicted maximum (clamped to the space).
pub fn find_boundary<F>(space: SearchSpace, start: u64, mut oracle: F) -> SearchOutcome
where
    F: FnMut(u64) -> Outcome,
{
    let mut p = Prober::new(space, |a: Ask| Answer::bare(oracle(a.value)));
    let start = space.snap(start.max(space.min));
    let wide = wide_stride(space, start);
    let (lo, hi) = if p.run(start) {
        p.gallop_up(start, wide)
    } else {
        p.gallop_down(start, wide)
    };
    p.finish(lo, hi, wide)
}

/// Most probes the measuring search places by measurement before it falls back.
const MAX_GUIDED: usize = 8;
/// Probes whose outcome the measurements got wrong before the search stops trusting them.
const MAX_MISSES: usize = 3;
/// The finest room worth resolving, whatever the plan's step.
pub const MIN_ROOM_STEP: u64 = 64 << 10;

/// Which measurements still count: after a probe the measurements got wrong, the bounds on
/// that side from the answers before it count only as their outcomes.
#[derive(Debug, Clone, Copy, Default)]
struct Trust {
    /// Measured lower bounds count from this answer on (one said a value fits that did not).
    at_least_from: usize,
    /// Measured upper bounds count from this answer on (one said a value fails that fit).
    below_from: usize,
}

impl Trust {
    /// Answer `i` as far as it is trusted.
    fn of(&self, i: usize, a: &Answer) -> Answer {
        Answer {
            bounds: Bounds {
                at_least: a.bounds.at_least.filter(|_| i >= self.at_least_from),
                below: a.bounds.below.filter(|_| i >= self.below_from),
            },
            ..*a
        }
    }
}

/// Most values the search scans for where the device's charge changes.
const MAX_SCAN: u64 = 1024;

/// The plan's bytes per value (its peak) and charge signature, memoised, and their inverse.
struct PlanBytes<B> {
    bytes: B,
    memo: BTreeMap<u64, Option<(u64, u64)>>,
    space: SearchSpace,
}

impl<B: FnMut(u64) -> Option<(u64, u64)>> PlanBytes<B> {
    fn cost(&mut self, x: u64) -> Option<(u64, u64)> {
        if let Some(b) = self.memo.get(&x) {
            return *b;
        }
        let b = (self.bytes)(x);
        self.memo.insert(x, b);
        b
    }

    fn at(&mut self, x: u64) -> Option<u64> {
        self.cost(x).map(|c| c.0)
    }

    /// Where to split a bracket (`lo` fit, `hi` failed): a device that charges in pages
    /// charges two values of one signature alike, so the first failure is `hi` or a value
    /// whose signature differs from the one below. The middle of those candidates; the plain
    /// middle when the bracket is too wide to scan.
    fn split(&mut self, lo: u64, hi: u64) -> u64 {
        let s = self.space;
        let g = s.granularity.max(1);
        let n = (hi - lo) / g;
        if n > MAX_SCAN {
            let mid = s.snap(lo + (hi - lo) / 2);
            return if mid <= lo { lo + g } else { mid };
        }
        let sig = |me: &mut Self, x: u64| me.cost(x).map(|c| c.1);
        // Where the first failure may be: `hi`, or a change below it.
        let mut firsts: Vec<u64> = (1..n)
            .map(|k| lo + k * g)
            .filter(|&x| sig(self, x) != sig(self, x - g))
            .collect();
        firsts.push(hi);
        // Probing a candidate halves them (a fit rules out it and those below); the one below
        // `hi` when only `hi` is left.
        match firsts[(firsts.len() - 1) / 2] {
            x if x == hi => hi - g,
            x => x,
        }
    }

    /// The largest value of the space whose bytes are at most `c` (None: not even the
    /// smallest). The bytes are non-decreasing in the value.
    fn invert(&mut self, c: u64) -> Option<u64> {
        let s = self.space;
        let g = s.granularity.max(1);
        let mut fits = |x: u64| self.at(x).is_some_and(|b| b <= c);
        if !fits(s.min) {
            return None;
        }
        let top = s.snap(s.max);
        if fits(top) {
            return Some(top);
        }
        // fits(lo), !fits(hi)
        let (mut lo, mut hi) = (s.min, top);
        while hi - lo > g {
            let mid = s.snap(lo + (hi - lo) / 2);
            let mid = if mid <= lo { lo + g } else { mid };
            if mid >= hi {
                break;
            }
            if fits(mid) {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        Some(lo)
    }

    /// The bounds an answer at `x` sets: what it measured, and what its outcome says by itself
    /// (a fit held the plan's peak; a failure could not).
    fn bounds_of(&mut self, x: u64, a: &Answer) -> Bounds {
        let own = if a.outcome.is_fit() {
            Bounds {
                at_least: self.at(x),
                below: None,
            }
        } else if a.outcome.is_inconclusive() {
            Bounds::default()
        } else {
            Bounds {
                at_least: None,
                below: self.at(x),
            }
        };
        own.meet(a.bounds)
    }

    /// What the answers agree on, newest first (of an answer that contradicts newer ones only
    /// its outcome counts, or nothing), the largest lower bound among them that a fit set, and
    /// whether all of them agree.
    fn agreed(&mut self, answers: &[(u64, Answer)], trust: Trust) -> (Bounds, Option<u64>, bool) {
        let mut b = Bounds::default();
        let mut by_fit: Option<u64> = None;
        let mut all = true;
        for (i, (x, a)) in answers.iter().enumerate().rev() {
            let mut kept = self.bounds_of(*x, &trust.of(i, a));
            let n = b.meet_close(kept).or_else(|| {
                all = false;
                kept = self.bounds_of(*x, &Answer::bare(a.outcome));
                b.meet_close(kept)
            });
            if let Some(n) = n {
                b = n;
                if a.outcome.is_fit() {
                    by_fit = by_fit.max(kept.at_least.map(|k| k.min(n.at_least.unwrap_or(k))));
                }
            }
        }
        (b, by_fit, all)
    }

    /// Where the newest two fits put the boundary when the capacity they measured grew with the
    /// value (a CPU adapter's address space, a driver's pools): the
    /// bytes where a line through their (bytes, capacity) meets the bytes themselves. None
    /// unless it grew, by less than the bytes did (a line that never meets them). Measurements
    /// it explains are used even where a miss made them untrusted.
    fn drift(&mut self, answers: &[(u64, Answer)]) -> Option<u64> {
        // Fits only: a refusal's room is taken in another state (where the step failed).
        let mut measured = answers
            .iter()
            .rev()
            .filter(|(_, a)| a.outcome.is_fit() && !a.replayed)
            .filter_map(|(x, a)| Some((self.at(*x)?, a.bounds.at_least?)));
        let (b2, c2) = measured.next()?;
        let (b1, c1) = measured.find(|(b, _)| *b < b2)?;
        let s = (c2 as f64 - c1 as f64) / (b2 as f64 - b1 as f64);
        if !(s > 0.0 && s < 0.9) {
            return None;
        }
        let b = (c2 as f64 - s * b2 as f64) / (1.0 - s);
        (b > 0.0).then_some(b as u64)
    }

    /// Whether every answer at the values `f` and `u` agrees on one capacity.
    fn pair_agrees(&mut self, answers: &[(u64, Answer)], f: Option<u64>, u: Option<u64>) -> bool {
        let mut b = Some(Bounds::default());
        for (x, a) in answers {
            if Some(*x) == f || Some(*x) == u {
                let own = self.bounds_of(*x, a);
                b = b.and_then(|b| b.meet_close(own));
            }
        }
        b.is_some()
    }

    /// The room worth measuring at `x`: up to the bytes of twice `x`, resolved to a quarter of
    /// the plan's next step.
    fn room_ask(&mut self, x: u64) -> Option<RoomAsk> {
        let s = self.space;
        let b = self.at(x)?;
        let step = self
            .at(s.snap(x.saturating_add(s.granularity.max(1))))
            .map_or(MIN_ROOM_STEP, |n| {
                (n.saturating_sub(b) / 4).max(MIN_ROOM_STEP)
            });
        let reach = self
            .at(s.snap(x.saturating_mul(2)))
            .unwrap_or(b.saturating_mul(2));
        // Not clipped by the upper bound met so far: a probe whose filler reaches its limit
        // proves only a lower bound, and capacity measured at another value drifts
        // (fragmentation, a CPU adapter's address space); filler never written costs little.
        let limit = reach.saturating_sub(b);
        // Even a value the bounds say fails measures a step: a refusal is measured too.
        Some(RoomAsk {
            limit: limit.max(step),
            step,
            reserve: 0,
        })
    }
}

/// Find the boundary from what the probes measure. `bytes(x)` is the plan's peak at `x` (None
/// where it cannot be built), non-decreasing in `x`; `oracle(ask)` runs one probe and returns
/// its outcome and the capacity bounds it measured. `start` is the predicted maximum.
///
/// Each probe's bounds (and its outcome: a fit held the plan's peak, a failure could not) are
/// met, newest first; the next probe is the largest value whose bytes fit under the measured
/// lower bound, kept inside the bracket of values seen to fit and fail (just above the largest
/// fit when the measurement says that is the boundary). The search ends on an adjacent fit and
/// failure, as the bisection does; that pair is the confirmation when its own answers agree on
/// one capacity. When they do not, when the measurements are wrong twice about a probe, or
/// measure nothing, it gallops and bisects from the bracket and confirms the pair once more.
pub fn find_boundary_measured<B, F>(
    space: SearchSpace,
    start: u64,
    mut bytes: B,
    oracle: F,
) -> SearchOutcome
where
    B: FnMut(u64) -> Option<u64>,
    F: FnMut(Ask) -> Answer,
{
    find_boundary_charged(space, start, |x| bytes(x).map(|b| (b, b)), oracle)
}

/// [`find_boundary_measured`] where `cost(x)` gives the plan's peak bytes at `x` and a
/// signature of what the device is charged (every tensor's pages): values of one signature
/// are charged alike, so bisection skips the values between the signature's changes.
pub fn find_boundary_charged<C, F>(
    space: SearchSpace,
    start: u64,
    cost: C,
    oracle: F,
) -> SearchOutcome
where
    C: FnMut(u64) -> Option<(u64, u64)>,
    F: FnMut(Ask) -> Answer,
{
    let g = space.granularity.max(1);
    let mut p = Prober::new(space, oracle);
    let mut plan = PlanBytes {
        bytes: cost,
        memo: BTreeMap::new(),
        space,
    };
    let start = space.snap(start.max(space.min));
    let wide = wide_stride(space, start);
    let mut next = Some((start, None::<bool>));
    let mut misses = 0;
    // A lower bound set by a refusal (fewer and smaller buffers live than at a peak, whose
    // rounding the device charged less) is aimed under by 1/2^shift, twice as far per miss.
    let mut shift = 5;
    let mut trust = Trust::default();
    // A value a refusal's measurement pinned as the boundary: the value above it is probed
    // next whatever its own room says (a device that packs small buffers into blocks can need
    // a new block one value up, which no room measured below shows).
    let mut edge = None;
    // The last probe the measurements got wrong was expected to fit and failed.
    let mut overshot = false;
    // The value below a failure was probed after an overshoot (once a search).
    let mut stepped_below = false;
    for _ in 0..MAX_GUIDED {
        let Some((x, expect)) = next.take() else {
            break;
        };
        let room = plan.room_ask(x);
        let before = p.answers.len();
        let fit = p.ask(Ask { value: x, room });
        if p.inconclusive_at(Some(x)) {
            break;
        }
        if expect.is_some_and(|e| e != fit) {
            // The measurements that placed this probe were wrong on one side: from now on only
            // newer ones count there.
            if fit {
                trust.below_from = before;
            } else {
                trust.at_least_from = before;
            }
            overshot = !fit;
            misses += 1;
            shift = (shift - 1).max(1);
            if misses >= MAX_MISSES {
                break;
            }
        }
        if p.settled() {
            break;
        }
        if fit && edge.take() == Some(x) && !p.seen.contains_key(&(x + g)) && x + g <= space.max {
            next = Some((x + g, Some(false)));
            continue;
        }
        let (cap, by_fit, _) = plan.agreed(&p.answers, trust);
        let Some(at_least) = cap.at_least else {
            break;
        };
        // Bounds that pin the boundary to a value or the one above (a refusal whose room was
        // measured there) are aimed at; a looser lower bound set by a refusal is aimed under.
        // The newest probe must pin it by itself: bounds met across probes whose devices
        // fragmented differently pin nothing.
        let pins = |plan: &mut PlanBytes<C>, b: Bounds| match (b.at_least, b.below) {
            (Some(a), Some(b)) if a < b => match plan.invert(a) {
                Some(c) => plan.invert(b - 1) <= Some(c + g),
                None => false,
            },
            _ => false,
        };
        let newest = p.answers.last().map(|(x, a)| plan.bounds_of(*x, a));
        let pinned = pins(&mut plan, cap) && newest.is_some_and(|b| pins(&mut plan, b));
        let target = if by_fit >= Some(at_least) || pinned {
            at_least
        } else {
            by_fit
                .max(Some(at_least - (at_least >> shift)))
                .unwrap_or(at_least)
        };
        // A fit that measured more capacity than a smaller fit: follow the drift. Never below
        // the target: a line through a fit that measured no room at all meets the bytes at that
        // fit (or, rounded, just under it, which aimed one value up from it again and again).
        let target = if fit {
            plan.drift(&p.answers).map_or(target, |d| d.max(target))
        } else {
            target
        };
        let (f, u) = p.bracket();
        // The largest value the measured capacity holds, inside the bracket.
        let (mut c, mut expect) = match plan.invert(target) {
            Some(c) => (c, true),
            None => (space.min, false),
        };
        // Placed without an expectation (the measurements no longer place it).
        let mut guess = false;
        if let Some(f) = f.filter(|f| c <= *f) {
            (c, expect) = (f + g, false);
            // Unless the newest probe's own measurement pins the boundary at `f`: then the
            // value above it is the one to probe.
            if let Some(u) = u.filter(|u| !pinned && u - f > 2 * g) {
                if overshot && !stepped_below {
                    // A measurement overshot: first the value below the failure (a device
                    // that charges a little more than modelled overshoots by one).
                    c = u - g;
                    stepped_below = true;
                    guess = true;
                } else if overshot || misses > 0 {
                    // Nothing trusted is left between: split where the charge changes.
                    c = plan.split(f, u);
                    guess = true;
                }
            }
        }
        if u.is_some_and(|u| c >= u) {
            (c, expect) = (u.map_or(c, |u| u - g), true);
        }
        // Measurements that were wrong place nothing more inside a bracket of a few values:
        // bisecting it costs as much as trusting them.
        if let (Some(f), Some(u), true) = (f, u, misses > 0) {
            if u - f > g && u - f <= 8 * g && !guess {
                c = plan.split(f, u);
                guess = true;
            }
        }
        if p.seen.contains_key(&c) || c > space.max {
            break;
        }
        // Pinned by a refusal: the value above is where that refusal's state fails.
        if pinned && expect && !guess && !fit {
            edge = Some(c);
        }
        next = Some((c, (!guess).then_some(expect)));
    }
    let (capacity, _, _) = plan.agreed(&p.answers, trust);
    let (f, u) = p.bracket();
    let agree = plan.pair_agrees(&p.answers, f, u);
    let mut out = if p.settled() && agree && misses < MAX_MISSES {
        let hi = p.bracket().1;
        assemble(&p.seen, p.probes, hi)
    } else {
        // Strides from one granule, doubling, where a fit and the measurements put the
        // boundary near; from a few percent of the start otherwise.
        let near =
            p.bracket().0.is_some() && p.answers.iter().any(|(_, a)| a.bounds != Bounds::default());
        let wide = if near { 2 * g } else { wide };
        let (lo, hi) = match p.bracket() {
            (Some(f), Some(u)) => (Some(f), Some(u)),
            (Some(f), None) => p.gallop_up(f, wide),
            (None, Some(u)) => p.gallop_down(u, wide),
            (None, None) => p.gallop_down(start, wide),
        };
        // Narrow the bracket where the charge changes, measuring the room at each probe: a
        // pair whose own measurements agree needs no confirmation.
        if let (Some(mut l), Some(mut h)) = (lo, hi) {
            while h - l > g {
                let x = plan.split(l, h);
                if x <= l || x >= h {
                    break;
                }
                let room = plan.room_ask(x);
                if p.ask(Ask { value: x, room }) {
                    l = x;
                } else {
                    h = x;
                }
            }
        }
        let (f, u) = p.bracket();
        let mut out = if p.settled() && f.is_some() && plan.pair_agrees(&p.answers, f, u) {
            assemble(&p.seen, p.probes, u)
        } else {
            p.finish(f.or(lo), u.or(hi), wide)
        };
        out.fell_back = true;
        out
    };
    out.capacity = capacity;
    out
}

/// The result from every first answer in `seen`: the boundary is the largest value that fit
/// every time below the lowest real failure (inconclusive values do not move it).
fn assemble(
    seen: &BTreeMap<u64, Outcome>,
    probes: Vec<(u64, Outcome)>,
    hi: Option<u64>,
) -> SearchOutcome {
    let failed = |o: &Outcome| !o.is_fit() && !o.is_inconclusive();
    let lowest_fail = seen.iter().find(|(_, o)| failed(o)).map(|(x, _)| *x);
    // Flaky: a value fit above a value that failed, or one value gave both answers.
    let flaky = match lowest_fail {
        Some(f) => {
            seen.iter().any(|(x, o)| *x > f && o.is_fit())
                || probes
                    .iter()
                    .any(|(x, o)| o.is_fit() && seen.get(x).is_some_and(failed))
        }
        None => false,
    };
    // Report only values that fit every time they ran, below the lowest real failure.
    let max_fit = seen
        .range(..lowest_fail.unwrap_or(u64::MAX))
        .filter(|(_, o)| o.is_fit())
        .map(|(x, _)| *x)
        .next_back();
    let above = max_fit.map_or(0, |m| m + 1);
    let first_fail = seen
        .range(above..)
        .find(|(_, o)| failed(o))
        .or_else(|| seen.range(above..).find(|(_, o)| !o.is_fit()))
        .map(|(x, _)| *x);
    let first_fail = first_fail.or(if max_fit.is_none() { hi } else { None });
    let fail_reason = first_fail.and_then(|x| seen.get(&x).copied());
    let inconclusive = seen
        .iter()
        .filter(|(_, o)| o.is_inconclusive())
        .map(|(x, _)| *x)
        .collect();
    SearchOutcome {
        max_fit,
        first_fail,
        fail_reason,
        probes,
        flaky,
        inconclusive,
        capacity: Bounds::default(),
        fell_back: false,
    }
}

/// The Lightning-style baseline: double from `from` until failure, then bisect.
/// Used by the search benchmark to compare probe counts on the same oracles.
pub fn lightning_style<F>(space: SearchSpace, from: u64, mut oracle: F) -> SearchOutcome
where
    F: FnMut(u64) -> Outcome,
{
    let mut probes = Vec::new();
    let mut x = space.snap(from);
    let mut lo: Option<u64> = None;
    let mut hi: Option<u64> = None;
    loop {
        let o = oracle(x);
        probes.push((x, o));
        if o.is_fit() {
            lo = Some(x);
            if x >= space.max {
                break;
            }
            x = space.snap(x.saturating_mul(2));
        } else {
            hi = Some(x);
            break;
        }
    }
    let mut reason = probes.last().map(|p| p.1).filter(|o| !o.is_fit());
    if let (Some(mut l), Some(mut h)) = (lo, hi) {
        while h - l > space.granularity.max(1) {
            let mid = space.snap(l + (h - l) / 2);
            if mid <= l || mid >= h {
                break;
            }
            let o = oracle(mid);
            probes.push((mid, o));
            if o.is_fit() {
                l = mid;
            } else {
                h = mid;
                reason = Some(o);
            }
        }
        lo = Some(l);
        hi = Some(h);
    }
    SearchOutcome {
        max_fit: lo,
        first_fail: hi,
        fail_reason: reason,
        probes,
        flaky: false,
        inconclusive: Vec::new(),
        capacity: Bounds::default(),
        fell_back: false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn threshold(b: u64) -> impl FnMut(u64) -> Outcome {
        move |x| {
            if x <= b {
                Outcome::Fit
            } else {
                Outcome::OutOfMemory
            }
        }
    }

    #[test]
    fn exact_boundary_from_a_good_prediction() {
        let r = find_boundary(SearchSpace::unit(1 << 20), 1000, threshold(1013));
        assert_eq!(r.max_fit, Some(1013));
        assert_eq!(r.first_fail, Some(1014));
        assert_eq!(r.fail_reason, Some(Outcome::OutOfMemory));
        assert!(!r.flaky);
        assert!(r.probes.len() < 20, "{} probes", r.probes.len());
    }

    #[test]
    fn an_exact_prediction_costs_two_probes_and_the_confirmation() {
        let r = find_boundary(SearchSpace::unit(1 << 20), 1013, threshold(1013));
        assert_eq!((r.max_fit, r.first_fail), (Some(1013), Some(1014)));
        assert_eq!(r.probes.len(), 4, "{:?}", r.probes);
        let r = find_boundary(SearchSpace::unit(1 << 20), 1014, threshold(1013));
        assert_eq!((r.max_fit, r.first_fail), (Some(1013), Some(1014)));
        assert_eq!(r.probes.len(), 4, "{:?}", r.probes);
    }

    #[test]
    fn exact_boundary_from_an_overestimate() {
        let r = find_boundary(SearchSpace::unit(1 << 20), 5000, threshold(37));
        assert_eq!((r.max_fit, r.first_fail), (Some(37), Some(38)));
    }

    #[test]
    fn boundary_at_one() {
        let r = find_boundary(SearchSpace::unit(1 << 20), 64, threshold(1));
        assert_eq!((r.max_fit, r.first_fail), (Some(1), Some(2)));
    }

    #[test]
    fn nothing_fits() {
        let r = find_boundary(SearchSpace::unit(1 << 20), 64, threshold(0));
        assert_eq!(r.max_fit, None);
        assert_eq!(r.first_fail, Some(1));
        assert!(!r.flaky);
    }

    #[test]
    fn boundary_beyond_the_sane_maximum() {
        let r = find_boundary(SearchSpace::unit(4096), 100, threshold(u64::MAX));
        assert_eq!(r.max_fit, Some(4096));
        assert_eq!(r.first_fail, None);
        assert_eq!(r.fail_reason, None);
    }

    #[test]
    fn granularity_is_respected() {
        let space = SearchSpace {
            min: 1 << 16,
            max: 1 << 40,
            granularity: 1 << 16,
        };
        let b = 123_456_789u64;
        let r = find_boundary(space, 100_000_000, threshold(b));
        let m = r.max_fit.unwrap();
        assert_eq!(m % (1 << 16), 0);
        assert!(m <= b && b < m + (1 << 16));
        assert_eq!(r.first_fail, Some(m + (1 << 16)));
    }

    #[test]
    fn a_failure_that_later_fits_is_reported_flaky() {
        // 101 fails the first time and fits on confirmation.
        let mut calls_at_101 = 0;
        let oracle = move |x: u64| {
            if x == 101 {
                calls_at_101 += 1;
                return if calls_at_101 == 1 {
                    Outcome::OutOfMemory
                } else {
                    Outcome::Fit
                };
            }
            if x <= 100 {
                Outcome::Fit
            } else {
                Outcome::OutOfMemory
            }
        };
        let r = find_boundary(SearchSpace::unit(1 << 20), 100, oracle);
        assert!(r.flaky, "{r:?}");
        assert_eq!(r.max_fit, Some(100));
        assert_eq!(r.first_fail, Some(101));
    }

    #[test]
    fn from_inside_a_fit_island_the_search_steps_down_to_the_boundary() {
        // Fits up to 100 and again at 130..=140 (say, a fragmentation artefact). Starting in
        // the island, the search steps down through failures to the real boundary.
        let oracle = |x: u64| {
            if x <= 100 || (130..=140).contains(&x) {
                Outcome::Fit
            } else {
                Outcome::OutOfMemory
            }
        };
        let r = find_boundary(SearchSpace::unit(1 << 20), 129, oracle);
        assert_eq!((r.max_fit, r.first_fail), (Some(100), Some(101)));
        assert!(!r.flaky, "the island was never probed: {r:?}");
    }

    #[test]
    fn a_flaky_confirmation_is_reported_not_hidden() {
        // 50 fits the first time, fails the second time.
        let mut calls_at_50 = 0;
        let oracle = move |x: u64| {
            if x == 50 {
                calls_at_50 += 1;
                if calls_at_50 == 1 {
                    return Outcome::Fit;
                }
                return Outcome::OutOfMemory;
            }
            if x < 50 {
                Outcome::Fit
            } else {
                Outcome::OutOfMemory
            }
        };
        let r = find_boundary(SearchSpace::unit(1 << 20), 50, oracle);
        assert!(r.flaky);
        assert!(r.max_fit.is_some_and(|m| m < 50), "{r:?}");
    }

    #[test]
    fn lightning_baseline_finds_the_same_boundary() {
        let r = lightning_style(SearchSpace::unit(1 << 20), 2, threshold(1013));
        assert_eq!((r.max_fit, r.first_fail), (Some(1013), Some(1014)));
    }

    #[test]
    fn first_failure_reason_is_kept() {
        let oracle = |x: u64| match x {
            0..=9 => Outcome::Fit,
            10..=11 => Outcome::Budget,
            _ => Outcome::Killed,
        };
        let r = find_boundary(SearchSpace::unit(1 << 20), 8, oracle);
        assert_eq!(r.max_fit, Some(9));
        assert_eq!(r.fail_reason, Some(Outcome::Budget));
    }

    /// `threshold(b)` except at `at`, where the first `times` probes give `o`.
    fn glitch_at(b: u64, at: u64, o: Outcome, times: usize) -> impl FnMut(u64) -> Outcome {
        let mut seen = 0;
        let mut inner = threshold(b);
        move |x| {
            if x == at && seen < times {
                seen += 1;
                return o;
            }
            inner(x)
        }
    }

    #[test]
    fn a_single_death_is_retried_and_does_not_count() {
        for o in [Outcome::Crashed, Outcome::Killed, Outcome::Timeout] {
            let r = find_boundary(
                SearchSpace::unit(1 << 20),
                1000,
                glitch_at(1013, 1013, o, 1),
            );
            assert_eq!((r.max_fit, r.first_fail), (Some(1013), Some(1014)), "{o:?}");
            assert_eq!(r.fail_reason, Some(Outcome::OutOfMemory));
            let at: Vec<_> = r.probes.iter().filter(|p| p.0 == 1013).collect();
            assert!(
                at.len() >= 2 && at[0].1 == o && at[1].1 == Outcome::Fit,
                "{r:?}"
            );
        }
    }

    #[test]
    fn a_repeating_crash_counts_as_not_fitting() {
        let r = find_boundary(
            SearchSpace::unit(1 << 20),
            1000,
            glitch_at(1013, 1012, Outcome::Crashed, usize::MAX),
        );
        assert_eq!((r.max_fit, r.first_fail), (Some(1011), Some(1012)));
        assert_eq!(r.fail_reason, Some(Outcome::Crashed));
        let at = r.probes.iter().filter(|p| p.0 == 1012).count();
        assert!(at >= 2, "retried once: {r:?}");
    }

    #[test]
    fn a_repeating_kill_never_moves_the_boundary() {
        for o in [Outcome::Killed, Outcome::Timeout] {
            // Killed every time at the predicted value, which fits in truth.
            let r = find_boundary(
                SearchSpace::unit(1 << 20),
                1000,
                glitch_at(1013, 1000, o, usize::MAX),
            );
            assert_eq!(
                (r.max_fit, r.first_fail),
                (Some(1013), Some(1014)),
                "{o:?}: {r:?}"
            );
            assert_eq!(r.fail_reason, Some(Outcome::OutOfMemory));
            assert_eq!(r.inconclusive, vec![1000]);
            // Killed every time just above a confirmed boundary: the boundary stays.
            let r = find_boundary(
                SearchSpace::unit(1 << 20),
                1000,
                glitch_at(1013, 1014, o, usize::MAX),
            );
            assert_eq!(r.max_fit, Some(1013), "{o:?}: {r:?}");
            // Killed on confirming a fit: the fit seen stands.
            let mut calls = 0;
            let mut inner = threshold(1013);
            let oracle = move |x: u64| {
                if x == 1013 {
                    calls += 1;
                    if calls > 1 {
                        return o;
                    }
                }
                inner(x)
            };
            let r = find_boundary(SearchSpace::unit(1 << 20), 1000, oracle);
            assert_eq!(r.max_fit, Some(1013), "{o:?}: {r:?}");
            assert!(!r.flaky);
        }
    }

    /// A device of `cap` bytes running a plan of `base + per·x` bytes allocated in `parts`
    /// equal tensors, each rounded up to `page` bytes on the device; a fitting probe measures
    /// its room with filler of `page`-rounded pieces resolved to the asked step.
    struct Device {
        cap: u64,
        base: u64,
        per: u64,
        parts: u64,
        page: u64,
    }

    impl Device {
        /// 1 GiB, 10 MiB of model states, 3 MiB per value in 40 tensors, 4-byte pages.
        const GIB: Device = Device {
            cap: 1 << 30,
            base: 10 << 20,
            per: 3 << 20,
            parts: 40,
            page: 4,
        };

        fn bytes(&self, x: u64) -> u64 {
            self.base + self.per * x
        }
        fn rounded(&self, b: u64) -> u64 {
            b.div_ceil(self.page) * self.page
        }
        fn answer(&self, ask: Ask) -> Answer {
            let total = self.bytes(ask.value);
            let part = total / self.parts;
            let mut used = 0;
            for i in 0..self.parts {
                let need = self.rounded(part);
                if used + need > self.cap {
                    // Refused: the plan held i parts and asked for one more.
                    return Answer::measured(
                        Outcome::OutOfMemory,
                        Bounds {
                            at_least: Some(i * part),
                            below: Some((i + 1) * part),
                        },
                    );
                }
                used += need;
            }
            let mut bounds = Bounds::default();
            if let Some(r) = ask.room {
                // Filler: whole steps (page-rounded) until refused or the limit.
                // (The probe asks for whole pages, as room::measure does on a GPU.)
                let piece = self.rounded(r.step);
                let n = ((self.cap - used) / piece).min(r.limit / piece);
                let room = n * piece;
                bounds.at_least = Some(total + room);
                if room + piece <= r.limit {
                    bounds.below = Some(total + room + piece);
                }
            }
            Answer::measured(Outcome::Fit, bounds)
        }
        /// The true boundary: the largest x whose parts all fit.
        fn boundary(&self) -> u64 {
            let mut x = 0;
            while self
                .answer(Ask {
                    value: x + 1,
                    room: None,
                })
                .outcome
                .is_fit()
            {
                x += 1;
            }
            x
        }
    }

    fn measured(d: &Device, start: u64) -> SearchOutcome {
        find_boundary_measured(
            SearchSpace::unit(1 << 20),
            start,
            |x| Some(d.bytes(x)),
            |a| d.answer(a),
        )
    }

    #[test]
    fn a_measured_capacity_finds_the_boundary_in_a_few_probes() {
        let d = Device::GIB;
        let b = d.boundary();
        assert!(b > 300, "{b}");
        for start in [
            b,
            b + 1,
            b - 9,
            b + 9,
            b * 8 / 10,
            b * 12 / 10,
            b / 2,
            2 * b,
        ] {
            let r = measured(&d, start);
            assert_eq!(
                (r.max_fit, r.first_fail),
                (Some(b), Some(b + 1)),
                "{start}: {r:?}"
            );
            assert!(!r.fell_back && !r.flaky, "{start}: {r:?}");
            assert!(r.probes.len() <= 4, "{start}: {:?}", r.probes);
            let at_least = r.capacity.at_least.unwrap();
            assert!(at_least <= d.cap && d.bytes(b) <= at_least, "{r:?}");
        }
    }

    #[test]
    fn page_granularity_and_an_unknown_overhead_still_give_the_exact_boundary() {
        // 2 MiB pages; the prediction assumed 1.5 GiB, the device keeps 300 MiB of it.
        let d = Device {
            cap: (3 << 29) - (300 << 20),
            base: 100 << 20,
            per: 5 << 20,
            parts: 64,
            page: 2 << 20,
        };
        let b = d.boundary();
        let predicted = ((3u64 << 29) - d.base) / d.per;
        for start in [predicted, b, b / 2, 2 * b] {
            let r = measured(&d, start);
            assert_eq!(
                (r.max_fit, r.first_fail),
                (Some(b), Some(b + 1)),
                "{start}: {r:?}"
            );
            // Every tensor here rounds the same way (the worst case for a measurement made at
            // another value): the fallback's galloping and bisecting pays for it.
            assert!(r.probes.len() <= 12, "{start}: {:?}", r.probes);
        }
    }

    #[test]
    fn measurements_that_lie_fall_back_and_still_find_the_boundary() {
        let d = Device::GIB;
        let b = d.boundary();
        // Filler that finds 200 MiB too much room (memory another process frees and takes back).
        let r = find_boundary_measured(
            SearchSpace::unit(1 << 20),
            b / 2,
            |x| Some(d.bytes(x)),
            |a| {
                let mut ans = d.answer(a);
                if ans.outcome.is_fit() {
                    ans.bounds.at_least = ans.bounds.at_least.map(|c| c + (200 << 20));
                    ans.bounds.below = ans.bounds.below.map(|c| c + (200 << 20));
                }
                ans
            },
        );
        assert_eq!((r.max_fit, r.first_fail), (Some(b), Some(b + 1)), "{r:?}");
        assert!(r.fell_back, "{r:?}");
        // Nothing measured at all: the same boundary by galloping and bisecting.
        let r = find_boundary_measured(
            SearchSpace::unit(1 << 20),
            b / 2,
            |x| Some(d.bytes(x)),
            |a| Answer::bare(d.answer(a).outcome),
        );
        assert_eq!((r.max_fit, r.first_fail), (Some(b), Some(b + 1)), "{r:?}");
    }

    #[test]
    fn a_flaky_probe_is_retried_and_the_boundary_holds() {
        let d = Device::GIB;
        let b = d.boundary();
        // The first probe, at b − 3, fails once for no reason of its own (its failure point says
        // far less room than the fits see).
        let mut spurious = false;
        let r = find_boundary_measured(
            SearchSpace::unit(1 << 20),
            b - 3,
            |x| Some(d.bytes(x)),
            |a| {
                if a.value == b - 3 && !spurious {
                    spurious = true;
                    return Answer::measured(
                        Outcome::OutOfMemory,
                        Bounds {
                            at_least: Some(d.bytes(b - 3) / 2),
                            below: Some(d.bytes(b - 3) / 2 + (1 << 20)),
                        },
                    );
                }
                d.answer(a)
            },
        );
        // The pair's answers disagree, so it is probed once more: b − 3 fits then. The first
        // failure stays the lowest, so the boundary stays below it and the run is flaky, as in
        // the plain search.
        assert_eq!(r.max_fit, Some(b - 4), "{r:?}");
        assert!(r.flaky && r.fell_back, "{r:?}");
        // A crash alone is retried and costs one probe.
        let mut crashed = false;
        let r = find_boundary_measured(
            SearchSpace::unit(1 << 20),
            b - 3,
            |x| Some(d.bytes(x)),
            |a| {
                if a.value == b && !crashed {
                    crashed = true;
                    assert!(a.room.is_some());
                    return Answer::bare(Outcome::Crashed);
                }
                d.answer(a)
            },
        );
        assert_eq!((r.max_fit, r.first_fail), (Some(b), Some(b + 1)), "{r:?}");
        let at_b: Vec<_> = r.probes.iter().filter(|p| p.0 == b).collect();
        assert_eq!(at_b.len(), 2, "{r:?}");
    }

    #[test]
    fn the_measuring_search_keeps_the_rules_for_dead_children() {
        let d = Device::GIB;
        let b = d.boundary();
        for o in [Outcome::Killed, Outcome::Timeout] {
            // No answer ever at the boundary: it stays unknown, not a failure.
            let r = find_boundary_measured(
                SearchSpace::unit(1 << 20),
                b - 20,
                |x| Some(d.bytes(x)),
                |a| {
                    if a.value == b {
                        Answer::bare(o)
                    } else {
                        d.answer(a)
                    }
                },
            );
            assert_eq!(r.max_fit, Some(b - 1), "{o:?}: {r:?}");
            assert_eq!(r.first_fail, Some(b + 1), "{o:?}: {r:?}");
            assert_eq!(r.inconclusive, vec![b], "{o:?}: {r:?}");
        }
    }

    #[test]
    fn a_capacity_that_grows_with_the_value_is_followed_not_crawled() {
        // Measured capacity grows by 0.4 MiB per value while the plan grows by 1 MiB (what a
        // CPU adapter's address space did under prlimit): each room alone undershoots.
        let mib = 1u64 << 20;
        let cap = |x: u64| 900 * mib + 2 * x * mib / 5;
        let bytes = |x: u64| 100 * mib + x * mib;
        let b = (0..)
            .take_while(|&x| bytes(x + 1) <= cap(x + 1))
            .last()
            .unwrap()
            + 1;
        for start in [b / 2, b * 8 / 10, b - 20] {
            let r = find_boundary_measured(
                SearchSpace::unit(1 << 20),
                start,
                |x| Some(bytes(x)),
                |a: Ask| {
                    // Fit or refused, the room is measured: the capacity at this value.
                    let c = cap(a.value);
                    held_between(bytes(a.value) <= c, c, c + 1)
                },
            );
            assert_eq!((r.max_fit, r.first_fail), (Some(b), Some(b + 1)), "{r:?}");
            assert!(r.probes.len() <= 6, "{start}: {:?}", r.probes);
        }
    }

    #[test]
    fn a_replayed_boundary_is_probed_not_extrapolated() {
        // Replays from far below put the boundary 54 values low, from near it exactly (what
        // lavapipe's flash did under 2 GiB): a line through the two aims past the boundary.
        let b = 9707u64;
        let bytes = |x: u64| 1_000_000_000 + x * 131_000;
        let run = |replayed: bool| {
            find_boundary_measured(
                SearchSpace::unit(1 << 20),
                9398,
                |x| Some(bytes(x)),
                |a: Ask| {
                    let said = if a.value + 200 < b { b - 54 } else { b };
                    let h = held_between(a.value <= b, bytes(said), bytes(said + 1));
                    Answer { replayed, ..h }
                },
            )
        };
        let r = run(true);
        assert_eq!((r.max_fit, r.first_fail), (Some(b), Some(b + 1)), "{r:?}");
        let values: Vec<u64> = r.probes.iter().map(|p| p.0).collect();
        assert_eq!(values, vec![9398, b - 54, b, b + 1]);
        // The same measurements as capacities: the drift line overshoots.
        let r = run(false);
        assert!(r.probes.iter().any(|p| p.0 > b + 1), "{:?}", r.probes);
    }

    /// A probe that fit (or was refused) and measured the capacity in `[at_least, below)`.
    fn held_between(fit: bool, at_least: u64, below: u64) -> Answer {
        let outcome = if fit {
            Outcome::Fit
        } else {
            Outcome::OutOfMemory
        };
        Answer::measured(
            outcome,
            Bounds {
                at_least: Some(at_least),
                below: Some(below),
            },
        )
    }

    #[test]
    fn a_fit_that_measured_no_room_aims_past_the_values_charged_alike() {
        // 992..=1150 all cost 1000 MiB (one page signature) on a device that holds 1001 MiB
        // and measures room in 4 MiB pieces. The fit at 991 measures less than 992 costs; 992
        // fits with no room: every value charged alike fits too, so the next probe is the
        // first one charged more. (Aiming by the line through the two fits, which meets the
        // bytes at 992, and with the odd 364 KiB here rounds to a byte under them, stepped up
        // one value at a time.)
        let mib = 1u64 << 20;
        let bytes = |x: u64| match x {
            ..=991 => x * mib + 372_736,
            992..=1150 => 1000 * mib,
            _ => (1010 + x - 1151) * mib,
        };
        let sig = |x: u64| bytes(x) + u64::from(x > 1100);
        let cap = 1001 * mib;
        let device = |a: Ask| {
            let b = bytes(a.value);
            let room = cap.saturating_sub(b) / (4 * mib) * (4 * mib);
            let held = if b <= cap {
                b + room
            } else {
                cap / (4 * mib) * (4 * mib)
            };
            held_between(b <= cap, held, held + 4 * mib)
        };
        for start in [991, 900] {
            let space = SearchSpace::unit(1 << 20);
            let r = find_boundary_charged(space, start, |x| Some((bytes(x), sig(x))), device);
            assert_eq!((r.max_fit, r.first_fail), (Some(1150), Some(1151)), "{r:?}");
            assert!(!r.fell_back, "{start}: {:?}", r.probes);
            assert!(r.probes.len() <= 5, "{start}: {:?}", r.probes);
        }
    }

    #[test]
    fn after_an_overshoot_a_fit_that_pins_the_boundary_is_believed() {
        // 2 MiB a value on a device of 1001 MiB: 500 fits, 501 does not. The first refusal
        // measures 100 MiB too much (its state held more), so the search overshoots; refusals
        // measure to 10 MiB, fits to 2 MiB. Once a fit's own room pins the boundary, the next
        // probe is the value above that fit, not the value below the overshoot.
        let mib = 1u64 << 20;
        let cap = 1001 * mib;
        let mut refusals = 0;
        let device = |a: Ask| {
            let b = 2 * a.value * mib;
            let (held, step) = if b <= cap {
                (b + cap.saturating_sub(b) / (2 * mib) * (2 * mib), 2 * mib)
            } else {
                refusals += 1;
                (1000 * mib + u64::from(refusals == 1) * 100 * mib, 10 * mib)
            };
            held_between(b <= cap, held, held + step)
        };
        let space = SearchSpace::unit(1 << 20);
        let r = find_boundary_measured(space, 800, |x| Some(2 * x * mib), device);
        assert_eq!((r.max_fit, r.first_fail), (Some(500), Some(501)), "{r:?}");
        assert!(r.probes.len() <= 5, "{:?}", r.probes);
    }

    #[test]
    fn bisection_skips_values_the_device_charges_alike() {
        // A device that charges whole pages of 50 values: 351..=400 cost what 400 costs, so
        // x fits up to 350. Nothing is measured: the search gallops and bisects, and with the
        // page signature it bisects only over the values where the page count changes.
        let pages = |x: u64| x.div_ceil(50);
        let device = |a: Ask| {
            Answer::bare(if pages(a.value) * 50 * 1000 <= 360_000 {
                Outcome::Fit
            } else {
                Outcome::OutOfMemory
            })
        };
        for start in [200, 340, 349, 350, 351, 700] {
            let space = SearchSpace::unit(1 << 20);
            let charged =
                find_boundary_charged(space, start, |x| Some((1000 * x, pages(x))), device);
            let plain = find_boundary_measured(space, start, |x| Some(1000 * x), device);
            for r in [&charged, &plain] {
                assert_eq!((r.max_fit, r.first_fail), (Some(350), Some(351)), "{r:?}");
            }
            assert!(
                charged.probes.len() <= plain.probes.len(),
                "{start}: {:?} vs {:?}",
                charged.probes,
                plain.probes
            );
        }
    }

    #[test]
    fn nothing_fits_and_everything_fits_under_measurement() {
        let d = Device {
            cap: 5 << 20,
            base: 10 << 20,
            per: 3 << 20,
            parts: 4,
            page: 4,
        };
        let r = measured(&d, 64);
        assert_eq!((r.max_fit, r.first_fail), (None, Some(1)), "{r:?}");
        let d = Device {
            cap: u64::MAX / 2,
            base: 10,
            per: 4,
            parts: 1,
            page: 4,
        };
        let r = find_boundary_measured(
            SearchSpace::unit(4096),
            100,
            |x| Some(d.bytes(x)),
            |a| d.answer(a),
        );
        assert_eq!((r.max_fit, r.first_fail), (Some(4096), None), "{r:?}");
    }
}
