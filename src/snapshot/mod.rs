//! PyTorch memory snapshots (`torch.cuda.memory._dump_snapshot`): read one into a step's
//! timeline at the granularity that matters (driver segments or tensor blocks), scale two of
//! them across batch sizes, and write a plan's timeline back as a snapshot PyTorch's viewer
//! opens. See docs/snapshots.md.

pub mod allocator;
pub mod consistency;
pub mod describe;
pub mod nesting;
pub mod read;
pub mod replay;
pub mod report;
pub mod scale;
pub mod schema;
pub mod trace;
pub mod verdict;
pub mod write;

use std::path::Path;

use serde::{Deserialize, Serialize};
use thiserror::Error;

pub use trace::{Allocation, OomRecord, Trace};

/// Why a snapshot file cannot be used (always bad input: exit 2).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum SnapshotError {
    #[error("cannot read it: {0}")]
    Io(String),
    #[error("not a PyTorch memory snapshot: {0}")]
    NotSnapshot(String),
    #[error("truncated: {0}")]
    Truncated(String),
    #[error("does not follow the snapshot schema: {0}")]
    Schema(String),
    #[error("{0}")]
    Scale(String),
    /// A device the file does not hold (the message names the flag).
    #[error("{0}")]
    Device(String),
}

/// What one allocation of the replay is.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum Granularity {
    /// The segments the caching allocator asked the driver for (cudaMalloc / mapped ranges):
    /// what the device must really provide.
    #[default]
    Segments,
    /// The tensor blocks the program asked the caching allocator for (sizes as recorded).
    Blocks,
}

impl Granularity {
    pub fn name(self) -> &'static str {
        match self {
            Granularity::Segments => "segments",
            Granularity::Blocks => "blocks",
        }
    }
}

/// Read a snapshot file and turn its default device (the OOM's, else the highest peak) into
/// its trace at `granularity`.
pub fn load(path: &Path, granularity: Granularity) -> Result<Trace, SnapshotError> {
    load_device(path, granularity, None)
}

/// Read one device of a snapshot file (None: the default device) as a trace.
pub fn load_device(
    path: &Path,
    granularity: Granularity,
    device: Option<usize>,
) -> Result<Trace, SnapshotError> {
    let snap = read::read_file(path)?;
    match device {
        Some(d) => trace::trace_of_device(&snap, granularity, d),
        None => trace::trace_of(&snap, granularity),
    }
}

/// What a probe replays: one snapshot as recorded, or two at two batch sizes scaled to the
/// probe's batch. Travels to probe children inside their request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Source {
    pub files: Vec<std::path::PathBuf>,
    /// The batch of each file (two files: required).
    #[serde(default)]
    pub batches: Vec<u64>,
    pub granularity: Granularity,
    /// The device to read (None: the file's default device).
    #[serde(default)]
    pub device: Option<usize>,
}

impl Source {
    /// The scaling model of a two-snapshot source (blocks granularity).
    pub fn model(&self) -> Result<scale::ScaleModel, SnapshotError> {
        match (&self.files[..], &self.batches[..]) {
            ([a, b, ..], [ba, bb, ..]) => {
                let ta = load_device(a, Granularity::Blocks, self.device)?;
                let tb = load_device(b, Granularity::Blocks, self.device)?;
                scale::ScaleModel::fit(&ta, *ba, &tb, *bb)
            }
            _ => Err(SnapshotError::Scale(
                "scaling needs two snapshots and their batch sizes (--batch-of A,B)".into(),
            )),
        }
    }

    /// True when the source scales (two snapshots).
    pub fn scales(&self) -> bool {
        self.files.len() >= 2
    }

    /// The plan to replay at batch `value` (ignored for a single snapshot).
    pub fn plan_at(&self, value: u64) -> Result<crate::plan::Plan, SnapshotError> {
        let label = self
            .files
            .first()
            .and_then(|p| p.file_name())
            .map_or_else(|| "snapshot".into(), |n| n.to_string_lossy().into_owned());
        if self.scales() {
            Ok(self.model()?.at(value).to_plan(&label, value))
        } else {
            let f = self
                .files
                .first()
                .ok_or_else(|| SnapshotError::Io("no snapshot file given".into()))?;
            Ok(load_device(f, self.granularity, self.device)?.to_plan(&label, value))
        }
    }
}
