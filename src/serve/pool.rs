//! The plan `probe --mode serve` replays: the profiling forward (weights kept), then the KV
//! block pool, one tensor per layer per round of blocks, as far as the whole card would take it.

use serde::Serialize;

use super::{size_with, ServeSizing};
use crate::plan::build::PlanError;
use crate::plan::{DType, Event, EventKind, Phase, Plan, Role, TensorSpec};
use crate::workload::Workload;

/// Rounds the pool is allocated in at most: the measured block count is a multiple of the
/// round's blocks (vLLM allocates one `page × blocks` tensor per layer at once).
pub const MAX_ROUNDS: u64 = 64;

/// Where the pool sits in the probe plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct Pool {
    /// The first event of the pool (every event before it is the profiling forward).
    pub first_event: usize,
    pub rounds: u64,
    pub blocks_per_round: u64,
    pub layers: u64,
    /// Blocks the card's total holds after the weights, by the plan's bytes.
    pub cap_blocks: u64,
}

impl Pool {
    /// Whole rounds the device held when the plan stopped before event `failed` (None: all).
    pub fn blocks_held(&self, failed: Option<usize>) -> u64 {
        let rounds = match failed {
            None => self.rounds,
            Some(e) if e < self.first_event => 0,
            Some(e) => ((e - self.first_event) as u64 / self.layers).min(self.rounds),
        };
        rounds * self.blocks_per_round
    }
}

/// The probe plan of serving workload `w` on a card of `total` bytes: the profiling forward,
/// then rounds of KV blocks up to what `total` minus the weights holds (past vLLM's own count,
/// so the device's refusal, not the arithmetic, ends it).
pub fn probe_plan(w: &Workload, total: u64) -> Result<(Plan, ServeSizing, Pool), PlanError> {
    // Nothing outside the plan's tensors grows on a probe's device: no Δnon_torch.
    let (z, mut plan) = size_with(w, total, 0)?;
    let per_block = z.page_bytes_per_layer * z.layers;
    let room = total.saturating_sub(z.weights_bytes);
    let cap = room.checked_div(per_block).unwrap_or(0);
    let k = cap.div_ceil(MAX_ROUNDS).max(1);
    let rounds = cap.div_ceil(k).max(1);
    let dtype = if z.kv_dtype_bytes == 1 {
        DType::U8
    } else {
        DType::Bf16
    };
    let row = z.page_bytes_per_layer / z.kv_dtype_bytes;
    let first_event = plan.events.len();
    for r in 0..rounds {
        for l in 0..z.layers {
            plan.tensors.push(TensorSpec {
                name: format!("kv_pool.L{l}.round{r}"),
                role: Role::Attention,
                dtype,
                shape: vec![k, row],
                bytes: k * z.page_bytes_per_layer,
                row_elems: row,
                stream: Default::default(),
                part_bytes: 0,
            });
            plan.events.push(Event {
                phase: Phase::Forward,
                kind: EventKind::Alloc(plan.tensors.len() - 1),
            });
        }
    }
    plan.notes.push(format!(
        "KV pool: {rounds} rounds of {k} blocks per layer after the profiling forward"
    ));
    let pool = Pool {
        first_event,
        rounds,
        blocks_per_round: k,
        layers: z.layers,
        cap_blocks: cap,
    };
    Ok((plan, z, pool))
}
