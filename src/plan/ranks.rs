//! Rank plans: the plan of one rank of a parallel layout (`workload::parallel`), the worst rank
//! when none is named, and a pipeline stage's schedule of micro-batches built from the stage's
//! plan of one micro-batch.

use super::builder::PlanError;
use super::{Event, EventKind, Phase, Plan, Role, Step, TensorIx, TensorSpec};
use crate::workload::parallel::{self, Schedule, Stage};
use crate::workload::Workload;

/// The plan of `w`'s rank (`parallel.rank`), or of its worst rank: one rank per pipeline stage
/// is built (the ranks of a stage hold the same) and the highest peak wins. `one` builds the
/// plan of one micro-batch of a rank whose `parallel.rank` is set.
pub fn plan(
    w: &Workload,
    one: impl Fn(&Workload) -> Result<Plan, PlanError>,
) -> Result<Plan, PlanError> {
    let ranks = match w.parallel.rank {
        Some(r) => vec![r],
        None => w.stage_ranks(),
    };
    let mut best: Option<(Plan, u64)> = None;
    for r in ranks {
        let mut rw = w.clone();
        rw.parallel.rank = Some(r);
        let mut p = one(&rw)?;
        let st = parallel::stage(&rw, r);
        if st.of > 1 {
            p = schedule(p, &st, &rw)?;
        }
        // Each plan's peak walked once (the best's is kept, not walked again per rank).
        let peak = p.peak().bytes;
        if best.as_ref().is_none_or(|(_, b)| peak > *b) {
            best = Some((p, peak));
        }
    }
    let (mut p, _) = best.ok_or_else(|| PlanError::Invalid("a layout without ranks".into()))?;
    let r = p.workload.parallel.rank.unwrap_or(0);
    let c = p.workload.coords(r);
    let st = parallel::stage(&p.workload, r);
    let mut at = format!("rank {r} of {}", w.gpus);
    if st.of > 1 {
        at.push_str(&format!(
            " (pipeline stage {} of {}, layers {}–{})",
            st.index,
            st.of,
            st.lo,
            st.hi - 1
        ));
    }
    let why = if w.parallel.rank.is_some() {
        "as asked".to_string()
    } else if st.of > 1 {
        "the worst: its stage holds the most".to_string()
    } else {
        "every rank holds the same".to_string()
    };
    let mut degrees = vec![format!("dp {}", c.dp)];
    let lp = &w.parallel;
    for (n, d) in [("tp", lp.tp), ("pp", lp.pp), ("cp", lp.cp)] {
        if d > 1 {
            degrees.push(format!(
                "{n} {}",
                match n {
                    "tp" => c.tp,
                    "pp" => c.pp,
                    _ => c.cp,
                }
            ));
        }
    }
    p.notes.insert(
        0,
        format!(
            "per-rank plan: {at}, {why}; its place: {}",
            degrees.join(", ")
        ),
    );
    // The plan is the worst rank's, but the workload stays as asked (no rank fixed).
    p.workload.parallel.rank = w.parallel.rank;
    Ok(p)
}

/// The rank a plan was built for: its workload's, or the worst one its first note names.
pub fn rank_of(p: &Plan) -> Option<u64> {
    p.workload.parallel.rank.or_else(|| {
        p.notes.iter().find_map(|n| {
            n.strip_prefix("per-rank plan: rank ")?
                .split(' ')
                .next()?
                .parse()
                .ok()
        })
    })
}

/// Forward and backward of micro-batches in the order the stage runs them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    F(u64),
    B(u64),
}

/// The micro-batches a stage's plan holds. GPipe holds all of them at once: every one. Under
/// 1F1B and interleaving, after the warm-up's forwards each forward is followed by a backward:
/// the first backward makes the gradients, every later one adds a temporary into them and
/// leaves the live set as the one before left it, so from the third steady pair on the step
/// repeats itself byte for byte, and the cool-down's backwards are the same whatever came
/// before. The plan holds the warm-up, three steady pairs and the cool-down; its peak, its
/// allocator replay and its note (which names every micro-batch) are those of the whole step,
/// and its size no longer grows with `--microbatches` (issue 48: 2,048 micro-batches on 16
/// stages replayed each plan of the search on each card in full).
fn simulated(st: &Stage, w: &Workload) -> u64 {
    let p = &w.parallel;
    let m = p.microbatches();
    #[cfg(test)]
    if tests::FULL.with(|f| f.get()) {
        return m;
    }
    match p.schedule {
        Schedule::Gpipe => m,
        Schedule::OneFOneB | Schedule::Interleaved => {
            m.min(st.in_flight(p).saturating_add(STEADY_PAIRS))
        }
    }
}

/// Steady forward/backward pairs a 1F1B plan keeps (see [`simulated`]). The live bytes repeat
/// from the third; PyTorch's allocator settles its segments a few pairs later (interleaved
/// with gradients kept needed 6 on the unit test's grid), so 8 are kept.
const STEADY_PAIRS: u64 = 8;

/// The stage's order of forwards and backwards over the micro-batches it simulates.
fn order(st: &Stage, w: &Workload) -> Vec<Op> {
    let p = &w.parallel;
    let m = simulated(st, w);
    let mut out = Vec::new();
    match p.schedule {
        Schedule::Gpipe => {
            out.extend((0..m).map(Op::F));
            out.extend((0..m).map(Op::B));
        }
        Schedule::OneFOneB | Schedule::Interleaved => {
            // Warm-up forwards, then one forward one backward, then the cool-down backwards.
            let warm = st.in_flight(p).saturating_sub(1).min(m);
            let (mut f, mut b) = (0, 0);
            while f < warm {
                out.push(Op::F(f));
                f += 1;
            }
            while f < m {
                out.push(Op::F(f));
                f += 1;
                out.push(Op::B(b));
                b += 1;
            }
            while b < m {
                out.push(Op::B(b));
                b += 1;
            }
        }
    }
    out
}

/// A stage's step: the plan of one micro-batch (forward, loss where the stage has the head,
/// backward) run for each micro-batch in the schedule's order, the model states shared, the
/// gradients made by the first backward and accumulated into by the others (each later
/// gradient a temporary added in place), then one optimizer step.
pub fn schedule(one: Plan, st: &Stage, w: &Workload) -> Result<Plan, PlanError> {
    let ops = order(st, w);
    let n = one.tensors.len();
    // Where each tensor is made and whether it is freed.
    let mut made = vec![Phase::Setup; n];
    let mut freed_in: Vec<Option<Phase>> = vec![None; n];
    for e in &one.events {
        match e.kind {
            EventKind::Alloc(t) => made[t] = e.phase,
            EventKind::Free(t) => freed_in[t] = Some(e.phase),
            EventKind::Kernel(_) => {}
        }
    }
    let fwd = |p: Phase| matches!(p, Phase::Forward | Phase::Loss);
    // Tensors each micro-batch has its own of: made in its forward or its backward, except
    // the gradients, which the first backward makes and the others add into.
    let per_mb = |t: TensorIx| -> bool {
        fwd(made[t]) || (made[t] == Phase::Backward && one.tensors[t].role != Role::Gradients)
    };
    let mut tensors = one.tensors.clone();
    let mut steps = one.steps.clone();
    let mut events: Vec<Event> = Vec::with_capacity(one.events.len() * ops.len());
    // clones[m][t]: micro-batch m's copy of tensor t (m = 0 keeps the originals).
    let mut clones: Vec<Vec<TensorIx>> = Vec::new();
    let m_count = w.parallel.microbatches();
    for m in 0..simulated(st, w) {
        // Names built by concatenation, not `format!`: a long pipeline's plan copies thousands
        // of tensors per micro-batch, for every value a boundary search tries.
        let prefix = format!("mb{m}.");
        let map: Vec<TensorIx> = (0..n)
            .map(|t| {
                if m == 0 || !per_mb(t) {
                    t
                } else {
                    tensors.push(renamed(&one.tensors[t], &prefix, ""));
                    tensors.len() - 1
                }
            })
            .collect();
        clones.push(map);
    }
    let step_of = |m: u64, k: usize, steps: &mut Vec<Step>| -> usize {
        if m == 0 {
            return k;
        }
        let map = &clones[m as usize];
        steps.push(one.steps[k].map_tensors(|t| map[t]));
        steps.len() - 1
    };
    let setup = one.events.iter().filter(|e| e.phase == Phase::Setup);
    events.extend(setup.copied());
    let mut first_backward = true;
    for op in ops {
        let (m, backward) = match op {
            Op::F(m) => (m, false),
            Op::B(m) => (m, true),
        };
        let map = clones[m as usize].clone();
        for e in &one.events {
            let mine = if backward {
                e.phase == Phase::Backward
            } else {
                fwd(e.phase)
            };
            if !mine {
                continue;
            }
            let kind = match e.kind {
                EventKind::Kernel(k) => EventKind::Kernel(step_of(m, k, &mut steps)),
                EventKind::Alloc(t) if backward && !per_mb(t) && !first_backward => {
                    // A later micro-batch's gradient: a temporary added into the first's.
                    let mut spec = renamed(&one.tensors[t], &format!("mb{m}."), ".new");
                    spec.role = Role::Workspace;
                    tensors.push(spec);
                    let tmp = tensors.len() - 1;
                    events.push(Event {
                        phase: e.phase,
                        kind: EventKind::Alloc(tmp),
                    });
                    EventKind::Free(tmp)
                }
                // What the step frees of the states in backward happens once.
                EventKind::Free(t) if backward && !per_mb(t) && !first_backward => continue,
                EventKind::Alloc(t) => EventKind::Alloc(map[t]),
                EventKind::Free(t) => EventKind::Free(map[t]),
            };
            events.push(Event {
                phase: e.phase,
                kind,
            });
        }
        if backward {
            first_backward = false;
        }
    }
    // The step's end; what a micro-batch held until then (a sent gradient) goes for each.
    for e in one.events.iter().filter(|e| e.phase == Phase::Optimizer) {
        match e.kind {
            EventKind::Free(t) if per_mb(t) => {
                for map in &clones {
                    events.push(Event {
                        phase: e.phase,
                        kind: EventKind::Free(map[t]),
                    });
                }
            }
            _ => events.push(*e),
        }
    }
    let mut notes = one.notes.clone();
    notes.push(format!(
        "pipeline: {} micro-batches of {} under {}, stage {} holds {} at once",
        m_count,
        w.batch,
        w.parallel.schedule.name(),
        st.index,
        st.in_flight(&w.parallel)
    ));
    Ok(Plan {
        workload: one.workload,
        scenario: one.scenario,
        value: one.value,
        tensors,
        steps,
        events,
        notes,
    })
}

/// A copy of `t` named `prefix` + its name + `suffix`.
fn renamed(t: &TensorSpec, prefix: &str, suffix: &str) -> TensorSpec {
    let mut name = String::with_capacity(prefix.len() + t.name.len() + suffix.len());
    name.push_str(prefix);
    name.push_str(&t.name);
    name.push_str(suffix);
    TensorSpec {
        name,
        role: t.role,
        dtype: t.dtype,
        shape: t.shape.clone(),
        bytes: t.bytes,
        row_elems: t.row_elems,
        stream: t.stream,
        part_bytes: t.part_bytes,
    }
}

/// Which rank a plan is (JSON `rank` of `estimate`; None without a layout).
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct RankInfo {
    pub rank: u64,
    pub of: u64,
    /// Chosen as the worst rank (no `--rank` was given).
    pub worst: bool,
    pub coords: crate::workload::parallel::Coords,
    pub stage: u64,
    pub stages: u64,
    /// The stage's layers, first and last.
    pub layers: [u64; 2],
}

/// The rank `p` was built for.
pub fn info(p: &Plan) -> Option<RankInfo> {
    let w = &p.workload;
    if w.parallel.is_single() {
        return None;
    }
    let r = rank_of(p)?;
    let st = parallel::stage(w, r);
    Some(RankInfo {
        rank: r,
        of: w.gpus,
        worst: w.parallel.rank.is_none(),
        coords: w.coords(r),
        stage: st.index,
        stages: st.of,
        layers: [st.lo, st.hi.saturating_sub(1)],
    })
}

#[cfg(test)]
mod tests {
    use crate::alloc::{timeline::replay, AllocConf};
    use crate::plan::Plan;
    use crate::workload::parallel::Schedule;
    use std::cell::Cell;

    thread_local! {
        /// Build every micro-batch (the step as it runs), to check the shortened plan.
        pub static FULL: Cell<bool> = const { Cell::new(false) };
    }

    fn both(w: &crate::workload::Workload) -> (Plan, Plan) {
        FULL.with(|f| f.set(true));
        let full = Plan::for_workload(w).unwrap();
        FULL.with(|f| f.set(false));
        (full, Plan::for_workload(w).unwrap())
    }

    #[test]
    fn a_shortened_1f1b_plan_peaks_and_replays_as_the_whole_step() {
        let mut checked = 0;
        for (layers, pp, schedule, chunks) in [
            (8, 2, Schedule::OneFOneB, 1),
            (8, 4, Schedule::OneFOneB, 1),
            (8, 8, Schedule::OneFOneB, 1),
            (8, 2, Schedule::Interleaved, 2),
            (8, 4, Schedule::Interleaved, 2),
            (16, 8, Schedule::OneFOneB, 1),
            (16, 4, Schedule::Interleaved, 4),
        ] {
            for m in [1, 2, 3, 5, 8, 13, 24, 40, 64] {
                for grads in [crate::workload::Grads::Free, crate::workload::Grads::Keep] {
                    let mut w = crate::workload::presets::get("tiny-gpt").unwrap();
                    w.layers = layers;
                    w.grads = grads;
                    w.parallel.pp = pp;
                    w.parallel.schedule = schedule;
                    w.parallel.chunks = chunks;
                    w.parallel.microbatches = m;
                    w.gpus = pp;
                    let (full, short) = both(&w);
                    let what = format!("{layers} layers, pp {pp}, {schedule:?}, {m} mbs");
                    assert_eq!(full.peak().bytes, short.peak().bytes, "{what}");
                    assert_eq!(full.notes, short.notes, "{what}");
                    let conf = AllocConf::default();
                    let (a, b) = (
                        replay(&full, &conf, None, 2, false),
                        replay(&short, &conf, None, 2, false),
                    );
                    // A piece's states are one block per parameter (`TensorSpec::part_bytes`):
                    // the biases' and norms' blocks share the small pool with the activations,
                    // and over many microbatches its free 2 MiB segments can drift by one that
                    // the shortened plan does not reach (8 layers, pp 4, interleaved, 64
                    // microbatches, gradients kept). The tensors are the same to the byte.
                    let (whole, cut) = (a.reserved_peak_bytes, b.reserved_peak_bytes);
                    assert!(
                        cut <= whole && whole - cut <= 2 << 20,
                        "{what}: reserved {whole} (whole step) against {cut} (shortened)"
                    );
                    assert_eq!(a.allocated_peak_bytes, b.allocated_peak_bytes, "{what}");
                    if short.events.len() < full.events.len() {
                        checked += 1;
                    }
                }
            }
        }
        assert!(checked > 20, "{checked} shortened");
    }
}
