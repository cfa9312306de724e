//! oomprobe: find the real out-of-memory boundary of deep-learning workloads on the GPU at hand.
//!
//! Layers, top to bottom (ARCHITECTURE.md); a module imports only the layers below it:
//! `cli` -> `commands` -> `probe` / `snapshot` / `message_check` -> `diagnose` / `layouts` ->
//! `estimate` / `search` / `serve` / `ops` -> `report` / `tensor` -> `backend` / `oom` ->
//! `alloc` / `resolve` -> `plan` -> `workload`; beside them all, the leaves `units`, `error`,
//! `input`, `scenario`, `term`, `help` and `kernels`. `scripts/import-cycles.py` checks that no
//! files import each other in a circle. One exception remains at module level: `probe` reads
//! types of `cli` and `commands`, and `snapshot` and `probe` use each other (ARCHITECTURE.md).

pub mod alloc;
pub mod backend;
pub mod cli;
pub mod commands;
pub mod cost;
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
pub mod ways;
pub mod workload;
