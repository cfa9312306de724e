//! A transformer step phase by phase: setup, embedding, the layers (checkpointed or not), a
//! pipeline stage's send or the head and loss (`head`), backward through the layers, then the
//! embedding's gradient, FSDP's root and the optimizer.

use super::Embed;
use super::{fsdp_layer, layer_params, ordinal, segment, spec_of, stage_pieces, widths, Frame, T};
use crate::plan::build::{prod, Builder, PlanError};
use crate::plan::params::{self, residual_dtype, States};
use crate::plan::{DType, Phase, Role, Step, TensorIx};
use crate::workload::parallel::{Stage, TpHead};
use crate::workload::{Attention, Checkpoint, Outputs, Precision, StepKind, Workload};

/// What the forward leaves for the phases after it.
pub(super) struct Fwd {
    pub(super) stage: Stage,
    pub(super) train: bool,
    /// A decoder LLM (its forward keeps `inputs_embeds` and eager attention's mask).
    pub(super) llm: bool,
    /// The base model's forward keeps the embedding's output until it returns (the decoder
    /// LLMs' `inputs_embeds`, `BertModel`'s `embedding_output`).
    pub(super) keeps_x0: bool,
    /// The first layer's input: the embedding's output, or a later stage's received input.
    pub(super) x0: TensorIx,
    /// The embedding's saved tensors: the last backward frame.
    pub(super) emb_saved: Vec<TensorIx>,
    /// Held by the caller until the step ends, not saved (autocast: the conv saves its copy).
    pub(super) inputs: Vec<TensorIx>,
    /// Eager attention's materialized causal masks.
    pub(super) masks: Vec<TensorIx>,
    /// Checkpoint segment length, training only.
    pub(super) seg: Option<u64>,
    /// Without checkpointing: every block's saved tensors, in forward order.
    pub(super) frames: Vec<Frame>,
    /// With checkpointing: each segment's layers and stored input.
    pub(super) ckpts: Vec<(u64, u64, TensorIx)>,
    /// A received input that no layer saved goes with the stage's backward.
    pub(super) recv_free: bool,
}

impl Fwd {
    /// The first layer's input goes when the model's forward returns (the decoder LLMs keep
    /// `inputs_embeds` until then), unless a layer saved it or it is the first checkpoint.
    pub(super) fn embeds_go(&self) -> bool {
        self.keeps_x0
            && self.stage.first()
            && self.seg.is_none()
            && !self.frames.iter().any(|f| f.saved.contains(&self.x0))
    }
}

/// Build a transformer step's timeline at the workload's batch and sequence.
pub fn build(b: &mut Builder, w: &Workload) -> Result<(), PlanError> {
    let (act_w, state_w, mp) = mixed_precision(w);
    let w = act_w.as_ref().unwrap_or(w);
    let stage = crate::workload::parallel::stage(w, w.parallel.rank.unwrap_or(0));
    let mut t = T::new(b, w, state_w.as_ref().unwrap_or(w), mp, &stage)?;
    t.b.phase(Phase::Forward);
    t.notes();
    let root_pieces = t.gather_root(&stage)?;
    let mut fwd = t.embed(stage)?;
    let head_in = t.forward(&mut fwd)?;
    let gin = if stage.last() {
        t.head_and_loss(&mut fwd, head_in)?
    } else {
        t.send(&mut fwd, head_in)?
    };
    // Inference ends with the forward.
    let Some(gin) = gin else {
        return Ok(());
    };
    let g = t.backward_layers(&mut fwd, gin)?;
    t.finish(fwd, g, &root_pieces)
}

/// FSDP under `amp-*` is FSDP2's MixedPrecisionPolicy(param_dtype=the 16-bit type,
/// reduce_dtype=fp32), as torchtitan trains (no autocast): the gathered parameters, and so
/// every activation, are 16-bit as under `model.bfloat16()`, while the sharded parameters,
/// gradients and optimizer state stay fp32. The workloads the activations and the states are
/// planned with, and the gathered type.
fn mixed_precision(w: &Workload) -> (Option<Workload>, Option<Workload>, Option<DType>) {
    let mp = (w.parallel.fsdp.is_some() && w.precision.is_autocast())
        .then(|| params::compute_dtype(w.precision));
    let with = |p: Precision| {
        let mut c = w.clone();
        c.precision = p;
        c
    };
    let act = mp.map(|low| {
        with(if low == DType::F16 {
            Precision::Fp16
        } else {
            Precision::Bf16
        })
    });
    let state = mp.map(|_| with(Precision::Fp32));
    (act, state, mp)
}

impl<'a> T<'a> {
    /// The builder of `w`'s step on `stage`, its states set up from `state_w`.
    fn new(
        b: &'a mut Builder,
        w: &'a Workload,
        state_w: &Workload,
        mp: Option<DType>,
        stage: &Stage,
    ) -> Result<Self, PlanError> {
        let spec = spec_of(w)?;
        if w.checkpoint == Checkpoint::Ops && !w.inference() {
            super::sac::allowed(w, &spec)?;
        }
        let (qw, kvw, d) = widths(w)?;
        let train = !w.inference();
        // A quantized base in training runs in fp32 around its 4-bit matmuls: PEFT's
        // `prepare_model_for_kbit_training` upcasts the embeddings, norms and head.
        let c = residual_dtype(w);
        let mut states = States::setup(b, state_w, &stage_pieces(w, stage)?)?;
        states.gather_dtype = mp;
        let ac = params::autocast(w);
        Ok(T {
            b,
            w,
            spec,
            states,
            bsz: w.batch,
            s: w.seq,
            h: w.hidden,
            a: w.heads,
            f: w.ffn,
            g: w.kv_heads(),
            moe: w.moe,
            layer: None,
            d,
            qw,
            kvw,
            widths: (d, qw, kvw),
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
            fwd_return: None,
            // Checkpointing calls `enable_input_require_grads` (transformers 5.24
            // `modeling_utils.py:3190-3198`); PEFT without it does not.
            live: w.lora.is_none() || !train || segment(w.checkpoint, w.layers).is_some(),
            live_in: true,
        })
    }

    /// What the plan counts but does not plan layer by layer.
    fn notes(&mut self) {
        let model = self.w.model.as_ref();
        if let Some(mixer) = model.and_then(|m| m.recurrent_mixer()) {
            self.b.note(format!(
                "its {} layers are planned with what {} save on CUDA (modelled, not measured); transformers' torch fallback (the CPU, or without those packages) saves more",
                mixer.name(),
                mixer.kernels().unwrap_or("their kernels")
            ));
        }
        if model
            .and_then(|m| m.first_mla())
            .is_some_and(|m| m.indexer.is_some())
        {
            self.b.note(
                "DeepSeek sparse attention: its lightning indexer's weights are counted, its activations are not planned, and attention is planned dense over the whole sequence (modelled, not measured)",
            );
        }
        if let Some(v) = model.and_then(|m| m.vision.as_ref()) {
            self.b.note(format!(
                "vision tower ({}): its {} weights are counted; its activations are not planned (the step is the text model's)",
                v.kind,
                crate::units::fmt_count(v.params)
            ));
        }
    }

    /// FSDP2's root unit (embedding, final norm, head), gathered at the root's pre-forward and
    /// kept through the backward (the root does not reshard after forward); ZeRO-3's gather
    /// buffer. The root's parameter groups.
    fn gather_root(&mut self, stage: &Stage) -> Result<Vec<String>, PlanError> {
        let w = self.w;
        let (root_pieces, root_elems): (Vec<String>, u64) = stage_pieces(w, stage)?
            .into_iter()
            .filter(|p| fsdp_layer(&p.name).is_none())
            .fold((Vec::new(), 0), |(mut names, n), p| {
                names.push(p.name);
                (names, n + p.elems)
            });
        self.unshard("root", root_elems)?;
        if w.zero == 3 && w.gpus > 1 {
            // One layer's gathered weights (or the embedding/head matrix if larger), prefetched
            // for the whole forward and backward.
            let e = "the ZeRO-3 gather buffer";
            let h = self.h;
            let mut gather = layer_params(w)?.max(prod(&[w.vocab, h], e)?);
            if self.spec.embed == Embed::Patches {
                gather = gather.max(prod(&[3, w.patch, w.patch, h], e)?);
            }
            let c = self.c;
            self.gather = Some(self.b.push(
                "ws.zero3_gather",
                Role::Workspace,
                c,
                &[gather],
                h.min(gather),
            )?);
        }
        Ok(root_pieces)
    }

    /// The embedding: the first layer's input and what its backward keeps.
    fn embed(&mut self, stage: Stage) -> Result<Fwd, PlanError> {
        let w = self.w;
        let train = self.train;
        let mut emb_saved = Vec::new();
        let mut inputs = Vec::new();
        let x0 = match self.spec.embed {
            // A later pipeline stage's input: the previous stage's output, received.
            _ if !stage.first() => self.resid("stage.recv")?,
            Embed::Patches => {
                let (img, c) = (w.image, self.c);
                self.use_piece("embed.rest")?;
                let shape = [self.bsz, 3, img, img];
                let image = if self.ac.is_some() {
                    // The pixels stay fp32 (an input); the patch conv saves its 16-bit copy.
                    let px =
                        self.b
                            .push("input.image", Role::Workspace, DType::F32, &shape, img)?;
                    inputs.push(px);
                    self.b
                        .push("image.cast", Role::Activations, c, &shape, img)?
                } else {
                    self.b.push("image", Role::Activations, c, &shape, img)?
                };
                // The conv's 16-bit output joins the fp32 class token and positions: fp32.
                let x0 = self.resid("L0.in")?;
                let wt = self.weights("embed.rest");
                self.b.step(Step::Conv2d {
                    x: image,
                    w: wt,
                    y: x0,
                    n: self.bsz,
                    c_in: 3,
                    h: img,
                    w_in: img,
                    c_out: self.h,
                    kernel: w.patch,
                    stride: w.patch,
                    pad: 0,
                });
                if train || self.ac.is_none() {
                    emb_saved.push(image);
                } else {
                    // Under no_grad nothing keeps the pixels' 16-bit copy past the conv.
                    self.b.free(image);
                }
                x0
            }
            Embed::TokensNorm => {
                let ln_in = self.resid("emb.ln_in")?;
                let y = self.norm("L0.in", ln_in, &mut emb_saved)?;
                if !train {
                    // Under no_grad the embeddings' sum goes once normed.
                    emb_saved.retain(|&x| x != ln_in);
                    self.b.free(ln_in);
                }
                y
            }
            // Embedding lookups are not autocast ops: the fp32 tables give fp32 rows. Gemma
            // multiplies them by √hidden into a new tensor.
            Embed::Tokens if self.spec.embed_scale => {
                let raw = self.resid("emb.raw")?;
                let x0 = self.resid("L0.in")?;
                self.b.free(raw);
                x0
            }
            Embed::Tokens => self.resid("L0.in")?,
        };
        Ok(Fwd {
            stage,
            train,
            llm: w.is_decoder_llm(),
            keeps_x0: w.is_decoder_llm() || self.spec.holds_returns,
            x0,
            emb_saved,
            inputs,
            masks: Vec::new(),
            seg: if train {
                segment(w.checkpoint, stage.hi - stage.lo)
            } else {
                None
            },
            frames: Vec::new(),
            ckpts: Vec::new(),
            recv_free: false,
        })
    }

    /// What every layer reads: RoPE's tables, eager attention's masks; the embedding's dropout.
    fn shared_inputs(&mut self, fwd: &mut Fwd) -> Result<(), PlanError> {
        // RoPE cos and sin [1, s, d], in the embeddings' type: made once, read (and saved) by
        // every layer's rotation.
        if self.spec.rope {
            // MLA rotates only each head's rope part (`qk_rope_head_dim` wide).
            let mla = self.w.model.as_ref().and_then(|m| m.first_mla());
            let d = mla.map_or(self.d, |m| m.qk_rope_head_dim);
            let (r, s) = (self.r, self.s);
            self.rope =
                Some(
                    self.b
                        .push("rope.cos_sin", Role::Activations, r, &[2, 1, s, d], d)?,
                );
        }
        // The decoder LLMs' forward keeps `inputs_embeds` (the first layer's input) until it
        // returns, and eager attention reads a materialized [b, 1, s, s] causal mask in the
        // embeddings' type (Gemma 2/3 one more for their sliding-window layers), alive as long.
        // Checkpointed layers keep the mask for their backward: a saved activation then.
        let mask_role = if fwd.seg.is_some() {
            Role::Activations
        } else {
            Role::Workspace
        };
        if fwd.llm && self.w.attention == Attention::Naive {
            let n = if self.spec.sandwich_norms { 2 } else { 1 };
            let (r, bsz, s) = (self.r, self.bsz, self.s);
            for i in 0..n {
                let name = format!("attn.causal_mask{i}");
                fwd.masks
                    .push(self.b.push(&name, mask_role, r, &[bsz, 1, s, s], s)?);
            }
        }
        if fwd.stage.first() {
            self.mask("emb.drop_mask", &mut fwd.emb_saved)?;
        }
        Ok(())
    }

    /// The stage's layers (all of them without a pipeline), checkpointed or not: the last
    /// one's output.
    fn forward(&mut self, fwd: &mut Fwd) -> Result<TensorIx, PlanError> {
        self.shared_inputs(fwd)?;
        let (lo, l, last) = (fwd.stage.lo, fwd.stage.hi, fwd.stage.last());
        let out_name = |i: u64, inner: &str| {
            if i + 1 == l {
                if last { "head.in" } else { "stage.send" }.to_string()
            } else {
                format!("{inner}L{}.in", i + 1)
            }
        };
        let head_in = match fwd.seg {
            None => {
                let (fr, out) = self.layers(lo, l, fwd.x0, fwd.train, !fwd.keeps_x0, &|i| {
                    out_name(i, "")
                })?;
                fwd.frames = fr;
                out
            }
            Some(k) => {
                let mut x = fwd.x0;
                let mut j = lo;
                while j < l {
                    let end = (j + k).min(l);
                    fwd.ckpts.push((j, end, x));
                    (_, x) = self.layers(j, end, x, false, false, &|i| out_name(i, "ckpt."))?;
                    j = end;
                }
                let which = match k {
                    1 => "every layer's input".to_string(),
                    _ => format!("the input of every {} layer", ordinal(k)),
                };
                self.b.note(format!(
                    "checkpointing: {which} stored ({} of {}), each segment recomputed in backward",
                    fwd.ckpts.len(),
                    l - lo
                ));
                x
            }
        };
        if !fwd.train {
            // Under no_grad the tables go with the last layer.
            if let Some(cs) = self.rope.take() {
                self.b.free(cs);
            }
        }
        self.saving = fwd.train;
        fwd.recv_free = !fwd.stage.first()
            && fwd.seg.is_none()
            && !fwd.frames.iter().any(|f| f.saved.contains(&fwd.x0));
        Ok(head_in)
    }

    /// Inference is over: what the forward still holds goes (`before` and `after` the
    /// embedding's tensors).
    pub(super) fn end_inference(
        &mut self,
        fwd: &mut Fwd,
        before: Vec<TensorIx>,
        after: &[TensorIx],
    ) {
        // autocast exits with the forward: the weight-cast cache is cleared.
        self.states.autocast_exit(self.b, |_| true);
        self.b.free_all(before);
        self.b.free_all(std::mem::take(&mut fwd.emb_saved));
        self.b.free_all(after.iter().copied());
        self.release_held();
        self.b.free_all(std::mem::take(&mut fwd.inputs));
    }

    /// A pipeline stage without the head sends its output and keeps it for its backward
    /// (torch.distributed.pipelining caches each micro-batch's output); its backward begins
    /// with the gradient the next stage sends back. None: inference, done.
    fn send(&mut self, fwd: &mut Fwd, head_in: TensorIx) -> Result<Option<TensorIx>, PlanError> {
        if fwd.seg.is_none() {
            self.b.free_all(std::mem::take(&mut fwd.masks));
        }
        if !fwd.train {
            let recv = (!fwd.stage.first()).then_some(fwd.x0);
            let after: Vec<TensorIx> = [head_in].into_iter().chain(recv).collect();
            self.end_inference(fwd, Vec::new(), &after);
            return Ok(None);
        }
        let ckpt_layers = fwd.seg.is_some();
        self.states
            .autocast_exit(self.b, |name| ckpt_layers && name.starts_with('L'));
        if fwd.embeds_go() {
            self.b.free(fwd.x0);
        }
        // torch.distributed.pipelining (2.15) releases a sent output and starts the backward
        // from its autograd edge (`_make_forward_chunk_state`).
        self.b.free(head_in);
        self.begin_backward(fwd.stage.hi - 1)?;
        let r = self.r;
        Ok(Some(self.hidden_t("grad.recv", Role::Workspace, r)?))
    }

    /// Backward through the stage's layers from the gradient of their output: the gradient of
    /// their input.
    fn backward_layers(&mut self, fwd: &mut Fwd, gin: TensorIx) -> Result<TensorIx, PlanError> {
        let mut g = gin;
        if fwd.seg.is_none() {
            while let Some(fr) = fwd.frames.pop() {
                g = self.backward(fr, g)?;
            }
            return Ok(g);
        }
        while let Some((from, to, x)) = fwd.ckpts.pop() {
            // Recompute the segment from its checkpoint, then backward through it. What the
            // recomputation's own graph held outside saved tensors goes with it: torch keeps
            // only detached copies of what it saved (`_recomputation_hook`).
            let mark = self.b.pins();
            let (mut fr, out) = self.layers(from, to, x, true, false, &|i| {
                format!("recompute.L{}.out", i + 1)
            })?;
            self.b.free(out);
            self.b.unpin_from(mark);
            // A checkpoint no recomputed norm saved (16-bit RMSNorm saves its fp32 copy)
            // goes with its segment.
            let kept = fr.iter().any(|f| f.saved.contains(&x));
            while let Some(f) = fr.pop() {
                g = self.backward(f, g)?;
            }
            if self.w.checkpoint == Checkpoint::Ops {
                for i in from..to {
                    self.b.stash_free(&format!("L{i}."));
                }
            }
            if !kept {
                self.b.free(x);
            }
        }
        // The first segment's backward released the last checkpoint holding the mask.
        self.b.free_all(std::mem::take(&mut fwd.masks));
        Ok(g)
    }

    /// The embedding's gradient (or the gradient sent back to the previous stage), FSDP's
    /// root, the outputs, and the optimizer step.
    fn finish(mut self, fwd: Fwd, g: TensorIx, root_pieces: &[String]) -> Result<(), PlanError> {
        let w = self.w;
        let mut sent_grad = None;
        if fwd.stage.first() {
            // Embedding backward: the dense gradient of the token embedding (added into the tied
            // head's gradient when it already exists) and of the positions.
            self.states.gradient(self.b, "embed", w)?;
            if w.parallel.tp > 1 && w.parallel.tp_head != TpHead::Replicated {
                self.states.hold_until_end(self.b, "embed", w)?;
            }
            // The last op (ViT's patch convolution, or the position lookup) releases what it
            // saved and its incoming gradient before its weight's gradient is converted to fp32.
            let emb_saved = fwd.emb_saved;
            self.states.gradient_then(self.b, "embed.rest", w, |b| {
                b.free_all(emb_saved);
                b.free(g);
            })?;
        } else {
            // The input's gradient is sent back: the schedule waits for its sends at the end of
            // the step, which holds it until then (measured: one [b, s, h] per micro-batch on
            // the last stage at its last backward).
            sent_grad = Some(g);
            if fwd.recv_free {
                self.b.free(fwd.x0);
            }
        }
        if let Some(cs) = self.rope.take() {
            self.b.free(cs);
        }
        if let Some(gb) = self.gather.take() {
            self.b.free(gb);
        }
        if w.parallel.fsdp.is_some() {
            // The root's post-backward: its gradients reduce-scattered, its parameters resharded.
            self.states.fsdp_reduce(self.b, root_pieces)?;
            self.reshard("root");
            self.states.fsdp_finalize(self.b);
        }
        // A loop that kept the outputs (logits, cache) drops them once backward is done; only
        // the detached loss lives through the optimizer step. The graph goes with them, and
        // what it held outside saved tensors (`hold_input`) with it.
        let next = w.outputs == Outputs::Next;
        if !next {
            self.release_held();
            self.b.unpin_from(0);
        }
        self.b.free_all(fwd.inputs);
        if let Some(g) = sent_grad {
            // The schedule's step ends by waiting on its sends, before the optimizer runs.
            self.b.phase(Phase::Optimizer);
            self.b.free(g);
        }
        self.states.optimizer_step(self.b, w)?;
        if next {
            // The loop holds them into the next step, until its forward returns: a steady step
            // began with the previous step's.
            let mut carried = self.held.clone();
            carried.extend(self.b.pinned());
            self.release_held();
            self.b.unpin_from(0);
            if let (StepKind::Steady, Some(at)) = (w.step, self.fwd_return) {
                self.b.carry_in(&carried, at);
            }
        }
        Ok(())
    }
}
