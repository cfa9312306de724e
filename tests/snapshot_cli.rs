//! `--snapshot` end to end: the GPT-2 snapshots replayed on the first adapter (lavapipe in CI)
//! under a budget, the scaled max batch predicted and confirmed by probing, a recorded OOM
//! reproduced, `estimate`/`diagnose` on the same timeline, export to PyTorch's format, and bad
//! files (exit 2, one line).

use std::path::{Path, PathBuf};

use serde_json::Value;

#[path = "common/adapter.rs"]
mod adapter;
use adapter::{oomprobe, require_adapter};

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/snapshots")
        .join(name)
}

fn fx(name: &str) -> String {
    fixture(name).display().to_string()
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
            vec![
                "diagnose",
                "--snapshot",
                &fx("bad-action.pickle")[..],
                "--memory",
                "1GiB",
            ],
            "unknown action",
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
