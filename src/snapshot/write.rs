//! Write a trace (a plan's timeline) as a snapshot pickle that PyTorch's memory viewer opens
//! (`python -m torch.cuda._memory_viz trace_plot FILE -o out.html`, pytorch.org/memory_viz).
//!
//! The allocator written is the simplest one: every allocation gets its own 512-byte-rounded
//! segment at a fresh address (no caching, no reuse), one stream, time stamps = event numbers.
//! What the step holds before it starts (the `setup` phase) is in `segments` and not in the
//! trace, as when recording starts after the model is built. Each entry's single frame is
//! `{filename: "oomprobe/<phase>/<role>", line: 0, name: <tensor name>}`, which the importer
//! reads back, so export then import gives the same timeline.

use std::path::Path;

use super::schema::{Block, Frame, Segment, Snapshot, Stack, TraceEntry};
use super::trace::{export_tag, Trace};
use super::SnapshotError;
use crate::plan::Phase;

/// Where the written addresses start (a typical CUDA device address).
const BASE: u64 = 0x7f00_0000_0000;

fn round512(b: u64) -> u64 {
    b.max(1).div_ceil(512) * 512
}

/// The snapshot of a trace.
pub fn to_snapshot(trace: &Trace) -> Snapshot {
    let mut addr = Vec::with_capacity(trace.allocs.len());
    let mut next = BASE;
    for a in &trace.allocs {
        addr.push(next);
        next += round512(a.bytes);
    }
    let frames = |ix: usize, phase: Phase| {
        let a = &trace.allocs[ix];
        Stack::from(vec![Frame {
            filename: export_tag(phase, a.role),
            line: 0,
            name: a.frame.to_string(),
        }])
    };
    let mut entries = Vec::new();
    let mut live = vec![false; trace.allocs.len()];
    for (t, e) in trace.events.iter().enumerate() {
        let a = &trace.allocs[e.ix];
        let entry = |action: &str, size: u64| TraceEntry {
            action: action.into(),
            addr: Some(addr[e.ix]),
            size,
            stream: 0,
            time_us: Some(t as i64),
            frames: frames(e.ix, e.phase),
            ..Default::default()
        };
        let seg = round512(a.bytes);
        if e.alloc {
            live[e.ix] = true;
            if e.phase == Phase::Setup {
                continue; // allocated before recording began
            }
            entries.push(entry("segment_alloc", seg));
            entries.push(entry("alloc", a.bytes));
        } else {
            live[e.ix] = false;
            entries.push(entry("free_requested", a.bytes));
            entries.push(entry("free_completed", a.bytes));
            entries.push(entry("segment_free", seg));
        }
    }
    let segments = (0..trace.allocs.len())
        .filter(|&i| live[i])
        .map(|i| {
            let a = &trace.allocs[i];
            let size = round512(a.bytes);
            let alloc_phase = trace
                .events
                .iter()
                .find(|e| e.alloc && e.ix == i)
                .map_or(Phase::Setup, |e| e.phase);
            Segment {
                device: 0,
                address: addr[i],
                total_size: size,
                stream: 0,
                segment_type: Some(if size <= 1 << 20 { "small" } else { "large" }.into()),
                allocated_size: size,
                active_size: size,
                requested_size: a.bytes,
                is_expandable: false,
                segment_pool_id: Some((0, 0)),
                blocks: vec![Block {
                    address: addr[i],
                    size,
                    requested_size: a.bytes,
                    state: "active_allocated".into(),
                    frames: frames(i, alloc_phase),
                    history: Vec::new(),
                }],
            }
        })
        .collect();
    Snapshot {
        segments,
        device_traces: vec![entries],
        allocator_settings: None,
        inconsistent: Vec::new(),
    }
}

/// The snapshot's pickle bytes.
pub fn to_bytes(snap: &Snapshot) -> Result<Vec<u8>, SnapshotError> {
    serde_pickle::to_vec(snap, serde_pickle::SerOptions::new())
        .map_err(|e| SnapshotError::Io(format!("cannot encode the snapshot: {e}")))
}

/// Write a trace as a snapshot file.
pub fn write_file(trace: &Trace, path: &Path) -> Result<(), SnapshotError> {
    let bytes = to_bytes(&to_snapshot(trace))?;
    std::fs::write(path, bytes).map_err(|e| SnapshotError::Io(format!("{}: {e}", path.display())))
}
