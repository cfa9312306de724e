//! How much memory a run measures against: the user's budget, the device's free memory, or on
//! CPU adapters a default cap that keeps the run inside free RAM (the kernel's OOM killer is not
//! a result anyone wants), unless an address-space limit already binds first.

use crate::backend::{DeviceInfo, DeviceType};

/// Share of available RAM a CPU adapter may use by default.
pub const CPU_DEFAULT_SHARE: f64 = 0.5;

/// The capacity a run is sized against, and why.
#[derive(Debug, Clone, PartialEq)]
pub struct Capacity {
    /// The budget enforced by oomprobe itself (None: only the driver says no).
    pub budget: Option<u64>,
    /// The memory the prediction is made against.
    pub predict_against: Option<u64>,
    /// Free memory at start, where the device tells (for the fill ratio).
    pub free_at_start: Option<u64>,
    /// Lines a person should see ("CPU adapter: capped at ...").
    pub notes: Vec<String>,
}

/// Bytes of RAM available now (Linux /proc/meminfo `MemAvailable`).
pub fn ram_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// The process's address-space limit (RLIMIT_AS), if one is set.
pub fn address_space_limit() -> Option<u64> {
    #[cfg(unix)]
    {
        let mut lim = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        // SAFETY: getrlimit writes into the struct we pass and has no other effect.
        let rc = unsafe { libc::getrlimit(libc::RLIMIT_AS, &mut lim) };
        if rc == 0 && lim.rlim_cur != libc::RLIM_INFINITY {
            return Some(lim.rlim_cur);
        }
        None
    }
    #[cfg(not(unix))]
    {
        None
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

/// Headroom kept for pipelines, staging buffers and the driver's own allocations when a
/// prediction is made against an address-space limit.
pub const ADDRESS_SPACE_SLACK: u64 = 96 << 20;

/// Under an address-space limit, what a freshly opened device leaves for tensors: the limit
/// minus the address space this process maps once `open` has opened the device (measured, then
/// the device is dropped), minus a slack. None when there is no limit or `open` fails.
pub fn usable_under_address_space_limit<T, E>(open: impl FnOnce() -> Result<T, E>) -> Option<u64> {
    let limit = address_space_limit()?;
    let device = open().ok()?;
    let mapped = address_space_in_use()?;
    drop(device);
    Some(
        limit
            .saturating_sub(mapped)
            .saturating_sub(ADDRESS_SPACE_SLACK),
    )
}

/// Decide the capacity for a run on `device` with an optional user budget.
pub fn decide(device: &DeviceInfo, user_budget: Option<u64>) -> Capacity {
    let free = device.memory_free_bytes;
    let mut notes = Vec::new();
    if let Some(b) = user_budget {
        return Capacity {
            budget: Some(b),
            predict_against: Some(b),
            free_at_start: free,
            notes,
        };
    }
    if device.device_type == DeviceType::Cpu {
        let ram = ram_available();
        let cap = ram.map(|r| (r as f64 * CPU_DEFAULT_SHARE) as u64);
        let as_limit = address_space_limit();
        if let Some(limit) = as_limit.filter(|l| cap.is_none_or(|c| *l <= c)) {
            notes.push(format!(
                "CPU adapter under an address-space limit of {}: no cap of oomprobe's own, \
                 the driver's real OOM is the boundary",
                crate::units::fmt_bytes(limit)
            ));
            let usable = limit.saturating_sub(address_space_in_use().unwrap_or(0));
            return Capacity {
                budget: None,
                predict_against: Some(usable),
                free_at_start: free,
                notes,
            };
        }
        match cap {
            Some(c) => {
                notes.push(format!(
                    "CPU adapter: capped at {} ({}% of available RAM) so the kernel's OOM killer \
                     stays away; pass --budget to choose",
                    crate::units::fmt_bytes(c),
                    (CPU_DEFAULT_SHARE * 100.0) as u32
                ));
                Capacity {
                    budget: Some(c),
                    predict_against: Some(c),
                    free_at_start: ram,
                    notes,
                }
            }
            None => Capacity {
                budget: None,
                predict_against: device.memory_total_bytes,
                free_at_start: free,
                notes,
            },
        }
    } else {
        Capacity {
            budget: None,
            predict_against: free.or(device.memory_total_bytes),
            free_at_start: free,
            notes,
        }
    }
}
