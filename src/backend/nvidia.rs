//! Is an NVIDIA driver installed while wgpu sees only CPU adapters? Then a "GPU" boundary
//! would silently be measured on the CPU: say how to install the NVIDIA Vulkan ICD.
//!
//! The driver counts as present when `libcuda` loads or `/proc/driver/nvidia` exists. Both
//! checks are injectable ([`Detector`]) for tests, and the environment variable
//! [`DRIVER_ENV`] (`present` / `absent`) overrides them for the whole process (CLI tests).

use std::path::PathBuf;

use super::{BackendKind, DeviceInfo, DeviceType};

/// `present` or `absent`: overrides the detection (for tests without a GPU).
pub const DRIVER_ENV: &str = "OOMPROBE_NVIDIA_DRIVER";

/// What was found of an NVIDIA driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Presence {
    /// `libcuda` could be opened.
    pub libcuda: bool,
    /// `/proc/driver/nvidia` exists (the kernel module is loaded).
    pub proc_driver: bool,
    /// Said so by [`DRIVER_ENV`]` = present` (tests), not found.
    pub forced: bool,
}

impl Presence {
    pub fn any(self) -> bool {
        self.libcuda || self.proc_driver || self.forced
    }

    fn evidence(self) -> String {
        let mut what = Vec::new();
        if self.forced {
            what.push("OOMPROBE_NVIDIA_DRIVER=present");
        }
        if self.libcuda {
            what.push("libcuda loads");
        }
        if self.proc_driver {
            what.push("/proc/driver/nvidia exists");
        }
        what.join(", ")
    }
}

/// How the driver is looked for.
pub struct Detector {
    /// The directory whose existence means the kernel module is loaded.
    pub proc_path: PathBuf,
    /// Whether the CUDA driver library opens.
    pub libcuda: fn() -> bool,
}

impl Detector {
    /// The real checks: `/proc/driver/nvidia` and `libcuda`.
    pub fn system() -> Self {
        Detector {
            proc_path: PathBuf::from("/proc/driver/nvidia"),
            libcuda: libcuda_loads,
        }
    }

    pub fn detect(&self) -> Presence {
        Presence {
            libcuda: (self.libcuda)(),
            proc_driver: self.proc_path.is_dir(),
            forced: false,
        }
    }
}

/// The driver on this machine: [`DRIVER_ENV`] if set, else [`Detector::system`].
pub fn detect() -> Presence {
    match std::env::var(DRIVER_ENV).as_deref() {
        Ok("present") => Presence {
            forced: true,
            ..Presence::default()
        },
        Ok("absent") => Presence::default(),
        _ => Detector::system().detect(),
    }
}

fn libcuda_loads() -> bool {
    #[cfg(feature = "cuda")]
    {
        super::cuda::loader::driver_library().is_ok()
    }
    #[cfg(not(feature = "cuda"))]
    {
        ["libcuda.so.1", "libcuda.so"].iter().any(|name| {
            let Ok(c) = std::ffi::CString::new(*name) else {
                return false;
            };
            // SAFETY: a plain dlopen; the handle is closed again at once.
            unsafe {
                let h = libc::dlopen(c.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL);
                if h.is_null() {
                    false
                } else {
                    libc::dlclose(h);
                    true
                }
            }
        })
    }
}

/// How to get the NVIDIA Vulkan driver (ICD) in front of wgpu.
pub const VULKAN_ICD_HINT: &str = "install the NVIDIA Vulkan ICD: in a container, start it \
     with the `graphics` driver capability (e.g. `docker run --gpus all -e \
     NVIDIA_DRIVER_CAPABILITIES=compute,utility,graphics`, or `all`) so the NVIDIA container \
     toolkit mounts libGLX_nvidia.so.0 and its nvidia_icd.json; on a host, install the driver's \
     Vulkan/GL libraries (Debian/Ubuntu `libnvidia-gl-<driver major>`, e.g. libnvidia-gl-550; \
     Fedora/RHEL `nvidia-driver-libs`) and the Vulkan loader (`libvulkan1` / `vulkan-loader`); \
     `vulkaninfo --summary` should then list the GPU. `--backend cuda` measures the GPU \
     without Vulkan";

/// The advice when an NVIDIA driver is present but every wgpu adapter (CUDA rows aside) is a
/// CPU adapter, or there is none; `None` otherwise.
pub fn cpu_only_advice(devices: &[DeviceInfo], nvidia: Presence) -> Option<String> {
    if !nvidia.any() {
        return None;
    }
    let mut wgpu = devices.iter().filter(|d| d.backend != BackendKind::Cuda);
    let all_cpu = wgpu.all(|d| d.device_type == DeviceType::Cpu);
    all_cpu.then(|| {
        format!(
            "an NVIDIA driver is installed ({}) but wgpu sees only CPU adapters (software \
             rendering: measurements there are of host memory, not the GPU): {VULKAN_ICD_HINT}",
            nvidia.evidence()
        )
    })
}

/// The note for a probe on `device`: [`cpu_only_advice`] when `device` is a CPU adapter (the
/// adapters and the driver are only looked for then).
pub fn probe_note(
    device: &DeviceInfo,
    wgpu_devices: impl FnOnce() -> Vec<DeviceInfo>,
    nvidia: impl FnOnce() -> Presence,
) -> Option<String> {
    if device.device_type != DeviceType::Cpu {
        return None;
    }
    cpu_only_advice(&wgpu_devices(), nvidia())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn adapter(ty: DeviceType, backend: BackendKind) -> DeviceInfo {
        let mut d = DeviceInfo::sample("x", 1 << 30);
        d.device_type = ty;
        d.backend = backend;
        d
    }

    #[test]
    fn the_driver_is_found_by_either_sign() {
        let dir = tempfile::tempdir().expect("tempdir");
        let yes = || true;
        let no = || false;
        let with =
            |proc_path: PathBuf, libcuda: fn() -> bool| Detector { proc_path, libcuda }.detect();
        let missing = dir.path().join("nvidia");
        assert!(!with(missing.clone(), no).any());
        assert_eq!(
            with(missing, yes),
            Presence {
                libcuda: true,
                ..Presence::default()
            }
        );
        assert_eq!(
            with(dir.path().to_path_buf(), no),
            Presence {
                proc_driver: true,
                ..Presence::default()
            }
        );
    }

    #[test]
    fn only_cpu_adapters_with_a_driver_get_the_icd_advice() {
        let present = Presence {
            proc_driver: true,
            ..Presence::default()
        };
        let cpu = adapter(DeviceType::Cpu, BackendKind::Vulkan);
        let gpu = adapter(DeviceType::Discrete, BackendKind::Vulkan);
        let cuda = adapter(DeviceType::Discrete, BackendKind::Cuda);
        let advice = cpu_only_advice(&[cpu.clone(), cuda.clone()], present).expect("advice");
        assert!(advice.contains("NVIDIA_DRIVER_CAPABILITIES"), "{advice}");
        assert!(advice.contains("graphics"), "{advice}");
        assert!(advice.contains("libnvidia-gl"), "{advice}");
        assert!(advice.contains("/proc/driver/nvidia"), "{advice}");
        // No driver, or a real GPU adapter: nothing to say.
        assert_eq!(
            cpu_only_advice(std::slice::from_ref(&cpu), Presence::default()),
            None
        );
        assert_eq!(cpu_only_advice(&[cpu.clone(), gpu.clone()], present), None);
        // No adapter at all under a driver: the ICD is missing too.
        assert!(cpu_only_advice(&[], present).is_some());
        // A probe gets the note on the CPU adapter only.
        let only_cpu = || vec![cpu.clone()];
        assert!(probe_note(&cpu, only_cpu, || present).is_some());
        assert_eq!(
            probe_note(&cuda, || panic!("not looked at"), || present),
            None
        );
        assert_eq!(
            probe_note(&cpu, || vec![cpu.clone(), gpu.clone()], || present),
            None
        );
    }
}
