use super::*;

const KIB: u64 = 1 << 10;
const MIB: u64 = 1 << 20;

/// (layers, kv heads per GPU, head width, dtype bytes) → bytes per token per layer, per token,
/// per 16-token block over all layers: VLLM_SIZING.md §3, one row each.
fn row(layers: u64, kv: u64, d: u64, b: u64) -> (u64, u64, u64) {
    let page = page_bytes(16, kv, d, b);
    (page / 16, page / 16 * layers, page * layers)
}

#[test]
fn kv_bytes_mha_llama2_7b() {
    assert_eq!(row(32, 32, 128, 2), (16_384, 512 * KIB, 8 * MIB));
}

#[test]
fn kv_bytes_gqa_llama3_8b() {
    assert_eq!(row(32, 8, 128, 2), (4_096, 128 * KIB, 2 * MIB));
}

#[test]
fn kv_bytes_gqa_qwen25_7b() {
    assert_eq!(row(28, 4, 128, 2), (2_048, 56 * KIB, 917_504));
}

#[test]
fn kv_bytes_gqa_qwen3_14b() {
    assert_eq!(row(40, 8, 128, 2), (4_096, 160 * KIB, 2_621_440));
}

#[test]
fn kv_bytes_gqa_llama31_70b() {
    assert_eq!(row(80, 8, 128, 2), (4_096, 320 * KIB, 5 * MIB));
}

#[test]
fn kv_bytes_gqa_qwen3_235b_tp4() {
    // 4 KV heads over 4 GPUs: one each.
    let kv = kv_heads_per_gpu(4, 4);
    assert_eq!(kv, 1);
    assert_eq!(row(94, kv, 128, 2), (512, 48_128, 770_048));
    // More GPUs than KV heads: replicated, still one.
    assert_eq!(kv_heads_per_gpu(4, 8), 1);
}

#[test]
fn kv_bytes_mqa_falcon_like() {
    assert_eq!(row(32, 1, 64, 2), (256, 8 * KIB, 128 * KIB));
}

#[test]
fn kv_bytes_fp8_halves() {
    for (l, kv, d) in [(32, 32, 128), (32, 8, 128), (28, 4, 128), (32, 1, 64)] {
        let (a, b, c) = row(l, kv, d, 2);
        assert_eq!(row(l, kv, d, 1), (a / 2, b / 2, c / 2));
    }
}

#[test]
fn blocks_tokens_concurrency() {
    // ⌊⌊KV / page⌋ / L⌋ with KV = 11.1160 GiB, Llama-3-8B.
    let kv = (11.116 * (1u64 << 30) as f64) as i128;
    assert_eq!(blocks_in(kv, 64 * KIB, 32), 5691);
    assert_eq!(format!("{:.2}", concurrency(5691, 8192, 16)), "11.12");
    assert_eq!(blocks_in(-5, 64 * KIB, 32), 0);
    // Whole blocks per request: 20000 tokens are 1250 blocks.
    assert_eq!(format!("{:.2}", concurrency(1952, 20_000, 16)), "1.56");
}

#[test]
fn limits_follow_vllm_serve_defaults_and_clamps() {
    let s = |mml: u64, seqs: Option<u64>, toks: Option<u64>| Serve {
        engine: Engine::Vllm,
        gpu_memory_utilization: 0.9,
        max_model_len: mml,
        max_num_seqs: seqs,
        max_num_batched_tokens: toks,
        block_size: 16,
        kv_cache_dtype: KvDtype::Auto,
        tp: 1,
        util_default: false,
    };
    let l = resolve_limits(&s(8192, None, None), 40 * GIB);
    assert_eq!((l.max_num_batched_tokens, l.max_num_seqs), (2048, 256));
    let l = resolve_limits(&s(8192, None, None), 80 * GIB);
    assert_eq!((l.max_num_batched_tokens, l.max_num_seqs), (8192, 1024));
    // min(max_num_seqs × max_model_len, ·), then max_num_seqs ≤ max_num_batched_tokens.
    let l = resolve_limits(&s(4, Some(2), None), 40 * GIB);
    assert_eq!((l.max_num_batched_tokens, l.max_num_seqs), (8, 2));
    let l = resolve_limits(&s(1, None, None), 40 * GIB);
    assert_eq!((l.max_num_batched_tokens, l.max_num_seqs), (256, 256));
    let l = resolve_limits(&s(8192, Some(64), Some(4096)), 80 * GIB);
    assert_eq!((l.max_num_batched_tokens, l.max_num_seqs), (4096, 64));
}

#[test]
fn refusal_and_the_utilization_that_fits() {
    let g = |x: f64| (x * GIB as f64) as u64;
    // vllm_logs.json v0-qwen25-7b-rtx4060-8gb-no-memory: nothing left.
    let (kv, blocks, r, u) = size_from_parts(
        g(8.0),
        0.7,
        g(5.20),
        g(1.42),
        g(0.03),
        32 * KIB,
        28,
        4096,
        16,
    );
    assert!(kv < 0);
    assert_eq!(blocks, 0);
    assert_eq!(r, Some(Refusal::NoMemory));
    assert_eq!(u, Some(0.859));
    // One 29000-token request does not fit in 2.89 GiB (v0-llama31-8b-rtx3090-29k-refusal).
    let (_, blocks, r, u) = size_from_parts(
        g(23.58),
        0.9,
        g(17.98),
        0,
        g(0.35),
        64 * KIB,
        32,
        29_000,
        16,
    );
    assert!((1475..=1482).contains(&blocks), "{blocks}");
    match r {
        Some(Refusal::TooShort {
            estimated_max_model_len,
            ..
        }) => assert_eq!(estimated_max_model_len, blocks * 16),
        other => panic!("{other:?}"),
    }
    assert_eq!(u, Some(0.928));
}

fn llama3_8b() -> Workload {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/configs/llama3-8b.json"
    );
    let mut w = match crate::resolve::load_config(std::path::Path::new(path)).unwrap() {
        crate::resolve::LoadedConfig::Hf(w) => *w,
        _ => unreachable!(),
    };
    w.mode = Mode::Serve;
    w.serve = Some(Serve {
        engine: Engine::Vllm,
        gpu_memory_utilization: 0.9,
        max_model_len: 131_072,
        max_num_seqs: None,
        max_num_batched_tokens: None,
        block_size: 16,
        kv_cache_dtype: KvDtype::Auto,
        tp: 1,
        util_default: false,
    });
    w
}

#[test]
fn llama3_8b_at_40gib_adds_up() {
    let (z, plan) = size(&llama3_8b(), 40 * GIB).unwrap();
    assert_eq!(z.requested_bytes, 36 * GIB);
    assert_eq!(z.bytes_per_token, 128 * KIB);
    // 8.03 B params in bf16, vocab 128256 (already a multiple of 64).
    assert_eq!(
        z.weights_bytes,
        2 * crate::plan::build::param_count(&llama3_8b()).unwrap()
    );
    assert_eq!(
        z.kv_bytes,
        (z.requested_bytes - z.weights_bytes - z.profile_peak_bytes - z.non_torch_bytes) as i64
    );
    assert_eq!(z.blocks, z.kv_bytes as u64 / (64 * KIB) / 32);
    assert_eq!(z.tokens, z.blocks * 16);
    assert!(z.refusal.is_none());
    // The profile's head and sampler run over 256 rows, not 2048.
    let t = plan
        .tensors
        .iter()
        .find(|t| t.name == "sampler.sorted_idx")
        .unwrap();
    assert_eq!(t.shape, vec![256, 128_256]);
    assert!(plan.tensors.iter().all(|t| !t.name.contains("kv_cache")));
}

#[test]
fn tp_shards_weights_and_fp8_doubles_blocks() {
    let w = llama3_8b();
    let (one, _) = size(&w, 40 * GIB).unwrap();
    let (two, _) = size(&with(&w, |s| s.tp = 2), 40 * GIB).unwrap();
    assert_eq!(two.kv_heads_per_gpu, 4);
    assert!(two.weights_bytes < one.weights_bytes / 2 + GIB / 10);
    assert!(two.weights_bytes > one.weights_bytes / 2);
    let (fp8, _) = size(&with(&w, |s| s.kv_cache_dtype = KvDtype::Fp8), 40 * GIB).unwrap();
    assert_eq!(fp8.page_bytes_per_layer * 2, one.page_bytes_per_layer);
    assert!(fp8.blocks >= 2 * one.blocks && fp8.blocks <= 2 * one.blocks + 1);
}

#[test]
fn derived_length_follows_rope_scaling() {
    use serde_json::json;
    assert_eq!(derived_max(4096, None), 4096);
    let llama3 = json!({"rope_type": "llama3", "factor": 8.0});
    assert_eq!(derived_max(131_072, Some(&llama3)), 131_072);
    let linear = json!({"type": "linear", "factor": 4.0});
    assert_eq!(derived_max(4096, Some(&linear)), 16_384);
    let yarn =
        json!({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768});
    assert_eq!(derived_max(32_768, Some(&yarn)), 131_072);
}

fn derived_max(n: u64, r: Option<&serde_json::Value>) -> u64 {
    crate::workload::serve::derived_max_len(n, r)
}
