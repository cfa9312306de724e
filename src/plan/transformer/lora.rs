//! A fine-tuning run's linears: the frozen base linear as it is stored (bitsandbytes' 4-bit
//! and 8-bit layers dequantize and cast around the matmul) and PEFT's LoRA adapter beside it,
//! with what autograd saves and frees (tests/fixtures/finetune/RESEARCH.md cites each rule).
//!
//! Rules, measured with PyTorch + PEFT on the CPU (`lora_measured.json`):
//! - a frozen `F.linear(x, W)` saves only `W` (a parameter): not its input;
//! - `lora_A(x')` saves `x'` (the layer input, its fp32 copy over a 16-bit base, or the
//!   dropout's output), `lora_B` saves `lora_A`'s `[n, r]` output; `result + B(A(x))·s` is out
//!   of place and cast back to the base output's type;
//! - `nn.Dropout` (p > 0) makes each adapter its own dropped copy; its 1-byte mask is saved
//!   only where the input needs a gradient (not in the first layer without checkpointing:
//!   the frozen embedding's output does not);
//! - a frozen norm saves its input and rstd, not x̂ (no gain gradient).

use super::{DType, PlanError, Role, Step, TensorIx, T};
use crate::workload::{QuantKind, Target};

/// One projection of a shared input: its output tensor's name, PEFT's module name (what an
/// adapter's tensors are named after), the targets it stands for and its output width.
pub(super) struct Proj<'a> {
    pub tensor: String,
    pub module: String,
    pub targets: &'a [Target],
    pub width: u64,
}

impl<'a> Proj<'a> {
    /// A projection whose output tensor is named apart from its module.
    pub fn new(tensor: String, module: String, targets: &'a [Target], width: u64) -> Proj<'a> {
        Proj {
            tensor,
            module,
            targets,
            width,
        }
    }

    /// A projection whose tensor and module share a name.
    pub fn named(name: String, targets: &'a [Target], width: u64) -> Proj<'a> {
        Proj::new(name.clone(), name, targets, width)
    }
}

impl T<'_> {
    /// Projections of block `piece` that read the same input `x` (`inp` wide): q, k and v;
    /// gate and up; or one (fused, output, down). Each is the stored linear and its adapter, if
    /// any. Whether `x` needs a gradient is as it was before them all; past any adapter,
    /// everything after does. Returns the outputs in order.
    pub(super) fn projections(
        &mut self,
        piece: &str,
        x: TensorIx,
        inp: u64,
        projs: &[Proj<'_>],
        saved: &mut Vec<TensorIx>,
    ) -> Result<Vec<TensorIx>, PlanError> {
        let c = self.c;
        let live = self.live;
        let mut after = live;
        let mut outs = Vec::with_capacity(projs.len());
        let qkv = [Target::Q, Target::K, Target::V];
        let fused_lora = !self.w.framework.is_transformers()
            && projs
                .iter()
                .any(|p| p.targets.iter().any(|t| qkv.contains(t)));
        for pr in projs {
            let y = self.rows_t(&pr.tensor, Role::Activations, c, pr.width)?;
            self.linear(piece, x, y, pr.width, inp)?;
            let y = if fused_lora {
                y
            } else {
                self.adapt(piece, &pr.module, pr.targets, x, y, (pr.width, inp), saved)?
            };
            after |= self.live;
            self.live = live;
            outs.push(y);
        }
        if fused_lora {
            after |= self.adapt_qkv_litgpt(piece, x, inp, projs, &mut outs, saved)?;
        }
        self.live = after;
        Ok(outs)
    }

    /// LitGPT's `LoRAQKVLinear` over q, k and v (`lora.py` @5895df10; measured in
    /// `validation/litgpt_notes.md`): one dropout of the shared input, `lora_A` over it for
    /// every adapted part at once ([n, r·k], saved by the grouped `conv1d` that is `lora_B`),
    /// then `zero_pad`: unless q, k and v are all adapted, `index_copy` of the parts into a
    /// zeroed [n, q+k+v] saves its source (a copy of `lora_B`'s output). Everything is in the
    /// model's type. The adapted outputs are replaced by `pretrained + lora·scale`. Whether
    /// anything was adapted (past it every tensor needs a gradient).
    fn adapt_qkv_litgpt(
        &mut self,
        piece: &str,
        x: TensorIx,
        inp: u64,
        projs: &[Proj<'_>],
        outs: &mut [TensorIx],
        saved: &mut Vec<TensorIx>,
    ) -> Result<bool, PlanError> {
        let Some(lora) = self.w.lora.clone() else {
            return Ok(false);
        };
        let adapted: Vec<usize> = (0..projs.len())
            .filter(|&i| self.adapts(projs[i].targets))
            .collect();
        if adapted.is_empty() {
            return Ok(false);
        }
        let (c, r) = (self.c, lora.rank);
        let ad = format!("{piece}.lora");
        let rows = |t: &mut Self, what: &str, width: u64| {
            t.rows_t(&format!("{ad}.{what}"), Role::Activations, c, width)
        };
        let mut xin = x;
        if lora.dropout > 0.0 {
            let dt = self.dtype(x);
            xin = self.rows_t(&format!("{ad}.dropout"), Role::Activations, dt, inp)?;
            let mt = self.mask_type(dt);
            let mask = self.rows_t(&format!("{ad}.dropout_mask"), Role::Activations, mt, inp)?;
            if self.saving && self.live {
                saved.push(mask);
            } else {
                self.b.free(mask);
            }
        }
        let k = adapted.len() as u64;
        let width: u64 = adapted.iter().map(|&i| projs[i].width).sum();
        let total: u64 = projs.iter().map(|p| p.width).sum();
        let a = rows(self, "a", r * k)?;
        self.matmul(&ad, xin, a, r * k, inp);
        let bo = rows(self, "b", width)?;
        self.matmul(&ad, a, bo, width, r);
        let mut tmp = vec![bo];
        let all = [Target::Q, Target::K, Target::V]
            .iter()
            .all(|&t| self.adapts(&[t]));
        if !all {
            // zero_pad: the reshaped source (a copy: lora_B's output is transposed), saved by
            // IndexCopyBackward0; new_zeros, then the out-of-place index_copy.
            let src = rows(self, "zero_pad_src", width)?;
            if self.saving {
                saved.push(src);
            } else {
                tmp.push(src);
            }
            tmp.push(rows(self, "zeros", total)?);
            tmp.push(rows(self, "padded", total)?);
        }
        self.adapter_inputs(x, xin, a, saved);
        tmp.push(rows(self, "scaled", total)?);
        // pretrained + lora: the sum replaces each adapted part.
        for &i in &adapted {
            let y = outs[i];
            let n = self.rows_t(
                &format!("{}.lora_out", projs[i].module),
                Role::Activations,
                c,
                projs[i].width,
            )?;
            self.b.free(y);
            outs[i] = n;
        }
        self.b.free_all(tmp);
        Ok(true)
    }

    /// The base is frozen (adapters or a quantized base): its linears save no input for a
    /// weight gradient and its norms no x̂. Not under FSDP1: a layer's frozen weights are views
    /// of its flat parameter, which requires a gradient when an adapter in it does, so they
    /// save and compute what full fine-tuning does (`validation/fsdp1_notes.md`).
    pub(super) fn frozen(&self) -> bool {
        (self.w.lora.is_some() || self.w.quant.is_some_and(|q| q.kind.is_bnb()))
            && !self.w.parallel.fsdp1
    }

    /// Whether LoRA adapts one of `targets`.
    pub(super) fn adapts(&self, targets: &[Target]) -> bool {
        self.w
            .lora
            .as_ref()
            .is_some_and(|l| targets.iter().any(|&t| l.adapts(t)))
    }

    /// The 4-bit compute type (`bnb_4bit_compute_dtype`): as given, else the precision's.
    pub(super) fn quant_compute(&self) -> DType {
        self.w
            .quant
            .and_then(|q| q.compute)
            .map(crate::plan::params::compute_dtype)
            .unwrap_or_else(|| crate::plan::params::compute_dtype(self.w.precision))
    }

    /// A base linear of `piece`, `y[n, out] = x[n, inp] · Wᵀ`. A 4-bit weight is dequantized
    /// whole into the compute type first (`_dequant_linear_fallback`, bitsandbytes 95f9af3
    /// `backends/cuda/ops.py:904-916`, taken above 1536 tokens and on the CPU; with double
    /// quantization its absmax first to fp32), the input cast to the compute type and the
    /// output back to the input's (`nn/modules.py:628, 637`); LLM.int8() quantizes the input
    /// row-wise (int8 and an fp32 scale per row) into an int32 product (`_functions.py:101-199`).
    /// All of these are transient.
    pub(super) fn linear(
        &mut self,
        piece: &str,
        x: TensorIx,
        y: TensorIx,
        out: u64,
        inp: u64,
    ) -> Result<(), PlanError> {
        // A checkpoint's own format (FP8, MXFP4, GPTQ, AWQ) runs in fused kernels that read
        // the stored weight in place: no dequantized copy is modelled.
        let Some(q) = self.w.quant.filter(|q| q.kind.is_bnb()) else {
            let casts = self.float8_casts(piece, x, out, inp)?;
            self.matmul(piece, x, y, out, inp);
            self.b.free_all(casts);
            return Ok(());
        };
        let (bsz, s) = (self.bsz, self.s);
        let n = out.saturating_mul(inp);
        let mut tmp = Vec::new();
        match q.kind {
            QuantKind::Nf4 | QuantKind::Fp4 => {
                let qc = self.quant_compute();
                if q.double_quant {
                    tmp.push(self.b.push(
                        &format!("{piece}.absmax32"),
                        Role::Workspace,
                        DType::F32,
                        &[n.div_ceil(64)],
                        64,
                    )?);
                }
                let wdq = self.dequantized(&format!("{piece}.dequant"), out, inp, qc)?;
                tmp.push(wdq);
                let xin = if self.dtype(x) != qc {
                    let t = self.b.push(
                        &format!("{piece}.x_cast"),
                        Role::Workspace,
                        qc,
                        &[bsz, s, inp],
                        inp,
                    )?;
                    tmp.push(t);
                    t
                } else {
                    x
                };
                let yq = if self.dtype(y) != qc {
                    let t = self.b.push(
                        &format!("{piece}.y_cast"),
                        Role::Workspace,
                        qc,
                        &[bsz, s, out],
                        out,
                    )?;
                    tmp.push(t);
                    t
                } else {
                    y
                };
                let m = self.rows();
                self.b.step(Step::Matmul {
                    a: xin,
                    b: wdq,
                    c: yq,
                    batch: 1,
                    m,
                    n: out,
                    k: inp,
                });
                self.hold_input(xin);
            }
            QuantKind::Int8 => {
                // CA int8 [n, inp] + SCA fp32 [n]; the int32 product [n, out]; the weight's
                // int8 columns are read in place (no dequantized copy in forward).
                let ca = self.b.push(
                    &format!("{piece}.x_int8"),
                    Role::Workspace,
                    DType::U8,
                    &[bsz, s, inp],
                    inp,
                )?;
                let sca = self.b.push(
                    &format!("{piece}.x_scale"),
                    Role::Workspace,
                    DType::F32,
                    &[bsz, s],
                    1,
                )?;
                let acc = self.b.push(
                    &format!("{piece}.acc_i32"),
                    Role::Workspace,
                    DType::F32,
                    &[bsz, s, out],
                    out,
                )?;
                tmp.extend([ca, sca, acc]);
                self.matmul(piece, x, y, out, inp);
            }
            // Filtered out above.
            _ => self.matmul(piece, x, y, out, inp),
        }
        self.b.free_all(tmp);
        Ok(())
    }

    /// A bitsandbytes weight [out, inp] dequantized whole into `dt` (named `name`): a 4-bit one
    /// quantized from fp16 (`Quant::from_fp16`) dequantizes to fp16 first, and that copy is
    /// alive beside the one in `dt` until the cast is done.
    pub(super) fn dequantized(
        &mut self,
        name: &str,
        out: u64,
        inp: u64,
        dt: DType,
    ) -> Result<TensorIx, PlanError> {
        let from16 = self
            .w
            .quant
            .is_some_and(|q| q.from_fp16 && q.kind.is_4bit())
            && dt != DType::F16;
        let first = if from16 {
            let n = format!("{name}16");
            Some(
                self.b
                    .push(&n, Role::Workspace, DType::F16, &[out, inp], inp)?,
            )
        } else {
            None
        };
        let w = self.b.push(name, Role::Workspace, dt, &[out, inp], inp)?;
        self.b.free_all(first);
        Ok(w)
    }

    /// A base linear without an adapter: as `linear` stores it under a bitsandbytes base, else
    /// the plain matmul.
    pub(super) fn base_linear(
        &mut self,
        piece: &str,
        x: TensorIx,
        y: TensorIx,
        out: u64,
        inp: u64,
    ) -> Result<(), PlanError> {
        if self.w.quant.is_some_and(|q| q.kind.is_bnb()) {
            self.linear(piece, x, y, out, inp)
        } else {
            self.matmul(piece, x, y, out, inp);
            Ok(())
        }
    }

    /// Before bitsandbytes 0.44 a 4-bit matmul whose input needs a gradient keeps that input
    /// (the compute-type copy, if one was made) on its autograd context, which lives as long
    /// as the graph: pinned until the graph goes (`step::finish`), or, made by a checkpointed
    /// segment's recomputation, until that recomputation returns.
    pub(super) fn hold_input(&mut self, x: TensorIx) {
        if self.train && self.live && self.w.quant.is_some_and(|q| q.holds_input) {
            self.b.pin(x);
        }
    }

    /// An adapter's `lora_A` input `xin` (the layer input `x`, a copy of it or the dropout's
    /// output) and `lora_A`'s output `a`: saved for the adapters' weight gradients, or, not
    /// saving, gone now (`x` is the caller's).
    fn adapter_inputs(
        &mut self,
        x: TensorIx,
        xin: TensorIx,
        a: TensorIx,
        saved: &mut Vec<TensorIx>,
    ) {
        if self.saving {
            if !saved.contains(&xin) {
                saved.push(xin);
            }
            saved.push(a);
        } else {
            if xin != x {
                self.b.free(xin);
            }
            self.b.free(a);
        }
    }

    /// PEFT's adapter on a base linear named `name` (`targets`) of block `piece`, over input
    /// `x` with base output `y` ([b, s, out]): returns the adapted output (a new tensor; `y`
    /// goes) or `y` when no adapter is there. Saving, pushes what `lora_A`, `lora_B` and the
    /// dropout keep into `saved`. The input `x` is left to the caller.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn adapt(
        &mut self,
        piece: &str,
        name: &str,
        targets: &[Target],
        x: TensorIx,
        y: TensorIx,
        (out, inp): (u64, u64),
        saved: &mut Vec<TensorIx>,
    ) -> Result<TensorIx, PlanError> {
        let Some(lora) = self.w.lora.clone() else {
            return Ok(y);
        };
        if !self.adapts(targets) {
            return Ok(y);
        }
        let (bsz, s, r) = (self.bsz, self.s, lora.rank);
        let ad = format!("{piece}.lora");
        // The adapters' type: PEFT computes its fp32 adapters in fp32, LitGPT's are in the
        // model's type.
        let lit = !self.w.framework.is_transformers();
        let at = if lit { self.c } else { DType::F32 };
        let rows_of = |t: &mut Self, what: &str, width: u64, dt: DType| {
            t.b.push(
                &format!("{name}.lora_{what}"),
                Role::Activations,
                dt,
                &[bsz, s, width],
                width,
            )
        };
        // QLoRA's forward clones the 4-bit layer's output first (peft bnb.py:533).
        let mut y = y;
        if self.w.quant.is_some_and(|q| q.kind.is_4bit()) && !lit {
            let dt = self.dtype(y);
            let c = rows_of(self, "result_clone", out, dt)?;
            self.b.free(y);
            y = c;
        }
        // The adapters' fp32: x itself, or a copy per adapted layer (`_cast_input_dtype`).
        let mut xin = x;
        if self.dtype(x) != at {
            xin = rows_of(self, "x32", inp, at)?;
        }
        if lora.dropout > 0.0 {
            let dropped = rows_of(self, "dropout", inp, at)?;
            let mt = self.mask_type(at);
            let mask = rows_of(self, "dropout_mask", inp, mt)?;
            if self.saving && self.live {
                saved.push(mask);
            } else {
                self.b.free(mask);
            }
            if xin != x {
                self.b.free(xin);
            }
            xin = dropped;
        }
        let a = rows_of(self, "a", r, at)?;
        self.matmul(&ad, xin, a, r, inp);
        let bo = rows_of(self, "b", out, at)?;
        self.matmul(&ad, a, bo, out, r);
        self.adapter_inputs(x, xin, a, saved);
        // · scaling, then result + that (fp32), then back to the result's type.
        let scaled = rows_of(self, "scaled", out, at)?;
        self.b.free(bo);
        let sum = rows_of(self, "sum", out, at)?;
        self.b.free(scaled);
        let yt = self.dtype(y);
        self.b.free(y);
        let res = if yt != at {
            let t = rows_of(self, "out", out, yt)?;
            self.b.free(sum);
            t
        } else {
            sum
        };
        // Past an adapter everything needs a gradient.
        self.live = true;
        Ok(res)
    }

    /// The backward transients of block `piece`'s adapters and quantized linears, one linear
    /// at a time: the fp32 gradients of an adapter's output and input, and the weight
    /// dequantized again for the input gradient (`_functions.py:384`).
    pub(super) fn adapter_backward(&mut self, piece: &str, attn: bool) -> Result<(), PlanError> {
        if !self.frozen() {
            return Ok(());
        }
        let lin = super::count::linears(self.w)?;
        let (bsz, s) = (self.bsz, self.s);
        for l in lin.iter().filter(|l| l.attn == attn) {
            let mut tmp = Vec::new();
            if self.adapts(&l.targets) {
                for (what, width) in [("grad_b", l.out), ("grad_x", l.inp)] {
                    tmp.push(self.b.push(
                        &format!("{piece}.lora.{what}"),
                        Role::Workspace,
                        DType::F32,
                        &[bsz, s, width],
                        width,
                    )?);
                }
            }
            // (Backward runs only in training, where 4-bit and 8-bit layers both dequantize.)
            if self.w.quant.is_some_and(|q| q.kind.is_bnb()) {
                let dt = crate::plan::params::compute_dtype(self.w.precision);
                let name = format!("{piece}.dequant_bwd");
                tmp.push(self.dequantized(&name, l.out, l.inp, dt)?);
            }
            self.b.free_all(tmp);
        }
        Ok(())
    }
}
