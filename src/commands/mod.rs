//! Command implementations, one module per subcommand (`case`: `probe --config CASE.toml`, a
//! case file replayed on this device).

pub mod case;
pub mod compare;
pub mod completions;
pub mod devices;
pub mod diagnose;
pub mod estimate;
pub mod fleet;
pub mod probe;
pub mod snapshot;

use crate::cli::Command;
use crate::error::CliResult;

/// Run one parsed command.
pub fn run(command: Command) -> CliResult<()> {
    match command {
        Command::Devices(args) => devices::run(&args),
        Command::Estimate(args) => estimate::run(&args),
        Command::Probe(args) => probe::run(&args),
        Command::Diagnose(args) => diagnose::run(&args),
        Command::Compare(args) => compare::run(&args),
        Command::Completions(args) => completions::completions(&args),
        Command::Man(args) => completions::man(&args),
        Command::ProbeChild(args) => crate::probe::child::run_child(&args),
    }
}
