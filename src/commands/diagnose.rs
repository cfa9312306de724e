//! `oomprobe diagnose`.

use crate::cli::DiagnoseArgs;
use crate::error::{CliError, CliResult};

pub fn run(_args: &DiagnoseArgs) -> CliResult<()> {
    Err(CliError::run("`diagnose` is not built yet"))
}
