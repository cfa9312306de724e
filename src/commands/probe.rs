//! `oomprobe probe`.

use crate::cli::ProbeArgs;
use crate::error::{CliError, CliResult};

pub fn run(_args: &ProbeArgs) -> CliResult<()> {
    Err(CliError::run("`probe` is not built yet"))
}
