//! `oomprobe diagnose`: which of the four causes of an OOM dominates, and what each remedy buys.

use crate::cli::DiagnoseArgs;
use crate::commands::estimate::{case_memory, memory_arg, out, plan_error};
use crate::diagnose::{diagnose, render};
use crate::error::{CliError, CliResult};
use crate::workload::overrides::resolve;

pub fn run(args: &DiagnoseArgs) -> CliResult<()> {
    if crate::commands::snapshot::wanted(&args.snapshot) {
        // The card the snapshot was recorded on (its OOM), or --memory; never this machine's.
        let memory = args.memory.as_deref().map(memory_arg).transpose()?;
        return crate::commands::snapshot::diagnose(&args.snapshot, memory, args.json);
    }
    let r = resolve(&args.workload, "gpt2")?;
    let memory = match args.memory.as_deref() {
        Some(m) => memory_arg(m)?,
        None => match case_memory(&args.workload)? {
            Some(m) => m,
            None => match crate::backend::open::detected_gpu() {
                Some((name, m)) => {
                    eprintln!(
                        "oomprobe: judging against {name}, {} (detected)",
                        crate::units::fmt_bytes(m)
                    );
                    m
                }
                None => return Err(CliError::usage(
                    "no GPU's memory is known here (no GPU adapter, or its API does not tell; a CPU adapter's heap is no card's): pass --memory SIZE",
                )),
            },
        },
    };
    if r.workload.mode == crate::workload::Mode::Serve {
        let d = crate::serve::render::diagnose(&r.workload, memory).map_err(plan_error)?;
        if args.json {
            let s = serde_json::to_string_pretty(&d).map_err(|e| CliError::run(e.to_string()))?;
            return out(&format!("{s}\n"));
        }
        return out(&crate::serve::render::diagnosis_text(&d));
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
