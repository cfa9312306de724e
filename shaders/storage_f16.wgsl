// storage_f16: prelude for kernels over f16 tensors (two per 32-bit word, element i in bits
// (i & 1) * 16, converted with pack2x16float / unpack2x16float; arithmetic in f32).
// Followed by codec.wgsl (the load/store helpers) and the op's source.
const FMT: u32 = 1u;
const EPW: u32 = 2u;
