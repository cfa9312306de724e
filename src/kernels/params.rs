//! Kernel parameter structs (repr(C), Pod), identical in WGSL and CUDA.
