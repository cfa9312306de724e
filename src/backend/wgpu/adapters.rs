//! wgpu instances and adapters: which backends to enumerate, what each adapter says about
//! itself (info, limits, memory, Vulkan heaps and budget), and which one to open.

use crate::backend::{BackendKind, DeviceInfo, DeviceType, HeapUsage, MemoryInfo};

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
