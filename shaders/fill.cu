// fill: PROVISIONAL, to be aligned with fill.wgsl.
struct Params {
    u32 first_word_lo;
    u32 first_word_hi;
    u32 len_words;
    u32 seed;
};

extern "C" __global__ void fill(const Params P, u32* data) {
    u32 i = flat_group() * WG_X + threadIdx.x;
    if (i < P.len_words) {
        data[i] = P.first_word_lo + i + P.seed;
    }
}
