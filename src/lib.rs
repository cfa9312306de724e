//! oomprobe: find the real out-of-memory boundary of deep-learning workloads on the GPU at hand.
//!
//! Layers, top to bottom (see README.md): `cli` -> `commands` -> `workload` / `plan` / `estimate`
//! -> `search` -> `probe` -> `backend` (wgpu, cuda, mock) -> `report`.

pub mod alloc;
pub mod backend;
pub mod cli;
pub mod commands;
pub mod diagnose;
pub mod error;
pub mod estimate;
pub mod help;
pub mod input;
pub mod kernels;
pub mod layouts;
pub mod message_check;
pub mod oom;
pub mod ops;
pub mod plan;
pub mod probe;
pub mod report;
pub mod resolve;
pub mod scenario;
pub mod search;
pub mod serve;
pub mod snapshot;
pub mod tensor;
pub mod term;
pub mod units;
pub mod workload;
