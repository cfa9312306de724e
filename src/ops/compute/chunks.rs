//! The chunk splitter every op launches through: the work cap per dispatch, grids within the
//! dimension limit, the storage type the operands share, and [`split`], which cuts an op's
//! units into runs whose operands each lie in one chunk.

use crate::backend::{BackendError, BufferId};
use crate::kernels::Storage;
use crate::plan::DType;
use crate::tensor::DeviceTensor;

/// Most workgroups per grid dimension (WebGPU's guaranteed limit).
pub const MAX_GROUPS_PER_DIM: u64 = 65_535;
/// Most threads one dispatch of a flat (one thread per element) kernel covers.
pub(super) const MAX_FLAT_UNITS: u64 = 1 << 30;
/// Most rows one dispatch of a row kernel (softmax, layer norm) covers.
pub(super) const MAX_ROWS: u64 = 1 << 28;
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
pub(super) fn units_within(per_unit: u64) -> u64 {
    (dispatch_work() / per_unit.max(1)).max(1)
}

pub(super) fn err(msg: impl Into<String>) -> BackendError {
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

pub(super) fn u32_of(v: u64, what: &str) -> Result<u32, BackendError> {
    u32::try_from(v).map_err(|_| err(format!("{what} = {v} does not fit a 32-bit kernel index")))
}

/// The kernel storage type of a tensor; U8 tensors have no compute kernels.
pub(super) fn storage_of(t: &DeviceTensor) -> Result<Storage, BackendError> {
    if matches!(t.dtype, DType::U8 | DType::I64) {
        return Err(err(format!(
            "tensor {} is an integer tensor: no compute kernel reads it",
            t.name
        )));
    }
    Ok(t.dtype.storage())
}

/// The common storage type of tensors one kernel reads and writes.
pub(super) fn common_storage(op: &str, ts: &[&DeviceTensor]) -> Result<Storage, BackendError> {
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
pub(super) struct Operand<'a> {
    pub(super) t: &'a DeviceTensor,
    pub(super) base: u64,
    pub(super) stride: u64,
    pub(super) extent: u64,
}

pub(super) fn opnd(t: &DeviceTensor, base: u64, stride: u64, extent: u64) -> Operand<'_> {
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
pub(super) struct Run {
    pub(super) u0: u64,
    pub(super) units: u64,
    pub(super) at: Vec<(BufferId, u32)>,
}

/// Why units could not be grouped.
pub(super) enum SplitError {
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
pub(super) fn split(
    ops: &[Operand<'_>],
    units: u64,
    max_units: u64,
) -> Result<Vec<Run>, SplitError> {
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

#[cfg(test)]
mod tests {
    use super::super::testing::chunked;
    use super::*;

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
