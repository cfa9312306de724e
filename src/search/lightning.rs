//! The Lightning-style baseline the search benchmark compares probe counts against.

use crate::report::Outcome;

use super::{Bounds, SearchOutcome, SearchSpace};

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
    use super::super::oracles::threshold;
    use super::*;

    #[test]
    fn lightning_baseline_finds_the_same_boundary() {
        let r = lightning_style(SearchSpace::unit(1 << 20), 2, threshold(1013));
        assert_eq!((r.max_fit, r.first_fail), (Some(1013), Some(1014)));
    }
}
