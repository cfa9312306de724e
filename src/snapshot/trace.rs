//! A snapshot as an ordered list of allocations and frees at one granularity (driver segments
//! or tensor blocks), including what was allocated before recording began, and that list as a
//! plan's timeline.
//!
//! The trace (`device_traces`) is the allocator's history, possibly cut at its start (a ring
//! buffer, or recording switched on after the model was built); `segments` is the state at dump
//! time. An allocation whose first trace event is a free, or that is live at dump time with no
//! trace event, existed before the trace: it is placed at the start, in the `setup` phase.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use crate::plan::{DType, Event, EventKind, Phase, Plan, Role, TensorSpec};

use super::schema::{Frame, Snapshot, TraceEntry, ACTIONS};
use super::{Granularity, SnapshotError};

/// One allocation of the trace.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allocation {
    pub bytes: u64,
    /// The top stack frame, as a person reads it (`modeling_gpt2.py:310:forward (aten::mm)`).
    /// Shared by the allocations of one stack.
    pub frame: Arc<str>,
    /// All frames joined: what matches the same allocation in another trace of the job.
    pub key: Arc<str>,
    pub phase: Phase,
    pub role: Role,
    /// Allocated before the trace began (model states, typically).
    pub before_trace: bool,
    /// Whether `role` comes from the allocation's own frames (or the profiler's category);
    /// memory that existed before recording with no frames has no known role.
    pub role_known: bool,
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
    /// The device trace entry it comes from (None: existed before the trace).
    pub entry: Option<usize>,
}

/// The allocator's `oom` entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OomRecord {
    pub requested: u64,
    pub device_free: Option<u64>,
    pub frame: String,
    /// The call stack that asked, innermost first, as `file:line:function` (Python frames and
    /// named C++ ops; at most [`STACK_FRAMES`]).
    pub stack: Vec<String>,
    /// Index into `Trace::events` of the request's allocation.
    pub event: usize,
    /// Index of the `oom` entry in its device's trace.
    pub entry: usize,
}

/// How many frames of the OOM's stack are kept.
pub const STACK_FRAMES: usize = 12;

/// The prefix of frame filenames that an exported plan uses (`oomprobe/<phase>/<role>`), so a
/// round trip keeps phases and roles.
pub const EXPORT_PREFIX: &str = "oomprobe/";

impl Trace {
    /// Live bytes after event `e`, given `live` before it.
    pub fn apply(&self, e: &TraceEvent, live: u64) -> u64 {
        let b = self.allocs[e.ix].bytes;
        if e.alloc {
            live.saturating_add(b)
        } else {
            live.saturating_sub(b)
        }
    }

    /// The most bytes live after any of `events`.
    fn peak_over<'a>(&self, events: impl Iterator<Item = &'a TraceEvent>) -> u64 {
        events
            .scan(0u64, |live, e| {
                *live = self.apply(e, *live);
                Some(*live)
            })
            .max()
            .unwrap_or(0)
    }

    /// Live bytes before the first event (what existed before the trace) and the peak after any
    /// event: the trace's own peak, from the snapshot alone.
    pub fn peak(&self) -> u64 {
        self.peak_over(self.events.iter())
    }

    /// The peak without the refused request of a recorded OOM: what the allocator really held.
    pub fn held_peak(&self) -> u64 {
        let refused = self.oom.as_ref().map(|o| self.events[o.event].ix);
        self.peak_over(self.events.iter().filter(|e| Some(e.ix) != refused))
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
                name: a.frame.to_string(),
                role: a.role,
                dtype: DType::U8,
                shape: vec![a.bytes],
                bytes: a.bytes,
                row_elems: 1,
                stream: Default::default(),
                part_bytes: 0,
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
                    frame: t.name.as_str().into(),
                    key: t.name.as_str().into(),
                    phase,
                    role: t.role,
                    before_trace: phase == Phase::Setup,
                    role_known: true,
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
                    entry: None,
                }),
                EventKind::Free(ix) => Some(TraceEvent {
                    alloc: false,
                    ix,
                    phase: e.phase,
                    entry: None,
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

/// The devices a snapshot holds memory or history for, in order: every `device_traces[i]`
/// with an entry that is more than a dump marker, and every device a segment names.
pub fn devices(snap: &Snapshot) -> Vec<usize> {
    let mut ds: Vec<usize> = snap
        .device_traces
        .iter()
        .enumerate()
        .filter(|(_, t)| t.iter().any(|e| e.action != "snapshot"))
        .map(|(i, _)| i)
        .collect();
    ds.extend(snap.segments.iter().map(|s| s.device.max(0) as usize));
    ds.sort_unstable();
    ds.dedup();
    ds
}

/// The device whose trace records an `oom`, if one does (the first).
pub fn oom_device(snap: &Snapshot) -> Option<usize> {
    snap.device_traces
        .iter()
        .position(|t| t.iter().any(|e| e.action == "oom"))
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
        let p = slashed(&f.filename);
        !p.contains("torch/nn/") && !p.contains("torch/autograd/") && !p.contains("torch/utils/")
    });
    let op = op_of(frames);
    let op = op.as_deref();
    let short = |f: &Frame| {
        let file = f.filename.rsplit(['/', '\\']).next().unwrap_or(&f.filename);
        format!("{file}:{}:{}", f.line, f.name)
    };
    // In backward the job's own code is not on the stack: the autograd node says more than
    // the engine's Python frame.
    let node = frames
        .iter()
        .find(|f| !f.filename.ends_with(".py") && f.name.contains("Backward"));
    if let (None, Some(n)) = (own, node) {
        let name = node_name(&n.name);
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

/// A frame's path with Windows separators as `/`.
fn slashed(path: &str) -> std::borrow::Cow<'_, str> {
    if path.contains('\\') {
        path.replace('\\', "/").into()
    } else {
        path.into()
    }
}

/// The innermost ATen op of a C++ stack: `at::_ops::relu::call(...)` reads `aten::relu`;
/// failing that an `at::native::` or `aten::` frame's name without its arguments.
fn op_of(frames: &[Frame]) -> Option<String> {
    let cpp = || frames.iter().filter(|f| !f.filename.ends_with(".py"));
    if let Some(op) = cpp().find_map(|f| {
        let rest = f.name.strip_prefix("at::_ops::")?;
        let (name, _) = rest.split_once("::")?;
        Some(format!("aten::{name}"))
    }) {
        return Some(op);
    }
    cpp()
        .find(|f| f.name.starts_with("at::native::") || f.name.starts_with("aten::"))
        .map(|f| f.name.split('(').next().unwrap_or(&f.name).to_string())
}

/// An autograd node's name: `torch::autograd::generated::DivBackward0::apply(...)` reads
/// `DivBackward0`, `evaluate_function: MmBackward0` reads `MmBackward0`.
fn node_name(name: &str) -> &str {
    let name = name.trim_start_matches("evaluate_function: ");
    let name = name.split('(').next().unwrap_or(name);
    let name = name.strip_suffix("::apply").unwrap_or(name);
    name.rsplit("::").next().unwrap_or(name)
}

/// A free's frames say where it was freed, not where it was allocated, except in a file
/// oomprobe exported (its frame names the tensor).
fn exported(frames: &[Frame]) -> &[Frame] {
    match frames.first() {
        Some(f) if f.filename.starts_with(EXPORT_PREFIX) => frames,
        _ => &[],
    }
}

/// Phase and role of an allocation from its frames (innermost first) or the profiler's
/// category, and whether the role is known. Memory that existed before the trace is in the
/// setup phase; its role is what its frames tell (a module's `_apply`/`to`/`load_state_dict`
/// makes weights, `torch/optim` optimizer state, `AccumulateGrad` gradients), else unknown.
fn classify(frames: &[Frame], category: Option<&str>, before_trace: bool) -> (Phase, Role, bool) {
    if let Some(f) = frames.first() {
        if let Some(rest) = f.filename.strip_prefix(EXPORT_PREFIX) {
            if let Some((phase, role)) = parse_export_tag(rest) {
                return (if before_trace { Phase::Setup } else { phase }, role, true);
            }
        }
    }
    let by_category = category.and_then(|c| match c {
        "parameter" => Some(Role::Params),
        "gradient" => Some(Role::Gradients),
        "optimizer_state" => Some(Role::Optimizer),
        "activation" | "input" | "autograd_detail" => Some(Role::Activations),
        "temporary" => Some(Role::Workspace),
        _ => None,
    });
    let any = |p: &dyn Fn(&Frame) -> bool| frames.iter().any(p);
    let optimizer =
        || any(&|f| slashed(&f.filename).contains("torch/optim/") || f.name.contains("optimizer"));
    let backward = || {
        any(&|f| {
            f.filename.contains("autograd") || f.name.contains("Backward") || f.name == "backward"
        })
    };
    if before_trace {
        let role = by_category.or_else(|| {
            if optimizer() {
                Some(Role::Optimizer)
            } else if any(&|f| f.name.contains("AccumulateGrad")) {
                Some(Role::Gradients)
            } else if any(&|f| {
                slashed(&f.filename).ends_with("torch/nn/modules/module.py")
                    && [
                        "_apply",
                        "to",
                        "cuda",
                        "_load_from_state_dict",
                        "load_state_dict",
                    ]
                    .contains(&f.name.as_str())
                    || f.name == "from_pretrained"
            }) {
                Some(Role::Params)
            } else if !frames.is_empty() && backward() {
                Some(Role::Activations)
            } else {
                None
            }
        });
        return (Phase::Setup, role.unwrap_or(Role::Params), role.is_some());
    }
    let (phase, role) = if optimizer() {
        (Phase::Optimizer, Role::Optimizer)
    } else if backward() {
        (Phase::Backward, Role::Activations)
    } else if any(&|f| {
        let n = f.name.to_ascii_lowercase();
        n.contains("loss") || n.contains("cross_entropy")
    }) {
        (Phase::Loss, Role::Activations)
    } else {
        (Phase::Forward, Role::Activations)
    };
    (phase, by_category.unwrap_or(role), true)
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
    /// The device trace entry being read.
    entry: usize,
    /// What `add` made of each stack, by the stack's place in memory: a snapshot's equal
    /// stacks are one copy (`schema::Stack`), so a million allocations of a few thousand
    /// stacks classify and join each stack once. The stacks outlive the collector.
    seen: HashMap<Seen, Described>,
}

/// A stack (its frames' address and count) and what `add` was told with it.
type Seen = (usize, usize, Option<String>, bool);

/// An allocation's phase, role, top frame and key, as its stack gives them.
#[derive(Clone)]
struct Described {
    phase: Phase,
    role: Role,
    role_known: bool,
    frame: Arc<str>,
    key: Arc<str>,
}

impl Collector {
    fn add(
        &mut self,
        bytes: u64,
        frames: &[Frame],
        category: Option<&str>,
        before_trace: bool,
    ) -> usize {
        let seen = (
            frames.as_ptr() as usize,
            frames.len(),
            category.map(str::to_string),
            before_trace,
        );
        let d = match self.seen.get(&seen) {
            Some(d) => d.clone(),
            None => {
                let d = describe(frames, category, before_trace);
                self.seen.insert(seen, d.clone());
                d
            }
        };
        self.allocs.push(Allocation {
            bytes,
            frame: d.frame,
            key: d.key,
            phase: d.phase,
            role: d.role,
            before_trace,
            role_known: d.role_known,
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
            classify(frames, None, false).0
        } else {
            self.events
                .last()
                .map_or(self.allocs[ix].phase, |e| e.phase)
        };
        self.events.push(TraceEvent {
            alloc,
            ix,
            phase,
            entry: Some(self.entry),
        });
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
                entry: None,
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

/// What an allocation's stack says about it.
fn describe(frames: &[Frame], category: Option<&str>, before_trace: bool) -> Described {
    let (phase, role, role_known) = classify(frames, category, before_trace);
    let key = frames
        .iter()
        .map(|f| format!("{}:{}:{}", f.filename, f.line, f.name))
        .collect::<Vec<_>>()
        .join("|");
    let frame = if before_trace && frames.is_empty() {
        "(allocated before recording)".into()
    } else {
        top_frame(frames)
    };
    Described {
        phase,
        role,
        role_known,
        frame: frame.into(),
        key: key.into(),
    }
}

/// The trace of the snapshot's default device (the one whose trace records the OOM, else the
/// one with the highest peak at `granularity`): what a probe replays.
pub fn trace_of(snap: &Snapshot, granularity: Granularity) -> Result<Trace, SnapshotError> {
    trace_of_device(snap, granularity, default_device(snap, granularity))
}

/// The default device: the OOM's, else the one with the highest peak (the lowest index on a
/// tie; cuda:0 when the file holds nothing).
pub fn default_device(snap: &Snapshot, granularity: Granularity) -> usize {
    if let Some(d) = oom_device(snap) {
        return d;
    }
    devices(snap)
        .into_iter()
        .map(|d| {
            let peak = trace_of_device(snap, granularity, d).map_or(0, |t| t.peak());
            (d, peak)
        })
        .max_by_key(|&(d, p)| (p, usize::MAX - d))
        .map_or(0, |(d, _)| d)
}

/// Turn one device of a snapshot (`device_traces[device]` and the segments on it) into its
/// trace at `granularity`.
pub fn trace_of_device(
    snap: &Snapshot,
    granularity: Granularity,
    device: usize,
) -> Result<Trace, SnapshotError> {
    let empty = Vec::new();
    let entries = snap.device_traces.get(device).unwrap_or(&empty);
    let segments: Vec<_> = snap
        .segments
        .iter()
        .filter(|s| s.device.max(0) as usize == device)
        .collect();
    let notes = trace_notes(snap, granularity, device, entries);
    let mut c = Collector::default();
    let mut oom = None;
    let mut seen: HashSet<u64> = HashSet::new();
    let usable = entries
        .iter()
        .enumerate()
        .filter(|(_, e)| !needs_addr(e) || e.addr.is_some());
    match granularity {
        Granularity::Blocks => {
            let mut live: HashMap<u64, usize> = HashMap::new();
            for (i, e) in usable {
                c.entry = i;
                let addr = e.addr.unwrap_or(0);
                let cat = e.category.as_deref();
                match e.action.as_str() {
                    "alloc" => {
                        if let Some(old) = live.remove(&addr) {
                            c.push(false, old, &[]); // a lost free: end the old block
                        }
                        let a = c.add(e.size, &e.frames, cat, false);
                        c.push(true, a, &e.frames);
                        live.insert(addr, a);
                        seen.insert(addr);
                    }
                    "free_completed" => {
                        if let Some(a) = live.remove(&addr) {
                            c.push(false, a, &e.frames);
                        } else if seen.insert(addr) {
                            let a = c.add(e.size, exported(&e.frames), cat, true);
                            c.push(false, a, &e.frames);
                        }
                    }
                    "free_requested" => {
                        // Requested before its completion: if the trace never allocated it, it
                        // was live before the trace; its free_completed (if any) ends it.
                        if !live.contains_key(&addr) && !seen.contains(&addr) {
                            let a = c.add(e.size, exported(&e.frames), cat, true);
                            live.insert(addr, a);
                        }
                        seen.insert(addr);
                    }
                    "oom" => oom = Some(oom_request(&mut c, e, e.size, i)),
                    _ => {}
                }
            }
            for seg in &segments {
                for b in seg.blocks.iter().filter(|b| b.is_active()) {
                    if !seen.contains(&b.address) && !live.contains_key(&b.address) {
                        // The block's own size, as torch.cuda.memory_allocated() counts it
                        // (a plan oomprobe exported: the tensor's bytes, its requested size).
                        let bytes = if exported(&b.frames).is_empty() || b.requested_size == 0 {
                            b.size
                        } else {
                            b.requested_size
                        };
                        c.add(bytes, &b.frames, None, true);
                    }
                }
            }
        }
        Granularity::Segments => {
            // Mapped regions by start address: (end, allocation).
            let mut live: BTreeMap<u64, (u64, usize)> = BTreeMap::new();
            for (i, e) in usable {
                c.entry = i;
                let addr = e.addr.unwrap_or(0);
                match e.action.as_str() {
                    "segment_alloc" | "segment_map" => {
                        unmap(&mut c, &mut live, addr, e.size, &[]); // a lost free
                        let a = c.add(e.size, &e.frames, None, false);
                        c.push(true, a, &e.frames);
                        live.insert(addr, (addr + e.size, a));
                        seen.insert(addr);
                    }
                    "segment_free" | "segment_unmap" => {
                        let was_live = unmap(&mut c, &mut live, addr, e.size, &e.frames);
                        if !was_live && seen.insert(addr) {
                            let a = c.add(e.size, exported(&e.frames), None, true);
                            c.push(false, a, &e.frames);
                        }
                    }
                    "oom" => oom = Some(oom_request(&mut c, e, segment_size_for(e.size), i)),
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
                    c.add(seg.total_size, frames, None, true);
                }
            }
        }
    }
    Ok(c.finish(granularity, oom, notes))
}

/// Entries that name a block or a segment by its address (an `oom`, a `snapshot` marker or an
/// annotation names none).
fn needs_addr(e: &TraceEntry) -> bool {
    !matches!(
        e.action.as_str(),
        "oom" | "snapshot" | "user_defined" | "annotate"
    )
}

/// What a device's trace leaves out or reads its own way: synthetic segments, no history,
/// several streams, actions oomprobe does not know, entries without an address.
fn trace_notes(
    snap: &Snapshot,
    granularity: Granularity,
    device: usize,
    entries: &[TraceEntry],
) -> Vec<String> {
    let mut notes: Vec<String> = Vec::new();
    if let Some(why) = super::read::synthetic_segments(snap) {
        notes.push(match granularity {
            Granularity::Blocks => format!("read as tensor blocks: {why}"),
            Granularity::Segments => {
                format!("{why}; --granularity blocks reads the tensors instead")
            }
        });
    }
    if let Some(wrong) = snap.inconsistent.iter().find(|i| i.device == device) {
        notes.push(format!(
            "replayed although it cannot have happened (--lenient): {wrong}"
        ));
    }
    if entries.iter().all(|e| e.action == "snapshot") {
        notes.push(format!(
            "cuda:{device} has no trace (history was not recorded): only the state at dump time"
        ));
    }
    let streams: HashSet<i64> = entries.iter().map(|e| e.stream).collect();
    if streams.len() > 1 {
        notes.push(format!(
            "{} streams in cuda:{device}'s trace: replayed in recorded order on one queue",
            streams.len()
        ));
    }
    let unknown: Vec<&str> = entries
        .iter()
        .map(|e| e.action.as_str())
        .filter(|a| !ACTIONS.contains(a))
        .collect();
    if !unknown.is_empty() {
        let mut names: Vec<String> = unknown.iter().map(|a| crate::error::one_line(a)).collect();
        names.sort_unstable();
        names.dedup();
        notes.push(format!(
            "{} trace entries on cuda:{device} with actions oomprobe does not know ({}): skipped",
            unknown.len(),
            names.join(", ")
        ));
    }
    let no_addr = entries
        .iter()
        .filter(|e| needs_addr(e) && e.addr.is_none() && ACTIONS.contains(&e.action.as_str()))
        .count();
    if no_addr > 0 {
        notes.push(format!(
            "{no_addr} trace entries on cuda:{device} without an address: skipped"
        ));
    }
    notes
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
                    role_known: true,
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
fn oom_request(c: &mut Collector, e: &TraceEntry, bytes: u64, entry: usize) -> OomRecord {
    let a = c.add(bytes, &e.frames, None, false);
    let frame = c.allocs[a].frame.clone();
    c.allocs[a].frame = format!("OOM request: {frame}").into();
    c.push(true, a, &e.frames);
    let event = c.events.len() - 1;
    c.push(false, a, &e.frames);
    OomRecord {
        requested: e.size,
        // PyTorch 2.0 put the driver's free bytes where other entries keep the address.
        device_free: e.device_free.or(e.addr),
        frame: frame.to_string(),
        stack: stack_of(&e.frames),
        event,
        entry,
    }
}

/// A call stack as a person reads it: the innermost ATen op, then the Python frames
/// (innermost first), without the interpreter's and the allocator's C++ plumbing.
pub fn stack_of(frames: &[Frame]) -> Vec<String> {
    let py = frames
        .iter()
        .filter(|f| f.filename.ends_with(".py"))
        .map(|f| {
            let file = f.filename.rsplit(['/', '\\']).next().unwrap_or(&f.filename);
            format!("{file}:{}:{}", f.line, f.name)
        });
    op_of(frames)
        .into_iter()
        .chain(py)
        .take(STACK_FRAMES)
        .collect()
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
        let (phase, role, known) = classify(&backward, None, false);
        assert_eq!(
            (phase, role, known),
            (Phase::Backward, Role::Activations, true)
        );
        let tag = export_tag(Phase::Optimizer, Role::Optimizer);
        assert_eq!(
            classify(&[f(&tag, 0, "adam.m")], None, false),
            (Phase::Optimizer, Role::Optimizer, true)
        );
        assert_eq!(
            classify(&[f(&tag, 0, "adam.m")], None, true).0,
            Phase::Setup
        );
    }

    #[test]
    fn memory_from_before_the_trace_has_a_role_only_where_frames_tell() {
        assert_eq!(
            classify(&[], None, true),
            (Phase::Setup, Role::Params, false)
        );
        let to = [
            f("??", 0, "at::native::empty"),
            f("/usr/lib/python3/torch/nn/modules/module.py", 1340, "to"),
            f("/home/me/train.py", 10, "main"),
        ];
        assert_eq!(
            classify(&to, None, true),
            (Phase::Setup, Role::Params, true)
        );
        let adam = [f("/usr/lib/python3/torch/optim/adam.py", 90, "_init_group")];
        assert_eq!(classify(&adam, None, true).1, Role::Optimizer);
        let grad = [f("??", 0, "torch::autograd::AccumulateGrad::apply")];
        assert_eq!(classify(&grad, None, true).1, Role::Gradients);
        let other = [f("/home/me/train.py", 10, "main")];
        assert!(!classify(&other, None, true).2);
        assert_eq!(
            classify(&[], Some("optimizer_state"), true).1,
            Role::Optimizer
        );
        assert_eq!(classify(&[], Some("temporary"), false).1, Role::Workspace);
    }
}
