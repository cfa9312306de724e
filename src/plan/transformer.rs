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

use super::build::{prod, sum, Builder, PlanError, PENDING_SCORES, PENDING_WEIGHTS};
use super::params::{compute_dtype, push_states};
use super::{DType, Role, Step, TensorIx};
use crate::workload::{presets::vit_tokens, Arch, Attention, Checkpoint, Workload};

/// Parameters of one transformer layer.
pub fn layer_params(w: &Workload) -> Result<u64, PlanError> {
    let (h, f) = (w.hidden, w.ffn);
    let e = "the per-layer parameter count";
    let hh = prod(&[4, h, h], e)?;
    match w.arch {
        // 4h² (q, k, v, o) + 3hf (gate, up, down) + 2h (two RMSNorm gains), no biases.
        Arch::Llama => sum(&[hh, prod(&[3, h, f], e)?, prod(&[2, h], e)?], e),
        // 4h² + 4h (q, k, v, o with biases) + 2hf + f + h (fc1, fc2 with biases) + 4h (two LNs).
        _ => sum(&[hh, prod(&[2, h, f], e)?, prod(&[9, h], e)?, f], e),
    }
}

/// Total trainable parameters (embeddings, layers, head).
pub fn param_count(w: &Workload) -> Result<u64, PlanError> {
    let (h, v) = (w.hidden, w.vocab);
    let e = "the parameter count";
    let layers = prod(&[w.layers, layer_params(w)?], e)?;
    let emb = prod(&[v, h], e)?;
    let untied_head = if w.tied_head() { 0 } else { emb };
    // Learned positions grow with a longer --seq than the preset's context.
    let positions = prod(&[w.max_positions.max(w.seq), h], e)?;
    match w.arch {
        // wte + wpe + layers + final LN (2h) [+ lm_head if untied].
        Arch::Gpt2 => sum(&[emb, positions, layers, 2 * h, untied_head], e),
        // word + position + token-type (2h) embeddings and their LN (2h); layers; pooler (h² + h);
        // MLM head: transform dense (h² + h) + LN (2h) + decoder bias (V), decoder tied to the
        // word embedding.
        Arch::Bert => {
            let dense = sum(&[prod(&[h, h], e)?, h], e)?;
            sum(
                &[
                    emb,
                    positions,
                    4 * h,
                    layers,
                    dense,
                    dense,
                    2 * h,
                    v,
                    untied_head,
                ],
                e,
            )
        }
        // embed + layers + final RMSNorm (h) + lm_head (untied unless the config ties it).
        Arch::Llama => sum(&[emb, layers, h, untied_head], e),
        // patch conv (3p²h + h) + class token (h) + positions (tokens·h) + layers + final LN (2h)
        // + classifier (hC + C).
        Arch::Vit => {
            let conv = sum(&[prod(&[3, w.patch, w.patch, h], e)?, h], e)?;
            let pos = prod(&[vit_tokens(w.image, w.patch), h], e)?;
            sum(&[conv, h, pos, layers, 2 * h, emb, v], e)
        }
        Arch::Resnet | Arch::Dense => Err(PlanError::Invalid("not a transformer".into())),
    }
}

/// Where a layer writes its output.
enum Out {
    New(String),
    Existing(TensorIx),
}

struct T<'a> {
    b: &'a mut Builder,
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
    weights: TensorIx,
}

impl T<'_> {
    fn hidden(&mut self, name: &str, role: Role) -> Result<TensorIx, PlanError> {
        let (bsz, s, h, c) = (self.bsz, self.s, self.h, self.c);
        self.b.push(name, role, c, &[bsz, s, h], h)
    }
    fn wide(&mut self, name: &str) -> Result<TensorIx, PlanError> {
        let (bsz, s, f, c) = (self.bsz, self.s, self.f, self.c);
        self.b.push(name, Role::Activations, c, &[bsz, s, f], f)
    }
    fn mask(&mut self, name: &str) -> Result<(), PlanError> {
        if self.dropout {
            let (bsz, s, h) = (self.bsz, self.s, self.h);
            self.b
                .push(name, Role::Activations, DType::U8, &[bsz, s, h], h)?;
        }
        Ok(())
    }
    fn rows(&self) -> u64 {
        self.bsz.saturating_mul(self.s)
    }
    fn matmul(&mut self, a: TensorIx, c: TensorIx, n: u64, k: u64) {
        let m = self.rows();
        let b = self.weights;
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

    /// The attention core: stored q, k, v, scores (naive) or stats (flash), and ctx.
    fn attention(&mut self, p: &str, x: TensorIx) -> Result<TensorIx, PlanError> {
        let h = self.h;
        let q = self.hidden(&format!("{p}.q"), Role::Activations)?;
        let k = self.hidden(&format!("{p}.k"), Role::Activations)?;
        let v = self.hidden(&format!("{p}.v"), Role::Activations)?;
        for t in [q, k, v] {
            self.matmul(x, t, h, h);
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
            let probs = self.b.push(
                &format!("{p}.attn.probs"),
                Role::Attention,
                c,
                &[bsz, a, s, s],
                s,
            )?;
            if self.dropout {
                self.b.push(
                    &format!("{p}.attn.drop_mask"),
                    Role::Attention,
                    DType::U8,
                    &[bsz, a, s, s],
                    s,
                )?;
                self.b.push(
                    &format!("{p}.attn.drop_out"),
                    Role::Attention,
                    c,
                    &[bsz, a, s, s],
                    s,
                )?;
            }
            let ctx = self.hidden(&format!("{p}.ctx"), Role::Activations)?;
            self.b.step(Step::Attention {
                q,
                k,
                v,
                scores: PENDING_SCORES,
                probs,
                out: ctx,
                batch_heads: bh,
                seq: s,
                head_dim,
                causal,
            });
            Ok(ctx)
        }
    }

    /// One layer reading `x`; returns the output tensor.
    fn layer(&mut self, p: &str, x: TensorIx, out: Out) -> Result<TensorIx, PlanError> {
        let (h, f) = (self.h, self.f);
        let n1 = self.hidden(&format!("{p}.ln1.out"), Role::Activations)?;
        self.norm(x, n1);
        let ctx = self.attention(p, n1)?;
        self.mask(&format!("{p}.proj.drop_mask"))?;
        let x2 = self.hidden(&format!("{p}.ln2.in"), Role::Activations)?;
        self.matmul(ctx, x2, h, h);
        let n2 = self.hidden(&format!("{p}.ln2.out"), Role::Activations)?;
        self.norm(x2, n2);
        let last = if self.llama {
            let gate = self.wide(&format!("{p}.mlp.gate"))?;
            let up = self.wide(&format!("{p}.mlp.up"))?;
            let act = self.wide(&format!("{p}.mlp.act"))?;
            let prod = self.wide(&format!("{p}.mlp.prod"))?;
            self.matmul(n2, gate, f, h);
            self.matmul(n2, up, f, h);
            let elems = self.rows().saturating_mul(f);
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
            self.matmul(n2, fc1, f, h);
            let gelu = self.wide(&format!("{p}.gelu.out"))?;
            let elems = self.rows().saturating_mul(f);
            self.b.step(Step::Gelu {
                x: fc1,
                y: gelu,
                elems,
            });
            gelu
        };
        self.mask(&format!("{p}.mlp.drop_mask"))?;
        let out = match out {
            Out::New(name) => self.hidden(&name, Role::Activations)?,
            Out::Existing(ix) => ix,
        };
        self.matmul(last, out, h, f);
        Ok(out)
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

/// Build a transformer plan at the workload's batch and sequence.
pub fn build(b: &mut Builder, w: &Workload) -> Result<(), PlanError> {
    let (bsz, s, h, a, f, v) = (w.batch, w.seq, w.hidden, w.heads, w.ffn, w.vocab);
    let c = compute_dtype(w.precision);
    let psi = param_count(w)?;
    let states = push_states(b, w, psi, h)?;
    let zero3 = w.zero == 3 && w.gpus > 1;
    let weights = if zero3 {
        PENDING_WEIGHTS
    } else {
        states.params
    };
    let mut t = T {
        b,
        bsz,
        s,
        h,
        a,
        f,
        c,
        dropout: w.dropout,
        flash: w.attention == Attention::Flash,
        causal: matches!(w.arch, Arch::Gpt2 | Arch::Llama),
        llama: w.arch == Arch::Llama,
        weights,
    };

    // Embedding terms.
    let mut image = None;
    match w.arch {
        Arch::Bert => {
            t.hidden("emb.ln_in", Role::Activations)?;
        }
        Arch::Vit => {
            let img = w.image;
            image = Some(t.b.push("image", Role::Activations, c, &[bsz, 3, img, img], img)?);
        }
        _ => {}
    }
    t.mask("emb.drop_mask")?;

    // Layers.
    let l = w.layers;
    let first_in;
    let head_in = match segment(w.checkpoint, l) {
        None => {
            let mut x = t.hidden("L0.in", Role::Activations)?;
            first_in = Some(x);
            for i in 0..l {
                let name = if i + 1 == l {
                    "head.in".to_string()
                } else {
                    format!("L{}.in", i + 1)
                };
                x = t.layer(&format!("L{i}"), x, Out::New(name))?;
            }
            x
        }
        Some(k) => {
            let n_ckpt = l.div_ceil(k);
            let mut ckpts = Vec::new();
            for j in 0..n_ckpt {
                ckpts.push(t.hidden(&format!("ckpt{j}.L{}.in", j * k), Role::Activations)?);
            }
            let head_in = t.hidden("head.in", Role::Activations)?;
            let seg = k.min(l);
            first_in = ckpts.first().copied();
            let mut x = head_in;
            if let Some(&c0) = ckpts.first() {
                x = c0;
            }
            for i in 0..seg {
                let out = if i + 1 == seg {
                    Out::Existing(ckpts.get(1).copied().unwrap_or(head_in))
                } else {
                    Out::New(format!("recompute.L{}.in", i + 1))
                };
                x = t.layer(&format!("recompute.L{i}"), x, out)?;
            }
            let _ = x;
            t.b.note(format!(
                "checkpointing: inputs of every {k}th layer stored ({n_ckpt} of {l}), one segment of {seg} layer(s) recomputed"
            ));
            head_in
        }
    };
    // Patch embedding of a ViT writes the first layer's input.
    if let (Some(x), Some(y)) = (image, first_in) {
        {
            t.b.step(Step::Conv2d {
                x,
                w: weights,
                y,
                n: bsz,
                c_in: 3,
                h: w.image,
                w_in: w.image,
                c_out: h,
                kernel: w.patch,
                stride: w.patch,
                pad: 0,
            });
        }
    }

    // Head.
    let classes_only = w.arch == Arch::Vit;
    let head_x = if w.arch == Arch::Bert {
        let d = t.hidden("head.dense_out", Role::Activations)?;
        t.matmul(head_in, d, h, h);
        let g = t.hidden("head.gelu_out", Role::Activations)?;
        let elems = t.rows().saturating_mul(h);
        t.b.step(Step::Gelu { x: d, y: g, elems });
        let n = t.hidden("head.ln_out", Role::Activations)?;
        t.norm(g, n);
        n
    } else {
        let n = t.hidden("final_ln.out", Role::Activations)?;
        t.norm(head_in, n);
        n
    };
    let (logit_rows, logit_shape): (u64, Vec<u64>) = if classes_only {
        (bsz, vec![bsz, v])
    } else {
        (bsz.saturating_mul(s), vec![bsz, s, v])
    };
    let logits = t.b.push("logits", Role::Activations, c, &logit_shape, v)?;
    t.b.step(Step::Matmul {
        a: head_x,
        b: weights,
        c: logits,
        batch: 1,
        m: logit_rows,
        n: v,
        k: h,
    });
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

    // Workspace.
    if !t.flash {
        let ws =
            t.b.push("ws.attn_scores", Role::Workspace, c, &[bsz, a, s, s], s)?;
        t.b.patch(PENDING_SCORES, ws);
    }
    t.b.push(
        "ws.grad_logits",
        Role::Workspace,
        DType::F32,
        &logit_shape,
        v,
    )?;
    t.b.push("ws.grad_ffn", Role::Workspace, c, &[bsz, s, f], f)?;
    t.b.push("ws.grad_hidden", Role::Workspace, c, &[bsz, s, h], h)?;
    if zero3 {
        let e = "the ZeRO-3 gather buffer";
        let mut gather = layer_params(w)?.max(prod(&[v, h], e)?);
        if w.arch == Arch::Vit {
            gather = gather.max(prod(&[3, w.patch, w.patch, h], e)?);
        }
        let g = t.b.push(
            "ws.zero3_gather",
            Role::Workspace,
            c,
            &[gather],
            h.min(gather),
        )?;
        t.b.patch(PENDING_WEIGHTS, g);
    }
    Ok(())
}
