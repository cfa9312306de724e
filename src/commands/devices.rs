//! `oomprobe devices`.

use crate::cli::DevicesArgs;
use crate::error::{CliError, CliResult};

pub fn run(_args: &DevicesArgs) -> CliResult<()> {
    Err(CliError::run("`devices` is not built yet"))
}
