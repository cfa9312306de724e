//! Word kernels over device tensors: fill every byte with a pattern, verify it, checksum it.
