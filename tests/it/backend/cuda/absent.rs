//! CUDA absent (this machine, CI): the backend reports why, the CLI says so and keeps going,
//! nothing panics. On a machine with an NVIDIA driver the absence checks turn into presence
//! checks (the driver is there, so listing must succeed).
#![cfg(feature = "cuda")]

use std::path::PathBuf;
use std::process::Command;

use assert_cmd::cargo::CommandCargoExt;
use oomprobe::backend::cuda::{self, loader};

fn oomprobe() -> Command {
    Command::cargo_bin("oomprobe").expect("the oomprobe binary")
}

#[test]
fn listing_and_opening_report_absence_as_an_error() {
    match loader::driver_library() {
        Err(reason) => {
            assert!(reason.contains("libcuda"), "{reason}");
            let listed = cuda::list_devices().expect_err("no driver, no devices");
            assert_eq!(listed, reason);
            let opened = cuda::open(None).err().expect("no driver, no backend");
            assert_eq!(opened, reason);
            assert!(cuda::open(Some(3)).is_err());
        }
        Ok(()) => {
            // A driver is installed: listing must not panic, and with a device present and
            // NVRTC available it must succeed.
            match cuda::list_devices() {
                Ok(devs) => {
                    assert!(!devs.is_empty());
                    for d in &devs {
                        assert!(d.memory_total_bytes.unwrap_or(0) > 0, "{d:?}");
                        assert!(d.max_storage_binding_size <= cuda::MAX_BINDING_BYTES);
                    }
                }
                Err(reason) => eprintln!("libcuda present but no usable device: {reason}"),
            }
        }
    }
}

#[test]
fn devices_prints_cuda_unavailable_and_exits_zero() {
    let Err(reason) = loader::driver_library() else {
        eprintln!("an NVIDIA driver is installed: the unavailability line does not apply");
        return;
    };
    let out = oomprobe()
        .arg("devices")
        .output()
        .expect("run oomprobe devices");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(0),
        "stdout: {stdout}\nstderr: {stderr}"
    );
    let line = format!("CUDA: unavailable ({reason})");
    assert!(stdout.contains(&line), "expected `{line}` in:\n{stdout}");
    assert!(!stderr.contains("panicked"), "{stderr}");
}

#[test]
fn probe_on_cuda_exits_one_with_the_reason() {
    let Err(reason) = loader::driver_library() else {
        eprintln!("an NVIDIA driver is installed: the absence exit code does not apply");
        return;
    };
    for args in [
        vec!["probe", "--backend", "cuda", "--scenario", "params"],
        vec![
            "probe",
            "--backend",
            "cuda",
            "--device",
            "1",
            "--scenario",
            "params",
        ],
    ] {
        let out = oomprobe().args(&args).output().expect("run oomprobe probe");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(
            stderr.contains(&reason),
            "{args:?}: the reason in:\n{stderr}"
        );
        assert!(!stderr.contains("panicked"), "{args:?}: {stderr}");
    }
}

/// A shared library that is mapped into this process (so certainly loadable) and is not
/// libcuda: the C library.
fn some_loaded_library() -> PathBuf {
    let maps = std::fs::read_to_string("/proc/self/maps").expect("/proc/self/maps");
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| p.contains("/libc.so") || p.contains("/libc-"))
        .map(PathBuf::from)
        .expect("libc is mapped")
}

/// The second guard: a "libcuda.so" that loads but lacks the driver's symbols makes cudarc
/// panic inside `cuInit`; the backend turns that into the unavailability reason, silently.
#[cfg(target_os = "linux")]
#[test]
fn a_libcuda_without_symbols_is_reported_not_panicked() {
    let dir = tempfile::tempdir().expect("temp dir");
    std::os::unix::fs::symlink(some_loaded_library(), dir.path().join("libcuda.so"))
        .expect("symlink");
    let out = oomprobe()
        .arg("devices")
        .env("LD_LIBRARY_PATH", dir.path())
        .output()
        .expect("run oomprobe devices");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        out.status.code(),
        Some(0),
        "stdout: {stdout}\nstderr: {stderr}"
    );
    let line = stdout
        .lines()
        .find(|l| l.starts_with("CUDA: unavailable ("))
        .unwrap_or_else(|| panic!("no unavailability line in:\n{stdout}"));
    assert!(
        line.contains("cuInit") && line.contains("cudarc panicked"),
        "{line}"
    );
    assert!(
        !stderr.contains("panicked at"),
        "the guarded panic was printed:\n{stderr}"
    );
}
