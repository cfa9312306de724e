//! `run_step`: the kernels of one plan step, launched over the plan's allocated tensors.

use crate::backend::{Backend, BackendError};
use crate::kernels::reference::AdamConfig;
use crate::plan::Step;
use crate::tensor::DeviceTensor;

use super::chunks::*;
use super::{
    adam, attention_naive, conv2d, flash_attention, gelu, layer_norm, matmul, relu, softmax,
    AttentionDims, ConvDims, MatmulDims,
};

/// Run one plan step over the plan's allocated tensors (`tensors[i]` is `plan.tensors[i]`).
/// Enqueues its kernels; call `backend.synchronize()` to wait for them.
pub fn run_step(
    backend: &mut dyn Backend,
    step: &Step,
    tensors: &[DeviceTensor],
) -> Result<(), BackendError> {
    run_step_with(backend, step, &|ix| tensors.get(ix))
}

/// Run one plan step over tensors looked up by plan index (`None`: not allocated now).
pub fn run_step_with<'a>(
    backend: &mut dyn Backend,
    step: &Step,
    lookup: &dyn Fn(usize) -> Option<&'a DeviceTensor>,
) -> Result<(), BackendError> {
    let t = |ix: usize| {
        lookup(ix).ok_or_else(|| err(format!("plan step names tensor {ix}, which is not live")))
    };
    match *step {
        Step::Matmul {
            a,
            b,
            c,
            batch,
            m,
            n,
            k,
        } => {
            let dims = MatmulDims {
                batch,
                m,
                n,
                k,
                b_per_batch: false,
                b_transposed: false,
                alpha: 1.0,
            };
            matmul(backend, t(a)?, t(b)?, t(c)?, &dims)
        }
        Step::Softmax { x, y, rows, cols } => softmax(backend, t(x)?, t(y)?, rows, cols),
        Step::Attention {
            q,
            k,
            v,
            scores,
            probs,
            out,
            batch_heads,
            seq,
            head_dim,
            causal,
        } => {
            let d = AttentionDims {
                batch_heads,
                seq,
                head_dim,
                causal,
                kv_group: 1,
            };
            attention_naive(
                backend,
                t(q)?,
                t(k)?,
                t(v)?,
                t(scores)?,
                t(probs)?,
                t(out)?,
                &d,
            )
        }
        Step::FlashAttention {
            q,
            k,
            v,
            out,
            stats,
            batch_heads,
            seq,
            head_dim,
            causal,
            kv_group,
        } => {
            let d = AttentionDims {
                batch_heads,
                seq,
                head_dim,
                causal,
                kv_group,
            };
            flash_attention(backend, t(q)?, t(k)?, t(v)?, t(out)?, t(stats)?, &d)
        }
        Step::LayerNorm { x, y, rows, cols } => layer_norm(backend, t(x)?, t(y)?, rows, cols),
        Step::Gelu { x, y, elems } => gelu(backend, t(x)?, t(y)?, elems),
        Step::Relu { x, y, elems } => relu(backend, t(x)?, t(y)?, elems),
        Step::Conv2d {
            x,
            w,
            y,
            n,
            c_in,
            h,
            w_in,
            c_out,
            kernel,
            stride,
            pad,
        } => {
            let d = ConvDims {
                n,
                c_in,
                h,
                w: w_in,
                c_out,
                kernel,
                stride,
                pad,
            };
            conv2d(backend, t(x)?, t(w)?, t(y)?, &d)
        }
        Step::Adam { p, g, m, v, elems } => adam(
            backend,
            t(p)?,
            t(g)?,
            t(m)?,
            t(v)?,
            elems,
            &AdamConfig::default(),
        ),
    }
}
