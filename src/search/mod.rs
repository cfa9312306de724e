//! Boundary search over an oracle. Pure logic, tested with mock oracles.
//!
//! Two searches share one set of probing rules (`probing`). [`find_boundary_charged`] (the
//! default, and [`find_boundary_measured`] without the page signature) reads what each probe
//! measured about the device's capacity (the room filler found at a fit's peak or right after a
//! refusal), inverts the plan's bytes per value to the boundary, probes that value and its
//! neighbour, and when the measurements and the probes disagree bisects over the values where
//! the device's charge changes. [`find_boundary`] only sees fit or fail: it starts at the
//! prediction, gallops to bracket the boundary, bisects, then confirms the pair once more.
//!
//! A child that died before answering (`crashed`, `killed`, `timeout`) is probed once more at
//! the same value. Any outcome other than `Fit` steers the search like a failure, and the first
//! failure's reason is what the run reports. A `crashed` probe counts as not fitting. A `killed`
//! or `timeout` probe is inconclusive: the device said nothing, so it never lowers the boundary
//! below a fit seen above it, and when the bracket's upper end is inconclusive the search steps
//! over it to look for a real answer above.
//!
//! One file per search: `gallop` (fit or fail), `measured` (what the probes measured) and
//! `lightning` (the baseline the benchmark compares against); `probing` holds the rules
//! they share. This file holds the types they pass around and the values each scenario may
//! take.

mod gallop;
mod lightning;
mod measured;
mod probing;

pub use gallop::find_boundary;
pub use lightning::lightning_style;
pub use measured::{find_boundary_charged, find_boundary_measured, MIN_ROOM_STEP};

use serde::{Deserialize, Serialize};

use crate::report::Outcome;
use crate::scenario::Scenario;

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

/// Granularity of the params scenario: 2^16 parameters (1 MiB of fp32 Adam states).
pub const PARAMS_GRANULARITY: u64 = 1 << 16;

/// The values a scenario may take.
pub fn search_space(scenario: Scenario) -> SearchSpace {
    match scenario {
        Scenario::Params => SearchSpace {
            min: PARAMS_GRANULARITY,
            max: 1 << 44,
            granularity: PARAMS_GRANULARITY,
        },
        Scenario::Batch | Scenario::Activations => SearchSpace::unit(1 << 20),
        Scenario::Seq => SearchSpace::unit(1 << 22),
    }
}

/// Mock oracles the searches' tests share.
#[cfg(test)]
mod oracles {
    use crate::report::Outcome;

    /// Fits up to `b`, out of memory above.
    pub(super) fn threshold(b: u64) -> impl FnMut(u64) -> Outcome {
        move |x| {
            if x <= b {
                Outcome::Fit
            } else {
                Outcome::OutOfMemory
            }
        }
    }
}
