//! Autocast's weight-cast cache: the 16-bit copies of a piece's weights made at their first use
//! in forward, their gradients in backward, and when they go.

use super::{Cast, States};
use crate::plan::builder::{Builder, PlanError};
use crate::plan::{Role, TensorIx};

impl States {
    /// Autocast's cached 16-bit copy of piece `name`'s matmul (or conv) weights, `weight_elems`
    /// of them plus `bias_elems` of biases: made at the piece's first use in forward
    /// (`cached_cast` in PyTorch's `autocast_mode.cpp`: fp32 leaves that require grad are cast
    /// once per autocast region). `last_elems`: the parameters of the piece's first matmul
    /// (backward reaches it last). Returns the weight copy (what the kernels read), or None
    /// without autocast (and under flat ZeRO states, where it is not modelled).
    pub fn cast(
        &mut self,
        b: &mut Builder,
        name: &str,
        (weight_elems, bias_elems, last_elems): (u64, u64, u64),
    ) -> Result<Option<TensorIx>, PlanError> {
        let (Some(low), Some(i)) = (self.low, self.piece(name)) else {
            return Ok(None);
        };
        // A piece used again after its copy was dropped (a checkpointed segment recomputed in
        // backward, under autocast again) is cast anew; its biases' copies go at once then.
        let recast = match self.casts.get(&i) {
            Some(c) if c.weight_live => return Ok(Some(c.weight)),
            Some(_) => true,
            None => false,
        };
        let bias_elems = if recast { 0 } else { bias_elems };
        let rows = |e: u64| e.clamp(1, 4096);
        let weight = b.push(
            &format!("cast.{name}"),
            Role::Workspace,
            low,
            &[weight_elems.max(1)],
            rows(weight_elems),
        )?;
        let bias = if bias_elems > 0 {
            Some(b.push(
                &format!("cast.{name}.bias"),
                Role::Workspace,
                low,
                &[bias_elems],
                rows(bias_elems),
            )?)
        } else {
            None
        };
        self.casts.insert(
            i,
            Cast {
                weight,
                bias,
                weight_live: true,
                last_elems,
            },
        );
        Ok(Some(weight))
    }
    /// Piece `name`'s live 16-bit weight copy, if autocast made one.
    pub fn cast_weight(&self, name: &str) -> Option<TensorIx> {
        let c = self.casts.get(&self.piece(name)?)?;
        c.weight_live.then_some(c.weight)
    }
    /// The autocast region exits (`clear_cache`): cast biases are freed (no backward saves
    /// them); weight copies stay while backward still needs them, except those of the pieces
    /// `unsaved` names (an inference forward, or layers run under no_grad for checkpointing:
    /// no graph saved their copies).
    pub fn autocast_exit(&mut self, b: &mut Builder, unsaved: impl Fn(&str) -> bool) {
        let mut keys: Vec<usize> = self.casts.keys().copied().collect();
        keys.sort_unstable();
        for i in keys {
            let free_weight = unsaved(&self.names[i]);
            let c = self.casts.get_mut(&i).expect("key");
            if let Some(t) = c.bias.take() {
                b.free(t);
            }
            if free_weight && c.weight_live {
                c.weight_live = false;
                b.free(c.weight);
            }
        }
    }
    /// Under autocast, backward through piece `i`'s matmuls. Each matmul's node makes the
    /// 16-bit gradient of its weight copy and then releases its saved variables (the copy);
    /// `ToCopyBackward0` then makes the fp32 gradient from it. Modelled per piece: the copy is
    /// freed, the 16-bit gradient of the piece's last-reached matmul is allocated (returned)
    /// and freed once the fp32 gradient exists (`release_cast`).
    pub(super) fn cast_grad(
        &mut self,
        b: &mut Builder,
        i: usize,
    ) -> Result<Option<TensorIx>, PlanError> {
        let (Some(low), Some(c)) = (self.low, self.casts.get_mut(&i)) else {
            return Ok(None);
        };
        if !c.weight_live {
            return Ok(None);
        }
        let elems = c.last_elems.max(1);
        let name = format!("grad16.{}", self.names[i]);
        let g = b.push(&name, Role::Workspace, low, &[elems], elems.clamp(1, 4096))?;
        c.weight_live = false;
        b.free(c.weight);
        Ok(Some(g))
    }
    pub(super) fn release_cast(&mut self, b: &mut Builder, g16: Option<TensorIx>) {
        if let Some(g) = g16 {
            b.free(g);
        }
    }
}
