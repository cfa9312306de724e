//! Read a snapshot file (`torch.cuda.memory._dump_snapshot`, a pickle) into the typed schema,
//! with one clear reason when the file is not one.

use std::path::Path;

use super::schema::{Segment, Snapshot, ACTIONS, NO_ADDRESS};
use super::SnapshotError;

/// Read and check a snapshot file.
pub fn read_file(path: &Path) -> Result<Snapshot, SnapshotError> {
    let bytes = std::fs::read(path).map_err(|e| SnapshotError::Io(e.to_string()))?;
    read_bytes(&bytes)
}

/// Parse and check snapshot bytes.
pub fn read_bytes(bytes: &[u8]) -> Result<Snapshot, SnapshotError> {
    if bytes.is_empty() {
        return Err(SnapshotError::NotSnapshot("the file is empty".into()));
    }
    if bytes.starts_with(&[0x1f, 0x8b]) {
        return Err(SnapshotError::NotSnapshot(
            "the file is gzip-compressed: gunzip it first".into(),
        ));
    }
    // Protocol 2+ pickles start with PROTO (0x80); protocols 0 and 1 with an opcode such as '('
    // or '}'. Text (JSON, HTML) is refused here with a useful message.
    if bytes[0] == b'{' || bytes[0] == b'<' || bytes[0] == b'[' {
        return Err(SnapshotError::NotSnapshot(
            "the file is text, not a pickle (torch.cuda.memory._dump_snapshot writes a pickle)"
                .into(),
        ));
    }
    let opts = serde_pickle::DeOptions::new;
    let mut snap: Snapshot = match serde_pickle::from_slice::<Snapshot>(bytes, opts()) {
        Ok(s) => s,
        Err(e) => match serde_pickle::from_slice::<Vec<Segment>>(bytes, opts()) {
            // `torch.cuda.memory_snapshot()` pickled as it is: a bare list of segments, no
            // history (the state at dump time).
            Ok(segments) => Snapshot {
                segments,
                device_traces: Vec::new(),
            },
            Err(_) => {
                let msg = e.to_string();
                return Err(if msg.contains("EOF") || msg.contains("end of file") {
                    SnapshotError::Truncated(msg)
                } else {
                    SnapshotError::NotSnapshot(msg)
                });
            }
        },
    };
    fill_addresses(&mut snap);
    check(&snap)?;
    Ok(snap)
}

/// PyTorch 2.0's blocks have no address: each lies after the blocks before it in its segment
/// (the allocator splits a segment front to back and lists its blocks in address order).
pub fn fill_addresses(snap: &mut Snapshot) {
    for seg in &mut snap.segments {
        let mut at = seg.address;
        for b in &mut seg.blocks {
            if b.address == NO_ADDRESS {
                b.address = at;
            }
            at = b.address.saturating_add(b.size);
        }
    }
}

/// What serde cannot check: known actions, addresses where an action needs one, sane sizes.
fn check(snap: &Snapshot) -> Result<(), SnapshotError> {
    for (d, trace) in snap.device_traces.iter().enumerate() {
        for (i, e) in trace.iter().enumerate() {
            if !ACTIONS.contains(&e.action.as_str()) {
                return Err(SnapshotError::Schema(format!(
                    "device {d} trace entry {i}: unknown action '{}'",
                    e.action
                )));
            }
            if e.action != "oom" && e.action != "snapshot" && e.addr.is_none() {
                return Err(SnapshotError::Schema(format!(
                    "device {d} trace entry {i}: '{}' without an address",
                    e.action
                )));
            }
        }
    }
    for (s, seg) in snap.segments.iter().enumerate() {
        let blocks: u64 = seg.blocks.iter().map(|b| b.size).sum();
        if !seg.is_expandable && blocks > seg.total_size {
            return Err(SnapshotError::Schema(format!(
                "segment {s} at {:#x}: its blocks ({blocks} bytes) exceed its size ({})",
                seg.address, seg.total_size
            )));
        }
    }
    Ok(())
}
