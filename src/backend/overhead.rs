//! Measures what a device holds before the first tensor: free memory once it is open, then
//! again after every kernel is loaded and launched once (`Backend::warm_up`).
//!
//! A CUDA context costs 0.1-0.6 GB and grows at the first launch of a kernel that needs local
//! memory (sized for every thread the card can hold), so a prediction made against the free
//! memory of a bare context is too high by that much. `cuMemGetInfo` needs a context, so the
//! cost of the context itself is only known as total − free (which also counts other
//! processes' memory). Where the API tells no free memory (wgpu) nothing is measured.

use super::{Backend, BackendError, DeviceInfo};

/// Free memory before and after the warm-up.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Overhead {
    pub total: u64,
    /// Free once the device is open (context created, nothing loaded).
    pub free_open: u64,
    /// Free after every kernel was loaded and launched once.
    pub free_warm: u64,
}

impl Overhead {
    /// total − free after the warm-up: everything tensors cannot have.
    pub fn overhead_bytes(&self) -> u64 {
        self.total.saturating_sub(self.free_warm)
    }
    /// What the kernels (modules, first-launch local memory) took.
    pub fn kernel_bytes(&self) -> u64 {
        self.free_open.saturating_sub(self.free_warm)
    }
}

/// Warms the backend up and measures around it. `Ok(None)` where the API tells no free memory
/// (then nothing is loaded either). Buffers the backend holds count as used, so call it on a
/// freshly opened device.
pub fn measure(backend: &mut dyn Backend) -> Result<Option<Overhead>, BackendError> {
    let before = backend.memory();
    let (Some(total), Some(free_open)) = (before.total_bytes, before.free_bytes) else {
        return Ok(None);
    };
    backend.warm_up()?;
    backend.synchronize()?;
    let free_warm = backend.memory().free_bytes.unwrap_or(free_open);
    Ok(Some(Overhead {
        total,
        free_open,
        free_warm,
    }))
}

/// `info` with the measured overhead: `overhead_bytes`, `kernel_overhead_bytes`, and
/// `memory_free_bytes` as free after the warm-up (what a prediction is made against).
pub fn apply(mut info: DeviceInfo, overhead: Option<Overhead>) -> DeviceInfo {
    if let Some(o) = overhead {
        info.memory_total_bytes = Some(o.total);
        info.memory_free_bytes = Some(o.free_warm);
        info.overhead_bytes = Some(o.overhead_bytes());
        info.kernel_overhead_bytes = Some(o.kernel_bytes());
    }
    info
}

/// Measures a freshly opened backend and returns its info with the overhead (see [`apply`]).
pub fn measured_info(backend: &mut dyn Backend) -> Result<DeviceInfo, BackendError> {
    let overhead = measure(backend)?;
    Ok(apply(backend.info().clone(), overhead))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::mock::MockBackend;

    const MIB: u64 = 1 << 20;

    #[test]
    fn context_and_kernel_costs_are_measured_and_predictions_use_what_is_left() {
        let mut m = MockBackend::new(1024 * MIB).with_overhead(300 * MIB, 120 * MIB);
        // Open: the context is there, the kernels are not.
        assert_eq!(m.memory().free_bytes, Some(724 * MIB));
        let info = measured_info(&mut m).expect("measured");
        assert_eq!(info.overhead_bytes, Some(420 * MIB));
        assert_eq!(info.kernel_overhead_bytes, Some(120 * MIB));
        assert_eq!(info.memory_free_bytes, Some(604 * MIB));
        assert_eq!(info.memory_total_bytes, Some(1024 * MIB));
        // (probe::capacity's tests: the prediction is made against what is left.)
    }

    #[test]
    fn what_fits_after_the_warm_up_is_what_was_measured() {
        let mut m = MockBackend::with_limits(64 * MIB, 64 * MIB, 64 * MIB).with_overhead(MIB, MIB);
        let info = measured_info(&mut m).expect("measured");
        let free = info.memory_free_bytes.expect("free");
        assert_eq!(free, 62 * MIB);
        let id = m.alloc_buffer(free).expect("all of free fits");
        assert!(m.alloc_buffer(4).is_err(), "nothing beyond it");
        m.free_buffer(id);
    }

    #[test]
    fn no_free_memory_means_no_overhead() {
        struct Blind(MockBackend);
        impl Backend for Blind {
            fn info(&self) -> &DeviceInfo {
                self.0.info()
            }
            fn memory(&self) -> crate::backend::MemoryInfo {
                crate::backend::MemoryInfo {
                    total_bytes: Some(1 << 30),
                    free_bytes: None,
                }
            }
            fn alloc_buffer(
                &mut self,
                bytes: u64,
            ) -> Result<crate::backend::BufferId, crate::backend::AllocError> {
                self.0.alloc_buffer(bytes)
            }
            fn free_buffer(&mut self, id: crate::backend::BufferId) {
                self.0.free_buffer(id)
            }
            fn write_buffer(
                &mut self,
                id: crate::backend::BufferId,
                offset: u64,
                data: &[u8],
            ) -> Result<(), BackendError> {
                self.0.write_buffer(id, offset, data)
            }
            fn read_buffer(
                &mut self,
                id: crate::backend::BufferId,
                offset: u64,
                len: u64,
            ) -> Result<Vec<u8>, BackendError> {
                self.0.read_buffer(id, offset, len)
            }
            fn dispatch(
                &mut self,
                kernel: crate::kernels::KernelId,
                params: &[u8],
                buffers: &[crate::backend::BufferId],
                workgroups: [u32; 3],
            ) -> Result<(), BackendError> {
                self.0.dispatch(kernel, params, buffers, workgroups)
            }
            fn synchronize(&mut self) -> Result<(), BackendError> {
                self.0.synchronize()
            }
            fn allocated_bytes(&self) -> u64 {
                self.0.allocated_bytes()
            }
            fn warm_up(&mut self) -> Result<(), BackendError> {
                panic!("not warmed up where nothing can be measured")
            }
        }
        let mut b = Blind(MockBackend::new(MIB));
        let info = measured_info(&mut b).expect("measured");
        assert_eq!(info.overhead_bytes, None);
        assert_eq!(info.kernel_overhead_bytes, None);
        assert_eq!(info.memory_free_bytes, Some(MIB));
    }

    #[test]
    fn a_failed_warm_up_is_an_error_not_a_number() {
        let mut m = MockBackend::new(64 * MIB).with_overhead(MIB, MIB);
        m.lose_device("gone");
        assert!(matches!(
            measured_info(&mut m),
            Err(BackendError::DeviceLost(_))
        ));
    }
}
