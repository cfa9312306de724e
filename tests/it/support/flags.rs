//! A workload from command-line flags, resolved as the CLI resolves them (the published rows and
//! the validation rows built from a config at another size).

use clap::Parser;
use oomprobe::workload::args::WorkloadArgs;
use oomprobe::workload::Workload;

#[derive(Parser)]
struct Flags {
    #[command(flatten)]
    w: WorkloadArgs,
}

/// The workload these flags resolve to (a flag error or a refusal panics, naming the flags).
pub fn workload(flags: &str) -> Workload {
    let args: Vec<&str> = std::iter::once("x")
        .chain(flags.split_whitespace())
        .collect();
    let a = Flags::try_parse_from(&args).unwrap_or_else(|e| panic!("{flags}: {e}"));
    oomprobe::resolve::resolve(&a.w, "gpt2")
        .unwrap_or_else(|e| panic!("{flags}: {e}"))
        .workload
}
