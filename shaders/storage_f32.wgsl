// storage_f32: prelude for kernels over f32 tensors (one element per 32-bit word).
// Followed by codec.wgsl (the load/store helpers) and the op's source.
const FMT: u32 = 0u;
const EPW: u32 = 1u;
