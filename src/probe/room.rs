//! The room left on the device, measured with filler (buffers of the plan's chunk size while
//! they fit, then one buffer sized by bisection to what the device takes, in whole pages, never
//! more than the search's limit, all freed at once), and the capacity bounds a probe's record
//! gives the search.
//!
//! A fitting probe measures right before the allocation that reaches the charged peak, when the
//! plan holds the most it holds with that tensor still to come: the capacity is then at least
//! the live bytes plus the room, in the device's own state at that moment (fragmentation
//! included), and the room includes the peak tensor's share, so the filler is made of buffers
//! as large as the plan's own (a device charges small buffers differently: suballocation
//! blocks, pages). A refused probe measures right after the refusal: how much of the request
//! the device could still give. Measuring at the end of the step instead would fill everything
//! the step freed. The filler is allocated, not written: a driver that commits memory only when
//! it is written shows more room than it has, which the search notices when the next probe
//! disagrees.

use crate::backend::{AllocError, Backend, BufferId};
use crate::plan::{EventKind, Plan};
use crate::report::{Outcome, ProbeRecord, RoomMeasurement};
use crate::search::{Bounds, RoomAsk};
use crate::tensor::{self, DeviceTensor};

use super::charge::Charge;

/// Most filler buffers one measurement holds (a device that refuses nothing stops here, the
/// room counted so far a lower bound).
const MAX_FILLER_BUFFERS: usize = 4096;

fn is_memory(e: &AllocError) -> bool {
    matches!(
        e,
        AllocError::OutOfMemory { .. } | AllocError::Budget { .. }
    )
}

/// Measure the room on `backend` before timeline event `event`, with `live_bytes` of the plan
/// live and the plan's chunks there `chunk_bytes` large, in whole pages of `page` bytes (so
/// the room is what the device charged for it). Everything allocated is freed before returning.
pub fn measure(
    backend: &mut dyn Backend,
    event: usize,
    live_bytes: u64,
    chunk_bytes: u64,
    ask: RoomAsk,
    page: u64,
) -> RoomMeasurement {
    let page = page.max(1);
    let down = |b: u64| b / page * page;
    let up = |b: u64| b.div_ceil(page).max(1) * page;
    let max = down(backend.info().max_chunk_bytes()).max(page);
    let step = up(ask.step).min(max);
    // At most half a buffer, so the last one can grow to one piece more. (Pieces as large as
    // the plan's own 128 MiB chunks were tried on lavapipe under an address-space limit: a fit
    // then measured 290 MB of room where the plan's next 276 MB tensor was refused; 64 MiB
    // pieces measure 274 MB, a little under what the tensor gets, which costs fewer probes.)
    let piece = up(chunk_bytes).min(down(max / 2)).clamp(step, max);
    let mut held: Vec<BufferId> = Vec::new();
    let mut room = 0u64;
    let mut other_error = false;
    // Whole pieces while the device takes them and the limit allows.
    while room + piece <= ask.limit && held.len() < MAX_FILLER_BUFFERS {
        match backend.alloc_buffer(piece) {
            Ok(id) => {
                held.push(id);
                room += piece;
            }
            Err(e) => {
                other_error = !is_memory(&e);
                break;
            }
        }
    }
    // The rest as one buffer, from the last piece (freed) up to one piece more: the largest
    // size the device takes, bisected to `step`.
    let mut good = 0;
    if let Some(id) = held.pop() {
        backend.free_buffer(id);
        room -= piece;
        good = piece;
    }
    let mut bad = (good + piece).min(max).min(down(ask.limit - room));
    let mut refused = None;
    if !other_error && bad > good {
        let mut fits = |size: u64| match backend.alloc_buffer(size) {
            Ok(id) => {
                backend.free_buffer(id);
                Some(true)
            }
            Err(e) if is_memory(&e) => Some(false),
            Err(_) => None,
        };
        match fits(bad) {
            Some(true) => good = bad,
            Some(false) => {
                while bad - good > step {
                    let mid = (good + down((bad - good) / 2)).max(good + page);
                    match fits(mid) {
                        Some(true) => good = mid,
                        Some(false) => bad = mid,
                        None => break,
                    }
                }
                refused = Some(bad - good);
            }
            None => {}
        }
    }
    for id in held {
        backend.free_buffer(id);
    }
    RoomMeasurement {
        event,
        live_bytes,
        room_bytes: room + good,
        refused_bytes: refused,
        chunk_bytes: piece,
        limit_bytes: ask.limit,
    }
}

/// The room a replay measures: just before the allocation that reaches the charged peak (the
/// room then includes the peak tensor's share, so the search's limit is raised by its bytes),
/// and, where an allocation is refused, right after the refusal (how much of the request the
/// device could still give). The latter replaces the former.
#[derive(Debug, Clone)]
pub struct RoomProbe {
    peak_event: usize,
    ask: RoomAsk,
    charge: Charge,
    /// What was measured, if anything yet.
    pub found: Option<RoomMeasurement>,
}

impl RoomProbe {
    pub fn new(plan: &Plan, ask: RoomAsk, charge: Charge) -> Self {
        Self::before(charge.peak_event(plan), ask, charge)
    }

    /// Measuring before allocation event `event` instead of the peak (as before the peak:
    /// the limit raised by that tensor's bytes).
    pub fn before(event: usize, ask: RoomAsk, charge: Charge) -> Self {
        RoomProbe {
            peak_event: event,
            ask,
            charge,
            found: None,
        }
    }

    fn measure_at(&mut self, backend: &mut dyn Backend, plan: &Plan, i: usize, limit: u64) {
        let EventKind::Alloc(t) = plan.events[i].kind else {
            return;
        };
        let chunk = plan.tensors[t].bytes.min(backend.info().max_chunk_bytes());
        let ask = RoomAsk { limit, ..self.ask };
        let live = plan.live_before(i);
        self.found = Some(measure(backend, i, live, chunk, ask, self.charge.page));
    }

    /// Allocate the tensor of allocation event `i`, measuring the room as described.
    pub fn allocate(
        &mut self,
        backend: &mut dyn Backend,
        plan: &Plan,
        i: usize,
    ) -> Result<DeviceTensor, AllocError> {
        let EventKind::Alloc(t) = plan.events[i].kind else {
            return Err(AllocError::Other(format!("event {i} is not an allocation")));
        };
        let spec = &plan.tensors[t];
        let cost = self.charge.tensor(spec);
        if i == self.peak_event {
            self.measure_at(backend, plan, i, self.ask.limit.saturating_add(cost));
        }
        let r = tensor::allocate_tensor(backend, spec);
        if let Err(e) = &r {
            if is_memory(e) {
                self.measure_at(backend, plan, i, cost);
            }
        }
        r
    }
}

/// What a probe's record says about the capacity, in bytes `charge` charges for `plan` (the
/// plan the probe ran): a fit with its room measured held at least its live bytes plus the
/// room (and less than that plus the refused filler); a refused allocation could not add its
/// request to what was live, and held at least what was live plus the room measured there
/// (without that measurement, the most the step held before it).
pub fn bounds_of(rec: &ProbeRecord, plan: &Plan, charge: &Charge) -> Bounds {
    // Held at once: the bytes live before the measurement plus the room.
    let held = |live: u64, r: &RoomMeasurement| {
        let held = live.saturating_add(r.room_bytes);
        Bounds {
            at_least: Some(held),
            below: r.refused_bytes.map(|b| held.saturating_add(b)),
        }
    };
    match rec.outcome {
        Outcome::Fit => rec
            .room
            .as_ref()
            .map_or_else(Bounds::default, |r| held(charge.before(plan, r.event).0, r)),
        Outcome::OutOfMemory | Outcome::Budget => {
            rec.failed_at.map_or_else(Bounds::default, |f| {
                let (live, max) = charge.before(plan, f.event);
                let request = match plan.events.get(f.event).map(|e| e.kind) {
                    Some(EventKind::Alloc(t)) if f.requested_bytes > 0 => {
                        Some(charge.tensor(&plan.tensors[t]))
                    }
                    _ => None,
                };
                let below = request.map(|r| live.saturating_add(r));
                match rec.room.as_ref().filter(|r| r.event == f.event) {
                    // Measured where it was refused: the device's state then (the most held
                    // earlier in the step is another state, fragmented differently).
                    Some(r) => held(live, r).meet(Bounds {
                        at_least: None,
                        below,
                    }),
                    None => Bounds {
                        at_least: Some(max),
                        below,
                    },
                }
            })
        }
        _ => Bounds::default(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::budget::BudgetBackend;
    use crate::backend::mock::MockBackend;
    use crate::probe::charge::GPU_PAGE;
    use crate::scenario::Scenario;
    use crate::tensor::WORD_BYTES;
    use crate::workload::presets;

    const MIB: u64 = 1 << 20;

    fn capped(budget: u64) -> BudgetBackend {
        BudgetBackend::new(Box::new(MockBackend::new(1 << 30)), budget)
    }

    #[test]
    fn filler_finds_the_room_to_the_step_in_whole_pages_and_frees_it() {
        let mut b = capped(100 * MIB);
        let held = b.alloc_buffer(37 * MIB + 12).unwrap();
        let ask = RoomAsk {
            limit: 1 << 30,
            step: 64 << 10,
            reserve: 0,
        };
        let r = measure(&mut b, 7, 37 * MIB, 16 * MIB, ask, GPU_PAGE);
        let left = 100 * MIB - (37 * MIB + 12);
        assert!(
            r.room_bytes <= left && left - r.room_bytes < GPU_PAGE,
            "{r:?}"
        );
        assert_eq!(r.room_bytes % GPU_PAGE, 0, "{r:?}");
        let refused = r.refused_bytes.expect("the device refused");
        assert!(r.room_bytes + refused > left, "{r:?}");
        assert_eq!(
            (r.event, r.live_bytes, r.chunk_bytes),
            (7, 37 * MIB, 16 * MIB)
        );
        assert_eq!(b.used(), 37 * MIB + 12, "the filler is freed");
        b.free_buffer(held);
    }

    #[test]
    fn filler_never_passes_its_limit() {
        let mut b = capped(100 * MIB);
        let ask = RoomAsk {
            limit: 10 * MIB + 6,
            step: 64 << 10,
            reserve: 0,
        };
        let r = measure(&mut b, 0, 0, 4 * MIB, ask, WORD_BYTES);
        assert_eq!(r.room_bytes, 10 * MIB + 4, "{r:?}");
        assert_eq!(r.refused_bytes, None);
        assert_eq!(b.used(), 0);
        assert!(b.peak() <= 10 * MIB + 6);
    }

    #[test]
    fn a_fit_and_a_refusal_both_bound_the_capacity_they_ran_under() {
        let w = presets::get("tiny-gpt").unwrap();
        let plan = Plan::for_value(&w, Scenario::Batch, 4).unwrap();
        let words = Charge {
            page: WORD_BYTES,
            max_chunk: MockBackend::new(1).info().max_chunk_bytes(),
        };
        assert_eq!(words.peak(&plan), plan.peak_bytes());
        // Room at the peak of a fit; room after the refusal of a failure (its limit the
        // request). Either way the budget lies in the bounds, to the 64 KiB step.
        for budget in [plan.peak_bytes() + 3 * MIB + 100, plan.peak_bytes() - MIB] {
            let mut b = capped(budget);
            let ask = RoomAsk {
                limit: 1 << 30,
                step: 64 << 10,
                reserve: 0,
            };
            let rec = crate::probe::exec::replay_allocations(&mut b, &plan, Some((ask, words)));
            assert_eq!(rec.outcome.is_fit(), budget > plan.peak_bytes(), "{rec:?}");
            let r = rec.room.expect("measured");
            let bounds = bounds_of(&rec, &plan, &words);
            let (lo, hi) = (bounds.at_least.unwrap(), bounds.below.unwrap());
            assert!(lo <= budget && budget < hi, "{budget}: {bounds:?} {r:?}");
            assert!(hi - lo <= 64 << 10, "{bounds:?}");
            assert_eq!(b.used(), 0, "everything freed");
        }
        // A record that measured nothing says only what its outcome says.
        let mut rec = ProbeRecord::new(4, Outcome::Fit, plan.peak_bytes());
        assert_eq!(bounds_of(&rec, &plan, &words), Bounds::default());
        rec.outcome = Outcome::Crashed;
        assert_eq!(bounds_of(&rec, &plan, &words), Bounds::default());
    }
}
