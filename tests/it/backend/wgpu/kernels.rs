//! Every compute kernel on the wgpu adapter at hand (lavapipe in CI) against its f64 CPU
//! reference: fresh random inputs, outputs poisoned with NaN first, f32 / f16 / bf16 storage,
//! and tensors cut into many small chunks so kernels run across buffer boundaries. The checks
//! live in `support::kernel_checks` (shared with `backend::cuda::kernels`); this file opens the
//! adapter and runs each one.

use std::sync::{Mutex, MutexGuard, OnceLock};

use crate::support::kernel_checks::{self as kc, SMALL_CHUNK};

use oomprobe::backend::wgpu::{AdapterSelector, WgpuBackend};

const NO_ADAPTER: &str = "no wgpu adapter: install a GPU driver or the software Vulkan driver \
                          (apt-get install -y mesa-vulkan-drivers libvulkan1)";

fn open(cap: Option<u64>) -> Mutex<WgpuBackend> {
    let mut b = match WgpuBackend::open(AdapterSelector::Auto) {
        Ok(b) => b,
        Err(e) => panic!("{NO_ADAPTER}: {e}"),
    };
    if let Some(c) = cap {
        b.cap_max_buffer(c);
    }
    Mutex::new(b)
}

/// The adapter with its full limits (shared by the tests, one at a time).
fn device() -> MutexGuard<'static, WgpuBackend> {
    static D: OnceLock<Mutex<WgpuBackend>> = OnceLock::new();
    let m = D.get_or_init(|| open(None));
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The same adapter with buffers capped at `SMALL_CHUNK` bytes.
fn small_device() -> MutexGuard<'static, WgpuBackend> {
    static D: OnceLock<Mutex<WgpuBackend>> = OnceLock::new();
    let m = D.get_or_init(|| open(Some(SMALL_CHUNK)));
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[test]
fn matmul_matches_reference() {
    let (mut full, mut chunked) = (device(), small_device());
    kc::matmul_matches_reference(&mut *full, &mut *chunked);
}

#[test]
fn matmul_with_b_past_one_chunk_is_an_error() {
    kc::matmul_with_b_past_one_chunk_is_an_error(&mut *small_device());
}

#[test]
fn row_kernels_match_reference() {
    let (mut full, mut chunked) = (device(), small_device());
    kc::row_kernels_match_reference(&mut *full, &mut *chunked);
}

#[test]
fn causal_attention_probs_match_reference() {
    kc::causal_attention_probs_match_reference(&mut *small_device());
}

#[test]
fn elementwise_match_reference_and_write_only_their_range() {
    let (mut full, mut chunked) = (device(), small_device());
    kc::elementwise_match_reference_and_write_only_their_range(&mut *full, &mut *chunked);
}

#[test]
fn naive_attention_matches_reference() {
    let (mut full, mut chunked) = (device(), small_device());
    kc::naive_attention_matches_reference(&mut *full, &mut *chunked);
}

#[test]
fn flash_attention_matches_reference() {
    let (mut full, mut chunked) = (device(), small_device());
    kc::flash_attention_matches_reference(&mut *full, &mut *chunked);
}

#[test]
fn flash_equals_naive_attention() {
    kc::flash_equals_naive_attention(&mut *device());
}

#[test]
fn grouped_flash_matches_repeated_kv() {
    let (mut full, mut chunked) = (device(), small_device());
    kc::grouped_flash_matches_repeated_kv(&mut *full, &mut *chunked);
}

#[test]
fn conv2d_matches_reference() {
    let (mut full, mut chunked) = (device(), small_device());
    kc::conv2d_matches_reference(&mut *full, &mut *chunked);
}

#[test]
fn adam_matches_reference() {
    let (mut full, mut chunked) = (device(), small_device());
    kc::adam_matches_reference(&mut *full, &mut *chunked);
}

#[test]
fn run_step_runs_plan_steps() {
    kc::run_step_runs_plan_steps(&mut *small_device());
}
