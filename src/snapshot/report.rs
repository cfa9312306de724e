//! What a snapshot says, device by device: each device's peak at the chosen granularity (with
//! the other granularity's beside it), what is live at that peak by role (memory from before the
//! trace apart, and at segment granularity the allocator's reserved-but-free cache as its own
//! row), and the recorded OOM with the card's usable memory at that moment and whether the
//! replay fails where PyTorch did. One report every view (text, JSON, diagnose) reads.

use std::collections::BTreeMap;
use std::path::Path;

use serde::Serialize;

use crate::estimate::{Breakdown, TimelineSummary};
use crate::plan::Phase;

use super::read::load_file;
use super::schema::Snapshot;
use super::trace::{devices, oom_device, trace_of_device, Trace};
use super::{Granularity, SnapshotError};

/// Which devices to report.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize)]
pub enum DeviceSelect {
    /// Every device that holds segments or trace events.
    #[default]
    All,
    One(usize),
}

impl DeviceSelect {
    /// `N` or `all`.
    pub fn parse(s: &str) -> Result<DeviceSelect, String> {
        let s = s.trim();
        if s.eq_ignore_ascii_case("all") {
            return Ok(DeviceSelect::All);
        }
        s.trim_start_matches("cuda:")
            .parse::<usize>()
            .map(DeviceSelect::One)
            .map_err(|_| format!("'{s}' is not a device: give its index (0, 1, ...) or all"))
    }
}

/// The whole file.
#[derive(Debug, Clone, Serialize)]
pub struct SnapshotReport {
    pub file: String,
    /// What kind of file it was (pickle, JSON, a `_memory_viz` page).
    pub format: String,
    pub granularity: Granularity,
    /// Every device of the file that holds segments or trace events.
    pub devices_in_file: Vec<usize>,
    /// The device a probe replays and the headline reads: the OOM's, else the highest peak.
    pub default_device: usize,
    /// The devices reported, the default first.
    pub devices: Vec<DeviceReport>,
    pub notes: Vec<String>,
}

/// One device of the file.
#[derive(Debug, Clone, Serialize)]
pub struct DeviceReport {
    pub device: usize,
    pub segments: usize,
    pub trace_entries: usize,
    /// Segment bytes at dump time.
    pub reserved_at_dump_bytes: u64,
    /// Bytes of the blocks a tensor held at dump time (`active_allocated`).
    pub allocated_at_dump_bytes: u64,
    /// The peak at the report's granularity (what a replay must hold).
    pub peak_bytes: u64,
    /// Peak of reserved (segment) bytes and of allocated (block) bytes, each on its own, without
    /// an OOM's refused request.
    pub peak_reserved_bytes: u64,
    pub peak_allocated_bytes: u64,
    /// Bytes that existed before the trace began, at the report's granularity.
    pub before_trace_bytes: u64,
    pub peak_phase: Option<Phase>,
    /// Index of the event that reached the peak, and the number of events.
    pub peak_event: usize,
    pub events: usize,
    /// The allocation that reached the peak (its top stack frame).
    pub peak_frame: Option<String>,
    /// Live at the peak, by role, largest first; sums to `peak_bytes`.
    pub at_peak: Vec<Row>,
    /// The same by the contract's roles (memory from before the trace with no frames counts as
    /// params here, as a model's weights usually are).
    pub breakdown: Breakdown,
    pub timeline: TimelineSummary,
    pub oom: Option<OomReport>,
    /// The trace's own alloc/free stream through the caching allocator model: addresses and
    /// segment events matched (None where the file lacks what the replay needs: a note says).
    pub allocator_replay: Option<super::allocator::AllocatorReplay>,
    pub notes: Vec<String>,
}

/// One row of what is live at a peak.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Row {
    pub label: String,
    pub bytes: u64,
}

/// Label of memory that existed before the trace and whose frames do not tell what it is.
pub const BEFORE_TRACE: &str = "before the trace";
/// Label of reserved segment bytes no tensor held.
pub const CACHE: &str = "allocator cache (reserved, not allocated)";
/// Label of the failed request of a recorded OOM.
pub const OOM_REQUEST: &str = "the OOM's request (refused)";

/// The recorded out-of-memory, at its moment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct OomReport {
    pub device: usize,
    pub requested_bytes: u64,
    /// What the driver still reported free (`device_free`).
    pub device_free_bytes: Option<u64>,
    /// Segment bytes the allocator held just before the request.
    pub reserved_bytes: u64,
    /// Block bytes tensors held just before the request.
    pub allocated_bytes: u64,
    /// The memory the job could have had on that card: reserved + free.
    pub usable_bytes: Option<u64>,
    /// The top frame of the stack that asked, and the stack (innermost first).
    pub frame: String,
    pub stack: Vec<String>,
    /// Index of the `oom` entry in the device's trace.
    pub entry: usize,
    /// The replay at segment granularity under `usable_bytes`.
    pub verdict: OomVerdict,
}

/// Whether replaying the trace's segments under the card's usable memory fails where PyTorch
/// did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "replay", rename_all = "snake_case")]
pub enum OomVerdict {
    /// The first allocation that does not fit is the recorded request.
    FailsAtTheOom,
    /// An earlier allocation already does not fit (event index, its frame).
    FailsEarlier { event: usize, frame: String },
    /// Every allocation fits, the request too (the card's memory was used elsewhere, or the
    /// allocator could not use what was free).
    Fits,
    /// The card's free bytes were not recorded.
    Unknown,
}

impl OomVerdict {
    pub fn describe(&self, usable: Option<u64>) -> String {
        let on = usable.map_or_else(String::new, |u| {
            format!(" under {}", crate::units::fmt_bytes(u))
        });
        match self {
            OomVerdict::FailsAtTheOom => {
                format!("the replay's segments fail at the recorded request{on}, as PyTorch did")
            }
            OomVerdict::FailsEarlier { event, frame } => format!(
                "the replay's segments fail earlier{on}, at event {event} ({frame}): the segment model charges more than the card gave"
            ),
            OomVerdict::Fits => format!(
                "the replay's segments fit{on}, the request too: the difference was not the job's segments (another process, or memory the allocator could not use)"
            ),
            OomVerdict::Unknown => "the card's free bytes were not recorded".into(),
        }
    }
}

/// Read a file and report the selected devices at `granularity`.
pub fn report_file(
    path: &Path,
    granularity: Granularity,
    select: DeviceSelect,
) -> Result<SnapshotReport, SnapshotError> {
    let loaded = load_file(path)?;
    report(
        &loaded.snapshot,
        &path.display().to_string(),
        &loaded.format,
        granularity,
        select,
    )
}

/// Report the selected devices of a snapshot.
pub fn report(
    snap: &Snapshot,
    file: &str,
    format: &str,
    granularity: Granularity,
    select: DeviceSelect,
) -> Result<SnapshotReport, SnapshotError> {
    let in_file = devices(snap);
    let mut reports = Vec::new();
    let wanted: Vec<usize> = match select {
        DeviceSelect::All => in_file.clone(),
        DeviceSelect::One(d) => {
            if !(in_file.contains(&d) || in_file.is_empty() && d == 0) {
                return Err(SnapshotError::Device(format!(
                    "--snapshot-device {d}: the file holds no memory or history on cuda:{d} (it has {})",
                    list(&in_file)
                )));
            }
            vec![d]
        }
    };
    let wanted = if wanted.is_empty() { vec![0] } else { wanted };
    for d in wanted {
        reports.push(device_report(snap, granularity, d)?);
    }
    let default_device = oom_device(snap)
        .filter(|d| reports.iter().any(|r| r.device == *d))
        .or_else(|| {
            reports
                .iter()
                .max_by_key(|r| (r.peak_bytes, usize::MAX - r.device))
                .map(|r| r.device)
        })
        .unwrap_or(0);
    reports.sort_by_key(|r| (r.device != default_device, r.device));
    let mut notes = Vec::new();
    if let DeviceSelect::One(d) = select {
        let others: Vec<usize> = in_file.iter().copied().filter(|x| *x != d).collect();
        if !others.is_empty() {
            notes.push(format!(
                "read cuda:{d} (--snapshot-device); {} also in the file, not read",
                list(&others)
            ));
        }
    }
    if let Some(d) = oom_device(snap) {
        if !reports.iter().any(|r| r.device == d) {
            notes.push(format!(
                "the file records an OOM on cuda:{d}, not read here (--snapshot-device {d} or all)"
            ));
        }
    }
    Ok(SnapshotReport {
        file: file.to_string(),
        format: format.to_string(),
        granularity,
        devices_in_file: in_file,
        default_device,
        devices: reports,
        notes,
    })
}

fn list(ds: &[usize]) -> String {
    if ds.is_empty() {
        return "none".into();
    }
    ds.iter()
        .map(|d| format!("cuda:{d}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// One device: both granularities' traces, the peak at `granularity`, the rows at it, the OOM.
fn device_report(
    snap: &Snapshot,
    granularity: Granularity,
    device: usize,
) -> Result<DeviceReport, SnapshotError> {
    let segs = trace_of_device(snap, Granularity::Segments, device)?;
    let blocks = trace_of_device(snap, Granularity::Blocks, device)?;
    let main = match granularity {
        Granularity::Segments => &segs,
        Granularity::Blocks => &blocks,
    };
    let label = format!("cuda:{device}");
    let plan = main.to_plan(&label, 0);
    let peak = plan.peak();
    let timeline = crate::estimate::timeline_summary(&plan);
    let at_peak = match granularity {
        Granularity::Blocks => rows_of(&blocks, live_through(&blocks, peak.event), None),
        Granularity::Segments => segment_rows(&segs, &blocks, peak.event),
    };
    let on_device: Vec<_> = snap
        .segments
        .iter()
        .filter(|s| s.device.max(0) as usize == device)
        .collect();
    let mut notes = main.notes.clone();
    let has_trace = snap
        .device_traces
        .get(device)
        .is_some_and(|t| t.iter().any(|e| e.action == "alloc"));
    let conf = super::allocator::settings_of(snap.allocator_settings.as_ref());
    let allocator_replay = if has_trace {
        match super::allocator::replay(snap, device, &conf) {
            Ok(r) => Some(r),
            Err(why) => {
                notes.push(format!("cuda:{device}: allocator replay not run: {why}"));
                None
            }
        }
    } else {
        None
    };
    let oom = segs.oom.as_ref().map(|o| {
        let before = |t: &Trace| live_before_entry(t, o.entry);
        let reserved = before(&segs);
        let allocated = before(&blocks);
        let usable = o.device_free.map(|f| reserved.saturating_add(f));
        OomReport {
            device,
            requested_bytes: o.requested,
            device_free_bytes: o.device_free,
            reserved_bytes: reserved,
            allocated_bytes: allocated,
            usable_bytes: usable,
            frame: o.frame.clone(),
            stack: o.stack.clone(),
            entry: o.entry,
            verdict: usable.map_or(OomVerdict::Unknown, |u| verdict(&segs, o.event, u)),
        }
    });
    Ok(DeviceReport {
        device,
        segments: on_device.len(),
        trace_entries: snap.device_traces.get(device).map_or(0, |t| t.len()),
        reserved_at_dump_bytes: on_device.iter().map(|s| s.total_size).sum(),
        allocated_at_dump_bytes: on_device
            .iter()
            .flat_map(|s| s.blocks.iter())
            .filter(|b| b.state == "active_allocated")
            .map(|b| b.size)
            .sum(),
        peak_bytes: peak.bytes,
        peak_reserved_bytes: segs.held_peak(),
        peak_allocated_bytes: blocks.held_peak(),
        before_trace_bytes: main
            .allocs
            .iter()
            .filter(|a| a.before_trace)
            .map(|a| a.bytes)
            .sum(),
        peak_phase: peak.phase,
        peak_event: peak.event,
        events: main.events.len(),
        peak_frame: timeline.peak_tensor.clone(),
        at_peak,
        breakdown: crate::estimate::breakdown_of(&peak),
        timeline,
        oom,
        allocator_replay,
        notes,
    })
}

/// The allocations live after event `n` of a trace (inclusive), in allocation order.
fn live_through(t: &Trace, n: usize) -> Vec<usize> {
    let mut live = BTreeMap::new();
    for e in t.events.iter().take(n + 1) {
        if e.alloc {
            live.insert(e.ix, ());
        } else {
            live.remove(&e.ix);
        }
    }
    live.into_keys().collect()
}

/// Live bytes of a trace just before device trace entry `entry` (memory from before the trace
/// included).
pub fn live_before_entry(t: &Trace, entry: usize) -> u64 {
    let mut live = 0u64;
    for e in t
        .events
        .iter()
        .filter(|e| e.entry.is_none_or(|x| x < entry))
    {
        let b = t.allocs[e.ix].bytes;
        live = if e.alloc {
            live.saturating_add(b)
        } else {
            live.saturating_sub(b)
        };
    }
    live
}

/// Rows of a set of live allocations: each role, memory from before the trace apart (by role
/// where its frames tell), and the OOM's request.
fn rows_of(t: &Trace, live: Vec<usize>, oom_ix: Option<usize>) -> Vec<Row> {
    let oom_ix = oom_ix.or_else(|| t.oom.as_ref().map(|o| t.events[o.event].ix));
    let mut by: BTreeMap<String, u64> = BTreeMap::new();
    for ix in live {
        let a = &t.allocs[ix];
        let label = if Some(ix) == oom_ix {
            OOM_REQUEST.to_string()
        } else if a.before_trace && !a.role_known {
            BEFORE_TRACE.to_string()
        } else if a.before_trace {
            format!("{BEFORE_TRACE}: {}", a.role.name())
        } else {
            a.role.name().to_string()
        };
        let e = by.entry(label).or_default();
        *e = e.saturating_add(a.bytes);
    }
    sorted(by)
}

fn sorted(by: BTreeMap<String, u64>) -> Vec<Row> {
    let mut rows: Vec<Row> = by
        .into_iter()
        .filter(|(_, b)| *b > 0)
        .map(|(label, bytes)| Row { label, bytes })
        .collect();
    rows.sort_by(|a, b| b.bytes.cmp(&a.bytes).then(a.label.cmp(&b.label)));
    rows
}

/// What the reserved bytes at the segment peak (event `p` of `segs`) held: the tensor blocks
/// live then, by role, and the rest as the allocator's cache. The segment peak lasts until the
/// next segment is released; the blocks are read where they are most within that stretch (a
/// segment is reserved just before the allocation it is for).
fn segment_rows(segs: &Trace, blocks: &Trace, p: usize) -> Vec<Row> {
    let Some(ev) = segs.events.get(p) else {
        return Vec::new();
    };
    let reserved: u64 = live_through(segs, p)
        .iter()
        .map(|&ix| segs.allocs[ix].bytes)
        .sum();
    let oom_here = segs.oom.as_ref().filter(|o| o.event == p);
    // The moment: the entries of the peak's stretch (an OOM's: just before its entry).
    let (from, to) = match (oom_here, ev.entry) {
        (Some(o), _) => (o.entry, o.entry),
        (None, None) => (0, 0),
        (None, Some(r)) => {
            let end = segs
                .events
                .iter()
                .skip(p + 1)
                .find(|e| !e.alloc)
                .and_then(|e| e.entry)
                .unwrap_or(usize::MAX);
            (r + 1, end)
        }
    };
    let moment = best_moment(blocks, from, to);
    let live: Vec<usize> = live_until(blocks, moment);
    let mut by: BTreeMap<String, u64> = rows_of(blocks, live, None)
        .into_iter()
        .map(|r| (r.label, r.bytes))
        .collect();
    by.remove(OOM_REQUEST);
    let request = oom_here.map_or(0, |o| segs.allocs[segs.events[o.event].ix].bytes);
    let held: u64 = by.values().sum();
    let cache = reserved.saturating_sub(request).saturating_sub(held);
    by.insert(CACHE.into(), cache);
    if request > 0 {
        by.insert(OOM_REQUEST.into(), request);
    }
    let mut rows = sorted(by);
    // Blocks sized by their trace can exceed their segments by rounding: keep the rows' sum
    // equal to the peak.
    let sum: u64 = rows.iter().map(|r| r.bytes).sum();
    if sum > reserved {
        let mut over = sum - reserved;
        for r in rows.iter_mut().filter(|r| r.label != OOM_REQUEST) {
            let cut = over.min(r.bytes);
            r.bytes -= cut;
            over -= cut;
        }
        rows.retain(|r| r.bytes > 0);
    }
    rows
}

/// The moment in `[from, to]` (an entry limit: the events of entries before it applied) at
/// which the most block bytes are live.
fn best_moment(blocks: &Trace, from: usize, to: usize) -> usize {
    let ev = &blocks.events;
    let mut live = 0u64;
    let mut i = 0;
    while i < ev.len() && ev[i].entry.is_none_or(|x| x < from) {
        live = blocks.apply(&ev[i], live);
        i += 1;
    }
    let mut best = (live, from);
    while let Some(x) = ev.get(i).and_then(|e| e.entry) {
        if x >= to {
            break;
        }
        while i < ev.len() && ev[i].entry == Some(x) {
            live = blocks.apply(&ev[i], live);
            i += 1;
        }
        if live > best.0 {
            best = (live, x + 1);
        }
    }
    best.1
}

/// The allocations live with the events of entries before `limit` applied.
fn live_until(t: &Trace, limit: usize) -> Vec<usize> {
    let n = t
        .events
        .iter()
        .take_while(|e| e.entry.is_none_or(|x| x < limit))
        .count();
    if n == 0 {
        return Vec::new();
    }
    live_through(t, n - 1)
}

/// Replay the segments under `usable` bytes: where the first allocation that does not fit is.
fn verdict(segs: &Trace, oom_event: usize, usable: u64) -> OomVerdict {
    let mut live = 0u64;
    for (i, e) in segs.events.iter().enumerate() {
        live = segs.apply(e, live);
        if e.alloc && live > usable {
            return if i == oom_event {
                OomVerdict::FailsAtTheOom
            } else {
                OomVerdict::FailsEarlier {
                    event: i,
                    frame: segs.allocs[e.ix].frame.to_string(),
                }
            };
        }
    }
    OomVerdict::Fits
}
