//! Execute one plan on a Backend by replaying its timeline in order: each allocation is made
//! and written at once, kernels run at their points (full mode), each tensor is read back when
//! it is freed (verified against its pattern, or checksummed once a kernel wrote it), and what
//! the step keeps to its end is read back last. OOM is a result, not an error: a failure records
//! the event, phase and live bytes where it happened.

use std::time::Instant;

use crate::backend::{AllocError, Backend, BackendError};
use crate::ops;
use crate::ops::words::Scratch;
use crate::plan::{EventKind, Plan};
use crate::report::{FailurePoint, Outcome, ProbeRecord};
use crate::search::RoomAsk;
use crate::tensor::{self, DeviceTensor};

use super::charge::Charge;
use super::room::RoomProbe;
use super::Compute;

/// The outcome a failed allocation stands for.
pub fn outcome_of_alloc(e: &AllocError) -> Outcome {
    match e {
        AllocError::OutOfMemory { .. } => Outcome::OutOfMemory,
        AllocError::ExceedsLimit { .. } => Outcome::ExceedsLimit,
        AllocError::Budget { .. } => Outcome::Budget,
        AllocError::DeviceLost(_) => Outcome::DeviceLost,
        AllocError::Other(_) => Outcome::Error,
    }
}

/// The outcome a failed dispatch, copy or synchronisation stands for.
pub fn outcome_of_backend(e: &BackendError) -> Outcome {
    match e {
        BackendError::OutOfMemory(_) => Outcome::OutOfMemory,
        BackendError::Budget(_) => Outcome::Budget,
        BackendError::DeviceLost(_) => Outcome::DeviceLost,
        BackendError::Other(_) => Outcome::Error,
    }
}

/// A failure during the replay: its outcome, detail and the event where it happened.
struct Failure {
    outcome: Outcome,
    detail: String,
    event: usize,
    requested: u64,
    tensor: Option<String>,
}

impl Failure {
    /// A failure at `event` that is not a refused allocation.
    fn at(event: usize, (outcome, detail): (Outcome, String)) -> Failure {
        Failure {
            outcome,
            detail,
            event,
            requested: 0,
            tensor: None,
        }
    }
}

/// The replay's state: live device tensors by plan index, and what has been read back.
struct Replay<'a> {
    backend: &'a mut dyn Backend,
    plan: &'a Plan,
    compute: Compute,
    /// Steps replayed: 1, or where tensors go through the caching allocator the steps its
    /// model replays (its cache carries over, and a later step can need more segments).
    steps: usize,
    live: Vec<Option<DeviceTensor>>,
    /// Tensors a kernel has written (read back by checksum, not against their pattern).
    written: Vec<bool>,
    words_verified: u64,
    folded: u64,
    peak_allocated: u64,
    /// The verify/checksum result buffer, allocated before the first tensor.
    scratch: Scratch,
    /// The spill check, at the step's peak (see `spill`).
    spill: Option<SpillAt>,
    /// The room to measure at the plan's peak and at a refusal (see `room`).
    room: Option<RoomProbe>,
}

/// Where the spill check runs and what it found.
struct SpillAt {
    event: usize,
    heap_start: Option<crate::backend::HeapUsage>,
    report: Option<super::spill::SpillReport>,
}

impl Replay<'_> {
    fn run(&mut self) -> Result<(), Failure> {
        let plan = self.plan;
        for step in 1..=self.steps {
            let last = step == self.steps;
            for (i, e) in plan.events.iter().enumerate() {
                // A later step has the model's states already (as `alloc::timeline`).
                if step > 1 && e.phase == crate::plan::Phase::Setup {
                    continue;
                }
                let fail = |outcome, detail: String| Failure::at(i, (outcome, detail));
                match e.kind {
                    EventKind::Alloc(t) => {
                        if self.live[t].is_some() {
                            continue;
                        }
                        let spec = &plan.tensors[t];
                        let dt = match self.room.as_mut().filter(|_| last) {
                            Some(room) => room.allocate(self.backend, plan, i),
                            None => tensor::allocate_tensor(self.backend, spec),
                        };
                        let dt = dt.map_err(|err| Failure {
                            outcome: outcome_of_alloc(&err),
                            detail: in_step(step, err.to_string()),
                            event: i,
                            requested: spec.bytes,
                            tensor: Some(spec.name.clone()),
                        })?;
                        self.peak_allocated =
                            self.peak_allocated.max(self.backend.allocated_bytes());
                        let r = ops::words::fill_tensor(self.backend, &dt, seed_of(t));
                        self.live[t] = Some(dt);
                        self.written[t] = false;
                        r.map_err(|err| fail(outcome_of_backend(&err), err.to_string()))?;
                        if last && self.spill.as_ref().is_some_and(|s| s.event == i) {
                            self.check_spill()
                                .map_err(|err| fail(outcome_of_backend(&err), err.to_string()))?;
                        }
                    }
                    EventKind::Free(t) => {
                        self.read_back(t).map_err(|(o, d)| fail(o, d))?;
                        if let Some(dt) = self.live[t].take() {
                            tensor::free_tensor(self.backend, dt);
                        }
                    }
                    EventKind::Kernel(k) => {
                        if self.compute == Compute::Full {
                            let step = &plan.steps[k];
                            for t in step.tensors() {
                                self.written[t] = true;
                            }
                            let live = &self.live;
                            let r = ops::compute::run_step_with(self.backend, step, &|t| {
                                live.get(t).and_then(Option::as_ref)
                            });
                            r.map_err(|err| fail(outcome_of_backend(&err), err.to_string()))?;
                        }
                    }
                }
            }
        }
        let end = plan.events.len();
        for t in 0..self.live.len() {
            if self.live[t].is_some() {
                self.read_back(t).map_err(|e| Failure::at(end, e))?;
            }
        }
        self.backend
            .synchronize()
            .map_err(|err| Failure::at(end, (outcome_of_backend(&err), err.to_string())))
    }

    /// Read a live tensor back: verify its pattern, or fold its checksum once a kernel wrote it.
    fn read_back(&mut self, t: usize) -> Result<(), (Outcome, String)> {
        let Some(dt) = self.live[t].as_ref() else {
            return Ok(());
        };
        let fail = |e: BackendError| (outcome_of_backend(&e), e.to_string());
        let name = &self.plan.tensors[t].name;
        let expected = dt.words();
        if self.written[t] {
            let c =
                ops::words::checksum_tensor_with(self.backend, dt, self.scratch).map_err(fail)?;
            if let Some(f) = super::readback::checksum_failure(name, expected, &c) {
                return Err(f);
            }
            self.folded = self.folded.rotate_left(7) ^ c.sum;
            return Ok(());
        }
        let v = ops::words::verify_tensor_with(self.backend, dt, seed_of(t), self.scratch)
            .map_err(fail)?;
        if !v.ok(expected) {
            let zeros = if v.words_seen == expected && v.mismatches > 0 {
                let c = ops::words::checksum_tensor_with(self.backend, dt, self.scratch)
                    .map_err(fail)?;
                Some(super::readback::all_zero(&c, expected))
            } else {
                None
            };
            return Err(super::readback::verify_failure(name, expected, v, zeros));
        }
        self.words_verified += v.words_seen;
        Ok(())
    }
}

impl Replay<'_> {
    /// Time the first- and last-allocated buffers now, at the peak (see `spill`).
    fn check_spill(&mut self) -> Result<(), BackendError> {
        let regions = super::spill::regions(&self.live, &self.written, seed_of);
        let heap_start = self.spill.as_ref().and_then(|s| s.heap_start);
        let live = self.backend.allocated_bytes();
        let rule = super::spill::SpillRule::default();
        let report = super::spill::check(
            self.backend,
            &regions,
            self.scratch,
            heap_start,
            live,
            &rule,
        )?;
        if let Some(s) = self.spill.as_mut() {
            s.report = report;
        }
        Ok(())
    }
}

/// Where in `plan` a failure at `event` that asked for `requested` bytes happened.
fn failure_point(plan: &Plan, event: usize, requested: u64) -> FailurePoint {
    FailurePoint {
        event,
        phase: plan
            .events
            .get(event.min(plan.events.len().saturating_sub(1)))
            .map_or(crate::plan::Phase::Setup, |e| e.phase),
        live_bytes: plan.live_before(event),
        requested_bytes: requested,
        max_live_bytes: Some(plan.max_live_before(event)),
    }
}

/// Replay only the allocations and frees of `plan` (nothing written, no kernels), measuring
/// the room when `room` asks: a probe on a modelled device (the search bench) or in a test.
/// Frees everything before returning.
pub fn replay_allocations(
    backend: &mut dyn Backend,
    plan: &Plan,
    room: Option<(RoomAsk, Charge)>,
) -> ProbeRecord {
    let room = room.map(|(ask, charge)| RoomProbe::new(plan, ask, charge));
    replay_measuring(backend, plan, room)
}

/// [`replay_allocations`], measuring the room where `room` measures.
pub fn replay_measuring(
    backend: &mut dyn Backend,
    plan: &Plan,
    mut room: Option<RoomProbe>,
) -> ProbeRecord {
    let mut rec = ProbeRecord::new(plan.value, Outcome::Fit, plan.peak_bytes());
    let mut live: Vec<Option<DeviceTensor>> = vec![None; plan.tensors.len()];
    for (i, e) in plan.events.iter().enumerate() {
        match e.kind {
            EventKind::Alloc(t) => {
                let r = match room.as_mut() {
                    Some(room) => room.allocate(backend, plan, i),
                    None => tensor::allocate_tensor(backend, &plan.tensors[t]),
                };
                match r {
                    Ok(d) => live[t] = Some(d),
                    Err(err) => {
                        rec.outcome = outcome_of_alloc(&err);
                        rec.detail = Some(err.to_string());
                        rec.failed_at = Some(failure_point(plan, i, plan.tensors[t].bytes));
                        break;
                    }
                }
            }
            EventKind::Free(t) => {
                if let Some(d) = live[t].take() {
                    tensor::free_tensor(backend, d);
                }
            }
            EventKind::Kernel(_) => {}
        }
    }
    for d in live.into_iter().flatten() {
        tensor::free_tensor(backend, d);
    }
    rec.room = room.and_then(|r| r.found);
    rec
}

/// Run one probe of `plan` on `backend`. Always frees what it allocated before returning.
pub fn execute_plan(backend: &mut dyn Backend, plan: &Plan, compute: Compute) -> ProbeRecord {
    execute_plan_measuring(backend, plan, compute, None)
}

/// [`execute_plan`], measuring the room left at the plan's peak (and at a refusal) with filler
/// when `room` asks, in whole pages of `charge`.
pub fn execute_plan_measuring(
    backend: &mut dyn Backend,
    plan: &Plan,
    compute: Compute,
    room: Option<(RoomAsk, Charge)>,
) -> ProbeRecord {
    let started = Instant::now();
    let bytes = plan.peak_bytes();
    // Compile every kernel before memory fills up (a compiler out of memory crashes), and
    // set up every buffer besides tensors: nothing else is allocated once memory fills.
    let kernels = super::warmup::kernels_of(plan, compute, backend.info());
    let scratch = match Scratch::alloc(backend) {
        Ok(s) => s,
        Err(e) => {
            let detail = format!("allocating the read-back scratch: {e}");
            return ProbeRecord::failed(plan.value, bytes, outcome_of_backend(&e), detail, started);
        }
    };
    if let Err(e) = backend.prepare(&kernels) {
        scratch.free(backend);
        return ProbeRecord::failed(
            plan.value,
            bytes,
            outcome_of_backend(&e),
            format!("preparing kernels: {e}"),
            started,
        );
    }
    let spill = super::spill::SpillRule::default()
        .wanted(backend.info(), bytes)
        .then(|| SpillAt {
            event: plan.peak().event,
            heap_start: backend.heap_usage(),
            report: None,
        });
    let n = plan.tensors.len();
    let steps = if backend.allocator_stats().is_some() {
        crate::alloc::timeline::STEPS
    } else {
        1
    };
    let mut r = Replay {
        backend,
        plan,
        compute,
        steps,
        live: (0..n).map(|_| None).collect(),
        written: vec![false; n],
        words_verified: 0,
        folded: 0,
        peak_allocated: 0,
        scratch,
        spill,
        room: room.map(|(ask, charge)| RoomProbe::new(plan, ask, charge)),
    };
    let result = r.run();
    let mut record = ProbeRecord {
        bytes_allocated: r.peak_allocated,
        room: r.room.take().and_then(|r| r.found),
        ..ProbeRecord::new(plan.value, Outcome::Fit, bytes)
    };
    match result {
        Ok(()) => {
            record.checksum = Some(match compute {
                Compute::Full => format!("{:016x}", r.folded),
                Compute::Touch => format!("verified {} words", r.words_verified),
            });
            record.step_seconds = Some(started.elapsed().as_secs_f64());
        }
        Err(f) => {
            record.outcome = f.outcome;
            record.detail = Some(f.detail);
            record.failed_tensor = f.tensor;
            record.failed_at = Some(failure_point(plan, f.event, f.requested));
        }
    }
    for dt in r.live.iter_mut().filter_map(Option::take) {
        tensor::free_tensor(r.backend, dt);
    }
    r.scratch.free(r.backend);
    record.spill = r.spill.and_then(|s| s.report);
    if let Some(s) = record.spill.as_ref().filter(|s| s.spilled) {
        if record.outcome.is_fit() {
            record.outcome = Outcome::Spilled;
            record.detail = Some(s.reason.clone());
        }
    }
    record.seconds = started.elapsed().as_secs_f64();
    record
}

/// A refusal's detail, naming the step where it is not the first.
fn in_step(step: usize, detail: String) -> String {
    if step == 1 {
        detail
    } else {
        format!("step {step}: {detail}")
    }
}

/// The fill seed of the i-th tensor: distinct per tensor so a mixed-up buffer is caught.
fn seed_of(i: usize) -> u32 {
    0x9e37_79b9u32.wrapping_mul(i as u32 + 1)
}
