//! `oomprobe diagnose` from the outside: the causes of the done-when checks and the remedies.

use assert_cmd::Command;
use serde_json::Value;

fn diagnose(args: &[&str]) -> Value {
    let out = Command::cargo_bin("oomprobe")
        .unwrap()
        .arg("diagnose")
        .args(args)
        .arg("--json")
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    serde_json::from_slice(&out).unwrap()
}

fn remedy<'a>(v: &'a Value, name: &str) -> &'a Value {
    v["remedies"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == name)
        .unwrap_or_else(|| panic!("no {name} in {v}"))
}

#[test]
fn gpt2_at_16k_tokens_on_40gib_is_sequence_too_long() {
    // With SDPA (transformers' default) no [b, a, s, s] tensor is held: it fits.
    let v = diagnose(&["--model", "gpt2", "--seq", "16384", "--memory", "40GiB"]);
    assert_eq!(v["cause"], "fits");
    // The seed's story is eager attention's.
    let v = diagnose(&[
        "--model",
        "gpt2",
        "--seq",
        "16384",
        "--memory",
        "40GiB",
        "--attention",
        "eager",
    ]);
    assert_eq!(v["cause"], "sequence_too_long");
    assert_eq!(v["schema_version"], 1);
    for k in [
        "params",
        "gradients",
        "optimizer",
        "activations",
        "attention",
        "workspace",
        "total",
    ] {
        assert!(v["breakdown"][k].is_u64(), "{k}");
    }
    // Flash attention moves the line far beyond the naive one.
    let flash = remedy(&v, "flash attention");
    assert!(flash["value"].as_u64().unwrap() > 16384, "{flash}");
    assert!(flash["effect"].as_str().unwrap().contains("max seq"));
}

#[test]
fn llama_13b_mixed_adam_on_80gib_is_model_too_large() {
    let args = [
        "--model",
        "llama-13b",
        "--precision",
        "mixed",
        "--optimizer",
        "adam",
        "--memory",
        "80GiB",
    ];
    let v = diagnose(&args);
    assert_eq!(v["cause"], "model_too_large");
    // ZeRO-3 shards everything: 208 GB of states over N cards plus activations; ZeRO-2 needs
    // more cards, ZeRO-1 (the unsharded fp16 weights and gradients, 52 GB) more still.
    let z3 = remedy(&v, "ZeRO-3")["value"].as_u64().unwrap();
    let z2 = remedy(&v, "ZeRO-2")["value"].as_u64().unwrap();
    let z1 = remedy(&v, "ZeRO-1")["value"].as_u64().unwrap();
    assert!(
        z3 >= 3 && z3 < z2 && z2 < z1,
        "zero3 {z3} zero2 {z2} zero1 {z1}"
    );
    // With eager attention seq 2048's scores alone (40 layers × [40, 2048, 2048] in fp32 plus
    // an fp16 copy: 37.5 GiB) and the activations leave no room on 80 GiB for any stage.
    let mut eager = args.to_vec();
    eager.extend(["--attention", "eager"]);
    let v = diagnose(&eager);
    assert_eq!(v["cause"], "model_too_large");
    assert!(remedy(&v, "ZeRO-1")["value"].is_null());
}

#[test]
fn other_causes() {
    let v = diagnose(&[
        "--model", "resnet50", "--batch", "1024", "--memory", "40GiB",
    ]);
    assert_eq!(v["cause"], "batch_too_large");
    let max = remedy(&v, "smaller batch")["value"].as_u64().unwrap();
    assert!(max > 1 && max < 1024);
    let v = diagnose(&["--model", "tiny-gpt", "--memory", "1GiB"]);
    assert_eq!(v["cause"], "fits");
    // A deep stack where one sample's activations do not fit beside the model states.
    let v = diagnose(&[
        "--model",
        "gpt2-xl",
        "--precision",
        "mixed",
        "--seq",
        "1024",
        "--attention",
        "flash",
        "--memory",
        "24.5GiB",
    ]);
    // All model states (16 B/param) are 23.4 GiB; batch 1 peaks at 25.2 GiB.
    assert_eq!(v["cause"], "activations_explode", "{v}");
}

#[test]
fn text_report_is_short() {
    let out = Command::cargo_bin("oomprobe")
        .unwrap()
        .args([
            "diagnose",
            "--model",
            "gpt2",
            "--seq",
            "16384",
            "--memory",
            "40GiB",
            "--attention",
            "eager",
        ])
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    let text = String::from_utf8(out).unwrap();
    assert!(text.contains("cause: sequence_too_long"), "{text}");
    // The report (11 lines here) and the ways out: a header and the best three.
    assert!(text.lines().count() <= 16, "{text}");
    assert!(
        text.contains("--attention sdpa"),
        "eager attention's way out: {text}"
    );
}

#[test]
fn case_file_drives_diagnose() {
    let dir = tempfile::tempdir().unwrap();
    let c = dir.path().join("case.toml");
    std::fs::write(
        &c,
        "name = \"13B on 80GB\"\nmemory = \"80GB\"\n[workload]\nmodel = \"llama-13b\"\nprecision = \"mixed\"\noptimizer = \"adam\"\n[[expect]]\nverdict = \"oom\"\ncause = \"model_too_large\"\n",
    )
    .unwrap();
    let v = diagnose(&["--config", c.to_str().unwrap(), "--memory", "80GB"]);
    assert_eq!(v["cause"], "model_too_large");
}

#[test]
fn without_memory_uses_the_device_or_says_how() {
    let out = Command::cargo_bin("oomprobe")
        .unwrap()
        .args(["diagnose", "--model", "tiny-gpt"])
        .output()
        .unwrap();
    match out.status.code() {
        Some(0) => assert!(String::from_utf8_lossy(&out.stdout).contains("cause:")),
        Some(2) => assert!(String::from_utf8_lossy(&out.stderr).contains("--memory")),
        other => panic!("exit {other:?}: {}", String::from_utf8_lossy(&out.stderr)),
    }
}

fn diagnose_text(args: &[&str]) -> String {
    let out = Command::cargo_bin("oomprobe")
        .unwrap()
        .arg("diagnose")
        .args(args)
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    String::from_utf8(out).unwrap()
}

/// Issue 47: diagnose says first whether the step fits, with the ratio, as estimate does.
#[test]
fn diagnose_says_first_whether_it_fits() {
    let l8 = ["--model", "llama3-8b", "--seq", "2048", "--gpu", "rtx4090"];
    let text = diagnose_text(&l8);
    let first = text.lines().next().unwrap();
    assert!(
        first.starts_with("does not fit: the step needs 74.80 GiB") && first.contains("(3."),
        "{first}"
    );
    let v = diagnose(&l8);
    assert_eq!(v["fit"]["fits"], false);
    assert!(v["fit"]["ratio"].as_f64().unwrap() > 3.0, "{}", v["fit"]);
    assert_eq!(v["fit"]["usable_bytes"], v["memory_bytes"]);
    assert_eq!(v["fit"]["needed_bytes"], v["breakdown"]["total"]);
    let small = ["--model", "gpt2", "--batch", "2", "--gpu", "h100-sxm"];
    let text = diagnose_text(&small);
    assert!(text.starts_with("fits: the step needs"), "{text}");
    assert!(text.contains("cause: fits"), "{text}");
    assert_eq!(diagnose(&small)["fit"]["fits"], true);
}

/// Issue 47: "model states" at the step's peak and "all model states" (params + grads +
/// optimizer held at once) are named as which, and each figure is the same wherever it appears.
#[test]
fn model_states_are_named_as_at_the_peak_or_all() {
    // At seq 4096 the peak is in backward, before the gradients exist: the two differ.
    let args = ["--model", "llama3-8b", "--gpu", "rtx4090"];
    let v = diagnose(&args);
    let all = v["model_states_bytes"].as_u64().unwrap();
    let b = &v["breakdown"];
    let at_peak = ["params", "gradients", "optimizer"]
        .iter()
        .map(|k| b[k].as_u64().unwrap())
        .sum::<u64>();
    assert!(all > at_peak, "{all} {at_peak}");
    let gib = |x: u64| format!("{:.2} GiB", x as f64 / (1u64 << 30) as f64);
    let text = diagnose_text(&args);
    assert!(
        text.contains(&format!(
            "at the step's peak: model states {}",
            gib(at_peak)
        )),
        "{text}"
    );
    assert!(
        text.contains(&format!("all model states {} (params + grads", gib(all))),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "all model states (params + grads + optimizer) alone need {}",
            gib(all)
        )),
        "{text}"
    );
    assert!(
        text.contains(&format!(
            "none helps: all model states alone need {}",
            gib(all)
        )),
        "{text}"
    );
    // No bare "model states N" that is neither.
    for l in text.lines().filter(|l| l.contains("model states")) {
        assert!(
            l.contains("all model states") || l.contains("at the step's peak: model states"),
            "{l}"
        );
    }
}

/// Issue 47: where the tensors fit and the allocator does not, diagnose's headline and its cause
/// say both, not a bare "fits" (gpt2 batch 8: tensors 16.75 GB, reserved peak 16.90 GB).
#[test]
fn tensors_that_fit_where_the_allocator_does_not_say_so() {
    let args = ["--model", "gpt2", "--batch", "8", "--memory", "16830000000"];
    let text = diagnose_text(&args);
    assert!(
        text.starts_with("does not fit with PyTorch's allocator"),
        "{text}"
    );
    let cause = text.lines().find(|l| l.starts_with("cause:")).unwrap();
    assert!(
        cause.starts_with("cause: fits") && cause.contains("PyTorch's allocator needs"),
        "{cause}"
    );
    let v = diagnose(&args);
    assert_eq!(v["fit"]["verdict"], "allocator_refuses");
    assert!(v["fit"]["reserved_bytes"].as_u64().unwrap() > 16_830_000_000);
}

/// Issue 47: Llama-3-8B at sequence 2048 on one RTX 4090 does not fit; `diagnose` lists the
/// ways out (QLoRA with checkpointing, and full fine-tuning sharded over a stated number of
/// cards with checkpointing), each with its flags, peak and relative cost; each way's flags,
/// given back to `estimate`, make a step that fits on the card.
#[test]
fn the_ways_out_fit_when_their_flags_are_typed() {
    let v = diagnose(&["--model", "llama3-8b", "--seq", "2048", "--gpu", "rtx4090"]);
    let ways = v["ways"]["ways"].as_array().expect("ways");
    assert!(ways.len() >= 3, "{ways:?}");
    let flags = |w: &Value| -> Vec<String> {
        w["changes"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c.as_str().unwrap().to_string())
            .collect()
    };
    let has = |w: &Value, f: &str| flags(w).iter().any(|c| c.contains(f));
    assert!(
        ways.iter()
            .any(|w| has(w, "--quant nf4") && has(w, "--checkpoint full") && w["gpus"] == 1),
        "QLoRA with checkpointing: {ways:?}"
    );
    assert!(
        ways.iter().any(|w| has(w, "--fsdp full")
            && has(w, "--checkpoint full")
            && w["gpus"].as_u64().unwrap() > 1
            && !has(w, "--lora")),
        "a sharded full fine-tune: {ways:?}"
    );
    let mut last = 0.0;
    for w in ways {
        assert_eq!(w["fits"], true);
        let cost = w["relative_cost"].as_f64().unwrap();
        assert!(cost >= 1.0 && cost >= last, "best first: {ways:?}");
        last = cost;
        assert!(w["tokens_per_second_per_gpu"].as_f64().unwrap() > 0.0);
        assert!(w["max_micro_batch"].as_u64().unwrap() >= 1);
        // Typed back into estimate, the way fits on the card (the headline says so).
        let mut args: Vec<String> = ["estimate", "--model", "llama3-8b", "--seq", "2048"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        for c in flags(w).iter().filter(|c| c.starts_with("--")) {
            args.extend(c.split_whitespace().map(str::to_string));
        }
        args.extend(["--gpu".into(), "rtx4090".into(), "--json".into()]);
        let out = Command::cargo_bin("oomprobe")
            .unwrap()
            .args(&args)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let e: Value = serde_json::from_slice(&out.stdout).unwrap();
        assert_eq!(e["fit"]["fits"], true, "{args:?}: {}", e["fit"]);
        assert_eq!(
            e["fit"]["needed_bytes"].as_u64(),
            w["peak_bytes"].as_u64(),
            "{args:?}"
        );
    }
}
