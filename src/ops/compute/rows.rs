//! Row kernels: softmax, attention probabilities (scaled, optionally causal) and layer norm.

use bytemuck::bytes_of;

use crate::backend::{Backend, BackendError};
use crate::kernels::params::{LayerNormParams, SoftmaxParams};
use crate::kernels::{KernelId, Op};
use crate::tensor::DeviceTensor;

use super::chunks::*;

/// Layer norm epsilon.
pub const LAYER_NORM_EPS: f32 = 1e-5;

/// A row kernel (softmax, attention probs, layer norm) over `rows` rows of `cols`.
fn row_kernel(
    backend: &mut dyn Backend,
    op: Op,
    x: &DeviceTensor,
    y: &DeviceTensor,
    rows: u64,
    cols: u64,
    mut params: impl FnMut(&Run, u32, u32, u32) -> Vec<u8>,
) -> Result<(), BackendError> {
    let storage = common_storage(op.name(), &[x, y])?;
    let kernel = KernelId::new(op, storage);
    if rows == 0 || cols == 0 {
        return Ok(());
    }
    let cols32 = u32_of(cols, "row length")?;
    let runs = split(
        &[opnd(x, 0, cols, cols), opnd(y, 0, cols, cols)],
        rows,
        MAX_ROWS.min(units_within(cols)),
    )?;
    for r in runs {
        let bytes = params(&r, r.units as u32, cols32, 0);
        let grid = grid_1d(r.units)?;
        backend.dispatch(kernel, &bytes, &[r.at[0].0, r.at[1].0], grid)?;
    }
    Ok(())
}

/// Row softmax of `x[rows][cols]` into `y` (may be the same tensor).
pub fn softmax(
    backend: &mut dyn Backend,
    x: &DeviceTensor,
    y: &DeviceTensor,
    rows: u64,
    cols: u64,
) -> Result<(), BackendError> {
    softmax_rows(backend, Op::Softmax, x, y, rows, cols, 1.0, false)
}

/// Attention probabilities: row softmax of `scale * scores[rows][cols]` into `probs`; with
/// `causal`, row r is query `r % cols` and keys past it get probability 0.
pub fn attention_probs(
    backend: &mut dyn Backend,
    scores: &DeviceTensor,
    probs: &DeviceTensor,
    rows: u64,
    cols: u64,
    scale: f32,
    causal: bool,
) -> Result<(), BackendError> {
    softmax_rows(
        backend,
        Op::Attention,
        scores,
        probs,
        rows,
        cols,
        scale,
        causal,
    )
}

/// The softmax kernels' shared launch: `Op::Softmax` (never masked) or `Op::Attention`.
#[allow(clippy::too_many_arguments)]
fn softmax_rows(
    backend: &mut dyn Backend,
    op: Op,
    x: &DeviceTensor,
    y: &DeviceTensor,
    rows: u64,
    cols: u64,
    scale: f32,
    causal: bool,
) -> Result<(), BackendError> {
    let period = if causal { u32_of(cols, "seq")? } else { 0 };
    row_kernel(backend, op, x, y, rows, cols, |r, n, c, _| {
        bytes_of(&SoftmaxParams {
            rows: n,
            cols: c,
            x_off: r.at[0].1,
            y_off: r.at[1].1,
            scale,
            q_row0: if causal { (r.u0 % cols) as u32 } else { 0 },
            q_period: period,
            _pad: 0,
        })
        .to_vec()
    })
}

/// Layer norm over rows of `x[rows][cols]` into `y` (unit gain, zero bias, eps 1e-5).
pub fn layer_norm(
    backend: &mut dyn Backend,
    x: &DeviceTensor,
    y: &DeviceTensor,
    rows: u64,
    cols: u64,
) -> Result<(), BackendError> {
    row_kernel(backend, Op::LayerNorm, x, y, rows, cols, |r, n, c, _| {
        bytes_of(&LayerNormParams {
            rows: n,
            cols: c,
            x_off: r.at[0].1,
            y_off: r.at[1].1,
            eps: LAYER_NORM_EPS,
            _pad: [0; 3],
        })
        .to_vec()
    })
}
