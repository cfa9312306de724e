//! PyTorch memory snapshots without a device: the parser on schema-exact hand-built files and
//! bad ones, the GPT-2 fixtures' peaks against the script's own count, scaling checked on a
//! third batch, and export → import round trips.

use std::path::{Path, PathBuf};

use oomprobe::plan::{EventKind, Phase, Plan, Role};
use oomprobe::snapshot::scale::{Class, ScaleModel};
use oomprobe::snapshot::{load, read, trace, write, Granularity, SnapshotError, Trace};

const MIB: u64 = 1 << 20;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/snapshots")
        .join(name)
}

fn peaks() -> serde_json::Value {
    let text = std::fs::read_to_string(fixture("peaks.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

#[test]
fn hand_built_blocks_keep_pre_existing_pending_and_oom() {
    let t = load(&fixture("hand-oom.pickle"), Granularity::Blocks).unwrap();
    // Before the trace: the 1024-byte block freed in it and the one still live (100 bytes
    // asked, its 512-byte block held, as torch.cuda.memory_allocated() counts it).
    let before: Vec<u64> = t
        .allocs
        .iter()
        .filter(|a| a.before_trace)
        .map(|a| a.bytes)
        .collect();
    assert_eq!(before, vec![1024, 512]);
    assert!(t.events[..2]
        .iter()
        .all(|e| e.alloc && e.phase == Phase::Setup));
    // The block awaiting its free at dump time stays live: 512 + 4096 + 8192 with the OOM's
    // 3 GiB request on top.
    let oom = t.oom.as_ref().expect("the trace recorded an OOM");
    assert_eq!(oom.requested, 3 << 30);
    assert_eq!(oom.device_free, Some(123 * MIB));
    assert!(
        oom.frame.contains("train.py:42:forward (aten::mm)"),
        "{}",
        oom.frame
    );
    assert_eq!(t.peak(), 512 + 4096 + 8192 + (3 << 30));
    let plan = t.to_plan("hand", 0);
    plan.check_timeline().unwrap();
    assert_eq!(plan.peak_bytes(), t.peak());
}

#[test]
fn hand_built_segments_follow_maps_and_partial_unmaps() {
    let t = load(&fixture("hand-oom.pickle"), Granularity::Segments).unwrap();
    // seg0 (2 MiB, before the trace), seg1 (2 MiB), two 20 MiB maps, the second cut to 10 MiB
    // by the unmap; then the OOM's request as the allocator would have asked the driver.
    let first = &t.allocs[t.events[0].ix];
    assert!(first.before_trace && first.bytes == 2 * MIB, "{first:?}");
    assert_eq!(t.allocs.iter().filter(|a| a.before_trace).count(), 1);
    let live_before_oom = 2 * MIB + 2 * MIB + 20 * MIB + 10 * MIB;
    assert_eq!(t.peak(), live_before_oom + (3 << 30));
    t.to_plan("hand", 0).check_timeline().unwrap();
}

#[test]
fn bad_files_say_why() {
    let e = read::read_file(&fixture("bad-truncated.pickle")).unwrap_err();
    assert!(matches!(e, SnapshotError::Truncated(_)), "{e:?}");
    let e = read::read_file(&fixture("bad-not-snapshot.pickle")).unwrap_err();
    assert!(matches!(e, SnapshotError::NotSnapshot(_)), "{e:?}");
    // An action no PyTorch wrote is skipped with a note (a newer release may add actions).
    let t = load(&fixture("bad-action.pickle"), Granularity::Blocks).unwrap();
    assert!(
        t.notes
            .iter()
            .any(|n| n.contains("teleport") && n.contains("skipped")),
        "{:?}",
        t.notes
    );
    let e = read::read_bytes(&[0x1f, 0x8b, 8, 0]).unwrap_err();
    assert!(e.to_string().contains("gzip"), "{e}");
    // JSON is read (json.dump of the snapshot dict); other text is refused.
    assert!(read::read_bytes(b"{\"segments\": []}")
        .unwrap()
        .segments
        .is_empty());
    let e = read::read_bytes(b"{\"model\": 1}").unwrap_err();
    assert!(e.to_string().contains("without `segments`"), "{e}");
    let e = read::read_bytes(b"hello, world").unwrap_err();
    assert!(matches!(e, SnapshotError::NotSnapshot(_)), "{e:?}");
    assert!(read::read_bytes(&[]).is_err());
}

#[test]
fn gpt2_fixture_peaks_match_the_scripts_own_count() {
    let p = peaks();
    for b in 1..=3 {
        let name = format!("gpt2-tiny-b{b}.pickle");
        let row = &p["files"][&name];
        for (g, key) in [
            (Granularity::Blocks, "blocks_peak_bytes"),
            (Granularity::Segments, "segments_peak_bytes"),
        ] {
            let t = load(&fixture(&name), g).unwrap();
            assert_eq!(t.peak(), row[key].as_u64().unwrap(), "{name} {g:?}");
            let plan = t.to_plan(&name, b);
            plan.check_timeline().unwrap();
            assert_eq!(plan.peak_bytes(), t.peak());
        }
    }
}

#[test]
fn gpt2_fixture_phases_and_frames_come_from_the_stacks() {
    let t = load(&fixture("gpt2-tiny-b2.pickle"), Granularity::Blocks).unwrap();
    let phases: std::collections::BTreeSet<Phase> = t.allocs.iter().map(|a| a.phase).collect();
    for p in [
        Phase::Setup,
        Phase::Forward,
        Phase::Backward,
        Phase::Optimizer,
    ] {
        assert!(phases.contains(&p), "no {p:?} allocation: {phases:?}");
    }
    assert!(t
        .allocs
        .iter()
        .any(|a| a.frame.contains("modeling_gpt2.py")));
    // Parameters and Adam state were allocated before recording.
    assert!(t.allocs.iter().filter(|a| a.before_trace).count() >= 3 * 2);
}

fn model_1_2() -> ScaleModel {
    let a = load(&fixture("gpt2-tiny-b1.pickle"), Granularity::Blocks).unwrap();
    let b = load(&fixture("gpt2-tiny-b2.pickle"), Granularity::Blocks).unwrap();
    ScaleModel::fit(&a, 1, &b, 2).unwrap()
}

#[test]
fn scaling_reproduces_its_inputs_and_predicts_a_third_batch() {
    let m = model_1_2();
    let n = m.template.allocs.len();
    let scaling = (0..n).filter(|&i| m.class(i) == Class::Scaling).count();
    assert!(scaling > 0 && scaling < n, "{scaling} of {n} scale");
    // Parameters and Adam state do not scale.
    for (i, a) in m.template.allocs.iter().enumerate() {
        if a.before_trace {
            assert_eq!(m.class(i), Class::Fixed, "{}", a.frame);
        }
    }
    let p = peaks();
    let own = |b: u64| {
        p["files"][format!("gpt2-tiny-b{b}.pickle")]["blocks_peak_bytes"]
            .as_u64()
            .unwrap()
    };
    assert_eq!(m.at(2).peak(), own(2), "batch 2 is the template itself");
    let b3 = load(&fixture("gpt2-tiny-b3.pickle"), Granularity::Blocks).unwrap();
    let (pred, real) = oomprobe::snapshot::scale::check_against(&m, &b3, 3);
    let err = (pred as f64 - real as f64).abs() / real as f64;
    assert!(
        err < 0.005,
        "batch 3: predicted {pred}, traced {real} ({:.2} %)",
        err * 100.0
    );
    // The predicted max is the largest batch whose synthesized peak fits.
    let cap = 64 * MIB;
    let x = m.predict_max(cap, 1 << 20).unwrap();
    assert!(m.at(x).peak() <= cap && m.at(x + 1).peak() > cap);
}

fn roundtrip(t: &Trace) -> Trace {
    let bytes = write::to_bytes(&write::to_snapshot(t)).unwrap();
    let snap = read::read_bytes(&bytes).unwrap();
    trace::trace_of(&snap, Granularity::Blocks).unwrap()
}

/// A plan's timeline without its kernels: what a snapshot can carry.
fn memory_events(p: &Plan) -> Vec<(Phase, bool, String, u64, Role)> {
    p.events
        .iter()
        .filter_map(|e| match e.kind {
            EventKind::Alloc(t) | EventKind::Free(t) => Some((
                e.phase,
                matches!(e.kind, EventKind::Alloc(_)),
                p.tensors[t].name.clone(),
                p.tensors[t].bytes,
                p.tensors[t].role,
            )),
            EventKind::Kernel(_) => None,
        })
        .collect()
}

#[test]
fn exported_plan_imports_back_unchanged() {
    for model in ["tiny-gpt", "tiny-cnn"] {
        let w = oomprobe::workload::presets::get(model).unwrap();
        let plan = Plan::for_workload(&w).unwrap();
        let back = roundtrip(&Trace::from_plan(&plan)).to_plan(model, w.batch);
        assert_eq!(memory_events(&back), memory_events(&plan), "{model}");
        assert_eq!(back.peak_bytes(), plan.peak_bytes());
    }
}

#[test]
fn imported_snapshot_exports_and_imports_back_unchanged() {
    let t = load(&fixture("gpt2-tiny-b1.pickle"), Granularity::Blocks).unwrap();
    let once = t.to_plan("b1", 1);
    let twice = roundtrip(&t).to_plan("b1", 1);
    assert_eq!(memory_events(&twice), memory_events(&once));
}
