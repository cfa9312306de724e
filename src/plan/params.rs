//! Model states: params, gradients and optimizer state per precision, optimizer and ZeRO stage.
//!
//! Bytes per parameter (Ψ parameters; ZeRO paper §3.1):
//! - fp32: weights 4, gradients 4; Adam m, v 4 + 4; SGD-momentum 4; SGD 0 → 16 / 12 / 8.
//! - fp16 / bf16 (pure 16-bit training): every state in the 16-bit type → 8 / 6 / 4 with Adam /
//!   momentum / SGD.
//! - mixed: fp16 weights 2 + fp16 gradients 2 + fp32 master weights 4 (+ Adam m, v 8 or
//!   momentum 4) → 16 / 12 / 8; K (optimizer bytes incl. the master copy) = 12 with Adam.
//! - optimizer `none` (inference): weights only, in the compute type (fp32 4, otherwise 2).
//!
//! ZeRO over N data-parallel devices (the ZeRO paper's formulas, generalized to any precision
//! with P = weight, G = gradient, K = optimizer bytes per parameter): stage 1 shards the optimizer
//! state (PΨ + GΨ + KΨ/N), stage 2 also the gradients (PΨ + (G+K)Ψ/N), stage 3 also the weights
//! ((P+G+K)Ψ/N). A shard holds ⌈Ψ/N⌉ elements.

use super::build::{Builder, PlanError};
use super::{DType, Role, Step, TensorIx};
use crate::workload::{Optimizer, Precision, Workload};

/// The compute (activation) type of a precision: mixed computes in fp16.
pub fn compute_dtype(p: Precision) -> DType {
    match p {
        Precision::Fp32 => DType::F32,
        Precision::Fp16 | Precision::Mixed => DType::F16,
        Precision::Bf16 => DType::Bf16,
    }
}

/// One model-state tensor kind: its name, role, element type and ZeRO stage from which it is
/// sharded.
#[derive(Debug, Clone, PartialEq)]
pub struct StateKind {
    pub name: &'static str,
    pub role: Role,
    pub dtype: DType,
    pub sharded_from_stage: u8,
}

/// The model-state tensors of a precision and optimizer, in allocation order.
pub fn state_kinds(precision: Precision, optimizer: Optimizer) -> Vec<StateKind> {
    let c = compute_dtype(precision);
    let kind = |name, role, dtype, stage| StateKind {
        name,
        role,
        dtype,
        sharded_from_stage: stage,
    };
    let mut v = vec![kind("params", Role::Params, c, 3)];
    if optimizer == Optimizer::None {
        return v;
    }
    v.push(kind("grads", Role::Gradients, c, 2));
    // Optimizer-state element type: fp32 for fp32 and mixed, the 16-bit type for pure 16-bit.
    let o = match precision {
        Precision::Fp32 | Precision::Mixed => DType::F32,
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
        Optimizer::SgdMomentum => v.push(kind("opt.momentum", Role::Optimizer, o, 1)),
        Optimizer::Sgd | Optimizer::None => {}
    }
    v
}

/// Model-state bytes per parameter without sharding (16 for fp32 Adam and mixed Adam).
pub fn bytes_per_param(precision: Precision, optimizer: Optimizer) -> u64 {
    state_kinds(precision, optimizer)
        .iter()
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

/// Indices of the pushed model-state tensors.
#[derive(Debug, Clone, Default)]
pub struct StateIx {
    pub params: TensorIx,
    pub grads: Option<TensorIx>,
    pub master: Option<TensorIx>,
    pub adam: Option<(TensorIx, TensorIx)>,
}

/// Push the model states of Ψ parameters and, with Adam, the optimizer step over them (mixed
/// precision: over the fp32 master weights with the fp16 gradients; the Adam kernel takes a
/// storage type per tensor). Under ZeRO the step covers the local shard (the smallest tensor).
pub fn push_states(
    b: &mut Builder,
    w: &Workload,
    psi: u64,
    row_elems: u64,
) -> Result<StateIx, PlanError> {
    let mut ix = StateIx::default();
    for kind in state_kinds(w.precision, w.optimizer) {
        let elems = shard_elems(psi, &kind, w.zero, w.gpus);
        let row = row_elems.clamp(1, elems.max(1));
        let t = b.push(kind.name, kind.role, kind.dtype, &[elems], row)?;
        match kind.name {
            "params" => ix.params = t,
            "grads" => ix.grads = Some(t),
            "opt.master" => ix.master = Some(t),
            "opt.adam_m" => ix.adam = Some((t, 0)),
            "opt.adam_v" => {
                if let Some((m, _)) = ix.adam {
                    ix.adam = Some((m, t));
                }
            }
            _ => {}
        }
    }
    if let (Some(g), Some((m, v))) = (ix.grads, ix.adam) {
        let p = ix.master.unwrap_or(ix.params);
        let elems = [p, g, m, v]
            .iter()
            .map(|&t| b.tensor(t).elems())
            .min()
            .unwrap_or(0);
        b.step(Step::Adam { p, g, m, v, elems });
    }
    Ok(ix)
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
    }
}
