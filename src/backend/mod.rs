//! The `Backend` trait: the small surface every device implementation offers (wgpu, cuda, mock).
//!
//! Everything above this trait (tensor chunking, kernel orchestration, budgets, probes, search)
//! is written once and shared by all backends.

/// The `Backend` methods a wrapper (budget, pooled) passes straight to the backend it wraps,
/// `self.<field path>`.
macro_rules! forward_to_inner {
    ($($inner:ident).+) => {
        fn write_buffer(&mut self, id: BufferId, offset: u64, data: &[u8]) -> Result<(), BackendError> {
            self.$($inner).+.write_buffer(id, offset, data)
        }
        fn read_buffer(&mut self, id: BufferId, offset: u64, len: u64) -> Result<Vec<u8>, BackendError> {
            self.$($inner).+.read_buffer(id, offset, len)
        }
        fn dispatch(
            &mut self,
            kernel: KernelId,
            params: &[u8],
            buffers: &[BufferId],
            workgroups: [u32; 3],
        ) -> Result<(), BackendError> {
            self.$($inner).+.dispatch(kernel, params, buffers, workgroups)
        }
        fn synchronize(&mut self) -> Result<(), BackendError> {
            self.$($inner).+.synchronize()
        }
        fn warm_up(&mut self) -> Result<(), BackendError> {
            self.$($inner).+.warm_up()
        }
        fn prepare(&mut self, kernels: &[KernelId]) -> Result<(), BackendError> {
            self.$($inner).+.prepare(kernels)
        }
        fn staging_after_prepare(&self) -> u64 {
            self.$($inner).+.staging_after_prepare()
        }
        fn device_seconds(&self) -> Option<f64> {
            self.$($inner).+.device_seconds()
        }
        fn heap_usage(&self) -> Option<HeapUsage> {
            self.$($inner).+.heap_usage()
        }
    };
}
pub(crate) use forward_to_inner;

pub mod astrace;
pub mod budget;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod mock;
pub mod nvidia;
pub mod open;
pub mod overhead;
pub mod pooled;
pub mod timing;
pub mod wgpu;

use serde::{Deserialize, Serialize};
use thiserror::Error;

use crate::kernels::KernelId;

/// Which API a device is reached through (contract names, lower case in JSON).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum BackendKind {
    Vulkan,
    Metal,
    Dx12,
    Gl,
    Cuda,
    Mock,
}

impl BackendKind {
    pub fn as_str(self) -> &'static str {
        match self {
            BackendKind::Vulkan => "vulkan",
            BackendKind::Metal => "metal",
            BackendKind::Dx12 => "dx12",
            BackendKind::Gl => "gl",
            BackendKind::Cuda => "cuda",
            BackendKind::Mock => "mock",
        }
    }
}

/// `device_type` of the JSON contract.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceType {
    Discrete,
    Integrated,
    Cpu,
    Virtual,
    Other,
}

/// What `devices --json` prints per device and what a probe report carries (contract fields).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceInfo {
    pub index: usize,
    pub name: String,
    pub backend: BackendKind,
    pub device_type: DeviceType,
    pub driver: String,
    pub memory_total_bytes: Option<u64>,
    pub memory_free_bytes: Option<u64>,
    pub max_buffer_size: u64,
    pub max_storage_binding_size: u64,
    /// What the device holds before the first tensor (total − free once it is open, its
    /// kernels loaded and each launched once): the context, the modules, the local memory
    /// sized at the first launch, and other processes' memory. `memory_free_bytes` is what is
    /// left after it. Null where the API tells no free memory (wgpu) or it was not measured.
    #[serde(default)]
    pub overhead_bytes: Option<u64>,
    /// The part of `overhead_bytes` that appeared with loading the kernels and their first
    /// launch (the rest was there once the context existed). Null where not measured.
    #[serde(default)]
    pub kernel_overhead_bytes: Option<u64>,
}

impl DeviceInfo {
    /// A typical CPU adapter (lavapipe's facts) of `total` bytes, for tests and sample reports.
    pub fn sample(name: &str, total: u64) -> DeviceInfo {
        DeviceInfo {
            index: 0,
            name: name.to_string(),
            backend: BackendKind::Vulkan,
            device_type: DeviceType::Cpu,
            driver: "Mesa 22.3.6 (LLVM 15.0.6)".to_string(),
            memory_total_bytes: Some(total),
            memory_free_bytes: None,
            max_buffer_size: (2 << 30) - 1,
            max_storage_binding_size: 128 << 20,
            overhead_bytes: None,
            kernel_overhead_bytes: None,
        }
    }

    /// The largest single buffer a tensor chunk may use: one binding, one buffer.
    pub fn max_chunk_bytes(&self) -> u64 {
        self.max_buffer_size.min(self.max_storage_binding_size)
    }
}

/// Why an allocation did not happen. Kept apart so a probe can classify its outcome.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum AllocError {
    /// The device (driver) refused the memory.
    #[error("out of memory: the device refused {requested} bytes ({detail})")]
    OutOfMemory { requested: u64, detail: String },
    /// A buffer can never be this big on this device (validation, not memory pressure).
    #[error("{requested} bytes exceed the device limit of {limit} bytes")]
    ExceedsLimit { requested: u64, limit: u64 },
    /// The user's emulated cap (`--budget`) would be passed.
    #[error("budget: {requested} more bytes would pass the {budget}-byte budget ({used} in use)")]
    Budget {
        requested: u64,
        budget: u64,
        used: u64,
    },
    /// The device was lost (driver reset, crash).
    #[error("device lost: {0}")]
    DeviceLost(String),
    /// Anything else the backend reported.
    #[error("{0}")]
    Other(String),
}

/// A failure of a non-allocation operation (dispatch, copy, synchronise, read back).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum BackendError {
    #[error("out of memory during {0}")]
    OutOfMemory(String),
    /// A scratch allocation inside an operation was refused by the user's budget.
    #[error("{0}")]
    Budget(String),
    #[error("device lost: {0}")]
    DeviceLost(String),
    #[error("{0}")]
    Other(String),
}

impl From<AllocError> for BackendError {
    fn from(e: AllocError) -> Self {
        match e {
            AllocError::OutOfMemory { .. } => BackendError::OutOfMemory(e.to_string()),
            AllocError::Budget { .. } => BackendError::Budget(e.to_string()),
            AllocError::DeviceLost(m) => BackendError::DeviceLost(m),
            other => BackendError::Other(other.to_string()),
        }
    }
}

/// A device buffer (one chunk of a tensor), valid until freed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct BufferId(pub u64);

/// Memory as the API reports it right now (None where it does not tell).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct MemoryInfo {
    pub total_bytes: Option<u64>,
    pub free_bytes: Option<u64>,
}

/// Heap usage as Vulkan's `VK_EXT_memory_budget` reports it for this process: device-local
/// heaps (usage and the budget the driver grants) and every other heap (system memory the
/// device can reach). A driver that backs "device-local" buffers with system memory shows it
/// as usage growing outside the device-local heaps, or device-local usage over budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct HeapUsage {
    pub device_local_usage: u64,
    pub device_local_budget: u64,
    pub other_usage: u64,
}

/// Writes and reads of at most this many bytes go through staging the backend set up before
/// the probe (`Backend::prepare`); larger ones need a staging buffer of their own, which must
/// never happen once tensors fill memory (it can lose the device on wgpu).
pub const STAGED_BYTES: u64 = 256;

/// The small surface a device offers. Buffers are raw bytes; kernels are named by `KernelId`
/// and take `params` (a `#[repr(C)]` POD struct from `kernels::params`, bound as a uniform in
/// WGSL and passed by value in CUDA) plus storage buffers in binding order.
pub trait Backend {
    /// Static facts about the device.
    fn info(&self) -> &DeviceInfo;
    /// Current total/free memory where the API tells.
    fn memory(&self) -> MemoryInfo;
    /// Allocate one buffer of `bytes` (at most `info().max_chunk_bytes()`), contents undefined.
    /// Must return `OutOfMemory` when the device refuses, never panic.
    fn alloc_buffer(&mut self, bytes: u64) -> Result<BufferId, AllocError>;
    /// `alloc_buffer` from `stream`'s pool (`plan::Stream::id`): a backend that pools freed
    /// blocks per stream (`pooled`, as PyTorch's caching allocator) keeps them apart; the
    /// others allocate alike whatever the stream.
    fn alloc_buffer_on(&mut self, bytes: u64, stream: i64) -> Result<BufferId, AllocError> {
        let _ = stream;
        self.alloc_buffer(bytes)
    }
    /// Release a buffer. Freeing an unknown id is a no-op.
    fn free_buffer(&mut self, id: BufferId);
    /// Copy host bytes into a buffer at `offset`.
    fn write_buffer(&mut self, id: BufferId, offset: u64, data: &[u8]) -> Result<(), BackendError>;
    /// Copy `len` bytes from a buffer at `offset` back to the host (synchronises).
    fn read_buffer(&mut self, id: BufferId, offset: u64, len: u64)
        -> Result<Vec<u8>, BackendError>;
    /// Enqueue one kernel launch: `workgroups` groups of `kernel.workgroup_size()` threads.
    fn dispatch(
        &mut self,
        kernel: KernelId,
        params: &[u8],
        buffers: &[BufferId],
        workgroups: [u32; 3],
    ) -> Result<(), BackendError>;
    /// Wait for all enqueued work; report device loss or late errors.
    fn synchronize(&mut self) -> Result<(), BackendError>;
    /// Bytes currently held in live buffers allocated through this backend.
    fn allocated_bytes(&self) -> u64;
    /// Hold `bytes` outside the device's allocator, where a step holds what is not a tensor
    /// (command buffers, descriptors: host memory on a CPU adapter), until
    /// [`Backend::release_outside`]: whether it was taken, None where this backend holds
    /// nothing outside its buffers (see `probe::dry`).
    fn hold_outside(&mut self, _bytes: u64) -> Option<bool> {
        None
    }
    /// Give back what [`Backend::hold_outside`] holds.
    fn release_outside(&mut self) {}
    /// Loads every kernel and launches each once on no data, so that what the driver takes for
    /// kernels (module code, local memory sized at the first launch) is taken now, before
    /// memory is measured (see [`overhead`]). Nothing to do where the API tells no free memory.
    fn warm_up(&mut self) -> Result<(), BackendError> {
        Ok(())
    }
    /// Get `kernels` ready to launch (compile them) now, before a probe allocates its tensors:
    /// a shader compiler that runs out of host memory at the edge crashes the process, so
    /// nothing is compiled once memory is full. The default does nothing.
    ///
    /// It also sets up what the backend needs besides tensors for the whole probe (staging for
    /// kernel parameters, small writes and read-backs of at most [`STAGED_BYTES`]), so that
    /// no staging or scratch buffer is created once the tensors are allocated.
    fn prepare(&mut self, kernels: &[KernelId]) -> Result<(), BackendError> {
        let _ = kernels;
        Ok(())
    }
    /// Staging buffers the backend had to create for itself after `prepare` (a write or read
    /// larger than [`STAGED_BYTES`]): stays 0 during a probe. For tests and diagnostics.
    fn staging_after_prepare(&self) -> u64 {
        0
    }
    /// A clock of device time in seconds where the backend models or measures one (the mock
    /// models it from the bytes each kernel touches); None: callers time with the wall clock.
    fn device_seconds(&self) -> Option<f64> {
        None
    }
    /// Heap usage and budget where the API reports them (Vulkan with `VK_EXT_memory_budget`).
    fn heap_usage(&self) -> Option<HeapUsage> {
        None
    }
    /// A buffer that is `bytes` of `parent` from `offset` on (a tensor in a segment, see
    /// [`pooled`]): written, read and bound like any buffer; freeing it frees nothing, and
    /// freeing the parent ends it. None where the backend cannot bind part of a buffer.
    fn view_buffer(&mut self, _parent: BufferId, _offset: u64, _bytes: u64) -> Option<BufferId> {
        None
    }
    /// The caching allocator's counters where tensors go through one ([`pooled`]).
    fn allocator_stats(&self) -> Option<crate::alloc::Stats> {
        None
    }
}

/// A boxed backend for code that chooses one at run time.
pub type DynBackend = Box<dyn Backend>;
