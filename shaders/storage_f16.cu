// storage_f16: prelude for CUDA kernels over f16 tensors (two per 32-bit word, element i in bits (i & 1) * 16, IEEE binary16; arithmetic in f32).
// The twin of storage_f16.wgsl; followed by codec.cu and the op's source.
#define FMT 1u
#define EPW 2u
