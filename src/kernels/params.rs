//! Kernel parameter structs (`#[repr(C)]`, Pod), laid out identically in WGSL (`struct Params`,
//! a uniform at `@group(0) @binding(0)`) and CUDA (the first kernel argument, by value).
//! Storage buffers follow at bindings 1.. in the order the op documents.
//! Every struct is a multiple of 16 bytes (uniform layout rules).

use bytemuck::{Pod, Zeroable};

/// Fill / Verify / Checksum over one chunk of 32-bit words.
/// `first_word` is the chunk's offset in words within its tensor (split in two u32 for WGSL),
/// so the pattern continues across chunk boundaries.
/// Fill: binding 1 = data (read_write).
/// Verify: binding 1 = data (read), binding 2 = result [words_seen, mismatches] (atomic u32).
/// Checksum: binding 1 = data (read), binding 2 = result [sum_lo, sum_hi_or_xor, words_seen, _].
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable, PartialEq, Eq)]
pub struct WordParams {
    pub first_word_lo: u32,
    pub first_word_hi: u32,
    pub len_words: u32,
    pub seed: u32,
}
