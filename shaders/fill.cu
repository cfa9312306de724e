// fill: word[i] = pattern(first_word + i, seed) for every 32-bit word of one chunk.
// The CUDA twin of fill.wgsl. Params: WordParams (kernels/params.rs). Buffer: data (written).
// Any grid shape works: groups are numbered x-major and every thread walks the chunk with a
// grid-sized stride. Block: 256 threads.

struct Params {
    u32 first_word_lo;
    u32 first_word_hi;
    u32 len_words;
    u32 seed;
};

// The word kernels are written for 256-thread blocks (as the WGSL @workgroup_size(256)).
static_assert(WG_X == 256u && WG_Y == 1u && WG_Z == 1u, "word kernels need 256x1x1 blocks");

// fmix32 and pattern come from word_pattern.cu.

extern "C" __global__ void fill(const Params P, u32* data) {
    // Groups numbered x-major over the grid; every thread walks the chunk with a grid-sized
    // stride (u32 arithmetic wraps exactly as in WGSL).
    u32 local = threadIdx.x;
    u32 group = blockIdx.x + blockIdx.y * gridDim.x + blockIdx.z * gridDim.x * gridDim.y;
    u32 stride = gridDim.x * gridDim.y * gridDim.z * 256u;
    u32 i = group * 256u + local;
    u32 len = P.len_words;
    for (;;) {
        if (i >= len) {
            break;
        }
        // 64-bit index = first_word + i, with carry into the high half.
        u32 lo = P.first_word_lo + i;
        u32 hi = P.first_word_hi + (lo < i ? 1u : 0u);
        data[i] = pattern(lo, hi, P.seed);
        if (stride > len - i) {
            break;
        }
        i = i + stride;
    }
}
