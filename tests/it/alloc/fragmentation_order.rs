//! The caching allocator's reserved pool over a step, as PyTorch's own request sequence gives it
//! (`tests/fixtures/fragmentation_order.json`, `validation/fragmentation_order.py`): the real
//! allocations and frees of two training steps on the CPU, put through CUDACachingAllocator's
//! rules, against oomprobe's replay of its plan of the same step. A piece's model states are one
//! plan tensor and one PyTorch tensor per parameter; asked for as one block each, the replay
//! reserved 4 to 6 % (BERT-large) and 14 % (a grouped-query LLaMA) more than the real sequence;
//! one block per parameter, within 2 % (0.1 to 1.8 %).

use oomprobe::alloc::{timeline, AllocConf};
use oomprobe::plan::Plan;
use serde_json::Value;

#[test]
fn the_replayed_pool_is_the_real_request_sequences() {
    let path = format!(
        "{}/tests/fixtures/fragmentation_order.json",
        env!("CARGO_MANIFEST_DIR")
    );
    let fx: Value = serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
    let rows = fx["rows"].as_array().unwrap();
    assert!(rows.len() >= 3, "{} rows", rows.len());
    let mut bad = Vec::new();
    for r in rows {
        let (real, plan) = (&r["real"], &r["plan"]);
        let flags = plan["flags"].as_str().unwrap();
        let steps = r["shape"]["steps"].as_u64().unwrap() as usize;
        let p = Plan::for_workload(&crate::support::flags::workload(flags)).unwrap();
        let got = timeline::replay(&p, &AllocConf::default(), None, steps, false);
        let rel = |a: u64, b: u64| (a as f64 - b as f64) / b as f64;
        let reserved = rel(
            got.reserved_peak_bytes,
            real["reserved_peak_bytes"].as_u64().unwrap(),
        );
        let tensors = rel(
            p.peak().bytes,
            real["allocated_peak_bytes"].as_u64().unwrap(),
        );
        // What the same plan reserved as one block per tensor: the test would see it.
        let whole = rel(
            r["plan_whole_tensors"]["reserved_peak_bytes"]
                .as_u64()
                .unwrap(),
            real["reserved_peak_bytes"].as_u64().unwrap(),
        );
        println!("{flags}: reserved {reserved:+.4}, tensors {tensors:+.4}, whole {whole:+.4}");
        if reserved.abs() > 0.02 || tensors.abs() > 0.03 || whole.abs() < reserved.abs() + 0.02 {
            bad.push(format!(
                "{flags}: reserved {reserved:+.4} (2 %), tensors {tensors:+.4} (3 %), whole tensors {whole:+.4}"
            ));
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n"));
}
