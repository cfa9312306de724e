//! A snapshot as an ordered list of allocations and frees at one granularity (driver segments
//! or tensor blocks), including what was allocated before recording began, and that list as a
//! plan's timeline.
//!
//! The trace (`device_traces`) is the allocator's history, possibly cut at its start (a ring
//! buffer, or recording switched on after the model was built); `segments` is the state at dump
//! time. An allocation whose first trace event is a free, or that is live at dump time with no
//! trace event, existed before the trace: it is placed at the start, in the `setup` phase.

use std::collections::{BTreeMap, HashMap, HashSet};

use crate::plan::{DType, Event, EventKind, Phase, Plan, Role, TensorSpec};

use super::schema::{Frame, Snapshot, TraceEntry};
use super::{Granularity, SnapshotError};

/// One allocation of the trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allocation {
    pub bytes: u64,
    /// The top stack frame, as a person reads it (`modeling_gpt2.py:310:forward (aten::mm)`).
    pub frame: String,
    /// All frames joined: what matches the same allocation in another trace of the job.
    pub key: String,
    pub phase: Phase,
    pub role: Role,
    /// Allocated before the trace began (model states, typically).
    pub before_trace: bool,
}

/// The step's allocations and their alloc/free order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Trace {
    pub granularity: Granularity,
    pub allocs: Vec<Allocation>,
    /// The allocations and frees in order.
    pub events: Vec<TraceEvent>,
    /// The out-of-memory the trace recorded, if any (its request is in `allocs`).
    pub oom: Option<OomRecord>,
    pub notes: Vec<String>,
}

/// One allocation or free of the trace, with the phase it happens in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceEvent {
    pub alloc: bool,
    /// Index into `Trace::allocs`.
    pub ix: usize,
    pub phase: Phase,
}

/// The allocator's `oom` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OomRecord {
    pub requested: u64,
    pub device_free: Option<u64>,
    pub frame: String,
    /// Index into `Trace::events` of the request's allocation.
    pub event: usize,
}

/// The prefix of frame filenames that an exported plan uses (`oomprobe/<phase>/<role>`), so a
/// round trip keeps phases and roles.
pub const EXPORT_PREFIX: &str = "oomprobe/";

impl Trace {
    /// Live bytes before the first event (what existed before the trace) and the peak after any
    /// event: the trace's own peak, from the snapshot alone.
    pub fn peak(&self) -> u64 {
        let mut live = 0u64;
        let mut peak = 0u64;
        for e in &self.events {
            let b = self.allocs[e.ix].bytes;
            if e.alloc {
                live = live.saturating_add(b);
                peak = peak.max(live);
            } else {
                live = live.saturating_sub(b);
            }
        }
        peak
    }

    /// The trace as a plan's timeline: a tensor per allocation (1-byte elements, named by its
    /// top frame), its alloc and free events in order. `value` is what the plan is for (the
    /// batch when scaled). Kernels: none (a snapshot records memory, not compute).
    pub fn to_plan(&self, label: &str, value: u64) -> Plan {
        let mut workload =
            crate::workload::presets::get("tiny-gpt").expect("the tiny-gpt preset exists");
        workload.name = format!("snapshot:{label}");
        workload.batch = value;
        let tensors = self
            .allocs
            .iter()
            .map(|a| TensorSpec {
                name: a.frame.clone(),
                role: a.role,
                dtype: DType::U8,
                shape: vec![a.bytes],
                bytes: a.bytes,
                row_elems: 1,
            })
            .collect();
        let events = self
            .events
            .iter()
            .map(|e| Event {
                phase: e.phase,
                kind: if e.alloc {
                    EventKind::Alloc(e.ix)
                } else {
                    EventKind::Free(e.ix)
                },
            })
            .collect();
        Plan {
            workload,
            scenario: crate::scenario::Scenario::Batch,
            value,
            tensors,
            steps: Vec::new(),
            events,
            notes: self.notes.clone(),
        }
    }

    /// A trace from a plan's timeline (kernels dropped): what `--export-snapshot` writes.
    pub fn from_plan(plan: &Plan) -> Trace {
        let allocs = plan
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let phase = plan
                    .events
                    .iter()
                    .find(|e| e.kind == EventKind::Alloc(i))
                    .map_or(Phase::Setup, |e| e.phase);
                Allocation {
                    bytes: t.bytes,
                    frame: t.name.clone(),
                    key: t.name.clone(),
                    phase,
                    role: t.role,
                    before_trace: phase == Phase::Setup,
                }
            })
            .collect();
        let events = plan
            .events
            .iter()
            .filter_map(|e| match e.kind {
                EventKind::Alloc(ix) => Some(TraceEvent {
                    alloc: true,
                    ix,
                    phase: e.phase,
                }),
                EventKind::Free(ix) => Some(TraceEvent {
                    alloc: false,
                    ix,
                    phase: e.phase,
                }),
                EventKind::Kernel(_) => None,
            })
            .collect();
        Trace {
            granularity: Granularity::Blocks,
            allocs,
            events,
            oom: None,
            notes: Vec::new(),
        }
    }
}

/// The device whose history to read: the first whose trace records an `oom` (what a user
/// imports the file for), else the one with the most trace entries (0 when none).
fn pick_device(snap: &Snapshot) -> usize {
    if let Some(d) = snap
        .device_traces
        .iter()
        .position(|t| t.iter().any(|e| e.action == "oom"))
    {
        return d;
    }
    let busiest = snap
        .device_traces
        .iter()
        .enumerate()
        .max_by_key(|(i, t)| (t.len(), usize::MAX - i))
        .filter(|(_, t)| !t.is_empty())
        .map(|(i, _)| i);
    // No history anywhere: the device that holds the most memory.
    busiest.unwrap_or_else(|| {
        let mut by: std::collections::BTreeMap<usize, u64> = Default::default();
        for seg in &snap.segments {
            *by.entry(seg.device.max(0) as usize).or_default() += seg.total_size;
        }
        by.into_iter()
            .max_by_key(|&(d, b)| (b, usize::MAX - d))
            .map_or(0, |(d, _)| d)
    })
}

/// Which device was read, when the file has others with history or memory.
fn device_note(snap: &Snapshot, device: usize) -> Option<String> {
    let mut others: Vec<usize> = snap
        .device_traces
        .iter()
        .enumerate()
        .filter(|(i, t)| *i != device && !t.is_empty())
        .map(|(i, _)| i)
        .collect();
    for s in &snap.segments {
        let d = s.device.max(0) as usize;
        if d != device && !others.contains(&d) && snap.device_traces.len() > 1 {
            others.push(d);
        }
    }
    others.sort_unstable();
    if others.is_empty() {
        return None;
    }
    let list: Vec<String> = others.iter().map(|d| format!("cuda:{d}")).collect();
    let why = if snap
        .device_traces
        .get(device)
        .is_some_and(|t| t.iter().any(|e| e.action == "oom"))
    {
        "the device whose trace records the OOM"
    } else {
        "the device with the most trace entries"
    };
    Some(format!(
        "read cuda:{device} ({why}); {} also in the file, not read",
        list.join(", ")
    ))
}

/// The frame a person wants to see: the innermost frame of the job's own Python code (not
/// PyTorch's, not C++), with the innermost op's name; failing that the first frame there is.
pub fn top_frame(frames: &[Frame]) -> String {
    if let Some(f) = frames
        .first()
        .filter(|f| f.filename.starts_with(EXPORT_PREFIX))
    {
        return f.name.clone();
    }
    let is_py = |f: &&Frame| f.filename.ends_with(".py");
    let own = frames.iter().filter(is_py).find(|f| {
        !f.filename.contains("torch/nn/")
            && !f.filename.contains("torch/autograd/")
            && !f.filename.contains("torch/utils/")
    });
    let op = frames
        .iter()
        .find(|f| !f.filename.ends_with(".py") && f.name.contains("::"))
        .map(|f| f.name.as_str());
    let short = |f: &Frame| {
        let file = f.filename.rsplit('/').next().unwrap_or(&f.filename);
        format!("{file}:{}:{}", f.line, f.name)
    };
    // In backward the job's own code is not on the stack: the autograd node says more than
    // the engine's Python frame.
    let node = frames
        .iter()
        .find(|f| !f.filename.ends_with(".py") && f.name.contains("Backward"));
    if let (None, Some(n)) = (own, node) {
        let name = n.name.trim_start_matches("evaluate_function: ");
        return match op {
            Some(op) => format!("{name} ({op})"),
            None => name.to_string(),
        };
    }
    match (own.or_else(|| frames.iter().find(is_py)), op) {
        (Some(f), Some(op)) => format!("{} ({op})", short(f)),
        (Some(f), None) => short(f),
        (None, Some(op)) => op.to_string(),
        (None, None) => match frames.first() {
            Some(f) => short(f),
            None => "(no stack recorded)".into(),
        },
    }
}

/// A free's frames say where it was freed, not where it was allocated, except in a file
/// oomprobe exported (its frame names the tensor).
fn exported(frames: &[Frame]) -> &[Frame] {
    match frames.first() {
        Some(f) if f.filename.starts_with(EXPORT_PREFIX) => frames,
        _ => &[],
    }
}

/// Phase and role of an allocation from its frames (innermost first).
fn classify(frames: &[Frame], before_trace: bool) -> (Phase, Role) {
    if let Some(f) = frames.first() {
        if let Some(rest) = f.filename.strip_prefix(EXPORT_PREFIX) {
            if let Some((phase, role)) = parse_export_tag(rest) {
                return (if before_trace { Phase::Setup } else { phase }, role);
            }
        }
    }
    if before_trace {
        return (Phase::Setup, Role::Params);
    }
    let any = |p: &dyn Fn(&Frame) -> bool| frames.iter().any(p);
    if any(&|f| f.filename.contains("torch/optim/") || f.name.contains("optimizer")) {
        (Phase::Optimizer, Role::Optimizer)
    } else if any(&|f| {
        f.filename.contains("autograd") || f.name.contains("Backward") || f.name == "backward"
    }) {
        (Phase::Backward, Role::Activations)
    } else if any(&|f| {
        let n = f.name.to_ascii_lowercase();
        n.contains("loss") || n.contains("cross_entropy")
    }) {
        (Phase::Loss, Role::Activations)
    } else {
        (Phase::Forward, Role::Activations)
    }
}

/// `<phase>/<role>` of an exported frame.
pub fn export_tag(phase: Phase, role: Role) -> String {
    format!("{EXPORT_PREFIX}{}/{}", phase.name(), role.name())
}

fn parse_export_tag(rest: &str) -> Option<(Phase, Role)> {
    let (p, r) = rest.split_once('/')?;
    let phase = [
        Phase::Setup,
        Phase::Forward,
        Phase::Loss,
        Phase::Backward,
        Phase::Optimizer,
    ]
    .into_iter()
    .find(|x| x.name() == p)?;
    let role = Role::ALL.into_iter().find(|x| x.name() == r)?;
    Some((phase, role))
}

/// The segment a cudaMalloc for a request of `size` bytes gets (CUDACachingAllocator's
/// defaults): 2 MiB for at most 1 MiB, 20 MiB under 10 MiB, else rounded up to 2 MiB.
pub fn segment_size_for(size: u64) -> u64 {
    const MIB: u64 = 1 << 20;
    if size <= MIB {
        2 * MIB
    } else if size < 10 * MIB {
        20 * MIB
    } else {
        size.div_ceil(2 * MIB) * (2 * MIB)
    }
}

/// Building a trace: allocations so far, in-trace and pre-existing kept apart.
#[derive(Default)]
struct Collector {
    allocs: Vec<Allocation>,
    events: Vec<TraceEvent>,
    /// Pre-existing allocations, each allocated at the start.
    before: Vec<usize>,
}

impl Collector {
    fn add(&mut self, bytes: u64, frames: &[Frame], before_trace: bool) -> usize {
        let (phase, role) = classify(frames, before_trace);
        let key = frames
            .iter()
            .map(|f| format!("{}:{}:{}", f.filename, f.line, f.name))
            .collect::<Vec<_>>()
            .join("|");
        self.allocs.push(Allocation {
            bytes,
            frame: if before_trace && frames.is_empty() {
                "(allocated before recording)".into()
            } else {
                top_frame(frames)
            },
            key,
            phase,
            role,
            before_trace,
        });
        let a = self.allocs.len() - 1;
        if before_trace {
            self.before.push(a);
        }
        a
    }

    /// An allocation (`alloc`) or free at this point of the trace; a free's phase comes from
    /// its own frames, else from the event before it.
    fn push(&mut self, alloc: bool, ix: usize, frames: &[Frame]) {
        let phase = if alloc {
            self.allocs[ix].phase
        } else if !frames.is_empty() {
            classify(frames, false).0
        } else {
            self.events
                .last()
                .map_or(self.allocs[ix].phase, |e| e.phase)
        };
        self.events.push(TraceEvent { alloc, ix, phase });
    }

    fn finish(self, granularity: Granularity, oom: Option<OomRecord>, notes: Vec<String>) -> Trace {
        let shift = self.before.len();
        let mut events: Vec<TraceEvent> = self
            .before
            .iter()
            .map(|&ix| TraceEvent {
                alloc: true,
                ix,
                phase: Phase::Setup,
            })
            .collect();
        events.extend(self.events);
        Trace {
            granularity,
            allocs: self.allocs,
            events,
            oom: oom.map(|o| OomRecord {
                event: o.event + shift,
                ..o
            }),
            notes,
        }
    }
}

/// Turn a snapshot into the trace of its busiest device at `granularity`.
pub fn trace_of(snap: &Snapshot, granularity: Granularity) -> Result<Trace, SnapshotError> {
    let device = pick_device(snap);
    let empty = Vec::new();
    let entries = snap.device_traces.get(device).unwrap_or(&empty);
    let segments: Vec<_> = snap
        .segments
        .iter()
        .filter(|s| s.device as usize == device || snap.device_traces.len() <= 1)
        .collect();
    let mut notes: Vec<String> = device_note(snap, device).into_iter().collect();
    if entries.is_empty() {
        notes.push(
            "the snapshot has no trace (history was not recorded): only the state at dump time"
                .into(),
        );
    }
    let streams: HashSet<i64> = entries.iter().map(|e| e.stream).collect();
    if streams.len() > 1 {
        notes.push(format!(
            "{} streams in the trace: replayed in recorded order on one queue",
            streams.len()
        ));
    }
    let mut c = Collector::default();
    let mut oom = None;
    let mut seen: HashSet<u64> = HashSet::new();
    match granularity {
        Granularity::Blocks => {
            let mut live: HashMap<u64, usize> = HashMap::new();
            for e in entries {
                let addr = e.addr.unwrap_or(0);
                match e.action.as_str() {
                    "alloc" => {
                        if let Some(old) = live.remove(&addr) {
                            c.push(false, old, &[]); // a lost free: end the old block
                        }
                        let a = c.add(e.size, &e.frames, false);
                        c.push(true, a, &e.frames);
                        live.insert(addr, a);
                        seen.insert(addr);
                    }
                    "free_completed" => {
                        if let Some(a) = live.remove(&addr) {
                            c.push(false, a, &e.frames);
                        } else if seen.insert(addr) {
                            let a = c.add(e.size, exported(&e.frames), true);
                            c.push(false, a, &e.frames);
                        }
                    }
                    "free_requested" => {
                        // Requested before its completion: if the trace never allocated it, it
                        // was live before the trace; its free_completed (if any) ends it.
                        if !live.contains_key(&addr) && !seen.contains(&addr) {
                            let a = c.add(e.size, exported(&e.frames), true);
                            live.insert(addr, a);
                        }
                        seen.insert(addr);
                    }
                    "oom" => oom = Some(oom_request(&mut c, e, e.size)),
                    _ => {}
                }
            }
            for seg in &segments {
                for b in seg.blocks.iter().filter(|b| b.is_active()) {
                    if !seen.contains(&b.address) && !live.contains_key(&b.address) {
                        let bytes = if b.requested_size > 0 {
                            b.requested_size
                        } else {
                            b.size
                        };
                        c.add(bytes, &b.frames, true);
                    }
                }
            }
        }
        Granularity::Segments => {
            // Mapped regions by start address: (end, allocation).
            let mut live: BTreeMap<u64, (u64, usize)> = BTreeMap::new();
            for e in entries {
                let addr = e.addr.unwrap_or(0);
                match e.action.as_str() {
                    "segment_alloc" | "segment_map" => {
                        unmap(&mut c, &mut live, addr, e.size, &[]); // a lost free
                        let a = c.add(e.size, &e.frames, false);
                        c.push(true, a, &e.frames);
                        live.insert(addr, (addr + e.size, a));
                        seen.insert(addr);
                    }
                    "segment_free" | "segment_unmap" => {
                        let was_live = unmap(&mut c, &mut live, addr, e.size, &e.frames);
                        if !was_live && seen.insert(addr) {
                            let a = c.add(e.size, exported(&e.frames), true);
                            c.push(false, a, &e.frames);
                        }
                    }
                    "oom" => oom = Some(oom_request(&mut c, e, segment_size_for(e.size))),
                    _ => {}
                }
            }
            for seg in &segments {
                if !seen.contains(&seg.address) && !live.contains_key(&seg.address) {
                    let frames = seg
                        .blocks
                        .iter()
                        .find(|b| b.is_active())
                        .map_or(&[][..], |b| &b.frames[..]);
                    c.add(seg.total_size, frames, true);
                }
            }
        }
    }
    Ok(c.finish(granularity, oom, notes))
}

/// End every live region overlapping `[addr, addr+size)`; a partly unmapped region keeps its
/// remainders as new allocations. True when something was live there.
fn unmap(
    c: &mut Collector,
    live: &mut BTreeMap<u64, (u64, usize)>,
    addr: u64,
    size: u64,
    frames: &[Frame],
) -> bool {
    let end = addr.saturating_add(size.max(1));
    let hit: Vec<u64> = live
        .range(..end)
        .filter(|(&start, &(stop, _))| stop > addr && start < end)
        .map(|(&s, _)| s)
        .collect();
    for start in &hit {
        let (stop, a) = live.remove(start).expect("listed above");
        c.push(false, a, frames);
        let template = c.allocs[a].clone();
        for (lo, hi) in [(*start, addr.max(*start)), (end.min(stop), stop)] {
            if hi > lo {
                c.allocs.push(Allocation {
                    bytes: hi - lo,
                    before_trace: false,
                    ..template.clone()
                });
                let r = c.allocs.len() - 1;
                c.push(true, r, &[]);
                live.insert(lo, (hi, r));
            }
        }
    }
    !hit.is_empty()
}

/// The failed request of an `oom` entry, replayed as an allocation freed at once: on a device
/// with room it fits, under the original card's memory it fails where PyTorch's did.
fn oom_request(c: &mut Collector, e: &TraceEntry, bytes: u64) -> OomRecord {
    let a = c.add(bytes, &e.frames, false);
    let frame = c.allocs[a].frame.clone();
    c.allocs[a].frame = format!("OOM request: {frame}");
    c.push(true, a, &e.frames);
    let event = c.events.len() - 1;
    c.push(false, a, &e.frames);
    OomRecord {
        requested: e.size,
        device_free: e.device_free.or(e.addr),
        frame,
        event,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(filename: &str, line: i64, name: &str) -> Frame {
        Frame {
            filename: filename.into(),
            line,
            name: name.into(),
        }
    }

    #[test]
    fn segment_sizes_follow_the_caching_allocator() {
        const MIB: u64 = 1 << 20;
        assert_eq!(segment_size_for(512), 2 * MIB);
        assert_eq!(segment_size_for(MIB), 2 * MIB);
        assert_eq!(segment_size_for(MIB + 1), 20 * MIB);
        assert_eq!(segment_size_for(10 * MIB - 1), 20 * MIB);
        assert_eq!(segment_size_for(10 * MIB), 10 * MIB);
        assert_eq!(segment_size_for(11 * MIB), 12 * MIB);
    }

    #[test]
    fn the_top_frame_is_the_jobs_own_code_with_its_op() {
        let frames = [
            f("??", 0, "at::native::mm"),
            f("torch/nn/modules/linear.py", 125, "forward"),
            f("/home/me/train.py", 42, "step"),
        ];
        assert_eq!(top_frame(&frames), "train.py:42:step (at::native::mm)");
        let backward = [
            f("??", 0, "aten::mm"),
            f(
                "torch/csrc/autograd/engine.cpp",
                0,
                "evaluate_function: MmBackward0",
            ),
            f("torch/autograd/graph.py", 1100, "_engine_run_backward"),
        ];
        assert_eq!(top_frame(&backward), "MmBackward0 (aten::mm)");
        assert_eq!(top_frame(&[]), "(no stack recorded)");
        let (phase, role) = classify(&backward, false);
        assert_eq!((phase, role), (Phase::Backward, Role::Activations));
        let tag = export_tag(Phase::Optimizer, Role::Optimizer);
        assert_eq!(
            classify(&[f(&tag, 0, "adam.m")], false),
            (Phase::Optimizer, Role::Optimizer)
        );
        assert_eq!(classify(&[f(&tag, 0, "adam.m")], true).0, Phase::Setup);
    }
}
