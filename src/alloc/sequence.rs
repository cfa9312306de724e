//! Consecutive steps of different shapes through one caching allocator (`estimate
//! --seq-lengths`): batches of varying length, as fine-tuning datasets give them. The cache one
//! step leaves is what the next allocates from, so the blocks split for the shorter steps
//! before the longest are there when it comes: the reserved peak and the fragmentation that
//! builds up are the sequence's, not the longest step's alone.
//!
//! Each step is one steady-state plan. The model states (the plans' setup) are allocated once,
//! by the first step, and are the same tensors in every later one: the plans must agree on
//! them, tensor by tensor. Whatever else a step leaves live at its end is freed there.

use serde::Serialize;

use super::caching::{Allocator, BlockId};
use super::conf::AllocConf;
use super::device::ModelDevice;
use super::timeline::{malloc_tensor, Failure};
use crate::plan::{EventKind, Phase, Plan};

/// The most steps a sequence may have (`--seq-lengths`' bound).
pub const MAX_STEPS: usize = crate::workload::flags::MAX_SEQ_LENGTHS as usize;

/// One step of the sequence.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct StepRow {
    /// 1-based.
    pub step: usize,
    /// The value of the varied dimension (the sequence length).
    pub value: u64,
    /// The step's tensors at their peak (`max_memory_allocated` without rounding).
    pub tensors_peak_bytes: u64,
    /// The most the allocator reserved during the step, and reserved − allocated then.
    pub reserved_peak_bytes: u64,
    pub fragmentation_bytes: u64,
    /// Reserved when the step ends (the cache the next step starts from).
    pub reserved_end_bytes: u64,
}

/// The sequence through the allocator.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Sequence {
    /// The steps replayed (up to and including a failing one).
    pub steps: Vec<StepRow>,
    /// The highest reserved of all steps, the step that reached it and reserved − allocated
    /// then.
    pub reserved_peak_bytes: u64,
    pub reserved_peak_step: usize,
    pub fragmentation_bytes: u64,
    /// The highest tensors' peak of all steps (the longest step's).
    pub tensors_peak_bytes: u64,
    /// Times the allocator freed its cache and retried.
    pub retries: u64,
    /// The first request the card could not serve.
    pub failure: Option<Failure>,
}

/// Why a sequence cannot be replayed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SequenceError {
    #[error("no steps")]
    Empty,
    #[error("{0} steps: at most {MAX_STEPS}")]
    TooMany(usize),
    #[error("the model states differ between the plans of {0} and {1} (they must be the same tensors in every step)")]
    StatesDiffer(u64, u64),
    #[error("the step frees model states it began with (--grads until-backward): steps of varying length are replayed with gradients freed or kept")]
    StatesFreed,
}

/// The setup's allocations of `plan`: (tensor, bytes) in order.
fn setup_of(plan: &Plan) -> Vec<(usize, u64)> {
    plan.events
        .iter()
        .filter(|e| e.phase == Phase::Setup)
        .filter_map(|e| match e.kind {
            EventKind::Alloc(t) => Some((t, plan.tensors[t].bytes)),
            _ => None,
        })
        .collect()
}

/// Replay `steps` (each a value of the varied dimension and the plan at it) in order through
/// one allocator with `conf`, on a card whose allocator may take `capacity` bytes (None: no
/// limit).
pub fn replay(
    steps: &[(u64, &Plan)],
    conf: &AllocConf,
    capacity: Option<u64>,
) -> Result<Sequence, SequenceError> {
    let Some(&(first_value, _)) = steps.first() else {
        return Err(SequenceError::Empty);
    };
    if steps.len() > MAX_STEPS {
        return Err(SequenceError::TooMany(steps.len()));
    }
    // Each step's model states (its plan's setup), found once.
    let setups: Vec<Vec<(usize, u64)>> = steps.iter().map(|&(_, p)| setup_of(p)).collect();
    let setup = &setups[0];
    for (&(v, _), other) in steps.iter().zip(&setups).skip(1) {
        let same = other.len() == setup.len() && other.iter().zip(setup).all(|(a, b)| a.1 == b.1);
        if !same {
            return Err(SequenceError::StatesDiffer(first_value, v));
        }
    }
    let mut dev = match capacity {
        Some(c) => ModelDevice::new(c, c),
        None => ModelDevice::unlimited(),
    };
    let mut a = Allocator::new(conf.clone());
    // The model states' blocks, in setup order.
    let mut states: Vec<Vec<BlockId>> = Vec::with_capacity(setup.len());
    let mut out = Sequence {
        steps: Vec::with_capacity(steps.len()),
        reserved_peak_bytes: 0,
        reserved_peak_step: 1,
        fragmentation_bytes: 0,
        tensors_peak_bytes: 0,
        retries: 0,
        failure: None,
    };
    'steps: for (k, &(value, plan)) in steps.iter().enumerate() {
        let step = k + 1;
        let mut live: Vec<Option<Vec<BlockId>>> = vec![None; plan.tensors.len()];
        let mut setup_seen = 0;
        let mut row = StepRow {
            step,
            value,
            tensors_peak_bytes: plan.peak_bytes(),
            reserved_peak_bytes: 0,
            fragmentation_bytes: 0,
            reserved_end_bytes: 0,
        };
        for (i, e) in plan.events.iter().enumerate() {
            match e.kind {
                EventKind::Alloc(t) if e.phase == Phase::Setup && step > 1 => {
                    // The same tensor as the first step's.
                    live[t] = states.get(setup_seen).cloned();
                    setup_seen += 1;
                    continue;
                }
                EventKind::Alloc(t) => {
                    if live[t].is_some() {
                        continue;
                    }
                    match malloc_tensor(&mut a, &mut dev, &plan.tensors[t]) {
                        Ok(ids) => {
                            if e.phase == Phase::Setup {
                                states.push(ids.clone());
                            }
                            live[t] = Some(ids);
                        }
                        Err(oom) => {
                            out.failure = Some(Failure::at(plan, step, i, t, capacity, oom));
                            row.reserved_end_bytes = a.stats().reserved;
                            out.steps.push(row);
                            break 'steps;
                        }
                    }
                }
                EventKind::Free(t) => match live[t].take() {
                    Some(ids) => ids.into_iter().for_each(|id| a.free(id)),
                    None => continue,
                },
                EventKind::Kernel(_) => continue,
            }
            let s = a.stats();
            if s.reserved > row.reserved_peak_bytes {
                row.reserved_peak_bytes = s.reserved;
                row.fragmentation_bytes = s.reserved.saturating_sub(s.allocated);
            }
        }
        // The model states are still there; what the step leaves live beyond them goes with it.
        let held = states.len() == setup.len()
            && setups[k]
                .iter()
                .zip(&states)
                .all(|(&(t, _), ids)| live[t].take().as_ref() == Some(ids));
        if !held {
            return Err(SequenceError::StatesFreed);
        }
        for id in live.into_iter().flatten().flatten() {
            a.free(id);
        }
        row.reserved_end_bytes = a.stats().reserved;
        if row.reserved_peak_bytes > out.reserved_peak_bytes {
            out.reserved_peak_bytes = row.reserved_peak_bytes;
            out.reserved_peak_step = step;
            out.fragmentation_bytes = row.fragmentation_bytes;
        }
        out.tensors_peak_bytes = out.tensors_peak_bytes.max(row.tensors_peak_bytes);
        out.steps.push(row);
    }
    out.retries = a.stats().num_alloc_retries;
    Ok(out)
}

/// The sequence as text: a row per step (the first few, the longest, the reserved peak's and
/// the last, when there are many), then the reserved peak against the longest step replayed
/// alone, and the failure on the card if there is one.
/// `unlimited` is the same sequence with no limit on the card and `longest_alone` the longest
/// step replayed alone: their reserved peaks say what the other lengths add.
pub fn text(
    seq: &Sequence,
    unlimited: &Sequence,
    longest_alone: &super::timeline::Replay,
    usable: Option<u64>,
) -> String {
    use crate::units::fmt_bytes;
    let longest = seq
        .steps
        .iter()
        .max_by_key(|r| (r.value, std::cmp::Reverse(r.step)))
        .map_or(0, |r| r.step);
    let show = |r: &StepRow| {
        seq.steps.len() <= 24
            || r.step <= 4
            || r.step == longest
            || r.step == seq.reserved_peak_step
            || r.step == seq.steps.len()
    };
    let mut t = format!(
        "{} steps of varying length through PyTorch's caching allocator (steady steps, one cache)\n",
        seq.steps.len()
    );
    t.push_str(&format!(
        "{:>6} {:>8} {:>14} {:>14} {:>14} {:>14}\n",
        "step", "seq", "tensors peak", "reserved peak", "fragmentation", "reserved end"
    ));
    let mut skipped = false;
    for r in &seq.steps {
        if !show(r) {
            if !skipped {
                t.push_str("   ...\n");
            }
            skipped = true;
            continue;
        }
        skipped = false;
        t.push_str(&format!(
            "{:>6} {:>8} {:>14} {:>14} {:>14} {:>14}\n",
            r.step,
            r.value,
            fmt_bytes(r.tensors_peak_bytes),
            fmt_bytes(r.reserved_peak_bytes),
            fmt_bytes(r.fragmentation_bytes),
            fmt_bytes(r.reserved_end_bytes)
        ));
    }
    let extra = unlimited
        .reserved_peak_bytes
        .saturating_sub(longest_alone.reserved_peak_bytes);
    t.push_str(&format!(
        "with no limit: reserved peak {} at step {} ({} reserved but unallocated then); the longest step alone, replayed for {} steps, reserves {}: {} more from the steps of other lengths\n",
        fmt_bytes(unlimited.reserved_peak_bytes),
        unlimited.reserved_peak_step,
        fmt_bytes(unlimited.fragmentation_bytes),
        longest_alone.steps,
        fmt_bytes(longest_alone.reserved_peak_bytes),
        fmt_bytes(extra)
    ));
    match (&seq.failure, usable) {
        (Some(f), Some(u)) => t.push_str(&format!(
            "does not fit in {} for PyTorch: step {} ({} {}) cannot allocate {} for {} ({})\n",
            fmt_bytes(u),
            f.step,
            f.phase.name(),
            f.event,
            fmt_bytes(f.oom.requested),
            f.tensor,
            if f.fragmentation {
                "fragmentation: the free memory would have served it"
            } else {
                "a shortage"
            }
        )),
        (None, Some(u)) => t.push_str(&format!(
            "fits in {} for PyTorch: every step served\n",
            fmt_bytes(u)
        )),
        _ => {}
    }
    t
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::workload::presets;

    fn plan_at(seq: u64) -> Plan {
        let mut w = presets::get("tiny-gpt").unwrap();
        w.max_positions = 1024;
        w.seq = seq;
        // The steps alone: cuBLAS's 8 MiB workspace would take a 20 MiB segment of its own,
        // more than this tiny model's steps.
        w.cublas_workspace = Some(0);
        Plan::for_workload(&w).unwrap()
    }

    #[test]
    fn plans_whose_states_differ_are_refused() {
        // GPT-2's learned positions grow past max_positions with a longer --seq.
        let mut w = presets::get("tiny-gpt").unwrap();
        w.max_positions = 64;
        let short = Plan::for_workload(&w).unwrap();
        w.seq = 128;
        let long = Plan::for_workload(&w).unwrap();
        let r = replay(&[(64, &short), (128, &long)], &AllocConf::default(), None);
        assert_eq!(r, Err(SequenceError::StatesDiffer(64, 128)));
    }

    #[test]
    fn one_length_is_the_plain_replay() {
        let p = plan_at(64);
        let conf = AllocConf::default();
        let seq = replay(&[(64, &p), (64, &p)], &conf, None).unwrap();
        let plain = super::super::timeline::replay(&p, &conf, None, 2, false);
        assert_eq!(seq.reserved_peak_bytes, plain.reserved_peak_bytes);
        assert_eq!(seq.tensors_peak_bytes, p.peak_bytes());
        assert_eq!(seq.steps.len(), 2);
        assert!(seq.failure.is_none());
    }

    #[test]
    fn the_longest_step_sets_the_tensors_peak_and_short_steps_before_it_can_only_add() {
        let (short, long) = (plan_at(16), plan_at(128));
        let conf = AllocConf::default();
        let seq = replay(&[(16, &short), (128, &long), (16, &short)], &conf, None).unwrap();
        assert_eq!(seq.tensors_peak_bytes, long.peak_bytes());
        let alone = super::super::timeline::replay(&long, &conf, None, 1, false);
        assert!(seq.reserved_peak_bytes >= alone.reserved_peak_bytes);
        assert_eq!(seq.steps[1].value, 128);
    }

    #[test]
    fn a_card_too_small_names_the_step() {
        let (short, long) = (plan_at(16), plan_at(512));
        let cap = short.peak_bytes() + (short.peak_bytes() / 2);
        let seq = replay(
            &[(16, &short), (512, &long)],
            &AllocConf::default(),
            Some(cap),
        )
        .unwrap();
        assert_eq!(seq.failure.as_ref().map(|f| f.step), Some(2));
    }

    #[test]
    fn empty_and_too_long_are_refused() {
        let p = plan_at(16);
        let conf = AllocConf::default();
        assert_eq!(replay(&[], &conf, None), Err(SequenceError::Empty));
        let many = vec![(16, &p); MAX_STEPS + 1];
        assert_eq!(
            replay(&many, &conf, None),
            Err(SequenceError::TooMany(MAX_STEPS + 1))
        );
    }
}
