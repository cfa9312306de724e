//! The plan's builder: tensors with their alloc/free events and kernel steps, appended in
//! order, with checked u64 arithmetic (`prod`, `sum`); an overflow is a `PlanError`. Every
//! architecture's planner writes into one.

use thiserror::Error;

use super::{DType, Event, EventKind, Phase, Plan, Role, Step, TensorIx, TensorSpec};
use crate::scenario::Scenario;
use crate::workload::Workload;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum PlanError {
    /// A size does not fit in 64 bits.
    #[error("{what} is too large: its size overflows 64 bits")]
    Overflow { what: String },
    /// The scenario does not apply to this workload (e.g. `seq` on a CNN).
    #[error("{0}")]
    Unsupported(String),
    /// The workload's shape is inconsistent (zero sizes, heads not dividing hidden, ...).
    #[error("{0}")]
    Invalid(String),
}

/// Checked product of `dims`; `what` names the quantity in the error.
pub fn prod(dims: &[u64], what: &str) -> Result<u64, PlanError> {
    dims.iter().try_fold(1u64, |acc, &d| {
        acc.checked_mul(d).ok_or_else(|| PlanError::Overflow {
            what: what.to_string(),
        })
    })
}

/// Checked sum of `terms`.
pub fn sum(terms: &[u64], what: &str) -> Result<u64, PlanError> {
    terms.iter().try_fold(0u64, |acc, &d| {
        acc.checked_add(d).ok_or_else(|| PlanError::Overflow {
            what: what.to_string(),
        })
    })
}

/// Builds a timeline: tensors with their alloc/free events in the current phase, kernel steps
/// (each a `Kernel` event at the point it runs) and notes. The running live total is checked, so
/// a peak that overflows 64 bits is an error naming the tensor that crossed it.
#[derive(Debug)]
pub struct Builder {
    pub(crate) tensors: Vec<TensorSpec>,
    pub(crate) steps: Vec<Step>,
    pub(crate) events: Vec<Event>,
    pub(crate) notes: Vec<String>,
    phase: Phase,
    live: u64,
    /// Selective checkpointing's store: names whose free keeps the tensor instead.
    stash_names: Vec<String>,
    /// What the store holds, by name, until a push of that name takes it back.
    stashed: Vec<(String, TensorIx)>,
    /// Tensors an autograd node holds outside its saved tensors (a custom Function's `ctx`
    /// attribute), in pinning order, each with whether its owner has freed it meanwhile.
    pinned: Vec<(TensorIx, bool)>,
}

impl Default for Builder {
    fn default() -> Self {
        Builder {
            tensors: Vec::new(),
            steps: Vec::new(),
            events: Vec::new(),
            notes: Vec::new(),
            phase: Phase::Setup,
            live: 0,
            stash_names: Vec::new(),
            stashed: Vec::new(),
            pinned: Vec::new(),
        }
    }
}

impl Builder {
    /// Events from now on belong to `phase`.
    pub fn phase(&mut self, phase: Phase) {
        self.phase = phase;
    }
    /// The phase events belong to now.
    pub fn current_phase(&self) -> Phase {
        self.phase
    }
    /// Allocate a tensor of `shape` (elements) now and return its index.
    pub fn push(
        &mut self,
        name: &str,
        role: Role,
        dtype: DType,
        shape: &[u64],
        row_elems: u64,
    ) -> Result<TensorIx, PlanError> {
        if !self.stashed.is_empty() {
            if let Some(ix) = self.take_stashed(name, dtype, shape) {
                return Ok(ix);
            }
        }
        let what = || {
            let dims: Vec<String> = shape.iter().map(|d| d.to_string()).collect();
            format!("tensor '{name}' [{}]", dims.join(" x "))
        };
        let elems = prod(shape, "").map_err(|_| PlanError::Overflow { what: what() })?;
        let bytes = elems
            .checked_mul(dtype.bytes())
            .ok_or_else(|| PlanError::Overflow { what: what() })?;
        self.live = self
            .live
            .checked_add(bytes)
            .ok_or_else(|| PlanError::Overflow {
                what: format!("the live total (at {})", what()),
            })?;
        self.tensors.push(TensorSpec {
            name: name.to_string(),
            role,
            dtype,
            shape: shape.to_vec(),
            bytes,
            row_elems: row_elems.max(1),
            stream: Default::default(),
            part_bytes: 0,
        });
        let ix = self.tensors.len() - 1;
        self.events.push(Event {
            phase: self.phase,
            kind: EventKind::Alloc(ix),
        });
        Ok(ix)
    }
    /// Tensor `ix` is allocated on `stream` (its pool in the caching allocator).
    pub fn on_stream(&mut self, ix: TensorIx, stream: super::Stream) {
        self.tensors[ix].stream = stream;
    }
    /// Tensor `ix` stands for PyTorch tensors of `part_bytes` each, and one of the rest
    /// (`TensorSpec::part_bytes`).
    pub fn in_parts(&mut self, ix: TensorIx, part_bytes: u64) {
        self.tensors[ix].part_bytes = part_bytes;
    }
    /// Free a live tensor now (unless the selective-checkpoint store keeps it, or a pin holds
    /// it: then it goes when the pin is let go).
    pub fn free(&mut self, ix: TensorIx) {
        if let Some(p) = self.pinned.iter_mut().find(|p| p.0 == ix) {
            p.1 = true;
            return;
        }
        if !self.stash_names.is_empty() {
            let name = &self.tensors[ix].name;
            if self.stash_names.contains(name) && !self.stashed.iter().any(|s| s.1 == ix) {
                self.stashed.push((name.clone(), ix));
                return;
            }
        }
        self.live = self.live.saturating_sub(self.tensors[ix].bytes);
        self.events.push(Event {
            phase: self.phase,
            kind: EventKind::Free(ix),
        });
    }
    /// An autograd node holds live tensor `ix` until `unpin_from` lets go of it: a free
    /// before then waits.
    pub fn pin(&mut self, ix: TensorIx) {
        if !self.pinned.iter().any(|p| p.0 == ix) {
            self.pinned.push((ix, false));
        }
    }

    /// How many tensors are pinned now (a mark for `unpin_from`).
    pub fn pins(&self) -> usize {
        self.pinned.len()
    }

    /// The tensors pinned now, in pinning order.
    pub fn pinned(&self) -> Vec<TensorIx> {
        self.pinned.iter().map(|p| p.0).collect()
    }

    /// Let go of the pins made since `mark` (the graph that held them is gone): those their
    /// owner has freed go now, in pinning order; the rest are the owner's again.
    pub fn unpin_from(&mut self, mark: usize) {
        let at = mark.min(self.pinned.len());
        let gone: Vec<(TensorIx, bool)> = self.pinned.drain(at..).collect();
        for (ix, freed) in gone {
            if freed {
                self.free(ix);
            }
        }
    }

    /// The index the next event will have: a point of the timeline to come back to.
    pub fn mark(&self) -> usize {
        self.events.len()
    }

    /// The previous step's `carried` tensors (what its loop and its graph still hold as this
    /// step begins) live from this step's first forward event until event `until`: a copy of
    /// each, named `prev.<name>`, is allocated just before the first event of phase `Forward`
    /// and freed at `until` (a `mark` taken after that first event).
    pub fn carry_in(&mut self, carried: &[TensorIx], until: usize) {
        let start = self
            .events
            .iter()
            .position(|e| e.phase == Phase::Forward)
            .unwrap_or(self.events.len());
        let until = until.clamp(start, self.events.len());
        let mut copies = Vec::with_capacity(carried.len());
        for &ix in carried {
            let mut spec = self.tensors[ix].clone();
            spec.name = format!("prev.{}", spec.name);
            self.tensors.push(spec);
            copies.push(self.tensors.len() - 1);
        }
        let at = self
            .events
            .get(until.saturating_sub(1))
            .map_or(Phase::Forward, |e| e.phase);
        let frees = copies.iter().map(|&c| Event {
            phase: at,
            kind: EventKind::Free(c),
        });
        self.events.splice(until..until, frees);
        let allocs = copies.iter().map(|&c| Event {
            phase: Phase::Forward,
            kind: EventKind::Alloc(c),
        });
        self.events.splice(start..start, allocs);
    }

    /// Selective activation checkpointing's store (`torch.utils.checkpoint`'s
    /// `_CachingTorchDispatchMode` under a `MUST_SAVE` policy): from now on, until
    /// `stash_end`, a tensor named in `names` is kept live when it is freed; the recomputation's
    /// push of the same name (`_CachedTorchDispatchMode`) takes it back without allocating.
    pub fn stash_begin(&mut self, names: Vec<String>) {
        self.stash_names = names;
    }

    /// The store takes no more tensors (what it holds stays until taken back or `stash_free`).
    pub fn stash_end(&mut self) {
        self.stash_names.clear();
    }

    /// Free what the store still holds of `prefix` (a recomputation that did not take it).
    pub fn stash_free(&mut self, prefix: &str) {
        let (gone, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut self.stashed)
            .into_iter()
            .partition(|(n, _)| n.starts_with(prefix));
        self.stashed = kept;
        self.free_all(gone.into_iter().map(|(_, ix)| ix));
    }

    /// The stored tensor of `name`, taken out of the store, when its type and shape match.
    fn take_stashed(&mut self, name: &str, dtype: DType, shape: &[u64]) -> Option<TensorIx> {
        let at = self.stashed.iter().position(|(n, ix)| {
            let t = &self.tensors[*ix];
            n == name && t.dtype == dtype && t.shape == shape
        })?;
        Some(self.stashed.swap_remove(at).1)
    }

    /// Free several tensors now, in order.
    pub fn free_all(&mut self, ixs: impl IntoIterator<Item = TensorIx>) {
        for ix in ixs {
            self.free(ix);
        }
    }
    /// The loss's log-softmax over `logits` ([rows, cols]): an fp32 copy of the logits first
    /// when `fp32_copy` (freed once the log-probabilities exist), then the log-probabilities in
    /// `dtype`, which the loss's backward keeps. Returns the log-probabilities.
    /// The loss's log-softmax over `logits` (an fp32 copy first when `fp32_copy`): its output,
    /// and the copy when `keep_input` (PyTorch before 1.11 saves the input too:
    /// `Release::softmax_saves_input`), which the caller frees with the output.
    pub fn loss_log_softmax(
        &mut self,
        logits: TensorIx,
        rows: u64,
        cols: u64,
        fp32_copy: bool,
        dtype: DType,
        keep_input: bool,
    ) -> Result<(TensorIx, Option<TensorIx>), PlanError> {
        let shape = [rows, cols];
        let copy = if fp32_copy {
            Some(self.push("loss.logits_f32", Role::Workspace, DType::F32, &shape, cols)?)
        } else {
            None
        };
        let logprobs = self.push("logprobs", Role::Activations, dtype, &shape, cols)?;
        self.step(Step::Softmax {
            x: copy.unwrap_or(logits),
            y: logprobs,
            rows,
            cols,
        });
        if keep_input {
            return Ok((logprobs, copy));
        }
        self.free_all(copy);
        Ok((logprobs, None))
    }
    pub fn tensor(&self, ix: TensorIx) -> &TensorSpec {
        &self.tensors[ix]
    }
    /// Run a kernel now. A kernel over tensors of different floating types (an autocast op
    /// that reads a 16-bit tensor and writes an fp32 one) has no WGSL/CUDA kernel: it is left
    /// out (its tensors are still allocated, filled and freed in order).
    pub fn step(&mut self, s: Step) {
        let mut types = s
            .tensors()
            .into_iter()
            .map(|t| self.tensors[t].dtype)
            .filter(|d| !matches!(d, DType::U8 | DType::I64));
        if let Some(first) = types.next() {
            if types.any(|d| d != first) {
                return;
            }
        }
        self.steps.push(s);
        self.events.push(Event {
            phase: self.phase,
            kind: EventKind::Kernel(self.steps.len() - 1),
        });
    }
    pub fn note(&mut self, n: impl Into<String>) {
        self.notes.push(n.into());
    }
    pub(crate) fn finish(self, workload: Workload, scenario: Scenario, value: u64) -> Plan {
        Plan {
            workload,
            scenario,
            value,
            tensors: self.tensors,
            steps: self.steps,
            events: self.events,
            notes: self.notes,
        }
    }
}
