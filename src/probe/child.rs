//! Probe isolation: re-exec this binary for one probe and read its result as one JSON line.

use crate::cli::ProbeChildArgs;
use crate::error::{CliError, CliResult};

pub fn run_child(_args: &ProbeChildArgs) -> CliResult<()> {
    Err(CliError::run("probe-child is not built yet"))
}
