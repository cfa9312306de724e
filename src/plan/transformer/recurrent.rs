//! The recurrent mixers of today's hybrids, as their CUDA kernels run them in training:
//! Gated DeltaNet (Qwen3-Next, Qwen3.5) through flash-linear-attention's
//! `chunk_gated_delta_rule` and causal-conv1d, Mamba-2 (Nemotron-H, Bamba, Falcon-H1) through
//! mamba_ssm's `mamba_split_conv1d_scan_combined`. What each autograd function saves is read
//! from its `save_for_backward` (cited at each mixer); the kernels' own intermediates live
//! only while they run.
//!
//! Modelled, not measured: the CPU harness cannot run these kernels. transformers' torch
//! fallback (taken on the CPU, or where those packages are missing) saves more: its chunked
//! [b, h, s/64, 64, 64] matrices and per-op intermediates (validation/families_notes.md, the
//! qwen3_next and nemotron_h rows).

use super::lora::Proj;
use super::T;
use crate::plan::build::{prod, PlanError};
use crate::plan::{DType, Role, TensorIx};
use crate::workload::layers::{DeltaNet, Mamba2, Mixer};

/// mamba_ssm's `chunk_size` default (`Mamba2`, `Mamba2Config`): the chunk the scan's states
/// are kept per.
const MAMBA_CHUNK: u64 = 256;

/// flash-linear-attention's chunk (`chunk_local_cumsum(g, chunk_size=64)`; the WY
/// representation `A` is [b, s, h, 64]).
const FLA_CHUNK: u64 = 64;

impl T<'_> {
    /// The layer's recurrent mixer, where the model is described layer by layer.
    pub(super) fn recurrent(&self) -> Option<Mixer> {
        self.layer
            .map(|l| l.mixer)
            .filter(|m| matches!(m, Mixer::GatedDeltaNet(_) | Mixer::Mamba2(_)))
    }

    /// The width of the gradient the mixer's input projections end with in backward (the
    /// projections' outputs): q, k, v for attention, the in_proj outputs for the recurrent
    /// mixers.
    pub(super) fn mixer_grad_width(&self) -> u64 {
        match self.recurrent() {
            Some(Mixer::GatedDeltaNet(m)) => {
                let (key, value) = gdn_widths(&m);
                key.saturating_mul(2)
                    .saturating_add(value.saturating_mul(2))
                    .saturating_add(m.v_heads.saturating_mul(2))
            }
            Some(Mixer::Mamba2(m)) => mamba_in_width(&m),
            _ => self.qw.saturating_add(self.kvw.saturating_mul(2)),
        }
    }

    /// A [b·s, width] tensor of the layer's rows.
    fn tokens_t(&mut self, name: &str, dtype: DType, width: u64) -> Result<TensorIx, PlanError> {
        let n = self.rows();
        self.b
            .push(name, Role::Activations, dtype, &[n, width], width)
    }

    /// What `own` holds is saved (training) or goes now (no_grad).
    fn keep_or_free(&mut self, own: Vec<TensorIx>, saved: &mut Vec<TensorIx>) {
        if self.saving {
            saved.extend(own);
        } else {
            self.b.free_all(own);
        }
    }

    /// A gated RMSNorm's fp32 rstd (one per row and group, `groups` a row) and its output
    /// [b·s, width] in the compute type.
    fn gated_norm(
        &mut self,
        p: &str,
        groups: u64,
        width: u64,
    ) -> Result<(TensorIx, TensorIx), PlanError> {
        let rows = prod(&[self.rows(), groups], "the gated norm's rows")?;
        let rstd = self.b.push(
            &format!("{p}.norm_rstd"),
            Role::Activations,
            DType::F32,
            &[rows],
            1,
        )?;
        let c = self.c;
        let y = self.tokens_t(&format!("{p}.ctx"), c, width)?;
        Ok((rstd, y))
    }

    /// Gated DeltaNet (transformers 5.24 `Qwen3NextGatedDeltaNet.forward` with
    /// flash-linear-attention and causal-conv1d installed). Per layer it saves:
    /// - `in_proj_qkvz`'s and `in_proj_ba`'s input (the block norm's output, by the caller);
    /// - the convolution's input, q, k and v joined by `torch.cat` (`CausalConv1dFn` saves `x`;
    ///   SiLU is fused and recomputed);
    /// - z, copied out of `in_proj_qkvz`'s output by its reshape (the gated norm saves it);
    /// - β = sigmoid(b) (its output) and the gate's fp32 pieces: softplus's input
    ///   `a.float() + dt_bias` and its output;
    /// - `ChunkGatedDeltaRuleFunction.save_for_backward(q, q_rstd, k, k_rstd, v, g, beta, A, …)`
    ///   (fla `ops/gated_delta_rule/chunk.py` @ 0315a70): the L2-normed q and k at the value
    ///   heads with their fp32 rstd, v (`input_guard`'s contiguous copy), the chunk-local
    ///   cumulative gate (fp32) and the WY matrix A [b, s, h_v, 64];
    /// - `FusedRMSNormGated`: its input (the core's output), z, and the fp32 rstd; its output
    ///   is what out_proj reads (saved by the caller).
    ///
    /// Returns the gated norm's output [b, s, h_v·d_v].
    pub(super) fn gated_delta_net(
        &mut self,
        p: &str,
        piece: &str,
        x: TensorIx,
        m: DeltaNet,
        saved: &mut Vec<TensorIx>,
    ) -> Result<TensorIx, PlanError> {
        let (h, c) = (self.h, self.c);
        let (key, value) = gdn_widths(&m);
        let e = "the Gated DeltaNet width";
        let hv = m.v_heads;
        let conv_dim = prod(&[key, 2], e)?.saturating_add(value);
        let named = |n: &str, width| Proj::named(format!("{p}.{n}"), &[], width);
        let o = self.projections(
            piece,
            x,
            h,
            &[
                named("in_proj_qkvz", conv_dim.saturating_add(value)),
                named("in_proj_ba", hv.saturating_mul(2)),
            ],
            saved,
        )?;
        let (qkvz, ba) = (o[0], o[1]);
        let conv_in = self.tokens_t(&format!("{p}.conv_in"), c, conv_dim)?;
        let z = self.tokens_t(&format!("{p}.z"), c, value)?;
        self.b.free(qkvz);
        let conv_out = self.tokens_t(&format!("{p}.conv_out"), c, conv_dim)?;
        // The gates: β = sigmoid(b); g = -exp(A_log) · softplus(a.float() + dt_bias) in fp32.
        let beta = self.tokens_t(&format!("{p}.beta"), c, hv)?;
        let a32 = self.tokens_t(&format!("{p}.a_dt"), DType::F32, hv)?;
        let sp = self.tokens_t(&format!("{p}.softplus"), DType::F32, hv)?;
        let g = self.tokens_t(&format!("{p}.g"), DType::F32, hv)?;
        self.b.free(ba);
        // q and k repeated to the value heads (or `input_guard`'s contiguous copies), v's copy.
        let qk_width = prod(&[hv, m.head_k_dim], e)?;
        let qr = self.tokens_t(&format!("{p}.q_rep"), c, qk_width)?;
        let kr = self.tokens_t(&format!("{p}.k_rep"), c, qk_width)?;
        let v = self.tokens_t(&format!("{p}.v"), c, value)?;
        self.b.free(conv_out);
        // Inside the autograd function: l2norm_fwd, the chunk-local cumsum, A, then the
        // kernels' w, u, the per-chunk states h and the new values, and the output.
        let qn = self.tokens_t(&format!("{p}.q_l2"), c, qk_width)?;
        let q_rstd = self.tokens_t(&format!("{p}.q_rstd"), DType::F32, hv)?;
        let kn = self.tokens_t(&format!("{p}.k_l2"), c, qk_width)?;
        let k_rstd = self.tokens_t(&format!("{p}.k_rstd"), DType::F32, hv)?;
        self.b.free_all([qr, kr]);
        let gc = self.tokens_t(&format!("{p}.g_cumsum"), DType::F32, hv)?;
        self.b.free(g);
        let a = self.tokens_t(&format!("{p}.wy_a"), c, hv.saturating_mul(FLA_CHUNK))?;
        let w = self.tokens_t(&format!("{p}.wy_w"), c, qk_width)?;
        let u = self.tokens_t(&format!("{p}.wy_u"), c, value)?;
        let chunks = self.s.div_ceil(FLA_CHUNK);
        let states = self.b.push(
            &format!("{p}.chunk_states"),
            Role::Workspace,
            c,
            &[self.bsz, chunks, hv, m.head_k_dim, m.head_v_dim],
            m.head_v_dim,
        )?;
        let v_new = self.tokens_t(&format!("{p}.v_new"), c, value)?;
        let core = self.tokens_t(&format!("{p}.core_out"), c, value)?;
        self.b.free_all([w, u, states, v_new]);
        // FusedRMSNormGated over each head's d_v with the SiLU gate z.
        let (rstd, y) = self.gated_norm(p, hv, value)?;
        let own = vec![
            conv_in, z, beta, a32, sp, qn, q_rstd, kn, k_rstd, v, gc, a, core, rstd,
        ];
        self.keep_or_free(own, saved);
        self.consumed(x, saved);
        Ok(y)
    }

    /// Mamba-2 (transformers 5.24 `NemotronHMamba2Mixer.cuda_kernels_forward` in training:
    /// `mamba_split_conv1d_scan_combined` with the gated RMSNorm and out_proj fused). Per
    /// layer it saves in_proj's input (the block norm's output, by the caller) and
    /// `MambaSplitConv1dScanCombinedFn.save_for_backward(zxbcdt, …, out_x, …, rstd, …)`
    /// (state-spaces/mamba `mamba_ssm/ops/triton/ssd_combined.py`): in_proj's output, the
    /// scan's output before the norm [b, s, heads·head_dim] and the norm's fp32 rstd per row
    /// and group. The convolution's output, the chunk cumsums and the per-chunk states
    /// [b, s/256, heads, head_dim, d_state] (fp32) live while the kernels run; the gated norm's
    /// output feeds out_proj, which saves nothing of it (recomputed in backward).
    ///
    /// Returns the gated norm's output [b, s, heads·head_dim], which nothing saves.
    pub(super) fn mamba2(
        &mut self,
        p: &str,
        piece: &str,
        x: TensorIx,
        m: Mamba2,
        saved: &mut Vec<TensorIx>,
    ) -> Result<TensorIx, PlanError> {
        let (h, c, bsz) = (self.h, self.c, self.bsz);
        let inner = m.inner();
        let proj = Proj::named(format!("{p}.in_proj"), &[], mamba_in_width(&m));
        let zxbcdt = self.projections(piece, x, h, &[proj], saved)?[0];
        let xbc = self.tokens_t(&format!("{p}.conv_out"), c, m.conv_dim())?;
        let chunks = self.s.div_ceil(MAMBA_CHUNK);
        let cumsum = self.b.push(
            &format!("{p}.dA_cumsum"),
            Role::Workspace,
            DType::F32,
            &[bsz, m.heads, chunks, MAMBA_CHUNK],
            MAMBA_CHUNK,
        )?;
        let states = self.b.push(
            &format!("{p}.chunk_states"),
            Role::Workspace,
            DType::F32,
            &[bsz, chunks, m.heads, m.head_dim, m.d_state],
            m.d_state,
        )?;
        let out_x = self.tokens_t(&format!("{p}.scan_out"), c, inner)?;
        self.b.free_all([xbc, cumsum, states]);
        let (rstd, y) = self.gated_norm(p, m.groups.max(1), inner)?;
        self.keep_or_free(vec![zxbcdt, out_x, rstd], saved);
        self.consumed(x, saved);
        Ok(y)
    }
}

/// Gated DeltaNet's key width (k_heads · head_k_dim) and value width (v_heads · head_v_dim).
fn gdn_widths(m: &DeltaNet) -> (u64, u64) {
    (
        m.k_heads.saturating_mul(m.head_k_dim),
        m.v_heads.saturating_mul(m.head_v_dim),
    )
}

/// Mamba-2's in_proj output: z, x, B, C and dt (2·inner + 2·groups·d_state + heads).
fn mamba_in_width(m: &Mamba2) -> u64 {
    m.inner()
        .saturating_add(m.conv_dim())
        .saturating_add(m.heads)
}
