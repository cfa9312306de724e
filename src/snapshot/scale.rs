//! Two snapshots of the same job at two batch sizes: match their allocations, classify each as
//! fixed or scaling, and synthesize the trace at any batch.
//!
//! Assumption (stated in every report): each allocation's bytes are linear in the batch,
//! `bytes(x) = bytes(a) + (bytes(b) - bytes(a)) * (x - a) / (b - a)`, and the sequence of
//! allocations at batch x is the one at the larger batch b. Allocations are matched by order and
//! stack frames (a windowed alignment: PyTorch takes fast paths at batch 1 that skip a copy, so
//! the two sequences can differ by a few allocations); an allocation of b without a partner in
//! a is fixed. Scaling works on tensor blocks: segments are the caching allocator's response
//! and their count changes with the batch.

use super::trace::Trace;
use super::{Granularity, SnapshotError};

/// How far ahead the alignment looks for a partner (allocations).
const WINDOW: usize = 64;

/// Fixed or scaling with the batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Class {
    Fixed,
    Scaling,
}

/// The fitted model: the larger trace as the template, a line per allocation.
#[derive(Debug, Clone)]
pub struct ScaleModel {
    pub template: Trace,
    pub batches: (u64, u64),
    /// Bytes at batch a and b of each template allocation (a = b when unmatched).
    pub sizes: Vec<(u64, u64)>,
    pub matched: usize,
    pub unmatched: usize,
}

/// Allocation indices in allocation order.
fn alloc_order(t: &Trace) -> Vec<usize> {
    t.events.iter().filter(|e| e.alloc).map(|e| e.ix).collect()
}

/// For each allocation of `b` (in allocation order), its partner in `a`, by a windowed
/// alignment of their frame keys.
fn align(a: &Trace, b: &Trace) -> Vec<(usize, Option<usize>)> {
    let (oa, ob) = (alloc_order(a), alloc_order(b));
    let key_a = |i: usize| &a.allocs[oa[i]].key;
    let key_b = |j: usize| &b.allocs[ob[j]].key;
    let (mut i, mut j) = (0, 0);
    let mut out = Vec::with_capacity(ob.len());
    while j < ob.len() {
        if i < oa.len() && key_a(i) == key_b(j) {
            out.push((ob[j], Some(oa[i])));
            i += 1;
            j += 1;
            continue;
        }
        // The nearest resynchronisation: skip d in b (extra allocations of b) or in a.
        let skip_b =
            (1..=WINDOW).find(|&d| i < oa.len() && j + d < ob.len() && key_a(i) == key_b(j + d));
        let skip_a = (1..=WINDOW).find(|&d| i + d < oa.len() && key_a(i + d) == key_b(j));
        match (skip_b, skip_a) {
            (Some(db), Some(da)) if da < db => i += da,
            (Some(db), _) => {
                for k in 0..db {
                    out.push((ob[j + k], None));
                }
                j += db;
            }
            (None, Some(da)) => i += da,
            (None, None) => {
                out.push((ob[j], None));
                i += 1;
                j += 1;
            }
        }
    }
    out
}

impl ScaleModel {
    /// Fit from trace `a` at batch `ba` and trace `b` at batch `bb` (blocks granularity).
    pub fn fit(a: &Trace, ba: u64, b: &Trace, bb: u64) -> Result<ScaleModel, SnapshotError> {
        if a.granularity != Granularity::Blocks || b.granularity != Granularity::Blocks {
            return Err(SnapshotError::Scale(
                "scaling needs block-granularity traces".into(),
            ));
        }
        if ba == bb || ba == 0 || bb == 0 {
            return Err(SnapshotError::Scale(format!(
                "--batch-of: the two snapshots need two different batch sizes above 0 (got {ba} and {bb})"
            )));
        }
        let (a, ba, b, bb) = if ba < bb {
            (a, ba, b, bb)
        } else {
            (b, bb, a, ba)
        };
        let mut sizes: Vec<(u64, u64)> = b.allocs.iter().map(|x| (x.bytes, x.bytes)).collect();
        let (mut matched, mut unmatched) = (0, 0);
        let mut lone = Vec::new();
        for (jb, ia) in align(a, b) {
            match ia {
                Some(ia) => {
                    sizes[jb].0 = a.allocs[ia].bytes;
                    matched += 1;
                }
                None => lone.push(jb),
            }
        }
        // An allocation only at batch b (a copy PyTorch skips at batch 1) follows a matched
        // one of the same stack and the same bytes at b, if there is one; else it is fixed.
        let mut line_of: std::collections::HashMap<(&str, u64), (u64, u64)> = Default::default();
        for (i, x) in b.allocs.iter().enumerate() {
            if sizes[i].0 != sizes[i].1 {
                line_of.entry((&*x.key, x.bytes)).or_insert(sizes[i]);
            }
        }
        for jb in lone {
            match line_of.get(&(&*b.allocs[jb].key, b.allocs[jb].bytes)) {
                Some(&line) => {
                    sizes[jb] = line;
                    matched += 1;
                }
                None => unmatched += 1,
            }
        }
        Ok(ScaleModel {
            template: b.clone(),
            batches: (ba, bb),
            sizes,
            matched,
            unmatched,
        })
    }

    pub fn class(&self, i: usize) -> Class {
        let (sa, sb) = self.sizes[i];
        if sa == sb {
            Class::Fixed
        } else {
            Class::Scaling
        }
    }

    /// Bytes of allocation `i` at batch `x` (the line through the two measurements, at least 0).
    pub fn bytes_at(&self, i: usize, x: u64) -> u64 {
        let (sa, sb) = self.sizes[i];
        let (a, b) = self.batches;
        let slope = (sb as f64 - sa as f64) / (b as f64 - a as f64);
        let v = sa as f64 + slope * (x as f64 - a as f64);
        if v <= 0.0 {
            0
        } else {
            v.round().min(u64::MAX as f64) as u64
        }
    }

    /// The synthesized trace at batch `x`.
    pub fn at(&self, x: u64) -> Trace {
        let mut t = self.template.clone();
        for (i, a) in t.allocs.iter_mut().enumerate() {
            a.bytes = self.bytes_at(i, x);
        }
        t.notes.push(format!(
            "synthesized at batch {x} from snapshots at batch {} and {} (each allocation linear in the batch)",
            self.batches.0, self.batches.1
        ));
        t
    }

    /// Bytes of fixed and of scaling allocations at the template's peak.
    pub fn split_at_peak(&self) -> (u64, u64) {
        let t = &self.template;
        let mut live = vec![false; t.allocs.len()];
        let (mut best, mut at) = (0u64, Vec::new());
        let mut sum = 0u64;
        for e in &t.events {
            live[e.ix] = e.alloc;
            let b = t.allocs[e.ix].bytes;
            if e.alloc {
                sum += b;
                if sum > best {
                    best = sum;
                    at = live.clone();
                }
            } else {
                sum = sum.saturating_sub(b);
            }
        }
        let (mut fixed, mut scaling) = (0, 0);
        for (i, &l) in at.iter().enumerate() {
            if l {
                match self.class(i) {
                    Class::Fixed => fixed += t.allocs[i].bytes,
                    Class::Scaling => scaling += t.allocs[i].bytes,
                }
            }
        }
        (fixed, scaling)
    }

    /// The largest batch (up to `max`) whose synthesized peak fits in `capacity` bytes.
    pub fn predict_max(&self, capacity: u64, max: u64) -> Option<u64> {
        let r: Result<Option<u64>, ()> =
            crate::estimate::largest_true(|x| Ok(x <= max && self.at(x).peak() <= capacity));
        r.ok().flatten()
    }
}

/// How well the model predicts a third trace at batch `x`: (predicted peak, its own peak).
pub fn check_against(model: &ScaleModel, third: &Trace, x: u64) -> (u64, u64) {
    (model.at(x).peak(), third.peak())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::{Phase, Role};
    use crate::snapshot::trace::{Allocation, TraceEvent};

    /// A trace allocating `(key, bytes)` in order and freeing nothing.
    fn trace(allocs: &[(&str, u64)]) -> Trace {
        Trace {
            granularity: Granularity::Blocks,
            allocs: allocs
                .iter()
                .map(|&(k, bytes)| Allocation {
                    bytes,
                    frame: k.into(),
                    key: k.into(),
                    phase: Phase::Forward,
                    role: Role::Activations,
                    before_trace: false,
                    role_known: true,
                })
                .collect(),
            events: (0..allocs.len())
                .map(|ix| TraceEvent {
                    alloc: true,
                    ix,
                    phase: Phase::Forward,
                    entry: Some(ix),
                })
                .collect(),
            oom: None,
            notes: Vec::new(),
        }
    }

    #[test]
    fn an_extra_copy_at_the_larger_batch_scales_like_its_sibling() {
        let a = trace(&[("w", 100), ("x", 10), ("y", 20)]);
        let b = trace(&[("w", 100), ("x", 20), ("x", 20), ("y", 40)]);
        let m = ScaleModel::fit(&a, 1, &b, 2).unwrap();
        assert_eq!(m.class(0), Class::Fixed);
        assert_eq!(m.class(1), Class::Scaling);
        assert_eq!(m.class(2), Class::Scaling, "the copy follows x");
        assert_eq!(m.unmatched, 0);
        assert_eq!(m.at(4).peak(), 100 + 40 + 40 + 80);
        // Given in either order, the same model.
        let m2 = ScaleModel::fit(&b, 2, &a, 1).unwrap();
        assert_eq!(m2.at(4).peak(), m.at(4).peak());
        assert!(ScaleModel::fit(&a, 1, &b, 1).is_err());
    }
}
