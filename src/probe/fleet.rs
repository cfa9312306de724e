//! Probe every device of the machine: a child `oomprobe probe` per device (in parallel where
//! the devices are distinct, one after another where two adapters are the same card), each
//! writing its own result file.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::backend::{DeviceInfo, DeviceType};
use crate::error::{CliError, CliResult};

/// The devices `--device all` covers for a `--backend`: the GPUs when there are any, else every
/// adapter (so a CPU-only machine still probes lavapipe).
pub fn fleet_devices(backend: &str) -> CliResult<Vec<DeviceInfo>> {
    use crate::backend::open::{list_cuda_devices, list_devices, parse_backend, BackendChoice};
    let all = match parse_backend(backend)? {
        BackendChoice::Cuda => {
            list_cuda_devices().map_err(|m| CliError::run(format!("CUDA: {m}")))?
        }
        BackendChoice::Auto => list_devices(),
        BackendChoice::Wgpu(kind) => list_devices()
            .into_iter()
            .filter(|d| d.backend == kind)
            .collect(),
    };
    if all.is_empty() {
        return Err(CliError::run(crate::backend::open::NO_ADAPTER_HINT));
    }
    let gpus: Vec<DeviceInfo> = all
        .iter()
        .filter(|d| d.device_type != DeviceType::Cpu)
        .cloned()
        .collect();
    Ok(if gpus.is_empty() { all } else { gpus })
}

/// This invocation's arguments without the flags the fleet sets per child.
fn child_args(argv: &[String]) -> Vec<String> {
    let mut out = Vec::new();
    let mut it = argv.iter().peekable();
    while let Some(a) = it.next() {
        let takes_value = ["--device", "--out", "--format"].contains(&a.as_str());
        if takes_value {
            it.next();
            continue;
        }
        if a.starts_with("--device=") || a.starts_with("--out=") || a.starts_with("--format=") {
            continue;
        }
        if a == "--json" || a == "--quiet" {
            continue;
        }
        out.push(a.clone());
    }
    out
}

/// What one device's child left behind.
#[derive(Debug)]
pub struct DeviceRun {
    pub index: usize,
    /// Its result file (it may hold a partial run when the child failed).
    pub path: PathBuf,
    /// The child's last stderr line when it failed.
    pub error: Option<String>,
}

/// Run `exe probe` with this invocation's arguments `argv` (less the per-child flags) on every
/// device, each writing `dir/device-N.json`.
pub fn probe_all(
    exe: &Path,
    argv: &[String],
    devices: &[DeviceInfo],
    dir: &Path,
    world: Option<u64>,
) -> Vec<DeviceRun> {
    let base = child_args(argv);
    // Adapters with the same name are one card seen through two APIs: run those in turn.
    let mut by_card: BTreeMap<String, Vec<&DeviceInfo>> = BTreeMap::new();
    for d in devices {
        by_card.entry(d.name.clone()).or_default().push(d);
    }
    std::thread::scope(|s| {
        let handles: Vec<_> = by_card
            .values()
            .map(|group| {
                let base = &base;
                s.spawn(move || {
                    group
                        .iter()
                        .map(|d| probe_one(exe, base, d, dir, world))
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_default())
            .collect()
    })
}

/// The number of groups `probe_all` runs in parallel.
pub fn parallel_groups(devices: &[DeviceInfo]) -> usize {
    let mut names: Vec<&str> = devices.iter().map(|d| d.name.as_str()).collect();
    names.sort_unstable();
    names.dedup();
    names.len()
}

/// One device's child; with a parallel layout of `world` ranks, device i runs rank i (mod the
/// world size): each GPU probes its own rank's plan.
fn probe_one(
    exe: &Path,
    base: &[String],
    d: &DeviceInfo,
    dir: &Path,
    world: Option<u64>,
) -> DeviceRun {
    let path = dir.join(format!("device-{}.json", d.index));
    let mut cmd = Command::new(exe);
    cmd.args(base);
    if let Some(n) = world {
        cmd.args(["--rank", &(d.index as u64 % n.max(1)).to_string()]);
    }
    cmd.args(["--device", &d.index.to_string(), "--quiet", "--out"])
        .arg(&path)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    super::child::die_with_parent(&mut cmd);
    let error = match cmd.output() {
        Ok(o) if o.status.success() => None,
        Ok(o) => Some(
            String::from_utf8_lossy(&o.stderr)
                .lines()
                .rev()
                .find(|l| !l.trim().is_empty())
                .unwrap_or("failed")
                .to_string(),
        ),
        Err(e) => Some(e.to_string()),
    };
    DeviceRun {
        index: d.index,
        path,
        error,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn child_args_drop_the_per_child_flags() {
        let argv: Vec<String> = [
            "probe",
            "--device",
            "all",
            "--budget",
            "1GiB",
            "--out",
            "x.md",
            "--json",
            "--format=csv",
            "--quiet",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        assert_eq!(child_args(&argv), vec!["probe", "--budget", "1GiB"]);
    }
}
