//! Attention: naive (scores and probabilities stored, three kernels) and flash (no seq×seq
//! buffer, one kernel per group of heads).

use bytemuck::bytes_of;

use crate::backend::{Backend, BackendError, BufferId};
use crate::kernels::params::{fmt_code, FlashParams, FLASH_MAX_HEAD_DIM, FLASH_ROWS};
use crate::kernels::{KernelId, Op};
use crate::tensor::DeviceTensor;

use super::chunks::*;
use super::matmul::{matmul, MatmulDims};
use super::rows::attention_probs;

/// Shape of an attention call: `batch_heads` heads of `[seq][head_dim]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttentionDims {
    pub batch_heads: u64,
    pub seq: u64,
    pub head_dim: u64,
    pub causal: bool,
    /// Query heads per key/value head (flash only; 1 without grouped-query attention).
    pub kv_group: u64,
}

/// Naive attention: `scores = q·kᵀ/√d` (stored, unmasked), `probs = softmax(scores)` with the
/// causal mask (stored), `out = probs·v`. Three kernels: matmul, attention, matmul.
#[allow(clippy::too_many_arguments)]
pub fn attention_naive(
    backend: &mut dyn Backend,
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    scores: &DeviceTensor,
    probs: &DeviceTensor,
    out: &DeviceTensor,
    d: &AttentionDims,
) -> Result<(), BackendError> {
    let scale = 1.0 / (d.head_dim.max(1) as f32).sqrt();
    let qk = MatmulDims {
        batch: d.batch_heads,
        m: d.seq,
        n: d.seq,
        k: d.head_dim,
        b_per_batch: true,
        b_transposed: true,
        alpha: scale,
    };
    matmul(backend, q, k, scores, &qk)?;
    attention_probs(
        backend,
        scores,
        probs,
        d.batch_heads * d.seq,
        d.seq,
        1.0,
        d.causal,
    )?;
    let pv = MatmulDims {
        batch: d.batch_heads,
        m: d.seq,
        n: d.head_dim,
        k: d.seq,
        b_per_batch: true,
        b_transposed: false,
        alpha: 1.0,
    };
    matmul(backend, probs, v, out, &pv)
}

/// Flash attention: `out` as naive attention without any seq×seq buffer, and per row
/// `stats = [max, sum]` (`[bh][seq][2]`, any float type). head_dim at most 256.
pub fn flash_attention(
    backend: &mut dyn Backend,
    q: &DeviceTensor,
    k: &DeviceTensor,
    v: &DeviceTensor,
    out: &DeviceTensor,
    stats: &DeviceTensor,
    d: &AttentionDims,
) -> Result<(), BackendError> {
    let storage = common_storage("flash_attention", &[q, k, v, out])?;
    let stats_fmt = fmt_code(storage_of(stats)?);
    let kernel = KernelId::new(Op::FlashAttention, storage);
    if d.batch_heads == 0 || d.seq == 0 {
        return Ok(());
    }
    if d.head_dim == 0 || d.head_dim > FLASH_MAX_HEAD_DIM as u64 {
        return Err(err(format!(
            "flash attention takes head_dim 1..={FLASH_MAX_HEAD_DIM}, not {}",
            d.head_dim
        )));
    }
    let blocks = d.seq.div_ceil(FLASH_ROWS as u64);
    if blocks > MAX_GROUPS_PER_DIM {
        return Err(err(format!("flash attention: seq {} is too long", d.seq)));
    }
    // A unit of the split is one key/value head and its `g` query heads (grouped-query
    // attention), so a run's query heads and key/value heads stay contiguous together.
    let g = d.kv_group.max(1);
    if !d.batch_heads.is_multiple_of(g) {
        return Err(err(format!(
            "flash attention: {} heads are not a multiple of the key/value group {g}",
            d.batch_heads
        )));
    }
    let hs = d.seq * d.head_dim;
    let ops = [
        opnd(q, 0, g * hs, g * hs),
        opnd(k, 0, hs, hs),
        opnd(v, 0, hs, hs),
        opnd(out, 0, g * hs, g * hs),
        opnd(stats, 0, g * 2 * d.seq, g * 2 * d.seq),
    ];
    // QKᵀ and PV of one head: 2·seq²·head_dim multiply-adds.
    let per_unit = g * 2 * d.seq * d.seq * d.head_dim;
    let max_units = (MAX_GROUPS_PER_DIM / g).max(1);
    let launch = |backend: &mut dyn Backend, r: &Run, heads: u64, group: u64| {
        let p = FlashParams {
            heads: heads as u32,
            seq: u32_of(d.seq, "seq")?,
            head_dim: d.head_dim as u32,
            causal: d.causal as u32,
            q_off: r.at[0].1,
            k_off: r.at[1].1,
            v_off: r.at[2].1,
            o_off: r.at[3].1,
            s_off: r.at[4].1,
            stats_fmt,
            scale: 1.0 / (d.head_dim as f32).sqrt(),
            kv_group: group as u32,
        };
        let bufs: Vec<BufferId> = r.at.iter().map(|x| x.0).collect();
        backend.dispatch(
            kernel,
            bytes_of(&p),
            &bufs,
            [blocks as u32, heads as u32, 1],
        )
    };
    match split(
        &ops,
        d.batch_heads / g,
        max_units.min(units_within(per_unit)),
    ) {
        Ok(runs) => {
            for r in runs {
                launch(backend, &r, r.units * g, g)?;
            }
        }
        // A key/value head's group of query heads spans chunks: one query head per launch,
        // reading its key/value head.
        Err(SplitError::Straddle(_)) if g > 1 => {
            for i in 0..d.batch_heads {
                let kv = (i / g) * hs;
                let one = [
                    opnd(q, i * hs, 0, hs),
                    opnd(k, kv, 0, hs),
                    opnd(v, kv, 0, hs),
                    opnd(out, i * hs, 0, hs),
                    opnd(stats, i * 2 * d.seq, 0, 2 * d.seq),
                ];
                for r in split(&one, 1, 1)? {
                    launch(backend, &r, 1, 1)?;
                }
            }
        }
        Err(e) => return Err(e.into()),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::testing::{whole, Launches};
    use super::*;

    #[test]
    fn flash_attention_takes_as_many_heads_as_the_cap_allows() {
        if std::env::var_os(DISPATCH_WORK_ENV).is_some() {
            return;
        }
        for (seq, heads, launches) in [(1024u64, 20u64, 3usize), (4096, 4, 4)] {
            let hd = 64;
            let t = whole(heads * seq * hd, hd);
            let stats = whole(heads * seq * 2, 2);
            let d = AttentionDims {
                batch_heads: heads,
                seq,
                head_dim: hd,
                causal: true,
                kv_group: 1,
            };
            let mut l = Launches::new();
            flash_attention(&mut l, &t, &t, &t, &t, &stats, &d).unwrap();
            assert_eq!(l.seen.len(), launches, "seq {seq}");
        }
    }
}
