//! `--mode serve` from the outside: estimate's vLLM-style lines and JSON, bad input exiting 2
//! with one line, and `probe --mode serve --budget` on lavapipe (fails, never skips, without
//! an adapter).

use crate::support::adapter::{oomprobe, require_adapter};
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

/// A request's cache on a real config, as the JSON reports it: (kind, layers, bytes per
/// layer) of each part and the total.
fn cache_parts(config: &str, len: u64) -> (Vec<(String, u64, u64)>, u64) {
    let path = format!(
        "{}/tests/fixtures/configs/{config}.json",
        env!("CARGO_MANIFEST_DIR")
    );
    let len = len.to_string();
    let args = [
        "estimate",
        "--config",
        &path,
        "--mode",
        "serve",
        "--memory",
        "4000GiB",
        "--max-model-len",
        &len,
        "--json",
    ];
    let out = oomprobe()
        .args(args)
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    let v: Value = serde_json::from_slice(&out).unwrap();
    let c = &v["serving"]["cache"];
    let parts = c["parts"]
        .as_array()
        .unwrap_or_else(|| panic!("{config}: no cache parts in {c}"))
        .iter()
        .map(|p| {
            let n = |k: &str| p[k].as_u64().unwrap();
            (
                p["kind"].as_str().unwrap().to_string(),
                n("layers"),
                n("bytes_per_layer"),
            )
        })
        .collect();
    (parts, c["bytes_per_request"].as_u64().unwrap())
}

/// Bytes per request against vLLM's KV-cache specs written out by hand from each config's
/// fields (`vllm/v1/kv_cache_interface.py` at e675dda; block 16, bf16, `vllm serve`'s 8192
/// batched tokens on a card of 70 GiB or more), one real config per cache kind: full, sliding, chunked, MLA and the two
/// hybrids (Gated DeltaNet, Mamba-2).
#[test]
fn cache_per_request_is_vllms_closed_form_on_real_configs() {
    let (block, bt, len) = (16_u64, 8192_u64, 32768_u64);
    // FullAttentionSpec page: 2 (K and V) × block × kv_heads × head_dim × 2 bytes.
    let page = |kv_heads: u64, head_dim: u64| 2 * block * kv_heads * head_dim * 2;
    let check = |config: &str, len: u64, want: &[(&str, u64, u64)]| {
        let (parts, total) = cache_parts(config, len);
        let want: Vec<(String, u64, u64)> = want
            .iter()
            .map(|&(k, l, b)| (k.to_string(), l, b))
            .collect();
        let mut got = parts.clone();
        got.sort();
        let mut w = want.clone();
        w.sort();
        assert_eq!(got, w, "{config}");
        assert_eq!(
            total,
            want.iter().map(|(_, l, b)| l * b).sum::<u64>(),
            "{config}"
        );
    };
    // Gemma 3 1B: 26 layers, every 6th full (sliding_window_pattern 6), window 512, one KV
    // head of 256: sliding layers keep min(512 − 1 + 8192, len) tokens in ⌈·/16⌉ + 1 pages.
    let p = page(1, 256);
    check(
        "gemma3-1b",
        len,
        &[
            ("sliding_window", 22, ((511 + bt).div_ceil(block) + 1) * p),
            ("full", 4, len / block * p),
        ],
    );
    // Llama 4 Scout: 48 layers, every 4th global (NoPE), the rest chunked at 8192: they keep
    // min(8192 + 8192, len) tokens; 8 KV heads of 128.
    let p = page(8, 128);
    check(
        "llama4-scout",
        len,
        &[
            ("chunked", 36, (8192 + bt).div_ceil(block) * p),
            ("full", 12, len / block * p),
        ],
    );
    // DeepSeek-V3: 61 MLA layers, one latent of kv_lora_rank 512 + qk_rope_head_dim 64.
    check("deepseek-v3", len, &[("mla", 61, len * (512 + 64) * 2)]);
    // Qwen3-Next 80B-A3B: every 4th layer full attention (2 KV heads of 256); the other 36
    // Gated DeltaNet, one state per request: conv (kernel 4 − 1) × (2·16·128 + 32·128) plus
    // the delta-rule state 32 value heads × 128 × 128.
    let gdn = (3 * (2 * 16 * 128 + 32 * 128) + 32 * 128 * 128) * 2;
    check(
        "qwen3-next-80b-a3b",
        len,
        &[
            ("gated_deltanet", 36, gdn),
            ("full", 12, len / block * page(2, 256)),
        ],
    );
    // Nemotron-H 8B: 4 attention layers ('*', 8 KV heads of head_dim 128) among 24 Mamba-2
    // ('M'); the state: conv (4 − 1) × (128·64 + 2·8·128) plus SSM 128 heads × 64 × 128.
    let mamba = (3 * (128 * 64 + 2 * 8 * 128) + 128 * 64 * 128) * 2;
    check(
        "nemotron-h-8b",
        8192,
        &[
            ("mamba", 24, mamba),
            ("full", 4, 8192 / block * page(8, 128)),
        ],
    );
}
