//! The attention cores: eager (scores materialized), SDPA with the kernel PyTorch picks,
//! flash-attention, grouped-query heads and the KV cache, for the decoder LLMs (MLA's own
//! projections in `mla`, GPT-2/BERT/ViT's in `gpt_attention`).

use super::lora::Proj;
use super::T;
use crate::plan::autocast;
use crate::plan::build::{prod, PlanError};
use crate::plan::params::residual_dtype;
use crate::plan::{DType, Role, Step, TensorIx};
use crate::workload::layers::{Attn, Mixer, QkNorm, Window};
use crate::workload::{Attention, Checkpoint, Target, Workload};

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
        // `_scaled_dot_product_flash_attention_for_cpu` takes grouped heads in 2.15 (measured:
        // validation/llm_notes.md), not dropout.
        autocast::Device::Cpu if dropout => SdpaBackend::Math,
        autocast::Device::Cpu => SdpaBackend::Flash,
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
            let dtype = match crate::plan::params::autocast(w) {
                Some(a) => a.low,
                None => residual_dtype(w),
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
pub(super) struct Qkv {
    pub(super) q: TensorIx,
    pub(super) k: TensorIx,
    pub(super) v: TensorIx,
    /// `k` and `v` are the KV cache's (held), not attention's own.
    pub(super) cached: bool,
    /// SDPA is passed a mask (a window the sequence reaches).
    pub(super) masked: bool,
    /// The heads `k` and `v` have (the query heads once repeated).
    pub(super) kv_heads: u64,
}

impl T<'_> {
    /// The layer's attention, where the model is described layer by layer.
    fn attn_layer(&self) -> Option<Attn> {
        match self.layer?.mixer {
            Mixer::Attention(a) => Some(a),
            _ => None,
        }
    }

    /// The layer's window (sliding or chunked) is reached by the sequence, so its causal mask
    /// cannot be left to the kernel.
    fn window_reached(&self) -> bool {
        match self.attn_layer().map(|a| a.window) {
            Some(Window::Sliding(w) | Window::Chunked(w)) => self.s >= w,
            _ => false,
        }
    }

    /// A flash kernel's output is laid out [b, a, s, d] and copied for the output projection:
    /// its query is contiguous in that layout when only part of each head rotates
    /// (`torch.cat` of the rotated and the passed-through parts); the memory-efficient kernel
    /// writes [b, s, a, d] whatever the query.
    fn flash_out_copied(&self, backend: SdpaBackend) -> bool {
        backend == SdpaBackend::Flash
            && self.spec.rope
            && self
                .attn_layer()
                .is_some_and(|a| a.rotary_fraction > 0.0 && a.rotary_fraction < 1.0)
    }

    /// `x · rsqrt(mean(x²) + eps)` in fp32 over rows of `width` (`Llama4TextL2Norm`, cast
    /// back with `type_as`): saves its fp32 input and the per-row rsqrt; the input goes unless
    /// saved.
    fn l2_norm(
        &mut self,
        name: &str,
        x: TensorIx,
        width: u64,
        saved: &mut Vec<TensorIx>,
    ) -> Result<TensorIx, PlanError> {
        let xt = self.dtype(x);
        let rows = self.b.tensor(x).elems() / width.max(1);
        let shape = self.b.tensor(x).shape.clone();
        let x32 = if xt == DType::F32 {
            x
        } else {
            self.b.push(
                &format!("{name}.x32"),
                Role::Activations,
                DType::F32,
                &shape,
                width,
            )?
        };
        let r = self.b.push(
            &format!("{name}.rsqrt"),
            Role::Activations,
            DType::F32,
            &[rows, 1],
            1,
        )?;
        let y32 = if xt == DType::F32 {
            None
        } else {
            let n = format!("{name}.out32");
            Some(
                self.b
                    .push(&n, Role::Workspace, DType::F32, &shape, width)?,
            )
        };
        let y = self
            .b
            .push(&format!("{name}.out"), Role::Activations, xt, &shape, width)?;
        self.norm_step(x, y, rows, width);
        self.b.free_all(y32);
        if self.saving && self.live {
            if !saved.contains(&x32) {
                saved.push(x32);
            }
            saved.push(r);
        } else {
            self.b.free(r);
            if x32 != x {
                self.b.free(x32);
            }
        }
        if !saved.contains(&x) {
            self.b.free(x);
        }
        Ok(y)
    }

    /// Scores with the sink's column, [b, a, s, s + 1].
    fn sink_scores(&mut self, name: &str, role: Role, dtype: DType) -> Result<TensorIx, PlanError> {
        let (bsz, a, s) = (self.bsz, self.a, self.s);
        let w = s.saturating_add(1);
        self.b.push(name, role, dtype, &[bsz, a, s, w], w)
    }

    /// A [b, heads, s, d] tensor (q, k or v in attention's layout).
    pub(super) fn heads_t(
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
    pub(super) fn attention_done(&mut self, saved: &mut Vec<TensorIx>, from: usize) {
        if !self.saving {
            let done: Vec<TensorIx> = saved.drain(from..).collect();
            self.b.free_all(done);
        }
    }

    /// The attention block's core for the decoder LLM families: q, k, v projections (fused or
    /// not, with biases), q/k norms, the rotation, the KV cache, then eager, SDPA or flash
    /// attention. Returns the context [b, s, a·d] the output projection reads.
    pub(super) fn attention_llm(
        &mut self,
        p: &str,
        piece: &str,
        x: TensorIx,
        saved: &mut Vec<TensorIx>,
    ) -> Result<TensorIx, PlanError> {
        let (h, qw, kvw, a, g) = (self.h, self.qw, self.kvw, self.a, self.g);
        let c = self.c;
        let gated = self.attn_layer().is_some_and(|l| l.output_gate) && !self.spec.fused_qkv;
        let mut gate = None;
        // Projections: separate outputs, or slices (views) of one fused output.
        // (Over a frozen base each is the stored linear and its adapter, if any.)
        let (q0, k0, v0) = if self.spec.fused_qkv {
            let all = [Target::Q, Target::K, Target::V];
            let qkv = Proj {
                tensor: format!("{p}.qkv"),
                module: format!("{p}.qkv_proj"),
                targets: &all,
                width: qw + 2 * kvw,
            };
            let qkv = self.projections(piece, x, h, &[qkv], saved)?[0];
            (qkv, qkv, qkv)
        } else {
            let named = |name: &str, t: &'static [Target], width| {
                Proj::named(format!("{p}.{name}"), t, width)
            };
            let mut projs = vec![
                named("q_proj", &[Target::Q], qw),
                named("k_proj", &[Target::K], kvw),
                named("v_proj", &[Target::V], kvw),
            ];
            if gated {
                // Qwen3-Next: q_proj's output is each head's query and its output gate, as two
                // slices of one storage.
                projs.push(named("q_proj.gate", &[Target::Q], qw));
            }
            let o = self.projections(piece, x, h, &projs, saved)?;
            gate = o.get(3).copied();
            (o[0], o[1], o[2])
        };
        // LitGPT (`model.py` @5895df10, `CausalSelfAttention.forward`): q, k and v are views of
        // one fused output. With grouped heads k and v are expanded to every query head and
        // reshaped (copies at the query width); with a key and value per head they stay views,
        // and the value SDPA saves keeps the whole fused output alive (measured,
        // `validation/litgpt_notes.md`).
        let lit = !self.w.framework.is_transformers();
        let (k0, v0) = if lit && g != a {
            let ke = self.heads_t(
                &format!("{p}.k_expand"),
                a,
                self.dtype(k0),
                Role::Activations,
            )?;
            let ve = self.heads_t(
                &format!("{p}.v_expand"),
                a,
                self.dtype(v0),
                Role::Activations,
            )?;
            for t in [k0, v0] {
                if !saved.contains(&t) {
                    self.b.free(t);
                }
            }
            (ke, ve)
        } else {
            if lit && self.saving {
                for t in [q0, k0] {
                    if !saved.contains(&t) {
                        saved.push(t);
                    }
                }
            }
            (k0, v0)
        };
        // The heads k and v have from here on.
        let kv_heads = if lit { a } else { g };
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
        let rope = self.spec.rope && self.attn_layer().is_none_or(|a| a.rotary_fraction > 0.0);
        let (q, k) = if rope {
            let rt = autocast::promote(c, self.r);
            let qr = self.heads_t(&format!("{p}.q"), a, rt, Role::Activations)?;
            let kr = self.heads_t(&format!("{p}.k"), kv_heads, rt, Role::Activations)?;
            (qr, kr)
        } else {
            (q1, k1)
        };
        // The gate shares the query's storage: it stays while a norm saves the query.
        let gate_kept = gate.filter(|_| saved.contains(&q0));
        if let Some(t) = gate_kept {
            saved.push(t);
        }
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
        // Llama 4: an L2 norm without weights over each rotated head.
        let (q, k) = if self.attn_layer().is_some_and(|a| a.qk_norm == QkNorm::L2) {
            let d = self.d;
            let qn = self.l2_norm(&format!("{p}.q_l2"), q, d, saved)?;
            let kn = self.l2_norm(&format!("{p}.k_l2"), k, d, saved)?;
            (qn, kn)
        } else {
            (q, k)
        };
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
        let from = saved.len();
        // LitGPT hands SDPA every head's key and value: no grouped heads in the core.
        let grouped = (self.g, self.kvw);
        if kv_heads != g {
            (self.g, self.kvw) = (a, self.qw);
        }
        let ctx = self.llm_core(p, q, k, v, cached, saved);
        (self.g, self.kvw) = grouped;
        let ctx = ctx?;
        // The value's projection (or the fused output it is a slice of) goes unless saved; with
        // the cache, attention read the cache's copy.
        let v0_saved = saved.contains(&v0);
        self.attention_done(saved, from);
        if !v0_saved {
            self.b.free(v0);
        }
        // The decoder layer's local keeps the norm's output until the attention returns.
        self.consumed(x, saved);
        match gate {
            Some(gate) => self.output_gate(p, ctx, gate, gate_kept.is_some(), saved),
            None => Ok(ctx),
        }
    }

    /// The decoder LLMs' attention core over q, k and v (the cache's copies when `cached`):
    /// the kernel PyTorch picks, K and V repeated where a mask keeps SDPA from grouped heads;
    /// returns the context [b, s, a·d].
    fn llm_core(
        &mut self,
        p: &str,
        q: TensorIx,
        k: TensorIx,
        v: TensorIx,
        cached: bool,
        saved: &mut Vec<TensorIx>,
    ) -> Result<TensorIx, PlanError> {
        let (a, g) = (self.a, self.g);
        // A window the sequence reaches makes transformers pass SDPA a mask (below it the
        // causal mask is skipped: masking_utils' `_ignore_causal_mask_sdpa`); with a mask it
        // does not pass grouped heads (`use_gqa_in_sdpa`) and CUDA's flash kernel takes none.
        let masked = self.w.attention == Attention::Sdpa && self.window_reached();
        let grouped = g != a && !masked;
        let dev = self.w.autocast_device;
        let backend = match self.w.attention {
            Attention::Naive => SdpaBackend::Math,
            Attention::Flash => SdpaBackend::Flash,
            Attention::Sdpa => {
                let qt = self.out("scaled_dot_product_attention", &[self.dtype(q)]);
                match sdpa_backend(dev, qt, self.d, grouped, self.dropout) {
                    SdpaBackend::Flash if masked && dev == autocast::Device::Cuda => {
                        SdpaBackend::Efficient
                    }
                    b => b,
                }
            }
        };
        if backend == SdpaBackend::Math && self.train && self.w.checkpoint == Checkpoint::Ops {
            return Err(PlanError::Unsupported(
                "--checkpoint ops is modelled for SDPA's flash and memory-efficient kernels; this \
                 step falls back to the math kernel (fp32 with grouped heads, or dropout)"
                    .into(),
            ));
        }
        let eager = self.w.attention == Attention::Naive;
        let qkv = if masked && g != a && backend != SdpaBackend::Math {
            // repeat_kv: expand + reshape, copies at the query heads.
            let kr = self.heads_t(&format!("{p}.k_rep"), a, self.dtype(k), Role::Activations)?;
            let vr = self.heads_t(&format!("{p}.v_rep"), a, self.dtype(v), Role::Activations)?;
            if !cached && !saved.contains(&k) {
                self.b.free(k);
            }
            Qkv {
                q,
                k: kr,
                v: vr,
                cached: false,
                masked,
                kv_heads: a,
            }
        } else {
            Qkv {
                q,
                k,
                v,
                cached,
                masked,
                kv_heads: g,
            }
        };
        if backend == SdpaBackend::Math {
            self.attention_scores(p, qkv, eager, saved)
        } else {
            self.attention_fused(p, qkv, backend, saved)
        }
    }

    /// Qwen3-Next's gated attention: `attn_output * sigmoid(gate)`, the sigmoid's output and
    /// the context saved by the product (measured); returns the product, o_proj's input.
    fn output_gate(
        &mut self,
        p: &str,
        ctx: TensorIx,
        gate: TensorIx,
        gate_kept: bool,
        saved: &mut Vec<TensorIx>,
    ) -> Result<TensorIx, PlanError> {
        let (c, qw) = (self.c, self.qw);
        let sig = self.rows_t(&format!("{p}.gate_sigmoid"), Role::Activations, c, qw)?;
        if !gate_kept {
            self.b.free(gate);
        }
        let out = self.rows_t(&format!("{p}.gated"), Role::Activations, c, qw)?;
        if self.saving {
            saved.extend([sig, ctx]);
        } else {
            self.b.free_all([sig, ctx]);
        }
        Ok(out)
    }

    /// K and V as probs·V reads them: `repeat_kv`'s copies at the query heads when grouped
    /// (expand + reshape), or a copy of a value that is a slice of a fused projection.
    fn repeated_kv(
        &mut self,
        p: &str,
        k: TensorIx,
        v: TensorIx,
        cached: bool,
        saved: &mut Vec<TensorIx>,
    ) -> Result<(TensorIx, TensorIx), PlanError> {
        let a = self.a;
        if self.g != a {
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
            return Ok((kr, vr));
        }
        let whole = prod(&[self.bsz, self.s, self.kvw], "the value")?;
        // MLA's value is a slice of kv_b_proj's output (each head's key part beside it), the
        // cache's copy is whole.
        let sliced = match self.mla() {
            Some(_) => !cached,
            None => self.b.tensor(v).elems() != whole,
        };
        let vr = if sliced {
            self.heads_t(&format!("{p}.v_copy"), a, self.dtype(v), Role::Activations)?
        } else {
            v
        };
        Ok((k, vr))
    }

    /// The scores with the sinks' column (`torch.cat`), less the row max (whose backward saves
    /// its int64 indices): the softmax's input [b, a, s, s + 1].
    fn sink_columns(&mut self, p: &str, saved: &mut Vec<TensorIx>) -> Result<TensorIx, PlanError> {
        let (c, row) = (self.c, [self.bsz, self.a, self.s, 1]);
        let cat = self.sink_scores(&format!("{p}.attn.sinks_cat"), Role::Workspace, c)?;
        let max = format!("{p}.attn.sinks_max");
        let mx = self.b.push(&max, Role::Workspace, c, &row, 1)?;
        let argmax = format!("{p}.attn.sinks_argmax");
        let idx = self.b.push(&argmax, Role::Attention, DType::I64, &row, 1)?;
        saved.push(idx);
        let sub = self.sink_scores(&format!("{p}.attn.sinks_sub"), Role::Workspace, c)?;
        self.b.free_all([cat, mx]);
        Ok(sub)
    }

    /// Attention that materializes the scores (eager, or SDPA's math fallback): K and V
    /// repeated to the query heads when grouped (saved copies), the scores, the softmax (fp32
    /// in eager for the LLaMA families, cast back), probs·V; returns the context copy
    /// [b, s, a·d]. `k` and `v` are the cache's (held) when `cached`.
    pub(super) fn attention_scores(
        &mut self,
        p: &str,
        qkv: Qkv,
        eager: bool,
        saved: &mut Vec<TensorIx>,
    ) -> Result<TensorIx, PlanError> {
        let Qkv {
            q, k, v, cached, ..
        } = qkv;
        let (a, c) = (self.a, self.c);
        let (bsz, s, d) = (self.bsz, self.s, self.d);
        let qt = self.dtype(q);
        let q = self.cast_for("matmul", q, false)?;
        let (kr, vr) = self.repeated_kv(p, k, v, cached, saved)?;
        let kr = self.cast_for("matmul", kr, cached && kr == k)?;
        let vr = self.cast_for("matmul", vr, vr == v)?;
        // q·kᵀ saves q for the key's gradient only: over a frozen base before any adapter,
        // an unadapted key needs none (measured: layer 0 of LoRA on q, v).
        let q_unsaved = self.saving && !self.live_in && !self.adapts(&[Target::K]);
        for t in [q, kr, vr] {
            if t == q && q_unsaved {
                continue;
            }
            if !(cached && (t == k || t == v)) && !saved.contains(&t) {
                saved.push(t);
            }
        }
        // PyTorch before 1.11 saves the softmax's input as well: then the scores it reads are
        // a saved activation (the CPU's fp32 copy, below, or the scores themselves).
        let keeps_input = self.saving && self.w.softmax_saves_input();
        let role = if keeps_input && !(eager && self.w.attn_softcap) {
            Role::Attention
        } else {
            Role::Workspace
        };
        let scores = self.scores(&format!("{p}.attn.scores"), role, c)?;
        let sm = self.spec.softmax;
        let mut last = scores;
        if eager && self.w.attn_softcap {
            // Gemma 2: scores / cap, tanh (saves its output), · cap.
            // Each op's input goes once its output exists (two score tensors at a time).
            let t = self.scores(&format!("{p}.attn.softcap_tanh"), Role::Attention, c)?;
            saved.push(t);
            self.b.free(scores);
            let capped = self.scores(&format!("{p}.attn.capped"), Role::Workspace, c)?;
            last = capped;
        }
        // Attention sinks (gpt-oss): a learned logit per head joins the scores as one more
        // column (`torch.cat`), the row max is taken off (its backward saves the int64
        // indices) and the softmax runs over s + 1 columns in the scores' type; the
        // probabilities are its slice (a view) without the sink.
        let sinks = eager && self.attn_layer().is_some_and(|l| l.sinks);
        let sink_in = if sinks {
            Some(self.sink_columns(p, saved)?)
        } else {
            None
        };
        let pt = if sinks {
            c
        } else if sm.fp32 && eager {
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
        let probs = if sinks {
            self.sink_scores(&format!("{p}.attn.probs"), Role::Attention, pt)?
        } else {
            self.scores(&format!("{p}.attn.probs"), Role::Attention, pt)?
        };
        // PyTorch before 1.11 saves the softmax's input too (the CPU's fp32 copy, or the
        // scores as the kernel reads them).
        let softmax_in = (keeps_input && !sinks).then(|| widened.unwrap_or(last));
        if let Some(t) = softmax_in {
            saved.push(t);
        }
        if widened != softmax_in {
            self.b.free_all(widened);
        }
        self.b.free_all(sink_in);
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
            // native_dropout saves its 1-byte mask (the CPU's dropout its noise); its input is
            // not saved.
            let mt = self.mask_type(self.dtype(pv));
            let m = self.scores(&format!("{p}.attn.drop_mask"), Role::Attention, mt)?;
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
        let fits = last != probs && s >= d && softmax_in != Some(last);
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
        if softmax_in != Some(last) {
            self.b.free(last);
        }
        if q_unsaved && !saved.contains(&q) {
            self.b.free(q);
        }
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
    pub(super) fn attention_fused(
        &mut self,
        p: &str,
        qkv: Qkv,
        backend: SdpaBackend,
        saved: &mut Vec<TensorIx>,
    ) -> Result<TensorIx, PlanError> {
        let Qkv {
            q,
            k,
            v,
            cached,
            masked,
            kv_heads: g,
        } = qkv;
        let (a, c) = (self.a, self.c);
        let (bsz, s, d) = (self.bsz, self.s, self.d);
        let op = "scaled_dot_product_attention";
        let q = self.cast_for(op, q, false)?;
        let kc = self.cast_for(op, k, cached)?;
        let vc = self.cast_for(op, v, true)?;
        // SDPA turns transformers' boolean mask into an additive one in the query's type for
        // each call (`convert_boolean_attn_mask`), and the kernel saves it.
        let mask = if masked {
            let mt = self.dtype(q);
            let m = self.b.push(
                &format!("{p}.attn.mask"),
                Role::Attention,
                mt,
                &[bsz, 1, s, s],
                s,
            )?;
            Some(m)
        } else {
            None
        };
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
        // Context parallelism (ring attention, torch's `context_parallel`): the key and value
        // chunks of the other ranks pass round the ring in a double buffer while this rank's
        // partial outputs and statistics are merged into its own (modelled, not measured: the
        // CPU runs no ring attention).
        let cp = self.w.parallel.cp;
        let ring = if cp > 1 {
            let kv = [bsz, g, s, d];
            let mut r = Vec::new();
            for name in ["k0", "v0", "k1", "v1"] {
                r.push(
                    self.b
                        .push(&format!("{p}.cp.ring_{name}"), Role::Workspace, c, &kv, d)?,
                );
            }
            r.push(self.rows_t(&format!("{p}.cp.partial_out"), Role::Workspace, c, self.qw)?);
            r
        } else {
            Vec::new()
        };
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
        self.b.free_all(ring);
        for t in [q, kc, vc, stats].into_iter().chain(mask) {
            if !(cached && (t == k || t == v)) && !saved.contains(&t) {
                saved.push(t);
            }
        }
        if self.flash_out_copied(backend) {
            // A contiguous [b, a, s, d] query (partial rotary's `torch.cat`) gives the flash
            // kernels an output in that layout: `transpose(1, 2).reshape` copies it for the
            // output projection, and the kernel saves its own.
            saved.push(ctx);
            let copy = self.rows_t(&format!("{p}.ctx_copy"), Role::Activations, c, self.qw)?;
            return Ok(copy);
        }
        if self.saving && self.frozen() {
            // The kernel saves its output (the frozen output projection does not).
            saved.push(ctx);
        }
        Ok(ctx)
    }
}
