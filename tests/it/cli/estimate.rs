//! `oomprobe estimate` from the outside: the done-when numbers, JSON contract, and bad input
//! exiting 2 with one line.

use assert_cmd::Command;
use serde_json::Value;

use crate::support::output::workload_line;

fn oomprobe() -> Command {
    Command::cargo_bin("oomprobe").unwrap()
}

fn json(args: &[&str]) -> Value {
    let out = oomprobe()
        .args(args)
        .arg("--json")
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    serde_json::from_slice(&out).unwrap()
}

fn u(v: &Value, path: &str) -> u64 {
    v.pointer(path)
        .and_then(Value::as_u64)
        .unwrap_or_else(|| panic!("{path} missing in {v}"))
}

#[test]
fn llama_13b_mixed_adam_is_208_gb_of_model_states() {
    // Seed §3.1 with eager attention (the LLaMA-1 era's; SDPA moves the peak).
    let v = json(&[
        "estimate",
        "--model",
        "llama-13b",
        "--precision",
        "mixed",
        "--optimizer",
        "adam",
        "--attention",
        "eager",
    ]);
    // Every model state, once backward has made all gradients.
    let states = u(&v, "/timeline/model_states_bytes");
    assert_eq!(states, 16 * u(&v, "/param_count"));
    // The peak sits early in backward: params, master weights and Adam state (14 B/param) are
    // there, but only the first layers' gradients (PyTorch frees them after every step).
    assert_eq!(
        u(&v, "/breakdown/params") + u(&v, "/breakdown/optimizer"),
        14 * u(&v, "/param_count")
    );
    assert!(u(&v, "/breakdown/gradients") < u(&v, "/param_count") / 10);
    assert_eq!(v["timeline"]["peak_phase"], "backward");
    assert!((states as f64 / 1e9 - 208.0).abs() < 1.0, "{states}");
    assert_eq!(u(&v, "/schema_version"), 1);
    assert!(v.get("boundaries").is_none());
    let out = oomprobe()
        .args([
            "estimate",
            "--model",
            "llama-13b",
            "--precision",
            "mixed",
            "--optimizer",
            "adam",
        ])
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    let text = String::from_utf8(out).unwrap();
    assert!(
        text.lines()
            .any(|l| l.contains("all model states") && l.contains("208.25 GB")),
        "{text}"
    );
}

#[test]
fn gpt2_fp16_activations_follow_korthikanti() {
    let v = json(&[
        "estimate",
        "--model",
        "gpt2",
        "--attention",
        "eager",
        "--batch",
        "8",
        "--seq",
        "1024",
        "--precision",
        "fp16",
        "--gelu",
        "fused",
    ]);
    let (s, b, h, a, l, vocab) = (1024u64, 8u64, 768u64, 12u64, 12u64, 50257u64);
    // 12 × s·b·h·(34 + 5·a·s/h) = 12 × (34·sbh + 5·a·s²·b)
    let layers = l * (34 * s * b * h + 5 * a * s * s * b);
    // Documented terms: embedding dropout mask sbh; final LN input + output 2·2·sbh;
    // logits 2·sbV (fp16) + fp32 log-probs 4·sbV.
    let extras = s * b * h * 5 + s * b * vocab * 6;
    assert_eq!(
        u(&v, "/breakdown/activations") + u(&v, "/breakdown/attention"),
        layers + extras
    );
    assert_eq!(layers, 8_606_711_808);
    let total: u64 = [
        "params",
        "gradients",
        "optimizer",
        "activations",
        "attention",
        "workspace",
    ]
    .iter()
    .map(|k| u(&v, &format!("/breakdown/{k}")))
    .sum();
    assert_eq!(total, u(&v, "/breakdown/total"));
}

#[test]
fn memory_adds_boundaries() {
    let v = json(&["estimate", "--model", "gpt2", "--memory", "40GiB"]);
    let bs = v["boundaries"].as_array().unwrap();
    let names: Vec<&str> = bs.iter().map(|b| b["scenario"].as_str().unwrap()).collect();
    assert_eq!(names, ["params", "batch", "seq", "activations"]);
    for b in bs {
        assert!(
            b["dimension"].is_string() && b["max"].as_u64().unwrap() > 0,
            "{b}"
        );
    }
    // fp32 Adam, foreach (PyTorch's CUDA default): 40 GiB / (16 B of states + a 4 B/param
    // temporary in the update).
    assert_eq!(bs[0]["max"].as_u64(), Some((40u64 << 30) / 20));
    let v = json(&["estimate", "--model", "resnet50", "--memory", "512MiB"]);
    let names: Vec<&str> = v["boundaries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| b["scenario"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["params", "batch"]);
}

fn fails_with_one_line(args: &[&str], needle: &str) {
    let out = oomprobe().args(args).assert().code(2).get_output().clone();
    let err = String::from_utf8(out.stderr).unwrap();
    assert_eq!(err.trim_end().lines().count(), 1, "{args:?}: {err}");
    assert!(
        err.contains(needle),
        "{args:?}: expected '{needle}' in {err}"
    );
    assert!(out.stdout.is_empty());
}

#[test]
fn bad_input_exits_2_with_one_line() {
    fails_with_one_line(
        &["estimate", "--model", "gpt5"],
        "unknown model preset 'gpt5'",
    );
    fails_with_one_line(&["estimate", "--batch", "0"], "--batch");
    fails_with_one_line(&["estimate", "--hidden", "0"], "--hidden");
    fails_with_one_line(
        &["estimate", "--seq", "99999999999999999999999"],
        "too large",
    );
    fails_with_one_line(&["estimate", "--seq", "5000000000"], "at most 16777216");
    fails_with_one_line(
        &["estimate", "--batch", "18446744073709551615"],
        "--batch: 18446744073709551615 is absurd",
    );
    // Each size within its limit, their product past 64 bits.
    fails_with_one_line(
        &[
            "estimate",
            "--seq",
            "16777216",
            "--batch",
            "65536",
            "--attention",
            "eager",
        ],
        "overflows 64 bits",
    );
    fails_with_one_line(&["estimate", "--memory", "0GB"], "--memory");
    fails_with_one_line(&["estimate", "--memory", "lots"], "--memory");
    fails_with_one_line(&["estimate", "--heads", "5"], "must divide hidden");
    fails_with_one_line(&["estimate", "--checkpoint", "every:0"], "--checkpoint");
    fails_with_one_line(
        &["estimate", "--config", "/no/such/config.json"],
        "/no/such/config.json",
    );
    fails_with_one_line(&["estimate", "--zero", "4"], "--zero");
}

#[test]
fn config_files_name_the_bad_field() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("config.json");
    std::fs::write(
        &p,
        r#"{"model_type":"bert","hidden_size":"768","num_hidden_layers":12}"#,
    )
    .unwrap();
    fails_with_one_line(
        &["estimate", "--config", p.to_str().unwrap()],
        "'hidden_size'",
    );
    std::fs::write(&p, r#"{"model_type":"bert","hidden_size":768,"num_hidden_layers":12,"num_attention_heads":12,"vocab_size":30522,"max_position_embeddings":512}"#).unwrap();
    fails_with_one_line(
        &["estimate", "--config", p.to_str().unwrap()],
        "'intermediate_size'",
    );
    let c = dir.path().join("case.toml");
    std::fs::write(&c, "name = \"x\"\n[workload]\nmodel = \"gpt2\"\nbatchsize = 4\n[[expect]]\nverdict = \"oom\"\n").unwrap();
    fails_with_one_line(
        &["estimate", "--config", c.to_str().unwrap()],
        "workload.batchsize",
    );
    std::fs::write(
        &c,
        "name = \"x\"\n[workload]\nmodel = \"gpt2\"\n[[expect]]\nverdict = \"maybe\"\n",
    )
    .unwrap();
    fails_with_one_line(
        &["estimate", "--config", c.to_str().unwrap()],
        "expect[0].verdict",
    );

    // A fine-tuned BERT classifier's config: its class and labels pick the head.
    std::fs::write(&p, r#"{"model_type":"bert","architectures":["BertForSequenceClassification"],"hidden_size":768,"num_hidden_layers":12,"num_attention_heads":12,"intermediate_size":3072,"vocab_size":30522,"max_position_embeddings":512,"id2label":{"0":"a","1":"b","2":"c"}}"#).unwrap();
    let out = oomprobe()
        .args(["estimate", "--config", p.to_str().unwrap(), "--json"])
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(v["workload"]["labels"], 3, "{v}");
    assert_eq!(v["param_count"], 109_482_240u64 + 768 * 3 + 3, "{v}");
    for (args, says) in [
        (
            &["--head", "seq-cls", "--model", "gpt2"][..],
            "BERT's heads",
        ),
        (
            &["--head", "pooled", "--model", "bert-base"][..],
            "unknown value",
        ),
        (
            &["--num-labels", "3", "--model", "bert-base"][..],
            "needs --head seq-cls",
        ),
        (
            &[
                "--head",
                "seq-cls",
                "--num-labels",
                "0",
                "--model",
                "bert-base",
            ][..],
            "--num-labels",
        ),
        (&["--torch-version", "one.ten"][..], "like 1.10"),
        (&["--torch-version", "0.4"][..], "older than PyTorch 1.0"),
        (&["--torch-version", "1.10.2.1"][..], "like 1.10"),
        (
            &["--torch-version", "1.10", "--attention", "sdpa"][..],
            "sdpa needs PyTorch 2.0",
        ),
        (
            &["--attention-mask", "on", "--model", "gpt2"][..],
            "applies to BERT",
        ),
        (
            &["--attention-mask", "maybe", "--model", "bert-base"][..],
            "--attention-mask",
        ),
    ] {
        let mut a = vec!["estimate"];
        a.extend(args.iter().copied());
        fails_with_one_line(&a, says);
    }

    // A good HF config: GPT-2 small's shape gives GPT-2's parameter count.
    std::fs::write(
        &p,
        r#"{"model_type":"gpt2","n_embd":768,"n_layer":12,"n_head":12,"n_positions":1024,"vocab_size":50257,"n_inner":null,"resid_pdrop":0.1}"#,
    )
    .unwrap();
    let v = json(&["estimate", "--config", p.to_str().unwrap()]);
    assert_eq!(u(&v, "/param_count"), 124_439_808);
}

#[test]
fn negative_and_absurd_values_name_their_flag() {
    fails_with_one_line(
        &["estimate", "--memory", "-1GiB"],
        "--memory: '-1GiB' is negative",
    );
    fails_with_one_line(&["estimate", "--batch", "-3"], "--batch: '-3' is negative");
    fails_with_one_line(&["estimate", "--layers", "-1"], "--layers");
    // Plans are bounded: a layer count past the cap is refused at once.
    fails_with_one_line(&["estimate", "--layers", "1000000"], "at most 2048");
    fails_with_one_line(&["estimate", "--hidden", "1e12"], "--hidden");
    fails_with_one_line(&["estimate", "--vocab", "1e12"], "--vocab");
}

#[test]
fn the_largest_layer_count_builds_quickly() {
    let _load = crate::support::load::timed();
    let started = std::time::Instant::now();
    let v = json(&[
        "estimate", "--model", "gpt2", "--layers", "2048", "--memory", "80GB",
    ]);
    assert!(u(&v, "/breakdown/total") > 0);
    assert!(
        started.elapsed().as_secs() < 5,
        "took {:?}",
        started.elapsed()
    );
}

#[test]
fn no_command_and_bad_usage_are_one_clear_line() {
    fails_with_one_line(&[], "missing command: one of devices, estimate, probe");
    fails_with_one_line(&["estimate", "--nope"], "--nope");
}

#[test]
fn config_sizes_are_capped_and_overflows_name_the_fields() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("config.json");
    let gpt2_heads = |n_layer: &str, n_embd: &str, n_head: &str, n_positions: &str| {
        format!(
            r#"{{"model_type":"gpt2","n_embd":{n_embd},"n_layer":{n_layer},"n_head":{n_head},"n_positions":{n_positions},"vocab_size":50257,"_attn_implementation":"eager"}}"#
        )
    };
    let gpt2 = |n_layer: &str, n_embd: &str, n_positions: &str| {
        gpt2_heads(n_layer, n_embd, "12", n_positions)
    };
    // Each size within its cap, the attention scores [heads, s, s] past 64 bits together.
    let huge = gpt2_heads("12", "1048576", "65536", "16777216");
    let path = p.to_str().unwrap();
    for (text, needle) in [
        (
            gpt2("10000000", "768", "1024"),
            "'n_layer': 10000000 is absurd",
        ),
        (gpt2("2147483648", "768", "1024"), "'n_layer'"),
        (gpt2("12", "768000000000", "1024"), "'n_embd'"),
        (
            gpt2("-12", "768", "1024"),
            "'n_layer': expected a positive integer",
        ),
        (gpt2("1e30", "768", "1024"), "'n_layer'"),
        (huge.clone(), "together too large"),
    ] {
        std::fs::write(&p, &text).unwrap();
        fails_with_one_line(&["estimate", "--config", path], needle);
    }
    std::fs::write(&p, &huge).unwrap();
    let out = oomprobe()
        .args(["estimate", "--config", path])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("n_positions"), "names the field: {err}");

    // A UTF-8 byte-order mark is accepted, in config.json and in a case file.
    std::fs::write(&p, format!("\u{feff}{}", gpt2("12", "768", "1024"))).unwrap();
    let v = json(&["estimate", "--config", path]);
    assert_eq!(u(&v, "/param_count"), 124_439_808);
    let c = dir.path().join("case.toml");
    std::fs::write(
        &c,
        "\u{feff}name = \"x\"\n[workload]\nmodel = \"gpt2\"\n[[expect]]\nverdict = \"oom\"\n",
    )
    .unwrap();
    oomprobe()
        .args(["estimate", "--config", c.to_str().unwrap()])
        .assert()
        .success();
    // Case-file sizes go through the flags' checks.
    std::fs::write(
        &c,
        "name = \"x\"\n[workload]\nmodel = \"gpt2\"\nlayers = 5000000\n[[expect]]\nverdict = \"oom\"\n",
    )
    .unwrap();
    fails_with_one_line(
        &["estimate", "--config", c.to_str().unwrap()],
        "--layers: 5000000 is absurd",
    );
}

#[test]
fn autocast_precisions_are_their_own_values() {
    // amp-fp16 / amp-bf16 (torch.autocast) keep fp32 states: 16 B/param with Adam like fp32,
    // but a smaller peak than fp32 (16-bit activations) and a larger one than model.half().
    let peak = |p: &str| {
        let v = json(&[
            "estimate",
            "--model",
            "gpt2",
            "--batch",
            "8",
            "--seq",
            "1024",
            "--precision",
            p,
        ]);
        assert_eq!(v["workload"]["precision"], p);
        u(&v, "/breakdown/total")
    };
    let (fp32, amp16, ampbf, half) = (
        peak("fp32"),
        peak("amp-fp16"),
        peak("amp-bf16"),
        peak("fp16"),
    );
    assert!(half < amp16 && amp16 < fp32, "{half} {amp16} {fp32}");
    assert_eq!(amp16, ampbf);
    // "amp" alone is ambiguous (torch.autocast or DeepSpeed fp16): refused with one line.
    let out = oomprobe()
        .args(["estimate", "--model", "gpt2", "--precision", "amp"])
        .assert()
        .code(2)
        .get_output()
        .stderr
        .clone();
    let err = String::from_utf8(out).unwrap();
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(err.contains("amp-fp16") && err.contains("mixed"), "{err}");
}

#[test]
fn oversized_inputs_are_refused_without_being_read_whole() {
    let d = tempfile::tempdir().unwrap();
    // A config.json past 16 MiB (a real one is a few KB).
    let big = d.path().join("config.json");
    let pad = " ".repeat(17 << 20);
    std::fs::write(&big, format!("{{\"model_type\":\"gpt2\"{pad}}}")).unwrap();
    fails_with_one_line(
        &["estimate", "--config", big.to_str().unwrap()],
        "larger than 16 MiB",
    );
    // A case file with more [[expect]] runs than the cap.
    let case = d.path().join("c.toml");
    let mut text = String::from("name = \"many\"\n[workload]\nmodel = \"gpt2\"\n");
    for _ in 0..257 {
        text.push_str("[[expect]]\nverdict = \"fits\"\n");
    }
    std::fs::write(&case, text).unwrap();
    fails_with_one_line(
        &["estimate", "--config", case.to_str().unwrap()],
        "at most 256",
    );
}

/// Issue 31: the step through PyTorch's caching allocator, on a card of the table.
#[test]
fn the_card_and_the_allocator_move_the_boundaries() {
    let base = ["estimate", "--model", "gpt2", "--batch", "8"];
    let on = |gpu: &str| {
        let mut a = base.to_vec();
        a.extend(["--gpu", gpu]);
        json(&a)
    };
    let r4090 = on("rtx4090");
    let a100 = on("a100-80gb");
    for v in [&r4090, &a100] {
        let reserved = u(v, "/reserved_peak_bytes");
        assert!(reserved >= u(v, "/breakdown/total"), "{v}");
        assert_eq!(
            u(v, "/card_usable_bytes") + u(v, "/non_pytorch_bytes"),
            u(v, "/memory_bytes")
        );
        assert!(u(v, "/fragmentation_bytes") < reserved);
        // The allocator's max never passes the tensors' own.
        for b in v["boundaries"].as_array().unwrap() {
            assert!(b["max_reserved"].as_u64() <= b["max"].as_u64(), "{b}");
        }
    }
    assert_eq!(u(&r4090, "/memory_bytes"), 25_393_364_992);
    // seq on a 24 GB card: the allocator's and the runtime's bytes cost real tokens.
    let seq = |v: &Value, key: &str| {
        v["boundaries"]
            .as_array()
            .unwrap()
            .iter()
            .find(|b| b["scenario"] == "seq")
            .unwrap()[key]
            .as_u64()
            .unwrap()
    };
    assert!(seq(&r4090, "max_reserved") < seq(&r4090, "max"));
    assert!(seq(&a100, "max_reserved") > seq(&r4090, "max_reserved"));
    // --gpu all: a row per card.
    let mut a = base.to_vec();
    a.extend(["--gpu", "all"]);
    let all = json(&a);
    assert_eq!(
        all["cards"].as_array().unwrap().len(),
        oomprobe::alloc::cards::CARDS.len()
    );
}

#[test]
fn a_bad_allocator_setting_or_card_exits_2_naming_it() {
    for (args, needle) in [
        (
            vec!["--alloc-conf", "expandable_segment:True"],
            "expandable_segment",
        ),
        (
            vec!["--alloc-conf", "max_split_size_mb:1"],
            "max_split_size_mb",
        ),
        (vec!["--gpu", "rtx9999"], "rtx9999"),
    ] {
        let mut a = vec!["estimate"];
        a.extend(args);
        fails_with_one_line(&a, needle);
    }
    // The environment variable is read when no flag is given.
    let out = oomprobe()
        .args(["estimate", "--model", "tiny-gpt"])
        .env("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:Tru")
        .assert()
        .code(2)
        .get_output()
        .stderr
        .clone();
    assert!(String::from_utf8(out)
        .unwrap()
        .contains("PYTORCH_CUDA_ALLOC_CONF"));
}

#[test]
fn expandable_segments_reserve_no_more_than_the_default() {
    let base = ["estimate", "--model", "gpt2", "--batch", "4"];
    let mut e = base.to_vec();
    e.extend(["--alloc-conf", "expandable_segments:True"]);
    let d = json(&base);
    let x = json(&e);
    assert!(u(&x, "/reserved_peak_bytes") <= u(&d, "/reserved_peak_bytes"));
    assert_eq!(x["alloc_conf"], "expandable_segments:True");
}

/// Over several GPUs the card's footprint outside PyTorch gains one NCCL communicator per
/// process group of the rank.
#[test]
fn several_gpus_add_an_nccl_communicator_outside_pytorch() {
    let json = |extra: &[&str]| -> serde_json::Value {
        let out = oomprobe()
            .args([
                "estimate",
                "--model",
                "gpt2",
                "--gpu",
                "a100-80gb",
                "--json",
            ])
            .args(extra)
            .output()
            .unwrap();
        assert!(out.status.success());
        serde_json::from_slice(&out.stdout).unwrap()
    };
    let one = json(&[])["non_pytorch_bytes"].as_u64().unwrap();
    let four = json(&["--zero", "2", "--gpus", "4"])["non_pytorch_bytes"]
        .as_u64()
        .unwrap();
    assert_eq!(four - one, 1 << 30);
    // A rank of tensor × data parallelism is in two process groups: two communicators.
    let two = json(&["--tp", "2", "--fsdp", "full", "--gpus", "8"])["non_pytorch_bytes"]
        .as_u64()
        .unwrap();
    assert_eq!(two - one, 2 << 30);
    // Set by hand, it is taken as given.
    let set = json(&["--zero", "2", "--gpus", "4", "--non-pytorch", "700MiB"]);
    assert_eq!(set["non_pytorch_bytes"].as_u64(), Some(700 << 20));
}

/// Inference names no optimizer and no dropout: its plan has neither (issue 35).
#[test]
fn inference_names_no_optimizer_and_no_dropout() {
    let out = oomprobe()
        .args(["estimate", "--model", "gpt2", "--mode", "inference"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8(out.stdout).unwrap();
    let first = workload_line(&text);
    assert!(first.contains("no optimizer (inference)"), "{first}");
    assert!(
        !first.contains("adam") && !first.contains("dropout"),
        "{first}"
    );
    // Training still names both.
    let out = oomprobe()
        .args(["estimate", "--model", "gpt2"])
        .output()
        .unwrap();
    let text = String::from_utf8(out.stdout).unwrap();
    let first = workload_line(&text);
    assert!(
        first.contains("adam") && first.contains("dropout"),
        "{first}"
    );
}

/// Issue 35: with kbit preparation the residual stream is fp32, so grouped-query SDPA falls back
/// to math; the summary line said "flash kernel" while the plan put the peak at grad_scores.
#[test]
fn qlora_summary_names_the_kernel_the_plan_uses() {
    let out = oomprobe()
        .args(["estimate", "--model", "llama3-8b", "--lora", "16"])
        .args([
            "--lora-targets",
            "all-linear",
            "--quant",
            "nf4",
            "--memory",
            "24GiB",
        ])
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    let text = String::from_utf8(out).unwrap();
    let first = workload_line(&text);
    assert!(first.contains("math fallback"), "{first}");
    assert!(text.contains("grad_scores"), "{text}");
    // Without kbit preparation the stream stays bf16 and the flash kernel runs.
    let out = oomprobe()
        .args([
            "estimate",
            "--model",
            "llama3-8b",
            "--lora",
            "16",
            "--quant",
            "nf4",
        ])
        .args(["--kbit-prep", "off", "--memory", "24GiB"])
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    let text = String::from_utf8(out).unwrap();
    let first = workload_line(&text);
    assert!(first.contains("flash kernel"), "{first}");
}

/// The checkpointing note reads as English at every segment length ("every 1th layer" before).
#[test]
fn the_checkpointing_note_names_its_segment_in_words() {
    for (ckpt, want) in [
        ("full", "checkpointing: every layer's input stored (2 of 2)"),
        ("every:2", "the input of every 2nd layer stored (1 of 2)"),
        ("every:3", "the input of every 3rd layer stored (1 of 2)"),
        ("every:11", "the input of every 11th layer stored (1 of 2)"),
        ("every:21", "the input of every 21st layer stored (1 of 2)"),
    ] {
        let v = json(&["estimate", "--model", "tiny-gpt", "--checkpoint", ckpt]);
        let notes = v["notes"].to_string();
        assert!(notes.contains(want), "{ckpt}: {notes}");
    }
}

fn text_of(args: &[&str]) -> String {
    let out = oomprobe()
        .args(args)
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    String::from_utf8(out).unwrap()
}

/// The ratio in a headline's "(3.34×" (issue 47).
fn headline_ratio(line: &str) -> f64 {
    let at = line
        .find('×')
        .unwrap_or_else(|| panic!("no ratio in {line}"));
    let start = line[..at].rfind('(').unwrap() + 1;
    line[start..at].parse().unwrap()
}

/// Issue 47: Llama-3-8B at 2048 tokens on an RTX 4090 needs three times the card; the first line
/// says so, and the refusal is a shortage, not fragmentation.
#[test]
fn a_step_three_times_the_card_says_it_does_not_fit_first() {
    let args = [
        "estimate",
        "--model",
        "llama3-8b",
        "--seq",
        "2048",
        "--gpu",
        "rtx4090",
    ];
    let text = text_of(&args);
    let first = text.lines().next().unwrap();
    assert!(
        first.starts_with("does not fit: the step needs 74.80 GiB"),
        "{first}"
    );
    assert!(first.contains("PyTorch may use 23.17 GiB"), "{first}");
    assert!(headline_ratio(first) > 3.0, "{first}");
    let refused = text.lines().find(|l| l.contains("refused")).unwrap();
    assert!(refused.contains("short by 51.62 GiB"), "{refused}");
    assert!(refused.ends_with(": not fragmentation"), "{refused}");
    assert!(!refused.contains("was enough"), "{refused}");
    let v = json(&args);
    let fit = &v["fit"];
    assert_eq!(fit["fits"], false);
    assert_eq!(fit["verdict"], "does_not_fit");
    assert_eq!(u(&v, "/fit/needed_bytes"), u(&v, "/breakdown/total"));
    assert_eq!(u(&v, "/fit/usable_bytes"), u(&v, "/card_usable_bytes"));
    let shortage = u(&v, "/fit/needed_bytes") - u(&v, "/fit/usable_bytes");
    assert_eq!(u(&v, "/fit/shortage_bytes"), shortage);
    assert_eq!(u(&v, "/allocator/failure/shortage_bytes"), shortage);
    assert_eq!(v["allocator"]["failure"]["fragmentation"], false);
    // The tensors alone say it (no allocator search); the ratio is theirs over usable.
    assert!(fit.get("reserved_bytes").is_none(), "{fit}");
    let ratio = fit["ratio"].as_f64().unwrap();
    let tensors = u(&v, "/fit/needed_bytes") as f64 / u(&v, "/fit/usable_bytes") as f64;
    assert!((ratio - tensors).abs() < 1e-9, "{fit}");
    assert!(
        (headline_ratio(first) - ratio).abs() < 0.006,
        "{first} {ratio}"
    );
}

/// Issue 47: a small step on a big card fits and says its share of usable first.
#[test]
fn a_small_step_on_a_big_card_says_it_fits_first() {
    let args = [
        "estimate", "--model", "gpt2", "--batch", "2", "--gpu", "h100-sxm",
    ];
    let text = text_of(&args);
    let first = text.lines().next().unwrap();
    assert!(first.starts_with("fits: the step needs"), "{first}");
    assert!(first.ends_with("% of usable)"), "{first}");
    assert!(!text.contains("refused"), "{text}");
    let v = json(&args);
    assert_eq!(v["fit"]["fits"], true);
    assert_eq!(v["fit"]["shortage_bytes"], 0);
    assert_eq!(
        u(&v, "/fit/reserved_bytes"),
        u(&v, "/reserved_peak_bytes"),
        "on the card the allocator's own peak"
    );
    assert!(v["fit"]["ratio"].as_f64().unwrap() < 0.1, "{}", v["fit"]);
}

/// Issue 47: tensors that fit where the allocator's free pieces do not serve a request are still
/// fragmentation (gpt2 batch 8: tensors 16.75 GB, reserved peak 16.90 GB; the card between).
#[test]
fn a_refusal_with_the_tensors_fitting_is_still_fragmentation() {
    let args = [
        "estimate",
        "--model",
        "gpt2",
        "--batch",
        "8",
        "--memory",
        "16830000000",
    ];
    let text = text_of(&args);
    let first = text.lines().next().unwrap();
    assert!(
        first.starts_with("does not fit with PyTorch's allocator: the tensors need"),
        "{first}"
    );
    assert!(first.ends_with("% of usable)"), "{first}");
    let refused = text.lines().find(|l| l.contains("refused")).unwrap();
    assert!(refused.ends_with("): fragmentation"), "{refused}");
    let v = json(&args);
    assert_eq!(v["fit"]["verdict"], "allocator_refuses");
    // What the allocator needs: more than the card, at most its peak with no limit.
    let needs = u(&v, "/fit/reserved_bytes");
    assert!(
        needs > 16_830_000_000 && needs > u(&v, "/fit/needed_bytes"),
        "{}",
        v["fit"]
    );
    let free = json(&[
        "estimate", "--model", "gpt2", "--batch", "8", "--memory", "1TB",
    ]);
    assert!(needs <= u(&free, "/reserved_peak_bytes"));
    assert!(v["fit"]["ratio"].as_f64().unwrap() > 1.0);
    assert_eq!(v["fit"]["shortage_bytes"], 0);
    assert_eq!(v["allocator"]["failure"]["fragmentation"], true);
    assert_eq!(v["allocator"]["failure"]["shortage_bytes"], 0);
}

/// `--seq-lengths`: steps of varying length through one cache; a card too small names the step
/// that fails and still exits 0 (an OOM is a result); bad lists exit 2 with one line.
#[test]
fn seq_lengths_replays_steps_of_varying_length() {
    let base = ["estimate", "--model", "qwen2.5-0.5b", "--precision", "bf16"];
    let v = json(&[&base[..], &["--seq-lengths", "512,128,1024,256"]].concat());
    let steps = v["sequence"]["steps"].as_array().unwrap();
    assert_eq!(steps.len(), 4);
    assert_eq!(u(&v, "/longest"), 1024);
    assert_eq!(steps[2]["value"], 1024);
    // The longest step sets the tensors' peak; the cache the shorter ones left can only add
    // to what it reserves alone.
    let peak = steps
        .iter()
        .map(|s| s["tensors_peak_bytes"].as_u64().unwrap())
        .max();
    assert_eq!(peak, Some(u(&v, "/sequence/tensors_peak_bytes")));
    assert_eq!(peak, steps[2]["tensors_peak_bytes"].as_u64());
    assert!(u(&v, "/unlimited/reserved_peak_bytes") >= u(&v, "/longest_alone_reserved_peak_bytes"));
    // On a card the longest step does not fit: the failure names step 3.
    let v = json(
        &[
            &base[..],
            &["--seq-lengths", "512,128,8192,256", "--memory", "8GiB"],
        ]
        .concat(),
    );
    assert_eq!(u(&v, "/sequence/failure/step"), 3);
    let text = oomprobe()
        .args(base)
        .args(["--seq-lengths", "512,128,8192,256", "--memory", "8GiB"])
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    let text = String::from_utf8(text).unwrap();
    assert!(text.contains("does not fit"), "{text}");
    for bad in ["", "1,0", "12,x", "@/nonexistent/lengths", "16,99999999999"] {
        let out = oomprobe()
            .args(base)
            .args(["--seq-lengths", bad])
            .assert()
            .code(2)
            .get_output()
            .stderr
            .clone();
        let err = String::from_utf8(out).unwrap();
        assert_eq!(err.lines().count(), 1, "{bad}: {err}");
        assert!(err.contains("--seq-lengths"), "{bad}: {err}");
    }
}

/// `--cuda-modules eager` (PyTorch before 1.13, CUDA before 11.7): the card holds about 1 GiB
/// more outside PyTorch, so the allocator's boundary moves down; lazy is the default.
#[test]
fn eager_module_loading_holds_more_outside_pytorch() {
    let base = [
        "estimate",
        "--model",
        "gpt2",
        "--gpu",
        "v100-16gb",
        "--batch",
        "8",
    ];
    let lazy = json(&base);
    let eager = json(&[&base[..], &["--cuda-modules", "eager"]].concat());
    assert_eq!(
        u(&eager, "/non_pytorch_bytes") - u(&lazy, "/non_pytorch_bytes"),
        oomprobe::alloc::cards::EAGER_MODULES
    );
    assert_eq!(eager["workload"]["cuda_modules"], "eager");
    assert!(lazy["workload"].get("cuda_modules").is_none());
    let same = json(&[&base[..], &["--cuda-modules", "lazy"]].concat());
    assert_eq!(
        u(&same, "/non_pytorch_bytes"),
        u(&lazy, "/non_pytorch_bytes")
    );
}

/// `--checkpoint ops` (torchtitan's op-level selective checkpointing) saves between full
/// checkpointing and none: each layer's input plus its odd matmuls' and its attention's
/// outputs. Where it is not modelled it says so in one line.
#[test]
fn selective_checkpointing_saves_between_full_and_none() {
    let saved = |c: &str| {
        let args = [
            "estimate",
            "--model",
            "llama3-8b",
            "--batch",
            "1",
            "--seq",
            "4096",
            "--precision",
            "bf16",
            "--checkpoint",
            c,
        ];
        u(&json(&args), "/timeline/saved_bytes")
    };
    let (none, full, ops) = (saved("none"), saved("full"), saved("ops"));
    assert!(
        full < ops && ops < none,
        "full {full} ops {ops} none {none}"
    );
    // Per layer: the input (h), q_proj (h), v_proj (kv width), the attention's output (h) and
    // logsumexp (fp32 per head and row), gate (ffn), down_proj's output (h); bf16, s = 4096.
    let (s, h, kv, f, a) = (4096u64, 4096, 1024, 14336, 32);
    let per_layer = 2 * s * (4 * h + kv + f) + 4 * a * s;
    let extra = ops - full;
    let want = 32 * (per_layer - 2 * s * h);
    assert!(
        extra.abs_diff(want) * 100 < want,
        "ops keeps {extra} more than full; the layers' stored outputs are {want}"
    );
    fails_with_one_line(
        &["estimate", "--model", "gpt2", "--checkpoint", "ops"],
        "--checkpoint ops",
    );
    fails_with_one_line(
        &[
            "estimate",
            "--model",
            "llama3-8b",
            "--checkpoint",
            "ops",
            "--lora",
            "8",
        ],
        "--checkpoint ops",
    );
}

/// `--float8`: torchao's float8 training saves what bf16 saves; FSDP2's float8 all-gather
/// gathers the layers' weights in one byte each, so a rank holds less; refused outside bf16 in
/// one line.
#[test]
fn float8_all_gather_holds_less_and_bad_settings_are_refused() {
    let peak = |f: &str| {
        let args = [
            "estimate",
            "--model",
            "llama3-8b",
            "--batch",
            "1",
            "--seq",
            "2048",
            "--precision",
            "amp-bf16",
            "--fsdp",
            "full",
            "--gpus",
            "8",
            "--float8",
            f,
        ];
        let v = json(&args);
        (u(&v, "/breakdown/total"), u(&v, "/timeline/saved_bytes"))
    };
    let (off, off_saved) = peak("off");
    let (tw, tw_saved) = peak("tensorwise");
    let (ag, ag_saved) = peak("tensorwise-all-gather");
    assert_eq!(off_saved, tw_saved);
    assert_eq!(off_saved, ag_saved);
    assert!(tw >= off, "tensorwise {tw} off {off}");
    assert!(ag < tw, "all-gather {ag} tensorwise {tw}");
    fails_with_one_line(
        &[
            "estimate",
            "--model",
            "llama3-8b",
            "--precision",
            "fp32",
            "--float8",
            "rowwise",
        ],
        "--float8",
    );
    fails_with_one_line(
        &[
            "estimate",
            "--model",
            "llama3-8b",
            "--precision",
            "bf16",
            "--float8",
            "tensorwise-all-gather",
        ],
        "--fsdp",
    );
    fails_with_one_line(&["estimate", "--float8", "fp4"], "--float8");
}
