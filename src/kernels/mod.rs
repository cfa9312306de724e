//! Kernel identities shared by every backend: which op, which storage type, the workgroup size,
//! and where its source lives (`shaders/<op>.wgsl`, `shaders/<op>.cu`).

pub mod params;
pub mod reference;
pub mod source;

use serde::{Deserialize, Serialize};

/// One compute kernel. The WGSL and CUDA versions take the same params struct
/// (`params.rs`) and the same buffers in the same order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Op {
    /// Write a deterministic pattern to every 32-bit word of a chunk.
    Fill,
    /// Check every word of a chunk against the fill pattern; count words seen and mismatches.
    Verify,
    /// Reduce a chunk to a checksum (wrapping sum of words and word count).
    Checksum,
    Matmul,
    Softmax,
    Attention,
    FlashAttention,
    Conv2d,
    Relu,
    Gelu,
    LayerNorm,
    Adam,
}

impl Op {
    pub const ALL: [Op; 12] = [
        Op::Fill,
        Op::Verify,
        Op::Checksum,
        Op::Matmul,
        Op::Softmax,
        Op::Attention,
        Op::FlashAttention,
        Op::Conv2d,
        Op::Relu,
        Op::Gelu,
        Op::LayerNorm,
        Op::Adam,
    ];

    /// File stem of the kernel's source in `shaders/`.
    pub fn name(self) -> &'static str {
        match self {
            Op::Fill => "fill",
            Op::Verify => "verify",
            Op::Checksum => "checksum",
            Op::Matmul => "matmul",
            Op::Softmax => "softmax",
            Op::Attention => "attention",
            Op::FlashAttention => "flash_attention",
            Op::Conv2d => "conv2d",
            Op::Relu => "relu",
            Op::Gelu => "gelu",
            Op::LayerNorm => "layer_norm",
            Op::Adam => "adam",
        }
    }
}

/// How tensor elements are stored in a buffer. 16-bit types are packed two per 32-bit word.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Storage {
    F32,
    F16,
    Bf16,
}

impl Storage {
    pub fn bytes(self) -> u64 {
        match self {
            Storage::F32 => 4,
            Storage::F16 | Storage::Bf16 => 2,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Storage::F32 => "f32",
            Storage::F16 => "f16",
            Storage::Bf16 => "bf16",
        }
    }
}

/// A kernel as a backend compiles and caches it: the op specialised to one storage type.
/// Word-level kernels (fill, verify, checksum) ignore the storage type; use `F32` for them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct KernelId {
    pub op: Op,
    pub storage: Storage,
}

impl KernelId {
    pub fn new(op: Op, storage: Storage) -> Self {
        KernelId { op, storage }
    }
    pub fn words(op: Op) -> Self {
        KernelId {
            op,
            storage: Storage::F32,
        }
    }
    /// Threads per workgroup (WGSL `@workgroup_size`, CUDA `blockDim`), the same on every backend.
    pub fn workgroup_size(self) -> [u32; 3] {
        source::workgroup_size(self.op)
    }
    /// A stable label, e.g. `matmul_f16`.
    pub fn label(self) -> String {
        format!("{}_{}", self.op.name(), self.storage.name())
    }
}

/// murmur3's 32-bit finaliser (the same as `fmix32` in `shaders/fill.wgsl`).
pub fn fmix32(x: u32) -> u32 {
    let mut h = x;
    h ^= h >> 16;
    h = h.wrapping_mul(0x85eb_ca6b);
    h ^= h >> 13;
    h = h.wrapping_mul(0xc2b2_ae35);
    h ^= h >> 16;
    h
}

/// The word the fill kernel writes at tensor word `index` for `seed` (bit-identical to WGSL).
pub fn pattern(index: u64, seed: u32) -> u32 {
    let lo = index as u32;
    let hi = (index >> 32) as u32;
    let k = fmix32(seed ^ hi.wrapping_mul(0x9e37_79b9).wrapping_add(0x7f4a_7c15));
    fmix32(lo ^ k) ^ (k >> 7)
}
