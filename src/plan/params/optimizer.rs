//! The optimizer step: each piece's update with its implementation's temporaries, then
//! `zero_grad`; or, under torchtune's optimizer-in-backward, each piece's update as backward
//! makes its gradient.

use super::{Defer, StateKind, States};
use crate::plan::builder::{Builder, PlanError};
use crate::plan::{DType, Phase, Role, Step, TensorIx};
use crate::workload::{Optimizer, OptimizerImpl, Workload};

impl States {
    /// The optimizer step (phase `Optimizer`): the first step creates the optimizer state; the
    /// update runs per piece with its implementation's temporaries; `zero_grad` then frees the
    /// gradients unless they are kept. Under optimizer-in-backward all of it has run already.
    pub fn optimizer_step(&mut self, b: &mut Builder, w: &Workload) -> Result<(), PlanError> {
        b.phase(Phase::Optimizer);
        let Some(grad_kind) = self.grad_kind() else {
            return Ok(());
        };
        if self.in_backward {
            self.settle(b, w)?;
            let held = std::mem::take(&mut self.held_to_end);
            b.free_all(held);
            return Ok(());
        }
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
                let elems = self.pieces[i].elems;
                self.create_opt_state(b, i, w, elems)?;
            }
        }
        let adam = w.optimizer == Optimizer::Adam;
        let imp = w.optimizer_impl();
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
                    let t = self.temp(b, i, "foreach_sqrt", elems, None)?;
                    foreach_tmps.push(t);
                }
            }
            for i in 0..n {
                if self.frozen(i) || self.groups.get(i).copied().unwrap_or(0) != group {
                    continue;
                }
                self.update(b, i, w)?;
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

    /// Optimizer-in-backward (torchtune's `register_optim_in_bwd_hooks`): backward has just
    /// made piece `i`'s gradient. Its own optimizer steps it (creating its state on the first
    /// step) and `zero_grad` frees it: at once, or at [`States::settle`] after
    /// `gradient_deferred`; `gradient_split` steps the piece's first tensor now and the rest
    /// at `settle`. The hook runs per parameter tensor, so no more than the largest tensor's
    /// gradient is alive at a time: that is what the plan allocates.
    pub(super) fn step_in_backward(
        &mut self,
        b: &mut Builder,
        i: usize,
        kind: &StateKind,
        w: &Workload,
    ) -> Result<(), PlanError> {
        let elems = self.pieces[i].elems.max(1);
        let largest = self.pieces[i].largest.clamp(1, elems);
        match self.defer {
            Defer::No => self.stepped_in_backward(b, i, kind, w, elems),
            Defer::Whole => {
                let name = self.names[i].clone();
                let g = self.alloc_elems(b, kind, &name, i, w, largest)?;
                self.pieces[i].grad = Some(g);
                self.deferred.push((i, elems));
                Ok(())
            }
            Defer::Rest => {
                self.stepped_in_backward(b, i, kind, w, largest)?;
                if elems > largest {
                    self.deferred.push((i, elems - largest));
                }
                Ok(())
            }
        }
    }

    /// `gradient`, whose optimizer-in-backward step waits for [`States::settle`]: autograd
    /// runs a parameter's post-accumulate-grad hook after the node that made its gradient
    /// has finished and freed its inputs (the output head's: the logits' gradient).
    pub fn gradient_deferred(
        &mut self,
        b: &mut Builder,
        name: &str,
        w: &Workload,
    ) -> Result<(), PlanError> {
        self.gradient_with(Defer::Whole, b, name, w)
    }

    /// `gradient` for a layer's block, whose backward makes its output projection's weight
    /// gradient first (`o_proj`, `down_proj`: the piece's largest tensor) and its input
    /// projections' (`q/k/v`, `gate/up`) last: under optimizer-in-backward the first is
    /// stepped now, the rest at [`States::settle`].
    pub fn gradient_split(
        &mut self,
        b: &mut Builder,
        name: &str,
        w: &Workload,
    ) -> Result<(), PlanError> {
        self.gradient_with(Defer::Rest, b, name, w)
    }

    /// `gradient` with its optimizer-in-backward step deferred as `defer` says.
    fn gradient_with(
        &mut self,
        defer: Defer,
        b: &mut Builder,
        name: &str,
        w: &Workload,
    ) -> Result<(), PlanError> {
        self.defer = defer;
        let r = self.gradient(b, name, w);
        self.defer = Defer::No;
        r
    }

    /// Run the optimizer-in-backward steps left waiting.
    pub fn settle(&mut self, b: &mut Builder, w: &Workload) -> Result<(), PlanError> {
        let Some(kind) = self.grad_kind() else {
            return Ok(());
        };
        for (i, part) in std::mem::take(&mut self.deferred) {
            self.stepped_in_backward(b, i, &kind, w, part)?;
        }
        Ok(())
    }

    /// Optimizer-in-backward: `part` elements of piece `i` have their gradient (allocated
    /// here unless it is already): their update runs and `zero_grad` frees it.
    pub(super) fn stepped_in_backward(
        &mut self,
        b: &mut Builder,
        i: usize,
        kind: &StateKind,
        w: &Workload,
        part: u64,
    ) -> Result<(), PlanError> {
        if self.pieces[i].grad.is_none() {
            let largest = self.pieces[i].largest.clamp(1, part.max(1));
            let name = self.names[i].clone();
            let g = self.alloc_elems(b, kind, &name, i, w, largest)?;
            self.pieces[i].grad = Some(g);
        }
        if self.first_step {
            self.create_opt_state(b, i, w, part)?;
        }
        self.update(b, i, w)?;
        if let Some(g) = self.pieces[i].grad.take() {
            b.free(g);
        }
        Ok(())
    }

    /// The first step's lazily created optimizer state of `part` of piece `i`'s elements.
    fn create_opt_state(
        &mut self,
        b: &mut Builder,
        i: usize,
        w: &Workload,
        part: u64,
    ) -> Result<(), PlanError> {
        let kinds: Vec<StateKind> = self
            .kinds
            .iter()
            .filter(|k| k.role == Role::Optimizer && k.name != "opt.master")
            .cloned()
            .collect();
        let name = self.names[i].clone();
        for kind in &kinds {
            let t = self.alloc_part(b, kind, &name, i, w, part)?;
            self.pieces[i].set(kind, t);
        }
        Ok(())
    }

    /// A temporary of the update of piece `i`: `elems` elements of `dtype`, or of the piece's
    /// state type (fp32 for adapters over a 16-bit base).
    fn temp(
        &self,
        b: &mut Builder,
        i: usize,
        what: &str,
        elems: u64,
        dtype: Option<DType>,
    ) -> Result<TensorIx, PlanError> {
        let state = self
            .kinds
            .iter()
            .find(|k| k.role == Role::Optimizer && k.name != "opt.master")
            .map_or(DType::F32, |k| k.dtype);
        let own = match self.defs[i].dtype {
            Some(t @ (DType::F32 | DType::F16 | DType::Bf16)) => t,
            _ => state,
        };
        let name = format!("opt.{what}.{}", self.names[i]);
        let t = b.push(
            &name,
            Role::Workspace,
            dtype.unwrap_or(own),
            &[elems],
            elems.clamp(1, 4096),
        )?;
        // `_foreach_sqrt` makes one tensor per parameter.
        self.per_parameter(b, t, i);
        Ok(t)
    }

    /// Piece `i`'s update, one parameter tensor at a time where the implementation loops: its
    /// temporaries alive at once, sized by the piece's largest tensor.
    fn update(&mut self, b: &mut Builder, i: usize, w: &Workload) -> Result<(), PlanError> {
        let imp = w.optimizer_impl();
        let largest = self.pieces[i].largest.max(1).min(self.pieces[i].elems);
        let elems = largest.div_ceil(self.shard);
        let mut temps = Vec::new();
        match w.optimizer {
            // transformers' Adafactor, per parameter (`optimization.py:1215-1290`): a 16-bit
            // gradient and parameter are stepped as fp32 copies (`grad.float()`,
            // `p.float()`); `update = grad**2 + eps`, then the approximated second moment
            // (`_approx_sq_grad`, or `exp_avg_sq.rsqrt()` for 1-D) is made while `update`
            // is still held, then multiplied by the gradient in place.
            Optimizer::Adafactor | Optimizer::AdafactorBeta1 => {
                let sixteen = self.param_dtype(i).is_some_and(|d| d != DType::F32);
                let f32 = Some(DType::F32);
                if sixteen {
                    temps.push(self.temp(b, i, "grad_fp32", elems, f32)?);
                    temps.push(self.temp(b, i, "param_fp32", elems, f32)?);
                }
                let update = self.temp(b, i, "update", elems, f32)?;
                temps.push(self.temp(b, i, "approx", elems, f32)?);
                b.free(update);
            }
            // _single_tensor_adam: denom = (exp_avg_sq.sqrt() / bc2).add_(eps): the sqrt
            // and the quotient are alive together for a moment. lion-pytorch's update
            // (`exp_avg.clone().mul_(b1).add(grad)`) holds two as well.
            // One parameter's own foreach Adam (optimizer-in-backward): `_foreach_sqrt` of its
            // second moment.
            Optimizer::Adam if imp == OptimizerImpl::Foreach && self.in_backward => {
                temps.push(self.temp(b, i, "foreach_sqrt", elems, None)?);
            }
            o if o == Optimizer::Lion
                || (o == Optimizer::Adam && imp == OptimizerImpl::ForLoop) =>
            {
                let sqrt = self.temp(b, i, "sqrt", elems, None)?;
                temps.push(self.temp(b, i, "denom", elems, None)?);
                b.free(sqrt);
            }
            // transformers' AdamW: `denom = exp_avg_sq.sqrt().add_(eps)`, in place after the
            // sqrt; `addcdiv_` and the decoupled weight decay write the parameter in place.
            Optimizer::Adam if imp == OptimizerImpl::Transformers => {
                temps.push(self.temp(b, i, "denom", elems, None)?);
            }
            _ => {}
        }
        let ps = &self.pieces[i];
        if let (Optimizer::Adam, Some(g), [m, v]) = (w.optimizer, ps.grad, ps.opt.as_slice()) {
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
        b.free_all(temps);
        Ok(())
    }

    /// The element type of piece `i`'s parameters as the optimizer sees them (its master
    /// copy's under mixed precision).
    fn param_dtype(&self, i: usize) -> Option<DType> {
        let ps = &self.pieces[i];
        Some(self.kinds.iter().find(|k| k.role == Role::Params)?.dtype).map(|d| {
            match (ps.master, self.defs[i].dtype) {
                (Some(_), _) => DType::F32,
                (None, Some(own)) => own,
                (None, None) => d,
            }
        })
    }
}
