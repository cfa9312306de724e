//! Parameter groups of a transformer (`pieces`), their element counts and largest tensors,
//! and what autocast's weight cache copies of each, from the family's `Spec`.

use super::spec::{Embed, Head, Mlp, Spec};
use super::spec_of;
use crate::plan::build::{prod, sum, PlanError};
use crate::plan::params::Piece;
use crate::workload::{presets::vit_tokens, Workload};

/// Attention widths: (query width a·d, key/value width g·d, head width d).
pub(super) fn widths(w: &Workload) -> Result<(u64, u64, u64), PlanError> {
    let d = w.head_dim();
    let e = "the attention width";
    Ok((prod(&[w.heads, d], e)?, prod(&[w.kv_heads(), d], e)?, d))
}

/// (elements, largest tensor's elements) of one parameter group.
type Group = (u64, u64);

/// Parameter elements of one layer's attention block (with its norms) and MLP block (with its
/// norms), and of the largest single parameter tensor in each (for-loop Adam's temporaries are
/// one parameter at a time).
fn block_params(w: &Workload, s: &Spec) -> Result<(Group, Group), PlanError> {
    let (h, f) = (w.hidden, w.ffn);
    let (qw, kvw, d) = widths(w)?;
    let e = "the per-layer parameter count";
    let norms = |n: u64| prod(&[s.norm_params(h), n], e);
    let sandwich = if s.sandwich_norms { 2 } else { 1 };
    let q = prod(&[h, qw], e)?;
    let kv = prod(&[h, kvw], e)?;
    let qkv = sum(&[q, kv, kv], e)?;
    let mut attn = vec![qkv, q, norms(sandwich)?];
    if s.qkv_bias {
        attn.extend([qw, kvw, kvw]);
    }
    if s.o_bias {
        attn.push(h);
    }
    if s.qk_norm {
        attn.push(2 * d);
    }
    let attn_largest = if s.fused_qkv { qkv } else { q.max(kv) };
    let hf = prod(&[h, f], e)?;
    let (mlp, mlp_largest) = match s.mlp {
        Mlp::Gelu => {
            let mut v = vec![prod(&[2, hf], e)?, norms(1)?];
            if s.mlp_bias {
                v.extend([f, h]);
            }
            (sum(&v, e)?, hf)
        }
        Mlp::Gated => {
            let mut v = vec![prod(&[3, hf], e)?, norms(sandwich)?];
            if s.mlp_bias {
                v.extend([2 * f, h]);
            }
            let largest = if s.fused_gate_up { 2 * hf } else { hf };
            (sum(&v, e)?, largest)
        }
        Mlp::Moe => {
            let m = w
                .moe
                .ok_or_else(|| PlanError::Invalid("a mixture of experts needs experts".into()))?;
            let gate_up = prod(&[m.experts, 2, h, m.expert_ffn], e)?;
            let down = prod(&[m.experts, h, m.expert_ffn], e)?;
            let mut v = vec![prod(&[m.experts, h], e)?, gate_up, down, norms(sandwich)?];
            if m.shared_ffn > 0 {
                // The shared expert's gate, up and down, and its sigmoid gate (h -> 1).
                v.extend([prod(&[3, h, m.shared_ffn], e)?, h]);
            }
            (sum(&v, e)?, gate_up)
        }
    };
    Ok(((sum(&attn, e)?, attn_largest), (mlp, mlp_largest)))
}

/// Parameters of one transformer layer.
pub fn layer_params(w: &Workload) -> Result<u64, PlanError> {
    let ((a, _), (m, _)) = block_params(w, &spec_of(w)?)?;
    sum(&[a, m], "the per-layer parameter count")
}

/// The model's parameter groups in backward order of need: `embed` (the token embedding, also
/// the output head when tied), `embed.rest` (positions, token types, embedding norm, patch
/// embedding), per layer `L{i}.attn` and `L{i}.mlp`, `head.rest` (final norm, BERT's MLM
/// transform and decoder bias, ViT's classifier) and `head` (an untied output head).
pub fn pieces(w: &Workload) -> Result<Vec<Piece>, PlanError> {
    let s = spec_of(w)?;
    let (h, v) = (w.hidden, w.vocab);
    let e = "the parameter count";
    let emb = prod(&[v, h], e)?;
    // Learned positions grow with a longer --seq than the preset's context.
    let positions = if s.learned_positions {
        prod(&[w.max_positions.max(w.seq), h], e)?
    } else {
        0
    };
    let final_norm = s.norm_params(h);
    let (embed, embed_rest, head_rest) = match (s.embed, s.head) {
        // word; position + token type (2h) + LN (2h); MLM transform (h² + h) + LN (2h) +
        // decoder bias (V). BertForMaskedLM has no pooler.
        (Embed::TokensNorm, _) => (
            emb,
            sum(&[positions, 4 * h], e)?,
            sum(&[prod(&[h, h], e)?, 3 * h, v], e)?,
        ),
        // patch conv (3p²h + h) + class token (h) + positions (tokens·h); final LN (2h) +
        // classifier (hC + C).
        (Embed::Patches, _) => {
            let conv = sum(&[prod(&[3, w.patch, w.patch, h], e)?, h], e)?;
            let pos = prod(&[vit_tokens(w.image, w.patch), h], e)?;
            (0, sum(&[conv, h, pos], e)?, sum(&[final_norm, emb, v], e)?)
        }
        // wte (+ wpe); final norm.
        _ => (emb, positions, final_norm),
    };
    let ((attn, attn_largest), (mlp, mlp_largest)) = block_params(w, &s)?;
    // The largest single tensors of the embedding's and head's other parameters.
    let (rest_largest, head_largest) = match s.embed {
        Embed::Patches => (
            prod(&[3, w.patch, w.patch, h], e)?.max(prod(&[vit_tokens(w.image, w.patch), h], e)?),
            emb,
        ),
        Embed::TokensNorm => (positions, prod(&[h, h], e)?),
        Embed::Tokens => (positions, h),
    };
    let mut out = vec![
        Piece::new("embed", embed),
        Piece::new("embed.rest", embed_rest).largest(rest_largest),
    ];
    for i in 0..w.layers {
        out.push(Piece::new(format!("L{i}.attn"), attn).largest(attn_largest));
        out.push(Piece::new(format!("L{i}.mlp"), mlp).largest(mlp_largest));
    }
    out.push(Piece::new("head.rest", head_rest).largest(head_largest));
    if s.head != Head::Classifier && !w.tied_head() {
        out.push(Piece::new("head", emb));
    }
    out.retain(|p| p.elems > 0);
    Ok(out)
}

/// Total trainable parameters (embeddings, layers, head).
pub fn param_count(w: &Workload) -> Result<u64, PlanError> {
    let p = pieces(w)?;
    let elems: Vec<u64> = p.iter().map(|p| p.elems).collect();
    sum(&elems, "the parameter count")
}

/// Parameters of piece `name` that autocast casts to 16 bits (matmul and conv weights, and
/// biases, which no backward saves): (weights, biases, the weight and bias of the piece's first
/// matmul, which backward reaches last). Norm gains, position and token-type embeddings are
/// used in fp32 and never cast; a mixture of experts' grouped matmuls are not autocast ops
/// (transformers casts their input to the weights' type), only its router and shared expert.
pub(super) fn cast_elems(w: &Workload, name: &str) -> Result<(u64, u64, u64), PlanError> {
    let s = spec_of(w)?;
    let (h, f, v) = (w.hidden, w.ffn, w.vocab);
    let (qw, kvw, _) = widths(w)?;
    let e = "the weight-cast cache";
    let hh = prod(&[h, h], e)?;
    let hf = prod(&[h, f], e)?;
    Ok(if name.ends_with(".attn") {
        let q = prod(&[h, qw], e)?;
        let kv = prod(&[h, kvw], e)?;
        let weights = sum(&[q, kv, kv, q], e)?;
        let qkv_b = if s.qkv_bias { qw + 2 * kvw } else { 0 };
        let bias = qkv_b + if s.o_bias { h } else { 0 };
        // The first matmul: the fused projection, or q's.
        let first = if s.fused_qkv {
            sum(&[q, kv, kv, qkv_b], e)?
        } else {
            sum(&[q, if s.qkv_bias { qw } else { 0 }], e)?
        };
        (weights, bias, first)
    } else if name.ends_with(".mlp") {
        match s.mlp {
            Mlp::Gelu => {
                let b = if s.mlp_bias { f + h } else { 0 };
                let b1 = if s.mlp_bias { f } else { 0 };
                (prod(&[2, hf], e)?, b, sum(&[hf, b1], e)?)
            }
            Mlp::Gated => {
                let b = if s.mlp_bias { 2 * f + h } else { 0 };
                let b1 = if s.mlp_bias { f } else { 0 };
                let first = if s.fused_gate_up { 2 * hf } else { hf };
                (prod(&[3, hf], e)?, b, sum(&[first, b1], e)?)
            }
            Mlp::Moe => {
                let m = w.moe.unwrap_or(crate::workload::Moe {
                    experts: 0,
                    top_k: 0,
                    expert_ffn: 0,
                    shared_ffn: 0,
                });
                let router = prod(&[m.experts, h], e)?;
                let shared = if m.shared_ffn > 0 {
                    sum(&[prod(&[3, h, m.shared_ffn], e)?, h], e)?
                } else {
                    0
                };
                (sum(&[router, shared], e)?, 0, router)
            }
        }
    } else {
        match (name, s.embed) {
            ("embed" | "head", _) => {
                let vh = prod(&[v, h], e)?;
                (vh, 0, vh)
            }
            // BERT's MLM transform dense and the decoder's bias; ViT's classifier.
            ("head.rest", Embed::TokensNorm) => (hh, sum(&[h, v], e)?, sum(&[hh, h], e)?),
            ("head.rest", Embed::Patches) => {
                let hv = prod(&[h, v], e)?;
                (hv, v, sum(&[hv, v], e)?)
            }
            // ViT's patch convolution.
            ("embed.rest", Embed::Patches) => {
                let k = prod(&[3, w.patch, w.patch, h], e)?;
                (k, h, sum(&[k, h], e)?)
            }
            _ => (0, 0, 0),
        }
    })
}
