//! `probe --config CASE.toml`: replay an OOM case file and say whether its verdicts reproduced.

use std::path::Path;
use std::time::Duration;

use crate::cli::ProbeArgs;
use crate::error::{CliError, CliResult};

/// True when `--config` names an oomprobe case file (TOML) rather than a config.json.
pub fn is_case_file(path: &Path) -> bool {
    path.extension().is_some_and(|e| e.eq_ignore_ascii_case("toml"))
}

pub fn run(_args: &ProbeArgs, _budget: Option<u64>, _timeout: Duration) -> CliResult<()> {
    Err(CliError::run("case replay is not built yet"))
}
