//! The card, not the tensors: PyTorch's CUDA caching allocator as one model that `estimate`,
//! `probe` and snapshot replay all use, the settings it reads (`PYTORCH_CUDA_ALLOC_CONF`), the
//! cards people have and what the CUDA runtime holds outside the allocator on them.
//!
//! This floor imports only `plan` (the timeline it replays); everything above reads it.

pub mod caching;
pub mod cards;
pub mod conf;
pub mod timeline;

pub use caching::{Action, Allocator, BlockId, Device, ModelDevice, Oom, Stats};
pub use conf::{AllocConf, ConfError};
