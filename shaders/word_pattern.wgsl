// The fill pattern, shared by fill.wgsl and verify.wgsl (prepended by kernels::source) and
// equal bit for bit to ops::words::pattern and shaders/word_pattern.cu.

// murmur3's 32-bit finaliser: a bijection with full avalanche.
fn fmix32(x: u32) -> u32 {
    var h = x;
    h = h ^ (h >> 16u);
    h = h * 0x85ebca6bu;
    h = h ^ (h >> 13u);
    h = h * 0xc2b2ae35u;
    h = h ^ (h >> 16u);
    return h;
}

// pattern(index, seed) for the 64-bit word index (lo, hi).
fn pattern(lo: u32, hi: u32, seed: u32) -> u32 {
    let k = fmix32(seed ^ (hi * 0x9e3779b9u + 0x7f4a7c15u));
    return fmix32(lo ^ k) ^ (k >> 7u);
}
