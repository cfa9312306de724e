//! vLLM's published startup logs (tests/fixtures/serving/vllm_logs.json) through oomprobe's
//! block arithmetic (`oomprobe::serve`). Inputs are the printed numbers; a printed GiB `x`
//! stands for bytes in [x − 0.005, x + 0.005) GiB, so the printed block count must lie in the
//! range that interval implies, and the printed tokens and concurrency follow from the blocks
//! exactly. The per-token bytes are each model's (VLLM_SIZING.md §3).

use oomprobe::serve::{blocks_in, concurrency, page_bytes, size_from_parts, Refusal};
use serde_json::Value;

const GIB: f64 = (1u64 << 30) as f64;

fn logs() -> Vec<Value> {
    let text = include_str!(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/serving/vllm_logs.json"
    ));
    let v: Value = serde_json::from_str(text).unwrap();
    v["logs"].as_array().unwrap().clone()
}

fn log(id: &str) -> Value {
    logs()
        .into_iter()
        .find(|l| l["id"] == id)
        .unwrap_or_else(|| panic!("no log {id}"))
}

fn p(l: &Value, k: &str) -> f64 {
    l["printed"][k]
        .as_f64()
        .unwrap_or_else(|| panic!("{k} not printed in {}", l["id"]))
}

fn bytes(g: f64) -> i128 {
    (g * GIB) as i128
}

/// Blocks a printed KV size allows, given one layer's page and the layers.
fn block_range(kv_gib: f64, page: u64, layers: u64) -> (u64, u64) {
    (
        blocks_in(bytes(kv_gib - 0.005), page, layers),
        blocks_in(bytes(kv_gib + 0.005), page, layers),
    )
}

/// (layers, one layer's page at block 16) by model.
fn model(layers: u64, kv: u64, d: u64, b: u64) -> (u64, u64) {
    (layers, page_bytes(16, kv, d, b))
}

#[test]
fn v0_llama3_8b_a100_40gb() {
    let l = log("v0-llama3-8b-a100-40gb");
    let (layers, page) = model(32, 8, 128, 2);
    // KV = requested − weights − non-torch − activation peak, to the rounding of four terms.
    let kv = p(&l, "requested_gib")
        - p(&l, "weights_gib")
        - p(&l, "non_torch_gib")
        - p(&l, "activation_peak_gib");
    assert!((kv - p(&l, "kv_cache_gib")).abs() < 0.02, "{kv}");
    let blocks = l["printed"]["gpu_blocks"].as_u64().unwrap();
    let (lo, hi) = block_range(p(&l, "kv_cache_gib"), page, layers);
    assert!((lo..=hi).contains(&blocks), "{blocks} not in {lo}..={hi}");
    let c = format!("{:.2}", concurrency(blocks, 8192, 16));
    assert_eq!(c, format!("{:.2}", p(&l, "max_concurrency")));
    // V0's CPU (swap) blocks: 4 GiB / the all-layer block.
    assert_eq!((4u64 << 30) / (page * layers), 2048);
}

#[test]
fn v0_llama31_8b_rtx3090_20k() {
    let l = log("v0-llama31-8b-rtx3090-20k");
    let (layers, page) = model(32, 8, 128, 2);
    let blocks = l["printed"]["gpu_blocks"].as_u64().unwrap();
    let (lo, hi) = block_range(p(&l, "kv_cache_gib"), page, layers);
    assert!((lo..=hi).contains(&blocks));
    assert_eq!(format!("{:.2}", concurrency(blocks, 20_000, 16)), "1.56");
}

#[test]
fn v0_llama31_8b_rtx3090_29k_refuses() {
    let l = log("v0-llama31-8b-rtx3090-29k-refusal");
    let (layers, page) = model(32, 8, 128, 2);
    let blocks = l["printed"]["gpu_blocks"].as_u64().unwrap();
    let (lo, hi) = block_range(p(&l, "kv_cache_gib"), page, layers);
    assert!((lo..=hi).contains(&blocks));
    assert_eq!(
        blocks * 16,
        l["printed"]["refusal_kv_tokens"].as_u64().unwrap()
    );
    assert_eq!(format!("{:.2}", concurrency(blocks, 29_000, 16)), "0.82");
    // This log format prints the torch peak (weights + activations) as one number.
    let (_, _, r, u) = size_from_parts(
        bytes(p(&l, "total_gpu_gib")) as u64,
        0.9,
        bytes(p(&l, "peak_torch_gib")) as u64,
        0,
        bytes(p(&l, "non_torch_gib")) as u64,
        page,
        layers,
        29_000,
        16,
    );
    assert!(matches!(r, Some(Refusal::TooShort { .. })), "{r:?}");
    assert_eq!(u, Some(0.928));
}

#[test]
fn v0_llama32_11b_vision_h100() {
    let l = log("v0-llama32-11b-vision-h100-80g");
    let (layers, page) = model(40, 8, 128, 2);
    let blocks = l["printed"]["gpu_blocks"].as_u64().unwrap();
    let (lo, hi) = block_range(p(&l, "kv_cache_gib"), page, layers);
    assert!((lo..=hi).contains(&blocks));
    assert_eq!((4u64 << 30) / (page * layers), 1638);
}

#[test]
fn v1_llama31_70b_mml2048() {
    let l = log("v1-llama31-70b-w8a8-mml2048");
    let blocks = l["printed"]["gpu_blocks"].as_u64().unwrap();
    assert_eq!(format!("{:.2}", concurrency(blocks, 2048, 16)), "10.79");
}

#[test]
fn v1_mistral_small_24b_tokens_and_concurrency() {
    let l = log("v1-mistral-small-31-24b-awq-24g");
    let tokens = l["printed"]["kv_cache_tokens"].as_u64().unwrap();
    assert_eq!(tokens % 16, 0);
    assert_eq!(format!("{:.2}", concurrency(tokens / 16, 4096, 16)), "8.64");
}

#[test]
fn v1_qwen3_14b_exact() {
    let l = log("v1-qwen3-14b-single-gpu");
    let (layers, page) = model(40, 8, 128, 2);
    let (lo, hi) = block_range(p(&l, "kv_cache_gib"), page, layers);
    let tokens = l["printed"]["kv_cache_tokens"].as_u64().unwrap();
    assert!((lo..=hi).contains(&(tokens / 16)), "{lo}..={hi}");
    assert_eq!(
        format!("{:.2}", concurrency(tokens / 16, 32_768, 16)),
        "1.30"
    );
}

#[test]
fn v1_fp8_kv_one_byte_per_element() {
    // 48 KiB per token: e.g. 48 layers × 4 KV heads × 128 × 2 (K, V) × 1 B (model not stated).
    let (layers, page) = model(48, 4, 128, 1);
    let l = log("v1-fp8kv-mml100000");
    let (lo, hi) = block_range(p(&l, "kv_cache_gib"), page, layers);
    let tokens = l["printed"]["kv_cache_tokens"].as_u64().unwrap();
    assert!((lo..=hi).contains(&(tokens / 16)));
    assert_eq!(
        format!("{:.2}", concurrency(tokens / 16, 100_000, 16)),
        "2.31"
    );
    // The refusal at 221000 tokens: 10.12 GiB needed, 122080 the estimated max length.
    let l = log("v1-fp8kv-mml221000-refusal");
    let avail = bytes(p(&l, "kv_cache_gib"));
    let needed = 221_000u64.div_ceil(16) * page * layers;
    assert_eq!(format!("{:.2}", needed as f64 / GIB), "10.12");
    assert!(needed as i128 > avail);
    let (lo, hi) = block_range(p(&l, "kv_cache_gib"), page, layers);
    let est = l["printed"]["refusal_estimated_max_model_len"]
        .as_u64()
        .unwrap();
    assert!((lo * 16..=hi * 16).contains(&est), "{est}");
}

#[test]
fn v1_qwen3_235b_tp4_is_not_reproduced_from_one_line() {
    // 1 KV head per GPU. 8.11 GiB would be ~11,308 blocks; 178,880 tokens (11,180) is printed:
    // 1.1 % short (VLLM_SIZING.md §4.12: likely the minimum over the TP workers).
    let (layers, page) = model(94, 1, 128, 2);
    let l = log("v1-qwen3-235b-fp8-tp4-h100");
    let (lo, _) = block_range(p(&l, "kv_cache_gib"), page, layers);
    let tokens = l["printed"]["kv_cache_tokens"].as_u64().unwrap();
    assert!(
        tokens / 16 < lo,
        "now reproduced: update docs/validation.md"
    );
}

#[test]
fn v0_qwen25_7b_8gb_has_no_memory() {
    let l = log("v0-qwen25-7b-rtx4060-8gb-no-memory");
    let (layers, page) = model(28, 4, 128, 2);
    let (kv, blocks, r, u) = size_from_parts(
        bytes(p(&l, "total_gpu_gib")) as u64,
        0.7,
        bytes(p(&l, "weights_gib")) as u64,
        bytes(p(&l, "activation_peak_gib")) as u64,
        bytes(p(&l, "non_torch_gib")) as u64,
        page,
        layers,
        4096,
        16,
    );
    assert_eq!(format!("{:.2}", kv as f64 / GIB), "-1.05");
    assert_eq!(blocks, 0);
    assert_eq!(r, Some(Refusal::NoMemory));
    assert_eq!(u, Some(0.859));
    assert_eq!((4u64 << 30) / (page * layers), 4681);
}

#[test]
fn v0_qwen15_7b_mha_refuses_32k() {
    let l = log("v0-qwen15-7b-gptq-rtx3090-refusal");
    let (layers, page) = model(32, 32, 128, 2);
    let tokens = l["printed"]["refusal_kv_tokens"].as_u64().unwrap();
    let kv = (tokens / 16 * page * layers) as i128;
    let (_, blocks, r, _) = size_from_parts(kv as u64, 1.0, 0, 0, 0, page, layers, 32_768, 16);
    assert_eq!(blocks * 16, tokens);
    assert!(matches!(
        r,
        Some(Refusal::TooShort {
            estimated_max_model_len: 24_320,
            ..
        })
    ));
}
