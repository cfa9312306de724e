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

/// Element format codes used in params where a tensor's format is chosen at run time
/// (`AdamParams::*_fmt`, `FlashParams::stats_fmt`); the same codes as `shaders/codec.wgsl`.
pub fn fmt_code(storage: super::Storage) -> u32 {
    match storage {
        super::Storage::F32 => 0,
        super::Storage::F16 => 1,
        super::Storage::Bf16 => 2,
    }
}

/// `matmul` (bindings 1 = A, 2 = B, 3 = C). All offsets and strides in elements of the bound
/// buffers. For b < batch, i < m, j < n:
/// `C[c_off + b*c_sb + i*c_sm + j] = alpha * Σ_t A[a_off + b*a_sb + i*a_sm + t*a_sk]
///  * B[b_off + b*b_sb + t*b_sk + j*b_sn]`.
/// Grid: `[ceil(n/64), ceil(m/64), batch]` (64x64 output tile per 16x16 workgroup).
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable, PartialEq)]
pub struct MatmulParams {
    pub m: u32,
    pub n: u32,
    pub k: u32,
    pub batch: u32,
    pub a_off: u32,
    pub a_sb: u32,
    pub a_sm: u32,
    pub a_sk: u32,
    pub b_off: u32,
    pub b_sb: u32,
    pub b_sk: u32,
    pub b_sn: u32,
    pub c_off: u32,
    pub c_sb: u32,
    pub c_sm: u32,
    pub alpha: f32,
}

/// Output tile of one matmul workgroup (rows and columns).
pub const MATMUL_TILE: u32 = 64;

/// `softmax` and `attention` (bindings 1 = X, 2 = Y), one workgroup per row; rows are
/// `wid.x + wid.y * num_workgroups.x`. Row r: `v_j = scale * X[x_off + r*cols + j]`,
/// `Y[y_off + r*cols + j] = exp(v_j - max v) / Σ exp(v - max v)`. The `attention` op also
/// applies a causal mask when `q_period > 0`: row r is query `(q_row0 + r) % q_period` and only
/// columns `j <= query` take part; masked outputs are 0.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable, PartialEq)]
pub struct SoftmaxParams {
    pub rows: u32,
    pub cols: u32,
    pub x_off: u32,
    pub y_off: u32,
    pub scale: f32,
    pub q_row0: u32,
    pub q_period: u32,
    pub _pad: u32,
}

/// `layer_norm` (bindings 1 = X, 2 = Y), one workgroup per row (as softmax):
/// `Y = (X - mean) / sqrt(var + eps)` per row, population variance, unit gain, zero bias.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable, PartialEq)]
pub struct LayerNormParams {
    pub rows: u32,
    pub cols: u32,
    pub x_off: u32,
    pub y_off: u32,
    pub eps: f32,
    pub _pad: [u32; 3],
}

/// `relu` and `gelu` (bindings 1 = X, 2 = Y): `Y[y_off + i] = f(X[x_off + i])` for i < len,
/// one thread per element, flat index `(wid.x + wid.y * num_workgroups.x) * 256 + lid.x`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable, PartialEq, Eq)]
pub struct ElemParams {
    pub len: u32,
    pub x_off: u32,
    pub y_off: u32,
    pub _pad: u32,
}

/// `conv2d` (bindings 1 = X, 2 = W, 3 = Y): NCHW, square kernel, zero padding; one thread per
/// output element of the `n` images of this dispatch (flat index as `ElemParams`).
/// `h_out = (h + 2 pad - kernel) / stride + 1`, `w_out` likewise.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable, PartialEq, Eq)]
pub struct Conv2dParams {
    pub n: u32,
    pub c_in: u32,
    pub h: u32,
    pub w: u32,
    pub c_out: u32,
    pub kernel: u32,
    pub stride: u32,
    pub pad: u32,
    pub h_out: u32,
    pub w_out: u32,
    pub x_off: u32,
    pub w_off: u32,
    pub y_off: u32,
    pub _pad: [u32; 3],
}

/// A convolution's output height and width (`h_out`, `w_out` above); None when the kernel does
/// not fit the padded input or the stride is 0. The one formula the reference and `ops` share.
pub fn conv_out_hw(h: u64, w: u64, kernel: u64, stride: u64, pad: u64) -> Option<(u64, u64)> {
    if stride == 0 || kernel == 0 {
        return None;
    }
    let hp = (h + 2 * pad).checked_sub(kernel)?;
    let wp = (w + 2 * pad).checked_sub(kernel)?;
    Some((hp / stride + 1, wp / stride + 1))
}

/// `flash_attention` (bindings 1 = Q, 2 = K, 3 = V, 4 = O, 5 = S). Head h of the dispatch:
/// Q/O at `<t>_off + h*seq*head_dim` ([seq][head_dim]), K/V at `<t>_off +
/// (h / kv_group)*seq*head_dim` (grouped-query attention; `kv_group` 0 reads as 1), stats S at `s_off + h*seq*2`
/// ([seq][2] = row max of the scaled scores, row sum of exp(score - max)), S in format
/// `stats_fmt` (see [`fmt_code`]). `head_dim <= 256`. Grid `[ceil(seq/64), heads, 1]`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable, PartialEq)]
pub struct FlashParams {
    pub heads: u32,
    pub seq: u32,
    pub head_dim: u32,
    pub causal: u32,
    pub q_off: u32,
    pub k_off: u32,
    pub v_off: u32,
    pub o_off: u32,
    pub s_off: u32,
    pub stats_fmt: u32,
    pub scale: f32,
    pub kv_group: u32,
}

/// Largest head dimension the flash kernel takes.
pub const FLASH_MAX_HEAD_DIM: u32 = 256;
/// Query rows per flash workgroup.
pub const FLASH_ROWS: u32 = 64;

/// `adam` (bindings 1 = P, 2 = G, 3 = M, 4 = V; P, M, V updated in place), one thread per
/// element. Each tensor has its own format code ([`fmt_code`]); `bc1 = 1 - beta1^t`,
/// `bc2 = 1 - beta2^t`.
#[repr(C)]
#[derive(Debug, Clone, Copy, Pod, Zeroable, PartialEq)]
pub struct AdamParams {
    pub len: u32,
    pub p_off: u32,
    pub g_off: u32,
    pub m_off: u32,
    pub v_off: u32,
    pub p_fmt: u32,
    pub g_fmt: u32,
    pub m_fmt: u32,
    pub v_fmt: u32,
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    pub bc1: f32,
    pub bc2: f32,
    pub _pad: u32,
}

/// Bytes of the params struct an op takes (the first kernel argument in CUDA, the uniform in
/// WGSL).
pub fn params_bytes(op: super::Op) -> usize {
    use super::Op;
    use std::mem::size_of;
    match op {
        Op::Fill | Op::Verify | Op::Checksum => size_of::<WordParams>(),
        Op::Matmul => size_of::<MatmulParams>(),
        Op::Softmax | Op::Attention => size_of::<SoftmaxParams>(),
        Op::LayerNorm => size_of::<LayerNormParams>(),
        Op::Relu | Op::Gelu => size_of::<ElemParams>(),
        Op::Conv2d => size_of::<Conv2dParams>(),
        Op::FlashAttention => size_of::<FlashParams>(),
        Op::Adam => size_of::<AdamParams>(),
    }
}

/// Storage buffers an op binds after its params (bindings 1.., as documented above).
pub fn buffer_count(op: super::Op) -> usize {
    use super::Op;
    match op {
        Op::Fill => 1,
        Op::Verify | Op::Checksum => 2,
        Op::Softmax | Op::Attention | Op::LayerNorm | Op::Relu | Op::Gelu => 2,
        Op::Matmul | Op::Conv2d => 3,
        Op::Adam => 4,
        Op::FlashAttention => 5,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_are_uniform_sized() {
        for (name, size) in [
            ("word", std::mem::size_of::<WordParams>()),
            ("matmul", std::mem::size_of::<MatmulParams>()),
            ("softmax", std::mem::size_of::<SoftmaxParams>()),
            ("layer_norm", std::mem::size_of::<LayerNormParams>()),
            ("elem", std::mem::size_of::<ElemParams>()),
            ("conv2d", std::mem::size_of::<Conv2dParams>()),
            ("flash", std::mem::size_of::<FlashParams>()),
            ("adam", std::mem::size_of::<AdamParams>()),
        ] {
            assert_eq!(size % 16, 0, "{name} params are {size} bytes");
        }
        assert_eq!(std::mem::size_of::<MatmulParams>(), 64);
        assert_eq!(std::mem::size_of::<FlashParams>(), 48);
    }
}
