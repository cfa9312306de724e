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

/// `msg` as one line a terminal shows as it is: control characters (a newline, a carriage
/// return, the ESC that starts a colour or cursor sequence, C1 controls) are written as Rust
/// escapes (`\n`, `\u{1b}`), so user input echoed in an error can neither break the one-line
/// contract nor reach the terminal as a command. `main` prints every error through it.
pub fn one_line(msg: &str) -> String {
    let mut out = String::with_capacity(msg.len());
    for c in msg.chars() {
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// Print a warning on stderr, one line, escaped as errors are ([`one_line`]).
pub fn warn(msg: impl std::fmt::Display) {
    eprintln!("oomprobe: warning: {}", one_line(&msg.to_string()));
}

#[cfg(test)]
mod tests {
    #[test]
    fn controls_are_escaped_and_the_rest_kept() {
        assert_eq!(
            super::one_line("key 'a\nb\r\u{1b}[31mc\u{9b}' — ü"),
            "key 'a\\nb\\r\\u{1b}[31mc\\u{9b}' — ü"
        );
        assert_eq!(super::one_line("plain"), "plain");
    }
}
