//! `probe --config CASE.toml`: replay an OOM case file on this device, with the case's card
//! memory as the budget, and say whether each expected verdict reproduced.

use std::path::Path;

use crate::cli::ProbeArgs;
use crate::error::{CliError, CliResult};
use crate::probe::case::{replay, CaseOptions};
use crate::probe::child::ProbeTimeout;
use crate::probe::session::NO_ISOLATE_WARNING;
use crate::resolve::{load_config, LoadedConfig};
use crate::units::fmt_bytes;

/// True when `--config` names an oomprobe case file (TOML) rather than a config.json.
pub fn is_case_file(path: &Path) -> bool {
    path.extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("toml"))
}

pub fn run(args: &ProbeArgs, budget: Option<u64>, timeout: ProbeTimeout) -> CliResult<()> {
    let Some(path) = &args.workload.config else {
        return Err(CliError::usage("case replay needs --config CASE.toml"));
    };
    let case = match load_config(path).map_err(|e| CliError::usage(e.to_string()))? {
        LoadedConfig::Case(c) => c,
        LoadedConfig::Hf(_) => {
            return Err(CliError::usage(format!(
                "{} is not an oomprobe case file",
                path.display()
            )))
        }
    };
    let memory = case.memory.ok_or_else(|| {
        CliError::usage(format!(
            "case {}: `memory` (the card's memory) is required to replay it",
            path.display()
        ))
    })?;
    if budget.is_some_and(|b| b != memory) {
        return Err(CliError::usage(format!(
            "case {} sets the card's memory ({}); --budget cannot change it",
            path.display(),
            fmt_bytes(memory)
        )));
    }
    if args.no_isolate {
        crate::error::warn(NO_ISOLATE_WARNING);
    }
    let report = replay(
        &case,
        memory,
        &CaseOptions {
            backend: args.device.backend.clone(),
            device: args.device.device.clone(),
            allocator: args.device.allocator(),
            isolate: !args.no_isolate,
            timeout,
        },
    )?;
    if args.json {
        let text =
            serde_json::to_string_pretty(&report).map_err(|e| CliError::run(e.to_string()))?;
        println!("{text}");
    } else {
        print!("{}", crate::report::case_replay::render(&report));
    }
    Ok(())
}
