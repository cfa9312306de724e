//! Word kernels over device tensors: fill every byte with a pattern, verify it, checksum it.
//!
//! A tensor's words are numbered across its chunks (padding words included), so the pattern
//! continues over chunk boundaries: word `w` of a tensor always holds `pattern(w, seed)`.

use crate::backend::{Backend, BackendError, BufferId};
use crate::kernels::params::WordParams;
use crate::kernels::{KernelId, Op};
use crate::tensor::DeviceTensor;

/// Threads per workgroup of the word kernels (`@workgroup_size(256)`).
const GROUP: u64 = 256;
/// Most workgroups along one dispatch dimension (WebGPU's default limit).
const MAX_GROUPS_PER_DIM: u64 = 65535;
/// Workgroups of a reducing dispatch (verify, checksum): enough threads to fill a large GPU
/// (262,144), few enough that per-workgroup barriers and atomics stay cheap (lavapipe runs
/// barriers slowly); each thread grid-strides over the rest.
const MAX_REDUCE_GROUPS: u64 = 1024;
/// Words each thread handles at least before another workgroup is added: a workgroup's
/// reduction (eight barriers) must be paid for by real work, or small tensors cost more per
/// byte than big ones (on lavapipe a barrier switches between all 256 invocations).
const MIN_WORDS_PER_THREAD: u64 = 64;

pub use crate::kernels::{fmix32, pattern};

/// What `verify` found.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct VerifyResult {
    pub words_seen: u64,
    pub mismatches: u64,
}

impl VerifyResult {
    pub fn ok(&self, expected_words: u64) -> bool {
        self.mismatches == 0 && self.words_seen == expected_words
    }
}

/// A wrapping 64-bit sum of a tensor's words, and how many words were summed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Checksum {
    pub sum: u64,
    pub words: u64,
}

impl Checksum {
    /// The checksum of host words (for comparing with the device's).
    pub fn of_words(words: &[u32]) -> Self {
        Checksum {
            sum: words
                .iter()
                .fold(0u64, |s, &w| s.wrapping_add(u64::from(w))),
            words: words.len() as u64,
        }
    }
    /// The checksum a tensor of `words` words filled with `seed` must have.
    pub fn of_pattern(first_word: u64, words: u64, seed: u32) -> Self {
        let sum = (first_word..first_word + words)
            .fold(0u64, |s, w| s.wrapping_add(u64::from(pattern(w, seed))));
        Checksum { sum, words }
    }
    fn add(self, other: Checksum) -> Self {
        Checksum {
            sum: self.sum.wrapping_add(other.sum),
            words: self.words + other.words,
        }
    }
}

/// A dispatch shape that covers `len_words` words with 256-thread groups (2D past 65535
/// groups; the kernels grid-stride, so any shape is correct).
pub fn word_workgroups(len_words: u64) -> [u32; 3] {
    let groups = len_words.div_ceil(GROUP).max(1);
    if groups <= MAX_GROUPS_PER_DIM {
        [groups as u32, 1, 1]
    } else {
        let y = groups.div_ceil(MAX_GROUPS_PER_DIM).min(MAX_GROUPS_PER_DIM);
        [MAX_GROUPS_PER_DIM as u32, y as u32, 1]
    }
}

/// The dispatch shape of fill, verify and checksum: at most `MAX_REDUCE_GROUPS` workgroups that
/// grid-stride (per-workgroup overhead dominates on CPU adapters; enough threads for a GPU).
pub fn reduce_workgroups(len_words: u64) -> [u32; 3] {
    [
        len_words
            .div_ceil(GROUP * MIN_WORDS_PER_THREAD)
            .clamp(1, MAX_REDUCE_GROUPS) as u32,
        1,
        1,
    ]
}

fn params(first_word: u64, len_words: u64, seed: u32) -> Result<WordParams, BackendError> {
    let len_words = u32::try_from(len_words)
        .map_err(|_| BackendError::Other(format!("{len_words} words in one buffer")))?;
    Ok(WordParams {
        first_word_lo: first_word as u32,
        first_word_hi: (first_word >> 32) as u32,
        len_words,
        seed,
    })
}

/// Fill `len_words` words of one buffer with the pattern starting at tensor word `first_word`.
pub fn fill_buffer(
    backend: &mut dyn Backend,
    buffer: BufferId,
    first_word: u64,
    len_words: u64,
    seed: u32,
) -> Result<(), BackendError> {
    if len_words == 0 {
        return Ok(());
    }
    let p = params(first_word, len_words, seed)?;
    backend.dispatch(
        KernelId::words(Op::Fill),
        bytemuck::bytes_of(&p),
        &[buffer],
        reduce_workgroups(len_words),
    )
}

/// A 16-byte device buffer the reducing kernels (verify, checksum) add their result into.
/// A probe allocates one before its first tensor and reuses it, so nothing but tensors is
/// allocated once memory fills up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Scratch(pub BufferId);

impl Scratch {
    /// Bytes of the result buffer.
    pub const BYTES: u64 = 16;
    pub fn alloc(backend: &mut dyn Backend) -> Result<Scratch, BackendError> {
        Ok(Scratch(backend.alloc_buffer(Self::BYTES)?))
    }
    pub fn free(self, backend: &mut dyn Backend) {
        backend.free_buffer(self.0);
    }
}

/// Run `f` with a scratch result buffer of its own (allocated now, freed after).
fn with_scratch<T>(
    backend: &mut dyn Backend,
    f: impl FnOnce(&mut dyn Backend, Scratch) -> Result<T, BackendError>,
) -> Result<T, BackendError> {
    let s = Scratch::alloc(backend)?;
    let out = f(backend, s);
    s.free(backend);
    out
}

/// Run verify or checksum over one buffer into the zeroed result buffer; return its words.
fn reduce_buffer(
    backend: &mut dyn Backend,
    op: Op,
    buffer: BufferId,
    first_word: u64,
    len_words: u64,
    seed: u32,
    scratch: Scratch,
) -> Result<[u32; 4], BackendError> {
    let p = params(first_word, len_words, seed)?;
    let result = scratch.0;
    backend.write_buffer(result, 0, &[0u8; 16])?;
    if len_words > 0 {
        backend.dispatch(
            KernelId::words(op),
            bytemuck::bytes_of(&p),
            &[buffer, result],
            reduce_workgroups(len_words),
        )?;
    }
    read_result(backend, result)
}

/// Count the words of one buffer and those that differ from the pattern.
pub fn verify_buffer(
    backend: &mut dyn Backend,
    buffer: BufferId,
    first_word: u64,
    len_words: u64,
    seed: u32,
) -> Result<VerifyResult, BackendError> {
    let w = with_scratch(backend, |b, s| {
        reduce_buffer(b, Op::Verify, buffer, first_word, len_words, seed, s)
    })?;
    Ok(VerifyResult {
        words_seen: u64::from(w[0]),
        mismatches: u64::from(w[1]),
    })
}

/// The checksum of `len_words` words of one buffer.
pub fn checksum_buffer(
    backend: &mut dyn Backend,
    buffer: BufferId,
    len_words: u64,
) -> Result<Checksum, BackendError> {
    with_scratch(backend, |b, s| {
        checksum_buffer_with(b, buffer, len_words, s)
    })
}

/// The checksum of the first `len_words` words of one buffer, through `scratch`.
pub fn checksum_buffer_with(
    backend: &mut dyn Backend,
    buffer: BufferId,
    len_words: u64,
    scratch: Scratch,
) -> Result<Checksum, BackendError> {
    let w = reduce_buffer(backend, Op::Checksum, buffer, 0, len_words, 0, scratch)?;
    Ok(Checksum {
        sum: u64::from(w[0]) | (u64::from(w[1]) << 32),
        words: u64::from(w[2]),
    })
}

/// Write the pattern for `seed` to every word of every chunk (this commits the memory).
pub fn fill_tensor(
    backend: &mut dyn Backend,
    tensor: &DeviceTensor,
    seed: u32,
) -> Result<(), BackendError> {
    let mut first = 0u64;
    for c in &tensor.chunks {
        fill_buffer(backend, c.buffer, first, c.words(), seed)?;
        first += c.words();
    }
    Ok(())
}

/// Words accumulated in one result buffer before it is read back: keeps the u32 counters
/// of the kernels (words seen, mismatches) from wrapping.
const WORDS_PER_READBACK: u64 = 1 << 31;

/// Run verify or checksum over every chunk of a tensor with one 16-byte result buffer: the
/// kernels add into it, so it is read back (and zeroed) only every `WORDS_PER_READBACK` words.
/// Returns the partial results, one per read-back.
fn reduce_tensor(
    backend: &mut dyn Backend,
    op: Op,
    tensor: &DeviceTensor,
    seed: u32,
    scratch: Scratch,
) -> Result<Vec<[u32; 4]>, BackendError> {
    reduce_tensor_batched(backend, op, tensor, seed, WORDS_PER_READBACK, scratch)
}

fn reduce_tensor_batched(
    backend: &mut dyn Backend,
    op: Op,
    tensor: &DeviceTensor,
    seed: u32,
    words_per_readback: u64,
    scratch: Scratch,
) -> Result<Vec<[u32; 4]>, BackendError> {
    let result = scratch.0;
    let mut partials = Vec::new();
    let mut first = 0u64;
    let mut pending = 0u64;
    backend.write_buffer(result, 0, &[0u8; 16])?;
    for c in &tensor.chunks {
        let n = c.words();
        if pending > 0 && pending + n > words_per_readback {
            partials.push(read_result(backend, result)?);
            backend.write_buffer(result, 0, &[0u8; 16])?;
            pending = 0;
        }
        if n > 0 {
            let p = params(first, n, seed)?;
            backend.dispatch(
                KernelId::words(op),
                bytemuck::bytes_of(&p),
                &[c.buffer, result],
                reduce_workgroups(n),
            )?;
        }
        pending += n;
        first += n;
    }
    partials.push(read_result(backend, result)?);
    Ok(partials)
}

fn read_result(backend: &mut dyn Backend, result: BufferId) -> Result<[u32; 4], BackendError> {
    let bytes = backend.read_buffer(result, 0, 16)?;
    let mut w = [0u32; 4];
    for (i, c) in bytes.chunks_exact(4).enumerate().take(4) {
        w[i] = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
    Ok(w)
}

/// Check every word of a tensor against the pattern for `seed`. Needs a 16-byte scratch
/// buffer on the device (allocated now and counted like any allocation; see
/// [`verify_tensor_with`] to reuse one).
pub fn verify_tensor(
    backend: &mut dyn Backend,
    tensor: &DeviceTensor,
    seed: u32,
) -> Result<VerifyResult, BackendError> {
    with_scratch(backend, |b, s| verify_tensor_with(b, tensor, seed, s))
}

/// [`verify_tensor`] through a scratch result buffer allocated earlier.
pub fn verify_tensor_with(
    backend: &mut dyn Backend,
    tensor: &DeviceTensor,
    seed: u32,
    scratch: Scratch,
) -> Result<VerifyResult, BackendError> {
    let partials = reduce_tensor(backend, Op::Verify, tensor, seed, scratch)?;
    Ok(partials
        .iter()
        .fold(VerifyResult::default(), |t, w| VerifyResult {
            words_seen: t.words_seen + u64::from(w[0]),
            mismatches: t.mismatches + u64::from(w[1]),
        }))
}

/// The wrapping sum of every word of a tensor. Needs a 16-byte scratch buffer on the device
/// (see [`checksum_tensor_with`] to reuse one).
pub fn checksum_tensor(
    backend: &mut dyn Backend,
    tensor: &DeviceTensor,
) -> Result<Checksum, BackendError> {
    with_scratch(backend, |b, s| checksum_tensor_with(b, tensor, s))
}

/// [`checksum_tensor`] through a scratch result buffer allocated earlier.
pub fn checksum_tensor_with(
    backend: &mut dyn Backend,
    tensor: &DeviceTensor,
    scratch: Scratch,
) -> Result<Checksum, BackendError> {
    let partials = reduce_tensor(backend, Op::Checksum, tensor, 0, scratch)?;
    Ok(partials.iter().fold(Checksum::default(), |t, w| {
        t.add(Checksum {
            sum: u64::from(w[0]) | (u64::from(w[1]) << 32),
            words: u64::from(w[2]),
        })
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pattern_depends_on_index_high_bits_and_seed() {
        assert_ne!(pattern(5, 0), pattern(5, 1));
        assert_ne!(pattern(5, 0), pattern(5 + (1 << 32), 0));
        let words: std::collections::HashSet<u32> = (0..10_000).map(|i| pattern(i, 7)).collect();
        assert_eq!(
            words.len(),
            10_000,
            "fmix32 is a bijection for a fixed high half"
        );
    }

    #[test]
    fn pattern_known_values_pin_the_definition() {
        // Pinned so a change to the host or WGSL pattern is deliberate (WGSL is checked
        // against this function on a device in tests/it/backend/wgpu/alloc.rs).
        let k = fmix32(0x7f4a_7c15);
        assert_eq!(pattern(0, 0), fmix32(k) ^ (k >> 7));
        assert_eq!(fmix32(0), 0);
        assert_eq!(fmix32(1), 0x514e_28b7);
    }

    #[test]
    fn workgroups_cover_and_stay_within_limits() {
        assert_eq!(word_workgroups(1), [1, 1, 1]);
        assert_eq!(word_workgroups(256 * 65535), [65535, 1, 1]);
        let [x, y, _] = word_workgroups(256 * 65535 + 1);
        assert_eq!((x, y), (65535, 2));
        let [x, y, _] = word_workgroups(1 << 30);
        assert!(u64::from(x) * u64::from(y) * 256 >= 1 << 30);
    }

    #[test]
    fn batched_read_backs_add_up_to_the_same_result() {
        use crate::backend::mock::MockBackend;
        use crate::plan::DType;
        let mut m = MockBackend::with_limits(1 << 20, 400, 400);
        let t = crate::tensor::allocate(&mut m, "t", DType::F32, 1000, 1).unwrap();
        fill_tensor(&mut m, &t, 4).unwrap();
        m.write_buffer(t.chunks[1].buffer, 0, &[0; 4]).unwrap();
        let s = Scratch::alloc(&mut m).unwrap();
        let one = reduce_tensor_batched(&mut m, Op::Verify, &t, 4, u64::MAX, s).unwrap();
        let many = reduce_tensor_batched(&mut m, Op::Verify, &t, 4, 150, s).unwrap();
        assert_eq!(one.len(), 1);
        assert_eq!(many.len(), t.chunks.len());
        let sum = |p: &[[u32; 4]], i: usize| p.iter().map(|w| u64::from(w[i])).sum::<u64>();
        assert_eq!((sum(&one, 0), sum(&one, 1)), (1000, 1));
        assert_eq!((sum(&many, 0), sum(&many, 1)), (1000, 1));
        let c = checksum_tensor(&mut m, &t).unwrap();
        let mut host = Vec::new();
        for ch in &t.chunks {
            let b = m.read_buffer(ch.buffer, 0, ch.bytes).unwrap();
            host.extend(
                b.chunks_exact(4)
                    .map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]])),
            );
        }
        assert_eq!(c, Checksum::of_words(&host));
    }

    #[test]
    fn checksum_of_words_wraps() {
        let c = Checksum::of_words(&[u32::MAX, u32::MAX, 2]);
        assert_eq!(c.sum, 2 * u64::from(u32::MAX) + 2);
        assert_eq!(c.words, 3);
    }
}
