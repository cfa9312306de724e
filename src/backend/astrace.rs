//! Optional trace of what each buffer costs in address space, for finding why a CPU adapter's
//! room (filler) and its real allocations disagree under an address-space limit: with
//! `OOMPROBE_AS_TRACE=FILE`, a backend appends one tab-separated line per buffer allocated or
//! freed (`pid op bytes result vmsize_before vmsize_after`), and one when it opens. Never on by
//! default.

use std::io::Write;
use std::path::PathBuf;

/// The environment variable naming the file the lines are appended to.
pub const AS_TRACE_ENV: &str = "OOMPROBE_AS_TRACE";

/// Where the lines go, when the environment asks for them.
#[derive(Debug)]
pub struct AsTrace {
    file: PathBuf,
}

impl AsTrace {
    /// Tracing on when the environment asks for it; the opening line is written then.
    pub fn from_env() -> Option<AsTrace> {
        let file = std::env::var_os(AS_TRACE_ENV).filter(|f| !f.is_empty())?;
        let t = AsTrace {
            file: PathBuf::from(file),
        };
        let vm = Self::vm();
        t.line("open", 0, "ok", vm, vm);
        Some(t)
    }

    /// The address space mapped now (0 where the system does not tell).
    pub fn vm() -> u64 {
        address_space_in_use().unwrap_or(0)
    }

    /// Append one line: `op` of `bytes` ended as `result`, the mapped bytes around it.
    pub fn line(&self, op: &str, bytes: u64, result: &str, before: u64, after: u64) {
        let pid = std::process::id();
        let text = format!("{pid}\t{op}\t{bytes}\t{result}\t{before}\t{after}\n");
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.file)
        {
            let _ = f.write_all(text.as_bytes());
        }
    }
}

/// Address space this process maps now (Linux `VmSize`): what a limit leaves for tensors is
/// the limit minus this.
pub fn address_space_in_use() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = text.lines().find(|l| l.starts_with("VmSize:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}
