//! BERT (`BertForMaskedLM`): post-LN encoder (its stored tensors have the pre-LN layer's shapes
//! and count, so it is built with the same layer), embeddings LayerNorm, separate q, k, v with
//! biases, GELU MLP, the MLM head tied to the word embeddings; no cast back after the softmax.

use super::spec::{Embed, Head, Mlp, Norm, SoftmaxCode, Spec};
use crate::workload::Workload;

pub(super) fn spec(_w: &Workload) -> Spec {
    Spec {
        norm: Norm::Layer,
        mlp: Mlp::Gelu,
        embed: Embed::TokensNorm,
        head: Head::Mlm,
        learned_positions: true,
        fused_qkv: false,
        fused_gate_up: false,
        qkv_bias: true,
        o_bias: true,
        mlp_bias: true,
        qk_norm: false,
        rope: false,
        causal: false,
        softmax: SoftmaxCode {
            fp32: false,
            mask_promotes: false,
            cast_back: false,
        },
        sandwich_norms: false,
        embed_scale: false,
    }
}
