//! The host allocator's policy in a probe: on glibc, buffers of a CPU adapter (lavapipe's
//! device memory is host `malloc`) are mapped and unmapped one by one, whatever the probe freed
//! before, and no arena is created once the device is open.
//!
//! glibc raises its mmap threshold each time it unmaps a buffer (up to 32 MiB), and serves
//! later requests under it from its heap, whose freed pieces stay mapped. Under an address-space
//! limit, what a buffer costs then depends on what the process freed before (traced on
//! lavapipe: after a step, replaying the same allocations found 105 MiB still mapped that the
//! first replay had freed). A fixed threshold keeps it at what the buffer maps, so a probe's
//! answer and the replays measured after it (`probe::dry`) see one device.
//!
//! glibc also retries a request its main arena refused in a new arena, which reserves 64 MiB of
//! address space for the life of the process. Traced on lavapipe under `prlimit --as`
//! (`OOMPROBE_AS_TRACE`, issue 25): each refused buffer left 64 MiB more mapped, so a probe
//! whose filler was refused before its peak tensor (`probe::room`) was refused where the same
//! probe without filler fit, and the replays after a refusal put the boundary 64 MiB low
//! (params under 3 GiB: 3.2M parameters). So once the device is open no arena is created:
//! a refused request is retried in an arena that exists. The arenas the driver's threads made
//! while it opened stay (one arena for every thread was tried: a device then mapped 299 MB
//! instead of 702 MB, but every small allocation of the driver's threads grew the one heap,
//! probes crashed in Mesa at the limit, 3 in 19, and what a step held besides its tensors
//! grew from 1 MiB to 12 MiB). Nothing changes on a GPU: its memory is not the host's.

/// The fixed threshold: glibc's default before it adapts (requests at least this large are
/// mapped on their own).
pub const MMAP_THRESHOLD: i32 = 128 << 10;

/// glibc fixes its limit on arenas the first time it needs one once more than this many exist
/// (8 by default); kept above any thread count so the limit `freeze_arenas` sets is the one
/// it fixes.
const ARENA_TEST: i32 = 1 << 16;

/// Set the policy for this process before the device opens. Idempotent.
pub fn fix_policy() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only changes the allocator's parameters; it is safe to call at any
        // time, from any thread.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD);
            libc::mallopt(libc::M_ARENA_TEST, ARENA_TEST);
        }
    }
}

/// From now on glibc creates no arena: a thread without one, or a request an arena refused,
/// goes to an arena that exists. Call once the device is open.
pub fn freeze_arenas() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: as above.
        unsafe {
            libc::mallopt(libc::M_ARENA_MAX, 1);
        }
    }
}

#[cfg(all(test, target_os = "linux", target_env = "gnu"))]
mod tests {
    use super::*;
    use crate::probe::capacity::address_space_in_use;
    use std::sync::{Arc, Barrier};

    /// Set in the child `threads_that_allocate_map_no_arena_each` runs (this test binary run
    /// again, one test in a process of its own); arenas frozen when set to "frozen".
    const CHILD: &str = "OOMPROBE_HOSTMEM_CHILD";
    const THREADS: usize = 4;

    /// Bytes the address space grew by while `THREADS` threads each hold a small `malloc`.
    fn growth_with_threads_allocating() -> u64 {
        let before = address_space_in_use().expect("VmSize");
        let hold = Arc::new(Barrier::new(THREADS + 1));
        let measured = Arc::new(Barrier::new(THREADS + 1));
        let threads: Vec<_> = (0..THREADS)
            .map(|_| {
                let (hold, measured) = (hold.clone(), measured.clone());
                std::thread::spawn(move || {
                    // SAFETY: a valid malloc and its free.
                    let p = unsafe { libc::malloc(1024) };
                    assert!(!p.is_null());
                    hold.wait();
                    measured.wait();
                    unsafe { libc::free(p) };
                })
            })
            .collect();
        hold.wait();
        let grown = address_space_in_use()
            .expect("VmSize")
            .saturating_sub(before);
        measured.wait();
        threads.into_iter().for_each(|t| t.join().unwrap());
        grown
    }

    #[test]
    fn hostmem_child_side() {
        let Some(mode) = std::env::var_os(CHILD) else {
            return;
        };
        if mode == "frozen" {
            fix_policy();
            freeze_arenas();
        }
        println!("growth={}", growth_with_threads_allocating());
    }

    fn growth_in_child(mode: &str) -> u64 {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args(["--exact", "probe::hostmem::tests::hostmem_child_side"])
            .args(["--nocapture", "--test-threads=1"])
            .env(CHILD, mode)
            .output()
            .expect("run the test binary again");
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(out.status.success(), "child failed: {text}");
        // libtest prints the test's name on the same line.
        text.split("growth=")
            .nth(1)
            .and_then(|g| g.split_whitespace().next())
            .and_then(|g| g.parse().ok())
            .unwrap_or_else(|| panic!("no growth line in: {text}"))
    }

    #[test]
    fn threads_that_allocate_map_no_arena_each() {
        // glibc's default gives each of these threads an arena of 64 MiB of address space:
        // measured here too, so the test notices a libc where the fix proves nothing.
        let per_thread = |g: u64| g / THREADS as u64;
        let default = per_thread(growth_in_child("default"));
        let frozen = per_thread(growth_in_child("frozen"));
        assert!(
            default >= 64 << 20,
            "default policy: {default} bytes of address space a thread (no arena each?)"
        );
        // A thread's stack (2 MiB and a guard page) and nothing of the allocator's.
        assert!(
            frozen < 4 << 20,
            "arenas frozen: still {frozen} bytes of address space a thread"
        );
    }
}
