//! Kernel orchestration above the Backend trait: run an op over a chunked tensor, once for all backends.
