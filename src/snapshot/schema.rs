//! The snapshot's schema as PyTorch writes it (`torch/cuda/memory.py`: the `Snapshot`,
//! `Segment`, `Block`, `Frame` and `TraceEntry` TypedDicts), for serde-pickle in both
//! directions. Fields PyTorch may omit are optional; unknown fields are ignored.

use serde::{Deserialize, Serialize};

/// `torch.cuda.memory._snapshot()`: the segments at dump time and the allocator's history.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Snapshot {
    pub segments: Vec<Segment>,
    /// One list of trace entries per device (empty when history was not recorded).
    #[serde(default)]
    pub device_traces: Vec<Vec<TraceEntry>>,
}

/// Memory returned by one cudaMalloc (or one expandable segment), split into blocks.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Segment {
    #[serde(default)]
    pub device: i64,
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
    /// active_allocated | active_awaiting_free | inactive
    pub state: String,
    #[serde(default)]
    pub frames: Vec<Frame>,
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
#[derive(Debug, Clone, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Frame {
    pub filename: String,
    pub line: i64,
    pub name: String,
}

/// One action of the caching allocator, in order.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TraceEntry {
    /// alloc | free_requested | free_completed | segment_alloc | segment_free | segment_map |
    /// segment_unmap | snapshot | oom | annotate
    pub action: String,
    /// Absent for `oom` (older PyTorch put the device's free bytes here).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub addr: Option<u64>,
    #[serde(default)]
    pub size: u64,
    #[serde(default)]
    pub stream: i64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub time_us: Option<i64>,
    #[serde(default)]
    pub frames: Vec<Frame>,
    /// `oom` only: what the driver still reported free.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device_free: Option<u64>,
}

/// The actions oomprobe knows; any other is a bad file.
pub const ACTIONS: [&str; 10] = [
    "alloc",
    "free_requested",
    "free_completed",
    "segment_alloc",
    "segment_free",
    "segment_map",
    "segment_unmap",
    "snapshot",
    "oom",
    "annotate",
];
