//! The kernel checks of `backend::wgpu::kernels`, on the CUDA backend: every compute kernel
//! against its f64 CPU reference (fresh random inputs, outputs poisoned with NaN first, f32 /
//! f16 / bf16 storage, tensors cut into small chunks), plus the word kernels against the host
//! pattern and an allocation run to `OutOfMemory`.
//!
//! These need an NVIDIA GPU with its driver (NVRTC optional): they are `#[ignore]`d so CI skips
//! them explicitly; `scripts/gpu-check.sh` runs them with `--include-ignored`, where a missing
//! device is a failure. The kernel checks are the ones `backend::wgpu::kernels` runs on wgpu,
//! shared through `support::kernel_checks`, so the two backends pass the same bar.
#![cfg(feature = "cuda")]

use std::sync::{Mutex, MutexGuard, OnceLock};

use crate::support::kernel_checks::{self as kc, SMALL_CHUNK};

use oomprobe::backend::cuda::CudaBackend;
use oomprobe::backend::{AllocError, Backend};
use oomprobe::ops::words;
use oomprobe::plan::DType;
use oomprobe::tensor::allocate;

const NO_GPU: &str = "no usable CUDA device (these tests need an NVIDIA GPU and its driver; \
                      NVRTC is optional: without it the embedded PTX is loaded)";

fn open(cap: Option<u64>) -> Mutex<CudaBackend> {
    let mut b = match CudaBackend::new(0) {
        Ok(b) => b,
        Err(e) => panic!("{NO_GPU}: {e}"),
    };
    if let Some(c) = cap {
        b.cap_max_buffer(c);
    }
    Mutex::new(b)
}

/// The CUDA device with its full limits (shared by the tests, one at a time).
fn device() -> MutexGuard<'static, CudaBackend> {
    static D: OnceLock<Mutex<CudaBackend>> = OnceLock::new();
    let m = D.get_or_init(|| open(None));
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The same device with buffers capped at `SMALL_CHUNK` bytes.
fn small_device() -> MutexGuard<'static, CudaBackend> {
    static D: OnceLock<Mutex<CudaBackend>> = OnceLock::new();
    let m = D.get_or_init(|| open(Some(SMALL_CHUNK)));
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-check.sh"]
fn matmul_matches_reference() {
    let (mut full, mut chunked) = (device(), small_device());
    kc::matmul_matches_reference(&mut *full, &mut *chunked);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-check.sh"]
fn matmul_with_b_past_one_chunk_is_an_error() {
    kc::matmul_with_b_past_one_chunk_is_an_error(&mut *small_device());
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-check.sh"]
fn row_kernels_match_reference() {
    let (mut full, mut chunked) = (device(), small_device());
    kc::row_kernels_match_reference(&mut *full, &mut *chunked);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-check.sh"]
fn causal_attention_probs_match_reference() {
    kc::causal_attention_probs_match_reference(&mut *small_device());
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-check.sh"]
fn elementwise_match_reference_and_write_only_their_range() {
    let (mut full, mut chunked) = (device(), small_device());
    kc::elementwise_match_reference_and_write_only_their_range(&mut *full, &mut *chunked);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-check.sh"]
fn naive_attention_matches_reference() {
    let (mut full, mut chunked) = (device(), small_device());
    kc::naive_attention_matches_reference(&mut *full, &mut *chunked);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-check.sh"]
fn flash_attention_matches_reference() {
    let (mut full, mut chunked) = (device(), small_device());
    kc::flash_attention_matches_reference(&mut *full, &mut *chunked);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-check.sh"]
fn flash_equals_naive_attention() {
    kc::flash_equals_naive_attention(&mut *device());
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-check.sh"]
fn grouped_flash_matches_repeated_kv() {
    let (mut full, mut chunked) = (device(), small_device());
    kc::grouped_flash_matches_repeated_kv(&mut *full, &mut *chunked);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-check.sh"]
fn conv2d_matches_reference() {
    let (mut full, mut chunked) = (device(), small_device());
    kc::conv2d_matches_reference(&mut *full, &mut *chunked);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-check.sh"]
fn adam_matches_reference() {
    let (mut full, mut chunked) = (device(), small_device());
    kc::adam_matches_reference(&mut *full, &mut *chunked);
}

#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-check.sh"]
fn run_step_runs_plan_steps() {
    kc::run_step_runs_plan_steps(&mut *small_device());
}

/// Word kernels: fill then verify and checksum every word of a tensor spread over chunks,
/// against the host pattern (`ops::words::pattern`) and a host-side sum; a corrupted word is
/// counted as a mismatch.
#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-check.sh"]
fn word_kernels_match_the_host_pattern() {
    let mut dev = small_device();
    let b = &mut *dev;
    let elems = 10_000u64; // f32: 40 000 bytes, 5 chunks of 8 KiB
    let t = allocate(b, "w", DType::F32, elems, 1).expect("allocate");
    assert!(t.chunks.len() > 2);
    let seed = 0x5eed_1234;
    words::fill_tensor(b, &t, seed).expect("fill");
    let v = words::verify_tensor(b, &t, seed).expect("verify");
    assert_eq!((v.words_seen, v.mismatches), (elems, 0));
    let mut host_sum = 0u64;
    let mut first = 0u64;
    for c in &t.chunks {
        let bytes = b.read_buffer(c.buffer, 0, c.bytes).expect("read");
        for (i, w) in bytes.chunks_exact(4).enumerate() {
            let w = u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
            assert_eq!(
                w,
                words::pattern(first + i as u64, seed),
                "word {}",
                first + i as u64
            );
            host_sum = host_sum.wrapping_add(u64::from(w));
        }
        first += c.words();
    }
    let sum = words::checksum_tensor(b, &t).expect("checksum");
    assert_eq!((sum.sum, sum.words), (host_sum, elems));
    // Corrupt one word: verify sees exactly one mismatch; another seed mismatches everywhere.
    let c = &t.chunks[1];
    b.write_buffer(c.buffer, 8, &[0xde, 0xad, 0xbe, 0xef])
        .expect("corrupt");
    let v = words::verify_tensor(b, &t, seed).expect("verify");
    assert_eq!(v.mismatches, 1);
    let v = words::verify_tensor(b, &t, seed ^ 1).expect("verify");
    assert_eq!(v.mismatches, elems);
    oomprobe::tensor::free_tensor(b, t);
}

/// The pattern continues across the 2^32-word boundary (the carry into first_word_hi).
#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-check.sh"]
fn fill_carries_into_the_high_word_index() {
    let mut dev = device();
    let b = &mut *dev;
    let buf = b.alloc_buffer(4096).expect("alloc");
    let first = (1u64 << 32) - 512;
    words::fill_buffer(b, buf, first, 1024, 7).expect("fill");
    let bytes = b.read_buffer(buf, 0, 4096).expect("read");
    for (i, w) in bytes.chunks_exact(4).enumerate() {
        let w = u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
        assert_eq!(w, words::pattern(first + i as u64, 7), "word {i}");
    }
    let v = words::verify_buffer(b, buf, first, 1024, 7).expect("verify");
    assert_eq!((v.words_seen, v.mismatches), (1024, 0));
    b.free_buffer(buf);
}

/// Allocating 256 MiB buffers until the device refuses gives `OutOfMemory` (not another
/// error, not a panic) near the free memory reported at the start; after freeing, the same
/// size fits again and the free memory is back.
#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-check.sh"]
fn allocation_runs_into_out_of_memory_and_recovers() {
    let mut dev = device();
    let b = &mut *dev;
    let free0 = b.memory().free_bytes.expect("cuMemGetInfo");
    let size = 256u64 << 20;
    let mut held = Vec::new();
    let err = loop {
        match b.alloc_buffer(size) {
            Ok(id) => held.push(id),
            Err(e) => break e,
        }
        assert!(
            (held.len() as u64) * size <= free0 + size,
            "allocated past the free memory"
        );
    };
    assert!(matches!(err, AllocError::OutOfMemory { .. }), "{err}");
    let reached = held.len() as u64 * size;
    eprintln!(
        "OOM after {reached} of {free0} free bytes ({:.1}%)",
        100.0 * reached as f64 / free0 as f64
    );
    assert!(
        reached + 2 * size >= free0 / 2,
        "stopped far below the free memory: {reached}"
    );
    assert_eq!(b.allocated_bytes(), reached);
    for id in held {
        b.free_buffer(id);
    }
    assert_eq!(b.allocated_bytes(), 0);
    let id = b.alloc_buffer(size).expect("fits again after freeing");
    b.free_buffer(id);
    let free1 = b.memory().free_bytes.expect("cuMemGetInfo");
    assert!(
        free1 + size >= free0,
        "free memory not back: {free1} < {free0}"
    );
}

/// A dispatch whose params or buffers do not match the kernel is refused with an error
/// (where the driver tells the kernel's signature), and out-of-range copies are errors.
#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-check.sh"]
fn mismatched_dispatches_and_copies_are_errors() {
    use oomprobe::kernels::{KernelId, Op};
    let mut dev = device();
    let b = &mut *dev;
    let buf = b.alloc_buffer(64).expect("alloc");
    assert!(b.write_buffer(buf, 60, &[0u8; 8]).is_err());
    assert!(b.read_buffer(buf, 0, 65).is_err());
    let e = b.dispatch(
        KernelId::words(Op::Fill),
        &[0u8; 16],
        &[buf, buf],
        [1, 1, 1],
    );
    eprintln!("fill with two buffers: {e:?}");
    // cuFuncGetParamInfo (driver 12.4+) or else the embedded PTX tells the kernel's
    // signature: the mismatch is caught.
    assert!(e.is_err(), "a 1-buffer kernel was launched with 2 buffers");
    let e = b.dispatch(KernelId::words(Op::Fill), &[0u8; 8], &[buf], [1, 1, 1]);
    assert!(
        e.is_err(),
        "an 8-byte params block for a 16-byte struct was launched"
    );
    b.synchronize().expect("device still usable");
    b.free_buffer(buf);
}

/// The embedded PTX (what a machine without NVRTC runs) passes the same checks as whatever
/// `device()` loads, on its own pair of devices.
#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-check.sh"]
fn embedded_ptx_kernels_match_reference() {
    let open_embedded = |cap: Option<u64>| {
        let mut b = CudaBackend::with_embedded_ptx(0).unwrap_or_else(|e| panic!("{NO_GPU}: {e}"));
        if let Some(c) = cap {
            b.cap_max_buffer(c);
        }
        b
    };
    let (mut full, mut chunked) = (open_embedded(None), open_embedded(Some(SMALL_CHUNK)));
    assert!(
        full.info().driver.contains("embedded PTX"),
        "{}",
        full.info().driver
    );
    kc::matmul_matches_reference(&mut full, &mut chunked);
    kc::row_kernels_match_reference(&mut full, &mut chunked);
    kc::flash_attention_matches_reference(&mut full, &mut chunked);
    kc::adam_matches_reference(&mut full, &mut chunked);
}

/// After every kernel is loaded and launched once, the overhead is what the device holds
/// beyond free memory; printed for the GPU check's log.
#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-check.sh"]
fn overhead_is_measured_after_the_warm_up() {
    use oomprobe::backend::overhead;
    let mut b = CudaBackend::with_embedded_ptx(0).unwrap_or_else(|e| panic!("{NO_GPU}: {e}"));
    let o = overhead::measure(&mut b)
        .expect("warm-up")
        .expect("CUDA tells free memory");
    eprintln!(
        "total {} free at open {} free after warm-up {}: overhead {} (kernels {})",
        o.total,
        o.free_open,
        o.free_warm,
        o.overhead_bytes(),
        o.kernel_bytes()
    );
    assert!(o.overhead_bytes() > 0, "a context costs memory: {o:?}");
    assert!(o.kernel_bytes() <= o.overhead_bytes(), "{o:?}");
    assert_eq!(o.free_warm + o.overhead_bytes(), o.total);
    // The warm-up left nothing allocated and the device usable.
    assert_eq!(b.allocated_bytes(), 0);
    let info = overhead::apply(b.info().clone(), Some(o));
    assert_eq!(info.memory_free_bytes, Some(o.free_warm));
    let listed = oomprobe::backend::cuda::list_devices().expect("list");
    assert!(listed[0].overhead_bytes.is_some(), "{:?}", listed[0]);
}

/// `--allocator pytorch` on the card: tensors are views at offsets inside `cuMemAlloc`
/// segments. A full step (every kernel, on tensors packed into shared segments) gives the
/// checksum the direct probe gives, and under a budget the probe fits and fails exactly where
/// the allocator model says, as on the mock backend (tests/it/probe/allocator.rs).
#[test]
#[ignore = "needs an NVIDIA GPU: run scripts/gpu-check.sh"]
fn the_pytorch_allocator_places_tensors_in_segments_on_the_card() {
    use oomprobe::alloc::{timeline, AllocConf};
    use oomprobe::backend::budget::BudgetBackend;
    use oomprobe::backend::pooled::PooledBackend;
    use oomprobe::plan::Plan;
    use oomprobe::probe::exec::execute_plan;
    use oomprobe::probe::Compute;
    use oomprobe::report::Outcome;
    use oomprobe::scenario::Scenario;
    let cuda = || -> Box<dyn Backend> {
        Box::new(CudaBackend::new(0).unwrap_or_else(|e| panic!("{NO_GPU}: {e}")))
    };
    let w = oomprobe::workload::presets::get("tiny-gpt").unwrap();
    let plan = Plan::for_value(&w, Scenario::Batch, 96).unwrap();
    let conf = AllocConf::default();
    let direct = execute_plan(&mut *cuda(), &plan, Compute::Full);
    assert_eq!(direct.outcome, Outcome::Fit, "{:?}", direct.detail);
    let mut pooled = PooledBackend::new(cuda(), conf.clone()).unwrap();
    let rec = execute_plan(&mut pooled, &plan, Compute::Full);
    assert_eq!(rec.outcome, Outcome::Fit, "{:?}", rec.detail);
    assert_eq!(rec.checksum, direct.checksum, "same kernels, same data");
    let model = timeline::replay(&plan, &conf, None, timeline::STEPS, false);
    assert_eq!(rec.bytes_allocated, model.reserved_peak_bytes);
    // The least budget the model fits in, and a MiB less.
    let hi = timeline::least_capacity(&plan, &conf, timeline::STEPS);
    for (cap, want) in [(hi, Outcome::Fit), (hi - (1 << 20), Outcome::Budget)] {
        let b = Box::new(BudgetBackend::new(cuda(), cap));
        let mut p = PooledBackend::new(b, conf.clone()).unwrap();
        let rec = execute_plan(&mut p, &plan, Compute::Touch);
        assert_eq!(rec.outcome, want, "budget {cap}: {:?}", rec.detail);
    }
}
