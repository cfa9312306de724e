//! Fuzzing the config readers with generated inputs: every Hugging Face config.json and every
//! TOML case file, however odd, is read into a workload or refused with a clean error, within a
//! bounded time; a workload that is read builds its plan and its estimate (or a clean error) in
//! bounded time too. A handful of generated configs also go through `oomprobe estimate`, which
//! must exit 0 or 2.

use std::path::Path;
use std::time::{Duration, Instant};

use oomprobe::plan::Plan;
use oomprobe::resolve::load_case;
use oomprobe::workload::hf::load_hf;
use proptest::prelude::*;
use serde_json::{json, Value};

use crate::support::load::timed;

/// Field names a config.json may carry (and a few it should not).
const HF_KEYS: [&str; 24] = [
    "model_type",
    "n_embd",
    "n_layer",
    "n_head",
    "n_positions",
    "n_ctx",
    "n_inner",
    "vocab_size",
    "resid_pdrop",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "max_position_embeddings",
    "hidden_dropout_prob",
    "attention_dropout",
    "rms_norm_eps",
    "tie_word_embeddings",
    "image_size",
    "patch_size",
    "num_channels",
    "id2label",
    "_name_or_path",
];

/// Numbers at the edges: small, typical, at and past each cap, at and past 64 bits.
fn edge_number() -> impl Strategy<Value = Value> {
    prop_oneof![
        (1u64..=64).prop_map(Value::from),
        prop::sample::select(vec![
            0u64,
            12,
            768,
            1024,
            4096,
            50257,
            2048,
            2049,
            1 << 16,
            (1 << 16) + 1,
            1 << 20,
            (1 << 20) + 1,
            1 << 24,
            (1 << 24) + 1,
            1 << 31,
            1 << 32,
            u64::MAX,
        ])
        .prop_map(Value::from),
        any::<u64>().prop_map(Value::from),
        any::<i64>().prop_map(Value::from),
        prop::sample::select(vec![-1.0f64, 0.5, 768.0, 1e30, -0.0, 0.1]).prop_map(Value::from),
    ]
}

fn any_value() -> impl Strategy<Value = Value> {
    prop_oneof![
        6 => edge_number(),
        1 => Just(Value::Null),
        1 => any::<bool>().prop_map(Value::from),
        1 => "[a-z0-9_ ]{0,12}".prop_map(Value::from),
        1 => prop::sample::select(vec!["gpt2", "bert", "llama", "vit", "t5", ""]).prop_map(Value::from),
        1 => Just(json!({"0": "a", "1": "b"})),
        1 => Just(json!([1, 2, 3])),
    ]
}

/// A config.json: a plausible base with some fields replaced, removed or added.
fn hf_config() -> impl Strategy<Value = String> {
    let base = prop::sample::select(vec![
        json!({"model_type":"gpt2","n_embd":768,"n_layer":12,"n_head":12,"n_positions":1024,"vocab_size":50257}),
        json!({"model_type":"bert","hidden_size":768,"num_hidden_layers":12,"num_attention_heads":12,"intermediate_size":3072,"vocab_size":30522,"max_position_embeddings":512}),
        json!({"model_type":"llama","hidden_size":4096,"num_hidden_layers":32,"num_attention_heads":32,"intermediate_size":11008,"vocab_size":32000}),
        json!({"model_type":"vit","hidden_size":768,"num_hidden_layers":12,"num_attention_heads":12,"intermediate_size":3072,"image_size":224,"patch_size":16}),
        json!({}),
    ]);
    let edits = prop::collection::vec(
        (
            prop::sample::select(HF_KEYS.to_vec()),
            prop::option::of(any_value()),
        ),
        0..6,
    );
    (base, edits, any::<bool>()).prop_map(|(mut v, edits, bom)| {
        if let Value::Object(m) = &mut v {
            for (k, val) in edits {
                match val {
                    Some(x) => {
                        m.insert(k.to_string(), x);
                    }
                    None => {
                        m.remove(k);
                    }
                }
            }
        }
        let text = v.to_string();
        if bom {
            format!("\u{feff}{text}")
        } else {
            text
        }
    })
}

fn toml_value() -> impl Strategy<Value = String> {
    prop_oneof![
        any::<i64>().prop_map(|i| i.to_string()),
        prop::sample::select(vec![
            "1",
            "0",
            "-1",
            "4",
            "2048",
            "2049",
            "5000000",
            "9223372036854775807"
        ])
        .prop_map(str::to_string),
        prop::sample::select(vec!["1.5", "1e30", "8.0", "nan", "inf"]).prop_map(str::to_string),
        "[a-z0-9:]{0,10}".prop_map(|s| format!("\"{s}\"")),
        prop::sample::select(vec![
            "\"7B\"",
            "\"every:0\"",
            "\"every:4\"",
            "\"-1GiB\"",
            "\"80GB\""
        ])
        .prop_map(str::to_string),
        any::<bool>().prop_map(|b| b.to_string()),
        Just("[1, 2]".to_string()),
        Just("{ a = 1 }".to_string()),
    ]
}

const CASE_KEYS: [&str; 16] = [
    "model",
    "batch",
    "seq",
    "layers",
    "hidden",
    "heads",
    "ffn",
    "vocab",
    "image",
    "params",
    "precision",
    "optimizer",
    "attention",
    "checkpoint",
    "zero",
    "gpus",
];

/// A case file: a valid skeleton with generated workload and expectation keys.
fn case_file() -> impl Strategy<Value = String> {
    let kv = || {
        prop::collection::vec(
            (prop::sample::select(CASE_KEYS.to_vec()), toml_value()),
            0..5,
        )
    };
    (
        prop::sample::select(vec![
            "gpt2", "tiny-gpt", "resnet50", "vit-b16", "llama-7b", "x",
        ]),
        kv(),
        kv(),
        toml_value(),
    )
        .prop_map(|(model, w, e, memory)| {
            let mut s =
                format!("name = \"fuzz\"\nmemory = {memory}\n[workload]\nmodel = \"{model}\"\n");
            let mut seen = std::collections::HashSet::new();
            for (k, v) in w {
                if k != "model" && seen.insert(k) {
                    s.push_str(&format!("{k} = {v}\n"));
                }
            }
            s.push_str("[[expect]]\nverdict = \"oom\"\n");
            let mut seen = std::collections::HashSet::new();
            for (k, v) in e {
                if seen.insert(k) {
                    s.push_str(&format!("{k} = {v}\n"));
                }
            }
            s
        })
}

/// Reading, planning and estimating `w` stay within a bounded time.
fn plan_is_bounded(w: &oomprobe::workload::Workload) {
    let started = Instant::now();
    if let Ok(plan) = Plan::for_workload(w) {
        let _ = plan.peak_bytes();
    }
    let _ = oomprobe::estimate::predicted_max(w, oomprobe::scenario::Scenario::Batch, 80 << 30);
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "plan of {w:?} took {:?}",
        started.elapsed()
    );
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1000))]

    #[test]
    fn any_config_json_reads_or_is_refused_cleanly(text in hf_config()) {
        let _load = timed();
        let started = Instant::now();
        let text = text.strip_prefix('\u{feff}').unwrap_or(&text).to_string();
        match load_hf("fuzz.json", &text) {
            Ok(w) => plan_is_bounded(&w),
            Err(e) => {
                let msg = e.to_string();
                prop_assert!(msg.contains("fuzz.json"), "{}", msg);
                prop_assert_eq!(msg.lines().count(), 1, "{}", msg);
            }
        }
        prop_assert!(started.elapsed() < Duration::from_secs(5));
    }

    #[test]
    fn any_case_file_reads_or_is_refused_cleanly(text in case_file()) {
        let _load = timed();
        let started = Instant::now();
        match load_case(Path::new("fuzz.toml"), &text) {
            Ok(c) => plan_is_bounded(&c.workload),
            Err(e) => {
                let msg = e.to_string();
                prop_assert!(msg.contains("fuzz.toml"), "{}", msg);
                prop_assert_eq!(msg.lines().count(), 1, "{}", msg);
            }
        }
        prop_assert!(started.elapsed() < Duration::from_secs(5));
    }
}

#[test]
fn generated_configs_exit_0_or_2_through_the_cli() {
    use proptest::strategy::ValueTree;
    use proptest::test_runner::TestRunner;
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("config.json");
    let mut runner = TestRunner::deterministic();
    for _ in 0..20 {
        let text = hf_config().new_tree(&mut runner).unwrap().current();
        std::fs::write(&p, &text).unwrap();
        let _load = timed();
        let started = Instant::now();
        let out = assert_cmd::Command::cargo_bin("oomprobe")
            .unwrap()
            .args(["estimate", "--memory", "80GB", "--config"])
            .arg(&p)
            .output()
            .unwrap();
        let code = out.status.code();
        assert!(
            code == Some(0) || code == Some(2),
            "{text}: exit {code:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        if code == Some(2) {
            assert_eq!(
                String::from_utf8_lossy(&out.stderr)
                    .trim_end()
                    .lines()
                    .count(),
                1
            );
        }
        assert!(started.elapsed() < Duration::from_secs(10), "{text}");
    }
}
