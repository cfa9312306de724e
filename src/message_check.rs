//! A pasted OOM message against the workload the user says ran: the allocator replays the
//! workload's step on the memory PyTorch had at the failure (its reserved plus the headroom the
//! message printed), and the failure it predicts is compared with the message's request and
//! allocated bytes. Then the workload's remedies are judged on that same memory.

use serde::Serialize;

use crate::alloc::conf::AllocConf;
use crate::alloc::timeline::{replay, STEPS};
use crate::diagnose::{diagnose, Diagnosis};
use crate::oom::Message;
use crate::plan::build::PlanError;
use crate::plan::Plan;
use crate::snapshot::report::OomReport;
use crate::units::fmt_bytes;
use crate::workload::Workload;

/// How far the predicted allocated bytes at the failure may be from the message's and still be
/// the same run (the plan's step peaks are within 0.5 % of PyTorch; the moment of failure moves
/// with what the plan does not hold, such as a data batch or a cuBLAS workspace).
pub const SAME_RUN_TOLERANCE: f64 = 0.10;

/// Where the allocator model says the workload fails on the message's memory.
#[derive(Debug, Clone, Serialize)]
pub struct PredictedFailure {
    pub phase: &'static str,
    pub tensor: String,
    /// What it asks the device for (the message's "Tried to allocate").
    pub requested_bytes: u64,
    pub allocated_bytes: u64,
    pub fragmentation: bool,
}

#[derive(Debug, Clone, Serialize)]
pub struct MessageCheck {
    /// What PyTorch could hold at the failure: reserved + headroom.
    pub capacity_bytes: u64,
    pub predicted_allocated_peak_bytes: u64,
    pub predicted_reserved_peak_bytes: u64,
    pub predicted_failure: Option<PredictedFailure>,
    /// The message is what this workload would print here.
    pub same_run: bool,
    pub verdict: String,
    /// With expandable segments: the reserved peak, and whether the step then fits.
    pub expandable_reserved_peak_bytes: u64,
    pub expandable_fits: bool,
    /// The workload's cause and remedies on `capacity_bytes`.
    pub diagnosis: Diagnosis,
}

/// What PyTorch could hold when the message was printed (None: the message lacks the figures).
pub fn capacity(m: &Message) -> Option<u64> {
    let r = m.reserved_total()?;
    let h = m.headroom()?;
    Some(r.mid().saturating_add(h.mid())).filter(|&c| c <= MAX_CARD)
}

/// Past this a message's figures describe no card (an edited "1e30 GiB"): it is judged on its
/// own, not replayed against a workload.
const MAX_CARD: u64 = 1 << 50;

fn share(a: u64, b: u64) -> f64 {
    (a as f64 - b as f64).abs() / (b.max(1) as f64)
}

/// Check `m` against `w` (None: the message has no reserved and free figures to judge on).
pub fn check(w: &Workload, m: &Message) -> Result<Option<MessageCheck>, PlanError> {
    let Some(cap) = capacity(m) else {
        return Ok(None);
    };
    let plan = Plan::for_workload(w)?;
    let native = AllocConf::default();
    let free_run = replay(&plan, &native, None, STEPS, false);
    let on_card = replay(&plan, &native, Some(cap), STEPS, false);
    let expandable = AllocConf {
        expandable_segments: true,
        ..AllocConf::default()
    };
    let exp = replay(&plan, &expandable, Some(cap), STEPS, false);
    let exp_free = replay(&plan, &expandable, None, STEPS, false);
    let msg_alloc = m.allocated.as_ref().map(|a| a.bytes);
    let msg_req = m.requested.as_ref().map(|r| r.bytes);
    let failure = on_card.failure.as_ref().map(|f| PredictedFailure {
        phase: f.phase.name(),
        tensor: f.tensor.clone(),
        requested_bytes: f.oom.alloc_size,
        allocated_bytes: f.oom.allocated,
        fragmentation: f.fragmentation,
    });
    let (same_run, verdict) = match (&failure, msg_alloc) {
        (None, _) => (
            false,
            format!(
                "not this workload: it fits in the {} PyTorch had (its reserved peak {}), so the run that failed held more{}",
                fmt_bytes(cap),
                fmt_bytes(free_run.reserved_peak_bytes),
                match (msg_alloc, msg_req) {
                    (Some(a), Some(t)) => format!(" ({} allocated + {} requested)", fmt_bytes(a), fmt_bytes(t)),
                    _ => String::new(),
                }
            ),
        ),
        (Some(f), Some(a)) if share(f.allocated_bytes, a) <= SAME_RUN_TOLERANCE => (
            true,
            format!(
                "consistent: the model fails at {} in {} asking {} with {} allocated; the message: {} with {} allocated",
                f.tensor,
                f.phase,
                fmt_bytes(f.requested_bytes),
                fmt_bytes(f.allocated_bytes),
                msg_req.map_or("?".into(), fmt_bytes),
                fmt_bytes(a)
            ),
        ),
        (Some(f), Some(a)) => (
            false,
            format!(
                "not this workload as given: the model fails with {} allocated ({} in {}), the message with {} ({:+.0} %): check batch, sequence, precision and checkpointing",
                fmt_bytes(f.allocated_bytes),
                f.tensor,
                f.phase,
                fmt_bytes(a),
                (a as f64 / f.allocated_bytes.max(1) as f64 - 1.0) * 100.0
            ),
        ),
        (Some(f), None) => (
            false,
            format!(
                "the model fails at {} in {}; the message prints no allocated figure to compare",
                f.tensor, f.phase
            ),
        ),
    };
    Ok(Some(MessageCheck {
        capacity_bytes: cap,
        predicted_allocated_peak_bytes: free_run.allocated_peak_bytes,
        predicted_reserved_peak_bytes: free_run.reserved_peak_bytes,
        predicted_failure: failure,
        same_run,
        verdict,
        expandable_reserved_peak_bytes: exp_free.reserved_peak_bytes,
        expandable_fits: exp.fits(),
        diagnosis: diagnose(w, cap)?,
    }))
}

/// The check for people, as lines under the message.
pub fn lines(c: &MessageCheck) -> Vec<String> {
    let mut v = vec![format!("workload: {}", c.verdict)];
    v.push(format!(
        "  the step reserves {} at its peak ({} with expandable segments, which then {}) of the {} PyTorch had",
        fmt_bytes(c.predicted_reserved_peak_bytes),
        fmt_bytes(c.expandable_reserved_peak_bytes),
        if c.expandable_fits { "fits" } else { "still does not fit" },
        fmt_bytes(c.capacity_bytes),
    ));
    v.push(format!(
        "  workload cause: {} ({})",
        c.diagnosis.cause.name(),
        c.diagnosis.reason
    ));
    for r in &c.diagnosis.remedies {
        v.push(format!("    {}: {}", r.name, r.effect));
    }
    v
}

/// How far a snapshot's recorded request may sit from the message's "Tried to allocate": the
/// trace records the request rounded to 512 B, the message the segment size asked of the driver
/// (2 MiB pages, 20 MiB for requests of 1-10 MiB).
const REQUEST_SLACK: u64 = 20 << 20;

/// A snapshot's recorded OOM against the message: the same failure or not.
#[derive(Debug, Clone, Serialize)]
pub struct SnapshotMatch {
    pub device: usize,
    pub entry: usize,
    pub same_oom: bool,
    pub lines: Vec<String>,
}

fn within(p: &Option<crate::oom::Printed>, v: u64, slack: u64) -> Option<bool> {
    let p = p.as_ref()?;
    Some(v.saturating_add(slack) >= p.min && v <= p.max.saturating_add(slack))
}

/// Compare `m` with the OOM a snapshot recorded.
pub fn against_snapshot(m: &Message, o: &OomReport) -> SnapshotMatch {
    let mut lines = Vec::new();
    let mut same = true;
    let mut row = |name: &str, ok: Option<bool>, snap: u64, msg: &Option<crate::oom::Printed>| {
        if let Some(ok) = ok {
            same &= ok;
            lines.push(format!(
                "  {name}: snapshot {}, message {}{}",
                fmt_bytes(snap),
                msg.as_ref().map_or("?", |p| p.text.as_str()),
                if ok { "" } else { "  (differs)" }
            ));
        }
    };
    row(
        "requested",
        within(&m.requested, o.requested_bytes, REQUEST_SLACK),
        o.requested_bytes,
        &m.requested,
    );
    if let Some(f) = o.device_free_bytes {
        row("free", within(&m.free, f, 0), f, &m.free);
    }
    row(
        "allocated",
        within(&m.allocated, o.allocated_bytes, 0),
        o.allocated_bytes,
        &m.allocated,
    );
    if let Some(g) = m.gpu {
        if g as usize != o.device {
            same = false;
            lines.push(format!(
                "  device: snapshot cuda:{}, message GPU {g}  (differs)",
                o.device
            ));
        }
    }
    let head = if same {
        format!(
            "snapshot: the same OOM (device {}, trace entry {}, asked by {})",
            o.device, o.entry, o.frame
        )
    } else {
        format!(
            "snapshot: a different OOM from the one recorded on device {} (entry {}): the figures disagree",
            o.device, o.entry
        )
    };
    lines.insert(0, head);
    SnapshotMatch {
        device: o.device,
        entry: o.entry,
        same_oom: same,
        lines,
    }
}
