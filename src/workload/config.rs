//! What reading a config file shares between its two formats (a Hugging Face config.json, read
//! by `workload::hf`, and an oomprobe TOML case file, read by `workload::case`): the error type
//! naming the file and field, and the capped read of the file's text.

use std::path::Path;

use thiserror::Error;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ConfigError {
    #[error("config file '{0}' not found")]
    NotFound(String),
    #[error("cannot read config file '{path}': {msg}")]
    Read { path: String, msg: String },
    #[error("config file '{path}' is not valid {format}: {msg}")]
    Syntax {
        path: String,
        format: &'static str,
        msg: String,
    },
    #[error("config file '{path}': field '{field}': {msg}")]
    Field {
        path: String,
        field: String,
        msg: String,
    },
}

pub(crate) fn field_err(path: &str, field: &str, msg: impl Into<String>) -> ConfigError {
    ConfigError::Field {
        path: path.to_string(),
        field: field.to_string(),
        msg: msg.into(),
    }
}

/// The largest config.json or case file read (a real config.json is a few KB).
pub const MAX_CONFIG_BYTES: u64 = 16 << 20;

/// The text of a config file: refused when it is not a regular file or is larger than
/// [`MAX_CONFIG_BYTES`]; a UTF-8 byte-order mark removed.
pub fn read_text(path: &Path) -> Result<String, ConfigError> {
    let p = path.display().to_string();
    // What is not a regular file (a FIFO, a device) is refused before it is opened, and a huge
    // file without being read whole.
    let text = crate::input::read_text_capped(path, MAX_CONFIG_BYTES).map_err(|e| match e {
        crate::input::InputError::NotFound => ConfigError::NotFound(p.clone()),
        crate::input::InputError::TooLarge { .. } => ConfigError::Read {
            path: p.clone(),
            msg: format!(
                "larger than {} MiB: no config.json or case file is this large",
                MAX_CONFIG_BYTES >> 20
            ),
        },
        e => ConfigError::Read {
            path: p.clone(),
            msg: e.to_string(),
        },
    })?;
    // A UTF-8 byte-order mark (some Windows editors write one) is not part of the text.
    Ok(match text.strip_prefix('\u{feff}') {
        Some(t) => t.to_string(),
        None => text,
    })
}

/// Whether `path` names a case file (`.toml`, any case) rather than a config.json.
pub fn is_case_path(path: &Path) -> bool {
    path.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| e.eq_ignore_ascii_case("toml"))
}
