//! Errors at the command boundary: bad input (exit 2) versus a failed run (exit 1).

use thiserror::Error;

/// An error a command returns; `main` turns it into one line on stderr and an exit code.
#[derive(Debug, Error)]
pub enum CliError {
    /// Bad usage or bad input: unknown preset, malformed config, zero or absurd sizes,
    /// overflowing arithmetic, a device index that does not exist. Exit code 2.
    #[error("{0}")]
    Usage(String),
    /// The run failed: no device, a probe error that is not an OOM result. Exit code 1.
    #[error("{0}")]
    Run(String),
}

impl CliError {
    pub fn usage(msg: impl Into<String>) -> Self {
        CliError::Usage(msg.into())
    }
    pub fn run(msg: impl Into<String>) -> Self {
        CliError::Run(msg.into())
    }
    /// The process exit code for this error.
    pub fn exit_code(&self) -> i32 {
        match self {
            CliError::Usage(_) => 2,
            CliError::Run(_) => 1,
        }
    }
}

pub type CliResult<T> = Result<T, CliError>;
