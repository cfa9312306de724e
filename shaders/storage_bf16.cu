// storage_bf16: prelude for CUDA kernels over bf16 tensors (two per 32-bit word, element i in bits (i & 1) * 16, the upper half of an f32, rounded to nearest even on store; arithmetic in f32).
// The twin of storage_bf16.wgsl; followed by codec.cu and the op's source.
#define FMT 2u
#define EPW 2u
