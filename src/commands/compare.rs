//! `oomprobe compare`.

use crate::cli::CompareArgs;
use crate::error::{CliError, CliResult};

pub fn run(_args: &CompareArgs) -> CliResult<()> {
    Err(CliError::run("`compare` is not built yet"))
}
