//! Model states: params, gradients and optimizer state per precision, optimizer and ZeRO stage.
//!
//! Bytes per parameter (Ψ parameters; ZeRO paper §3.1):
//! - fp32: weights 4, gradients 4; Adam m, v 4 + 4; SGD-momentum 4; SGD 0 → 16 / 12 / 8.
//! - fp16 / bf16 (pure 16-bit training): every state in the 16-bit type → 8 / 6 / 4 with Adam /
//!   momentum / SGD.
//! - mixed: fp16 weights 2 + fp16 gradients 2 + fp32 master weights 4 (+ Adam m, v 8 or
//!   momentum 4) → 16 / 12 / 8; K (optimizer bytes incl. the master copy) = 12 with Adam.
//! - amp-fp16 / amp-bf16 (torch.autocast): params, gradients and Adam state fp32 as in fp32
//!   (16 / 12 / 8); the 16-bit copies of the weights (autocast's weight-cast cache, `cast`) are
//!   not model states: they live from the forward's first use to the backward's last.
//! - optimizer `none` (inference): weights only, in the parameter type (fp32 and amp 4,
//!   otherwise 2).
//!
//! ZeRO over N data-parallel devices (the ZeRO paper's formulas, generalized to any precision
//! with P = weight, G = gradient, K = optimizer bytes per parameter): stage 1 shards the optimizer
//! state (PΨ + GΨ + KΨ/N), stage 2 also the gradients (PΨ + (G+K)Ψ/N), stage 3 also the weights
//! ((P+G+K)Ψ/N). A shard holds ⌈Ψ/N⌉ elements.

//!
//! The `States` of a step are here with their setup; `grads`, `casts`, `parallel` and
//! `optimizer` hold what happens to them through the step.

mod casts;
mod grads;
mod optimizer;
mod parallel;

use super::autocast::Autocast;
use super::builder::{Builder, PlanError};
use super::{DType, Phase, Role, TensorIx};
use crate::workload::{Grads, Optimizer, Precision, StepKind, Workload};

/// The compute (activation) type of a precision: mixed computes in fp16; autocast's
/// lower-precision ops (matmuls, convolutions) in its 16-bit type.
pub fn compute_dtype(p: Precision) -> DType {
    match p {
        Precision::Fp32 => DType::F32,
        Precision::Fp16 | Precision::Mixed | Precision::AmpFp16 => DType::F16,
        Precision::Bf16 | Precision::AmpBf16 => DType::Bf16,
    }
}

/// The residual stream's type: the compute type, or fp32 when a quantized base trains under
/// PEFT's `prepare_model_for_kbit_training` (it upcasts the embeddings, norms and head). The
/// plan and its one-line summary both read it.
pub fn residual_dtype(w: &Workload) -> DType {
    if w.quant.is_some_and(|q| q.prepare) && !w.inference() {
        DType::F32
    } else {
        compute_dtype(w.precision)
    }
}

/// The type parameters and gradients are stored in: fp32 under autocast.
pub fn param_dtype(p: Precision) -> DType {
    if p.is_autocast() {
        DType::F32
    } else {
        compute_dtype(p)
    }
}

/// Autocast in effect for a workload (None unless `amp-*`), with the workload's op lists.
pub fn autocast(w: &Workload) -> Option<Autocast> {
    w.precision.is_autocast().then(|| Autocast {
        device: w.autocast_device,
        low: compute_dtype(w.precision),
    })
}

/// One model-state tensor kind: its name, role, element type and ZeRO stage from which it is
/// sharded.
#[derive(Debug, Clone, PartialEq)]
pub struct StateKind {
    pub name: &'static str,
    pub role: Role,
    pub dtype: DType,
    pub sharded_from_stage: u8,
    /// How many elements a piece of Ψ parameters has of it.
    pub count: Count,
}

/// Elements of a state tensor for a piece of Ψ parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Count {
    /// Ψ: one per parameter.
    Each,
    /// bitsandbytes' 8-bit blockwise state: two fp32 absmax per 256 elements (one per state).
    Absmax256,
    /// Adafactor's factored second moment: rows + columns of each ≥2-D tensor (`Piece::factored`).
    Factored,
}

/// The model-state tensors of a precision and optimizer, in allocation order.
pub fn state_kinds(precision: Precision, optimizer: Optimizer) -> Vec<StateKind> {
    let c = param_dtype(precision);
    let kind = |name, role, dtype, stage| StateKind {
        name,
        role,
        dtype,
        sharded_from_stage: stage,
        count: Count::Each,
    };
    let mut v = vec![kind("params", Role::Params, c, 3)];
    if optimizer == Optimizer::None {
        return v;
    }
    v.push(kind("grads", Role::Gradients, c, 2));
    // Optimizer-state element type: fp32 for fp32, mixed and autocast, the 16-bit type for
    // pure 16-bit.
    let o = match precision {
        Precision::Fp32 | Precision::Mixed | Precision::AmpFp16 | Precision::AmpBf16 => DType::F32,
        Precision::Fp16 | Precision::Bf16 => c,
    };
    if precision == Precision::Mixed {
        v.push(kind("opt.master", Role::Optimizer, DType::F32, 1));
    }
    match optimizer {
        Optimizer::Adam => {
            v.push(kind("opt.adam_m", Role::Optimizer, o, 1));
            v.push(kind("opt.adam_v", Role::Optimizer, o, 1));
        }
        Optimizer::SgdMomentum | Optimizer::Lion => {
            v.push(kind("opt.momentum", Role::Optimizer, o, 1))
        }
        Optimizer::AdamW8bit | Optimizer::PagedAdamW8bit => {
            v.push(kind("opt.adam8_m", Role::Optimizer, DType::U8, 1));
            v.push(kind("opt.adam8_v", Role::Optimizer, DType::U8, 1));
            v.push(StateKind {
                count: Count::Absmax256,
                ..kind("opt.absmax", Role::Optimizer, DType::F32, 1)
            });
        }
        // transformers' Adafactor keeps its state in fp32 whatever the parameters' type (it
        // steps an fp32 copy of a 16-bit gradient, `optimization.py:1220-1221`).
        Optimizer::Adafactor | Optimizer::AdafactorBeta1 => {
            if optimizer == Optimizer::AdafactorBeta1 {
                v.push(kind("opt.adafactor_m", Role::Optimizer, DType::F32, 1));
            }
            v.push(StateKind {
                count: Count::Factored,
                ..kind("opt.adafactor_v", Role::Optimizer, DType::F32, 1)
            })
        }
        Optimizer::Sgd | Optimizer::None => {}
    }
    v
}

/// Model-state bytes per parameter without sharding (16 for fp32 Adam and mixed Adam).
pub fn bytes_per_param(precision: Precision, optimizer: Optimizer) -> u64 {
    state_kinds(precision, optimizer)
        .iter()
        .filter(|k| k.count == Count::Each)
        .map(|k| k.dtype.bytes())
        .sum()
}

/// Elements of one state tensor on one device: Ψ, or ⌈Ψ/N⌉ when the ZeRO stage shards it.
pub fn shard_elems(psi: u64, kind: &StateKind, zero: u8, gpus: u64) -> u64 {
    if zero >= kind.sharded_from_stage && zero > 0 && gpus > 1 {
        psi.div_ceil(gpus)
    } else {
        psi
    }
}

/// A group of parameters whose gradient appears at one point of the backward pass (a layer's
/// attention or MLP, the embedding, the head). PyTorch allocates each parameter's state
/// separately; a piece stands for the parameters of one such group.
#[derive(Debug, Clone, PartialEq)]
pub struct Piece {
    pub name: String,
    pub elems: u64,
    /// Elements of the group's largest single parameter tensor (what one for-loop Adam
    /// temporary holds at a time).
    pub largest: u64,
    /// Frozen (a fine-tuning run's base): params only, no gradient or optimizer state.
    pub frozen: bool,
    /// The element type of its states when not the precision's (fp32 adapters; a quantized
    /// base's bytes as `U8`).
    pub dtype: Option<DType>,
    /// Adafactor's second-moment elements (rows + columns of each ≥2-D tensor); None: `elems`.
    pub factored: Option<u64>,
}

impl Piece {
    pub fn new(name: impl Into<String>, elems: u64) -> Piece {
        Piece {
            name: name.into(),
            elems,
            largest: elems,
            frozen: false,
            dtype: None,
            factored: None,
        }
    }
    /// The same piece whose largest parameter tensor has `n` elements (at most all of them).
    pub fn largest(mut self, n: u64) -> Piece {
        self.largest = n.min(self.elems);
        self
    }
}

/// The state tensors of one piece.
#[derive(Debug, Clone, Default)]
pub struct PieceStates {
    pub elems: u64,
    /// Elements of the largest parameter tensor (see `Piece::largest`).
    pub largest: u64,
    pub params: TensorIx,
    /// fp32 master weights (mixed precision).
    pub master: Option<TensorIx>,
    pub grad: Option<TensorIx>,
    /// Adam m and v, or the momentum buffer.
    pub opt: Vec<TensorIx>,
    /// FSDP: the gradient is part of its unit's scattered output (held by the unit's first
    /// piece), not a tensor of its own.
    pub grad_in_unit: bool,
}

/// Model states through a step: set up before it, gradients as backward reaches each piece, the
/// optimizer update and `zero_grad` after it.
///
/// Under ZeRO (stage ≥ 1 on more than one device) the states are DeepSpeed's flat partitioned
/// buffers: one piece, every buffer (gradients included) allocated before the step.
#[derive(Debug, Clone)]
pub struct States {
    pub pieces: Vec<PieceStates>,
    names: Vec<String>,
    /// Each piece as defined (frozen, its own element type, Adafactor's factored count).
    defs: Vec<Piece>,
    /// Piece index by name (plans of thousands of layers look pieces up per layer).
    index: std::collections::HashMap<String, usize>,
    kinds: Vec<StateKind>,
    flat: bool,
    keep_grads: bool,
    /// The last step's gradients are freed when the backward begins (`Grads::UntilBackward`).
    grads_until_backward: bool,
    first_step: bool,
    /// Optimizer-in-backward: each piece is stepped as backward makes its gradient.
    in_backward: bool,
    /// Optimizer-in-backward: (piece, elements) whose step waits for `settle` (the op that
    /// made their gradient has not yet released its inputs, or has not yet run).
    deferred: Vec<(usize, u64)>,
    /// Set while `gradient_deferred` or `gradient_split` runs.
    defer: Defer,
    /// A tied parameter's first gradient contributions, waiting in autograd's input buffer for
    /// the last one: (piece, tensor).
    pending: Vec<(usize, TensorIx)>,
    /// Autocast's lower-precision type, when it is on (not modelled under flat ZeRO states).
    low: Option<DType>,
    /// The weight-cast cache: per piece, the 16-bit copies of its matmul/conv weights (saved
    /// for backward) and biases (not saved), made at the first use in forward.
    casts: std::collections::HashMap<usize, Cast>,
    /// FSDP's shard degree: each state holds 1/shard of its piece (1: unsharded).
    shard: u64,
    /// FSDP: the unsharded gradients backward made, waiting for their unit's reduce-scatter.
    unsharded: Vec<(usize, TensorIx)>,
    /// DDP's `gradient_as_bucket_view`: gradients live in the buckets (allocated once).
    grads_in_buckets: bool,
    /// Per piece, the optimizer parameter group its foreach kernels run in: tensor
    /// parallelism with a replicated head needs two (foreach Adam refuses to mix DTensor and
    /// plain parameters), whose temporaries are never alive together.
    groups: Vec<u8>,
    /// Tensors held from the backward to the step's end (see `hold_until_end`).
    held_to_end: Vec<TensorIx>,
    /// FSDP: the last reduce-scatter's input, kept until the next one (see `fsdp_reduce`).
    rs_kept: Option<TensorIx>,
    /// FSDP's mixed-precision parameter type: the unsharded gradients backward makes are in
    /// it (None: the gradients' own type).
    pub gather_dtype: Option<DType>,
    /// FSDP1: a unit's gradients are concatenated by autograd into one flat gradient, which
    /// goes once its reduce-scatter is done.
    fsdp1: bool,
}

/// Which part of an optimizer-in-backward step waits for `States::settle`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Defer {
    No,
    Whole,
    /// All but the piece's first (largest) tensor.
    Rest,
}

/// One piece's entry in autocast's weight-cast cache.
#[derive(Debug, Clone, Copy)]
struct Cast {
    weight: TensorIx,
    bias: Option<TensorIx>,
    weight_live: bool,
    /// Elements of the weight (and bias) that backward reaches last in the piece (the first
    /// matmul of its forward): its 16-bit gradient is the piece's last transient one.
    last_elems: u64,
}

impl States {
    /// Allocate what exists before the step (phase `Setup`): params (and master weights), the
    /// optimizer state in a steady-state step, the gradients when they are kept.
    pub fn setup(b: &mut Builder, w: &Workload, pieces: &[Piece]) -> Result<States, PlanError> {
        let flat = w.zero > 0 && w.gpus > 1;
        let inference = w.inference();
        let optimizer = if inference {
            Optimizer::None
        } else {
            w.optimizer
        };
        let kinds = state_kinds(w.precision, optimizer);
        let pieces: Vec<Piece> = if flat {
            let total = pieces
                .iter()
                .try_fold(0u64, |a, p| a.checked_add(p.elems))
                .ok_or_else(|| PlanError::Overflow {
                    what: "the parameter count".into(),
                })?;
            vec![Piece::new("", total)]
        } else {
            pieces.to_vec()
        };
        let mut s = States {
            pieces: Vec::with_capacity(pieces.len()),
            names: pieces.iter().map(|p| p.name.clone()).collect(),
            defs: pieces.clone(),
            index: pieces
                .iter()
                .enumerate()
                .map(|(i, p)| (p.name.clone(), i))
                .collect(),
            kinds,
            flat,
            keep_grads: flat || w.grads == Grads::Keep,
            grads_until_backward: !flat && w.grads == Grads::UntilBackward,
            first_step: !flat && w.step == StepKind::First,
            in_backward: w.optimizer_in_backward && !flat && !inference,
            deferred: Vec::new(),
            defer: Defer::No,
            pending: Vec::new(),
            low: autocast(w).filter(|_| !flat).map(|a| a.low),
            casts: Default::default(),
            shard: w.shard_degree(),
            fsdp1: w.parallel.fsdp1 && w.parallel.fsdp.is_some(),
            unsharded: Vec::new(),
            grads_in_buckets: w.parallel.ddp_bucket_mb.is_some() && w.parallel.bucket_view,
            groups: pieces
                .iter()
                .map(|p| {
                    let plain = w.parallel.tp > 1
                        && w.parallel.tp_head == crate::workload::parallel::TpHead::Replicated
                        && !p.name.starts_with('L');
                    u8::from(plain)
                })
                .collect(),
            held_to_end: Vec::new(),
            rs_kept: None,
            gather_dtype: None,
        };
        b.phase(Phase::Setup);
        for (i, p) in pieces.iter().enumerate() {
            let mut ps = PieceStates {
                elems: p.elems,
                largest: p.largest,
                ..Default::default()
            };
            for kind in s.kinds.clone() {
                let present = match kind.role {
                    Role::Params => true,
                    _ if p.frozen => false,
                    // Kept gradients exist before a steady step; the first step has none
                    // before its first backward, whatever zero_grad does later.
                    Role::Gradients => (s.keep_grads || s.grads_until_backward) && !s.first_step,
                    _ => kind.name == "opt.master" || !s.first_step,
                };
                if present {
                    let t = s.alloc_kind(b, &kind, &p.name, i, w)?;
                    ps.set(&kind, t);
                }
            }
            s.pieces.push(ps);
        }
        if let Some(mb) = w.parallel.ddp_bucket_mb {
            s.ddp_buckets(b, w, mb)?;
        }
        Ok(s)
    }
    /// The backward begins (phase `Backward`): under `Grads::UntilBackward` the last step's
    /// gradients are freed here (Lightning's closure calls `zero_grad` between the forward and
    /// the backward), and the backward makes them anew as under `Grads::Free`.
    pub fn begin_backward(&mut self, b: &mut Builder) {
        b.phase(Phase::Backward);
        if self.grads_until_backward {
            for ps in &mut self.pieces {
                if let Some(g) = ps.grad.take() {
                    b.free(g);
                }
            }
        }
    }
    /// A state tensor of `kind` for piece `i` (named `piece`): its count of elements and its
    /// type (the piece's own float type for float kinds: fp32 adapters; a quantized base's
    /// params as bytes).
    fn alloc_kind(
        &self,
        b: &mut Builder,
        kind: &StateKind,
        piece: &str,
        i: usize,
        w: &Workload,
    ) -> Result<TensorIx, PlanError> {
        self.alloc_part(b, kind, piece, i, w, self.defs[i].elems)
    }
    /// `alloc_kind` for `part` of the piece's elements (its count scaled to match).
    fn alloc_part(
        &self,
        b: &mut Builder,
        kind: &StateKind,
        piece: &str,
        i: usize,
        w: &Workload,
        part: u64,
    ) -> Result<TensorIx, PlanError> {
        let elems = self.defs[i].elems;
        let psi = match (kind.count, self.defs[i].factored) {
            (Count::Each, _) | (Count::Factored, None) => part,
            (Count::Absmax256, _) => part.div_ceil(256).saturating_mul(2),
            (Count::Factored, Some(f)) if part >= elems => f,
            (Count::Factored, Some(f)) => {
                ((f as u128 * part as u128 / elems.max(1) as u128) as u64).max(1)
            }
        };
        self.alloc_elems(b, kind, piece, i, w, psi)
    }
    /// A state tensor of `kind` for piece `i` with `psi` elements before sharding.
    fn alloc_elems(
        &self,
        b: &mut Builder,
        kind: &StateKind,
        piece: &str,
        i: usize,
        w: &Workload,
        psi: u64,
    ) -> Result<TensorIx, PlanError> {
        let def = &self.defs[i];
        let elems = shard_elems(psi, kind, w.zero, w.gpus).div_ceil(self.shard.max(1));
        let name = if piece.is_empty() {
            kind.name.to_string()
        } else {
            format!("{}.{}", kind.name, piece)
        };
        let float = |d: DType| matches!(d, DType::F32 | DType::F16 | DType::Bf16);
        let dtype = match def.dtype {
            Some(d) if kind.role == Role::Params => d,
            Some(d) if float(d) && float(kind.dtype) => d,
            _ => kind.dtype,
        };
        let t = b.push(&name, kind.role, dtype, &[elems], elems.clamp(1, 4096))?;
        // FSDP1's flat parameter is one tensor; so is a state counted otherwise than element
        // by element (Adafactor's factors, 8-bit absmax), and a quantized base's packed bytes.
        if !self.fsdp1
            && kind.count == Count::Each
            && (float(dtype) || (kind.role == Role::Optimizer && def.dtype.is_none()))
        {
            self.per_parameter(b, t, i);
        }
        Ok(t)
    }
    /// Tensor `t`, of piece `i`'s elements, is one PyTorch tensor per parameter (FSDP2 shards
    /// each along its first dimension): the caching allocator is asked for a block the size of
    /// the piece's largest parameter at a time (`TensorSpec::part_bytes`). Flat states (ZeRO's
    /// partitions) stay one block.
    pub(super) fn per_parameter(&self, b: &mut Builder, t: TensorIx, i: usize) {
        let largest = self.defs[i].largest.div_ceil(self.shard.max(1));
        let spec = b.tensor(t);
        if !self.flat && largest > 0 && spec.elems() > largest {
            let part = largest.saturating_mul(spec.dtype.bytes());
            b.in_parts(t, part);
        }
    }
    /// Whether piece `i` is frozen (no gradient, no optimizer state).
    fn frozen(&self, i: usize) -> bool {
        !self.flat && self.defs.get(i).is_some_and(|d| d.frozen)
    }
    /// FSDP1: a frozen piece of a decoder layer shares its unit's flat parameter with the
    /// layer's adapters, so backward computes its gradient, which is reduce-scattered and kept
    /// sharded; only the optimizer leaves it alone (`validation/fsdp1_notes.md`, §5).
    fn frozen_in_flat(&self, i: usize) -> bool {
        self.fsdp1
            && self.names.get(i).is_some_and(|n| {
                n.strip_prefix('L')
                    .and_then(|r| r.split('.').next())
                    .is_some_and(|d| d.parse::<u64>().is_ok())
            })
    }
    /// Index of the piece called `name` (always 0 for flat ZeRO states); None when the model
    /// has no such parameters.
    pub fn piece(&self, name: &str) -> Option<usize> {
        if self.flat {
            return Some(0);
        }
        self.index.get(name).copied()
    }
    /// The params tensor a kernel of piece `name` reads (the largest piece if there is none).
    pub fn weights(&self, name: &str) -> TensorIx {
        let i = self.piece(name).unwrap_or_else(|| {
            (0..self.pieces.len())
                .max_by_key(|&i| self.pieces[i].elems)
                .unwrap_or(0)
        });
        self.pieces[i].params
    }
}

/// A bare parameter count: its states, the gradients a backward pass would leave, one
/// optimizer step.
pub fn build_dense(b: &mut Builder, w: &Workload, psi: u64) -> Result<(), PlanError> {
    let mut s = States::setup(b, w, &[Piece::new("", psi)])?;
    if !w.inference() {
        s.begin_backward(b);
        s.gradient(b, "", w)?;
        s.optimizer_step(b, w)?;
    }
    Ok(())
}

impl PieceStates {
    fn set(&mut self, kind: &StateKind, t: TensorIx) {
        match kind.role {
            Role::Params => self.params = t,
            Role::Gradients => self.grad = Some(t),
            _ if kind.name == "opt.master" => self.master = Some(t),
            _ => self.opt.push(t),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_per_param_table() {
        use Optimizer::*;
        use Precision::*;
        assert_eq!(bytes_per_param(Fp32, Adam), 16);
        assert_eq!(bytes_per_param(Mixed, Adam), 16);
        assert_eq!(bytes_per_param(Fp32, SgdMomentum), 12);
        assert_eq!(bytes_per_param(Fp32, Sgd), 8);
        assert_eq!(bytes_per_param(Fp16, Adam), 8);
        assert_eq!(bytes_per_param(Fp16, None), 2);
        assert_eq!(bytes_per_param(Fp32, None), 4);
        assert_eq!(bytes_per_param(Mixed, SgdMomentum), 12);
        assert_eq!(bytes_per_param(AmpFp16, Adam), 16);
        assert_eq!(bytes_per_param(AmpBf16, Adam), 16);
        assert_eq!(bytes_per_param(AmpBf16, None), 4);
        assert_eq!(bytes_per_param(Bf16, Adam), 8);
    }
}
