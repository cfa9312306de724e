//! Model states under data parallelism and FSDP: DDP's reducer buckets, FSDP's reduce-scatter
//! of each unit's gradients, and the gradient copies held to the step's end.

use super::{StateKind, States};
use crate::plan::builder::{Builder, PlanError};
use crate::plan::Role;
use crate::workload::Workload;

impl States {
    /// DDP's reducer buckets, made when the model is wrapped: one flat buffer per bucket of
    /// about `mb` MiB, together as large as every trainable gradient (measured on CPU over
    /// gloo: 27 469 904 B of buckets beside 27 468 800 B of fp32 parameters). With
    /// `gradient_as_bucket_view` the gradients are views into them.
    pub(super) fn ddp_buckets(
        &mut self,
        b: &mut Builder,
        w: &Workload,
        mb: u64,
    ) -> Result<(), PlanError> {
        let Some(kind) = self.grad_kind() else {
            return Ok(());
        };
        let trainable = (0..self.defs.len()).filter(|&i| !self.frozen(i)).count() as u64;
        let elems: u64 = (0..self.defs.len())
            .filter(|&i| !self.frozen(i))
            .map(|i| self.defs[i].elems)
            .fold(0u64, |a, e| a.saturating_add(e));
        let bucket = mb.saturating_mul(1 << 20) / kind.dtype.bytes().max(1);
        // A bucket holds whole parameters (one larger than the cap gets its own): never more
        // buckets than trainable tensors, whatever the cap.
        let n = elems.div_ceil(bucket.max(1)).min(trainable.max(1)).max(1);
        let mut left = elems;
        for k in 0..n {
            let e = if k + 1 == n { left } else { left.min(bucket) }.max(1);
            left = left.saturating_sub(e);
            b.push(
                &format!("ddp.bucket{k}"),
                Role::Gradients,
                kind.dtype,
                &[e],
                e.clamp(1, 4096),
            )?;
        }
        let _ = w;
        Ok(())
    }
    /// FSDP2's backward is finalized: the last reduce-scatter input goes.
    pub fn fsdp_finalize(&mut self, b: &mut Builder) {
        if let Some(t) = self.rs_kept.take() {
            b.free(t);
        }
    }
    /// A copy of piece `name`'s gradient held from now to the step's end: under tensor
    /// parallelism a vocabulary-split embedding's local gradient is there twice through the
    /// optimizer step (measured over gloo on two models, `tests/fixtures/distributed*.json`;
    /// which reference keeps the second one is not traced).
    pub fn hold_until_end(
        &mut self,
        b: &mut Builder,
        name: &str,
        w: &Workload,
    ) -> Result<(), PlanError> {
        let (Some(kind), Some(i)) = (self.grad_kind(), self.piece(name)) else {
            return Ok(());
        };
        if self.frozen(i) {
            return Ok(());
        }
        let held = StateKind {
            role: Role::Workspace,
            ..kind
        };
        let t = self.alloc_kind(b, &held, &format!("{name}.grad_copy"), i, w)?;
        self.held_to_end.push(t);
        Ok(())
    }
    /// FSDP's reduce-scatter after a unit's backward (`pieces` named): the unit's unsharded
    /// gradients are copied into one flat input and freed, the scattered output (1/shard of
    /// it) holds the sharded gradients (added into kept ones), the input goes.
    pub fn fsdp_reduce(&mut self, b: &mut Builder, pieces: &[String]) -> Result<(), PlanError> {
        if self.shard <= 1 && self.unsharded.is_empty() {
            return Ok(());
        }
        let Some(kind) = self.grad_kind() else {
            return Ok(());
        };
        let ids: Vec<usize> = pieces.iter().filter_map(|n| self.piece(n)).collect();
        let (mine, rest): (Vec<_>, Vec<_>) =
            self.unsharded.drain(..).partition(|(i, _)| ids.contains(i));
        self.unsharded = rest;
        if mine.is_empty() {
            return Ok(());
        }
        let full: u64 = mine
            .iter()
            .map(|&(i, _)| self.defs[i].elems)
            .fold(0u64, |a, e| a.saturating_add(e));
        let unit = &self.names[mine[0].0];
        // FSDP1 (`_flat_param.py`): the unit's parameters are views of one flat parameter, so
        // autograd concatenates their gradients (`SplitWithSizesBackward0`'s `cat`) into one
        // flat gradient in the gathered type; under mixed precision the post-backward hook
        // casts it to the reduce type (a second full copy) before the reduce-scatter
        // (`_runtime_utils.py` `_post_backward_hook`, `_reduce_grad`).
        let cat = if self.fsdp1 {
            let dt = self.gather_dtype.unwrap_or(kind.dtype);
            let t = b.push(
                &format!("fsdp.flat_grad.{unit}"),
                Role::Workspace,
                dt,
                &[full.max(1)],
                full.clamp(1, 4096),
            )?;
            for &(_, g) in &mine {
                b.free(g);
            }
            Some(t)
        } else {
            None
        };
        let input = match cat {
            Some(t) if b.tensor(t).dtype == kind.dtype => t,
            _ => b.push(
                &format!("fsdp.rs_input.{unit}"),
                Role::Workspace,
                kind.dtype,
                &[full.max(1)],
                full.clamp(1, 4096),
            )?,
        };
        if cat.is_none() {
            for &(_, g) in &mine {
                b.free(g);
            }
        }
        let out_elems = full.div_ceil(self.shard);
        let out = b.push(
            &format!("grads.{unit}.shard"),
            kind.role,
            kind.dtype,
            &[out_elems.max(1)],
            out_elems.clamp(1, 4096),
        )?;
        b.on_stream(out, crate::plan::Stream::ReduceScatter);
        if let Some(t) = cat {
            // FSDP1: the flat gradient (and its cast) go when the post-backward hook returns.
            if t != input {
                b.free(input);
            }
            b.free(t);
        } else if let Some(prev) = self.rs_kept.replace(input) {
            // FSDP2 keeps a unit's reduce-scatter input until the next unit's reduce-scatter
            // has been waited on; the last one until the backward is finalized
            // (`finalize_backward`).
            b.free(prev);
        }
        // The scattered output is the sharded `.grad`s of the whole unit (views into it); a
        // kept gradient takes it in place.
        let first = mine[0].0;
        let existing = mine.iter().any(|&(i, _)| self.pieces[i].grad.is_some());
        if existing {
            b.free(out);
        } else {
            self.pieces[first].grad = Some(out);
            for &(i, _) in &mine[1..] {
                self.pieces[i].grad_in_unit = true;
            }
        }
        Ok(())
    }
}
