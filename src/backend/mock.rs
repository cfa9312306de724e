//! A host-memory backend with a set capacity, for fast deterministic tests.
//!
//! Buffers are host byte vectors; allocating past the capacity is `OutOfMemory`, a buffer over
//! the configured limits is `ExceedsLimit`. The word kernels (fill, verify, checksum) run on
//! the host with the same pattern as the WGSL, so probe logic can be tested without a device.
//! Other kernels are refused with an error.
//!
//! Hazards of real drivers can be switched on for tests: buffers placed in host memory past a
//! point (slow, and counted outside the device-local heap: a spill), a device lost after some
//! launches, command buffers aborted after some launches (nothing runs, read-backs are zeros,
//! as on Metal), and a count of staging used after `prepare`.

use std::collections::{HashMap, HashSet};

use super::{
    AllocError, Backend, BackendError, BackendKind, BufferId, DeviceInfo, DeviceType, HeapUsage,
    MemoryInfo, STAGED_BYTES,
};
use crate::kernels::params::WordParams;
use crate::kernels::pattern;
use crate::kernels::{KernelId, Op};

/// A host-memory device.
#[derive(Debug, Clone)]
pub struct MockBackend {
    info: DeviceInfo,
    capacity: u64,
    buffers: HashMap<BufferId, Vec<u8>>,
    /// Views into buffers (`Backend::view_buffer`): parent, first byte, length.
    views: HashMap<BufferId, (BufferId, usize, usize)>,
    next_id: u64,
    allocated: u64,
    /// Count of dispatches run (for tests).
    pub dispatches: u64,
    lost: Option<String>,
    /// Bytes the driver would hold once the device is open (a context) ...
    context_bytes: u64,
    /// ... and once the kernels are loaded and launched (`warm_up`).
    kernel_bytes: u64,
    warm: bool,
    /// Buffers allocated once this many bytes are in use go to host memory, `slowdown` times
    /// slower than device memory (None: everything is device memory).
    spill: Option<(u64, f64)>,
    host_buffers: HashSet<BufferId>,
    /// Whether `heap_usage` reports (as Vulkan with VK_EXT_memory_budget).
    heaps: bool,
    /// Modelled device time: each word kernel costs its bytes over the buffer's bandwidth.
    clock: f64,
    /// Lose the device at this many dispatches.
    lose_at: Option<u64>,
    /// From this many dispatches on, command buffers abort: nothing runs, reads are zeros.
    abort_at: Option<u64>,
    prepared: bool,
    /// Whether `view_buffer` works (false: as a backend that binds whole buffers only).
    views_on: bool,
    /// Buffers allocated after `prepare` (tests compare with the plan's tensor chunks).
    pub allocs_after_prepare: u64,
    staging_after_prepare: u64,
}

/// Device-memory bandwidth of the mock's clock (bytes per second).
const MOCK_BANDWIDTH: f64 = 1e12;

impl MockBackend {
    /// A device with `capacity` bytes; buffers and bindings limited to 128 MiB by default.
    pub fn new(capacity: u64) -> Self {
        Self::with_limits(capacity, 128 << 20, 128 << 20)
    }

    /// A device with explicit buffer and storage-binding limits.
    pub fn with_limits(capacity: u64, max_buffer_size: u64, max_storage_binding_size: u64) -> Self {
        MockBackend {
            info: DeviceInfo {
                index: 0,
                name: "mock".to_string(),
                backend: BackendKind::Mock,
                device_type: DeviceType::Virtual,
                driver: "host memory".to_string(),
                memory_total_bytes: Some(capacity),
                memory_free_bytes: Some(capacity),
                max_buffer_size,
                max_storage_binding_size,
                overhead_bytes: None,
                kernel_overhead_bytes: None,
            },
            capacity,
            buffers: HashMap::new(),
            views: HashMap::new(),
            next_id: 1,
            allocated: 0,
            dispatches: 0,
            lost: None,
            context_bytes: 0,
            kernel_bytes: 0,
            warm: false,
            spill: None,
            host_buffers: HashSet::new(),
            heaps: false,
            clock: 0.0,
            lose_at: None,
            abort_at: None,
            prepared: false,
            views_on: true,
            allocs_after_prepare: 0,
            staging_after_prepare: 0,
        }
    }

    /// Simulates a driver that pages to system memory: buffers allocated once `device_bytes`
    /// are in use live in host memory, `slowdown` times slower (1.0: as fast as the rest).
    pub fn spill_after(mut self, device_bytes: u64, slowdown: f64) -> Self {
        self.spill = Some((device_bytes, slowdown));
        self
    }

    /// A backend that binds whole buffers only (`view_buffer` gives None).
    pub fn without_views(mut self) -> Self {
        self.views_on = false;
        self
    }

    /// Report heap usage (host buffers outside the device-local heap), as VK_EXT_memory_budget.
    pub fn report_heaps(mut self) -> Self {
        self.heaps = true;
        self
    }

    /// Lose the device at the `n`-th dispatch (counting from 0) and after.
    pub fn lose_device_at_dispatch(mut self, n: u64) -> Self {
        self.lose_at = Some(n);
        self
    }

    /// From the `n`-th dispatch on, command buffers abort silently (Metal on OOM or the
    /// watchdog): kernels do nothing and buffers read back as zeros.
    pub fn abort_at_dispatch(mut self, n: u64) -> Self {
        self.abort_at = Some(n);
        self
    }

    fn aborted(&self) -> bool {
        self.abort_at.is_some_and(|n| self.dispatches > n)
    }

    /// Simulates a driver's own memory: `context` bytes gone once open, `kernels` more after
    /// `warm_up` (as CUDA's modules and first-launch local memory).
    pub fn with_overhead(mut self, context: u64, kernels: u64) -> Self {
        self.context_bytes = context;
        self.kernel_bytes = kernels;
        self.info.memory_free_bytes = Some(self.capacity.saturating_sub(context));
        self
    }

    /// Bytes the simulated driver holds now.
    fn reserved(&self) -> u64 {
        self.context_bytes + if self.warm { self.kernel_bytes } else { 0 }
    }

    /// The set capacity in bytes.
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// Simulate a device loss: every later call fails with `DeviceLost`.
    pub fn lose_device(&mut self, reason: &str) {
        self.lost = Some(reason.to_string());
    }

    /// Host view of a buffer or view (for tests).
    pub fn buffer_bytes(&self, id: BufferId) -> Option<&[u8]> {
        self.words_of(id).ok()
    }

    fn check_lost(&self) -> Result<(), BackendError> {
        match &self.lost {
            Some(m) => Err(BackendError::DeviceLost(m.clone())),
            None => Ok(()),
        }
    }

    /// A write or read larger than what `prepare` staged needs staging of its own.
    fn count_staging(&mut self, bytes: u64) {
        if self.prepared && bytes > STAGED_BYTES {
            self.staging_after_prepare += 1;
        }
    }

    /// The buffer a buffer or view lives in, and its byte range there.
    fn resolve(&self, id: BufferId) -> Result<(BufferId, usize, usize), BackendError> {
        if let Some(&v) = self.views.get(&id) {
            return Ok(v);
        }
        self.buffers
            .get(&id)
            .map(|b| (id, 0, b.len()))
            .ok_or_else(|| BackendError::Other(format!("unknown buffer {}", id.0)))
    }

    fn words_of(&self, id: BufferId) -> Result<&[u8], BackendError> {
        let (parent, start, len) = self.resolve(id)?;
        Ok(&self.buffers[&parent][start..start + len])
    }

    fn words_mut(&mut self, id: BufferId) -> Result<&mut [u8], BackendError> {
        let (parent, start, len) = self.resolve(id)?;
        let b = self
            .buffers
            .get_mut(&parent)
            .ok_or_else(|| BackendError::Other(format!("unknown buffer {}", parent.0)))?;
        Ok(&mut b[start..start + len])
    }

    fn run_word_kernel(
        &mut self,
        op: Op,
        p: WordParams,
        buffers: &[BufferId],
    ) -> Result<(), BackendError> {
        let first = u64::from(p.first_word_lo) | (u64::from(p.first_word_hi) << 32);
        let len = p.len_words as usize;
        let data_id = *buffers
            .first()
            .ok_or_else(|| BackendError::Other("word kernel without a data buffer".into()))?;
        let data_len = self.words_of(data_id)?.len() / 4;
        if len > data_len {
            return Err(BackendError::Other(format!(
                "{len} words requested from a {data_len}-word buffer"
            )));
        }
        let home = self.resolve(data_id)?.0;
        let slowdown = match self.spill {
            Some((_, s)) if self.host_buffers.contains(&home) => s,
            _ => 1.0,
        };
        self.clock += (len * 4) as f64 / MOCK_BANDWIDTH * slowdown;
        match op {
            Op::Fill => {
                let data = self.words_mut(data_id)?;
                for (i, w) in data.chunks_exact_mut(4).take(len).enumerate() {
                    w.copy_from_slice(&pattern(first + i as u64, p.seed).to_le_bytes());
                }
                Ok(())
            }
            Op::Verify | Op::Checksum => {
                let result_id = *buffers
                    .get(1)
                    .ok_or_else(|| BackendError::Other("word kernel without a result".into()))?;
                let data = self.words_of(data_id)?;
                let words = data
                    .chunks_exact(4)
                    .take(len)
                    .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]));
                let add: [u32; 4] = if op == Op::Verify {
                    let mut bad = 0u32;
                    for (i, w) in words.enumerate() {
                        if w != pattern(first + i as u64, p.seed) {
                            bad = bad.wrapping_add(1);
                        }
                    }
                    [len as u32, bad, 0, 0]
                } else {
                    let sum = words.fold(0u64, |s, w| s.wrapping_add(u64::from(w)));
                    [sum as u32, (sum >> 32) as u32, len as u32, 0]
                };
                let result = self.words_mut(result_id)?;
                // Same semantics as the atomics: add into what is there (64-bit for checksum).
                let get = |r: &[u8], i: usize| {
                    r.get(i * 4..i * 4 + 4)
                        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .unwrap_or(0)
                };
                let mut cur = [0u32; 4];
                for (i, c) in cur.iter_mut().enumerate() {
                    *c = get(result, i);
                }
                let new = if op == Op::Checksum {
                    let s = (u64::from(cur[0]) | (u64::from(cur[1]) << 32))
                        .wrapping_add(u64::from(add[0]) | (u64::from(add[1]) << 32));
                    [
                        s as u32,
                        (s >> 32) as u32,
                        cur[2].wrapping_add(add[2]),
                        cur[3],
                    ]
                } else {
                    [
                        cur[0].wrapping_add(add[0]),
                        cur[1].wrapping_add(add[1]),
                        cur[2],
                        cur[3],
                    ]
                };
                for (i, v) in new.iter().enumerate() {
                    if let Some(slot) = result.get_mut(i * 4..i * 4 + 4) {
                        slot.copy_from_slice(&v.to_le_bytes());
                    }
                }
                Ok(())
            }
            _ => Err(BackendError::Other(
                "mock backend runs word kernels only".into(),
            )),
        }
    }
}

impl Backend for MockBackend {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn memory(&self) -> MemoryInfo {
        MemoryInfo {
            total_bytes: Some(self.capacity),
            free_bytes: Some(
                self.capacity
                    .saturating_sub(self.reserved())
                    .saturating_sub(self.allocated),
            ),
        }
    }

    fn alloc_buffer(&mut self, bytes: u64) -> Result<BufferId, AllocError> {
        let limit = self.info.max_chunk_bytes();
        if bytes > limit {
            return Err(AllocError::ExceedsLimit {
                requested: bytes,
                limit,
            });
        }
        if let Some(m) = &self.lost {
            return Err(AllocError::DeviceLost(m.clone()));
        }
        let size = bytes.div_ceil(4).max(1) * 4;
        if self.allocated.saturating_add(size) > self.capacity.saturating_sub(self.reserved()) {
            return Err(AllocError::OutOfMemory {
                requested: size,
                detail: format!(
                    "mock device: {} of {} bytes in use",
                    self.allocated, self.capacity
                ),
            });
        }
        let id = BufferId(self.next_id);
        self.next_id += 1;
        if self
            .spill
            .is_some_and(|(device, _)| self.allocated >= device)
        {
            self.host_buffers.insert(id);
        }
        if self.prepared {
            self.allocs_after_prepare += 1;
        }
        // Contents undefined on a real device; poison here so unwritten bytes show.
        self.buffers.insert(id, vec![0xA5; size as usize]);
        self.allocated += size;
        Ok(id)
    }

    fn free_buffer(&mut self, id: BufferId) {
        if self.views.remove(&id).is_some() {
            return;
        }
        if let Some(b) = self.buffers.remove(&id) {
            self.views.retain(|_, v| v.0 != id);
            self.allocated -= b.len() as u64;
            self.host_buffers.remove(&id);
        }
    }

    fn write_buffer(&mut self, id: BufferId, offset: u64, data: &[u8]) -> Result<(), BackendError> {
        self.check_lost()?;
        self.count_staging(data.len() as u64);
        let buf = self.words_mut(id)?;
        let start = usize::try_from(offset).map_err(|_| BackendError::Other("offset".into()))?;
        let slot = start
            .checked_add(data.len())
            .and_then(|end| buf.get_mut(start..end))
            .ok_or_else(|| BackendError::Other("write past the end of the buffer".into()))?;
        slot.copy_from_slice(data);
        Ok(())
    }

    fn read_buffer(
        &mut self,
        id: BufferId,
        offset: u64,
        len: u64,
    ) -> Result<Vec<u8>, BackendError> {
        self.check_lost()?;
        self.count_staging(len);
        if self.aborted() {
            return Ok(vec![0; len as usize]);
        }
        let buf = self.words_of(id)?;
        let start = usize::try_from(offset).map_err(|_| BackendError::Other("offset".into()))?;
        let len = usize::try_from(len).map_err(|_| BackendError::Other("length".into()))?;
        start
            .checked_add(len)
            .and_then(|end| buf.get(start..end))
            .map(<[u8]>::to_vec)
            .ok_or_else(|| BackendError::Other("read past the end of the buffer".into()))
    }

    fn dispatch(
        &mut self,
        kernel: KernelId,
        params: &[u8],
        buffers: &[BufferId],
        _workgroups: [u32; 3],
    ) -> Result<(), BackendError> {
        if self.lose_at.is_some_and(|n| self.dispatches >= n) {
            self.lose_device("mock: lost mid-probe");
        }
        self.check_lost()?;
        self.dispatches += 1;
        if self.aborted() {
            return Ok(());
        }
        match kernel.op {
            Op::Fill | Op::Verify | Op::Checksum => {
                let n = std::mem::size_of::<WordParams>();
                let bytes = params
                    .get(..n)
                    .ok_or_else(|| BackendError::Other("word params too short".into()))?;
                let p: WordParams = bytemuck::pod_read_unaligned(bytes);
                self.run_word_kernel(kernel.op, p, buffers)
            }
            _ => Err(BackendError::Other(
                "mock backend runs word kernels only".into(),
            )),
        }
    }

    fn view_buffer(&mut self, parent: BufferId, offset: u64, bytes: u64) -> Option<BufferId> {
        if !self.views_on {
            return None;
        }
        let len = self.buffers.get(&parent)?.len();
        let start = usize::try_from(offset).ok()?;
        let n = usize::try_from(bytes.div_ceil(4).max(1) * 4).ok()?;
        if start.checked_add(n)? > len {
            return None;
        }
        let id = BufferId(self.next_id);
        self.next_id += 1;
        self.views.insert(id, (parent, start, n));
        Some(id)
    }

    fn warm_up(&mut self) -> Result<(), BackendError> {
        self.check_lost()?;
        self.warm = true;
        Ok(())
    }

    fn synchronize(&mut self) -> Result<(), BackendError> {
        self.check_lost()
    }

    fn allocated_bytes(&self) -> u64 {
        self.allocated
    }

    fn prepare(&mut self, _kernels: &[KernelId]) -> Result<(), BackendError> {
        self.check_lost()?;
        self.prepared = true;
        Ok(())
    }

    fn staging_after_prepare(&self) -> u64 {
        self.staging_after_prepare
    }

    fn device_seconds(&self) -> Option<f64> {
        Some(self.clock)
    }

    fn heap_usage(&self) -> Option<HeapUsage> {
        if !self.heaps {
            return None;
        }
        let host: u64 = self
            .host_buffers
            .iter()
            .filter_map(|id| self.buffers.get(id))
            .map(|b| b.len() as u64)
            .sum();
        Some(HeapUsage {
            device_local_usage: self.allocated - host + self.reserved(),
            device_local_budget: self.capacity,
            other_usage: host,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ops::words::{checksum_tensor, fill_tensor, verify_tensor, Checksum};
    use crate::plan::DType;
    use crate::tensor::{allocate, free_tensor};

    #[test]
    fn out_of_memory_then_free_then_fits() {
        let mut m = MockBackend::new(1000);
        let a = m.alloc_buffer(600).unwrap();
        let e = m.alloc_buffer(600).unwrap_err();
        assert!(matches!(e, AllocError::OutOfMemory { requested: 600, .. }));
        m.free_buffer(a);
        assert_eq!(m.allocated_bytes(), 0);
        assert!(m.alloc_buffer(600).is_ok());
    }

    #[test]
    fn exceeds_limit_is_not_oom() {
        let mut m = MockBackend::with_limits(1 << 30, 1024, 512);
        let e = m.alloc_buffer(513).unwrap_err();
        assert_eq!(
            e,
            AllocError::ExceedsLimit {
                requested: 513,
                limit: 512
            }
        );
    }

    #[test]
    fn chunked_fill_verify_checksum_round_trip() {
        // 1000 f32 in rows of 10, 256-byte buffers -> 16 chunks of 6 rows (240 B) and a tail.
        let mut m = MockBackend::with_limits(1 << 20, 256, 256);
        let t = allocate(&mut m, "t", DType::F32, 1000, 10).unwrap();
        assert_eq!(t.chunks.len(), 17);
        fill_tensor(&mut m, &t, 9).unwrap();
        let v = verify_tensor(&mut m, &t, 9).unwrap();
        assert_eq!((v.words_seen, v.mismatches), (1000, 0));
        assert_eq!(verify_tensor(&mut m, &t, 10).unwrap().mismatches, 1000);
        let c = checksum_tensor(&mut m, &t).unwrap();
        assert_eq!(c, Checksum::of_pattern(0, 1000, 9));
        // Corrupt one word in the third chunk.
        m.write_buffer(t.chunks[2].buffer, 8, &[0, 0, 0, 0])
            .unwrap();
        assert_eq!(verify_tensor(&mut m, &t, 9).unwrap().mismatches, 1);
        free_tensor(&mut m, t);
        assert_eq!(m.allocated_bytes(), 0);
    }

    #[test]
    fn failed_tensor_allocation_frees_its_chunks() {
        let mut m = MockBackend::with_limits(1000, 256, 256);
        let e = allocate(&mut m, "t", DType::F32, 300, 1).unwrap_err();
        assert!(matches!(e, AllocError::OutOfMemory { .. }));
        assert_eq!(m.allocated_bytes(), 0);
    }

    #[test]
    fn other_kernels_are_refused_and_loss_is_reported() {
        let mut m = MockBackend::new(1 << 20);
        let id = m.alloc_buffer(64).unwrap();
        let e = m
            .dispatch(KernelId::words(Op::Matmul), &[0; 16], &[id], [1, 1, 1])
            .unwrap_err();
        assert!(e.to_string().contains("word kernels only"));
        m.lose_device("test");
        assert!(matches!(m.synchronize(), Err(BackendError::DeviceLost(_))));
        assert!(matches!(m.alloc_buffer(4), Err(AllocError::DeviceLost(_))));
    }
}
