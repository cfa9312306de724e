//! The step's end of the forward: the head's piece, BERT's MLM transform or pooler, the final norm,
//! the logits (gathered, replaced or kept as the caller holds them) and the loss with its
//! gradient.

use super::step::Fwd;
use super::{sample, Head, T};
use crate::plan::autocast;
use crate::plan::build::PlanError;
use crate::plan::{DType, Phase, Role, Step, TensorIx};
use crate::workload::parallel::TpHead;
use crate::workload::Outputs;

/// The logits as the loss reads them.
struct Logits {
    t: TensorIx,
    rows: u64,
    shape: Vec<u64>,
    /// The vocabulary the loss sees (all of it when tensor parallelism gathers the logits).
    v: u64,
    /// This rank's vocabulary slice.
    v_local: u64,
    gathered: bool,
}

impl T<'_> {
    /// The untied LM head is a bitsandbytes linear (`--quant-head`).
    fn quant_head(&self) -> bool {
        self.w.quant.is_some_and(|q| q.head && q.kind.is_bnb())
            && self.spec.head == Head::Lm
            && !self.w.tied_head()
    }

    /// The head's parameter group: a classifier's own, a tied head's embedding, or the head.
    fn head_piece(&self) -> &'static str {
        if matches!(self.spec.head, Head::Classifier | Head::Pooled) {
            "head.rest"
        } else if self.w.tied_head() {
            "embed"
        } else {
            "head"
        }
    }

    /// The head, the loss and the head's backward: the gradient of the last layer's output
    /// (None: inference, done).
    pub(super) fn head_and_loss(
        &mut self,
        fwd: &mut Fwd,
        head_in: TensorIx,
    ) -> Result<Option<TensorIx>, PlanError> {
        let mut head_saved = Vec::new();
        let mut head_tail = None;
        let head_x = match self.spec.head {
            Head::Mlm => {
                // `BertModel` has returned: its `embedding_output` goes.
                self.base_model_returns(fwd);
                self.mlm_transform(head_in, &mut head_saved, &mut head_tail)?
            }
            Head::Pooled => {
                // The pooler runs inside `BertModel`, which returns after it.
                let x = self.pooler(head_in, &mut head_saved, &mut head_tail)?;
                self.base_model_returns(fwd);
                x
            }
            _ => self.final_norm(fwd, head_in, &mut head_saved, &mut head_tail)?,
        };
        let logits = self.logits(head_x, &mut head_saved, &mut head_tail)?;
        if !fwd.train {
            // The caller keeps the logits (and a KV cache) until the step is over.
            self.end_inference(fwd, head_saved, &[logits.t]);
            return Ok(None);
        }
        self.held.push(logits.t);
        let g = self.loss(fwd, logits)?;
        self.b.free_all(head_saved);
        Ok(Some(g))
    }

    /// BERT's MLM transform over every position: the head's matmul input.
    fn mlm_transform(
        &mut self,
        head_in: TensorIx,
        head_saved: &mut Vec<TensorIx>,
        head_tail: &mut Option<TensorIx>,
    ) -> Result<TensorIx, PlanError> {
        let (train, h, c) = (self.train, self.h, self.c);
        self.use_piece("head.rest")?;
        // The MLM transform: dense (saves its input, a 16-bit copy under autocast), GELU,
        // LayerNorm over the GELU's 16-bit output: CUDA's autocast runs it in fp32 on an fp32
        // copy (which its backward saves), CPU's in the input's type.
        // Under no_grad each of these goes once read; the encoder's output stays with the
        // returned outputs until the logits exist.
        if !train {
            *head_tail = Some(head_in);
        }
        let x = self.matmul_input(head_in, 1, !train, head_saved)?;
        let d = self.hidden("head.dense_out", Role::Activations)?;
        self.matmul("head.rest", x, d, h, h);
        if !train && x != head_in {
            head_saved.retain(|&y| y != x);
            self.b.free(x);
        }
        let g = self.hidden("head.gelu_out", Role::Activations)?;
        let elems = self.rows().saturating_mul(h);
        self.b.step(Step::Gelu { x: d, y: g, elems });
        if train {
            head_saved.push(d);
        } else {
            self.b.free(d);
        }
        let ln_in = if self.ac.is_some_and(|a| a.casts_input("layer_norm", c)) {
            let g32 = self.hidden_t("head.gelu_out32", Role::Activations, DType::F32)?;
            self.b.free(g);
            g32
        } else {
            g
        };
        let n = self.norm("head.ln", ln_in, head_saved)?;
        if !train {
            head_saved.retain(|&y| y != ln_in);
            self.b.free(ln_in);
        }
        let piece = self.head_piece();
        self.use_piece(piece)?;
        self.matmul_input(n, 1, false, head_saved)
    }

    /// BERT's pooler (`BertPooler`: dense and tanh over the first token) and the classifier's
    /// dropout: the classifier's input, [b, h].
    fn pooler(
        &mut self,
        head_in: TensorIx,
        head_saved: &mut Vec<TensorIx>,
        head_tail: &mut Option<TensorIx>,
    ) -> Result<TensorIx, PlanError> {
        let (train, c, bsz, h) = (self.train, self.c, self.bsz, self.h);
        self.use_piece("head.rest")?;
        // `hidden_states[:, 0]` is a view: the dense saves it as it is, which keeps the whole
        // [b, s, h] output alive until the pooler's backward, unless autocast casts it (a
        // [b, h] 16-bit copy; the output then goes with the model's outputs).
        let cast = self
            .ac
            .is_some_and(|a| a.casts_input("linear", self.dtype(head_in)));
        let x = if cast {
            let t = self
                .b
                .push("head.cls_cast", Role::Activations, c, &[bsz, h], h)?;
            head_saved.push(t);
            t
        } else {
            head_in
        };
        if train && !cast {
            head_saved.push(head_in);
        } else {
            *head_tail = Some(head_in);
        }
        let d = self
            .b
            .push("head.pool_dense", Role::Activations, c, &[bsz, h], h)?;
        self.matmul_rows("head.rest", x, d, bsz, h, h);
        // tanh saves its output; the classifier saves its input (dropout's output, in the
        // dense's type: neither op is on autocast's lists).
        let t = self
            .b
            .push("head.pool_tanh", Role::Activations, c, &[bsz, h], h)?;
        self.b.free(d);
        head_saved.push(t);
        if !(train && self.dropout) {
            return Ok(t);
        }
        let mt = self.mask_type(c);
        let mask = self
            .b
            .push("head.dropout_mask", Role::Activations, mt, &[bsz, h], h)?;
        let o = self
            .b
            .push("head.dropout_out", Role::Activations, c, &[bsz, h], h)?;
        head_saved.extend([mask, o]);
        Ok(o)
    }

    /// The base model's forward returns: its mask and `inputs_embeds` go (the embeddings unless
    /// the first layer saved them or they are the first checkpoint). Checkpointed layers were
    /// handed the mask as an input: each checkpoint keeps it until its layer's backward is
    /// done, so it lives until layer 0's (measured, issue 35).
    fn base_model_returns(&mut self, fwd: &mut Fwd) {
        if fwd.seg.is_none() {
            self.b.free_all(std::mem::take(&mut fwd.masks));
        }
        // (A later pipeline stage's received input is the pipeline's until its backward.)
        if fwd.embeds_go() {
            self.b.free(fwd.x0);
        }
    }

    /// The final norm, and the head's matmul input: the model's forward returns meanwhile.
    fn final_norm(
        &mut self,
        fwd: &mut Fwd,
        head_in: TensorIx,
        head_saved: &mut Vec<TensorIx>,
        head_tail: &mut Option<TensorIx>,
    ) -> Result<TensorIx, PlanError> {
        let n = self.norm("final_ln", head_in, head_saved)?;
        if !fwd.train {
            // Under no_grad the last layer's output goes once normed.
            head_saved.retain(|&x| x != head_in);
        }
        if !head_saved.contains(&head_in) {
            // (A 16-bit RMSNorm saves its fp32 copy instead.)
            self.b.free(head_in);
        }
        self.base_model_returns(fwd);
        let piece = self.head_piece();
        self.use_piece(piece)?;
        if self.spec.head == Head::Classifier && self.ac.is_some() {
            // ViT's classifier reads `sequence_output[:, 0]`: under autocast it saves a [b, h]
            // 16-bit copy of that token, and the fp32 norm output goes; without autocast
            // it saves a view, which keeps the whole [b, s, h] output alive.
            let (c, bsz, h) = (self.c, self.bsz, self.h);
            let tok = self
                .b
                .push("head.cls_cast", Role::Activations, c, &[bsz, h], h)?;
            head_saved.push(tok);
            self.b.free(n);
            Ok(tok)
        } else if fwd.llm {
            // The decoder LLMs' head reads `outputs.last_hidden_state`: the normed output
            // stays alive through the head even when autocast casts it.
            let ng = self.sp_gather(n, 1, true, head_saved)?;
            if ng != n {
                // The gathered copy is what the head saves; the sharded output is held
                // (`last_hidden_state`) until the head is done.
                *head_tail = Some(n);
            }
            let x = self.matmul_input(ng, 1, true, head_saved)?;
            if ng != n {
            } else if x != n || self.frozen() {
                *head_tail = Some(n);
            } else {
                head_saved.push(n);
            }
            Ok(x)
        } else {
            self.matmul_input(n, 1, false, head_saved)
        }
    }

    /// The head's matmul, a serving profile's sampled rows, tensor parallelism's gather and the
    /// logits' softcap and scale.
    fn logits(
        &mut self,
        head_x: TensorIx,
        head_saved: &mut Vec<TensorIx>,
        head_tail: &mut Option<TensorIx>,
    ) -> Result<Logits, PlanError> {
        let (w, c, h, bsz) = (self.w, self.c, self.h, self.bsz);
        let pooled = self.spec.head == Head::Pooled;
        let v = if pooled {
            w.labels.unwrap_or(2)
        } else {
            w.vocab
        };
        let (mut rows, mut shape): (u64, Vec<u64>) = if pooled || self.spec.head == Head::Classifier
        {
            (bsz, vec![bsz, v])
        } else {
            (bsz.saturating_mul(self.s), vec![bsz, self.s, v])
        };
        // A serving profile: the head reads each request's last hidden state only.
        let sampled = sample::rows(w, rows).filter(|_| !self.train && w.is_decoder_llm());
        let mut head_x = head_x;
        if let Some(r) = sampled {
            let dt = self.dtype(head_x);
            let rows_in = self
                .b
                .push("head.sampled_rows", Role::Activations, dt, &[r, h], h)?;
            // The profile run keeps the hidden states through the sampler.
            for x in head_tail.take().into_iter().chain([head_x, rows_in]) {
                if !head_saved.contains(&x) {
                    head_saved.push(x);
                }
            }
            head_x = rows_in;
            (rows, shape) = (r, vec![r, v]);
        }
        let logits = self.b.push("logits", Role::Activations, c, &shape, v)?;
        if self.quant_head() && sampled.is_none() {
            // `--quant-head`: the head is a bitsandbytes linear like the layers' (dequantized
            // whole for each matmul; LitGPT's chunks do that once per chunk, one at a time).
            self.linear("head", head_x, logits, v, h)?;
        } else {
            let wt = self.weights(self.head_piece());
            self.b.step(Step::Matmul {
                a: head_x,
                b: wt,
                c: logits,
                batch: 1,
                m: rows,
                n: v,
                k: h,
            });
        }
        self.b.free_all(head_tail.take());
        if let Some(r) = sampled {
            sample::sampler(self.b, r, v)?;
        }
        let mut out = Logits {
            t: logits,
            rows,
            shape,
            v,
            v_local: v,
            gathered: w.parallel.tp > 1 && w.parallel.tp_head == TpHead::Gathered,
        };
        if out.gathered {
            // Tensor parallelism with gathered logits: each rank's vocabulary slice is
            // all-gathered to the full logits, which the loss reads; the slice goes. DTensor
            // all-gathers along dim 0 and concatenates the chunks along the vocabulary: the
            // gather's output and the concatenation are alive together (measured: two logit
            // sizes at the forward's end of tp-sp).
            out.v = v.saturating_mul(w.parallel.tp);
            if let Some(l) = out.shape.last_mut() {
                *l = out.v;
            }
            let ag = self
                .b
                .push("logits.all_gather", Role::Workspace, c, &out.shape, out.v)?;
            let g = self
                .b
                .push("logits.gathered", Role::Activations, c, &out.shape, out.v)?;
            self.b.free(ag);
            self.b.free(out.t);
            out.t = g;
        }
        if w.logit_softcap {
            // Gemma 2: logits / cap, tanh (which saves its output), · cap: new [b, s, V] tensors.
            // The raw logits go once their tanh exists (two [b, s, V] tensors at a time).
            let tanh = self.replace(out.t, "logits.softcap_tanh", &out.shape, out.v)?;
            out.t = self
                .b
                .push("logits.capped", Role::Activations, c, &out.shape, out.v)?;
            if self.train {
                head_saved.push(tanh);
            } else {
                self.b.free(tanh);
            }
        }
        if w.model.as_ref().is_some_and(|m| m.logit_scale) {
            // Cohere's `logits * logit_scale`, Granite's `logits / logits_scaling`: a new
            // [b, s, V] tensor beside the first (a scalar product saves nothing).
            out.t = self.replace(out.t, "logits.scaled", &out.shape, out.v)?;
        }
        Ok(out)
    }

    /// A new activation of the compute type in place of `old`, which goes once it exists.
    fn replace(
        &mut self,
        old: TensorIx,
        name: &str,
        shape: &[u64],
        cols: u64,
    ) -> Result<TensorIx, PlanError> {
        let c = self.c;
        let t = self.b.push(name, Role::Activations, c, shape, cols)?;
        self.b.free(old);
        Ok(t)
    }

    /// The loss and the head's backward: the gradient of the head's input.
    fn loss(&mut self, fwd: &Fwd, lg: Logits) -> Result<TensorIx, PlanError> {
        let c = self.c;
        self.b.phase(Phase::Loss);
        // The loss's log-softmax output (saved by log_softmax and nll_loss backward) and whether
        // an fp32 copy of the logits is made first:
        // - GPT-2 and ViT (HF's `ForCausalLMLoss` / classification loss): `logits.float()`, an
        //   fp32 copy in any 16-bit precision, fp32 log-probabilities.
        // - BERT (`CrossEntropyLoss` on the logits as they are): without autocast the
        //   log-softmax runs in the logits' type; CPU autocast puts `cross_entropy_loss` on its
        //   fp32 list (an fp32 copy); CUDA's runs `log_softmax` with `dtype=float32`, which for
        //   fp16 is one kernel (`half_to_float`, no copy; aten/src/ATen/native/SoftMax.cpp) and
        //   for bf16 converts first (a copy).
        // - LitGPT's chunked head (`--loss-chunk`, `chunked_cross_entropy`): Fabric's
        //   true-half precision returns the model's outputs in the default dtype
        //   (`HalfPrecision.convert_output`, lightning 2.6.6 `fabric/plugins/precision/
        //   half.py`), so the loop holds fp32 logits chunks (the 16-bit ones go) and each
        //   chunk's `cross_entropy` runs on them as they are: fp32 log-probabilities, no copy.
        let chunk = self
            .w
            .loss_chunk
            .filter(|_| self.spec.head == Head::Lm && !lg.gathered);
        let mut lg = lg;
        if chunk.is_some() && c != DType::F32 {
            let f = self
                .b
                .push("logits_f32", Role::Activations, DType::F32, &lg.shape, lg.v)?;
            if let Some(slot) = self.held.iter_mut().find(|t| **t == lg.t) {
                *slot = f;
            }
            self.b.free(lg.t);
            lg.t = f;
            // The model's forward has returned (Fabric converted its outputs).
            self.fwd_return = Some(self.b.mark());
        }
        let (lp_dtype, copy, half_to_float) = if chunk.is_some() {
            (DType::F32, false, false)
        } else if !matches!(self.spec.head, Head::Mlm | Head::Pooled) {
            (DType::F32, c != DType::F32, false)
        } else {
            match self.ac {
                None => (c, false, false),
                Some(a) if a.device == autocast::Device::Cuda && c == DType::F16 => {
                    (DType::F32, false, true)
                }
                Some(_) => (DType::F32, true, false),
            }
        };
        // PyTorch before 1.11 saves the log-softmax's input too: the fp32 copy, or the logits
        // themselves, which then outlive the caller's hold until the loss's backward.
        let keep_input = self.w.softmax_saves_input() && chunk.is_none();
        let (logprobs, kept_copy) = self
            .b
            .loss_log_softmax(lg.t, lg.rows, lg.v, copy, lp_dtype, keep_input)?;
        let mut kept = kept_copy;
        if keep_input && !copy && self.w.outputs != Outputs::Kept {
            if let Some(i) = self.held.iter().position(|&t| t == lg.t) {
                self.held.remove(i);
                kept = Some(lg.t);
            }
        }
        // transformers computes the loss inside the model's forward, which returns now.
        self.fwd_return.get_or_insert(self.b.mark());
        // The autocast region ends with the loss: the cache is cleared (bias copies go; weight
        // copies stay saved by the matmuls, except those of checkpointed layers, run under no_grad).
        let ckpt_layers = fwd.seg.is_some();
        self.states
            .autocast_exit(self.b, |name| ckpt_layers && name.starts_with('L'));
        // Only the loss leaves the step function: the outputs (logits, a cache's copies) go now;
        // log_softmax saved its output, not the logits.
        if self.w.outputs == Outputs::Dropped {
            self.release_held();
        }
        // Backward: nll_loss and log_softmax backward make two [rows, V] gradients (fp32 when the
        // log-probabilities are; `half_to_float`'s backward gives the logits' type directly).
        self.begin_backward(fwd.stage.hi - 1)?;
        let mut shape = lg.shape.clone();
        if let (Some(k), Some(s)) = (chunk, shape.get_mut(1)) {
            // Chunked: `torch.cat(loss_chunks)`'s backward readies every chunk's loss
            // backward at once, and autograd runs them before any of the head's matmuls
            // (later nodes first): one chunk's nll gradient at a time, each chunk's
            // log-probabilities going as its logits' gradient is made.
            *s = k.min(*s);
        }
        let g_lp = self
            .b
            .push("grad.logprobs", Role::Workspace, lp_dtype, &shape, lg.v)?;
        if chunk.is_some() {
            // Each chunk's log_softmax backward makes its logits' gradient beside nll's, with
            // the log-probabilities of the chunks not yet reached and the gradients of those
            // done: n + 2 chunks at every chunk (measured, `litgpt_measured.json`).
            let gc = self
                .b
                .push("grad.logits_chunk", Role::Workspace, lp_dtype, &shape, lg.v)?;
            self.b.free_all([logprobs, gc]);
        }
        let mut shape = lg.shape;
        let gl_dtype = if half_to_float { c } else { lp_dtype };
        let mut g_logits = self
            .b
            .push("grad.logits", Role::Workspace, gl_dtype, &shape, lg.v)?;
        self.b.free(g_lp);
        if chunk.is_none() {
            self.b.free(logprobs);
        }
        self.b.free_all(kept);
        if gl_dtype != c {
            let g = self
                .b
                .push("grad.logits_16", Role::Workspace, c, &shape, lg.v)?;
            self.b.free(g_logits);
            g_logits = g;
        }
        // Gathered logits: the gather's backward keeps this rank's slice of the gradient.
        if lg.gathered {
            if let Some(l) = shape.last_mut() {
                *l = lg.v_local;
            }
            let name = "grad.logits_local";
            let g = self.b.push(name, Role::Workspace, c, &shape, lg.v_local)?;
            self.b.free(g_logits);
            g_logits = g;
        }
        // The head's matmul: its weight gradient and the gradient of its input.
        let w = self.w;
        let piece = self.head_piece();
        if piece == "embed" && fwd.stage.first() {
            // A tied head: its gradient waits for the embedding's (on a later pipeline stage
            // the head is the stage's own copy: its gradient is whole here).
            self.states.gradient_part(self.b, piece, w)?;
        } else {
            self.states.gradient_deferred(self.b, piece, w)?;
        }
        // (ViT's classifier reads one token; its input gradient is still [b, s, h], zeros elsewhere.)
        // A quantized head is dequantized again for its input's gradient.
        let deq = if self.quant_head() {
            let dt = crate::plan::params::compute_dtype(w.precision);
            let (v, h) = (w.vocab, self.h);
            Some(self.dequantized("head.dequant_bwd", v, h, dt)?)
        } else {
            None
        };
        // The pooler's gradients are [b, h] until the first token's select scatters them.
        let (bsz, h) = (self.bsz, self.h);
        let head_x_grad = |t: &mut Self, name: &str, dt: DType| {
            if t.spec.head == Head::Pooled {
                t.b.push(name, Role::Workspace, dt, &[bsz, h], h)
            } else {
                t.hidden_t(name, Role::Workspace, dt)
            }
        };
        let mut gx = head_x_grad(self, "grad.head_x", c)?;
        self.b.free_all(deq);
        self.b.free(g_logits);
        self.states.settle(self.b, w)?;
        if self.r != c {
            // ToCopyBackward0: the 16-bit gradient of the head's input copy becomes fp32.
            let g = head_x_grad(self, "grad.head_x32", self.r)?;
            self.b.free(gx);
            gx = g;
        }
        if piece != "head.rest" {
            self.states.gradient(self.b, "head.rest", w)?;
        }
        let gin = self.hidden_t("grad.head_in", Role::Workspace, self.r)?;
        self.b.free(gx);
        Ok(gin)
    }
}
