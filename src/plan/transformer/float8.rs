//! torchao's float8 training in a plan: each converted linear's float8 casts around its matmul,
//! and FSDP2's float8 all-gather of a layer's weights. What float8 saves for backward is what
//! bf16 saves (measured: `validation/measure_float8.py`), so nothing else changes.

use super::{count, T};
use crate::plan::build::PlanError;
use crate::plan::{DType, Role, TensorIx};
use crate::workload::{Float8, Workload};

impl T<'_> {
    /// torchao's `Float8Linear` forward: the input and (unless FSDP2 gathered it in float8) the
    /// weight cast to float8 for `_scaled_mm`, one byte per element, gone after it. What its
    /// backward saves is the bf16 input and weight, as without float8 (torchao 0.18,
    /// `matmul_with_hp_or_float8_args`: measured on the CPU, the same saved tensors and bytes as
    /// bf16), so nothing else changes. The casts are as `torch.compile` fuses them (torchtitan
    /// compiles float8 runs); eager casts go through fp32 temporaries the size of the input.
    pub(super) fn float8_casts(
        &mut self,
        piece: &str,
        x: TensorIx,
        out: u64,
        inp: u64,
    ) -> Result<Vec<TensorIx>, PlanError> {
        if self.w.float8.is_off() || !piece.starts_with('L') {
            return Ok(Vec::new());
        }
        let rows = self.b.tensor(x).elems() / inp.max(1);
        let mut casts = vec![self.b.push(
            &format!("{piece}.x_fp8"),
            Role::Workspace,
            DType::U8,
            &[rows, inp],
            inp,
        )?];
        if self.w.float8 != Float8::TensorwiseAllGather || self.w.parallel.fsdp.is_none() {
            casts.push(self.b.push(
                &format!("{piece}.w_fp8"),
                Role::Workspace,
                DType::U8,
                &[out, inp],
                inp,
            )?);
        }
        Ok(casts)
    }
}

/// The bytes of one layer of `elems` parameters gathered by torchao's float8 all-gather
/// (`WeightWithDynamicFloat8CastTensor`'s `fsdp_pre_all_gather`): the linears' weights one byte
/// each, the norms in the 16-bit type.
pub(super) fn gathered_layer_bytes(w: &Workload, elems: u64) -> Result<u64, PlanError> {
    let lin: u64 = count::linears(w)?
        .iter()
        .map(|l| l.out.saturating_mul(l.inp))
        .fold(0, u64::saturating_add);
    Ok(lin.saturating_add(elems.saturating_sub(lin).saturating_mul(2)))
}
