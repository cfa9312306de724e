//! Gradients as backward reaches each piece: a tied parameter's partial gradients, the
//! gradient's kind, and the transient buffers each gradient takes.

use super::{Piece, StateKind, States};
use crate::plan::builder::{Builder, PlanError};
use crate::plan::{Role, TensorIx};
use crate::workload::Workload;

impl States {
    /// A tied parameter's gradient from one of its uses before the last (the output head of a
    /// tied embedding): autograd holds it in the parameter's input buffer until the last use's
    /// gradient arrives (`gradient`).
    pub fn gradient_part(
        &mut self,
        b: &mut Builder,
        name: &str,
        w: &Workload,
    ) -> Result<(), PlanError> {
        let Some(kind) = self.grad_kind() else {
            return Ok(());
        };
        let Some(i) = self.piece(name) else {
            return Ok(());
        };
        if self.flat || self.frozen(i) {
            return Ok(());
        }
        let part = format!("{}.part", self.names[i]);
        // Not yet a `.grad`: an autograd buffer (workspace) until the sum is made.
        // (Under autocast it becomes `.grad` itself: see `gradient`.)
        let buffer = if self.low.is_some() {
            kind
        } else {
            StateKind {
                role: Role::Workspace,
                ..kind
            }
        };
        let g16 = self.cast_grad(b, i)?;
        let t = self.alloc_kind(b, &buffer, &part, i, w)?;
        self.release_cast(b, g16);
        self.pending.push((i, t));
        Ok(())
    }
    pub(super) fn grad_kind(&self) -> Option<StateKind> {
        self.kinds
            .iter()
            .find(|k| k.role == Role::Gradients)
            .cloned()
    }
    /// Backward reaches piece `name` (its last use): its gradient is computed. With PyTorch's
    /// default the new gradient becomes `.grad` (allocated now, kept until `zero_grad`); when a
    /// gradient already exists (kept gradients) the new one is a temporary added into it in
    /// place. Pending parts of a tied parameter are first summed with it into a new tensor
    /// (measured: three [V, h] live at once at GPT-2's embedding backward).
    pub fn gradient(&mut self, b: &mut Builder, name: &str, w: &Workload) -> Result<(), PlanError> {
        let Some(kind) = self.grad_kind() else {
            return Ok(());
        };
        let Some(i) = self.piece(name) else {
            return Ok(());
        };
        if self.frozen(i) && !self.frozen_in_flat(i) {
            return Ok(());
        }
        let piece = Piece::new(self.names[i].clone(), self.pieces[i].elems);
        if self.flat {
            // DeepSpeed reduces into its flat buffer bucket by bucket: no per-piece temporary.
            return Ok(());
        }
        let g16 = self.cast_grad(b, i)?;
        self.gradient_fp(b, i, &kind, piece, w)?;
        self.release_cast(b, g16);
        Ok(())
    }
    /// `gradient`, with `then` run once the op that makes it has released its inputs: under
    /// autocast between its 16-bit gradient and `ToCopyBackward0`'s fp32 one (the op's node
    /// frees its saved tensors and its incoming gradient first), otherwise after it.
    pub fn gradient_then(
        &mut self,
        b: &mut Builder,
        name: &str,
        w: &Workload,
        then: impl FnOnce(&mut Builder),
    ) -> Result<(), PlanError> {
        let (Some(kind), Some(i)) = (self.grad_kind(), self.piece(name)) else {
            then(b);
            return Ok(());
        };
        if self.flat || (self.frozen(i) && !self.frozen_in_flat(i)) {
            then(b);
            return Ok(());
        }
        let piece = Piece::new(self.names[i].clone(), self.pieces[i].elems);
        let g16 = self.cast_grad(b, i)?;
        if g16.is_some() {
            then(b);
            self.gradient_fp(b, i, &kind, piece, w)?;
        } else {
            self.gradient_fp(b, i, &kind, piece, w)?;
            then(b);
        }
        self.release_cast(b, g16);
        Ok(())
    }
    /// The gradient of piece `i` in the gradients' own type (see `gradient`).
    pub(super) fn gradient_fp(
        &mut self,
        b: &mut Builder,
        i: usize,
        kind: &StateKind,
        piece: Piece,
        w: &Workload,
    ) -> Result<(), PlanError> {
        let parts: Vec<TensorIx> = self
            .pending
            .iter()
            .filter(|(p, _)| *p == i)
            .map(|&(_, t)| t)
            .collect();
        if !parts.is_empty() {
            // The new contribution arrives in a workspace buffer beside the earlier parts.
            self.pending.retain(|(p, _)| *p != i);
            let buffer = StateKind {
                role: Role::Workspace,
                ..kind.clone()
            };
            let new = self.alloc_kind(b, &buffer, &format!("{}.new", piece.name), i, w)?;
            if self.low.is_some() {
                // Under autocast the earlier part is `ToCopyBackward0`'s fresh fp32 output:
                // autograd's input buffer adds the new contribution into it in place
                // (measured: two [V, h] at GPT-2's embedding backward, not three). It becomes
                // `.grad`, or is added into the kept one.
                b.free(new);
                for (j, part) in parts.into_iter().enumerate() {
                    if j == 0 && self.pieces[i].grad.is_none() {
                        self.pieces[i].grad = Some(part);
                    } else {
                        b.free(part);
                    }
                }
                if self.in_backward {
                    return self.stepped_in_backward(b, i, kind, w, self.pieces[i].elems);
                }
                return Ok(());
            }
            let sum = self.alloc_kind(b, kind, &format!("{}.sum", piece.name), i, w)?;
            b.free_all(parts);
            b.free(new);
            if self.in_backward {
                self.pieces[i].grad = Some(sum);
                return self.stepped_in_backward(b, i, kind, w, self.pieces[i].elems);
            }
            if self.pieces[i].grad.is_none() {
                self.pieces[i].grad = Some(sum);
            } else {
                b.free(sum);
            }
            return Ok(());
        }
        if self.grads_in_buckets {
            // DDP's bucket views: the gradient is written into its bucket.
            return Ok(());
        }
        if self.shard > 1 {
            // FSDP: backward makes the unsharded gradient; the unit's reduce-scatter shards it.
            // In the gathered parameters' type (16-bit under FSDP2's mixed precision).
            let full = StateKind {
                role: Role::Workspace,
                dtype: self.gather_dtype.or(self.low).unwrap_or(kind.dtype),
                ..kind.clone()
            };
            let shard = std::mem::replace(&mut self.shard, 1);
            let t = self.alloc_kind(b, &full, &format!("{}.unsharded", piece.name), i, w);
            self.shard = shard;
            self.unsharded.push((i, t?));
            return Ok(());
        }
        if self.in_backward {
            return self.step_in_backward(b, i, kind, w);
        }
        if self.pieces[i].grad.is_none() {
            let t = self.alloc_kind(b, kind, &piece.name, i, w)?;
            self.pieces[i].grad = Some(t);
        } else {
            let t = self.alloc_kind(b, kind, &format!("{}.new", piece.name), i, w)?;
            b.free(t);
        }
        Ok(())
    }
}
