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

use std::borrow::Cow;
use std::cell::RefCell;
use std::collections::{HashMap, HashSet};
use std::ops::Deref;
use std::sync::Arc;

use serde::de::{IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// `torch.cuda.memory._snapshot()`: the segments at dump time and the allocator's history.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct Snapshot {
    #[serde(default)]
    pub segments: Vec<Segment>,
    /// One list of trace entries per device: `device_traces[i]` is cuda:i (empty when history
    /// was not recorded or the device was not used).
    #[serde(default, deserialize_with = "trace_lists")]
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

/// What one read keeps aside: the stacks it has seen, and the trace entries taken as the
/// pickle was parsed ([`take_trace_entry`]).
#[derive(Default)]
struct Interner {
    by_content: HashSet<Arc<[Frame]>>,
    /// By the pickle memo id of their list.
    by_id: HashMap<u64, Stack>,
    /// Trace entries, by the pickle memo id of the list they were appended to.
    traces: HashMap<u64, Vec<TraceEntry>>,
    /// The memo ids of lists whose first item was not a trace entry.
    not_traces: HashSet<u64>,
}

thread_local! {
    /// What the [`interning`] call running on this thread has read so far.
    static INTERNER: RefCell<Option<Interner>> = const { RefCell::new(None) };
}

/// Run `read` (one deserialization) with equal stacks read as one shared copy, and trace
/// entries kept as [`take_trace_entry`] takes them. What was kept is forgotten when it
/// returns.
pub fn interning<T>(read: impl FnOnce() -> T) -> T {
    let outer = INTERNER.with(|i| i.borrow_mut().replace(Interner::default()));
    let out = read();
    INTERNER.with(|i| *i.borrow_mut() = outer);
    out
}

/// serde-pickle's `take_list_items` (vendor/serde-pickle/PATCHED.md, change 5), called inside
/// [`interning`]: each trace entry is made a [`TraceEntry`] as soon as the pickle has appended
/// it to its list, and the parsed dict is dropped, so that a million entries are never held as
/// parsed values. A list holds trace entries when its first item is a dict with an `action`
/// key; an item of such a list that is not one fails the read, as it would have after.
pub fn take_trace_entry(list: u64, item: serde_pickle::Walk<'_>) -> serde_pickle::Result<bool> {
    let known = INTERNER.with(|i| {
        let i = i.borrow();
        let seen = i.as_ref()?;
        Some((
            seen.traces.contains_key(&list),
            seen.not_traces.contains(&list),
        ))
    });
    let (trace, not_trace) = match known {
        Some(k) => k,
        None => return Ok(false),
    };
    if not_trace {
        return Ok(false);
    }
    if !trace && !HasAction::deserialize(item).is_ok_and(|h| h.0) {
        INTERNER.with(|i| i.borrow_mut().as_mut().map(|s| s.not_traces.insert(list)));
        return Ok(false);
    }
    let entry = TraceEntry::deserialize(item)?;
    INTERNER.with(|i| {
        if let Some(seen) = i.borrow_mut().as_mut() {
            seen.traces.entry(list).or_default().push(entry);
        }
    });
    Ok(true)
}

/// Whether a parsed value is a dict with an `action` key (a trace entry, by its shape).
struct HasAction(bool);

impl<'de> Deserialize<'de> for HasAction {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = HasAction;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a dict")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<HasAction, A::Error> {
                let mut found = false;
                while let Some(key) = map.next_key::<IsAction>()? {
                    found |= key.0;
                    map.next_value::<IgnoredAny>()?;
                }
                Ok(HasAction(found))
            }
        }
        d.deserialize_map(V)
    }
}

/// Whether a dict key is the string `action`.
struct IsAction(bool);

impl<'de> Deserialize<'de> for IsAction {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = IsAction;
            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str("a string")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<IsAction, E> {
                Ok(IsAction(v == "action"))
            }
        }
        d.deserialize_str(V)
    }
}

/// `Snapshot::device_traces`: each list either taken whole from what [`take_trace_entry`]
/// kept (its items then read back as unit), or read as it stands.
fn trace_lists<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<Vec<TraceEntry>>, D::Error> {
    Ok(Vec::<TraceList>::deserialize(d)?
        .into_iter()
        .map(|t| t.0)
        .collect())
}

struct TraceList(Vec<TraceEntry>);

impl<'de> Deserialize<'de> for TraceList {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        d.deserialize_newtype_struct(serde_pickle::MEMO_ID, TraceListVisitor)
    }
}

struct TraceListVisitor;

impl<'de> Visitor<'de> for TraceListVisitor {
    type Value = TraceList;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str("a list of trace entries")
    }

    fn visit_newtype_struct<D: Deserializer<'de>>(self, d: D) -> Result<TraceList, D::Error> {
        Vec::deserialize(d).map(TraceList)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<TraceList, A::Error> {
        let missing = || serde::de::Error::custom("a memoized trace without its entries");
        let id: u64 = seq.next_element()?.ok_or_else(missing)?;
        let taken = (id != u64::MAX)
            .then(|| INTERNER.with(|i| i.borrow_mut().as_mut()?.traces.remove(&id)))
            .flatten();
        let Some(taken) = taken else {
            return Ok(TraceList(seq.next_element()?.ok_or_else(missing)?));
        };
        let items = seq
            .next_element::<Vec<IgnoredAny>>()?
            .ok_or_else(missing)?
            .len();
        if items != taken.len() {
            return Err(serde::de::Error::custom(format!(
                "a trace of {items} items, of which {} are trace entries",
                taken.len()
            )));
        }
        Ok(TraceList(taken))
    }
}

/// One action of the caching allocator, in order.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct TraceEntry {
    /// One of [`ACTIONS`]; others are skipped with a note.
    pub action: Action,
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

/// A trace entry's action: one of [`ACTIONS`] without a copy of its own (a million entries
/// each held an allocation for "alloc"), or any other name as read.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "String", into = "String")]
pub struct Action(Cow<'static, str>);

impl Action {
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl From<&str> for Action {
    fn from(name: &str) -> Self {
        match ACTIONS.iter().find(|a| **a == name) {
            Some(known) => Action(Cow::Borrowed(known)),
            None => Action(Cow::Owned(name.to_string())),
        }
    }
}

impl From<String> for Action {
    fn from(name: String) -> Self {
        match ACTIONS.iter().find(|a| **a == name) {
            Some(known) => Action(Cow::Borrowed(known)),
            None => Action(Cow::Owned(name)),
        }
    }
}

impl From<Action> for String {
    fn from(a: Action) -> String {
        a.0.into_owned()
    }
}

impl Deref for Action {
    type Target = str;
    fn deref(&self) -> &str {
        &self.0
    }
}

impl PartialEq<str> for Action {
    fn eq(&self, other: &str) -> bool {
        *self.0 == *other
    }
}

impl PartialEq<&str> for Action {
    fn eq(&self, other: &&str) -> bool {
        *self.0 == **other
    }
}

impl std::fmt::Display for Action {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
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
