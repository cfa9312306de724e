//! ViT (`ViTForImageClassification`): patch convolution, class token and positions, pre-LN
//! encoder with separate q, k, v with biases, GELU MLP, a classifier over the class token.

use super::spec::{Embed, Head, Mlp, Norm, SoftmaxCode, Spec};
use crate::workload::Workload;

pub(super) fn spec(_w: &Workload) -> Spec {
    Spec {
        norm: Norm::Layer,
        mlp: Mlp::Gelu,
        embed: Embed::Patches,
        head: Head::Classifier,
        learned_positions: false,
        fused_qkv: false,
        fused_gate_up: false,
        qkv_bias: true,
        o_bias: true,
        mlp_bias: true,
        qk_norm: false,
        rope: false,
        causal: false,
        softmax: SoftmaxCode {
            fp32: true,
            mask_promotes: false,
            cast_back: true,
        },
        sandwich_norms: false,
        embed_scale: false,
    }
}
