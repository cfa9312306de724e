//! Where the caching allocator's segments come from: the [`Device`] it asks, and
//! [`ModelDevice`], a modelled card (what `estimate` replays a plan on).

use super::sizes::ROUND_LARGE;

/// Where segments come from: `cudaMalloc`/`cudaFree`, and for expandable segments address space
/// plus physical pages (`cuMemAddressReserve`, `cuMemCreate` + `cuMemMap`, `cuMemUnmap`).
pub trait Device {
    /// A segment of `size` bytes at some address, or None when the device has no room.
    fn malloc(&mut self, size: u64) -> Option<u64>;
    fn free(&mut self, addr: u64, size: u64);
    /// Reserve `size` bytes of address space (no memory): the base address.
    fn reserve(&mut self, size: u64) -> u64;
    /// Back `[addr, addr + size)` with memory; false when the device has no room.
    fn map(&mut self, addr: u64, size: u64) -> bool;
    fn unmap(&mut self, addr: u64, size: u64);
    /// `totalGlobalMem`: expandable segments reserve 9/8 of it as address space.
    fn total(&self) -> u64;
    /// What `cudaMemGetInfo` would call free.
    fn free_bytes(&self) -> u64;
}

/// A card as the allocator sees it: `capacity` bytes it may take from the driver (the card's
/// total less what lives outside PyTorch), addresses handed out in order.
#[derive(Debug, Clone)]
pub struct ModelDevice {
    pub total: u64,
    pub capacity: u64,
    pub used: u64,
    next: u64,
}

impl ModelDevice {
    pub fn new(total: u64, capacity: u64) -> Self {
        ModelDevice {
            total,
            capacity,
            used: 0,
            next: 1 << 40,
        }
    }
    /// A device with no limit (the reserved curve of a plan on its own).
    pub fn unlimited() -> Self {
        Self::new(1 << 50, u64::MAX)
    }
    fn take(&mut self, size: u64) -> bool {
        match self.used.checked_add(size) {
            Some(u) if u <= self.capacity => {
                self.used = u;
                true
            }
            _ => false,
        }
    }
}

impl Device for ModelDevice {
    fn malloc(&mut self, size: u64) -> Option<u64> {
        if !self.take(size) {
            return None;
        }
        let a = self.next;
        self.next += size.div_ceil(ROUND_LARGE) * ROUND_LARGE;
        Some(a)
    }
    fn free(&mut self, _addr: u64, size: u64) {
        self.used -= size;
    }
    fn reserve(&mut self, size: u64) -> u64 {
        let a = self.next;
        self.next = self
            .next
            .saturating_add(size.div_ceil(ROUND_LARGE) * ROUND_LARGE);
        a
    }
    fn map(&mut self, _addr: u64, size: u64) -> bool {
        self.take(size)
    }
    fn unmap(&mut self, _addr: u64, size: u64) {
        self.used -= size;
    }
    fn total(&self) -> u64 {
        self.total
    }
    fn free_bytes(&self) -> u64 {
        self.capacity.saturating_sub(self.used)
    }
}
