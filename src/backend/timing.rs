//! Optional per-kernel dispatch timing, for sizing dispatches under a watchdog: with
//! `OOMPROBE_DISPATCH_TIMES=FILE`, a backend waits for every launch and records its time; each
//! kernel's count, total and slowest launch (with its workgroups) are appended to FILE when the
//! backend is dropped, one tab-separated line per kernel. Slows every probe down; never on by
//! default.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;

/// The environment variable naming the file the timings are appended to.
pub const DISPATCH_TIMES_ENV: &str = "OOMPROBE_DISPATCH_TIMES";

#[derive(Debug, Default, Clone, Copy)]
struct KernelTimes {
    count: u64,
    total: f64,
    max: f64,
    max_groups: [u32; 3],
}

/// Launch times by kernel label.
#[derive(Debug)]
pub struct DispatchTimes {
    file: PathBuf,
    by_kernel: BTreeMap<String, KernelTimes>,
}

impl DispatchTimes {
    /// Timing on when the environment asks for it.
    pub fn from_env() -> Option<DispatchTimes> {
        let file = std::env::var_os(DISPATCH_TIMES_ENV).filter(|f| !f.is_empty())?;
        Some(DispatchTimes {
            file: PathBuf::from(file),
            by_kernel: BTreeMap::new(),
        })
    }

    /// One launch of `label` over `groups` took `seconds`.
    pub fn record(&mut self, label: &str, groups: [u32; 3], seconds: f64) {
        let k = self.by_kernel.entry(label.to_string()).or_default();
        k.count += 1;
        k.total += seconds;
        if seconds > k.max {
            k.max = seconds;
            k.max_groups = groups;
        }
    }

    /// The lines appended on drop: `label count total_s max_s gx,gy,gz`.
    pub fn lines(&self) -> Vec<String> {
        self.by_kernel
            .iter()
            .map(|(label, k)| {
                let [x, y, z] = k.max_groups;
                format!(
                    "{label}\t{}\t{:.6}\t{:.6}\t{x},{y},{z}",
                    k.count, k.total, k.max
                )
            })
            .collect()
    }
}

impl Drop for DispatchTimes {
    fn drop(&mut self) {
        let lines = self.lines();
        if lines.is_empty() {
            return;
        }
        let r = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.file)
            .and_then(|mut f| f.write_all((lines.join("\n") + "\n").as_bytes()));
        if let Err(e) = r {
            log::warn!(
                "cannot append dispatch times to {}: {e}",
                self.file.display()
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keeps_the_slowest_launch_of_each_kernel() {
        let mut t = DispatchTimes {
            file: PathBuf::new(),
            by_kernel: BTreeMap::new(),
        };
        t.record("matmul_f32", [4, 1, 1], 0.5);
        t.record("matmul_f32", [9, 2, 1], 1.5);
        t.record("fill", [1, 1, 1], 0.1);
        assert_eq!(
            t.lines(),
            [
                "fill\t1\t0.100000\t0.100000\t1,1,1",
                "matmul_f32\t2\t2.000000\t1.500000\t9,2,1"
            ]
        );
        t.by_kernel.clear(); // nothing to append to an empty path
    }
}
