//! Fine-tuning from the command line: LoRA and QLoRA over the published Llama-3-8B config
//! (`estimate`, `diagnose`, a config's `quantization_config`), the closed forms of what the
//! adapters and a quantized base hold, bad fine-tuning flags exiting 2 with one line, and the
//! measured boundary of a scaled-down QLoRA run on the device.

use std::path::PathBuf;

use assert_cmd::Command;
use oomprobe::plan::build::param_count;
use oomprobe::plan::{Plan, Role};
use oomprobe::workload::hf::load_hf;
use oomprobe::workload::{Lora, Precision, Quant, QuantKind, Target, Workload};
use serde_json::Value;

use crate::support::adapter;

fn llama3() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/configs/llama3-8b.json")
}

fn llama3_workload() -> Workload {
    let p = llama3();
    load_hf(
        &p.display().to_string(),
        &std::fs::read_to_string(&p).unwrap(),
    )
    .unwrap()
}

fn oomprobe() -> Command {
    Command::cargo_bin("oomprobe").unwrap()
}

fn json(args: &[&str]) -> Value {
    let out = oomprobe()
        .args(args)
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    serde_json::from_slice(&out).unwrap()
}

#[test]
fn qlora_llama3_8b_on_24_gib_prints_a_max_batch() {
    let p = llama3();
    let p = p.to_str().unwrap();
    let base = [
        "estimate",
        "--config",
        p,
        "--lora",
        "16",
        "--lora-targets",
        "all-linear",
        "--quant",
        "nf4",
        "--precision",
        "bf16",
        "--seq",
        "2048",
        "--memory",
        "24GiB",
    ];
    let out = oomprobe()
        .args(base)
        .assert()
        .success()
        .get_output()
        .clone();
    let text = String::from_utf8(out.stdout).unwrap();
    assert!(text.contains("LoRA r16 on all-linear"), "{text}");
    assert!(text.contains("nf4 base (double quant)"), "{text}");
    assert!(text.contains("max batch"), "{text}");
    // prepare_model_for_kbit_training's checkpointing is said on stderr.
    let err = String::from_utf8(out.stderr).unwrap();
    assert!(err.contains("gradient checkpointing on"), "{err}");

    let mut a = base.to_vec();
    a.push("--json");
    let v = json(&a);
    assert_eq!(v["workload"]["lora"]["rank"], 16);
    assert_eq!(v["workload"]["quant"]["kind"], "nf4");
    let batch = v["boundaries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["scenario"] == "batch")
        .and_then(|b| b["max"].as_u64())
        .expect("a max batch");
    assert!(batch >= 1, "{v}");
    // The same without the quantized base holds 16 GB of bf16 weights: fewer sequences fit.
    let lora = json(&[
        "estimate",
        "--config",
        p,
        "--lora",
        "16",
        "--lora-targets",
        "all-linear",
        "--precision",
        "bf16",
        "--checkpoint",
        "full",
        "--seq",
        "2048",
        "--memory",
        "24GiB",
        "--json",
    ]);
    let lora_batch = lora["boundaries"]
        .as_array()
        .unwrap()
        .iter()
        .find(|b| b["scenario"] == "batch")
        .and_then(|b| b["max"].as_u64())
        .unwrap_or(0);
    assert!(lora_batch < batch, "LoRA {lora_batch} vs QLoRA {batch}");
}

#[test]
fn adapters_and_quantized_bases_hold_their_closed_forms() {
    let mut w = llama3_workload();
    w.seq = 512;
    w.precision = Precision::Bf16;
    let full = Plan::for_workload(&w).unwrap();
    w.lora = Some(Lora {
        rank: 16,
        targets: Target::ALL.to_vec(),
        alpha: Some(32.0),
        dropout: 0.0,
    });
    // Adapters: r·(in + out) per linear, every layer (Llama-3-8B: q 4096→4096, k/v →1024,
    // o, gate/up 4096→14336, down 14336→4096).
    let per_layer = 16
        * ((4096 + 4096) + 2 * (4096 + 1024) + (4096 + 4096) + 2 * (4096 + 14336) + (14336 + 4096));
    let adapters = 32 * per_layer;
    assert_eq!(
        oomprobe::plan::transformer::trainable_count(&w).unwrap(),
        adapters
    );
    assert_eq!(param_count(&w).unwrap(), 8_030_261_248 + adapters);
    let lora = Plan::for_workload(&w).unwrap();
    let role = |p: &Plan, r: Role| {
        p.tensors
            .iter()
            .filter(|t| t.role == r)
            .map(|t| t.bytes)
            .sum::<u64>()
    };
    // Frozen bf16 base (2 B/param) + fp32 adapters (4 B); gradients and AdamW state (fp32)
    // for the adapters only.
    assert_eq!(role(&lora, Role::Params), 8_030_261_248 * 2 + adapters * 4);
    assert_eq!(
        lora.states_peak() - role(&lora, Role::Params),
        adapters * 4 * 3
    );
    assert!(lora.states_peak() < full.states_peak() / 3);

    // QLoRA: every layer linear in bitsandbytes' nf4 layout with double quantization; the
    // embeddings, norms and head upcast to fp32.
    w.quant = Some(Quant {
        kind: QuantKind::Nf4,
        double_quant: true,
        prepare: true,
        compute: Some(Precision::Bf16),
        ..Quant::bnb(QuantKind::Nf4)
    });
    let q = Plan::for_workload(&w).unwrap();
    let layer_linears: [(u64, u64); 7] = [
        (4096, 4096),
        (1024, 4096),
        (1024, 4096),
        (4096, 4096),
        (14336, 4096),
        (14336, 4096),
        (4096, 14336),
    ];
    let quantized: u64 = layer_linears
        .iter()
        .map(|&(o, i)| oomprobe::workload::stored::quantized_bytes(QuantKind::Nf4, true, o, i))
        .sum::<u64>()
        * 32;
    let linear_elems: u64 = layer_linears.iter().map(|&(o, i)| o * i).sum::<u64>() * 32;
    let rest = 8_030_261_248 - linear_elems; // embeddings, head, norms
    assert_eq!(role(&q, Role::Params), quantized + rest * 4 + adapters * 4);
    // About 0.52 B per quantized weight (0.5 packed + the absmax bytes).
    let per = quantized as f64 / linear_elems as f64;
    assert!((0.5..0.53).contains(&per), "{per}");
}

#[test]
fn a_config_quantization_config_sets_the_base() {
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(llama3()).unwrap()).unwrap();
    cfg["quantization_config"] = serde_json::json!({
        "quant_method": "bitsandbytes",
        "load_in_4bit": true,
        "bnb_4bit_quant_type": "nf4",
        "bnb_4bit_use_double_quant": true,
        "bnb_4bit_compute_dtype": "bfloat16"
    });
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.json");
    std::fs::write(&path, cfg.to_string()).unwrap();
    let p = path.to_str().unwrap();
    let v = json(&["estimate", "--config", p, "--lora", "8", "--json"]);
    assert_eq!(v["workload"]["quant"]["kind"], "nf4");
    assert_eq!(v["workload"]["quant"]["double_quant"], true);
    assert_eq!(v["workload"]["quant"]["compute"], "bf16");
    assert_eq!(v["workload"]["checkpoint"]["mode"], "full");
    // Without adapters a 4-bit base cannot train: one line, exit 2.
    let out = oomprobe()
        .args(["estimate", "--config", p])
        .assert()
        .code(2)
        .get_output()
        .stderr
        .clone();
    let err = String::from_utf8(out).unwrap();
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("--lora"), "{err}");
}

#[test]
fn bad_fine_tuning_flags_exit_2_with_one_line() {
    let p = llama3();
    let p = p.to_str().unwrap();
    for (args, says) in [
        (
            vec!["--lora", "8", "--lora-targets", "lm_head"],
            "unknown module",
        ),
        (vec!["--lora", "0"], "lora"),
        (vec!["--lora", "8", "--lora-dropout", "1.5"], "probability"),
        (vec!["--lora-alpha", "16"], "needs --lora"),
        (vec!["--double-quant", "on"], "needs --quant"),
        (vec!["--quant", "int4"], "unknown value"),
        (vec!["--quant", "nf4"], "--lora"),
        (
            vec!["--lora", "8", "--precision", "amp-bf16"],
            "not modelled",
        ),
        (
            vec!["--lora", "8", "--quant", "int8", "--quant-compute", "bf16"],
            "4-bit",
        ),
        (
            vec!["--lora", "8", "--bnb-version", "0.42"],
            "needs --quant",
        ),
        (
            vec!["--lora", "8", "--quant", "nf4", "--bnb-version", "zero"],
            "like 0.42.0",
        ),
        (
            vec!["--lora", "8", "--quant", "nf4", "--bnb-version", "0.42.0.1"],
            "like 0.42.0",
        ),
        (
            vec!["--lora", "8", "--quant", "nf4", "--bnb-version", "0.38.1"],
            "0.39.0",
        ),
        (
            vec!["--lora", "8", "--quant", "int8", "--bnb-version", "0.42"],
            "4-bit",
        ),
        (vec!["--lora", "8", "--quant-head", "on"], "needs --quant"),
        (
            vec!["--lora", "8", "--quant", "nf4", "--quant-head", "maybe"],
            "on or off",
        ),
        (vec!["--lora", "8", "--outputs", "later"], "unknown value"),
        (vec!["--lora", "8", "--framework", "lit"], "unknown value"),
        (vec!["--cublas-workspace", "lots"], "invalid size"),
        (vec!["--cublas-workspace", "2TiB"], "more than 1 TiB"),
    ] {
        let mut a = vec!["estimate", "--config", p];
        a.extend(args.iter().copied());
        let out = oomprobe()
            .args(&a)
            .assert()
            .code(2)
            .get_output()
            .stderr
            .clone();
        let err = String::from_utf8(out).unwrap();
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
    }
    let out = oomprobe()
        .args(["estimate", "--model", "gpt2", "--lora", "8"])
        .assert()
        .code(2)
        .get_output()
        .stderr
        .clone();
    assert!(String::from_utf8(out).unwrap().contains("LLaMA-style"));
    // A tied head is the embedding, which bitsandbytes does not quantize.
    let out = oomprobe()
        .args([
            "estimate",
            "--model",
            "qwen2.5-0.5b",
            "--lora",
            "8",
            "--quant",
            "nf4",
            "--quant-head",
            "on",
        ])
        .assert()
        .code(2)
        .get_output()
        .stderr
        .clone();
    let err = String::from_utf8(out).unwrap();
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("tied"), "{err}");
}

#[test]
fn diagnose_offers_lora_and_qlora_for_a_model_too_large() {
    let p = llama3();
    let v = json(&[
        "diagnose",
        "--config",
        p.to_str().unwrap(),
        "--precision",
        "bf16",
        "--seq",
        "2048",
        "--memory",
        "24GiB",
        "--json",
    ]);
    assert_eq!(v["cause"], "model_too_large");
    let remedies = v["remedies"].as_array().unwrap();
    let qlora = remedies
        .iter()
        .find(|r| r["name"].as_str().unwrap().starts_with("QLoRA"))
        .expect("a QLoRA remedy");
    assert!(qlora["value"].as_u64().is_some_and(|b| b >= 1), "{qlora}");
    assert!(remedies
        .iter()
        .any(|r| r["name"].as_str().unwrap().starts_with("LoRA")));
}

#[test]
fn scaled_down_qlora_probes_its_boundary_on_the_device() {
    adapter::require_adapter();
    // Llama-3-8B's layers at width 256 with nf4 linears, fp32 adapters on every linear and
    // checkpointing: every byte written and read back under a 128 MiB budget.
    let p = llama3();
    let out = adapter::oomprobe()
        .args([
            "probe",
            "--config",
            p.to_str().unwrap(),
            "--layers",
            "2",
            "--hidden",
            "256",
            "--heads",
            "8",
            "--kv-heads",
            "2",
            "--ffn",
            "688",
            "--vocab",
            "2048",
            "--seq",
            "128",
            "--lora",
            "16",
            "--lora-targets",
            "all-linear",
            "--quant",
            "nf4",
            "--precision",
            "bf16",
            "--scenario",
            "batch",
            "--budget",
            "128MiB",
            "--json",
        ])
        .assert()
        .success()
        .get_output()
        .stdout
        .clone();
    let v: Value = serde_json::from_slice(&out).unwrap();
    let run = &v["runs"][0];
    let (fit, fail) = (run["max_fit"].as_u64(), run["first_fail"].as_u64());
    assert!(fit.is_some_and(|f| f >= 1), "{run}");
    assert_eq!(fail, fit.map(|f| f + 1), "an exact boundary: {run}");
    assert_eq!(
        run["predicted_max"].as_u64(),
        fit,
        "under --budget the plan is exact"
    );
}

#[test]
fn fine_tuning_optimizers_hold_their_state() {
    use oomprobe::workload::{presets, Arch, Optimizer};
    let psi: u64 = 1 << 20;
    let states = |o: Optimizer| {
        let mut w = presets::base("dense", Arch::Dense);
        w.params = Some(psi);
        w.optimizer = o;
        Plan::for_workload(&w).unwrap().states_peak()
    };
    let base = psi * 4 * 2; // fp32 params and gradients
    assert_eq!(states(Optimizer::Adam), base + psi * 8);
    // bitsandbytes 8-bit: two uint8 states and an fp32 absmax per 256 elements for each.
    assert_eq!(
        states(Optimizer::AdamW8bit),
        base + psi * 2 + (psi / 256) * 2 * 4
    );
    assert_eq!(
        states(Optimizer::PagedAdamW8bit),
        states(Optimizer::AdamW8bit)
    );
    // Lion: one momentum; Adafactor without factoring information: one second moment.
    assert_eq!(states(Optimizer::Lion), base + psi * 4);
    assert_eq!(states(Optimizer::Adafactor), base + psi * 4);
    // Adafactor over LoRA adapters: rows + columns of each lora_A [r, in] and lora_B [out, r].
    let mut w = llama3_workload();
    w.seq = 256;
    w.precision = Precision::Bf16;
    w.lora = Some(Lora {
        rank: 8,
        targets: vec![Target::Q, Target::V],
        alpha: None,
        dropout: 0.0,
    });
    w.optimizer = Optimizer::Adafactor;
    let plan = Plan::for_workload(&w).unwrap();
    let opt: u64 = plan
        .tensors
        .iter()
        .filter(|t| t.role == Role::Optimizer)
        .map(|t| t.bytes)
        .sum();
    // q: (8 + 4096) + (4096 + 8); v: (8 + 4096) + (1024 + 8); fp32, 32 layers.
    assert_eq!(
        opt,
        32 * 4 * ((8 + 4096 + 4096 + 8) + (8 + 4096 + 1024 + 8))
    );
}

/// bitsandbytes before 0.44 (`--bnb-version`): each 4-bit linear whose input needs a gradient
/// keeps that input on its autograd context until the graph goes. Over Llama-3-8B with LoRA on
/// q and v, that is every layer's normed inputs (q/k/v's, gate/up's) and down_proj's input;
/// o_proj's is SDPA's output, saved anyway; layer 0's q/k/v input needs no gradient (the frozen
/// embedding's output, before the first adapter). Under LitGPT's loop (`--outputs next`) a
/// steady step begins with the previous step's held inputs and logits, gone once its forward
/// returns; a first step has none.
#[test]
fn legacy_bitsandbytes_inputs_live_as_long_as_the_graph() {
    use oomprobe::workload::{Outputs, StepKind};
    let mut w = llama3_workload();
    w.seq = 256;
    w.batch = 2;
    w.kv_cache = false;
    w.precision = Precision::Bf16;
    w.lora = Some(Lora {
        rank: 8,
        targets: vec![Target::Q, Target::V],
        alpha: Some(16.0),
        dropout: 0.0,
    });
    w.quant = Some(Quant {
        double_quant: false,
        prepare: false,
        compute: Some(Precision::Bf16),
        ..Quant::bnb(QuantKind::Nf4)
    });
    let modern = Plan::for_workload(&w).unwrap();
    let mut legacy_w = w.clone();
    legacy_w.quant.as_mut().unwrap().holds_input = true;
    let legacy = Plan::for_workload(&legacy_w).unwrap();
    legacy.check_timeline().unwrap();
    let (tokens, h, i, layers) = (2 * 256u64, 4096u64, 14336u64, 32u64);
    let held = tokens * 2 * ((layers - 1) * (2 * h + i) + (h + i));
    assert_eq!(legacy.saved_bytes() - modern.saved_bytes(), held);
    // Held through the backward: its maximum grows by at least as much.
    let bwd = |p: &Plan| p.phase_max(oomprobe::plan::Phase::Backward);
    assert!(bwd(&legacy) >= bwd(&modern) + held);

    // LitGPT's loop: the previous step's inputs and logits (bf16 here: no --loss-chunk) live
    // from the forward's start until it returns. After its backward the graph is all that
    // holds its inputs, o_proj's too (measured: `bnb_legacy_measured.json`, step 1's
    // leftover).
    legacy_w.outputs = Outputs::Next;
    let next = Plan::for_workload(&legacy_w).unwrap();
    next.check_timeline().unwrap();
    let prev: u64 = next
        .tensors
        .iter()
        .filter(|t| t.name.starts_with("prev."))
        .map(|t| t.bytes)
        .sum();
    let logits = tokens * 128_256 * 2;
    let o_proj_inputs = layers * tokens * h * 2;
    assert_eq!(prev, held + o_proj_inputs + logits);
    assert!(next.peak().bytes >= legacy.saved_bytes() + prev);
    legacy_w.step = StepKind::First;
    let first = Plan::for_workload(&legacy_w).unwrap();
    assert!(first.tensors.iter().all(|t| !t.name.starts_with("prev.")));
}

/// `--framework litgpt`: LitGPT's fine-tuning defaults unless given (the chunked head, the
/// loop's held outputs, no KV cache; Fabric's 4-bit head, no k-bit preparation, bnb.nf4
/// without double quantization), refused for a model LitGPT's GPT is not planned for; its
/// adapters are in the model's type, so they and their Adam state take half PEFT's fp32.
#[test]
fn the_litgpt_framework_takes_its_scripts_defaults() {
    let p = llama3();
    let p = p.to_str().unwrap();
    let base = [
        "estimate",
        "--config",
        p,
        "--precision",
        "bf16",
        "--lora",
        "8",
    ];
    let with = |extra: &[&str]| {
        let mut a = base.to_vec();
        a.extend(extra);
        a.push("--json");
        json(&a)
    };
    let v = with(&["--quant", "nf4", "--framework", "litgpt"]);
    let w = &v["workload"];
    assert_eq!(w["framework"], "litgpt");
    assert_eq!(w["loss_chunk"], 128);
    assert_eq!(w["outputs"], "next");
    assert_eq!(w["kv_cache"], false);
    assert_eq!(w["quant"]["head"], true);
    assert_eq!(w["quant"]["prepare"], false);
    assert_eq!(w["quant"]["double_quant"], false);
    assert_eq!(w["checkpoint"]["mode"], "none");
    // Given flags win.
    let v = with(&[
        "--framework",
        "litgpt",
        "--loss-chunk",
        "0",
        "--outputs",
        "kept",
    ]);
    assert!(v["workload"]["loss_chunk"].is_null());
    assert!(v["workload"]["outputs"].is_null());
    // bf16 adapters: both Adam moments at 2 B instead of 4 (Llama-3-8B, r8 on q and v:
    // 32 layers of 8·(4096 + 4096) + 8·(4096 + 1024) parameters).
    let peft = with(&["--kv-cache", "off"]);
    let lit = with(&[
        "--framework",
        "litgpt",
        "--loss-chunk",
        "0",
        "--outputs",
        "kept",
    ]);
    let adapters = 32 * (8 * (4096 + 4096) + 8 * (4096 + 1024));
    assert_eq!(peft["breakdown"]["optimizer"], adapters * 2 * 4);
    assert_eq!(lit["breakdown"]["optimizer"], adapters * 2 * 2);
    let out = oomprobe()
        .args(["estimate", "--model", "gpt2", "--framework", "litgpt"])
        .assert()
        .code(2)
        .get_output()
        .stderr
        .clone();
    let err = String::from_utf8(out).unwrap();
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("gpt2"), "{err}");
}

/// cuBLAS's workspace (pytorch 26a3905 `CublasHandlePool.cpp`): PyTorch's default 8 MiB + 128 KiB
/// is in a CUDA step's plan from its start, 32 MiB on a Hopper `--gpu`, none with
/// `--cublas-workspace 0` or on the CPU.
#[test]
fn the_cublas_workspace_is_a_tensor_of_the_step() {
    let p = llama3();
    let p = p.to_str().unwrap();
    let workspace = |extra: &[&str]| {
        let mut a = vec![
            "estimate",
            "--config",
            p,
            "--precision",
            "bf16",
            "--seq",
            "512",
        ];
        a.extend(extra);
        a.push("--json");
        let v = json(&a);
        v["breakdown"]["workspace"].as_u64().unwrap()
    };
    let default = workspace(&[]);
    let none = workspace(&["--cublas-workspace", "0"]);
    assert_eq!(default - none, 4096 * 1024 * 2 + 16 * 1024 * 8);
    assert_eq!(workspace(&["--gpu", "h100-sxm"]) - none, 32 << 20);
    assert_eq!(workspace(&["--gpu", "a100-80gb"]) - none, default - none);
    assert_eq!(workspace(&["--autocast-device", "cpu"]), none);
}
