//! The timeline of one step: alloc/free events and kernel launches in order, tagged by phase,
//! and what follows from it (live bytes after each event, the peak, its phase and its breakdown).
//!
//! A plan's `events` are the single source every consumer reads: `estimate` and `diagnose` take
//! the peak, `probe` replays the events on the device in order, and a PyTorch memory snapshot can
//! be turned into the same shape. Tensors never freed in the events (model states) stay live to
//! the end of the step.

use serde::{Deserialize, Serialize};

use super::{Plan, Role, TensorIx};

/// Where in a training (or inference) step an event happens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Phase {
    /// Model states that exist before the step (params, optimizer state, kept gradients).
    Setup,
    Forward,
    /// The loss: log-softmax and its reduction.
    Loss,
    Backward,
    /// The optimizer step and `zero_grad`.
    Optimizer,
}

impl Phase {
    pub fn name(self) -> &'static str {
        match self {
            Phase::Setup => "setup",
            Phase::Forward => "forward",
            Phase::Loss => "loss",
            Phase::Backward => "backward",
            Phase::Optimizer => "optimizer",
        }
    }
}

/// What happens at one point of the step.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "event", content = "index", rename_all = "snake_case")]
pub enum EventKind {
    /// A tensor (index into `Plan::tensors`) is allocated.
    Alloc(TensorIx),
    /// A tensor is freed.
    Free(TensorIx),
    /// A kernel (index into `Plan::steps`) runs over live tensors.
    Kernel(usize),
}

/// One event of the timeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Event {
    pub phase: Phase,
    #[serde(flatten)]
    pub kind: EventKind,
}

/// Live bytes per role at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct RoleBytes([u64; 6]);

impl RoleBytes {
    pub fn get(&self, role: Role) -> u64 {
        self.0[role as usize]
    }
    fn add(&mut self, role: Role, bytes: u64) {
        let r = &mut self.0[role as usize];
        *r = r.saturating_add(bytes);
    }
    fn sub(&mut self, role: Role, bytes: u64) {
        let r = &mut self.0[role as usize];
        *r = r.saturating_sub(bytes);
    }
    pub fn total(&self) -> u64 {
        self.0.iter().fold(0u64, |a, &b| a.saturating_add(b))
    }
}

/// The highest live-bytes point of a timeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct Peak {
    pub bytes: u64,
    /// Index into `Plan::events` of the allocation that reached the peak (0 for an empty plan).
    pub event: usize,
    pub phase: Option<Phase>,
    pub by_role: RoleBytes,
}

/// One point of the live-bytes curve (after an alloc or free).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CurvePoint {
    pub event: usize,
    pub phase: Phase,
    pub live_bytes: u64,
}

impl Plan {
    /// Walk the events, calling `f(event index, event, live bytes by role after it)`.
    pub fn walk(&self, mut f: impl FnMut(usize, &Event, &RoleBytes)) {
        let mut live = RoleBytes::default();
        for (i, e) in self.events.iter().enumerate() {
            match e.kind {
                EventKind::Alloc(t) => live.add(self.tensors[t].role, self.tensors[t].bytes),
                EventKind::Free(t) => live.sub(self.tensors[t].role, self.tensors[t].bytes),
                EventKind::Kernel(_) => {}
            }
            f(i, e, &live);
        }
    }

    /// The peak of live bytes over the step, its phase and the breakdown by role at that moment.
    /// The first event that reaches the maximum is reported.
    pub fn peak(&self) -> Peak {
        let mut peak = Peak::default();
        self.walk(|i, e, live| {
            let total = live.total();
            if total > peak.bytes {
                peak = Peak {
                    bytes: total,
                    event: i,
                    phase: Some(e.phase),
                    by_role: *live,
                };
            }
        });
        peak
    }

    /// The tensor whose allocation reached `peak` (None for an empty plan).
    pub fn peak_tensor(&self, peak: &Peak) -> Option<&str> {
        match self.events.get(peak.event).map(|e| e.kind) {
            Some(EventKind::Alloc(t)) if peak.bytes > 0 => Some(&self.tensors[t].name),
            _ => None,
        }
    }

    /// The most bytes of model states (params, gradients, optimizer state) live at once: all
    /// of them, once backward has made every gradient.
    pub fn states_peak(&self) -> u64 {
        let mut max = 0;
        self.walk(|_, _, live| {
            let s = live
                .get(Role::Params)
                .saturating_add(live.get(Role::Gradients))
                .saturating_add(live.get(Role::Optimizer));
            max = max.max(s);
        });
        max
    }

    /// Activation bytes (activations and attention roles) live when backward starts: what the
    /// forward pass and the loss saved, plus what the caller holds (logits).
    pub fn saved_bytes(&self) -> u64 {
        let mut saved = 0;
        let mut done = false;
        self.walk(|_, e, live| {
            if !done && e.phase <= Phase::Loss {
                saved = live
                    .get(Role::Activations)
                    .saturating_add(live.get(Role::Attention));
            } else {
                done = true;
            }
        });
        saved
    }

    /// The most bytes live during one phase (0 if the phase has no events).
    pub fn phase_max(&self, phase: Phase) -> u64 {
        let mut max = 0;
        self.walk(|_, e, live| {
            if e.phase == phase {
                max = max.max(live.total());
            }
        });
        max
    }

    /// Peak live bytes (what must fit on the device).
    pub fn peak_bytes(&self) -> u64 {
        self.peak().bytes
    }

    /// Live bytes after every alloc and free.
    pub fn curve(&self) -> Vec<CurvePoint> {
        let mut out = Vec::new();
        self.walk(|i, e, live| {
            if !matches!(e.kind, EventKind::Kernel(_)) {
                out.push(CurvePoint {
                    event: i,
                    phase: e.phase,
                    live_bytes: live.total(),
                });
            }
        });
        out
    }

    /// Live bytes just before event `i` (what was held when an allocation at `i` was refused).
    pub fn live_before(&self, i: usize) -> u64 {
        let mut before = 0;
        self.walk(|j, _, live| {
            if j + 1 == i {
                before = live.total();
            }
        });
        before
    }

    /// The most bytes live at once before event `i` (what the device held before a refusal
    /// at `i`).
    pub fn max_live_before(&self, i: usize) -> u64 {
        let mut max = 0;
        self.walk(|j, _, live| {
            if j < i {
                max = max.max(live.total());
            }
        });
        max
    }

    /// Tensors live at the end of the events (never freed): the model states.
    pub fn live_at_end(&self) -> Vec<TensorIx> {
        self.live_after(self.events.len())
    }

    /// Tensors live after the first `n` events.
    pub fn live_after(&self, n: usize) -> Vec<TensorIx> {
        let mut live = vec![false; self.tensors.len()];
        for e in self.events.iter().take(n) {
            match e.kind {
                EventKind::Alloc(t) => live[t] = true,
                EventKind::Free(t) => live[t] = false,
                EventKind::Kernel(_) => {}
            }
        }
        (0..self.tensors.len()).filter(|&t| live[t]).collect()
    }

    /// Check the timeline's consistency: every tensor allocated exactly once, freed at most once
    /// and only after its allocation, and every kernel's tensors live when it runs.
    pub fn check_timeline(&self) -> Result<(), String> {
        let n = self.tensors.len();
        let mut state = vec![0u8; n]; // 0 never, 1 live, 2 freed
        for (i, e) in self.events.iter().enumerate() {
            match e.kind {
                EventKind::Alloc(t) => {
                    if state[t] != 0 {
                        return Err(format!(
                            "event {i}: {} allocated twice",
                            self.tensors[t].name
                        ));
                    }
                    state[t] = 1;
                }
                EventKind::Free(t) => {
                    if state[t] != 1 {
                        return Err(format!(
                            "event {i}: {} freed while not live",
                            self.tensors[t].name
                        ));
                    }
                    state[t] = 2;
                }
                EventKind::Kernel(k) => {
                    for t in self.steps[k].tensors() {
                        if state[t] != 1 {
                            return Err(format!(
                                "event {i}: kernel {k} reads {} which is not live",
                                self.tensors[t].name
                            ));
                        }
                    }
                }
            }
        }
        if let Some(t) = state.iter().position(|&s| s == 0) {
            return Err(format!("{} is never allocated", self.tensors[t].name));
        }
        Ok(())
    }
}
