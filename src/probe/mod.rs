//! Probes: execute a plan on a Backend and classify the outcome; run each in a child process;
//! search each scenario's boundary and collect the results.

pub mod capacity;
pub mod case;
pub mod charge;
pub mod child;
pub mod dry;
pub mod exec;
pub mod fleet;
pub mod hostmem;
pub mod readback;
pub mod room;
pub mod runner;
pub mod serve;
pub mod session;
pub mod sinks;
pub mod spill;
pub mod suite;
pub mod warmup;

use serde::{Deserialize, Serialize};

/// How much work a probe does over its tensors once they are allocated.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Compute {
    /// Fill and verify every byte, then run the plan's real kernels, then checksum.
    Full,
    /// Fill and verify every byte, then checksum.
    Touch,
}

impl Compute {
    pub fn name(self) -> &'static str {
        match self {
            Compute::Full => "full",
            Compute::Touch => "touch",
        }
    }
}

/// Which device a probe runs on, as the parent resolved it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceChoice {
    /// auto | vulkan | metal | dx12 | gl | cuda | mock
    pub backend: String,
    pub index: Option<usize>,
    /// The caching allocator's settings when tensors go through it (`--allocator pytorch`,
    /// see `backend::pooled`); None: each tensor chunk is its own buffer.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub allocator: Option<String>,
}
