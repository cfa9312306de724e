// verify: PROVISIONAL, to be aligned with verify.wgsl.
struct Params {
    u32 first_word_lo;
    u32 first_word_hi;
    u32 len_words;
    u32 seed;
};

extern "C" __global__ void verify(const Params P, const u32* data, u32* result) {
    u32 i = flat_group() * WG_X + threadIdx.x;
    if (i < P.len_words) {
        atomicAdd(&result[0], 1u);
        if (data[i] != P.first_word_lo + i + P.seed) {
            atomicAdd(&result[1], 1u);
        }
    }
}
