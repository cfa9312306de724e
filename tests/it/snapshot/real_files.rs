//! Snapshots as people have them (tests/fixtures/snapshots/real, SOURCES.md there): four real
//! files from licensed repositories (PyTorch 2.0 to 2.9) and the layout variants
//! `validation/snapshot_variants.py` writes (tests/fixtures/snapshots/variants: the 3-GPU
//! expandable-segments OOM we may not redistribute rebuilt small, `_profile_to_snapshot`'s
//! blocks, JSON, the `_memory_viz` page, unknown actions), each device's peaks checked against
//! an independent replay written here (from the dump-time state, on the raw schema) and against
//! `validation/snapshot_totals.py`'s numbers; the layouts of the other unlicensed files rebuilt
//! in code: a bare list of segments on cuda:1 and a multi-device trace whose OOM is on a device
//! with fewer entries than another.

use std::path::{Path, PathBuf};

use oomprobe::snapshot::report::{report, report_file, DeviceSelect, OomVerdict, CACHE};
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
            ..Default::default()
        }],
    }
}

fn entry(action: &str, addr: Option<u64>, size: u64) -> TraceEntry {
    TraceEntry {
        action: action.into(),
        addr,
        size,
        stream: 0,
        device_free: (action == "oom").then_some(95_682_560),
        ..Default::default()
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
        allocator_settings: None,
        inconsistent: Vec::new(),
    };
    let t = trace::trace_of(&snap, Granularity::Segments).unwrap();
    let oom = t.oom.as_ref().expect("the OOM is found");
    assert_eq!(oom.device_free, Some(95_682_560));
    assert!(t.peak() >= 5_308_694_528, "{}", t.peak());
    // Every device is reported, the OOM's first; one device on request, the rest named.
    let all = report(
        &snap,
        "x",
        "pickle",
        Granularity::Segments,
        DeviceSelect::All,
    )
    .unwrap();
    let order: Vec<usize> = all.devices.iter().map(|d| d.device).collect();
    assert_eq!(order, [1, 0]);
    assert_eq!(all.default_device, 1);
    let one = report(
        &snap,
        "x",
        "pickle",
        Granularity::Segments,
        DeviceSelect::One(0),
    )
    .unwrap();
    assert!(
        one.notes
            .iter()
            .any(|n| n.contains("read cuda:0") && n.contains("cuda:1")),
        "{:?}",
        one.notes
    );
    assert!(one
        .notes
        .iter()
        .any(|n| n.contains("records an OOM on cuda:1")));
    assert!(report(
        &snap,
        "x",
        "pickle",
        Granularity::Segments,
        DeviceSelect::One(5)
    )
    .is_err());
}

#[test]
fn segments_on_cuda_1_with_empty_traces_are_not_peak_0() {
    // Two empty `device_traces` lists, every segment on cuda:1 (a published layout that read
    // as "peak 0 B"): the device holding the memory is read.
    let snap = Snapshot {
        segments: vec![segment(1, 0x7f00_0000_0000, 20 << 20)],
        device_traces: vec![Vec::new(), Vec::new()],
        allocator_settings: None,
        inconsistent: Vec::new(),
    };
    let t = trace::trace_of(&snap, Granularity::Segments).unwrap();
    assert_eq!(t.peak(), 20 << 20);
}

fn variant(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/snapshots/variants")
        .join(name)
}

/// Reserved and allocated peaks of one device, replayed independently of oomprobe's trace
/// module: reserved backwards from the segments at dump time over the segment actions;
/// allocated forwards from the active blocks the trace never allocated (plus the blocks it
/// frees without allocating) over alloc/free_completed. An `oom` changes neither.
fn independent_peaks(snap: &Snapshot, device: usize) -> (u64, u64) {
    let empty = Vec::new();
    let trace = snap.device_traces.get(device).unwrap_or(&empty);
    let segs: Vec<&Segment> = snap
        .segments
        .iter()
        .filter(|s| s.device as usize == device)
        .collect();
    let mut cur: i128 = segs.iter().map(|s| s.total_size as i128).sum();
    let mut reserved = cur;
    for e in trace.iter().rev() {
        match e.action.as_str() {
            "segment_alloc" | "segment_map" => cur -= e.size as i128,
            "segment_free" | "segment_unmap" => cur += e.size as i128,
            _ => {}
        }
        reserved = reserved.max(cur);
    }
    let allocated_addrs: std::collections::HashSet<u64> = trace
        .iter()
        .filter(|e| e.action == "alloc")
        .filter_map(|e| e.addr)
        .collect();
    let mut seen = std::collections::HashSet::new();
    let mut freed_untraced = 0i128;
    for e in trace {
        match (e.action.as_str(), e.addr) {
            ("alloc", Some(a)) => {
                seen.insert(a);
            }
            ("free_completed", Some(a)) if !seen.contains(&a) => {
                seen.insert(a);
                freed_untraced += e.size as i128;
            }
            _ => {}
        }
    }
    let mut live: i128 = segs
        .iter()
        .flat_map(|s| s.blocks.iter())
        .filter(|b| b.state == "active_allocated" && !allocated_addrs.contains(&b.address))
        .map(|b| b.size as i128)
        .sum::<i128>()
        + freed_untraced;
    let mut allocated = live;
    for e in trace {
        match e.action.as_str() {
            "alloc" => live += e.size as i128,
            "free_completed" => live -= e.size as i128,
            _ => {}
        }
        allocated = allocated.max(live);
    }
    (reserved as u64, allocated as u64)
}

fn within_01pct(ours: u64, reference: u64) -> bool {
    (ours as f64 - reference as f64).abs() <= reference.max(1) as f64 * 0.001
}

#[test]
fn every_device_of_every_file_agrees_with_an_independent_replay() {
    let files = [
        real("torch20-block-history.pickle"),
        real("torch25-sketchkv2-state.pickle"),
        real("torch26-small-trace.pickle"),
        real("torch29-decomfl-trace.pickle"),
        variant("expandable-oom-4dev.pickle"),
        variant("expandable-oom-4dev.json"),
        variant("expandable-oom-4dev.html"),
        variant("profile-to-snapshot.pickle"),
        variant("segments-list-dev1.json"),
        variant("future-actions.pickle"),
    ];
    let expected: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(variant("expected.json")).unwrap()).unwrap();
    for f in &files {
        let name = f.file_name().unwrap().to_string_lossy().to_string();
        check_against_independent_replay(f, expected.get(&name));
    }
}

/// Every device of `f`: the peaks against `independent_peaks` (0.1 %) and, when given, the
/// script's numbers exactly; the rows at each peak add up to it.
fn check_against_independent_replay(f: &Path, want: Option<&serde_json::Value>) {
    let name = f.file_name().unwrap().to_string_lossy().to_string();
    let snap = read::read_file(f).unwrap_or_else(|e| panic!("{name}: {e}"));
    let rep = report_file(f, Granularity::Segments, DeviceSelect::All).unwrap();
    assert!(!rep.devices.is_empty(), "{name}");
    for d in &rep.devices {
        let (reserved, allocated) = independent_peaks(&snap, d.device);
        assert!(
            within_01pct(d.peak_reserved_bytes, reserved),
            "{name} cuda:{}: reserved {} vs independent {reserved}",
            d.device,
            d.peak_reserved_bytes
        );
        assert!(
            within_01pct(d.peak_allocated_bytes, allocated),
            "{name} cuda:{}: allocated {} vs independent {allocated}",
            d.device,
            d.peak_allocated_bytes
        );
        if let Some(want) = want {
            let w = &want[d.device.to_string()];
            assert_eq!(
                d.peak_reserved_bytes,
                w["reserved_peak"].as_u64().unwrap(),
                "{name}"
            );
            assert_eq!(
                d.peak_allocated_bytes,
                w["allocated_peak"].as_u64().unwrap(),
                "{name}"
            );
            assert_eq!(
                d.reserved_at_dump_bytes,
                w["reserved_at_dump"].as_u64().unwrap()
            );
        }
        let rows: u64 = d.at_peak.iter().map(|r| r.bytes).sum();
        assert_eq!(
            rows, d.peak_bytes,
            "{name} cuda:{}: {:?}",
            d.device, d.at_peak
        );
    }
    if let Some(want) = want {
        let mut got: Vec<String> = rep.devices.iter().map(|d| d.device.to_string()).collect();
        got.sort();
        let mut want_devices: Vec<String> = want.as_object().unwrap().keys().cloned().collect();
        want_devices.sort();
        assert_eq!(
            got, want_devices,
            "{name}: every device with memory is reported"
        );
    }
}

/// The published files we may not redistribute (SOURCES.md says where each is): put them in a
/// folder and run `OOMPROBE_REAL_SNAPSHOTS=DIR cargo test --test it snapshot::real_files --
/// --ignored`.
#[test]
#[ignore = "needs the unlicensed real snapshots in $OOMPROBE_REAL_SNAPSHOTS (SOURCES.md)"]
fn the_unlicensed_published_files_agree_with_an_independent_replay() {
    let dir = std::env::var("OOMPROBE_REAL_SNAPSHOTS")
        .expect("set OOMPROBE_REAL_SNAPSHOTS to the folder of the files SOURCES.md lists");
    let mut n = 0;
    for f in std::fs::read_dir(dir).unwrap() {
        let f = f.unwrap().path();
        if f.extension().is_some_and(|e| e == "pickle" || e == "pkl") {
            check_against_independent_replay(&f, None);
            n += 1;
        }
    }
    assert!(n > 0, "no .pickle or .pkl file there");
}

#[test]
fn the_published_files_peaks_are_the_scripts_to_the_byte() {
    // validation/snapshot_totals.py on the licensed files (SOURCES.md): DeComFL's 23,105-entry
    // trace and SketchKV2's dump-time state.
    let d = report_file(
        &real("torch29-decomfl-trace.pickle"),
        Granularity::Segments,
        DeviceSelect::All,
    )
    .unwrap();
    assert_eq!(d.devices[0].peak_reserved_bytes, 1_897_922_560);
    assert_eq!(d.devices[0].peak_allocated_bytes, 1_783_664_516);
    let s = report_file(
        &real("torch25-sketchkv2-state.pickle"),
        Granularity::Blocks,
        DeviceSelect::All,
    )
    .unwrap();
    assert_eq!(s.devices[0].peak_reserved_bytes, 17_133_731_840);
    assert_eq!(s.devices[0].peak_bytes, 16_397_578_248);
}

#[test]
fn the_recorded_oom_is_read_with_its_moment_and_the_cards_memory() {
    let rep = report_file(
        &variant("expandable-oom-4dev.pickle"),
        Granularity::Segments,
        DeviceSelect::All,
    )
    .unwrap();
    assert_eq!(rep.default_device, 1, "the OOM's device comes first");
    assert_eq!(rep.devices[0].device, 1);
    let o = rep.devices[0].oom.as_ref().expect("the OOM");
    assert_eq!(o.requested_bytes, 90 * (1 << 20) + 12345);
    assert_eq!(o.device_free_bytes, Some(9 * (1 << 20) + (1 << 19)));
    // Six 12 MiB tensors mapped (2 MiB pages), the first freed and cached: 82 MiB reserved,
    // 60 MiB and 5 x 512 B allocated.
    assert_eq!(o.reserved_bytes, 82 << 20);
    assert_eq!(o.allocated_bytes, 5 * (12 << 20) + 512 * 15);
    assert_eq!(o.usable_bytes, Some((82 << 20) + 9 * (1 << 20) + (1 << 19)));
    assert_eq!(o.verdict, OomVerdict::FailsAtTheOom);
    assert!(
        o.frame.contains("models.py:181:update_nodes"),
        "{}",
        o.frame
    );
    assert_eq!(o.stack[0], "aten::clamp_min");
    assert!(
        o.stack.iter().any(|f| f == "models.py:181:update_nodes"),
        "{:?}",
        o.stack
    );
    // At segment granularity the cache is its own row; memory from before the trace on
    // cuda:0 is the weights its frames name (module.to), not "params" by default.
    let d0 = rep.devices.iter().find(|d| d.device == 0).unwrap();
    assert!(
        d0.at_peak.iter().any(|r| r.label == CACHE && r.bytes > 0),
        "{:?}",
        d0.at_peak
    );
    assert!(
        d0.at_peak
            .iter()
            .any(|r| r.label == "before the trace: params"),
        "{:?}",
        d0.at_peak
    );
    // Under more memory than the card had, the request fits.
    assert!(rep.devices.iter().all(|d| d.oom.is_none() || d.device == 1));
}

#[test]
fn unknown_actions_are_skipped_with_a_note_and_user_annotations_ignored() {
    let rep = report_file(
        &variant("future-actions.pickle"),
        Granularity::Blocks,
        DeviceSelect::All,
    )
    .unwrap();
    let notes = &rep.devices[0].notes;
    assert!(
        notes.iter().any(|n| n.contains("from_the_future")),
        "{notes:?}"
    );
    assert!(
        !notes.iter().any(|n| n.contains("user_defined")),
        "{notes:?}"
    );
    assert_eq!(rep.devices[0].peak_bytes, 10 << 20);
}

#[test]
fn json_and_the_viewer_page_read_as_the_pickle_does() {
    let p = report_file(
        &variant("expandable-oom-4dev.pickle"),
        Granularity::Blocks,
        DeviceSelect::All,
    )
    .unwrap();
    for f in ["expandable-oom-4dev.json", "expandable-oom-4dev.html"] {
        let r = report_file(&variant(f), Granularity::Blocks, DeviceSelect::All).unwrap();
        assert_eq!(
            serde_json::to_value(&r.devices).unwrap(),
            serde_json::to_value(&p.devices).unwrap(),
            "{f}"
        );
        assert_ne!(r.format, p.format);
    }
    // A page cut short, and one without a snapshot, are refused with a reason.
    let html = std::fs::read_to_string(variant("expandable-oom-4dev.html")).unwrap();
    let cut = &html[..html.len() / 2];
    assert!(matches!(
        read::read_bytes(cut.as_bytes()),
        Err(oomprobe::snapshot::SnapshotError::Truncated(_))
    ));
    let e = read::read_bytes(b"<html><body>hello</body></html>").unwrap_err();
    assert!(e.to_string().contains("no embedded snapshot"), "{e}");
}

/// Issue 31: each real trace's own allocations through the caching allocator model land at the
/// addresses the file records, every segment event matches, and the reserved peak is exact.
#[test]
fn the_allocator_model_replays_real_traces_to_the_recorded_address() {
    use oomprobe::snapshot::allocator::{replay, settings_of};
    for (name, blocks, segments, peak) in [
        ("torch26-small-trace.pickle", 36, 9, 3_781_165_056),
        ("torch29-decomfl-trace.pickle", 7946, 61, 1_897_922_560),
        ("cs336-niu-fwd-100.pickle", 785, 31, 463_470_592),
        ("cs336-niu-fwdbwd-200-mixed.pickle", 4404, 88, 1_205_862_400),
        // Traces that start with segments held: replayed from the dump's state walked back.
        ("octree-nca-traditional-step.pickle", 12, 4, 98_566_144),
        ("octree-nca-db23ad8.pickle", 217, 20, 9_193_914_368),
    ] {
        let snap = oomprobe::snapshot::read::read_file(&real(name)).unwrap();
        let conf = settings_of(snap.allocator_settings.as_ref());
        let r = replay(&snap, 0, &conf).unwrap();
        assert_eq!(
            (r.blocks_total, r.blocks_matched),
            (blocks, blocks),
            "{name}"
        );
        assert_eq!(
            (r.segment_events_total, r.segment_events_matched),
            (segments, segments),
            "{name}"
        );
        assert_eq!(r.reserved_peak_recorded, peak, "{name}");
        assert_eq!(r.reserved_peak_replayed, peak, "{name}");
    }
    // A state-only file has nothing to replay, and says so in one line.
    let snap =
        oomprobe::snapshot::read::read_file(&real("torch25-sketchkv2-state.pickle")).unwrap();
    let why = replay(&snap, 0, &Default::default()).unwrap_err();
    assert!(why.contains("no alloc/free trace"), "{why}");
    // Dropping the held segments from the dump breaks the walk back, and the replay says so
    // rather than replaying from a wrong start.
    let mut snap = oomprobe::snapshot::read::read_file(&real("octree-nca-db23ad8.pickle")).unwrap();
    snap.segments.truncate(snap.segments.len() / 2);
    let why = replay(&snap, 0, &Default::default()).unwrap_err();
    assert!(
        why.contains("lies in no segment") || why.contains("reserved"),
        "{why}"
    );
}

#[test]
fn every_committed_snapshot_is_a_trace_that_could_have_happened() {
    // The consistency checks refuse no real file: ring buffers that start mid-run, PyTorch 2.0
    // blocks, expandable segments on four devices, profiles turned into snapshots.
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/snapshots");
    let mut n = 0;
    for dir in [root.join("real"), root.join("variants"), root.clone()] {
        for f in std::fs::read_dir(&dir).unwrap() {
            let p = f.unwrap().path();
            let name = p.file_name().unwrap().to_string_lossy().into_owned();
            if name.starts_with("bad-") || !(name.ends_with(".pickle") || name.ends_with(".html")) {
                continue;
            }
            let snap = read::read_file(&p).unwrap();
            assert_eq!(
                oomprobe::snapshot::consistency::check(&snap),
                None,
                "{name}"
            );
            n += 1;
        }
    }
    assert!(n >= 15, "{n} files checked");
}
