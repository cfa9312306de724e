//! Expandable segments (`expandable_segments:True`): one growing range of address space per
//! pool and stream, mapped and unmapped in pages (2 MiB for the small pool, 20 MiB for the
//! large) instead of whole segments.

use super::{Action, Allocator, Block, BlockId, Device, LARGE_BUFFER, SMALL_BUFFER};

/// One expandable segment: `pages` pages of `page` bytes from `base`.
#[derive(Debug, Clone)]
pub(super) struct Expandable {
    base: u64,
    page: u64,
    pages: u64,
}

impl Allocator {
    fn allocatable(&self, id: Option<BlockId>) -> Option<BlockId> {
        id.filter(|&i| !self.blocks[i].allocated)
    }

    fn find_expandable_block(
        &mut self,
        dev: &mut dyn Device,
        pool: usize,
        size: u64,
        stream: i64,
    ) -> BlockId {
        let cands: Vec<BlockId> = self.pools[pool]
            .unmapped
            .range((stream, 0, 0)..)
            .take_while(|k| k.0 == stream)
            .map(|k| k.2)
            .collect();
        for c in cands {
            let c = self.allocatable(self.blocks[c].prev).unwrap_or(c);
            let mut bytes = 0u64;
            let mut b = Some(c);
            while bytes < size {
                let Some(i) = self.allocatable(b) else { break };
                bytes += self.blocks[i].size;
                b = self.blocks[i].next;
            }
            if bytes >= size {
                return c;
            }
        }
        let page = if self.pools[pool].small {
            SMALL_BUFFER
        } else {
            LARGE_BUFFER
        };
        let total = dev.total();
        let pages = total.saturating_add(total / 8).div_ceil(page).max(1);
        let base = dev.reserve(pages.saturating_mul(page));
        self.expandables
            .push(Some(Expandable { base, page, pages }));
        let es = self.expandables.len() - 1;
        let id = self.new_block(Block::free_piece(
            base,
            pages * page,
            (stream, pool, Some(es)),
            false,
            None,
            None,
        ));
        self.insert_unmapped(id);
        id
    }

    /// Map whole pages covering `[addr, addr + size)` of expandable segment `es`: the range
    /// mapped, or None when the device refused a page (those already mapped are released).
    fn es_map(
        &mut self,
        dev: &mut dyn Device,
        es: usize,
        addr: u64,
        size: u64,
    ) -> Option<(u64, u64)> {
        let e = self.expandables[es]
            .as_mut()
            .expect("a live expandable segment");
        let begin = (addr - e.base) / e.page;
        let end = (addr + size - e.base).div_ceil(e.page).min(e.pages);
        for i in begin..end {
            if !dev.map(e.base + i * e.page, e.page) {
                for j in begin..i {
                    dev.unmap(e.base + j * e.page, e.page);
                }
                return None;
            }
        }
        Some((e.base + begin * e.page, (end - begin) * e.page))
    }

    fn map_block(&mut self, dev: &mut dyn Device, id: BlockId, size: u64) -> bool {
        let es = self.blocks[id].expandable.expect("an expandable block");
        let addr = self.blocks[id].addr;
        let Some((maddr, msize)) = self.es_map(dev, es, addr, size) else {
            return false;
        };
        debug_assert_eq!(maddr, addr);
        self.remove_unmapped(id);
        self.blocks[id].mapped = true;
        if msize < self.blocks[id].size {
            let b = self.blocks[id].clone();
            let rem = self.new_block(Block::free_piece(
                b.addr + msize,
                b.size - msize,
                (b.stream, b.pool, b.expandable),
                false,
                Some(id),
                b.next,
            ));
            if let Some(n) = b.next {
                self.blocks[n].prev = Some(rem);
            }
            self.blocks[id].next = Some(rem);
            self.blocks[id].size = msize;
            self.insert_unmapped(rem);
        }
        let (prev, next) = (self.blocks[id].prev, self.blocks[id].next);
        self.try_merge(id, prev);
        self.try_merge(id, next);
        self.insert_free(id);
        self.add_reserved(msize);
        self.stats.num_device_alloc += 1;
        self.log(Action::SegmentMap {
            addr: maddr,
            size: msize,
        });
        true
    }

    pub(super) fn try_allocate_expandable(
        &mut self,
        dev: &mut dyn Device,
        pool: usize,
        size: u64,
        stream: i64,
    ) -> Option<BlockId> {
        let mut cand = self.find_expandable_block(dev, pool, size, stream);
        if !self.blocks[cand].mapped {
            let s = self.blocks[cand].size.min(size);
            if !self.map_block(dev, cand, s) {
                return None;
            }
        }
        while self.blocks[cand].size < size {
            let remaining = size - self.blocks[cand].size;
            let next = self.blocks[cand]
                .next
                .expect("unmapped space after a free block");
            let s = remaining.min(self.blocks[next].size);
            if !self.map_block(dev, next, s) {
                return None;
            }
            cand = next;
        }
        self.remove_free(cand);
        Some(cand)
    }

    pub(super) fn unmap_block(&mut self, dev: &mut dyn Device, id: BlockId) {
        let es = self.blocks[id].expandable.expect("an expandable block");
        let (addr, size) = (self.blocks[id].addr, self.blocks[id].size);
        let e = self.expandables[es]
            .as_mut()
            .expect("a live expandable segment");
        let begin = (addr - e.base).div_ceil(e.page);
        let end = (addr + size - e.base) / e.page;
        if begin >= end {
            return;
        }
        for i in begin..end {
            dev.unmap(e.base + i * e.page, e.page);
        }
        let (uaddr, usize_) = (e.base + begin * e.page, (end - begin) * e.page);
        self.remove_free(id);
        let b = self.blocks[id].clone();
        let before = uaddr - b.addr;
        if before > 0 {
            let bf = self.new_block(Block::free_piece(
                b.addr,
                before,
                (b.stream, b.pool, b.expandable),
                true,
                b.prev,
                Some(id),
            ));
            if let Some(p) = b.prev {
                self.blocks[p].next = Some(bf);
            }
            self.blocks[id].prev = Some(bf);
            self.insert_free(bf);
        }
        let after = b.size - (before + usize_);
        if after > 0 {
            let af = self.new_block(Block::free_piece(
                uaddr + usize_,
                after,
                (b.stream, b.pool, b.expandable),
                true,
                Some(id),
                b.next,
            ));
            if let Some(n) = b.next {
                self.blocks[n].prev = Some(af);
            }
            self.blocks[id].next = Some(af);
            self.insert_free(af);
        }
        self.blocks[id].addr = uaddr;
        self.blocks[id].size = usize_;
        self.blocks[id].mapped = false;
        let (prev, next) = (self.blocks[id].prev, self.blocks[id].next);
        self.try_merge(id, prev);
        self.try_merge(id, next);
        self.insert_unmapped(id);
        self.stats.reserved -= usize_;
        self.stats.num_device_free += 1;
        self.log(Action::SegmentUnmap {
            addr: uaddr,
            size: usize_,
        });
    }

    pub(super) fn release_expandable(&mut self, dev: &mut dyn Device, id: BlockId) {
        let es = self.blocks[id].expandable.expect("an expandable block");
        if let Some(e) = self.expandables[es].take() {
            dev.free(e.base, 0);
        }
        self.remove_unmapped(id);
        self.drop_block(id);
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::{alloc, MIB};
    use super::*;
    use crate::alloc::conf::parse;
    use crate::alloc::{AllocConf, ModelDevice};

    #[test]
    fn expandable_segments_tile_requests_into_pages() {
        // 8 MiB requests: three 20 MiB segments by default (two per segment, 4 MiB left
        // over in each), two 20 MiB pages of one expandable segment.
        let mut a = Allocator::new(AllocConf::default());
        let mut d = ModelDevice::new(1 << 30, 1 << 30);
        for _ in 0..5 {
            alloc(&mut a, &mut d, 8 * MIB);
        }
        assert_eq!(a.stats().reserved, 60 * MIB);
        let mut a = Allocator::new(parse("expandable_segments:True").unwrap());
        for _ in 0..5 {
            alloc(&mut a, &mut d, 8 * MIB);
        }
        assert_eq!(a.stats().reserved, 40 * MIB);
    }

    #[test]
    fn expandable_segments_grow_and_shrink_in_pages() {
        let mut a = Allocator::new(parse("expandable_segments:True").unwrap());
        a.record();
        let mut d = ModelDevice::new(1 << 30, 1 << 30);
        let x = alloc(&mut a, &mut d, 30 * MIB);
        let y = alloc(&mut a, &mut d, 30 * MIB);
        assert_eq!(a.block(y).0, a.block(x).0 + 30 * MIB, "one growing segment");
        assert_eq!(a.stats().reserved, 60 * MIB);
        a.free(y);
        a.empty_cache(&mut d);
        // Pages 2 (from 40 MiB) up are free: 20 MiB unmapped; page 1 holds x's tail.
        assert_eq!(a.stats().reserved, 40 * MIB);
        a.free(x);
        a.empty_cache(&mut d);
        assert_eq!(a.stats().reserved, 0);
        assert_eq!(d.used, 0);
        let log = a.take_log();
        let maps = log
            .iter()
            .filter(|l| matches!(l, Action::SegmentMap { .. }))
            .count();
        assert_eq!(maps, 2);
        assert!(
            log.contains(&Action::SegmentUnmap {
                addr: a.block(x).0 + 40 * MIB,
                size: 20 * MIB
            }) || log
                .iter()
                .any(|l| matches!(l, Action::SegmentUnmap { size, .. } if *size == 20 * MIB))
        );
    }
}
