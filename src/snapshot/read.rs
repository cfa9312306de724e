//! Read a snapshot file into the typed schema, whatever PyTorch (or a person) wrote: the pickle
//! of `torch.cuda.memory._dump_snapshot` (every layout since 2.0), a bare list of segments
//! (`torch.cuda.memory_snapshot()` pickled), the same dicts as JSON, and the HTML page (or its
//! `local_files` JSON) that `torch.cuda._memory_viz` writes around the pickle. One clear
//! reason when the file is none of these.

use std::path::Path;

use base64::Engine;

use super::schema::{interning, Segment, Snapshot, NO_ADDRESS};
use super::SnapshotError;

/// A snapshot and what kind of file it came from.
#[derive(Debug, Clone, PartialEq)]
pub struct Loaded {
    pub snapshot: Snapshot,
    /// e.g. "pickle (dict)", "JSON (bare list of segments)", "HTML from torch.cuda._memory_viz".
    pub format: String,
}

/// Read and check a snapshot file.
pub fn read_file(path: &Path) -> Result<Snapshot, SnapshotError> {
    Ok(load_file(path)?.snapshot)
}

/// The largest snapshot file read: `_dump_snapshot` with a million trace entries and their
/// stacks writes a few hundred MB.
pub const MAX_SNAPSHOT_BYTES: u64 = 1 << 30;

/// Read a snapshot file and say what kind of file it was.
pub fn load_file(path: &Path) -> Result<Loaded, SnapshotError> {
    let bytes = crate::input::read_capped(path, MAX_SNAPSHOT_BYTES)
        .map_err(|e| SnapshotError::Io(e.to_string()))?;
    load_bytes(&bytes)
}

/// Parse and check snapshot bytes.
pub fn read_bytes(bytes: &[u8]) -> Result<Snapshot, SnapshotError> {
    Ok(load_bytes(bytes)?.snapshot)
}

/// Parse and check snapshot bytes, with their format.
pub fn load_bytes(bytes: &[u8]) -> Result<Loaded, SnapshotError> {
    if bytes.is_empty() {
        return Err(SnapshotError::NotSnapshot("the file is empty".into()));
    }
    if bytes.starts_with(&[0x1f, 0x8b]) {
        return Err(SnapshotError::NotSnapshot(
            "the file is gzip-compressed: gunzip it first".into(),
        ));
    }
    let text_start = bytes.iter().find(|b| !b.is_ascii_whitespace()).copied();
    let (mut snapshot, format) = match text_start {
        Some(b'{') | Some(b'[') => from_json(bytes)?,
        Some(b'<') => from_html(bytes)?,
        _ => from_pickle(bytes)?,
    };
    fill_from_history(&mut snapshot);
    fill_addresses(&mut snapshot);
    check(&snapshot)?;
    snapshot.inconsistent = super::consistency::check_all(&snapshot);
    Ok(Loaded { snapshot, format })
}

/// A pickle: the snapshot dict, or a bare list of segments (the state at dump time).
fn from_pickle(bytes: &[u8]) -> Result<(Snapshot, String), SnapshotError> {
    // The decoder recurses as deep as the objects nest: refuse what would overflow the stack.
    super::nesting::check(bytes).map_err(|e| SnapshotError::NotSnapshot(e.to_string()))?;
    let opts = || serde_pickle::DeOptions::new().take_list_items(super::schema::take_trace_entry);
    match interning(|| serde_pickle::from_slice::<Snapshot>(bytes, opts())) {
        Ok(s) => Ok((s, "pickle".into())),
        Err(e) => match interning(|| serde_pickle::from_slice::<Vec<Segment>>(bytes, opts())) {
            Ok(segments) => Ok((
                Snapshot {
                    segments,
                    device_traces: Vec::new(),
                    allocator_settings: None,
                    inconsistent: Vec::new(),
                },
                "pickle (a bare list of segments: torch.cuda.memory_snapshot())".into(),
            )),
            Err(_) => {
                let msg = e.to_string();
                Err(
                    if msg.contains("EOF") || msg.contains("end of file") || msg.contains("eof") {
                        SnapshotError::Truncated(msg)
                    } else {
                        SnapshotError::NotSnapshot(msg)
                    },
                )
            }
        },
    }
}

/// The snapshot dict or list of segments as JSON (`json.dump(torch.cuda.memory._snapshot())`),
/// or `_memory_viz`'s `[{"name": ..., "base64": <pickle>}]`.
fn from_json(bytes: &[u8]) -> Result<(Snapshot, String), SnapshotError> {
    let v: serde_json::Value = serde_json::from_slice(bytes).map_err(|e| {
        if e.is_eof() {
            SnapshotError::Truncated(format!("JSON: {e}"))
        } else {
            SnapshotError::NotSnapshot(format!("JSON: {e}"))
        }
    })?;
    let schema = |e: serde_json::Error| SnapshotError::NotSnapshot(format!("JSON: {e}"));
    match &v {
        serde_json::Value::Object(m) if m.contains_key("segments") => Ok((
            interning(|| serde_json::from_value(v)).map_err(schema)?,
            "JSON (dict)".into(),
        )),
        serde_json::Value::Array(items) if items.first().is_some_and(|i| i.get("base64").is_some()) => {
            let (s, f) = embedded(items)?;
            Ok((s, format!("{f} (base64 in _memory_viz's local_files JSON)")))
        }
        serde_json::Value::Array(_) => Ok((
            Snapshot {
                segments: interning(|| serde_json::from_value(v)).map_err(schema)?,
                device_traces: Vec::new(),
                allocator_settings: None,
                inconsistent: Vec::new(),
            },
            "JSON (a bare list of segments)".into(),
        )),
        _ => Err(SnapshotError::NotSnapshot(
            "JSON without `segments` (a memory snapshot is {\"segments\": [...], \"device_traces\": [...]})"
                .into(),
        )),
    }
}

/// The first pickle of a `local_files` list.
fn embedded(items: &[serde_json::Value]) -> Result<(Snapshot, String), SnapshotError> {
    let b64 = items
        .first()
        .and_then(|i| i.get("base64"))
        .and_then(|b| b.as_str())
        .ok_or_else(|| SnapshotError::NotSnapshot("local_files without base64".into()))?;
    let mut pickle = base64::engine::general_purpose::STANDARD
        .decode(b64.trim())
        .map_err(|e| SnapshotError::NotSnapshot(format!("the embedded base64: {e}")))?;
    // _format_viz pads the pickle with NUL bytes to a multiple of 3; a pickle ends at STOP.
    while pickle.last() == Some(&0) {
        pickle.pop();
    }
    from_pickle(&pickle)
}

/// The page `python -m torch.cuda._memory_viz trace_plot|segment_plot` (or `profile_plot`)
/// writes: `const local_files = [{"name": ..., "base64": ...}]` on one line.
fn from_html(bytes: &[u8]) -> Result<(Snapshot, String), SnapshotError> {
    let text = String::from_utf8_lossy(bytes);
    const MARK: &str = "const local_files =";
    let Some(at) = text.find(MARK) else {
        return Err(SnapshotError::NotSnapshot(
            "the file is text (HTML) with no embedded snapshot: give the pickle torch.cuda.memory._dump_snapshot wrote, or the page torch.cuda._memory_viz made from it"
                .into(),
        ));
    };
    let rest = &text[at + MARK.len()..];
    let line = rest
        .lines()
        .next()
        .unwrap_or("")
        .trim()
        .trim_end_matches(';');
    let items: Vec<serde_json::Value> = serde_json::from_str(line).map_err(|e| {
        if e.is_eof() {
            SnapshotError::Truncated(format!("the page's local_files: {e}"))
        } else {
            SnapshotError::NotSnapshot(format!("the page's local_files: {e}"))
        }
    })?;
    let (s, f) = embedded(&items)?;
    Ok((
        s,
        format!("{f} (embedded in a torch.cuda._memory_viz page)"),
    ))
}

/// PyTorch 2.0's blocks keep their frames and requested size in `history` (what
/// `_memory_viz._block_extra_legacy` reads: the first entry).
fn fill_from_history(snap: &mut Snapshot) {
    for b in snap.segments.iter_mut().flat_map(|s| s.blocks.iter_mut()) {
        if let Some(h) = b.history.first() {
            if b.frames.is_empty() {
                b.frames = h.frames.clone();
            }
            if b.requested_size == 0 {
                b.requested_size = h.real_size;
            }
        }
    }
}

/// PyTorch 2.0's blocks (and `_profile_to_snapshot`'s) have no address: each lies after the
/// blocks before it in its segment (the allocator splits a segment front to back and lists its
/// blocks in address order).
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

/// The most bytes one segment, block or trace entry may claim: the 48-bit virtual address space
/// of today's CPUs and GPUs (256 TiB). A larger size is no allocation that happened, and sums of
/// such sizes would overflow.
pub const MAX_ENTRY_BYTES: u64 = 1 << 48;

pub use super::schema::{synthetic_segments, MAX_DEVICE_BYTES};

/// What serde cannot check: sane sizes. (Unknown actions and entries without an address are
/// skipped with a note when the trace is built: a newer PyTorch may add actions; a trace that
/// cannot have happened is `consistency`'s.)
fn check(snap: &Snapshot) -> Result<(), SnapshotError> {
    let too_large = |what: String, size: u64| {
        SnapshotError::Schema(format!(
            "{what} claims {size} bytes, more than a 48-bit address space ({MAX_ENTRY_BYTES}): \
             no allocation is that large"
        ))
    };
    for (d, trace) in snap.device_traces.iter().enumerate() {
        if let Some((i, e)) = trace
            .iter()
            .enumerate()
            .find(|(_, e)| e.size > MAX_ENTRY_BYTES)
        {
            return Err(too_large(format!("device {d}'s trace entry {i}"), e.size));
        }
    }
    for (s, seg) in snap.segments.iter().enumerate() {
        if seg.total_size > MAX_ENTRY_BYTES {
            return Err(too_large(format!("segment {s}"), seg.total_size));
        }
        if let Some(b) = seg.blocks.iter().find(|b| b.size > MAX_ENTRY_BYTES) {
            return Err(too_large(format!("a block of segment {s}"), b.size));
        }
        let blocks = seg
            .blocks
            .iter()
            .fold(0u64, |a, b| a.saturating_add(b.size));
        if !seg.is_expandable && blocks > seg.total_size {
            return Err(SnapshotError::Schema(format!(
                "segment {s} at {:#x}: its blocks ({blocks} bytes) exceed its size ({})",
                seg.address, seg.total_size
            )));
        }
    }
    Ok(())
}
