//! Finding the CUDA driver (`libcuda`) and NVRTC (`libnvrtc`) before cudarc is called.
//!
//! cudarc (feature `dynamic-loading`) opens its libraries lazily on the first call and **panics**
//! when they are missing (or when a symbol is missing). So every entry point of this backend
//! first asks [`driver_library`] / [`nvrtc_library`], which use cudarc's own search
//! (`is_culib_present`, the same candidate names, the same `dlopen` search path), and then runs
//! the cudarc calls inside [`guarded`], which turns a panic that still slips through into an
//! `Err` (second guard).
//!
//! How the libraries are found (cudarc 0.19, `get_lib_name_candidates`): `dlopen` of plain names
//! such as `libcuda.so`, `libcuda.so.12`, `libcuda.so.1` and `libnvrtc.so`, `libnvrtc.so.12`.
//! A plain name is looked up in `LD_LIBRARY_PATH`, the `ld.so` cache and the default dirs, so a
//! pip-installed NVRTC (`pip install nvidia-cuda-nvrtc-cu12`, which puts `libnvrtc.so.12` under
//! `site-packages/nvidia/cuda_nvrtc/lib`) is only found with that directory on
//! `LD_LIBRARY_PATH`. As a convenience, [`nvrtc_library`] also preloads NVRTC by absolute path
//! from `$OOMPROBE_NVRTC` (a file or a directory), `$CUDA_PATH/lib64`, `$CUDA_HOME/lib64` and
//! `/usr/local/cuda/lib64`: once a `libnvrtc.so.12` is loaded, glibc's `dlopen("libnvrtc.so.12")`
//! (cudarc's search) matches it by its soname and returns the same library.

use std::ffi::CString;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

/// The hint printed when NVRTC is missing.
pub const NVRTC_HINT: &str = "install it with `pip install nvidia-cuda-nvrtc-cu12` and put its \
     lib directory on the library path: export LD_LIBRARY_PATH=\"$(python3 -c 'import \
     nvidia.cuda_nvrtc as m; print(list(m.__path__)[0])')/lib:$LD_LIBRARY_PATH\" (or set \
     OOMPROBE_NVRTC to the libnvrtc.so.12 file or its directory)";

/// Checks that the CUDA driver library can be opened, the way cudarc will open it.
/// Returns the reason when it cannot (a line for `devices`: "CUDA: unavailable (reason)").
pub fn driver_library() -> Result<(), String> {
    static FOUND: OnceLock<Result<(), String>> = OnceLock::new();
    FOUND
        .get_or_init(|| {
            // SAFETY: only opens and closes the library (its initialisers run, as with any
            // dlopen); no symbol is called.
            let present = guarded("looking for libcuda", || unsafe {
                cudarc::driver::sys::is_culib_present()
            })?;
            if present {
                Ok(())
            } else {
                Err(format!(
                    "libcuda.so not found: no NVIDIA driver on the library path (searched {})",
                    candidates_summary("cuda")
                ))
            }
        })
        .clone()
}

/// Checks that NVRTC can be opened, the way cudarc will open it (after trying to preload it
/// from the known locations listed in the module docs).
pub fn nvrtc_library() -> Result<(), String> {
    static FOUND: OnceLock<Result<(), String>> = OnceLock::new();
    FOUND
        .get_or_init(|| {
            // SAFETY: as in `driver_library`.
            let present = || {
                guarded("looking for libnvrtc", || unsafe {
                    cudarc::nvrtc::sys::is_culib_present()
                })
            };
            if present()? {
                return Ok(());
            }
            let mut tried = Vec::new();
            for path in nvrtc_preload_candidates() {
                if path.is_file() {
                    tried.push(path.display().to_string());
                    if preload(&path) && present()? {
                        return Ok(());
                    }
                }
            }
            let extra = if tried.is_empty() {
                String::new()
            } else {
                format!("; could not use {}", tried.join(", "))
            };
            Err(format!(
                "libnvrtc.so.12 not found (searched {}{extra}): {NVRTC_HINT}",
                candidates_summary("nvrtc")
            ))
        })
        .clone()
}

/// Runs cudarc calls, turning a panic (a library or symbol cudarc could not load) into `Err`.
/// While `f` runs on this thread, the panic message is not printed (a process-wide hook that
/// defers to the previous one for every other panic); it is returned in the `Err` instead.
pub fn guarded<T>(what: &str, f: impl FnOnce() -> T) -> Result<T, String> {
    install_quiet_hook();
    let was = IN_GUARD.with(|g| g.replace(true));
    let r = catch_unwind(AssertUnwindSafe(f));
    IN_GUARD.with(|g| g.set(was));
    r.map_err(|payload| {
        let msg = payload
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "unknown panic".to_string());
        format!("{what}: cudarc panicked: {msg}")
    })
}

thread_local! {
    static IN_GUARD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

fn install_quiet_hook() {
    static INSTALLED: OnceLock<()> = OnceLock::new();
    INSTALLED.get_or_init(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !IN_GUARD.with(|g| g.get()) {
                previous(info);
            }
        }));
    });
}

/// A short list of the names cudarc tries (first, `.so.12` and last).
fn candidates_summary(lib: &str) -> String {
    let names = cudarc::get_lib_name_candidates(lib);
    let mut shown: Vec<&str> = Vec::new();
    for n in &names {
        let wanted = n == &format!("lib{lib}.so") || n.ends_with(".so.12") || n.ends_with(".so.1");
        if wanted && !shown.contains(&n.as_str()) {
            shown.push(n);
        }
    }
    format!(
        "{} and {} more names via dlopen",
        shown.join(", "),
        names.len() - shown.len()
    )
}

/// Absolute paths tried, in order, when NVRTC is not on the library path.
fn nvrtc_preload_candidates() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Some(p) = std::env::var_os("OOMPROBE_NVRTC") {
        let p = PathBuf::from(p);
        if p.is_file() {
            return vec![p];
        }
        dirs.push(p);
    }
    for var in ["CUDA_PATH", "CUDA_HOME"] {
        if let Some(root) = std::env::var_os(var) {
            dirs.push(Path::new(&root).join("lib64"));
            dirs.push(Path::new(&root).join("lib"));
        }
    }
    dirs.push(PathBuf::from("/usr/local/cuda/lib64"));
    dirs.iter()
        .flat_map(|d| ["libnvrtc.so.12", "libnvrtc.so"].map(|n| d.join(n)))
        .collect()
}

/// `dlopen` by absolute path, kept open for the life of the process (RTLD_GLOBAL so that a
/// later `dlopen` of the soname finds it).
fn preload(path: &Path) -> bool {
    let Some(s) = path.to_str() else { return false };
    let Ok(c) = CString::new(s) else { return false };
    // SAFETY: a plain dlopen of a shared library; the handle is intentionally leaked.
    let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    !handle.is_null()
}
