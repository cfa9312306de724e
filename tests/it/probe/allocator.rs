//! `--allocator pytorch` on the mock backend: the probe takes segments from the device and
//! places every tensor in them with the one allocator model, for the steps that model replays,
//! so a probe's outcome and the segments it held are what `estimate`'s replay of the same plan
//! says, on every capacity around the boundary; and it needs more than the direct probe.

use oomprobe::alloc::{timeline, AllocConf};
use oomprobe::backend::mock::MockBackend;
use oomprobe::backend::pooled::PooledBackend;
use oomprobe::backend::Backend;
use oomprobe::plan::Plan;
use oomprobe::probe::exec::execute_plan;
use oomprobe::probe::Compute;
use oomprobe::report::Outcome;
use oomprobe::scenario::Scenario;
use oomprobe::workload::presets;

const MIB: u64 = 1 << 20;
/// The probe's verify/checksum result: one more small block, in the small pool's first
/// segment (a plan whose tensors are all large needs that 2 MiB segment for it alone).
const SMALL_SEGMENT: u64 = 2 * MIB;

fn plan(preset: &str, scenario: Scenario, value: u64) -> Plan {
    let w = presets::get(preset).unwrap();
    Plan::for_value(&w, scenario, value).unwrap()
}

fn mock(capacity: u64) -> MockBackend {
    MockBackend::with_limits(capacity, 1 << 34, 1 << 34)
}

fn pooled(capacity: u64, conf: &AllocConf) -> PooledBackend {
    PooledBackend::new(Box::new(mock(capacity)), conf.clone()).unwrap()
}

/// Whether the plan has a tensor that goes to the small pool (≤ 1 MiB).
fn has_small(p: &Plan) -> bool {
    p.tensors.iter().any(|t| t.bytes <= MIB)
}

#[test]
fn the_probe_holds_the_segments_the_model_says_and_fits_exactly_where_it_says() {
    for (preset, scenario, value, conf) in [
        ("tiny-gpt", Scenario::Batch, 4, ""),
        ("tiny-gpt", Scenario::Batch, 48, ""),
        ("tiny-gpt", Scenario::Batch, 160, "max_split_size_mb:20"),
        (
            "tiny-gpt",
            Scenario::Batch,
            40,
            "roundup_power2_divisions:4",
        ),
        // Step 2 needs 12 MiB more segments than step 1 (the cache step 1 left is split
        // otherwise than a fresh one would be): a one-step probe would pass where PyTorch fails.
        ("tiny-gpt", Scenario::Batch, 96, ""),
    ] {
        let conf = oomprobe::alloc::conf::parse(conf).unwrap();
        let p = plan(preset, scenario, value);
        let free = timeline::replay(&p, &conf, None, timeline::STEPS, false);
        if value == 96 {
            let one = timeline::replay(&p, &conf, None, 1, false);
            assert!(free.reserved_peak_bytes > one.reserved_peak_bytes);
        }
        let extra = if has_small(&p) { 0 } else { SMALL_SEGMENT };
        let rec = execute_plan(&mut pooled(1 << 34, &conf), &p, Compute::Touch);
        assert_eq!(rec.outcome, Outcome::Fit, "{preset}: {:?}", rec.detail);
        assert_eq!(
            rec.bytes_allocated,
            free.reserved_peak_bytes + extra,
            "{preset} {:?}: the probe's segments at its peak are the model's reserved peak",
            conf.text
        );
        // The least capacity the model fits in (below the unlimited reserved peak where the
        // allocator frees its cache and retries) ...
        let hi = timeline::least_capacity(&p, &conf, timeline::STEPS);
        // ... and around it, in 1 MiB steps: fit and OOM agree with the model everywhere.
        let need = hi + extra;
        let mut seen = [false; 2];
        for capacity in
            (need.saturating_sub(4 * MIB).max(extra)..need + 4 * MIB).step_by(MIB as usize)
        {
            let model = timeline::replay(&p, &conf, Some(capacity - extra), timeline::STEPS, false);
            let rec = execute_plan(&mut pooled(capacity, &conf), &p, Compute::Touch);
            let fit = rec.outcome == Outcome::Fit;
            seen[usize::from(fit)] = true;
            assert_eq!(
                fit,
                model.fits(),
                "{preset} {:?} on {capacity} bytes: probe {:?} ({:?}), model {:?}",
                conf.text,
                rec.outcome,
                rec.detail,
                model.failure
            );
            if !fit {
                assert_eq!(rec.outcome, Outcome::OutOfMemory);
                let d = rec.detail.unwrap_or_default();
                assert!(d.contains("caching allocator: tried to allocate"), "{d}");
            }
        }
        assert_eq!(
            seen,
            [true, true],
            "{preset} {value}: the sweep crosses the boundary at {need}"
        );
    }
}

#[test]
fn segments_cost_more_than_tensors_so_the_pytorch_boundary_is_below_the_direct_one() {
    let p = plan("tiny-gpt", Scenario::Batch, 48);
    let conf = AllocConf::default();
    // The direct probe needs the tensors' peak; PyTorch's allocator needs its reserved peak.
    let direct_need = {
        let rec = execute_plan(&mut mock(1 << 34), &p, Compute::Touch);
        assert_eq!(rec.outcome, Outcome::Fit);
        rec.bytes_allocated
    };
    let rec = execute_plan(&mut pooled(1 << 34, &conf), &p, Compute::Touch);
    assert!(
        rec.bytes_allocated > direct_need,
        "reserved {} vs tensors {}",
        rec.bytes_allocated,
        direct_need
    );
    // On a card with room for the tensors but not the segments: direct fits, pytorch does not.
    let between = (direct_need + rec.bytes_allocated) / 2;
    assert_eq!(
        execute_plan(&mut mock(between), &p, Compute::Touch).outcome,
        Outcome::Fit
    );
    assert_eq!(
        execute_plan(&mut pooled(between, &conf), &p, Compute::Touch).outcome,
        Outcome::OutOfMemory
    );
}

#[test]
fn every_tensor_byte_is_written_and_read_back_inside_shared_segments() {
    // Touch mode fills each tensor with its own pattern and verifies it when freed: tensors
    // packed into shared segments must not overwrite each other.
    let p = plan("tiny-gpt", Scenario::Batch, 2);
    let mut b = pooled(1 << 30, &AllocConf::default());
    let rec = execute_plan(&mut b, &p, Compute::Touch);
    assert_eq!(rec.outcome, Outcome::Fit, "{:?}", rec.detail);
    assert!(rec.checksum.is_some());
    let s = b.allocator_stats().unwrap();
    assert_eq!(s.allocated, 0, "every block freed at the end");
    assert!(s.segments >= 1 && s.reserved >= SMALL_SEGMENT);
}

/// FSDP2's all-gather and reduce-scatter outputs come from their own streams' pools (`Stream`):
/// the model reserves more than one shared pool would, and the probe's pooled backend holds
/// the segments the model says.
#[test]
fn fsdp_streams_keep_their_own_pools_in_the_model_and_the_probe() {
    use oomprobe::plan::Stream;
    use oomprobe::workload::parallel::Fsdp;
    let mut w = presets::get("tiny-gpt").unwrap();
    w.gpus = 2;
    w.parallel.fsdp = Some(Fsdp::Full);
    let p = Plan::for_value(&w, Scenario::Batch, 16).unwrap();
    for s in [Stream::AllGather, Stream::ReduceScatter] {
        assert!(p.tensors.iter().any(|t| t.stream == s), "{s:?}");
    }
    let conf = AllocConf::default();
    let split = timeline::replay(&p, &conf, None, timeline::STEPS, false);
    let mut one = p.clone();
    for t in &mut one.tensors {
        t.stream = Stream::Compute;
    }
    let shared = timeline::replay(&one, &conf, None, timeline::STEPS, false);
    assert!(
        split.reserved_peak_bytes > shared.reserved_peak_bytes,
        "per-stream pools {} vs one pool {}",
        split.reserved_peak_bytes,
        shared.reserved_peak_bytes
    );
    let extra = if has_small(&p) { 0 } else { SMALL_SEGMENT };
    let rec = execute_plan(&mut pooled(1 << 34, &conf), &p, Compute::Touch);
    assert_eq!(rec.outcome, Outcome::Fit, "{:?}", rec.detail);
    assert_eq!(rec.bytes_allocated, split.reserved_peak_bytes + extra);
}
