//! Transformer plans per Korthikanti et al. generalized to the element size: shared layer
//! builders over one `Spec` per family (`spec.rs`; GPT-2, BERT and ViT, and the decoder LLMs:
//! LLaMA, Mistral, Qwen2/3, Gemma 1-3, Phi-3, Mixtral, Qwen2/3-MoE, each in a file of its own).
//! This file builds the step (embedding, layers, head, loss, backward, checkpointing) and the
//! norms; `attention.rs` the attention cores, `mlp.rs` the MLP blocks and experts, `count.rs`
//! the parameter groups.
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
//! Eager attention's [b, 1, s, s] mask is an input of every checkpointed layer: a saved
//! activation until layer 0's backward is done.

mod attention;
mod bert;
mod count;
mod decoder;
mod gemma;
mod gpt2;
mod llama;
mod lora;
mod mlp;
mod moe;
mod phi3;
mod qwen;
mod sample;
pub mod spec;
mod vit;

use super::autocast::{self, Autocast};
use super::build::{prod, Builder, PlanError};
use super::params::{param_dtype, residual_dtype, States};
use super::{DType, Phase, Role, Step, TensorIx};
use crate::workload::layers::{BlockForm, LayerSpec, MlpSpec};
use crate::workload::parallel::TpHead;
use crate::workload::{Attention, Checkpoint, DropoutMask, Outputs, Target, Workload};
use spec::{Embed, Head, Mlp, Norm, Spec};

pub use attention::{attention_summary, sdpa_backend, SdpaBackend};
use count::{cast_elems, widths};
pub use count::{layer_params, param_count, pieces, trainable_count};

/// The spec of a transformer workload (an error for ResNet and a bare parameter count).
fn spec_of(w: &Workload) -> Result<Spec, PlanError> {
    Spec::of(w).ok_or_else(|| PlanError::Invalid("not a transformer".into()))
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
    /// The experts of the layer being built (a model described layer by layer has dense layers
    /// among sparse ones, `enter_layer`).
    moe: Option<crate::workload::Moe>,
    /// The record of the layer being built, where the model is described layer by layer.
    layer: Option<LayerSpec>,
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
    /// FSDP: each unit's unsharded parameters while gathered ("root", "L{i}").
    units: std::collections::HashMap<String, TensorIx>,
    /// FSDP: the last forward all-gather's flat output, kept until the next one.
    all_gather_kept: Option<TensorIx>,
    /// The stage's first layer.
    lo: u64,
    /// Sequence parallelism: the residual stream holds 1/tp of the sequence.
    sp: bool,
    /// RoPE's cos and sin tables, made once per forward.
    rope: Option<TensorIx>,
    /// Not saving: what the layer being built keeps until it returns (eager attention's
    /// returned probabilities, which the decoder layer binds to `_`).
    layer_tail: Vec<TensorIx>,
    /// Tensors the caller holds until the end of the step (logits, a kept KV cache).
    held: Vec<TensorIx>,
    /// The residual stream needs a gradient: false over a frozen base until the first adapter
    /// (no checkpointing: transformers' `enable_input_require_grads` is not called), so the
    /// ops before it save nothing.
    live: bool,
    /// `live` as the layer being built began.
    live_in: bool,
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
    /// A residual-stream tensor (layer input and output, norm inputs): under sequence
    /// parallelism this rank's share of the sequence.
    fn resid(&mut self, name: &str) -> Result<TensorIx, PlanError> {
        let (r, bsz, h) = (self.r, self.bsz, self.h);
        let s = if self.sp {
            self.s.div_ceil(self.w.parallel.tp)
        } else {
            self.s
        };
        self.b.push(name, Role::Activations, r, &[bsz, s, h], h)
    }
    /// Sequence parallelism: each of `readers` column-parallel linears all-gathers the sharded
    /// `x` over the sequence into a full-length copy of its own, which it saves (DTensor's
    /// redistribute, once per linear: measured five [b, s, h] copies per LLaMA layer); the
    /// sharded `x` goes unless something saved it. Returns the first copy (what kernels read);
    /// without sequence parallelism, `x`.
    fn sp_gather(
        &mut self,
        x: TensorIx,
        readers: u64,
        kept: bool,
        saved: &mut Vec<TensorIx>,
    ) -> Result<TensorIx, PlanError> {
        if !self.sp {
            return Ok(x);
        }
        let spec = self.b.tensor(x).clone();
        let mut first = None;
        for j in 0..readers.max(1) {
            let t = self.hidden_t(
                &format!("{}.gathered{j}", spec.name),
                Role::Activations,
                spec.dtype,
            )?;
            saved.push(t);
            first.get_or_insert(t);
        }
        if !kept && !saved.contains(&x) {
            self.b.free(x);
        }
        Ok(first.unwrap_or(x))
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
            let t = self.mask_type(self.c);
            saved.push(self.b.push(name, Role::Activations, t, &[bsz, s, h], h)?);
        }
        Ok(())
    }
    /// The type of the mask a dropout over `input` saves (`DropoutMask`).
    fn mask_type(&self, input: DType) -> DType {
        match self.w.dropout_mask {
            DropoutMask::Bool => DType::U8,
            DropoutMask::Input => input,
        }
    }
    /// The caller lets go of what it held (logits, a kept cache's copies).
    fn release_held(&mut self) {
        let held = std::mem::take(&mut self.held);
        self.b.free_all(held);
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
        if self.ac.is_some() && self.gather.is_none() && self.w.parallel.fsdp.is_none() {
            let elems = cast_elems(self.w, piece)?;
            if elems.0 > 0 {
                self.states.cast(self.b, piece, elems)?;
            }
        }
        Ok(())
    }
    fn weights(&self, piece: &str) -> TensorIx {
        self.gather
            .or_else(|| self.units.get(&fsdp_unit(piece)).copied())
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
        // The fp32 reciprocal RMS, one per normalized row (per head for q/k norms).
        let rsqrt = |t: &mut Self| {
            let r = format!("{name}.rsqrt");
            t.b.push(&r, Role::Activations, DType::F32, &[rows, 1], 1)
        };
        if !self.live && self.saving {
            // Nothing before it needs a gradient and its gain is frozen: it saves nothing.
            self.saving = false;
            let mut none = Vec::new();
            let y = self.norm_over(name, x, width, &mut none);
            self.saving = true;
            return y;
        }
        match self.spec.norm {
            Norm::Centered => {
                let mut own = vec![
                    push(self, "centred_pow", DType::F32)?,
                    push(self, "centred_mul", DType::F32)?,
                ];
                own.push(rsqrt(self)?);
                let xhat = push(self, "xhat", DType::F32)?;
                let y = push(self, "out", xt)?;
                self.norm_step(x, y, rows, width);
                if self.frozen() {
                    self.b.free(xhat);
                } else {
                    own.push(xhat);
                }
                if self.saving {
                    saved.extend(own);
                } else {
                    self.b.free_all(own);
                }
                Ok(y)
            }
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
                own.push(rsqrt(self)?);
                let gemma = self.spec.norm == Norm::RmsGemma;
                let xhat = push(self, "xhat", if gemma { DType::F32 } else { xt })?;
                // LLaMA: weight · x̂ in the weights' and input's promoted type; Gemma: cast back
                // to the input's type.
                let out_t = if gemma {
                    xt
                } else {
                    autocast::promote(param_dtype(self.w.precision), xt)
                };
                let y = push(self, "out", out_t)?;
                self.norm_step(x, y, rows, width);
                // A frozen gain needs no x̂ for its gradient: it goes with the output.
                if self.frozen() {
                    self.b.free(xhat);
                } else {
                    own.push(xhat);
                }
                if self.saving {
                    saved.extend(own);
                } else {
                    self.b.free_all(own);
                }
                Ok(y)
            }
        }
    }

    /// FSDP: all-gather unit `unit`'s parameters (a no-op while they are gathered): the flat
    /// output of the whole unit in the parameters' type (FSDP2's `foreach_all_gather`, copied
    /// out into the unsharded parameters).
    fn unshard(&mut self, unit: &str, elems: u64) -> Result<(), PlanError> {
        if self.w.parallel.fsdp.is_none() || self.units.contains_key(unit) || elems == 0 {
            return Ok(());
        }
        // Under `amp-*`, FSDP2's MixedPrecisionPolicy(param_dtype=the 16-bit type,
        // reduce_dtype=fp32), as torchtitan sets it: the gathered parameters are 16-bit and
        // autocast has nothing to cast.
        let dt = self.ac.map_or(param_dtype(self.w.precision), |a| a.low);
        // The flat all-gather output, copied out into the unsharded parameters. In forward
        // FSDP2 keeps it until the next unit's all-gather has been waited on (to overlap the
        // copy-out with it), the last one until the root's forward returns
        // (`_fsdp_param_group.py` `wait_for_unshard`, `_fsdp_state.py` `_post_forward`); in
        // backward it goes after the copy-out.
        let flat = self.b.push(
            &format!("fsdp.all_gather.{unit}"),
            Role::Workspace,
            dt,
            &[elems],
            elems.clamp(1, 4096),
        )?;
        let t = self.b.push(
            &format!("fsdp.unsharded.{unit}"),
            Role::Params,
            dt,
            &[elems],
            elems.clamp(1, 4096),
        )?;
        self.units.insert(unit.to_string(), t);
        if self.b.current_phase() == Phase::Backward {
            self.b.free(flat);
        } else if let Some(prev) = self.all_gather_kept.replace(flat) {
            self.b.free(prev);
        }
        Ok(())
    }
    fn reshard(&mut self, unit: &str) {
        if let Some(t) = self.units.remove(unit) {
            self.b.free(t);
        }
    }
    /// Layer `i`'s unit, gathered for its forward or backward.
    fn unshard_layer(&mut self, i: u64) -> Result<(), PlanError> {
        if self.w.parallel.fsdp.is_none() {
            return Ok(());
        }
        let e = layer_params(self.w)?;
        self.unshard(&format!("L{i}"), e)
    }
    /// The backward begins: FSDP2's root pre-backward prefetches the last layer's all-gather.
    fn begin_backward(&mut self, last_layer: u64) -> Result<(), PlanError> {
        // The root's forward has returned: FSDP2 lets go of the last all-gather output.
        if let Some(flat) = self.all_gather_kept.take() {
            self.b.free(flat);
        }
        self.states.begin_backward(self.b);
        self.unshard_layer(last_layer)
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
            // A frozen linear saves no input (its weight needs no gradient).
            if !src_kept && !saved.contains(&src) && !self.frozen() {
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
        self.live_in = self.live;
        self.enter_layer(i);
        self.unshard_layer(i)?;
        let (h, f) = (self.h, self.f);
        let (pa, pm) = (format!("L{i}.attn"), format!("L{i}.mlp"));
        let llm = self.w.is_decoder_llm();
        self.use_piece(&pa)?;
        let mut sa = Vec::new();
        let n1 = self.norm(&format!("{p}.ln1"), x, &mut sa)?;
        let readers = if self.spec.fused_qkv { 1 } else { 3 };
        let n1 = self.sp_gather(n1, readers, false, &mut sa)?;
        // A parallel block (Cohere: `x + attn(ln(x)) + mlp(ln(x))`): the MLP reads the same
        // normalised input, which stays until both branches ran.
        let parallel = self.parallel_block();
        let n1 = self.matmul_input(n1, readers, parallel, &mut sa)?;
        // Over a frozen base before any adapter, an attention block without q, k or v
        // adapters needs no gradient: it saves nothing.
        let dead = saving && !self.live && !self.adapts(&[Target::Q, Target::K, Target::V]);
        if dead {
            self.saving = false;
        }
        let ctx = if llm {
            self.attention_llm(p, &pa, n1, &mut sa)?
        } else {
            self.attention_gpt(p, &pa, n1, &mut sa)?
        };
        if self.frozen() && !sa.contains(&n1) && !parallel {
            // Nothing saved the projections' input (adapters copied theirs).
            self.b.free(n1);
        }
        let ctx = self.matmul_input(ctx, 1, false, &mut sa)?;
        self.mask(&format!("{p}.proj.drop_mask"), &mut sa)?;
        let mut sm = Vec::new();
        let qw = self.qw;
        // The projection's output plus the residual: the residual stream's type. Gemma 2/3
        // normalize the projection's output first (its norm saves it).
        let x2 = if parallel {
            // The attention branch's output waits for the MLP's; nothing saves it.
            let c = self.c;
            let o = self.hidden_t(&format!("{p}.attn.out"), Role::Activations, c)?;
            self.matmul(&pa, ctx, o, h, qw);
            self.consumed(ctx, &mut sa);
            if saving && !sa.contains(&n1) {
                sa.push(n1);
            }
            o
        } else if self.spec.sandwich_norms {
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
        } else if self.frozen() {
            // The output projection as the base stores it, its adapter, then the residual add.
            let proj = lora::Proj::named(format!("{p}.o_proj"), &[Target::O], h);
            let o = self.projections(&pa, ctx, qw, &[proj], &mut sa)?[0];
            if !sa.contains(&ctx) {
                self.b.free(ctx);
            }
            let x2 = self.resid(&format!("{p}.ln2.in"))?;
            self.b.free(o);
            x2
        } else if self.sp {
            // Sequence parallelism: the row-parallel projection's partial sums, full length,
            // reduce-scattered over the sequence into the residual.
            let c = self.c;
            let o = self.hidden_t(&format!("{p}.attn.partial"), Role::Workspace, c)?;
            self.matmul(&pa, ctx, o, h, qw);
            self.consumed(ctx, &mut sa);
            let x2 = self.resid(&format!("{p}.ln2.in"))?;
            self.b.free(o);
            x2
        } else {
            let x2 = self.resid(&format!("{p}.ln2.in"))?;
            self.matmul(&pa, ctx, x2, h, qw);
            self.consumed(ctx, &mut sa);
            x2
        };
        if dead {
            self.saving = saving;
        }
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
        let n2 = if parallel {
            n1
        } else {
            let n2 = self.norm(&format!("{p}.ln2"), x2, &mut sm)?;
            let readers = match (self.spec.mlp, self.spec.fused_gate_up) {
                (Mlp::Gated, false) => 2,
                _ => 1,
            };
            let n2 = self.sp_gather(n2, readers, false, &mut sm)?;
            self.matmul_input(n2, readers, false, &mut sm)?
        };
        let dead = saving && !self.live && !self.adapts(&[Target::Gate, Target::Up]);
        if dead {
            self.saving = false;
        }
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
                self.mask(&format!("{p}.mlp.drop_mask"), &mut sm)?;
                let out = self.resid(out_name)?;
                self.matmul(&pm, last, out, h, f);
                out
            }
        };
        if dead {
            self.saving = saving;
        }
        if !sm.contains(&x2) {
            self.b.free(x2);
        }
        if parallel && !saving {
            self.b.free(n1);
        }
        if !saving {
            let done = std::mem::take(&mut sm);
            self.b.free_all(done);
        }
        let tail = std::mem::take(&mut self.layer_tail);
        self.b.free_all(tail);
        // FSDP2 reshards after the forward (not after a recomputation in backward).
        if self.b.current_phase() != Phase::Backward && !self.w.parallel.keeps_unsharded() {
            self.reshard(&format!("L{i}"));
        }
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
            }
            cur = out;
        }
        Ok((frames, cur))
    }

    /// Layer `i`'s own MLP, where the model is described layer by layer (dense layers among
    /// sparse ones, each with its width): the spec's MLP kind, the width and the experts.
    fn enter_layer(&mut self, i: u64) {
        let Some(l) = self.w.model.as_ref().and_then(|m| m.layers.get(i as usize)) else {
            return;
        };
        self.layer = Some(*l);
        self.spec.mlp = decoder::mlp_kind(&l.mlp);
        match l.mlp {
            MlpSpec::Dense { ffn, .. } => self.f = ffn,
            MlpSpec::Moe(e) => {
                self.moe = Some(crate::workload::Moe {
                    experts: e.experts,
                    top_k: e.top_k,
                    expert_ffn: e.expert_ffn,
                    shared_ffn: e.shared_ffn,
                })
            }
            MlpSpec::None => {}
        }
    }

    /// The layer being built is a parallel block (attention and MLP over one norm's output).
    fn parallel_block(&self) -> bool {
        self.layer.is_some_and(|l| l.block == BlockForm::Parallel)
    }

    /// Free the saved tensors of a backward frame whose names `pred` picks (their node ran).
    fn release_saved(&mut self, saved: &mut Vec<TensorIx>, pred: impl Fn(&str) -> bool) {
        let (gone, kept): (Vec<TensorIx>, Vec<TensorIx>) =
            saved.iter().partition(|&&t| pred(&self.b.tensor(t).name));
        *saved = kept;
        self.b.free_all(gone);
    }

    fn backward(&mut self, fr: Frame, incoming: TensorIx) -> Result<TensorIx, PlanError> {
        let layer = fsdp_layer(&fr.piece);
        if let Some(i) = layer {
            self.enter_layer(i);
        }
        let block = fr.block;
        if let (Some(i), Block::Mlp) = (layer, block) {
            // FSDP2's pre-backward: the layer gathered, the next one in backward prefetched.
            self.unshard_layer(i)?;
            if i > self.lo {
                self.unshard_layer(i - 1)?;
            }
        }
        let g = self.block_backward(fr, incoming)?;
        if let (Some(i), Block::Attn) = (layer, block) {
            if self.w.parallel.fsdp.is_some() {
                // The layer's post-backward: reduce-scatter its gradients, reshard.
                let names = [format!("L{i}.attn"), format!("L{i}.mlp")];
                self.states.fsdp_reduce(self.b, &names)?;
                self.reshard(&format!("L{i}"));
            }
        }
        Ok(g)
    }

    fn block_backward(&mut self, mut fr: Frame, incoming: TensorIx) -> Result<TensorIx, PlanError> {
        let w = self.w;
        self.states.gradient(self.b, &fr.piece, w)?;
        if self.frozen() {
            self.adapter_backward(&fr.piece, fr.block == Block::Attn)?;
            self.states
                .gradient(self.b, &format!("{}.lora", fr.piece), w)?;
        }
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
            Block::Mlp if self.spec.mlp == Mlp::Gated && !self.spec.fused_gate_up => {
                // Node by node, as autograd runs them (measured: `MulBackward0` holds three
                // [b,s,f] gradients): the down projection's input gradient, after which its
                // saved input (the product, or an adapter's copy of it) goes; act·up's backward
                // the gradients of both factors, then its saved factors go; the activation's
                // backward the gate's, then its saved input goes.
                let lname = fr.piece.trim_end_matches(".mlp").to_string();
                let g1 = self.wide_as(&format!("{p}.grad_prod"), Role::Workspace)?;
                self.release_saved(&mut fr.saved, |n| {
                    n.ends_with(".mlp.prod") || n.starts_with(&format!("{lname}.down_proj.lora_"))
                });
                let g2 = self.wide_as(&format!("{p}.grad_act"), Role::Workspace)?;
                let g3 = self.wide_as(&format!("{p}.grad_up"), Role::Workspace)?;
                self.b.free(g1);
                self.release_saved(&mut fr.saved, |n| {
                    n.ends_with(".mlp.act") || n.ends_with(".mlp.up")
                });
                let g4 = self.wide_as(&format!("{p}.grad_gate"), Role::Workspace)?;
                self.b.free(g2);
                self.release_saved(&mut fr.saved, |n| n.ends_with(".mlp.gate"));
                self.b.free(g3);
                g4
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
                let mut grad_v = None;
                if scores_saved {
                    // probs·V backward (BmmBackward0, measured op by op): the gradient of V at
                    // the query heads, then of the probabilities; then the node's saved copy of
                    // V (repeated for grouped heads, or copied out of a fused projection) and
                    // its incoming gradient go. Softmax backward: the scores' gradient (in the
                    // probabilities' type); the scale/mask ops pass on one more of that size.
                    let pt = fr
                        .saved
                        .iter()
                        .map(|&t| self.b.tensor(t))
                        .find(|t| t.name.ends_with(".attn.probs"))
                        .map_or(c, |t| t.dtype);
                    // The output projection's backward made `gctx`: what it saved (the
                    // context, and its adapter's copies) goes (measured: before the core's).
                    let lname = fr.piece.trim_end_matches(".attn");
                    let ctx = format!("{lname}.ctx");
                    let ctx_copy = format!("{ctx}.");
                    let o = format!("{lname}.o_proj.");
                    self.release_saved(&mut fr.saved, |n| {
                        n == ctx || n.starts_with(&ctx_copy) || n.starts_with(&o)
                    });
                    let a = self.a;
                    grad_v = Some(self.heads_t(&format!("{p}.grad_v"), a, c, Role::Workspace)?);
                    let g1 = self.scores(&format!("{p}.grad_probs"), Role::Workspace, c)?;
                    self.release_saved(&mut fr.saved, |n| {
                        n.ends_with(".v_rep") || n.ends_with(".v_copy")
                    });
                    self.b.free(last);
                    let g2 = self.scores(&format!("{p}.grad_scores"), Role::Workspace, pt)?;
                    self.b.free(g1);
                    last = g2;
                }
                let width = self.qw + 2 * self.kvw;
                let gqkv = self.rows_t(&format!("{p}.grad_qkv"), Role::Workspace, c, width)?;
                self.b.free(last);
                self.b.free_all(grad_v);
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

/// "2nd", "3rd", "11th", "21st": the K of a checkpoint note.
fn ordinal(k: u64) -> String {
    let suffix = match (k % 10, k % 100) {
        (_, 11..=13) => "th",
        (1, _) => "st",
        (2, _) => "nd",
        (3, _) => "rd",
        _ => "th",
    };
    format!("{k}{suffix}")
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

/// FSDP's unit of a parameter group: its layer's ("L{i}"), or the root's.
fn fsdp_unit(piece: &str) -> String {
    match fsdp_layer(piece) {
        Some(i) => format!("L{i}"),
        None => "root".into(),
    }
}

/// The layer of a parameter group named `L{i}.…`.
fn fsdp_layer(piece: &str) -> Option<u64> {
    piece.strip_prefix('L')?.split('.').next()?.parse().ok()
}

/// The parameter groups a pipeline stage holds: its layers', the embedding's on the first,
/// the final norm's and head's on the last (a tied head: its own copy of the embedding).
fn stage_pieces(
    w: &Workload,
    st: &crate::workload::parallel::Stage,
) -> Result<Vec<super::params::Piece>, PlanError> {
    let all = pieces(w)?;
    if st.of <= 1 {
        return Ok(all);
    }
    let layer =
        |name: &str| -> Option<u64> { name.strip_prefix('L')?.split('.').next()?.parse().ok() };
    Ok(all
        .into_iter()
        .filter(|p| match layer(&p.name) {
            Some(i) => (st.lo..st.hi).contains(&i),
            None => match p.name.as_str() {
                "embed" => st.first() || (st.last() && w.tied_head()),
                n if n.starts_with("embed") => st.first(),
                _ => st.last(),
            },
        })
        .collect())
}

/// Build a transformer step's timeline at the workload's batch and sequence.
pub fn build(b: &mut Builder, w: &Workload) -> Result<(), PlanError> {
    // FSDP under `amp-*` is FSDP2's MixedPrecisionPolicy(param_dtype=the 16-bit type,
    // reduce_dtype=fp32), as torchtitan trains (no autocast): the gathered parameters, and so
    // every activation, are 16-bit as under `model.bfloat16()`, while the sharded parameters,
    // gradients and optimizer state stay fp32.
    let mp = (w.parallel.fsdp.is_some() && w.precision.is_autocast())
        .then(|| super::params::compute_dtype(w.precision));
    let with = |p: crate::workload::Precision| {
        let mut c = w.clone();
        c.precision = p;
        c
    };
    let act_w = mp.map(|low| {
        with(if low == DType::F16 {
            crate::workload::Precision::Fp16
        } else {
            crate::workload::Precision::Bf16
        })
    });
    let state_w = mp.map(|_| with(crate::workload::Precision::Fp32));
    let w = act_w.as_ref().unwrap_or(w);
    let (bsz, s, h, a, f, v) = (w.batch, w.seq, w.hidden, w.heads, w.ffn, w.vocab);
    let spec = spec_of(w)?;
    let (qw, kvw, d) = widths(w)?;
    let train = !w.inference();
    // A quantized base in training runs in fp32 around its 4-bit matmuls: PEFT's
    // `prepare_model_for_kbit_training` upcasts the embeddings, norms and head.
    let c = residual_dtype(w);
    let stage = crate::workload::parallel::stage(w, w.parallel.rank.unwrap_or(0));
    let mut states = States::setup(b, state_w.as_ref().unwrap_or(w), &stage_pieces(w, &stage)?)?;
    states.gather_dtype = mp;
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
        moe: w.moe,
        layer: None,
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
        units: Default::default(),
        all_gather_kept: None,
        lo: stage.lo,
        sp: w.parallel.sequence_parallel && w.parallel.tp > 1,
        rope: None,
        layer_tail: Vec::new(),
        held: Vec::new(),
        // Checkpointing calls `enable_input_require_grads` (transformers 5.24
        // `modeling_utils.py:3190-3198`); PEFT without it does not.
        live: w.lora.is_none() || !train || segment(w.checkpoint, w.layers).is_some(),
        live_in: true,
    };
    t.b.phase(Phase::Forward);
    if let Some(mixer) = w.model.as_ref().and_then(|m| m.unplanned_mixer()) {
        t.b.note(format!(
            "the forward of its {mixer} layers is planned as softmax attention of the model's head widths (modelled, not measured); their weights and serving cache are their own"
        ));
    }
    if let Some(v) = w.model.as_ref().and_then(|m| m.vision.as_ref()) {
        t.b.note(format!(
            "vision tower ({}): its {} weights are counted; its activations are not planned (the step is the text model's)",
            v.kind,
            crate::units::fmt_count(v.params)
        ));
    }
    // FSDP2's root unit (embedding, final norm, head): gathered at the root's pre-forward and
    // kept through the backward (the root does not reshard after forward).
    let root_pieces: Vec<String> = stage_pieces(w, &stage)?
        .into_iter()
        .filter(|p| fsdp_layer(&p.name).is_none())
        .map(|p| p.name)
        .collect();
    let root_elems: u64 = stage_pieces(w, &stage)?
        .iter()
        .filter(|p| fsdp_layer(&p.name).is_none())
        .map(|p| p.elems)
        .sum();
    t.unshard("root", root_elems)?;
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
        // A later pipeline stage's input: the previous stage's output, received.
        _ if !stage.first() => t.resid("stage.recv")?,
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
    let seg = if train {
        segment(w.checkpoint, stage.hi - stage.lo)
    } else {
        None
    };
    // Checkpointed layers keep the mask for their backward: a saved activation then.
    let mask_role = if seg.is_some() {
        Role::Activations
    } else {
        Role::Workspace
    };
    if llm && w.attention == Attention::Naive {
        let n = if spec.sandwich_norms { 2 } else { 1 };
        for i in 0..n {
            let r = t.r;
            masks.push(t.b.push(
                &format!("attn.causal_mask{i}"),
                mask_role,
                r,
                &[bsz, 1, s, s],
                s,
            )?);
        }
    }
    if stage.first() {
        t.mask("emb.drop_mask", &mut emb_saved)?;
    }

    // Layers: the stage's (all of them without a pipeline).
    let (lo, l) = (stage.lo, stage.hi);
    let name_out = |i: u64| {
        if i + 1 == l {
            if stage.last() {
                "head.in"
            } else {
                "stage.send"
            }
            .to_string()
        } else {
            format!("L{}.in", i + 1)
        }
    };
    let mut frames = Vec::new();
    let mut ckpts = Vec::new();
    let head_in = match seg {
        None => {
            let (fr, out) = t.layers(lo, l, x0, train, !llm, &name_out)?;
            frames = fr;
            out
        }
        Some(k) => {
            let mut x = x0;
            let mut j = lo;
            while j < l {
                let end = (j + k).min(l);
                ckpts.push((j, end, x));
                let ckpt_name = |i: u64| {
                    if i + 1 == l {
                        if stage.last() {
                            "head.in"
                        } else {
                            "stage.send"
                        }
                        .to_string()
                    } else {
                        format!("ckpt.L{}.in", i + 1)
                    }
                };
                let (_, out) = t.layers(j, end, x, false, false, &ckpt_name)?;
                x = out;
                j = end;
            }
            let which = match k {
                1 => "every layer's input".to_string(),
                _ => format!("the input of every {} layer", ordinal(k)),
            };
            t.b.note(format!(
                "checkpointing: {which} stored ({} of {}), each segment recomputed in backward",
                ckpts.len(),
                l - lo
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

    // A pipeline stage without the head sends its output and keeps it for its backward
    // (torch.distributed.pipelining caches each micro-batch's output); its backward begins
    // with the gradient the next stage sends back.
    // A received input no layer saved goes with the stage's backward.
    let recv_free =
        !stage.first() && seg.is_none() && !frames.iter().any(|f| f.saved.contains(&x0));
    let gin = if !stage.last() {
        if seg.is_none() {
            t.b.free_all(std::mem::take(&mut masks));
        }
        if !train {
            t.states.autocast_exit(t.b, |_| true);
            t.b.free_all(emb_saved);
            t.b.free(head_in);
            if !stage.first() {
                t.b.free(x0);
            }
            t.release_held();
            t.b.free_all(inputs);
            return Ok(());
        }
        let ckpt_layers = seg.is_some();
        t.states
            .autocast_exit(t.b, |name| ckpt_layers && name.starts_with('L'));
        if llm && stage.first() && seg.is_none() && !frames.iter().any(|f| f.saved.contains(&x0)) {
            t.b.free(x0);
        }
        // torch.distributed.pipelining (2.15) releases a sent output and starts the backward
        // from its autograd edge (`_make_forward_chunk_state`).
        t.b.free(head_in);
        t.begin_backward(l - 1)?;
        let r = t.r;
        t.hidden_t("grad.recv", Role::Workspace, r)?
    } else {
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
            // the first layer saved them or they are the first checkpoint). Checkpointed layers
            // were handed the mask as an input: each checkpoint keeps it until its layer's backward
            // is done, so it lives until layer 0's (measured, issue 35).
            if seg.is_none() {
                t.b.free_all(std::mem::take(&mut masks));
            }
            // (A later pipeline stage's received input is the pipeline's until its backward.)
            if llm
                && stage.first()
                && seg.is_none()
                && !frames.iter().any(|f| f.saved.contains(&x0))
            {
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
                let ng = t.sp_gather(n, 1, true, &mut head_saved)?;
                if ng != n {
                    // The gathered copy is what the head saves; the sharded output is held
                    // (`last_hidden_state`) until the head is done.
                    head_tail = Some(n);
                }
                let x = t.matmul_input(ng, 1, true, &mut head_saved)?;
                if ng != n {
                } else if x != n || t.frozen() {
                    head_tail = Some(n);
                } else {
                    head_saved.push(n);
                }
                x
            } else {
                t.matmul_input(n, 1, false, &mut head_saved)?
            }
        };
        let (mut logit_rows, mut logit_shape): (u64, Vec<u64>) = if classes_only {
            (bsz, vec![bsz, v])
        } else {
            (bsz.saturating_mul(s), vec![bsz, s, v])
        };
        // A serving profile: the head reads each request's last hidden state only.
        let sampled = sample::rows(w, logit_rows).filter(|_| !train && llm);
        let mut head_x = head_x;
        if let Some(r) = sampled {
            let dt = t.dtype(head_x);
            let rows_in =
                t.b.push("head.sampled_rows", Role::Activations, dt, &[r, h], h)?;
            // The profile run keeps the hidden states through the sampler.
            for x in head_tail.take().into_iter().chain([head_x, rows_in]) {
                if !head_saved.contains(&x) {
                    head_saved.push(x);
                }
            }
            head_x = rows_in;
            (logit_rows, logit_shape) = (r, vec![r, v]);
        }
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
        if let Some(r) = sampled {
            sample::sampler(t.b, r, v)?;
        }
        // Tensor parallelism with gathered logits: each rank's vocabulary slice is all-gathered
        // to the full logits, which the loss reads; the slice goes.
        let v_local = v;
        let gathered = w.parallel.tp > 1 && w.parallel.tp_head == TpHead::Gathered;
        let (logits, v) = if gathered {
            let full = v.saturating_mul(w.parallel.tp);
            if let Some(l) = logit_shape.last_mut() {
                *l = full;
            }
            // DTensor all-gathers along dim 0 and concatenates the chunks along the
            // vocabulary: the gather's output and the concatenation are alive together
            // (measured: two logit sizes at the forward's end of tp-sp).
            let ag =
                t.b.push("logits.all_gather", Role::Workspace, c, &logit_shape, full)?;
            let g =
                t.b.push("logits.gathered", Role::Activations, c, &logit_shape, full)?;
            t.b.free(ag);
            t.b.free(logits);
            (g, full)
        } else {
            (logits, v)
        };
        let logits = if w.logit_softcap {
            // Gemma 2: logits / cap, tanh (which saves its output), · cap: new [b, s, V] tensors.
            let tanh =
                t.b.push("logits.softcap_tanh", Role::Activations, c, &logit_shape, v)?;
            // The raw logits go once their tanh exists (two [b, s, V] tensors at a time).
            t.b.free(logits);
            let capped =
                t.b.push("logits.capped", Role::Activations, c, &logit_shape, v)?;
            if train {
                head_saved.push(tanh);
            } else {
                t.b.free(tanh);
            }
            capped
        } else {
            logits
        };
        let logits = if w.model.as_ref().is_some_and(|m| m.logit_scale) {
            // Cohere's `logits * logit_scale`, Granite's `logits / logits_scaling`: a new
            // [b, s, V] tensor beside the first (a scalar product saves nothing).
            let scaled =
                t.b.push("logits.scaled", Role::Activations, c, &logit_shape, v)?;
            t.b.free(logits);
            scaled
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
            t.release_held();
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

        // Only the loss leaves the step function: the outputs (logits, a cache's copies) go now;
        // log_softmax saved its output, not the logits.
        if t.w.outputs == Outputs::Dropped {
            t.release_held();
        }
        // Backward: nll_loss and log_softmax backward make two [rows, V] gradients (fp32 when the
        // log-probabilities are; `half_to_float`'s backward gives the logits' type directly).
        t.begin_backward(l - 1)?;
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
        // Gathered logits: the gather's backward keeps this rank's slice of the gradient.
        let g_logits = if gathered {
            if let Some(l) = logit_shape.last_mut() {
                *l = v_local;
            }
            let g = t.b.push(
                "grad.logits_local",
                Role::Workspace,
                c,
                &logit_shape,
                v_local,
            )?;
            t.b.free(g_logits);
            g
        } else {
            g_logits
        };
        // The head's matmul: its weight gradient and the gradient of its input.
        let w_ = t.w;
        if head_piece == "embed" && stage.first() {
            // A tied head: its gradient waits for the embedding's (on a later pipeline stage
            // the head is the stage's own copy: its gradient is whole here).
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
        gin
    };
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
            // The first segment's backward released the last checkpoint holding the mask.
            t.b.free_all(std::mem::take(&mut masks));
        }
    }
    let w_ = t.w;
    let mut sent_grad = None;
    if stage.first() {
        // Embedding backward: the dense gradient of the token embedding (added into the tied
        // head's gradient when it already exists) and of the positions.
        t.states.gradient(t.b, "embed", w_)?;
        if w_.parallel.tp > 1 && w_.parallel.tp_head != TpHead::Replicated {
            t.states.hold_until_end(t.b, "embed", w_)?;
        }
        // The last op (ViT's patch convolution, or the position lookup) releases what it saved
        // and its incoming gradient before its weight's gradient is converted to fp32.
        t.states.gradient_then(t.b, "embed.rest", w_, |b| {
            b.free_all(emb_saved);
            b.free(g);
        })?;
    } else {
        // The input's gradient is sent back: the schedule waits for its sends at the end of
        // the step, which holds it until then (measured: one [b, s, h] per micro-batch on
        // the last stage at its last backward).
        sent_grad = Some(g);
        if recv_free {
            t.b.free(x0);
        }
    }
    if let Some(cs) = t.rope.take() {
        t.b.free(cs);
    }
    if let Some(gb) = t.gather.take() {
        t.b.free(gb);
    }
    if w.parallel.fsdp.is_some() {
        // The root's post-backward: its gradients reduce-scattered, its parameters resharded.
        t.states.fsdp_reduce(t.b, &root_pieces)?;
        t.reshard("root");
        t.states.fsdp_finalize(t.b);
    }
    // A loop that kept the outputs (logits, cache) drops them once backward is done; only the
    // detached loss lives through the optimizer step.
    t.release_held();
    t.b.free_all(inputs);
    if let Some(g) = sent_grad {
        // The schedule's step ends by waiting on its sends, before the optimizer runs.
        t.b.phase(Phase::Optimizer);
        t.b.free(g);
    }
    t.states.optimizer_step(t.b, w_)?;
    Ok(())
}
