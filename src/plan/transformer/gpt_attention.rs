//! The attention of GPT-2, BERT and ViT: q, k, v with biases from one input, eager scores or
//! SDPA's fused kernels, and the context.

use super::attention::{sdpa_backend, SdpaBackend};
use super::T;
use crate::plan::autocast;
use crate::plan::build::PlanError;
use crate::plan::{DType, Role, Step, TensorIx};
use crate::workload::{Attention, Checkpoint};

impl T<'_> {
    /// The attention core of GPT-2, BERT and ViT (see `attention_gpt_core`). Not saving, q, k,
    /// v, the probabilities and the attention's input go once the context exists.
    pub(super) fn attention_gpt(
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
        // The heads' width: the hidden size, or one tensor-parallel rank's share of it.
        let (h, qw, c0) = (self.h, self.qw, self.c);
        let q = self.rows_t(&format!("{p}.q"), Role::Activations, c0, qw)?;
        let k = self.rows_t(&format!("{p}.k"), Role::Activations, c0, qw)?;
        let v = self.rows_t(&format!("{p}.v"), Role::Activations, c0, qw)?;
        for t in [q, k, v] {
            self.matmul(piece, x, t, qw, h);
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
                &[2, bsz, s, qw],
                qw,
            )?;
            self.held.push(kv);
        }
        let (bsz, s, a, c) = (self.bsz, self.s, self.a, self.c);
        let bh = bsz.saturating_mul(a);
        let head_dim = self.d;
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
            let ctx = self.rows_t(&format!("{p}.ctx"), Role::Activations, c, qw)?;
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
            // PyTorch before 1.11 saves the softmax's input too: the scores as the kernel
            // reads them (16-bit under `dtype=float32`; else cast or promoted to the
            // probabilities' type first, a tensor of its own).
            let input_type = (self.saving && self.w.softmax_saves_input()).then_some(if sm.fp32 {
                c
            } else {
                pt
            });
            let role = if input_type == Some(c) {
                Role::Attention
            } else {
                Role::Workspace
            };
            let scores = self.scores(&format!("{p}.attn.scores"), role, c)?;
            let softmax_in = match input_type {
                Some(it) if it == c => Some(scores),
                Some(it) => {
                    Some(self.scores(&format!("{p}.attn.softmax_in"), Role::Attention, it)?)
                }
                None => None,
            };
            saved.extend(softmax_in);
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
                // native_dropout saves its 1-byte mask (the CPU's dropout its noise); its input
                // is not saved.
                let dt = self.dtype(cur);
                let m = self.scores(
                    &format!("{p}.attn.drop_mask"),
                    Role::Attention,
                    self.mask_type(dt),
                )?;
                saved.push(m);
                let o = self.scores(&format!("{p}.attn.drop_out"), Role::Attention, dt)?;
                if !cur_saved {
                    self.b.free(cur);
                }
                cur = o;
                cur_saved = false;
            }
            // BERT's attention returns its probabilities (after dropout) and `BertLayer` keeps
            // them (`_`) until it returns: under no_grad they outlive the attention.
            let returned = (!self.saving && self.spec.holds_returns).then_some(cur);
            // probs·V saves its first input; under autocast in the 16-bit type (a cast copy
            // when the probabilities are still fp32, e.g. BERT's on CUDA).
            let pv = if self.dtype(cur) != c {
                let t = self.scores(&format!("{p}.attn.probs_cast"), Role::Attention, c)?;
                if !cur_saved && returned.is_none() {
                    self.b.free(cur);
                }
                t
            } else {
                cur
            };
            if pv != probs {
                saved.push(pv);
            }
            if let Some(r) = returned {
                saved.retain(|&t| t != r);
                self.layer_tail.push(r);
            }
            let ctx = self.rows_t(&format!("{p}.ctx"), Role::Activations, c, qw)?;
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
            if softmax_in != Some(scores) {
                self.b.free(scores);
            }
            Ok(ctx)
        }
    }
}
