//! Giving segments back to the device: the OOM path (free one oversize block, then every
//! unsplit cached segment), `torch.cuda.empty_cache()` and garbage collection under a memory
//! fraction.

use super::{Action, Allocator, BlockId, Device, LARGE};

impl Allocator {
    fn release_block(&mut self, dev: &mut dyn Device, id: BlockId) {
        self.remove_free(id);
        let (addr, size) = (self.blocks[id].addr, self.blocks[id].size);
        dev.free(addr, size);
        self.stats.reserved -= size;
        self.stats.segments -= 1;
        self.stats.num_device_free += 1;
        self.log(Action::SegmentFree { addr, size });
        self.drop_block(id);
    }

    pub(super) fn release_available_cached_blocks(
        &mut self,
        dev: &mut dyn Device,
        pool: usize,
        size: u64,
        stream: i64,
    ) -> bool {
        let max_split = self.conf.max_split_size;
        if max_split == u64::MAX {
            return false;
        }
        let key = size.max(max_split);
        let p = &self.pools[pool];
        if let Some(&k) = p.blocks.range((stream, key, 0, 0)..).next() {
            if k.0 == stream && self.blocks[k.3].expandable.is_none() {
                self.release_block(dev, k.3);
                return true;
            }
        }
        // No single block is large enough: free oversize blocks, the largest first.
        let below: Vec<_> = p
            .blocks
            .range(..(stream, key, 0, 0))
            .rev()
            .take_while(|k| k.0 == stream && k.1 >= max_split)
            .copied()
            .collect();
        let mut released = 0u64;
        for k in below {
            if released >= key {
                break;
            }
            if self.blocks[k.3].expandable.is_some() {
                continue;
            }
            released += k.1;
            self.release_block(dev, k.3);
        }
        released >= key
    }

    /// The OOM path and `torch.cuda.empty_cache()`: every cached segment that is not split goes
    /// back to the device; expandable segments unmap their free pages.
    pub fn release_cached_blocks(&mut self, dev: &mut dyn Device) {
        for pool in 0..self.pools.len() {
            if self.pools[pool].private {
                continue;
            }
            let ids: Vec<BlockId> = self.pools[pool].blocks.iter().map(|k| k.3).collect();
            let mut to_unmap = Vec::new();
            for id in ids {
                if self.blocks[id].expandable.is_some() {
                    to_unmap.push(id);
                } else if !self.is_split(id) {
                    self.release_block(dev, id);
                }
            }
            for id in to_unmap {
                self.unmap_block(dev, id);
                if !self.is_split(id) && !self.blocks[id].mapped {
                    self.release_expandable(dev, id);
                }
            }
        }
    }

    /// `torch.cuda.empty_cache()`.
    pub fn empty_cache(&mut self, dev: &mut dyn Device) {
        self.release_cached_blocks(dev);
    }

    pub(super) fn garbage_collect(&mut self, dev: &mut dyn Device) {
        let allowed = self.allowed.unwrap_or(u64::MAX) as f64;
        let threshold = (self.conf.garbage_collection_threshold * allowed) as u64;
        if self.stats.reserved <= threshold {
            return;
        }
        let target = self.stats.reserved - threshold;
        let calls = self.pools[LARGE].free_calls;
        let age = |a: &Self, id: BlockId| calls - a.blocks[id].gc_base;
        let freeable: Vec<BlockId> = self.pools[LARGE]
            .blocks
            .iter()
            .map(|k| k.3)
            .filter(|&id| !self.is_split(id))
            .collect();
        if freeable.is_empty() {
            return;
        }
        let mut total_age: u64 = freeable.iter().map(|&id| age(self, id)).sum();
        let mut count = freeable.len() as u64;
        let mut reclaimed = 0u64;
        let mut freed = true;
        while reclaimed < target && freed && count > 0 {
            let threshold_age = total_age as f64 / count as f64;
            freed = false;
            let ids: Vec<BlockId> = self.pools[LARGE].blocks.iter().map(|k| k.3).collect();
            for id in ids {
                let b = &self.blocks[id];
                if !self.is_split(id)
                    && b.expandable.is_none()
                    && age(self, id) as f64 >= threshold_age
                {
                    freed = true;
                    reclaimed += b.size;
                    total_age -= age(self, id);
                    count -= 1;
                    self.release_block(dev, id);
                }
            }
        }
    }
}
