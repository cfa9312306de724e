//! Kernel orchestration above the Backend trait: run an op over chunked tensors, written once
//! for all backends.

pub mod compute;
pub mod words;
