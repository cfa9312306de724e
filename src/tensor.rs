//! Device tensors: a tensor of any size as row-aligned chunks within the device's buffer and binding limits.
//!
//! A chunk is one device buffer. Chunks hold whole rows (`row_elems` elements), so row-wise
//! kernels never see a row split across two buffers. Each chunk's byte size is its elements
//! times the element size, rounded up to whole 32-bit words (u8 and odd-length 16-bit chunks
//! carry up to 3 bytes of padding, and that padding is counted as allocated).

use crate::backend::{AllocError, Backend, BufferId};
use crate::plan::{DType, TensorSpec};

/// Bytes in one word: buffers and copies are whole words.
pub const WORD_BYTES: u64 = 4;

/// One buffer of a tensor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    pub buffer: BufferId,
    /// Index (in elements) of the chunk's first element within the tensor.
    pub first_elem: u64,
    /// Elements in this chunk (a whole number of rows, except possibly none).
    pub elems: u64,
    /// Bytes allocated for this chunk (elements × size, rounded up to whole words).
    pub bytes: u64,
}

impl Chunk {
    /// 32-bit words in this chunk's buffer.
    pub fn words(&self) -> u64 {
        self.bytes / WORD_BYTES
    }
}

/// A tensor living on a device as one or more chunks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceTensor {
    pub name: String,
    pub dtype: DType,
    pub elems: u64,
    pub row_elems: u64,
    pub chunks: Vec<Chunk>,
}

impl DeviceTensor {
    /// Logical bytes (elements × element size), without padding.
    pub fn bytes(&self) -> u64 {
        self.elems.saturating_mul(self.dtype.bytes())
    }
    /// Bytes actually allocated (sum of chunk sizes, padding included).
    pub fn allocated_bytes(&self) -> u64 {
        self.chunks.iter().map(|c| c.bytes).sum()
    }
    /// 32-bit words over all chunks.
    pub fn words(&self) -> u64 {
        self.chunks.iter().map(Chunk::words).sum()
    }
    /// The chunk holding element `elem` and its index within that chunk.
    pub fn locate(&self, elem: u64) -> Option<(&Chunk, u64)> {
        self.chunks
            .iter()
            .find(|c| elem >= c.first_elem && elem - c.first_elem < c.elems)
            .map(|c| (c, elem - c.first_elem))
    }
}

/// The layout of one chunk before allocation: (first_elem, elems, bytes).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChunkLayout {
    pub first_elem: u64,
    pub elems: u64,
    pub bytes: u64,
}

/// Split `elems` elements of `elem_bytes` bytes into chunks of whole rows, each at most
/// `max_chunk_bytes` (rounded down to whole words). A row too big for one chunk is
/// `ExceedsLimit`. Zero elements gives no chunks.
pub fn plan_chunks(
    elems: u64,
    elem_bytes: u64,
    row_elems: u64,
    max_chunk_bytes: u64,
) -> Result<Vec<ChunkLayout>, AllocError> {
    if elems == 0 {
        return Ok(Vec::new());
    }
    let row_elems = row_elems.clamp(1, elems);
    let max = max_chunk_bytes / WORD_BYTES * WORD_BYTES;
    let row_bytes = row_elems
        .checked_mul(elem_bytes)
        .ok_or(AllocError::ExceedsLimit {
            requested: u64::MAX,
            limit: max,
        })?;
    if row_bytes > max {
        return Err(AllocError::ExceedsLimit {
            requested: row_bytes.div_ceil(WORD_BYTES) * WORD_BYTES,
            limit: max,
        });
    }
    // rows_per_chunk * row_bytes <= max, and max is whole words, so rounding up stays <= max.
    let rows_per_chunk = max / row_bytes;
    let chunk_elems = rows_per_chunk.saturating_mul(row_elems);
    let mut out = Vec::with_capacity(elems.div_ceil(chunk_elems).min(1 << 20) as usize);
    let mut first = 0u64;
    while first < elems {
        let n = chunk_elems.min(elems - first);
        let bytes = (n * elem_bytes).div_ceil(WORD_BYTES) * WORD_BYTES;
        out.push(ChunkLayout {
            first_elem: first,
            elems: n,
            bytes,
        });
        first += n;
    }
    Ok(out)
}

/// Allocate a tensor of `elems` elements as chunks; on any failure, free what was allocated
/// and return the error.
pub fn allocate(
    backend: &mut dyn Backend,
    name: &str,
    dtype: DType,
    elems: u64,
    row_elems: u64,
) -> Result<DeviceTensor, AllocError> {
    allocate_on(backend, name, dtype, elems, row_elems, 0)
}

/// `allocate` from `stream`'s pool (see `Backend::alloc_buffer_on`).
fn allocate_on(
    backend: &mut dyn Backend,
    name: &str,
    dtype: DType,
    elems: u64,
    row_elems: u64,
    stream: i64,
) -> Result<DeviceTensor, AllocError> {
    let layout = plan_chunks(
        elems,
        dtype.bytes(),
        row_elems,
        backend.info().max_chunk_bytes(),
    )?;
    let mut chunks = Vec::with_capacity(layout.len());
    for l in layout {
        match backend.alloc_buffer_on(l.bytes, stream) {
            Ok(buffer) => chunks.push(Chunk {
                buffer,
                first_elem: l.first_elem,
                elems: l.elems,
                bytes: l.bytes,
            }),
            Err(e) => {
                for c in &chunks {
                    backend.free_buffer(c.buffer);
                }
                return Err(e);
            }
        }
    }
    Ok(DeviceTensor {
        name: name.to_string(),
        dtype,
        elems,
        row_elems: row_elems.max(1),
        chunks,
    })
}

/// Allocate the tensor a plan describes (see `allocate`).
pub fn allocate_tensor(
    backend: &mut dyn Backend,
    spec: &TensorSpec,
) -> Result<DeviceTensor, AllocError> {
    allocate_on(
        backend,
        &spec.name,
        spec.dtype,
        spec.elems(),
        spec.row_elems,
        spec.stream.id(),
    )
}

/// Release every chunk of a tensor.
pub fn free_tensor(backend: &mut dyn Backend, tensor: DeviceTensor) {
    for c in tensor.chunks {
        backend.free_buffer(c.buffer);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunks_hold_whole_rows_within_the_limit() {
        // 10 rows of 7 f32 (28 B); 64 B max -> 2 rows (56 B) per chunk.
        let c = plan_chunks(70, 4, 7, 64).unwrap();
        assert_eq!(c.len(), 5);
        assert!(c.iter().all(|l| l.elems == 14 && l.bytes == 56));
        assert_eq!(c[4].first_elem, 56);
    }

    #[test]
    fn padding_rounds_up_to_words() {
        // 5 u8 in one row: 8 bytes allocated.
        let c = plan_chunks(5, 1, 5, 1 << 20).unwrap();
        assert_eq!(
            c,
            vec![ChunkLayout {
                first_elem: 0,
                elems: 5,
                bytes: 8
            }]
        );
        // 3 f16 rows of 3: per chunk of 2 rows (12 B) within 13 B -> max rounds down to 12.
        let c = plan_chunks(9, 2, 3, 13).unwrap();
        assert_eq!(c.iter().map(|l| l.elems).collect::<Vec<_>>(), vec![6, 3]);
        assert_eq!(c.iter().map(|l| l.bytes).collect::<Vec<_>>(), vec![12, 8]);
    }

    #[test]
    fn a_row_bigger_than_a_chunk_is_exceeds_limit() {
        let e = plan_chunks(100, 4, 100, 256).unwrap_err();
        assert!(matches!(e, AllocError::ExceedsLimit { limit: 256, .. }));
    }

    #[test]
    fn zero_elements_give_no_chunks() {
        assert!(plan_chunks(0, 4, 1, 64).unwrap().is_empty());
    }

    #[test]
    fn chunks_cover_every_element_once() {
        for &(elems, eb, row, max) in &[
            (1000u64, 2u64, 10u64, 100u64),
            (12345, 1, 1, 4096),
            (7, 4, 1, 4),
        ] {
            let c = plan_chunks(elems, eb, row, max).unwrap();
            let mut next = 0;
            for l in &c {
                assert_eq!(l.first_elem, next);
                assert!(l.bytes <= max && l.bytes % 4 == 0);
                assert!(l.bytes >= l.elems * eb);
                next += l.elems;
            }
            assert_eq!(next, elems);
        }
    }
}
