//! torch.autocast's op lists as data, keyed by device type, and the output dtype they give an op.
//!
//! Source: PyTorch `aten/src/ATen/autocast_mode.h` (torch 2.15.0, git d0f2af8b, the header the
//! validation venv installs: `AT_FORALL_LOWER_PRECISION_FP`, `AT_FORALL_FP32`,
//! `AT_FORALL_FP32_SET_OPT_DTYPE`, `AT_FORALL_PROMOTE`) and `aten/src/ATen/autocast_mode.cpp`
//! (pytorch/pytorch 008ec6b1): the `AutocastCUDA` registration is those four macro lists plus
//! `cudnn_convolution(_transpose)`; `AutocastCPU` registers its own, shorter lists (no
//! `layer_norm`, `softmax`, `log_softmax`, `pow` on CPU; `cross_entropy_loss` is fp32 there).
//!
//! Policies (`autocast_mode.h`, `CastPolicy`): `lower_precision_fp` casts floating inputs to the
//! autocast dtype (fp16/bf16) and runs there; `fp32` casts inputs to fp32; `fp32_set_opt_dtype`
//! runs the op with `dtype=float32` (softmax, log_softmax, sum: fp32 output); `promote` runs in
//! the widest input type. An op on no list runs in its inputs' promoted type.
//!
//! The weight-cast cache (`cached_cast` in `autocast_mode.cpp`): the lower-precision cast of a
//! tensor that is fp32, a leaf, requires grad and is not a view (a parameter) is cached until the
//! outermost autocast region exits (`clear_cache`); every other cast is a fresh tensor.
//! Predictions use the CUDA lists; the CPU lists exist so that CPU measurements
//! (`tests/fixtures/validation_autocast.json`) check the same model.

use super::DType;

/// The device type whose autocast op lists apply (a workload's field, so the workload owns it).
pub use crate::workload::AutocastDevice as Device;

/// An autocast cast policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    LowerPrecision,
    Fp32,
    Fp32SetOptDtype,
    Promote,
}

/// CUDA: `AT_FORALL_LOWER_PRECISION_FP` + the cuDNN convolutions.
const CUDA_LOWER: &[&str] = &[
    "_convolution",
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_tbc",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "convolution",
    "prelu",
    "addmm",
    "addmv",
    "addr",
    "matmul",
    "einsum",
    "mm",
    "mv",
    "linalg_vecdot",
    "linear",
    "addbmm",
    "baddbmm",
    "bmm",
    "chain_matmul",
    "linalg_multi_dot",
    "_thnn_fused_lstm_cell",
    "_thnn_fused_gru_cell",
    "lstm_cell",
    "gru_cell",
    "rnn_tanh_cell",
    "rnn_relu_cell",
    "_scaled_dot_product_flash_attention",
    "scaled_dot_product_attention",
    "cudnn_convolution",
    "cudnn_convolution_transpose",
];

/// CUDA: `AT_FORALL_FP32`.
const CUDA_FP32: &[&str] = &[
    "acos",
    "asin",
    "cosh",
    "erfinv",
    "exp",
    "expm1",
    "log",
    "log10",
    "log2",
    "log1p",
    "reciprocal",
    "rsqrt",
    "sinh",
    "tan",
    "pow",
    "softplus",
    "layer_norm",
    "native_layer_norm",
    "rms_norm",
    "group_norm",
    "frobenius_norm",
    "nuclear_norm",
    "cosine_similarity",
    "poisson_nll_loss",
    "cosine_embedding_loss",
    "nll_loss",
    "nll_loss2d",
    "hinge_embedding_loss",
    "kl_div",
    "l1_loss",
    "smooth_l1_loss",
    "huber_loss",
    "mse_loss",
    "margin_ranking_loss",
    "multilabel_margin_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
    "multi_margin_loss",
    "binary_cross_entropy_with_logits",
    "dist",
    "pdist",
    "cdist",
    "renorm",
    "logsumexp",
    "upsample_nearest1d",
    "_upsample_nearest_exact1d",
    "upsample_nearest2d",
    "_upsample_nearest_exact2d",
    "upsample_nearest3d",
    "_upsample_nearest_exact3d",
    "upsample_linear1d",
    "upsample_bilinear2d",
    "_upsample_bilinear2d_aa",
    "upsample_trilinear3d",
    "upsample_bicubic2d",
    "_upsample_bicubic2d_aa",
    // fp32_append_dtype (AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE)
    "norm",
];

/// CUDA: `AT_FORALL_FP32_SET_OPT_DTYPE`.
const CUDA_FP32_SET_OPT_DTYPE: &[&str] = &[
    "prod",
    "softmax",
    "log_softmax",
    "cumprod",
    "cumsum",
    "linalg_vector_norm",
    "linalg_matrix_norm",
    "sum",
];

/// `AT_FORALL_PROMOTE` (CUDA; CPU registers none of these as promote).
const CUDA_PROMOTE: &[&str] = &[
    "addcdiv",
    "addcmul",
    "atan2",
    "bilinear",
    "cross",
    "dot",
    "vdot",
    "grid_sampler",
    "index_put",
    "tensordot",
    "scatter_add",
];

/// CPU: `TORCH_LIBRARY_IMPL(aten, AutocastCPU, m)`, lower_precision_fp.
const CPU_LOWER: &[&str] = &[
    "conv1d",
    "conv2d",
    "conv3d",
    "bmm",
    "mm",
    "linalg_vecdot",
    "baddbmm",
    "addmm",
    "_addmm_activation",
    "addbmm",
    "linear",
    "_convolution",
    "matmul",
    "conv_tbc",
    "mkldnn_rnn_layer",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "prelu",
    "scaled_dot_product_attention",
    "_native_multi_head_attention",
];

/// CPU: fp32 (the ops a transformer or CNN step can reach; the CPU list also has linear
/// algebra, FFTs and padding ops, none of which these plans use).
const CPU_FP32: &[&str] = &[
    "avg_pool3d",
    "binary_cross_entropy",
    "grid_sampler",
    "polar",
    "prod",
    "quantile",
    "nanquantile",
    "stft",
    "cdist",
    "trace",
    "max_pool3d",
    "adaptive_avg_pool3d",
    "mse_loss",
    "cosine_embedding_loss",
    "nll_loss",
    "nll_loss2d",
    "hinge_embedding_loss",
    "poisson_nll_loss",
    "smooth_l1_loss",
    "cross_entropy_loss",
    "l1_loss",
    "huber_loss",
    "margin_ranking_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
    "multi_margin_loss",
    "ctc_loss",
    "kl_div",
    "multilabel_margin_loss",
    "binary_cross_entropy_with_logits",
];

/// The policy autocast gives `op` on `device`, or None (the op runs in its inputs' type).
pub fn policy(device: Device, op: &str) -> Option<Policy> {
    let lists: [(&[&str], Policy); 4] = match device {
        Device::Cuda => [
            (CUDA_LOWER, Policy::LowerPrecision),
            (CUDA_FP32, Policy::Fp32),
            (CUDA_FP32_SET_OPT_DTYPE, Policy::Fp32SetOptDtype),
            (CUDA_PROMOTE, Policy::Promote),
        ],
        Device::Cpu => [
            (CPU_LOWER, Policy::LowerPrecision),
            (CPU_FP32, Policy::Fp32),
            (&[], Policy::Fp32SetOptDtype),
            (&[], Policy::Promote),
        ],
    };
    lists
        .iter()
        .find(|(ops, _)| ops.contains(&op))
        .map(|&(_, p)| p)
}

/// The wider of two floating types (PyTorch's type promotion; fp16 with bf16 gives fp32).
pub fn promote(a: DType, b: DType) -> DType {
    match (a, b) {
        (x, y) if x == y => x,
        (DType::F32, _) | (_, DType::F32) => DType::F32,
        (DType::F16, DType::Bf16) | (DType::Bf16, DType::F16) => DType::F32,
        (x, DType::U8 | DType::I64) => x,
        (_, y) => y,
    }
}

/// Autocast in effect: the device whose lists apply and the lower-precision type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Autocast {
    pub device: Device,
    pub low: DType,
}

impl Autocast {
    /// The type `op` computes in (and, for ops whose output follows it, returns) given its
    /// floating inputs' types.
    pub fn compute(&self, op: &str, inputs: &[DType]) -> DType {
        let promoted = inputs.iter().copied().reduce(promote).unwrap_or(DType::F32);
        match policy(self.device, op) {
            Some(Policy::LowerPrecision) => self.low,
            Some(Policy::Fp32 | Policy::Fp32SetOptDtype) => DType::F32,
            Some(Policy::Promote) | None => promoted,
        }
    }
    /// Whether `op` casts an input of type `input` to another type first (a new tensor; what
    /// the op's backward saves is that copy, not the input).
    pub fn casts_input(&self, op: &str, input: DType) -> bool {
        match policy(self.device, op) {
            Some(Policy::LowerPrecision) => input != self.low,
            Some(Policy::Fp32) => input != DType::F32,
            _ => false,
        }
    }
}

/// The output type of `op` over `inputs` with or without autocast.
pub fn out_dtype(ac: Option<Autocast>, op: &str, inputs: &[DType]) -> DType {
    match ac {
        Some(a) => a.compute(op, inputs),
        None => inputs.iter().copied().reduce(promote).unwrap_or(DType::F32),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cuda_and_cpu_lists_differ_where_pytorch_says() {
        // layer_norm, softmax, log_softmax and pow are fp32 on CUDA only.
        for op in ["layer_norm", "pow"] {
            assert_eq!(policy(Device::Cuda, op), Some(Policy::Fp32), "{op}");
            assert_eq!(policy(Device::Cpu, op), None, "{op}");
        }
        for op in ["softmax", "log_softmax"] {
            assert_eq!(policy(Device::Cuda, op), Some(Policy::Fp32SetOptDtype));
            assert_eq!(policy(Device::Cpu, op), None);
        }
        assert_eq!(
            policy(Device::Cpu, "cross_entropy_loss"),
            Some(Policy::Fp32)
        );
        assert_eq!(policy(Device::Cuda, "cross_entropy_loss"), None);
        for d in [Device::Cuda, Device::Cpu] {
            for op in ["linear", "addmm", "bmm", "matmul", "conv2d"] {
                assert_eq!(policy(d, op), Some(Policy::LowerPrecision), "{op}");
            }
            assert_eq!(policy(d, "nll_loss"), Some(Policy::Fp32));
            // Not on any list: GELU, dropout, batch norm, relu, add.
            for op in [
                "gelu",
                "native_dropout",
                "batch_norm",
                "relu",
                "add",
                "tanh",
            ] {
                assert_eq!(policy(d, op), None, "{op}");
            }
        }
    }

    #[test]
    fn output_types() {
        let cuda = Autocast {
            device: Device::Cuda,
            low: DType::F16,
        };
        let cpu = Autocast {
            device: Device::Cpu,
            low: DType::Bf16,
        };
        assert_eq!(
            cuda.compute("linear", &[DType::F32, DType::F32]),
            DType::F16
        );
        assert_eq!(cuda.compute("softmax", &[DType::F16]), DType::F32);
        assert_eq!(cpu.compute("softmax", &[DType::Bf16]), DType::Bf16);
        assert_eq!(cpu.compute("add", &[DType::Bf16, DType::F32]), DType::F32);
        assert!(cuda.casts_input("layer_norm", DType::F16));
        assert!(!cuda.casts_input("layer_norm", DType::F32));
        assert!(cpu.casts_input("linear", DType::F32));
        assert_eq!(out_dtype(None, "linear", &[DType::F16]), DType::F16);
        assert_eq!(promote(DType::F16, DType::Bf16), DType::F32);
    }
}
