// codec: element formats packed in 32-bit storage words, shared by every compute kernel
// (the CUDA twin of codec.wgsl).
//
// Format codes (also used in params where a tensor's format is chosen at run time):
//   0 = f32  (one element per word, the word's bits)
//   1 = f16  (two per word: element i in bits (i & 1) * 16 .. +16; IEEE binary16, stored
//             with round-to-nearest-even, as pack2x16float)
//   2 = bf16 (two per word: the upper 16 bits of an f32, round-to-nearest-even on store,
//             NaN -> 0x7fc0, bit for bit as codec.wgsl)
// Element i of a buffer lives in word i / epw. WGSL has no 16-bit stores and updates a half
// word with atomicAnd/atomicOr; CUDA stores the 16-bit half directly (on little-endian
// devices element i of the u16 view is bits (i & 1) * 16 of word i / 2), which leaves the
// neighbouring element untouched just the same.
// The storage prelude (storage_<type>.cu) defines FMT and EPW for the kernel's type.

#define FMT_F32 0u
#define FMT_F16 1u
#define FMT_BF16 2u

__device__ __forceinline__ u32 fmt_epw(u32 fmt) {
    return fmt == FMT_F32 ? 1u : 2u;
}

__device__ __forceinline__ float f16_to_f32(u32 h) {
    unsigned short s = (unsigned short)(h & 0xffffu);
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(s));
    return f;
}

__device__ __forceinline__ u32 f32_to_f16(float v) {
    unsigned short s;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(s) : "f"(v));
    return (u32)s;
}

// Element i (buffer-relative element index) decoded from its word.
__device__ __forceinline__ float fmt_unpack(u32 word, u32 i, u32 fmt) {
    if (fmt == FMT_F32) {
        return __uint_as_float(word);
    }
    u32 h = (word >> ((i & 1u) * 16u)) & 0xffffu;
    if (fmt == FMT_F16) {
        return f16_to_f32(h);
    }
    return __uint_as_float(h << 16u);
}

// The bits of v in the format: all 32 for f32, the low 16 for f16 and bf16.
__device__ __forceinline__ u32 fmt_bits(float v, u32 fmt) {
    if (fmt == FMT_F32) {
        return __float_as_uint(v);
    }
    if (fmt == FMT_F16) {
        return f32_to_f16(v);
    }
    u32 b = __float_as_uint(v);
    if ((b & 0x7fffffffu) > 0x7f800000u) {
        return 0x7fc0u;
    }
    return (b + 0x7fffu + ((b >> 16u) & 1u)) >> 16u;
}

// Element i of a buffer in format fmt.
__device__ __forceinline__ float fmt_load(const u32* buf, u32 i, u32 fmt) {
    return fmt_unpack(buf[i / fmt_epw(fmt)], i, fmt);
}

// Writes element i of a buffer in format fmt, leaving the other half of its word as it was.
__device__ __forceinline__ void fmt_store(u32* buf, u32 i, float v, u32 fmt) {
    if (fmt == FMT_F32) {
        buf[i] = fmt_bits(v, fmt);
    } else {
        reinterpret_cast<unsigned short*>(buf)[i] = (unsigned short)fmt_bits(v, fmt);
    }
}

// The same, for the kernel's own storage type (FMT from the prelude).
__device__ __forceinline__ float load_elem(const u32* buf, u32 i) {
    return fmt_load(buf, i, FMT);
}

__device__ __forceinline__ void store_elem(u32* buf, u32 i, float v) {
    fmt_store(buf, i, v, FMT);
}
