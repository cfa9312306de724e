//! Parallel layouts end to end: bad layouts exit 2 with one line naming the dimension, estimate
//! names the rank it planned, diagnose --gpus lists the layouts that fit, and a rank's plan is
//! probed to an exact boundary on the first wgpu adapter (lavapipe in CI), each rank its own.

use serde_json::Value;

use crate::support::adapter::{self, oomprobe, require_adapter};

fn stderr_line(args: &[&str]) -> String {
    let out = oomprobe().args(args).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr).to_string();
    let lines: Vec<&str> = err
        .lines()
        .filter(|l| !l.contains("XDG_RUNTIME_DIR") && !l.trim().is_empty())
        .collect();
    assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
    assert_eq!(lines.len(), 1, "{args:?}: one line, got {err}");
    assert!(!err.contains("panicked"), "{args:?}: {err}");
    lines[0].to_string()
}

#[test]
fn a_bad_layout_exits_2_naming_its_dimension() {
    let l8 = ["estimate", "--model", "llama3-8b"];
    for (extra, names) in [
        // 32 heads, 8 key/value heads, 32 layers.
        (vec!["--tp", "3"], ["--tp", "attention heads"]),
        (vec!["--tp", "16"], ["--tp", "key/value heads"]),
        (vec!["--pp", "64"], ["--pp", "layers"]),
        (vec!["--pp", "3"], ["--pp", "do not divide the 32 layers"]),
        (vec!["--tp", "2", "--gpus", "3"], ["--gpus", "tp 2"]),
        (
            vec!["--dp", "2", "--tp", "2", "--gpus", "8"],
            ["--dp", "--gpus is 8"],
        ),
        (
            vec!["--tp", "2", "--rank", "5"],
            ["--rank", "not among the 2 GPUs"],
        ),
        (vec!["--sequence-parallel"], ["--sequence-parallel", "--tp"]),
        (vec!["--microbatches", "4"], ["--microbatches", "--pp"]),
        (vec!["--cp", "2", "--seq", "1022"], ["--cp", "seq"]),
        (vec!["--cp", "2", "--attention", "eager"], ["--cp", "sdpa"]),
        (
            vec!["--fsdp", "full", "--zero", "3", "--gpus", "8"],
            ["--fsdp", "ZeRO"],
        ),
        (vec!["--fsdp", "sideways"], ["--fsdp", "full, hybrid"]),
        (
            vec!["--fsdp-version", "1"],
            ["--fsdp-version 1", "--fsdp full"],
        ),
        (vec!["--fsdp-version", "3"], ["--fsdp-version", "1, 2"]),
        (
            vec![
                "--fsdp",
                "full",
                "--gpus",
                "8",
                "--backward-prefetch",
                "post",
            ],
            ["--backward-prefetch", "--fsdp-version 1"],
        ),
        (
            vec![
                "--fsdp",
                "full",
                "--gpus",
                "8",
                "--fsdp-version",
                "1",
                "--backward-prefetch",
                "later",
            ],
            ["--backward-prefetch", "pre, post"],
        ),
        (
            vec![
                "--fsdp",
                "full",
                "--fsdp-version",
                "1",
                "--gpus",
                "8",
                "--quant",
                "nf4",
                "--lora",
                "8",
                "--precision",
                "bf16",
            ],
            ["--fsdp-version 1", "quantized base"],
        ),
        (
            vec!["--schedule", "zigzag", "--pp", "2"],
            ["--schedule", "1f1b"],
        ),
    ] {
        let mut args = l8.to_vec();
        args.extend(extra.iter());
        let line = stderr_line(&args);
        for n in names {
            assert!(line.contains(n), "{args:?}: {line}");
        }
    }
}

fn json(args: &[&str]) -> Value {
    adapter::json_of(args)
}

#[test]
fn estimate_plans_the_worst_rank_and_any_rank_asked() {
    let base = [
        "estimate",
        "--model",
        "llama3-8b",
        "--seq",
        "2048",
        "--pp",
        "4",
        "--microbatches",
        "8",
    ];
    let worst = json(&base);
    let note = worst["notes"][0].as_str().unwrap();
    assert!(
        note.contains("rank 0 of 4") && note.contains("the worst"),
        "{note}"
    );
    let mut last = base.to_vec();
    last.extend(["--rank", "3"]);
    let last = json(&last);
    let note = last["notes"][0].as_str().unwrap();
    assert!(
        note.contains("rank 3 of 4") && note.contains("as asked"),
        "{note}"
    );
    assert_eq!(worst["rank"]["rank"], 0, "{}", worst["rank"]);
    assert_eq!(worst["rank"]["worst"], true);
    assert_eq!(worst["rank"]["stages"], 4);
    assert_eq!(last["rank"]["stage"], 3);
    assert_eq!(last["rank"]["layers"], serde_json::json!([24, 31]));
    assert_eq!(last["rank"]["worst"], false);
    // Under 1F1B the first stage holds four micro-batches, the last one (plus the logits).
    let total = |v: &Value| v["breakdown"]["total"].as_u64().unwrap();
    assert!(total(&worst) > total(&last));
}

#[test]
fn diagnose_lists_the_layouts_that_fit_on_n_gpus() {
    let d = json(&[
        "diagnose",
        "--model",
        "llama3-8b",
        "--precision",
        "amp-bf16",
        "--seq",
        "4096",
        "--batch",
        "1",
        "--gpus",
        "8",
        "--memory",
        "80GiB",
    ]);
    let l = &d["layouts"];
    assert!(l["tried"].as_u64().unwrap() >= 8, "{l}");
    assert!(l["fitting"].as_u64().unwrap() >= 1, "{l}");
    let best = &l["best"][0];
    assert_eq!(best["fits"], true, "{l}");
    assert!(best["peak_bytes"].as_u64().unwrap() <= 80 << 30);
    assert!(best["max_micro_batch"].as_u64().unwrap() >= 1);
    // On a card of the table each layout's ranks lose the card's non-PyTorch share and one NCCL
    // communicator per process group; what PyTorch's allocator gets is at most what the
    // tensors alone would.
    let d = json(&[
        "diagnose",
        "--model",
        "llama3-8b",
        "--precision",
        "amp-bf16",
        "--seq",
        "4096",
        "--batch",
        "1",
        "--gpus",
        "8",
        "--gpu",
        "h100-sxm",
    ]);
    for x in d["layouts"]["best"].as_array().unwrap() {
        let usable = x["usable_bytes"].as_u64().unwrap();
        let groups = u64::from(x["tp"].as_u64().unwrap() > 1)
            + u64::from(x["pp"].as_u64().unwrap() > 1)
            + u64::from(x["dp"].as_u64().unwrap() > 1);
        assert!(usable + groups.max(1) * (1 << 30) < 80 << 30, "{x}");
        if let (Some(a), Some(t)) = (
            x["max_micro_batch"].as_u64(),
            x["max_micro_batch_tensors"].as_u64(),
        ) {
            assert!(a <= t, "{x}");
        }
    }
    // Eight 24 GiB cards cannot hold a 70B model's Adam states in any layout.
    let cfg = format!(
        "{}/tests/fixtures/configs/llama3-70b.json",
        env!("CARGO_MANIFEST_DIR")
    );
    let d = json(&[
        "diagnose",
        "--config",
        &cfg,
        "--precision",
        "amp-bf16",
        "--seq",
        "4096",
        "--batch",
        "1",
        "--gpus",
        "8",
        "--memory",
        "24GiB",
    ]);
    assert_eq!(d["layouts"]["fitting"], 0, "{}", d["layouts"]);
}

fn probe(args: &[&str]) -> Value {
    let mut all = vec!["probe"];
    all.extend(args);
    adapter::json_of(&all)
}

#[test]
fn a_rank_plan_is_probed_to_an_exact_boundary() {
    require_adapter();
    let mut maxes = Vec::new();
    for rank in ["0", "3"] {
        let base = [
            "--model",
            "tiny-gpt",
            "--tp",
            "2",
            "--pp",
            "2",
            "--rank",
            rank,
            "--scenario",
            "batch",
            "--budget",
            "24MiB",
        ];
        let r = probe(&base);
        let run = &r["runs"][0];
        let max = run["max_fit"].as_u64().expect("a batch fits");
        assert_eq!(run["first_fail"].as_u64(), Some(max + 1), "{run}");
        assert_eq!(run["fail_reason"], "budget", "{run}");
        assert_eq!(run["predicted_max"].as_u64(), Some(max), "{run}");
        for x in [max, max + 1] {
            let mut a = base.to_vec();
            let xs = x.to_string();
            a.extend(["--at", xs.as_str()]);
            let p = &probe(&a)["runs"][0]["probes"][0];
            let want = if x == max { "fit" } else { "budget" };
            assert_eq!(p["outcome"], want, "rank {rank} at {x}: {p}");
        }
        maxes.push(max);
    }
    // Stage 0 holds two micro-batches under 1F1B, stage 1 one: their boundaries differ.
    assert_ne!(maxes[0], maxes[1], "{maxes:?}");
}

/// Issue 48: with a card named, every plan of the boundary search was a stage's step over all
/// its micro-batches (2,048 on 16 stages: minutes); a 1F1B plan now holds the warm-up, a few
/// steady pairs and the cool-down, so the time does not grow with `--microbatches`
/// (0.34 s measured for 2,048 on one card, 2 cores).
#[test]
fn a_long_pipeline_on_a_card_answers_at_once() {
    let _load = crate::support::load::timed();
    for m in ["2048", "4096"] {
        let t = std::time::Instant::now();
        let out = oomprobe()
            .args(["estimate", "--model", "llama3-8b", "--pp", "16"])
            .args(["--microbatches", m, "--gpu", "h100-sxm"])
            .timeout(std::time::Duration::from_secs(60))
            .assert()
            .success()
            .get_output()
            .stdout
            .clone();
        let s = String::from_utf8(out).unwrap();
        assert!(s.contains(&format!("pipeline: {m} micro-batches")), "{s}");
        assert!(t.elapsed().as_secs_f64() < 5.0, "{m}: {:?}", t.elapsed());
    }
}
