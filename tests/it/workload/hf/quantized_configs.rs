//! Checkpoints shipped quantized (a config.json's `quantization_config`: MXFP4, block-wise FP8,
//! GPTQ): `estimate --mode inference` and `--mode serve` hold their weights as stored, checked
//! against the published checkpoint sizes in `tests/fixtures/configs/sources/quantized.md`;
//! training one, and formats not read, exit 2 with one line.

use std::path::{Path, PathBuf};

use assert_cmd::Command;
use serde_json::Value;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/configs")
}

fn oomprobe() -> Command {
    Command::cargo_bin("oomprobe").unwrap()
}

fn read(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir().join(name)).unwrap()).unwrap()
}

/// `estimate --json` of the config at `path` with `extra` flags.
fn estimate(path: &Path, extra: &[&str]) -> Value {
    let mut args = vec!["estimate", "--config", path.to_str().unwrap(), "--json"];
    args.extend_from_slice(extra);
    let out = oomprobe()
        .args(&args)
        .assert()
        .success()
        .get_output()
        .clone();
    serde_json::from_slice(&out.stdout).unwrap()
}

/// The weight bytes `estimate --mode inference` holds for the config at `path`.
fn inference_weights(path: &Path) -> u64 {
    let v = estimate(
        path,
        &["--mode", "inference", "--seq", "128", "--batch", "1"],
    );
    v["breakdown"]["params"].as_u64().unwrap()
}

/// The same for a config given as JSON (written to a temporary file).
fn weights_of(config: &Value) -> u64 {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("config.json");
    std::fs::write(&p, config.to_string()).unwrap();
    inference_weights(&p)
}

fn assert_within(got: u64, want: u64, pct: f64, what: &str) {
    let off = (got as f64 - want as f64) / want as f64 * 100.0;
    assert!(off.abs() <= pct, "{what}: {got} vs {want} ({off:+.3} %)");
}

#[test]
fn gpt_oss_holds_its_published_mxfp4_checkpoint() {
    // Index total_size 13,761,264,768 (20b) and 65,248,815,744 tensor bytes (120b): exact.
    assert_eq!(
        inference_weights(&dir().join("gpt-oss-20b.json")),
        13_761_264_768
    );
    assert_eq!(
        inference_weights(&dir().join("holdout/gpt-oss-120b.json")),
        65_248_815_744
    );
}

#[test]
fn serving_sizes_the_stored_weights() {
    let p = dir().join("gpt-oss-20b.json");
    let v = estimate(&p, &["--mode", "serve", "--memory", "80GiB"]);
    assert_eq!(v["serving"]["weights_bytes"].as_u64(), Some(13_761_264_768));
}

/// DeepSeek-V3's MTP module beside a main MoE layer: `embed_tokens` and `shared_head.head`
/// (129280 × 7168), `eh_proj` (7168 × 14336), `enorm`, `hnorm`, `shared_head.norm`, all BF16.
fn mtp_extra(v: u64, h: u64) -> u64 {
    2 * (2 * v * h + 2 * h * h + 3 * h)
}

#[test]
fn deepseek_v3_holds_its_fp8_checkpoint_with_the_mtp_layer_added() {
    let mut c = read("deepseek-v3.json");
    let main = weights_of(&c);
    c["num_hidden_layers"] = 62.into();
    let with_mtp = weights_of(&c) + mtp_extra(129_280, 7168);
    // Sum of every shard's tensors (simpx/model-inspect): 688,574,839,360 bytes.
    assert_within(with_mtp, 688_574_839_360, 0.1, "DeepSeek-V3 + MTP");
    // R1 and V3.1 ship the same shapes in the same format.
    for name in ["holdout/deepseek-r1.json", "deepseek-v3.1.json"] {
        assert_eq!(weights_of(&read(name)), main, "{name}");
    }
    // Counted at bf16 the same model is nearly twice as large.
    c["num_hidden_layers"] = 61.into();
    c.as_object_mut().unwrap().remove("quantization_config");
    let bf16 = weights_of(&c);
    assert!(bf16 > main * 19 / 10, "{bf16} vs {main}");
}

#[test]
fn fp8_moe_configs_hold_about_one_byte_per_parameter() {
    // No published total found for these: one FP8 byte per expert and attention weight, the
    // embeddings and head BF16, so between 1 and 1.1 bytes per parameter.
    for (name, params) in [
        ("holdout/kimi-k2.json", 1_026_408_209_408u64),
        ("minimax-m2.7.json", 228_689_748_992),
    ] {
        let b = weights_of(&read(name)) as f64 / params as f64;
        assert!((1.0..1.1).contains(&b), "{name}: {b} bytes per parameter");
    }
}

/// A Qwen2 config of the given shape, float16, with Qwen's GPTQ-Int4 `quantization_config`.
fn qwen2_gptq(h: u64, f: u64, heads: u64, kv: u64, vocab: u64, tied: bool) -> Value {
    let mut c = read("qwen2.5-7b.json");
    for (k, x) in [
        ("hidden_size", h),
        ("intermediate_size", f),
        ("num_attention_heads", heads),
        ("num_key_value_heads", kv),
        ("vocab_size", vocab),
    ] {
        c[k] = x.into();
    }
    c["tie_word_embeddings"] = tied.into();
    c["torch_dtype"] = "float16".into();
    c["quantization_config"] = serde_json::json!({
        "bits": 4, "group_size": 128, "desc_act": false, "sym": true,
        "quant_method": "gptq", "exllama_config": {"version": 1}, "use_exllama": true
    });
    c
}

#[test]
fn qwen_gptq_checkpoints_match_their_files() {
    // Shard files (headers included): MoE 8,414,508,312, Coder-7B 5,575,381,144, Coder-1.5B
    // 1,149,862,960.
    let moe = inference_weights(&dir().join("quantized/qwen1.5-moe-a2.7b-chat-gptq-int4.json"));
    assert_within(moe, 8_414_508_312, 0.3, "Qwen1.5-MoE-A2.7B GPTQ");
    assert!(moe < 8_414_508_312);
    let seven = weights_of(&qwen2_gptq(3584, 18944, 28, 4, 152_064, false));
    assert_within(seven, 5_575_381_144, 0.01, "Qwen2.5-Coder-7B GPTQ");
    let small = weights_of(&qwen2_gptq(1536, 8960, 12, 2, 151_936, true));
    assert_within(small, 1_149_862_960, 0.01, "Qwen2.5-Coder-1.5B GPTQ");
}

#[test]
fn awq_stores_four_bits_and_group_scales() {
    let mut c = qwen2_gptq(3584, 18944, 28, 4, 152_064, false);
    let gptq = weights_of(&c);
    c["quantization_config"] = serde_json::json!({
        "bits": 4, "group_size": 128, "quant_method": "awq", "version": "gemm",
        "zero_point": true, "modules_to_not_convert": null
    });
    let awq = weights_of(&c);
    // AWQ has no g_idx: 4 bytes per input of each of the 7 linears of 28 layers.
    let g_idx = 28 * 4 * (6 * 3584 + 18944);
    assert_eq!(gptq - awq, g_idx);
}

fn stderr_of_failure(args: &[&str]) -> String {
    let out = oomprobe().args(args).assert().code(2).get_output().clone();
    let e = String::from_utf8(out.stderr).unwrap();
    assert_eq!(e.trim_end().lines().count(), 1, "one line: {e}");
    e
}

#[test]
fn training_a_stored_checkpoint_or_an_unread_format_exits_2() {
    let p = dir().join("deepseek-v3.json");
    let e = stderr_of_failure(&["estimate", "--config", p.to_str().unwrap()]);
    assert!(e.contains("fp8") && e.contains("--mode inference"), "{e}");
    let d = tempfile::tempdir().unwrap();
    for (method, word) in [
        ("compressed-tensors", "compressed-tensors"),
        ("hqq", "not read"),
    ] {
        let mut c = read("qwen2.5-7b.json");
        c["quantization_config"] = serde_json::json!({ "quant_method": method });
        let f = d.path().join("c.json");
        std::fs::write(&f, c.to_string()).unwrap();
        let e = stderr_of_failure(&[
            "estimate",
            "--config",
            f.to_str().unwrap(),
            "--mode",
            "inference",
        ]);
        assert!(e.contains("quant_method") && e.contains(word), "{e}");
    }
}
