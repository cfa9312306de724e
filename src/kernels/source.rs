//! Kernel sources (`shaders/*.wgsl`, `shaders/*.cu`) and their fixed workgroup sizes.

use super::{KernelId, Op};

/// Threads per workgroup of each op (the same in WGSL and CUDA).
pub fn workgroup_size(op: Op) -> [u32; 3] {
    match op {
        Op::Matmul => [16, 16, 1],
        Op::FlashAttention => [64, 1, 1],
        _ => [256, 1, 1],
    }
}

/// The fill pattern (`fmix32`, `pattern`) that fill and verify share.
pub const WORD_PATTERN_WGSL: &str = include_str!("../../shaders/word_pattern.wgsl");

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

/// The element codec every compute kernel shares (`shaders/codec.wgsl`): decode/encode f32,
/// f16 and bf16 elements packed in 32-bit words, and the kernel-storage shorthands.
pub const WGSL_CODEC: &str = include_str!("../../shaders/codec.wgsl");

/// X/Y bindings with `ld_x`/`st_y`, shared by the row and elementwise kernels.
pub const ROW_IO_WGSL: &str = include_str!("../../shaders/row_io.wgsl");
/// `reduce_sum`/`reduce_max` over a workgroup, shared by softmax, attention and layer norm.
pub const ROW_REDUCE_WGSL: &str = include_str!("../../shaders/row_reduce.wgsl");
/// The entry point of the elementwise kernels (relu, gelu), which define `f`.
pub const ELEMENTWISE_WGSL: &str = include_str!("../../shaders/elementwise.wgsl");

/// The complete WGSL module for a kernel. Word ops (fill, verify, checksum) are their file
/// alone. A compute kernel is composed as:
/// 1. the storage prelude `shaders/storage_<type>.wgsl` (`const FMT`, `const EPW`),
/// 2. `shaders/codec.wgsl` (load/store helpers over `array<u32>` words),
/// 3. `const WG_X/WG_Y/WG_Z` from [`workgroup_size`] (the op uses `@workgroup_size(WG_X, ..)`),
/// 4. the op's file; `softmax` gets `const MASKED: bool = false;` first, and `attention` is
///    `attention.wgsl` (which sets `MASKED = true`) followed by `softmax.wgsl`. Row kernels
///    (softmax, attention, layer norm) get `row_io.wgsl` and `row_reduce.wgsl` before it;
///    elementwise kernels (relu, gelu) get `row_io.wgsl` before it and `elementwise.wgsl` after.
pub fn wgsl_source(id: KernelId) -> String {
    match id.op {
        Op::Fill | Op::Verify => format!("{WORD_PATTERN_WGSL}\n{}", wgsl_file(id.op)),
        Op::Checksum => wgsl_file(id.op).to_string(),
        op => {
            let [x, y, z] = workgroup_size(op);
            let body = match op {
                Op::Softmax => format!(
                    "const MASKED: bool = false;\n{ROW_IO_WGSL}\n{ROW_REDUCE_WGSL}\n{}",
                    wgsl_file(op)
                ),
                Op::Attention => format!(
                    "{ROW_IO_WGSL}\n{ROW_REDUCE_WGSL}\n{}\n{}",
                    wgsl_file(op),
                    wgsl_file(Op::Softmax)
                ),
                Op::LayerNorm => format!("{ROW_IO_WGSL}\n{ROW_REDUCE_WGSL}\n{}", wgsl_file(op)),
                Op::Relu | Op::Gelu => {
                    format!("{ROW_IO_WGSL}\n{}\n{ELEMENTWISE_WGSL}", wgsl_file(op))
                }
                _ => wgsl_file(op).to_string(),
            };
            format!(
                "{}\n{}\nconst WG_X: u32 = {x}u;\nconst WG_Y: u32 = {y}u;\nconst WG_Z: u32 = {z}u;\n{}",
                storage_prelude(id.storage),
                WGSL_CODEC,
                body
            )
        }
    }
}

fn storage_prelude(storage: super::Storage) -> &'static str {
    match storage {
        super::Storage::F32 => include_str!("../../shaders/storage_f32.wgsl"),
        super::Storage::F16 => include_str!("../../shaders/storage_f16.wgsl"),
        super::Storage::Bf16 => include_str!("../../shaders/storage_bf16.wgsl"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::Storage;
    use wgpu::naga;

    const COMPUTE: [Op; 9] = [
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

    /// Every compute kernel parses and validates (naga, the compiler wgpu uses) for every
    /// storage type, with one `main` entry point of the fixed workgroup size.
    #[test]
    fn compute_kernels_validate() {
        for op in COMPUTE {
            for storage in [Storage::F32, Storage::F16, Storage::Bf16] {
                let id = KernelId::new(op, storage);
                let src = wgsl_source(id);
                let module = naga::front::wgsl::parse_str(&src)
                    .unwrap_or_else(|e| panic!("{}: {}", id.label(), e.emit_to_string(&src)));
                naga::valid::Validator::new(
                    naga::valid::ValidationFlags::all(),
                    // pack2x16float / unpack2x16float (granted on every Vulkan, Metal, DX12 device).
                    naga::valid::Capabilities::SHADER_FLOAT16_IN_FLOAT32,
                )
                .validate(&module)
                .unwrap_or_else(|e| panic!("{}: {}", id.label(), e.emit_to_string(&src)));
                assert_eq!(module.entry_points.len(), 1, "{}", id.label());
                let ep = &module.entry_points[0];
                assert_eq!(ep.name, "main");
                assert_eq!(ep.workgroup_size, workgroup_size(op), "{}", id.label());
            }
        }
    }
}
