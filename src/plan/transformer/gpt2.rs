//! GPT-2 (`GPT2LMHeadModel`): learned positions, LayerNorm, fused `c_attn` with biases, GELU
//! MLP, tied head; the causal mask is added in the embeddings' type.

use super::spec::{Embed, Head, Mlp, Norm, SoftmaxCode, Spec};
use crate::workload::Workload;

pub(super) fn spec(_w: &Workload) -> Spec {
    Spec {
        norm: Norm::Layer,
        mlp: Mlp::Gelu,
        embed: Embed::Tokens,
        head: Head::Lm,
        learned_positions: true,
        fused_qkv: true,
        fused_gate_up: false,
        qkv_bias: true,
        o_bias: true,
        mlp_bias: true,
        qk_norm: false,
        rope: false,
        causal: true,
        softmax: SoftmaxCode {
            fp32: false,
            mask_promotes: true,
            cast_back: true,
        },
        sandwich_norms: false,
        embed_scale: false,
    }
}
