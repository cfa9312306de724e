//! Kernels over elements one by one: the activations (ReLU, GeLU) and the Adam step.

use bytemuck::bytes_of;

use crate::backend::{Backend, BackendError, BufferId};
use crate::kernels::params::{fmt_code, AdamParams, ElemParams};
use crate::kernels::reference::AdamConfig;
use crate::kernels::{KernelId, Op};
use crate::tensor::DeviceTensor;

use super::chunks::*;

fn elementwise(
    backend: &mut dyn Backend,
    op: Op,
    x: &DeviceTensor,
    y: &DeviceTensor,
    elems: u64,
) -> Result<(), BackendError> {
    let storage = common_storage(op.name(), &[x, y])?;
    let kernel = KernelId::new(op, storage);
    let wg = kernel.workgroup_size()[0] as u64;
    let max = MAX_FLAT_UNITS.min(dispatch_work());
    for r in split(&[opnd(x, 0, 1, 1), opnd(y, 0, 1, 1)], elems, max)? {
        let p = ElemParams {
            len: r.units as u32,
            x_off: r.at[0].1,
            y_off: r.at[1].1,
            _pad: 0,
        };
        let grid = grid_1d(r.units.div_ceil(wg))?;
        backend.dispatch(kernel, bytes_of(&p), &[r.at[0].0, r.at[1].0], grid)?;
    }
    Ok(())
}

/// `y = max(x, 0)` over the first `elems` elements.
pub fn relu(
    backend: &mut dyn Backend,
    x: &DeviceTensor,
    y: &DeviceTensor,
    elems: u64,
) -> Result<(), BackendError> {
    elementwise(backend, Op::Relu, x, y, elems)
}

/// GeLU (tanh form) over the first `elems` elements.
pub fn gelu(
    backend: &mut dyn Backend,
    x: &DeviceTensor,
    y: &DeviceTensor,
    elems: u64,
) -> Result<(), BackendError> {
    elementwise(backend, Op::Gelu, x, y, elems)
}

/// One Adam step over `elems` elements: p, m, v updated in place from g. Each tensor may have
/// its own float type (e.g. 16-bit grads with f32 master weights and moments).
pub fn adam(
    backend: &mut dyn Backend,
    p: &DeviceTensor,
    g: &DeviceTensor,
    m: &DeviceTensor,
    v: &DeviceTensor,
    elems: u64,
    cfg: &AdamConfig,
) -> Result<(), BackendError> {
    let fmts = [
        fmt_code(storage_of(p)?),
        fmt_code(storage_of(g)?),
        fmt_code(storage_of(m)?),
        fmt_code(storage_of(v)?),
    ];
    let kernel = KernelId::new(Op::Adam, storage_of(p)?);
    let wg = kernel.workgroup_size()[0] as u64;
    let (bc1, bc2) = cfg.bias_corrections();
    let ops = [
        opnd(p, 0, 1, 1),
        opnd(g, 0, 1, 1),
        opnd(m, 0, 1, 1),
        opnd(v, 0, 1, 1),
    ];
    for r in split(&ops, elems, MAX_FLAT_UNITS.min(dispatch_work()))? {
        let params = AdamParams {
            len: r.units as u32,
            p_off: r.at[0].1,
            g_off: r.at[1].1,
            m_off: r.at[2].1,
            v_off: r.at[3].1,
            p_fmt: fmts[0],
            g_fmt: fmts[1],
            m_fmt: fmts[2],
            v_fmt: fmts[3],
            lr: cfg.lr as f32,
            beta1: cfg.beta1 as f32,
            beta2: cfg.beta2 as f32,
            eps: cfg.eps as f32,
            bc1: bc1 as f32,
            bc2: bc2 as f32,
            _pad: 0,
        };
        let bufs: Vec<BufferId> = r.at.iter().map(|x| x.0).collect();
        backend.dispatch(
            kernel,
            bytes_of(&params),
            &bufs,
            grid_1d(r.units.div_ceil(wg))?,
        )?;
    }
    Ok(())
}
