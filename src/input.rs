//! Read a file the user named, safely: what is not a regular file (a FIFO with no writer, a
//! device such as /dev/zero, a directory) is refused before it is opened, and no more than a
//! cap is ever read, so a wrong path costs one clear line, never a hang or the host's memory.

use std::io::Read;
use std::path::Path;

/// Why a named file was not read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum InputError {
    #[error("no such file")]
    NotFound,
    /// A FIFO, a device, a socket or a directory.
    #[error("it is {0}, not a regular file")]
    NotRegular(&'static str),
    #[error("larger than {}: no such file is this large", crate::units::fmt_bytes(*.cap))]
    TooLarge { cap: u64 },
    #[error("{0}")]
    Io(String),
}

impl InputError {
    fn io(e: std::io::Error) -> InputError {
        match e.kind() {
            std::io::ErrorKind::NotFound => InputError::NotFound,
            _ => InputError::Io(e.to_string()),
        }
    }
}

/// What a file is, in words, when it is not a regular file (None when it is one).
fn not_regular(m: &std::fs::Metadata) -> Option<&'static str> {
    let t = m.file_type();
    if t.is_file() {
        return None;
    }
    if t.is_dir() {
        return Some("a directory");
    }
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if t.is_fifo() {
            return Some("a FIFO (named pipe)");
        }
        if t.is_char_device() {
            return Some("a character device");
        }
        if t.is_block_device() {
            return Some("a block device");
        }
        if t.is_socket() {
            return Some("a socket");
        }
    }
    Some("not a regular file")
}

/// Refuse `path` unless it is a regular file (links followed), without opening it.
pub fn check_regular(path: &Path) -> Result<(), InputError> {
    let m = std::fs::metadata(path).map_err(InputError::io)?;
    match not_regular(&m) {
        Some(what) => Err(InputError::NotRegular(what)),
        None => Ok(()),
    }
}

/// The bytes of the regular file `path`, at most `cap` of them (a larger file is refused after
/// reading one byte past the cap, so a file that grows while read is refused too).
pub fn read_capped(path: &Path, cap: u64) -> Result<Vec<u8>, InputError> {
    check_regular(path)?;
    let f = std::fs::File::open(path).map_err(InputError::io)?;
    if f.metadata().is_ok_and(|m| m.len() > cap) {
        return Err(InputError::TooLarge { cap });
    }
    let mut bytes = Vec::new();
    f.take(cap.saturating_add(1))
        .read_to_end(&mut bytes)
        .map_err(InputError::io)?;
    if bytes.len() as u64 > cap {
        return Err(InputError::TooLarge { cap });
    }
    Ok(bytes)
}

/// The text of the regular file `path`, at most `cap` bytes of UTF-8.
pub fn read_text_capped(path: &Path, cap: u64) -> Result<String, InputError> {
    String::from_utf8(read_capped(path, cap)?).map_err(|_| InputError::Io("not UTF-8 text".into()))
}

/// Open `path` to be streamed: a regular file or a pipe (a FIFO a writer feeds), never a
/// device or a directory. A FIFO blocks until its writer opens it, as a pipe would.
pub fn open_stream(path: &Path) -> Result<std::fs::File, InputError> {
    let m = std::fs::metadata(path).map_err(InputError::io)?;
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileTypeExt;
        if m.file_type().is_fifo() {
            return std::fs::File::open(path).map_err(InputError::io);
        }
    }
    if let Some(what) = not_regular(&m) {
        return Err(InputError::NotRegular(what));
    }
    if let Some(what) = pseudo(path) {
        return Err(InputError::NotRegular(what));
    }
    std::fs::File::open(path).map_err(InputError::io)
}

/// A kernel's pseudo-file (procfs, sysfs): it says size 0 and may yield without end
/// (`/proc/self/pagemap`), so it is not a log.
fn pseudo(path: &Path) -> Option<&'static str> {
    let real = std::fs::canonicalize(path).ok()?;
    if real.starts_with("/proc") {
        Some("a procfs file")
    } else if real.starts_with("/sys") {
        Some("a sysfs file")
    } else {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn regular_files_are_read_up_to_the_cap_and_refused_past_it() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("f");
        std::fs::write(&p, b"12345").unwrap();
        assert_eq!(read_capped(&p, 5).unwrap(), b"12345");
        assert_eq!(read_capped(&p, 4), Err(InputError::TooLarge { cap: 4 }));
        assert_eq!(
            read_capped(&dir.path().join("none"), 4),
            Err(InputError::NotFound)
        );
        assert_eq!(
            read_capped(dir.path(), 4),
            Err(InputError::NotRegular("a directory"))
        );
    }

    #[cfg(unix)]
    #[test]
    fn devices_and_fifos_are_refused_before_they_are_opened() {
        let zero = Path::new("/dev/zero");
        assert_eq!(
            read_capped(zero, 1 << 20),
            Err(InputError::NotRegular("a character device"))
        );
        assert!(open_stream(zero).is_err());
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("fifo");
        let c = std::ffi::CString::new(fifo.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path; mkfifo only creates the node.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        // Would block forever in open(2) if it were opened: it is refused first.
        assert_eq!(
            read_capped(&fifo, 1 << 20),
            Err(InputError::NotRegular("a FIFO (named pipe)"))
        );
    }
}
