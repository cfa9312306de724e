//! GPT-2 (`GPT2LMHeadModel`): learned positions, LayerNorm, fused `c_attn` with biases, GELU
//! MLP, tied head; the causal mask is added in the embeddings' type.

use super::spec::{Embed, Head, SoftmaxCode, Spec};
use crate::workload::Workload;

pub(super) fn spec(_w: &Workload) -> Spec {
    let softmax = SoftmaxCode {
        fp32: false,
        mask_promotes: true,
        cast_back: true,
    };
    Spec {
        learned_positions: true,
        fused_qkv: true,
        causal: true,
        ..Spec::layer_norm_family(Embed::Tokens, Head::Lm, softmax)
    }
}
