//! The kernels a probe will launch, found by a dry run of its plan on a backend that allocates
//! nothing, so they can be compiled before the tensors fill memory.

use std::collections::BTreeSet;

use crate::backend::{AllocError, Backend, BackendError, BufferId, DeviceInfo, MemoryInfo};
use crate::kernels::{KernelId, Op};
use crate::plan::Plan;
use crate::tensor;

use super::Compute;

/// A backend that hands out buffer ids without memory and records every kernel launched.
struct Recorder {
    info: DeviceInfo,
    next: u64,
    /// Labels of the kernels seen (`KernelId` is not `Ord`; its label is a stable key).
    seen: BTreeSet<String>,
    kernels: Vec<KernelId>,
}

impl Backend for Recorder {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }
    fn memory(&self) -> MemoryInfo {
        MemoryInfo::default()
    }
    fn alloc_buffer(&mut self, _bytes: u64) -> Result<BufferId, AllocError> {
        self.next += 1;
        Ok(BufferId(self.next))
    }
    fn free_buffer(&mut self, _id: BufferId) {}
    fn write_buffer(&mut self, _: BufferId, _: u64, _: &[u8]) -> Result<(), BackendError> {
        Ok(())
    }
    fn read_buffer(&mut self, _: BufferId, _: u64, len: u64) -> Result<Vec<u8>, BackendError> {
        Ok(vec![0; len.min(1 << 20) as usize])
    }
    fn dispatch(
        &mut self,
        kernel: KernelId,
        _params: &[u8],
        _buffers: &[BufferId],
        _workgroups: [u32; 3],
    ) -> Result<(), BackendError> {
        if self.seen.insert(kernel.label()) {
            self.kernels.push(kernel);
        }
        Ok(())
    }
    fn synchronize(&mut self) -> Result<(), BackendError> {
        Ok(())
    }
    fn allocated_bytes(&self) -> u64 {
        0
    }
}

/// Every kernel a probe of `plan` launches in `compute` mode on a device like `info`: the word
/// kernels (fill, verify, checksum) and, in full mode, those of each plan step.
pub fn kernels_of(plan: &Plan, compute: Compute, info: &DeviceInfo) -> Vec<KernelId> {
    let mut kernels: Vec<KernelId> = [Op::Fill, Op::Verify, Op::Checksum]
        .into_iter()
        .map(KernelId::words)
        .collect();
    if compute == Compute::Full {
        let mut rec = Recorder {
            info: info.clone(),
            next: 0,
            seen: BTreeSet::new(),
            kernels: Vec::new(),
        };
        let tensors: Vec<_> = plan
            .tensors
            .iter()
            .filter_map(|t| tensor::allocate_tensor(&mut rec, t).ok())
            .collect();
        if tensors.len() == plan.tensors.len() {
            for step in &plan.steps {
                // A step the dry run cannot follow fails the same way on the device.
                let _ = crate::ops::compute::run_step(&mut rec, step, &tensors);
            }
        }
        kernels.extend(rec.kernels);
    }
    kernels
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::scenario::Scenario;

    #[test]
    fn a_transformer_plan_needs_its_step_kernels_once_each() {
        let w = crate::workload::presets::get("tiny-gpt").unwrap();
        let plan = Plan::for_value(&w, Scenario::Batch, 2).unwrap();
        let info = crate::backend::mock::MockBackend::new(1 << 30)
            .info()
            .clone();
        let touch = kernels_of(&plan, Compute::Touch, &info);
        assert_eq!(touch.len(), 3);
        let full = kernels_of(&plan, Compute::Full, &info);
        let ops: Vec<Op> = full.iter().map(|k| k.op).collect();
        for op in [Op::Matmul, Op::LayerNorm, Op::Adam] {
            assert!(ops.contains(&op), "{op:?} missing from {ops:?}");
        }
        let mut labels: Vec<String> = full.iter().map(|k| k.label()).collect();
        let n = labels.len();
        labels.sort();
        labels.dedup();
        assert_eq!(labels.len(), n, "no kernel twice");
    }
}
