//! `oomprobe diagnose`: the seed's quick diagnosis as a command.

use crate::cli::DiagnoseArgs;
use crate::commands::estimate::{case_memory, memory_arg, out, plan_error};
use crate::diagnose::{diagnose, render};
use crate::error::{CliError, CliResult};
use crate::workload::overrides::resolve;

pub fn run(args: &DiagnoseArgs) -> CliResult<()> {
    let r = resolve(&args.workload, "gpt2")?;
    let memory = match args.memory.as_deref() {
        Some(m) => memory_arg(m)?,
        None => match case_memory(&args.workload)? {
            Some(m) => m,
            None => crate::backend::open::default_device_memory().ok_or_else(|| {
                CliError::usage(
                "no device memory known (no adapter, or its API does not tell): pass --memory SIZE",
            )
            })?,
        },
    };
    if crate::commands::snapshot::wanted(&args.snapshot) {
        return crate::commands::snapshot::diagnose(&args.snapshot, memory, args.json);
    }
    let d = diagnose(&r.workload, memory).map_err(plan_error)?;
    for w in &r.warnings {
        eprintln!("oomprobe: warning: {w}");
    }
    if args.json {
        let s = serde_json::to_string_pretty(&d).map_err(|e| CliError::run(e.to_string()))?;
        out(&format!("{s}\n"))
    } else {
        out(&render(&d))
    }
}
