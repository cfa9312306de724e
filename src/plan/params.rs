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

use super::autocast::Autocast;
use super::builder::{Builder, PlanError};
use super::{DType, Phase, Role, Step, TensorIx};
use crate::workload::{Grads, Optimizer, OptimizerImpl, Precision, StepKind, Workload};

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
        Optimizer::Adafactor => v.push(StateKind {
            count: Count::Factored,
            ..kind("opt.adafactor_v", Role::Optimizer, DType::F32, 1)
        }),
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
            pending: Vec::new(),
            low: autocast(w).filter(|_| !flat).map(|a| a.low),
            casts: Default::default(),
            shard: w.shard_degree(),
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

    /// DDP's reducer buckets, made when the model is wrapped: one flat buffer per bucket of
    /// about `mb` MiB, together as large as every trainable gradient (measured on CPU over
    /// gloo: 27 469 904 B of buckets beside 27 468 800 B of fp32 parameters). With
    /// `gradient_as_bucket_view` the gradients are views into them.
    fn ddp_buckets(&mut self, b: &mut Builder, w: &Workload, mb: u64) -> Result<(), PlanError> {
        let Some(kind) = self.grad_kind() else {
            return Ok(());
        };
        let trainable = (0..self.defs.len()).filter(|&i| !self.frozen(i)).count() as u64;
        let elems: u64 = (0..self.defs.len())
            .filter(|&i| !self.frozen(i))
            .map(|i| self.defs[i].elems)
            .fold(0u64, |a, e| a.saturating_add(e));
        let bucket = mb.saturating_mul(1 << 20) / kind.dtype.bytes().max(1);
        // A bucket holds whole parameters (one larger than the cap gets its own): never more
        // buckets than trainable tensors, whatever the cap.
        let n = elems.div_ceil(bucket.max(1)).min(trainable.max(1)).max(1);
        let mut left = elems;
        for k in 0..n {
            let e = if k + 1 == n { left } else { left.min(bucket) }.max(1);
            left = left.saturating_sub(e);
            b.push(
                &format!("ddp.bucket{k}"),
                Role::Gradients,
                kind.dtype,
                &[e],
                e.clamp(1, 4096),
            )?;
        }
        let _ = w;
        Ok(())
    }

    /// FSDP2's backward is finalized: the last reduce-scatter input goes.
    pub fn fsdp_finalize(&mut self, b: &mut Builder) {
        if let Some(t) = self.rs_kept.take() {
            b.free(t);
        }
    }

    /// A copy of piece `name`'s gradient held from now to the step's end: under tensor
    /// parallelism a vocabulary-split embedding's local gradient is there twice through the
    /// optimizer step (measured over gloo on two models, `tests/fixtures/distributed*.json`;
    /// which reference keeps the second one is not traced).
    pub fn hold_until_end(
        &mut self,
        b: &mut Builder,
        name: &str,
        w: &Workload,
    ) -> Result<(), PlanError> {
        let (Some(kind), Some(i)) = (self.grad_kind(), self.piece(name)) else {
            return Ok(());
        };
        if self.frozen(i) {
            return Ok(());
        }
        let held = StateKind {
            role: Role::Workspace,
            ..kind
        };
        let t = self.alloc_kind(b, &held, &format!("{name}.grad_copy"), i, w)?;
        self.held_to_end.push(t);
        Ok(())
    }

    /// FSDP's reduce-scatter after a unit's backward (`pieces` named): the unit's unsharded
    /// gradients are copied into one flat input and freed, the scattered output (1/shard of
    /// it) holds the sharded gradients (added into kept ones), the input goes.
    pub fn fsdp_reduce(&mut self, b: &mut Builder, pieces: &[String]) -> Result<(), PlanError> {
        if self.shard <= 1 && self.unsharded.is_empty() {
            return Ok(());
        }
        let Some(kind) = self.grad_kind() else {
            return Ok(());
        };
        let ids: Vec<usize> = pieces.iter().filter_map(|n| self.piece(n)).collect();
        let (mine, rest): (Vec<_>, Vec<_>) =
            self.unsharded.drain(..).partition(|(i, _)| ids.contains(i));
        self.unsharded = rest;
        if mine.is_empty() {
            return Ok(());
        }
        let full: u64 = mine
            .iter()
            .map(|&(i, _)| self.defs[i].elems)
            .fold(0u64, |a, e| a.saturating_add(e));
        let unit = &self.names[mine[0].0];
        let input = b.push(
            &format!("fsdp.rs_input.{unit}"),
            Role::Workspace,
            kind.dtype,
            &[full.max(1)],
            full.clamp(1, 4096),
        )?;
        for &(_, g) in &mine {
            b.free(g);
        }
        let out_elems = full.div_ceil(self.shard);
        let out = b.push(
            &format!("grads.{unit}.shard"),
            kind.role,
            kind.dtype,
            &[out_elems.max(1)],
            out_elems.clamp(1, 4096),
        )?;
        // FSDP2 keeps a unit's reduce-scatter input until the next unit's reduce-scatter has
        // been waited on; the last one until the backward is finalized (`finalize_backward`).
        if let Some(prev) = self.rs_kept.replace(input) {
            b.free(prev);
        }
        // The scattered output is the sharded `.grad`s of the whole unit (views into it); a
        // kept gradient takes it in place.
        let first = mine[0].0;
        let existing = mine.iter().any(|&(i, _)| self.pieces[i].grad.is_some());
        if existing {
            b.free(out);
        } else {
            self.pieces[first].grad = Some(out);
            for &(i, _) in &mine[1..] {
                self.pieces[i].grad_in_unit = true;
            }
        }
        Ok(())
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
        let def = &self.defs[i];
        let psi = match kind.count {
            Count::Each => def.elems,
            Count::Absmax256 => def.elems.div_ceil(256).saturating_mul(2),
            Count::Factored => def.factored.unwrap_or(def.elems),
        };
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
        b.push(&name, kind.role, dtype, &[elems], elems.clamp(1, 4096))
    }

    /// Whether piece `i` is frozen (no gradient, no optimizer state).
    fn frozen(&self, i: usize) -> bool {
        !self.flat && self.defs.get(i).is_some_and(|d| d.frozen)
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

    /// A tied parameter's gradient from one of its uses before the last (the output head of a
    /// tied embedding): autograd holds it in the parameter's input buffer until the last use's
    /// gradient arrives (`gradient`).
    pub fn gradient_part(
        &mut self,
        b: &mut Builder,
        name: &str,
        w: &Workload,
    ) -> Result<(), PlanError> {
        let Some(kind) = self.grad_kind() else {
            return Ok(());
        };
        let Some(i) = self.piece(name) else {
            return Ok(());
        };
        if self.flat || self.frozen(i) {
            return Ok(());
        }
        let part = format!("{}.part", self.names[i]);
        // Not yet a `.grad`: an autograd buffer (workspace) until the sum is made.
        // (Under autocast it becomes `.grad` itself: see `gradient`.)
        let buffer = if self.low.is_some() {
            kind
        } else {
            StateKind {
                role: Role::Workspace,
                ..kind
            }
        };
        let g16 = self.cast_grad(b, i)?;
        let t = self.alloc_kind(b, &buffer, &part, i, w)?;
        self.release_cast(b, g16);
        self.pending.push((i, t));
        Ok(())
    }

    /// Autocast's cached 16-bit copy of piece `name`'s matmul (or conv) weights, `weight_elems`
    /// of them plus `bias_elems` of biases: made at the piece's first use in forward
    /// (`cached_cast` in PyTorch's `autocast_mode.cpp`: fp32 leaves that require grad are cast
    /// once per autocast region). `last_elems`: the parameters of the piece's first matmul
    /// (backward reaches it last). Returns the weight copy (what the kernels read), or None
    /// without autocast (and under flat ZeRO states, where it is not modelled).
    pub fn cast(
        &mut self,
        b: &mut Builder,
        name: &str,
        (weight_elems, bias_elems, last_elems): (u64, u64, u64),
    ) -> Result<Option<TensorIx>, PlanError> {
        let (Some(low), Some(i)) = (self.low, self.piece(name)) else {
            return Ok(None);
        };
        // A piece used again after its copy was dropped (a checkpointed segment recomputed in
        // backward, under autocast again) is cast anew; its biases' copies go at once then.
        let recast = match self.casts.get(&i) {
            Some(c) if c.weight_live => return Ok(Some(c.weight)),
            Some(_) => true,
            None => false,
        };
        let bias_elems = if recast { 0 } else { bias_elems };
        let rows = |e: u64| e.clamp(1, 4096);
        let weight = b.push(
            &format!("cast.{name}"),
            Role::Workspace,
            low,
            &[weight_elems.max(1)],
            rows(weight_elems),
        )?;
        let bias = if bias_elems > 0 {
            Some(b.push(
                &format!("cast.{name}.bias"),
                Role::Workspace,
                low,
                &[bias_elems],
                rows(bias_elems),
            )?)
        } else {
            None
        };
        self.casts.insert(
            i,
            Cast {
                weight,
                bias,
                weight_live: true,
                last_elems,
            },
        );
        Ok(Some(weight))
    }

    /// Piece `name`'s live 16-bit weight copy, if autocast made one.
    pub fn cast_weight(&self, name: &str) -> Option<TensorIx> {
        let c = self.casts.get(&self.piece(name)?)?;
        c.weight_live.then_some(c.weight)
    }

    /// The autocast region exits (`clear_cache`): cast biases are freed (no backward saves
    /// them); weight copies stay while backward still needs them, except those of the pieces
    /// `unsaved` names (an inference forward, or layers run under no_grad for checkpointing:
    /// no graph saved their copies).
    pub fn autocast_exit(&mut self, b: &mut Builder, unsaved: impl Fn(&str) -> bool) {
        let mut keys: Vec<usize> = self.casts.keys().copied().collect();
        keys.sort_unstable();
        for i in keys {
            let free_weight = unsaved(&self.names[i]);
            let c = self.casts.get_mut(&i).expect("key");
            if let Some(t) = c.bias.take() {
                b.free(t);
            }
            if free_weight && c.weight_live {
                c.weight_live = false;
                b.free(c.weight);
            }
        }
    }

    /// Under autocast, backward through piece `i`'s matmuls. Each matmul's node makes the
    /// 16-bit gradient of its weight copy and then releases its saved variables (the copy);
    /// `ToCopyBackward0` then makes the fp32 gradient from it. Modelled per piece: the copy is
    /// freed, the 16-bit gradient of the piece's last-reached matmul is allocated (returned)
    /// and freed once the fp32 gradient exists (`release_cast`).
    fn cast_grad(&mut self, b: &mut Builder, i: usize) -> Result<Option<TensorIx>, PlanError> {
        let (Some(low), Some(c)) = (self.low, self.casts.get_mut(&i)) else {
            return Ok(None);
        };
        if !c.weight_live {
            return Ok(None);
        }
        let elems = c.last_elems.max(1);
        let name = format!("grad16.{}", self.names[i]);
        let g = b.push(&name, Role::Workspace, low, &[elems], elems.clamp(1, 4096))?;
        c.weight_live = false;
        b.free(c.weight);
        Ok(Some(g))
    }

    fn release_cast(&mut self, b: &mut Builder, g16: Option<TensorIx>) {
        if let Some(g) = g16 {
            b.free(g);
        }
    }

    fn grad_kind(&self) -> Option<StateKind> {
        self.kinds
            .iter()
            .find(|k| k.role == Role::Gradients)
            .cloned()
    }

    /// Backward reaches piece `name` (its last use): its gradient is computed. With PyTorch's
    /// default the new gradient becomes `.grad` (allocated now, kept until `zero_grad`); when a
    /// gradient already exists (kept gradients) the new one is a temporary added into it in
    /// place. Pending parts of a tied parameter are first summed with it into a new tensor
    /// (measured: three [V, h] live at once at GPT-2's embedding backward).
    pub fn gradient(&mut self, b: &mut Builder, name: &str, w: &Workload) -> Result<(), PlanError> {
        let Some(kind) = self.grad_kind() else {
            return Ok(());
        };
        let Some(i) = self.piece(name) else {
            return Ok(());
        };
        if self.frozen(i) {
            return Ok(());
        }
        let piece = Piece::new(self.names[i].clone(), self.pieces[i].elems);
        if self.flat {
            // DeepSpeed reduces into its flat buffer bucket by bucket: no per-piece temporary.
            return Ok(());
        }
        let g16 = self.cast_grad(b, i)?;
        self.gradient_fp(b, i, &kind, piece, w)?;
        self.release_cast(b, g16);
        Ok(())
    }

    /// `gradient`, with `then` run once the op that makes it has released its inputs: under
    /// autocast between its 16-bit gradient and `ToCopyBackward0`'s fp32 one (the op's node
    /// frees its saved tensors and its incoming gradient first), otherwise after it.
    pub fn gradient_then(
        &mut self,
        b: &mut Builder,
        name: &str,
        w: &Workload,
        then: impl FnOnce(&mut Builder),
    ) -> Result<(), PlanError> {
        let (Some(kind), Some(i)) = (self.grad_kind(), self.piece(name)) else {
            then(b);
            return Ok(());
        };
        if self.flat || self.frozen(i) {
            then(b);
            return Ok(());
        }
        let piece = Piece::new(self.names[i].clone(), self.pieces[i].elems);
        let g16 = self.cast_grad(b, i)?;
        if g16.is_some() {
            then(b);
            self.gradient_fp(b, i, &kind, piece, w)?;
        } else {
            self.gradient_fp(b, i, &kind, piece, w)?;
            then(b);
        }
        self.release_cast(b, g16);
        Ok(())
    }

    /// The gradient of piece `i` in the gradients' own type (see `gradient`).
    fn gradient_fp(
        &mut self,
        b: &mut Builder,
        i: usize,
        kind: &StateKind,
        piece: Piece,
        w: &Workload,
    ) -> Result<(), PlanError> {
        let parts: Vec<TensorIx> = self
            .pending
            .iter()
            .filter(|(p, _)| *p == i)
            .map(|&(_, t)| t)
            .collect();
        if !parts.is_empty() {
            // The new contribution arrives in a workspace buffer beside the earlier parts.
            self.pending.retain(|(p, _)| *p != i);
            let buffer = StateKind {
                role: Role::Workspace,
                ..kind.clone()
            };
            let new = self.alloc_kind(b, &buffer, &format!("{}.new", piece.name), i, w)?;
            if self.low.is_some() {
                // Under autocast the earlier part is `ToCopyBackward0`'s fresh fp32 output:
                // autograd's input buffer adds the new contribution into it in place
                // (measured: two [V, h] at GPT-2's embedding backward, not three). It becomes
                // `.grad`, or is added into the kept one.
                b.free(new);
                for (j, part) in parts.into_iter().enumerate() {
                    if j == 0 && self.pieces[i].grad.is_none() {
                        self.pieces[i].grad = Some(part);
                    } else {
                        b.free(part);
                    }
                }
                return Ok(());
            }
            let sum = self.alloc_kind(b, kind, &format!("{}.sum", piece.name), i, w)?;
            b.free_all(parts);
            b.free(new);
            if self.pieces[i].grad.is_none() {
                self.pieces[i].grad = Some(sum);
            } else {
                b.free(sum);
            }
            return Ok(());
        }
        if self.grads_in_buckets {
            // DDP's bucket views: the gradient is written into its bucket.
            return Ok(());
        }
        if self.shard > 1 {
            // FSDP: backward makes the unsharded gradient; the unit's reduce-scatter shards it.
            // In the gathered parameters' type (16-bit under FSDP2's mixed precision).
            let full = StateKind {
                role: Role::Workspace,
                dtype: self.gather_dtype.or(self.low).unwrap_or(kind.dtype),
                ..kind.clone()
            };
            let shard = std::mem::replace(&mut self.shard, 1);
            let t = self.alloc_kind(b, &full, &format!("{}.unsharded", piece.name), i, w);
            self.shard = shard;
            self.unsharded.push((i, t?));
            return Ok(());
        }
        if self.pieces[i].grad.is_none() {
            let t = self.alloc_kind(b, kind, &piece.name, i, w)?;
            self.pieces[i].grad = Some(t);
        } else {
            let t = self.alloc_kind(b, kind, &format!("{}.new", piece.name), i, w)?;
            b.free(t);
        }
        Ok(())
    }

    /// The optimizer step (phase `Optimizer`): the first step creates the optimizer state; the
    /// update runs per piece with its implementation's temporaries; `zero_grad` then frees the
    /// gradients unless they are kept.
    pub fn optimizer_step(&mut self, b: &mut Builder, w: &Workload) -> Result<(), PlanError> {
        b.phase(Phase::Optimizer);
        let opt_kinds: Vec<StateKind> = self
            .kinds
            .iter()
            .filter(|k| k.role == Role::Optimizer && k.name != "opt.master")
            .cloned()
            .collect();
        let Some(grad_kind) = self.grad_kind() else {
            return Ok(());
        };
        // Pieces whose gradient never appeared (unused parameters) get none now either.
        let n = self.pieces.len();
        for i in 0..n {
            if self.frozen(i) {
                continue;
            }
            let name = self.names[i].clone();
            let ps = &self.pieces[i];
            if ps.grad.is_none() && !ps.grad_in_unit && !self.keep_grads && !self.grads_in_buckets {
                let t = self.alloc_kind(b, &grad_kind, &name, i, w)?;
                self.pieces[i].grad = Some(t);
            }
            if self.first_step {
                for kind in &opt_kinds {
                    let t = self.alloc_kind(b, kind, &name, i, w)?;
                    self.pieces[i].set(kind, t);
                }
            }
        }
        let adam = w.optimizer == Optimizer::Adam;
        let tmp_dtype = opt_kinds.first().map(|k| k.dtype).unwrap_or(DType::F32);
        // Temporaries in the piece's state type (fp32 for adapters over a 16-bit base).
        let tmp_types: Vec<DType> = self
            .defs
            .iter()
            .map(|d| match d.dtype {
                Some(t @ (DType::F32 | DType::F16 | DType::Bf16)) => t,
                _ => tmp_dtype,
            })
            .collect();
        let tmp_of = |b: &mut Builder, i: usize, what: &str, names: &[String], elems: u64| {
            let name = format!("opt.{what}.{}", names[i]);
            b.push(
                &name,
                Role::Workspace,
                tmp_types.get(i).copied().unwrap_or(tmp_dtype),
                &[elems],
                elems.clamp(1, 4096),
            )
        };
        let imp = w.optimizer_impl();
        // lion-pytorch's update (`exp_avg.clone().mul_(b1).add(grad)`) and transformers'
        // Adafactor (`grad**2 + eps`, the approximated second moment times the gradient) hold
        // two temporaries of one parameter tensor at a time, like the for-loop Adam.
        let two_temps = (adam && imp == OptimizerImpl::ForLoop)
            || matches!(w.optimizer, Optimizer::Lion | Optimizer::Adafactor);
        let mut groups: Vec<u8> = self.groups.clone();
        groups.sort_unstable();
        groups.dedup();
        for group in groups {
            let mut foreach_tmps = Vec::new();
            if adam && imp == OptimizerImpl::Foreach {
                // _multi_tensor_adam: exp_avg_sq_sqrt = _foreach_sqrt(exp_avg_sqs), all of the
                // parameter group's at once.
                for i in 0..n {
                    if self.frozen(i) || self.groups.get(i).copied().unwrap_or(0) != group {
                        continue;
                    }
                    let elems = self.pieces[i].elems.div_ceil(self.shard);
                    let t = tmp_of(b, i, "foreach_sqrt", &self.names, elems)?;
                    foreach_tmps.push(t);
                }
            }
            for i in 0..n {
                if self.frozen(i) || self.groups.get(i).copied().unwrap_or(0) != group {
                    continue;
                }
                let mut denom = None;
                if two_temps {
                    // _single_tensor_adam, one parameter tensor at a time: denom =
                    // (exp_avg_sq.sqrt() / bc2).add_(eps): the sqrt and the quotient are alive
                    // together for a moment; the largest tensor of the group sets the peak.
                    let elems = self.pieces[i].largest.max(1).min(self.pieces[i].elems);
                    let elems = elems.div_ceil(self.shard);
                    let sqrt = tmp_of(b, i, "sqrt", &self.names, elems)?;
                    denom = Some(tmp_of(b, i, "denom", &self.names, elems)?);
                    b.free(sqrt);
                }
                let ps = &self.pieces[i];
                if let (Some(g), [m, v]) = (ps.grad, ps.opt.as_slice()) {
                    let p = ps.master.unwrap_or(ps.params);
                    let elems = [p, g, *m, *v]
                        .iter()
                        .map(|&t| b.tensor(t).elems())
                        .min()
                        .unwrap_or(0);
                    b.step(Step::Adam {
                        p,
                        g,
                        m: *m,
                        v: *v,
                        elems,
                    });
                }
                b.free_all(denom);
            }
            b.free_all(foreach_tmps);
        }
        if !self.keep_grads {
            for ps in &mut self.pieces {
                if let Some(g) = ps.grad.take() {
                    b.free(g);
                }
            }
        }
        let held = std::mem::take(&mut self.held_to_end);
        b.free_all(held);
        Ok(())
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
