//! A modelled lavapipe under an address-space limit, as traced with `OOMPROBE_AS_TRACE`
//! (validation/search/2026-12-02): wgpu's allocator (gpu-allocator 0.28, host memory under
//! `MemoryHints::MemoryUsage`) suballocates a buffer no larger than its block size from host
//! blocks of 4 MiB doubling with each general block to 32 MiB, trying the blocks in the highest
//! slot first and the best fit inside one; a new block takes the highest free slot (or a new
//! one); a larger buffer is mapped on its own. Every mapping costs its size in 4 KiB pages plus
//! 8 KiB (lavapipe's memory is host `malloc`, mapped on its own under oomprobe's fixed mmap
//! threshold). A block emptied is unmapped unless it is the last general one. The device opens
//! with 738 MiB of the address space mapped (672 MiB before the probe ran on a thread of its
//! own, whose glibc arena and stack take 66 MiB: `probe::hostmem`) and its first block holding
//! wgpu's and oomprobe's own 2 MiB. A real step also maps what it holds besides its tensors
//! (1.5-2.1 MiB measured on the final build, 0.7-1.0 MiB before the reserve was measured once
//! the process had settled: 2 MiB here), a replay does not.

use std::collections::HashMap;

use oomprobe::backend::{
    AllocError, Backend, BackendError, BackendKind, BufferId, DeviceInfo, DeviceType, MemoryInfo,
};
use oomprobe::kernels::KernelId;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;
const PAGE: u64 = 4 * KIB;
/// What a mapping costs besides its pages.
const MAP_EXTRA: u64 = 8 * KIB;
/// Mapped once the device is open: the process, Mesa, LLVM, the pipelines.
const OPEN: u64 = 738 * MIB - 4 * MIB - MAP_EXTRA;
/// gpu-allocator's host block sizes under `MemoryHints::MemoryUsage`.
const MIN_BLOCK: u64 = 4 * MIB;
const MAX_BLOCK: u64 = 32 * MIB;

struct Block {
    size: u64,
    general: bool,
    /// Free ranges (offset, length), by offset.
    free: Vec<(u64, u64)>,
    live: usize,
}

/// The modelled device.
pub struct Lavapipe {
    info: DeviceInfo,
    /// The address-space limit.
    limit: u64,
    mapped: u64,
    slots: Vec<Option<Block>>,
    general: usize,
    /// Buffer: (slot, offset, length).
    bufs: HashMap<u64, (usize, u64, u64)>,
    next: u64,
    /// Held by `hold_outside`.
    outside: u64,
}

impl Lavapipe {
    /// A device opened under an address-space limit of `limit` bytes, `extra` of it mapped by
    /// what a real step holds besides its tensors (none in a replay).
    pub fn new(limit: u64, extra: u64) -> Self {
        let mut d = Lavapipe {
            info: DeviceInfo {
                index: 0,
                name: "modelled lavapipe".into(),
                backend: BackendKind::Mock,
                device_type: DeviceType::Cpu,
                driver: "model".into(),
                memory_total_bytes: Some(2 << 30),
                memory_free_bytes: None,
                max_buffer_size: (2 << 30) - 1,
                max_storage_binding_size: 128 * MIB,
                overhead_bytes: None,
                kernel_overhead_bytes: None,
            },
            limit,
            mapped: OPEN + extra,
            slots: Vec::new(),
            general: 0,
            bufs: HashMap::new(),
            next: 1,
            outside: 0,
        };
        // The staging, the parameter ring and wgpu's own buffers, for good.
        d.alloc_buffer(2 * MIB).expect("the first block");
        d
    }

    fn map(&mut self, bytes: u64) -> Result<(), AllocError> {
        let cost = bytes.div_ceil(PAGE) * PAGE + MAP_EXTRA;
        if self.mapped + cost > self.limit {
            return Err(AllocError::OutOfMemory {
                requested: bytes,
                detail: "modelled address space".into(),
            });
        }
        self.mapped += cost;
        Ok(())
    }

    fn unmap(&mut self, bytes: u64) {
        self.mapped -= bytes.div_ceil(PAGE) * PAGE + MAP_EXTRA;
    }

    /// A new block of `size` in the highest free slot (or a new one).
    fn new_block(&mut self, size: u64, general: bool) -> Result<usize, AllocError> {
        self.map(size)?;
        let block = Block {
            size,
            general,
            free: vec![(0, size)],
            live: 0,
        };
        if general {
            self.general += 1;
        }
        // A general block takes the highest free slot, one of its own the lowest.
        let free = if general {
            self.slots.iter().rposition(Option::is_none)
        } else {
            self.slots.iter().position(Option::is_none)
        };
        let slot = free.unwrap_or_else(|| {
            self.slots.push(None);
            self.slots.len() - 1
        });
        self.slots[slot] = Some(block);
        Ok(slot)
    }

    /// Best fit of `len` in `slot`'s block.
    fn fit(&mut self, slot: usize, len: u64) -> Option<u64> {
        let b = self.slots[slot].as_mut()?;
        let (i, &(off, free)) = b
            .free
            .iter()
            .enumerate()
            .filter(|(_, (_, l))| *l >= len)
            .min_by_key(|(_, (_, l))| *l)?;
        if free == len {
            b.free.remove(i);
        } else {
            b.free[i] = (off + len, free - len);
        }
        b.live += 1;
        Some(off)
    }
}

impl Backend for Lavapipe {
    fn alloc_buffer(&mut self, bytes: u64) -> Result<BufferId, AllocError> {
        let len = bytes.max(4).div_ceil(256) * 256;
        let block = (MIN_BLOCK << self.general.min(7)).min(MAX_BLOCK);
        let (slot, off) = if len > block {
            let slot = self.new_block(len, false)?;
            (slot, self.fit(slot, len).expect("a block of its own"))
        } else {
            let general: Vec<usize> = (0..self.slots.len())
                .rev()
                .filter(|&s| self.slots[s].as_ref().is_some_and(|b| b.general))
                .collect();
            let found = general
                .into_iter()
                .find_map(|s| self.fit(s, len).map(|o| (s, o)));
            match found {
                Some(f) => f,
                None => {
                    let slot = self.new_block(block, true)?;
                    (slot, self.fit(slot, len).expect("a new block"))
                }
            }
        };
        let id = self.next;
        self.next += 1;
        self.bufs.insert(id, (slot, off, len));
        Ok(BufferId(id))
    }
    fn free_buffer(&mut self, id: BufferId) {
        let Some((slot, off, len)) = self.bufs.remove(&id.0) else {
            return;
        };
        let general = self.general;
        let Some(b) = self.slots[slot].as_mut() else {
            return;
        };
        b.live -= 1;
        b.free.push((off, len));
        b.free.sort_unstable();
        // Merge neighbours.
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(b.free.len());
        for &(o, l) in &b.free {
            match merged.last_mut() {
                Some(last) if last.0 + last.1 == o => last.1 += l,
                _ => merged.push((o, l)),
            }
        }
        b.free = merged;
        if b.live == 0 && (!b.general || general > 1) {
            let (size, was_general) = (b.size, b.general);
            self.slots[slot] = None;
            if was_general {
                self.general -= 1;
            }
            self.unmap(size);
        }
    }
    memory_only!();
    /// Mapped on its own, as a real step's extra is.
    fn hold_outside(&mut self, bytes: u64) -> Option<bool> {
        self.release_outside();
        if bytes == 0 {
            return Some(true);
        }
        let ok = self.map(bytes).is_ok();
        self.outside = if ok { bytes } else { 0 };
        Some(ok)
    }
    fn release_outside(&mut self) {
        if self.outside > 0 {
            self.unmap(self.outside);
            self.outside = 0;
        }
    }
}
