//! Rank plans against PyTorch distributed: every rank of every row of
//! `tests/fixtures/distributed.json` (measured on CPU over gloo by `validation/distributed.py`:
//! DDP with and without bucket views, FSDP2 resharding and not, tensor parallelism with a
//! replicated head and with sequence parallelism, a 2-stage 1F1B and GPipe pipeline, and the
//! one-device reference) must be reproduced by that rank's plan: the first and the steady
//! step's peak within 2 %, in the phase PyTorch peaked in. No torch is needed here.

use clap::Parser;
use oomprobe::cli::WorkloadArgs;
use oomprobe::plan::Plan;
use serde_json::Value;

#[derive(Parser)]
struct Flags {
    #[command(flatten)]
    w: WorkloadArgs,
}

fn load(name: &str) -> Value {
    let path = format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"));
    serde_json::from_str(&std::fs::read_to_string(path).expect("fixture")).expect("JSON")
}

fn fixture() -> Value {
    load("distributed.json")
}

/// The oomprobe flags of a row's layout, at rank `rank`: its model (the LLaMA-style mini of
/// `validation/measure.py`, its attention kernel, fp32, CPU kernels, foreach Adam, gradients freed)
/// and the layout as the frameworks name it. `--batch` is one rank's micro-batch.
fn flags(r: &Value, rank: u64, step: &str) -> Vec<String> {
    let m = &r["model"];
    let l = &r["layout"];
    let n = |v: &Value| v.as_u64().unwrap();
    let mb = l["microbatches"].as_u64().unwrap_or(1).max(1);
    let mut f: Vec<String> = format!(
        "x --model llama-7b --layers {} --hidden {} --heads {} --kv-heads {} --ffn {} --vocab {} \
         --attention {} --precision fp32 --autocast-device cpu --optimizer-impl foreach \
         --grads free --batch {} --seq {} --step {step}",
        n(&m["layers"]),
        n(&m["hidden"]),
        n(&m["heads"]),
        n(&m["kv_heads"]),
        n(&m["ffn"]),
        n(&m["vocab"]),
        m["attn_implementation"].as_str().unwrap_or("eager"),
        n(&m["batch"]) / mb,
        n(&m["seq"]),
    )
    .split_whitespace()
    .map(String::from)
    .collect();
    let world = n(&l["world"]);
    // Every decoder layer checkpointed (torch's checkpoint_wrapper, non-reentrant).
    if l["checkpoint"].is_string() {
        f.extend(["--checkpoint".into(), "full".into()]);
    }
    // FSDP2's MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): `amp-bf16` with FSDP.
    if l["mp_param_dtype"].as_str() == Some("bfloat16") {
        let i = f.iter().position(|a| a == "fp32").unwrap();
        f[i] = "amp-bf16".into();
    }
    let mut add = |s: String| f.extend(s.split_whitespace().map(String::from));
    match l["kind"].as_str().unwrap() {
        "single" => return f,
        "ddp" => {
            add(format!("--gpus {world} --ddp {}", n(&l["bucket_cap_mb"])));
            if l["gradient_as_bucket_view"].as_bool() == Some(true) {
                add("--bucket-view on".into());
            }
        }
        "fsdp2" => {
            let on = l["reshard_after_forward"].as_bool().unwrap();
            add(format!(
                "--gpus {world} --fsdp full --reshard-after-forward {}",
                if on { "on" } else { "off" }
            ));
        }
        "fsdp1" => {
            let strategy = match l["sharding_strategy"].as_str().unwrap() {
                "FULL_SHARD" => "full",
                "SHARD_GRAD_OP" => "shard-grad-op",
                other => panic!("FSDP1 {other} is not planned"),
            };
            add(format!("--gpus {world} --fsdp {strategy} --fsdp-version 1"));
            add(format!(
                "--backward-prefetch {}",
                match l["backward_prefetch"].as_str() {
                    Some("BACKWARD_PRE") => "pre",
                    Some("BACKWARD_POST") => "post",
                    None => "none",
                    Some(other) => panic!("backward_prefetch {other}"),
                }
            ));
            // PEFT's LoRA inside the flat parameters (use_orig_params).
            if let Some(lora) = l["lora"].as_object() {
                let targets: Vec<&str> = lora["targets"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|t| t.as_str().unwrap())
                    .collect();
                add(format!(
                    "--lora {} --lora-alpha {} --lora-dropout {} --lora-targets {}",
                    lora["r"],
                    lora["alpha"],
                    lora["dropout"],
                    targets.join(",")
                ));
                // The CPU's dropout saves its noise in the input's type.
                if lora["dropout"].as_f64().unwrap() > 0.0 {
                    add("--dropout-mask input".into());
                }
            }
        }
        "tp" => {
            let head = l["lm_head_placement"].as_str().unwrap_or("").to_lowercase();
            let head = if head.contains("replicated") {
                "replicated"
            } else if head.contains("full logits") {
                "gathered"
            } else {
                "sharded"
            };
            add(format!("--tp {} --tp-head {head}", n(&l["tp"])));
            if l["sp"].as_bool() == Some(true) {
                add("--sequence-parallel on".into());
            }
        }
        "pp" => {
            let sched = l["schedule"].as_str().unwrap().to_lowercase();
            if sched.starts_with("interleaved") {
                add(format!(
                    "--pp {} --microbatches {mb} --schedule interleaved --chunks {}",
                    n(&l["pp"]),
                    n(&l["chunks"])
                ));
            } else {
                add(format!(
                    "--pp {} --microbatches {mb} --schedule {sched}",
                    n(&l["pp"])
                ));
            }
        }
        other => panic!("unknown layout {other}"),
    }
    add(format!("--rank {rank}"));
    f
}

/// The interleaved schedule: planned at whole-stage granularity (a rank's micro-batches in
/// flight rounded up from Narayanan's chunk count), which PyTorch's ScheduleInterleaved1F1B
/// does not follow (it holds half-stages of micro-batches).
fn interleaved(r: &Value) -> bool {
    r["layout"]["schedule"]
        .as_str()
        .is_some_and(|s| s.to_lowercase().starts_with("interleaved"))
}

fn plan(args: &[String]) -> Plan {
    let a = Flags::try_parse_from(args).unwrap_or_else(|e| panic!("{args:?}: {e}"));
    let w = oomprobe::resolve::resolve(&a.w, "gpt2")
        .unwrap_or_else(|e| panic!("{args:?}: {e}"))
        .workload;
    let p = Plan::for_workload(&w).unwrap();
    p.check_timeline().unwrap();
    p
}

/// Every rank's step peak and each phase's maximum (forward, backward, optimizer) within 2 %,
/// the peak in PyTorch's phase; returns the failures and the count of checks.
fn check(fx: &Value) -> (Vec<String>, usize) {
    let mut failures = Vec::new();
    let mut checked = 0;
    for r in fx["rows"].as_array().unwrap() {
        let id = r["id"].as_str().unwrap();
        if interleaved(r) {
            continue; // a known miss, held apart below
        }
        for k in r["ranks"].as_array().unwrap() {
            let rank = k["rank"].as_u64().unwrap();
            for step in ["first", "steady"] {
                let p = plan(&flags(r, rank, step));
                let peak = p.peak();
                let measured = k[format!("train_foreach_free_{step}_peak_bytes")]
                    .as_u64()
                    .unwrap();
                let phase = k[format!("train_foreach_free_{step}_peak_phase")]
                    .as_str()
                    .unwrap();
                let err = (peak.bytes as f64 - measured as f64) / measured as f64;
                let got = peak.phase.map_or("", |p| p.name());
                checked += 1;
                if std::env::var_os("OOMPROBE_DISTRIBUTED_TABLE").is_some() {
                    println!(
                        "| {id} | {rank} | {step} | {measured} | {} | {:+.2} % |",
                        peak.bytes,
                        err * 100.0
                    );
                }
                if err.abs() > 0.02 || got != phase {
                    failures.push(format!(
                        "{id} rank {rank} {step}: measured {measured} in {phase}, planned {} in {got} ({:+.2} %)",
                        peak.bytes,
                        err * 100.0
                    ));
                }
                use oomprobe::plan::Phase;
                for (name, ph) in [
                    ("forward", Phase::Forward),
                    ("backward", Phase::Backward),
                    ("optimizer", Phase::Optimizer),
                ] {
                    let key = format!("train_foreach_free_{step}_{name}_max_bytes");
                    let Some(m) = k[key.as_str()].as_u64().filter(|&m| m > 0) else {
                        continue;
                    };
                    let got = p.phase_max(ph);
                    let err = (got as f64 - m as f64) / m as f64;
                    checked += 1;
                    // FSDP1 with adapters: a rank's Adam state is the adapters' elements in its
                    // slice of each flat parameter, which PEFT puts near the front (the held-out
                    // row's rank 0 holds all of it); the plan gives each rank an even share.
                    let uneven = ph == Phase::Optimizer
                        && r["layout"]["kind"] == "fsdp1"
                        && r["layout"]["lora"].is_object();
                    let tol = if uneven { 0.04 } else { 0.02 };
                    if err.abs() > tol {
                        failures.push(format!(
                            "{id} rank {rank} {step} {name} max: measured {m}, planned {got} ({:+.2} %)",
                            err * 100.0
                        ));
                    }
                }
            }
        }
    }
    (failures, checked)
}

#[test]
fn every_rank_of_every_layout_is_reproduced() {
    let (failures, checked) = check(&fixture());
    assert!(checked >= 100, "only {checked} checks in the fixture");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The held-out rows (`validation/distributed.py --holdout`: a wider 6-layer LLaMA-style model,
/// DDP with 1 MiB buckets, FSDP2 over 4 ranks, TP with and without SP, a 3-stage 1F1B pipeline
/// with 6 micro-batches), measured after the model above was built; and issue 45's two
/// reported misses measured on our shapes (FSDP2 under transformers' gradient checkpointing on
/// 2 and 4 ranks and on the mini, TP + SP with SDPA at b2 s512).
#[test]
fn held_out_layouts_are_reproduced() {
    let (failures, checked) = check(&load("distributed_holdout.json"));
    assert!(checked >= 110, "only {checked} checks in the holdout");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// FSDP1 (`validation/distributed.py --fsdp1`, `validation/fsdp1_notes.md`): FULL_SHARD and
/// SHARD_GRAD_OP, with and without `use_orig_params`, bf16 mixed precision, checkpointed layers,
/// with and without `limit_all_gathers` and `forward_prefetch`, and the held-out rows (a wider
/// model over 4 ranks, an odd-sized one whose flat parameters are padded). Not planned, so not
/// checked: NO_SHARD (FSDP1 deprecates it for DDP), frozen parameters without adapters, LoRA
/// under mixed precision (refused: adapters under `amp-*` are not modelled),
/// and one unit for the whole model (Lightning's default without a wrap policy). Backward
/// prefetch is checked as BACKWARD_PRE (torch's default), BACKWARD_POST and none
/// (Accelerate's and the Trainer's default, `--backward-prefetch`).
fn fsdp1_rows(name: &str) -> Value {
    let mut fx = load(name);
    let planned = |r: &Value| {
        let l = &r["layout"];
        l["sharding_strategy"] != "NO_SHARD"
            && (l["frozen"].is_null() || l["lora"].is_object())
            && !(l["lora"].is_object() && l["mp_param_dtype"].is_string())
            && !l["auto_wrap_policy"].is_null()
    };
    let rows: Vec<Value> = fx["rows"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| planned(r))
        .cloned()
        .collect();
    fx["rows"] = Value::Array(rows);
    fx
}

#[test]
fn fsdp1_ranks_are_reproduced() {
    let (failures, checked) = check(&fsdp1_rows("fsdp1_measured.json"));
    assert!(checked >= 60, "only {checked} FSDP1 checks");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

#[test]
fn fsdp1_held_out_ranks_are_reproduced() {
    let (failures, checked) = check(&fsdp1_rows("fsdp1_holdout.json"));
    assert!(checked >= 40, "only {checked} held-out FSDP1 checks");
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// The layouts differ from one device by what PyTorch measured, and the plans follow: DDP adds
/// its buckets, FSDP2 and tensor parallelism take memory away, pipeline ranks differ.
#[test]
fn layouts_move_the_peak_the_way_pytorch_measured() {
    let fx = fixture();
    let row = |id: &str| {
        fx["rows"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["id"] == id)
            .unwrap_or_else(|| panic!("no row {id}"))
            .clone()
    };
    let peak = |id: &str, rank: u64| plan(&flags(&row(id), rank, "steady")).peak().bytes;
    let single = peak("single", 0);
    assert!(peak("ddp", 0) > single);
    assert!(peak("fsdp2", 0) < single);
    assert!(peak("fsdp2-no-reshard", 0) > peak("fsdp2", 0));
    assert!(peak("tp", 0) < single);
    assert!(peak("tp-sp", 0) < peak("tp", 0));
    assert!(peak("pp-1f1b", 1) > peak("pp-1f1b", 0));
    assert!(peak("pp-gpipe", 1) > peak("pp-1f1b", 1));
}

/// The known miss: the interleaved 1F1B row (2 ranks × 2 chunks, 4 micro-batches) is planned
/// above what PyTorch measured on every rank (+8 % and +31 % at the peaks, measured after
/// the model), never below: a conservative answer, not a 2 % one.
#[test]
fn the_interleaved_schedule_is_over_planned_not_under() {
    let fx = fixture();
    let rows: Vec<&Value> = fx["rows"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|r| interleaved(r))
        .collect();
    assert!(!rows.is_empty(), "no interleaved row");
    for r in rows {
        for k in r["ranks"].as_array().unwrap() {
            let rank = k["rank"].as_u64().unwrap();
            for step in ["first", "steady"] {
                let m = k[format!("train_foreach_free_{step}_peak_bytes")]
                    .as_u64()
                    .unwrap();
                let p = plan(&flags(r, rank, step)).peak().bytes;
                assert!(
                    p >= m && (p as f64) < 1.35 * m as f64,
                    "rank {rank} {step}: measured {m}, planned {p}"
                );
            }
        }
    }
}
