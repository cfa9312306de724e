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

struct T<'a> {
    b: &'a mut Builder,
    w: &'a Workload,
    states: States,
    bsz: u64,
    s: u64,
    h: u64,
    a: u64,
    f: u64,
    c: DType,
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

impl T<'_> {
    fn hidden(&mut self, name: &str, role: Role) -> Result<TensorIx, PlanError> {
        let (bsz, s, h, c) = (self.bsz, self.s, self.h, self.c);
        self.b.push(name, role, c, &[bsz, s, h], h)
    }
    fn wide(&mut self, name: &str) -> Result<TensorIx, PlanError> {
        self.wide_as(name, Role::Activations)
    }
    fn wide_as(&mut self, name: &str, role: Role) -> Result<TensorIx, PlanError> {
        let (bsz, s, f, c) = (self.bsz, self.s, self.f, self.c);
        self.b.push(name, role, c, &[bsz, s, f], f)
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
    fn weights(&self, piece: &str) -> TensorIx {
        self.gather.unwrap_or_else(|| self.states.weights(piece))
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
            let probs = self.scores(&format!("{p}.attn.probs"), Role::Attention, c)?;
            saved.push(probs);
            if self.dropout {
                let m = self.scores(&format!("{p}.attn.drop_mask"), Role::Attention, DType::U8)?;
                let o = self.scores(&format!("{p}.attn.drop_out"), Role::Attention, c)?;
                saved.extend([m, o]);
            }
            let ctx = self.hidden(&format!("{p}.ctx"), Role::Activations)?;
            saved.push(ctx);
            self.b.step(Step::Attention {
                q,
                k,
                v,
                scores,
                probs,
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

    /// One layer's forward reading `x`: its two frames and its output (a new tensor).
    fn layer(
        &mut self,
        i: u64,
        p: &str,
        x: TensorIx,
        out_name: &str,
    ) -> Result<(Frame, Frame, TensorIx), PlanError> {
        let (h, f) = (self.h, self.f);
        let (pa, pm) = (format!("L{i}.attn"), format!("L{i}.mlp"));
        let mut sa = vec![x];
        let n1 = self.hidden(&format!("{p}.ln1.out"), Role::Activations)?;
        sa.push(n1);
        self.norm(x, n1);
        let ctx = self.attention(p, &pa, n1, &mut sa)?;
        self.mask(&format!("{p}.proj.drop_mask"), &mut sa)?;
        let mut sm = Vec::new();
        let x2 = self.hidden(&format!("{p}.ln2.in"), Role::Activations)?;
        sm.push(x2);
        self.matmul(&pa, ctx, x2, h, h);
        let n2 = self.hidden(&format!("{p}.ln2.out"), Role::Activations)?;
        sm.push(n2);
        self.norm(x2, n2);
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
            sm.push(fc1);
            self.matmul(&pm, n2, fc1, f, h);
            if self.w.gelu == Gelu::Unfused && self.train {
                // gelu_new: 0.5·x · (1 + tanh(√(2/π)·(x + 0.044715·x³))) in separate ops saves
                // tanh's output, 0.5·x and 1 + tanh (both factors of the last product).
                for t in ["tanh", "half_x", "one_plus_tanh"] {
                    sm.push(self.wide(&format!("{p}.gelu.{t}"))?);
                }
            }
            let gelu = self.wide(&format!("{p}.gelu.out"))?;
            sm.push(gelu);
            self.b.step(Step::Gelu {
                x: fc1,
                y: gelu,
                elems,
            });
            gelu
        };
        self.mask(&format!("{p}.mlp.drop_mask"), &mut sm)?;
        let out = self.hidden(out_name, Role::Activations)?;
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
            let (fa, fm, out) = self.layer(i, &format!("L{i}"), cur, &out_name(i))?;
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
                    // the scores; the scale/mask ops pass on one more of the same size.
                    let g1 = self.scores(&format!("{p}.grad_probs"), Role::Workspace, c)?;
                    let g2 = self.scores(&format!("{p}.grad_scores"), Role::Workspace, c)?;
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
        // The block's input projection makes the gradient of its norm's output, the norm's
        // backward (with the residual) that of the block's input.
        let gn = self.hidden(&format!("{p}.grad_norm_out"), Role::Workspace)?;
        self.b.free(inner);
        let gx = self.hidden(&format!("{p}.grad_in"), Role::Workspace)?;
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
    let x0 = match w.arch {
        Arch::Vit => {
            let img = w.image;
            let image =
                t.b.push("image", Role::Activations, c, &[bsz, 3, img, img], img)?;
            emb_saved.push(image);
            let x0 = t.hidden("L0.in", Role::Activations)?;
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
            x0
        }
        Arch::Bert => {
            let ln_in = t.hidden("emb.ln_in", Role::Activations)?;
            emb_saved.push(ln_in);
            let x0 = t.hidden("L0.in", Role::Activations)?;
            t.norm(ln_in, x0);
            x0
        }
        _ => t.hidden("L0.in", Role::Activations)?,
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
    let mut head_saved = vec![head_in];
    let head_x = if w.arch == Arch::Bert {
        let d = t.hidden("head.dense_out", Role::Activations)?;
        t.matmul("head.rest", head_in, d, h, h);
        let g = t.hidden("head.gelu_out", Role::Activations)?;
        let elems = t.rows().saturating_mul(h);
        t.b.step(Step::Gelu { x: d, y: g, elems });
        let n = t.hidden("head.ln_out", Role::Activations)?;
        t.norm(g, n);
        head_saved.extend([d, g, n]);
        n
    } else {
        let n = t.hidden("final_ln.out", Role::Activations)?;
        t.norm(head_in, n);
        head_saved.push(n);
        n
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
        t.b.free_all(head_saved);
        t.b.free_all(emb_saved);
        // The caller keeps the logits (and a KV cache) until the step is over.
        t.b.free(logits);
        let held = std::mem::take(&mut t.held);
        t.b.free_all(held);
        return Ok(());
    }
    t.held.push(logits);
    t.b.phase(Phase::Loss);
    // The loss runs in fp32: a 16-bit model's logits are cast first (HF's `logits.float()`).
    let loss_in = if c == DType::F32 {
        None
    } else {
        Some(t.b.push(
            "loss.logits_f32",
            Role::Workspace,
            DType::F32,
            &logit_shape,
            v,
        )?)
    };
    let logprobs =
        t.b.push("logprobs", Role::Activations, DType::F32, &logit_shape, v)?;
    if c == DType::F32 {
        t.b.step(Step::Softmax {
            x: logits,
            y: logprobs,
            rows: logit_rows,
            cols: v,
        });
    }
    if let Some(x) = loss_in {
        t.b.free(x);
    }

    // Backward: nll_loss and log_softmax backward make two fp32 [rows, V] gradients.
    t.b.phase(Phase::Backward);
    let g_lp = t.b.push(
        "grad.logprobs",
        Role::Workspace,
        DType::F32,
        &logit_shape,
        v,
    )?;
    let g_logits =
        t.b.push("grad.logits", Role::Workspace, DType::F32, &logit_shape, v)?;
    t.b.free(g_lp);
    t.b.free(logprobs);
    let g_logits = if c == DType::F32 {
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
    let gx = t.hidden("grad.head_x", Role::Workspace)?;
    t.b.free(g_logits);
    if head_piece != "head.rest" {
        t.states.gradient(t.b, "head.rest", w_)?;
    }
    let gin = t.hidden("grad.head_in", Role::Workspace)?;
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
    t.states.optimizer_step(t.b, w_)?;
    Ok(())
}
