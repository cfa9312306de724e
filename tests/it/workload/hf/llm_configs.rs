//! Today's LLM families from their published config.json files (`tests/fixtures/configs`,
//! sources in its SOURCES.md): parameter counts exactly as transformers builds the models
//! (`validation/param_counts.py` counted them on the meta device into `param_counts.json`), the
//! presets' counts beside the same configs, grouped-query attention's closed forms, and bad
//! or partial configs exiting 2 with one line naming the field.

use std::path::PathBuf;

use assert_cmd::Command;
use oomprobe::plan::build::param_count;
use oomprobe::plan::{Plan, Role};
use oomprobe::workload::hf::load_hf;
use oomprobe::workload::{presets, Arch, Attention, Precision, Workload};
use serde_json::Value;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/configs")
}

fn counts() -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir().join("param_counts.json")).unwrap())
        .unwrap()
}

fn config(name: &str) -> Workload {
    let path = dir().join(format!("{name}.json"));
    load_hf(
        &path.display().to_string(),
        &std::fs::read_to_string(&path).unwrap(),
    )
    .unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn oomprobe() -> Command {
    Command::cargo_bin("oomprobe").unwrap()
}

#[test]
fn every_config_has_transformers_parameter_count() {
    let c = counts();
    let models = c["models"].as_object().unwrap();
    assert!(models.len() >= 12, "{} models", models.len());
    for (name, m) in models {
        let w = config(name);
        let want = m["params"].as_u64().unwrap();
        assert_eq!(param_count(&w).unwrap(), want, "{name}");
    }
}

#[test]
fn presets_match_their_published_configs() {
    let c = counts();
    for (preset, cfg) in [
        ("llama3-8b", "llama3-8b"),
        ("mistral-7b", "mistral-7b"),
        ("qwen2.5-7b", "qwen2.5-7b"),
        ("qwen2.5-0.5b", "qwen2.5-0.5b"),
        ("mixtral-8x7b", "mixtral-8x7b"),
        ("gemma2-9b", "gemma2-9b"),
        ("phi3-mini", "phi3-mini"),
    ] {
        let w = presets::get(preset).unwrap();
        let want = c["models"][cfg]["params"].as_u64().unwrap();
        assert_eq!(param_count(&w).unwrap(), want, "{preset}");
        // Their published counts, to three digits (model cards: 8.03B, 7.25B, 7.61B, 0.49B,
        // 46.7B, 9.24B, 3.8B).
        let published = c["models"][cfg]["published"].as_str().unwrap_or("");
        assert!(!published.is_empty(), "{cfg}: no published count");
    }
    let llama3 = presets::get("llama3-8b").unwrap();
    assert_eq!(llama3.kv_heads(), 8);
    assert_eq!(llama3.precision, Precision::Bf16);
    assert_eq!(
        presets::get("gemma2-9b").unwrap().attention,
        Attention::Naive
    );
}

#[test]
fn configs_read_what_transformers_reads() {
    let l = config("llama3-8b");
    assert_eq!((l.arch, l.kv_heads(), l.head_dim()), (Arch::Llama, 8, 128));
    assert_eq!(
        l.seq, 4096,
        "the context (131072) capped at 4096 by default"
    );
    assert_eq!(l.precision, Precision::Bf16);
    assert!(l.kv_cache, "use_cache defaults to true");
    let g = config("gemma2-9b");
    assert_eq!((g.arch, g.head_dim()), (Arch::Gemma2, 256));
    assert!(g.logit_softcap && g.attn_softcap && g.tied_head());
    assert_eq!(
        g.attention,
        Attention::Naive,
        "no SDPA path in transformers' Gemma 2"
    );
    let m = config("mixtral-8x7b").moe.unwrap();
    assert_eq!((m.experts, m.top_k, m.expert_ffn), (8, 2, 14336));
    let q = config("qwen1.5-moe-a2.7b").moe.unwrap();
    assert_eq!(
        (q.experts, q.top_k, q.expert_ffn, q.shared_ffn),
        (60, 4, 1408, 5632)
    );
    assert!(config("qwen2.5-0.5b").tied_head());
    assert_eq!(config("gemma3-1b").arch, Arch::Gemma3);
    assert_eq!(config("qwen3-30b-a3b").arch, Arch::Qwen3Moe);
}

/// Bytes of the tensors named `L0.<suffix>` in a plan.
fn layer0(p: &Plan, suffix: &str) -> u64 {
    p.tensors
        .iter()
        .filter(|t| t.name == format!("L0.{suffix}"))
        .map(|t| t.bytes)
        .sum()
}

#[test]
fn grouped_query_attention_closed_forms() {
    // LLaMA-3-8B's shape in fp32, 2 layers, b 2, s 512: the k and v projections and the
    // parameters shrink by heads / kv-heads; eager attention repeats K and V to the query heads
    // (`repeat_kv`), SDPA keeps them at the key/value heads.
    let mut w = presets::get("llama3-8b").unwrap();
    w.layers = 2;
    w.batch = 2;
    w.seq = 512;
    w.precision = Precision::Fp32;
    w.kv_cache = false;
    let (b, s, h, d) = (2u64, 512u64, 4096u64, 128u64);
    let per_layer = |kv: u64| 2 * h * h + 2 * h * kv * d + 3 * h * 14336 + 2 * h;
    let mut mha = w.clone();
    mha.kv_heads = None;
    let l = presets::get("llama3-8b").unwrap().layers;
    assert_eq!(
        param_count(&presets::get("llama3-8b").unwrap()).unwrap(),
        l * per_layer(8) + 2 * 128256 * h + h
    );
    for (attention, precision, e) in [
        (Attention::Naive, Precision::Fp32, 4u64),
        (Attention::Sdpa, Precision::Bf16, 2),
    ] {
        let mut g = w.clone();
        g.attention = attention;
        g.precision = precision;
        let p = Plan::for_workload(&g).unwrap();
        assert_eq!(layer0(&p, "k_proj"), e * b * s * 8 * d);
        assert_eq!(layer0(&p, "q_proj"), e * b * s * h);
        let repeated = layer0(&p, "k_rep") + layer0(&p, "v_rep");
        if attention == Attention::Naive {
            assert_eq!(repeated, 2 * e * b * s * h, "eager repeats K and V");
            assert_eq!(layer0(&p, "attn.probs"), 4 * b * 32 * s * s);
        } else {
            assert_eq!(repeated, 0, "SDPA reads grouped K and V");
            assert_eq!(
                layer0(&p, "attn.probs"),
                0,
                "CUDA's flash kernel saves no scores"
            );
        }
        // Multi-query: one key/value head.
        let mut mq = g.clone();
        mq.kv_heads = Some(1);
        let pm = Plan::for_workload(&mq).unwrap();
        assert_eq!(layer0(&pm, "k_proj"), e * b * s * d);
    }
    // fp32 grouped heads on CUDA: the memory-efficient kernel takes no grouped heads, so SDPA
    // falls back to math and materializes the scores (bf16 takes the flash kernel).
    let mut g32 = w.clone();
    g32.attention = Attention::Sdpa;
    g32.precision = Precision::Fp32;
    assert!(
        Plan::for_workload(&g32)
            .unwrap()
            .tensors
            .iter()
            .any(|t| t.role == Role::Attention && t.name.ends_with("attn.probs")),
        "fp32 GQA under SDPA on CUDA runs the math kernel"
    );
    let mut g16 = w.clone();
    g16.attention = Attention::Sdpa;
    g16.precision = Precision::Bf16;
    assert!(!Plan::for_workload(&g16)
        .unwrap()
        .tensors
        .iter()
        .any(|t| t.name.ends_with("attn.probs")));
}

fn write_config(name: &str, body: &str) -> (tempfile::TempDir, PathBuf) {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join(name);
    std::fs::write(&p, body).unwrap();
    (d, p)
}

fn stderr_of_failure(args: &[&str]) -> String {
    let out = oomprobe().args(args).assert().code(2).get_output().clone();
    let e = String::from_utf8(out.stderr).unwrap();
    assert_eq!(e.trim_end().lines().count(), 1, "one line: {e}");
    e
}

#[test]
fn bad_configs_exit_2_naming_the_field() {
    let base = std::fs::read_to_string(dir().join("llama3-8b.json")).unwrap();
    let v: Value = serde_json::from_str(&base).unwrap();
    let with = |k: &str, x: Value| {
        let mut v = v.clone();
        v[k] = x;
        v.to_string()
    };
    for (body, field) in [
        (
            with("num_key_value_heads", Value::from(5)),
            "num_key_value_heads",
        ),
        (
            with("num_key_value_heads", Value::from(0)),
            "num_key_value_heads",
        ),
        (with("model_type", Value::from("llama9")), "model_type"),
        (with("hidden_size", Value::from("4096")), "hidden_size"),
        (with("torch_dtype", Value::from("int3")), "torch_dtype"),
    ] {
        let (_d, p) = write_config("config.json", &body);
        let e = stderr_of_failure(&["estimate", "--config", p.to_str().unwrap()]);
        assert!(e.contains(field), "{field}: {e}");
    }
    // An unknown type names the families it knows and suggests none of them (a look-alike
    // would plan another model without a word); a known but unmodelled one names what it needs.
    let (_d, p) = write_config("config.json", &with("model_type", Value::from("llama9")));
    let e = stderr_of_failure(&["estimate", "--config", p.to_str().unwrap()]);
    assert!(
        e.contains("'llama9'") && e.contains("qwen3_moe") && !e.contains("nearest"),
        "{e}"
    );
    let (_d, p) = write_config("config.json", &with("model_type", Value::from("jamba")));
    let e = stderr_of_failure(&["estimate", "--config", p.to_str().unwrap()]);
    assert!(e.contains("Mamba-1"), "{e}");
    // Zero experts.
    let mix = std::fs::read_to_string(dir().join("mixtral-8x7b.json")).unwrap();
    let mut m: Value = serde_json::from_str(&mix).unwrap();
    m["num_local_experts"] = Value::from(0);
    let (_d, p) = write_config("config.json", &m.to_string());
    let e = stderr_of_failure(&["estimate", "--config", p.to_str().unwrap()]);
    assert!(e.contains("num_local_experts"), "{e}");
    // A missing num_key_value_heads means one per head, as transformers does.
    let mut v2 = v.clone();
    v2.as_object_mut().unwrap().remove("num_key_value_heads");
    let w = load_hf("c.json", &v2.to_string()).unwrap();
    assert_eq!(w.kv_heads(), w.heads);
    // --kv-heads on the command line: must divide the heads, and only for the decoders.
    let e = stderr_of_failure(&["estimate", "--model", "llama3-8b", "--kv-heads", "5"]);
    assert!(e.contains("kv-heads"), "{e}");
    let e = stderr_of_failure(&["estimate", "--model", "gpt2", "--kv-heads", "4"]);
    assert!(
        e.starts_with("oomprobe: --kv-heads") || e.contains("--kv-heads"),
        "{e}"
    );
}

#[test]
fn every_family_estimates_and_diagnoses_with_exit_0() {
    for name in [
        "llama3-8b",
        "mistral-7b",
        "qwen2.5-7b",
        "qwen2.5-0.5b",
        "mixtral-8x7b",
        "gemma2-9b",
        "phi3-mini",
        "qwen3-8b",
        "qwen3-30b-a3b",
        "qwen1.5-moe-a2.7b",
        "gemma-2b",
        "gemma3-1b",
    ] {
        let p = dir().join(format!("{name}.json"));
        let p = p.to_str().unwrap();
        let out = oomprobe()
            .args([
                "estimate", "--config", p, "--seq", "2048", "--memory", "80GiB",
            ])
            .assert()
            .success()
            .get_output()
            .stdout
            .clone();
        let text = String::from_utf8(out).unwrap();
        // The fit headline, then the workload's line.
        assert!(
            crate::support::output::is_headline(text.lines().next().unwrap()),
            "{name}: {text}"
        );
        assert!(
            crate::support::output::workload_line(&text).contains("attention"),
            "{name}: {text}"
        );
        oomprobe()
            .args(["diagnose", "--config", p, "--memory", "24GiB", "--json"])
            .assert()
            .success();
    }
}

use crate::support::adapter;

#[test]
fn scaled_down_families_probe_on_the_device_with_exit_0() {
    adapter::require_adapter();
    // Each family's own layers at a small width, every byte written and the real kernels run
    // (grouped-query flash attention under SDPA, Gemma 2's eager soft-capped scores, the
    // experts' grouped matmuls), under a 96 MiB budget: an exact boundary beside the prediction.
    for (name, extra) in [
        ("llama3-8b", &[][..]),
        ("gemma2-9b", &[][..]),
        ("mixtral-8x7b", &["--experts", "4"][..]),
    ] {
        let p = dir().join(format!("{name}.json"));
        let mut args = vec![
            "probe",
            "--config",
            p.to_str().unwrap(),
            "--layers",
            "2",
            "--hidden",
            "256",
            "--heads",
            "8",
            "--ffn",
            "256",
            "--vocab",
            "2000",
            "--seq",
            "64",
            "--scenario",
            "batch",
            "--budget",
            "96MiB",
            "--compute",
            "full",
            "--json",
        ];
        args.extend_from_slice(extra);
        let out = adapter::oomprobe()
            .args(&args)
            .assert()
            .success()
            .get_output()
            .stdout
            .clone();
        let v: Value = serde_json::from_slice(&out).unwrap();
        let run = &v["runs"][0];
        let (fit, fail) = (run["max_fit"].as_u64(), run["first_fail"].as_u64());
        assert!(fit.is_some_and(|f| f >= 1), "{name}: {run}");
        assert_eq!(fail, fit.map(|f| f + 1), "{name}: an exact boundary");
        assert_eq!(
            run["predicted_max"].as_u64(),
            fit,
            "{name}: under --budget the plan is exact"
        );
    }
}

/// The configs of `dir` with transformers' counts for each (`validation/layer_counts.py`), as
/// (name, path, expected record).
fn counted(dir: &std::path::Path, section: &str) -> Vec<(String, PathBuf, Value)> {
    let doc: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("layer_counts.json")).unwrap())
            .unwrap();
    let mut out = Vec::new();
    for (name, rec) in doc[section].as_object().unwrap() {
        let path = if section == "defaults" {
            dir.join("defaults").join(format!("{name}.json"))
        } else {
            dir.join(format!("{name}.json"))
        };
        out.push((name.clone(), path, rec.clone()));
    }
    out
}

/// Every counted config is read, and its layers weigh what transformers builds to the
/// element: total, active (the routed experts a token does not reach left out), the vision
/// tower, and each layer's mixer + MLP + norms. Configs transformers itself rejects, and the
/// families not modelled yet, are refused with one line that names the cause.
fn check_counts(rows: Vec<(String, PathBuf, Value)>) -> Vec<String> {
    let mut bad = Vec::new();
    for (name, path, rec) in rows {
        let text = std::fs::read_to_string(&path).unwrap();
        let got = load_hf(&path.display().to_string(), &text);
        if rec.get("error").is_some() {
            // transformers' own default MinistralConfig cannot build (its rope parameters are
            // None); the file is still a valid shape.
            if got.is_ok() && name != "ministral" {
                bad.push(format!(
                    "{name}: transformers refuses it, oomprobe reads it"
                ));
            }
            continue;
        }
        let w = match got {
            Ok(w) => w,
            Err(e) => {
                let refused_family = ["jamba", "falcon_h1", "gemma4", "gemma4_text"]
                    .iter()
                    .any(|t| rec["model_type"] == *t);
                if !refused_family {
                    bad.push(format!("{name}: refused: {e}"));
                }
                continue;
            }
        };
        let m = w.model.as_ref().expect("a decoder config has layers");
        let c = m.counts();
        let want = |k: &str| rec[k].as_u64().unwrap_or(0);
        if c.total != want("params") || c.active != want("active_params") {
            bad.push(format!(
                "{name}: total {} (transformers {}), active {} ({}), vision {} ({})",
                c.total,
                want("params"),
                c.active,
                want("active_params"),
                c.vision,
                want("vision_params")
            ));
        }
        if c.vision != want("vision_params") {
            bad.push(format!(
                "{name}: vision {} ({})",
                c.vision,
                want("vision_params")
            ));
        }
        let layers = rec["layers"].as_array().unwrap();
        if layers.len() != m.layers.len() {
            bad.push(format!(
                "{name}: {} layers ({})",
                m.layers.len(),
                layers.len()
            ));
            continue;
        }
        for (i, (l, r)) in m.layers.iter().zip(layers).enumerate() {
            let p = l.params(m.hidden, m.norm);
            let total = r["params"].as_u64().unwrap();
            if p.mixer + p.mlp != total {
                bad.push(format!(
                    "{name}: layer {i}: {} + {} = {} (transformers {total}: mixer {} mlp {} norms {})",
                    p.mixer,
                    p.mlp,
                    p.mixer + p.mlp,
                    r["mixer"],
                    r["mlp"],
                    r["norms"]
                ));
                break;
            }
        }
    }
    bad
}

#[test]
fn layer_counts_match_transformers_for_real_configs() {
    let bad = check_counts(counted(&dir(), "configs"));
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

#[test]
fn layer_counts_match_transformers_for_config_class_defaults() {
    let bad = check_counts(counted(&dir(), "defaults"));
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// The configs set aside while the family table was written (`tests/fixtures/configs/holdout/`:
/// DeepSeek-R1, Kimi K2, gpt-oss-120b, Llama 4 Maverick, Nemotron-Nano-9B-v2, OLMo 2 13B,
/// Phi-4-mini, Qwen3-32B, Llama 3.2 3B), counted by transformers the same way.
#[test]
fn layer_counts_match_transformers_for_held_out_configs() {
    let rows = counted(&dir().join("holdout"), "configs");
    assert!(rows.len() >= 9, "{} held-out configs", rows.len());
    let bad = check_counts(rows);
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}

/// A workload read from any config crosses the process boundary intact: the probe child gets
/// it as JSON (`probe-child`), so every family's layers round-trip (a flattened layer once
/// wrote MLA's `bias` beside a dense MLP's, and the child refused DeepSeek's request).
#[test]
fn every_config_round_trips_through_json() {
    let mut rows = counted(&dir(), "configs");
    rows.extend(counted(&dir(), "defaults"));
    rows.extend(counted(&dir().join("holdout"), "configs"));
    let mut read = 0;
    for (name, path, _) in rows {
        let text = std::fs::read_to_string(&path).unwrap();
        let Ok(w) = load_hf(&path.display().to_string(), &text) else {
            continue;
        };
        let json = serde_json::to_string(&w).unwrap();
        let back: Workload =
            serde_json::from_str(&json).unwrap_or_else(|e| panic!("{name}: {e}\n{json}"));
        assert_eq!(back, w, "{name}");
        read += 1;
    }
    assert!(read >= 40, "{read} configs read");
}

/// Phi and GPT-NeoX (LitGPT's phi-1.5 and StableLM-Alpha 3B, written as transformers configs):
/// the readers' parameter counts equal transformers 5.24's on the meta device, counted
/// 2026-12-06 (phi-1.5: 1,418,270,720, the checkpoint's published 1.42B; StableLM-Alpha 3B:
/// 3,637,321,728), and serving keeps every layer's K and V: bytes per token are
/// layers · 2 · hidden · 2 in bf16.
#[test]
fn phi_and_gpt_neox_count_and_cache_as_transformers_builds_them() {
    for (name, params, layers, hidden) in [
        ("phi-1_5-litgpt", 1_418_270_720u64, 24u64, 2048u64),
        ("stablelm-base-alpha-3b-litgpt", 3_637_321_728, 16, 4096),
    ] {
        let w = config(name);
        let m = w.model.as_ref().unwrap();
        assert_eq!(m.counts().total, params, "{name}");
        let per_request: u64 = m.layers.iter().map(|l| l.cache_bytes(1000, 2, 2)).sum();
        assert_eq!(per_request, 1000 * layers * 2 * hidden * 2, "{name}");
    }
}
