//! The wgpu backend: Vulkan, Metal, DX12 and GL adapters with their full limits.
//!
//! Every allocation runs inside an out-of-memory and a validation error scope, so the device
//! refusing memory comes back as `AllocError::OutOfMemory` and an impossible request as
//! `AllocError::ExceedsLimit`; errors outside any scope go to an installed handler (wgpu's
//! default one panics) and are reported by the next `synchronize`. Device loss is recorded by a
//! callback and reported by every later call.
//!
//! Staging: `prepare` (or the first launch) sets up a parameter ring and a read-back buffer
//! once, before any tensor. Kernel parameters and writes of at most `STAGED_BYTES` are written
//! into a mapped upload buffer and reach the device in one copy per batch of launches; small
//! read-backs reuse the read-back buffer. No `queue.write_buffer`, no `mapped_at_creation` and
//! no buffer of the backend's own is created during a probe (wgpu's internal staging loses the
//! device when it runs out of memory); a larger write or read still works through a buffer of
//! its own, and is counted (`staging_after_prepare`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::astrace::AsTrace;
use super::timing::DispatchTimes;
use super::{
    AllocError, Backend, BackendError, BackendKind, BufferId, DeviceInfo, DeviceType, HeapUsage,
    MemoryInfo, STAGED_BYTES,
};
use crate::kernels::{source, KernelId};

/// Copies and buffer sizes are whole 32-bit words.
const WORD: u64 = 4;
/// Slots of the parameter ring: launches and small writes batched into one submission.
const SLOTS: u64 = 64;
/// Read-backs of at most this many bytes reuse the read-back buffer.
const READBACK_BYTES: u64 = 4096;

/// Give Mesa a runtime directory when the environment has none: its EGL/Wayland probe (wgpu's
/// GL backend) otherwise prints `error: XDG_RUNTIME_DIR is invalid or not set in the
/// environment.` on every enumeration. The directory is private to the user (0700), under the
/// temporary directory, and reused. Call it first thing in `main`, before any thread starts;
/// probe children inherit it.
pub fn quiet_mesa_runtime_dir() {
    if std::env::var_os("XDG_RUNTIME_DIR").is_some_and(|d| !d.is_empty()) {
        return;
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
        // SAFETY: getuid has no preconditions and cannot fail.
        let uid = unsafe { libc::getuid() };
        let dir = std::env::temp_dir().join(format!("oomprobe-runtime-{uid}"));
        let _ = std::fs::DirBuilder::new().mode(0o700).create(&dir);
        // Only a directory this user owns and nobody else can enter.
        let ok = std::fs::symlink_metadata(&dir)
            .is_ok_and(|m| m.is_dir() && m.uid() == uid && m.permissions().mode() & 0o077 == 0);
        if ok {
            std::env::set_var("XDG_RUNTIME_DIR", &dir);
        }
    }
}

/// A new wgpu instance over every backend compiled in (honours `WGPU_BACKEND` and friends).
pub fn new_instance() -> wgpu::Instance {
    new_instance_for(wgpu::Backends::all())
}

/// A new wgpu instance over `backends` only (further narrowed by `WGPU_BACKEND`): opening a
/// Vulkan device need not start GL/EGL, which is slow and noisy on Mesa.
pub fn new_instance_for(backends: wgpu::Backends) -> wgpu::Instance {
    let mut desc = wgpu::InstanceDescriptor {
        backends: wgpu::Backends::all(),
        ..wgpu::InstanceDescriptor::new_without_display_handle()
    }
    .with_env();
    desc.backends &= backends;
    wgpu::Instance::new(desc)
}

/// The backends listed up to and including `kind` in `enumerate_adapters` order. Enumerating
/// only these yields the same first adapters as enumerating all, so an index into the full
/// list still names the same adapter of `kind`.
pub fn backends_through(kind: BackendKind) -> wgpu::Backends {
    let order = [
        (BackendKind::Vulkan, wgpu::Backends::VULKAN),
        (BackendKind::Metal, wgpu::Backends::METAL),
        (BackendKind::Dx12, wgpu::Backends::DX12),
        (BackendKind::Gl, wgpu::Backends::GL),
    ];
    let mut mask = wgpu::Backends::empty();
    for (k, b) in order {
        mask |= b;
        if k == kind {
            return mask;
        }
    }
    wgpu::Backends::all()
}

/// Every adapter of every backend, in a stable order: the index used by `--device`.
pub fn enumerate_adapters(instance: &wgpu::Instance) -> Vec<wgpu::Adapter> {
    let mut adapters = pollster::block_on(instance.enumerate_adapters(wgpu::Backends::all()));
    adapters.sort_by_key(|a| backend_rank(a.get_info().backend));
    adapters
}

fn backend_rank(b: wgpu::Backend) -> u8 {
    match b {
        wgpu::Backend::Vulkan => 0,
        wgpu::Backend::Metal => 1,
        wgpu::Backend::Dx12 => 2,
        wgpu::Backend::Gl => 3,
        _ => 4,
    }
}

/// Our name for a wgpu backend (`None` for ones we do not drive, e.g. the browser).
pub fn backend_kind(b: wgpu::Backend) -> Option<BackendKind> {
    match b {
        wgpu::Backend::Vulkan => Some(BackendKind::Vulkan),
        wgpu::Backend::Metal => Some(BackendKind::Metal),
        wgpu::Backend::Dx12 => Some(BackendKind::Dx12),
        wgpu::Backend::Gl => Some(BackendKind::Gl),
        _ => None,
    }
}

fn device_type(t: wgpu::DeviceType) -> DeviceType {
    match t {
        wgpu::DeviceType::DiscreteGpu => DeviceType::Discrete,
        wgpu::DeviceType::IntegratedGpu => DeviceType::Integrated,
        wgpu::DeviceType::Cpu => DeviceType::Cpu,
        wgpu::DeviceType::VirtualGpu => DeviceType::Virtual,
        wgpu::DeviceType::Other => DeviceType::Other,
    }
}

/// The contract's description of one adapter (index = position in `enumerate_adapters`).
pub fn adapter_info(index: usize, adapter: &wgpu::Adapter) -> DeviceInfo {
    let info = adapter.get_info();
    let limits = adapter.limits();
    let driver = match (info.driver.is_empty(), info.driver_info.is_empty()) {
        (false, false) => format!("{} {}", info.driver, info.driver_info),
        (false, true) => info.driver.clone(),
        (true, false) => info.driver_info.clone(),
        (true, true) => String::new(),
    };
    let mem = adapter_memory(adapter);
    DeviceInfo {
        index,
        name: info.name.clone(),
        backend: backend_kind(info.backend).unwrap_or(BackendKind::Vulkan),
        device_type: device_type(info.device_type),
        driver,
        memory_total_bytes: mem.total_bytes,
        memory_free_bytes: mem.free_bytes,
        max_buffer_size: limits.max_buffer_size,
        max_storage_binding_size: limits.max_storage_buffer_binding_size,
        overhead_bytes: None,
        kernel_overhead_bytes: None,
    }
}

/// Device-local memory as the API tells: on Vulkan the device-local heaps and, with
/// VK_EXT_memory_budget, the budget left; nothing elsewhere.
///
/// Note: lavapipe (software Vulkan) reports a 2 GiB heap that it does not enforce; this
/// function reports what the API says, not what the host can give.
pub fn adapter_memory(adapter: &wgpu::Adapter) -> MemoryInfo {
    #[cfg(not(target_arch = "wasm32"))]
    {
        if adapter.get_info().backend == wgpu::Backend::Vulkan {
            return vulkan_memory(adapter).unwrap_or_default();
        }
    }
    let _ = adapter;
    MemoryInfo::default()
}

/// Heap usage and budgets (`VK_EXT_memory_budget`) of a Vulkan adapter; None elsewhere or
/// without the extension. wgpu itself exposes no heap budgets (only thresholds in
/// `InstanceDescriptor::memory_budget_thresholds` and `generate_allocator_report`), so this
/// reads them through the raw Vulkan handles.
pub fn adapter_heaps(adapter: &wgpu::Adapter) -> Option<HeapUsage> {
    #[cfg(not(target_arch = "wasm32"))]
    {
        if adapter.get_info().backend == wgpu::Backend::Vulkan {
            return vulkan_heaps(adapter).and_then(|h| h.usage);
        }
    }
    let _ = adapter;
    None
}

/// What the Vulkan heaps tell.
#[cfg(not(target_arch = "wasm32"))]
struct VulkanHeaps {
    device_local_total: u64,
    /// Per device-local heap, budget − usage (never below 0), summed: with the extension.
    device_local_free: Option<u64>,
    usage: Option<HeapUsage>,
}

#[cfg(not(target_arch = "wasm32"))]
fn vulkan_memory(adapter: &wgpu::Adapter) -> Option<MemoryInfo> {
    let h = vulkan_heaps(adapter)?;
    let total = h.device_local_total;
    Some(MemoryInfo {
        total_bytes: (total > 0).then_some(total),
        free_bytes: h.device_local_free.filter(|_| total > 0),
    })
}

#[cfg(not(target_arch = "wasm32"))]
fn vulkan_heaps(adapter: &wgpu::Adapter) -> Option<VulkanHeaps> {
    use ash::vk;
    // SAFETY: we only read properties through the raw handles; nothing is created or destroyed,
    // and the guard keeps the adapter alive while we use them.
    unsafe {
        let hal = adapter.as_hal::<wgpu::hal::api::Vulkan>()?;
        let instance = hal.shared_instance().raw_instance();
        let phd = hal.raw_physical_device();
        let caps = hal.physical_device_capabilities();
        let has_budget = caps.supports_extension(ash::ext::memory_budget::NAME);
        let api = caps.properties().api_version;
        let can_props2 = api >= vk::API_VERSION_1_1
            || hal
                .shared_instance()
                .extensions()
                .contains(&ash::khr::get_physical_device_properties2::NAME);
        let with_budget = has_budget && can_props2;
        let mut budget = vk::PhysicalDeviceMemoryBudgetPropertiesEXT::default();
        let props = if with_budget {
            let mut props2 = vk::PhysicalDeviceMemoryProperties2::default().push_next(&mut budget);
            instance.get_physical_device_memory_properties2(phd, &mut props2);
            props2.memory_properties
        } else {
            instance.get_physical_device_memory_properties(phd)
        };
        let mut total = 0u64;
        let mut free = 0u64;
        let mut usage = HeapUsage::default();
        let heaps = props.memory_heap_count.min(vk::MAX_MEMORY_HEAPS as u32) as usize;
        for i in 0..heaps {
            let heap = props.memory_heaps[i];
            let (b, u) = (budget.heap_budget[i], budget.heap_usage[i]);
            if heap.flags.contains(vk::MemoryHeapFlags::DEVICE_LOCAL) {
                total = total.saturating_add(heap.size);
                free = free.saturating_add(b.saturating_sub(u));
                usage.device_local_usage = usage.device_local_usage.saturating_add(u);
                usage.device_local_budget = usage.device_local_budget.saturating_add(b);
            } else {
                usage.other_usage = usage.other_usage.saturating_add(u);
            }
        }
        Some(VulkanHeaps {
            device_local_total: total,
            device_local_free: with_budget.then_some(free),
            usage: with_budget.then_some(usage),
        })
    }
}

/// Which adapter to open.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AdapterSelector {
    /// Position in `enumerate_adapters`.
    Index(usize),
    /// The first adapter of this backend (discrete GPUs first).
    Kind(BackendKind),
    /// The default: the first discrete GPU, else integrated, else any.
    Auto,
}

/// Why no device was opened.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WgpuOpenError {
    #[error("no adapter at all")]
    NoAdapter,
    #[error("device index {index} does not exist ({count} adapters)")]
    NoSuchIndex { index: usize, count: usize },
    #[error("no {0} adapter")]
    NoSuchBackend(&'static str),
    #[error("requesting the device failed: {0}")]
    RequestDevice(String),
}

/// Rank for automatic choice: prefer real GPUs.
fn type_rank(t: wgpu::DeviceType) -> u8 {
    match t {
        wgpu::DeviceType::DiscreteGpu => 0,
        wgpu::DeviceType::IntegratedGpu => 1,
        wgpu::DeviceType::VirtualGpu => 2,
        wgpu::DeviceType::Cpu => 3,
        wgpu::DeviceType::Other => 4,
    }
}

/// Pick the index of the adapter `sel` names in `adapters`.
pub fn select_adapter(
    adapters: &[wgpu::Adapter],
    sel: AdapterSelector,
) -> Result<usize, WgpuOpenError> {
    if adapters.is_empty() {
        return Err(WgpuOpenError::NoAdapter);
    }
    match sel {
        AdapterSelector::Index(i) if i < adapters.len() => Ok(i),
        AdapterSelector::Index(index) => Err(WgpuOpenError::NoSuchIndex {
            index,
            count: adapters.len(),
        }),
        AdapterSelector::Kind(kind) => adapters
            .iter()
            .enumerate()
            .filter(|(_, a)| backend_kind(a.get_info().backend) == Some(kind))
            .min_by_key(|(i, a)| (type_rank(a.get_info().device_type), *i))
            .map(|(i, _)| i)
            .ok_or(WgpuOpenError::NoSuchBackend(kind.as_str())),
        AdapterSelector::Auto => adapters
            .iter()
            .enumerate()
            .min_by_key(|(i, a)| {
                let info = a.get_info();
                (type_rank(info.device_type), backend_rank(info.backend), *i)
            })
            .map(|(i, _)| i)
            .ok_or(WgpuOpenError::NoAdapter),
    }
}

struct Buf {
    buffer: wgpu::Buffer,
    bytes: u64,
}

/// Staging set up once and reused. Kernel parameters and small writes go into a slot of
/// `upload` (mappable, written while mapped); a batch's slots are copied to the same slots of
/// `params` (a uniform buffer each launch binds one slot of) before the batch's commands.
struct Staging {
    upload: wgpu::Buffer,
    mapped: bool,
    params: wgpu::Buffer,
    /// Bytes per slot (256, or the device's uniform offset alignment if larger).
    slot: u64,
    /// Slots used by the batch being recorded.
    used: u64,
    readback: wgpu::Buffer,
}

/// Shared between the device callbacks and the backend.
#[derive(Default)]
struct Events {
    lost: Option<String>,
    errors: Vec<wgpu::Error>,
}

/// A wgpu device with its full limits, buffers by id, and a pipeline cache per kernel.
pub struct WgpuBackend {
    _instance: wgpu::Instance,
    _adapter: wgpu::Adapter,
    device: wgpu::Device,
    queue: wgpu::Queue,
    info: DeviceInfo,
    /// Largest single buffer we hand out (`info.max_chunk_bytes()` unless capped for tests).
    max_buffer: u64,
    buffers: HashMap<BufferId, Buf>,
    next_id: u64,
    allocated: u64,
    pipelines: HashMap<KernelId, wgpu::ComputePipeline>,
    events: Arc<Mutex<Events>>,
    staging: Option<Staging>,
    /// Commands recorded since the last submission (launches, small writes).
    pending: Option<wgpu::CommandEncoder>,
    prepared: bool,
    staging_after_prepare: u64,
    times: Option<DispatchTimes>,
    as_trace: Option<AsTrace>,
    /// Host memory held by `hold_outside` (never written).
    outside: Vec<u8>,
}

impl WgpuBackend {
    /// Create one storage buffer of `bytes` inside error scopes (see the module's notes).
    fn create_storage(&mut self, bytes: u64) -> Result<BufferId, AllocError> {
        let size = round_up_word(bytes).max(WORD);
        if size > self.max_buffer {
            return Err(AllocError::ExceedsLimit {
                requested: bytes,
                limit: self.max_buffer,
            });
        }
        if let Some(m) = self.lost() {
            return Err(AllocError::DeviceLost(m));
        }
        let oom = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let val = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let buffer = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: None,
            size,
            usage: wgpu::BufferUsages::STORAGE
                | wgpu::BufferUsages::COPY_SRC
                | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        let v = pollster::block_on(val.pop());
        let o = pollster::block_on(oom.pop());
        if let Some(e) = o {
            buffer.destroy();
            return Err(AllocError::OutOfMemory {
                requested: size,
                detail: e.to_string(),
            });
        }
        if let Some(e) = v {
            buffer.destroy();
            if let Some(m) = self.lost() {
                return Err(AllocError::DeviceLost(m));
            }
            // Some drivers report memory exhaustion as a failed allocation inside validation.
            let text = e.to_string();
            let lower = text.to_lowercase();
            if lower.contains("out of memory") || lower.contains("outofmemory") {
                return Err(AllocError::OutOfMemory {
                    requested: size,
                    detail: text,
                });
            }
            return Err(AllocError::Other(text));
        }
        let id = BufferId(self.next_id);
        self.next_id += 1;
        self.allocated += size;
        self.buffers.insert(
            id,
            Buf {
                buffer,
                bytes: size,
            },
        );
        Ok(id)
    }

    /// Open an adapter with its full limits.
    pub fn open(sel: AdapterSelector) -> Result<Self, WgpuOpenError> {
        let instance = new_instance();
        let adapters = enumerate_adapters(&instance);
        let index = select_adapter(&adapters, sel)?;
        let adapter = adapters
            .into_iter()
            .nth(index)
            .ok_or(WgpuOpenError::NoAdapter)?;
        Self::from_adapter(instance, adapter, index)
    }

    /// Open the device of an adapter found by `enumerate_adapters` (index = its position).
    pub fn from_adapter(
        instance: wgpu::Instance,
        adapter: wgpu::Adapter,
        index: usize,
    ) -> Result<Self, WgpuOpenError> {
        let info = adapter_info(index, &adapter);
        let wanted = wgpu::Features::SHADER_F16 | wgpu::Features::SHADER_INT64;
        let features = adapter.features() & wanted;
        let desc = wgpu::DeviceDescriptor {
            label: Some("oomprobe"),
            required_features: features,
            required_limits: adapter.limits(),
            memory_hints: wgpu::MemoryHints::MemoryUsage,
            ..Default::default()
        };
        let (device, queue) = pollster::block_on(adapter.request_device(&desc))
            .map_err(|e| WgpuOpenError::RequestDevice(e.to_string()))?;
        let events = Arc::new(Mutex::new(Events::default()));
        {
            let ev = Arc::clone(&events);
            device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
                log::warn!("wgpu error outside an error scope: {e}");
                if let Ok(mut g) = ev.lock() {
                    g.errors.push(e);
                }
            }));
        }
        {
            let ev = Arc::clone(&events);
            device.set_device_lost_callback(move |reason, msg| {
                if let Ok(mut g) = ev.lock() {
                    // Dropping the device reports `Destroyed`; that is not a loss.
                    if reason != wgpu::DeviceLostReason::Destroyed {
                        g.lost = Some(format!("{reason:?}: {msg}"));
                    }
                }
            });
        }
        let max_buffer = info.max_chunk_bytes();
        Ok(WgpuBackend {
            _instance: instance,
            _adapter: adapter,
            device,
            queue,
            info,
            max_buffer,
            buffers: HashMap::new(),
            next_id: 1,
            allocated: 0,
            pipelines: HashMap::new(),
            events,
            staging: None,
            pending: None,
            prepared: false,
            staging_after_prepare: 0,
            times: DispatchTimes::from_env(),
            as_trace: AsTrace::from_env(),
            outside: Vec::new(),
        })
    }

    /// Cap the largest buffer (and so the chunk size tensors use) below the device's limit:
    /// lets tests exercise many chunks with small tensors. Never raises the limit.
    pub fn cap_max_buffer(&mut self, bytes: u64) {
        let cap = (bytes / WORD * WORD).max(WORD);
        self.max_buffer = cap.min(self.info.max_chunk_bytes());
        self.info.max_buffer_size = self.info.max_buffer_size.min(self.max_buffer);
        self.info.max_storage_binding_size =
            self.info.max_storage_binding_size.min(self.max_buffer);
    }

    /// The wgpu device (for kernels or diagnostics that need it directly).
    pub fn device(&self) -> &wgpu::Device {
        &self.device
    }

    fn lost(&self) -> Option<String> {
        self.events.lock().ok().and_then(|g| g.lost.clone())
    }

    fn take_errors(&self) -> Vec<wgpu::Error> {
        self.events
            .lock()
            .map(|mut g| std::mem::take(&mut g.errors))
            .unwrap_or_default()
    }

    fn check_lost(&self) -> Result<(), BackendError> {
        match self.lost() {
            Some(m) => Err(BackendError::DeviceLost(m)),
            None => Ok(()),
        }
    }

    fn buffer(&self, id: BufferId) -> Result<&Buf, BackendError> {
        self.buffers
            .get(&id)
            .ok_or_else(|| BackendError::Other(format!("unknown buffer {}", id.0)))
    }

    /// Run `f` inside OOM + validation scopes; map what they caught to a BackendError.
    fn scoped<T>(&self, what: &str, f: impl FnOnce() -> T) -> Result<T, BackendError> {
        let oom = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let val = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let out = f();
        let v = pollster::block_on(val.pop());
        let o = pollster::block_on(oom.pop());
        if let Some(e) = o {
            return Err(BackendError::OutOfMemory(format!("{what}: {e}")));
        }
        if let Some(e) = v {
            self.check_lost()?;
            return Err(BackendError::Other(format!("{what}: {e}")));
        }
        Ok(out)
    }

    fn pipeline(&mut self, kernel: KernelId) -> Result<&wgpu::ComputePipeline, BackendError> {
        if !self.pipelines.contains_key(&kernel) {
            let label = kernel.label();
            let src = source::wgsl_source(kernel);
            let device = &self.device;
            let pipeline = self.scoped(&format!("compiling {label}"), || {
                let module = device.create_shader_module(wgpu::ShaderModuleDescriptor {
                    label: Some(&label),
                    source: wgpu::ShaderSource::Wgsl(src.into()),
                });
                device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                    label: Some(&label),
                    layout: None,
                    module: &module,
                    entry_point: None,
                    compilation_options: Default::default(),
                    cache: None,
                })
            })?;
            self.pipelines.insert(kernel, pipeline);
        }
        self.pipelines
            .get(&kernel)
            .ok_or_else(|| BackendError::Other("pipeline cache".into()))
    }

    /// A mappable buffer of its own holding `data` (padded to whole words), unmapped and ready
    /// to copy from: only for writes larger than a ring slot, never during a probe. It is
    /// `MAP_WRITE` and mapped at creation, so wgpu maps the buffer itself (never
    /// `queue.write_buffer` or `create_buffer_init` on a non-mappable buffer, whose internal
    /// staging path unwraps an out-of-memory error and panics at the edge of memory).
    fn staging_with(&mut self, data: &[u8]) -> Result<wgpu::Buffer, BackendError> {
        if self.prepared {
            self.staging_after_prepare += 1;
        }
        let size = round_up_word(data.len() as u64).max(WORD);
        let device = &self.device;
        let staging = self.scoped("staging buffer", || {
            device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("staging"),
                size,
                usage: wgpu::BufferUsages::MAP_WRITE | wgpu::BufferUsages::COPY_SRC,
                mapped_at_creation: true,
            })
        })?;
        {
            let mut view = staging.get_mapped_range_mut(..).map_err(|e| {
                staging.destroy();
                BackendError::OutOfMemory(format!("mapping a staging buffer: {e:?}"))
            })?;
            view.slice(..data.len()).copy_from_slice(data);
        }
        staging.unmap();
        Ok(staging)
    }

    /// Copy `data` into `dst` at `offset` (both whole words) through a staging buffer of its
    /// own, after everything recorded so far.
    fn upload(&mut self, dst: &wgpu::Buffer, offset: u64, data: &[u8]) -> Result<(), BackendError> {
        self.flush()?;
        let staging = self.staging_with(data)?;
        let (device, queue) = (&self.device, &self.queue);
        let done = self.scoped("write", || {
            let mut enc = device.create_command_encoder(&Default::default());
            enc.copy_buffer_to_buffer(&staging, 0, dst, offset, data.len() as u64);
            queue.submit([enc.finish()]);
        });
        staging.destroy();
        done
    }

    /// Copy whole words into `dst` at `offset`, after everything recorded so far: through a
    /// ring slot when they fit one, else through a staging buffer of their own.
    fn write_words(
        &mut self,
        dst: &wgpu::Buffer,
        offset: u64,
        data: &[u8],
    ) -> Result<(), BackendError> {
        if data.len() as u64 > STAGED_BYTES {
            return self.upload(dst, offset, data);
        }
        let off = self.stage(data)?;
        let params = match &self.staging {
            Some(st) => st.params.clone(),
            None => return Err(BackendError::Other("no staging".into())),
        };
        let mut enc = self.encoder();
        enc.copy_buffer_to_buffer(&params, off, dst, offset, data.len() as u64);
        self.pending = Some(enc);
        Ok(())
    }

    /// Set up the parameter ring and the read-back buffer (once).
    fn ensure_staging(&mut self) -> Result<(), BackendError> {
        if self.staging.is_some() {
            return Ok(());
        }
        let align = u64::from(self.device.limits().min_uniform_buffer_offset_alignment);
        let slot = STAGED_BYTES.max(align);
        let device = &self.device;
        let buffer = |label, size, usage, mapped_at_creation| {
            device.create_buffer(&wgpu::BufferDescriptor {
                label: Some(label),
                size,
                usage,
                mapped_at_creation,
            })
        };
        use wgpu::BufferUsages as U;
        let st = self.scoped("staging buffers", || Staging {
            upload: buffer(
                "upload ring",
                slot * SLOTS,
                U::MAP_WRITE | U::COPY_SRC,
                true,
            ),
            mapped: true,
            params: buffer(
                "parameter ring",
                slot * SLOTS,
                U::UNIFORM | U::COPY_DST | U::COPY_SRC,
                false,
            ),
            slot,
            used: 0,
            readback: buffer(
                "read-back",
                READBACK_BYTES,
                U::MAP_READ | U::COPY_DST,
                false,
            ),
        })?;
        self.staging = Some(st);
        Ok(())
    }

    /// Map `buffer` (whole) for `mode` and wait until it is.
    fn map_and_wait(&self, buffer: &wgpu::Buffer, mode: wgpu::MapMode) -> Result<(), BackendError> {
        let (tx, rx) = std::sync::mpsc::channel();
        buffer.map_async(mode, .., move |r| {
            let _ = tx.send(r);
        });
        self.wait()?;
        match rx.try_recv() {
            Ok(Ok(())) => Ok(()),
            Ok(Err(e)) => {
                self.check_lost()?;
                Err(BackendError::Other(format!(
                    "mapping a staging buffer: {e}"
                )))
            }
            Err(_) => {
                self.check_lost()?;
                Err(BackendError::Other("a staging buffer never mapped".into()))
            }
        }
    }

    /// Put `data` (whole words, at most one slot) in the next ring slot; returns its offset
    /// (the same in `upload` and `params`). Submits the batch first when the ring is full.
    fn stage(&mut self, data: &[u8]) -> Result<u64, BackendError> {
        let len = data.len() as u64;
        if len == 0 || len > STAGED_BYTES || !len.is_multiple_of(WORD) {
            return Err(BackendError::Other(format!(
                "{len} bytes do not fit a staging slot"
            )));
        }
        self.ensure_staging()?;
        if self.staging.as_ref().is_some_and(|st| st.used == SLOTS) {
            self.flush()?;
        }
        let (upload, mapped) = match &self.staging {
            Some(st) => (st.upload.clone(), st.mapped),
            None => return Err(BackendError::Other("no staging".into())),
        };
        if !mapped {
            self.map_and_wait(&upload, wgpu::MapMode::Write)?;
        }
        let Some(st) = self.staging.as_mut() else {
            return Err(BackendError::Other("no staging".into()));
        };
        st.mapped = true;
        let off = st.used * st.slot;
        {
            let mut view = upload
                .get_mapped_range_mut(off..off + len)
                .map_err(|e| BackendError::Other(format!("staging slot: {e:?}")))?;
            view.copy_from_slice(data);
        }
        st.used += 1;
        Ok(off)
    }

    /// The recorder of the current batch.
    fn encoder(&mut self) -> wgpu::CommandEncoder {
        self.pending
            .take()
            .unwrap_or_else(|| self.device.create_command_encoder(&Default::default()))
    }

    /// Submit the batch: the used ring slots are copied to `params`, then the recorded
    /// commands run.
    fn flush(&mut self) -> Result<(), BackendError> {
        let pending = self.pending.take();
        let staged = match self.staging.as_mut() {
            Some(st) if st.used > 0 => {
                if st.mapped {
                    st.upload.unmap();
                    st.mapped = false;
                }
                let bytes = st.used * st.slot;
                st.used = 0;
                Some((st.upload.clone(), st.params.clone(), bytes))
            }
            _ => None,
        };
        if pending.is_none() && staged.is_none() {
            return Ok(());
        }
        let (device, queue) = (&self.device, &self.queue);
        self.scoped("submit", || {
            let mut cmds = Vec::with_capacity(2);
            if let Some((upload, params, bytes)) = &staged {
                let mut enc = device.create_command_encoder(&Default::default());
                enc.copy_buffer_to_buffer(upload, 0, params, 0, *bytes);
                cmds.push(enc.finish());
            }
            if let Some(enc) = pending {
                cmds.push(enc.finish());
            }
            queue.submit(cmds);
        })
    }

    fn wait(&self) -> Result<(), BackendError> {
        let r = self.device.poll(wgpu::PollType::Wait {
            submission_index: None,
            timeout: None,
        });
        self.check_lost()?;
        r.map(|_| ())
            .map_err(|e| BackendError::Other(format!("poll: {e}")))
    }
}

fn round_up_word(n: u64) -> u64 {
    n.div_ceil(WORD) * WORD
}

impl Backend for WgpuBackend {
    fn info(&self) -> &DeviceInfo {
        &self.info
    }

    fn memory(&self) -> MemoryInfo {
        adapter_memory(&self._adapter)
    }

    fn alloc_buffer(&mut self, bytes: u64) -> Result<BufferId, AllocError> {
        let Some(before) = self.as_trace.as_ref().map(|_| AsTrace::vm()) else {
            return self.create_storage(bytes);
        };
        let r = self.create_storage(bytes);
        if let Some(t) = &self.as_trace {
            let result = match &r {
                Ok(_) => "ok",
                Err(AllocError::OutOfMemory { .. }) => "oom",
                Err(_) => "error",
            };
            t.line("alloc", bytes, result, before, AsTrace::vm());
        }
        r
    }

    /// On a CPU adapter the device's memory is this process's: what a step holds besides its
    /// tensors is host memory, held here unwritten.
    fn hold_outside(&mut self, bytes: u64) -> Option<bool> {
        if self.info.device_type != DeviceType::Cpu {
            return None;
        }
        let bytes = usize::try_from(bytes).ok()?;
        self.outside = Vec::new();
        Some(self.outside.try_reserve_exact(bytes).is_ok())
    }

    fn release_outside(&mut self) {
        self.outside = Vec::new();
    }

    fn free_buffer(&mut self, id: BufferId) {
        let before = self.as_trace.as_ref().map(|_| AsTrace::vm());
        let Some(b) = self.buffers.remove(&id) else {
            return;
        };
        self.allocated -= b.bytes;
        b.buffer.destroy();
        if let (Some(t), Some(before)) = (&self.as_trace, before) {
            t.line("free", b.bytes, "ok", before, AsTrace::vm());
        }
    }

    fn write_buffer(&mut self, id: BufferId, offset: u64, data: &[u8]) -> Result<(), BackendError> {
        self.check_lost()?;
        let buf = self.buffer(id)?;
        let end = offset
            .checked_add(data.len() as u64)
            .filter(|&e| e <= buf.bytes)
            .ok_or_else(|| {
                BackendError::Other(format!(
                    "write of {} bytes at {offset} past the end of a {}-byte buffer",
                    data.len(),
                    buf.bytes
                ))
            })?;
        if data.is_empty() {
            return Ok(());
        }
        if offset.is_multiple_of(WORD) && (data.len() as u64).is_multiple_of(WORD) {
            let buffer = buf.buffer.clone();
            return self.write_words(&buffer, offset, data);
        }
        // Unaligned: read the covering words, patch, write them back.
        let start = offset / WORD * WORD;
        let stop = round_up_word(end);
        let mut words = self.read_buffer(id, start, stop - start)?;
        let at = (offset - start) as usize;
        words[at..at + data.len()].copy_from_slice(data);
        let buffer = self.buffer(id)?.buffer.clone();
        self.write_words(&buffer, start, &words)
    }

    fn read_buffer(
        &mut self,
        id: BufferId,
        offset: u64,
        len: u64,
    ) -> Result<Vec<u8>, BackendError> {
        self.check_lost()?;
        let buf = self.buffer(id)?;
        let end = offset
            .checked_add(len)
            .filter(|&e| e <= buf.bytes)
            .ok_or_else(|| {
                BackendError::Other(format!(
                    "read of {len} bytes at {offset} past the end of a {}-byte buffer",
                    buf.bytes
                ))
            })?;
        if len == 0 {
            return Ok(Vec::new());
        }
        let start = offset / WORD * WORD;
        let stop = round_up_word(end);
        let size = stop - start;
        let source = buf.buffer.clone();
        self.flush()?;
        self.ensure_staging()?;
        let own = match &self.staging {
            Some(st) if size <= READBACK_BYTES => Some((st.readback.clone(), false)),
            _ => None,
        };
        if own.is_none() && self.prepared {
            self.staging_after_prepare += 1;
        }
        let device = &self.device;
        let queue = &self.queue;
        let (staging, temporary) = self.scoped("read-back", || {
            let (staging, temporary) = own.unwrap_or_else(|| {
                let b = device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some("read-back"),
                    size,
                    usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                    mapped_at_creation: false,
                });
                (b, true)
            });
            let mut enc = device.create_command_encoder(&Default::default());
            enc.copy_buffer_to_buffer(&source, start, &staging, 0, size);
            queue.submit([enc.finish()]);
            (staging, temporary)
        })?;
        let mapped = self.map_and_wait(&staging, wgpu::MapMode::Read);
        let out = mapped.and_then(|()| {
            let view = staging
                .get_mapped_range(..size)
                .map_err(|e| BackendError::Other(format!("mapped range: {e:?}")))?;
            let a = (offset - start) as usize;
            Ok(view[a..a + len as usize].to_vec())
        });
        staging.unmap();
        if temporary {
            staging.destroy();
        }
        out
    }

    fn dispatch(
        &mut self,
        kernel: KernelId,
        params: &[u8],
        buffers: &[BufferId],
        workgroups: [u32; 3],
    ) -> Result<(), BackendError> {
        self.check_lost()?;
        if workgroups.contains(&0) {
            return Ok(());
        }
        let mut bound = Vec::with_capacity(buffers.len());
        for id in buffers {
            bound.push(self.buffer(*id)?.buffer.clone());
        }
        let pipeline = self.pipeline(kernel)?.clone();
        if self.times.is_some() {
            // Timing on: start from an idle queue, so the wait below is this launch alone.
            self.flush()?;
            self.wait()?;
        }
        let mut contents = params.to_vec();
        contents.resize(contents.len().div_ceil(16).max(1) * 16, 0);
        let off = self.stage(&contents)?;
        let params = match &self.staging {
            Some(st) => st.params.clone(),
            None => return Err(BackendError::Other("no staging".into())),
        };
        let device = &self.device;
        let label = kernel.label();
        // The bind group is checked on its own: an invalid one is refused here and never
        // recorded into the batch (where it would fail every launch with it).
        let group = self.scoped(&format!("dispatch {label}"), || {
            let layout = pipeline.get_bind_group_layout(0);
            let mut entries = Vec::with_capacity(bound.len() + 1);
            entries.push(wgpu::BindGroupEntry {
                binding: 0,
                resource: wgpu::BindingResource::Buffer(wgpu::BufferBinding {
                    buffer: &params,
                    offset: off,
                    size: wgpu::BufferSize::new(contents.len() as u64),
                }),
            });
            for (i, b) in bound.iter().enumerate() {
                entries.push(wgpu::BindGroupEntry {
                    binding: i as u32 + 1,
                    resource: b.as_entire_binding(),
                });
            }
            device.create_bind_group(&wgpu::BindGroupDescriptor {
                label: Some(&label),
                layout: &layout,
                entries: &entries,
            })
        })?;
        let mut enc = self.encoder();
        {
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some(&label),
                timestamp_writes: None,
            });
            pass.set_pipeline(&pipeline);
            pass.set_bind_group(0, &group, &[]);
            pass.dispatch_workgroups(workgroups[0], workgroups[1], workgroups[2]);
        }
        self.pending = Some(enc);
        if self.times.is_some() {
            let t0 = std::time::Instant::now();
            self.flush()?;
            self.wait()?;
            let seconds = t0.elapsed().as_secs_f64();
            if let Some(t) = self.times.as_mut() {
                t.record(&label, workgroups, seconds);
            }
        }
        Ok(())
    }

    fn synchronize(&mut self) -> Result<(), BackendError> {
        self.flush()?;
        self.wait()?;
        let errors = self.take_errors();
        if let Some(e) = errors
            .iter()
            .find(|e| matches!(e, wgpu::Error::OutOfMemory { .. }))
        {
            return Err(BackendError::OutOfMemory(e.to_string()));
        }
        if let Some(e) = errors.first() {
            return Err(BackendError::Other(e.to_string()));
        }
        Ok(())
    }

    fn allocated_bytes(&self) -> u64 {
        self.allocated
    }

    fn prepare(&mut self, kernels: &[KernelId]) -> Result<(), BackendError> {
        for k in kernels {
            self.pipeline(*k)?;
        }
        self.ensure_staging()?;
        self.prepared = true;
        Ok(())
    }

    fn staging_after_prepare(&self) -> u64 {
        self.staging_after_prepare
    }

    fn heap_usage(&self) -> Option<HeapUsage> {
        adapter_heaps(&self._adapter)
    }
}

impl Drop for WgpuBackend {
    fn drop(&mut self) {
        for (_, b) in self.buffers.drain() {
            b.buffer.destroy();
        }
    }
}
