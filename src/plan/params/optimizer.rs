//! The optimizer step: each piece's update with its implementation's temporaries, then
//! `zero_grad`.

use super::{StateKind, States};
use crate::plan::builder::{Builder, PlanError};
use crate::plan::{DType, Phase, Role, Step};
use crate::workload::{Optimizer, OptimizerImpl, Workload};

impl States {
    /// The optimizer step (phase `Optimizer`): the first step creates the optimizer state; the
    /// update runs per piece with its implementation's temporaries; `zero_grad` then frees the
    /// gradients unless they are kept.
    pub fn optimizer_step(&mut self, b: &mut Builder, w: &Workload) -> Result<(), PlanError> {
        b.phase(Phase::Optimizer);
        let opt_kinds: Vec<StateKind> = self
            .kinds
            .iter()
            .filter(|k| k.role == Role::Optimizer && k.name != "opt.master")
            .cloned()
            .collect();
        let Some(grad_kind) = self.grad_kind() else {
            return Ok(());
        };
        // Pieces whose gradient never appeared (unused parameters) get none now either.
        let n = self.pieces.len();
        for i in 0..n {
            if self.frozen(i) {
                continue;
            }
            let name = self.names[i].clone();
            let ps = &self.pieces[i];
            if ps.grad.is_none() && !ps.grad_in_unit && !self.keep_grads && !self.grads_in_buckets {
                let t = self.alloc_kind(b, &grad_kind, &name, i, w)?;
                self.pieces[i].grad = Some(t);
            }
            if self.first_step {
                for kind in &opt_kinds {
                    let t = self.alloc_kind(b, kind, &name, i, w)?;
                    self.pieces[i].set(kind, t);
                }
            }
        }
        let adam = w.optimizer == Optimizer::Adam;
        let tmp_dtype = opt_kinds.first().map(|k| k.dtype).unwrap_or(DType::F32);
        // Temporaries in the piece's state type (fp32 for adapters over a 16-bit base).
        let tmp_types: Vec<DType> = self
            .defs
            .iter()
            .map(|d| match d.dtype {
                Some(t @ (DType::F32 | DType::F16 | DType::Bf16)) => t,
                _ => tmp_dtype,
            })
            .collect();
        let tmp_of = |b: &mut Builder, i: usize, what: &str, names: &[String], elems: u64| {
            let name = format!("opt.{what}.{}", names[i]);
            b.push(
                &name,
                Role::Workspace,
                tmp_types.get(i).copied().unwrap_or(tmp_dtype),
                &[elems],
                elems.clamp(1, 4096),
            )
        };
        let imp = w.optimizer_impl();
        // lion-pytorch's update (`exp_avg.clone().mul_(b1).add(grad)`) and transformers'
        // Adafactor (`grad**2 + eps`, the approximated second moment times the gradient) hold
        // two temporaries of one parameter tensor at a time, like the for-loop Adam.
        let two_temps = (adam && imp == OptimizerImpl::ForLoop)
            || matches!(w.optimizer, Optimizer::Lion | Optimizer::Adafactor);
        let mut groups: Vec<u8> = self.groups.clone();
        groups.sort_unstable();
        groups.dedup();
        for group in groups {
            let mut foreach_tmps = Vec::new();
            if adam && imp == OptimizerImpl::Foreach {
                // _multi_tensor_adam: exp_avg_sq_sqrt = _foreach_sqrt(exp_avg_sqs), all of the
                // parameter group's at once.
                for i in 0..n {
                    if self.frozen(i) || self.groups.get(i).copied().unwrap_or(0) != group {
                        continue;
                    }
                    let elems = self.pieces[i].elems.div_ceil(self.shard);
                    let t = tmp_of(b, i, "foreach_sqrt", &self.names, elems)?;
                    foreach_tmps.push(t);
                }
            }
            for i in 0..n {
                if self.frozen(i) || self.groups.get(i).copied().unwrap_or(0) != group {
                    continue;
                }
                let mut denom = None;
                if two_temps {
                    // _single_tensor_adam, one parameter tensor at a time: denom =
                    // (exp_avg_sq.sqrt() / bc2).add_(eps): the sqrt and the quotient are alive
                    // together for a moment; the largest tensor of the group sets the peak.
                    let elems = self.pieces[i].largest.max(1).min(self.pieces[i].elems);
                    let elems = elems.div_ceil(self.shard);
                    let sqrt = tmp_of(b, i, "sqrt", &self.names, elems)?;
                    denom = Some(tmp_of(b, i, "denom", &self.names, elems)?);
                    b.free(sqrt);
                }
                let ps = &self.pieces[i];
                if let (Some(g), [m, v]) = (ps.grad, ps.opt.as_slice()) {
                    let p = ps.master.unwrap_or(ps.params);
                    let elems = [p, g, *m, *v]
                        .iter()
                        .map(|&t| b.tensor(t).elems())
                        .min()
                        .unwrap_or(0);
                    b.step(Step::Adam {
                        p,
                        g,
                        m: *m,
                        v: *v,
                        elems,
                    });
                }
                b.free_all(denom);
            }
            b.free_all(foreach_tmps);
        }
        if !self.keep_grads {
            for ps in &mut self.pieces {
                if let Some(g) = ps.grad.take() {
                    b.free(g);
                }
            }
        }
        let held = std::mem::take(&mut self.held_to_end);
        b.free_all(held);
        Ok(())
    }
}
