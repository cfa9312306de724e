//! The sizes PyTorch's caching allocator rounds to and carves segments in
//! (c10/cuda/CUDACachingAllocator.cpp): what the allocator and its settings both read.

/// All sizes are rounded to at least 512 bytes.
pub const MIN_BLOCK: u64 = 512;
/// The largest "small" allocation.
pub const SMALL_SIZE: u64 = 1 << 20;
/// Small allocations are packed in 2 MiB segments.
pub const SMALL_BUFFER: u64 = 2 << 20;
/// Allocations between 1 and 10 MiB may use a 20 MiB segment.
pub const MIN_LARGE_ALLOC: u64 = 10 << 20;
/// Large segments are rounded up to 2 MiB.
pub const ROUND_LARGE: u64 = 2 << 20;
/// The 20 MiB segment of 1-10 MiB requests.
pub const LARGE_BUFFER: u64 = 20 << 20;
