//! The CUDA backend through cudarc (dynamic loading; NVRTC-compiled kernels from shaders/*.cu).
