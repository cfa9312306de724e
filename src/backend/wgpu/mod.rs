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

//!
//! `adapters` finds and describes adapters; `staging` holds the upload and read-back paths.

mod adapters;
mod staging;

pub use adapters::{
    adapter_heaps, adapter_info, adapter_memory, backend_kind, backends_through,
    enumerate_adapters, new_instance, new_instance_for, quiet_mesa_runtime_dir, select_adapter,
    AdapterSelector, WgpuOpenError,
};

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use super::astrace::AsTrace;
use super::timing::DispatchTimes;
use super::{
    AllocError, Backend, BackendError, BufferId, DeviceInfo, DeviceType, HeapUsage, MemoryInfo,
};
use crate::kernels::{source, KernelId};

use staging::Staging;

/// Copies and buffer sizes are whole 32-bit words.
const WORD: u64 = 4;
/// Slots of the parameter ring: launches and small writes batched into one submission.
const SLOTS: u64 = 64;
/// Read-backs of at most this many bytes reuse the read-back buffer.
const READBACK_BYTES: u64 = 4096;

struct Buf {
    buffer: wgpu::Buffer,
    bytes: u64,
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
