//! A decoder described by its layers alone (`Arch::Decoder`): the op-level spec comes from the
//! model's layer records (`workload::layers`). The layer a step starts from is the first; the
//! builder switches the MLP layer by layer (`T::enter_layer`).

use super::spec::{Mlp, Norm, Spec};
use crate::workload::layers::{BlockForm, Mixer, MlpSpec, NormKind, QkNorm};
use crate::workload::Workload;

pub(super) fn spec(w: &Workload) -> Spec {
    let mut s = Spec::llama(w);
    let Some(m) = &w.model else {
        return s;
    };
    s.norm = match m.norm {
        NormKind::Rms => Norm::Rms,
        NormKind::Layer => Norm::Layer,
        NormKind::LayerNoBias => Norm::Centered,
    };
    s.sandwich_norms = m
        .layers
        .first()
        .is_some_and(|l| l.block == BlockForm::Sandwich);
    if let Some(a) = m.layers.iter().find_map(|l| match l.mixer {
        Mixer::Attention(a) => Some(a),
        _ => None,
    }) {
        s.qkv_bias = a.qkv_bias;
        s.o_bias = a.o_bias;
        s.qk_norm = !matches!(a.qk_norm, QkNorm::None | QkNorm::L2);
        s.fused_qkv = a.fused_qkv;
    }
    if let Some(l) = m.layers.first() {
        s.mlp = mlp_kind(&l.mlp);
    }
    s
}

/// The spec's MLP kind of one layer's MLP.
pub(super) fn mlp_kind(m: &MlpSpec) -> Mlp {
    match m {
        MlpSpec::Moe(_) => Mlp::Moe,
        MlpSpec::Dense { gated: false, .. } => Mlp::Gelu,
        _ => Mlp::Gated,
    }
}
