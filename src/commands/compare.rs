//! `oomprobe compare`: several probe result files side by side.
//!
//! Reads every file first (a bad one stops with exit 2 and one line naming it), prints the
//! warnings (workloads that differ for the same scenario) on stderr, then writes the comparison
//! to `--out` (format from the extension unless `--format` says otherwise; `-` is stdout) or
//! to stdout (a table unless `--format` says otherwise).

use crate::cli::{CompareArgs, OutputFormat};
use crate::error::CliResult;
use crate::report::compare::{build, load_report, render, LoadedFile};
use crate::report::{out_format, write_output};

pub fn run(args: &CompareArgs) -> CliResult<()> {
    let mut files = Vec::with_capacity(args.files.len());
    for path in &args.files {
        let report = load_report(path)?;
        files.push(LoadedFile {
            path: path.clone(),
            report,
        });
    }
    let format = match &args.out {
        Some(p) => out_format(p, args.format)?,
        None => args.format.unwrap_or(OutputFormat::Table),
    };
    let cmp = build(&files);
    for w in &cmp.warnings {
        crate::error::warn(w);
    }
    let text = render(&files, &cmp, format, args.wide)?;
    match &args.out {
        Some(p) => write_output(p, &text)?,
        None => print!("{text}"),
    }
    Ok(())
}
