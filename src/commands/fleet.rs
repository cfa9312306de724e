//! `probe --device all`: probe every device of the machine, then put the results side by side
//! as `compare` does.

use crate::cli::{OutputFormat, ProbeArgs};
use crate::error::{CliError, CliResult};
use crate::probe::fleet::{fleet_devices, parallel_groups, probe_all};
use crate::report::compare::{build, load_report, render, LoadedFile};
use crate::report::{out_format, write_output};

/// True when `--device` asks for every device.
pub fn wants_all(device: Option<&str>) -> bool {
    device.is_some_and(|d| d.trim().eq_ignore_ascii_case("all"))
}

pub fn run(args: &ProbeArgs) -> CliResult<()> {
    let devices = fleet_devices(&args.device.backend)?;
    let exe = std::env::current_exe()
        .map_err(|e| CliError::run(format!("cannot find this executable: {e}")))?;
    let argv: Vec<String> = std::env::args().skip(1).collect();
    let dir = std::env::temp_dir().join(format!("oomprobe-fleet-{}", std::process::id()));
    std::fs::create_dir_all(&dir)
        .map_err(|e| CliError::run(format!("cannot create {}: {e}", dir.display())))?;
    if !args.quiet {
        eprintln!(
            "oomprobe: probing {} device(s) in {} parallel group(s)",
            devices.len(),
            parallel_groups(&devices)
        );
    }
    // A parallel layout without --rank: each device probes its own rank's plan.
    let world = crate::resolve::resolve(&args.workload, "gpt2")
        .ok()
        .map(|r| r.workload)
        .filter(|w| !w.parallel.is_single() && w.parallel.rank.is_none())
        .map(|w| w.gpus);
    if let (Some(n), false) = (world, args.quiet) {
        eprintln!("oomprobe: a {n}-rank layout: device i probes rank i's plan");
    }
    let mut files = Vec::new();
    for run in probe_all(&exe, &argv, &devices, &dir, world) {
        if let Some(e) = &run.error {
            eprintln!("oomprobe: device {}: {e}", run.index);
        }
        // A failed run may still have written what it measured.
        if let Ok(report) = load_report(&run.path) {
            files.push(LoadedFile {
                path: run.path,
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
    let text = render(&files, &cmp, format, args.wide)?;
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
    fn all_is_recognised() {
        assert!(wants_all(Some("all")));
        assert!(wants_all(Some(" ALL ")));
        assert!(!wants_all(Some("0")));
        assert!(!wants_all(None));
    }
}
