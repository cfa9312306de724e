//! `--snapshot` end to end: the GPT-2 snapshots replayed on the first adapter (lavapipe in CI)
//! under a budget, the scaled max batch predicted and confirmed by probing, a recorded OOM
//! reproduced, `estimate`/`diagnose` on the same timeline, export to PyTorch's format, and bad
//! files (exit 2, one line).

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::support::adapter::{oomprobe, require_adapter};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/snapshots")
        .join(name)
}

fn fx(name: &str) -> String {
    fixture(name).display().to_string()
}

fn variant(name: &str) -> String {
    fixture("variants").join(name).display().to_string()
}

fn peak_of(file: &str, key: &str) -> u64 {
    let text = std::fs::read_to_string(fixture("peaks.json")).unwrap();
    let v: Value = serde_json::from_str(&text).unwrap();
    v["files"][file][key].as_u64().unwrap()
}

fn run_json(args: &[&str]) -> Value {
    let out = oomprobe().args(args).args(["--json"]).output().unwrap();
    assert!(
        out.status.success(),
        "{args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("--json prints JSON")
}

fn within_1pct(measured: u64, reference: u64) -> bool {
    (measured as f64 - reference as f64).abs() <= 0.01 * reference as f64
}

#[test]
fn gpt2_snapshots_replay_under_a_budget_at_their_own_peak() {
    require_adapter();
    for (file, g, key) in [
        ("gpt2-tiny-b1.pickle", "segments", "segments_peak_bytes"),
        ("gpt2-tiny-b2.pickle", "segments", "segments_peak_bytes"),
        ("gpt2-tiny-b2.pickle", "blocks", "blocks_peak_bytes"),
    ] {
        let r = run_json(&[
            "probe",
            "--snapshot",
            &fx(file),
            "--granularity",
            g,
            "--budget",
            "64MiB",
            "--quiet",
        ]);
        let s = &r["snapshot"];
        let own = peak_of(file, key);
        assert_eq!(s["fits"], true, "{file} {g}: {s}");
        assert_eq!(s["trace_peak_bytes"].as_u64().unwrap(), own);
        let held = s["probe"]["bytes_allocated"].as_u64().unwrap();
        assert!(
            within_1pct(held, own),
            "{file} {g}: held {held}, trace {own}"
        );
    }
    // Under a budget below its peak the same trace fails, naming the event and the frame.
    let r = run_json(&[
        "probe",
        "--snapshot",
        &fx("gpt2-tiny-b2.pickle"),
        "--granularity",
        "blocks",
        "--budget",
        "12MiB",
        "--quiet",
    ]);
    let s = &r["snapshot"];
    assert_eq!(s["fits"], false, "{s}");
    assert_eq!(s["probe"]["outcome"], "budget");
    assert!(s["probe"]["failed_at"]["event"].as_u64().is_some(), "{s}");
    assert!(!s["failed_frame"].as_str().unwrap_or("").is_empty(), "{s}");
}

#[test]
fn scaled_max_batch_is_predicted_then_confirmed_by_probing() {
    require_adapter();
    let r = run_json(&[
        "probe",
        "--snapshot",
        &fx("gpt2-tiny-b1.pickle"),
        "--snapshot",
        &fx("gpt2-tiny-b2.pickle"),
        "--snapshot",
        &fx("gpt2-tiny-b3.pickle"),
        "--batch-of",
        "1,2,3",
        "--budget",
        "48MiB",
        "--quiet",
    ]);
    let s = &r["snapshot"];
    let predicted = s["predicted_max"].as_u64().expect("a prediction");
    assert!(predicted > 3, "{s}");
    assert_eq!(s["max_fit"].as_u64(), Some(predicted), "{s}");
    assert_eq!(s["first_fail"].as_u64(), Some(predicted + 1), "{s}");
    assert_eq!(s["fail_reason"], "budget");
    let check = &s["summary"]["check"];
    assert_eq!(check["batch"], 3);
    assert!(check["error"].as_f64().unwrap().abs() < 0.005, "{check}");
}

#[test]
fn a_recorded_oom_reproduces_under_the_cards_memory() {
    require_adapter();
    // hand-oom.pickle asked for 3 GiB on a card with 123 MiB free: a 64 MiB budget refuses
    // exactly that request.
    let r = run_json(&[
        "probe",
        "--snapshot",
        &fx("hand-oom.pickle"),
        "--granularity",
        "blocks",
        "--budget",
        "64MiB",
        "--quiet",
    ]);
    let s = &r["snapshot"];
    assert_eq!(s["fits"], false);
    assert_eq!(s["recorded_oom"]["requested_bytes"], 3u64 << 30);
    assert!(
        s["failed_frame"]
            .as_str()
            .unwrap()
            .starts_with("OOM request: train.py:42:forward"),
        "{s}"
    );
}

#[test]
fn estimate_and_diagnose_read_the_same_timeline() {
    let file = "gpt2-tiny-b2.pickle";
    let e = run_json(&["estimate", "--snapshot", &fx(file), "--memory", "16MiB"]);
    let own = peak_of(file, "segments_peak_bytes");
    assert_eq!(e["breakdown"]["total"].as_u64().unwrap(), own);
    assert_eq!(e["fits"], false);
    let d = run_json(&["diagnose", "--snapshot", &fx(file), "--memory", "16MiB"]);
    assert_eq!(d["cause"], "batch_too_large");
    assert!(!d["live_at_peak_by_frame"].as_array().unwrap().is_empty());
    let e = run_json(&[
        "estimate",
        "--snapshot",
        &fx("gpt2-tiny-b1.pickle"),
        "--snapshot",
        &fx("gpt2-tiny-b2.pickle"),
        "--batch-of",
        "1,2",
        "--memory",
        "48MiB",
    ]);
    assert!(e["predicted_max_batch"].as_u64().unwrap() > 2, "{e}");
}

#[test]
fn export_writes_a_snapshot_the_importer_reads() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("plan.pickle");
    let p = path.display().to_string();
    let plan = run_json(&["estimate", "--model", "tiny-gpt", "--export-snapshot", &p]);
    let back = run_json(&["estimate", "--snapshot", &p, "--granularity", "blocks"]);
    assert_eq!(back["breakdown"], plan["breakdown"]);
    assert_eq!(
        back["timeline"]["peak_phase"], plan["timeline"]["peak_phase"],
        "{back}"
    );
}

#[test]
fn bad_snapshots_exit_2_with_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("missing.pickle").display().to_string();
    // A real snapshot with bytes overwritten in the middle.
    let mut bytes = std::fs::read(fixture("real/torch26-small-trace.pickle")).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid..mid + 64].fill(0xff);
    let corrupt = dir.path().join("corrupt.pickle");
    std::fs::write(&corrupt, &bytes).unwrap();
    let corrupt = corrupt.display().to_string();
    for (args, needle) in [
        (
            vec!["estimate", "--snapshot", &fx("bad-truncated.pickle")[..]],
            "truncated",
        ),
        (
            vec!["estimate", "--snapshot", &fx("bad-not-snapshot.pickle")[..]],
            "not a PyTorch memory snapshot",
        ),
        (
            vec!["estimate", "--snapshot", &corrupt[..]],
            "not a PyTorch memory snapshot",
        ),
        (
            vec!["diagnose", "--snapshot", &fx("gpt2-tiny-b1.pickle")[..]],
            "records no OOM",
        ),
        (
            vec![
                "estimate",
                "--snapshot",
                &variant("expandable-oom-4dev.pickle")[..],
                "--snapshot-device",
                "3",
            ],
            "no memory or history on cuda:3",
        ),
        (
            vec![
                "estimate",
                "--snapshot",
                &fx("hand-oom.pickle")[..],
                "--snapshot-device",
                "gpu0",
            ],
            "--snapshot-device",
        ),
        (
            vec![
                "probe",
                "--snapshot",
                &fx("bad-truncated.pickle")[..],
                "--budget",
                "1GiB",
            ],
            "truncated",
        ),
        (vec!["estimate", "--snapshot", &missing[..]], "cannot read"),
        (
            vec![
                "probe",
                "--snapshot",
                &fx("hand-oom.pickle")[..],
                "--model",
                "gpt2",
            ],
            "replaces the workload",
        ),
        (
            vec![
                "estimate",
                "--snapshot",
                &fx("gpt2-tiny-b1.pickle")[..],
                "--snapshot",
                &fx("gpt2-tiny-b2.pickle")[..],
            ],
            "--batch-of",
        ),
    ] {
        let out = oomprobe().args(&args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}

#[test]
fn a_snapshot_with_an_oom_on_cuda_1_is_reported_and_judged_on_its_card() {
    // The 3-GPU expandable-segments layout (validation/snapshot_variants.py): cuda:1 recorded
    // the OOM (90 MiB asked, 9.5 MiB free, 82 MiB reserved).
    let f = variant("expandable-oom-4dev.pickle");
    let e = run_json(&["estimate", "--snapshot", &f]);
    assert_eq!(e["device"], 1);
    assert_eq!(e["devices"].as_array().unwrap().len(), 3);
    assert_eq!(e["oom"]["requested_bytes"], 90 * (1u64 << 20) + 12345);
    assert_eq!(e["oom"]["verdict"]["replay"], "fails_at_the_oom");
    let text = oomprobe()
        .args(["estimate", "--snapshot", &f])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.starts_with("snapshot ")
            && text
                .lines()
                .nth(1)
                .unwrap()
                .starts_with("recorded OOM on cuda:1: 90.01 MiB requested with 9.50 MiB free"),
        "{text}"
    );
    assert!(
        text.contains("allocator cache (reserved, not allocated)"),
        "{text}"
    );
    // diagnose without --memory judges against the recorded card (82 MiB + 9.5 MiB), never
    // this machine's adapter.
    let d = run_json(&["diagnose", "--snapshot", &f]);
    assert_eq!(d["memory_bytes"], (82u64 << 20) + (19u64 << 19));
    assert!(d["memory_from"].as_str().unwrap().contains("cuda:1"), "{d}");
    assert_eq!(d["cause"], "batch_too_large");
    let judged = d["judged"].as_array().unwrap();
    assert_eq!(judged.len(), 3);
    assert!(judged[1..].iter().all(|j| j["cause"] == "fits"), "{d}");
    // --memory overrides; --snapshot-device picks one device.
    let d = run_json(&["diagnose", "--snapshot", &f, "--memory", "1GiB"]);
    assert_eq!(d["cause"], "fits");
    let one = run_json(&["estimate", "--snapshot", &f, "--snapshot-device", "2"]);
    assert_eq!(one["devices"].as_array().unwrap().len(), 1);
    assert_eq!(one["device"], 2);
    assert!(one["oom"].is_null());
}

#[test]
fn a_probe_replays_every_device_and_fails_where_pytorch_did() {
    require_adapter();
    // Under the recorded card's usable memory the OOM device fails at its request; the others
    // fit.
    let f = variant("expandable-oom-4dev.pickle");
    let r = run_json(&["probe", "--snapshot", &f, "--budget", "95944704", "--quiet"]);
    let runs = r["snapshot"].as_array().expect("one result per device");
    assert_eq!(runs.len(), 3);
    assert_eq!(runs[0]["device"], 1);
    assert_eq!(runs[0]["fits"], false, "{r}");
    assert!(
        runs[0]["failed_frame"]
            .as_str()
            .unwrap()
            .starts_with("OOM request:"),
        "{r}"
    );
    assert!(runs[1..].iter().all(|x| x["fits"] == true), "{r}");
}

/// A real trace (torch 2.9, tests/fixtures/snapshots/real/SOURCES.md) changed into four that
/// cannot have happened: each is refused with the entry that breaks it, and `--lenient`
/// replays it with a warning and a note.
#[test]
fn traces_that_cannot_have_happened_are_named_and_lenient_replays_them() {
    use oomprobe::snapshot::schema::TraceEntry;
    let real = fixture("real").join("torch29-decomfl-trace.pickle");
    let snap = oomprobe::snapshot::read::read_file(&real).unwrap();
    let trace = &snap.device_traces[0];
    let first_free = trace
        .iter()
        .position(|e| e.action == "free_completed")
        .unwrap();
    let mut mutants: Vec<(&str, Vec<TraceEntry>, &str)> = Vec::new();
    let mut doubled = trace.clone();
    doubled.insert(first_free + 1, trace[first_free].clone());
    mutants.push(("double free", doubled, "double free"));
    let mut reversed = trace.clone();
    reversed.reverse();
    mutants.push(("reversed", reversed, "lies in no segment"));
    let frees: Vec<TraceEntry> = trace
        .iter()
        .filter(|e| e.action.starts_with("free"))
        .cloned()
        .collect();
    mutants.push(("frees only", frees, "double free"));
    let seg = trace
        .iter()
        .position(|e| e.action == "segment_alloc")
        .unwrap();
    let mut overlap = trace.clone();
    let mut twin = trace[seg].clone();
    twin.addr = twin.addr.map(|a| a + twin.size / 2);
    overlap.insert(seg + 1, twin);
    mutants.push(("overlapping segments", overlap, "overlaps the live segment"));
    let dir = tempfile::tempdir().unwrap();
    for (name, entries, says) in mutants {
        let mut s = snap.clone();
        s.device_traces[0] = entries;
        let path = dir
            .path()
            .join(format!("{}.pickle", name.replace(' ', "-")));
        let bytes = serde_pickle::to_vec(&s, serde_pickle::SerOptions::new()).unwrap();
        std::fs::write(&path, bytes).unwrap();
        let p = path.display().to_string();
        let out = oomprobe()
            .args(["estimate", "--snapshot", &p])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{name}: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{name}: {err}");
        assert!(
            err.contains("cannot have happened") && err.contains(says),
            "{name}: {err}"
        );
        let r = oomprobe()
            .args(["estimate", "--snapshot", &p, "--lenient", "--json"])
            .output()
            .unwrap();
        let warned = String::from_utf8_lossy(&r.stderr);
        assert!(r.status.success(), "{name} --lenient: {warned}");
        assert!(
            warned.contains("warning") && warned.contains(says),
            "{name}: {warned}"
        );
        let v: Value = serde_json::from_slice(&r.stdout).unwrap();
        assert!(
            v.to_string().contains("--lenient"),
            "{name}: the JSON notes the lenient replay: {v}"
        );
    }
    // The real file itself is consistent.
    assert_eq!(oomprobe::snapshot::consistency::check(&snap), None);
}
