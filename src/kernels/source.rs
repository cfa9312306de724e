//! Kernel sources (`shaders/*.wgsl`, `shaders/*.cu`) and their fixed workgroup sizes.

use super::{KernelId, Op};

/// Threads per workgroup of each op (the same in WGSL and CUDA).
pub fn workgroup_size(op: Op) -> [u32; 3] {
    match op {
        Op::Matmul | Op::Conv2d => [16, 16, 1],
        _ => [256, 1, 1],
    }
}

/// The raw WGSL text of an op, as stored in `shaders/`.
pub fn wgsl_file(op: Op) -> &'static str {
    match op {
        Op::Fill => include_str!("../../shaders/fill.wgsl"),
        Op::Verify => include_str!("../../shaders/verify.wgsl"),
        Op::Checksum => include_str!("../../shaders/checksum.wgsl"),
        Op::Matmul => include_str!("../../shaders/matmul.wgsl"),
        Op::Softmax => include_str!("../../shaders/softmax.wgsl"),
        Op::Attention => include_str!("../../shaders/attention.wgsl"),
        Op::FlashAttention => include_str!("../../shaders/flash_attention.wgsl"),
        Op::Conv2d => include_str!("../../shaders/conv2d.wgsl"),
        Op::Relu => include_str!("../../shaders/relu.wgsl"),
        Op::Gelu => include_str!("../../shaders/gelu.wgsl"),
        Op::LayerNorm => include_str!("../../shaders/layer_norm.wgsl"),
        Op::Adam => include_str!("../../shaders/adam.wgsl"),
    }
}

/// The complete WGSL module for a kernel: a storage prelude (`shaders/storage_<type>.wgsl`,
/// defining `load`/`store` helpers for the element type) followed by the op's source.
/// Word ops (fill, verify, checksum) get no prelude.
pub fn wgsl_source(id: KernelId) -> String {
    match id.op {
        Op::Fill | Op::Verify | Op::Checksum => wgsl_file(id.op).to_string(),
        op => format!("{}\n{}", storage_prelude(id.storage), wgsl_file(op)),
    }
}

fn storage_prelude(storage: super::Storage) -> &'static str {
    match storage {
        super::Storage::F32 => include_str!("../../shaders/storage_f32.wgsl"),
        super::Storage::F16 => include_str!("../../shaders/storage_f16.wgsl"),
        super::Storage::Bf16 => include_str!("../../shaders/storage_bf16.wgsl"),
    }
}
