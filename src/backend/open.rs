//! Enumerate devices across backends and open one by --backend/--device.
//!
//! Indices are the ones `oomprobe devices` prints: for wgpu backends (vulkan, metal, dx12, gl)
//! a position in the list of every adapter of every backend; for `cuda`, the CUDA ordinal.
//! Memory figures are what the API reports. Note that lavapipe (software Vulkan) reports a
//! 2 GiB device-local heap that it does not enforce: its real limit is host memory (or an
//! address-space limit), so a probe on it must be capped by `--budget` or `prlimit`.

use thiserror::Error;

use super::wgpu::{self as wg, AdapterSelector, WgpuBackend, WgpuOpenError};
use super::{Backend, BackendKind, DeviceInfo};
use crate::error::CliError;

/// The command that installs lavapipe, the software Vulkan driver (Debian, Ubuntu).
macro_rules! lavapipe_install {
    () => {
        "apt-get install -y mesa-vulkan-drivers libvulkan1"
    };
}

/// What to tell a user with no adapter at all.
pub const NO_ADAPTER_HINT: &str = concat!(
    "no GPU adapter found: install your GPU's driver (with Vulkan support), or the software \
     Vulkan driver lavapipe: `",
    lavapipe_install!(),
    "`"
);

/// What to tell a user whose default device is GL's software rasteriser.
pub const LAVAPIPE_FASTER_HINT: &str = concat!(
    "no Vulkan adapter: probing on GL's software rasteriser; the software Vulkan driver \
     lavapipe is faster: `",
    lavapipe_install!(),
    "`"
);

/// A hint when `--backend auto` chose a GL CPU adapter (llvmpipe): that means there is no
/// Vulkan adapter at all (a Vulkan CPU adapter would rank first), and lavapipe would be faster.
pub fn faster_driver_hint(info: &DeviceInfo, requested_backend: &str) -> Option<&'static str> {
    let auto = matches!(parse_backend(requested_backend), Ok(BackendChoice::Auto));
    (auto && info.backend == BackendKind::Gl && info.device_type == super::DeviceType::Cpu)
        .then_some(LAVAPIPE_FASTER_HINT)
}

/// Why a build without the `cuda` feature has no CUDA devices.
pub const NO_CUDA_BUILD: &str = "this build has no CUDA backend (build with --features cuda)";

/// The backend names `--backend` accepts.
pub const BACKEND_NAMES: &str = "auto, vulkan, metal, dx12, gl, cuda";

/// Why no device was opened: bad input (exit 2) or a failed run (exit 1).
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum OpenError {
    /// Unknown backend, a malformed or nonexistent index, a backend not built in.
    #[error("{0}")]
    Usage(String),
    /// No adapter at all, or the driver failed to open the device.
    #[error("{0}")]
    Run(String),
}

impl From<OpenError> for CliError {
    fn from(e: OpenError) -> Self {
        match e {
            OpenError::Usage(m) => CliError::Usage(m),
            OpenError::Run(m) => CliError::Run(m),
        }
    }
}

/// Which backend `--backend` names.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BackendChoice {
    Auto,
    Wgpu(BackendKind),
    Cuda,
}

/// Parse a `--backend` value (case-insensitive).
pub fn parse_backend(name: &str) -> Result<BackendChoice, OpenError> {
    match name.trim().to_ascii_lowercase().as_str() {
        "auto" | "" => Ok(BackendChoice::Auto),
        "vulkan" | "vk" => Ok(BackendChoice::Wgpu(BackendKind::Vulkan)),
        "metal" => Ok(BackendChoice::Wgpu(BackendKind::Metal)),
        "dx12" | "d3d12" => Ok(BackendChoice::Wgpu(BackendKind::Dx12)),
        "gl" | "gles" | "opengl" => Ok(BackendChoice::Wgpu(BackendKind::Gl)),
        "cuda" => Ok(BackendChoice::Cuda),
        other => Err(OpenError::Usage(format!(
            "unknown backend '{other}' (expected one of: {BACKEND_NAMES})"
        ))),
    }
}

/// Parse a `--device` value: a non-negative integer.
pub fn parse_device_index(text: &str) -> Result<usize, OpenError> {
    text.trim().parse::<usize>().map_err(|_| {
        OpenError::Usage(format!(
            "--device expects a device index as `oomprobe devices` lists it, got '{text}'"
        ))
    })
}

/// Every adapter of every wgpu backend, with its limits and memory where the API tells.
pub fn list_devices() -> Vec<DeviceInfo> {
    let instance = wg::new_instance();
    wg::enumerate_adapters(&instance)
        .iter()
        .enumerate()
        .map(|(i, a)| wg::adapter_info(i, a))
        .collect()
}

/// The CUDA devices, or why there are none (also when this build has no CUDA backend).
pub fn list_cuda_devices() -> Result<Vec<DeviceInfo>, String> {
    #[cfg(feature = "cuda")]
    {
        // Hook owned by the CUDA backend (src/backend/cuda).
        crate::backend::cuda::list_devices()
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(NO_CUDA_BUILD.to_string())
    }
}

/// The default device's name and memory (what `--backend auto` opens) when it is a GPU whose
/// API tells its memory: None without an adapter, for a CPU adapter (lavapipe's heap is a
/// number it does not enforce, not a card's memory), or when the API does not tell.
pub fn detected_gpu() -> Option<(String, u64)> {
    let instance = wg::new_instance();
    let adapters = wg::enumerate_adapters(&instance);
    let i = wg::select_adapter(&adapters, AdapterSelector::Auto).ok()?;
    let info = wg::adapter_info(i, &adapters[i]);
    if info.device_type == crate::backend::DeviceType::Cpu {
        return None;
    }
    Some((info.name, info.memory_total_bytes?))
}

/// Open a device by `--backend` name and optional `--device` index.
pub fn open_device(backend: &str, index: Option<usize>) -> Result<Box<dyn Backend>, OpenError> {
    match parse_backend(backend)? {
        BackendChoice::Cuda => open_cuda(index),
        BackendChoice::Auto => open_wgpu(None, index).map(|b| Box::new(b) as Box<dyn Backend>),
        BackendChoice::Wgpu(kind) => {
            open_wgpu(Some(kind), index).map(|b| Box::new(b) as Box<dyn Backend>)
        }
    }
}

/// Open a wgpu adapter: by index (checked against `kind` when given), else the first of
/// `kind`, else the default (discrete GPU first).
pub fn open_wgpu(
    kind: Option<BackendKind>,
    index: Option<usize>,
) -> Result<WgpuBackend, OpenError> {
    let (instance, adapters, i) = select_wgpu(kind, index)?;
    let adapter = adapters.into_iter().nth(i);
    let adapter = adapter.ok_or_else(|| OpenError::Run(NO_ADAPTER_HINT.to_string()))?;
    WgpuBackend::from_adapter(instance, adapter, i)
        .map_err(|e| OpenError::Run(format!("opening device {i} failed: {e}")))
}

/// The device `open_device(backend, index)` would open, without opening it (a probe's parent
/// process must not hold device memory while its children measure).
pub fn device_info(backend: &str, index: Option<usize>) -> Result<DeviceInfo, OpenError> {
    match parse_backend(backend)? {
        BackendChoice::Cuda => cuda_device_info(index.unwrap_or(0)),
        BackendChoice::Auto => select_wgpu(None, index).map(|(_, a, i)| wg::adapter_info(i, &a[i])),
        BackendChoice::Wgpu(kind) => {
            select_wgpu(Some(kind), index).map(|(_, a, i)| wg::adapter_info(i, &a[i]))
        }
    }
}

/// CUDA device `i` as `devices` lists it (only that one is opened and measured).
fn cuda_device_info(i: usize) -> Result<DeviceInfo, OpenError> {
    #[cfg(feature = "cuda")]
    {
        use crate::backend::cuda;
        let count = cuda::device_count().map_err(|m| OpenError::Run(format!("CUDA: {m}")))?;
        if i >= count {
            return Err(OpenError::Usage(format!(
                "CUDA device {i} does not exist (see `oomprobe devices`)"
            )));
        }
        cuda::measured_device(i).map_err(|m| OpenError::Run(format!("CUDA: {m}")))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = i;
        Err(OpenError::Run(format!("CUDA: {NO_CUDA_BUILD}")))
    }
}

/// Enumerate the adapters and pick one (see `open_wgpu`).
fn select_wgpu(
    kind: Option<BackendKind>,
    index: Option<usize>,
) -> Result<(wgpu::Instance, Vec<wgpu::Adapter>, usize), OpenError> {
    if let Some(k) = kind {
        // A named backend enumerates only the backends listed before it and itself: the same
        // indices, without starting GL/EGL for a Vulkan device. Errors are worded from the
        // full list below (an index or a backend that does not exist).
        let instance = wg::new_instance_for(wg::backends_through(k));
        let adapters = wg::enumerate_adapters(&instance);
        if let Ok(i) = pick_wgpu(&adapters, kind, index) {
            return Ok((instance, adapters, i));
        }
    }
    let instance = wg::new_instance();
    let adapters = wg::enumerate_adapters(&instance);
    let i = pick_wgpu(&adapters, kind, index)?;
    Ok((instance, adapters, i))
}

/// The adapter `--backend`/`--device` name among `adapters`.
fn pick_wgpu(
    adapters: &[wgpu::Adapter],
    kind: Option<BackendKind>,
    index: Option<usize>,
) -> Result<usize, OpenError> {
    if adapters.is_empty() {
        return Err(OpenError::Run(NO_ADAPTER_HINT.to_string()));
    }
    let sel = match (index, kind) {
        (Some(i), _) => AdapterSelector::Index(i),
        (None, Some(k)) => AdapterSelector::Kind(k),
        (None, None) => AdapterSelector::Auto,
    };
    let i = wg::select_adapter(adapters, sel).map_err(|e| match e {
        WgpuOpenError::NoAdapter => OpenError::Run(NO_ADAPTER_HINT.to_string()),
        WgpuOpenError::NoSuchIndex { index, count } => OpenError::Usage(format!(
            "device {index} does not exist: there {} {count} adapter{} (see `oomprobe devices`)",
            if count == 1 { "is" } else { "are" },
            if count == 1 { "" } else { "s" }
        )),
        WgpuOpenError::NoSuchBackend(name) => OpenError::Usage(format!(
            "no {name} adapter on this machine (see `oomprobe devices`)"
        )),
        WgpuOpenError::RequestDevice(m) => OpenError::Run(m),
    })?;
    if let Some(k) = kind {
        let got = wg::backend_kind(adapters[i].get_info().backend);
        if got != Some(k) {
            return Err(OpenError::Usage(format!(
                "device {i} is not a {} adapter (see `oomprobe devices`)",
                k.as_str()
            )));
        }
    }
    Ok(i)
}

fn open_cuda(index: Option<usize>) -> Result<Box<dyn Backend>, OpenError> {
    #[cfg(feature = "cuda")]
    {
        // Hook owned by the CUDA backend (src/backend/cuda): a nonexistent ordinal is bad
        // input; anything else (no driver, no device) is a failed run.
        if let Some(i) = index {
            if let Ok(count) = crate::backend::cuda::device_count() {
                if i >= count {
                    return Err(OpenError::Usage(format!(
                        "CUDA device {i} does not exist: there are {count} (see `oomprobe devices`)"
                    )));
                }
            }
        }
        crate::backend::cuda::open(index).map_err(|m| OpenError::Run(format!("CUDA: {m}")))
    }
    #[cfg(not(feature = "cuda"))]
    {
        let _ = index;
        Err(OpenError::Usage(NO_CUDA_BUILD.to_string()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backend_names_parse_and_bad_ones_are_usage_errors() {
        assert_eq!(parse_backend("auto").unwrap(), BackendChoice::Auto);
        assert_eq!(
            parse_backend("Vulkan").unwrap(),
            BackendChoice::Wgpu(BackendKind::Vulkan)
        );
        assert_eq!(parse_backend("cuda").unwrap(), BackendChoice::Cuda);
        let e = parse_backend("opencl").unwrap_err();
        assert!(matches!(e, OpenError::Usage(ref m) if m.contains("opencl")));
        assert_eq!(CliError::from(e).exit_code(), 2);
    }

    #[test]
    fn device_index_must_be_a_number() {
        assert_eq!(parse_device_index(" 3 ").unwrap(), 3);
        assert!(matches!(parse_device_index("-1"), Err(OpenError::Usage(_))));
        assert!(matches!(
            parse_device_index("gpu0"),
            Err(OpenError::Usage(_))
        ));
    }

    #[test]
    fn a_nonexistent_index_is_a_usage_error() {
        match open_device("auto", Some(999)) {
            Err(e @ OpenError::Usage(_)) => {
                assert!(e.to_string().contains("999"), "{e}");
                assert_eq!(CliError::from(e).exit_code(), 2);
            }
            // No adapter at all is a run error, which is right too, but this machine must
            // have one for the test to mean anything.
            Err(OpenError::Run(m)) => panic!("needs an adapter: {m}"),
            Ok(_) => panic!("device 999 opened"),
        }
    }

    #[test]
    fn llvmpipe_on_gl_by_default_suggests_lavapipe() {
        let mut info = super::super::DeviceInfo::sample("llvmpipe", 2 << 30);
        info.device_type = super::super::DeviceType::Cpu;
        info.backend = BackendKind::Gl;
        let hint = faster_driver_hint(&info, "auto").expect("a hint");
        assert!(hint.contains("mesa-vulkan-drivers"), "{hint}");
        // Asked for GL by name: the user knows; a Vulkan or a GPU adapter: nothing to say.
        assert_eq!(faster_driver_hint(&info, "gl"), None);
        info.backend = BackendKind::Vulkan;
        assert_eq!(faster_driver_hint(&info, "auto"), None);
        info.backend = BackendKind::Gl;
        info.device_type = super::super::DeviceType::Discrete;
        assert_eq!(faster_driver_hint(&info, "auto"), None);
    }

    #[test]
    fn a_bad_backend_name_is_a_usage_error_before_any_device_work() {
        assert!(matches!(
            open_device("directx9", None),
            Err(OpenError::Usage(_))
        ));
    }
}
