//! Boundary search over an oracle: start at the prediction, gallop to bracket the boundary,
//! bisect, then confirm the boundary pair once more. Pure logic, tested with mock oracles.
//!
//! Any outcome other than `Fit` counts as a failure for the search (OOM, budget, a killed or
//! timed-out child, an error); the first failure's reason is what the run reports.

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
}

/// The probes run so far and the first answer seen at each value.
struct Prober<F> {
    oracle: F,
    space: SearchSpace,
    probes: Vec<(u64, Outcome)>,
    seen: BTreeMap<u64, Outcome>,
}

impl<F: FnMut(u64) -> Outcome> Prober<F> {
    fn run(&mut self, x: u64) -> bool {
        let o = (self.oracle)(x);
        self.probes.push((x, o));
        // A later fit does not erase a failure seen at the same value.
        self.seen
            .entry(x)
            .and_modify(|prev| {
                if prev.is_fit() {
                    *prev = o
                }
            })
            .or_insert(o);
        o.is_fit()
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
        let lo_holds = p.run(l);
        p.run(h);
        if lo_holds {
            (lo, hi) = (Some(l), Some(h));
            break;
        }
        (lo, hi) = p.gallop_down(l, wide);
    }

    let Prober { probes, seen, .. } = p;
    // Flaky: a value fit above a value that failed, or one value gave both answers.
    let lowest_fail = seen.iter().find(|(_, o)| !o.is_fit()).map(|(x, _)| *x);
    let flaky = match lowest_fail {
        Some(f) => {
            seen.iter().any(|(x, o)| *x > f && o.is_fit())
                || probes
                    .iter()
                    .any(|(x, o)| o.is_fit() && seen.get(x).is_some_and(|s| !s.is_fit()))
        }
        None => false,
    };
    // Report only values that fit every time they ran.
    let max_fit = lo.filter(|x| seen.get(x).is_some_and(|o| o.is_fit()));
    let first_fail = match max_fit {
        Some(m) => seen
            .range(m + 1..)
            .find(|(_, o)| !o.is_fit())
            .map(|(x, _)| *x),
        None => lowest_fail,
    };
    let first_fail = first_fail.or(if max_fit.is_none() { hi } else { None });
    let fail_reason = first_fail.and_then(|x| seen.get(&x).copied());
    SearchOutcome {
        max_fit,
        first_fail,
        fail_reason,
        probes,
        flaky,
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
                return Outcome::Killed;
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
}
