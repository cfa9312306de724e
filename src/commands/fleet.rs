//! `probe --device all`: probe every device of the machine with a child `oomprobe probe` per
//! device (in parallel where the devices are distinct, one after another where two adapters are
//! the same card), then put the results side by side as `compare` does.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use crate::backend::{DeviceInfo, DeviceType};
use crate::cli::{OutputFormat, ProbeArgs};
use crate::error::{CliError, CliResult};
use crate::report::compare::{build, load_report, render, LoadedFile};
use crate::report::{out_format, write_output};

/// True when `--device` asks for every device.
pub fn wants_all(device: Option<&str>) -> bool {
    device.is_some_and(|d| d.trim().eq_ignore_ascii_case("all"))
}

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

pub fn run(args: &ProbeArgs) -> CliResult<()> {
    let devices = fleet_devices(&args.device.backend)?;
    let exe = std::env::current_exe()
        .map_err(|e| CliError::run(format!("cannot find this executable: {e}")))?;
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let base = child_args(&argv);
    let dir = std::env::temp_dir().join(format!("oomprobe-fleet-{}", std::process::id()));
    std::fs::create_dir_all(&dir)
        .map_err(|e| CliError::run(format!("cannot create {}: {e}", dir.display())))?;

    // Adapters with the same name are one card seen through two APIs: run those in turn.
    let mut by_card: BTreeMap<String, Vec<&DeviceInfo>> = BTreeMap::new();
    for d in &devices {
        by_card.entry(d.name.clone()).or_default().push(d);
    }
    if !args.quiet {
        eprintln!(
            "oomprobe: probing {} device(s) in {} parallel group(s)",
            devices.len(),
            by_card.len()
        );
    }
    let results: Vec<(usize, PathBuf, Result<(), String>)> = std::thread::scope(|s| {
        let handles: Vec<_> = by_card
            .values()
            .map(|group| {
                let (exe, base, dir) = (&exe, &base, &dir);
                s.spawn(move || {
                    group
                        .iter()
                        .map(|d| {
                            let path = dir.join(format!("device-{}.json", d.index));
                            let mut cmd = Command::new(exe);
                            cmd.args(base)
                                .args(["--device", &d.index.to_string(), "--quiet", "--out"])
                                .arg(&path)
                                .stdin(Stdio::null())
                                .stdout(Stdio::null())
                                .stderr(Stdio::piped());
                            crate::probe::child::die_with_parent(&mut cmd);
                            let out = cmd.output();
                            let res = match out {
                                Ok(o) if o.status.success() => Ok(()),
                                Ok(o) => Err(String::from_utf8_lossy(&o.stderr)
                                    .lines()
                                    .rev()
                                    .find(|l| !l.trim().is_empty())
                                    .unwrap_or("failed")
                                    .to_string()),
                                Err(e) => Err(e.to_string()),
                            };
                            (d.index, path, res)
                        })
                        .collect::<Vec<_>>()
                })
            })
            .collect();
        handles
            .into_iter()
            .flat_map(|h| h.join().unwrap_or_default())
            .collect()
    });

    let mut files = Vec::new();
    for (index, path, res) in results {
        if let Err(e) = res {
            eprintln!("oomprobe: device {index}: {e}");
        }
        // A failed run may still have written what it measured.
        if let Ok(report) = load_report(&path) {
            files.push(LoadedFile {
                path: path.clone(),
                report,
            });
        }
    }
    files.sort_by_key(|f| f.report.device.index);
    if files.is_empty() {
        return Err(CliError::run("no device produced a result"));
    }
    let format = match &args.out {
        Some(p) => out_format(p, args.format)?,
        None if args.json => OutputFormat::Json,
        None => args.format.unwrap_or(OutputFormat::Table),
    };
    let cmp = build(&files);
    let text = render(&files, &cmp, format)?;
    match &args.out {
        Some(p) => write_output(p, &text)?,
        None => print!("{text}"),
    }
    if !args.quiet {
        eprintln!("oomprobe: per-device results in {}", dir.display());
    }
    Ok(())
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

    #[test]
    fn all_is_recognised() {
        assert!(wants_all(Some("all")));
        assert!(wants_all(Some(" ALL ")));
        assert!(!wants_all(Some("0")));
        assert!(!wants_all(None));
    }
}
