//! Transformer plans (GPT-2, BERT, LLaMA, ViT) per Korthikanti et al. generalized to the element size.
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
//! # LLaMA layer (SwiGLU MLP, RMSNorm, no dropout, RoPE)
//!
//! `in` (RMSNorm1 input), `n1` (QKV input), rotated `q`, `k`, `v`, `attn.probs`, `ctx`, `x2`
//! (residual = RMSNorm2 input), `n2` (gate/up input): 8B·sbh; `gate` (SiLU input), `up`,
//! `act` = SiLU(gate), `prod` = act·up (down-projection input): 4B·sbf; scores B·as²b. The
//! pre-rotation q, k are not stored (the rotation is linear; its backward needs only sin/cos).
//!
//! # Flash attention
//!
//! Drops every as²b term (probs, dropout mask and output, and the scores workspace) and stores
//! per-row softmax statistics `attn.stats` [b,a,s,2] in fp32 (row max and row sum).
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

use super::autocast::{self, Autocast};
use super::build::{prod, sum, Builder, PlanError};
use super::params::{compute_dtype, Piece, States};
use super::{DType, Phase, Role, Step, TensorIx};
use crate::workload::{presets::vit_tokens, Arch, Attention, Checkpoint, Gelu, Workload};

/// Parameters of one layer's attention block (with its norm) and MLP block (with its norm).
fn block_params(w: &Workload) -> Result<(u64, u64), PlanError> {
    let (h, f) = (w.hidden, w.ffn);
    let e = "the per-layer parameter count";
    let hh = prod(&[4, h, h], e)?;
    match w.arch {
        // q, k, v, o without biases + one RMSNorm gain; gate, up, down + one RMSNorm gain.
        Arch::Llama => Ok((sum(&[hh, h], e)?, sum(&[prod(&[3, h, f], e)?, h], e)?)),
        // q, k, v, o with biases (4h² + 4h) + LN (2h); fc1, fc2 with biases (2hf + f + h) + LN.
        _ => Ok((
            sum(&[hh, prod(&[6, h], e)?], e)?,
            sum(&[prod(&[2, h, f], e)?, f, prod(&[3, h], e)?], e)?,
        )),
    }
}

/// Parameters of one transformer layer.
pub fn layer_params(w: &Workload) -> Result<u64, PlanError> {
    let (a, m) = block_params(w)?;
    sum(&[a, m], "the per-layer parameter count")
}

/// The model's parameter groups in backward order of need: `embed` (the token embedding, also
/// the output head when tied), `embed.rest` (positions, token types, embedding norm, patch
/// embedding), per layer `L{i}.attn` and `L{i}.mlp`, `head.rest` (final norm, BERT's MLM
/// transform and decoder bias, ViT's classifier) and `head` (an untied output head).
pub fn pieces(w: &Workload) -> Result<Vec<Piece>, PlanError> {
    let (h, v) = (w.hidden, w.vocab);
    let e = "the parameter count";
    let emb = prod(&[v, h], e)?;
    // Learned positions grow with a longer --seq than the preset's context.
    let positions = prod(&[w.max_positions.max(w.seq), h], e)?;
    let (embed, embed_rest, head_rest) = match w.arch {
        // wte; wpe; final LN.
        Arch::Gpt2 => (emb, positions, 2 * h),
        // word; position + token type (2h) + LN (2h); MLM transform (h² + h) + LN (2h) +
        // decoder bias (V). BertForMaskedLM has no pooler.
        Arch::Bert => (
            emb,
            sum(&[positions, 4 * h], e)?,
            sum(&[prod(&[h, h], e)?, 3 * h, v], e)?,
        ),
        // embed; final RMSNorm.
        Arch::Llama => (emb, 0, h),
        // patch conv (3p²h + h) + class token (h) + positions (tokens·h); final LN (2h) +
        // classifier (hC + C).
        Arch::Vit => {
            let conv = sum(&[prod(&[3, w.patch, w.patch, h], e)?, h], e)?;
            let pos = prod(&[vit_tokens(w.image, w.patch), h], e)?;
            (0, sum(&[conv, h, pos], e)?, sum(&[2 * h, emb, v], e)?)
        }
        Arch::Resnet | Arch::Dense => return Err(PlanError::Invalid("not a transformer".into())),
    };
    let (attn, mlp) = block_params(w)?;
    let mut out = vec![
        Piece::new("embed", embed),
        Piece::new("embed.rest", embed_rest),
    ];
    for i in 0..w.layers {
        out.push(Piece::new(format!("L{i}.attn"), attn));
        out.push(Piece::new(format!("L{i}.mlp"), mlp));
    }
    out.push(Piece::new("head.rest", head_rest));
    if w.arch != Arch::Vit && !w.tied_head() {
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

/// How a model's code runs attention's softmax (Hugging Face transformers 5.24,
/// `eager_attention_forward` of each model), which decides the probabilities' type together with
/// autocast's lists.
#[derive(Debug, Clone, Copy)]
struct SoftmaxCode {
    /// `softmax(..., dtype=torch.float32)` (ViT, LLaMA): fp32 probabilities whatever the input.
    fp32: bool,
    /// The scores get `+ attention_mask` first, a mask in the embeddings' type (GPT-2's causal
    /// mask): under autocast that promotes the 16-bit scores to fp32.
    mask_promotes: bool,
    /// The probabilities are cast back to the values' type right after the softmax
    /// (`.type(value.dtype)` in GPT-2, `.to(query.dtype)` in ViT and LLaMA); BERT does not, so
    /// under autocast its dropout runs on fp32 probabilities and the matmul casts them.
    cast_back: bool,
}

impl SoftmaxCode {
    fn of(arch: Arch) -> SoftmaxCode {
        match arch {
            Arch::Gpt2 => SoftmaxCode {
                fp32: false,
                mask_promotes: true,
                cast_back: true,
            },
            Arch::Bert => SoftmaxCode {
                fp32: false,
                mask_promotes: false,
                cast_back: false,
            },
            _ => SoftmaxCode {
                fp32: true,
                mask_promotes: false,
                cast_back: true,
            },
        }
    }
}

struct T<'a> {
    b: &'a mut Builder,
    w: &'a Workload,
    states: States,
    bsz: u64,
    s: u64,
    h: u64,
    a: u64,
    f: u64,
    /// The compute type: matmul outputs (autocast's lower-precision type under `amp-*`).
    c: DType,
    /// The residual stream's type: fp32 under autocast (fp32 embeddings plus 16-bit block
    /// outputs promote to fp32), else `c`.
    r: DType,
    /// Autocast and the op lists in effect.
    ac: Option<Autocast>,
    softmax: SoftmaxCode,
    /// How many projections read the attention's normed input (GPT-2's fused `c_attn`: 1;
    /// separate q, k, v Linears: 3). Under autocast each casts it separately and saves its copy.
    qkv_readers: u64,
    dropout: bool,
    flash: bool,
    causal: bool,
    llama: bool,
    train: bool,
    /// ZeRO-3's gathered weights (kernels read them instead of the local shard).
    gather: Option<TensorIx>,
    /// Tensors the caller holds until the end of the step (logits, a kept KV cache).
    held: Vec<TensorIx>,
}

/// Parameters of piece `name` that autocast casts to 16 bits (matmul and conv weights, and
/// biases, which no backward saves): (weights, biases, the weight and bias of the piece's first
/// matmul, which backward reaches last). LayerNorm/RMSNorm gains, position and token-type
/// embeddings are used in fp32 and never cast.
fn cast_elems(w: &Workload, name: &str) -> Result<(u64, u64, u64), PlanError> {
    let (h, f, v) = (w.hidden, w.ffn, w.vocab);
    let e = "the weight-cast cache";
    let llama = w.arch == Arch::Llama;
    let hh = prod(&[h, h], e)?;
    let hf = prod(&[h, f], e)?;
    Ok(if name.ends_with(".attn") {
        // GPT-2's fused c_attn (3h² + 3h) is its first matmul; the others' q projection.
        let first = match w.arch {
            Arch::Gpt2 => sum(&[prod(&[3, h, h], e)?, 3 * h], e)?,
            Arch::Llama => hh,
            _ => sum(&[hh, h], e)?,
        };
        (prod(&[4, h, h], e)?, if llama { 0 } else { 4 * h }, first)
    } else if name.ends_with(".mlp") {
        if llama {
            (prod(&[3, h, f], e)?, 0, hf)
        } else {
            (prod(&[2, h, f], e)?, sum(&[f, h], e)?, sum(&[hf, f], e)?)
        }
    } else {
        match (name, w.arch) {
            ("embed" | "head", _) => {
                let vh = prod(&[v, h], e)?;
                (vh, 0, vh)
            }
            // BERT's MLM transform dense and the decoder's bias; ViT's classifier.
            ("head.rest", Arch::Bert) => (hh, sum(&[h, v], e)?, sum(&[hh, h], e)?),
            ("head.rest", Arch::Vit) => {
                let hv = prod(&[h, v], e)?;
                (hv, v, sum(&[hv, v], e)?)
            }
            // ViT's patch convolution.
            ("embed.rest", Arch::Vit) => {
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
    fn matmul(&mut self, piece: &str, a: TensorIx, c: TensorIx, n: u64, k: u64) {
        let m = self.rows();
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
    fn norm(&mut self, x: TensorIx, y: TensorIx) {
        let (rows, cols) = (self.rows(), self.h);
        self.b.step(Step::LayerNorm { x, y, rows, cols });
    }

    /// A layer norm over residual `x` (whose backward saves `x`): its output, in the type the
    /// op lists give it.
    fn norm_out(&mut self, name: &str, x: TensorIx) -> Result<TensorIx, PlanError> {
        let dt = self.out("layer_norm", &[self.dtype(x)]);
        let y = self.hidden_t(name, Role::Activations, dt)?;
        self.norm(x, y);
        Ok(y)
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
            if !src_kept {
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
            self.b.free(src);
        }
        Ok(first.unwrap_or(src))
    }

    /// The attention core: q, k, v, the probabilities (naive; the pre-softmax scores are a
    /// temporary) or the softmax statistics (flash), and the context.
    fn attention(
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
        let cache = self.w.kv_cache && self.causal && !ckpt;
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
        let causal = self.causal;
        if self.flash {
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
            });
            Ok(ctx)
        } else {
            let scores = self.scores(&format!("{p}.attn.scores"), Role::Workspace, c)?;
            // The probabilities' type: the model's own softmax call and autocast's lists.
            let sm = self.softmax;
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

    /// One layer's forward reading `x`: its two frames and its output (a new tensor). Not
    /// `saving` (no_grad), the attention block's tensors other than `x` go once its output
    /// exists (nothing holds them).
    fn layer(
        &mut self,
        i: u64,
        p: &str,
        x: TensorIx,
        out_name: &str,
        saving: bool,
    ) -> Result<(Frame, Frame, TensorIx), PlanError> {
        let (h, f) = (self.h, self.f);
        let (pa, pm) = (format!("L{i}.attn"), format!("L{i}.mlp"));
        self.use_piece(&pa)?;
        let mut sa = vec![x];
        let n1 = self.norm_out(&format!("{p}.ln1.out"), x)?;
        let n1 = self.matmul_input(n1, self.qkv_readers, false, &mut sa)?;
        let ctx = self.attention(p, &pa, n1, &mut sa)?;
        self.mask(&format!("{p}.proj.drop_mask"), &mut sa)?;
        let mut sm = Vec::new();
        // The projection's output plus the residual: the residual stream's type.
        let x2 = self.resid(&format!("{p}.ln2.in"))?;
        sm.push(x2);
        self.matmul(&pa, ctx, x2, h, h);
        if !saving {
            let done: Vec<TensorIx> = sa.drain(1..).collect();
            self.b.free_all(done);
        }
        self.use_piece(&pm)?;
        let n2 = self.norm_out(&format!("{p}.ln2.out"), x2)?;
        // LLaMA's gate and up projections both read the norm's output.
        let readers = if self.llama { 2 } else { 1 };
        let n2 = self.matmul_input(n2, readers, false, &mut sm)?;
        let elems = self.rows().saturating_mul(f);
        let last = if self.llama {
            let gate = self.wide(&format!("{p}.mlp.gate"))?;
            let up = self.wide(&format!("{p}.mlp.up"))?;
            let act = self.wide(&format!("{p}.mlp.act"))?;
            let prod = self.wide(&format!("{p}.mlp.prod"))?;
            sm.extend([gate, up, act, prod]);
            self.matmul(&pm, n2, gate, f, h);
            self.matmul(&pm, n2, up, f, h);
            // SiLU runs as the GeLU kernel (same cost class); the gate product act·up has no
            // kernel of its own, so a GeLU over act writes `prod` with the same extent.
            self.b.step(Step::Gelu {
                x: gate,
                y: act,
                elems,
            });
            self.b.step(Step::Gelu {
                x: act,
                y: prod,
                elems,
            });
            prod
        } else {
            let fc1 = self.wide(&format!("{p}.fc1.out"))?;
            self.matmul(&pm, n2, fc1, f, h);
            self.activation(p, fc1, &mut sm)?
        };
        self.mask(&format!("{p}.mlp.drop_mask"), &mut sm)?;
        let out = self.resid(out_name)?;
        self.matmul(&pm, last, out, h, f);
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
    /// segment under no_grad) each layer's tensors are freed once its output exists, except `x`.
    fn layers(
        &mut self,
        from: u64,
        to: u64,
        x: TensorIx,
        saving: bool,
        out_name: &dyn Fn(u64) -> String,
    ) -> Result<(Vec<Frame>, TensorIx), PlanError> {
        let mut frames = Vec::new();
        let mut cur = x;
        for i in from..to {
            let (fa, fm, out) = self.layer(i, &format!("L{i}"), cur, &out_name(i), saving)?;
            if saving {
                frames.push(fa);
                frames.push(fm);
            } else {
                for t in fa.saved.into_iter().chain(fm.saved) {
                    if t != x {
                        self.b.free(t);
                    }
                }
            }
            cur = out;
        }
        Ok((frames, cur))
    }

    /// Backward through one frame: its weight gradient, the activation gradients it makes and
    /// frees, its saved tensors freed. Takes the incoming gradient and returns the outgoing one.
    /// Each gradient has its tensor's type: 16-bit for autocast's matmul inputs and outputs,
    /// the residual stream's type for the norms' inputs and outputs (`ToCopyBackward0` turns
    /// a cast copy's 16-bit gradient into one of the original's type).
    fn backward(&mut self, fr: Frame, incoming: TensorIx) -> Result<TensorIx, PlanError> {
        let w = self.w;
        self.states.gradient(self.b, &fr.piece, w)?;
        let p = &fr.piece;
        let c = self.c;
        // The gradient the block's inner ops end with ([b,s,f] for the MLP, [b,s,3h] for q/k/v).
        let inner = match fr.block {
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
                if !self.flash {
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
                let (bsz, s, h) = (self.bsz, self.s, self.h);
                let gqkv = self.b.push(
                    &format!("{p}.grad_qkv"),
                    Role::Workspace,
                    c,
                    &[bsz, s, 3, h],
                    h,
                )?;
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
    let c = compute_dtype(w.precision);
    let train = !w.inference();
    let states = States::setup(b, w, &pieces(w)?)?;
    let zero3 = w.zero == 3 && w.gpus > 1;
    let ac = super::params::autocast(w);
    let mut t = T {
        b,
        w,
        states,
        bsz,
        s,
        h,
        a,
        f,
        c,
        r: if ac.is_some() { DType::F32 } else { c },
        ac,
        softmax: SoftmaxCode::of(w.arch),
        qkv_readers: if w.arch == Arch::Gpt2 { 1 } else { 3 },
        dropout: w.dropout && train,
        flash: w.attention == Attention::Flash,
        causal: matches!(w.arch, Arch::Gpt2 | Arch::Llama),
        llama: w.arch == Arch::Llama,
        train,
        gather: None,
        held: Vec::new(),
    };
    t.b.phase(Phase::Forward);
    if zero3 {
        // One layer's gathered weights (or the embedding/head matrix if larger), prefetched
        // for the whole forward and backward.
        let e = "the ZeRO-3 gather buffer";
        let mut gather = layer_params(w)?.max(prod(&[v, h], e)?);
        if w.arch == Arch::Vit {
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
    let x0 = match w.arch {
        Arch::Vit => {
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
        Arch::Bert => {
            let ln_in = t.resid("emb.ln_in")?;
            emb_saved.push(ln_in);
            t.norm_out("L0.in", ln_in)?
        }
        // Embedding lookups are not autocast ops: the fp32 tables give fp32 rows.
        _ => t.resid("L0.in")?,
    };
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
            let (fr, out) = t.layers(0, l, x0, train, &name_out)?;
            if !train {
                t.b.free(x0);
            }
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
                let (_, out) = t.layers(j, end, x, false, &ckpt_name)?;
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

    // Head and loss.
    let classes_only = w.arch == Arch::Vit;
    let head_piece = if w.tied_head() { "embed" } else { "head" };
    let head_piece = if classes_only {
        "head.rest"
    } else {
        head_piece
    };
    let mut head_saved = Vec::new();
    let head_x = if w.arch == Arch::Bert {
        t.use_piece("head.rest")?;
        // The MLM transform: dense (saves its input, a 16-bit copy under autocast), GELU,
        // LayerNorm over the GELU's 16-bit output: CUDA's autocast runs it in fp32 on an fp32
        // copy (which its backward saves), CPU's in the input's type.
        let x = t.matmul_input(head_in, 1, false, &mut head_saved)?;
        let d = t.hidden("head.dense_out", Role::Activations)?;
        t.matmul("head.rest", x, d, h, h);
        let g = t.hidden("head.gelu_out", Role::Activations)?;
        let elems = t.rows().saturating_mul(h);
        t.b.step(Step::Gelu { x: d, y: g, elems });
        head_saved.push(d);
        let ln_in = if ac.is_some_and(|a| a.casts_input("layer_norm", c)) {
            let g32 = t.hidden_t("head.gelu_out32", Role::Activations, DType::F32)?;
            t.b.free(g);
            g32
        } else {
            g
        };
        head_saved.push(ln_in);
        let n = t.norm_out("head.ln_out", ln_in)?;
        t.use_piece(head_piece)?;
        t.matmul_input(n, 1, false, &mut head_saved)?
    } else {
        head_saved.push(head_in);
        let n = t.norm_out("final_ln.out", head_in)?;
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
    let (lp_dtype, copy, half_to_float) = if w.arch != Arch::Bert {
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
                let (mut fr, out) =
                    t.layers(from, to, x, true, &|i| format!("recompute.L{}.out", i + 1))?;
                t.b.free(out);
                while let Some(f) = fr.pop() {
                    g = t.backward(f, g)?;
                }
            }
        }
    }
    // Embedding backward: the dense gradient of the token embedding (added into the tied head's
    // gradient when it already exists) and of the positions.
    t.states.gradient(t.b, "embed", w_)?;
    t.states.gradient(t.b, "embed.rest", w_)?;
    t.b.free_all(emb_saved);
    t.b.free(g);
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
