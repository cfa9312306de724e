// The fill pattern, shared by fill.cu and verify.cu (prepended by the CUDA backend) and equal
// bit for bit to ops::words::pattern and shaders/word_pattern.wgsl.

// murmur3's 32-bit finaliser: a bijection with full avalanche.
__device__ __forceinline__ u32 fmix32(u32 x) {
    u32 h = x;
    h = h ^ (h >> 16u);
    h = h * 0x85ebca6bu;
    h = h ^ (h >> 13u);
    h = h * 0xc2b2ae35u;
    h = h ^ (h >> 16u);
    return h;
}

// pattern(index, seed) for the 64-bit word index (lo, hi).
__device__ __forceinline__ u32 pattern(u32 lo, u32 hi, u32 seed) {
    u32 k = fmix32(seed ^ (hi * 0x9e3779b9u + 0x7f4a7c15u));
    return fmix32(lo ^ k) ^ (k >> 7u);
}
