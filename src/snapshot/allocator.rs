//! A real trace's own alloc/free stream through the caching allocator model (`alloc`): does
//! each allocation land at the address the file records, and does each segment event match?
//! The truth check of the model against real CUDA runs.
//!
//! Segments the model asks for get the address of the recorded `segment_alloc` (or, for an
//! expandable segment, `segment_map`) of the same size between the same two trace entries; a
//! request the file does not record gets an address no segment has. A run of `segment_free`
//! entries the model did not make itself is read as `torch.cuda.empty_cache()`.
//!
//! A trace that starts with segments already held (recorded after the model was built, or a
//! ring buffer that wrapped) starts from the state before it: the dump's segments and blocks
//! in use, walked back over the trace (a `segment_alloc` had no segment before it, a
//! `segment_free` had one; an `alloc` had no block, a `free_completed` had one). A block known
//! only from its free has the requested size there, rounded as the allocator rounds; a large
//! block also keeps a following gap PyTorch would not have split off (≤ 1 MiB).

use std::collections::{BTreeMap, HashMap, VecDeque};

use serde::Serialize;

use crate::alloc::caching::{Action, Allocator, BlockId};
use crate::alloc::conf::AllocConf;
use crate::alloc::device::Device;
use crate::alloc::sizes::{SMALL_BUFFER, SMALL_SIZE};

use super::schema::{Snapshot, TraceEntry};

/// The replay's agreement with the file (`estimate --snapshot --json`, per device).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct AllocatorReplay {
    /// Allocations in the trace, and those the model placed at the recorded address.
    pub blocks_total: u64,
    pub blocks_matched: u64,
    /// Segment events in the trace (alloc, free, map, unmap), and those the model made alike
    /// (same kind, address and size between the same two trace entries).
    pub segment_events_total: u64,
    pub segment_events_matched: u64,
    /// The reserved peak as the file records it, and as the model reached it.
    pub reserved_peak_recorded: u64,
    pub reserved_peak_replayed: u64,
    /// The settings replayed with (from the file's `allocator_settings` where it has them).
    pub settings: String,
    /// Blocks held before the trace that neither the dump nor the trace shows (freed after the
    /// trace stopped recording), seen from where the run's allocations went: an allocation
    /// always starts a free piece, so one recorded inside what the model holds free means the
    /// piece's start up to it was in use. Only in a trace that starts with segments held.
    #[serde(skip_serializing_if = "is_zero")]
    pub blocks_inferred_before_trace: u64,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// Segments served at recorded addresses.
struct Recorded {
    pending: VecDeque<(bool, u64, u64)>,
    next_fake: u64,
    total: u64,
}

impl Recorded {
    fn take(&mut self, map: bool, size: Option<u64>) -> u64 {
        let pos = self
            .pending
            .iter()
            .position(|&(m, _, s)| m == map && size.is_none_or(|z| z == s));
        match pos.and_then(|p| self.pending.remove(p)) {
            Some((_, addr, _)) => addr,
            None => {
                let a = self.next_fake;
                self.next_fake += size.unwrap_or(1 << 30).max(1 << 21) + (1 << 21);
                a
            }
        }
    }
}

impl Device for Recorded {
    fn malloc(&mut self, size: u64) -> Option<u64> {
        Some(self.take(false, Some(size)))
    }
    fn free(&mut self, _addr: u64, _size: u64) {}
    fn reserve(&mut self, _size: u64) -> u64 {
        self.take(true, None)
    }
    fn map(&mut self, _addr: u64, _size: u64) -> bool {
        true
    }
    fn unmap(&mut self, _addr: u64, _size: u64) {}
    fn total(&self) -> u64 {
        self.total
    }
    fn free_bytes(&self) -> u64 {
        u64::MAX / 4
    }
}

/// A recorded segment event as the model's [`Action`].
fn segment_action(e: &TraceEntry) -> Option<Action> {
    let addr = e.addr?;
    let size = e.size;
    Some(match e.action.as_str() {
        "segment_alloc" => Action::SegmentAlloc { addr, size },
        "segment_free" => Action::SegmentFree { addr, size },
        "segment_map" => Action::SegmentMap { addr, size },
        "segment_unmap" => Action::SegmentUnmap { addr, size },
        _ => return None,
    })
}

fn is_segment(a: &Action) -> bool {
    matches!(
        a,
        Action::SegmentAlloc { .. }
            | Action::SegmentFree { .. }
            | Action::SegmentMap { .. }
            | Action::SegmentUnmap { .. }
    )
}

/// The settings the file says it ran with (`allocator_settings`, PyTorch 2.5+), else defaults.
pub fn settings_of(raw: Option<&serde_pickle::Value>) -> AllocConf {
    use serde_pickle::{HashableValue as H, Value as V};
    let mut conf = AllocConf::default();
    let Some(V::Dict(d)) = raw else { return conf };
    for (k, v) in d {
        let H::String(k) = k else { continue };
        match (k.as_str(), v) {
            ("expandable_segments", V::Bool(b)) => conf.expandable_segments = *b,
            ("max_split_size", V::I64(n)) if *n > 0 => conf.max_split_size = *n as u64,
            ("garbage_collection_threshold", V::F64(f)) => conf.garbage_collection_threshold = *f,
            ("PYTORCH_CUDA_ALLOC_CONF", V::String(s)) if !s.is_empty() => {
                if let Ok(c) = crate::alloc::conf::parse(s) {
                    conf = c;
                }
            }
            _ => {}
        }
    }
    conf
}

/// Bytes reserved before the trace began (what the dump holds less what the trace added), and
/// the peak the trace's segment events reach above them.
fn reserved_before(snap: &Snapshot, device: usize, trace: &[TraceEntry]) -> (i128, i128) {
    // Reserved before the trace: what the dump holds less what the trace added.
    let at_dump: u64 = snap
        .segments
        .iter()
        .filter(|s| s.device as usize == device)
        .map(|s| s.total_size)
        .sum();
    let mut net: i128 = 0;
    let mut cur: i128 = 0;
    let mut recorded_peak: i128 = 0;
    for e in trace {
        match e.action.as_str() {
            "segment_alloc" | "segment_map" => cur += e.size as i128,
            "segment_free" | "segment_unmap" => cur -= e.size as i128,
            _ => {}
        }
        net = cur;
        recorded_peak = recorded_peak.max(cur);
    }
    (at_dump as i128 - net, recorded_peak)
}

/// Replay device `device`'s trace; Err(why) in one line when the file lacks what it needs.
pub fn replay(snap: &Snapshot, device: usize, conf: &AllocConf) -> Result<AllocatorReplay, String> {
    let trace = snap
        .device_traces
        .get(device)
        .filter(|t| t.iter().any(|e| e.action == "alloc"))
        .ok_or("no alloc/free trace to replay")?;
    let (before, recorded_peak) = reserved_before(snap, device, trace);
    let mut dev = Recorded {
        pending: VecDeque::new(),
        next_fake: 1 << 56,
        total: 1 << 40,
    };
    let mut a = Allocator::new(conf.clone());
    a.record();
    let mut out = AllocatorReplay {
        blocks_total: 0,
        blocks_matched: 0,
        segment_events_total: 0,
        segment_events_matched: 0,
        reserved_peak_recorded: (before + recorded_peak).max(0) as u64,
        reserved_peak_replayed: 0,
        settings: conf.describe(),
        blocks_inferred_before_trace: 0,
    };
    let mut by_addr: HashMap<u64, BlockId> = HashMap::new();
    if before != 0 {
        for seg in state_before(snap, device, trace, &a)? {
            let ids = a
                .adopt_segment((seg.addr, seg.size, seg.stream), seg.small, &seg.blocks)
                .ok_or("blocks in use before the trace do not fit their segment")?;
            for (b, id) in seg.blocks.iter().zip(ids) {
                by_addr.insert(b.0, id);
            }
        }
        if i128::from(a.stats().reserved) != before {
            return Err(format!(
                "the trace starts with {before} B reserved, but its segments walked back from \
                 the dump hold {} B",
                a.stats().reserved
            ));
        }
    }
    // Recorded segment events since the last alloc or free, and the model's since then.
    let mut window: Vec<Action> = Vec::new();
    let mut model: Vec<Action> = Vec::new();
    let settle = |window: &mut Vec<Action>, model: &mut Vec<Action>, out: &mut AllocatorReplay| {
        for w in window.drain(..) {
            if let Some(p) = model.iter().position(|m| *m == w) {
                model.remove(p);
                out.segment_events_matched += 1;
            }
        }
        model.clear();
    };
    for (i, e) in trace.iter().enumerate() {
        if let Some(act) = segment_action(e) {
            out.segment_events_total += 1;
            if let Action::SegmentAlloc { addr, size } = act {
                dev.pending.push_back((false, addr, size));
            }
            if let Action::SegmentMap { addr, size } = act {
                dev.pending.push_back((true, addr, size));
            }
            // A run of frees the model has not made: empty_cache().
            if matches!(
                act,
                Action::SegmentFree { .. } | Action::SegmentUnmap { .. }
            ) && !model.contains(&act)
                && trace[..i]
                    .last()
                    .is_none_or(|p| !matches!(p.action.as_str(), "segment_free" | "segment_unmap"))
            {
                a.empty_cache(&mut dev);
                model.extend(a.take_log().into_iter().filter(is_segment));
            }
            window.push(act);
            continue;
        }
        match e.action.as_str() {
            "alloc" => {
                let Some(addr) = e.addr else { continue };
                out.blocks_total += 1;
                let mut got = a.malloc(&mut dev, e.size, e.stream, None);
                // Placed elsewhere, with no segment taken: a block held before the trace that
                // no record shows may have sat where the run's allocation went around.
                if let Ok(id) = got {
                    let (at, _) = a.block(id);
                    let quiet = at != addr
                        && before != 0
                        && a.logged().iter().all(|l| !is_segment(l))
                        && dev.pending.is_empty();
                    if quiet {
                        a.free(id);
                        match a.free_piece_at(addr) {
                            Some((start, _))
                                if start < addr && a.hold(start, addr - start).is_some() =>
                            {
                                out.blocks_inferred_before_trace += 1;
                            }
                            _ => {}
                        }
                        a.take_log();
                        got = a.malloc(&mut dev, e.size, e.stream, None);
                    }
                }
                match got {
                    Ok(id) => {
                        if a.block(id).0 == addr {
                            out.blocks_matched += 1;
                        }
                        by_addr.insert(addr, id);
                    }
                    Err(_) => return Err("the model refused an allocation the run made".into()),
                }
            }
            "free_completed" => {
                let Some(addr) = e.addr else { continue };
                if let Some(id) = by_addr.remove(&addr) {
                    a.free(id);
                }
            }
            _ => continue,
        }
        // The model's segment events for this entry happened before it in the file.
        let log = a.take_log();
        model.extend(log.into_iter().filter(is_segment));
        settle(&mut window, &mut model, &mut out);
        dev.pending.clear();
    }
    settle(&mut window, &mut model, &mut out);
    out.reserved_peak_replayed = a.stats().reserved_peak;
    Ok(out)
}

/// A segment as it was when the trace began.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Held {
    addr: u64,
    size: u64,
    stream: i64,
    small: bool,
    /// Blocks in use: address, block size, requested size.
    blocks: Vec<(u64, u64, u64)>,
}

const EXPANDABLE_HELD: &str =
    "the trace starts with expandable segments held; their mapped pages before it are not rebuilt";

/// The segments and blocks in use before `trace`: the dump's, walked back over it.
fn state_before(
    snap: &Snapshot,
    device: usize,
    trace: &[TraceEntry],
    a: &Allocator,
) -> Result<Vec<Held>, String> {
    let mut segs: BTreeMap<u64, Held> = BTreeMap::new();
    // Blocks in use: (block size, requested, size known exactly).
    let mut used: BTreeMap<u64, (u64, u64, bool)> = BTreeMap::new();
    let held = |addr, size, stream, small| Held {
        addr,
        size,
        stream,
        small,
        blocks: Vec::new(),
    };
    for s in snap.segments.iter().filter(|s| s.device as usize == device) {
        if s.is_expandable {
            return Err(EXPANDABLE_HELD.into());
        }
        if s.segment_pool_id.is_some_and(|p| p != (0, 0)) {
            return Err(
                "the trace starts with segments held in a private pool (CUDA graphs); \
                        not rebuilt"
                    .into(),
            );
        }
        let small = match s.segment_type.as_deref() {
            Some(t) => t == "small",
            None => s.total_size == SMALL_BUFFER,
        };
        segs.insert(s.address, held(s.address, s.total_size, s.stream, small));
        for b in s.blocks.iter().filter(|b| b.state.starts_with("active")) {
            used.insert(b.address, (b.size, b.requested_size, true));
        }
    }
    for e in trace.iter().rev() {
        let Some(addr) = e.addr else { continue };
        match e.action.as_str() {
            "segment_alloc" => {
                segs.remove(&addr);
            }
            "segment_free" => {
                segs.insert(addr, held(addr, e.size, e.stream, e.size == SMALL_BUFFER));
            }
            "segment_map" | "segment_unmap" => return Err(EXPANDABLE_HELD.into()),
            "alloc" => {
                used.remove(&addr);
            }
            "free_completed" => {
                used.insert(addr, (a.round_size(e.size), e.size, false));
            }
            _ => {}
        }
    }
    let mut blocks: Vec<(u64, (u64, u64, bool))> = used.into_iter().collect();
    // A block known from its free alone takes the gap after it that PyTorch does not split off.
    for i in 0..blocks.len() {
        let (at, (size, _, exact)) = blocks[i];
        let Some(seg) = segs.range(..=at).next_back().map(|(_, s)| s) else {
            return Err(format!(
                "a block in use before the trace at {at:#x} lies in no segment"
            ));
        };
        let seg_end = seg.addr + seg.size;
        let next = blocks
            .get(i + 1)
            .map(|b| b.0)
            .filter(|&n| n < seg_end)
            .unwrap_or(seg_end);
        if at + size > next {
            return Err(format!("blocks in use before the trace overlap at {at:#x}"));
        }
        let gap = next - (at + size);
        if !exact && !seg.small && gap > 0 && gap <= SMALL_SIZE {
            blocks[i].1 .0 += gap;
        }
    }
    for (at, (size, requested, _)) in blocks {
        if let Some(seg) = segs.range_mut(..=at).next_back().map(|(_, s)| s) {
            seg.blocks.push((at, size, requested));
        }
    }
    Ok(segs.into_values().collect())
}
