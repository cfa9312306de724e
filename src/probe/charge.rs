//! What a device charges for a plan's tensors: every chunk rounded up to the device's page. The
//! measuring search states capacity in these bytes, so a step that makes some chunk cross a
//! page costs the page it really costs (a params step of 1 MiB split over five 2 GiB chunks
//! can cost five 2 MiB pages).
//!
//! Pages: 2 MiB on a GPU (drivers map device memory in 2 MiB pages), 4 KiB on a CPU adapter
//! (its buffers are host memory, mapped in 4 KiB pages), one 32-bit word under `--budget`
//! (oomprobe's own cap counts words). Suballocation blocks are not modelled: where a device
//! packs small buffers into larger blocks, the search sees it as measurements that disagree.

use serde::{Deserialize, Serialize};

use crate::backend::{DeviceInfo, DeviceType};
use crate::plan::{EventKind, Plan, TensorSpec};
use crate::tensor::{plan_chunks, WORD_BYTES};

/// A GPU's allocation page.
pub const GPU_PAGE: u64 = 2 << 20;
/// A CPU adapter's allocation page.
pub const CPU_PAGE: u64 = 4 << 10;

/// How a device charges buffers: `page` granularity, tensors split at `max_chunk` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Charge {
    pub page: u64,
    pub max_chunk: u64,
}

impl Charge {
    /// The charge of `info`'s device, or of oomprobe's own cap when `budget` is set.
    pub fn of(info: &DeviceInfo, budget: Option<u64>) -> Charge {
        let page = match (budget, info.device_type) {
            (Some(_), _) => WORD_BYTES,
            (None, DeviceType::Cpu) => CPU_PAGE,
            (None, _) => GPU_PAGE,
        };
        Charge {
            page,
            max_chunk: info.max_chunk_bytes(),
        }
    }

    /// One buffer of `bytes`, rounded up to the page.
    pub fn buffer(&self, bytes: u64) -> u64 {
        bytes.max(1).div_ceil(self.page).saturating_mul(self.page)
    }

    /// One tensor: each of its chunks rounded up to the page.
    pub fn tensor(&self, spec: &TensorSpec) -> u64 {
        match plan_chunks(
            spec.elems(),
            spec.dtype.bytes(),
            spec.row_elems,
            self.max_chunk,
        ) {
            Ok(chunks) => chunks
                .iter()
                .fold(0u64, |a, c| a.saturating_add(self.buffer(c.bytes))),
            Err(_) => self.buffer(spec.bytes),
        }
    }

    /// The charged bytes live after each event of `plan`.
    pub fn curve(&self, plan: &Plan) -> Vec<u64> {
        curve_of(plan, &self.tensors(plan))
    }

    /// Every tensor's charge, in the plan's order.
    fn tensors(&self, plan: &Plan) -> Vec<u64> {
        plan.tensors.iter().map(|t| self.tensor(t)).collect()
    }

    /// The most charged bytes live at once.
    pub fn peak(&self, plan: &Plan) -> u64 {
        self.curve(plan).into_iter().max().unwrap_or(0)
    }

    /// The allocation that first reaches the charged peak (the plan's own peak may be another:
    /// small tensors each rounded up to a page weigh more here).
    pub fn peak_event(&self, plan: &Plan) -> usize {
        let curve = self.curve(plan);
        let max = curve.iter().copied().max().unwrap_or(0);
        curve.iter().position(|&c| c == max).unwrap_or(0)
    }

    /// The peak and a signature of every tensor's charge: two plans of one signature are
    /// charged alike (the search bisects between the values where it changes).
    pub fn cost(&self, plan: &Plan) -> (u64, u64) {
        use std::hash::{Hash, Hasher};
        let costs = self.tensors(plan);
        let mut h = std::collections::hash_map::DefaultHasher::new();
        costs.hash(&mut h);
        let peak = curve_of(plan, &costs).into_iter().max().unwrap_or(0);
        (peak, h.finish())
    }

    /// Charged bytes live just before event `i`, and the most live at any point before it.
    pub fn before(&self, plan: &Plan, i: usize) -> (u64, u64) {
        let curve = self.curve(plan);
        let before = &curve[..i.min(curve.len())];
        (
            before.last().copied().unwrap_or(0),
            before.iter().copied().max().unwrap_or(0),
        )
    }
}

/// The bytes live after each event of `plan`, tensor `t` costing `cost[t]`.
fn curve_of(plan: &Plan, cost: &[u64]) -> Vec<u64> {
    let mut live = 0u64;
    plan.events
        .iter()
        .map(|e| {
            match e.kind {
                EventKind::Alloc(t) => live = live.saturating_add(cost[t]),
                EventKind::Free(t) => live = live.saturating_sub(cost[t]),
                EventKind::Kernel(_) => {}
            }
            live
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scenario::Scenario;
    use crate::workload::presets;

    fn gpu(max_chunk: u64) -> Charge {
        Charge {
            page: GPU_PAGE,
            max_chunk,
        }
    }

    #[test]
    fn chunks_are_rounded_to_pages_one_by_one() {
        let w = presets::get("tiny-gpt").unwrap();
        let plan = Plan::for_value(&w, Scenario::Batch, 4).unwrap();
        let t = plan
            .tensors
            .iter()
            .max_by_key(|t| t.bytes)
            .expect("a tensor");
        let whole = gpu(u64::MAX).tensor(t);
        assert_eq!(whole, t.bytes.div_ceil(GPU_PAGE) * GPU_PAGE);
        // Split into chunks of at most 1 MiB: every chunk is charged a whole page.
        let split = gpu(1 << 20).tensor(t);
        let chunks = plan_chunks(t.elems(), t.dtype.bytes(), t.row_elems, 1 << 20).unwrap();
        assert_eq!(split, chunks.len() as u64 * GPU_PAGE);
        // Word pages charge the plan's own bytes.
        let words = Charge {
            page: WORD_BYTES,
            max_chunk: u64::MAX,
        };
        assert_eq!(words.peak(&plan), plan.peak_bytes());
    }

    #[test]
    fn the_curve_and_what_came_before() {
        let w = presets::get("tiny-gpt").unwrap();
        let plan = Plan::for_value(&w, Scenario::Batch, 2).unwrap();
        let c = gpu(u64::MAX);
        let curve = c.curve(&plan);
        assert_eq!(curve.len(), plan.events.len());
        let peak = plan.peak().event;
        let (live, max) = c.before(&plan, peak);
        assert_eq!(live, curve[peak - 1]);
        assert!(max >= live && max <= c.peak(&plan));
        assert_eq!(c.before(&plan, 0), (0, 0));
        assert!(c.peak(&plan) >= plan.peak_bytes());
    }

    #[test]
    fn a_budget_counts_words_and_a_cpu_small_pages() {
        use crate::backend::Backend;
        let mut info = crate::backend::mock::MockBackend::new(1 << 30)
            .info()
            .clone();
        info.device_type = DeviceType::Cpu;
        assert_eq!(Charge::of(&info, None).page, CPU_PAGE);
        assert_eq!(Charge::of(&info, Some(1 << 20)).page, WORD_BYTES);
        info.device_type = DeviceType::Discrete;
        assert_eq!(Charge::of(&info, None).page, GPU_PAGE);
    }
}
