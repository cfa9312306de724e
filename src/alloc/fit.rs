//! Whether a step fits on the memory given: the tensors' peak (and PyTorch's reserved peak, where
//! the allocator was replayed) against the bytes PyTorch may use, the ratio, and the headline
//! `estimate` and `diagnose` print first (issue 47).

use serde::Serialize;

use super::conf::AllocConf;
use super::timeline::{least_capacity_between, replay, Replay};
use crate::plan::Plan;
use crate::units::fmt_bytes;

/// The judgement in one word (JSON `fit.verdict`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Verdict {
    /// The tensors fit, and the allocator (where replayed) served every request.
    Fits,
    /// The tensors' peak alone is more than PyTorch may use.
    DoesNotFit,
    /// The tensors fit, but the allocator's rounding and cache do not: it refused a request.
    AllocatorRefuses,
}

/// Needed against usable (JSON `fit`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Fit {
    pub fits: bool,
    pub verdict: Verdict,
    /// The tensors' peak: the most bytes live at once in the step.
    pub needed_bytes: u64,
    /// What PyTorch's allocator reserves, where it was replayed: its reserved peak on the card
    /// when every request was served; when it refused one with the tensors fitting, the least
    /// memory on which it serves every one (under a limit it frees its cache and retries, so
    /// this can be below its reserved peak with no limit). Absent when the tensors alone do not
    /// fit (`does_not_fit`: no allocator figure is needed to say so, and its search costs).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reserved_bytes: Option<u64>,
    /// What PyTorch's allocator may take (the card less what lives outside PyTorch).
    pub usable_bytes: u64,
    /// The larger of `needed_bytes` and `reserved_bytes`, over `usable_bytes`: above 1 does not
    /// fit.
    pub ratio: f64,
    /// `needed_bytes` − `usable_bytes` (0 when the tensors fit): what no allocator setting can
    /// find.
    pub shortage_bytes: u64,
}

/// Judge `needed` tensor bytes on `usable` bytes; `allocator` is what the allocator reserves
/// (see [`Fit::reserved_bytes`]) and whether it served every request on the card, when it was
/// replayed.
pub fn judge(needed: u64, allocator: Option<(u64, bool)>, usable: u64) -> Fit {
    let reserved = allocator.map(|(r, _)| r).filter(|_| needed <= usable);
    let verdict = if needed > usable {
        Verdict::DoesNotFit
    } else if allocator.is_some_and(|(_, served)| !served) {
        Verdict::AllocatorRefuses
    } else {
        Verdict::Fits
    };
    let top = needed.max(reserved.unwrap_or(0));
    Fit {
        fits: verdict == Verdict::Fits,
        verdict,
        needed_bytes: needed,
        reserved_bytes: reserved,
        usable_bytes: usable,
        ratio: top as f64 / usable.max(1) as f64,
        shortage_bytes: needed.saturating_sub(usable),
    }
}

/// Judge `plan` on `usable` bytes from its replay on that card (`on_card`, replayed with
/// `conf`): for a refused replay with the tensors fitting, the least capacity that serves every
/// request is what it needs (searched between `usable`, refused, and its peak with no limit).
pub fn of_plan(plan: &Plan, conf: &AllocConf, on_card: &Replay, usable: u64) -> Fit {
    let needed = plan.peak_bytes();
    if needed > usable {
        return judge(needed, None, usable);
    }
    let reserved = if on_card.fits() {
        on_card.reserved_peak_bytes
    } else {
        let free = replay(plan, conf, None, on_card.steps, false).reserved_peak_bytes;
        least_capacity_between(plan, conf, on_card.steps, usable, free)
    };
    judge(needed, Some((reserved, on_card.fits())), usable)
}

/// Replay `plan` with `conf` on `usable` bytes and judge it (for a caller without a replay).
pub fn replayed(plan: &Plan, conf: &AllocConf, usable: u64) -> Fit {
    let r = replay(plan, conf, Some(usable), super::timeline::STEPS, false);
    of_plan(plan, conf, &r, usable)
}

/// The first line of `estimate` and `diagnose`: the verdict, needed against usable, the ratio.
pub fn headline(f: &Fit) -> String {
    let usable = fmt_bytes(f.usable_bytes);
    let needed = fmt_bytes(f.needed_bytes);
    let pct = f.ratio * 100.0;
    match (f.verdict, f.reserved_bytes) {
        (Verdict::Fits, Some(r)) => format!(
            "fits: the step needs {needed} at its peak (PyTorch's allocator reserves {}) of the \
             {usable} PyTorch may use ({pct:.1} % of usable)",
            fmt_bytes(r)
        ),
        (Verdict::Fits, None) => format!(
            "fits: the step needs {needed} at its peak of the {usable} PyTorch may use \
             ({pct:.1} % of usable)"
        ),
        (Verdict::DoesNotFit, _) => format!(
            "does not fit: the step needs {needed} at its peak, PyTorch may use {usable} \
             ({:.2}×, short by {})",
            f.ratio,
            fmt_bytes(f.shortage_bytes)
        ),
        (Verdict::AllocatorRefuses, r) => format!(
            "does not fit with PyTorch's allocator: the tensors need {needed} of the {usable} it \
             may use, but it would need {} ({pct:.1} % of usable)",
            fmt_bytes(r.unwrap_or(f.needed_bytes)),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn tensors_over_usable_do_not_fit_and_say_the_ratio_and_the_shortage() {
        let f = judge(75 * GIB, Some((76 * GIB, false)), 25 * GIB);
        assert_eq!(f.verdict, Verdict::DoesNotFit);
        assert!(!f.fits);
        assert_eq!(f.shortage_bytes, 50 * GIB);
        // The tensors alone say it: the allocator's figure is left out.
        assert_eq!(f.reserved_bytes, None);
        assert!((f.ratio - 3.0).abs() < 1e-9, "{}", f.ratio);
        let h = headline(&f);
        assert!(
            h.starts_with("does not fit: the step needs 75.00 GiB"),
            "{h}"
        );
        assert!(h.contains("(3.00×, short by 50.00 GiB)"), "{h}");
    }

    #[test]
    fn tensors_that_fit_where_the_allocator_refuses_are_its_verdict() {
        let f = judge(20 * GIB, Some((26 * GIB, false)), 25 * GIB);
        assert_eq!(f.verdict, Verdict::AllocatorRefuses);
        assert!(!f.fits && f.shortage_bytes == 0);
        // The larger of the two needs, over usable.
        assert!((f.ratio - 26.0 / 25.0).abs() < 1e-9, "{}", f.ratio);
        assert!(headline(&f).starts_with("does not fit with PyTorch's allocator"));
    }

    #[test]
    fn a_step_that_fits_says_its_share_of_usable() {
        let f = judge(GIB, Some((2 * GIB, true)), 8 * GIB);
        assert!(f.fits && f.verdict == Verdict::Fits);
        assert!((f.ratio - 0.25).abs() < 1e-9);
        let h = headline(&f);
        assert!(h.starts_with("fits: the step needs 1.00 GiB"), "{h}");
        assert!(h.contains("(25.0 % of usable)"), "{h}");
        // Without a replay only the tensors count.
        let t = judge(GIB, None, 8 * GIB);
        assert!(t.fits && t.reserved_bytes.is_none() && (t.ratio - 0.125).abs() < 1e-9);
    }

    #[test]
    fn no_usable_memory_is_no_division_by_zero() {
        let f = judge(GIB, None, 0);
        assert!(!f.fits && f.ratio.is_finite());
    }

    #[test]
    fn a_refused_replay_is_judged_by_the_reserved_peak_it_would_need() {
        let mut w = crate::workload::presets::get("tiny-gpt").unwrap();
        w.batch = 4;
        let plan = Plan::for_workload(&w).unwrap();
        let conf = AllocConf::default();
        let free = replay(&plan, &conf, None, 2, false);
        let usable = free.reserved_peak_bytes - 1;
        assert!(plan.peak_bytes() <= usable, "the tensors fit");
        let f = replayed(&plan, &conf, usable);
        assert_eq!(f.verdict, Verdict::AllocatorRefuses, "{f:?}");
        let least = crate::alloc::timeline::least_capacity(&plan, &conf, 2);
        assert_eq!(f.reserved_bytes, Some(least));
        assert!(least > usable && f.ratio > 1.0);
        // Below the tensors' peak no allocator figure is searched for.
        let short = replayed(&plan, &conf, plan.peak_bytes() / 2);
        assert_eq!(short.verdict, Verdict::DoesNotFit);
        assert_eq!(short.reserved_bytes, None);
        let ok = replayed(&plan, &conf, free.reserved_peak_bytes);
        assert!(ok.fits && ok.ratio <= 1.0, "{ok:?}");
    }
}
