//! The CUDA backend through cudarc (dynamic loading; kernels from shaders/*.cu).
//!
//! Building needs no CUDA, and running needs only the NVIDIA driver: the kernels ship inside
//! the binary as PTX ([`ptx`]), which the driver JIT-compiles for the card. Where NVRTC is found
//! at run time, kernels are compiled by it instead, as a CUBIN for the exact card
//! ([`KernelSource`]). The driver library is checked for before cudarc is called (see
//! [`loader`]), so a machine without it gets an `Err` with the reason, never a panic.
//!
//! Memory: buffers are plain `cuMemAlloc` / `cuMemFree` (not cudarc's stream-ordered pool), so
//! `CUDA_ERROR_OUT_OF_MEMORY` comes back at the allocation that does not fit, and freed memory
//! goes straight back to the driver, as with PyTorch's first `cudaMalloc`. All work (copies and
//! launches) goes to the legacy default stream, so it runs in submission order.
//!
//! Chunk size: CUDA has no per-buffer limit below the card's memory, so `max_buffer_size` is
//! the total memory. `max_storage_binding_size` (and so the chunk size the shared tensor code
//! uses) is capped at [`MAX_BINDING_BYTES`] = 2 GiB, the same cap wgpu has on every card: the
//! kernels index 32-bit words with `u32` like their WGSL twins, and the two backends then
//! split every tensor into the same chunks, so their tables are comparable.
//!
//! `device` finds devices and says what each is; `errors` names and classifies driver errors.

mod device;
mod errors;
pub mod loader;
pub mod nvrtc;
pub mod ptx;

use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::{Arc, Mutex, OnceLock};

use cudarc::driver::result::{self as cu, DriverError};
use cudarc::driver::sys;
use cudarc::driver::{CudaContext, CudaFunction};
use cudarc::nvrtc::Ptx;

use super::{AllocError, Backend, BackendError, BufferId, DeviceInfo, MemoryInfo};
use crate::kernels::{params, KernelId};

pub use device::{device_count, list_devices, measured_device};
pub use nvrtc::compile_all_kernels;

use device::{device_info, driver_version, new_context};
use errors::{classify, err_name, err_text, Class};

/// The largest chunk (one buffer bound to one kernel argument) the shared code uses on CUDA.
pub const MAX_BINDING_BYTES: u64 = 1 << 31;

/// The largest params struct a dispatch accepts (all of `kernels::params` are far smaller).
pub const MAX_PARAM_BYTES: usize = 256;

/// CUDA's grid limits (x up to 2^31 - 1 blocks, y and z up to 65535).
const MAX_GRID: [u32; 3] = [i32::MAX as u32, 65535, 65535];

/// Set to `1` to load the embedded PTX even where NVRTC is found (the driver-only path).
pub const EMBEDDED_ENV: &str = "OOMPROBE_CUDA_EMBEDDED";

/// Bytes of the one buffer every warm-up launch binds (no kernel touches it on empty params).
const WARM_UP_SCRATCH_BYTES: u64 = 4096;

/// Opens CUDA device `index` (default 0) as a backend, or says why it cannot.
pub fn open(index: Option<usize>) -> Result<Box<dyn Backend>, String> {
    Ok(Box::new(CudaBackend::new(index.unwrap_or(0))?))
}

/// The driver library present, or the reason it is not (no driver call is made). NVRTC is
/// optional (see [`KernelSource`]).
pub fn available() -> Result<(), String> {
    loader::driver_library()
}

/// Where a device's kernels come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelSource {
    /// NVRTC at run time: a CUBIN for the card's own architecture, or PTX for the newest one
    /// NVRTC knows below it.
    Nvrtc(nvrtc::Target),
    /// The PTX inside the binary ([`ptx`]), JIT-compiled by the driver: no NVRTC needed.
    Embedded,
}

impl std::fmt::Display for KernelSource {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            KernelSource::Nvrtc(t) => match nvrtc::version() {
                Ok((a, b)) => write!(f, "NVRTC {a}.{b} {t}"),
                Err(_) => write!(f, "NVRTC {t}"),
            },
            KernelSource::Embedded => write!(
                f,
                "embedded PTX compute_{} ISA {}.{}",
                ptx::EMBED_ARCH,
                ptx::EMBED_ISA.0,
                ptx::EMBED_ISA.1
            ),
        }
    }
}

/// NVRTC when it is found and can target the card (unless [`EMBEDDED_ENV`] says otherwise),
/// else the embedded PTX.
fn kernel_source(major: i32, minor: i32) -> KernelSource {
    if std::env::var_os(EMBEDDED_ENV).is_some_and(|v| v == "1") {
        return KernelSource::Embedded;
    }
    match loader::nvrtc_library().and_then(|()| nvrtc::target_for_device(major, minor)) {
        Ok(t) => KernelSource::Nvrtc(t),
        Err(reason) => {
            log::info!("CUDA kernels: the embedded PTX ({reason})");
            KernelSource::Embedded
        }
    }
}

/// A loaded kernel and what the driver says about its signature.
struct Loaded {
    func: CudaFunction,
    /// (size of the params struct, number of kernel parameters), from `cuFuncGetParamInfo`
    /// (driver 12.4+); `None` on older drivers.
    signature: Option<(usize, usize)>,
}

/// One live buffer: device pointer and size in bytes; `parent` for a view into another
/// buffer (`Backend::view_buffer`: a tensor in a segment), which owns no memory.
#[derive(Debug, Clone, Copy)]
struct Buffer {
    ptr: sys::CUdeviceptr,
    bytes: u64,
    parent: Option<u64>,
}

/// The params struct as the first kernel argument: the driver copies as many bytes as the
/// kernel's first parameter declares (checked against `params.len()` where the driver tells).
#[repr(C, align(16))]
#[derive(Clone, Copy)]
struct ParamBlock([u8; MAX_PARAM_BYTES]);

/// A CUDA device opened for probing.
pub struct CudaBackend {
    info: DeviceInfo,
    ctx: Arc<CudaContext>,
    /// Where kernels come from (NVRTC for the card, or the embedded PTX).
    source: KernelSource,
    /// Driver version as an integer (e.g. 12040), for feature checks and error hints.
    driver_version: i32,
    buffers: HashMap<u64, Buffer>,
    next_id: u64,
    allocated: u64,
    kernels: HashMap<KernelId, Loaded>,
    /// Set by the first sticky error; every later call reports it as device loss.
    lost: Option<String>,
}

impl CudaBackend {
    /// Opens CUDA device `ordinal`. Errors (as one line) when the driver is unavailable.
    pub fn new(ordinal: usize) -> Result<Self, String> {
        Self::open(ordinal, None)
    }

    /// Opens CUDA device `ordinal` with the embedded PTX as its kernels, NVRTC or not.
    pub fn with_embedded_ptx(ordinal: usize) -> Result<Self, String> {
        Self::open(ordinal, Some(KernelSource::Embedded))
    }

    fn open(ordinal: usize, source: Option<KernelSource>) -> Result<Self, String> {
        loader::driver_library()?;
        let ctx = new_context(ordinal)?;
        let (major, minor) = loader::guarded("compute capability", || ctx.compute_capability())?
            .map_err(|e| format!("compute capability: {}", err_text(e)))?;
        let source = source.unwrap_or_else(|| kernel_source(major, minor));
        let info = device_info(&ctx, ordinal, source)?;
        let driver_version = loader::guarded("cuDriverGetVersion", driver_version)??;
        Ok(CudaBackend {
            info,
            ctx,
            source,
            driver_version,
            buffers: HashMap::new(),
            next_id: 1,
            allocated: 0,
            kernels: HashMap::new(),
            lost: None,
        })
    }

    /// Caps the chunk size (for tests that make tensors span many buffers), like
    /// `WgpuBackend::cap_max_buffer`: rounded down to whole 32-bit words, at least one word.
    pub fn cap_max_buffer(&mut self, bytes: u64) {
        let cap = (bytes / 4 * 4).max(4).min(self.info.max_chunk_bytes());
        self.info.max_storage_binding_size = self.info.max_storage_binding_size.min(cap);
    }

    /// The driver's CUDA version as `cuDriverGetVersion` gives it (e.g. 12040 for 12.4).
    pub fn driver_version(&self) -> i32 {
        self.driver_version
    }

    /// Where kernels come from on this device.
    pub fn kernel_source(&self) -> KernelSource {
        self.source
    }

    fn bind(&self) -> Result<(), DriverError> {
        self.ctx.bind_to_thread()
    }

    /// Records a sticky error and builds the error to return.
    fn backend_error(&mut self, what: &str, e: DriverError) -> BackendError {
        let text = format!("{what}: {}", err_text(e));
        match classify(e) {
            Class::OutOfMemory => BackendError::OutOfMemory(text),
            Class::Lost => {
                self.lost = Some(text.clone());
                BackendError::DeviceLost(text)
            }
            Class::Other => BackendError::Other(text),
        }
    }

    fn check_lost(&self) -> Result<(), BackendError> {
        match &self.lost {
            Some(m) => Err(BackendError::DeviceLost(m.clone())),
            None => Ok(()),
        }
    }

    fn buffer(&self, id: BufferId) -> Result<Buffer, BackendError> {
        self.buffers
            .get(&id.0)
            .copied()
            .ok_or_else(|| BackendError::Other(format!("unknown CUDA buffer {}", id.0)))
    }

    fn range(&self, id: BufferId, offset: u64, len: u64) -> Result<Buffer, BackendError> {
        let b = self.buffer(id)?;
        match offset.checked_add(len) {
            Some(end) if end <= b.bytes => Ok(b),
            _ => Err(BackendError::Other(format!(
                "range {offset}+{len} is outside CUDA buffer {} of {} bytes",
                id.0, b.bytes
            ))),
        }
    }

    /// Compiles (NVRTC) or takes (embedded PTX) a kernel and loads it, on first use.
    fn load(&mut self, kernel: KernelId) -> Result<(), BackendError> {
        if self.kernels.contains_key(&kernel) {
            return Ok(());
        }
        let mut loaded = match self.source {
            KernelSource::Nvrtc(target) => {
                let image = compiled_image(kernel, target).map_err(BackendError::Other)?;
                self.load_image(kernel, image)?
            }
            KernelSource::Embedded => self.load_image(kernel, ptx::embedded_image(kernel))?,
        };
        if let (Err(e), KernelSource::Nvrtc(_)) = (&loaded, self.source) {
            if classify(*e) == Class::Other {
                // E.g. NVRTC's PTX is newer than this driver, or its CUBIN is of another CUDA
                // major version: the embedded PTX is older than both.
                log::info!(
                    "{}: NVRTC's image did not load ({}); loading the embedded PTX",
                    kernel.label(),
                    err_name(*e)
                );
                loaded = self.load_image(kernel, ptx::embedded_image(kernel))?;
            }
        }
        let func = match loaded {
            Ok(f) => f,
            Err(e) => {
                let mut err = self.backend_error(&format!("loading kernel {}", kernel.label()), e);
                if err_name(e) == "CUDA_ERROR_UNSUPPORTED_PTX_VERSION" {
                    let hint = format!(
                        "; this driver (CUDA {}.{}) is older than the PTX ISA {}.{} of the \
                         embedded kernels needs: {} or newer",
                        self.driver_version / 1000,
                        (self.driver_version % 1000) / 10,
                        ptx::EMBED_ISA.0,
                        ptx::EMBED_ISA.1,
                        ptx::EMBED_MIN_DRIVER
                    );
                    if let BackendError::Other(m) = &mut err {
                        m.push_str(&hint);
                    }
                }
                return Err(err);
            }
        };
        let signature = if self.driver_version >= 12040 {
            loader::guarded("cuFuncGetParamInfo", || signature(&func)).unwrap_or(None)
        } else {
            // Older drivers cannot tell: the embedded PTX declares the same entry point.
            ptx_signature(kernel)
        };
        self.kernels.insert(kernel, Loaded { func, signature });
        Ok(())
    }

    /// Loads a module image (PTX text with its NUL, or CUBIN bytes) and finds the entry point.
    fn load_image(
        &self,
        kernel: KernelId,
        image: Vec<u8>,
    ) -> Result<Result<CudaFunction, DriverError>, BackendError> {
        let ctx = self.ctx.clone();
        loader::guarded("cuModuleLoadData", || {
            ctx.load_module(Ptx::from_binary(image))
                .and_then(|m| m.load_function(nvrtc::entry_point(kernel.op)))
        })
        .map_err(BackendError::Other)
    }

    /// A scratch buffer, each of `kernels` launched once over it, freed.
    fn launch_once(&mut self, kernels: &[KernelId]) -> Result<(), BackendError> {
        let scratch = self.alloc_buffer(WARM_UP_SCRATCH_BYTES)?;
        let r = self.launch_each_kernel_once(kernels, scratch);
        self.free_buffer(scratch);
        r
    }

    /// Launches each of `kernels` once on empty params (each then does nothing) over one small
    /// scratch buffer.
    fn launch_each_kernel_once(
        &mut self,
        kernels: &[KernelId],
        scratch: BufferId,
    ) -> Result<(), BackendError> {
        self.write_buffer(scratch, 0, &[0u8; WARM_UP_SCRATCH_BYTES as usize])?;
        for &id in kernels {
            let params = vec![0u8; params::params_bytes(id.op)];
            let buffers = vec![scratch; params::buffer_count(id.op)];
            self.dispatch(id, &params, &buffers, [1, 1, 1])?;
        }
        self.synchronize()
    }
}

/// NVRTC's module image of a kernel, compiled once per process and target (listing several
/// cards of one architecture, or a warm-up then a probe, compiles each kernel once).
fn compiled_image(kernel: KernelId, target: nvrtc::Target) -> Result<Vec<u8>, String> {
    type Cache = Mutex<HashMap<(KernelId, nvrtc::Target), Vec<u8>>>;
    static CACHE: OnceLock<Cache> = OnceLock::new();
    let cache = CACHE.get_or_init(Default::default);
    let key = (ptx::canonical(kernel), target);
    if let Some(image) = cache.lock().ok().and_then(|c| c.get(&key).cloned()) {
        return Ok(image);
    }
    let compiled = nvrtc::compile(key.0, target)?;
    if !compiled.log.trim().is_empty() {
        log::debug!("NVRTC log for {}: {}", kernel.label(), compiled.log.trim());
    }
    if let Ok(mut c) = cache.lock() {
        c.insert(key, compiled.image.clone());
    }
    Ok(compiled.image)
}

/// (size of parameter 0, number of parameters) of a kernel's entry point in the embedded PTX.
fn ptx_signature(kernel: KernelId) -> Option<(usize, usize)> {
    let entries = ptx::parse_entries(ptx::embedded(kernel)).ok()?;
    let entry = entries
        .into_iter()
        .find(|e| e.name == nvrtc::entry_point(kernel.op))?;
    Some((entry.params.first()?.size(), entry.params.len()))
}

/// (size of parameter 0, number of parameters) of a kernel, where the driver tells.
fn signature(func: &CudaFunction) -> Option<(usize, usize)> {
    let f = func.cu_function();
    let mut first = 0usize;
    let mut count = 0usize;
    for index in 0..64usize {
        let (mut offset, mut size) = (0usize, 0usize);
        // SAFETY: `f` is a live function handle; out-pointers to live locals.
        let r = unsafe { sys::cuFuncGetParamInfo(f, index, &mut offset, &mut size) };
        if r != sys::CUresult::CUDA_SUCCESS {
            break;
        }
        if index == 0 {
            first = size;
        }
        count = index + 1;
    }
    (count > 0).then_some((first, count))
}

impl Backend for CudaBackend {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn memory(&self) -> MemoryInfo {
        let got = loader::guarded("cuMemGetInfo", || {
            self.bind()?;
            cu::mem_get_info()
        });
        match got {
            Ok(Ok((free, total))) => MemoryInfo {
                total_bytes: Some(total as u64),
                free_bytes: Some(free as u64),
            },
            _ => MemoryInfo {
                total_bytes: self.info.memory_total_bytes,
                free_bytes: None,
            },
        }
    }

    fn alloc_buffer(&mut self, bytes: u64) -> Result<BufferId, AllocError> {
        if let Some(m) = &self.lost {
            return Err(AllocError::DeviceLost(m.clone()));
        }
        if bytes > self.info.max_buffer_size {
            return Err(AllocError::ExceedsLimit {
                requested: bytes,
                limit: self.info.max_buffer_size,
            });
        }
        let size = usize::try_from(bytes).map_err(|_| AllocError::ExceedsLimit {
            requested: bytes,
            limit: usize::MAX as u64,
        })?;
        let ptr = if size == 0 {
            0
        } else {
            let got = loader::guarded("cuMemAlloc", || {
                self.bind()?;
                // SAFETY: a plain allocation in the bound context.
                unsafe { cu::malloc_sync(size) }
            })
            .map_err(AllocError::Other)?;
            match got {
                Ok(p) => p,
                Err(e) => {
                    return Err(match classify(e) {
                        Class::OutOfMemory => {
                            let free = self
                                .memory()
                                .free_bytes
                                .map(|f| format!("; {f} bytes free"))
                                .unwrap_or_default();
                            AllocError::OutOfMemory {
                                requested: bytes,
                                detail: format!("cuMemAlloc: {}{free}", err_name(e)),
                            }
                        }
                        Class::Lost => {
                            let m = format!("cuMemAlloc: {}", err_text(e));
                            self.lost = Some(m.clone());
                            AllocError::DeviceLost(m)
                        }
                        Class::Other => {
                            AllocError::Other(format!("cuMemAlloc({bytes}): {}", err_text(e)))
                        }
                    })
                }
            }
        };
        let id = self.next_id;
        self.next_id += 1;
        self.buffers.insert(
            id,
            Buffer {
                ptr,
                bytes,
                parent: None,
            },
        );
        self.allocated += bytes;
        Ok(BufferId(id))
    }

    fn free_buffer(&mut self, id: BufferId) {
        let Some(b) = self.buffers.remove(&id.0) else {
            return;
        };
        if b.parent.is_some() {
            return;
        }
        self.buffers.retain(|_, v| v.parent != Some(id.0));
        self.allocated = self.allocated.saturating_sub(b.bytes);
        if b.ptr != 0 {
            let r = loader::guarded("cuMemFree", || {
                self.bind()?;
                // SAFETY: `b.ptr` came from cuMemAlloc in this context and is freed once.
                unsafe { cu::free_sync(b.ptr) }
            });
            if let Ok(Err(e)) = r {
                log::warn!("cuMemFree: {}", err_text(e));
            }
        }
    }

    fn write_buffer(&mut self, id: BufferId, offset: u64, data: &[u8]) -> Result<(), BackendError> {
        self.check_lost()?;
        let b = self.range(id, offset, data.len() as u64)?;
        if data.is_empty() {
            return Ok(());
        }
        let r = loader::guarded("cuMemcpyHtoD", || {
            self.bind()?;
            // SAFETY: the destination range lies inside a live allocation (checked above).
            unsafe { cu::memcpy_htod_sync(b.ptr + offset, data) }
        })
        .map_err(BackendError::Other)?;
        r.map_err(|e| self.backend_error("cuMemcpyHtoD", e))
    }

    fn read_buffer(
        &mut self,
        id: BufferId,
        offset: u64,
        len: u64,
    ) -> Result<Vec<u8>, BackendError> {
        self.check_lost()?;
        let b = self.range(id, offset, len)?;
        let n = usize::try_from(len)
            .map_err(|_| BackendError::Other(format!("cannot read {len} bytes")))?;
        let mut out = vec![0u8; n];
        if n == 0 {
            return Ok(out);
        }
        let r = loader::guarded("cuMemcpyDtoH", || {
            self.bind()?;
            // SAFETY: the source range lies inside a live allocation (checked above); the copy
            // is synchronous, so `out` is complete when it returns.
            unsafe { cu::memcpy_dtoh_sync(&mut out, b.ptr + offset) }
        })
        .map_err(BackendError::Other)?;
        r.map_err(|e| self.backend_error("cuMemcpyDtoH", e))?;
        Ok(out)
    }

    fn dispatch(
        &mut self,
        kernel: KernelId,
        params: &[u8],
        buffers: &[BufferId],
        workgroups: [u32; 3],
    ) -> Result<(), BackendError> {
        self.check_lost()?;
        if params.len() > MAX_PARAM_BYTES {
            return Err(BackendError::Other(format!(
                "{}: {} bytes of params exceed the {MAX_PARAM_BYTES}-byte limit",
                kernel.label(),
                params.len()
            )));
        }
        for (axis, (&n, &max)) in workgroups.iter().zip(MAX_GRID.iter()).enumerate() {
            if n > max {
                return Err(BackendError::Other(format!(
                    "{}: {n} workgroups on axis {axis} exceed CUDA's grid limit {max}",
                    kernel.label()
                )));
            }
        }
        let ptrs: Vec<sys::CUdeviceptr> = buffers
            .iter()
            .map(|&id| self.buffer(id).map(|b| b.ptr))
            .collect::<Result<_, _>>()?;
        if workgroups.contains(&0) {
            return Ok(());
        }
        self.load(kernel)?;
        let Some(loaded) = self.kernels.get(&kernel) else {
            return Err(BackendError::Other(format!(
                "{}: kernel not loaded",
                kernel.label()
            )));
        };
        if let Some((param_bytes, count)) = loaded.signature {
            if param_bytes != params.len() || count != 1 + buffers.len() {
                return Err(BackendError::Other(format!(
                    "{}: the kernel takes a {param_bytes}-byte params struct and {} buffers, \
                     the dispatch gave {} bytes and {} buffers",
                    kernel.label(),
                    count.saturating_sub(1),
                    params.len(),
                    buffers.len()
                )));
            }
        }
        let mut block = ParamBlock([0u8; MAX_PARAM_BYTES]);
        block.0[..params.len()].copy_from_slice(params);
        let mut args: Vec<*mut c_void> = Vec::with_capacity(1 + ptrs.len());
        args.push(&mut block as *mut ParamBlock as *mut c_void);
        let mut ptrs = ptrs;
        for p in ptrs.iter_mut() {
            args.push(p as *mut sys::CUdeviceptr as *mut c_void);
        }
        let [bx, by, bz] = kernel.workgroup_size();
        let f = loaded.func.cu_function();
        let r = loader::guarded("cuLaunchKernel", || {
            self.bind()?;
            // SAFETY: `f` is a loaded kernel whose parameters are the params struct (copied
            // from `block`, at least as many bytes as declared) and one device pointer per
            // buffer; every pointer refers to a live allocation; `args` outlives the call
            // (the driver copies argument values at launch).
            unsafe {
                cu::launch_kernel(
                    f,
                    (workgroups[0], workgroups[1], workgroups[2]),
                    (bx, by, bz),
                    0,
                    std::ptr::null_mut(),
                    &mut args,
                )
            }
        })
        .map_err(BackendError::Other)?;
        r.map_err(|e| self.backend_error(&format!("launching {}", kernel.label()), e))
    }

    fn synchronize(&mut self) -> Result<(), BackendError> {
        self.check_lost()?;
        let r = loader::guarded("cuCtxSynchronize", || self.ctx.synchronize())
            .map_err(BackendError::Other)?;
        r.map_err(|e| self.backend_error("cuCtxSynchronize", e))
    }

    fn allocated_bytes(&self) -> u64 {
        self.allocated
    }

    /// A device pointer inside the parent's allocation: no driver call.
    fn view_buffer(&mut self, parent: BufferId, offset: u64, bytes: u64) -> Option<BufferId> {
        let p = *self.buffers.get(&parent.0)?;
        if p.parent.is_some() || offset.checked_add(bytes)? > p.bytes {
            return None;
        }
        let id = self.next_id;
        self.next_id += 1;
        self.buffers.insert(
            id,
            Buffer {
                ptr: p.ptr + offset,
                bytes,
                parent: Some(parent.0),
            },
        );
        Some(BufferId(id))
    }

    /// Loads every kernel (30 modules) and launches each once: module code and the local
    /// memory the driver sizes at the first launch (per thread the card can hold) are taken.
    fn warm_up(&mut self) -> Result<(), BackendError> {
        self.check_lost()?;
        self.launch_once(&nvrtc::all_kernel_ids())
    }

    /// Loads the probe's kernels and launches each once before the first tensor: module code
    /// and the local memory the driver sizes at a kernel's first launch are taken while memory
    /// is free. Parameters go by value and copies through the driver's own host staging, so
    /// nothing else needs a buffer during the probe.
    fn prepare(&mut self, kernels: &[KernelId]) -> Result<(), BackendError> {
        self.check_lost()?;
        self.launch_once(kernels)
    }
}

impl Drop for CudaBackend {
    fn drop(&mut self) {
        let ids: Vec<u64> = self
            .buffers
            .iter()
            .filter(|(_, b)| b.parent.is_none())
            .map(|(&id, _)| id)
            .collect();
        for id in ids {
            self.free_buffer(BufferId(id));
        }
        // Modules unload (and the context is released) when the fields drop, after this.
        self.kernels.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn param_block_holds_every_params_struct() {
        use crate::kernels::params::*;
        use std::mem::size_of;
        let sizes = [
            size_of::<WordParams>(),
            size_of::<MatmulParams>(),
            size_of::<SoftmaxParams>(),
            size_of::<LayerNormParams>(),
            size_of::<ElemParams>(),
            size_of::<Conv2dParams>(),
            size_of::<FlashParams>(),
            size_of::<AdamParams>(),
        ];
        for s in sizes {
            assert!(s <= MAX_PARAM_BYTES && s % 4 == 0, "{s}");
        }
        assert_eq!(std::mem::align_of::<ParamBlock>(), 16);
    }
}
