//! The snapshot's schema as PyTorch has written it since 2.0 (`torch/cuda/memory.py`: the
//! `Snapshot`, `Segment`, `Block`, `Frame` and `TraceEntry` TypedDicts; the dicts built in
//! `torch/csrc/cuda/Module.cpp`, later `memory_snapshot.cpp`), for serde-pickle in both
//! directions. Every field a version may omit is optional and unknown fields are ignored
//! (`allocator_settings`, `external_annotations`, `compile_context`, `user_metadata`, ...).
//!
//! What changed between versions (docs/snapshots.md has the commits):
//! - 2.0: blocks carry `history: [{addr, real_size, frames}]` and no `address`/`frames`;
//!   segments no `frames`/`is_expandable`/`segment_pool_id`; trace entries no `time_us`.
//! - 2.1: blocks `address`, `frames`, `requested_size`; segments `frames`, `is_expandable`,
//!   `segment_pool_id`; `time_us`; `segment_map`/`segment_unmap` for expandable segments.
//! - 2.5+: a top-level `allocator_settings`, later `external_annotations`; `user_defined`
//!   trace entries (`torch.cuda.memory._record_memory_history` annotations).
//! - `torch.cuda.memory._profile_to_snapshot` (the profiler's timeline as a snapshot): blocks
//!   of only `size`/`state`, trace entries with a `category` (`parameter`, `activation`, ...).

use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::ops::Deref;
use std::sync::Arc;

use serde::de::{SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// `torch.cuda.memory._snapshot()`: the segments at dump time and the allocator's history.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Snapshot {
    #[serde(default)]
    pub segments: Vec<Segment>,
    /// One list of trace entries per device: `device_traces[i]` is cuda:i (empty when history
    /// was not recorded or the device was not used).
    #[serde(default)]
    pub device_traces: Vec<Vec<TraceEntry>>,
    /// PyTorch 2.5+: the allocator's settings when the snapshot was taken (a dict:
    /// `PYTORCH_CUDA_ALLOC_CONF`, `max_split_size`, `expandable_segments`, ...); the
    /// allocator replay runs with them.
    #[serde(default, skip_serializing)]
    pub allocator_settings: Option<serde_pickle::Value>,
    /// Filled by `read` (`consistency::check_all`), once per file: the first inconsistency of
    /// each device whose trace cannot have happened. Not part of the file.
    #[serde(skip)]
    pub inconsistent: Vec<Inconsistency>,
}

/// The first event of a device's trace that cannot have happened, and how many did
/// (`super::consistency` finds them).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Inconsistency {
    pub device: usize,
    /// The index in `device_traces[device]`; None for the state before the trace.
    pub entry: Option<usize>,
    pub what: String,
    /// How many entries break the trace in all (this one included).
    pub count: usize,
}

impl std::fmt::Display for Inconsistency {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.entry {
            Some(i) => write!(f, "cuda:{} trace entry {i}: {}", self.device, self.what)?,
            None => write!(f, "cuda:{}: {}", self.device, self.what)?,
        }
        if self.count > 1 {
            write!(f, " ({} inconsistent entries in all)", self.count)?;
        }
        Ok(())
    }
}

/// Memory returned by one cudaMalloc (or one expandable segment), split into blocks.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Segment {
    #[serde(default)]
    pub device: i64,
    #[serde(default)]
    pub address: u64,
    pub total_size: u64,
    #[serde(default)]
    pub stream: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub segment_type: Option<String>,
    #[serde(default)]
    pub allocated_size: u64,
    #[serde(default)]
    pub active_size: u64,
    #[serde(default)]
    pub requested_size: u64,
    #[serde(default)]
    pub is_expandable: bool,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub segment_pool_id: Option<(i64, i64)>,
    #[serde(default)]
    pub blocks: Vec<Block>,
}

/// A piece of a segment: in use by a tensor, waiting for another stream, or free for reuse.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Block {
    /// PyTorch 2.0 wrote no block address (each block carried a `history`): read as
    /// [`NO_ADDRESS`], then laid out from its segment's address (`read::fill_addresses`).
    #[serde(default = "no_address")]
    pub address: u64,
    pub size: u64,
    #[serde(default)]
    pub requested_size: u64,
    /// active_allocated | active_awaiting_free (active_pending_free) | inactive
    pub state: String,
    #[serde(default)]
    pub frames: Stack,
    /// PyTorch 2.0: what was allocated in the block, newest last (`read` takes the frames and
    /// requested size from it when the block has none of its own).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub history: Vec<History>,
}

impl Default for Block {
    fn default() -> Self {
        Block {
            address: NO_ADDRESS,
            size: 0,
            requested_size: 0,
            state: "inactive".into(),
            frames: Stack::default(),
            history: Vec::new(),
        }
    }
}

/// One allocation in a PyTorch 2.0 block's `history`.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct History {
    #[serde(default)]
    pub addr: u64,
    #[serde(default)]
    pub real_size: u64,
    #[serde(default)]
    pub frames: Stack,
}

/// A block address the file did not give.
pub const NO_ADDRESS: u64 = u64::MAX;

fn no_address() -> u64 {
    NO_ADDRESS
}

impl Block {
    /// Whether a tensor (or a pending free) holds the block.
    pub fn is_active(&self) -> bool {
        self.state.starts_with("active")
    }
}

/// One stack frame, innermost first in a list.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Frame {
    #[serde(default)]
    pub filename: String,
    #[serde(default)]
    pub line: i64,
    #[serde(default)]
    pub name: String,
}

/// A call stack, innermost first (a list of [`Frame`]s in the file). Trace entries and blocks
/// that share a stack share one copy: PyTorch's snapshots repeat the same few thousand stacks
/// across up to millions of trace entries (`_record_memory_history(max_entries=...)`), and a
/// copy each took gigabytes. Within [`interning`], equal stacks read are one allocation.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Stack(Arc<[Frame]>);

impl Deref for Stack {
    type Target = [Frame];
    fn deref(&self) -> &[Frame] {
        &self.0
    }
}

impl From<Vec<Frame>> for Stack {
    fn from(frames: Vec<Frame>) -> Self {
        Stack(frames.into())
    }
}

impl Serialize for Stack {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.0.serialize(s)
    }
}

impl<'de> Deserialize<'de> for Stack {
    /// Through serde-pickle, a stack the file memoized (`pickle` writes a list once and refers
    /// to it after) is read once per read (vendor/serde-pickle/PATCHED.md, `MEMO_ID`).
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_newtype_struct(serde_pickle::MEMO_ID, StackVisitor)
    }
}

struct StackVisitor;

impl<'de> Visitor<'de> for StackVisitor {
    type Value = Stack;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a list of stack frames")
    }

    fn visit_newtype_struct<D: Deserializer<'de>>(self, d: D) -> Result<Stack, D::Error> {
        Ok(intern(Vec::<Frame>::deserialize(d)?))
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Stack, A::Error> {
        let missing = || serde::de::Error::custom("a memoized stack without its frames");
        let id: u64 = seq.next_element()?.ok_or_else(missing)?;
        let known = (id != u64::MAX)
            .then(|| INTERNER.with(|i| i.borrow().as_ref()?.by_id.get(&id).cloned()))
            .flatten();
        if let Some(stack) = known {
            return Ok(stack);
        }
        let stack = intern(seq.next_element::<Vec<Frame>>()?.ok_or_else(missing)?);
        if id != u64::MAX {
            INTERNER.with(|i| {
                if let Some(seen) = i.borrow_mut().as_mut() {
                    seen.by_id.insert(id, stack.clone());
                }
            });
        }
        Ok(stack)
    }
}

/// A frame's strings as they may reach a terminal: control characters escaped (a file may put
/// an escape sequence in a filename; `crate::error::one_line`).
fn escaped(mut f: Frame) -> Frame {
    for s in [&mut f.filename, &mut f.name] {
        if s.chars().any(char::is_control) {
            *s = crate::error::one_line(s);
        }
    }
    f
}

/// The stack of these frames (their strings escaped): the copy read before, if any.
fn intern(frames: Vec<Frame>) -> Stack {
    let frames: Vec<Frame> = frames.into_iter().map(escaped).collect();
    INTERNER.with(|i| match i.borrow_mut().as_mut() {
        Some(seen) => match seen.by_content.get(&frames[..]) {
            Some(s) => Stack(s.clone()),
            None => {
                let s: Arc<[Frame]> = frames.into();
                seen.by_content.insert(s.clone());
                Stack(s)
            }
        },
        None => frames.into(),
    })
}

/// The stacks one read has seen.
#[derive(Default)]
struct Interner {
    by_content: HashSet<Arc<[Frame]>>,
    /// By the pickle memo id of their list.
    by_id: HashMap<u64, Stack>,
}

thread_local! {
    /// The stacks read so far by the [`interning`] call running on this thread.
    static INTERNER: RefCell<Option<Interner>> = const { RefCell::new(None) };
}

/// Run `read` (one deserialization) with equal stacks read as one shared copy. The stacks
/// seen are forgotten when it returns.
pub fn interning<T>(read: impl FnOnce() -> T) -> T {
    let outer = INTERNER.with(|i| i.borrow_mut().replace(Interner::default()));
    let out = read();
    INTERNER.with(|i| *i.borrow_mut() = outer);
    out
}

/// One action of the caching allocator, in order.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TraceEntry {
    /// One of [`ACTIONS`]; others are skipped with a note.
    pub action: String,
    /// Absent for `oom` (its free bytes are in `device_free`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub addr: Option<u64>,
    #[serde(default)]
    pub size: u64,
    #[serde(default)]
    pub stream: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_us: Option<i64>,
    #[serde(default)]
    pub frames: Stack,
    /// `oom` only: what the driver still reported free.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_free: Option<u64>,
    /// `_profile_to_snapshot`: the profiler's category of the tensor (parameter, gradient,
    /// optimizer_state, activation, temporary, input, autograd_detail, unknown).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub category: Option<String>,
}

/// The actions PyTorch writes (`TraceEntry::Action` in CUDACachingAllocator.h), and
/// `annotate`, which earlier oomprobe releases accepted.
pub const ACTIONS: [&str; 11] = [
    "alloc",
    "free_requested",
    "free_completed",
    "segment_alloc",
    "segment_free",
    "segment_map",
    "segment_unmap",
    "snapshot",
    "oom",
    "user_defined",
    "annotate",
];

/// More memory than any one device has (the largest, MI355X, has 288 GB).
pub const MAX_DEVICE_BYTES: u64 = 1 << 40;

/// Why the file's segments are no driver allocations, when they are not: a CPU or GPU profile
/// turned into a snapshot by `torch.cuda._memory_viz._profile_to_snapshot` holds one made-up
/// segment per device, from the lowest tensor address to the highest (tens of TiB for host
/// memory), and trace entries with the profiler's `category`. Such a file is read as blocks.
pub fn synthetic_segments(snap: &Snapshot) -> Option<String> {
    if let Some(seg) = snap
        .segments
        .iter()
        .find(|s| s.total_size > MAX_DEVICE_BYTES)
    {
        return Some(format!(
            "a segment of {} at {:#x} is larger than any device: its segments are made up, as \
             _profile_to_snapshot makes them (one per device, from the lowest tensor address to \
             the highest)",
            crate::units::fmt_bytes(seg.total_size),
            seg.address
        ));
    }
    snap.device_traces
        .iter()
        .flatten()
        .any(|e| e.category.is_some())
        .then(|| {
            "its trace entries carry a profiler's categories: a profile turned into a snapshot by \
             _profile_to_snapshot, whose segments are made up"
                .to_string()
        })
}
