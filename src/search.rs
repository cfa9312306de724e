//! Boundary search over an oracle: start at the prediction, gallop to bracket the boundary,
//! bisect, then confirm the boundary pair once more. Pure logic, tested with mock oracles.
//!
//! A child that died before answering (`crashed`, `killed`, `timeout`) is probed once more at
//! the same value. Any outcome other than `Fit` steers the search like a failure, and the first
//! failure's reason is what the run reports. A `crashed` probe counts as not fitting. A `killed`
//! or `timeout` probe is inconclusive: the device said nothing, so it never lowers the boundary
//! below a fit seen above it, and when the bracket's upper end is inconclusive the search steps
//! over it to look for a real answer above.

use std::collections::BTreeMap;

use crate::report::Outcome;

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
}

/// The probes run so far and the first answer seen at each value.
struct Prober<F> {
    oracle: F,
    space: SearchSpace,
    probes: Vec<(u64, Outcome)>,
    seen: BTreeMap<u64, Outcome>,
}

impl<F: FnMut(u64) -> Outcome> Prober<F> {
    /// Probe `x` (once more if the child died before answering); true if it fit.
    fn run(&mut self, x: u64) -> bool {
        let mut o = (self.oracle)(x);
        self.probes.push((x, o));
        if o.is_transient() {
            o = (self.oracle)(x);
            self.probes.push((x, o));
        }
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

/// Find the boundary. `oracle(x)` runs one probe at `x` and returns its outcome.
/// `start` is the predicted maximum (clamped to the space).
pub fn find_boundary<F>(space: SearchSpace, start: u64, oracle: F) -> SearchOutcome
where
    F: FnMut(u64) -> Outcome,
{
    let g = space.granularity.max(1);
    let mut p = Prober {
        oracle,
        space,
        probes: Vec::new(),
        seen: BTreeMap::new(),
    };
    let start = space.snap(start.max(space.min));
    // The wide stride: a few percent of the prediction, at least one granule.
    let wide = (start / 32).max(g) / g * g;

    let (mut lo, mut hi) = if p.run(start) {
        p.gallop_up(start, wide)
    } else {
        p.gallop_down(start, wide)
    };

    // Bisect, then confirm the pair once more. If the fit does not hold on confirmation,
    // search again below it (a few rounds at most); every answer stays in `seen`.
    for _round in 0..3 {
        let (Some(l0), Some(h0)) = (lo, hi) else {
            break;
        };
        let (l, h) = p.bisect(l0, h0);
        let lo_holds = p.run(l) || p.seen.get(&l).is_some_and(|o| o.is_fit());
        p.run(h);
        if lo_holds {
            (lo, hi) = (Some(l), Some(h));
            break;
        }
        (lo, hi) = p.gallop_down(l, wide);
    }

    // A killed or timed-out upper end says nothing: step over it (a few times at most) and
    // look for a real answer above, then narrow that bracket as before.
    for _round in 0..3 {
        let (Some(_), Some(h0)) = (lo, hi) else {
            break;
        };
        if !p.inconclusive_at(Some(h0)) {
            break;
        }
        let (l, h) = p.gallop_up(h0, wide);
        match (l, h) {
            (Some(l), Some(h)) if l > h0 => {
                let (l, h) = p.bisect(l, h);
                p.run(l);
                p.run(h);
                (lo, hi) = (Some(l), Some(h));
            }
            (_, h) => hi = h.or(hi),
        }
    }

    let Prober { probes, seen, .. } = p;
    assemble(&seen, probes, hi)
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
}
