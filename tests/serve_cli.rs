//! `--mode serve` from the outside: estimate's vLLM-style lines and JSON, bad input exiting 2
//! with one line, and `probe --mode serve --budget` on lavapipe (fails, never skips, without
//! an adapter).

#[path = "common/adapter.rs"]
mod adapter;
use adapter::{oomprobe, require_adapter};
use serde_json::Value;

const LLAMA: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/tests/fixtures/configs/llama3-8b.json"
);

fn serve(extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = ["estimate", "--config", LLAMA, "--mode", "serve"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

#[test]
fn estimate_prints_vllm_lines_at_40gib() {
    let out = oomprobe()
        .args(serve(&["--memory", "40GiB"]))
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    let t = String::from_utf8(out).unwrap();
    for line in [
        "requested memory       36.00 GiB",
        "model weights          14.96 GiB",
        "Available KV cache memory: ",
        "# GPU blocks: ",
        "GPU KV cache size: ",
        "Maximum concurrency for 131,072 tokens per request: ",
    ] {
        assert!(t.contains(line), "{line:?} missing in\n{t}");
    }
}

#[test]
fn estimate_json_serving_adds_up() {
    let out = oomprobe()
        .args(serve(&["--memory", "40GiB", "--json"]))
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    let v: Value = serde_json::from_slice(&out).unwrap();
    let s = &v["serving"];
    let g = |k: &str| s[k].as_i64().unwrap_or_else(|| panic!("{k} in {s}"));
    assert_eq!(v["schema_version"], 1);
    assert!(v["breakdown"]["total"].as_u64().is_some());
    assert_eq!(g("requested_bytes"), 36 << 30);
    assert_eq!(
        g("kv_bytes"),
        g("requested_bytes") - g("weights_bytes") - g("profile_peak_bytes") - g("non_torch_bytes")
    );
    assert_eq!(g("page_bytes_per_layer"), 65_536);
    assert_eq!(g("blocks"), g("kv_bytes") / 65_536 / 32);
    assert_eq!(g("tokens"), g("blocks") * 16);
    assert_eq!(s["limits"]["max_num_batched_tokens"], 2048);
    assert_eq!(s["limits"]["max_num_seqs"], 256);
    assert!(s.get("refusal").is_none());
}

#[test]
fn a_refusal_is_a_result_with_the_utilization_that_fits() {
    let out = oomprobe()
        .args(serve(&["--memory", "34GiB"]))
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    let t = String::from_utf8(out).unwrap();
    assert!(t.contains("vLLM would not start"), "{t}");
    assert!(t.contains("the estimated maximum model length is"), "{t}");
    assert!(t.contains("--gpu-memory-utilization 0."), "{t}");
}

fn bad(extra: &[&str], needle: &str) {
    let out = oomprobe().args(extra).assert().code(2).get_output().clone();
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains(needle), "{needle:?} not in {err}");
}

#[test]
fn bad_serving_input_exits_2_with_one_line() {
    let e = |x: &[&str]| serve(&[&["--memory", "40GiB"], x].concat());
    let s = |v: Vec<String>| v;
    let run = |x: &[&str], needle: &str| {
        let a = s(e(x));
        let a: Vec<&str> = a.iter().map(String::as_str).collect();
        bad(&a, needle);
    };
    run(&["--gpu-memory-utilization", "0"], "outside (0, 1]");
    run(&["--gpu-memory-utilization", "1.5"], "outside (0, 1]");
    run(
        &["--max-model-len", "200000"],
        "derived max_model_len (131072",
    );
    run(&["--block-size", "24"], "--block-size");
    run(&["--tp", "3"], "--tp: 3 does not divide");
    run(&["--engine", "foo"], "--engine");
    run(&["--kv-cache-dtype", "int4"], "--kv-cache-dtype");
    bad(
        &["estimate", "--config", LLAMA, "--max-model-len", "4096"],
        "go with --mode serve",
    );
    bad(
        &[
            "estimate", "--model", "gpt2", "--mode", "serve", "--memory", "40GiB",
        ],
        "serve needs a decoder LLM",
    );
    // A preset's context without rope scaling is the cap.
    bad(
        &[
            "estimate",
            "--model",
            "llama-7b",
            "--mode",
            "serve",
            "--memory",
            "40GiB",
            "--max-model-len",
            "4097",
        ],
        "--max-model-len",
    );
}

#[test]
fn probe_serve_on_lavapipe_measures_the_pool() {
    require_adapter();
    let out = oomprobe()
        .args([
            "probe",
            "--config",
            LLAMA,
            "--mode",
            "serve",
            "--layers",
            "2",
            "--hidden",
            "256",
            "--heads",
            "4",
            "--kv-heads",
            "2",
            "--ffn",
            "512",
            "--vocab",
            "4096",
            "--max-model-len",
            "1024",
            "--max-num-batched-tokens",
            "256",
            "--max-num-seqs",
            "16",
            "--budget",
            "64MiB",
            "--json",
        ])
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    let v: Value = serde_json::from_slice(&out).unwrap();
    let (p, m) = (&v["predicted"], &v["measured"]);
    assert_eq!(v["budget_bytes"], 64u64 << 20);
    assert_eq!(m["profile_fit"], true);
    let predicted = p["blocks"].as_u64().unwrap();
    let device = m["device_blocks"].as_u64().unwrap();
    let cap = m["pool"]["cap_blocks"].as_u64().unwrap();
    let k = m["granularity_blocks"].as_u64().unwrap();
    assert!(predicted > 0);
    // The budget refuses the pool within a round (or two: scratch buffers) of the card's total.
    assert!(
        device <= cap && device + 2 * k >= cap,
        "{device} of {cap} (k {k})"
    );
    assert_eq!(m["blocks"].as_u64().unwrap(), predicted.min(device));
    assert_eq!(
        m["tokens"].as_u64().unwrap(),
        m["blocks"].as_u64().unwrap() * 16
    );
}

#[test]
fn diagnose_serve_gives_the_verdict_and_remedies() {
    let out = oomprobe()
        .args([
            "diagnose", "--config", LLAMA, "--mode", "serve", "--memory", "34GiB", "--json",
        ])
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    let v: Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(v["cause"], "refuses_to_start");
    let names: Vec<&str> = v["remedies"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["name"].as_str().unwrap())
        .collect();
    assert!(
        names.iter().any(|n| n.starts_with("--max-model-len ")),
        "{names:?}"
    );
    assert!(
        names
            .iter()
            .any(|n| n.starts_with("--gpu-memory-utilization ")),
        "{names:?}"
    );
    assert!(names.contains(&"--kv-cache-dtype fp8"), "{names:?}");
}

#[test]
fn sglang_and_trtllm_size_their_pools_their_own_way() {
    let text = |engine: &str| {
        let out = oomprobe()
            .args(serve(&[
                "--memory",
                "80GiB",
                "--max-model-len",
                "8192",
                "--engine",
                engine,
            ]))
            .assert()
            .success()
            .get_output()
            .stdout
            .clone();
        String::from_utf8(out).unwrap()
    };
    let sg = text("sglang");
    assert!(sg.contains("KV Cache is allocated. #tokens: "), "{sg}");
    assert!(sg.contains("mem_fraction_static 0.875"), "{sg}");
    let tr = text("trtllm");
    assert!(tr.contains("[MemUsageChange] Allocated"), "{tr}");
    assert!(tr.contains("block_size 32"), "{tr}");
    let json = |engine: &str| -> Value {
        let out = oomprobe()
            .args(serve(&[
                "--memory",
                "80GiB",
                "--max-model-len",
                "8192",
                "--engine",
                engine,
                "--json",
            ]))
            .assert()
            .success()
            .get_output()
            .stdout
            .clone();
        serde_json::from_slice(&out).unwrap()
    };
    let z = |v: &Value| v["serving"].clone();
    let (v, s, t) = (json("vllm"), json("sglang"), json("trtllm"));
    let per_token = 131_072u64; // Llama-3-8B: 2 x 8 KV heads x 128 x 32 layers x 2 B
                                // SGLang: f x total − weights over the cell, one token per page.
    let sz = z(&s);
    let f = sz["gpu_memory_utilization"].as_f64().unwrap();
    let weights = sz["weights_bytes"].as_u64().unwrap();
    let expect = ((80u64 << 30) as f64 * f) as u64 - weights;
    assert_eq!(sz["tokens"].as_u64().unwrap(), expect / per_token, "{sz}");
    // TensorRT-LLM: tokens a whole number of 32-token blocks.
    let tz = z(&t);
    assert_eq!(tz["tokens"].as_u64().unwrap() % 32, 0, "{tz}");
    // All three hold the same weights.
    assert_eq!(z(&v)["weights_bytes"], sz["weights_bytes"]);
    assert_eq!(z(&v)["weights_bytes"], tz["weights_bytes"]);
    // TensorRT-LLM's fraction must stay below 1.
    bad(
        &serve(&[
            "--memory",
            "80GiB",
            "--engine",
            "trtllm",
            "--gpu-memory-utilization",
            "1",
        ])
        .iter()
        .map(String::as_str)
        .collect::<Vec<_>>(),
        "below 1",
    );
}
