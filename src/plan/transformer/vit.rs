//! ViT (`ViTForImageClassification`): patch convolution, class token and positions, pre-LN
//! encoder with separate q, k, v with biases, GELU MLP, a classifier over the class token.

use super::spec::{Embed, Head, SoftmaxCode, Spec};
use crate::workload::Workload;

pub(super) fn spec(_w: &Workload) -> Spec {
    let softmax = SoftmaxCode {
        fp32: true,
        mask_promotes: false,
        cast_back: true,
    };
    Spec::layer_norm_family(Embed::Patches, Head::Classifier, softmax)
}
