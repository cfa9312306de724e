//! The probing rules the searches share: a child that died before answering is probed once
//! more, the first answer at each value is kept (an inconclusive one never replaces a real
//! one), galloping and bisection over the grid, the final confirmation, and the result
//! assembled from every answer seen.

use std::collections::BTreeMap;

use crate::report::Outcome;

use super::{Answer, Ask, Bounds, SearchOutcome, SearchSpace};

/// The probes run so far, the first answer seen at each value, and every answer's bounds.
pub(super) struct Prober<F> {
    oracle: F,
    space: SearchSpace,
    pub(super) probes: Vec<(u64, Outcome)>,
    pub(super) seen: BTreeMap<u64, Outcome>,
    pub(super) answers: Vec<(u64, Answer)>,
}

impl<F: FnMut(Ask) -> Answer> Prober<F> {
    pub(super) fn new(space: SearchSpace, oracle: F) -> Self {
        Prober {
            oracle,
            space,
            probes: Vec::new(),
            seen: BTreeMap::new(),
            answers: Vec::new(),
        }
    }

    /// Probe `x` measuring nothing; true if it fit.
    pub(super) fn run(&mut self, x: u64) -> bool {
        self.ask(Ask {
            value: x,
            room: None,
        })
    }

    /// Probe as asked (once more, without filler, if the child died before answering); true
    /// if it fit.
    pub(super) fn ask(&mut self, ask: Ask) -> bool {
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

    pub(super) fn inconclusive_at(&self, x: Option<u64>) -> bool {
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
    pub(super) fn gallop_up(&mut self, from: u64, wide: u64) -> (Option<u64>, Option<u64>) {
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
    pub(super) fn gallop_down(&mut self, from: u64, wide: u64) -> (Option<u64>, Option<u64>) {
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
pub(super) fn wide_stride(space: SearchSpace, start: u64) -> u64 {
    let g = space.granularity.max(1);
    (start / 32).max(g) / g * g
}

impl<F: FnMut(Ask) -> Answer> Prober<F> {
    /// The bracket the answers so far give: the largest value that fit below the lowest real
    /// failure, and that failure (inconclusive answers are neither).
    pub(super) fn bracket(&self) -> (Option<u64>, Option<u64>) {
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
    pub(super) fn settled(&self) -> bool {
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
    pub(super) fn finish(
        mut self,
        mut lo: Option<u64>,
        mut hi: Option<u64>,
        wide: u64,
    ) -> SearchOutcome {
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

/// The result from every first answer in `seen`: the boundary is the largest value that fit
/// every time below the lowest real failure (inconclusive values do not move it).
pub(super) fn assemble(
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
