//! Snapshots as people have them (tests/fixtures/snapshots/real, SOURCES.md there): two real
//! files from licensed repositories against the totals `validation/snapshot_totals.py` computes
//! from the pickle itself, and the layouts of the real files we may not redistribute rebuilt
//! here: a bare list of segments on cuda:1 (`torch.cuda.memory_snapshot()`) and a multi-device
//! trace whose OOM is on a device with fewer entries than another.

use std::path::{Path, PathBuf};

use oomprobe::snapshot::schema::{Block, Segment, Snapshot, TraceEntry};
use oomprobe::snapshot::{load, read, trace, Granularity};

fn real(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/snapshots/real")
        .join(name)
}

#[test]
fn pytorch_2_0_blocks_without_addresses_are_read() {
    // Yiyi-philosophy/LLM-inference (Apache-2.0): PyTorch 2.0, blocks carry `history`, no
    // `address`; 176 segments, one `snapshot` trace entry. The script's totals: segments
    // 11,844,714,496 B, active blocks 11,840,159,744 B.
    let p = real("torch20-block-history.pickle");
    let snap = read::read_file(&p).unwrap();
    for seg in &snap.segments {
        let mut at = seg.address;
        for b in &seg.blocks {
            assert_eq!(b.address, at, "blocks laid out front to back");
            at += b.size;
        }
    }
    assert_eq!(
        load(&p, Granularity::Segments).unwrap().peak(),
        11_844_714_496
    );
    assert_eq!(
        load(&p, Granularity::Blocks).unwrap().peak(),
        11_840_159_744
    );
}

#[test]
fn pytorch_2_6_trace_peaks_match_the_script() {
    // silmont2000/assignment2-systems (MIT): a small full trace; the script's replays peak at
    // 3,781,165,056 B reserved and 3,249,143,816 B allocated.
    let p = real("torch26-small-trace.pickle");
    assert_eq!(
        load(&p, Granularity::Segments).unwrap().peak(),
        3_781_165_056
    );
    assert_eq!(load(&p, Granularity::Blocks).unwrap().peak(), 3_249_143_816);
}

fn segment(device: i64, address: u64, size: u64) -> Segment {
    Segment {
        device,
        address,
        total_size: size,
        stream: 0,
        segment_type: Some("large".into()),
        allocated_size: size,
        active_size: size,
        requested_size: size,
        is_expandable: false,
        segment_pool_id: None,
        blocks: vec![Block {
            address,
            size,
            requested_size: size,
            state: "active_allocated".into(),
            frames: Vec::new(),
        }],
    }
}

fn entry(action: &str, addr: Option<u64>, size: u64) -> TraceEntry {
    TraceEntry {
        action: action.into(),
        addr,
        size,
        stream: 0,
        time_us: None,
        frames: Vec::new(),
        device_free: (action == "oom").then_some(95_682_560),
    }
}

#[test]
fn a_bare_list_of_segments_is_the_state_at_dump_time() {
    // As Muduard/LayoutEditing published it: `torch.cuda.memory_snapshot()` pickled, every
    // segment on cuda:1, no history.
    let segs = vec![
        segment(1, 0x7f00_0000_0000, 20 << 20),
        segment(1, 0x7f00_4000_0000, 2 << 20),
    ];
    let bytes = serde_pickle::to_vec(&segs, serde_pickle::SerOptions::new()).unwrap();
    let snap = read::read_bytes(&bytes).unwrap();
    assert!(snap.device_traces.is_empty());
    let t = trace::trace_of(&snap, Granularity::Segments).unwrap();
    assert_eq!(t.peak(), 22 << 20);
    assert!(
        t.notes.iter().any(|n| n.contains("no trace")),
        "{:?}",
        t.notes
    );
}

#[test]
fn the_device_that_ran_out_of_memory_is_read_and_named() {
    // As Constructor-Sun/code_location's 3-GPU file: cuda:0 has the most entries, cuda:1 the
    // OOM. The OOM's device is read, and a note says which and what was left out.
    let busy: Vec<TraceEntry> = (0..10u64)
        .flat_map(|i| {
            let a = 0x1000_0000 + i * (4 << 20);
            [
                entry("segment_alloc", Some(a), 4 << 20),
                entry("segment_free", Some(a), 4 << 20),
            ]
        })
        .collect();
    let oom_dev = vec![
        entry("segment_alloc", Some(0x2000_0000), 64 << 20),
        entry("oom", None, 5_308_694_528),
    ];
    let snap = Snapshot {
        segments: vec![
            segment(0, 0x1000_0000, 2 << 20),
            segment(1, 0x2000_0000, 64 << 20),
        ],
        device_traces: vec![busy, oom_dev, Vec::new()],
    };
    let t = trace::trace_of(&snap, Granularity::Segments).unwrap();
    let oom = t.oom.as_ref().expect("the OOM is found");
    assert_eq!(oom.device_free, Some(95_682_560));
    assert!(t.peak() >= 5_308_694_528, "{}", t.peak());
    assert!(
        t.notes
            .iter()
            .any(|n| n.contains("read cuda:1") && n.contains("cuda:0")),
        "{:?}",
        t.notes
    );
}

#[test]
fn segments_on_cuda_1_with_empty_traces_are_not_peak_0() {
    // Two empty `device_traces` lists, every segment on cuda:1 (a published layout that read
    // as "peak 0 B"): the device holding the memory is read.
    let snap = Snapshot {
        segments: vec![segment(1, 0x7f00_0000_0000, 20 << 20)],
        device_traces: vec![Vec::new(), Vec::new()],
    };
    let t = trace::trace_of(&snap, Granularity::Segments).unwrap();
    assert_eq!(t.peak(), 20 << 20);
}
