//! The card, not the tensors: PyTorch's CUDA caching allocator as one model that `estimate`,
//! `probe` and snapshot replay all use, the settings it reads (`PYTORCH_CUDA_ALLOC_CONF`), the
//! cards people have and what the CUDA runtime holds outside the allocator on them.
//!
//! This floor imports only `plan` (the timeline it replays) and `units`; everything above reads it.

pub mod caching;
pub mod cards;
pub mod conf;
pub mod device;
pub mod fit;
pub mod render;
pub mod sequence;
pub mod sizes;
pub mod timeline;

pub use caching::{Action, Allocator, BlockId, Oom, Stats};
pub use conf::{AllocConf, ConfError};
pub use device::{Device, ModelDevice};

/// How the card is seen by the allocator's boundaries.
#[derive(Debug, Clone)]
pub struct Card {
    /// The card's memory (`--memory`).
    pub total: u64,
    /// Held outside PyTorch's allocator.
    pub non_pytorch: u64,
    pub conf: AllocConf,
}

impl Card {
    /// What PyTorch's allocator may take from the driver.
    pub fn usable(&self) -> u64 {
        self.total.saturating_sub(self.non_pytorch)
    }
}
