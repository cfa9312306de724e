//! The search that reads what each probe measured about the device's capacity: it inverts the
//! plan's bytes per value to the boundary, probes that value and its neighbour, and when the
//! measurements and the probes disagree bisects over the values where the device's charge
//! changes.

use std::collections::BTreeMap;

use super::probing::{assemble, wide_stride, Prober};
use super::{Answer, Ask, Bounds, RoomAsk, SearchOutcome, SearchSpace};

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
    let mut p = Prober::new(space, oracle);
    let mut plan = PlanBytes {
        bytes: cost,
        memo: BTreeMap::new(),
        space,
    };
    let start = space.snap(start.max(space.min));
    let wide = wide_stride(space, start);
    let (trust, misses) = guided(&mut p, &mut plan, start);
    let (capacity, _, _) = plan.agreed(&p.answers, trust);
    let (f, u) = p.bracket();
    let agree = plan.pair_agrees(&p.answers, f, u);
    let mut out = if p.settled() && agree && misses < MAX_MISSES {
        let hi = p.bracket().1;
        assemble(&p.seen, p.probes, hi)
    } else {
        fall_back(p, &mut plan, start, wide)
    };
    out.capacity = capacity;
    out
}

/// The guided phase: up to [`MAX_GUIDED`] probes, each placed where the measurements so far put
/// the boundary, until the bracket settles, a probe is inconclusive, or the measurements were
/// wrong [`MAX_MISSES`] times. The measurements still trusted, and how often they missed.
fn guided<C, F>(p: &mut Prober<F>, plan: &mut PlanBytes<C>, start: u64) -> (Trust, usize)
where
    C: FnMut(u64) -> Option<(u64, u64)>,
    F: FnMut(Ask) -> Answer,
{
    let space = plan.space;
    let g = space.granularity.max(1);
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
        let pinned = pins(plan, cap) && newest.is_some_and(|b| pins(plan, b));
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
    (trust, misses)
}

/// The fallback when the guided probes did not settle on a pair that agrees: gallop from the
/// bracket, narrow it where the charge changes, and confirm the pair once more unless its own
/// measurements agree.
fn fall_back<C, F>(
    mut p: Prober<F>,
    plan: &mut PlanBytes<C>,
    start: u64,
    wide: u64,
) -> SearchOutcome
where
    C: FnMut(u64) -> Option<(u64, u64)>,
    F: FnMut(Ask) -> Answer,
{
    let g = plan.space.granularity.max(1);
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
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::report::Outcome;

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
