//! `oomprobe estimate`.

use crate::cli::EstimateArgs;
use crate::error::{CliError, CliResult};

pub fn run(_args: &EstimateArgs) -> CliResult<()> {
    Err(CliError::run("`estimate` is not built yet"))
}
