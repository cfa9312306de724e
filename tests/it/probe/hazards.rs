//! The hazards of real drivers, replayed on the mock backend: buffers spilled to host memory
//! (slow last buffers → `spilled`), a device lost mid-probe (`device_lost`), command buffers
//! aborted so read-backs are zeros (`verify_failed`), and staging used after the first tensor
//! (never).

use oomprobe::backend::mock::MockBackend;
use oomprobe::backend::Backend;
use oomprobe::plan::{DType, Event, EventKind, Phase, Plan, Role, TensorSpec};
use oomprobe::probe::exec::execute_plan;
use oomprobe::probe::Compute;
use oomprobe::report::Outcome;
use oomprobe::scenario::Scenario;
use oomprobe::tensor::plan_chunks;
use oomprobe::workload::presets;

const MIB: u64 = 1 << 20;

/// A real step's timeline (tiny-gpt, batch 2).
fn gpt_plan() -> Plan {
    let w = presets::get("tiny-gpt").unwrap();
    Plan::for_value(&w, Scenario::Batch, 2).unwrap()
}

/// `n` tensors of `each` bytes allocated one after the other (the peak at the last), then
/// freed: which buffers come first and last is plain.
fn stack_plan(n: usize, each: u64) -> Plan {
    let mut plan = gpt_plan();
    plan.steps.clear();
    plan.tensors = (0..n)
        .map(|i| TensorSpec {
            name: format!("t{i}"),
            role: Role::Activations,
            dtype: DType::F32,
            shape: vec![each / 4],
            bytes: each,
            row_elems: 1,
            stream: Default::default(),
            part_bytes: 0,
        })
        .collect();
    let alloc = (0..n).map(|t| Event {
        phase: Phase::Forward,
        kind: EventKind::Alloc(t),
    });
    let free = (0..n).rev().map(|t| Event {
        phase: Phase::Backward,
        kind: EventKind::Free(t),
    });
    plan.events = alloc.chain(free).collect();
    plan
}

/// A device the plan's peak fills to 2/3: near the boundary, so the spill check runs.
fn near_boundary(plan: &Plan) -> MockBackend {
    MockBackend::new(plan.peak_bytes() / 2 * 3)
}

#[test]
fn slow_last_buffers_are_spilled_not_a_fit() {
    let plan = stack_plan(8, MIB);
    // Past 4 MiB in use the "driver" places buffers in host memory, 20× slower.
    let mut b = near_boundary(&plan).spill_after(4 * MIB, 20.0);
    let rec = execute_plan(&mut b, &plan, Compute::Touch);
    assert_eq!(rec.outcome, Outcome::Spilled, "{rec:?}");
    assert!(!rec.outcome.is_fit());
    let s = rec.spill.as_ref().expect("the spill check ran");
    assert!(s.spilled);
    assert_eq!(s.sample_bytes, 4 * MIB, "half the live bytes on each side");
    assert!((s.ratio() - 20.0).abs() < 1e-6, "{s:?}");
    assert!(rec.detail.unwrap().contains("host-link"));
    assert_eq!(b.allocated_bytes(), 0, "everything freed");
}

#[test]
fn equal_speeds_are_a_fit_with_the_check_recorded() {
    let plan = stack_plan(8, MIB);
    let mut b = near_boundary(&plan).spill_after(4 * MIB, 1.0);
    let rec = execute_plan(&mut b, &plan, Compute::Touch);
    assert_eq!(rec.outcome, Outcome::Fit, "{rec:?}");
    let s = rec.spill.expect("the spill check ran");
    assert!(!s.spilled && (s.ratio() - 1.0).abs() < 1e-9, "{s:?}");
    assert!(s.reason.starts_with("device memory"), "{}", s.reason);
}

#[test]
fn memory_counted_outside_the_device_heap_is_spilled_even_at_full_speed() {
    let plan = stack_plan(8, MIB);
    let mut b = near_boundary(&plan)
        .spill_after(4 * MIB, 1.0)
        .report_heaps();
    let rec = execute_plan(&mut b, &plan, Compute::Touch);
    assert_eq!(rec.outcome, Outcome::Spilled, "{rec:?}");
    assert!(rec
        .detail
        .unwrap()
        .contains("outside the device-local heap"));
}

#[test]
fn far_from_the_boundary_there_is_no_check() {
    if std::env::var_os(oomprobe::probe::spill::SPILL_CHECK_ENV).is_some() {
        return;
    }
    let plan = stack_plan(8, MIB);
    let mut b = MockBackend::new(plan.peak_bytes() * 4).spill_after(4 * MIB, 20.0);
    let rec = execute_plan(&mut b, &plan, Compute::Touch);
    assert_eq!(rec.outcome, Outcome::Fit);
    assert!(rec.spill.is_none());
}

#[test]
fn a_device_lost_mid_probe_is_device_lost_never_a_fit() {
    let plan = gpt_plan();
    for at in [0, 5, 40] {
        let mut b = MockBackend::new(1 << 30).lose_device_at_dispatch(at);
        let rec = execute_plan(&mut b, &plan, Compute::Touch);
        assert_eq!(
            rec.outcome,
            Outcome::DeviceLost,
            "lost at dispatch {at}: {rec:?}"
        );
        assert!(rec.failed_at.is_some());
        assert_eq!(b.allocated_bytes(), 0, "everything freed after the loss");
    }
}

#[test]
fn zeros_on_read_back_are_verify_failed_never_a_fit() {
    let plan = gpt_plan();
    // From the 10th launch on, command buffers abort and read back as zeros (Metal).
    let mut b = MockBackend::new(1 << 30).abort_at_dispatch(10);
    let rec = execute_plan(&mut b, &plan, Compute::Touch);
    assert_eq!(rec.outcome, Outcome::VerifyFailed, "{rec:?}");
    let detail = rec.detail.unwrap();
    assert!(
        detail.starts_with("verify failed: possible OOM/watchdog"),
        "{detail}"
    );
}

#[test]
fn a_pattern_overwritten_with_zeros_or_damaged_is_verify_failed_and_says_which() {
    use oomprobe::ops::words;
    use oomprobe::probe::readback;
    let mut b = MockBackend::new(1 << 20);
    let t = oomprobe::tensor::allocate(&mut b, "t", DType::F32, 256, 1).unwrap();
    words::fill_tensor(&mut b, &t, 3).unwrap();
    b.write_buffer(t.chunks[0].buffer, 0, &[0; 1024]).unwrap();
    let v = words::verify_tensor(&mut b, &t, 3).unwrap();
    let c = words::checksum_tensor(&mut b, &t).unwrap();
    let zeros = readback::all_zero(&c, t.words());
    assert_eq!(
        readback::verify_failure("t", t.words(), v, Some(zeros)).0,
        Outcome::VerifyFailed
    );
    b.write_buffer(t.chunks[0].buffer, 0, &[1; 4]).unwrap();
    let v = words::verify_tensor(&mut b, &t, 3).unwrap();
    let c = words::checksum_tensor(&mut b, &t).unwrap();
    let zeros = readback::all_zero(&c, t.words());
    // Damage other than zeros (GL at the edge of an address-space limit) is an outcome too.
    let (o, detail) = readback::verify_failure("t", t.words(), v, Some(zeros));
    assert_eq!(o, Outcome::VerifyFailed);
    assert!(detail.contains("corrupted"), "{detail}");
}

#[test]
fn no_staging_and_no_buffer_but_tensors_after_the_first_tensor() {
    let plan = gpt_plan();
    let mut b = MockBackend::new(1 << 30);
    let rec = execute_plan(&mut b, &plan, Compute::Touch);
    assert_eq!(rec.outcome, Outcome::Fit, "{rec:?}");
    assert_eq!(
        b.staging_after_prepare(),
        0,
        "staging used after the first tensor"
    );
    let max = b.info().max_chunk_bytes();
    let chunks: u64 = plan
        .tensors
        .iter()
        .map(|t| {
            let layout = plan_chunks(t.elems(), t.dtype.bytes(), t.row_elems, max).unwrap();
            layout.len() as u64
        })
        .sum();
    assert_eq!(
        b.allocs_after_prepare, chunks,
        "every allocation after prepare is a tensor chunk"
    );
}

#[test]
fn the_mock_counts_staging_after_prepare() {
    // The counter the test above relies on does count: a large write after prepare.
    let mut b = MockBackend::new(1 << 20);
    let id = b.alloc_buffer(4096).unwrap();
    b.write_buffer(id, 0, &[0; 4096]).unwrap();
    assert_eq!(b.staging_after_prepare(), 0, "before prepare it is allowed");
    b.prepare(&[]).unwrap();
    b.write_buffer(id, 0, &[0; 16]).unwrap();
    assert_eq!(
        b.staging_after_prepare(),
        0,
        "small writes use the prepared staging"
    );
    b.write_buffer(id, 0, &[0; 4096]).unwrap();
    b.read_buffer(id, 0, 4096).unwrap();
    assert_eq!(b.staging_after_prepare(), 2);
}
