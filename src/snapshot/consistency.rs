//! Is a device's trace one that could have happened? Walks the allocator's actions with the
//! memory they imply and names the first that breaks it: a free of a block or segment already
//! freed, an allocation over a live one, a block outside every live segment, more allocated than
//! reserved. `--snapshot` refuses such a file unless `--lenient` is given.
//!
//! What a real trace may do and is not flagged: PyTorch keeps the trace in a ring buffer
//! (`_record_memory_history(max_entries=…)`), so a trace often starts mid-run and frees blocks
//! and segments it never saw allocated. Those lived before the trace: a first free of an unseen
//! address makes it live from the start, as do the segments listed at dump time that the trace
//! never mapped. Only what contradicts the trace itself is a problem.

use std::collections::{BTreeMap, HashMap, HashSet};

pub use super::schema::Inconsistency;
use super::schema::{Snapshot, TraceEntry};
use crate::units::fmt_bytes;

/// The first inconsistency of any device, in device order.
pub fn check(snap: &Snapshot) -> Option<Inconsistency> {
    (0..snap.device_traces.len()).find_map(|d| check_device(snap, d))
}

/// The first inconsistency of each device that has one (what `read` keeps on the snapshot).
pub fn check_all(snap: &Snapshot) -> Vec<Inconsistency> {
    (0..snap.device_traces.len())
        .filter_map(|d| check_device(snap, d))
        .collect()
}

/// The first inconsistency of cuda:`device`'s trace, if any.
pub fn check_device(snap: &Snapshot, device: usize) -> Option<Inconsistency> {
    let entries = snap.device_traces.get(device)?;
    let with_segments = super::schema::synthetic_segments(snap).is_none();
    let mut w = Walk::new(snap, device, entries, with_segments);
    let mut first: Option<Inconsistency> = w.start();
    let mut count = usize::from(first.is_some());
    for (i, e) in entries.iter().enumerate() {
        if let Some(what) = w.step(i, e) {
            count += 1;
            first.get_or_insert(Inconsistency {
                device,
                entry: Some(i),
                what: format!(
                    "{} at {:#x} of {}: {what}",
                    e.action,
                    e.addr.unwrap_or(0),
                    fmt_bytes(e.size)
                ),
                count: 0,
            });
        }
    }
    first.map(|f| Inconsistency { count, ..f })
}

/// Address ranges by start: (end, the entry that made it live; None before the trace).
type Ranges = BTreeMap<u64, (u64, Option<usize>)>;

/// The memory a trace implies, entry by entry.
struct Walk {
    device: usize,
    /// Whether the file's segments are real (not `_profile_to_snapshot`'s) and any are known:
    /// only then are blocks checked against them.
    segments_known: bool,
    segments: Ranges,
    /// Segments allocated or mapped in the trace, ever (to tell a double free from a segment
    /// that lived before the trace).
    seen_segments: Ranges,
    blocks: HashMap<u64, (u64, usize)>,
    /// Blocks the trace allocated or freed and that are not live now: entry of their end.
    ended: HashMap<u64, usize>,
    allocated: u64,
    reserved: u64,
    /// Whether more is allocated than reserved now (named once, when it starts).
    over: bool,
    /// The segments listed at dump time, by address: (start, end).
    dump: Vec<(u64, u64)>,
}

fn ends(addr: u64, size: u64) -> u64 {
    addr.saturating_add(size)
}

/// Ranges overlapping `[lo, hi)`.
fn overlapping(r: &Ranges, lo: u64, hi: u64) -> Vec<(u64, u64, Option<usize>)> {
    r.range(..hi.max(lo + 1))
        .filter(|(&s, &(e, _))| e > lo && s < hi.max(lo + 1))
        .map(|(&s, &(e, at))| (s, e, at))
        .collect()
}

/// Whether `[lo, hi)` lies in the union of `r` (expandable segments map adjacent pieces).
fn covered(r: &Ranges, lo: u64, hi: u64) -> bool {
    let mut at = lo;
    while at < hi {
        match r.range(..=at).next_back() {
            Some((_, &(e, _))) if e > at => at = e,
            _ => return false,
        }
    }
    true
}

fn is_segment_alloc(a: &str) -> bool {
    matches!(a, "segment_alloc" | "segment_map")
}

fn is_segment_free(a: &str) -> bool {
    matches!(a, "segment_free" | "segment_unmap")
}

fn entry_of(at: Option<usize>) -> String {
    at.map_or_else(|| "before the trace".into(), |i| format!("at entry {i}"))
}

impl Walk {
    fn new(snap: &Snapshot, device: usize, entries: &[TraceEntry], real: bool) -> Walk {
        let on_device = |d: i64| d.max(0) as usize == device;
        // Segments and blocks that lived before the trace: freed before any allocation.
        let mut segments = Ranges::new();
        let mut mapped = Ranges::new();
        // Blocks whose first action in the trace is a free: (size, the entry of that free).
        let mut before: HashMap<u64, (u64, usize)> = HashMap::new();
        let mut allocated_seen = HashSet::new();
        for (i, e) in entries.iter().enumerate().filter(|(_, e)| e.addr.is_some()) {
            let (a, hi) = (e.addr.unwrap_or(0), ends(e.addr.unwrap_or(0), e.size));
            match e.action.as_str() {
                x if is_segment_alloc(x) => {
                    mapped.insert(a, (hi, None));
                }
                x if is_segment_free(x) && overlapping(&mapped, a, hi).is_empty() => {
                    segments.insert(a, (hi, None));
                    mapped.insert(a, (hi, None));
                }
                "alloc" => {
                    allocated_seen.insert(a);
                }
                "free_requested" | "free_completed" if !allocated_seen.contains(&a) => {
                    before.entry(a).or_insert((e.size, i));
                }
                _ => {}
            }
        }
        // Segments at dump time that the trace never touched lived throughout.
        for s in snap.segments.iter().filter(|s| on_device(s.device)) {
            let hi = ends(s.address, s.total_size);
            if overlapping(&mapped, s.address, hi).is_empty() {
                segments.insert(s.address, (hi, None));
            }
        }
        let mut dump: Vec<(u64, u64)> = snap
            .segments
            .iter()
            .filter(|s| on_device(s.device))
            .map(|s| (s.address, ends(s.address, s.total_size)))
            .collect();
        dump.sort_unstable();
        let has_segment_actions = entries
            .iter()
            .any(|e| is_segment_alloc(&e.action) || is_segment_free(&e.action));
        Walk {
            device,
            segments_known: real && (!segments.is_empty() || has_segment_actions),
            reserved: segments
                .iter()
                .fold(0u64, |a, (s, (e, _))| a.saturating_add(e - s)),
            segments,
            seen_segments: Ranges::new(),
            allocated: before
                .values()
                .fold(0u64, |a, (size, _)| a.saturating_add(*size)),
            blocks: before,
            ended: HashMap::new(),
            over: false,
            dump,
        }
    }

    /// Overlapping segments at dump time, and blocks that lived before the trace: the state
    /// the trace starts from.
    fn start(&mut self) -> Option<Inconsistency> {
        if let Some(w) = self.dump.windows(2).find(|w| w[1].0 < w[0].1) {
            return Some(self.before_trace(format!(
                "the segments listed at dump time at {:#x} and {:#x} overlap (the first ends at \
                 {:#x})",
                w[0].0, w[1].0, w[0].1
            )));
        }
        if !self.segments_known {
            return None;
        }
        let mut lost: Vec<(&u64, &(u64, usize))> = self
            .blocks
            .iter()
            .filter(|(&b, &(size, _))| !covered(&self.segments, b, ends(b, size)))
            .collect();
        lost.sort();
        if let Some((b, (_, at))) = lost.first() {
            return Some(self.before_trace(format!(
                "the block at {b:#x} (freed at entry {at}, so live before the trace) lies in no \
                 segment"
            )));
        }
        if self.allocated > self.reserved {
            self.over = true;
            return Some(self.before_trace(format!(
                "the blocks the trace frees without allocating (so live before it) hold {}, more \
                 than the {} reserved in segments",
                fmt_bytes(self.allocated),
                fmt_bytes(self.reserved)
            )));
        }
        None
    }

    fn before_trace(&self, what: String) -> Inconsistency {
        Inconsistency {
            device: self.device,
            entry: None,
            what,
            count: 1,
        }
    }

    /// Apply one entry; what is wrong with it, if anything.
    fn step(&mut self, i: usize, e: &TraceEntry) -> Option<String> {
        let addr = e.addr?;
        let hi = ends(addr, e.size);
        let wrong = match e.action.as_str() {
            x if is_segment_alloc(x) => self.segment_alloc(i, addr, hi),
            x if is_segment_free(x) => self.segment_free(addr, hi),
            "alloc" => self.alloc(i, addr, e.size),
            "free_requested" => self.free(i, addr, false),
            "free_completed" => self.free(i, addr, true),
            _ => None,
        };
        let over = self.segments_known && self.allocated > self.reserved;
        let starts = over && !self.over;
        self.over = over;
        wrong.or_else(|| {
            starts.then(|| {
                format!(
                    "{} allocated, more than the {} reserved in segments",
                    fmt_bytes(self.allocated),
                    fmt_bytes(self.reserved)
                )
            })
        })
    }

    fn segment_alloc(&mut self, i: usize, addr: u64, hi: u64) -> Option<String> {
        if let Some(&(s, e, at)) = overlapping(&self.segments, addr, hi).first() {
            return Some(format!(
                "overlaps the live segment {s:#x}..{e:#x} (mapped {})",
                entry_of(at)
            ));
        }
        self.segments.insert(addr, (hi, Some(i)));
        self.seen_segments.insert(addr, (hi, Some(i)));
        self.reserved = self.reserved.saturating_add(hi - addr);
        None
    }

    fn segment_free(&mut self, addr: u64, hi: u64) -> Option<String> {
        let hit = overlapping(&self.segments, addr, hi);
        if hit.is_empty() {
            return Some(if overlapping(&self.seen_segments, addr, hi).is_empty() {
                "frees memory no segment holds".to_string()
            } else {
                "a double free: the segment there was already freed".to_string()
            });
        }
        // Unmapping part of a range keeps the rest (expandable segments).
        for (s, e, at) in hit {
            self.segments.remove(&s);
            self.reserved -= e - s;
            for (lo, up) in [(s, addr.max(s)), (hi.min(e), e)] {
                if up > lo {
                    self.segments.insert(lo, (up, at));
                    self.reserved += up - lo;
                }
            }
        }
        let in_freed = self
            .blocks
            .iter()
            .find(|(&b, &(size, _))| b < hi && ends(b, size) > addr);
        in_freed.map(|(&b, &(_, at))| {
            format!("frees a segment that still holds the live block at {b:#x} (allocated at entry {at})")
        })
    }

    fn alloc(&mut self, i: usize, addr: u64, size: u64) -> Option<String> {
        if let Some(&(_, at)) = self.blocks.get(&addr) {
            return Some(format!(
                "allocates over the live block allocated at entry {at} (no free between)"
            ));
        }
        self.blocks.insert(addr, (size, i));
        self.ended.remove(&addr);
        self.allocated = self.allocated.saturating_add(size);
        (self.segments_known && !covered(&self.segments, addr, ends(addr, size)))
            .then(|| "the block lies in no live segment".to_string())
    }

    fn free(&mut self, i: usize, addr: u64, completed: bool) -> Option<String> {
        if let Some(&at) = self.ended.get(&addr) {
            return Some(format!(
                "a double free: the block there was freed at entry {at} and not allocated since"
            ));
        }
        if completed {
            if let Some((b, _)) = self.blocks.remove(&addr) {
                self.allocated -= b;
                self.ended.insert(addr, i);
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::snapshot::schema::Segment;

    fn entry(action: &str, addr: u64, size: u64) -> TraceEntry {
        TraceEntry {
            action: action.into(),
            addr: Some(addr),
            size,
            ..TraceEntry::default()
        }
    }

    fn snap(entries: Vec<TraceEntry>, segments: Vec<Segment>) -> Snapshot {
        Snapshot {
            segments,
            device_traces: vec![entries],
            allocator_settings: None,
            inconsistent: Vec::new(),
        }
    }

    const MIB: u64 = 1 << 20;

    fn step(base: u64) -> Vec<TraceEntry> {
        vec![
            entry("segment_alloc", base, 2 * MIB),
            entry("alloc", base, 512),
            entry("alloc", base + 512, 1024),
            entry("free_requested", base, 512),
            entry("free_completed", base, 512),
            entry("free_requested", base + 512, 1024),
            entry("free_completed", base + 512, 1024),
            entry("segment_free", base, 2 * MIB),
        ]
    }

    #[test]
    fn a_trace_that_happened_passes() {
        assert_eq!(check(&snap(step(0x1000_0000), vec![])), None);
    }

    #[test]
    fn a_ring_buffer_that_starts_mid_run_passes() {
        // The trace lost its first three entries: the segment and the first block were live
        // before it (the segment is known from its free).
        let t = step(0x1000_0000)[3..].to_vec();
        assert_eq!(check(&snap(t, vec![])), None);
    }

    #[test]
    fn a_double_free_is_named_at_its_entry() {
        let mut t = step(0x1000_0000);
        t.insert(5, entry("free_completed", 0x1000_0000, 512));
        let p = check(&snap(t, vec![])).expect("a double free");
        assert_eq!(p.entry, Some(5));
        assert!(p.what.contains("double free"), "{p}");
    }

    #[test]
    fn a_reversed_trace_is_refused() {
        let mut t = step(0x1000_0000);
        t.reverse();
        let p = check(&snap(t, vec![])).expect("reversed");
        assert!(p.entry.is_some(), "{p}");
    }

    #[test]
    fn overlapping_segments_are_refused() {
        let mut t = step(0x1000_0000);
        t.insert(1, entry("segment_alloc", 0x1000_0000 + MIB, 2 * MIB));
        let p = check(&snap(t, vec![])).expect("overlap");
        assert_eq!(p.entry, Some(1));
        assert!(p.what.contains("overlaps the live segment"), "{p}");
    }

    #[test]
    fn overlapping_segments_at_dump_time_are_refused() {
        let seg = |address| Segment {
            address,
            total_size: 2 * MIB,
            ..Segment::default()
        };
        let s = snap(vec![], vec![seg(0x1000_0000), seg(0x1000_0000 + MIB)]);
        let p = check_device(&s, 0).expect("overlap at dump");
        assert_eq!(p.entry, None);
        assert!(p.what.contains("overlap"), "{p}");
    }

    #[test]
    fn frees_only_above_the_reserved_memory_are_refused() {
        // Three blocks of 1 MiB freed (so live before the trace) in one 2 MiB segment.
        let seg = Segment {
            address: 0x1000_0000,
            total_size: 2 * MIB,
            ..Segment::default()
        };
        let t = (0..3)
            .map(|k| entry("free_completed", 0x1000_0000 + k * (MIB / 2), MIB))
            .collect();
        let p = check(&snap(t, vec![seg])).expect("allocated above reserved");
        assert!(p.what.contains("more than the 2.00 MiB reserved"), "{p}");
    }

    #[test]
    fn an_expandable_segment_mapped_in_pieces_holds_a_block_across_them() {
        let t = vec![
            entry("segment_map", 0x2000_0000, 2 * MIB),
            entry("segment_map", 0x2000_0000 + 2 * MIB, 2 * MIB),
            entry("alloc", 0x2000_0000 + MIB, 2 * MIB),
            entry("free_completed", 0x2000_0000 + MIB, 2 * MIB),
            entry("segment_unmap", 0x2000_0000, 4 * MIB),
        ];
        assert_eq!(check(&snap(t, vec![])), None);
    }
}
