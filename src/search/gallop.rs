//! The search that only sees fit or fail: start at the prediction, gallop to bracket the
//! boundary, bisect, then confirm the pair once more.

use crate::report::Outcome;

use super::probing::{wide_stride, Prober};
use super::{Answer, Ask, SearchOutcome, SearchSpace};

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

#[cfg(test)]
mod tests {
    use super::super::oracles::threshold;
    use super::*;

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
