// codec: element formats packed in 32-bit storage words, shared by every compute kernel.
//
// Format codes (also used in params where a tensor's format is chosen at run time):
//   0 = f32  (one element per word, the word's bits)
//   1 = f16  (two per word: element i in bits (i & 1) * 16 .. +16, via pack2x16float)
//   2 = bf16 (two per word: the upper 16 bits of an f32, round-to-nearest-even on store)
// Element i of a buffer lives in word i / epw. Kernels never write a 16-bit element by
// overwriting its whole word: outputs are `array<atomic<u32>>` and a 16-bit store clears its
// half with atomicAnd, then sets it with atomicOr, so neighbours written by other threads (or
// elements outside this dispatch's range) are left as they were.
// The storage prelude (storage_<type>.wgsl) defines `FMT` and `EPW` for the kernel's type.

const FMT_F32: u32 = 0u;
const FMT_F16: u32 = 1u;
const FMT_BF16: u32 = 2u;

fn fmt_epw(fmt: u32) -> u32 {
    if (fmt == FMT_F32) {
        return 1u;
    }
    return 2u;
}

// Element i (buffer-relative element index) decoded from its word.
fn fmt_unpack(word: u32, i: u32, fmt: u32) -> f32 {
    if (fmt == FMT_F32) {
        return bitcast<f32>(word);
    }
    let h = (word >> ((i & 1u) * 16u)) & 0xffffu;
    if (fmt == FMT_F16) {
        return unpack2x16float(h).x;
    }
    return bitcast<f32>(h << 16u);
}

// The bits of v in the format: all 32 for f32, the low 16 for f16 and bf16.
fn fmt_bits(v: f32, fmt: u32) -> u32 {
    if (fmt == FMT_F32) {
        return bitcast<u32>(v);
    }
    if (fmt == FMT_F16) {
        return pack2x16float(vec2<f32>(v, 0.0)) & 0xffffu;
    }
    let b = bitcast<u32>(v);
    if ((b & 0x7fffffffu) > 0x7f800000u) {
        return 0x7fc0u;
    }
    return (b + 0x7fffu + ((b >> 16u) & 1u)) >> 16u;
}

// Bit position of element i inside its word.
fn fmt_shift(i: u32, fmt: u32) -> u32 {
    if (fmt == FMT_F32) {
        return 0u;
    }
    return (i & 1u) * 16u;
}

// Mask of the bits of element i's word that do NOT belong to element i.
fn fmt_keep(i: u32, fmt: u32) -> u32 {
    if (fmt == FMT_F32) {
        return 0u;
    }
    return ~(0xffffu << fmt_shift(i, fmt));
}

// The same, for the kernel's own storage type (FMT from the prelude).
fn unpack_elem(word: u32, i: u32) -> f32 {
    return fmt_unpack(word, i, FMT);
}

fn elem_bits(v: f32) -> u32 {
    return fmt_bits(v, FMT);
}

fn elem_shift(i: u32) -> u32 {
    return fmt_shift(i, FMT);
}

fn elem_keep(i: u32) -> u32 {
    return fmt_keep(i, FMT);
}
