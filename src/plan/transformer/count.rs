//! Parameter groups of a transformer (`pieces`), their element counts and largest tensors,
//! and what autocast's weight cache copies of each, from the family's `Spec`.

use super::spec::{Embed, Head, Mlp, Spec};
use super::spec_of;
use crate::plan::build::{prod, sum, PlanError};
use crate::plan::params::Piece;
use crate::plan::DType;
use crate::workload::layers::ModelSpec;
use crate::workload::stored::quantized_bytes;
use crate::workload::{presets::vit_tokens, Target, Workload};

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

/// A linear layer of a decoder block as PEFT and bitsandbytes see it: the targets it stands
/// for (one, or three and two for Phi-3's fused `qkv_proj` and `gate_up_proj`), its output and
/// input widths, and whether it is in the attention block.
#[derive(Debug, Clone, PartialEq)]
pub struct Linear {
    pub targets: Vec<Target>,
    pub out: u64,
    pub inp: u64,
    pub attn: bool,
}

/// The linears of one decoder layer (dense MLP), in forward order.
pub fn linears(w: &Workload) -> Result<Vec<Linear>, PlanError> {
    let s = spec_of(w)?;
    let (h, f) = (w.hidden, w.ffn);
    let (qw, kvw, _) = widths(w)?;
    let l = |targets: &[Target], out: u64, inp: u64, attn: bool| Linear {
        targets: targets.to_vec(),
        out,
        inp,
        attn,
    };
    let mut v = Vec::new();
    if s.fused_qkv {
        v.push(l(&[Target::Q, Target::K, Target::V], qw + 2 * kvw, h, true));
    } else {
        v.push(l(&[Target::Q], qw, h, true));
        v.push(l(&[Target::K], kvw, h, true));
        v.push(l(&[Target::V], kvw, h, true));
    }
    v.push(l(&[Target::O], h, qw, true));
    if s.mlp == Mlp::Moe {
        return Err(PlanError::Invalid(
            "adapters over a mixture of experts are not modelled".into(),
        ));
    }
    if s.mlp == Mlp::Gelu {
        // An ungated MLP has two: fc1 (up) and fc2 (down); no gate to adapt.
        v.push(l(&[Target::Up], f, h, false));
    } else if s.fused_gate_up {
        v.push(l(&[Target::Gate, Target::Up], 2 * f, h, false));
    } else {
        v.push(l(&[Target::Gate], f, h, false));
        v.push(l(&[Target::Up], f, h, false));
    }
    v.push(l(&[Target::Down], h, f, false));
    Ok(v)
}

/// The linears LoRA adapts in each layer (a fused linear once, if any of its targets is named).
pub fn adapted(w: &Workload) -> Result<Vec<Linear>, PlanError> {
    let Some(lora) = &w.lora else {
        return Ok(Vec::new());
    };
    Ok(linears(w)?
        .into_iter()
        .filter(|l| l.targets.iter().any(|&t| lora.adapts(t)))
        .collect())
}

/// Adapter parameters (`lora_A` r×in plus `lora_B` out×r per adapted linear) of one layer's
/// attention and MLP blocks, with their largest tensor and Adafactor's factored count.
fn adapter_pieces(w: &Workload, i: u64) -> Result<Vec<Piece>, PlanError> {
    let Some(lora) = &w.lora else {
        return Ok(Vec::new());
    };
    let r = lora.rank;
    let e = "the adapter parameter count";
    let ad = adapted(w)?;
    let mut out = Vec::new();
    for (attn, block) in [(true, "attn"), (false, "mlp")] {
        let mut elems = 0u64;
        let mut largest = 0u64;
        let mut factored = 0u64;
        for l in ad.iter().filter(|l| l.attn == attn) {
            let a = prod(&[r, l.inp], e)?;
            let b = prod(&[l.out, r], e)?;
            elems = sum(&[elems, a, b], e)?;
            largest = largest.max(a).max(b);
            factored = sum(&[factored, r, l.inp, l.out, r], e)?;
        }
        if elems > 0 {
            let mut p = Piece::new(format!("L{i}.{block}.lora"), elems).largest(largest);
            // PEFT keeps the adapters fp32 (`autocast_adapter_dtype`); LitGPT's are the
            // model's, converted with it by Fabric's true-half precision.
            p.dtype = Some(if w.framework.is_transformers() {
                DType::F32
            } else {
                crate::plan::params::param_dtype(w.precision)
            });
            p.factored = Some(factored);
            out.push(p);
        }
    }
    Ok(out)
}

/// The model's parameter groups (see `base_pieces`) as a fine-tuning run holds them: with
/// adapters or a quantized base every base piece is frozen (no gradient, no optimizer state);
/// a 4-bit or 8-bit base stores each layer's linears in bitsandbytes' layout (a `U8` piece of
/// that many bytes) and, in training, the rest in fp32 (`prepare_model_for_kbit_training`
/// upcasts every non-quantized parameter, peft 5d602fd `utils/other.py:204-209`); the
/// adapters, fp32 (`autocast_adapter_dtype`), follow each layer's blocks.
pub fn pieces(w: &Workload) -> Result<Vec<Piece>, PlanError> {
    let base = base_pieces(w)?;
    if let Some(q) = w.quant.filter(|q| !q.kind.is_bnb()) {
        return Ok(stored_pieces(w, &q, base));
    }
    if w.lora.is_none() && w.quant.is_none() {
        return Ok(base);
    }
    let upcast = w.quant.is_some_and(|q| q.prepare) && !w.inference();
    let lin = if w.quant.is_some() {
        linears(w)?
    } else {
        Vec::new()
    };
    let e = "the quantized base";
    let mut out = Vec::new();
    for mut p in base {
        p.frozen = true;
        if upcast {
            p.dtype = Some(DType::F32);
        }
        if let Some(q) = &w.quant {
            let block = if p.name.ends_with(".attn") {
                Some(true)
            } else if p.name.ends_with(".mlp") {
                Some(false)
            } else {
                None
            };
            if let Some(attn) = block {
                let mine: Vec<&Linear> = lin.iter().filter(|l| l.attn == attn).collect();
                let mut bytes = 0u64;
                let mut weights = 0u64;
                for l in &mine {
                    bytes = sum(
                        &[bytes, quantized_bytes(q.kind, q.double_quant, l.out, l.inp)],
                        e,
                    )?;
                    weights = sum(&[weights, prod(&[l.out, l.inp], e)?], e)?;
                }
                let rest_t = if upcast {
                    DType::F32
                } else {
                    crate::plan::params::param_dtype(w.precision)
                };
                let rest = prod(&[p.elems.saturating_sub(weights), rest_t.bytes()], e)?;
                p.elems = sum(&[bytes, rest], e)?;
                p.largest = p.elems;
                p.dtype = Some(DType::U8);
            } else if p.name == "head" && q.head {
                // `--quant-head`: the untied head's [V, h] weight in the same layout.
                p.elems = quantized_bytes(q.kind, q.double_quant, w.vocab, w.hidden);
                p.largest = p.elems;
                p.dtype = Some(DType::U8);
            }
        }
        let layer = p
            .name
            .strip_prefix('L')
            .and_then(|r| r.strip_suffix(".mlp"))
            .and_then(|n| n.parse::<u64>().ok());
        out.push(p);
        if let Some(i) = layer {
            out.extend(adapter_pieces(w, i)?);
        }
    }
    Ok(out)
}

/// The parameter groups of a checkpoint stored quantized (`workload::stored`), as inference and
/// serving hold them: each layer's mixer and MLP as the bytes of its quantized linears plus its
/// other parameters in the precision's type (a `U8` piece), the embedding, head and vision
/// tower unchanged. Training such a checkpoint is refused at the command line; a plan built for
/// training keeps the 16-bit pieces.
fn stored_pieces(w: &Workload, q: &crate::workload::Quant, base: Vec<Piece>) -> Vec<Piece> {
    let Some(m) = w.model.as_ref().filter(|_| w.inference()) else {
        return base;
    };
    let rest = crate::plan::params::param_dtype(w.precision).bytes();
    let layer = |name: &str| -> Option<(usize, bool)> {
        let (i, block) = name.strip_prefix('L')?.split_once('.')?;
        Some((i.parse().ok()?, block == "attn"))
    };
    let mut out = base;
    for p in &mut out {
        p.frozen = true;
        let Some((i, attn)) = layer(&p.name) else {
            continue;
        };
        let Some(l) = m.layers.get(i) else { continue };
        let (mixer, mlp) = crate::workload::stored::layer_bytes(q, l, m.hidden, m.norm, rest);
        p.elems = if attn { mixer } else { mlp };
        p.largest = p.elems;
        p.dtype = Some(DType::U8);
    }
    out
}

/// Parameters that train: the adapters' under LoRA (none under a bare quantized base), else all.
pub fn trainable_count(w: &Workload) -> Result<u64, PlanError> {
    if w.lora.is_none() && !w.quant.is_some_and(|q| q.kind.is_bnb()) {
        return param_count(w);
    }
    adapter_params(w)
}

/// All adapter parameters: every layer has the same adapters (none without LoRA).
fn adapter_params(w: &Workload) -> Result<u64, PlanError> {
    let e = "the adapter parameter count";
    let per_layer: Vec<u64> = adapter_pieces(w, 0)?.iter().map(|p| p.elems).collect();
    prod(&[sum(&per_layer, e)?, w.layers], e)
}

/// The model's parameter groups in backward order of need: `embed` (the token embedding, also
/// the output head when tied), `embed.rest` (positions, token types, embedding norm, patch
/// embedding), per layer `L{i}.attn` and `L{i}.mlp`, `head.rest` (final norm, BERT's MLM
/// transform and decoder bias, ViT's classifier) and `head` (an untied output head).
pub fn base_pieces(w: &Workload) -> Result<Vec<Piece>, PlanError> {
    if let Some(m) = &w.model {
        let mut out = layer_pieces(m);
        factor(w, &mut out);
        return Ok(out);
    }
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
        (Embed::TokensNorm, Head::Mlm) => (
            emb,
            sum(&[positions, 4 * h], e)?,
            sum(&[prod(&[h, h], e)?, 3 * h, v], e)?,
        ),
        // BertForSequenceClassification: the pooler (h² + h) and the classifier (hL + L).
        (Embed::TokensNorm, _) => {
            let l = w.labels.unwrap_or(2);
            let pooler = sum(&[prod(&[h, h], e)?, h], e)?;
            (
                emb,
                sum(&[positions, 4 * h], e)?,
                sum(&[pooler, prod(&[h, l], e)?, l], e)?,
            )
        }
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
    if !matches!(s.head, Head::Classifier | Head::Pooled) && !w.tied_head() {
        out.push(Piece::new("head", emb));
    }
    out.retain(|p| p.elems > 0);
    factor(w, &mut out);
    Ok(out)
}

/// Adafactor's factored second-moment elements of each piece (`Piece::factored`):
/// transformers keeps a row and a column vector for each ≥2-D tensor (`shape[:-1]` and
/// `shape[:-2] + shape[-1:]`, `optimization.py:1237-1238`) and a full one for a 1-D tensor.
/// Exact for the embedding, the head and each layer's linears, whose shapes are known; every
/// other parameter of a piece is counted as a vector (norms and biases are), except a piece
/// whose matrices are not listed (a mixture of experts, a mixer described layer by layer),
/// taken as [n/h, h] matrices (`n/h + h` per largest tensor).
fn factor(w: &Workload, pieces: &mut [Piece]) {
    let h = w.hidden.max(1);
    let mats = linears(w).ok();
    let layer_mats = |attn: bool| -> Option<(u64, u64)> {
        let m = mats.as_ref()?;
        let sel = m.iter().filter(|l| l.attn == attn);
        let elems = sel.clone().map(|l| l.out.saturating_mul(l.inp)).sum();
        Some((elems, sel.map(|l| l.out + l.inp).sum()))
    };
    for p in pieces.iter_mut().filter(|p| p.factored.is_none()) {
        let block = p.name.rsplit_once('.').map(|(_, b)| b);
        let known = match (p.name.as_str(), block) {
            ("embed" | "head", _) => Some((w.vocab.saturating_mul(h), w.vocab + h)),
            (n, Some("attn")) if n.starts_with('L') && w.model.is_none() => layer_mats(true),
            (n, Some("mlp")) if n.starts_with('L') && w.model.is_none() && w.moe.is_none() => {
                layer_mats(false)
            }
            _ => None,
        };
        p.factored = Some(match known {
            Some((elems, rows_cols)) if elems <= p.elems => rows_cols + (p.elems - elems),
            _ => {
                let tensors = p.elems.div_ceil(p.largest.max(1));
                (p.elems / h)
                    .saturating_add(tensors.saturating_mul(h))
                    .min(p.elems)
            }
        });
    }
}

/// Autocast's casts of one layer's piece where the layer is its own (a model described layer
/// by layer whose plan family is `Arch::Decoder`, or a layer whose MLP differs from the
/// family's: a dense layer among sparse ones): the matmul weights and biases of the piece.
fn layer_cast_elems(w: &Workload, s: &Spec, name: &str) -> Option<(u64, u64, u64)> {
    use crate::workload::layers::{Mixer, MlpSpec};
    let m = w.model.as_ref()?;
    let (i, block) = name.strip_prefix('L')?.split_once('.')?;
    let l = m.layers.get(i.parse::<usize>().ok()?)?;
    let own = w.arch == crate::workload::Arch::Decoder || super::decoder::mlp_kind(&l.mlp) != s.mlp;
    if !own {
        return None;
    }
    let h = m.hidden;
    match block {
        "attn" if w.arch == crate::workload::Arch::Decoder => Some(match l.mixer {
            Mixer::Attention(a) => {
                let q = a.heads * a.head_dim;
                let kv = a.kv_heads * a.head_dim;
                let qp = if a.output_gate { 2 * q } else { q };
                let bias = if a.qkv_bias { qp + 2 * kv } else { 0 } + if a.o_bias { h } else { 0 };
                (h * (qp + 2 * kv) + q * h, bias, h * qp)
            }
            _ => {
                let p = l.params(h, m.norm);
                (p.mixer, 0, p.mixer_largest)
            }
        }),
        "mlp" => Some(match l.mlp {
            MlpSpec::Dense { ffn, gated, bias } => {
                let mats = if gated { 3 } else { 2 };
                let b = if bias { (mats - 1) * ffn + h } else { 0 };
                (mats * h * ffn, b, h * ffn + if bias { ffn } else { 0 })
            }
            MlpSpec::Moe(e) => {
                let router = e.experts * h;
                let mats = if e.gated { 3 } else { 2 };
                let shared = mats * h * e.shared_ffn + if e.shared_gate { h } else { 0 };
                (router + shared, 0, router)
            }
            MlpSpec::None => (0, 0, 0),
        }),
        _ => None,
    }
}

/// The parameter groups of a model described layer by layer: `embed`, each layer's mixer
/// (`L{i}.attn`) and MLP (`L{i}.mlp`) with their norms, `head.rest` (the final norm), `head`
/// (an untied output head) and `vision` (a multimodal wrapper's tower and projector).
fn layer_pieces(m: &ModelSpec) -> Vec<Piece> {
    let h = m.hidden;
    let emb = m.vocab.saturating_mul(h);
    let mut out = vec![
        Piece::new("embed", emb),
        Piece::new("embed.rest", m.extra_params),
    ];
    for (i, l) in m.layers.iter().enumerate() {
        let p = l.params(h, m.norm);
        out.push(Piece::new(format!("L{i}.attn"), p.mixer).largest(p.mixer_largest));
        out.push(Piece::new(format!("L{i}.mlp"), p.mlp).largest(p.mlp_largest));
    }
    out.push(Piece::new("head.rest", m.norm.params(h)));
    if !m.tied {
        out.push(Piece::new("head", emb));
    }
    if let Some(v) = &m.vision {
        out.push(Piece::new("vision", v.params));
    }
    out.retain(|p| p.elems > 0);
    out
}

/// All parameters (embeddings, layers, head, and the adapters under LoRA).
pub fn param_count(w: &Workload) -> Result<u64, PlanError> {
    let p = base_pieces(w)?;
    let elems: Vec<u64> = p.iter().map(|p| p.elems).collect();
    let base = sum(&elems, "the parameter count")?;
    sum(&[base, adapter_params(w)?], "the parameter count")
}

/// Parameters of piece `name` that autocast casts to 16 bits (matmul and conv weights, and
/// biases, which no backward saves): (weights, biases, the weight and bias of the piece's first
/// matmul, which backward reaches last). Norm gains, position and token-type embeddings are
/// used in fp32 and never cast; a mixture of experts' grouped matmuls are not autocast ops
/// (transformers casts their input to the weights' type), only its router and shared expert.
pub(super) fn cast_elems(w: &Workload, name: &str) -> Result<(u64, u64, u64), PlanError> {
    let s = spec_of(w)?;
    if let Some(c) = layer_cast_elems(w, &s, name) {
        return Ok(c);
    }
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
            // BERT's pooler and classifier (the pooler's dense first).
            ("head.rest", Embed::TokensNorm) if s.head == Head::Pooled => {
                let l = w.labels.unwrap_or(2);
                (sum(&[hh, prod(&[h, l], e)?], e)?, h + l, sum(&[hh, h], e)?)
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
