//! The MLP blocks: GELU (fused or transformers' `gelu_new`), gated (SwiGLU, GeGLU, fused
//! gate-up), a mixture of experts as transformers 5.24 dispatches it, and a GELU MLP with
//! LoRA on its linears.

use super::lora::Proj;
use super::T;
use crate::plan::autocast;
use crate::plan::build::{prod, PlanError};
use crate::plan::params::param_dtype;
use crate::plan::{DType, Role, Step, TensorIx};
use crate::workload::layers::{MlpSpec, MoeSpec};
use crate::workload::{Gelu, Target};

impl T<'_> {
    /// The router's logits [T, E] in the compute type, from the block's normed input `n2`.
    fn router_logits(
        &mut self,
        p: &str,
        pm: &str,
        n2: TensorIx,
        t: u64,
        e: u64,
    ) -> Result<TensorIx, PlanError> {
        let (h, c) = (self.h, self.c);
        let name = format!("{p}.moe.router_logits");
        let logits = self.b.push(&name, Role::Activations, c, &[t, e], e)?;
        self.matmul_rows(pm, n2, logits, t, e, h);
        Ok(logits)
    }

    /// An ungated MLP over a frozen base with adapters on fc1 (`up`) or fc2 (`down`): each
    /// linear as `projections` makes it (the base, then its adapter), fc2 into a tensor of its
    /// own before the residual add. `live`: whether the MLP's input needs a gradient.
    pub(super) fn mlp_gelu_adapted(
        &mut self,
        p: &str,
        pm: &str,
        n2: TensorIx,
        live: bool,
        out_name: &str,
        sm: &mut Vec<TensorIx>,
    ) -> Result<TensorIx, PlanError> {
        let (h, f) = (self.h, self.f);
        let was = self.live;
        self.live = live;
        let proj = Proj::new;
        let up = proj(format!("{p}.fc1.out"), format!("{p}.fc1"), &[Target::Up], f);
        let fc1 = self.projections(pm, n2, h, &[up], sm)?[0];
        if !sm.contains(&n2) && !self.shared_norm() {
            self.b.free(n2);
        }
        let last = self.activation(p, fc1, sm)?;
        self.mask(&format!("{p}.mlp.drop_mask"), sm)?;
        let down = proj(
            format!("{p}.fc2.out"),
            format!("{p}.fc2"),
            &[Target::Down],
            h,
        );
        let y = self.projections(pm, last, f, &[down], sm)?[0];
        if !sm.contains(&last) {
            self.b.free(last);
        }
        let out = self.resid(out_name)?;
        self.b.free(y);
        self.live |= was;
        Ok(out)
    }

    /// The MLP's activation over `fc1` ([b,s,f]): pushes what its backward saves and returns
    /// the tensor the second projection reads (and whether `fc1` itself is saved).
    pub(super) fn activation(
        &mut self,
        p: &str,
        fc1: TensorIx,
        sm: &mut Vec<TensorIx>,
    ) -> Result<TensorIx, PlanError> {
        let c = self.c;
        let elems = self.rows().saturating_mul(self.f);
        if self.w.gelu == Gelu::Unfused && self.train {
            // gelu_new: 0.5·x · (1 + tanh(√(2/π)·(x + 0.044715·pow(x, 3)))) in separate ops
            // saves pow's input, tanh's output, 0.5·x and 1 + tanh (both factors of the last
            // product). Under CUDA autocast `pow` is on the fp32 list: it saves an fp32 copy
            // of x, and everything after it (tanh, 1 + tanh, the product) is fp32.
            let pow_cast = self.ac.is_some_and(|a| a.casts_input("pow", c));
            if pow_cast {
                sm.push(self.wide_t(&format!("{p}.gelu.x32"), Role::Activations, DType::F32)?);
            } else {
                sm.push(fc1);
            }
            let t = autocast::promote(c, self.out("pow", &[c]));
            sm.push(self.wide_t(&format!("{p}.gelu.tanh"), Role::Activations, t)?);
            sm.push(self.wide(&format!("{p}.gelu.half_x"))?);
            sm.push(self.wide_t(&format!("{p}.gelu.one_plus_tanh"), Role::Activations, t)?);
            let out = self.wide_t(&format!("{p}.gelu.out"), Role::Activations, t)?;
            self.b.step(Step::Gelu {
                x: fc1,
                y: out,
                elems,
            });
            if pow_cast {
                self.b.free(fc1);
            }
            self.matmul_input(out, 1, false, sm)
        } else {
            let gelu = self.wide(&format!("{p}.gelu.out"))?;
            self.b.step(Step::Gelu {
                x: fc1,
                y: gelu,
                elems,
            });
            if self.saving {
                sm.push(fc1);
                // The second projection's input: a frozen one does not save it.
                if !self.frozen() {
                    sm.push(gelu);
                }
            } else {
                // No graph (no_grad, or an input that needs no gradient, as layer 0's MLP over
                // a frozen embedding in a parallel block): the GELU's input goes once read; a
                // trained second projection's input goes with the layer's, a frozen one's once
                // read (`mlp_block`).
                self.b.free(fc1);
                if !self.frozen() {
                    sm.push(gelu);
                }
            }
            Ok(gelu)
        }
    }

    /// The kernels of a gated activation `prod = act(gate) · up` over `elems` elements: the
    /// activation runs as the GeLU kernel (same cost class); the product has no kernel of its
    /// own, so a GeLU over `act` writes `prod` with the same extent.
    fn gated_kernels(&mut self, gate: TensorIx, act: TensorIx, prod: TensorIx, elems: u64) {
        self.b.step(Step::Gelu {
            x: gate,
            y: act,
            elems,
        });
        self.b.step(Step::Gelu {
            x: act,
            y: prod,
            elems,
        });
    }

    /// Routed token-expert pairs T·k and each expert's width.
    pub(super) fn routed(&self) -> Result<(u64, u64), PlanError> {
        let m = self
            .moe
            .ok_or_else(|| PlanError::Invalid("a mixture of experts needs experts".into()))?;
        Ok((
            prod(&[self.rows(), m.top_k], "the routed tokens")?,
            m.expert_ffn,
        ))
    }

    /// The gated MLP (`down(act(gate(x)) * up(x))`) over the norm's output `n2`: saves gate (or
    /// the fused gate-up output), up, act and their product (the down projection's input);
    /// returns the down projection's output.
    pub(super) fn mlp_gated(
        &mut self,
        p: &str,
        pm: &str,
        n2: TensorIx,
        sm: &mut Vec<TensorIx>,
    ) -> Result<TensorIx, PlanError> {
        let (h, f) = (self.h, self.f);
        let elems = self.rows().saturating_mul(f);
        // The gate (the fused output, whose first half it is) and every projection output.
        let (gate, gu) = if self.spec.fused_gate_up {
            let both = [Target::Gate, Target::Up];
            let gu = Proj {
                tensor: format!("{p}.mlp.gate_up"),
                module: format!("{p}.gate_up_proj"),
                targets: &both,
                width: 2 * f,
            };
            let gu = self.projections(pm, n2, h, &[gu], sm)?[0];
            (gu, vec![gu])
        } else {
            let proj = |name: &str, module: &str, t: &'static [Target]| Proj {
                tensor: format!("{p}.mlp.{name}"),
                module: format!("{p}.{module}"),
                targets: t,
                width: f,
            };
            let projs = [
                proj("gate", "gate_proj", &[Target::Gate]),
                proj("up", "up_proj", &[Target::Up]),
            ];
            let o = self.projections(pm, n2, h, &projs, sm)?;
            (o[0], o)
        };
        self.consumed(n2, sm);
        if self.frozen() && !sm.contains(&n2) && !self.shared_norm() {
            self.b.free(n2);
        }
        let act = self.wide(&format!("{p}.mlp.act"))?;
        let prod_ = self.wide(&format!("{p}.mlp.prod"))?;
        sm.extend(gu.iter().copied());
        sm.push(act);
        // The product is the down projection's input: a frozen one does not save it.
        let frozen = self.frozen();
        if !frozen {
            sm.push(prod_);
        }
        self.gated_kernels(gate, act, prod_, elems);
        for t in gu {
            self.consumed(t, sm);
        }
        self.consumed(act, sm);
        let down = Proj {
            tensor: format!("{p}.mlp.out"),
            module: format!("{p}.down_proj"),
            targets: &[Target::Down],
            width: h,
        };
        let out = self.projections(pm, prod_, f, &[down], sm)?[0];
        self.consumed(prod_, sm);
        if frozen && !sm.contains(&prod_) {
            self.b.free(prod_);
        }
        Ok(out)
    }

    /// The layer's experts (its record, or the workload's).
    fn moe_layer(&self) -> Option<MoeSpec> {
        match self.layer.map(|l| l.mlp) {
            Some(MlpSpec::Moe(e)) => Some(e),
            _ => None,
        }
    }

    /// A sparse mixture of experts over `n2`: the router, the routed experts (grouped, or
    /// every token through every expert for Llama 4), and a shared expert over every token.
    pub(super) fn mlp_moe(
        &mut self,
        p: &str,
        pm: &str,
        n2: TensorIx,
        sm: &mut Vec<TensorIx>,
    ) -> Result<TensorIx, PlanError> {
        let m = self
            .moe
            .ok_or_else(|| PlanError::Invalid("a mixture of experts needs experts".into()))?;
        let (out, router, routed_out) = if self.moe_layer().is_some_and(|e| e.all_tokens) {
            self.experts_all_tokens(p, pm, n2, sm)?
        } else {
            let (out, router) = self.experts_grouped(p, pm, n2, sm)?;
            (out, router, None)
        };
        if m.shared_ffn > 0 {
            self.shared_expert(p, pm, n2, m.shared_ffn, sm)?;
        }
        self.b.free_all(routed_out);
        for x in router {
            self.consumed(x, sm);
        }
        self.consumed(n2, sm);
        Ok(out)
    }

    /// The routed experts as transformers 5.24 runs them by default
    /// (`grouped_mm_experts_forward`): the router's logits and fp32 probabilities [T, E], top-k
    /// indices; the tokens gathered by expert [T·k, h]; gate-up [T·k, 2f], act and product
    /// [T·k, f], the down output [T·k, h] weighted by the routing weights; the sort, gather and
    /// inverse-permutation indices (int64). Returns the output and the router's saved tensors.
    fn experts_grouped(
        &mut self,
        p: &str,
        pm: &str,
        n2: TensorIx,
        sm: &mut Vec<TensorIx>,
    ) -> Result<(TensorIx, Vec<TensorIx>), PlanError> {
        let h = self.h;
        let t = self.rows();
        let (s_rows, fe) = self.routed()?;
        let e = self.moe.map_or(0, |m| m.experts);
        let logits = self.router_logits(p, pm, n2, t, e)?;
        let probs = self.b.push(
            &format!("{p}.moe.router_probs"),
            Role::Activations,
            DType::F32,
            &[t, e],
            e,
        )?;
        self.b.free(logits);
        // topk's indices and values, the sort's permutation, the gather's and the inverse
        // permutation's indices: int64 per pair.
        let index = self.b.push(
            &format!("{p}.moe.index"),
            Role::Activations,
            DType::I64,
            &[4, s_rows],
            s_rows.max(1),
        )?;
        let weights = self.b.push(
            &format!("{p}.moe.weights"),
            Role::Activations,
            DType::F32,
            &[2, s_rows],
            s_rows.max(1),
        )?;
        sm.extend([probs, index, weights]);
        // The experts read the norm's output in their weights' type (no autocast op).
        let xt = self.dtype(n2);
        let pt = param_dtype(self.w.precision);
        let row = |t: &mut Self, n: &str, dt: DType, w: u64| {
            t.b.push(
                &format!("{p}.moe.{n}"),
                Role::Activations,
                dt,
                &[s_rows, w],
                w,
            )
        };
        let xin = if xt != pt && self.ac.is_some() {
            row(self, "x_cast", pt, h)?
        } else {
            n2
        };
        let xg = row(self, "gathered", pt, h)?;
        if xin != n2 {
            self.b.free(xin);
        }
        let gu = row(self, "gate_up", pt, 2 * fe)?;
        self.matmul_rows(pm, xg, gu, s_rows, 2 * fe, h);
        // gpt-oss's clamped SwiGLU saves the clamped gate, `up + 1` and the GLU besides the
        // sigmoid (act) and the product (measured: GptOssExperts on CPU).
        let mut clamped = Vec::new();
        if self.moe_layer().is_some_and(|e| e.clamped) {
            for n in ["gate_clamped", "up_plus1", "glu"] {
                clamped.push(row(self, n, pt, fe)?);
            }
        }
        let act = row(self, "act", pt, fe)?;
        let prod_ = row(self, "prod", pt, fe)?;
        let elems = s_rows.saturating_mul(fe);
        self.gated_kernels(gu, act, prod_, elems);
        sm.extend([xg, gu, act, prod_]);
        sm.extend(clamped.iter().copied());
        // The gate's halves and act go with `_apply_gate`; the product after the down
        // projection, which the weighting replaces; the gathered tokens when the experts'
        // function returns.
        for x in [gu, act].into_iter().chain(clamped) {
            self.consumed(x, sm);
        }
        let down = row(self, "down", pt, h)?;
        self.matmul_rows(pm, prod_, down, s_rows, h, fe);
        sm.push(down);
        self.consumed(prod_, sm);
        let weighted = row(self, "weighted", pt, h)?;
        self.consumed(down, sm);
        let out = self.hidden_t(&format!("{p}.mlp.out"), Role::Activations, self.dtype(n2))?;
        self.b.free(weighted);
        self.consumed(xg, sm);
        Ok((out, vec![probs, index, weights]))
    }

    /// Llama 4's experts (`Llama4TextMoe`): every token goes through every expert. The router's
    /// sigmoid scores [T, E] (zero outside the top k) and top-k indices; the input repeated E
    /// times [E·T, h] and scaled by the scores (both saved); one batched matmul per projection
    /// over [E, T, ·]: gate-up [E·T, 2f], act and product [E·T, f]; the down output summed over
    /// the experts into [T, h] after the shared expert ran, so returned to be freed then
    /// (measured: layer 1 of the llama4_text family rows).
    #[allow(clippy::type_complexity)]
    fn experts_all_tokens(
        &mut self,
        p: &str,
        pm: &str,
        n2: TensorIx,
        sm: &mut Vec<TensorIx>,
    ) -> Result<(TensorIx, Vec<TensorIx>, Option<TensorIx>), PlanError> {
        let (h, c) = (self.h, self.c);
        let t = self.rows();
        let m = self
            .moe
            .ok_or_else(|| PlanError::Invalid("a mixture of experts needs experts".into()))?;
        let (e, fe) = (m.experts, m.expert_ffn);
        let r = prod(&[t, e], "the tokens times the experts")?;
        let logits = self.router_logits(p, pm, n2, t, e)?;
        let index = self.b.push(
            &format!("{p}.moe.index"),
            Role::Activations,
            DType::I64,
            &[t, m.top_k],
            m.top_k.max(1),
        )?;
        let scores = self.b.push(
            &format!("{p}.moe.router_probs"),
            Role::Activations,
            c,
            &[t, e],
            e,
        )?;
        self.b.free(logits);
        let pt = self.dtype(n2);
        let row = |s: &mut Self, n: &str, w: u64| {
            s.b.push(&format!("{p}.moe.{n}"), Role::Activations, pt, &[r, w], w)
        };
        let weights = self.b.push(
            &format!("{p}.moe.weights"),
            Role::Activations,
            c,
            &[r, 1],
            1,
        )?;
        let repeated = row(self, "repeated", h)?;
        let xg = row(self, "scaled", h)?;
        sm.extend([index, scores, weights, repeated, xg]);
        self.consumed(repeated, sm);
        let gu = row(self, "gate_up", 2 * fe)?;
        self.matmul_rows(pm, xg, gu, r, 2 * fe, h);
        let act = row(self, "act", fe)?;
        let prod_ = row(self, "prod", fe)?;
        self.gated_kernels(gu, act, prod_, r.saturating_mul(fe));
        sm.extend([gu, act, prod_]);
        self.consumed(gu, sm);
        self.consumed(act, sm);
        self.consumed(xg, sm);
        let down = row(self, "down", h)?;
        self.matmul_rows(pm, prod_, down, r, h, fe);
        self.consumed(prod_, sm);
        let out = self.hidden_t(&format!("{p}.mlp.out"), Role::Activations, self.dtype(n2))?;
        Ok((out, vec![index, scores, weights], Some(down)))
    }

    /// The shared expert (a SwiGLU over every token) and, where it has one (Qwen2-MoE,
    /// Qwen3-Next), its sigmoid gate [T, 1], whose product saves the expert's output; without
    /// (DeepSeek, GLM-4.5, Llama 4) the output is only added.
    fn shared_expert(
        &mut self,
        p: &str,
        pm: &str,
        n2: TensorIx,
        fs: u64,
        sm: &mut Vec<TensorIx>,
    ) -> Result<(), PlanError> {
        let (h, c) = (self.h, self.c);
        let gate = self.layer.is_none_or(|l| match l.mlp {
            MlpSpec::Moe(e) => e.shared_gate,
            _ => true,
        });
        let mut shared = Vec::new();
        for n in ["shared.gate", "shared.up", "shared.act", "shared.prod"] {
            shared.push(self.rows_t(&format!("{p}.moe.{n}"), Role::Activations, c, fs)?);
        }
        self.matmul(pm, n2, shared[0], fs, h);
        self.matmul(pm, n2, shared[1], fs, h);
        let so = self.hidden_t(&format!("{p}.moe.shared.out"), Role::Activations, c)?;
        self.matmul(pm, shared[3], so, h, fs);
        sm.extend(shared.iter().copied());
        if gate {
            let sg = self.rows_t(&format!("{p}.moe.shared.gate_sig"), Role::Activations, c, 1)?;
            sm.extend([so, sg]);
            shared.extend([so, sg]);
        } else {
            self.b.free(so);
        }
        if !self.saving {
            for x in shared {
                self.consumed(x, sm);
            }
        }
        Ok(())
    }
}
