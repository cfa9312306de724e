//! The MLP blocks: GELU (fused or transformers' `gelu_new`), gated (SwiGLU, GeGLU, fused
//! gate-up) and a mixture of experts as transformers 5.24 dispatches it.

use super::lora::Proj;
use super::T;
use crate::plan::autocast;
use crate::plan::build::{prod, PlanError};
use crate::plan::params::param_dtype;
use crate::plan::{DType, Role, Step, TensorIx};
use crate::workload::layers::MlpSpec;
use crate::workload::{Gelu, Target};

impl T<'_> {
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
            sm.push(fc1);
            let gelu = self.wide(&format!("{p}.gelu.out"))?;
            sm.push(gelu);
            self.b.step(Step::Gelu {
                x: fc1,
                y: gelu,
                elems,
            });
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
        if self.frozen() && !sm.contains(&n2) && !self.parallel_block() {
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

    /// A sparse mixture of experts over `n2` as transformers 5.24 runs it by default
    /// (`grouped_mm_experts_forward`): the router's logits and fp32 probabilities [T, E], top-k
    /// indices; the tokens gathered by expert [T·k, h]; gate-up [T·k, 2f], act and product
    /// [T·k, f], the down output [T·k, h] weighted by the routing weights; the sort, gather and
    /// inverse-permutation indices (int64). A shared expert (Qwen2-MoE) runs over every token.
    pub(super) fn mlp_moe(
        &mut self,
        p: &str,
        pm: &str,
        n2: TensorIx,
        sm: &mut Vec<TensorIx>,
    ) -> Result<TensorIx, PlanError> {
        let (h, c) = (self.h, self.c);
        let m = self
            .moe
            .ok_or_else(|| PlanError::Invalid("a mixture of experts needs experts".into()))?;
        let t = self.rows();
        let (s_rows, fe) = self.routed()?;
        let e = m.experts;
        let logits = self.b.push(
            &format!("{p}.moe.router_logits"),
            Role::Activations,
            c,
            &[t, e],
            e,
        )?;
        self.matmul_rows(pm, n2, logits, t, e, h);
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
        let act = row(self, "act", pt, fe)?;
        let prod_ = row(self, "prod", pt, fe)?;
        let elems = s_rows.saturating_mul(fe);
        self.gated_kernels(gu, act, prod_, elems);
        sm.extend([xg, gu, act, prod_]);
        // The gate's halves and act go with `_apply_gate`; the product after the down
        // projection, which the weighting replaces; the gathered tokens when the experts'
        // function returns.
        self.consumed(gu, sm);
        self.consumed(act, sm);
        let down = row(self, "down", pt, h)?;
        self.matmul_rows(pm, prod_, down, s_rows, h, fe);
        sm.push(down);
        self.consumed(prod_, sm);
        let weighted = row(self, "weighted", pt, h)?;
        self.consumed(down, sm);
        let out = self.hidden_t(&format!("{p}.mlp.out"), Role::Activations, self.dtype(n2))?;
        self.b.free(weighted);
        self.consumed(xg, sm);
        if m.shared_ffn > 0 {
            // The shared expert (a SwiGLU over every token) and, where it has one (Qwen2-MoE,
            // Qwen3-Next), its sigmoid gate [T, 1], whose product saves the expert's output;
            // without (DeepSeek, GLM-4.5, Llama 4) the output is only added.
            let gate = self.layer.is_none_or(|l| match l.mlp {
                MlpSpec::Moe(e) => e.shared_gate,
                _ => true,
            });
            let fs = m.shared_ffn;
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
                let sg =
                    self.rows_t(&format!("{p}.moe.shared.gate_sig"), Role::Activations, c, 1)?;
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
        }
        for x in [probs, index, weights] {
            self.consumed(x, sm);
        }
        self.consumed(n2, sm);
        Ok(out)
    }
}
