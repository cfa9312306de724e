//! Published real-GPU memory figures re-predicted (`tests/fixtures/published_memory.json`,
//! issue 45 item 1): each row's workload as oomprobe flags, its published counter beside the
//! plan. Rows that hold are within 8 %; rows with a known gap stay inside the band their
//! reason explains, so that a change to the model that moves them is seen.

use oomprobe::plan::Plan;
use serde_json::Value;

fn rows() -> Vec<Value> {
    let path = format!(
        "{}/tests/fixtures/published_memory.json",
        env!("CARGO_MANIFEST_DIR")
    );
    let fx: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    fx["rows"].as_array().unwrap().clone()
}

/// The plan's peak for a row's flags (`tensors_peak`), the caching allocator's reserved peak
/// over two steps (`reserved_peak`), or that on top of the process's memory outside PyTorch
/// (`nvml_after`: what NVML shows once training is over; the row's `context_bytes`).
fn predicted(r: &Value) -> u64 {
    let (flags, compare) = (r["flags"].as_str().unwrap(), r["compare"].as_str().unwrap());
    let w = crate::support::flags::workload(flags);
    let plan = Plan::for_workload(&w).unwrap();
    let reserved = || {
        let conf = oomprobe::alloc::AllocConf::default();
        oomprobe::alloc::timeline::replay(&plan, &conf, None, 2, false).reserved_peak_bytes
    };
    match compare {
        "tensors_peak" => plan.peak().bytes,
        "reserved_peak" => reserved(),
        "nvml_after" => r["context_bytes"].as_u64().expect("context_bytes") + reserved(),
        other => panic!("{flags}: compare {other}"),
    }
}

#[test]
fn published_rows_hold_or_stay_in_their_known_gap() {
    let rows = rows();
    assert!(rows.len() >= 32, "{} rows", rows.len());
    let mut bad = Vec::new();
    let mut held = 0;
    let mut held_errors = Vec::new();
    let mut all_errors = Vec::new();
    let mut ooms = 0;
    for r in &rows {
        let id = r["id"].as_str().unwrap();
        assert!(
            r["source"].as_str().unwrap().starts_with("https://"),
            "{id}"
        );
        let got = predicted(r);
        if r["expect"] == "oom" {
            // A published OOM: the plan must not fit what the card leaves PyTorch.
            let card = oomprobe::alloc::cards::get(r["card"].as_str().unwrap()).unwrap();
            let usable = card.total - card.non_pytorch;
            if got <= usable {
                bad.push(format!("{id}: published OOM, planned {got} fits {usable}"));
            }
            ooms += 1;
            continue;
        }
        let published = r["published_bytes"].as_u64().unwrap();
        let err = (got as f64 - published as f64) / published as f64;
        all_errors.push(err.abs());
        let (lo, hi) = match r["expect"].as_str().unwrap() {
            "holds" => {
                held += 1;
                held_errors.push(err.abs());
                (-0.08, 0.08)
            }
            "known_gap" => {
                assert!(r["why"].as_str().is_some_and(|w| w.len() > 20), "{id}");
                let b = r["band"].as_array().unwrap();
                (b[0].as_f64().unwrap(), b[1].as_f64().unwrap())
            }
            other => panic!("{id}: expect {other}"),
        };
        if !(lo..=hi).contains(&err) {
            bad.push(format!(
                "{id}: published {published}, planned {got} ({:+.2} %, expected {:+.0} % to {:+.0} %)",
                err * 100.0,
                lo * 100.0,
                hi * 100.0
            ));
        }
    }
    assert!(held >= 29, "{held} rows hold");
    // Issue 45's bar: median within 3 %, over the rows that hold and over every numeric row
    // (the known gaps included).
    for (what, errors, bar) in [
        ("the rows that hold", held_errors, 0.03),
        ("all rows", all_errors, 0.03),
    ] {
        let mut e = errors;
        e.sort_by(f64::total_cmp);
        let median = e[e.len() / 2];
        assert!(median <= bar, "median |error| of {what}: {median}");
    }
    assert!(ooms >= 3, "{ooms} published OOMs");
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// Developer aid: `cargo test --test it published_table -- --ignored --nocapture` prints every
/// row's published figure beside the plan's.
#[test]
#[ignore]
fn published_table() {
    println!("| row | counter | published GiB | planned GiB | error |\n|---|---|---:|---:|---:|");
    for r in rows() {
        let Some(published) = r["published_bytes"].as_u64() else {
            continue;
        };
        let compare = r["compare"].as_str().unwrap();
        let got = predicted(&r);
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        println!(
            "| {} | {compare} | {:.2} | {:.2} | {:+.2} % |",
            r["id"].as_str().unwrap(),
            gib(published),
            gib(got),
            (got as f64 - published as f64) / published as f64 * 100.0
        );
    }
}

/// The held-out rows (`validation/published/*_holdout_rows.json`, each committed before any of
/// its rows was predicted) are in the table with the flags and figures they were committed
/// with, and each numeric one keeps the error of its first prediction. A row whose flags were
/// changed after that says why (`reflagged`), and no longer counts as held out.
#[test]
fn held_out_rows_keep_their_committed_flags() {
    let dir = format!("{}/validation/published", env!("CARGO_MANIFEST_DIR"));
    let table = rows();
    let mut files = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        if !name.ends_with("_holdout_rows.json") {
            continue;
        }
        files += 1;
        let held: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        for h in held["rows"].as_array().unwrap() {
            let id = h["id"].as_str().unwrap();
            let r = table
                .iter()
                .find(|r| r["id"] == id)
                .unwrap_or_else(|| panic!("{name}: {id} is not in the table"));
            if r["flags"] != h["flags"] {
                // Re-flagged after its first prediction: allowed only with the reason, and the
                // row then no longer counts as held out.
                assert!(
                    r["reflagged"].as_str().is_some_and(|w| w.len() > 20),
                    "{name}: {id}'s flags changed without a `reflagged` reason"
                );
            }
            assert_eq!(r["published_bytes"], h["published_bytes"], "{name}: {id}");
            if h["published_bytes"].is_u64() {
                assert!(r["first_prediction_pct"].is_f64(), "{name}: {id}");
            }
        }
    }
    assert!(files >= 3, "{files} held-out files");
}
