//! The room left on the device at a probe's peak, measured with filler (buffers of the plan's
//! chunk size while they fit, then one buffer sized by bisection to what the device takes,
//! never more than the search's limit, all freed at once), and the capacity bounds a probe's
//! record gives the search.
//!
//! The room is measured right before the allocation that reaches the plan's peak, when the plan
//! holds the most it holds with that tensor still to come: the capacity is then at least the
//! live bytes plus the room, in the device's own state at that moment (fragmentation included),
//! and the room includes the peak tensor's share, so the filler is made of buffers as large as
//! the plan's own (a device charges small buffers differently: suballocation blocks, pages).
//! Near the boundary what is left over is small. Measuring at the end of the step instead would
//! fill everything the step freed. The filler is allocated, not written: a driver that commits
//! memory only when it is written shows more room than it has, which the search notices when
//! the next probe disagrees.

use crate::backend::{AllocError, Backend, BufferId, DeviceType};
use crate::report::{Outcome, ProbeRecord, RoomMeasurement};
use crate::search::{Bounds, RoomAsk};
use crate::tensor::WORD_BYTES;

/// The finest filler resolution on a GPU: drivers map device memory in 2 MiB pages. (CPU
/// adapters map 4 KiB pages.)
pub const GPU_PAGE: u64 = 2 << 20;

/// Most filler buffers one measurement holds (a device that refuses nothing stops here, the
/// room counted so far a lower bound).
const MAX_FILLER_BUFFERS: usize = 4096;

/// Measure the room on `backend` before timeline event `event`, with `live_bytes` of the plan
/// live and the plan's chunks there `chunk_bytes` large. Everything allocated is freed before
/// returning.
pub fn measure(
    backend: &mut dyn Backend,
    event: usize,
    live_bytes: u64,
    chunk_bytes: u64,
    ask: RoomAsk,
) -> RoomMeasurement {
    let words = |b: u64| b.div_ceil(WORD_BYTES).max(1) * WORD_BYTES;
    let max = (backend.info().max_chunk_bytes() / WORD_BYTES * WORD_BYTES).max(WORD_BYTES);
    let page = match backend.info().device_type {
        DeviceType::Cpu => WORD_BYTES,
        _ => GPU_PAGE,
    };
    let step = words(ask.step).max(page).min(max);
    // At most half a buffer, so the last one can grow to one piece more.
    let piece = words(chunk_bytes).min(max / 2).clamp(step, max);
    let is_memory = |e: &AllocError| {
        matches!(
            e,
            AllocError::OutOfMemory { .. } | AllocError::Budget { .. }
        )
    };
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
    let mut bad = (good + piece).min(max).min(ask.limit - room);
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
                    let mid = words(good + (bad - good) / 2);
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

/// What a probe's record says about the capacity, in the plan's bytes: a fit with its room
/// measured holds at least the peak plus the room (and less than that plus the refused
/// filler); a refused allocation held everything before it and not that plus its request.
pub fn bounds_of(rec: &ProbeRecord) -> Bounds {
    match rec.outcome {
        Outcome::Fit => rec.room.map_or_else(Bounds::default, |r| {
            let held = r.live_bytes.saturating_add(r.room_bytes);
            Bounds {
                at_least: Some(held),
                below: r.refused_bytes.map(|b| held.saturating_add(b)),
            }
        }),
        Outcome::OutOfMemory | Outcome::Budget => {
            rec.failed_at.map_or_else(Bounds::default, |f| Bounds {
                at_least: f.max_live_bytes,
                below: (f.requested_bytes > 0)
                    .then(|| f.live_bytes.saturating_add(f.requested_bytes)),
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

    const MIB: u64 = 1 << 20;

    #[test]
    fn filler_finds_the_room_to_the_step_and_frees_it() {
        let mut b: BudgetBackend =
            BudgetBackend::new(Box::new(MockBackend::new(1 << 30)), 100 * MIB);
        let held = b.alloc_buffer(37 * MIB + 12).unwrap();
        let ask = RoomAsk {
            limit: 1 << 30,
            step: 64 << 10,
        };
        let r = measure(&mut b, 7, 37 * MIB, 16 * MIB, ask);
        let left = 100 * MIB - (37 * MIB + 12);
        // The mock is a GPU-like device: pieces of at least a 2 MiB page.
        assert!(
            r.room_bytes <= left && left - r.room_bytes < GPU_PAGE,
            "{r:?}"
        );
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
        let mut b: BudgetBackend =
            BudgetBackend::new(Box::new(MockBackend::new(1 << 30)), 100 * MIB);
        let ask = RoomAsk {
            limit: 10 * MIB + 6,
            step: 64 << 10,
        };
        let r = measure(&mut b, 0, 0, 4 * MIB, ask);
        assert_eq!(r.room_bytes, 10 * MIB + 6, "{r:?}");
        assert_eq!(r.refused_bytes, None);
        assert_eq!(b.used(), 0);
        assert!(b.peak() <= 10 * MIB + 8);
    }

    #[test]
    fn a_record_gives_capacity_bounds() {
        let mut rec = crate::probe::child::failed_record(
            5,
            100,
            Outcome::Fit,
            String::new(),
            std::time::Instant::now(),
        );
        assert_eq!(bounds_of(&rec), Bounds::default());
        rec.room = Some(RoomMeasurement {
            event: 3,
            live_bytes: 100,
            room_bytes: 40,
            refused_bytes: Some(8),
            chunk_bytes: 16,
            limit_bytes: 1000,
        });
        assert_eq!(
            bounds_of(&rec),
            Bounds {
                at_least: Some(140),
                below: Some(148)
            }
        );
        rec.outcome = Outcome::Budget;
        rec.room = None;
        rec.failed_at = Some(crate::report::FailurePoint {
            event: 9,
            phase: crate::plan::Phase::Backward,
            live_bytes: 90,
            requested_bytes: 30,
            max_live_bytes: Some(95),
        });
        assert_eq!(
            bounds_of(&rec),
            Bounds {
                at_least: Some(95),
                below: Some(120)
            }
        );
        rec.outcome = Outcome::Crashed;
        assert_eq!(bounds_of(&rec), Bounds::default());
    }
}
