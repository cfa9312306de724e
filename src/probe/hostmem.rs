//! The host allocator's policy in a probe: on glibc, buffers of a CPU adapter (lavapipe's
//! device memory is host `malloc`) are mapped and unmapped one by one, whatever the probe freed
//! before, and a refused buffer changes nothing.
//!
//! glibc raises its mmap threshold each time it unmaps a buffer (up to 32 MiB), and serves
//! later requests under it from its heap, whose freed pieces stay mapped. Under an address-space
//! limit, what a buffer costs then depends on what the process freed before (traced on
//! lavapipe: after a step, replaying the same allocations found 105 MiB still mapped that the
//! first replay had freed). A fixed threshold keeps it at what the buffer maps, so a probe's
//! answer and the replays measured after it (`probe::dry`) see one device.
//!
//! glibc retries a request that the main arena refused in another arena, and from then on the
//! thread allocates there: a new arena that reserves 64 MiB of address space for good, or,
//! where no more may be made, another thread's, whose reserve the thread's small allocations
//! then use. Traced on lavapipe under `prlimit --as` (`OOMPROBE_AS_TRACE`, issue 25): with the
//! default, each refused buffer left 64 MiB more mapped, so a probe whose filler was refused
//! before its peak tensor (`probe::room`) was refused where the same probe without filler fit,
//! and the replays after a refusal put the boundary 64 MiB low (params under 3 GiB: 3.2M
//! parameters); with no arena made after the device opened, a probe whose filler was refused
//! fit 1.5 MB more than one without (params under 2 GiB: 73.07M fit with filler, 72.16M was
//! refused without). A request refused in any other arena is retried in the main arena and the
//! thread stays where it was: so the probe runs on a thread of its own (`off_main_arena`), and
//! the driver's threads keep their arenas. (One arena for every thread was tried too: a device
//! then mapped 299 MB instead of 702 MB, but the driver's threads grew the one heap, probes
//! crashed in Mesa at the limit, 3 in 19, and a step held 12 MiB besides its tensors.)
//! Nothing changes on a GPU: its memory is not the host's.

/// The fixed threshold: glibc's default before it adapts (requests at least this large are
/// mapped on their own).
pub const MMAP_THRESHOLD: i32 = 128 << 10;

/// The stack of the probe's thread: the main thread's on Linux (LLVM compiles kernels on it).
const PROBE_STACK: usize = 8 << 20;

/// Fix the threshold for this process before the device opens. Idempotent.
pub fn fix_mmap_threshold() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only changes the allocator's parameters; it is safe to call at any
        // time, from any thread.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD);
        }
    }
}

/// Run `f` on a thread of its own (so on an arena other than glibc's main one), and wait for
/// it; on the calling thread where no thread can be started. A panic in `f` goes on here.
pub fn off_main_arena<T: Send>(f: impl FnOnce() -> T + Send) -> T {
    let f = std::sync::Mutex::new(Some(f));
    let take = || f.lock().ok().and_then(|mut g| g.take());
    std::thread::scope(|s| {
        let spawned = std::thread::Builder::new()
            .name("probe".into())
            .stack_size(PROBE_STACK)
            .spawn_scoped(s, || take().map(|f| f()));
        match spawned.map(|h| h.join()) {
            Ok(Ok(Some(out))) => out,
            Ok(Err(panic)) => std::panic::resume_unwind(panic),
            // Not started: `f` is still here.
            _ => (take().expect("the probe ran nowhere"))(),
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn off_the_main_arena_runs_on_another_thread_and_hands_back_its_answer_or_panic() {
        let main = std::thread::current().id();
        let (answer, on) = off_main_arena(|| (42, std::thread::current().id()));
        assert_eq!(answer, 42);
        assert_ne!(on, main);
        let r = std::panic::catch_unwind(|| off_main_arena(|| panic!("in the probe")));
        assert!(r.is_err());
    }

    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    mod glibc {
        use super::super::*;
        use crate::probe::capacity::address_space_in_use;

        /// Set in the child `a_refused_buffer_maps_nothing_more` runs (this test binary run
        /// again, one test in a process of its own, whose address-space limit it sets).
        const CHILD: &str = "OOMPROBE_HOSTMEM_CHILD";

        #[test]
        fn hostmem_child_side() {
            if std::env::var_os(CHILD).is_none() {
                return;
            }
            fix_mmap_threshold();
            let grown = off_main_arena(|| {
                // SAFETY: malloc and free with valid arguments, and setrlimit on this process,
                // the child started for this test alone.
                unsafe {
                    // This thread's arena exists before the measurement.
                    libc::free(std::hint::black_box(libc::malloc(1024)));
                    let before = address_space_in_use().expect("VmSize");
                    let limit = before + (256 << 20);
                    let rl = libc::rlimit {
                        rlim_cur: limit,
                        rlim_max: limit,
                    };
                    assert_eq!(libc::setrlimit(libc::RLIMIT_AS, &rl), 0);
                    // black_box: the compiler may drop a malloc whose result is only tested.
                    let p = std::hint::black_box(libc::malloc(std::hint::black_box(512 << 20)));
                    assert!(p.is_null(), "512 MiB under 256 MiB of headroom");
                    // Small ones after it still come from this thread's arena.
                    for _ in 0..64 {
                        libc::free(std::hint::black_box(libc::malloc(4096)));
                    }
                    address_space_in_use()
                        .expect("VmSize")
                        .saturating_sub(before)
                }
            });
            println!("growth={grown}");
        }

        #[test]
        fn a_refused_buffer_maps_nothing_more() {
            let out = std::process::Command::new(std::env::current_exe().unwrap())
                .args([
                    "--exact",
                    "probe::hostmem::tests::glibc::hostmem_child_side",
                ])
                .args(["--nocapture", "--test-threads=1"])
                .env(CHILD, "1")
                .output()
                .expect("run the test binary again");
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(out.status.success(), "child failed: {text}");
            // libtest prints the test's name on the same line.
            let grown: u64 = text
                .split("growth=")
                .nth(1)
                .and_then(|g| g.split_whitespace().next())
                .and_then(|g| g.parse().ok())
                .unwrap_or_else(|| panic!("no growth line in: {text}"));
            // glibc's default on the main arena would have made an arena of 64 MiB.
            assert!(
                grown < 1 << 20,
                "a refused buffer left {grown} bytes mapped"
            );
        }
    }
}
