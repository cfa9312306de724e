//! The host allocator's policy in a probe: on glibc, buffers of a CPU adapter (lavapipe's
//! device memory is host `malloc`) are mapped and unmapped one by one, whatever the probe freed
//! before.
//!
//! glibc raises its mmap threshold each time it unmaps a buffer (up to 32 MiB), and serves
//! later requests under it from its heap, whose freed pieces stay mapped. Under an address-space
//! limit, what a buffer costs then depends on what the process freed before (traced on
//! lavapipe: after a step, replaying the same allocations found 105 MiB still mapped that the
//! first replay had freed). A fixed threshold keeps it at what the buffer maps, so a probe's
//! answer and the replays measured after it (`probe::dry`) see one device. Nothing changes on a
//! GPU: its memory is not the host's.

/// The fixed threshold: glibc's default before it adapts (requests at least this large are
/// mapped on their own).
pub const MMAP_THRESHOLD: i32 = 128 << 10;

/// Fix the threshold for this process (a probe child, or an in-process probe). Idempotent.
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
