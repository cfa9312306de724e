//! A Backend wrapper that emulates a smaller card: every byte requested counts against a cap.
//!
//! The cap is checked before the inner backend is asked, so a refusal past the budget is
//! `AllocError::Budget` and never touches the device; freeing releases the bytes. Bytes are
//! counted as requested (rounded up to whole 32-bit words, as every backend allocates).

use std::collections::HashMap;

use super::{AllocError, Backend, BackendError, BufferId, DeviceInfo, HeapUsage, MemoryInfo};
use crate::kernels::KernelId;

/// Any backend, limited to `budget` bytes of live buffers.
pub struct BudgetBackend<B: Backend + ?Sized = dyn Backend> {
    inner: Box<B>,
    budget: u64,
    used: u64,
    peak: u64,
    sizes: HashMap<BufferId, u64>,
}

impl<B: Backend + ?Sized> BudgetBackend<B> {
    pub fn new(inner: Box<B>, budget: u64) -> Self {
        BudgetBackend {
            inner,
            budget,
            used: 0,
            peak: 0,
            sizes: HashMap::new(),
        }
    }
    /// The cap in bytes.
    pub fn budget(&self) -> u64 {
        self.budget
    }
    /// Bytes counted against the cap right now.
    pub fn used(&self) -> u64 {
        self.used
    }
    /// The most bytes ever counted at once.
    pub fn peak(&self) -> u64 {
        self.peak
    }
    /// The wrapped backend.
    pub fn inner(&self) -> &B {
        &self.inner
    }
    pub fn inner_mut(&mut self) -> &mut B {
        &mut self.inner
    }
    pub fn into_inner(self) -> Box<B> {
        self.inner
    }
}

impl<B: Backend + ?Sized> Backend for BudgetBackend<B> {
    super::forward_to_inner!(inner);

    fn info(&self) -> &DeviceInfo {
        self.inner.info()
    }

    /// The budget as the total, clipped by what the device tells.
    fn memory(&self) -> MemoryInfo {
        let m = self.inner.memory();
        let free = self.budget.saturating_sub(self.used);
        MemoryInfo {
            total_bytes: Some(m.total_bytes.map_or(self.budget, |t| t.min(self.budget))),
            free_bytes: Some(m.free_bytes.map_or(free, |f| f.min(free))),
        }
    }

    fn alloc_buffer(&mut self, bytes: u64) -> Result<BufferId, AllocError> {
        let counted = bytes.div_ceil(4).max(1) * 4;
        if self.used.saturating_add(counted) > self.budget {
            return Err(AllocError::Budget {
                requested: counted,
                budget: self.budget,
                used: self.used,
            });
        }
        let id = self.inner.alloc_buffer(bytes)?;
        self.used += counted;
        self.peak = self.peak.max(self.used);
        self.sizes.insert(id, counted);
        Ok(id)
    }

    fn free_buffer(&mut self, id: BufferId) {
        if let Some(n) = self.sizes.remove(&id) {
            self.used -= n;
        }
        self.inner.free_buffer(id);
    }

    fn allocated_bytes(&self) -> u64 {
        self.inner.allocated_bytes()
    }

    /// A view costs nothing: its parent was counted.
    fn view_buffer(&mut self, parent: BufferId, offset: u64, bytes: u64) -> Option<BufferId> {
        self.inner.view_buffer(parent, offset, bytes)
    }

    fn allocator_stats(&self) -> Option<crate::alloc::Stats> {
        self.inner.allocator_stats()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::mock::MockBackend;

    #[test]
    fn refuses_past_the_cap_and_releases_on_free() {
        let mut b: BudgetBackend = BudgetBackend::new(Box::new(MockBackend::new(1 << 20)), 1000);
        let a = b.alloc_buffer(600).unwrap();
        let e = b.alloc_buffer(401).unwrap_err();
        assert_eq!(
            e,
            AllocError::Budget {
                requested: 404,
                budget: 1000,
                used: 600
            }
        );
        // The refused request never reached the device.
        assert_eq!(b.inner().allocated_bytes(), 600);
        let c = b.alloc_buffer(400).unwrap();
        assert_eq!(b.used(), 1000);
        b.free_buffer(a);
        b.free_buffer(c);
        assert_eq!(b.used(), 0);
        assert_eq!(b.peak(), 1000);
        assert!(b.alloc_buffer(1000).is_ok());
    }

    #[test]
    fn device_oom_below_the_cap_passes_through() {
        let mut b = BudgetBackend::new(Box::new(MockBackend::new(100)), 1000);
        let e = b.alloc_buffer(200).unwrap_err();
        assert!(matches!(e, AllocError::OutOfMemory { .. }));
        assert_eq!(b.used(), 0);
        assert_eq!(b.memory().total_bytes, Some(100));
    }

    #[test]
    fn freeing_an_unknown_id_is_a_no_op() {
        let mut b = BudgetBackend::new(Box::new(MockBackend::new(100)), 100);
        b.free_buffer(BufferId(77));
        assert_eq!(b.used(), 0);
    }
}
