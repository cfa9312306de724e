//! One scenario's boundary search on a device: predict, search with real probes (in a child
//! each, or in process), and assemble the `RunResult` with prediction error and fill ratio.

use std::time::Instant;

use crate::backend::DeviceInfo;
use crate::plan::{Plan, Role};
use crate::report::{ProbeRecord, RunResult};
use crate::scenario::Scenario;
use crate::search::{self, Answer, RoomAsk, SearchOutcome, SearchSpace};

use super::capacity::Capacity;
use super::charge::Charge;
use super::child::{probe_in_process, ChildRequest, ChildRunner};
use super::suite::RunSpec;
use super::{Compute, DeviceChoice};

/// Granularity of the params scenario: 2^16 parameters (1 MiB of fp32 Adam states).
pub const PARAMS_GRANULARITY: u64 = 1 << 16;

/// What a search reports as it goes (for progress and partial results).
#[derive(Debug, Clone, Copy)]
pub enum ProbeEvent<'a> {
    /// A probe at this value is starting.
    Started(u64),
    /// A probe has finished.
    Finished(&'a ProbeRecord),
}

/// How probes are run.
#[derive(Debug, Clone)]
pub enum Isolation {
    /// A child process per probe (the default).
    Child(ChildRunner),
    /// In this process (`--no-isolate`).
    InProcess,
}

/// Which boundary search a run uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum SearchMode {
    /// Measure the capacity (the room at a fit's peak or right after a refusal) and invert the
    /// plan's charged bytes to the boundary (`search::find_boundary_charged`).
    #[default]
    Measure,
    /// Only fit or fail: gallop from the prediction and bisect (`search::find_boundary`).
    Gallop,
}

/// Everything shared by the runs of one invocation.
#[derive(Debug, Clone)]
pub struct RunContext {
    pub device: DeviceChoice,
    pub info: DeviceInfo,
    pub capacity: Capacity,
    pub compute: Compute,
    pub isolation: Isolation,
    pub search: SearchMode,
    /// `--repeat N`: after a search, probe `max_fit` and `first_fail` N more times each in
    /// fresh children (0: not at all).
    pub repeat: u32,
}

/// The values a repeat probed: `fit` and the `steps` granules above it.
fn steps_probed(fit: u64, steps: u32, granularity: u64) -> Vec<u64> {
    (0..=u64::from(steps))
        .map(|k| fit.saturating_add(k.saturating_mul(granularity)))
        .collect()
}

/// The most steps down a `max_fit` that failed on repeat takes.
const MAX_REPEAT_STEPS: u32 = 8;

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

impl RunContext {
    /// Run one probe of `spec` at `value`.
    pub fn probe(&self, spec: &RunSpec, value: u64) -> ProbeRecord {
        self.probe_measuring(spec, value, None)
    }

    /// Run one probe of `spec` at `value`, measuring the room at its peak when `room` asks.
    pub fn probe_measuring(
        &self,
        spec: &RunSpec,
        value: u64,
        room: Option<RoomAsk>,
    ) -> ProbeRecord {
        let req = ChildRequest {
            room,
            workload: spec.workload.clone(),
            scenario: spec.scenario,
            value,
            compute: self.compute,
            device: self.device.clone(),
            budget: self.capacity.budget,
            snapshot: None,
        };
        match &self.isolation {
            Isolation::Child(runner) => runner.run(&req),
            Isolation::InProcess => probe_in_process(&req),
        }
    }

    /// What the fill ratio is measured against: the budget when one is enforced, else the
    /// free memory at start.
    fn fill_base(&self) -> Option<u64> {
        self.capacity.budget.or(self.capacity.free_at_start)
    }

    /// The predicted maximum of `spec` against this run's capacity.
    /// Where tensors go through the caching allocator, what its segments need.
    pub fn predicted_max(&self, spec: &RunSpec) -> Option<u64> {
        let cap = self.capacity.predict_against?;
        match &self.device.allocator {
            Some(text) => {
                let card = crate::alloc::Card {
                    total: cap,
                    non_pytorch: 0,
                    conf: crate::alloc::conf::parse(text).ok()?,
                };
                crate::estimate::predicted_max_reserved(&spec.workload, spec.scenario, &card)
            }
            None => crate::estimate::predicted_max(&spec.workload, spec.scenario, cap),
        }
        .ok()
        .flatten()
    }

    /// Search the boundary of one run. `on_event` sees every probe start and finish.
    pub fn search(&self, spec: &RunSpec, on_event: &mut dyn FnMut(ProbeEvent<'_>)) -> RunResult {
        let started = Instant::now();
        let space = search_space(spec.scenario);
        let predicted = self.predicted_max(spec);
        let start = predicted.unwrap_or(match spec.scenario {
            Scenario::Params => 1 << 24,
            Scenario::Seq => 1024,
            _ => 8,
        });
        let mut records: Vec<ProbeRecord> = Vec::new();
        let mut verify = Vec::new();
        let found = self.find(spec, space, start, &mut records, &mut verify, on_event);
        let plan_at = |x: u64| Plan::for_value(&spec.workload, spec.scenario, x).ok();
        let max_plan = found.max_fit.and_then(plan_at);
        let bytes_at_max_fit = max_plan.as_ref().map(|p| p.peak_bytes());
        let activation_share = max_plan.as_ref().and_then(|p| {
            // One walk of the timeline: the breakdown at its peak.
            let peak = p.peak();
            let act = peak
                .by_role
                .get(Role::Activations)
                .saturating_add(peak.by_role.get(Role::Attention));
            (peak.bytes > 0).then(|| act as f64 / peak.bytes as f64)
        });
        let fill_ratio = match (bytes_at_max_fit, self.fill_base()) {
            (Some(b), Some(free)) if free > 0 => Some(b as f64 / free as f64),
            _ => None,
        };
        let mut notes = spec.notes.clone();
        if self.compute == Compute::Full {
            if let Some(m) = spec
                .workload
                .model
                .as_ref()
                .and_then(|m| m.recurrent_mixer())
            {
                notes.push(format!(
                    "{} layers ran touch-only: their scans have no WGSL/CUDA kernel yet, so their tensors were written and read back; the projections, norms, attention and MLPs around them ran their kernels",
                    m.name()
                ));
            }
        }
        let mut found = found;
        let repeats = self.repeat_boundary(spec, space, &mut found, &mut notes);
        for (x, again) in &verify {
            let dim = spec.scenario.dimension();
            notes.push(if *again {
                format!("verify_failed at {dim}={x} twice (in fresh children): the adapter loses written data at the edge of memory (corrupting); the boundary is the last verified fit")
            } else {
                format!("verify_failed at {dim}={x}, then fit in a fresh child: counted as the retry's answer")
            });
        }
        if found.flaky {
            notes.push("flaky: a value fit above a value that failed; boundary shown is the largest value that always fit below the lowest failure".into());
        }
        if !found.inconclusive.is_empty() {
            let at: Vec<String> = found.inconclusive.iter().map(|x| x.to_string()).collect();
            notes.push(format!(
                "no answer at {}={} (the child was killed or timed out, twice): not counted as a failure",
                spec.scenario.dimension(),
                at.join(", ")
            ));
        }
        if found.fell_back && self.search == SearchMode::Measure {
            notes.push(
                "the measured capacity and the probes disagreed (fragmentation, or memory \
                 that comes and goes): the boundary was found by galloping and bisecting"
                    .into(),
            );
        }
        if found.max_fit.is_some() && found.first_fail.is_none() {
            notes.push(format!(
                "everything up to the search maximum {} fit",
                space.max
            ));
        }
        RunResult {
            scenario: spec.scenario,
            dimension: spec.scenario.dimension().to_string(),
            variant: spec.variant.clone(),
            workload: spec.workload.clone(),
            max_fit: found.max_fit,
            first_fail: found.first_fail,
            fail_reason: found.fail_reason,
            bytes_at_max_fit,
            predicted_max: predicted,
            capacity_bytes: self.capacity.predict_against,
            fill_ratio,
            activation_share,
            at: None,
            flaky: found.flaky,
            measured_capacity_bytes: found.capacity.at_least,
            measured_capacity_below: found.capacity.below,
            device_overhead_bytes: found.capacity.at_least.and_then(|m| {
                let assumed = self.capacity.predict_against?;
                Some(i64::try_from(assumed).ok()? - i64::try_from(m).ok()?)
            }),
            notes,
            probes: records,
            repeats,
            seconds: started.elapsed().as_secs_f64(),
            in_progress: false,
        }
    }

    /// Run the search of this context's mode, each probe through `on_event` into `records`.
    /// A `verify_failed` probe is retried once in a fresh child; `verify` gets (value, whether
    /// it failed again) for each.
    fn find(
        &self,
        spec: &RunSpec,
        space: SearchSpace,
        start: u64,
        records: &mut Vec<ProbeRecord>,
        verify: &mut Vec<(u64, bool)>,
        on_event: &mut dyn FnMut(ProbeEvent<'_>),
    ) -> SearchOutcome {
        let charge = Charge::of(&self.info, self.capacity.budget);
        let plan_at = |x: u64| Plan::for_value(&spec.workload, spec.scenario, x).ok();
        // What a replay holds besides the plan's tensors, as the latest probe calibrated it.
        let mut reserve = 0;
        let mut run = |x: u64, room: Option<RoomAsk>| {
            let room = room.map(|r| RoomAsk { reserve, ..r });
            on_event(ProbeEvent::Started(x));
            let mut rec = self.probe_measuring(spec, x, room);
            on_event(ProbeEvent::Finished(&rec));
            if rec.outcome == crate::report::Outcome::VerifyFailed {
                // A read-back that lost data: once more in a fresh child before it counts.
                records.push(rec);
                on_event(ProbeEvent::Started(x));
                rec = self.probe_measuring(spec, x, room);
                on_event(ProbeEvent::Finished(&rec));
                verify.push((x, rec.outcome == crate::report::Outcome::VerifyFailed));
            }
            let answer = plan_at(x).map_or_else(
                || Answer::bare(rec.outcome),
                |p| super::dry::answer_of(&rec, &p, &charge, &plan_at),
            );
            if let Some(d) = rec.dry {
                reserve = d.reserve_bytes;
            }
            records.push(rec);
            answer
        };
        match self.search {
            SearchMode::Gallop => search::find_boundary(space, start, |x| run(x, None).outcome),
            SearchMode::Measure => {
                // The search's bytes are what the device charges (chunks in whole pages).
                let cost = |x: u64| plan_at(x).map(|p| charge.cost(&p));
                search::find_boundary_charged(space, start, cost, |a| run(a.value, a.room))
            }
        }
    }

    /// `--repeat N`: probe the boundary's two values N times each in fresh children. A
    /// `max_fit` that fails any repeat steps down (one granule at a time, each value probed N
    /// times) to one that always fit; a `first_fail` that fits is reported, never moved up.
    fn repeat_boundary(
        &self,
        spec: &RunSpec,
        space: SearchSpace,
        found: &mut SearchOutcome,
        notes: &mut Vec<String>,
    ) -> Vec<crate::report::Repeat> {
        let n = self.repeat;
        let mut out = Vec::new();
        let Some(mut fit) = found.max_fit.filter(|_| n > 0) else {
            return out;
        };
        let dim = spec.scenario.dimension();
        let mut probe_n = |x: u64| {
            let outcomes: Vec<crate::report::Outcome> =
                (0..n).map(|_| self.probe(spec, x).outcome).collect();
            let r = crate::report::Repeat {
                value: x,
                tries: n,
                fits: outcomes.iter().filter(|o| o.is_fit()).count() as u32,
                outcomes,
            };
            out.push(r.clone());
            r
        };
        let mut steps = 0;
        loop {
            let r = probe_n(fit);
            if r.fits == n {
                break;
            }
            let lower = fit.saturating_sub(space.granularity);
            if lower < space.min || steps == MAX_REPEAT_STEPS {
                notes.push(format!(
                    "repeat: {dim}={fit} fit {} of {n} times, and no value below it always fit within {MAX_REPEAT_STEPS} steps: the boundary does not repeat",
                    r.fits
                ));
                break;
            }
            notes.push(format!(
                "repeat: {dim}={fit} fit {} of {n} times in fresh children: stepped down",
                r.fits
            ));
            found.first_fail = Some(fit);
            found.fail_reason = r.outcomes.iter().copied().find(|o| !o.is_fit());
            fit = lower;
            found.max_fit = Some(fit);
            steps += 1;
        }
        let probed: Vec<u64> = steps_probed(fit, steps, space.granularity);
        if let Some(ff) = found.first_fail.filter(|ff| !probed.contains(ff)) {
            let r = probe_n(ff);
            if r.fits > 0 {
                notes.push(format!(
                    "repeat: {dim}={ff} (the first failure) fit {} of {n} times in fresh children: the edge moves between runs",
                    r.fits
                ));
            }
        }
        out
    }

    /// One probe at `value` reported as a run (`--at X`).
    pub fn single(&self, spec: &RunSpec, value: u64) -> RunResult {
        let started = Instant::now();
        let mut probes = vec![self.probe(spec, value)];
        if probes[0].outcome.is_transient() {
            // A child that died before answering gets one more try, as in a search.
            probes.push(self.probe(spec, value));
        }
        let rec = probes[probes.len() - 1].clone();
        let fit = rec.outcome.is_fit();
        let bytes = rec.bytes;
        RunResult {
            scenario: spec.scenario,
            dimension: spec.scenario.dimension().to_string(),
            variant: spec.variant.clone(),
            workload: spec.workload.clone(),
            max_fit: fit.then_some(value),
            first_fail: (!fit).then_some(value),
            fail_reason: (!fit).then_some(rec.outcome),
            bytes_at_max_fit: fit.then_some(bytes),
            predicted_max: self.predicted_max(spec),
            capacity_bytes: self.capacity.predict_against,
            fill_ratio: match self.fill_base() {
                Some(free) if fit && free > 0 => Some(bytes as f64 / free as f64),
                _ => None,
            },
            activation_share: None,
            at: Some(value),
            flaky: false,
            measured_capacity_bytes: None,
            measured_capacity_below: None,
            device_overhead_bytes: None,
            notes: spec.notes.clone(),
            probes,
            repeats: Vec::new(),
            seconds: started.elapsed().as_secs_f64(),
            in_progress: false,
        }
    }
}
