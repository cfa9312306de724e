//! Compute kernels over device tensors (matmul, softmax, attention, conv2d, ...) and `run_step` for plan steps.
//!
//! Every function here works across the chunks of big tensors: the work is cut into "units"
//! (elements, rows, heads, images, batches) and consecutive units whose data lies in one chunk
//! of every operand go to one dispatch, with element offsets relative to that chunk's buffer.
//! One unit's data must lie in a single chunk (`DeviceTensor` chunks hold whole rows of the
//! tensor's `row_elems`), otherwise the op returns a `BackendError` naming the tensor. Operands
//! read whole by every unit (a linear layer's weight, a conv's filters) must fit one chunk.
//!
//! Shapes are in elements, tensors dense row-major; see `kernels::params` for each kernel's
//! exact semantics and `kernels::reference` for the f64 references.

use bytemuck::bytes_of;

use crate::backend::{Backend, BackendError, BufferId};
use crate::kernels::params::{
    fmt_code, AdamParams, Conv2dParams, ElemParams, FlashParams, LayerNormParams, MatmulParams,
    SoftmaxParams, FLASH_MAX_HEAD_DIM, FLASH_ROWS, MATMUL_TILE,
};
use crate::kernels::reference::AdamConfig;
use crate::kernels::{KernelId, Op, Storage};
use crate::plan::{DType, Step};
use crate::tensor::DeviceTensor;

/// Most workgroups per grid dimension (WebGPU's guaranteed limit).
pub const MAX_GROUPS_PER_DIM: u64 = 65_535;
/// Most threads one dispatch of a flat (one thread per element) kernel covers.
const MAX_FLAT_UNITS: u64 = 1 << 30;
/// Most rows one dispatch of a row kernel (softmax, layer norm) covers.
const MAX_ROWS: u64 = 1 << 28;
/// Layer norm epsilon.
pub const LAYER_NORM_EPS: f32 = 1e-5;
/// The slicing rule: one dispatch does at most this much work (multiply-adds for matmul,
/// attention and convolution; elements for row and elementwise kernels), so that every launch
/// stays well under a watchdog (Windows TDR: 2 s; macOS) on the slowest supported device. See
/// the README ("Watchdogs") for the measurement behind it. Exceptions, since a kernel cannot be
/// cut finer: one matmul tile (64 × 64 × k), one flash-attention head, one conv image.
pub const MAX_DISPATCH_WORK: u64 = 1 << 30;
/// Overrides [`MAX_DISPATCH_WORK`] (for measuring the rule itself).
pub const DISPATCH_WORK_ENV: &str = "OOMPROBE_MAX_DISPATCH_WORK";

/// The work cap in force.
pub fn dispatch_work() -> u64 {
    static CAP: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *CAP.get_or_init(|| {
        std::env::var(DISPATCH_WORK_ENV)
            .ok()
            .and_then(|v| v.parse::<u64>().ok())
            .filter(|&v| v > 0)
            .unwrap_or(MAX_DISPATCH_WORK)
    })
}

/// Most units one dispatch covers when each costs `per_unit` work (at least one).
fn units_within(per_unit: u64) -> u64 {
    (dispatch_work() / per_unit.max(1)).max(1)
}

fn err(msg: impl Into<String>) -> BackendError {
    BackendError::Other(msg.into())
}

/// A grid of `groups` workgroups: `[x, y, 1]` with `x <= 65535`; kernels index groups as
/// `wid.x + wid.y * num_workgroups.x` and ignore those past the end.
pub fn grid_1d(groups: u64) -> Result<[u32; 3], BackendError> {
    let groups = groups.max(1);
    let x = groups.min(MAX_GROUPS_PER_DIM);
    let y = groups.div_ceil(x);
    if y > MAX_GROUPS_PER_DIM {
        return Err(err(format!("{groups} workgroups in one dispatch")));
    }
    Ok([x as u32, y as u32, 1])
}

fn u32_of(v: u64, what: &str) -> Result<u32, BackendError> {
    u32::try_from(v).map_err(|_| err(format!("{what} = {v} does not fit a 32-bit kernel index")))
}

/// The kernel storage type of a tensor; U8 tensors have no compute kernels.
fn storage_of(t: &DeviceTensor) -> Result<Storage, BackendError> {
    if matches!(t.dtype, DType::U8 | DType::I64) {
        return Err(err(format!(
            "tensor {} is an integer tensor: no compute kernel reads it",
            t.name
        )));
    }
    Ok(t.dtype.storage())
}

/// The common storage type of tensors one kernel reads and writes.
fn common_storage(op: &str, ts: &[&DeviceTensor]) -> Result<Storage, BackendError> {
    let s = storage_of(ts[0])?;
    for t in &ts[1..] {
        if storage_of(t)? != s {
            return Err(err(format!(
                "{op}: tensors {} ({:?}) and {} ({:?}) differ in element type",
                ts[0].name, ts[0].dtype, t.name, t.dtype
            )));
        }
    }
    Ok(s)
}

/// How one operand maps a unit u to its elements: `[base + u*stride, .. + extent)`.
#[derive(Clone, Copy)]
struct Operand<'a> {
    t: &'a DeviceTensor,
    base: u64,
    stride: u64,
    extent: u64,
}

fn opnd(t: &DeviceTensor, base: u64, stride: u64, extent: u64) -> Operand<'_> {
    Operand {
        t,
        base,
        stride,
        extent,
    }
}

/// Consecutive units `[u0, u0 + units)` whose operands each lie in one buffer; `at[i]` is
/// operand i's buffer and the buffer-relative element index of unit u0's first element.
#[derive(Debug, Clone)]
struct Run {
    u0: u64,
    units: u64,
    at: Vec<(BufferId, u32)>,
}

/// Why units could not be grouped.
enum SplitError {
    /// One unit of an operand crosses a chunk boundary.
    Straddle(String),
    Other(BackendError),
}

impl From<SplitError> for BackendError {
    fn from(e: SplitError) -> Self {
        match e {
            SplitError::Straddle(m) => err(m),
            SplitError::Other(e) => e,
        }
    }
}

/// Cut `units` units into runs where every operand stays within one chunk (at most
/// `max_units` units per run).
fn split(ops: &[Operand<'_>], units: u64, max_units: u64) -> Result<Vec<Run>, SplitError> {
    if units == 0 {
        return Ok(Vec::new());
    }
    for o in ops {
        let end = (units - 1)
            .checked_mul(o.stride)
            .and_then(|v| v.checked_add(o.base))
            .and_then(|v| v.checked_add(o.extent))
            .ok_or_else(|| SplitError::Other(err("tensor index overflow")))?;
        if end > o.t.elems {
            return Err(SplitError::Other(err(format!(
                "tensor {} holds {} elements; the kernel needs {end}",
                o.t.name, o.t.elems
            ))));
        }
    }
    let mut runs = Vec::new();
    let mut u0 = 0u64;
    while u0 < units {
        let mut n = (units - u0).min(max_units.max(1));
        let mut at = Vec::with_capacity(ops.len());
        for o in ops {
            let first = o.base + u0 * o.stride;
            let (chunk, local) = o.t.locate(first).ok_or_else(|| {
                SplitError::Other(err(format!(
                    "tensor {}: no chunk holds element {first}",
                    o.t.name
                )))
            })?;
            let chunk_end = chunk.first_elem + chunk.elems;
            if first + o.extent > chunk_end {
                return Err(SplitError::Straddle(format!(
                    "tensor {}: elements {first}..{} that one kernel invocation reads cross a \
                     chunk boundary at {chunk_end} (rows of {} elements per chunk row); give the \
                     tensor a row size that is a multiple of {}",
                    o.t.name,
                    first + o.extent,
                    o.t.row_elems,
                    o.extent
                )));
            }
            // Units that still end inside this chunk (all of them when the stride is 0).
            if let Some(more) = (chunk_end - first - o.extent).checked_div(o.stride) {
                n = n.min(more + 1);
            }
            if chunk.elems > u32::MAX as u64 {
                return Err(SplitError::Other(err(format!(
                    "tensor {}: a chunk of {} elements is past 32-bit kernel indexing",
                    o.t.name, chunk.elems
                ))));
            }
            at.push((chunk.buffer, local as u32));
        }
        runs.push(Run { u0, units: n, at });
        u0 += n;
    }
    Ok(runs)
}

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

/// An NCHW convolution: `x[n][c_in][h][w] * w[c_out][c_in][kernel][kernel] -> y`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ConvDims {
    pub n: u64,
    pub c_in: u64,
    pub h: u64,
    pub w: u64,
    pub c_out: u64,
    pub kernel: u64,
    pub stride: u64,
    pub pad: u64,
}

impl ConvDims {
    /// Output height and width; None when the kernel does not fit or the stride is 0.
    pub fn out_hw(&self) -> Option<(u64, u64)> {
        if self.stride == 0 || self.kernel == 0 {
            return None;
        }
        let hp = (self.h + 2 * self.pad).checked_sub(self.kernel)?;
        let wp = (self.w + 2 * self.pad).checked_sub(self.kernel)?;
        Some((hp / self.stride + 1, wp / self.stride + 1))
    }
}

/// Direct convolution, image by image (one image of x and of y must each lie in one chunk;
/// the filters in one chunk).
pub fn conv2d(
    backend: &mut dyn Backend,
    x: &DeviceTensor,
    w: &DeviceTensor,
    y: &DeviceTensor,
    d: &ConvDims,
) -> Result<(), BackendError> {
    let storage = common_storage("conv2d", &[x, w, y])?;
    let kernel = KernelId::new(Op::Conv2d, storage);
    let (ho, wo) = d
        .out_hw()
        .ok_or_else(|| err(format!("conv2d: no output for {d:?}")))?;
    if d.n == 0 || d.c_out == 0 {
        return Ok(());
    }
    let x_img = d.c_in * d.h * d.w;
    let y_img = d.c_out * ho * wo;
    let w_all = d.c_out * d.c_in * d.kernel * d.kernel;
    let wg = kernel.workgroup_size()[0] as u64;
    let per_img = y_img * d.c_in * d.kernel * d.kernel;
    let max_imgs = (MAX_FLAT_UNITS / y_img.max(1))
        .max(1)
        .min(units_within(per_img));
    let ops = [
        opnd(x, 0, x_img, x_img),
        opnd(w, 0, 0, w_all),
        opnd(y, 0, y_img, y_img),
    ];
    for r in split(&ops, d.n, max_imgs)? {
        let p = Conv2dParams {
            n: r.units as u32,
            c_in: u32_of(d.c_in, "c_in")?,
            h: u32_of(d.h, "h")?,
            w: u32_of(d.w, "w")?,
            c_out: u32_of(d.c_out, "c_out")?,
            kernel: u32_of(d.kernel, "kernel")?,
            stride: u32_of(d.stride, "stride")?,
            pad: u32_of(d.pad, "pad")?,
            h_out: ho as u32,
            w_out: wo as u32,
            x_off: r.at[0].1,
            w_off: r.at[1].1,
            y_off: r.at[2].1,
            _pad: [0; 3],
        };
        let grid = grid_1d((r.units * y_img).div_ceil(wg))?;
        let bufs = [r.at[0].0, r.at[1].0, r.at[2].0];
        backend.dispatch(kernel, bytes_of(&p), &bufs, grid)?;
    }
    Ok(())
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::Chunk;

    /// A tensor of `elems` f32 cut into chunks of `chunk` elements (buffer ids 0, 1, ..).
    fn chunked(elems: u64, chunk: u64, row: u64) -> DeviceTensor {
        let chunks = (0..elems.div_ceil(chunk))
            .map(|i| Chunk {
                buffer: BufferId(i),
                first_elem: i * chunk,
                elems: chunk.min(elems - i * chunk),
                bytes: 4 * chunk.min(elems - i * chunk),
            })
            .collect();
        DeviceTensor {
            name: "t".into(),
            dtype: DType::F32,
            elems,
            row_elems: row,
            chunks,
        }
    }

    /// A device that records each launch's kernel, params and grid, and runs nothing.
    struct Launches {
        info: crate::backend::DeviceInfo,
        seen: Vec<(Op, Vec<u8>, [u32; 3])>,
    }

    impl Launches {
        fn new() -> Self {
            let info = crate::backend::mock::MockBackend::new(1 << 40)
                .info()
                .clone();
            Launches {
                info,
                seen: Vec::new(),
            }
        }
    }

    impl Backend for Launches {
        fn info(&self) -> &crate::backend::DeviceInfo {
            &self.info
        }
        fn memory(&self) -> crate::backend::MemoryInfo {
            Default::default()
        }
        fn alloc_buffer(&mut self, _: u64) -> Result<BufferId, crate::backend::AllocError> {
            Ok(BufferId(0))
        }
        fn free_buffer(&mut self, _: BufferId) {}
        fn write_buffer(&mut self, _: BufferId, _: u64, _: &[u8]) -> Result<(), BackendError> {
            Ok(())
        }
        fn read_buffer(&mut self, _: BufferId, _: u64, n: u64) -> Result<Vec<u8>, BackendError> {
            Ok(vec![0; n as usize])
        }
        fn dispatch(
            &mut self,
            kernel: KernelId,
            params: &[u8],
            _: &[BufferId],
            groups: [u32; 3],
        ) -> Result<(), BackendError> {
            self.seen.push((kernel.op, params.to_vec(), groups));
            Ok(())
        }
        fn synchronize(&mut self) -> Result<(), BackendError> {
            Ok(())
        }
        fn allocated_bytes(&self) -> u64 {
            0
        }
    }

    /// One chunk of `elems` f32 in rows of `row`.
    fn whole(elems: u64, row: u64) -> DeviceTensor {
        chunked(elems, elems, row)
    }

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

    #[test]
    fn runs_follow_every_operands_chunks() {
        // Rows of 10: x in chunks of 30 (3 rows), y in chunks of 40 (4 rows).
        let x = chunked(100, 30, 10);
        let y = chunked(100, 40, 10);
        let runs = split(&[opnd(&x, 0, 10, 10), opnd(&y, 0, 10, 10)], 9, 100)
            .unwrap_or_else(|_| panic!("split"));
        let got: Vec<(u64, u64, u32, u32)> = runs
            .iter()
            .map(|r| (r.u0, r.units, r.at[0].1, r.at[1].1))
            .collect();
        assert_eq!(
            got,
            vec![
                (0, 3, 0, 0),
                (3, 1, 0, 30),
                (4, 2, 10, 0),
                (6, 2, 0, 20),
                (8, 1, 20, 0)
            ]
        );
        assert_eq!(runs[3].at[0].0, BufferId(2));
        // A shared operand (stride 0) never cuts runs; max_units does.
        let w = chunked(10, 10, 10);
        let runs = split(&[opnd(&w, 0, 0, 10), opnd(&x, 0, 1, 1)], 25, 7)
            .unwrap_or_else(|_| panic!("split"));
        assert_eq!(
            runs.iter().map(|r| r.units).collect::<Vec<_>>(),
            vec![7, 7, 7, 4]
        );
    }

    #[test]
    fn a_unit_across_chunks_or_past_the_end_is_refused() {
        let x = chunked(100, 30, 10);
        assert!(matches!(
            split(&[opnd(&x, 0, 20, 20)], 5, 100),
            Err(SplitError::Straddle(_))
        ));
        assert!(matches!(
            split(&[opnd(&x, 0, 10, 10)], 11, 100),
            Err(SplitError::Other(_))
        ));
        assert!(split(&[opnd(&x, 0, 10, 10)], 0, 100)
            .map(|r| r.is_empty())
            .unwrap_or(false));
    }

    #[test]
    fn grids_stay_within_the_dimension_limit() {
        assert_eq!(grid_1d(0).ok(), Some([1, 1, 1]));
        assert_eq!(grid_1d(65_535).ok(), Some([65_535, 1, 1]));
        assert_eq!(grid_1d(65_536).ok(), Some([65_535, 2, 1]));
        assert!(grid_1d(65_535 * 65_535 + 1).is_err());
    }

    #[test]
    fn mismatched_element_types_are_refused() {
        let a = chunked(16, 16, 4);
        let mut b = chunked(16, 16, 4);
        b.dtype = DType::F16;
        let e = common_storage("matmul", &[&a, &b]).unwrap_err();
        assert!(e.to_string().contains("element type"), "{e}");
        b.dtype = DType::U8;
        assert!(storage_of(&b).is_err());
    }
}
