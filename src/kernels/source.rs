//! Kernel sources (`shaders/*.wgsl`, `shaders/*.cu`) and their fixed workgroup sizes.

use super::Op;

/// Threads per workgroup of each op (the same in WGSL and CUDA).
pub fn workgroup_size(op: Op) -> [u32; 3] {
    match op {
        Op::Matmul | Op::Conv2d => [16, 16, 1],
        _ => [256, 1, 1],
    }
}
