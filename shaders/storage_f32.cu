// storage_f32: prelude for CUDA kernels over f32 tensors (one element per 32-bit word).
// The twin of storage_f32.wgsl; followed by codec.cu and the op's source.
#define FMT 0u
#define EPW 1u
