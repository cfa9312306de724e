//! Execute one plan on a Backend: allocate every tensor in order, write and verify every byte,
//! run the plan's kernels (full mode), read back a checksum, free. OOM is a result, not an error.

use std::time::Instant;

use crate::backend::{AllocError, Backend, BackendError};
use crate::ops;
use crate::plan::Plan;
use crate::report::{Outcome, ProbeRecord};
use crate::tensor::{self, DeviceTensor};

use super::Compute;

/// The outcome a failed allocation stands for.
pub fn outcome_of_alloc(e: &AllocError) -> Outcome {
    match e {
        AllocError::OutOfMemory { .. } => Outcome::OutOfMemory,
        AllocError::ExceedsLimit { .. } => Outcome::ExceedsLimit,
        AllocError::Budget { .. } => Outcome::Budget,
        AllocError::DeviceLost(_) => Outcome::DeviceLost,
        AllocError::Other(_) => Outcome::Error,
    }
}

/// The outcome a failed dispatch, copy or synchronisation stands for.
pub fn outcome_of_backend(e: &BackendError) -> Outcome {
    match e {
        BackendError::OutOfMemory(_) => Outcome::OutOfMemory,
        BackendError::Budget(_) => Outcome::Budget,
        BackendError::DeviceLost(_) => Outcome::DeviceLost,
        BackendError::Other(_) => Outcome::Error,
    }
}

/// Run one probe of `plan` on `backend`. Always frees what it allocated before returning.
pub fn execute_plan(backend: &mut dyn Backend, plan: &Plan, compute: Compute) -> ProbeRecord {
    let started = Instant::now();
    let bytes = plan.total_bytes();
    let mut record = ProbeRecord {
        value: plan.value,
        outcome: Outcome::Fit,
        bytes,
        bytes_allocated: 0,
        failed_tensor: None,
        seconds: 0.0,
        step_seconds: None,
        checksum: None,
        detail: None,
    };

    let mut tensors: Vec<DeviceTensor> = Vec::with_capacity(plan.tensors.len());
    for spec in &plan.tensors {
        match tensor::allocate_tensor(backend, spec) {
            Ok(t) => tensors.push(t),
            Err(e) => {
                record.outcome = outcome_of_alloc(&e);
                record.failed_tensor = Some(spec.name.clone());
                record.detail = Some(e.to_string());
                break;
            }
        }
    }
    record.bytes_allocated = backend.allocated_bytes();

    if record.outcome.is_fit() {
        let step_started = Instant::now();
        match run_step(backend, plan, &tensors, compute) {
            Ok(check) => {
                record.checksum = Some(match compute {
                    Compute::Full => format!("{check:016x}"),
                    Compute::Touch => format!("verified {check} words"),
                });
                record.step_seconds = Some(step_started.elapsed().as_secs_f64());
            }
            Err((outcome, detail)) => {
                record.outcome = outcome;
                record.detail = Some(detail);
            }
        }
    }

    for t in tensors {
        tensor::free_tensor(backend, t);
    }
    record.seconds = started.elapsed().as_secs_f64();
    record
}

/// Fill and verify every tensor; in full mode run the kernels and fold the tensors' checksums.
/// Returns the folded checksum (full) or the number of words verified (touch).
fn run_step(
    backend: &mut dyn Backend,
    plan: &Plan,
    tensors: &[DeviceTensor],
    compute: Compute,
) -> Result<u64, (Outcome, String)> {
    let fail = |e: BackendError| (outcome_of_backend(&e), e.to_string());
    for (i, t) in tensors.iter().enumerate() {
        ops::words::fill_tensor(backend, t, seed_of(i)).map_err(fail)?;
    }
    for (i, t) in tensors.iter().enumerate() {
        let v = ops::words::verify_tensor(backend, t, seed_of(i)).map_err(fail)?;
        let expected = t.words();
        if v.words_seen != expected || v.mismatches != 0 {
            return Err((
                Outcome::Error,
                format!(
                    "tensor {} read back wrong: {} of {} words seen, {} mismatches",
                    plan.tensors[i].name, v.words_seen, expected, v.mismatches
                ),
            ));
        }
    }
    if compute == Compute::Full {
        for step in &plan.steps {
            ops::compute::run_step(backend, step, tensors).map_err(fail)?;
        }
    }
    backend.synchronize().map_err(fail)?;
    if compute == Compute::Touch {
        // Verify has read every word back; its count is the check.
        let words: u64 = tensors.iter().map(|t| t.words()).sum();
        return Ok(words);
    }
    let mut folded: u64 = 0;
    for t in tensors {
        let c = ops::words::checksum_tensor(backend, t).map_err(fail)?;
        folded = folded.rotate_left(7) ^ c.sum;
    }
    Ok(folded)
}

/// The fill seed of the i-th tensor: distinct per tensor so a mixed-up buffer is caught.
fn seed_of(i: usize) -> u32 {
    0x9e37_79b9u32.wrapping_mul(i as u32 + 1)
}
