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
mod block;
mod count;
mod decoder;
mod float8;
mod gemma;
mod gpt2;
mod gpt_attention;
mod head;
mod llama;
mod lora;
mod mla;
mod mlp;
mod moe;
mod phi3;
mod qwen;
mod recurrent;
mod sac;
mod sample;
pub mod spec;
mod step;
mod vit;

use super::autocast::{self, Autocast};
use super::build::{Builder, PlanError};
use super::params::{param_dtype, States};
use super::{DType, Phase, Role, Step, TensorIx};
use crate::workload::layers::LayerSpec;
use crate::workload::{Checkpoint, DropoutMask, Workload};
use spec::{Embed, Head, Mlp, Norm, Spec};

pub use attention::{attention_summary, sdpa_backend, SdpaBackend};
use count::{cast_elems, widths};
pub use count::{layer_params, param_count, pieces, trainable_count};
pub use step::build;

/// The spec of a transformer workload, by its family (an error for ResNet and a bare parameter
/// count).
fn spec_of(w: &Workload) -> Result<Spec, PlanError> {
    use crate::workload::Arch;
    let mut s = match w.arch {
        Arch::Gpt2 => gpt2::spec(w),
        Arch::Bert => bert::spec(w),
        Arch::Vit => vit::spec(w),
        Arch::Llama | Arch::Mistral => llama::spec(w),
        Arch::Qwen2 | Arch::Qwen3 => qwen::spec(w),
        Arch::Gemma | Arch::Gemma2 | Arch::Gemma3 => gemma::spec(w),
        Arch::Phi3 => phi3::spec(w),
        Arch::Mixtral | Arch::Qwen2Moe | Arch::Qwen3Moe => moe::spec(w),
        Arch::Decoder => decoder::spec(w),
        Arch::Resnet | Arch::Dense => return Err(PlanError::Invalid("not a transformer".into())),
    };
    if !w.framework.is_transformers() {
        // LitGPT's LoRA adapts q, k and v apart (one module, one weight gradient each), so they
        // are planned as three projections; what its one fused output keeps alive is the
        // attention's to say (`attention_llm`).
        s.fused_qkv = false;
    }
    Ok(s)
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
    /// (d, qw, kvw) of the model's reference attention: an MLA layer sets its own
    /// (`enter_layer`), any other layer gets these back.
    widths: (u64, u64, u64),
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
    /// The point (`Builder::mark`) where the model's forward returned to the loop.
    fwd_return: Option<usize>,
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
        // Under `amp-*`, FSDP2's MixedPrecisionPolicy(param_dtype=the 16-bit type,
        // reduce_dtype=fp32), as torchtitan sets it: the gathered parameters are 16-bit and
        // autocast has nothing to cast.
        let dt = self.ac.map_or(param_dtype(self.w.precision), |a| a.low);
        self.unshard_as(unit, elems, dt)
    }
    /// `unshard` with the gathered unit `elems` elements of `dt`.
    fn unshard_as(&mut self, unit: &str, elems: u64, dt: DType) -> Result<(), PlanError> {
        if self.w.parallel.fsdp.is_none() || self.units.contains_key(unit) || elems == 0 {
            return Ok(());
        }
        // The flat all-gather output, copied out into the unsharded parameters. In forward
        // FSDP2 keeps it until the next unit's all-gather has been waited on (to overlap the
        // copy-out with it), the last one until the root's forward returns
        // (`_fsdp_param_group.py` `wait_for_unshard`, `_fsdp_state.py` `_post_forward`); in
        // backward it goes after the copy-out.
        // FSDP1 gathers into the unit's padded flat parameter, which the parameters view:
        // one allocation on the unshard stream, no copy-out (`_flat_param.py`
        // `_alloc_padded_unsharded_flat_param`, `_all_gather_flat_param`).
        let mut flat_of =
            |name: String, role| self.b.push(&name, role, dt, &[elems], elems.clamp(1, 4096));
        let flat = if self.w.parallel.fsdp1 {
            None
        } else {
            Some(flat_of(format!("fsdp.all_gather.{unit}"), Role::Workspace)?)
        };
        let t = flat_of(format!("fsdp.unsharded.{unit}"), Role::Params)?;
        if let Some(f) = flat {
            self.b.on_stream(f, crate::plan::Stream::AllGather);
        }
        if flat.is_none() {
            self.b.on_stream(t, crate::plan::Stream::AllGather);
        }
        self.units.insert(unit.to_string(), t);
        match flat {
            None => {}
            Some(flat) if self.b.current_phase() == Phase::Backward => self.b.free(flat),
            Some(flat) => {
                if let Some(prev) = self.all_gather_kept.replace(flat) {
                    self.b.free(prev);
                }
            }
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
        if self.w.float8 == crate::workload::Float8::TensorwiseAllGather {
            // One byte-sized tensor of the float8 weights and 16-bit norms.
            let bytes = float8::gathered_layer_bytes(self.w, e)?;
            return self.unshard_as(&format!("L{i}"), bytes, DType::U8);
        }
        self.unshard(&format!("L{i}"), e)
    }
    /// The backward begins: FSDP2's root pre-backward prefetches the last layer's all-gather.
    fn begin_backward(&mut self, last_layer: u64) -> Result<(), PlanError> {
        // The root's forward has returned: FSDP2 lets go of the last all-gather output.
        if let Some(flat) = self.all_gather_kept.take() {
            self.b.free(flat);
        }
        self.states.begin_backward(self.b);
        // The root's pre-backward prefetches the last layer, except under FSDP1's
        // BACKWARD_POST or none, where the layer is gathered at its own pre-backward.
        if self.post_prefetch() {
            return Ok(());
        }
        self.unshard_layer(last_layer)
    }

    /// FSDP1 without BACKWARD_PRE: a unit is gathered in the backward only at its own
    /// pre-backward (BACKWARD_POST prefetches it after the unit before has resharded, the same
    /// moment for memory).
    fn post_prefetch(&self) -> bool {
        self.w.parallel.fsdp1 && self.w.parallel.no_pre_prefetch
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
        Checkpoint::Full | Checkpoint::Ops => Some(1),
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
