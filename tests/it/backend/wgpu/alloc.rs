//! Allocation, fill/verify/checksum and OOM behaviour of the wgpu backend (on lavapipe in CI).

use oomprobe::backend::wgpu::{AdapterSelector, WgpuBackend};
use oomprobe::backend::{AllocError, Backend};
use oomprobe::ops::words::{self, pattern};

const NO_ADAPTER: &str = "no wgpu adapter: install a GPU driver or the software Vulkan driver \
                          (apt-get install -y mesa-vulkan-drivers libvulkan1)";

fn open() -> WgpuBackend {
    match WgpuBackend::open(AdapterSelector::Auto) {
        Ok(b) => b,
        Err(e) => panic!("{NO_ADAPTER}: {e}"),
    }
}

fn read_words(b: &mut dyn Backend, id: oomprobe::backend::BufferId, words: u64) -> Vec<u32> {
    let bytes = b.read_buffer(id, 0, words * 4).expect("read back");
    bytes
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[test]
fn fill_kernel_writes_the_host_pattern() {
    let mut b = open();
    let words = 1000u64;
    let id = b.alloc_buffer(words * 4).expect("alloc");
    // Poison first so unwritten words are caught.
    b.write_buffer(id, 0, &vec![0xAB; (words * 4) as usize])
        .unwrap();
    let first = (1u64 << 32) - 300; // crosses the 32-bit boundary of the word index
    words::fill_buffer(&mut b, id, first, words, 42).expect("fill");
    b.synchronize().expect("sync");
    let got = read_words(&mut b, id, words);
    let want: Vec<u32> = (0..words).map(|i| pattern(first + i, 42)).collect();
    assert_eq!(got, want);
    b.free_buffer(id);
    assert_eq!(b.allocated_bytes(), 0);
}

#[test]
fn fill_verify_checksum_across_many_chunks() {
    use oomprobe::plan::DType;
    use oomprobe::tensor::{allocate, free_tensor};
    let mut b = open();
    // 4 KiB buffers: 10_001 f16 elements in rows of 30 -> 34 rows (2040 B) per chunk.
    b.cap_max_buffer(4096);
    let t = allocate(&mut b, "t", DType::F16, 10_001, 30).expect("alloc");
    assert!(t.chunks.len() > 4, "{} chunks", t.chunks.len());
    assert!(t.chunks.iter().all(|c| c.bytes <= 4096 && c.bytes % 4 == 0));
    // 10_001 f16 = 20_002 bytes; the odd tail chunk pads 2 bytes.
    assert_eq!(t.allocated_bytes(), t.bytes() + 2);
    assert_eq!(b.allocated_bytes(), t.allocated_bytes());
    words::fill_tensor(&mut b, &t, 7).expect("fill");
    let v = words::verify_tensor(&mut b, &t, 7).expect("verify");
    assert_eq!(v.words_seen, t.words());
    assert_eq!(v.mismatches, 0);
    // A different seed: every word differs.
    let w = words::verify_tensor(&mut b, &t, 8).expect("verify");
    assert_eq!(w.mismatches, t.words());
    let c = words::checksum_tensor(&mut b, &t).expect("checksum");
    assert_eq!(c, words::Checksum::of_pattern(0, t.words(), 7));
    // Corrupt one word in the middle of the third chunk: exactly one mismatch.
    b.write_buffer(t.chunks[2].buffer, 40, &[1, 2, 3, 4])
        .unwrap();
    let v = words::verify_tensor(&mut b, &t, 7).expect("verify");
    assert_eq!(v.mismatches, 1);
    // Unaligned write (2 bytes) patches within a word: still one word differs there.
    b.write_buffer(t.chunks[3].buffer, 6, &[9, 9]).unwrap();
    assert_eq!(words::verify_tensor(&mut b, &t, 7).unwrap().mismatches, 2);
    free_tensor(&mut b, t);
    assert_eq!(b.allocated_bytes(), 0);
}

#[test]
fn big_dispatch_uses_a_2d_grid() {
    // More than 65535 workgroups of 256 words: 16.8M words = 64 MiB + 4 KiB.
    let mut b = open();
    let words_n = 256 * 65535 + 1024;
    let id = b.alloc_buffer(words_n * 4).expect("alloc");
    assert!(words::word_workgroups(words_n)[1] > 1);
    words::fill_buffer(&mut b, id, 0, words_n, 3).expect("fill");
    let v = words::verify_buffer(&mut b, id, 0, words_n, 3).expect("verify");
    assert_eq!((v.words_seen, v.mismatches), (words_n, 0));
    let tail = b.read_buffer(id, (words_n - 1) * 4, 4).unwrap();
    assert_eq!(
        u32::from_le_bytes([tail[0], tail[1], tail[2], tail[3]]),
        pattern(words_n - 1, 3)
    );
    b.free_buffer(id);
}

#[test]
fn a_buffer_over_the_limit_is_exceeds_limit() {
    let mut b = open();
    let limit = b.info().max_chunk_bytes();
    match b.alloc_buffer(limit + 4) {
        Err(AllocError::ExceedsLimit { limit: l, .. }) => assert_eq!(l, limit),
        other => panic!("expected ExceedsLimit, got {other:?}"),
    }
    // A tensor whose single row is larger than a chunk is refused the same way.
    let e = oomprobe::tensor::allocate(&mut b, "row", oomprobe::plan::DType::F32, limit, limit)
        .unwrap_err();
    assert!(matches!(e, AllocError::ExceedsLimit { .. }), "{e:?}");
    assert_eq!(b.allocated_bytes(), 0);
    // The device is still fine.
    let id = b.alloc_buffer(64).unwrap();
    b.free_buffer(id);
}

#[test]
fn budget_backend_refuses_before_the_device() {
    use oomprobe::backend::budget::BudgetBackend;
    let mut b: BudgetBackend = BudgetBackend::new(Box::new(open()), 1 << 20);
    let t = oomprobe::tensor::allocate(&mut b, "a", oomprobe::plan::DType::F32, 200_000, 1)
        .expect("800 KB fits in 1 MiB");
    let e = oomprobe::tensor::allocate(&mut b, "b", oomprobe::plan::DType::F32, 100_000, 1)
        .unwrap_err();
    assert!(matches!(e, AllocError::Budget { .. }), "{e:?}");
    assert_eq!(b.inner().allocated_bytes(), 800_000);
    oomprobe::tensor::free_tensor(&mut b, t);
    assert_eq!(b.used(), 0);
    let t = oomprobe::tensor::allocate(&mut b, "b", oomprobe::plan::DType::F32, 100_000, 1)
        .expect("fits after free");
    words::fill_tensor(&mut b, &t, 1).unwrap();
    assert_eq!(words::verify_tensor(&mut b, &t, 1).unwrap().mismatches, 0);
}

// ---------------------------------------------------------------------------------------------
// A real out-of-memory boundary on lavapipe: the test re-runs this executable as a child
// (selecting `oom_child` below through an environment variable). The child opens the device,
// compiles the kernels, then limits its own address space (RLIMIT_AS, what `prlimit --as`
// sets) to its current size plus a headroom, and allocates + fills 32 MiB buffers until the
// device refuses. It then frees half and allocates again. Result: one JSON line on stdout.

const CHILD_ENV: &str = "OOMPROBE_TEST_OOM_CHILD";
const CHUNK: u64 = 32 << 20;

fn vm_size_bytes() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmSize:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

#[test]
fn oom_child() {
    let Ok(headroom) = std::env::var(CHILD_ENV) else {
        return; // only meaningful as the child of `out_of_memory_under_an_address_space_limit`
    };
    let headroom: u64 = headroom.parse().expect("headroom bytes");
    let mut b = open();
    // Warm up: compile fill and verify before limiting memory.
    let w = b.alloc_buffer(4096).unwrap();
    words::fill_buffer(&mut b, w, 0, 1024, 1).unwrap();
    words::verify_buffer(&mut b, w, 0, 1024, 1).unwrap();
    b.free_buffer(w);
    let base = vm_size_bytes();
    let limit = base + headroom;
    let rl = libc::rlimit {
        rlim_cur: limit as libc::rlim_t,
        rlim_max: limit as libc::rlim_t,
    };
    // SAFETY: plain syscall on our own process with a valid struct.
    assert_eq!(unsafe { libc::setrlimit(libc::RLIMIT_AS, &rl) }, 0);
    let started = std::time::Instant::now();
    let mut held = Vec::new();
    let mut outcome = String::from("never refused");
    let mut oom_detail = String::new();
    let max_tries = headroom / CHUNK + 64;
    for _ in 0..max_tries {
        match b.alloc_buffer(CHUNK) {
            Ok(id) => {
                held.push(id);
                let first = (held.len() as u64 - 1) * CHUNK / 4;
                if let Err(e) = words::fill_buffer(&mut b, id, first, CHUNK / 4, 5)
                    .and_then(|_| b.synchronize())
                {
                    outcome = format!("fill failed: {e}");
                    break;
                }
            }
            Err(AllocError::OutOfMemory { detail, .. }) => {
                outcome = "out_of_memory".into();
                oom_detail = detail;
                break;
            }
            Err(e) => {
                outcome = format!("other: {e}");
                break;
            }
        }
    }
    let held_bytes = b.allocated_bytes();
    let seconds = started.elapsed().as_secs_f64();
    // Free half, then the next allocation must succeed and hold its pattern.
    let keep = held.len() / 2;
    for id in held.drain(keep..) {
        b.free_buffer(id);
    }
    let recovered = match b.alloc_buffer(CHUNK) {
        Ok(id) => {
            let ok = words::fill_buffer(&mut b, id, 0, CHUNK / 4, 6).is_ok()
                && matches!(words::verify_buffer(&mut b, id, 0, CHUNK / 4, 6),
                            Ok(v) if v.mismatches == 0 && v.words_seen == CHUNK / 4);
            b.free_buffer(id);
            ok
        }
        Err(_) => false,
    };
    // Earlier chunks still hold their data.
    let intact = held.iter().enumerate().all(|(i, &id)| {
        matches!(words::verify_buffer(&mut b, id, i as u64 * CHUNK / 4, CHUNK / 4, 5),
                 Ok(v) if v.mismatches == 0)
    });
    let result = serde_json::json!({
        "outcome": outcome,
        "detail": oom_detail,
        "base_vm": base,
        "limit": limit,
        "held_bytes": held_bytes,
        "recovered": recovered,
        "intact": intact,
        "seconds": seconds,
    });
    println!("\nOOM_RESULT {result}");
}

#[test]
fn out_of_memory_under_an_address_space_limit() {
    let headroom: u64 = 768 << 20;
    let exe = std::env::current_exe().expect("test executable");
    // The child's full test name: this module's path without the crate's name.
    let (_, module) = module_path!().split_once("::").expect("a module path");
    let out = std::process::Command::new(exe)
        .arg(format!("{module}::oom_child"))
        .args(["--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, headroom.to_string())
        .output()
        .expect("spawn child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    let line = stdout
        .lines()
        .find_map(|l| l.split_once("OOM_RESULT ").map(|(_, r)| r))
        .unwrap_or_else(|| {
            panic!(
                "child gave no result (status {:?})\nstdout:\n{stdout}\nstderr:\n{stderr}",
                out.status
            )
        });
    eprintln!("child: {line}");
    let v: serde_json::Value = serde_json::from_str(line).expect("child JSON");
    assert_eq!(v["outcome"], "out_of_memory", "{line}");
    let held = v["held_bytes"].as_u64().unwrap();
    assert!(held >= CHUNK, "refused before any chunk: {line}");
    assert!(held <= headroom, "held more than the limit allows: {line}");
    assert_eq!(v["recovered"], true, "{line}");
    assert_eq!(v["intact"], true, "{line}");
    assert!(out.status.success(), "child failed: {stderr}");
}

#[test]
fn misuse_is_an_error_not_a_panic() {
    use oomprobe::kernels::{KernelId, Op};
    let mut b = open();
    let id = b.alloc_buffer(64).unwrap();
    // Verify needs a result buffer at binding 2: the bind group fails validation.
    let p = oomprobe::kernels::params::WordParams {
        first_word_lo: 0,
        first_word_hi: 0,
        len_words: 16,
        seed: 0,
    };
    let e = b
        .dispatch(
            KernelId::words(Op::Verify),
            bytemuck::bytes_of(&p),
            &[id],
            [1, 1, 1],
        )
        .unwrap_err();
    assert!(
        matches!(e, oomprobe::backend::BackendError::Other(_)),
        "{e:?}"
    );
    assert!(b.read_buffer(id, 60, 8).is_err());
    assert!(b.write_buffer(id, 64, &[0]).is_err());
    assert!(b
        .read_buffer(oomprobe::backend::BufferId(999_999), 0, 4)
        .is_err());
    // The device still works afterwards.
    b.synchronize().expect("no late errors");
    words::fill_buffer(&mut b, id, 0, 16, 2).unwrap();
    assert_eq!(
        words::verify_buffer(&mut b, id, 0, 16, 2)
            .unwrap()
            .mismatches,
        0
    );
}

#[test]
fn a_probe_uses_no_staging_after_its_first_tensor_on_a_real_adapter() {
    use oomprobe::probe::{exec::execute_plan, Compute};
    let mut b = open();
    let w = oomprobe::workload::presets::get("tiny-gpt").unwrap();
    let plan = oomprobe::plan::Plan::for_value(&w, oomprobe::scenario::Scenario::Batch, 2).unwrap();
    for compute in [Compute::Touch, Compute::Full] {
        let rec = execute_plan(&mut b, &plan, compute);
        assert_eq!(rec.outcome, oomprobe::report::Outcome::Fit, "{rec:?}");
        assert_eq!(
            b.staging_after_prepare(),
            0,
            "{compute:?}: staging during the probe"
        );
    }
}
