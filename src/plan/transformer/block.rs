//! One layer of a transformer step: its forward (the attention block, then the MLP block, each
//! a backward frame of what it saved) and its backward, block by block.

use super::{decoder, fsdp_layer, lora, Block, Frame, Mlp, T};
use crate::plan::build::PlanError;
use crate::plan::{Phase, Role, TensorIx};
use crate::workload::layers::{BlockForm, Mixer, MlpSpec};
use crate::workload::{Checkpoint, Target};

impl T<'_> {
    /// One layer's forward reading `x`: its frames (the mixer's and the MLP's; a hybrid's
    /// layer has one of the two, Nemotron-H's `M`/`*` a mixer, its `-`/`E` an MLP) and its
    /// output (a new tensor). `owned`: nothing outside the layer keeps `x` (it goes after the
    /// residual add unless saved). Not `saving` (no_grad), each intermediate goes once its last
    /// reader ran.
    fn layer(
        &mut self,
        i: u64,
        p: &str,
        x: TensorIx,
        out_name: &str,
        saving: bool,
        owned: bool,
    ) -> Result<(Vec<Frame>, TensorIx), PlanError> {
        self.saving = saving;
        self.live_in = self.live;
        // torchtitan's selective checkpointing keeps some of a checkpointed layer's outputs.
        let stash = !saving && self.train && self.w.checkpoint == Checkpoint::Ops;
        if stash {
            self.b.stash_begin(super::sac::kept(i));
        }
        self.enter_layer(i);
        self.unshard_layer(i)?;
        let (has_mixer, has_mlp) = self.layer.map_or((true, true), |l| {
            (l.mixer != Mixer::None, l.mlp != MlpSpec::None)
        });
        let (pa, pm) = (format!("L{i}.attn"), format!("L{i}.mlp"));
        let mut frames = Vec::with_capacity(2);
        let mut sa = Vec::new();
        let (n1, x2) = if has_mixer {
            self.attn_block(p, &pa, x, &mut sa)?
        } else {
            (x, x)
        };
        // The residual add was the input's last reader, but the model's loop variable keeps it
        // until the layer returns: an owned input goes then, unless a norm saved it (not
        // saving, nothing is kept).
        if !saving {
            let done: Vec<TensorIx> = sa.drain(..).filter(|&t| t != x).collect();
            self.b.free_all(done);
        }
        // A norm each over the layer's input (GPT-NeoX): the MLP's norm reads it too.
        let norms_each = self.parallel_norms();
        if has_mixer && owned && !sa.contains(&x) && !norms_each {
            self.input_done(x);
        }
        let mut sm = Vec::new();
        let mut x2_gone = false;
        let out = if has_mlp {
            let n2_in = if norms_each { x } else { x2 };
            let (out, gone) = self.mlp_block(p, &pm, n2_in, n1, out_name, &mut sm)?;
            x2_gone = gone;
            out
        } else {
            x2
        };
        if norms_each {
            // Both norms saved the input: the attention block's frame holds it, and it goes
            // when that frame's backward ran.
            if saving && sa.contains(&x) {
                sm.retain(|&t| t != x);
            } else if owned && (!saving || !sm.contains(&x)) {
                self.input_done(x);
            }
        }
        if !has_mixer {
            // An MLP-only layer: its input is the loop variable (not saving, a norm's hold on
            // it ends with the layer).
            if owned && (!saving || !sm.contains(&x)) {
                self.input_done(x);
            }
        } else if has_mlp && !sm.contains(&x2) && !x2_gone {
            self.b.free(x2);
        }
        if self.shared_norm()
            && (!saving || (self.frozen() && !sa.contains(&n1) && !sm.contains(&n1)))
        {
            self.b.free(n1);
        }
        if !saving {
            // What the MLP saved goes, but the layer's input is the caller's.
            let done: Vec<TensorIx> = sm.drain(..).filter(|&t| t != x).collect();
            self.b.free_all(done);
        }
        let tail = std::mem::take(&mut self.layer_tail);
        self.b.free_all(tail);
        if stash {
            self.b.stash_end();
        }
        // FSDP2 reshards after the forward (not after a recomputation in backward).
        if self.b.current_phase() != Phase::Backward && !self.w.parallel.keeps_unsharded() {
            self.reshard(&format!("L{i}"));
        }
        if has_mixer {
            frames.push(Frame {
                block: Block::Attn,
                piece: pa,
                saved: sa,
            });
        }
        if has_mlp {
            frames.push(Frame {
                block: Block::Mlp,
                piece: pm,
                saved: sm,
            });
        }
        Ok((frames, out))
    }

    /// A layer's owned input after its last reader: the decoder LLMs' and BERT's loop variable
    /// keeps it until the layer returns; elsewhere it goes now.
    fn input_done(&mut self, x: TensorIx) {
        if self.w.is_decoder_llm() || self.spec.holds_returns {
            self.layer_tail.push(x);
        } else {
            self.b.free(x);
        }
    }

    /// The attention block over `x`, saving into `sa`: its norm's output (which a parallel
    /// block's MLP reads too) and the residual after it.
    fn attn_block(
        &mut self,
        p: &str,
        pa: &str,
        x: TensorIx,
        sa: &mut Vec<TensorIx>,
    ) -> Result<(TensorIx, TensorIx), PlanError> {
        let saving = self.saving;
        self.use_piece(pa)?;
        let n1 = self.norm(&format!("{p}.ln1"), x, sa)?;
        let readers = if let Some(Mixer::Mamba2(_)) = self.recurrent() {
            1
        } else if self.mla().is_some() || self.recurrent().is_some() {
            // q_a_proj (or q_proj) and kv_a_proj_with_mqa; in_proj_qkvz and in_proj_ba.
            2
        } else if self.spec.fused_qkv {
            1
        } else {
            3
        };
        let n1 = self.sp_gather(n1, readers, false, sa)?;
        // A parallel block (Cohere: `x + attn(ln(x)) + mlp(ln(x))`): the MLP reads the same
        // normalised input, which stays until both branches ran.
        let parallel = self.shared_norm();
        let n1 = self.matmul_input(n1, readers, parallel, sa)?;
        // Over a frozen base before any adapter, an attention block without q, k or v
        // adapters needs no gradient: it saves nothing.
        let dead = saving && !self.live && !self.adapts(&[Target::Q, Target::K, Target::V]);
        if dead {
            self.saving = false;
        }
        let ctx = if let Some(m) = self.mla() {
            self.attention_mla(p, pa, n1, m, sa)?
        } else if let Some(r) = self.recurrent() {
            match r {
                Mixer::GatedDeltaNet(m) => self.gated_delta_net(p, pa, n1, m, sa)?,
                Mixer::Mamba2(m) => self.mamba2(p, pa, n1, m, sa)?,
                _ => unreachable!("recurrent() is one of the two"),
            }
        } else if self.w.is_decoder_llm() {
            self.attention_llm(p, pa, n1, sa)?
        } else {
            self.attention_gpt(p, pa, n1, sa)?
        };
        if self.frozen() && !sa.contains(&n1) && !parallel {
            // Nothing saved the projections' input (adapters copied theirs).
            self.b.free(n1);
        }
        let ctx = self.matmul_input(ctx, 1, false, sa)?;
        self.mask(&format!("{p}.proj.drop_mask"), sa)?;
        let x2 = self.attn_output(p, pa, ctx, n1, sa)?;
        if let Some(Mixer::Mamba2(_)) = self.recurrent() {
            // The fused out_proj saves nothing of its input (recomputed in backward).
            if let Some(i) = sa.iter().position(|&t| t == ctx) {
                sa.remove(i);
                self.b.free(ctx);
            }
        }
        if dead {
            self.saving = saving;
        }
        Ok((n1, x2))
    }

    /// The output projection of the context `ctx`, plus the residual: the residual stream's
    /// type. Gemma 2/3 normalize the projection's output first (its norm saves it); a
    /// parallel block's attention output waits for the MLP's.
    fn attn_output(
        &mut self,
        p: &str,
        pa: &str,
        ctx: TensorIx,
        n1: TensorIx,
        sa: &mut Vec<TensorIx>,
    ) -> Result<TensorIx, PlanError> {
        let (h, qw, c) = (self.h, self.qw, self.c);
        let ln2_in = format!("{p}.ln2.in");
        if self.parallel_block() {
            // The attention branch's output waits for the MLP's; nothing saves it.
            let o = self.output_projection(p, pa, ctx, sa)?;
            self.projection_read(ctx, sa);
            // The MLP reads the shared norm's output: a trained one saves it with the
            // attention's frame (a frozen base's linears save no input).
            if self.shared_norm() && self.saving && !self.frozen() && !sa.contains(&n1) {
                sa.push(n1);
            }
            Ok(o)
        } else if self.spec.sandwich_norms {
            let o = self.output_projection(p, pa, ctx, sa)?;
            self.projection_read(ctx, sa);
            let y = self.norm(&format!("{p}.post_attn_norm"), o, sa)?;
            let x2 = self.resid(&ln2_in)?;
            self.b.free(y);
            if !sa.contains(&o) {
                self.b.free(o);
            }
            Ok(x2)
        } else if self.frozen() {
            // The output projection as the base stores it, its adapter, then the residual add.
            let proj = lora::Proj::named(format!("{p}.o_proj"), &[Target::O], h);
            let o = self.projections(pa, ctx, qw, &[proj], sa)?[0];
            if !sa.contains(&ctx) {
                self.b.free(ctx);
            }
            let x2 = self.resid(&ln2_in)?;
            self.b.free(o);
            Ok(x2)
        } else if self.sp {
            // Sequence parallelism: the row-parallel projection's partial sums, full length,
            // reduce-scattered over the sequence into the residual.
            let o = self.hidden_t(&format!("{p}.attn.partial"), Role::Workspace, c)?;
            self.matmul(pa, ctx, o, h, qw);
            self.consumed(ctx, sa);
            let x2 = self.resid(&ln2_in)?;
            self.b.free(o);
            Ok(x2)
        } else {
            let x2 = self.resid(&ln2_in)?;
            self.matmul(pa, ctx, x2, h, qw);
            self.consumed(ctx, sa);
            Ok(x2)
        }
    }

    /// The attention's output projection of `ctx` into a tensor of its own (a parallel or a
    /// sandwich block): as the base stores it, with its adapter when `o` is adapted (LoRA's
    /// dropout copy, its mask and `lora_A`'s output saved; measured under LitGPT's phi,
    /// `validation/litgpt_phi_all.py`).
    fn output_projection(
        &mut self,
        p: &str,
        pa: &str,
        ctx: TensorIx,
        sa: &mut Vec<TensorIx>,
    ) -> Result<TensorIx, PlanError> {
        let (h, qw, c) = (self.h, self.qw, self.c);
        if self.frozen() && self.adapts(&[Target::O]) {
            let proj = lora::Proj::new(
                format!("{p}.attn.out"),
                format!("{p}.o_proj"),
                &[Target::O],
                h,
            );
            return Ok(self.projections(pa, ctx, qw, &[proj], sa)?[0]);
        }
        let o = self.hidden_t(&format!("{p}.attn.out"), Role::Activations, c)?;
        self.base_linear(pa, ctx, o, h, qw)?;
        Ok(o)
    }

    /// The output projection has read the context `ctx`: a frozen projection saves no input, so
    /// unless something else saved it, it goes now (measured under LitGPT's parallel blocks,
    /// `validation/litgpt_notes.md`); a trained one saved it.
    fn projection_read(&mut self, ctx: TensorIx, sa: &mut Vec<TensorIx>) {
        if self.saving && self.frozen() {
            if !sa.contains(&ctx) {
                self.b.free(ctx);
            }
        } else {
            self.consumed(ctx, sa);
        }
    }

    /// The MLP block over `x2` (the residual after attention; a parallel block with one norm:
    /// the attention's normed input `n1`; with a norm each: the layer's input), saving into
    /// `sm`: the layer's output, and whether `x2` is gone already.
    fn mlp_block(
        &mut self,
        p: &str,
        pm: &str,
        x2: TensorIx,
        n1: TensorIx,
        out_name: &str,
        sm: &mut Vec<TensorIx>,
    ) -> Result<(TensorIx, bool), PlanError> {
        let (h, f, saving) = (self.h, self.f, self.saving);
        self.use_piece(pm)?;
        let mut x2_gone = false;
        // Whether the MLP's input needs a gradient: a parallel block's MLP reads the layer's
        // input (normed), not the attention's output, so past an attention adapter it is as
        // the layer began (over a frozen embedding, layer 0's builds no graph at all).
        let live = if self.parallel_block() {
            self.live_in
        } else {
            self.live
        };
        let n2 = if self.shared_norm() {
            n1
        } else {
            // A frozen norm over an input that needs no gradient saves nothing (`norm_over`).
            let was = self.live;
            self.live = live;
            let n2 = self.norm(&format!("{p}.ln2"), x2, sm);
            self.live = was;
            let n2 = n2?;
            if !saving && self.spec.post_ln {
                // BERT is post-LN: the MLP adds its output to the normed `attention_output`,
                // so under no_grad the residual sum goes once normed.
                sm.retain(|&t| t != x2);
                self.b.free(x2);
                x2_gone = true;
            }
            let readers = match (self.spec.mlp, self.spec.fused_gate_up) {
                (Mlp::Gated, false) => 2,
                _ => 1,
            };
            let n2 = self.sp_gather(n2, readers, false, sm)?;
            self.matmul_input(n2, readers, false, sm)?
        };
        let dead = saving && !live && !self.adapts(&[Target::Gate, Target::Up]);
        if dead {
            self.saving = false;
        }
        let mlp_out = match self.spec.mlp {
            Mlp::Gated => Some(self.mlp_gated(p, pm, n2, sm)?),
            Mlp::Moe => Some(self.mlp_moe(p, pm, n2, sm)?),
            Mlp::Gelu => None,
        };
        let out = match mlp_out {
            Some(o) => {
                let y = if self.spec.sandwich_norms {
                    let y = self.norm(&format!("{p}.post_ffn_norm"), o, sm)?;
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
            None if self.frozen() && self.adapts(&[Target::Up, Target::Down]) => {
                self.mlp_gelu_adapted(p, pm, n2, live, out_name, sm)?
            }
            None => {
                let fc1 = self.wide(&format!("{p}.fc1.out"))?;
                self.base_linear(pm, n2, fc1, f, h)?;
                // Frozen linears save no input: it goes once read (a shared norm's output
                // is the layer's to free).
                if self.frozen() && !sm.contains(&n2) && !self.shared_norm() {
                    self.b.free(n2);
                }
                let last = self.activation(p, fc1, sm)?;
                self.mask(&format!("{p}.mlp.drop_mask"), sm)?;
                let out = self.resid(out_name)?;
                self.base_linear(pm, last, out, h, f)?;
                if self.frozen() && !sm.contains(&last) {
                    self.b.free(last);
                }
                out
            }
        };
        if dead {
            self.saving = saving;
        }
        Ok((out, x2_gone))
    }

    /// Layers `from..to` in forward from `x`. Saving (a training forward without
    /// checkpointing, or a recomputation) keeps every frame; otherwise (inference, a checkpointed
    /// segment under no_grad) each layer's tensors are freed as they are used, except `x`.
    /// `x_owned`: the first layer owns `x` (the embedding's output in a plain forward), rather
    /// than a checkpoint or the caller keeping it.
    pub(super) fn layers(
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
            let (fr, out) = self.layer(i, &format!("L{i}"), cur, &out_name(i), saving, owned)?;
            if saving {
                frames.extend(fr);
            } else {
                for t in fr.into_iter().flat_map(|f| f.saved) {
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
    pub(super) fn enter_layer(&mut self, i: u64) {
        let Some(l) = self.w.model.as_ref().and_then(|m| m.layers.get(i as usize)) else {
            return;
        };
        self.layer = Some(*l);
        (self.d, self.qw, self.kvw) = match l.mixer {
            // MLA: the core's output (and so the context and the output projection's input)
            // is at the value width; q and k at the query/key width.
            Mixer::Mla(m) => (
                m.v_head_dim,
                self.a.saturating_mul(m.v_head_dim),
                self.a
                    .saturating_mul(m.qk_nope_head_dim.saturating_add(m.qk_rope_head_dim)),
            ),
            // Gated DeltaNet and Mamba-2: out_proj reads the gated norm's output.
            Mixer::GatedDeltaNet(m) => (
                m.head_v_dim,
                m.v_heads.saturating_mul(m.head_v_dim),
                self.widths.2,
            ),
            Mixer::Mamba2(m) => (m.head_dim, m.inner(), self.widths.2),
            _ => self.widths,
        };
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

    /// The layer being built is a parallel block (attention and MLP side by side, both added
    /// to the residual after the MLP), with one norm or a norm each.
    pub(super) fn parallel_block(&self) -> bool {
        self.layer
            .is_some_and(|l| matches!(l.block, BlockForm::Parallel | BlockForm::ParallelNorms))
    }

    /// A parallel block whose attention and MLP read one norm's output.
    pub(super) fn shared_norm(&self) -> bool {
        self.layer.is_some_and(|l| l.block == BlockForm::Parallel)
    }

    /// A parallel block with a norm each over the layer's input (GPT-NeoX).
    fn parallel_norms(&self) -> bool {
        self.layer
            .is_some_and(|l| l.block == BlockForm::ParallelNorms)
    }

    /// Free the saved tensors of a backward frame whose names `pred` picks (their node ran).
    fn release_saved(&mut self, saved: &mut Vec<TensorIx>, pred: impl Fn(&str) -> bool) {
        let (gone, kept): (Vec<TensorIx>, Vec<TensorIx>) =
            saved.iter().partition(|&&t| pred(&self.b.tensor(t).name));
        *saved = kept;
        self.b.free_all(gone);
    }

    pub(super) fn backward(
        &mut self,
        fr: Frame,
        incoming: TensorIx,
    ) -> Result<TensorIx, PlanError> {
        let layer = fsdp_layer(&fr.piece);
        if let Some(i) = layer {
            self.enter_layer(i);
        }
        let block = fr.block;
        if let (Some(i), Block::Mlp) = (layer, block) {
            // The layer's pre-backward: it is gathered, and the next one in backward prefetched
            // (FSDP2; FSDP1's BACKWARD_PRE). Under FSDP1's BACKWARD_POST or none the next one
            // waits until this one has resharded (torch 2.15 `fsdp/_runtime_utils.py`,
            // `_pre_backward_hook` / `_post_backward_hook` and `_prefetch_handle`).
            self.unshard_layer(i)?;
            if i > self.lo && !self.post_prefetch() {
                self.unshard_layer(i - 1)?;
            }
        }
        let g = self.block_backward(fr, incoming)?;
        if let (Some(i), Block::Attn) = (layer, block) {
            if self.w.parallel.fsdp.is_some() {
                // The layer's post-backward: reduce-scatter its gradients, reshard.
                // The unit holds the layer's adapters too.
                let names = [
                    format!("L{i}.attn"),
                    format!("L{i}.mlp"),
                    format!("L{i}.attn.lora"),
                    format!("L{i}.mlp.lora"),
                ];
                self.states.fsdp_reduce(self.b, &names)?;
                self.reshard(&format!("L{i}"));
            }
        }
        Ok(g)
    }

    fn block_backward(&mut self, mut fr: Frame, incoming: TensorIx) -> Result<TensorIx, PlanError> {
        let w = self.w;
        self.states.gradient_split(self.b, &fr.piece, w)?;
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
                let width = self.mixer_grad_width();
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
        self.states.settle(self.b, w)?;
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
