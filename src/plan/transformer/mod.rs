//! Transformer plans per Korthikanti et al. generalized to the element size: shared layer
//! builders over one `Spec` per family (`spec.rs`; GPT-2, BERT and ViT, and the decoder LLMs:
//! LLaMA, Mistral, Qwen2/3, Gemma 1-3, Phi-3, Mixtral, Qwen2/3-MoE, each in a file of its own).
//!
//! Notation: b batch, s sequence, h hidden, a heads, f FFN width, V vocabulary (classes for ViT),
//! B bytes per element of the compute type (fp32 4; fp16, bf16 and mixed 2), masks 1 byte.
//!
//! # Stored activations of one GPT-2 / BERT / ViT layer (Korthikanti et al. 2022, §4.1)
//!
//! | tensor                          | shape     | bytes       | Korthikanti (B = 2) |
//! |---------------------------------|-----------|-------------|---------------------|
//! | `in`: layer input = LN1 input   | [b,s,h]   | B·sbh       | LN: 2sbh            |
//! | `ln1.out`: QKV matmul input     | [b,s,h]   | B·sbh       | attn: 2sbh          |
//! | `q`, `k` (QKᵀ inputs)           | [b,s,h]×2 | 2B·sbh      | attn: 4sbh          |
//! | `v` (probs·V input)             | [b,s,h]   | B·sbh       | attn: 2sbh          |
//! | `attn.probs`: softmax output    | [b,a,s,s] | B·as²b      | attn: 2as²b         |
//! | `attn.drop_mask` (dropout only) | [b,a,s,s] | as²b        | attn: as²b          |
//! | `attn.drop_out` (dropout only)  | [b,a,s,s] | B·as²b      | attn: 2as²b         |
//! | `ctx`: output projection input  | [b,s,h]   | B·sbh       | attn: 2sbh          |
//! | `proj.drop_mask` (dropout only) | [b,s,h]   | sbh         | attn: sbh           |
//! | `ln2.in`: residual = LN2 input  | [b,s,h]   | B·sbh       | LN: 2sbh            |
//! | `ln2.out`: fc1 input            | [b,s,h]   | B·sbh       | MLP: 2sbh           |
//! | `fc1.out`: GeLU input           | [b,s,f]   | B·sbf       | MLP: 8sbh (f = 4h)  |
//! | `gelu.out`: fc2 input           | [b,s,f]   | B·sbf       | MLP: 8sbh           |
//! | `mlp.drop_mask` (dropout only)  | [b,s,h]   | sbh         | MLP: sbh            |
//!
//! With f = 4h: `sbh(16B + 2) + as²b(2B + 1)`; B = 2 gives eq. 1, `sbh(34 + 5as/h)`; fp32 gives
//! `sbh(66 + 9as/h)`; without dropout the mask terms (and `attn.drop_out`) go:
//! `16B·sbh + B·as²b`. The attention-score tensors (`attn.*`) have `Role::Attention`, the rest
//! `Role::Activations`. BERT is post-LN: its stored tensors have the same shapes and count (layer
//! input, LN1 input and output, LN2 input), so it is built with the same layer.
//!
//! # LLaMA-style layer (RMSNorm, RoPE, gated MLP or experts; transformers 5.24)
//!
//! With d the head width, a query and g key/value heads (`num_key_value_heads`): `in`
//! (RMSNorm1 input, or its fp32 copy in 16-bit), the norm's `xhat` (its gain's backward needs
//! it) and per-row rsqrt, `n1` (q, k, v input), rotated `q` [b,a,s,d], `k` and `v` (eager:
//! repeated to a heads by `repeat_kv`, a copy; SDPA and flash: g heads), the scores' tensors,
//! `ctx`, `x2`, RMSNorm2's `xhat`, `n2`; gated MLP: `gate`, `up`, `act`, `prod` (4B·sbf).
//! RoPE's cos/sin [b,s,d] are made once per forward and saved by every layer's rotation (the
//! rotation's multiplications save only them). Qwen3 and Gemma 3 add an RMSNorm over each head's
//! q and k (input and x̂ saved); Gemma 2/3 a norm after the attention and after the MLP.
//!
//! # Attention implementations
//!
//! - eager: scores and softmax as separate ops (`attn.probs` [b,a,s,s] saved).
//! - sdpa (transformers' default): `F.scaled_dot_product_attention`; the backend PyTorch picks
//!   decides what is saved ([`sdpa_backend`]): flash/cuDNN and memory-efficient save q, k, v, the
//!   output and a per-row logsumexp (no [b,a,s,s] tensor; K and V at g heads with
//!   `enable_gqa`); math materializes the scores as eager does.
//! - flash (`flash_attention_2`): as SDPA's flash backend.
//!
//! The device's kernel (`Step::FlashAttention`) writes per-row statistics `attn.stats`
//! [b,a,s,2] in fp32 (row max and row sum) for every implementation that saves no scores.
//!
//! # Embedding and head terms (documented extras beyond the per-layer formula)
//!
//! - GPT-2: embedding dropout mask `emb.drop_mask` sbh (dropout only); `head.in` (last layer
//!   output = final LN input) B·sbh; `final_ln.out` (logits matmul input) B·sbh; `logits` [b,s,V]
//!   in the compute type B·sbV; `logprobs` [b,s,V] in fp32 4·sbV (the cross-entropy's
//!   log-softmax, computed in fp32 under autocast). Total: `sbh(1 + 2B) + sbV(B + 4)`.
//! - LLaMA: the same without the embedding mask: `2B·sbh + sbV(B + 4)`.
//! - BERT (MLM head over every position): `emb.ln_in` B·sbh, `emb.drop_mask` sbh; `head.in`,
//!   `head.dense_out`, `head.gelu_out`, `head.ln_out` 4B·sbh; logits and logprobs sbV(B + 4).
//! - ViT: the input `image` [b,3,I,I] (patch-conv input) B·3bI², `emb.drop_mask` if dropout;
//!   `head.in`, `final_ln.out` 2B·sbh; `logits` [b,C] B and `logprobs` [b,C] fp32.
//!
//! Token ids (int64, 8·bs bytes) are not counted.
//!
//! # Workspace (backward, `Role::Workspace`)
//!
//! `ws.attn_scores` [b,a,s,s] B (naive attention only: one layer's pre-softmax scores in the
//! forward pass, the score gradient in the backward pass; shared by all layers);
//! `ws.grad_logits` (the loss gradient, fp32, shape of `logprobs`); `ws.grad_ffn` [b,s,f] and
//! `ws.grad_hidden` [b,s,h] (one layer's widest activation gradient and its output gradient);
//! with ZeRO-3, `ws.zero3_gather` (one layer's gathered weights, or the head/embedding matrix if
//! larger).
//!
//! # Checkpointing
//!
//! With segments of K layers (full: K = 1; sqrt: K = ⌈√L⌉; every:K), the plan stores the input of
//! every K-th layer (`ckpt*`, ⌈L/K⌉ tensors of B·sbh) and one segment's activations for the
//! recomputation (`recompute.*`): min(K, L) full layers minus the segment input, which is the
//! checkpoint. Full recompute thus holds `L·B·sbh + (one layer − B·sbh)`.

mod bert;
mod gemma;
mod gpt2;
mod llama;
mod moe;
mod phi3;
mod qwen;
pub mod spec;
mod vit;

use super::autocast::{self, Autocast};
use super::build::{prod, sum, Builder, PlanError};
use super::params::{compute_dtype, param_dtype, Piece, States};
use super::{DType, Phase, Role, Step, TensorIx};
use crate::workload::{presets::vit_tokens, Attention, Checkpoint, Gelu, Workload};
use spec::{Embed, Head, Mlp, Norm, Spec};

/// The spec of a transformer workload (an error for ResNet and a bare parameter count).
fn spec_of(w: &Workload) -> Result<Spec, PlanError> {
    Spec::of(w).ok_or_else(|| PlanError::Invalid("not a transformer".into()))
}

/// Attention widths: (query width a·d, key/value width g·d, head width d).
fn widths(w: &Workload) -> Result<(u64, u64, u64), PlanError> {
    let d = w.head_dim();
    let e = "the attention width";
    Ok((prod(&[w.heads, d], e)?, prod(&[w.kv_heads(), d], e)?, d))
}

/// Parameter elements of one layer's attention block (with its norms) and MLP block (with its
/// norms), and of the largest single parameter tensor in each (for-loop Adam's temporaries are
/// one parameter at a time).
/// (elements, largest tensor's elements) of one parameter group.
type Group = (u64, u64);

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

/// The kernels PyTorch's `scaled_dot_product_attention` dispatches to (which decides what its
/// backward saves).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SdpaBackend {
    /// Flash (or cuDNN) attention: q, k, v (at the key/value head count), the output and a
    /// per-row logsumexp [b, a, s] in fp32.
    Flash,
    /// Memory-efficient attention (fp32 on CUDA): as flash, the logsumexp padded to 32 rows.
    Efficient,
    /// The math fallback: scaled q and kᵀ, the [b, a, s, s] probabilities (and a dropout
    /// mask), v; K and V repeated to the query heads.
    Math,
}

/// The SDPA backend PyTorch 2.15 picks (`aten/src/ATen/native/transformers/sdp_utils_cpp.cpp`
/// and `cuda/sdp_utils.cpp`, `select_sdp_backend`), for transformers' call without a mask
/// (causal or not, no padding): on CUDA flash takes fp16/bf16 with head_dim ≤ 256, dropout and
/// grouped-query heads (`enable_gqa`); memory-efficient takes fp32 and dropout but not grouped
/// heads (`check_batch_size_and_num_heads_dense<false>` in its constraints), which then fall
/// back to math. On CPU the flash kernel takes any float type and grouped heads but no
/// dropout (measured on 2.15: the grouped sdpa rows of `tests/fixtures/validation_llm.json` run
/// `_scaled_dot_product_flash_attention_for_cpu`).
pub fn sdpa_backend(
    device: autocast::Device,
    dtype: DType,
    head_dim: u64,
    grouped: bool,
    dropout: bool,
) -> SdpaBackend {
    match device {
        autocast::Device::Cpu => {
            // `_scaled_dot_product_flash_attention_for_cpu` takes grouped heads in 2.15
            // (measured: validation/llm_notes.md).
            let _ = grouped;
            if dropout {
                SdpaBackend::Math
            } else {
                SdpaBackend::Flash
            }
        }
        autocast::Device::Cuda => {
            if dtype != DType::F32 && head_dim <= 256 {
                SdpaBackend::Flash
            } else if !grouped {
                SdpaBackend::Efficient
            } else {
                SdpaBackend::Math
            }
        }
    }
}

/// The attention a plan assumes, in words: the implementation and, for SDPA, the kernels
/// PyTorch picks on the plan's device (e.g. "sdpa (flash kernels: no [b, a, s, s] scores)").
pub fn attention_summary(w: &Workload) -> String {
    match w.attention {
        Attention::Naive => "eager".into(),
        Attention::Flash => "flash-attention-2".into(),
        Attention::Sdpa => {
            let dtype = match super::params::autocast(w) {
                Some(a) => a.low,
                None => compute_dtype(w.precision),
            };
            let grouped = w.kv_heads() != w.heads;
            let dropout = w.dropout && !w.inference();
            let dev = match w.autocast_device {
                autocast::Device::Cuda => "CUDA",
                autocast::Device::Cpu => "CPU",
            };
            let what = match sdpa_backend(w.autocast_device, dtype, w.head_dim(), grouped, dropout)
            {
                SdpaBackend::Flash => "flash kernel: no [b, a, s, s] scores",
                SdpaBackend::Efficient => "memory-efficient kernel: no [b, a, s, s] scores",
                SdpaBackend::Math => "math fallback: the [b, a, s, s] scores are materialized",
            };
            format!("sdpa ({dev} {what})")
        }
    }
}

/// The query, key and value an attention core reads ([b, heads, s, d]); `cached`: the key and
/// value are the KV cache's copies, which the output holds (not freed, not saved).
#[derive(Debug, Clone, Copy)]
struct Qkv {
    q: TensorIx,
    k: TensorIx,
    v: TensorIx,
    cached: bool,
}

/// What one backward frame is: a layer's attention or MLP block.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Block {
    Attn,
    Mlp,
}

/// The tensors one block saved in forward (freed as backward passes it) and its parameters.
#[derive(Debug, Clone)]
struct Frame {
    block: Block,
    piece: String,
    saved: Vec<TensorIx>,
}

struct T<'a> {
    b: &'a mut Builder,
    w: &'a Workload,
    spec: Spec,
    states: States,
    bsz: u64,
    s: u64,
    h: u64,
    a: u64,
    f: u64,
    /// Key/value heads.
    g: u64,
    /// Head width.
    d: u64,
    /// Query width a·d and key/value width g·d.
    qw: u64,
    kvw: u64,
    /// The compute type: matmul outputs (autocast's lower-precision type under `amp-*`).
    c: DType,
    /// The residual stream's type: fp32 under autocast (fp32 embeddings plus 16-bit block
    /// outputs promote to fp32), else `c`.
    r: DType,
    /// Autocast and the op lists in effect.
    ac: Option<Autocast>,
    dropout: bool,
    train: bool,
    /// The layer being built keeps what backward needs (training or a recomputation); not
    /// saving (no_grad), each intermediate is freed once its last reader ran.
    saving: bool,
    /// ZeRO-3's gathered weights (kernels read them instead of the local shard).
    gather: Option<TensorIx>,
    /// RoPE's cos and sin tables, made once per forward.
    rope: Option<TensorIx>,
    /// Not saving: what the layer being built keeps until it returns (eager attention's
    /// returned probabilities, which the decoder layer binds to `_`).
    layer_tail: Vec<TensorIx>,
    /// Tensors the caller holds until the end of the step (logits, a kept KV cache).
    held: Vec<TensorIx>,
}

/// Parameters of piece `name` that autocast casts to 16 bits (matmul and conv weights, and
/// biases, which no backward saves): (weights, biases, the weight and bias of the piece's first
/// matmul, which backward reaches last). Norm gains, position and token-type embeddings are
/// used in fp32 and never cast; a mixture of experts' grouped matmuls are not autocast ops
/// (transformers casts their input to the weights' type), only its router and shared expert.
fn cast_elems(w: &Workload, name: &str) -> Result<(u64, u64, u64), PlanError> {
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

impl T<'_> {
    fn hidden(&mut self, name: &str, role: Role) -> Result<TensorIx, PlanError> {
        let c = self.c;
        self.hidden_t(name, role, c)
    }
    fn hidden_t(&mut self, name: &str, role: Role, dtype: DType) -> Result<TensorIx, PlanError> {
        let (bsz, s, h) = (self.bsz, self.s, self.h);
        self.b.push(name, role, dtype, &[bsz, s, h], h)
    }
    /// A [b, s, width] tensor (a projection's output).
    fn rows_t(
        &mut self,
        name: &str,
        role: Role,
        dtype: DType,
        width: u64,
    ) -> Result<TensorIx, PlanError> {
        let (bsz, s) = (self.bsz, self.s);
        self.b.push(name, role, dtype, &[bsz, s, width], width)
    }
    /// A residual-stream tensor (layer input and output, norm inputs).
    fn resid(&mut self, name: &str) -> Result<TensorIx, PlanError> {
        let r = self.r;
        self.hidden_t(name, Role::Activations, r)
    }
    fn wide(&mut self, name: &str) -> Result<TensorIx, PlanError> {
        self.wide_as(name, Role::Activations)
    }
    fn wide_as(&mut self, name: &str, role: Role) -> Result<TensorIx, PlanError> {
        let c = self.c;
        self.wide_t(name, role, c)
    }
    fn wide_t(&mut self, name: &str, role: Role, dtype: DType) -> Result<TensorIx, PlanError> {
        let (bsz, s, f) = (self.bsz, self.s, self.f);
        self.b.push(name, role, dtype, &[bsz, s, f], f)
    }
    fn scores(&mut self, name: &str, role: Role, dtype: DType) -> Result<TensorIx, PlanError> {
        let (bsz, a, s) = (self.bsz, self.a, self.s);
        self.b.push(name, role, dtype, &[bsz, a, s, s], s)
    }
    fn mask(&mut self, name: &str, saved: &mut Vec<TensorIx>) -> Result<(), PlanError> {
        if self.dropout {
            let (bsz, s, h) = (self.bsz, self.s, self.h);
            saved.push(
                self.b
                    .push(name, Role::Activations, DType::U8, &[bsz, s, h], h)?,
            );
        }
        Ok(())
    }
    fn rows(&self) -> u64 {
        self.bsz.saturating_mul(self.s)
    }
    fn dtype(&self, t: TensorIx) -> DType {
        self.b.tensor(t).dtype
    }
    /// The output type of `op` over inputs of these types (autocast's lists, or promotion).
    fn out(&self, op: &str, inputs: &[DType]) -> DType {
        autocast::out_dtype(self.ac, op, inputs)
    }
    /// Not saving (no_grad), `t` has had its last reader: it goes now, out of `saved` too.
    fn consumed(&mut self, t: TensorIx, saved: &mut Vec<TensorIx>) {
        if !self.saving {
            if let Some(i) = saved.iter().position(|&x| x == t) {
                saved.remove(i);
                self.b.free(t);
            }
        }
    }
    /// Piece `piece`'s first use in forward: under autocast its weights are cast (and cached).
    fn use_piece(&mut self, piece: &str) -> Result<(), PlanError> {
        if self.ac.is_some() && self.gather.is_none() {
            let elems = cast_elems(self.w, piece)?;
            if elems.0 > 0 {
                self.states.cast(self.b, piece, elems)?;
            }
        }
        Ok(())
    }
    fn weights(&self, piece: &str) -> TensorIx {
        self.gather
            .or_else(|| self.states.cast_weight(piece))
            .unwrap_or_else(|| self.states.weights(piece))
    }
    fn matmul_rows(&mut self, piece: &str, a: TensorIx, c: TensorIx, m: u64, n: u64, k: u64) {
        let b = self.weights(piece);
        self.b.step(Step::Matmul {
            a,
            b,
            c,
            batch: 1,
            m,
            n,
            k,
        });
    }
    fn matmul(&mut self, piece: &str, a: TensorIx, c: TensorIx, n: u64, k: u64) {
        let m = self.rows();
        self.matmul_rows(piece, a, c, m, n, k);
    }
    fn norm_step(&mut self, x: TensorIx, y: TensorIx, rows: u64, cols: u64) {
        self.b.step(Step::LayerNorm { x, y, rows, cols });
    }

    /// A norm over `x` ([b, s, width] rows of `width`; the residual for the block norms): pushes
    /// what its backward saves into `saved` (`x` itself, or its fp32 copy, and the norm's own
    /// tensors; see `spec::Norm`) and returns its output. Not saving, the norm's own tensors
    /// go once the output exists.
    fn norm_over(
        &mut self,
        name: &str,
        x: TensorIx,
        width: u64,
        saved: &mut Vec<TensorIx>,
    ) -> Result<TensorIx, PlanError> {
        let xt = self.dtype(x);
        let rows = self.b.tensor(x).elems() / width.max(1);
        let shape = self.b.tensor(x).shape.clone();
        let push = |t: &mut Self, n: &str, dt: DType| {
            t.b.push(&format!("{name}.{n}"), Role::Activations, dt, &shape, width)
        };
        match self.spec.norm {
            Norm::Layer => {
                if !saved.contains(&x) {
                    saved.push(x);
                }
                let dt = self.out("layer_norm", &[xt]);
                let y = push(self, "out", dt)?;
                self.norm_step(x, y, rows, width);
                Ok(y)
            }
            Norm::Rms | Norm::RmsGemma => {
                let mut own = Vec::new();
                if xt == DType::F32 {
                    if !saved.contains(&x) {
                        saved.push(x);
                    }
                } else {
                    own.push(push(self, "x32", DType::F32)?);
                }
                let mut rshape = shape.clone();
                if let Some(l) = rshape.last_mut() {
                    *l = 1;
                }
                own.push(self.b.push(
                    &format!("{name}.rsqrt"),
                    Role::Activations,
                    DType::F32,
                    &rshape,
                    1,
                )?);
                let gemma = self.spec.norm == Norm::RmsGemma;
                own.push(push(self, "xhat", if gemma { DType::F32 } else { xt })?);
                // LLaMA: weight · x̂ in the weights' and input's promoted type; Gemma: cast back
                // to the input's type.
                let out_t = if gemma {
                    xt
                } else {
                    autocast::promote(param_dtype(self.w.precision), xt)
                };
                let y = push(self, "out", out_t)?;
                self.norm_step(x, y, rows, width);
                if self.saving {
                    saved.extend(own);
                } else {
                    self.b.free_all(own);
                }
                Ok(y)
            }
        }
    }

    /// A norm over the hidden size (see `norm_over`).
    fn norm(
        &mut self,
        name: &str,
        x: TensorIx,
        saved: &mut Vec<TensorIx>,
    ) -> Result<TensorIx, PlanError> {
        let h = self.h;
        self.norm_over(name, x, h, saved)
    }

    /// What `readers` matmuls save of their input `src`: under autocast, when `src` is not in
    /// the 16-bit type, each casts it to a fresh copy and saves that (`src` is freed unless
    /// `src_kept`, something else keeps it); otherwise they share `src` itself. Returns the
    /// tensor the kernels read.
    fn matmul_input(
        &mut self,
        src: TensorIx,
        readers: u64,
        src_kept: bool,
        saved: &mut Vec<TensorIx>,
    ) -> Result<TensorIx, PlanError> {
        let c = self.c;
        let cast = self
            .ac
            .is_some_and(|a| a.casts_input("linear", self.dtype(src)));
        if !cast {
            if !src_kept && !saved.contains(&src) {
                saved.push(src);
            }
            return Ok(src);
        }
        let spec = self.b.tensor(src).clone();
        let mut first = None;
        for j in 0..readers.max(1) {
            let t = self.b.push(
                &format!("{}.cast{j}", spec.name),
                Role::Activations,
                c,
                &spec.shape,
                spec.row_elems,
            )?;
            saved.push(t);
            first.get_or_insert(t);
        }
        if !src_kept {
            if let Some(i) = saved.iter().position(|&x| x == src) {
                saved.remove(i);
            }
            self.b.free(src);
        }
        Ok(first.unwrap_or(src))
    }

    /// `t` as the 16-bit input of an autocast `op`: a fresh cast copy (`t` freed unless
    /// `keep`: something else holds it), or `t` itself.
    fn cast_for(&mut self, op: &str, t: TensorIx, keep: bool) -> Result<TensorIx, PlanError> {
        let c = self.c;
        if !self.ac.is_some_and(|a| a.casts_input(op, self.dtype(t))) {
            return Ok(t);
        }
        let spec = self.b.tensor(t).clone();
        let x = self.b.push(
            &format!("{}.cast", spec.name),
            spec.role,
            c,
            &spec.shape,
            spec.row_elems,
        )?;
        if !keep {
            self.b.free(t);
        }
        Ok(x)
    }

    /// A [b, heads, s, d] tensor (q, k or v in attention's layout).
    fn heads_t(
        &mut self,
        name: &str,
        heads: u64,
        dtype: DType,
        role: Role,
    ) -> Result<TensorIx, PlanError> {
        let (bsz, s, d) = (self.bsz, self.s, self.d);
        self.b.push(name, role, dtype, &[bsz, heads, s, d], d)
    }

    /// Not saving, what an attention core pushed into `saved` from `from` on goes once the
    /// context exists.
    fn attention_done(&mut self, saved: &mut Vec<TensorIx>, from: usize) {
        if !self.saving {
            let done: Vec<TensorIx> = saved.drain(from..).collect();
            self.b.free_all(done);
        }
    }

    /// The attention block's core for the decoder LLM families: q, k, v projections (fused or
    /// not, with biases), q/k norms, the rotation, the KV cache, then eager, SDPA or flash
    /// attention. Returns the context [b, s, a·d] the output projection reads.
    fn attention_llm(
        &mut self,
        p: &str,
        piece: &str,
        x: TensorIx,
        saved: &mut Vec<TensorIx>,
    ) -> Result<TensorIx, PlanError> {
        let (h, qw, kvw, a, g) = (self.h, self.qw, self.kvw, self.a, self.g);
        let c = self.c;
        // Projections: separate outputs, or slices (views) of one fused output.
        let (q0, k0, v0) = if self.spec.fused_qkv {
            let qkv = self.rows_t(&format!("{p}.qkv"), Role::Activations, c, qw + 2 * kvw)?;
            self.matmul(piece, x, qkv, qw + 2 * kvw, h);
            (qkv, qkv, qkv)
        } else {
            let q = self.rows_t(&format!("{p}.q_proj"), Role::Activations, c, qw)?;
            let k = self.rows_t(&format!("{p}.k_proj"), Role::Activations, c, kvw)?;
            let v = self.rows_t(&format!("{p}.v_proj"), Role::Activations, c, kvw)?;
            self.matmul(piece, x, q, qw, h);
            self.matmul(piece, x, k, kvw, h);
            self.matmul(piece, x, v, kvw, h);
            (q, k, v)
        };
        let (q1, k1) = if self.spec.qk_norm {
            let d = self.d;
            let qn = self.norm_over(&format!("{p}.q_norm"), q0, d, saved)?;
            let kn = self.norm_over(&format!("{p}.k_norm"), k0, d, saved)?;
            (qn, kn)
        } else {
            (q0, k0)
        };
        // RoPE: q·cos + rotate_half(q)·sin, new tensors in the promoted type of the projection
        // and the tables (fp32 under autocast); the multiplications save cos and sin only.
        let (q, k) = if self.spec.rope {
            let rt = autocast::promote(c, self.r);
            let qr = self.heads_t(&format!("{p}.q"), a, rt, Role::Activations)?;
            let kr = self.heads_t(&format!("{p}.k"), g, rt, Role::Activations)?;
            (qr, kr)
        } else {
            (q1, k1)
        };
        // What fed the rotation goes unless a norm saved it (the value keeps a fused output).
        let mut fed = vec![q1, k1];
        if !self.spec.fused_qkv {
            fed.extend([q0, k0]);
        }
        fed.sort_unstable();
        fed.dedup();
        for t in fed {
            if t != q && t != k && t != v0 && !saved.contains(&t) {
                self.b.free(t);
            }
        }
        // use_cache: DynamicCache's update `torch.cat`s the key and value into copies that the
        // returned output holds, and attention reads those copies. transformers turns it off
        // under gradient checkpointing.
        let ckpt = self.train && self.w.checkpoint != Checkpoint::None;
        let cached = self.w.kv_cache && !ckpt;
        let (k, v) = if cached {
            let kc = self.heads_t(
                &format!("{p}.kv_cache.k"),
                g,
                self.dtype(k),
                Role::Activations,
            )?;
            let vc = self.heads_t(&format!("{p}.kv_cache.v"), g, c, Role::Activations)?;
            self.b.free(k);
            self.held.extend([kc, vc]);
            (kc, vc)
        } else {
            (k, v0)
        };
        let grouped = g != a;
        let backend = match self.w.attention {
            Attention::Naive => SdpaBackend::Math,
            Attention::Flash => SdpaBackend::Flash,
            Attention::Sdpa => {
                let qt = self.out("scaled_dot_product_attention", &[self.dtype(q)]);
                sdpa_backend(self.w.autocast_device, qt, self.d, grouped, self.dropout)
            }
        };
        let eager = self.w.attention == Attention::Naive;
        let from = saved.len();
        let qkv = Qkv { q, k, v, cached };
        let ctx = if backend == SdpaBackend::Math {
            self.attention_scores(p, qkv, eager, saved)?
        } else {
            self.attention_fused(p, qkv, backend, saved)?
        };
        // The value's projection (or the fused output it is a slice of) goes unless saved; with
        // the cache, attention read the cache's copy.
        let v0_saved = saved.contains(&v0);
        self.attention_done(saved, from);
        if !v0_saved {
            self.b.free(v0);
        }
        // The decoder layer's local keeps the norm's output until the attention returns.
        self.consumed(x, saved);
        Ok(ctx)
    }

    /// Attention that materializes the scores (eager, or SDPA's math fallback): K and V
    /// repeated to the query heads when grouped (saved copies), the scores, the softmax (fp32
    /// in eager for the LLaMA families, cast back), probs·V; returns the context copy
    /// [b, s, a·d]. `k` and `v` are the cache's (held) when `cached`.
    fn attention_scores(
        &mut self,
        p: &str,
        qkv: Qkv,
        eager: bool,
        saved: &mut Vec<TensorIx>,
    ) -> Result<TensorIx, PlanError> {
        let Qkv { q, k, v, cached } = qkv;
        let (a, g, c) = (self.a, self.g, self.c);
        let (bsz, s, d) = (self.bsz, self.s, self.d);
        let qt = self.dtype(q);
        let q = self.cast_for("matmul", q, false)?;
        let (kr, vr) = if g != a {
            // repeat_kv: expand + reshape, copies at a heads.
            let kr = self.heads_t(&format!("{p}.k_rep"), a, self.dtype(k), Role::Activations)?;
            let vr = self.heads_t(&format!("{p}.v_rep"), a, self.dtype(v), Role::Activations)?;
            if !cached {
                if self.saving {
                    self.b.free(k);
                } else {
                    // The attention's locals keep it until it returns.
                    saved.push(k);
                }
            }
            (kr, vr)
        } else {
            // probs·V copies a value that is a slice of a fused projection.
            let kvw = self.kvw;
            let whole = prod(&[bsz, s, kvw], "the value")?;
            let vr = if self.b.tensor(v).elems() != whole {
                self.heads_t(&format!("{p}.v_copy"), a, self.dtype(v), Role::Activations)?
            } else {
                v
            };
            (k, vr)
        };
        let kr = self.cast_for("matmul", kr, cached && kr == k)?;
        let vr = self.cast_for("matmul", vr, vr == v)?;
        for t in [q, kr, vr] {
            if !(cached && (t == k || t == v)) && !saved.contains(&t) {
                saved.push(t);
            }
        }
        let scores = self.scores(&format!("{p}.attn.scores"), Role::Workspace, c)?;
        let sm = self.spec.softmax;
        let mut last = scores;
        if eager && self.w.attn_softcap {
            // Gemma 2: scores / cap, tanh (saves its output), · cap.
            let t = self.scores(&format!("{p}.attn.softcap_tanh"), Role::Attention, c)?;
            saved.push(t);
            let capped = self.scores(&format!("{p}.attn.capped"), Role::Workspace, c)?;
            self.b.free(scores);
            last = capped;
        }
        let pt = if sm.fp32 && eager {
            DType::F32
        } else {
            self.out("softmax", &[c])
        };
        // CPU's softmax(dtype=float32) of 16-bit scores converts them to an fp32 copy first
        // (CUDA's kernel reads 16 bits and writes fp32: `half_to_float`).
        let widened = if pt == DType::F32
            && self.dtype(last) != DType::F32
            && self.w.autocast_device == autocast::Device::Cpu
        {
            Some(self.scores(&format!("{p}.attn.scores32"), Role::Workspace, DType::F32)?)
        } else {
            None
        };
        let probs = self.scores(&format!("{p}.attn.probs"), Role::Attention, pt)?;
        self.b.free_all(widened);
        saved.push(probs);
        let mut pv = probs;
        // `.to(query.dtype)` (a no-op for an fp32 query: under autocast the rotated q is fp32),
        // then probs·V under autocast casts them to 16 bits: one 16-bit copy either way.
        let returned = if sm.cast_back && qt != pt {
            None
        } else {
            Some(probs)
        };
        if sm.cast_back && pt != c {
            pv = self.scores(&format!("{p}.attn.probs16"), Role::Attention, c)?;
        }
        let returned = returned.unwrap_or(pv);
        if self.dropout {
            // native_dropout saves its 1-byte mask; its input is not saved.
            let m = self.scores(&format!("{p}.attn.drop_mask"), Role::Attention, DType::U8)?;
            saved.push(m);
            let o = self.scores(&format!("{p}.attn.drop_out"), Role::Attention, c)?;
            if pv != probs {
                self.b.free(pv);
            }
            pv = o;
        }
        if pv != probs {
            saved.push(pv);
        }
        if eager && !self.saving && !self.dropout {
            // The attention returns its probabilities; the decoder layer keeps them (`_`) until
            // it returns.
            saved.retain(|&t| t != returned);
            self.layer_tail.push(returned);
        }
        // probs·V's output [b, a, s, d] comes once the scores are gone (the softmax was their
        // last reader), then its `transpose(1, 2).contiguous()` copy, the context. The kernel
        // writes that output into the dead scores' buffer when it fits (s ≥ d), so the plan
        // allocates the context after the scores go, as PyTorch does.
        let fits = last != probs && s >= d;
        let ctx = if fits {
            None
        } else {
            Some(self.rows_t(&format!("{p}.ctx"), Role::Activations, c, self.qw)?)
        };
        self.b.step(Step::Attention {
            q,
            k: kr,
            v: vr,
            scores: last,
            probs: pv,
            out: ctx.unwrap_or(last),
            batch_heads: bsz.saturating_mul(a),
            seq: s,
            head_dim: d,
            causal: self.spec.causal,
        });
        self.b.free(last);
        match ctx {
            Some(c) => Ok(c),
            None => {
                let qw = self.qw;
                self.rows_t(&format!("{p}.ctx"), Role::Activations, c, qw)
            }
        }
    }

    /// Attention without scores (SDPA's flash or memory-efficient kernels, flash-attn): q, k
    /// and v at their own head counts, the output (in the context's layout: its
    /// `transpose(1, 2).contiguous()` is the same tensor) and the per-row statistics.
    fn attention_fused(
        &mut self,
        p: &str,
        qkv: Qkv,
        backend: SdpaBackend,
        saved: &mut Vec<TensorIx>,
    ) -> Result<TensorIx, PlanError> {
        let Qkv { q, k, v, cached } = qkv;
        let (a, g, c) = (self.a, self.g, self.c);
        let (bsz, s, d) = (self.bsz, self.s, self.d);
        let op = "scaled_dot_product_attention";
        let q = self.cast_for(op, q, false)?;
        let kc = self.cast_for(op, k, cached)?;
        let vc = self.cast_for(op, v, true)?;
        let rows = if backend == SdpaBackend::Efficient {
            s.div_ceil(32) * 32
        } else {
            s
        };
        let stats = self.b.push(
            &format!("{p}.attn.stats"),
            Role::Attention,
            DType::F32,
            &[bsz, a, rows, 2],
            2,
        )?;
        let ctx = self.rows_t(&format!("{p}.ctx"), Role::Activations, c, self.qw)?;
        self.b.step(Step::FlashAttention {
            q,
            k: kc,
            v: vc,
            out: ctx,
            stats,
            batch_heads: bsz.saturating_mul(a),
            seq: s,
            head_dim: d,
            causal: self.spec.causal,
            kv_group: a.checked_div(g).unwrap_or(1),
        });
        for t in [q, kc, vc, stats] {
            if !(cached && (t == k || t == v)) && !saved.contains(&t) {
                saved.push(t);
            }
        }
        Ok(ctx)
    }

    /// The attention core of GPT-2, BERT and ViT (see `attention_gpt_core`). Not saving, q, k,
    /// v, the probabilities and the attention's input go once the context exists.
    fn attention_gpt(
        &mut self,
        p: &str,
        piece: &str,
        x: TensorIx,
        saved: &mut Vec<TensorIx>,
    ) -> Result<TensorIx, PlanError> {
        let from = saved.len();
        let ctx = self.attention_gpt_core(p, piece, x, saved)?;
        if !self.saving {
            saved.retain(|&t| t != ctx);
            self.attention_done(saved, from);
            self.consumed(x, saved);
            saved.push(ctx);
        }
        Ok(ctx)
    }

    /// The attention core of GPT-2, BERT and ViT: q, k, v, the probabilities (eager; the
    /// pre-softmax scores are a temporary) or the softmax statistics (SDPA's fused kernels,
    /// flash), and the context.
    fn attention_gpt_core(
        &mut self,
        p: &str,
        piece: &str,
        x: TensorIx,
        saved: &mut Vec<TensorIx>,
    ) -> Result<TensorIx, PlanError> {
        let h = self.h;
        let q = self.hidden(&format!("{p}.q"), Role::Activations)?;
        let k = self.hidden(&format!("{p}.k"), Role::Activations)?;
        let v = self.hidden(&format!("{p}.v"), Role::Activations)?;
        for t in [q, k, v] {
            self.matmul(piece, x, t, h, h);
        }
        // use_cache: the returned cache (DynamicCache, `torch.cat` copies) keeps this layer's
        // key and value until the caller drops the output. In training with batch ≥ 2 the 4-D
        // matmuls copy q, k and v anyway and the saved k, v are the cache's copies (held, not
        // freed by backward); with batch 1 q·kᵀ saves views of the fused projection, so the
        // cache's copies come on top (measured, validation/saved_breakdown.md).
        // transformers turns use_cache off under gradient checkpointing.
        let ckpt = self.train && self.w.checkpoint != Checkpoint::None;
        let cache = self.w.kv_cache && self.spec.causal && !ckpt;
        if cache && self.train && self.bsz > 1 {
            saved.push(q);
            self.held.extend([k, v]);
        } else {
            saved.extend([q, k, v]);
        }
        if cache && (!self.train || self.bsz == 1) {
            let (bsz, s, c) = (self.bsz, self.s, self.c);
            let kv = self.b.push(
                &format!("{p}.kv_cache"),
                Role::Activations,
                c,
                &[2, bsz, s, h],
                h,
            )?;
            self.held.push(kv);
        }
        let (bsz, s, a, c) = (self.bsz, self.s, self.a, self.c);
        let bh = bsz.saturating_mul(a);
        let head_dim = h / a;
        let causal = self.spec.causal;
        let fused = match self.w.attention {
            Attention::Naive => false,
            Attention::Flash => true,
            Attention::Sdpa => {
                let dev = self.w.autocast_device;
                let qt = self.out("scaled_dot_product_attention", &[c]);
                sdpa_backend(dev, qt, head_dim, false, self.dropout) != SdpaBackend::Math
            }
        };
        if fused {
            let stats = self.b.push(
                &format!("{p}.attn.stats"),
                Role::Attention,
                DType::F32,
                &[bsz, a, s, 2],
                2,
            )?;
            let ctx = self.hidden(&format!("{p}.ctx"), Role::Activations)?;
            saved.extend([stats, ctx]);
            self.b.step(Step::FlashAttention {
                q,
                k,
                v,
                out: ctx,
                stats,
                batch_heads: bh,
                seq: s,
                head_dim,
                causal,
                kv_group: 1,
            });
            Ok(ctx)
        } else {
            let scores = self.scores(&format!("{p}.attn.scores"), Role::Workspace, c)?;
            // The probabilities' type: the model's own softmax call and autocast's lists.
            let sm = self.spec.softmax;
            let pt = if sm.fp32 {
                DType::F32
            } else {
                let input = if sm.mask_promotes {
                    autocast::promote(c, self.r)
                } else {
                    c
                };
                self.out("softmax", &[input])
            };
            // Softmax's backward saves its output.
            let probs = self.scores(&format!("{p}.attn.probs"), Role::Attention, pt)?;
            saved.push(probs);
            let mut cur = probs;
            let mut cur_saved = true;
            if sm.cast_back && pt != c {
                cur = self.scores(&format!("{p}.attn.probs16"), Role::Attention, c)?;
                cur_saved = false;
            }
            if self.dropout {
                // native_dropout saves its 1-byte mask; its input is not saved.
                let m = self.scores(&format!("{p}.attn.drop_mask"), Role::Attention, DType::U8)?;
                saved.push(m);
                let dt = self.dtype(cur);
                let o = self.scores(&format!("{p}.attn.drop_out"), Role::Attention, dt)?;
                if !cur_saved {
                    self.b.free(cur);
                }
                cur = o;
                cur_saved = false;
            }
            // probs·V saves its first input; under autocast in the 16-bit type (a cast copy
            // when the probabilities are still fp32, e.g. BERT's on CUDA).
            let pv = if self.dtype(cur) != c {
                let t = self.scores(&format!("{p}.attn.probs_cast"), Role::Attention, c)?;
                if !cur_saved {
                    self.b.free(cur);
                }
                t
            } else {
                cur
            };
            if pv != probs {
                saved.push(pv);
            }
            let ctx = self.hidden(&format!("{p}.ctx"), Role::Activations)?;
            saved.push(ctx);
            self.b.step(Step::Attention {
                q,
                k,
                v,
                scores,
                probs: pv,
                out: ctx,
                batch_heads: bh,
                seq: s,
                head_dim,
                causal,
            });
            self.b.free(scores);
            Ok(ctx)
        }
    }

    /// The MLP's activation over `fc1` ([b,s,f]): pushes what its backward saves and returns
    /// the tensor the second projection reads (and whether `fc1` itself is saved).
    fn activation(
        &mut self,
        p: &str,
        fc1: TensorIx,
        sm: &mut Vec<TensorIx>,
    ) -> Result<TensorIx, PlanError> {
        let c = self.c;
        let elems = self.rows().saturating_mul(self.f);
        if self.w.gelu == Gelu::Unfused && self.train {
            // gelu_new: 0.5·x · (1 + tanh(√(2/π)·(x + 0.044715·pow(x, 3)))) in separate ops
            // saves pow's input, tanh's output, 0.5·x and 1 + tanh (both factors of the last
            // product). Under CUDA autocast `pow` is on the fp32 list: it saves an fp32 copy
            // of x, and everything after it (tanh, 1 + tanh, the product) is fp32.
            let pow_cast = self.ac.is_some_and(|a| a.casts_input("pow", c));
            if pow_cast {
                sm.push(self.wide_t(&format!("{p}.gelu.x32"), Role::Activations, DType::F32)?);
            } else {
                sm.push(fc1);
            }
            let t = autocast::promote(c, self.out("pow", &[c]));
            sm.push(self.wide_t(&format!("{p}.gelu.tanh"), Role::Activations, t)?);
            sm.push(self.wide(&format!("{p}.gelu.half_x"))?);
            sm.push(self.wide_t(&format!("{p}.gelu.one_plus_tanh"), Role::Activations, t)?);
            let out = self.wide_t(&format!("{p}.gelu.out"), Role::Activations, t)?;
            self.b.step(Step::Gelu {
                x: fc1,
                y: out,
                elems,
            });
            if pow_cast {
                self.b.free(fc1);
            }
            self.matmul_input(out, 1, false, sm)
        } else {
            sm.push(fc1);
            let gelu = self.wide(&format!("{p}.gelu.out"))?;
            sm.push(gelu);
            self.b.step(Step::Gelu {
                x: fc1,
                y: gelu,
                elems,
            });
            Ok(gelu)
        }
    }

    /// Routed token-expert pairs T·k and each expert's width.
    fn routed(&self) -> Result<(u64, u64), PlanError> {
        let m = self
            .w
            .moe
            .ok_or_else(|| PlanError::Invalid("a mixture of experts needs experts".into()))?;
        Ok((
            prod(&[self.rows(), m.top_k], "the routed tokens")?,
            m.expert_ffn,
        ))
    }

    /// The gated MLP (`down(act(gate(x)) * up(x))`) over the norm's output `n2`: saves gate (or
    /// the fused gate-up output), up, act and their product (the down projection's input);
    /// returns the down projection's output.
    fn mlp_gated(
        &mut self,
        p: &str,
        pm: &str,
        n2: TensorIx,
        sm: &mut Vec<TensorIx>,
    ) -> Result<TensorIx, PlanError> {
        let (h, f) = (self.h, self.f);
        let elems = self.rows().saturating_mul(f);
        let (gate, up, gu) = if self.spec.fused_gate_up {
            let c = self.c;
            let gu = self.rows_t(&format!("{p}.mlp.gate_up"), Role::Activations, c, 2 * f)?;
            self.matmul(pm, n2, gu, 2 * f, h);
            (gu, gu, vec![gu])
        } else {
            let gate = self.wide(&format!("{p}.mlp.gate"))?;
            let up = self.wide(&format!("{p}.mlp.up"))?;
            self.matmul(pm, n2, gate, f, h);
            self.matmul(pm, n2, up, f, h);
            (gate, up, vec![gate, up])
        };
        self.consumed(n2, sm);
        let act = self.wide(&format!("{p}.mlp.act"))?;
        let prod_ = self.wide(&format!("{p}.mlp.prod"))?;
        sm.extend(gu.iter().copied());
        sm.extend([act, prod_]);
        // The activation runs as the GeLU kernel (same cost class); the product act·up has no
        // kernel of its own, so a GeLU over act writes `prod` with the same extent.
        self.b.step(Step::Gelu {
            x: gate,
            y: act,
            elems,
        });
        self.b.step(Step::Gelu {
            x: act,
            y: prod_,
            elems,
        });
        let _ = up;
        for t in gu {
            self.consumed(t, sm);
        }
        self.consumed(act, sm);
        let c = self.c;
        let out = self.hidden_t(&format!("{p}.mlp.out"), Role::Activations, c)?;
        self.matmul(pm, prod_, out, h, f);
        self.consumed(prod_, sm);
        Ok(out)
    }

    /// A sparse mixture of experts over `n2` as transformers 5.24 runs it by default
    /// (`grouped_mm_experts_forward`): the router's logits and fp32 probabilities [T, E], top-k
    /// indices; the tokens gathered by expert [T·k, h]; gate-up [T·k, 2f], act and product
    /// [T·k, f], the down output [T·k, h] weighted by the routing weights; the sort, gather and
    /// inverse-permutation indices (int64). A shared expert (Qwen2-MoE) runs over every token.
    fn mlp_moe(
        &mut self,
        p: &str,
        pm: &str,
        n2: TensorIx,
        sm: &mut Vec<TensorIx>,
    ) -> Result<TensorIx, PlanError> {
        let (h, c) = (self.h, self.c);
        let m = self
            .w
            .moe
            .ok_or_else(|| PlanError::Invalid("a mixture of experts needs experts".into()))?;
        let t = self.rows();
        let (s_rows, fe) = self.routed()?;
        let e = m.experts;
        let logits = self.b.push(
            &format!("{p}.moe.router_logits"),
            Role::Activations,
            c,
            &[t, e],
            e,
        )?;
        self.matmul_rows(pm, n2, logits, t, e, h);
        let probs = self.b.push(
            &format!("{p}.moe.router_probs"),
            Role::Activations,
            DType::F32,
            &[t, e],
            e,
        )?;
        self.b.free(logits);
        // topk's indices and values, the sort's permutation, the gather's and the inverse
        // permutation's indices: int64 per pair.
        let index = self.b.push(
            &format!("{p}.moe.index"),
            Role::Activations,
            DType::I64,
            &[4, s_rows],
            s_rows.max(1),
        )?;
        let weights = self.b.push(
            &format!("{p}.moe.weights"),
            Role::Activations,
            DType::F32,
            &[2, s_rows],
            s_rows.max(1),
        )?;
        sm.extend([probs, index, weights]);
        // The experts read the norm's output in their weights' type (no autocast op).
        let xt = self.dtype(n2);
        let pt = param_dtype(self.w.precision);
        let row = |t: &mut Self, n: &str, dt: DType, w: u64| {
            t.b.push(
                &format!("{p}.moe.{n}"),
                Role::Activations,
                dt,
                &[s_rows, w],
                w,
            )
        };
        let xin = if xt != pt && self.ac.is_some() {
            row(self, "x_cast", pt, h)?
        } else {
            n2
        };
        let xg = row(self, "gathered", pt, h)?;
        if xin != n2 {
            self.b.free(xin);
        }
        let gu = row(self, "gate_up", pt, 2 * fe)?;
        self.matmul_rows(pm, xg, gu, s_rows, 2 * fe, h);
        let act = row(self, "act", pt, fe)?;
        let prod_ = row(self, "prod", pt, fe)?;
        let elems = s_rows.saturating_mul(fe);
        self.b.step(Step::Gelu {
            x: gu,
            y: act,
            elems,
        });
        self.b.step(Step::Gelu {
            x: act,
            y: prod_,
            elems,
        });
        sm.extend([xg, gu, act, prod_]);
        // The gate's halves and act go with `_apply_gate`; the product after the down
        // projection, which the weighting replaces; the gathered tokens when the experts'
        // function returns.
        self.consumed(gu, sm);
        self.consumed(act, sm);
        let down = row(self, "down", pt, h)?;
        self.matmul_rows(pm, prod_, down, s_rows, h, fe);
        sm.push(down);
        self.consumed(prod_, sm);
        let weighted = row(self, "weighted", pt, h)?;
        self.consumed(down, sm);
        let out = self.hidden_t(&format!("{p}.mlp.out"), Role::Activations, self.dtype(n2))?;
        self.b.free(weighted);
        self.consumed(xg, sm);
        if m.shared_ffn > 0 {
            // The shared expert (a SwiGLU over every token) and its sigmoid gate [T, 1].
            let fs = m.shared_ffn;
            let mut shared = Vec::new();
            for n in ["shared.gate", "shared.up", "shared.act", "shared.prod"] {
                shared.push(self.rows_t(&format!("{p}.moe.{n}"), Role::Activations, c, fs)?);
            }
            self.matmul(pm, n2, shared[0], fs, h);
            self.matmul(pm, n2, shared[1], fs, h);
            let so = self.hidden_t(&format!("{p}.moe.shared.out"), Role::Activations, c)?;
            self.matmul(pm, shared[3], so, h, fs);
            let sg = self.rows_t(&format!("{p}.moe.shared.gate_sig"), Role::Activations, c, 1)?;
            sm.extend(shared.iter().copied());
            sm.extend([so, sg]);
            if !self.saving {
                for x in shared.into_iter().chain([so, sg]) {
                    self.consumed(x, sm);
                }
            }
        }
        for x in [probs, index, weights] {
            self.consumed(x, sm);
        }
        self.consumed(n2, sm);
        Ok(out)
    }

    /// One layer's forward reading `x`: its two frames and its output (a new tensor). `owned`:
    /// nothing outside the layer keeps `x` (it goes after the residual add unless saved). Not
    /// `saving` (no_grad), each intermediate goes once its last reader ran.
    fn layer(
        &mut self,
        i: u64,
        p: &str,
        x: TensorIx,
        out_name: &str,
        saving: bool,
        owned: bool,
    ) -> Result<(Frame, Frame, TensorIx), PlanError> {
        self.saving = saving;
        let (h, f) = (self.h, self.f);
        let (pa, pm) = (format!("L{i}.attn"), format!("L{i}.mlp"));
        let llm = self.w.is_decoder_llm();
        self.use_piece(&pa)?;
        let mut sa = Vec::new();
        let n1 = self.norm(&format!("{p}.ln1"), x, &mut sa)?;
        let readers = if self.spec.fused_qkv { 1 } else { 3 };
        let n1 = self.matmul_input(n1, readers, false, &mut sa)?;
        let ctx = if llm {
            self.attention_llm(p, &pa, n1, &mut sa)?
        } else {
            self.attention_gpt(p, &pa, n1, &mut sa)?
        };
        let ctx = self.matmul_input(ctx, 1, false, &mut sa)?;
        self.mask(&format!("{p}.proj.drop_mask"), &mut sa)?;
        let mut sm = Vec::new();
        let qw = self.qw;
        // The projection's output plus the residual: the residual stream's type. Gemma 2/3
        // normalize the projection's output first (its norm saves it).
        let x2 = if self.spec.sandwich_norms {
            let c = self.c;
            let o = self.hidden_t(&format!("{p}.attn.out"), Role::Activations, c)?;
            self.matmul(&pa, ctx, o, h, qw);
            self.consumed(ctx, &mut sa);
            let y = self.norm(&format!("{p}.post_attn_norm"), o, &mut sa)?;
            let x2 = self.resid(&format!("{p}.ln2.in"))?;
            self.b.free(y);
            if !sa.contains(&o) {
                self.b.free(o);
            }
            x2
        } else {
            let x2 = self.resid(&format!("{p}.ln2.in"))?;
            self.matmul(&pa, ctx, x2, h, qw);
            self.consumed(ctx, &mut sa);
            x2
        };
        // The residual add was the input's last reader, but the model's loop variable keeps it
        // until the layer returns: an owned input goes then, unless a norm saved it (not
        // saving, nothing is kept).
        if !saving {
            let done: Vec<TensorIx> = sa.drain(..).filter(|&t| t != x).collect();
            self.b.free_all(done);
        }
        if owned && !sa.contains(&x) {
            if llm {
                self.layer_tail.push(x);
            } else {
                self.b.free(x);
            }
        }
        self.use_piece(&pm)?;
        let n2 = self.norm(&format!("{p}.ln2"), x2, &mut sm)?;
        let readers = match (self.spec.mlp, self.spec.fused_gate_up) {
            (Mlp::Gated, false) => 2,
            _ => 1,
        };
        let n2 = self.matmul_input(n2, readers, false, &mut sm)?;
        let elems = self.rows().saturating_mul(f);
        let mlp_out = match self.spec.mlp {
            Mlp::Gated => Some(self.mlp_gated(p, &pm, n2, &mut sm)?),
            Mlp::Moe => Some(self.mlp_moe(p, &pm, n2, &mut sm)?),
            Mlp::Gelu => None,
        };
        let out = match mlp_out {
            Some(o) => {
                let y = if self.spec.sandwich_norms {
                    let y = self.norm(&format!("{p}.post_ffn_norm"), o, &mut sm)?;
                    if !sm.contains(&o) {
                        self.b.free(o);
                    }
                    y
                } else {
                    o
                };
                let out = self.resid(out_name)?;
                self.b.free(y);
                out
            }
            None => {
                let fc1 = self.wide(&format!("{p}.fc1.out"))?;
                self.matmul(&pm, n2, fc1, f, h);
                let last = self.activation(p, fc1, &mut sm)?;
                let _ = elems;
                self.mask(&format!("{p}.mlp.drop_mask"), &mut sm)?;
                let out = self.resid(out_name)?;
                self.matmul(&pm, last, out, h, f);
                out
            }
        };
        if !sm.contains(&x2) {
            self.b.free(x2);
        }
        if !saving {
            let done = std::mem::take(&mut sm);
            self.b.free_all(done);
        }
        let tail = std::mem::take(&mut self.layer_tail);
        self.b.free_all(tail);
        Ok((
            Frame {
                block: Block::Attn,
                piece: pa,
                saved: sa,
            },
            Frame {
                block: Block::Mlp,
                piece: pm,
                saved: sm,
            },
            out,
        ))
    }

    /// Layers `from..to` in forward from `x`. Saving (a training forward without
    /// checkpointing, or a recomputation) keeps every frame; otherwise (inference, a checkpointed
    /// segment under no_grad) each layer's tensors are freed as they are used, except `x`.
    /// `x_owned`: the first layer owns `x` (the embedding's output in a plain forward), rather
    /// than a checkpoint or the caller keeping it.
    fn layers(
        &mut self,
        from: u64,
        to: u64,
        x: TensorIx,
        saving: bool,
        x_owned: bool,
        out_name: &dyn Fn(u64) -> String,
    ) -> Result<(Vec<Frame>, TensorIx), PlanError> {
        let mut frames = Vec::new();
        let mut cur = x;
        for i in from..to {
            let owned = i > from || x_owned;
            let (fa, fm, out) =
                self.layer(i, &format!("L{i}"), cur, &out_name(i), saving, owned)?;
            if saving {
                frames.push(fa);
                frames.push(fm);
            } else {
                for t in fa.saved.into_iter().chain(fm.saved) {
                    if t != x {
                        self.b.free(t);
                    }
                }
                if owned && cur != x {
                    // (freed with its frame above, or after its residual add)
                }
            }
            cur = out;
        }
        Ok((frames, cur))
    }

    fn backward(&mut self, fr: Frame, incoming: TensorIx) -> Result<TensorIx, PlanError> {
        let w = self.w;
        self.states.gradient(self.b, &fr.piece, w)?;
        let p = &fr.piece;
        let c = self.c;
        // The gradient the block's inner ops end with ([b,s,f] for the MLP, [b,s,3h] for q/k/v).
        let inner = match fr.block {
            Block::Mlp if self.spec.mlp == Mlp::Moe => {
                // Per routed token-expert pair: the down projection's input gradient [T·k, f],
                // then the gate-up output's [T·k, 2f]; the gather's backward scatters into the
                // norm output's gradient.
                let (s_rows, fe) = self.routed()?;
                let g1 = self.b.push(
                    &format!("{p}.grad_experts_out"),
                    Role::Workspace,
                    c,
                    &[s_rows, fe],
                    fe,
                )?;
                let g2 = self.b.push(
                    &format!("{p}.grad_experts_in"),
                    Role::Workspace,
                    c,
                    &[s_rows, 2 * fe],
                    2 * fe,
                )?;
                self.b.free(g1);
                g2
            }
            Block::Mlp => {
                // fc2 backward makes the gradient of its input [b,s,f]; the activation's backward
                // another [b,s,f] (both alive for a moment); fc1's the gradient of LN2's output.
                let g1 = self.wide_as(&format!("{p}.grad_wide_out"), Role::Workspace)?;
                let g2 = self.wide_as(&format!("{p}.grad_wide_in"), Role::Workspace)?;
                self.b.free(g1);
                g2
            }
            Block::Attn => {
                let gctx = self.hidden(&format!("{p}.grad_ctx"), Role::Workspace)?;
                let mut last = gctx;
                let scores_saved = fr
                    .saved
                    .iter()
                    .any(|&t| self.b.tensor(t).name.ends_with(".attn.probs"));
                if scores_saved {
                    // probs·V backward: the gradient of the probabilities; softmax backward: of
                    // the scores (in the probabilities' type); the scale/mask ops pass on one
                    // more of the same size.
                    let pt = fr
                        .saved
                        .iter()
                        .map(|&t| self.b.tensor(t))
                        .find(|t| t.name.ends_with(".attn.probs"))
                        .map_or(c, |t| t.dtype);
                    let g1 = self.scores(&format!("{p}.grad_probs"), Role::Workspace, c)?;
                    let g2 = self.scores(&format!("{p}.grad_scores"), Role::Workspace, pt)?;
                    self.b.free(g1);
                    self.b.free(last);
                    last = g2;
                }
                let width = self.qw + 2 * self.kvw;
                let gqkv = self.rows_t(&format!("{p}.grad_qkv"), Role::Workspace, c, width)?;
                self.b.free(last);
                gqkv
            }
        };
        // The block's input projection makes the gradient of its norm's output (16-bit under
        // autocast, then cast back), the norm's backward (with the residual) that of the
        // block's input.
        let mut gn = self.hidden(&format!("{p}.grad_norm_out"), Role::Workspace)?;
        self.b.free(inner);
        if self.r != c {
            let g = self.hidden_t(&format!("{p}.grad_norm_out32"), Role::Workspace, self.r)?;
            self.b.free(gn);
            gn = g;
        }
        let gx = self.hidden_t(&format!("{p}.grad_in"), Role::Workspace, self.r)?;
        self.b.free(gn);
        self.b.free_all(fr.saved);
        self.b.free(incoming);
        Ok(gx)
    }
}

/// Checkpoint segment length K, or None without checkpointing.
pub fn segment(checkpoint: Checkpoint, layers: u64) -> Option<u64> {
    match checkpoint {
        Checkpoint::None => None,
        Checkpoint::Full => Some(1),
        Checkpoint::Every(k) => Some(u64::from(k).max(1)),
        Checkpoint::Sqrt => {
            let mut r = (layers as f64).sqrt().ceil() as u64;
            while r.saturating_mul(r) < layers {
                r += 1;
            }
            while r > 1 && (r - 1).saturating_mul(r - 1) >= layers {
                r -= 1;
            }
            Some(r.max(1))
        }
    }
}

/// Build a transformer step's timeline at the workload's batch and sequence.
pub fn build(b: &mut Builder, w: &Workload) -> Result<(), PlanError> {
    let (bsz, s, h, a, f, v) = (w.batch, w.seq, w.hidden, w.heads, w.ffn, w.vocab);
    let spec = spec_of(w)?;
    let (qw, kvw, d) = widths(w)?;
    let c = compute_dtype(w.precision);
    let train = !w.inference();
    let states = States::setup(b, w, &pieces(w)?)?;
    let zero3 = w.zero == 3 && w.gpus > 1;
    let ac = super::params::autocast(w);
    let mut t = T {
        b,
        w,
        spec,
        states,
        bsz,
        s,
        h,
        a,
        f,
        g: w.kv_heads(),
        d,
        qw,
        kvw,
        c,
        r: if ac.is_some() { DType::F32 } else { c },
        ac,
        dropout: w.dropout && train,
        train,
        saving: train,
        gather: None,
        rope: None,
        layer_tail: Vec::new(),
        held: Vec::new(),
    };
    t.b.phase(Phase::Forward);
    if zero3 {
        // One layer's gathered weights (or the embedding/head matrix if larger), prefetched
        // for the whole forward and backward.
        let e = "the ZeRO-3 gather buffer";
        let mut gather = layer_params(w)?.max(prod(&[v, h], e)?);
        if spec.embed == Embed::Patches {
            gather = gather.max(prod(&[3, w.patch, w.patch, h], e)?);
        }
        t.gather = Some(t.b.push(
            "ws.zero3_gather",
            Role::Workspace,
            c,
            &[gather],
            h.min(gather),
        )?);
    }

    // Embedding: its saved tensors form the last backward frame.
    let mut emb_saved = Vec::new();
    // Held by the caller until the step ends, not saved (autocast: the conv saves its copy).
    let mut inputs = Vec::new();
    let x0 = match spec.embed {
        Embed::Patches => {
            let img = w.image;
            t.use_piece("embed.rest")?;
            let shape = [bsz, 3, img, img];
            let image = if ac.is_some() {
                // The pixels stay fp32 (an input); the patch conv saves its 16-bit copy.
                let px =
                    t.b.push("input.image", Role::Workspace, DType::F32, &shape, img)?;
                inputs.push(px);
                t.b.push("image.cast", Role::Activations, c, &shape, img)?
            } else {
                t.b.push("image", Role::Activations, c, &shape, img)?
            };
            // The conv's 16-bit output joins the fp32 class token and positions: fp32.
            let x0 = t.resid("L0.in")?;
            let wt = t.weights("embed.rest");
            t.b.step(Step::Conv2d {
                x: image,
                w: wt,
                y: x0,
                n: bsz,
                c_in: 3,
                h: img,
                w_in: img,
                c_out: h,
                kernel: w.patch,
                stride: w.patch,
                pad: 0,
            });
            if train || ac.is_none() {
                emb_saved.push(image);
            } else {
                // Under no_grad nothing keeps the pixels' 16-bit copy past the conv.
                t.b.free(image);
            }
            x0
        }
        Embed::TokensNorm => {
            let ln_in = t.resid("emb.ln_in")?;
            let y = t.norm("L0.in", ln_in, &mut emb_saved)?;
            if !train {
                // Under no_grad the embeddings' sum goes once normed.
                emb_saved.retain(|&x| x != ln_in);
                t.b.free(ln_in);
            }
            y
        }
        // Embedding lookups are not autocast ops: the fp32 tables give fp32 rows. Gemma
        // multiplies them by √hidden into a new tensor.
        Embed::Tokens if spec.embed_scale => {
            let raw = t.resid("emb.raw")?;
            let x0 = t.resid("L0.in")?;
            t.b.free(raw);
            x0
        }
        Embed::Tokens => t.resid("L0.in")?,
    };
    // RoPE cos and sin [1, s, d], in the embeddings' type: made once, read (and saved) by
    // every layer's rotation.
    if spec.rope {
        let r = t.r;
        t.rope = Some(t.b.push("rope.cos_sin", Role::Activations, r, &[2, 1, s, d], d)?);
    }
    // The decoder LLMs' forward keeps `inputs_embeds` (the first layer's input) until it
    // returns, and eager attention reads a materialized [b, 1, s, s] causal mask in the
    // embeddings' type (Gemma 2/3 one more for their sliding-window layers), alive as long.
    let llm = w.is_decoder_llm();
    let mut masks = Vec::new();
    if llm && w.attention == Attention::Naive {
        let n = if spec.sandwich_norms { 2 } else { 1 };
        for i in 0..n {
            let r = t.r;
            masks.push(t.b.push(
                &format!("attn.causal_mask{i}"),
                Role::Workspace,
                r,
                &[bsz, 1, s, s],
                s,
            )?);
        }
    }
    t.mask("emb.drop_mask", &mut emb_saved)?;

    // Layers.
    let l = w.layers;
    let name_out = |i: u64| {
        if i + 1 == l {
            "head.in".to_string()
        } else {
            format!("L{}.in", i + 1)
        }
    };
    let seg = if train {
        segment(w.checkpoint, l)
    } else {
        None
    };
    let mut frames = Vec::new();
    let mut ckpts = Vec::new();
    let head_in = match seg {
        None => {
            let (fr, out) = t.layers(0, l, x0, train, !llm, &name_out)?;
            frames = fr;
            out
        }
        Some(k) => {
            let mut x = x0;
            let mut j = 0;
            while j < l {
                let end = (j + k).min(l);
                ckpts.push((j, end, x));
                let ckpt_name = |i: u64| {
                    if i + 1 == l {
                        "head.in".to_string()
                    } else {
                        format!("ckpt.L{}.in", i + 1)
                    }
                };
                let (_, out) = t.layers(j, end, x, false, false, &ckpt_name)?;
                x = out;
                j = end;
            }
            t.b.note(format!(
                "checkpointing: inputs of every {k}th layer stored ({} of {l}), each segment recomputed in backward",
                ckpts.len()
            ));
            x
        }
    };

    if !train {
        // Under no_grad the tables go with the last layer.
        if let Some(cs) = t.rope.take() {
            t.b.free(cs);
        }
    }
    t.saving = train;

    // Head and loss.
    let classes_only = spec.head == Head::Classifier;
    let head_piece = if w.tied_head() { "embed" } else { "head" };
    let head_piece = if classes_only {
        "head.rest"
    } else {
        head_piece
    };
    let mut head_saved = Vec::new();
    let mut head_tail = None;
    let head_x = if spec.head == Head::Mlm {
        t.use_piece("head.rest")?;
        // The MLM transform: dense (saves its input, a 16-bit copy under autocast), GELU,
        // LayerNorm over the GELU's 16-bit output: CUDA's autocast runs it in fp32 on an fp32
        // copy (which its backward saves), CPU's in the input's type.
        // Under no_grad each of these goes once read; the encoder's output stays with the
        // returned outputs until the logits exist.
        if !train {
            head_tail = Some(head_in);
        }
        let x = t.matmul_input(head_in, 1, !train, &mut head_saved)?;
        let d = t.hidden("head.dense_out", Role::Activations)?;
        t.matmul("head.rest", x, d, h, h);
        if !train && x != head_in {
            head_saved.retain(|&y| y != x);
            t.b.free(x);
        }
        let g = t.hidden("head.gelu_out", Role::Activations)?;
        let elems = t.rows().saturating_mul(h);
        t.b.step(Step::Gelu { x: d, y: g, elems });
        if train {
            head_saved.push(d);
        } else {
            t.b.free(d);
        }
        let ln_in = if ac.is_some_and(|a| a.casts_input("layer_norm", c)) {
            let g32 = t.hidden_t("head.gelu_out32", Role::Activations, DType::F32)?;
            t.b.free(g);
            g32
        } else {
            g
        };
        let n = t.norm("head.ln", ln_in, &mut head_saved)?;
        if !train {
            head_saved.retain(|&y| y != ln_in);
            t.b.free(ln_in);
        }
        t.use_piece(head_piece)?;
        t.matmul_input(n, 1, false, &mut head_saved)?
    } else {
        let n = t.norm("final_ln", head_in, &mut head_saved)?;
        if !train {
            // Under no_grad the last layer's output goes once normed.
            head_saved.retain(|&x| x != head_in);
        }
        if !head_saved.contains(&head_in) {
            // (A 16-bit RMSNorm saves its fp32 copy instead.)
            t.b.free(head_in);
        }
        // The model's forward returns: its mask and `inputs_embeds` go (the embeddings unless
        // the first layer saved them or they are the first checkpoint).
        t.b.free_all(std::mem::take(&mut masks));
        if llm && seg.is_none() && !frames.iter().any(|f| f.saved.contains(&x0)) {
            t.b.free(x0);
        }
        t.use_piece(head_piece)?;
        if classes_only && ac.is_some() {
            // ViT's classifier reads `sequence_output[:, 0]`: under autocast it saves a [b, h]
            // 16-bit copy of that token, and the fp32 norm output goes; without autocast
            // it saves a view, which keeps the whole [b, s, h] output alive.
            let tok =
                t.b.push("head.cls_cast", Role::Activations, c, &[bsz, h], h)?;
            head_saved.push(tok);
            t.b.free(n);
            tok
        } else if llm {
            // The decoder LLMs' head reads `outputs.last_hidden_state`: the normed output
            // stays alive through the head even when autocast casts it.
            let x = t.matmul_input(n, 1, true, &mut head_saved)?;
            if x != n {
                head_tail = Some(n);
            } else {
                head_saved.push(n);
            }
            x
        } else {
            t.matmul_input(n, 1, false, &mut head_saved)?
        }
    };
    let (logit_rows, logit_shape): (u64, Vec<u64>) = if classes_only {
        (bsz, vec![bsz, v])
    } else {
        (bsz.saturating_mul(s), vec![bsz, s, v])
    };
    let logits = t.b.push("logits", Role::Activations, c, &logit_shape, v)?;
    let wt = t.weights(head_piece);
    t.b.step(Step::Matmul {
        a: head_x,
        b: wt,
        c: logits,
        batch: 1,
        m: logit_rows,
        n: v,
        k: h,
    });
    t.b.free_all(head_tail);
    let logits = if w.logit_softcap {
        // Gemma 2: logits / cap, tanh (which saves its output), · cap: new [b, s, V] tensors.
        let tanh =
            t.b.push("logits.softcap_tanh", Role::Activations, c, &logit_shape, v)?;
        let capped =
            t.b.push("logits.capped", Role::Activations, c, &logit_shape, v)?;
        t.b.free(logits);
        if train {
            head_saved.push(tanh);
        } else {
            t.b.free(tanh);
        }
        capped
    } else {
        logits
    };
    if !train {
        // autocast exits with the forward: the weight-cast cache is cleared.
        t.states.autocast_exit(t.b, |_| true);
        t.b.free_all(head_saved);
        t.b.free_all(emb_saved);
        // The caller keeps the logits (and a KV cache) until the step is over.
        t.b.free(logits);
        let held = std::mem::take(&mut t.held);
        t.b.free_all(held);
        t.b.free_all(inputs);
        return Ok(());
    }
    t.held.push(logits);
    t.b.phase(Phase::Loss);
    // The loss's log-softmax output (saved by log_softmax and nll_loss backward) and whether
    // an fp32 copy of the logits is made first:
    // - GPT-2 and ViT (HF's `ForCausalLMLoss` / classification loss): `logits.float()`, an
    //   fp32 copy in any 16-bit precision, fp32 log-probabilities.
    // - BERT (`CrossEntropyLoss` on the logits as they are): without autocast the
    //   log-softmax runs in the logits' type; CPU autocast puts `cross_entropy_loss` on its
    //   fp32 list (an fp32 copy); CUDA's runs `log_softmax` with `dtype=float32`, which for
    //   fp16 is one kernel (`half_to_float`, no copy; aten/src/ATen/native/SoftMax.cpp) and
    //   for bf16 converts first (a copy).
    let (lp_dtype, copy, half_to_float) = if spec.head != Head::Mlm {
        (DType::F32, c != DType::F32, false)
    } else {
        match ac {
            None => (c, false, false),
            Some(a) if a.device == autocast::Device::Cuda && c == DType::F16 => {
                (DType::F32, false, true)
            }
            Some(_) => (DType::F32, true, false),
        }
    };
    let logprobs =
        t.b.loss_log_softmax(logits, logit_rows, v, copy, lp_dtype)?;
    // The autocast region ends with the loss: the cache is cleared (bias copies go; weight
    // copies stay saved by the matmuls, except those of checkpointed layers, run under no_grad).
    let ckpt_layers = seg.is_some();
    t.states
        .autocast_exit(t.b, |name| ckpt_layers && name.starts_with('L'));

    // Backward: nll_loss and log_softmax backward make two [rows, V] gradients (fp32 when the
    // log-probabilities are; `half_to_float`'s backward gives the logits' type directly).
    t.b.phase(Phase::Backward);
    let g_lp =
        t.b.push("grad.logprobs", Role::Workspace, lp_dtype, &logit_shape, v)?;
    let gl_dtype = if half_to_float { c } else { lp_dtype };
    let g_logits =
        t.b.push("grad.logits", Role::Workspace, gl_dtype, &logit_shape, v)?;
    t.b.free(g_lp);
    t.b.free(logprobs);
    let g_logits = if gl_dtype == c {
        g_logits
    } else {
        let g =
            t.b.push("grad.logits_16", Role::Workspace, c, &logit_shape, v)?;
        t.b.free(g_logits);
        g
    };
    // The head's matmul: its weight gradient and the gradient of its input.
    let w_ = t.w;
    if head_piece == "embed" {
        // A tied head: its gradient waits for the embedding's.
        t.states.gradient_part(t.b, head_piece, w_)?;
    } else {
        t.states.gradient(t.b, head_piece, w_)?;
    }
    // (ViT's classifier reads one token; its input gradient is still [b, s, h], zeros elsewhere.)
    let mut gx = t.hidden("grad.head_x", Role::Workspace)?;
    t.b.free(g_logits);
    if t.r != c {
        // ToCopyBackward0: the 16-bit gradient of the head's input copy becomes fp32.
        let g = t.hidden_t("grad.head_x32", Role::Workspace, t.r)?;
        t.b.free(gx);
        gx = g;
    }
    if head_piece != "head.rest" {
        t.states.gradient(t.b, "head.rest", w_)?;
    }
    let gin = t.hidden_t("grad.head_in", Role::Workspace, t.r)?;
    t.b.free(gx);
    t.b.free_all(head_saved);
    let mut g = gin;
    match seg {
        None => {
            while let Some(fr) = frames.pop() {
                g = t.backward(fr, g)?;
            }
        }
        Some(_) => {
            while let Some((from, to, x)) = ckpts.pop() {
                // Recompute the segment from its checkpoint, then backward through it.
                let (mut fr, out) = t.layers(from, to, x, true, false, &|i| {
                    format!("recompute.L{}.out", i + 1)
                })?;
                t.b.free(out);
                // A checkpoint no recomputed norm saved (16-bit RMSNorm saves its fp32 copy)
                // goes with its segment.
                let kept = fr.iter().any(|f| f.saved.contains(&x));
                while let Some(f) = fr.pop() {
                    g = t.backward(f, g)?;
                }
                if !kept {
                    t.b.free(x);
                }
            }
        }
    }
    // Embedding backward: the dense gradient of the token embedding (added into the tied head's
    // gradient when it already exists) and of the positions.
    t.states.gradient(t.b, "embed", w_)?;
    // The last op (ViT's patch convolution, or the position lookup) releases what it saved
    // and its incoming gradient before its weight's gradient is converted to fp32.
    t.states.gradient_then(t.b, "embed.rest", w_, |b| {
        b.free_all(emb_saved);
        b.free(g);
    })?;
    if let Some(cs) = t.rope.take() {
        t.b.free(cs);
    }
    if let Some(gb) = t.gather.take() {
        t.b.free(gb);
    }
    // The caller drops the outputs (logits, cache) once backward is done: Hugging Face's Trainer
    // and Lightning keep only the detached loss through the optimizer step.
    let held = std::mem::take(&mut t.held);
    t.b.free_all(held);
    t.b.free_all(inputs);
    t.states.optimizer_step(t.b, w_)?;
    Ok(())
}
