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
        SearchSpace { min: 1, max, granularity: 1 }
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

/// Find the boundary. `oracle(x)` runs one probe at `x` and returns its outcome.
/// `start` is the predicted maximum (clamped to the space).
pub fn find_boundary<F>(space: SearchSpace, start: u64, mut oracle: F) -> SearchOutcome
where
    F: FnMut(u64) -> Outcome,
{
    let g = space.granularity.max(1);
    let mut probes: Vec<(u64, Outcome)> = Vec::new();
    let mut seen: BTreeMap<u64, Outcome> = BTreeMap::new();
    let mut run = |x: u64, probes: &mut Vec<(u64, Outcome)>, seen: &mut BTreeMap<u64, Outcome>| {
        let o = oracle(x);
        probes.push((x, o));
        // Keep the first failure reason seen at a value; a later fit does not erase a failure.
        seen.entry(x)
            .and_modify(|prev| {
                if prev.is_fit() {
                    *prev = o
                }
            })
            .or_insert(o);
        o
    };

    let start = space.snap(start.max(space.min));
    // Initial stride: a few percent of the prediction, at least one granule.
    let stride0 = (start / 32).max(g) / g * g;
    let (mut lo, mut hi): (Option<u64>, Option<u64>);

    if run(start, &mut probes, &mut seen).is_fit() {
        lo = Some(start);
        hi = None;
        let mut stride = stride0;
        let mut x = start;
        while x < space.max {
            let next = space.snap(x.saturating_add(stride));
            if next <= x {
                break;
            }
            x = next;
            if run(x, &mut probes, &mut seen).is_fit() {
                lo = Some(x);
                stride = stride.saturating_mul(2);
            } else {
                hi = Some(x);
                break;
            }
        }
    } else {
        hi = Some(start);
        lo = None;
        let mut stride = stride0;
        let mut x = start;
        while x > space.min {
            let next = space.snap(x.saturating_sub(stride));
            if next >= x {
                break;
            }
            x = next;
            if run(x, &mut probes, &mut seen).is_fit() {
                lo = Some(x);
                break;
            }
            hi = Some(x);
            stride = stride.saturating_mul(2);
        }
    }

    // Bisect between a fit (lo) and a failure (hi).
    if let (Some(mut l), Some(mut h)) = (lo, hi) {
        while h - l > g {
            let mid = space.snap(l + (h - l) / 2);
            let mid = if mid <= l { l + g } else { mid };
            if mid >= h {
                break;
            }
            if run(mid, &mut probes, &mut seen).is_fit() {
                l = mid;
            } else {
                h = mid;
            }
        }
        lo = Some(l);
        // Confirm the boundary pair once more; a changed answer shows up as flaky below.
        run(l, &mut probes, &mut seen);
        run(h, &mut probes, &mut seen);
    }

    // Flaky: some value fit (every time it ran) above a value that failed.
    let lowest_fail = seen.iter().find(|(_, o)| !o.is_fit()).map(|(x, _)| *x);
    let flaky = match lowest_fail {
        Some(f) => seen.iter().any(|(x, o)| *x > f && o.is_fit())
            || probes
                .iter()
                .any(|(x, o)| o.is_fit() && seen.get(x).is_some_and(|s| !s.is_fit())),
        None => false,
    };
    // A value that failed even once is not reported as fitting.
    let max_fit = lo.filter(|x| seen.get(x).is_some_and(|o| o.is_fit()));
    let max_fit = match (max_fit, lo) {
        (Some(x), _) => Some(x),
        // The confirmation of lo failed: fall back to the largest value that always fit
        // below the lowest failure.
        (None, Some(_)) => seen
            .iter()
            .filter(|(x, o)| o.is_fit() && lowest_fail.is_none_or(|f| **x < f))
            .map(|(x, _)| *x)
            .next_back(),
        (None, None) => None,
    };
    let first_fail = match max_fit {
        Some(m) => seen.range(m + 1..).find(|(_, o)| !o.is_fit()).map(|(x, _)| *x),
        None => lowest_fail,
    };
    let fail_reason = first_fail.and_then(|x| seen.get(&x).copied());
    SearchOutcome { max_fit, first_fail, fail_reason, probes, flaky }
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
    SearchOutcome { max_fit: lo, first_fail: hi, fail_reason: reason, probes, flaky: false }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn threshold(b: u64) -> impl FnMut(u64) -> Outcome {
        move |x| if x <= b { Outcome::Fit } else { Outcome::OutOfMemory }
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
        let space = SearchSpace { min: 1 << 16, max: 1 << 40, granularity: 1 << 16 };
        let b = 123_456_789u64;
        let r = find_boundary(space, 100_000_000, threshold(b));
        let m = r.max_fit.unwrap();
        assert_eq!(m % (1 << 16), 0);
        assert!(m <= b && b < m + (1 << 16));
        assert_eq!(r.first_fail, Some(m + (1 << 16)));
    }

    #[test]
    fn non_monotone_device_is_reported_flaky() {
        // Fits up to 100, and again at 150..=160 (e.g. a fragmentation artefact).
        let oracle = |x: u64| {
            if x <= 100 || (150..=160).contains(&x) {
                Outcome::Fit
            } else {
                Outcome::OutOfMemory
            }
        };
        let r = find_boundary(SearchSpace::unit(1 << 20), 155, oracle);
        assert!(r.flaky, "probes: {:?}", r.probes);
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
