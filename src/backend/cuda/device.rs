//! Finding CUDA devices: how many the driver reports, a context on one, what it says about
//! itself, and each device opened, warmed up and measured for `devices`.

use std::sync::Arc;

use cudarc::driver::result as cu;
use cudarc::driver::sys;
use cudarc::driver::CudaContext;

use super::errors::err_text;
use super::{loader, CudaBackend, KernelSource, MAX_BINDING_BYTES};
use crate::backend::{Backend, BackendKind, DeviceInfo, DeviceType};

/// Lists the CUDA devices, or says why CUDA is unavailable (no driver library, no device, a
/// driver error). Never panics. Each device is opened, its kernels loaded and launched once,
/// and its overhead measured ([`crate::backend::overhead`]); a device whose warm-up fails is
/// listed with the overhead unknown (the reason is logged).
pub fn list_devices() -> Result<Vec<DeviceInfo>, String> {
    (0..device_count()?).map(measured_device).collect()
}

/// One device as [`list_devices`] lists it (opened, warmed up, measured, closed again).
pub fn measured_device(ordinal: usize) -> Result<DeviceInfo, String> {
    let mut backend = CudaBackend::new(ordinal)?;
    Ok(
        crate::backend::overhead::measured_info(&mut backend).unwrap_or_else(|e| {
            log::warn!("CUDA device {ordinal}: overhead not measured: {e}");
            backend.info().clone()
        }),
    )
}

/// How many CUDA devices the driver reports (an error when none, or no driver).
pub fn device_count() -> Result<usize, String> {
    loader::driver_library()?;
    let count = loader::guarded("cuDeviceGetCount", || -> Result<usize, String> {
        cu::init().map_err(|e| format!("cuInit failed: {}", err_text(e)))?;
        let n = cu::device::get_count()
            .map_err(|e| format!("cuDeviceGetCount failed: {}", err_text(e)))?;
        Ok(usize::try_from(n).unwrap_or(0))
    })??;
    if count == 0 {
        return Err("the NVIDIA driver reports no CUDA device".to_string());
    }
    Ok(count)
}

pub(super) fn new_context(ordinal: usize) -> Result<Arc<CudaContext>, String> {
    loader::guarded("cuCtx", || {
        cu::init().map_err(|e| format!("cuInit failed: {}", err_text(e)))?;
        let n = cu::device::get_count()
            .map_err(|e| format!("cuDeviceGetCount failed: {}", err_text(e)))?;
        if i64::try_from(ordinal).unwrap_or(i64::MAX) >= i64::from(n) {
            return Err(format!(
                "CUDA device {ordinal} not found ({n} CUDA device(s))"
            ));
        }
        CudaContext::new(ordinal).map_err(|e| {
            format!(
                "creating a context on CUDA device {ordinal}: {}",
                err_text(e)
            )
        })
    })?
}

pub(super) fn device_info(
    ctx: &Arc<CudaContext>,
    ordinal: usize,
    source: KernelSource,
) -> Result<DeviceInfo, String> {
    loader::guarded("device info", || {
        let name = ctx
            .name()
            .map_err(|e| format!("cuDeviceGetName: {}", err_text(e)))?;
        let (free, total) = ctx
            .mem_get_info()
            .map_err(|e| format!("cuMemGetInfo: {}", err_text(e)))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(|e| format!("compute capability: {}", err_text(e)))?;
        let integrated = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_INTEGRATED)
            .unwrap_or(0);
        let driver = driver_version()
            .map(|v| format!("CUDA {}.{}", v / 1000, (v % 1000) / 10))
            .unwrap_or_else(|e| format!("CUDA (version unknown: {e})"));
        let total = total as u64;
        Ok(DeviceInfo {
            index: ordinal,
            name,
            backend: BackendKind::Cuda,
            device_type: if integrated != 0 {
                DeviceType::Integrated
            } else {
                DeviceType::Discrete
            },
            driver: format!("{driver}, sm_{major}{minor}, {source}"),
            memory_total_bytes: Some(total),
            memory_free_bytes: Some(free as u64),
            max_buffer_size: total,
            max_storage_binding_size: total.min(MAX_BINDING_BYTES),
            overhead_bytes: None,
            kernel_overhead_bytes: None,
        })
    })?
}

pub(super) fn driver_version() -> Result<i32, String> {
    let mut v = 0;
    // SAFETY: an out-pointer to a live local; the library was checked for by the caller.
    unsafe { sys::cuDriverGetVersion(&mut v) }
        .result()
        .map_err(err_text)
        .map(|()| v)
}
