//! BERT (`BertForMaskedLM`): post-LN encoder (its stored tensors have the pre-LN layer's shapes
//! and count, so it is built with the same layer), embeddings LayerNorm, separate q, k, v with
//! biases, GELU MLP, the MLM head tied to the word embeddings; no cast back after the softmax.
//! `BertForSequenceClassification` (`--head seq-cls`) has the pooler and a classifier instead.

use super::spec::{Embed, Head, SoftmaxCode, Spec};
use crate::workload::Workload;

pub(super) fn spec(w: &Workload) -> Spec {
    let softmax = SoftmaxCode {
        fp32: false,
        // `--attention-mask`: the extended mask, in the embeddings' type, added to the scores.
        mask_promotes: w.attention_mask,
        cast_back: false,
    };
    Spec {
        learned_positions: true,
        post_ln: true,
        holds_returns: true,
        ..Spec::layer_norm_family(
            Embed::TokensNorm,
            if w.labels.is_some() {
                Head::Pooled
            } else {
                Head::Mlm
            },
            softmax,
        )
    }
}
