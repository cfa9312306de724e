// storage_bf16: prelude for kernels over bf16 tensors (two per 32-bit word, element i in bits
// (i & 1) * 16; an element is the upper half of an f32, rounded to nearest even on store;
// arithmetic in f32). Followed by codec.wgsl (the load/store helpers) and the op's source.
const FMT: u32 = 2u;
const EPW: u32 = 2u;
