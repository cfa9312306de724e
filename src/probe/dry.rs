//! The boundary the device shows to the step's own allocations, replayed unwritten: measured in
//! a probe's child after its step, each replay on a device opened afresh (as a probe's is), at
//! other values, with a reserve standing for what a real step holds besides its tensors.
//!
//! Filler measures room in buffers of one size. On lavapipe under an address-space limit
//! (traced with `OOMPROBE_AS_TRACE`), wgpu's allocator packs buffers of up to 32 MiB into host
//! blocks of 4-32 MiB and maps larger ones on their own: a 5.5 MiB tail of a [b, a, s, s]
//! tensor costs nothing in a block with room or 32 MiB in a new one, a 6 KiB tensor can keep a
//! 32 MiB block mapped after its neighbour is freed, and which block a buffer lands in depends
//! on every allocation and free before it. No filler sees that; replaying the plan's own
//! allocations does, on a fresh allocator (one replay after another on one device starts from
//! the blocks the last one left, and was off by 280 values of flash).
//!
//! What a replay does not allocate (command buffers, descriptors, the driver's own memory
//! while kernels run) is the reserve. A probe measures it: the room its filler found (`room`:
//! at its peak, or right after its refusal), less the same filler at the same point of its own
//! replay. Where that measured nothing, the reserve the search passes on (`RoomAsk::reserve`,
//! the latest measured) is kept, raised or lowered until the probe's own value replays as the
//! probe ended. The search probes what
//! this measures; the boundary it reports is still an adjacent fit and failure, each a real
//! probe. Measured on lavapipe: 0.7-1.0 MiB.

use crate::backend::{AllocError, Backend, BufferId};
use crate::plan::Plan;
use crate::report::{Outcome, ProbeRecord};
use crate::search::{Answer, Bounds, RoomAsk, SearchSpace};

use super::charge::Charge;
use super::room::RoomProbe;

/// Most replays one boundary search makes (the reserve's search makes as many again).
pub const MAX_REPLAYS: usize = 40;

/// The largest reserve the calibration tries.
pub const MAX_RESERVE: u64 = 1 << 30;

pub use crate::report::DryBoundary;

/// Whether `plan`'s allocations, replayed unwritten on `backend` with `reserve` bytes held,
/// fit (see [`replay`]). None: an error that is not the device's refusal.
pub fn replay_fits(backend: &mut dyn Backend, plan: &Plan, reserve: u64) -> Option<bool> {
    replay(backend, plan, reserve, None).and_then(|r| match r.outcome {
        Outcome::Fit => Some(true),
        Outcome::OutOfMemory | Outcome::Budget => Some(false),
        _ => None,
    })
}

/// Replay `plan`'s allocations unwritten on `backend` with `reserve` bytes held, measuring
/// the room as `room` asks: the record (refused when the reserve was). None: the reserve met
/// an error that is not the device's refusal. Everything is freed before returning. The
/// reserve is held outside the device's allocator where the backend can (`hold_outside`: on
/// a CPU adapter, host memory never written, as what a real step holds there besides tensors
/// is); elsewhere as device buffers of the largest chunk. (A small device buffer would land
/// in one of the allocator's blocks and move every tensor after it: a 2 MiB reserve as a
/// buffer moved lavapipe's flash boundary by 550 values.)
pub fn replay(
    backend: &mut dyn Backend,
    plan: &Plan,
    reserve: u64,
    room: Option<RoomProbe>,
) -> Option<ProbeRecord> {
    let mut held: Vec<BufferId> = Vec::new();
    // The reserve's own answer, where it was not all taken (None inside: an error).
    let refused = || {
        Some(ProbeRecord::new(
            plan.value,
            Outcome::OutOfMemory,
            plan.peak_bytes(),
        ))
    };
    let mut stopped: Option<Option<ProbeRecord>> = None;
    match backend.hold_outside(reserve) {
        Some(true) => {}
        Some(false) => stopped = Some(refused()),
        None => {
            let chunk = backend.info().max_chunk_bytes().max(1);
            let mut left = reserve;
            while left > 0 && stopped.is_none() {
                match backend.alloc_buffer(left.min(chunk)) {
                    Ok(id) => {
                        held.push(id);
                        left -= left.min(chunk);
                    }
                    Err(AllocError::OutOfMemory { .. } | AllocError::Budget { .. }) => {
                        stopped = Some(refused());
                    }
                    Err(_) => stopped = Some(None),
                }
            }
        }
    }
    let answer =
        stopped.unwrap_or_else(|| Some(super::exec::replay_measuring(backend, plan, room)));
    backend.release_outside();
    for id in held {
        backend.free_buffer(id);
    }
    answer
}

/// Find the values around `from` where `fits` (a replay at a value) turns from true to false:
/// from `from` up by doubling strides to at most twice it, or down to the space's minimum,
/// then by bisection. None when a replay answers nothing.
pub fn boundary(
    space: SearchSpace,
    from: u64,
    fits: &mut dyn FnMut(u64) -> Option<bool>,
) -> Option<(Option<u64>, Option<u64>, u32)> {
    let g = space.granularity.max(1);
    let top = space.snap(from.saturating_mul(2)).max(from);
    let (mut lo, mut hi) = if fits(from)? {
        (Some(from), None)
    } else {
        (None, Some(from))
    };
    let mut n = 1u32;
    let mut stride = g;
    // Gallop away from `from` until the answer turns.
    while (n as usize) < MAX_REPLAYS {
        let x = match (lo, hi) {
            (Some(l), None) if l < top => space.snap(l.saturating_add(stride)).min(top),
            (None, Some(h)) if h > space.min => space.snap(h.saturating_sub(stride)),
            _ => break,
        };
        if Some(x) == lo || Some(x) == hi {
            break;
        }
        n += 1;
        if fits(x)? {
            lo = Some(x);
        } else {
            hi = Some(x);
        }
        if lo.is_some() && hi.is_some() {
            break;
        }
        stride = stride.saturating_mul(2);
    }
    while let (Some(l), Some(h)) = (lo, hi) {
        if h - l <= g || n as usize >= MAX_REPLAYS {
            break;
        }
        let mid = space.snap(l + (h - l) / 2);
        let mid = if mid <= l { l + g } else { mid };
        n += 1;
        if fits(mid)? {
            lo = Some(mid);
        } else {
            hi = Some(mid);
        }
    }
    Some((lo, hi, n))
}

/// The reserve under which a replay at the probed value answers as the probe did: `reserve`
/// itself when it does; else the least more (to `step` bytes) under which the replay is refused
/// when the probe was refused, or the most less under which it fits when the probe fit. Also
/// the replays made. None when a replay answers nothing, or no reserve up to `MAX_RESERVE`
/// agrees.
pub fn calibrate(
    reserve: u64,
    probe_fit: bool,
    step: u64,
    fits: &mut dyn FnMut(u64) -> Option<bool>,
) -> Option<(u64, u32)> {
    let step = step.max(1);
    let mut n = 0u32;
    let mut agrees = |r: u64| {
        n += 1;
        fits(r).map(|f| f == probe_fit)
    };
    if agrees(reserve)? {
        return Some((reserve, 1));
    }
    // `wrong` answers otherwise than the probe; gallop away from it until one agrees, then
    // bisect between them.
    let mut wrong = reserve;
    let mut stride = step;
    let mut good = loop {
        let r = if probe_fit {
            wrong.saturating_sub(stride)
        } else {
            wrong.saturating_add(stride).min(MAX_RESERVE)
        };
        if agrees(r)? {
            break r;
        }
        if r == 0 || r == MAX_RESERVE {
            return None;
        }
        wrong = r;
        stride = stride.saturating_mul(2);
    };
    let mut tries = 0;
    while good.abs_diff(wrong) > step && tries < MAX_REPLAYS {
        let mid = good.min(wrong) + good.abs_diff(wrong) / 2;
        tries += 1;
        if agrees(mid)? {
            good = mid;
        } else {
            wrong = mid;
        }
    }
    Some((good, n))
}

/// Calibrate the reserve at `value` (whose probe fit when `probe_fit`), then find the boundary
/// under it. `fits(value, reserve)` replays one value on a fresh device.
pub fn measure(
    space: SearchSpace,
    value: u64,
    probe_fit: bool,
    reserve: u64,
    step: u64,
    fits: &mut dyn FnMut(u64, u64) -> Option<bool>,
) -> Option<DryBoundary> {
    measure_from(space, value, probe_fit, reserve, step, value, fits)
}

/// As [`measure`], the boundary searched from `from` instead of `value`.
pub fn measure_from(
    space: SearchSpace,
    value: u64,
    probe_fit: bool,
    reserve: u64,
    step: u64,
    from: u64,
    fits: &mut dyn FnMut(u64, u64) -> Option<bool>,
) -> Option<DryBoundary> {
    let (reserve, calibrations) = calibrate(reserve, probe_fit, step, &mut |r| fits(value, r))?;
    let (lo, hi, n) = boundary(space, from, &mut |x| fits(x, reserve))?;
    Some(DryBoundary {
        fits: lo,
        fails: hi,
        reserve_bytes: reserve,
        replays: calibrations + n,
    })
}

/// [`measure`] with the reserve measured twice: `reserve()` before the replays and again after
/// them (None: nothing measured, `passed` is used). Where the second differs from the first by
/// `step` or more, one of them was disturbed: the process was still settling after its step
/// when the first was measured, or (on a loaded machine: issue 35, two busy loops beside a
/// params search under `prlimit --as`, the second said 33 MiB where the first and every idle
/// run said 1.5 MiB, and the search took 16 probes for 5) something else ran while the second
/// was. A third measurement decides: the middle of the three is used, and where it is the
/// first the boundary already found stands; else it is found again under it, from where the
/// first replays put it.
pub fn measure_settled(
    space: SearchSpace,
    value: u64,
    probe_fit: bool,
    passed: u64,
    step: u64,
    reserve: &mut dyn FnMut() -> Option<u64>,
    fits: &mut dyn FnMut(u64, u64) -> Option<bool>,
) -> Option<DryBoundary> {
    let first = reserve();
    let d = measure(space, value, probe_fit, first.unwrap_or(passed), step, fits)?;
    let Some(first) = first else {
        return Some(d);
    };
    let close = |a: u64, b: u64| a.abs_diff(b) < step.max(1);
    let moved = reserve().filter(|&again| !close(again, first));
    let Some(again) = moved else {
        return Some(DryBoundary {
            replays: d.replays + 2,
            ..d
        });
    };
    let chosen = match reserve() {
        Some(third) => {
            let mut three = [first, again, third];
            three.sort_unstable();
            three[1]
        }
        None => again,
    };
    if close(chosen, first) {
        return Some(DryBoundary {
            replays: d.replays + 3,
            ..d
        });
    }
    let from = d.fits.or(d.fails).unwrap_or(value);
    let e = measure_from(space, value, probe_fit, chosen, step, from, fits)?;
    Some(DryBoundary {
        replays: d.replays + e.replays + 3,
        ..e
    })
}

/// The replays a measuring probe adds once its step is done and its device released: the
/// reserve (the room its filler measured, at its peak or right after its refusal, less the
/// same filler at the same point of its own replay; else the one `ask` passes on), then the
/// boundary under it. `rec` is the probe's record (`plan` at its value, its room measured as
/// `ask` and `charge` asked),
/// `fresh()` opens the device afresh with the step's kernels prepared. None for a probe that
/// neither fit nor was refused.
pub fn after_probe(
    rec: &ProbeRecord,
    plan: &Plan,
    ask: RoomAsk,
    charge: Charge,
    space: SearchSpace,
    plan_at: &dyn Fn(u64) -> Option<Plan>,
    fresh: &mut dyn FnMut() -> Option<Box<dyn Backend>>,
) -> Option<DryBoundary> {
    let fit = match rec.outcome {
        Outcome::Fit => true,
        Outcome::OutOfMemory | Outcome::Budget => false,
        _ => return None,
    };
    // Measured where the probe measured (its peak, or its refusal), on its own replay: the
    // room the replay's filler found there less the real step's. Measured again after the
    // replays: a device opened right after the step's still holds some of what the step
    // held (traced on lavapipe: 2.5 MB, gone over the next two devices opened), so the first
    // measurement can say too little.
    let fresh = std::cell::RefCell::new(fresh);
    let mut reserve = || -> Option<u64> {
        let real = rec.room?;
        let mut b = (fresh.borrow_mut())()?;
        let at = RoomProbe::before(real.event, ask, charge);
        replay(b.as_mut(), plan, 0, Some(at))
            .and_then(|r| r.room)
            .filter(|r| r.event == real.event && r.refused_bytes.is_some())
            .map(|r| r.room_bytes.saturating_sub(real.room_bytes))
    };
    let mut fits =
        |x: u64, reserve: u64| replay_fits((fresh.borrow_mut())()?.as_mut(), &plan_at(x)?, reserve);
    measure_settled(
        space,
        rec.value,
        fit,
        ask.reserve,
        ask.step,
        &mut reserve,
        &mut fits,
    )
}

/// The answer a probe's record gives the search, its bounds in bytes `charge` charges: where
/// its replays found the boundary, at least the charged peak of the value that fit and less
/// than that of the value refused (`replayed`); else what its room says (`room::bounds_of`).
/// `plan` is the probe's own plan, `plan_at` builds the plan at another value.
pub fn answer_of(
    rec: &ProbeRecord,
    plan: &Plan,
    charge: &Charge,
    plan_at: &dyn Fn(u64) -> Option<Plan>,
) -> Answer {
    let Some(d) = rec.dry else {
        return Answer::measured(rec.outcome, super::room::bounds_of(rec, plan, charge));
    };
    let peak = |x: Option<u64>| x.and_then(plan_at).map(|p| charge.peak(&p));
    let bounds = Bounds {
        at_least: peak(d.fits),
        below: peak(d.fails),
    };
    Answer {
        replayed: true,
        ..Answer::measured(rec.outcome, bounds)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::budget::BudgetBackend;
    use crate::backend::mock::MockBackend;
    use crate::scenario::Scenario;
    use crate::workload::presets;

    const MIB: u64 = 1 << 20;

    #[test]
    fn the_boundary_is_found_from_below_and_from_above_on_the_grid() {
        for from in [20, 37, 38, 100, 900] {
            let got = boundary(SearchSpace::unit(1 << 20), from, &mut |x| Some(x <= 37));
            let (lo, hi, n) = got.expect("answers");
            assert_eq!((lo, hi), (Some(37), Some(38)), "from {from}");
            // Doubling strides out, bisection back: about twice the log of the distance.
            assert!(n <= 22, "from {from}: {n} replays");
        }
        // Not past twice the value probed.
        let got = boundary(SearchSpace::unit(1 << 20), 10, &mut |x| Some(x <= 37)).unwrap();
        assert_eq!((got.0, got.1), (Some(20), None));
        let space = SearchSpace {
            min: 4,
            max: 1 << 20,
            granularity: 4,
        };
        let got = boundary(space, 24, &mut |x| Some(x <= 37)).expect("answers");
        assert_eq!((got.0, got.1), (Some(36), Some(40)));
        // Nothing fits: no value that fit; a replay that answers nothing: no boundary.
        let got = boundary(SearchSpace::unit(100), 50, &mut |_| Some(false)).unwrap();
        assert_eq!((got.0, got.1), (None, Some(1)));
        assert_eq!(boundary(SearchSpace::unit(100), 50, &mut |_| None), None);
    }

    #[test]
    fn the_reserve_is_calibrated_to_what_the_probe_answered() {
        // A replay fits when its 100 bytes and the reserve fit in 130.
        let mut fits = |r: u64| Some(100 + r <= 130);
        // The probe was refused: the least reserve (to the step) under which the replay is.
        let (r, _) = calibrate(0, false, 4, &mut fits).expect("agrees");
        assert!((31..=35).contains(&r), "{r}");
        assert_eq!(fits(r), Some(false));
        // The probe fit: the most reserve under which the replay still fits.
        let (r, _) = calibrate(200, true, 4, &mut fits).expect("agrees");
        assert!((26..=30).contains(&r), "{r}");
        assert_eq!(fits(r), Some(true));
        // A reserve that already agrees is kept, after one replay.
        assert_eq!(calibrate(10, true, 4, &mut fits), Some((10, 1)));
        // No reserve makes a fitting replay refuse what always fits.
        assert_eq!(calibrate(0, false, 4, &mut |_| Some(true)), None);
    }

    #[test]
    fn a_replay_holds_its_reserve_and_frees_everything() {
        let w = presets::get("tiny-gpt").unwrap();
        let plan = Plan::for_value(&w, Scenario::Batch, 4).unwrap();
        let mut b =
            BudgetBackend::new(Box::new(MockBackend::new(1 << 30)), plan.peak_bytes() + MIB);
        assert_eq!(replay_fits(&mut b, &plan, 0), Some(true));
        assert_eq!(replay_fits(&mut b, &plan, MIB / 2), Some(true));
        assert_eq!(replay_fits(&mut b, &plan, 2 * MIB), Some(false));
        assert_eq!(b.used(), 0, "the reserve and the plan are freed");
    }

    #[test]
    fn measured_on_fresh_devices_the_boundary_is_the_budgets() {
        let w = presets::get("tiny-gpt").unwrap();
        let plan_at = |x: u64| Plan::for_value(&w, Scenario::Batch, x).ok();
        let budget = plan_at(37).unwrap().peak_bytes() + 3;
        let mut fits = |x: u64, reserve: u64| {
            let mut b = BudgetBackend::new(Box::new(MockBackend::new(1 << 32)), budget);
            replay_fits(&mut b, &plan_at(x)?, reserve)
        };
        for (from, fit) in [(20, true), (60, false)] {
            let d = measure(SearchSpace::unit(1 << 20), from, fit, 0, 1024, &mut fits).unwrap();
            assert_eq!(
                (d.fits, d.fails, d.reserve_bytes),
                (Some(37), Some(38), 0),
                "{d:?}"
            );
        }
        // A probe at 37 that was refused (the real step held more): the reserve that makes its
        // replay refused too moves the boundary below it.
        let d = measure(SearchSpace::unit(1 << 20), 37, false, 0, 1024, &mut fits).unwrap();
        assert!(d.reserve_bytes > 0 && d.reserve_bytes <= 1024 + 3, "{d:?}");
        assert_eq!((d.fits, d.fails), (Some(36), Some(37)), "{d:?}");
    }

    #[test]
    fn a_reserve_that_moves_once_the_process_settles_moves_the_boundary() {
        // Capacity 1000 bytes, a value costs 10 bytes each, the real step holds 30 more: the
        // boundary is 97. `said` is what the two measurements of the reserve say.
        let fits = |x: u64, reserve: u64| Some(x * 10 + reserve <= 1000);
        let settled = |said: &[Option<u64>], passed: u64, calls: &mut usize| {
            let mut said = said.iter().copied();
            let mut reserve = || {
                *calls += 1;
                said.next().flatten()
            };
            let space = SearchSpace::unit(1 << 20);
            measure_settled(space, 60, true, passed, 5, &mut reserve, &mut { fits }).unwrap()
        };
        // The first says 0 (what the step's device left was still mapped), the second and the
        // third 30.
        let d = settled(&[Some(0), Some(30), Some(30)], 0, &mut 0);
        let got = (d.fits, d.fails, d.reserve_bytes);
        assert_eq!(got, (Some(97), Some(98), 30), "{d:?}");
        // No third measurement: the second, as before.
        let d = settled(&[Some(0), Some(30), None], 0, &mut 0);
        assert_eq!((d.fits, d.reserve_bytes), (Some(97), 30), "{d:?}");
        // The second disturbed (a loaded machine), the third agrees with the first: the first
        // boundary stands, after three measurements' replays.
        let once = measure(SearchSpace::unit(1 << 20), 60, true, 30, 5, &mut { fits }).unwrap();
        let mut calls = 0;
        let d = settled(&[Some(30), Some(330), Some(31)], 0, &mut calls);
        let want = (once.fits, once.fails, 30, once.replays + 3, 3);
        assert_eq!((d.fits, d.fails, d.reserve_bytes, d.replays, calls), want);
        // Both alike: one pass, as `measure`, and the two measurements' replays.
        let d = settled(&[Some(30), Some(32)], 0, &mut 0);
        let once = measure(SearchSpace::unit(1 << 20), 60, true, 30, 5, &mut { fits }).unwrap();
        let want = (once.fits, once.fails, once.replays + 2);
        assert_eq!((d.fits, d.fails, d.replays), want);
        // Nothing measured: the reserve passed on, one pass, no second measurement.
        let mut calls = 0;
        let d = settled(&[None, None], 30, &mut calls);
        assert_eq!((d.fits, d.reserve_bytes, calls), (Some(97), 30, 1));
    }

    #[test]
    fn a_record_with_replays_bounds_the_capacity_by_their_values_else_by_its_room() {
        let w = presets::get("tiny-gpt").unwrap();
        let plan_at = |x: u64| Plan::for_value(&w, Scenario::Batch, x).ok();
        let plan = plan_at(4).unwrap();
        let charge = Charge {
            page: 4096,
            max_chunk: 1 << 27,
        };
        let mut rec = ProbeRecord::new(4, Outcome::Fit, plan.peak_bytes());
        assert_eq!(
            answer_of(&rec, &plan, &charge, &plan_at),
            Answer::bare(Outcome::Fit)
        );
        rec.dry = Some(DryBoundary {
            fits: Some(9),
            fails: Some(10),
            reserve_bytes: 0,
            replays: 3,
        });
        let a = answer_of(&rec, &plan, &charge, &plan_at);
        let (b, peak) = (a.bounds, |x| charge.peak(&plan_at(x).unwrap()));
        assert!(a.replayed);
        assert_eq!((b.at_least, b.below), (Some(peak(9)), Some(peak(10))));
    }
}
