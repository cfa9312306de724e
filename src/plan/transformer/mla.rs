//! Multi-head latent attention (DeepSeek-V2/V3, Kimi K2, GLM-5) as transformers 5.24's
//! `DeepseekV3Attention` runs it: the query's low-rank path, the latent and the shared rotary
//! key, q and k joined at the query/key width, and the core at the value width.

use super::attention::{sdpa_backend, Qkv, SdpaBackend};
use super::lora::Proj;
use super::T;
use crate::plan::autocast;
use crate::plan::build::{prod, PlanError};
use crate::plan::{Role, TensorIx};
use crate::workload::layers::{Mixer, Mla};
use crate::workload::{Attention, Checkpoint, Target};

impl T<'_> {
    /// The layer's multi-head latent attention, where the model is described layer by layer.
    pub(super) fn mla(&self) -> Option<Mla> {
        match self.layer?.mixer {
            Mixer::Mla(m) => Some(m),
            _ => None,
        }
    }

    /// Multi-head latent attention (transformers 5.24 `DeepseekV3Attention.forward`, which
    /// Kimi K2 and GLM-5 load too). Measured on the CPU (`deepseek_v3` rows of
    /// `tests/fixtures/validation_families.json`), per layer:
    /// - the query through `q_a_proj`, its RMSNorm and `q_b_proj` (or one `q_proj`); each saves
    ///   its input, the norm its own tensors;
    /// - `kv_a_proj_with_mqa`'s output is the latent and one rotary key shared by the heads
    ///   (two slices of one storage: an fp32 norm that saves the latent keeps the rotary key's
    ///   bytes too); the latent's RMSNorm, then `kv_b_proj` to each head's key part and value;
    /// - the rotated parts (`apply_rotary_pos_emb_interleave`: saves only cos and sin) joined
    ///   to the passed-through ones by `torch.cat`: q and k [b, a, s, qk], new tensors;
    /// - the core reads q, k and the value (a slice of `kv_b_proj`'s output). With the query
    ///   width ≠ the value width, SDPA's CPU flash kernel is not taken: the math path saves as
    ///   eager does (measured). On CUDA flash is not taken either and the memory-efficient
    ///   kernel is (PyTorch's `check_head_dim_size_flash`; modelled). flash_attention_2 pads
    ///   the value to the query width and slices the output (modelled).
    ///
    /// Returns the context [b, s, a·v] the output projection reads.
    pub(super) fn attention_mla(
        &mut self,
        p: &str,
        piece: &str,
        x: TensorIx,
        m: Mla,
        saved: &mut Vec<TensorIx>,
    ) -> Result<TensorIx, PlanError> {
        let (a, c, bsz, s) = (self.a, self.c, self.bsz, self.s);
        let qk = m.qk_nope_head_dim.saturating_add(m.qk_rope_head_dim);
        let dv = m.v_head_dim;
        let (q_full, kv, k_rot_in, latent_saved) = self.mla_projections(p, piece, x, m, saved)?;
        let (q, k) = self.mla_joined(p, m, q_full, k_rot_in, latent_saved, saved)?;
        let rt = self.dtype(q);
        let ckpt = self.train && self.w.checkpoint != Checkpoint::None;
        let cached = self.w.kv_cache && !ckpt;
        let (k, v) = if cached {
            // DynamicCache keeps the joined key and the value, at every head.
            let kc = self.b.push(
                &format!("{p}.kv_cache.k"),
                Role::Activations,
                rt,
                &[bsz, a, s, qk],
                qk,
            )?;
            let vc = self.heads_t(&format!("{p}.kv_cache.v"), a, c, Role::Activations)?;
            self.b.free(k);
            self.held.extend([kc, vc]);
            (kc, vc)
        } else {
            (k, kv)
        };
        let dev = self.w.autocast_device;
        let backend = match self.w.attention {
            Attention::Naive => SdpaBackend::Math,
            Attention::Flash => SdpaBackend::Flash,
            Attention::Sdpa if qk != dv => match dev {
                autocast::Device::Cpu => SdpaBackend::Math,
                autocast::Device::Cuda => SdpaBackend::Efficient,
            },
            Attention::Sdpa => {
                let qt = self.out("scaled_dot_product_attention", &[rt]);
                sdpa_backend(dev, qt, qk, false, self.dropout)
            }
        };
        let from = saved.len();
        let qkv = Qkv {
            q,
            k,
            v,
            cached,
            masked: false,
            kv_heads: a,
        };
        let padded = backend == SdpaBackend::Flash && qk != dv && !cached;
        let ctx = match backend {
            SdpaBackend::Math => {
                let eager = self.w.attention == Attention::Naive;
                self.attention_scores(p, qkv, eager, saved)?
            }
            _ if padded => self.mla_flash_padded(p, qkv, kv, qk, saved)?,
            _ => self.attention_fused(p, qkv, backend, saved)?,
        };
        let kv_saved = saved.contains(&kv);
        self.attention_done(saved, from);
        if !kv_saved && !padded {
            self.b.free(kv);
        }
        self.consumed(x, saved);
        Ok(ctx)
    }

    /// MLA's projections of `x`: the query (through its low-rank path, or one q_proj), the
    /// latent's norm and kv_b_proj's output (each head's key part and value). Returns the
    /// query, kv_b's output, the shared rotary key (kv_a's other slice) and whether the latent
    /// is saved (then the rotary key's bytes, one storage with it, stay too).
    fn mla_projections(
        &mut self,
        p: &str,
        piece: &str,
        x: TensorIx,
        m: Mla,
        saved: &mut Vec<TensorIx>,
    ) -> Result<(TensorIx, TensorIx, TensorIx, bool), PlanError> {
        let (h, a) = (self.h, self.a);
        let (nope, rot, dv) = (m.qk_nope_head_dim, m.qk_rope_head_dim, m.v_head_dim);
        let e = "the MLA width";
        let q_width = prod(&[a, nope.saturating_add(rot)], e)?;
        let named =
            |n: &str, t: &'static [Target], width| Proj::named(format!("{p}.{n}"), t, width);
        let first_q = match m.q_lora_rank {
            Some(r) => named("q_a_proj", &[Target::Q], r),
            None => named("q_proj", &[Target::Q], q_width),
        };
        let kv_a = named(
            "kv_a_proj_with_mqa",
            &[Target::K, Target::V],
            m.kv_lora_rank,
        );
        let kv_a_rope = named("kv_a_proj_with_mqa.rope", &[Target::K], rot);
        let o = self.projections(piece, x, h, &[first_q, kv_a, kv_a_rope], saved)?;
        let (q0, latent, k_rot_in) = (o[0], o[1], o[2]);
        let q_full = match m.q_lora_rank {
            Some(r) => {
                let qn = self.norm_over(&format!("{p}.q_a_layernorm"), q0, r, saved)?;
                if !saved.contains(&q0) {
                    self.b.free(q0);
                }
                let qn = self.matmul_input(qn, 1, false, saved)?;
                let proj = named("q_b_proj", &[Target::Q], q_width);
                let q = self.projections(piece, qn, r, &[proj], saved)?[0];
                self.consumed(qn, saved);
                q
            }
            None => q0,
        };
        let kv_rank = m.kv_lora_rank;
        let kn = self.norm_over(&format!("{p}.kv_a_layernorm"), latent, kv_rank, saved)?;
        let latent_saved = saved.contains(&latent);
        if !latent_saved {
            self.b.free(latent);
        }
        let kn = self.matmul_input(kn, 1, false, saved)?;
        let kv_width = prod(&[a, nope.saturating_add(dv)], e)?;
        let proj = named("kv_b_proj", &[Target::K, Target::V], kv_width);
        let kv = self.projections(piece, kn, kv_rank, &[proj], saved)?[0];
        self.consumed(kn, saved);
        Ok((q_full, kv, k_rot_in, latent_saved))
    }

    /// The rotation of the query's and the shared key's rotary parts (in the promoted type of
    /// the projection and the tables), joined to the passed-through parts by `torch.cat`
    /// (which promotes: fp32 under autocast): q and k [b, a, s, qk].
    fn mla_joined(
        &mut self,
        p: &str,
        m: Mla,
        q_full: TensorIx,
        k_rot_in: TensorIx,
        latent_saved: bool,
        saved: &mut Vec<TensorIx>,
    ) -> Result<(TensorIx, TensorIx), PlanError> {
        let (a, bsz, s) = (self.a, self.bsz, self.s);
        let rot = m.qk_rope_head_dim;
        let qk = m.qk_nope_head_dim.saturating_add(rot);
        let rt = autocast::promote(self.c, self.r);
        let push = |t: &mut Self, n: &str, heads: u64, width: u64| {
            t.b.push(
                &format!("{p}.{n}"),
                Role::Activations,
                rt,
                &[bsz, heads, s, width],
                width,
            )
        };
        let q_rot = push(self, "q_rot", a, rot)?;
        let k_rot = push(self, "k_rot", 1, rot)?;
        if latent_saved && self.saving {
            // One storage with the saved latent.
            saved.push(k_rot_in);
        } else {
            self.b.free(k_rot_in);
        }
        let q = push(self, "q", a, qk)?;
        self.b.free_all([q_rot, q_full]);
        let k = push(self, "k", a, qk)?;
        self.b.free(k_rot);
        Ok((q, k))
    }

    /// flash_attention_2 under MLA: the value padded to the query/key width (kv_b's output
    /// goes), the kernel's output at that width (which it saves), sliced and copied for o_proj.
    fn mla_flash_padded(
        &mut self,
        p: &str,
        qkv: Qkv,
        kv: TensorIx,
        qk: u64,
        saved: &mut Vec<TensorIx>,
    ) -> Result<TensorIx, PlanError> {
        let (a, c, bsz, s) = (self.a, self.c, self.bsz, self.s);
        let q_width = prod(&[a, qk], "the MLA width")?;
        let vp = self.b.push(
            &format!("{p}.v_pad"),
            Role::Activations,
            c,
            &[bsz, a, s, qk],
            qk,
        )?;
        self.b.free(kv);
        let (d, qw) = (self.d, self.qw);
        (self.d, self.qw) = (qk, q_width);
        let out = self.attention_fused(p, Qkv { v: vp, ..qkv }, SdpaBackend::Flash, saved);
        (self.d, self.qw) = (d, qw);
        let out = out?;
        if self.saving && !saved.contains(&out) {
            saved.push(out);
        }
        let copy = self.rows_t(&format!("{p}.ctx_slice"), Role::Activations, c, qw)?;
        if !self.saving {
            self.b.free(out);
        }
        Ok(copy)
    }
}
