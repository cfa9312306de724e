//! Matrix multiplication over chunked tensors, cut by rows or by batches within the work cap.

use bytemuck::bytes_of;

use crate::backend::{Backend, BackendError, BufferId};
use crate::kernels::params::{MatmulParams, MATMUL_TILE};
use crate::kernels::{KernelId, Op};
use crate::tensor::DeviceTensor;

use super::chunks::*;

/// Shape of a matmul over dense tensors: `C[batch][m][n] = alpha · A[batch][m][k] · B`, with B
/// `[k][n]` shared by the batch or `[batch][k][n]` (`b_per_batch`); with `b_transposed`, B is
/// stored `[(batch)][n][k]` (Kᵀ of attention).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MatmulDims {
    pub batch: u64,
    pub m: u64,
    pub n: u64,
    pub k: u64,
    pub b_per_batch: bool,
    pub b_transposed: bool,
    pub alpha: f32,
}

/// `C = alpha · A · B` (see [`MatmulDims`]). A and C are cut by rows (or by batches when B is
/// per batch); one batch's B must lie in one chunk.
pub fn matmul(
    backend: &mut dyn Backend,
    a: &DeviceTensor,
    b: &DeviceTensor,
    c: &DeviceTensor,
    d: &MatmulDims,
) -> Result<(), BackendError> {
    let storage = common_storage("matmul", &[a, b, c])?;
    let kernel = KernelId::new(Op::Matmul, storage);
    if d.batch == 0 || d.m == 0 || d.n == 0 {
        return Ok(());
    }
    let (b_sk, b_sn) = if d.b_transposed { (1, d.k) } else { (d.n, 1) };
    let b_size = d.k * d.n;
    let tile = MATMUL_TILE as u64;
    // Rows per launch: the grid's limit, and the work cap for whole rows (at least a tile;
    // columns are cut below when even that is too much).
    let max_rows = (MAX_GROUPS_PER_DIM * tile).min(units_within(d.n * d.k).max(tile));
    let p = MatmulParams {
        m: 0,
        n: 0,
        k: u32_of(d.k, "matmul k")?,
        batch: 1,
        a_off: 0,
        a_sb: if d.b_per_batch {
            u32_of(d.m * d.k, "matmul A batch stride")?
        } else {
            0
        },
        a_sm: u32_of(d.k, "matmul k")?,
        a_sk: 1,
        b_off: 0,
        b_sb: if d.b_per_batch {
            u32_of(b_size, "matmul B batch stride")?
        } else {
            0
        },
        b_sk: u32_of(b_sk, "matmul B stride")?,
        b_sn: u32_of(b_sn, "matmul B stride")?,
        c_off: 0,
        c_sb: if d.b_per_batch {
            u32_of(d.m * d.n, "matmul C batch stride")?
        } else {
            0
        },
        c_sm: u32_of(d.n, "matmul n")?,
        alpha: d.alpha,
    };
    // Rows of one batch (B fixed at b_base) cut by the chunks of A and C.
    let row_runs = |bz: u64, b_base: u64| {
        split(
            &[
                opnd(a, bz * d.m * d.k, d.k, d.k),
                opnd(b, b_base, 0, b_size),
                opnd(c, bz * d.m * d.n, d.n, d.n),
            ],
            if d.b_per_batch { d.m } else { d.batch * d.m },
            max_rows,
        )
    };
    let mut launches: Vec<(MatmulParams, Vec<BufferId>)> = Vec::new();
    let launch = |r: &Run, m: u64, batch: u64| {
        (
            MatmulParams {
                m: m as u32,
                batch: batch as u32,
                a_off: r.at[0].1,
                b_off: r.at[1].1,
                c_off: r.at[2].1,
                ..p
            },
            r.at.iter().map(|x| x.0).collect::<Vec<_>>(),
        )
    };
    if !d.b_per_batch {
        // B shared: all batch*m rows are rows of one product.
        for r in row_runs(0, 0)? {
            launches.push(launch(&r, r.units, 1));
        }
    } else {
        // Whole batches per launch while one batch is within the cap.
        let by_batch = if d.m <= max_rows
            && d.m.saturating_mul(d.n).saturating_mul(d.k) <= dispatch_work()
        {
            split(
                &[
                    opnd(a, 0, d.m * d.k, d.m * d.k),
                    opnd(b, 0, b_size, b_size),
                    opnd(c, 0, d.m * d.n, d.m * d.n),
                ],
                d.batch,
                MAX_GROUPS_PER_DIM.min(units_within(d.m.saturating_mul(d.n).saturating_mul(d.k))),
            )
        } else {
            Err(SplitError::Straddle(String::new()))
        };
        match by_batch {
            Ok(runs) => {
                for r in runs {
                    launches.push(launch(&r, d.m, r.units));
                }
            }
            // One batch of A or C spans chunks: go batch by batch, cutting rows.
            Err(SplitError::Straddle(_)) => {
                for bz in 0..d.batch {
                    for r in row_runs(bz, bz * b_size)? {
                        launches.push(launch(&r, r.units, 1));
                    }
                }
            }
            Err(e) => return Err(e.into()),
        }
    }
    // Columns in blocks of at most 65535 tiles, and of whole tiles within the work cap.
    for (l, bufs) in launches {
        let per_col = l.m as u64 * l.batch as u64 * d.k;
        let max_cols = (MAX_GROUPS_PER_DIM * tile)
            .min(units_within(per_col) / tile * tile)
            .max(tile);
        let mut j0 = 0u64;
        while j0 < d.n {
            let nb = (d.n - j0).min(max_cols);
            let q = MatmulParams {
                n: nb as u32,
                b_off: u32_of(l.b_off as u64 + j0 * b_sn, "matmul B offset")?,
                c_off: u32_of(l.c_off as u64 + j0, "matmul C offset")?,
                ..l
            };
            let grid = [
                nb.div_ceil(tile) as u32,
                (l.m as u64).div_ceil(tile) as u32,
                l.batch,
            ];
            backend.dispatch(kernel, bytes_of(&q), &bufs, grid)?;
            j0 += nb;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::super::testing::{whole, Launches};
    use super::*;

    #[test]
    fn matmuls_are_sliced_within_the_work_cap() {
        if std::env::var_os(DISPATCH_WORK_ENV).is_some() {
            return; // the cap is overridden for a measurement
        }
        let cap = MAX_DISPATCH_WORK;
        for (batch, m, n, k, per_batch) in [
            (1u64, 4096u64, 4096u64, 256u64, false), // 4× the cap, B shared
            (8, 1024, 1024, 512, true),              // 4× the cap, two batches a launch
            (64, 128, 128, 64, true),                // small: whole batches together
        ] {
            let a = whole(batch * m * k, k);
            let b = whole(if per_batch { batch * k * n } else { k * n }, n);
            let c = whole(batch * m * n, n);
            let d = MatmulDims {
                batch: if per_batch { batch } else { 1 },
                m: if per_batch { m } else { batch * m },
                n,
                k,
                b_per_batch: per_batch,
                b_transposed: false,
                alpha: 1.0,
            };
            let mut l = Launches::new();
            matmul(&mut l, &a, &b, &c, &d).unwrap();
            let mut covered = 0u64;
            for (_, bytes, _) in &l.seen {
                let p: MatmulParams = bytemuck::pod_read_unaligned(bytes);
                let work = u64::from(p.m) * u64::from(p.n) * u64::from(p.batch) * k;
                assert!(work <= cap, "{work} multiply-adds in one launch");
                covered += u64::from(p.m) * u64::from(p.n) * u64::from(p.batch);
            }
            assert_eq!(covered, batch * m * n, "every output once");
            let total = batch * m * n * k;
            assert!(l.seen.len() as u64 >= total.div_ceil(cap));
            if total <= cap {
                assert_eq!(l.seen.len(), 1, "no slicing below the cap");
            }
        }
    }
}
